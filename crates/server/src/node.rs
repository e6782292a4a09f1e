//! The node runtime: the one task that drives the Raft core.
//!
//! ```text
//!  ticker (tick_ms) ─────────┐
//!  peers ─ serve_peers ─ mpsc ┼─► Driver ─ RawNode::ready ─┬─ 1. WAL append + hard state, fsync
//!  API ─ NodeRequest ─ mpsc ──┘   (one OS thread,          ├─ 2. PeerTransport::send
//!                                  group commit: drains     ├─ 3. StateMachine::apply ─► waiters
//!                                  every queue, then one    ├─ 4. read states ─► read waiters
//!                                  Ready, one fsync)        └─ 5. advance; maybe snapshot
//!  NodeStatus (watch) ◄── role, leader, term, commit, applied
//! ```
//!
//! The driver runs on its own OS thread with a current-thread runtime, so an fsync blocks
//! only Raft, never the gRPC server. A proposal's waiter is keyed by (index, term): if the entry
//! applied at that index carries another term, a new leader overwrote it and the waiter gets
//! [`Error::LeaderChanged`] instead of hanging.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use conclave_raft::{
    ConfChange, ConfChangeStep, ConfState, Config as RaftConfig, EntryKind, NodeId, RawNode, Ready,
    Role, Snapshot, Storage,
};
use conclave_state::{ApplyOutput, Command, Event, LeaseKeeper, Request, SessionSeq, StateMachine};
use conclave_storage::{OsDisk, StorageOptions, WalStorage};
use tokio::sync::{broadcast, mpsc, oneshot, watch};

use crate::config::{Member, ServerConfig};
use crate::error::Error;
use crate::transport::{InboundMessage, PeerTransport};

/// Requests and messages the driver takes from its queues before it handles a Ready, so one
/// fsync covers a whole batch (group commit) without starving the ticker.
const DRAIN_BATCH_MAX: usize = 1024;
/// Events a watcher hub may lag behind the apply path before it is told it lost some.
pub const APPLIED_EVENTS_BUFFER_MAX: usize = 65_536;
/// Leases one `LeaseExpire` command revokes at most, so one entry stays small.
const LEASE_EXPIRE_BATCH_MAX: usize = 1000;
/// Checkpoints one `LeaseCheckpoint` command carries at most (a new leader anchors every lease).
const LEASE_CHECKPOINT_BATCH_MAX: usize = 1000;
/// An expiry proposal not applied within this long (lost to a leader change) is made again.
const LEASE_EXPIRE_RETRY_MS: u64 = 1000;
/// A keepalive this long after its lease's last "renewed" record commits a new one first. An
/// abandoned lease ends by its last keepalive + TTL + this across leader changes; etcd's
/// clients renew every TTL/3 (at least 333 ms), so a shorter interval would cost an entry on
/// nearly every keepalive.
const LEASE_CHECKPOINT_INTERVAL_MS: u64 = 500;

/// What a committed proposal produced.
#[derive(Debug, Clone)]
pub struct Applied {
    /// The state machine's answer.
    pub output: ApplyOutput,
    /// The Raft term the entry was committed in.
    pub term: u64,
}

/// What the API asks of the driver.
pub enum NodeRequest {
    /// Replicate `request`; the reply comes once it is applied (or lost).
    Propose {
        request: Request,
        /// The client's exactly-once session position, if it has one.
        session: Option<SessionSeq>,
        reply: oneshot::Sender<Result<Applied, Error>>,
    },
    /// Answer once the state machine has applied up to a quorum-confirmed commit index.
    ReadIndex { reply: ReadWaiter },
    /// Hand leadership to `target` (Maintenance.MoveLeader, shutdown).
    TransferLeader {
        target: NodeId,
        reply: oneshot::Sender<Result<(), Error>>,
    },
    /// A lease keepalive, served by the leader only. `None`: the lease does not exist (or is
    /// past its deadline).
    LeaseRenew {
        id: i64,
        reply: oneshot::Sender<Result<Option<LeaseRenewal>, Error>>,
    },
    /// The leader's remaining time to live of a lease; `None` when it does not exist.
    LeaseRemaining {
        id: i64,
        reply: oneshot::Sender<Result<Option<u64>, Error>>,
    },
    /// Replicate a member record (the membership table lives next to the state machine, since
    /// users cannot write `/_conclave/` keys); answered once applied here. Leader only.
    ProposeMember {
        member: Member,
        reply: oneshot::Sender<Result<(), Error>>,
    },
    /// Propose one membership change; answered once its entry is applied here. Leader only.
    ChangeMembership {
        steps: Vec<ConfChangeStep>,
        reply: oneshot::Sender<Result<(), Error>>,
    },
    /// Graceful shutdown's first step: a leader starts handing over to its most up-to-date
    /// voter and goes on serving as a follower. Answers whether a transfer began.
    HandOff {
        reply: oneshot::Sender<Result<bool, Error>>,
    },
    /// How far the leader has replicated to `peer`; see [`PeerMatch`]. Leader only; `None`
    /// when `peer` is not in the configuration.
    PeerMatch {
        peer: NodeId,
        reply: oneshot::Sender<Result<Option<PeerMatch>, Error>>,
    },
}

/// A peer's replication progress as its leader sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerMatch {
    /// The highest log index known to be on the peer.
    pub matched: u64,
    /// The leader's own last log index.
    pub leader_last: u64,
}

/// A keepalive the leader accepted.
#[derive(Debug)]
pub struct LeaseRenewal {
    /// The lease's granted TTL, for the answer.
    pub ttl_ms: u64,
    /// When set, answer the client only after this checkpoint has committed: otherwise a
    /// later leader could resume the lease at an earlier deadline than the one promised.
    pub checkpoint: Option<oneshot::Receiver<Result<Applied, Error>>>,
}

/// The driver's public view of the node, published on every change.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeStatus {
    pub id: NodeId,
    pub role: Option<Role>,
    pub leader: Option<NodeId>,
    pub term: u64,
    pub commit_index: u64,
    pub applied_index: u64,
    pub last_index: u64,
    pub conf_state: ConfState,
    /// The replicated member records (ids, names, addresses), by id.
    pub members: Vec<Member>,
    /// Set once the driver stopped; the reason, empty for a clean shutdown.
    pub stopped: Option<String>,
}

/// A batch of state-machine events with the revision after it, for watchers.
#[derive(Debug, Clone)]
pub struct AppliedEvents {
    pub revision: i64,
    pub events: Arc<Vec<Event>>,
}

/// The handle the API layer holds: queue into the driver, watch its status, read the state.
#[derive(Clone)]
pub struct NodeHandle {
    pub requests: mpsc::Sender<NodeRequest>,
    pub status: watch::Receiver<NodeStatus>,
    /// The applied state. The driver holds the write lock only while applying a batch.
    pub state: Arc<RwLock<StateMachine>>,
    pub events: broadcast::Sender<AppliedEvents>,
}

impl NodeHandle {
    pub fn status(&self) -> NodeStatus {
        self.status.borrow().clone()
    }

    /// Runs `read` against the applied state. A poisoned lock (a panic while applying) is
    /// still read: the panic already stopped the driver, and status reads should still work.
    pub fn read_state<T>(&self, read: impl FnOnce(&StateMachine) -> T) -> T {
        let guard = self
            .state
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        read(&guard)
    }

    async fn ask<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, Error>>) -> NodeRequest,
    ) -> Result<T, Error> {
        let (reply, answer) = oneshot::channel();
        self.requests
            .send(make(reply))
            .await
            .map_err(|_| Error::Stopped)?;
        // A dropped sender means the driver stopped (or dropped the waiter on shutdown).
        answer.await.map_err(|_| Error::Stopped)?
    }

    pub async fn propose(&self, request: Request) -> Result<Applied, Error> {
        self.propose_in_session(request, None).await
    }

    /// Replicates `request` as position `session` of a client session (when given): a retry
    /// with the same position is answered from the state machine's cache, not applied again.
    pub async fn propose_in_session(
        &self,
        request: Request,
        session: Option<SessionSeq>,
    ) -> Result<Applied, Error> {
        self.ask(|reply| NodeRequest::Propose {
            request,
            session,
            reply,
        })
        .await
    }

    pub async fn read_index(&self) -> Result<(), Error> {
        self.ask(|reply| NodeRequest::ReadIndex { reply }).await
    }

    pub async fn transfer_leader(&self, target: NodeId) -> Result<(), Error> {
        self.ask(|reply| NodeRequest::TransferLeader { target, reply })
            .await
    }

    /// A keepalive on the leader; see [`NodeRequest::LeaseRenew`].
    pub async fn lease_renew(&self, id: i64) -> Result<Option<LeaseRenewal>, Error> {
        self.ask(|reply| NodeRequest::LeaseRenew { id, reply })
            .await
    }

    /// Replicates a member record; see [`NodeRequest::ProposeMember`].
    pub async fn propose_member(&self, member: Member) -> Result<(), Error> {
        self.ask(|reply| NodeRequest::ProposeMember { member, reply })
            .await
    }

    /// Proposes a membership change; see [`NodeRequest::ChangeMembership`].
    pub async fn change_membership(&self, steps: Vec<ConfChangeStep>) -> Result<(), Error> {
        self.ask(|reply| NodeRequest::ChangeMembership { steps, reply })
            .await
    }

    /// Starts a graceful hand-over of leadership; see [`NodeRequest::HandOff`].
    pub async fn hand_off(&self) -> Result<bool, Error> {
        self.ask(|reply| NodeRequest::HandOff { reply }).await
    }

    /// The leader's view of `peer`'s log; see [`NodeRequest::PeerMatch`].
    pub async fn peer_match(&self, peer: NodeId) -> Result<Option<PeerMatch>, Error> {
        self.ask(|reply| NodeRequest::PeerMatch { peer, reply })
            .await
    }

    /// The leader's remaining TTL of a lease; see [`NodeRequest::LeaseRemaining`].
    pub async fn lease_remaining_ms(&self, id: i64) -> Result<Option<u64>, Error> {
        self.ask(|reply| NodeRequest::LeaseRemaining { id, reply })
            .await
    }
}

/// The state machine configuration every replica must share (limits decide which commands
/// fail, so they are part of the replicated behaviour).
pub fn state_config(config: &ServerConfig) -> conclave_state::Config {
    conclave_state::Config {
        election_timeout_ms: config.election_timeout_ms(),
        request_bytes_max: config.request_bytes_max,
        key_bytes_max: config.request_bytes_max,
        value_bytes_max: config.request_bytes_max,
        lease_checkpoint_interval_ms: LEASE_CHECKPOINT_INTERVAL_MS,
        ..conclave_state::Config::default()
    }
}

/// Opens the data directory (bootstrapping a fresh one with the founding members) and rebuilds
/// the state machine from the newest snapshot. The log after it is replayed by the core.
pub fn open_storage(config: &ServerConfig) -> Result<(WalStorage, StateMachine), Error> {
    open_storage_with_members(config).map(|(store, state, _)| (store, state))
}

/// [`open_storage`], plus the member records: the snapshot's, or the founding members.
fn open_storage_with_members(
    config: &ServerConfig,
) -> Result<(WalStorage, StateMachine, BTreeMap<NodeId, Member>), Error> {
    let mut store = WalStorage::open(
        Arc::new(OsDisk),
        &config.data_dir,
        StorageOptions::default(),
    )?;
    // A joining node waits for the leader's snapshot, which carries the membership.
    if store.is_fresh() && !config.join {
        let voters = config.members.iter().map(|m| m.id);
        store.bootstrap(ConfState::with_voters(voters))?;
    }
    let snapshot = store
        .snapshot()
        .map_err(|e| Error::StateRestore(e.to_string()))?;
    let (state, members) = restore_state(config, &snapshot)?;
    let members = members
        .unwrap_or_else(|| config.members.clone())
        .into_iter()
        .map(|m| (m.id, m))
        .collect();
    Ok((store, state, members))
}

fn restore_state(
    config: &ServerConfig,
    snapshot: &Snapshot,
) -> Result<(StateMachine, Option<Vec<Member>>), Error> {
    if snapshot.data.is_empty() {
        // The bootstrap snapshot carries membership only.
        return Ok((StateMachine::new(state_config(config)), None));
    }
    let (members, data) = split_snapshot(&snapshot.data[..])
        .ok_or_else(|| Error::StateRestore("malformed member records in the snapshot".into()))?;
    let state = StateMachine::restore(state_config(config), data)
        .map_err(|e| Error::StateRestore(e.to_string()))?;
    Ok((state, members))
}

/// Starts a log entry that carries a member record rather than a state-machine command. A
/// command's encoding cannot start with it (leader time 0, then an invalid option tag).
const MEMBER_ENTRY_MAGIC: &[u8] = b"\x00conclave-member\x01";
/// Starts a snapshot whose member records precede the state machine's image. Snapshots
/// without it (taken before membership changes existed) are the image alone.
const SNAPSHOT_MEMBERS_MAGIC: &[u8] = b"CNCLMEMB";
/// Bounds a member record's strings, so a corrupt length cannot ask for gigabytes.
const MEMBER_FIELD_BYTES_MAX: usize = 4096;

fn encode_member_into(out: &mut Vec<u8>, member: &Member) {
    out.extend_from_slice(&member.id.to_be_bytes());
    for field in [&member.name, &member.peer_addr, &member.client_addr] {
        out.extend_from_slice(&(field.len() as u32).to_be_bytes());
        out.extend_from_slice(field.as_bytes());
    }
}

fn encode_member_entry(member: &Member) -> Vec<u8> {
    let mut out = MEMBER_ENTRY_MAGIC.to_vec();
    encode_member_into(&mut out, member);
    out
}

/// Reads what [`encode_member_into`] wrote; `None` on malformed bytes, never a panic.
fn decode_member(bytes: &mut &[u8]) -> Option<Member> {
    fn take<'a>(bytes: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        let (head, rest) = (bytes.get(..n)?, bytes.get(n..)?);
        *bytes = rest;
        Some(head)
    }
    fn string(bytes: &mut &[u8]) -> Option<String> {
        let len = u32::from_be_bytes(take(bytes, 4)?.try_into().ok()?) as usize;
        if len > MEMBER_FIELD_BYTES_MAX {
            return None;
        }
        String::from_utf8(take(bytes, len)?.to_vec()).ok()
    }
    let id = u64::from_be_bytes(take(bytes, 8)?.try_into().ok()?);
    Some(Member {
        id,
        name: string(bytes)?,
        peer_addr: string(bytes)?,
        client_addr: string(bytes)?,
    })
}

/// Splits a snapshot into its member records (if it has them) and the state image.
fn split_snapshot(data: &[u8]) -> Option<(Option<Vec<Member>>, &[u8])> {
    let Some(mut rest) = data.strip_prefix(SNAPSHOT_MEMBERS_MAGIC) else {
        return Some((None, data));
    };
    let count = u32::from_be_bytes(rest.get(..4)?.try_into().ok()?);
    rest = rest.get(4..)?;
    let mut members = Vec::new();
    for _ in 0..count {
        members.push(decode_member(&mut rest)?);
    }
    Some((Some(members), rest))
}

/// Who waits for a linearizable read to become safe.
type ReadWaiter = oneshot::Sender<Result<(), Error>>;

struct ProposalWaiter {
    term: u64,
    reply: Reply,
}

/// Who waits for an entry: a client command wants its output; a member record or a
/// membership change only that it was applied.
enum Reply {
    Command(oneshot::Sender<Result<Applied, Error>>),
    Done(oneshot::Sender<Result<(), Error>>),
}

impl ProposalWaiter {
    fn fail(self, error: Error) {
        match self.reply {
            Reply::Command(reply) => {
                let _ = reply.send(Err(error));
            }
            Reply::Done(reply) => {
                let _ = reply.send(Err(error));
            }
        }
    }

    /// Answers with what applying the entry at this waiter's index produced: `Some` output
    /// for a command, `None` for a member record or membership change.
    fn answer(self, entry_term: u64, output: Option<Applied>) {
        if self.term != entry_term {
            return self.fail(Error::LeaderChanged);
        }
        match (self.reply, output) {
            (Reply::Command(reply), Some(applied)) => {
                let _ = reply.send(Ok(applied));
            }
            (Reply::Done(reply), None) => {
                let _ = reply.send(Ok(()));
            }
            // Another kind of entry took the index: what was waited for is lost.
            (Reply::Command(reply), None) => {
                let _ = reply.send(Err(Error::LeaderChanged));
            }
            (Reply::Done(reply), Some(_)) => {
                let _ = reply.send(Err(Error::LeaderChanged));
            }
        }
    }
}

/// Where this node stands with the leases (only a leader keeps their deadlines).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LeaseRole {
    Follower,
    /// Leader, waiting to apply every entry up to `index` (its own term's first entry) so that
    /// it resumes the leases from the newest records earlier leaders left.
    Promoting {
        index: u64,
    },
    Leading,
}

/// The leader's lease duty: deadlines, expiry and checkpoints. See `docs/state.md`, Leases.
struct LeaseDuty {
    keeper: LeaseKeeper,
    role: LeaseRole,
    /// Applied index the keeper last adopted grants and revocations at.
    synced_index: u64,
    /// The last expiry proposal (index, leader time), until applied or given up on.
    expire_pending: Option<(u64, u64)>,
}

/// The Raft driver. Owned by one thread; see the module documentation.
pub struct Driver {
    config: ServerConfig,
    raw: RawNode<WalStorage>,
    transport: PeerTransport,
    state: Arc<RwLock<StateMachine>>,
    status: watch::Sender<NodeStatus>,
    events: broadcast::Sender<AppliedEvents>,
    /// Invariant: keys are indexes this node proposed as leader and has not applied yet.
    proposals: BTreeMap<u64, ProposalWaiter>,
    /// Reads asked for in this loop turn; they share one ReadIndex round.
    reads_unsent: Vec<ReadWaiter>,
    /// Reads whose round is under way, by context.
    reads_sent: HashMap<u64, Vec<ReadWaiter>>,
    /// Reads confirmed at an index the state machine has not reached yet.
    reads_confirmed: Vec<(u64, Vec<ReadWaiter>)>,
    next_read_context: u64,
    snapshot_index: u64,
    leases: LeaseDuty,
    /// The replicated member records, by id: founding members or the snapshot's, then
    /// applied member entries. The peer transport dials every one of them but this node.
    members: BTreeMap<NodeId, Member>,
    /// Nodes a membership change removes; their records go once the configuration no longer
    /// holds them (the joint configuration still needs them).
    removals: BTreeSet<NodeId>,
    /// The caller's runtime, which has the IO driver the peer links need (the driver's own
    /// runtime has timers only).
    peer_runtime: tokio::runtime::Handle,
}

/// Starts the driver thread. Returns the handle for the API and a join handle whose result is
/// the driver's exit: `Ok` after a clean shutdown, the fatal error otherwise.
pub fn spawn(
    config: ServerConfig,
    transport: PeerTransport,
    inbound: mpsc::Receiver<InboundMessage>,
    shutdown: oneshot::Receiver<()>,
) -> Result<(NodeHandle, std::thread::JoinHandle<Result<(), Error>>), Error> {
    config.validate()?;
    let (store, state, members) = open_storage_with_members(&config)?;
    let mut raft_config = RaftConfig::new(config.id);
    raft_config.election_ticks = config.election_ticks;
    raft_config.heartbeat_ticks = config.heartbeat_ticks;
    raft_config.max_uncommitted_bytes = (config.request_bytes_max as u64) * 64;
    raft_config.seed = election_seed(config.id);
    raft_config
        .validate()
        .map_err(|reason| Error::InvalidConfig { reason })?;
    let snapshot_index = store
        .first_index()
        .map_err(|e| Error::RaftStart(e.to_string()))?
        - 1;
    let raw = RawNode::new(raft_config, store).map_err(Error::RaftStart)?;
    let leases = LeaseDuty {
        keeper: LeaseKeeper::new(&state_config(&config)),
        role: LeaseRole::Follower,
        synced_index: 0,
        expire_pending: None,
    };
    let state = Arc::new(RwLock::new(state));
    let (status_sender, status_receiver) = watch::channel(NodeStatus::default());
    let (events, _) = broadcast::channel(APPLIED_EVENTS_BUFFER_MAX);
    let (request_sender, requests) = mpsc::channel(config.driver_queue_requests_max);
    let mut driver = Driver {
        config,
        raw,
        transport,
        state: state.clone(),
        status: status_sender,
        events: events.clone(),
        proposals: BTreeMap::new(),
        reads_unsent: Vec::new(),
        reads_sent: HashMap::new(),
        reads_confirmed: Vec::new(),
        next_read_context: 1,
        snapshot_index,
        leases,
        members,
        removals: BTreeSet::new(),
        peer_runtime: tokio::runtime::Handle::try_current()
            .map_err(|e| Error::RaftStart(format!("no tokio runtime for the peer links: {e}")))?,
    };
    driver.sync_peers();
    driver.publish_status();
    let thread = std::thread::Builder::new()
        .name("conclave-raft".into())
        .spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .map_err(|e| Error::RaftStart(format!("driver runtime: {e}")))?;
            let result = runtime.block_on(driver.run(requests, inbound, shutdown));
            let reason = match &result {
                Ok(()) => String::new(),
                Err(e) => e.to_string(),
            };
            driver.status.send_modify(|s| s.stopped = Some(reason));
            result
        })
        .map_err(|e| Error::RaftStart(format!("driver thread: {e}")))?;
    let handle = NodeHandle {
        requests: request_sender,
        status: status_receiver,
        state,
        events,
    };
    Ok((handle, thread))
}

/// A seed for the core's election timeouts, different in every process: members started in
/// the same millisecond with seeds derived from the clock drew identical timeouts and split
/// every vote. `RandomState` is keyed from the OS's randomness.
fn election_seed(id: NodeId) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(id);
    hasher.write_u64(now_ms());
    hasher.write_u32(std::process::id());
    hasher.finish()
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl Driver {
    async fn run(
        &mut self,
        mut requests: mpsc::Receiver<NodeRequest>,
        mut inbound: mpsc::Receiver<InboundMessage>,
        mut shutdown: oneshot::Receiver<()>,
    ) -> Result<(), Error> {
        let mut ticker = tokio::time::interval(Duration::from_millis(self.config.tick_ms));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // A one-member cluster need not wait out an election timeout.
        if self.raw.conf_state().voters.len() == 1 && self.raw.conf_state().is_voter(self.raw.id())
        {
            self.raw.campaign();
        }
        let mut stopping_since: Option<Instant> = None;
        loop {
            let mut ticked = false;
            tokio::select! {
                _ = &mut shutdown, if stopping_since.is_none() => {
                    stopping_since = Some(Instant::now());
                    if !self.begin_handoff() {
                        break;
                    }
                }
                _ = ticker.tick() => {
                    self.raw.tick();
                    self.drop_abandoned_waiters();
                    ticked = true;
                }
                message = inbound.recv() => {
                    if let Some((_, message)) = message {
                        self.step(message);
                    }
                }
                request = requests.recv() => match request {
                    Some(request) => self.handle_request(request),
                    // Every handle is gone: nobody can be served any more.
                    None => break,
                },
            }
            for _ in 0..DRAIN_BATCH_MAX {
                match inbound.try_recv() {
                    Ok((_, message)) => self.step(message),
                    Err(_) => break,
                }
            }
            for _ in 0..DRAIN_BATCH_MAX {
                match requests.try_recv() {
                    Ok(request) => self.handle_request(request),
                    Err(_) => break,
                }
            }
            self.flush_reads();
            self.drive_leases(ticked);
            while self.raw.has_ready() {
                self.handle_ready()?;
            }
            self.maybe_snapshot()?;
            self.publish_status();
            if let Some(since) = stopping_since {
                let waited = since.elapsed()
                    >= Duration::from_millis(self.config.shutdown_transfer_timeout_ms);
                if self.raw.role() != Role::Leader || waited {
                    break;
                }
            }
        }
        self.fail_all_waiters(|| Error::Stopped);
        if self.raw.store().needs_sync() {
            self.raw.store_mut().sync()?;
        }
        Ok(())
    }

    /// On shutdown a leader hands over to its most up-to-date voter, so a rolling restart
    /// loses no request. Returns false when there is nobody to hand over to.
    fn begin_handoff(&mut self) -> bool {
        if self.raw.role() != Role::Leader {
            return false;
        }
        let me = self.raw.id();
        let best = self
            .raw
            .conf_state()
            .voters
            .iter()
            .copied()
            .filter(|&id| id != me)
            .filter_map(|id| self.raw.peer_progress(id).map(|(matched, _)| (matched, id)))
            .max();
        match best {
            Some((_, target)) => {
                tracing::info!(target, "shutting down: transferring leadership");
                self.raw.transfer_leader(target).is_ok()
            }
            None => false,
        }
    }

    fn step(&mut self, message: conclave_raft::Message) {
        if let Err(error) = self.raw.step(message) {
            tracing::debug!(%error, "peer message refused");
        }
    }

    fn handle_request(&mut self, request: NodeRequest) {
        match request {
            NodeRequest::Propose {
                request,
                session,
                reply,
            } => self.propose(request, session, reply),
            NodeRequest::ReadIndex { reply } => {
                let pending: usize = self.reads_unsent.len()
                    + self.reads_sent.values().map(Vec::len).sum::<usize>()
                    + self
                        .reads_confirmed
                        .iter()
                        .map(|(_, r)| r.len())
                        .sum::<usize>();
                if pending >= self.config.reads_inflight_max {
                    let _ = reply.send(Err(Error::TooManyRequests));
                } else {
                    self.reads_unsent.push(reply);
                }
            }
            NodeRequest::TransferLeader { target, reply } => {
                let result = self.raw.transfer_leader(target).map_err(raft_error);
                let _ = reply.send(result);
            }
            NodeRequest::LeaseRenew { id, reply } => {
                let result = self.lease_renew(id);
                let _ = reply.send(result);
            }
            NodeRequest::LeaseRemaining { id, reply } => {
                let result = self.lease_remaining_ms(id);
                let _ = reply.send(result);
            }
            NodeRequest::ProposeMember { member, reply } => {
                let data = Bytes::from(encode_member_entry(&member));
                self.propose_tracked(Reply::Done(reply), |raw| raw.propose(data));
            }
            NodeRequest::ChangeMembership { steps, reply } => {
                self.propose_tracked(Reply::Done(reply), |raw| raw.propose_conf_change(steps));
            }
            NodeRequest::HandOff { reply } => {
                let _ = reply.send(Ok(self.begin_handoff()));
            }
            NodeRequest::PeerMatch { peer, reply } => {
                let answer = if self.raw.role() == Role::Leader {
                    Ok(self.raw.peer_progress(peer).map(|(matched, _)| PeerMatch {
                        matched,
                        leader_last: self.raw.last_index(),
                    }))
                } else {
                    Err(Error::NotLeader {
                        leader: self.raw.leader(),
                    })
                };
                let _ = reply.send(answer);
            }
        }
    }

    /// Proposes with `propose` as leader and keeps `reply` until the entry is applied.
    fn propose_tracked(
        &mut self,
        reply: Reply,
        propose: impl FnOnce(&mut RawNode<WalStorage>) -> Result<u64, conclave_raft::Error>,
    ) {
        let waiter = ProposalWaiter {
            term: self.raw.term(),
            reply,
        };
        if self.raw.role() != Role::Leader {
            return waiter.fail(Error::NotLeader {
                leader: self.raw.leader(),
            });
        }
        if self.proposals.len() >= self.config.proposals_inflight_max {
            return waiter.fail(Error::TooManyRequests);
        }
        match propose(&mut self.raw) {
            Ok(index) => {
                self.proposals.insert(index, waiter);
            }
            Err(error) => waiter.fail(raft_error(error)),
        }
    }

    /// Makes the transport dial exactly the recorded members other than this node.
    fn sync_peers(&mut self) {
        let _runtime = self.peer_runtime.enter();
        let me = self.raw.id();
        let stale: Vec<NodeId> = self
            .transport
            .peers()
            .filter(|id| !self.members.contains_key(id))
            .collect();
        for id in stale {
            self.transport.remove_peer(id);
        }
        for member in self.members.values().filter(|m| m.id != me) {
            if let Err(error) = self.transport.add_peer(member.id, member.peer_addr.clone()) {
                tracing::warn!(id = member.id, %error, "peer not added");
            }
        }
    }

    /// Drops the records of removed nodes once the configuration no longer holds them.
    fn finish_removals(&mut self) {
        if self.removals.is_empty() {
            return;
        }
        let conf = self.raw.conf_state().clone();
        let gone: Vec<NodeId> = self
            .removals
            .iter()
            .copied()
            .filter(|&id| !conf.contains(id))
            .collect();
        for id in gone {
            self.removals.remove(&id);
            if id != self.raw.id() {
                self.members.remove(&id);
            }
            tracing::info!(id, "member removed");
        }
        self.sync_peers();
    }

    /// Why this node cannot serve lease deadlines now, if it cannot.
    fn lease_unavailable(&self) -> Option<Error> {
        if self.raw.role() != Role::Leader {
            return Some(Error::NotLeader {
                leader: self.raw.leader(),
            });
        }
        // A fresh leader first resumes the leases (moments after its election); callers retry.
        (self.leases.role != LeaseRole::Leading).then_some(Error::LeaderChanged)
    }

    fn lease_renew(&mut self, id: i64) -> Result<Option<LeaseRenewal>, Error> {
        if let Some(error) = self.lease_unavailable() {
            return Err(error);
        }
        let now = now_ms();
        let renewal = {
            let state = self
                .state
                .read()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            self.leases.keeper.renew(state.leases(), id, now)
        };
        // The keeper refuses only leases that are gone or past their deadline.
        let Ok(renewal) = renewal else {
            return Ok(None);
        };
        let checkpoint = renewal.checkpoint_before_reply.map(|checkpoint| {
            let (reply, committed) = oneshot::channel();
            let request = Request::LeaseCheckpoint {
                checkpoints: vec![checkpoint],
            };
            self.propose(request, None, reply);
            committed
        });
        Ok(Some(LeaseRenewal {
            ttl_ms: renewal.ttl_ms,
            checkpoint,
        }))
    }

    fn lease_remaining_ms(&mut self, id: i64) -> Result<Option<u64>, Error> {
        if let Some(error) = self.lease_unavailable() {
            return Err(error);
        }
        let now = now_ms();
        let state = self
            .state
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let Some(lease) = state.lease(id) else {
            return Ok(None);
        };
        // A lease granted in this very turn is not synced into the keeper yet: its recorded
        // bound is where the keeper will put it.
        let interval_ms = state.config().lease_checkpoint_interval_ms;
        let remaining = self.leases.keeper.remaining_ms(id, now).unwrap_or_else(|| {
            lease
                .resume
                .promise_bound_ms(lease.ttl_ms, interval_ms)
                .saturating_sub(now)
        });
        Ok(Some(remaining))
    }

    /// The leader's lease duty, once per loop turn: follow leadership changes (promote once
    /// the new term's first entry is applied, demote on losing it), adopt applied grants and
    /// revocations, and on ticks propose the expiry of leases past their deadline.
    fn drive_leases(&mut self, ticked: bool) {
        let applied = self.raw.applied_index();
        if self.raw.role() != Role::Leader {
            if self.leases.role != LeaseRole::Follower {
                self.leases.keeper.demote();
                self.leases.role = LeaseRole::Follower;
                self.leases.expire_pending = None;
            }
            return;
        }
        match self.leases.role {
            LeaseRole::Follower => {
                // The no-op of this term is at or below the last index now.
                self.leases.role = LeaseRole::Promoting {
                    index: self.raw.last_index(),
                };
                return;
            }
            LeaseRole::Promoting { index } if applied < index => return,
            LeaseRole::Promoting { .. } => {
                let checkpoints = {
                    let state = self
                        .state
                        .read()
                        .unwrap_or_else(|poisoned| poisoned.into_inner());
                    self.leases.keeper.promote(state.leases(), now_ms())
                };
                self.leases.role = LeaseRole::Leading;
                self.leases.synced_index = applied;
                // Anchor what this leader decided, so the next one resumes from it rather than
                // granting another full grace (etcd issue 9888).
                for batch in checkpoints.chunks(LEASE_CHECKPOINT_BATCH_MAX) {
                    self.propose_lease_duty(Request::LeaseCheckpoint {
                        checkpoints: batch.to_vec(),
                    });
                }
                tracing::info!(leases = checkpoints.len(), "leases resumed as leader");
            }
            LeaseRole::Leading => {}
        }
        if applied > self.leases.synced_index {
            let state = self
                .state
                .read()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            self.leases.keeper.sync(state.leases());
            self.leases.synced_index = applied;
        }
        if !ticked {
            return;
        }
        let now = now_ms();
        if let Some((index, at_ms)) = self.leases.expire_pending {
            let lost = now >= at_ms.saturating_add(LEASE_EXPIRE_RETRY_MS);
            if applied < index && !lost {
                return;
            }
            self.leases.expire_pending = None;
        }
        let ids = self.leases.keeper.expired(now, LEASE_EXPIRE_BATCH_MAX);
        if ids.is_empty() {
            return;
        }
        tracing::debug!(?ids, "proposing lease expiry");
        if let Some(index) = self.propose_lease_duty(Request::LeaseExpire { ids }) {
            self.leases.expire_pending = Some((index, now));
        }
    }

    /// Proposes a leader-made lease command nobody waits for; returns its index.
    fn propose_lease_duty(&mut self, request: Request) -> Option<u64> {
        let command = Command::new(now_ms(), request);
        match self.raw.propose(Bytes::from(command.encode())) {
            Ok(index) => Some(index),
            Err(error) => {
                tracing::warn!(%error, "lease command not proposed");
                None
            }
        }
    }

    fn propose(
        &mut self,
        request: Request,
        session: Option<SessionSeq>,
        reply: oneshot::Sender<Result<Applied, Error>>,
    ) {
        if self.raw.role() != Role::Leader {
            let _ = reply.send(Err(Error::NotLeader {
                leader: self.raw.leader(),
            }));
            return;
        }
        if self.proposals.len() >= self.config.proposals_inflight_max {
            let _ = reply.send(Err(Error::TooManyRequests));
            return;
        }
        // The leader's clock is the state machine's only notion of time (leases, sessions).
        let command = Command {
            leader_time_ms: now_ms(),
            session,
            request,
        };
        match self.raw.propose(Bytes::from(command.encode())) {
            Ok(index) => {
                let term = self.raw.term();
                let reply = Reply::Command(reply);
                self.proposals.insert(index, ProposalWaiter { term, reply });
            }
            Err(error) => {
                let _ = reply.send(Err(raft_error(error)));
            }
        }
    }

    /// Starts one ReadIndex round for every read asked for since the last one.
    fn flush_reads(&mut self) {
        if self.reads_unsent.is_empty() {
            return;
        }
        let context = self.next_read_context;
        self.next_read_context += 1;
        let readers = std::mem::take(&mut self.reads_unsent);
        match self
            .raw
            .read_index(Bytes::copy_from_slice(&context.to_be_bytes()))
        {
            Ok(()) => {
                self.reads_sent.insert(context, readers);
            }
            Err(error) => {
                let error = raft_error(error);
                for reader in readers {
                    let _ = reader.send(Err(clone_error(&error)));
                }
            }
        }
    }

    /// Handles one Ready in the order its documentation prescribes.
    fn handle_ready(&mut self) -> Result<(), Error> {
        let ready: Ready = self.raw.ready();
        if let Some(soft) = ready.soft_state {
            tracing::info!(role = ?soft.role, leader = ?soft.leader, term = soft.term, "raft role");
            // Read rounds do not survive a leader change; let their callers retry at once.
            for (_, readers) in self.reads_sent.drain() {
                for reader in readers {
                    let _ = reader.send(Err(Error::LeaderChanged));
                }
            }
        }
        // 1. Persist: snapshot, entries, hard state; fsync when asked.
        let store = self.raw.store_mut();
        if let Some(snapshot) = &ready.snapshot {
            store.apply_snapshot(snapshot.clone())?;
        }
        if !ready.entries.is_empty() {
            store.append(&ready.entries)?;
        }
        if let Some(hard_state) = ready.hard_state {
            store.set_hard_state(hard_state)?;
        }
        if ready.must_sync {
            store.sync()?;
        }
        // 2. Send: everything a message depends on is durable now.
        for message in &ready.messages {
            if let Err(error) = self.transport.send(message.clone()) {
                tracing::debug!(%error, "peer message not sent");
            }
        }
        // 3. Apply: a snapshot from the leader replaces the state, then committed entries.
        if let Some(snapshot) = &ready.snapshot {
            let (restored, members) = restore_state(&self.config, snapshot)?;
            *self.write_state() = restored;
            if let Some(members) = members {
                self.members = members.into_iter().map(|m| (m.id, m)).collect();
                self.sync_peers();
            }
            self.snapshot_index = snapshot.meta.index;
            // Proposals at or below the snapshot can no longer be matched to their entry.
            let lost: Vec<u64> = self
                .proposals
                .range(..=snapshot.meta.index)
                .map(|(&i, _)| i)
                .collect();
            for index in lost {
                if let Some(waiter) = self.proposals.remove(&index) {
                    waiter.fail(Error::LeaderChanged);
                }
            }
        }
        self.apply_entries(&ready)?;
        // 4. Reads whose index is now applied.
        for read_state in &ready.read_states {
            let Ok(context) = <[u8; 8]>::try_from(&read_state.context[..]) else {
                continue;
            };
            if let Some(readers) = self.reads_sent.remove(&u64::from_be_bytes(context)) {
                self.reads_confirmed.push((read_state.index, readers));
            }
        }
        // 5. Advance: committed membership changes take effect here.
        self.raw.advance(ready);
        self.finish_removals();
        self.release_reads();
        Ok(())
    }

    fn write_state(&self) -> std::sync::RwLockWriteGuard<'_, StateMachine> {
        self.state
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn apply_entries(&mut self, ready: &Ready) -> Result<(), Error> {
        if ready.committed_entries.is_empty() {
            return Ok(());
        }
        let mut events = Vec::new();
        let mut revision = 0;
        let mut answers = Vec::new();
        let mut members_changed = false;
        {
            let mut state = self
                .state
                .write()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            for entry in &ready.committed_entries {
                let waiter = self.proposals.remove(&entry.index);
                if entry.kind == EntryKind::ConfChange {
                    // The core applies it at advance; the driver follows with the peers.
                    if let Some(ConfChange::Enter(steps)) = ConfChange::decode(&entry.data) {
                        for step in steps {
                            if let ConfChangeStep::RemoveNode(id) = step {
                                self.removals.insert(id);
                            }
                        }
                        members_changed = true;
                    }
                    if let Some(waiter) = waiter {
                        answers.push((waiter, entry.term, None));
                    }
                    continue;
                }
                if let Some(mut record) = entry.data.strip_prefix(MEMBER_ENTRY_MAGIC) {
                    match decode_member(&mut record) {
                        Some(member) => {
                            self.members.insert(member.id, member);
                            members_changed = true;
                        }
                        None => tracing::error!(index = entry.index, "bad member record skipped"),
                    }
                    if let Some(waiter) = waiter {
                        answers.push((waiter, entry.term, None));
                    }
                    continue;
                }
                if entry.data.is_empty() {
                    // A leader's no-op: whatever waited at this index was overwritten.
                    if let Some(waiter) = waiter {
                        waiter.fail(Error::LeaderChanged);
                    }
                    continue;
                }
                let output = match Command::decode(&entry.data) {
                    Ok(command) => state.apply(entry.index, &command),
                    Err(error) => {
                        // Every replica decodes the same bytes the same way, so skipping keeps
                        // them identical; it can only be a bug in the proposing node.
                        tracing::error!(index = entry.index, %error, "undecodable entry skipped");
                        continue;
                    }
                };
                revision = output.revision;
                events.extend(output.events.iter().cloned());
                if let Some(waiter) = waiter {
                    let applied = Applied {
                        output,
                        term: entry.term,
                    };
                    answers.push((waiter, entry.term, Some(applied)));
                }
            }
        }
        if !events.is_empty() {
            // No receiver is fine: nobody watches.
            let _ = self.events.send(AppliedEvents {
                revision,
                events: Arc::new(events),
            });
        }
        if members_changed {
            self.sync_peers();
        }
        for (waiter, term, output) in answers {
            waiter.answer(term, output);
        }
        // Anything still waiting below the last applied index was overwritten.
        let applied = ready.committed_entries.last().map_or(0, |e| e.index);
        let stale: Vec<u64> = self.proposals.range(..=applied).map(|(&i, _)| i).collect();
        for index in stale {
            if let Some(waiter) = self.proposals.remove(&index) {
                waiter.fail(Error::LeaderChanged);
            }
        }
        Ok(())
    }

    fn release_reads(&mut self) {
        let applied = self.raw.applied_index();
        let (ready, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.reads_confirmed)
            .into_iter()
            .partition(|(index, _)| *index <= applied);
        self.reads_confirmed = waiting;
        for (_, readers) in ready {
            for reader in readers {
                let _ = reader.send(Ok(()));
            }
        }
    }

    /// Forgets waiters whose caller gave up (deadline passed, connection closed), so a read
    /// round whose answer was lost cannot pin memory.
    fn drop_abandoned_waiters(&mut self) {
        self.reads_sent.retain(|_, readers| {
            readers.retain(|r| !r.is_closed());
            !readers.is_empty()
        });
    }

    fn fail_all_waiters(&mut self, error: impl Fn() -> Error) {
        for (_, waiter) in std::mem::take(&mut self.proposals) {
            waiter.fail(error());
        }
        let mut readers: Vec<_> = std::mem::take(&mut self.reads_unsent);
        readers.extend(self.reads_sent.drain().flat_map(|(_, r)| r));
        readers.extend(
            std::mem::take(&mut self.reads_confirmed)
                .into_iter()
                .flat_map(|(_, r)| r),
        );
        for reader in readers {
            let _ = reader.send(Err(error()));
        }
    }

    /// Every `snapshot_entries` applied entries, snapshot the state machine and let the
    /// storage drop the log below it.
    fn maybe_snapshot(&mut self) -> Result<(), Error> {
        let applied = self.raw.applied_index();
        if applied < self.snapshot_index + self.config.snapshot_entries {
            return Ok(());
        }
        let data = self
            .state
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .snapshot_to_vec();
        // The member records travel with the state, so a node that catches up by snapshot
        // (a joining one above all) learns every member's address.
        let mut framed = SNAPSHOT_MEMBERS_MAGIC.to_vec();
        framed.extend_from_slice(&(self.members.len() as u32).to_be_bytes());
        for member in self.members.values() {
            encode_member_into(&mut framed, member);
        }
        framed.extend_from_slice(&data);
        let data = framed;
        let conf_state = self.raw.conf_state().clone();
        self.raw
            .store_mut()
            .create_snapshot(applied, conf_state, Bytes::from(data))?;
        tracing::info!(index = applied, "snapshot taken, log compacted");
        self.snapshot_index = applied;
        Ok(())
    }

    fn publish_status(&mut self) {
        let status = NodeStatus {
            id: self.raw.id(),
            role: Some(self.raw.role()),
            leader: self.raw.leader(),
            term: self.raw.term(),
            commit_index: self.raw.commit_index(),
            applied_index: self.raw.applied_index(),
            last_index: self.raw.last_index(),
            conf_state: self.raw.conf_state().clone(),
            members: self.members.values().cloned().collect(),
            stopped: None,
        };
        self.status.send_if_modified(|current| {
            if *current == status {
                false
            } else {
                *current = status;
                true
            }
        });
    }
}

fn raft_error(error: conclave_raft::Error) -> Error {
    match error {
        conclave_raft::Error::NotLeader { leader } => Error::NotLeader { leader },
        conclave_raft::Error::NoLeader => Error::NoLeader,
        other => Error::Raft(other),
    }
}

/// The operating errors a batch of readers may share (the error type holds `io::Error`, so it
/// is not `Clone`).
fn clone_error(error: &Error) -> Error {
    match error {
        Error::NoLeader => Error::NoLeader,
        Error::NotLeader { leader } => Error::NotLeader { leader: *leader },
        Error::LeaderChanged => Error::LeaderChanged,
        Error::TooManyRequests => Error::TooManyRequests,
        Error::Raft(e) => Error::Raft(e.clone()),
        _ => Error::Stopped,
    }
}

/// The size of everything under `dir`, for Maintenance.Status's `dbSize`.
pub fn dir_size_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|entry| match entry.metadata() {
            Ok(meta) if meta.is_dir() => dir_size_bytes(&entry.path()),
            Ok(meta) => meta.len(),
            Err(_) => 0,
        })
        .sum()
}
