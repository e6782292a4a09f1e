//! Conclave's coordination state machine (`conclave_state::StateMachine`) on the generic
//! driver: commands stamped with the leader's clock, the leader's lease duty (deadlines,
//! keepalives, expiry and checkpoint proposals), and the applied events fanned out to
//! watchers. [`NodeHandle`] is what the etcd and `conclave.v1` services talk to.

use std::sync::{Arc, RwLock};

use conclave_raft::{ConfChangeStep, NodeId, Role};
use conclave_state::{ApplyOutput, Command, Event, LeaseKeeper, Request, SessionSeq, StateMachine};
use conclave_storage::WalStorage;
use tokio::sync::{broadcast, mpsc, oneshot, watch};

use super::driver::{
    self, Applied, Core, Duties, Handle, NodeRequest, NodeStatus, PeerMatch, now_ms,
};
use crate::config::{Member, ServerConfig};
use crate::error::Error;
use crate::machine::{MachineError, ReplicatedMachine};
use crate::transport::{InboundMessage, PeerTransport};

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

/// A client request for the coordination machine, with the client's exactly-once session
/// position when it has one. The leader stamps its clock on it when it proposes.
#[derive(Debug, Clone)]
pub struct Proposal {
    pub request: Request,
    pub session: Option<SessionSeq>,
}

impl ReplicatedMachine for StateMachine {
    type Command = Proposal;
    type Output = ApplyOutput;

    fn encode(proposal: Proposal) -> Vec<u8> {
        // The leader's clock is the state machine's only notion of time (leases, sessions).
        Command {
            leader_time_ms: now_ms(),
            session: proposal.session,
            request: proposal.request,
        }
        .encode()
    }

    fn apply(&mut self, index: u64, entry: &[u8]) -> Result<ApplyOutput, MachineError> {
        let command = Command::decode(entry)?;
        Ok(StateMachine::apply(self, index, &command))
    }

    fn snapshot(&self) -> Vec<u8> {
        self.snapshot_to_vec()
    }

    fn restore(&mut self, image: &[u8]) -> Result<(), MachineError> {
        *self = StateMachine::restore(self.config().clone(), image)?;
        Ok(())
    }
}

/// A batch of state-machine events with the revision after it, for watchers.
#[derive(Debug, Clone)]
pub struct AppliedEvents {
    pub revision: i64,
    pub events: Arc<Vec<Event>>,
}

/// A keepalive the leader accepted.
#[derive(Debug)]
pub struct LeaseRenewal {
    /// The lease's granted TTL, for the answer.
    pub ttl_ms: u64,
    /// When set, answer the client only after this checkpoint has committed: otherwise a
    /// later leader could resume the lease at an earlier deadline than the one promised.
    pub checkpoint: Option<oneshot::Receiver<Result<Applied<ApplyOutput>, Error>>>,
}

/// Requests only the driver thread can answer, because the lease deadlines live there.
pub(crate) enum LeaseRequest {
    /// A lease keepalive, served by the leader only. `None`: the lease does not exist (or is
    /// past its deadline).
    Renew {
        id: i64,
        reply: oneshot::Sender<Result<Option<LeaseRenewal>, Error>>,
    },
    /// The leader's remaining time to live of a lease; `None` when it does not exist.
    Remaining {
        id: i64,
        reply: oneshot::Sender<Result<Option<u64>, Error>>,
    },
}

/// The handle the API layer holds: queue into the driver, watch its status, read the state.
#[derive(Clone)]
pub struct NodeHandle {
    node: Handle<StateMachine, LeaseRequest>,
    pub status: watch::Receiver<NodeStatus>,
    /// The applied state. The driver holds the write lock only while applying a batch.
    pub state: Arc<RwLock<StateMachine>>,
    pub events: broadcast::Sender<AppliedEvents>,
}

impl NodeHandle {
    pub fn status(&self) -> NodeStatus {
        self.node.status()
    }

    /// Runs `read` against the applied state. A poisoned lock (a panic while applying) is
    /// still read: the panic already stopped the driver, and status reads should still work.
    pub fn read_state<T>(&self, read: impl FnOnce(&StateMachine) -> T) -> T {
        self.node.read_state(read)
    }

    pub async fn propose(&self, request: Request) -> Result<Applied<ApplyOutput>, Error> {
        self.propose_in_session(request, None).await
    }

    /// Replicates `request` as position `session` of a client session (when given): a retry
    /// with the same position is answered from the state machine's cache, not applied again.
    pub async fn propose_in_session(
        &self,
        request: Request,
        session: Option<SessionSeq>,
    ) -> Result<Applied<ApplyOutput>, Error> {
        self.node.propose(Proposal { request, session }).await
    }

    /// Waits until the state machine has applied up to a quorum-confirmed commit index.
    pub async fn read_index(&self) -> Result<(), Error> {
        self.node.read_index().await
    }

    pub async fn transfer_leader(&self, target: NodeId) -> Result<(), Error> {
        self.node.transfer_leader(target).await
    }

    /// A keepalive on the leader: `None` when the lease does not exist (or is past its
    /// deadline).
    pub async fn lease_renew(&self, id: i64) -> Result<Option<LeaseRenewal>, Error> {
        self.node
            .ask(|reply| NodeRequest::Duty(LeaseRequest::Renew { id, reply }))
            .await
    }

    /// Replicates a member record (the membership table lives next to the state machine,
    /// since users cannot write `/_conclave/` keys); answered once applied here. Leader only.
    pub async fn propose_member(&self, member: Member) -> Result<(), Error> {
        self.node.propose_member(member).await
    }

    pub async fn update_member(&self, member: Member) -> Result<(), Error> {
        self.node.update_member(member).await
    }

    /// Proposes one membership change; answered once its entry is applied here. Leader only.
    pub async fn change_membership(&self, steps: Vec<ConfChangeStep>) -> Result<(), Error> {
        self.node.change_membership(steps).await
    }

    /// Graceful shutdown's first step: a leader starts handing over to its most up-to-date
    /// voter and goes on serving as a follower. Answers whether a transfer began.
    pub async fn hand_off(&self) -> Result<bool, Error> {
        self.node.hand_off().await
    }

    /// How far the leader has replicated to `peer`. Leader only; `None` when `peer` is not in
    /// the configuration.
    pub async fn peer_match(&self, peer: NodeId) -> Result<Option<PeerMatch>, Error> {
        self.node.peer_match(peer).await
    }

    /// The leader's remaining TTL of a lease; `None` when it does not exist.
    pub async fn lease_remaining_ms(&self, id: i64) -> Result<Option<u64>, Error> {
        self.node
            .ask(|reply| NodeRequest::Duty(LeaseRequest::Remaining { id, reply }))
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
    let machine = StateMachine::new(state_config(config));
    driver::open_storage(config, machine).map(|(store, state, _)| (store, state))
}

/// Starts the driver thread for the coordination machine. Returns the handle for the API and
/// a join handle whose result is the driver's exit: `Ok` after a clean shutdown, the fatal
/// error otherwise.
pub fn spawn(
    config: ServerConfig,
    transport: PeerTransport,
    inbound: mpsc::Receiver<InboundMessage>,
    shutdown: oneshot::Receiver<()>,
) -> Result<(NodeHandle, std::thread::JoinHandle<Result<(), Error>>), Error> {
    let state_config = state_config(&config);
    let (events, _) = broadcast::channel(APPLIED_EVENTS_BUFFER_MAX);
    let duties = CoordinationDuties {
        leases: LeaseDuty {
            keeper: LeaseKeeper::new(&state_config),
            role: LeaseRole::Follower,
            synced_index: 0,
            expire_pending: None,
        },
        events: events.clone(),
        batch_events: Vec::new(),
        batch_revision: 0,
    };
    let machine = StateMachine::new(state_config);
    let (node, thread) = driver::spawn(config, machine, duties, transport, inbound, shutdown)?;
    let handle = NodeHandle {
        status: node.status.clone(),
        state: node.machine.clone(),
        node,
        events,
    };
    Ok((handle, thread))
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

/// What the coordination machine runs beside itself on the driver thread.
struct CoordinationDuties {
    leases: LeaseDuty,
    events: broadcast::Sender<AppliedEvents>,
    /// Events of the batch being applied, sent to watchers in one message after it.
    batch_events: Vec<Event>,
    /// The revision after the last command of the batch being applied.
    batch_revision: i64,
}

impl Duties<StateMachine> for CoordinationDuties {
    type Request = LeaseRequest;

    fn request(&mut self, core: &mut Core<StateMachine>, request: LeaseRequest) {
        match request {
            LeaseRequest::Renew { id, reply } => {
                let result = self.lease_renew(core, id);
                let _ = reply.send(result);
            }
            LeaseRequest::Remaining { id, reply } => {
                let result = self.lease_remaining_ms(core, id);
                let _ = reply.send(result);
            }
        }
    }

    fn turn(&mut self, core: &mut Core<StateMachine>, ticked: bool) {
        self.drive_leases(core, ticked);
    }

    fn applied(&mut self, output: &ApplyOutput) {
        self.batch_revision = output.revision;
        self.batch_events.extend(output.events.iter().cloned());
    }

    fn batch_applied(&mut self) {
        if self.batch_events.is_empty() {
            return;
        }
        // No receiver is fine: nobody watches.
        let _ = self.events.send(AppliedEvents {
            revision: self.batch_revision,
            events: Arc::new(std::mem::take(&mut self.batch_events)),
        });
    }
}

impl CoordinationDuties {
    /// Why this node cannot serve lease deadlines now, if it cannot.
    fn lease_unavailable(&self, core: &Core<StateMachine>) -> Option<Error> {
        if core.role() != Role::Leader {
            return Some(Error::NotLeader {
                leader: core.leader(),
            });
        }
        // A fresh leader first resumes the leases (moments after its election); callers retry.
        (self.leases.role != LeaseRole::Leading).then_some(Error::LeaderChanged)
    }

    fn lease_renew(
        &mut self,
        core: &mut Core<StateMachine>,
        id: i64,
    ) -> Result<Option<LeaseRenewal>, Error> {
        if let Some(error) = self.lease_unavailable(core) {
            return Err(error);
        }
        let now = now_ms();
        let renewal = self.leases.keeper.renew(core.machine().leases(), id, now);
        // The keeper refuses only leases that are gone or past their deadline.
        let Ok(renewal) = renewal else {
            return Ok(None);
        };
        let checkpoint = renewal.checkpoint_before_reply.map(|checkpoint| {
            let (reply, committed) = oneshot::channel();
            let request = Request::LeaseCheckpoint {
                checkpoints: vec![checkpoint],
            };
            core.propose(
                Proposal {
                    request,
                    session: None,
                },
                reply,
            );
            committed
        });
        Ok(Some(LeaseRenewal {
            ttl_ms: renewal.ttl_ms,
            checkpoint,
        }))
    }

    fn lease_remaining_ms(
        &mut self,
        core: &mut Core<StateMachine>,
        id: i64,
    ) -> Result<Option<u64>, Error> {
        if let Some(error) = self.lease_unavailable(core) {
            return Err(error);
        }
        let now = now_ms();
        let state = core.machine();
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
    fn drive_leases(&mut self, core: &mut Core<StateMachine>, ticked: bool) {
        let applied = core.applied_index();
        if core.role() != Role::Leader {
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
                    index: core.last_index(),
                };
                return;
            }
            LeaseRole::Promoting { index } if applied < index => return,
            LeaseRole::Promoting { .. } => {
                let checkpoints = self
                    .leases
                    .keeper
                    .promote(core.machine().leases(), now_ms());
                self.leases.role = LeaseRole::Leading;
                self.leases.synced_index = applied;
                // Anchor what this leader decided, so the next one resumes from it rather than
                // granting another full grace (etcd issue 9888).
                for batch in checkpoints.chunks(LEASE_CHECKPOINT_BATCH_MAX) {
                    Self::propose_lease_duty(
                        core,
                        Request::LeaseCheckpoint {
                            checkpoints: batch.to_vec(),
                        },
                    );
                }
                tracing::info!(leases = checkpoints.len(), "leases resumed as leader");
            }
            LeaseRole::Leading => {}
        }
        if applied > self.leases.synced_index {
            self.leases.keeper.sync(core.machine().leases());
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
        if let Some(index) = Self::propose_lease_duty(core, Request::LeaseExpire { ids }) {
            self.leases.expire_pending = Some((index, now));
        }
    }

    /// Proposes a leader-made lease command nobody waits for; returns its index.
    fn propose_lease_duty(core: &mut Core<StateMachine>, request: Request) -> Option<u64> {
        core.propose_untracked(Proposal {
            request,
            session: None,
        })
    }
}
