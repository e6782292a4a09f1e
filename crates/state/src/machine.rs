//! The state machine: applies committed commands, answers read-only queries.
//!
//! ```text
//!   apply(index, command)
//!     ├─ index <= last_applied?  ──► AlreadyApplied, nothing changes
//!     ├─ now := max(now, command.leader_time_ms)
//!     ├─ session retry?          ──► cached answer, no events
//!     ├─ execute(request)        ──► KV writes at revision+1, lease/group/topic changes
//!     │     (checks first, writes after: a failed request changes nothing)
//!     └─ ApplyOutput { revision, result, events }
//! ```
//!
//! A KV request or Txn takes at most one revision. A revoked lease takes one (all its keys go
//! together), and so does each priority-group seat grant, so every fence is unique even when one
//! command (say a lease expiry) changes the seats of several groups.

use bytes::Bytes;
use imbl::OrdMap;
use serde::{Deserialize, Serialize};

use crate::auth::{Access, AuthRequest, AuthState};
use crate::command::{
    ApplyOutput, Command, Event, GroupRegister, GroupStatus, LeaderKey, QueueResponse, Request,
    Response, SessionSeq,
};
use crate::config::{Config, TXN_RANGE_BYTES_MAX};
use crate::election::{
    Candidate, CandidateSummary, Decision, ElectionEvent, ElectionEventKind, Group, GroupPolicy,
    Handoff, PreemptPolicy, Seat,
};
use crate::error::{Error, Result};
use crate::lease::{Lease, LeaseTable};
use crate::mvcc::{KeyValue, KvStore, RangeRequest, RangeResponse, WatchEvent, prefix_end};
use crate::queue::{QueueLimits, WorkQueue, WorkQueues};
use crate::session::{SessionCheck, Sessions};
use crate::topic::{MESSAGE_FROM_BYTES_MAX, ReadBudget, Retention, TopicRead, Topics};
use crate::txn::{
    self, DeleteRangeRequest, DeleteRangeResponse, PutRequest, PutResponse, RequestOp, ResponseOp,
    TxnPath, TxnRequest, TxnResponse,
};

/// Keys under this prefix are written only by the state machine (group seat mirrors).
pub const RESERVED_PREFIX: &[u8] = b"/_conclave/";

/// The mirror key of a priority group's seat. Its `create_revision` is the seat's fence, so
/// `Compare::new(group_leader_key(g), Equal, Create(fence))` makes a Txn conditional on still
/// leading.
pub fn group_leader_key(group: &str) -> Bytes {
    Bytes::from(format!("/_conclave/elect/{group}/leader"))
}

/// The etcd recipe key of a campaign or lock: `<name>/<lease in lowercase hex>`.
pub fn queue_key(name: &[u8], lease: i64) -> Bytes {
    let mut key = name.to_vec();
    key.extend_from_slice(format!("/{lease:x}").as_bytes());
    Bytes::from(key)
}

fn is_reserved(key: &[u8]) -> bool {
    key.starts_with(RESERVED_PREFIX)
}

/// Where a lock waiter or election candidate stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum QueueStatus {
    /// It holds the lock / leads, with this fence (its key's create revision).
    Owner {
        /// The fencing token.
        fence: i64,
    },
    /// Wait for this key to be deleted, then ask again.
    Waiting {
        /// The key just ahead.
        waiting_for: KeyValue,
    },
    /// Its key is gone, was re-created (another fence), or its lease has run out: it will never
    /// own. Tell the client it lost.
    Lost,
}

/// [`State`] as snapshot format version 1 wrote it (sessions without secrets).
#[derive(Deserialize)]
pub(crate) struct StateV1 {
    last_applied: u64,
    now_ms: u64,
    kv: KvStore,
    leases: LeaseTable,
    groups: OrdMap<String, Group>,
    topics: Topics,
    sessions: crate::session::SessionsV1,
}

impl From<StateV1> for State {
    fn from(old: StateV1) -> State {
        State {
            last_applied: old.last_applied,
            now_ms: old.now_ms,
            kv: old.kv,
            leases: old.leases,
            groups: old.groups,
            topics: old.topics,
            sessions: old.sessions.into(),
            auth: AuthState::default(),
        }
    }
}

/// [`State`] as snapshot format version 2 wrote it (session answers without their revision).
#[derive(Deserialize)]
pub(crate) struct StateV2 {
    last_applied: u64,
    now_ms: u64,
    kv: KvStore,
    leases: LeaseTable,
    groups: OrdMap<String, Group>,
    topics: Topics,
    sessions: crate::session::SessionsV2,
}

impl From<StateV2> for State {
    fn from(old: StateV2) -> State {
        State {
            last_applied: old.last_applied,
            now_ms: old.now_ms,
            kv: old.kv,
            leases: old.leases,
            groups: old.groups,
            topics: old.topics,
            sessions: old.sessions.into(),
            auth: AuthState::default(),
        }
    }
}

/// Everything that is replicated and goes into a snapshot.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct State {
    pub(crate) last_applied: u64,
    pub(crate) now_ms: u64,
    pub(crate) kv: KvStore,
    pub(crate) leases: LeaseTable,
    pub(crate) groups: OrdMap<String, Group>,
    pub(crate) topics: Topics,
    pub(crate) sessions: Sessions,
    /// Users, roles and permissions (snapshot format 4 on; empty before).
    pub(crate) auth: AuthState,
}

/// [`State`] as snapshot format version 3 wrote it (no auth section).
#[derive(Deserialize)]
pub(crate) struct StateV3 {
    last_applied: u64,
    now_ms: u64,
    kv: KvStore,
    leases: LeaseTable,
    groups: OrdMap<String, Group>,
    topics: Topics,
    sessions: Sessions,
}

impl From<StateV3> for State {
    fn from(old: StateV3) -> State {
        State {
            last_applied: old.last_applied,
            now_ms: old.now_ms,
            kv: old.kv,
            leases: old.leases,
            groups: old.groups,
            topics: old.topics,
            sessions: old.sessions,
            auth: AuthState::default(),
        }
    }
}

/// Conclave's coordination state machine. Pure and deterministic.
#[derive(Clone, Debug)]
pub struct StateMachine {
    pub(crate) config: Config,
    pub(crate) state: State,
    /// Work queues: replicated too, a section of their own at the end of a snapshot.
    pub(crate) queues: WorkQueues,
}

impl StateMachine {
    /// An empty state machine (revision 1, nothing applied).
    ///
    /// # Panics
    /// If the configuration is invalid (a startup bug, not an input).
    pub fn new(config: Config) -> Self {
        let validation = config.validate();
        assert!(
            validation.is_ok(),
            "invalid state machine config: {validation:?}"
        );
        let state = State::default();
        StateMachine {
            config,
            state,
            queues: WorkQueues::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The last applied log index.
    pub fn last_applied(&self) -> u64 {
        self.state.last_applied
    }

    /// The largest leader timestamp applied so far.
    pub fn now_ms(&self) -> u64 {
        self.state.now_ms
    }

    /// Applies the committed command at `index`. An index at or below the last applied one
    /// changes nothing and answers `AlreadyApplied`, so replay after a restart is safe.
    pub fn apply(&mut self, index: u64, command: &Command) -> ApplyOutput {
        let state = &mut self.state;
        if index <= state.last_applied {
            let error = Error::AlreadyApplied {
                index,
                last_applied: state.last_applied,
            };
            return ApplyOutput {
                revision: state.kv.revision(),
                result: Err(error),
                events: Vec::new(),
                duplicate: false,
            };
        }
        state.last_applied = index;
        state.now_ms = state.now_ms.max(command.leader_time_ms);
        if let Some(at) = command.session {
            let ttl_ms = self.config.session_ttl_ms;
            match state.sessions.check(at, state.now_ms, ttl_ms) {
                Err(error) => return self.output(Err(error), Vec::new(), false),
                Ok(SessionCheck::Duplicate { result, revision }) => {
                    // The header of a retried write names the revision it was applied at, not
                    // the current one: a client watches or compares from there.
                    let mut output = self.output(result, Vec::new(), true);
                    if revision > 0 {
                        output.revision = revision;
                    }
                    return output;
                }
                Ok(SessionCheck::Fresh) => {}
            }
        }
        let mut events = Vec::new();
        let result = self.execute(index, &command.request, &mut events);
        if result.is_err() {
            assert!(
                !self.state.kv.has_pending_writes(),
                "a failed request wrote: {result:?}"
            );
        }
        self.flush(&mut events);
        if let Some(at) = command.session {
            self.record_session(at, &result);
        }
        self.output(result, events, false)
    }

    /// Decodes a Raft entry's bytes and applies them. Bytes that do not decode are a
    /// replicated fact like any other: every replica marks the index applied and answers
    /// `Error::Decode`, so replicas stay identical.
    pub fn apply_encoded(&mut self, index: u64, bytes: &[u8]) -> ApplyOutput {
        match Command::decode(bytes) {
            Ok(command) => self.apply(index, &command),
            Err(error) => {
                let last_applied = self.state.last_applied;
                let result = if index <= last_applied {
                    Err(Error::AlreadyApplied {
                        index,
                        last_applied,
                    })
                } else {
                    self.state.last_applied = index;
                    Err(error)
                };
                self.output(result, Vec::new(), false)
            }
        }
    }

    fn close_session(&mut self, client_id: u64, secret: u128) -> Result<Response> {
        if self.state.sessions.close(client_id, secret) {
            Ok(Response::SessionClosed)
        } else {
            Err(Error::SessionNotFound { client_id })
        }
    }

    fn record_session(&mut self, at: SessionSeq, result: &Result<Response>) {
        let now_ms = self.state.now_ms;
        // Closing one's own session has nothing left to cache.
        if !matches!(result, Ok(Response::SessionClosed)) {
            let revision = self.state.kv.revision();
            self.state
                .sessions
                .record(at, now_ms, result.clone(), revision);
        }
    }

    fn output(&self, result: Result<Response>, events: Vec<Event>, duplicate: bool) -> ApplyOutput {
        ApplyOutput {
            revision: self.state.kv.revision(),
            result,
            events,
            duplicate,
        }
    }

    /// Commits pending KV writes (if any) and moves their events out.
    fn flush(&mut self, events: &mut Vec<Event>) {
        events.extend(self.state.kv.finish_write().into_iter().map(Event::Kv));
    }

    fn execute(
        &mut self,
        index: u64,
        request: &Request,
        events: &mut Vec<Event>,
    ) -> Result<Response> {
        if request_payload_bytes(request) > self.config.request_bytes_max {
            return Err(Error::RequestTooLarge);
        }
        match request {
            // Applied by every member: the budget is the state machine's constant.
            Request::Range(range) => self
                .state
                .kv
                .range_within(range, TXN_RANGE_BYTES_MAX)
                .map(|(response, _)| Response::Range(response)),
            Request::Put(put) => {
                self.check_put(put)?;
                Ok(Response::Put(self.put_checked(put)))
            }
            Request::DeleteRange(delete) => {
                if delete.key.is_empty() {
                    return Err(Error::EmptyKey);
                }
                Ok(Response::DeleteRange(self.delete_checked(delete)))
            }
            Request::Txn(request) => self.txn(request).map(Response::Txn),
            Request::Compact { revision } => self
                .state
                .kv
                .compact(*revision)
                .map(|()| Response::Compacted),
            Request::LeaseGrant { id, ttl_ms } => {
                let now_ms = self.state.now_ms;
                let (id, ttl_ms) = self
                    .state
                    .leases
                    .grant(*id, *ttl_ms, now_ms, &self.config)?;
                Ok(Response::LeaseGranted { id, ttl_ms })
            }
            Request::LeaseRevoke { id } => {
                if self.state.leases.get(*id).is_none() {
                    return Err(Error::LeaseNotFound);
                }
                self.revoke_lease(*id, events);
                Ok(Response::LeaseRevoked)
            }
            Request::LeaseCheckpoint { checkpoints } => {
                for checkpoint in checkpoints {
                    self.state.leases.checkpoint(checkpoint, self.state.now_ms);
                }
                Ok(Response::LeaseCheckpointed)
            }
            Request::LeaseExpire { ids } => {
                let mut revoked = Vec::new();
                for id in ids {
                    if self.state.leases.get(*id).is_some() {
                        self.revoke_lease(*id, events);
                        revoked.push(*id);
                    }
                }
                Ok(Response::LeasesExpired { revoked })
            }
            Request::Campaign { name, lease, value } => self
                .enqueue(name, *lease, value.clone())
                .map(Response::Campaign),
            Request::Proclaim { leader, value } => self.proclaim(leader, value),
            Request::Resign { leader } => Ok(Response::Resigned {
                resigned: self.delete_if_created_at(&leader.key, Some(leader.rev)),
            }),
            Request::Lock { name, lease } => {
                self.enqueue(name, *lease, Bytes::new()).map(Response::Lock)
            }
            Request::Unlock { key, fence } => Ok(Response::Unlocked {
                released: self.delete_if_created_at(key, *fence),
            }),
            Request::GroupRegister(register) => self.group_register(register, events),
            Request::GroupResign {
                group,
                candidate,
                lease_id,
            } => self.group_resign(group, candidate, *lease_id, events),
            Request::GroupProclaim {
                group,
                candidate,
                fence,
                value,
            } => self.group_proclaim(group, candidate, *fence, value, events),
            Request::GroupConfigure { group, policy } => {
                // The older command encodes two of the three preempt policies.
                let preempt_policy = if policy.preempt {
                    PreemptPolicy::Always
                } else {
                    PreemptPolicy::Higher
                };
                self.group_configure(group, *policy, preempt_policy, events)
            }
            Request::GroupConfigurePreempt {
                group,
                policy,
                preempt_policy,
            } => self.group_configure(group, *policy, *preempt_policy, events),
            Request::Publish { topic, data } => self.publish(topic, data, "", events),
            Request::PublishFrom { topic, data, from } => self.publish(topic, data, from, events),
            Request::Ack {
                consumer,
                topic,
                seq,
            } => {
                self.check_name("consumer", consumer)?;
                self.check_name("topic", topic)?;
                let consumers_max = self.config.consumers_max;
                if !self.state.topics.has_consumer(consumer)
                    && self.state.topics.consumer_count() >= consumers_max
                {
                    return Err(limit("consumers", consumers_max));
                }
                let cursor = self.state.topics.ack(consumer, topic, *seq)?;
                Ok(Response::Acked { cursor })
            }
            Request::TopicConfigure { topic, retention } => {
                self.check_name("topic", topic)?;
                self.check_new_topic(topic)?;
                let messages_max = self.config.topic_messages_max;
                self.state
                    .topics
                    .configure(topic, *retention, self.state.now_ms, messages_max);
                Ok(Response::TopicConfigured)
            }
            Request::OpenSession => {
                let now_ms = self.state.now_ms;
                self.state
                    .sessions
                    .open(index, 0, now_ms, self.config.sessions_max);
                Ok(Response::SessionOpened { client_id: index })
            }
            Request::OpenSessionWithSecret { secret } => {
                // Secret 0 is the mark of a session from before secrets: refusing it keeps a
                // new session from being addressable without its secret.
                if *secret == 0 {
                    return Err(Error::InvalidArgument("session secret 0".into()));
                }
                let now_ms = self.state.now_ms;
                self.state
                    .sessions
                    .open(index, *secret, now_ms, self.config.sessions_max);
                Ok(Response::SessionOpened { client_id: index })
            }
            Request::CloseSession { client_id } => self.close_session(*client_id, 0),
            Request::CloseSessionWithSecret { client_id, secret } => {
                self.close_session(*client_id, *secret)
            }
            Request::Tick => {
                self.tick(events);
                Ok(Response::Ticked)
            }
            Request::QueuePush(push) => {
                let limits = self.queue_limits();
                let now_ms = self.state.now_ms;
                let (id, existing) = self.queues.push(push, now_ms, &limits)?;
                events.push(Event::Queue(push.queue.clone()));
                Ok(Response::JobPushed { id, existing })
            }
            Request::QueueClaim {
                queue,
                worker,
                visibility_timeout_ms,
            } => {
                let limits = self.queue_limits();
                let now_ms = self.state.now_ms;
                let claimed =
                    self.queues
                        .claim(queue, worker, *visibility_timeout_ms, now_ms, &limits)?;
                if claimed.is_some() {
                    events.push(Event::Queue(queue.clone()));
                }
                Ok(Response::JobClaimed(claimed))
            }
            Request::QueueAck {
                queue,
                job_id,
                fence,
            } => {
                let limits = self.queue_limits();
                let now_ms = self.state.now_ms;
                self.queues.ack(queue, *job_id, *fence, now_ms, &limits)?;
                events.push(Event::Queue(queue.clone()));
                Ok(Response::JobAcked)
            }
            Request::QueueNack {
                queue,
                job_id,
                fence,
                delay_ms,
            } => {
                let limits = self.queue_limits();
                let now_ms = self.state.now_ms;
                let dead_lettered = self
                    .queues
                    .nack(queue, *job_id, *fence, *delay_ms, now_ms, &limits)?;
                events.push(Event::Queue(queue.clone()));
                if dead_lettered {
                    events.push(Event::Queue(crate::queue::dead_letter_queue(queue)));
                }
                Ok(Response::JobNacked { dead_lettered })
            }
            Request::QueueExtend {
                queue,
                job_id,
                fence,
                visibility_timeout_ms,
            } => {
                let limits = self.queue_limits();
                let now_ms = self.state.now_ms;
                let deadline_ms = self.queues.extend(
                    queue,
                    *job_id,
                    *fence,
                    *visibility_timeout_ms,
                    now_ms,
                    &limits,
                )?;
                Ok(Response::JobExtended { deadline_ms })
            }
            Request::Auth(change) => {
                self.state.auth.apply(change)?;
                Ok(Response::AuthChanged {
                    auth_revision: self.state.auth.revision,
                })
            }
            Request::AsUser { user, request } => {
                self.authorize(user, request)?;
                self.execute(index, request, events)
            }
        }
    }

    fn queue_limits(&self) -> QueueLimits {
        QueueLimits {
            queues_max: self.config.queues_max,
            jobs_max: self.config.queue_jobs_max,
            payload_bytes_max: self.config.job_payload_bytes_max,
            name_bytes_max: self.config.name_bytes_max,
        }
    }

    // ---- Auth ----------------------------------------------------------------------------

    /// The replicated users, roles and permissions.
    pub fn auth(&self) -> &AuthState {
        &self.state.auth
    }

    /// Whether `user` (empty: no credentials) may have `request` applied, by etcd's rules and
    /// the key mapping of Conclave's own objects (`docs/security.md`): an etcd election or
    /// lock `name` writes `<name>/<lease hex>` and reads the `<name>/` prefix; a priority
    /// group, a topic and a work queue is the key of its own name (write to register, resign, proclaim,
    /// configure or publish; read to ack). Compaction, the leader's internal requests and
    /// auth changes need the root role. Always allowed while auth is disabled.
    pub fn authorize(&self, user: &str, request: &Request) -> Result<()> {
        let auth = &self.state.auth;
        if !auth.enabled {
            return Ok(());
        }
        let name_key = |name: &str| Bytes::copy_from_slice(name.as_bytes());
        let mut accesses = Vec::new();
        match request {
            Request::Range(range) => {
                accesses.push(Access::read(range.key.clone(), range.range_end.clone()));
            }
            Request::Put(put) => put_accesses(put, &mut accesses),
            Request::DeleteRange(delete) => delete_accesses(delete, &mut accesses),
            Request::Txn(txn) => txn_accesses(txn, &mut accesses),
            // etcd lets anyone grant a lease; what it guards is the keys put under it.
            Request::LeaseGrant { .. } => return Ok(()),
            Request::LeaseRevoke { id } => {
                if let Some(lease) = self.state.leases.get(*id) {
                    for key in &lease.keys {
                        accesses.push(Access::write(key.clone(), Bytes::new()));
                    }
                }
            }
            Request::Campaign { name, lease, .. } | Request::Lock { name, lease } => {
                let mut prefix = name.to_vec();
                prefix.push(b'/');
                accesses.push(Access::write(queue_key(name, *lease), Bytes::new()));
                let prefix_end = prefix_end(&prefix);
                accesses.push(Access::read(prefix, prefix_end));
            }
            Request::Proclaim { leader, .. } | Request::Resign { leader } => {
                accesses.push(Access::write(leader.key.clone(), Bytes::new()));
            }
            Request::Unlock { key, .. } => accesses.push(Access::write(key.clone(), Bytes::new())),
            Request::GroupRegister(register) => {
                accesses.push(Access::write(name_key(&register.group), Bytes::new()));
            }
            Request::GroupResign { group, .. }
            | Request::GroupProclaim { group, .. }
            | Request::GroupConfigure { group, .. }
            | Request::GroupConfigurePreempt { group, .. } => {
                accesses.push(Access::write(name_key(group), Bytes::new()));
            }
            Request::Publish { topic, .. }
            | Request::PublishFrom { topic, .. }
            | Request::TopicConfigure { topic, .. } => {
                accesses.push(Access::write(name_key(topic), Bytes::new()));
            }
            Request::Ack { topic, .. } => {
                accesses.push(Access::read(name_key(topic), Bytes::new()))
            }
            // A work queue is the key of its own name: every queue call changes the queue.
            Request::QueuePush(push) => {
                accesses.push(Access::write(name_key(&push.queue), Bytes::new()));
            }
            Request::QueueClaim { queue, .. }
            | Request::QueueAck { queue, .. }
            | Request::QueueNack { queue, .. }
            | Request::QueueExtend { queue, .. } => {
                accesses.push(Access::write(name_key(queue), Bytes::new()));
            }
            Request::OpenSession
            | Request::OpenSessionWithSecret { .. }
            | Request::CloseSession { .. }
            | Request::CloseSessionWithSecret { .. } => {}
            Request::Compact { .. }
            | Request::LeaseCheckpoint { .. }
            | Request::LeaseExpire { .. }
            | Request::Tick
            | Request::Auth(_) => return auth.check_admin(user),
            Request::AsUser { .. } => {
                return Err(Error::InvalidArgument(
                    "a request carries at most one identity".into(),
                ));
            }
        }
        auth.check_access(user, &accesses)
    }

    // ---- KV ------------------------------------------------------------------------------

    fn check_put(&self, put: &PutRequest) -> Result<()> {
        if put.key.is_empty() {
            return Err(Error::EmptyKey);
        }
        if put.key.len() > self.config.key_bytes_max
            || put.value.len() > self.config.value_bytes_max
        {
            return Err(Error::RequestTooLarge);
        }
        if is_reserved(&put.key) {
            return Err(Error::ReservedKey);
        }
        if put.ignore_value && !put.value.is_empty() {
            return Err(Error::ValueProvided);
        }
        if put.ignore_lease && put.lease != 0 {
            return Err(Error::LeaseProvided);
        }
        if (put.ignore_value || put.ignore_lease) && self.state.kv.get(&put.key).is_none() {
            return Err(Error::KeyNotFound);
        }
        if put.lease != 0 && self.state.leases.get(put.lease).is_none() {
            return Err(Error::LeaseNotFound);
        }
        Ok(())
    }

    /// Performs a put that passed `check_put`.
    fn put_checked(&mut self, put: &PutRequest) -> PutResponse {
        // Only the ignore flags need the current value first; a plain put is one lookup fewer.
        let current = if put.ignore_value || put.ignore_lease {
            self.state.kv.get(&put.key)
        } else {
            None
        };
        let value = match (&current, put.ignore_value) {
            (Some(current), true) => current.value.clone(),
            _ => put.value.clone(),
        };
        let lease = match (&current, put.ignore_lease) {
            (Some(current), true) => current.lease,
            _ => put.lease,
        };
        let (previous, _) = self.state.kv.put(put.key.clone(), value, lease);
        self.move_lease_attachment(&put.key, previous.as_ref().map_or(0, |kv| kv.lease), lease);
        PutResponse {
            prev_kv: if put.prev_kv { previous } else { None },
        }
    }

    fn move_lease_attachment(&mut self, key: &Bytes, old_lease: i64, new_lease: i64) {
        if old_lease != 0 && old_lease != new_lease {
            self.state.leases.detach_key(old_lease, key);
        }
        if new_lease != 0 {
            self.state.leases.attach_key(new_lease, key);
        }
    }

    /// Deletes the live user keys in the range. Reserved keys are skipped, so "delete
    /// everything" works and leaves the state machine's own keys alone.
    fn delete_checked(&mut self, delete: &DeleteRangeRequest) -> DeleteRangeResponse {
        let keys = self.state.kv.live_keys(&delete.key, &delete.range_end);
        let mut response = DeleteRangeResponse::default();
        for key in keys.iter().filter(|key| !is_reserved(key)) {
            if let Some(previous) = self.state.kv.delete(key) {
                if previous.lease != 0 {
                    self.state.leases.detach_key(previous.lease, key);
                }
                response.deleted += 1;
                if delete.prev_kv {
                    response.prev_kvs.push(previous);
                }
            }
        }
        response
    }

    fn txn(&mut self, request: &TxnRequest) -> Result<TxnResponse> {
        txn::check_shape(request, self.config.txn_ops_max)?;
        txn::check_no_duplicate_writes(request)?;
        let path = txn::decide_path(&self.state.kv, request);
        let mut budget = TxnRangeBudget {
            bytes_left: TXN_RANGE_BYTES_MAX,
            written_bytes: 0,
            wrote: false,
        };
        self.check_txn_path(request, &path, &mut budget)?;
        let mut bytes_left = TXN_RANGE_BYTES_MAX;
        Ok(self.execute_txn(request, &path, &mut bytes_left))
    }

    /// Runs every check that could fail on the branches the Txn will take, before any write.
    /// That includes the byte budget of its Ranges: each is measured (and stopped at the
    /// budget) against the state before the Txn. A Range that follows a write of the same Txn
    /// is charged more, so that it cannot pass its share when it runs: every key and value
    /// byte written before it, and its `limit` is ignored in the measure (a delete or an
    /// overwrite can let keys that were past the limit in). The write checks below need
    /// nothing from execution, so a refused Txn writes nothing, alike on every member.
    fn check_txn_path(
        &self,
        request: &TxnRequest,
        path: &TxnPath,
        budget: &mut TxnRangeBudget,
    ) -> Result<()> {
        let branch = if path.succeeded {
            &request.success
        } else {
            &request.failure
        };
        let mut nested = path.nested.iter();
        for op in branch {
            match op {
                RequestOp::Range(range) => {
                    self.state.kv.check_revision(range.revision)?;
                    let too_large = Error::RangeTooLarge {
                        bytes_max: TXN_RANGE_BYTES_MAX as u64,
                    };
                    let room = budget.bytes_left.saturating_sub(budget.written_bytes);
                    let unlimited;
                    let measured = if budget.wrote {
                        unlimited = RangeRequest {
                            limit: 0,
                            ..range.clone()
                        };
                        &unlimited
                    } else {
                        range
                    };
                    let (_, bytes) =
                        self.state
                            .kv
                            .range_within(measured, room)
                            .map_err(|e| match e {
                                Error::RangeTooLarge { .. } => too_large.clone(),
                                other => other,
                            })?;
                    let cost = bytes.saturating_add(budget.written_bytes);
                    budget.bytes_left = budget.bytes_left.checked_sub(cost).ok_or(too_large)?;
                }
                RequestOp::Put(put) => {
                    self.check_put(put)?;
                    budget.wrote = true;
                    budget.written_bytes = budget
                        .written_bytes
                        .saturating_add(put.key.len())
                        .saturating_add(put.value.len());
                }
                RequestOp::DeleteRange(_) => budget.wrote = true,
                RequestOp::Txn(inner) => {
                    let inner_path = nested.next();
                    assert!(inner_path.is_some(), "txn path lacks a nested txn");
                    if let Some(inner_path) = inner_path {
                        self.check_txn_path(inner, inner_path, budget)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Applies the branches `check_txn_path` accepted; `bytes_left` is what remains of the
    /// Txn's range budget, which that check guaranteed is enough.
    fn execute_txn(
        &mut self,
        request: &TxnRequest,
        path: &TxnPath,
        bytes_left: &mut usize,
    ) -> TxnResponse {
        let branch = if path.succeeded {
            &request.success
        } else {
            &request.failure
        };
        let mut nested = path.nested.iter();
        let mut responses = Vec::with_capacity(branch.len());
        for op in branch {
            let response = match op {
                RequestOp::Range(range) => match self.state.kv.range_within(range, *bytes_left) {
                    Ok((response, bytes)) => {
                        *bytes_left -= bytes;
                        ResponseOp::Range(response)
                    }
                    // check_txn_path validated the revision and the budget, and the shape
                    // checked the key.
                    Err(error) => panic!("txn range failed after validation: {error}"),
                },
                RequestOp::Put(put) => ResponseOp::Put(self.put_checked(put)),
                RequestOp::DeleteRange(delete) => {
                    ResponseOp::DeleteRange(self.delete_checked(delete))
                }
                RequestOp::Txn(inner) => {
                    let Some(inner_path) = nested.next() else {
                        panic!("txn path lacks a nested txn");
                    };
                    ResponseOp::Txn(self.execute_txn(inner, inner_path, bytes_left))
                }
            };
            responses.push(response);
        }
        TxnResponse {
            succeeded: path.succeeded,
            responses,
        }
    }

    // ---- leases --------------------------------------------------------------------------

    /// Removes a lease, deletes its keys (one revision) and its group registrations.
    fn revoke_lease(&mut self, id: i64, events: &mut Vec<Event>) {
        let Some(lease) = self.state.leases.remove(id) else {
            return;
        };
        for key in &lease.keys {
            let deleted = self.state.kv.delete(key);
            assert!(
                deleted.as_ref().is_none_or(|kv| kv.lease == id),
                "lease index out of sync"
            );
        }
        self.flush(events);
        let mut touched = Vec::new();
        for (group, candidate) in &lease.candidates {
            let Some(entry) = self.state.groups.get_mut(group) else {
                continue;
            };
            if entry
                .candidates
                .get(candidate)
                .is_some_and(|c| c.lease_id == id)
            {
                entry.candidates.remove(candidate);
                touched.push(group.clone());
            }
        }
        touched.dedup();
        for group in touched {
            self.emit_candidates_changed(&group, events);
            self.reconcile_group(&group, events);
        }
    }

    // ---- etcd Election and Lock recipes ----------------------------------------------------

    /// Campaign and Lock: create `<name>/<lease hex>` if absent (a campaign also updates the
    /// value, as etcd's Campaign proclaims it), then report the queue position.
    fn enqueue(&mut self, name: &Bytes, lease: i64, value: Bytes) -> Result<QueueResponse> {
        if name.is_empty() {
            return Err(Error::EmptyKey);
        }
        if !self.state.leases.is_live(
            lease,
            self.state.now_ms,
            self.config.lease_checkpoint_interval_ms,
        ) {
            return Err(Error::LeaseNotFound);
        }
        let key = queue_key(name, lease);
        let put = PutRequest {
            key: key.clone(),
            value,
            lease,
            ..PutRequest::default()
        };
        self.check_put(&put)?;
        let existing = self.state.kv.get(&key);
        if existing.as_ref().is_none_or(|kv| kv.value != put.value) {
            self.put_checked(&put);
        }
        let fence = self.state.kv.get(&key).map_or(0, |kv| kv.create_revision);
        let status = self.queue_status(name, &key, fence);
        Ok(QueueResponse {
            key,
            fence,
            owner: matches!(status, QueueStatus::Owner { .. }),
            waiting_for: match status {
                QueueStatus::Waiting { waiting_for } => Some(waiting_for),
                _ => None,
            },
        })
    }

    fn proclaim(&mut self, leader: &LeaderKey, value: &Bytes) -> Result<Response> {
        let current = self.state.kv.get(&leader.key);
        if current.is_none_or(|kv| kv.create_revision != leader.rev) {
            return Err(Error::ElectionNotLeader);
        }
        let put = PutRequest {
            key: leader.key.clone(),
            value: value.clone(),
            lease: leader.lease,
            ..PutRequest::default()
        };
        self.check_put(&put)?;
        self.put_checked(&put);
        Ok(Response::Proclaimed)
    }

    /// Deletes `key` if it exists and (when a fence is given) was created at that revision.
    fn delete_if_created_at(&mut self, key: &Bytes, fence: Option<i64>) -> bool {
        let Some(current) = self.state.kv.get(key) else {
            return false;
        };
        if is_reserved(key) || fence.is_some_and(|fence| fence != current.create_revision) {
            return false;
        }
        self.delete_checked(&DeleteRangeRequest {
            key: key.clone(),
            ..DeleteRangeRequest::default()
        });
        true
    }

    /// Where `key` (created at `fence`) stands in the queue of `name`: etcd's rule is that the
    /// key with the lowest create revision under `<name>/` owns. A waiter whose lease has run
    /// out (its anchored deadline passed) is `Lost`, never `Owner` (etcd issues 9921, 11456).
    pub fn queue_status(&self, name: &[u8], key: &[u8], fence: i64) -> QueueStatus {
        let Some(mine) = self.state.kv.get(key) else {
            return QueueStatus::Lost;
        };
        if mine.create_revision != fence
            || (mine.lease != 0
                && !self.state.leases.is_live(
                    mine.lease,
                    self.state.now_ms,
                    self.config.lease_checkpoint_interval_ms,
                ))
        {
            return QueueStatus::Lost;
        }
        let mut prefix = name.to_vec();
        prefix.push(b'/');
        let ahead = self
            .state
            .kv
            .live_kvs(&prefix, &prefix_end(&prefix))
            .into_iter()
            .filter(|kv| kv.create_revision < fence)
            .max_by_key(|kv| kv.create_revision);
        match ahead {
            None => QueueStatus::Owner { fence },
            Some(waiting_for) => QueueStatus::Waiting { waiting_for },
        }
    }

    /// etcd Election Leader: the key with the lowest create revision under `<name>/`.
    pub fn election_leader(&self, name: &[u8]) -> Result<KeyValue> {
        let mut prefix = name.to_vec();
        prefix.push(b'/');
        self.state
            .kv
            .live_kvs(&prefix, &prefix_end(&prefix))
            .into_iter()
            .min_by_key(|kv| kv.create_revision)
            .ok_or(Error::ElectionNoLeader)
    }

    // ---- priority election groups -------------------------------------------------------

    fn check_name(&self, what: &str, name: &str) -> Result<()> {
        if name.is_empty() {
            return Err(Error::InvalidArgument(format!("{what} name is empty")));
        }
        if name.len() > self.config.name_bytes_max {
            return Err(Error::RequestTooLarge);
        }
        Ok(())
    }

    fn check_new_group(&self, group: &str) -> Result<()> {
        let groups_max = self.config.groups_max;
        if !self.state.groups.contains_key(group) && self.state.groups.len() >= groups_max {
            return Err(limit("groups", groups_max));
        }
        Ok(())
    }

    fn check_new_topic(&self, topic: &str) -> Result<()> {
        let topics_max = self.config.topics_max;
        if !self.state.topics.contains(topic) && self.state.topics.len() >= topics_max {
            return Err(limit("topics", topics_max));
        }
        Ok(())
    }

    fn group_configure(
        &mut self,
        group: &str,
        mut policy: GroupPolicy,
        preempt_policy: PreemptPolicy,
        events: &mut Vec<Event>,
    ) -> Result<Response> {
        self.check_name("group", group)?;
        if policy.handoff_timeout_ms == Some(0) || policy.settle_ms == Some(0) {
            return Err(Error::InvalidArgument(
                "handoff_timeout_ms and settle_ms must be > 0 when set".into(),
            ));
        }
        self.check_new_group(group)?;
        policy.set_preempt_policy(preempt_policy);
        self.state
            .groups
            .entry(group.to_owned())
            .or_default()
            .policy = policy;
        self.reconcile_group(group, events);
        Ok(Response::Group(self.group_status(group)))
    }

    fn group_register(
        &mut self,
        register: &GroupRegister,
        events: &mut Vec<Event>,
    ) -> Result<Response> {
        let GroupRegister {
            group,
            candidate,
            priority,
            value,
            lease_id,
            preempt,
        } = register;
        self.check_name("group", group)?;
        self.check_name("candidate", candidate)?;
        if value.len() > self.config.value_bytes_max {
            return Err(Error::RequestTooLarge);
        }
        let now_ms = self.state.now_ms;
        if !self
            .state
            .leases
            .is_live(*lease_id, now_ms, self.config.lease_checkpoint_interval_ms)
        {
            return Err(Error::LeaseNotFound);
        }
        let existing = self
            .state
            .groups
            .get(group)
            .and_then(|g| g.candidates.get(candidate))
            .cloned();
        if let Some(existing) = &existing
            && existing.lease_id != *lease_id
        {
            if self.state.leases.is_live(
                existing.lease_id,
                now_ms,
                self.config.lease_checkpoint_interval_ms,
            ) {
                return Err(Error::CandidateIdTaken {
                    group: group.clone(),
                    candidate: candidate.clone(),
                    lease_id: existing.lease_id,
                });
            }
            // The id's previous holder is dead: take the id over.
            self.state
                .leases
                .detach_candidate(existing.lease_id, group, candidate);
        }
        if existing.is_none() {
            self.check_new_group(group)?;
            let candidates_max = self.config.group_candidates_max;
            let count = self
                .state
                .groups
                .get(group)
                .map_or(0, |g| g.candidates.len());
            if count >= candidates_max {
                return Err(limit("candidates in a group", candidates_max));
            }
        }
        let entry = Candidate {
            id: candidate.clone(),
            priority: *priority,
            value: value.clone(),
            lease_id: *lease_id,
            preempt: *preempt,
            registered_revision: self.state.kv.revision(),
        };
        self.state
            .leases
            .attach_candidate(*lease_id, group, candidate);
        let group_entry = self.state.groups.entry(group.clone()).or_default();
        group_entry.candidates.insert(candidate.clone(), entry);
        let leads = group_entry
            .seat
            .as_ref()
            .is_some_and(|seat| &seat.leader == candidate);
        let new_incarnation = existing.as_ref().is_some_and(|e| e.lease_id != *lease_id);
        if leads && new_incarnation {
            // A new lease is a new incarnation: the old leadership (and its fence) ends here and
            // the seat is decided afresh, with a new term and fence.
            group_entry.seat = None;
        }
        let value_changed = existing.as_ref().is_some_and(|e| e.value != *value);
        self.emit_candidates_changed(group, events);
        if leads && !new_incarnation && value_changed {
            self.emit_value_changed(group, events);
        }
        self.reconcile_group(group, events);
        Ok(Response::Group(self.group_status(group)))
    }

    fn group_resign(
        &mut self,
        group: &str,
        candidate: &str,
        lease_id: i64,
        events: &mut Vec<Event>,
    ) -> Result<Response> {
        let not_found = || Error::CandidateNotFound {
            group: group.to_owned(),
            candidate: candidate.to_owned(),
        };
        let entry = self.state.groups.get_mut(group).ok_or_else(not_found)?;
        if entry
            .candidates
            .get(candidate)
            .is_none_or(|c| c.lease_id != lease_id)
        {
            return Err(not_found());
        }
        entry.candidates.remove(candidate);
        self.state
            .leases
            .detach_candidate(lease_id, group, candidate);
        self.emit_candidates_changed(group, events);
        self.reconcile_group(group, events);
        Ok(Response::Group(self.group_status(group)))
    }

    fn group_proclaim(
        &mut self,
        group: &str,
        candidate: &str,
        fence: i64,
        value: &Bytes,
        events: &mut Vec<Event>,
    ) -> Result<Response> {
        if value.len() > self.config.value_bytes_max {
            return Err(Error::RequestTooLarge);
        }
        let not_leader = || Error::NotGroupLeader {
            group: group.to_owned(),
            fence,
        };
        let entry = self.state.groups.get_mut(group).ok_or_else(not_leader)?;
        let leads = entry
            .seat
            .as_ref()
            .is_some_and(|s| s.leader == candidate && s.fence == fence);
        let Some(registration) = entry.candidates.get_mut(candidate).filter(|_| leads) else {
            return Err(not_leader());
        };
        registration.value = value.clone();
        self.emit_value_changed(group, events);
        Ok(Response::Group(self.group_status(group)))
    }

    fn group_status(&self, group: &str) -> GroupStatus {
        let entry = self.state.groups.get(group);
        GroupStatus {
            group: group.to_owned(),
            term: entry.map_or(0, |g| g.term),
            seat: entry.and_then(|g| g.seat.clone()),
        }
    }

    fn emit_election(&self, group: &str, kind: ElectionEventKind, events: &mut Vec<Event>) {
        let term = self.state.groups.get(group).map_or(0, |g| g.term);
        let revision = self.state.kv.revision();
        events.push(Event::Election(ElectionEvent {
            group: group.to_owned(),
            term,
            revision,
            kind,
        }));
    }

    fn emit_candidates_changed(&self, group: &str, events: &mut Vec<Event>) {
        let Some(entry) = self.state.groups.get(group) else {
            return;
        };
        let candidates = entry
            .succession()
            .into_iter()
            .map(|c| CandidateSummary {
                id: c.id.clone(),
                priority: c.priority,
            })
            .collect();
        self.emit_election(
            group,
            ElectionEventKind::CandidatesChanged { candidates },
            events,
        );
    }

    fn emit_value_changed(&self, group: &str, events: &mut Vec<Event>) {
        let Some(entry) = self.state.groups.get(group) else {
            return;
        };
        let Some(seat) = &entry.seat else { return };
        let Some(leader) = entry.candidates.get(&seat.leader) else {
            return;
        };
        let kind = ElectionEventKind::ValueChanged {
            leader: leader.id.clone(),
            value: leader.value.clone(),
            fence: seat.fence,
        };
        self.emit_election(group, kind, events);
    }

    /// Applies the group's decisions until it is stable.
    fn reconcile_group(&mut self, group: &str, events: &mut Vec<Event>) {
        // Elect/Vacate leave a stable seat, handoff changes settle in one more step; three
        // rounds always suffice, so a fourth would be a bug.
        for _ in 0..4 {
            let now_ms = self.state.now_ms;
            let Some(entry) = self.state.groups.get(group) else {
                return;
            };
            let leases = &self.state.leases;
            let decision = entry.decide(now_ms, &|lease_id| {
                leases.is_live(lease_id, now_ms, self.config.lease_checkpoint_interval_ms)
            });
            match decision {
                Decision::Keep => return,
                Decision::StartSettling | Decision::StopSettling => {
                    let settling = (decision == Decision::StartSettling).then_some(now_ms);
                    if let Some(entry) = self.state.groups.get_mut(group) {
                        entry.settling_since_ms = settling;
                    }
                }
                Decision::Elect(leader) => self.seat_leader(group, &leader, events),
                Decision::Vacate => self.vacate_seat(group, events),
                Decision::RequestHandoff {
                    challenger,
                    deadline_ms,
                } => {
                    self.request_handoff(group, challenger, deadline_ms, events);
                }
                Decision::CancelHandoff => {
                    let Some(seat) = self
                        .state
                        .groups
                        .get_mut(group)
                        .and_then(|g| g.seat.as_mut())
                    else {
                        return;
                    };
                    seat.handoff = None;
                    let leader = seat.leader.clone();
                    self.emit_election(
                        group,
                        ElectionEventKind::HandoffCancelled { leader },
                        events,
                    );
                }
            }
        }
        panic!("group {group:?} did not settle");
    }

    fn seat_leader(&mut self, group: &str, leader: &str, events: &mut Vec<Event>) {
        // The grant gets a revision of its own so its fence is unique across groups and locks.
        self.flush(events);
        let mirror = group_leader_key(group);
        self.state.kv.delete(&mirror);
        let (_, written) = self.state.kv.put(mirror, Bytes::from(leader.to_owned()), 0);
        let fence = written.create_revision;
        self.flush(events);
        assert_eq!(
            fence,
            self.state.kv.revision(),
            "fence must be the grant revision"
        );
        let now_ms = self.state.now_ms;
        let Some(entry) = self.state.groups.get_mut(group) else {
            return;
        };
        let Some(candidate) = entry.candidates.get(leader) else {
            return;
        };
        entry.term += 1;
        entry.settling_since_ms = None;
        entry.seat = Some(Seat {
            leader: leader.to_owned(),
            fence,
            since_ms: now_ms,
            handoff: None,
        });
        let kind = ElectionEventKind::Elected {
            leader: leader.to_owned(),
            priority: candidate.priority,
            value: candidate.value.clone(),
            fence,
        };
        self.emit_election(group, kind, events);
    }

    fn vacate_seat(&mut self, group: &str, events: &mut Vec<Event>) {
        self.flush(events);
        self.state.kv.delete(&group_leader_key(group));
        self.flush(events);
        let Some(entry) = self.state.groups.get_mut(group) else {
            return;
        };
        entry.term += 1;
        entry.seat = None;
        entry.settling_since_ms = None;
        self.emit_election(group, ElectionEventKind::Vacant, events);
    }

    fn request_handoff(
        &mut self,
        group: &str,
        challenger: String,
        deadline_ms: Option<u64>,
        events: &mut Vec<Event>,
    ) {
        let now_ms = self.state.now_ms;
        let Some(entry) = self.state.groups.get_mut(group) else {
            return;
        };
        let challenger_priority = entry.candidates.get(&challenger).map_or(0, |c| c.priority);
        let Some(seat) = entry.seat.as_mut() else {
            return;
        };
        let requested_ms = seat.handoff.as_ref().map_or(now_ms, |h| h.requested_ms);
        seat.handoff = Some(Handoff {
            challenger: challenger.clone(),
            requested_ms,
            deadline_ms,
        });
        let kind = ElectionEventKind::HandoffRequested {
            leader: seat.leader.clone(),
            challenger,
            challenger_priority,
            deadline_ms,
        };
        self.emit_election(group, kind, events);
    }

    // ---- topics and time -----------------------------------------------------------------

    fn publish(
        &mut self,
        topic: &str,
        data: &Bytes,
        from: &str,
        events: &mut Vec<Event>,
    ) -> Result<Response> {
        self.check_name("topic", topic)?;
        if data.len() > self.config.value_bytes_max {
            return Err(Error::RequestTooLarge);
        }
        if from.len() > MESSAGE_FROM_BYTES_MAX {
            return Err(Error::InvalidArgument(format!(
                "the sender is {} bytes; at most {MESSAGE_FROM_BYTES_MAX} are allowed",
                from.len()
            )));
        }
        // A publish is a write: it takes a store revision, so messages and KV changes are
        // totally ordered.
        self.check_new_topic(topic)?;
        let messages_max = self.config.topic_messages_max;
        self.state.kv.mark_write();
        let revision = self.state.kv.write_revision();
        let message = self.state.topics.publish(
            topic,
            data.clone(),
            from,
            revision,
            self.state.now_ms,
            messages_max,
        );
        let seq = message.seq;
        events.push(Event::Topic(message));
        Ok(Response::Published { seq, revision })
    }

    fn tick(&mut self, events: &mut Vec<Event>) {
        let now_ms = self.state.now_ms;
        self.state
            .sessions
            .expire(now_ms, self.config.session_ttl_ms);
        let messages_max = self.config.topic_messages_max;
        self.state.topics.enforce_all(now_ms, messages_max);
        let due: Vec<String> = self
            .state
            .groups
            .iter()
            .filter(|(_, g)| {
                g.timer_ms()
                    .is_some_and(|deadline_ms| deadline_ms <= now_ms)
            })
            .map(|(name, _)| name.clone())
            .collect();
        for group in due {
            self.reconcile_group(&group, events);
        }
        let limits = self.queue_limits();
        for queue in self.queues.settle_all(now_ms, &limits) {
            events.push(Event::Queue(queue));
        }
    }

    // ---- read-only queries -----------------------------------------------------------------

    /// The current store revision.
    pub fn revision(&self) -> i64 {
        self.state.kv.revision()
    }

    /// The compaction revision (reads below it fail).
    pub fn compact_revision(&self) -> i64 {
        self.state.kv.compact_revision()
    }

    /// etcd Range, served from applied state (serializable read; linearizable once the server
    /// has done a ReadIndex), with no byte budget.
    pub fn range(&self, request: &RangeRequest) -> Result<RangeResponse> {
        self.state.kv.range(request)
    }

    /// etcd Range, refused with [`Error::RangeTooLarge`] as soon as the answer holds more than
    /// `bytes_max` key and value bytes; nothing past the budget is taken from the state.
    pub fn range_within(&self, request: &RangeRequest, bytes_max: usize) -> Result<RangeResponse> {
        self.state
            .kv
            .range_within(request, bytes_max)
            .map(|(response, _)| response)
    }

    /// Watch replay: every event at revision >= `start_revision` on the key range.
    pub fn events_since(
        &self,
        start_revision: i64,
        key: &[u8],
        range_end: &[u8],
    ) -> Result<Vec<WatchEvent>> {
        self.state.kv.events_since(start_revision, key, range_end)
    }

    /// The KV store, for direct reads.
    pub fn kv(&self) -> &KvStore {
        &self.state.kv
    }

    /// A lease, for LeaseTimeToLive (remaining time comes from the leader's `LeaseKeeper`).
    pub fn lease(&self, id: i64) -> Option<&Lease> {
        self.state.leases.get(id)
    }

    /// The lease table (for `LeaseKeeper` and LeaseLeases).
    pub fn leases(&self) -> &LeaseTable {
        &self.state.leases
    }

    /// A priority group.
    pub fn group(&self, group: &str) -> Option<&Group> {
        self.state.groups.get(group)
    }

    /// A priority group's seat.
    pub fn group_leader(&self, group: &str) -> Option<&Seat> {
        self.state.groups.get(group)?.seat.as_ref()
    }

    /// A priority group's candidates in order of succession.
    pub fn group_succession(&self, group: &str) -> Vec<&Candidate> {
        self.state
            .groups
            .get(group)
            .map(Group::succession)
            .unwrap_or_default()
    }

    /// Group names.
    pub fn group_names(&self) -> impl Iterator<Item = &str> {
        self.state.groups.keys().map(String::as_str)
    }

    /// A group's policy (default when the group does not exist).
    pub fn group_policy(&self, group: &str) -> GroupPolicy {
        self.state
            .groups
            .get(group)
            .map(|g| g.policy)
            .unwrap_or_default()
    }

    /// Read a topic from `from_seq` (at most `limit` messages, 0 for all).
    pub fn topic_read(&self, topic: &str, from_seq: u64, limit: usize) -> TopicRead {
        self.state.topics.read(topic, from_seq, limit)
    }

    /// What `consumer` has not acknowledged on `topics`.
    pub fn inbox(&self, consumer: &str, topics: &[String], limit: usize) -> Vec<TopicRead> {
        self.state.topics.inbox(consumer, topics, limit)
    }

    /// Read a topic from `from_seq`, as much as `budget` allows (see [`ReadBudget`]).
    pub fn topic_read_within(
        &self,
        topic: &str,
        from_seq: u64,
        budget: &mut ReadBudget,
    ) -> TopicRead {
        self.state.topics.read_within(topic, from_seq, budget)
    }

    /// What `consumer` has not acknowledged on `topics`, each read once, as much as `budget`
    /// allows over all of them.
    pub fn inbox_within(
        &self,
        consumer: &str,
        topics: &[String],
        budget: &mut ReadBudget,
    ) -> Vec<TopicRead> {
        self.state.topics.inbox_within(consumer, topics, budget)
    }

    /// The topics.
    pub fn topics(&self) -> &Topics {
        &self.state.topics
    }

    /// Number of open client sessions.
    pub fn session_count(&self) -> usize {
        self.state.sessions.len()
    }

    /// A work queue.
    pub fn work_queue(&self, queue: &str) -> Option<&WorkQueue> {
        self.queues.get(queue)
    }

    /// Work queue names from `from` on, in order.
    pub fn work_queue_names_from<'a>(&'a self, from: &str) -> impl Iterator<Item = &'a str> + 'a {
        self.queues.names_from(from)
    }

    /// The last claim fence handed out by any work queue (0: none yet).
    pub fn last_queue_fence(&self) -> u64 {
        self.queues.last_fence()
    }

    /// The earliest leader-clock time at which a `Tick` would change something (a handoff
    /// timeout, a topic's age retention, a queue's delay or claim running out). The leader proposes a `Tick` then.
    pub fn next_timer_ms(&self) -> Option<u64> {
        self.next_timer_ms_after(earliest_group_timer_ms(&self.state.groups))
    }

    /// [`StateMachine::next_timer_ms`] for a caller that asks every tick: the election groups
    /// are walked only when they changed since `memo` last saw them.
    pub fn next_timer_ms_memo(&self, memo: &mut GroupTimerMemo) -> Option<u64> {
        let handoffs = memo.earliest_ms(&self.state.groups);
        self.next_timer_ms_after(handoffs)
    }

    fn next_timer_ms_after(&self, handoffs: Option<u64>) -> Option<u64> {
        let retention = self.state.topics.next_expiry_ms();
        let queues = self.queues.next_timer_ms();
        [handoffs, retention, queues].into_iter().flatten().min()
    }

    /// Asserts internal invariants (kept in release builds: a broken one is a bug).
    pub fn check_invariants(&self) {
        let verdict = self.verify();
        assert!(
            verdict.is_ok(),
            "state machine invariant broken: {verdict:?}"
        );
    }

    /// Checks internal invariants without panicking (a restored snapshot is input).
    pub(crate) fn verify(&self) -> std::result::Result<(), String> {
        self.state.kv.verify()?;
        self.state.auth.verify()?;
        for lease in self.state.leases.iter() {
            for key in &lease.keys {
                if self.state.kv.get(key).is_none_or(|kv| kv.lease != lease.id) {
                    return Err(format!("lease {} lists a key it does not hold", lease.id));
                }
            }
        }
        for (name, group) in &self.state.groups {
            if let Some(seat) = &group.seat {
                let mirror = self.state.kv.get(&group_leader_key(name));
                if mirror.is_none_or(|kv| kv.create_revision != seat.fence) {
                    return Err(format!(
                        "seat mirror of group {name:?} does not match its fence"
                    ));
                }
            }
        }
        self.queues.verify()?;
        Ok(())
    }
}

/// What is left of a Txn's range budget while its branches are checked.
struct TxnRangeBudget {
    /// Budget not yet spent by the Txn's earlier Ranges.
    bytes_left: usize,
    /// Key and value bytes the Txn puts before the current op (what a later Range may see of
    /// its own writes).
    written_bytes: usize,
    /// Whether the Txn writes (puts or deletes) before the current op.
    wrote: bool,
}

fn limit(what: &str, limit: usize) -> Error {
    Error::LimitReached {
        what: what.to_owned(),
        limit: limit as u64,
    }
}

/// Bytes of user data in a request, for the request size limit.
fn request_payload_bytes(request: &Request) -> usize {
    fn range(r: &RangeRequest) -> usize {
        r.key.len() + r.range_end.len()
    }
    fn txn_bytes(t: &TxnRequest) -> usize {
        let compares: usize = t
            .compare
            .iter()
            .map(|c| {
                let operand = match &c.target {
                    txn::CompareTarget::Value(value) => value.len(),
                    _ => 8,
                };
                c.key.len() + c.range_end.len() + operand
            })
            .sum();
        let ops: usize = t.success.iter().chain(&t.failure).map(op_bytes).sum();
        compares + ops
    }
    fn op_bytes(op: &RequestOp) -> usize {
        match op {
            RequestOp::Range(r) => range(r),
            RequestOp::Put(p) => p.key.len() + p.value.len(),
            RequestOp::DeleteRange(d) => d.key.len() + d.range_end.len(),
            RequestOp::Txn(t) => txn_bytes(t),
        }
    }
    match request {
        Request::Range(r) => range(r),
        Request::Put(p) => p.key.len() + p.value.len(),
        Request::DeleteRange(d) => d.key.len() + d.range_end.len(),
        Request::Txn(t) => txn_bytes(t),
        Request::LeaseCheckpoint { checkpoints } => checkpoints.len() * 16,
        Request::LeaseExpire { ids } => ids.len() * 8,
        Request::Campaign { name, value, .. } => name.len() + value.len(),
        Request::Proclaim { leader, value } => leader.name.len() + leader.key.len() + value.len(),
        Request::Resign { leader } => leader.name.len() + leader.key.len(),
        Request::Lock { name, .. } => name.len(),
        Request::Unlock { key, .. } => key.len(),
        Request::GroupRegister(r) => r.group.len() + r.candidate.len() + r.value.len(),
        Request::GroupResign {
            group, candidate, ..
        } => group.len() + candidate.len(),
        Request::GroupProclaim {
            group,
            candidate,
            value,
            ..
        } => group.len() + candidate.len() + value.len(),
        Request::GroupConfigure { group, .. } | Request::GroupConfigurePreempt { group, .. } => {
            group.len()
        }
        Request::Publish { topic, data } => topic.len() + data.len(),
        Request::PublishFrom { topic, data, from } => topic.len() + data.len() + from.len(),
        Request::Ack {
            consumer, topic, ..
        } => consumer.len() + topic.len(),
        Request::TopicConfigure { topic, .. } => topic.len(),
        Request::QueuePush(push) => {
            push.queue.len() + push.payload.len() + push.dedup_key.as_ref().map_or(0, String::len)
        }
        Request::QueueClaim { queue, worker, .. } => queue.len() + worker.len(),
        Request::QueueAck { queue, .. }
        | Request::QueueNack { queue, .. }
        | Request::QueueExtend { queue, .. } => queue.len(),
        Request::Compact { .. }
        | Request::LeaseGrant { .. }
        | Request::LeaseRevoke { .. }
        | Request::OpenSession
        | Request::CloseSession { .. }
        | Request::OpenSessionWithSecret { .. }
        | Request::CloseSessionWithSecret { .. }
        | Request::Tick => 0,
        Request::Auth(change) => auth_request_bytes(change),
        Request::AsUser { user, request } => user.len() + request_payload_bytes(request),
    }
}

/// Used by `Retention` in docs and tests: a topic with no limits.
impl Retention {
    /// Keep everything.
    pub fn unbounded() -> Self {
        Retention::default()
    }
}

fn auth_request_bytes(change: &AuthRequest) -> usize {
    match change {
        AuthRequest::Enable { token_key } => token_key.len(),
        AuthRequest::Disable => 0,
        AuthRequest::UserAdd {
            name,
            password_hash,
        }
        | AuthRequest::UserChangePassword {
            name,
            password_hash,
        } => name.len() + password_hash.len(),
        AuthRequest::UserDelete { name }
        | AuthRequest::RoleAdd { name }
        | AuthRequest::RoleDelete { name } => name.len(),
        AuthRequest::UserGrantRole { user, role } | AuthRequest::UserRevokeRole { user, role } => {
            user.len() + role.len()
        }
        AuthRequest::RoleGrantPermission { name, permission } => {
            name.len() + permission.key.len() + permission.range_end.len()
        }
        AuthRequest::RoleRevokePermission {
            name,
            key,
            range_end,
        } => name.len() + key.len() + range_end.len(),
    }
}

fn put_accesses(put: &PutRequest, accesses: &mut Vec<Access>) {
    accesses.push(Access::write(put.key.clone(), Bytes::new()));
    if put.prev_kv {
        accesses.push(Access::read(put.key.clone(), Bytes::new()));
    }
}

fn delete_accesses(delete: &DeleteRangeRequest, accesses: &mut Vec<Access>) {
    accesses.push(Access::write(delete.key.clone(), delete.range_end.clone()));
    if delete.prev_kv {
        accesses.push(Access::read(delete.key.clone(), delete.range_end.clone()));
    }
}

/// etcd checks every compare (read) and every operation of both branches, whichever runs.
fn txn_accesses(txn: &TxnRequest, accesses: &mut Vec<Access>) {
    for compare in &txn.compare {
        accesses.push(Access::read(compare.key.clone(), compare.range_end.clone()));
    }
    for op in txn.success.iter().chain(&txn.failure) {
        match op {
            RequestOp::Range(range) => {
                accesses.push(Access::read(range.key.clone(), range.range_end.clone()));
            }
            RequestOp::Put(put) => put_accesses(put, accesses),
            RequestOp::DeleteRange(delete) => delete_accesses(delete, accesses),
            RequestOp::Txn(inner) => txn_accesses(inner, accesses),
        }
    }
}

/// The earliest handoff or settle timer of any election group: a walk over every group.
fn earliest_group_timer_ms(groups: &OrdMap<String, Group>) -> Option<u64> {
    groups.values().filter_map(Group::timer_ms).min()
}

/// The earliest election-group timer, remembered for one version of the groups.
///
/// A leader with 10,000 groups spent about a third of its driver thread walking them every
/// tick for the earliest handoff or settle timer, though most ticks find no group changed.
/// The memo keeps a clone of the groups it walked (a persistent map: the clone shares every
/// node) and walks again only when the live map is no longer the same map. Holding the clone
/// makes any change to the groups copy the path it touches, so the root differs after every
/// change and the comparison is exact, never stale.
#[derive(Debug, Default)]
pub struct GroupTimerMemo {
    seen: Option<OrdMap<String, Group>>,
    earliest_ms: Option<u64>,
    walks: u64,
}

impl GroupTimerMemo {
    fn earliest_ms(&mut self, groups: &OrdMap<String, Group>) -> Option<u64> {
        if let Some(seen) = &self.seen
            && seen.ptr_eq(groups)
        {
            return self.earliest_ms;
        }
        self.walks += 1;
        self.earliest_ms = earliest_group_timer_ms(groups);
        self.seen = Some(groups.clone());
        self.earliest_ms
    }

    /// How many times the groups were walked.
    pub fn walks(&self) -> u64 {
        self.walks
    }
}
