//! Conclave's coordination state machine (`conclave_state::StateMachine`) on the generic
//! driver: commands stamped with the leader's clock, the leader's duties (in the sans-IO
//! [`LeaderDuties`]) and the applied events fanned out to watchers. [`NodeHandle`] is what the
//! etcd and `conclave.v1` services talk to.

use std::sync::{Arc, RwLock};

use conclave_raft::{ConfChangeStep, NodeId};
use conclave_state::{ApplyOutput, Command, Event, Request, SessionSeq, StateMachine};
use conclave_storage::WalStorage;
use tokio::sync::{broadcast, mpsc, oneshot, watch};

use super::core::Duties;
use super::driver::{
    self, AfterRead, Applied, Core, Handle, NodeRequest, NodeStatus, PeerMatch, ShellDuties,
    Waiters, now_ms,
};
use super::leader_duties::LeaderDuties;
pub use super::leader_duties::Proposal;
use crate::config::{Member, ServerConfig};
use crate::error::Error;
use crate::machine::{FrozenImage, MachineError, ReplicatedMachine};
use crate::transport::{InboundMessage, PeerTransport};

/// Events a watcher hub may lag behind the apply path before it is told it lost some.
pub const APPLIED_EVENTS_BUFFER_MAX: usize = 65_536;
/// A keepalive this long after its lease's last "renewed" record commits a new one first. An
/// abandoned lease ends by its last keepalive + TTL + this across leader changes; etcd's
/// clients renew every TTL/3 (at least 333 ms), so a shorter interval would cost an entry on
/// nearly every keepalive.
const LEASE_CHECKPOINT_INTERVAL_MS: u64 = 500;

impl ReplicatedMachine for StateMachine {
    type Command = Proposal;
    type Output = ApplyOutput;

    fn encode(proposal: Proposal) -> Vec<u8> {
        Self::encode_at(proposal, now_ms())
    }

    fn encode_at(proposal: Proposal, now_ms: u64) -> Vec<u8> {
        // The leader's clock is the state machine's only notion of time (leases, sessions).
        Command {
            leader_time_ms: now_ms,
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

    fn snapshot_frozen(&self) -> FrozenImage {
        // The key-value store is a persistent map, so this clone is O(1) for it (the smaller
        // tables are copied); the writer thread encodes it into the snapshot file while the
        // driver applies on.
        let frozen = self.clone();
        FrozenImage::deferred_to(move |out| {
            frozen
                .snapshot(out)
                .map(|_| ())
                .map_err(std::io::Error::other)
        })
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
    /// The term this node led when it renewed; the answer waits for
    /// [`NodeHandle::confirm_leadership`] of it.
    pub term: u64,
    /// When set, answer the client only after this checkpoint has committed: otherwise a
    /// later leader could resume the lease at an earlier deadline than the one promised.
    pub checkpoint: Option<oneshot::Receiver<Result<Applied<ApplyOutput>, Error>>>,
    /// Names this renewal for [`NodeHandle::lease_orphaned`].
    pub stamp: u64,
    /// A quorum has already confirmed, in a round the driver started right after the
    /// renewal, that this node still leads `term`: answer without
    /// [`NodeHandle::confirm_leadership`]. Set when no checkpoint had to commit first.
    pub leadership_confirmed: bool,
}

/// An answer read from the leader's memory (a renewal, a remaining TTL), sent once the
/// leadership round the driver started right after reading it completes.
struct AnswerAfterRound<T> {
    answer: T,
    reply: oneshot::Sender<Result<T, Error>>,
}

impl<T: Send> AfterRead for AnswerAfterRound<T> {
    fn complete(self: Box<Self>, result: Result<(), Error>) {
        let AnswerAfterRound { answer, reply } = *self;
        let _ = reply.send(result.map(|()| answer));
    }

    fn abandoned(&self) -> bool {
        self.reply.is_closed()
    }
}

/// Starts the round that confirms this node still leads `term`, in the turn that read
/// `answer`, and answers once it is in: the caller wakes once, with something a quorum has
/// confirmed this term for since it was read.
fn answer_after_round<T: Send + 'static>(
    core: &mut Core<StateMachine>,
    waiters: &mut Waiters<ApplyOutput>,
    term: u64,
    answer: T,
    reply: oneshot::Sender<Result<T, Error>>,
) {
    match core.read_index_as_leader(term) {
        Ok(token) => waiters.after_read(token, Box::new(AnswerAfterRound { answer, reply })),
        Err(error) => {
            let _ = reply.send(Err(error));
        }
    }
}

/// Requests only the driver thread can answer, because the lease deadlines live there.
pub(crate) enum LeaseRequest {
    /// A lease keepalive, served by the leader only. `None`: the lease does not exist (or is
    /// past its deadline).
    Renew {
        id: i64,
        reply: oneshot::Sender<Result<Option<LeaseRenewal>, Error>>,
    },
    /// The leader's remaining time to live of a lease (`None` when it does not exist),
    /// answered once a ReadIndex round started right after the reading has confirmed that
    /// this node still leads: a deposed leader's figure may be one the cluster has ended.
    Remaining {
        id: i64,
        reply: oneshot::Sender<Result<Option<u64>, Error>>,
    },
    /// The keepalive stream of renewal `stamp` ended without a goodbye.
    Orphaned {
        id: i64,
        stamp: u64,
        reply: oneshot::Sender<Result<bool, Error>>,
    },
    /// How long ago the leader last renewed each lease.
    RenewalAges {
        ids: Vec<i64>,
        reply: oneshot::Sender<Result<Vec<Option<u64>>, Error>>,
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

    /// Resolves once this member has applied through `index`, or has stopped.
    pub async fn applied_through(&self, index: u64) {
        self.node.applied_waits.reached(index).await
    }

    /// What the driver and the API count as it happens (docs/operations.md).
    pub fn metrics(&self) -> &crate::metrics::NodeMetrics {
        &self.node.metrics
    }

    /// The count of clients' subscriptions to this member's applied events, which the watch
    /// hub keeps and the driver reads (a follower with any asks its leader to hold nothing
    /// back from it).
    pub fn subscriptions(&self) -> std::sync::Arc<std::sync::atomic::AtomicUsize> {
        self.node.subscriptions.clone()
    }

    /// The Raft driver thread's runtime (see `PeerListenerState::receive_on`).
    pub fn driver_runtime(&self) -> tokio::runtime::Handle {
        self.node.driver_runtime.clone()
    }

    /// A shared handle on the same metrics, for layers that outlive one call.
    pub fn metrics_arc(&self) -> std::sync::Arc<crate::metrics::NodeMetrics> {
        self.node.metrics.clone()
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

    /// [`NodeHandle::propose_in_session`] for a write that follower `origin` handed over
    /// (when known): `origin` hears of the commit at once, so it can answer its client.
    pub async fn propose_handed_over(
        &self,
        request: Request,
        session: Option<SessionSeq>,
        origin: Option<NodeId>,
    ) -> Result<Applied<ApplyOutput>, Error> {
        let proposal = Proposal { request, session };
        match origin {
            Some(origin) => self.node.propose_for(proposal, origin).await,
            None => self.node.propose(proposal).await,
        }
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

    /// Replicates the record of a new member at `peer_addr` (the membership table lives next
    /// to the state machine, since users cannot write `/_conclave/` keys) under an id never
    /// used before; answered with the id once applied here. Leader only.
    pub async fn add_member(&self, peer_addr: String) -> Result<NodeId, Error> {
        self.node.add_member(peer_addr).await
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

    /// Waits until a quorum has confirmed, in a round started after this call, that this
    /// node still leads `term`. Fails with a retriable not-leader error otherwise.
    pub async fn confirm_leadership(&self, term: u64) -> Result<(), Error> {
        self.node.confirm_leadership(term).await
    }

    /// The keepalive stream that made renewal `stamp` of lease `id` ended without a goodbye:
    /// the leader shortens the lease to `LEASE_ORPHAN_GRACE_MS` unless a keepalive came
    /// since. Answers whether it did.
    pub async fn lease_orphaned(&self, id: i64, stamp: u64) -> bool {
        self.node
            .ask(|reply| NodeRequest::Duty(LeaseRequest::Orphaned { id, stamp, reply }))
            .await
            .unwrap_or(false)
    }

    /// How long ago the leader last renewed each lease (`None`: not since it leads). Leader
    /// only.
    pub async fn lease_renewal_ages_ms(&self, ids: Vec<i64>) -> Result<Vec<Option<u64>>, Error> {
        self.node
            .ask(|reply| NodeRequest::Duty(LeaseRequest::RenewalAges { ids, reply }))
            .await
    }

    /// The leader's remaining TTL of a lease (`None` when it does not exist), once a quorum
    /// has confirmed, after the reading, that this node still leads. Leader only.
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
    driver::open_storage(config, machine).map(|(store, state, _, _)| (store, state))
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
        leader: LeaderDuties::new(&state_config),
        events: events.clone(),
        metrics: None,
        subscriptions: None,
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

/// What the coordination machine runs beside itself on the driver thread: the sans-IO
/// leader duties, and the fan-out of their applied events to watchers.
struct CoordinationDuties {
    leader: LeaderDuties,
    events: broadcast::Sender<AppliedEvents>,
    /// For `conclave_election_leader_changes_total{group}`, counted here as the events are
    /// applied: a task counting them from the broadcast woke on every applied batch, a
    /// wake-up per write on every member.
    metrics: Option<std::sync::Arc<crate::metrics::NodeMetrics>>,
    /// Clients' subscriptions to applied events (`Shell::subscriptions`). With none, a batch is
    /// not published: the watch hub's task, once started by a member's first watch, would
    /// otherwise wake for every applied batch for good, a thread wake-up per write on every
    /// member. Nothing is missed by it: a subscription registers and reads the state under
    /// the state's read lock, and the count is read after the batch was applied under the
    /// write lock, so a subscription either was counted before the batch was published or
    /// read a state that holds it. The first subscription after such a spell tells the hub
    /// the revision it read, where the hub's count of revisions starts again
    /// (`WatchHub::restart_at`).
    subscriptions: Option<std::sync::Arc<std::sync::atomic::AtomicUsize>>,
}

impl CoordinationDuties {
    fn anyone_subscribed(&self) -> bool {
        self.subscriptions
            .as_ref()
            .is_none_or(|count| count.load(std::sync::atomic::Ordering::Relaxed) > 0)
    }
}

impl Duties<StateMachine, WalStorage> for CoordinationDuties {
    fn turn(&mut self, core: &mut Core<StateMachine>, ticked: bool) {
        Duties::<StateMachine, WalStorage>::turn(&mut self.leader, core, ticked);
    }

    fn applied(&mut self, output: &ApplyOutput) {
        Duties::<StateMachine, WalStorage>::applied(&mut self.leader, output);
    }

    fn batch_applied(&mut self) {
        let Some((revision, events)) = self.leader.take_events() else {
            return;
        };
        if let Some(metrics) = &self.metrics {
            for event in &events {
                if let conclave_state::Event::Election(event) = event
                    && matches!(
                        event.kind,
                        conclave_state::ElectionEventKind::Elected { .. }
                    )
                {
                    metrics.election_leader_changed(&event.group);
                }
            }
        }
        if !self.anyone_subscribed() {
            return;
        }
        // No receiver is fine: nobody watches.
        let _ = self.events.send(AppliedEvents {
            revision,
            events: Arc::new(events),
        });
    }

    fn snapshot_installed(&mut self, machine: &StateMachine) {
        // A batch with no events at the snapshot's revision: each watch sees that the state
        // moved past what it covered and reads the skipped revisions from the history. Without
        // it a watch only noticed at the next write with an event, so a cluster that went
        // quiet (or wrote only leases, sessions or topics) left it waiting for good.
        let _ = self.events.send(AppliedEvents {
            revision: machine.revision(),
            events: Arc::new(Vec::new()),
        });
    }
}

impl ShellDuties<StateMachine> for CoordinationDuties {
    type Request = LeaseRequest;

    fn attach_metrics(&mut self, metrics: &std::sync::Arc<crate::metrics::NodeMetrics>) {
        self.metrics = Some(metrics.clone());
    }

    fn attach_subscriptions(
        &mut self,
        subscriptions: &std::sync::Arc<std::sync::atomic::AtomicUsize>,
    ) {
        self.subscriptions = Some(subscriptions.clone());
    }

    fn request(
        &mut self,
        core: &mut Core<StateMachine>,
        waiters: &mut Waiters<ApplyOutput>,
        request: LeaseRequest,
    ) {
        match request {
            LeaseRequest::Renew { id, reply } => {
                let term = core.raw().term();
                let renewal = match self.leader.lease_renew(core, id) {
                    Ok(Some(renewal)) => renewal,
                    other => {
                        let _ = reply.send(other.map(|_| None));
                        return;
                    }
                };
                let Some(checkpoint) = renewal.checkpoint else {
                    // Nothing must commit first: confirm the term right after the renewal.
                    let renewal = LeaseRenewal {
                        ttl_ms: renewal.ttl_ms,
                        term,
                        stamp: renewal.stamp,
                        checkpoint: None,
                        leadership_confirmed: true,
                    };
                    answer_after_round(core, waiters, term, Some(renewal), reply);
                    return;
                };
                let (committed_reply, committed) = oneshot::channel();
                waiters.command(checkpoint, committed_reply);
                let _ = reply.send(Ok(Some(LeaseRenewal {
                    ttl_ms: renewal.ttl_ms,
                    term,
                    stamp: renewal.stamp,
                    checkpoint: Some(committed),
                    leadership_confirmed: false,
                })));
            }
            LeaseRequest::Remaining { id, reply } => {
                let term = core.raw().term();
                let remaining_ms = match self.leader.lease_remaining_ms(core, id) {
                    Ok(remaining_ms) => remaining_ms,
                    Err(error) => {
                        let _ = reply.send(Err(error));
                        return;
                    }
                };
                answer_after_round(core, waiters, term, remaining_ms, reply);
            }
            LeaseRequest::Orphaned { id, stamp, reply } => {
                let _ = reply.send(Ok(self.leader.lease_orphan(core, id, stamp)));
            }
            LeaseRequest::RenewalAges { ids, reply } => {
                let _ = reply.send(self.leader.lease_renewal_ages_ms(core, &ids));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use conclave_state::{EventKind, KeyValue, WatchEvent};

    use super::*;

    fn put_applied(revision: i64) -> ApplyOutput {
        ApplyOutput {
            revision,
            result: Ok(conclave_state::Response::Compacted),
            events: vec![Event::Kv(WatchEvent {
                kind: EventKind::Put,
                kv: KeyValue {
                    key: b"k".to_vec().into(),
                    mod_revision: revision,
                    ..KeyValue::default()
                },
                prev_kv: None,
            })],
            duplicate: false,
        }
    }

    #[test]
    fn applied_batches_are_published_only_while_someone_subscribes() {
        let (events, mut published) = broadcast::channel(16);
        let subscriptions = Arc::new(AtomicUsize::new(0));
        let mut duties = CoordinationDuties {
            leader: LeaderDuties::new(&conclave_state::Config::default()),
            events,
            metrics: None,
            subscriptions: None,
        };
        duties.attach_subscriptions(&subscriptions);
        let apply = |duties: &mut CoordinationDuties, revision| {
            Duties::<StateMachine, WalStorage>::applied(duties, &put_applied(revision));
            Duties::<StateMachine, WalStorage>::batch_applied(duties);
        };

        // A watch came and went: the hub's receiver is still there, and must not wake.
        apply(&mut duties, 2);
        assert!(
            published.try_recv().is_err(),
            "a batch was published with nobody subscribed"
        );

        subscriptions.fetch_add(1, Ordering::Relaxed);
        apply(&mut duties, 3);
        let batch = published.try_recv().expect("the batch, with a subscriber");
        assert_eq!(batch.revision, 3);
        assert_eq!(batch.events.len(), 1, "only this batch's events");

        subscriptions.fetch_sub(1, Ordering::Relaxed);
        apply(&mut duties, 4);
        assert!(
            published.try_recv().is_err(),
            "published after the last one left"
        );
    }
}
