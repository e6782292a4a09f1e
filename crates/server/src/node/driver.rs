//! The node's I/O shell, generic over the replicated machine: one thread that runs the
//! sans-IO [`NodeCore`](super::core::NodeCore) and does what it asks. It reads the clock,
//! ticks, drains the request and peer queues (group commit: one Ready, one fsync for a whole
//! batch), sends through the peer transport, writes snapshot files on a helper thread, maps
//! the core's waiter tokens to reply channels and publishes the node's status. Everything
//! that decides lives in the core. What is particular to one machine (the coordination
//! machine's lease duties and watch fan-out, an embedding program's role callbacks) plugs in
//! through [`ShellDuties`].

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use conclave_raft::{
    ConfChangeStep, ConfState, Config as RaftConfig, Message, MessageBody, NodeId, RawNode, Storage,
};
use conclave_storage::{OsDisk, RecoveryReport, StorageOptions, SyncedPieceWriter, WalStorage};
use tokio::sync::{mpsc, oneshot, watch};

use super::applied_waits::{AppliedWaits, StopWaitsOnDrop};
pub use super::core::{Applied, NodeStatus, PeerMatch};
use super::core::{
    CoreSettings, Duties, MemberTable, NodeCore, Output, ReadyIo, ReadyPoint, SnapshotPlan, Token,
    TurnEnd, restore_machine,
};
use crate::config::{Member, ServerConfig};
use crate::error::Error;
use crate::machine::ReplicatedMachine;
use crate::metrics::NodeMetrics;
use crate::transport::{InboundMessage, PeerTransport};

/// Requests and messages the driver takes from its queues before it handles a Ready, so one
/// fsync covers a whole batch (group commit) without starving the ticker.
const DRAIN_BATCH_MAX: usize = 1024;

/// The snapshot thread streams the image into its file this many bytes at a time and syncs
/// each piece, so the log's fsyncs on the same disk queue behind at most one piece, not the
/// whole image, and no image-sized buffer is held.
const SNAPSHOT_SYNC_CHUNK_BYTES: usize = 1 << 20;

/// The nice value of the snapshot thread (the lowest CPU priority). Encoding a large state
/// takes a core for most of a second on this kind of machine; at this priority the driver,
/// the gRPC tasks and the peer links run first. Only the log between snapshots grows a little
/// longer meanwhile. (The synced pieces above removed most of the snapshot stalls; this trims
/// what was left, see docs/performance.md.)
const SNAPSHOT_THREAD_NICE: i32 = 19;

/// Lowers the calling thread's CPU priority to `nice`. Linux keeps a nice value per thread,
/// so this leaves the rest of the process alone. Failing is harmless: the snapshot is still
/// made, at normal priority.
fn lower_this_thread_priority(nice: i32) {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: gettid and setpriority take plain integers and touch no memory of ours.
        let result = unsafe {
            let thread_id = libc::gettid();
            libc::setpriority(libc::PRIO_PROCESS, thread_id as libc::id_t, nice)
        };
        if result != 0 {
            tracing::debug!(
                error = %std::io::Error::last_os_error(),
                "the snapshot thread keeps its normal CPU priority"
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = nice;
}

/// The core the server runs: over the write-ahead log on the operating system's disk.
pub(crate) type Core<M> = NodeCore<M, WalStorage>;

/// Where a proposal's answer goes.
pub(crate) type ProposeReply<O> = oneshot::Sender<Result<Applied<O>, Error>>;
/// Who waits for a linearizable read to become safe.
pub(crate) type ReadWaiter = oneshot::Sender<Result<(), Error>>;

/// An answer the driver sends once a read round it started completes, carrying more than the
/// round's outcome (a keepalive's renewal, say), so its caller wakes once for both.
pub(crate) trait AfterRead: Send {
    /// The round completed (`Ok`) or failed; answer the caller.
    fn complete(self: Box<Self>, result: Result<(), Error>);
    /// The caller stopped waiting (deadline passed, connection closed).
    fn abandoned(&self) -> bool;
}

/// Who is told when a read round completes.
enum PendingRead {
    Waiter(ReadWaiter),
    After(Box<dyn AfterRead>),
}

impl PendingRead {
    fn complete(self, result: Result<(), Error>) {
        match self {
            PendingRead::Waiter(reply) => {
                let _ = reply.send(result);
            }
            PendingRead::After(after) => after.complete(result),
        }
    }

    fn abandoned(&self) -> bool {
        match self {
            PendingRead::Waiter(reply) => reply.is_closed(),
            PendingRead::After(after) => after.abandoned(),
        }
    }
}

/// What a handle asks of the driver. `R` is the machine's own requests ([`ShellDuties::Request`]).
pub(crate) enum NodeRequest<M: ReplicatedMachine, R> {
    /// Replicate `command`; the reply comes once it is applied (or lost).
    Propose {
        command: M::Command,
        /// The member whose client waits for this write, when a follower handed it over.
        origin: Option<NodeId>,
        reply: ProposeReply<M::Output>,
    },
    /// Answer once the machine has applied up to a quorum-confirmed commit index.
    ReadIndex { reply: ReadWaiter },
    /// Answer once this node, as leader of `term`, has had its leadership confirmed by a
    /// quorum in a round started after this request (and applied up to that commit index).
    ConfirmLeadership { term: u64, reply: ReadWaiter },
    /// Hand leadership to `target` (Maintenance.MoveLeader, shutdown).
    TransferLeader {
        target: NodeId,
        reply: oneshot::Sender<Result<(), Error>>,
    },
    /// Replicate the record of a new member at `peer_addr` (the membership table lives next to
    /// the machine) under an id the core picks, never used before; answered with the id once
    /// applied here. Leader only.
    AddMember {
        peer_addr: String,
        reply: oneshot::Sender<Result<NodeId, Error>>,
    },
    /// Replicate a change to an existing member record (ignored if its member is gone);
    /// answered once applied here. Leader only.
    UpdateMember {
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
    /// A request for the machine's duties, handled on the driver thread.
    Duty(R),
}

/// The core's [`Duties`] plus what only the shell can do: take requests with reply channels.
pub(crate) trait ShellDuties<M: ReplicatedMachine>:
    Duties<M, WalStorage> + Send + 'static
{
    /// Requests a handle queues for these duties ([`NodeRequest::Duty`]).
    type Request: Send + 'static;

    /// Handles one [`NodeRequest::Duty`]; `waiters` takes reply channels for core tokens.
    fn request(
        &mut self,
        core: &mut Core<M>,
        waiters: &mut Waiters<M::Output>,
        request: Self::Request,
    );

    /// Hands over the node's metrics, once, before the driver runs: duties that count what
    /// they apply do it on the driver's thread instead of waking a task per applied batch.
    fn attach_metrics(&mut self, _metrics: &Arc<NodeMetrics>) {}

    /// Hands over the count of clients' subscriptions to applied events, once, before the
    /// driver runs: duties that publish applied events skip it while nobody is subscribed.
    fn attach_subscriptions(&mut self, _subscriptions: &Arc<AtomicUsize>) {}
}

/// Who waits for a settled proposal: a machine command wants its output; a new member's
/// record the id it was given; a member record update or a membership change only that it
/// was applied.
enum Reply<O> {
    Command(ProposeReply<O>),
    NewMember(NodeId, oneshot::Sender<Result<NodeId, Error>>),
    Done(oneshot::Sender<Result<(), Error>>),
}

/// The reply channels behind the core's tokens.
pub(crate) struct Waiters<O> {
    proposals: HashMap<Token, Reply<O>>,
    reads: HashMap<Token, PendingRead>,
}

impl<O> Waiters<O> {
    fn new() -> Self {
        Waiters {
            proposals: HashMap::new(),
            reads: HashMap::new(),
        }
    }

    /// `reply` hears the output of the proposal `token` names.
    pub(crate) fn command(&mut self, token: Token, reply: ProposeReply<O>) {
        self.proposals.insert(token, Reply::Command(reply));
    }

    /// `after` answers its caller once the read round `token` names completes.
    pub(crate) fn after_read(&mut self, token: Token, after: Box<dyn AfterRead>) {
        self.reads.insert(token, PendingRead::After(after));
    }

    fn read(&mut self, token: Token, reply: ReadWaiter) {
        self.reads.insert(token, PendingRead::Waiter(reply));
    }

    fn done(&mut self, token: Token, reply: oneshot::Sender<Result<(), Error>>) {
        self.proposals.insert(token, Reply::Done(reply));
    }

    fn new_member(
        &mut self,
        token: Token,
        id: NodeId,
        reply: oneshot::Sender<Result<NodeId, Error>>,
    ) {
        self.proposals.insert(token, Reply::NewMember(id, reply));
    }

    fn deliver(&mut self, output: Output<O>, metrics: &NodeMetrics) {
        match output {
            Output::Settled { token, result } => match self.proposals.remove(&token) {
                Some(Reply::Command(reply)) if !matches!(result, Ok(Some(_))) => {
                    metrics.proposals_failed.inc();
                    let result = result.and_then(|applied| applied.ok_or(Error::LeaderChanged));
                    let _ = reply.send(result);
                }
                Some(Reply::Command(reply)) => {
                    let result = result.and_then(|applied| applied.ok_or(Error::LeaderChanged));
                    let _ = reply.send(result);
                }
                Some(Reply::NewMember(id, reply)) => {
                    let _ = reply.send(result.map(|_| id));
                }
                Some(Reply::Done(reply)) => {
                    let _ = reply.send(result.map(|_| ()));
                }
                None => {}
            },
            Output::ReadReady { token, result } => {
                if let Some(pending) = self.reads.remove(&token) {
                    pending.complete(result);
                }
            }
        }
    }

    /// Reads whose caller gave up (deadline passed, connection closed).
    fn abandoned_reads(&mut self) -> BTreeSet<Token> {
        let gone: BTreeSet<Token> = self
            .reads
            .iter()
            .filter(|(_, r)| r.abandoned())
            .map(|(&t, _)| t)
            .collect();
        self.reads.retain(|t, _| !gone.contains(t));
        gone
    }
}

/// The handle API layers hold: queue into the driver, watch its status, read the machine.
pub(crate) struct Handle<M: ReplicatedMachine, R> {
    pub requests: mpsc::Sender<NodeRequest<M, R>>,
    /// What the driver counts as it happens (leader changes, fsyncs, failed proposals).
    pub metrics: Arc<NodeMetrics>,
    pub status: watch::Receiver<NodeStatus>,
    /// Waits for the applied index to reach a point (the status watch does not wake on it).
    pub applied_waits: Arc<AppliedWaits>,
    /// The applied state. The driver holds the write lock only while applying a batch.
    pub machine: Arc<RwLock<M>>,
    /// The driver thread's runtime: tasks spawned on it run on the driver's thread, between
    /// its turns (the peer listener reads connections there).
    pub driver_runtime: tokio::runtime::Handle,
    /// Clients' subscriptions to this member's applied events, counted by the API (see
    /// `Shell::subscriptions`).
    pub subscriptions: Arc<AtomicUsize>,
}

impl<M: ReplicatedMachine, R> Clone for Handle<M, R> {
    fn clone(&self) -> Self {
        Handle {
            requests: self.requests.clone(),
            metrics: self.metrics.clone(),
            status: self.status.clone(),
            applied_waits: self.applied_waits.clone(),
            machine: self.machine.clone(),
            driver_runtime: self.driver_runtime.clone(),
            subscriptions: self.subscriptions.clone(),
        }
    }
}

impl<M: ReplicatedMachine, R> Handle<M, R> {
    pub fn status(&self) -> NodeStatus {
        self.status.borrow().clone()
    }

    /// Runs `read` against the applied state. A poisoned lock (a panic while applying) is
    /// still read: the panic already stopped the driver, and status reads should still work.
    pub fn read_state<T>(&self, read: impl FnOnce(&M) -> T) -> T {
        let guard = self
            .machine
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        read(&guard)
    }

    pub async fn ask<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, Error>>) -> NodeRequest<M, R>,
    ) -> Result<T, Error> {
        let (reply, answer) = oneshot::channel();
        self.requests
            .send(make(reply))
            .await
            .map_err(|_| Error::Stopped)?;
        // A dropped sender means the driver stopped (or dropped the waiter on shutdown).
        answer.await.map_err(|_| Error::Stopped)?
    }

    pub async fn propose(&self, command: M::Command) -> Result<Applied<M::Output>, Error> {
        self.ask(|reply| NodeRequest::Propose {
            command,
            origin: None,
            reply,
        })
        .await
    }

    /// [`Handle::propose`] for a write follower `origin` handed over: `origin` hears of the
    /// commit at once ([`NodeCore::propose_for`]).
    pub async fn propose_for(
        &self,
        command: M::Command,
        origin: NodeId,
    ) -> Result<Applied<M::Output>, Error> {
        self.ask(|reply| NodeRequest::Propose {
            command,
            origin: Some(origin),
            reply,
        })
        .await
    }

    pub async fn read_index(&self) -> Result<(), Error> {
        self.ask(|reply| NodeRequest::ReadIndex { reply }).await
    }

    /// See [`NodeCore::read_index_as_leader`].
    pub async fn confirm_leadership(&self, term: u64) -> Result<(), Error> {
        self.ask(|reply| NodeRequest::ConfirmLeadership { term, reply })
            .await
    }

    pub async fn transfer_leader(&self, target: NodeId) -> Result<(), Error> {
        self.ask(|reply| NodeRequest::TransferLeader { target, reply })
            .await
    }

    /// Records a new member at `peer_addr` under an id never used before; its id once the
    /// record is applied here.
    pub async fn add_member(&self, peer_addr: String) -> Result<NodeId, Error> {
        self.ask(|reply| NodeRequest::AddMember { peer_addr, reply })
            .await
    }

    /// Proposes a change to an existing member record; once applied, the record holds it
    /// unless the member was removed first.
    pub async fn update_member(&self, member: Member) -> Result<(), Error> {
        self.ask(|reply| NodeRequest::UpdateMember { member, reply })
            .await
    }

    pub async fn change_membership(&self, steps: Vec<ConfChangeStep>) -> Result<(), Error> {
        self.ask(|reply| NodeRequest::ChangeMembership { steps, reply })
            .await
    }

    pub async fn hand_off(&self) -> Result<bool, Error> {
        self.ask(|reply| NodeRequest::HandOff { reply }).await
    }

    pub async fn peer_match(&self, peer: NodeId) -> Result<Option<PeerMatch>, Error> {
        self.ask(|reply| NodeRequest::PeerMatch { peer, reply })
            .await
    }
}

/// Opens the data directory (bootstrapping a fresh one with the founding members) and
/// restores `machine` from the newest snapshot. The log after it is replayed by the core.
/// Returns the member table too: the snapshot's records (or the founding members) and the
/// highest member id used up to it; and the snapshot's size in bytes.
pub(crate) fn open_storage<M: ReplicatedMachine>(
    config: &ServerConfig,
    mut machine: M,
) -> Result<(WalStorage, M, MemberTable, u64), Error> {
    let mut store = WalStorage::open(
        Arc::new(OsDisk),
        &config.data_dir,
        // A leader that has to send a large image to a follower must not stop heartbeating
        // while it is read from its file.
        StorageOptions {
            snapshot_read_in_background: true,
            ..StorageOptions::default()
        },
    )
    .map_err(|error| match error {
        error if error.is_repairable_log_corruption() => Error::CorruptLog {
            corruption: error.to_string(),
            data_dir: config.data_dir.display().to_string(),
        },
        error => Error::Storage(error),
    })?;
    log_recovery(store.recovery_report());
    // After the open, so the directory's lock is held: two nodes cannot race here.
    super::identity::check_or_record(&config.data_dir, config.cluster_id(), config.id)?;
    // A joining node waits for the leader's snapshot, which carries the membership.
    if store.is_fresh() && !config.join {
        let voters = config.members.iter().map(|m| m.id);
        store.bootstrap(ConfState::with_voters(voters))?;
    }
    let snapshot = store
        .load_snapshot()
        .map_err(|e| Error::StateRestore(e.to_string()))?;
    let members = restore_machine(&mut machine, &snapshot)?.into_table(config.members.clone());
    let snapshot_bytes = snapshot.data.len() as u64;
    Ok((store, machine, members, snapshot_bytes))
}

/// Says what opening the data directory changed or passed over: an operator must hear of every
/// record dropped and every file that failed verification.
fn log_recovery(report: &RecoveryReport) {
    if let Some(tail) = &report.wal.dropped_tail {
        tracing::warn!(
            file = %tail.file.display(),
            offset = tail.offset_bytes,
            records = tail.records,
            bytes = tail.bytes,
            reason = %tail.reason,
            "recovery dropped a damaged end of the write-ahead log (a torn final write, or a last \
             record that fails its checksum); the node catches up from its peers"
        );
    }
    for (file, reason) in &report.invalid_snapshots {
        tracing::warn!(file = %file.display(), %reason, "snapshot file failed verification and was passed over");
    }
    if let Some(index) = report.adopted_snapshot {
        tracing::info!(index, "adopted a snapshot file written just before a crash");
    }
    if !report.tightened_permissions.is_empty() {
        let paths: Vec<String> = report
            .tightened_permissions
            .iter()
            .map(|path| path.display().to_string())
            .collect();
        tracing::warn!(
            paths = %paths.join(","),
            "data directory entries were open to group or others; restricted them to the owner"
        );
    }
}

/// A snapshot a helper thread encodes and writes: the driver only freezes the machine's
/// state (a clone of persistent maps) and goes on applying.
struct SnapshotJob {
    index: u64,
    started: Instant,
    /// Time the driver spent freezing the state.
    freeze_ms: f64,
    written: std::sync::mpsc::Receiver<SnapshotWritten>,
}

/// What the snapshot writer thread hands back.
struct SnapshotWritten {
    file: Result<conclave_storage::SnapshotFile, Error>,
    /// Encoding and writing together: the image is written as it is encoded.
    write_ms: f64,
}

/// The shell's I/O: the peer transport, the status channel, the reply channels and the
/// snapshot writer. Owned by one thread; see the module documentation.
struct Shell<O> {
    config: ServerConfig,
    transport: PeerTransport,
    /// See [`TransportIo::deferred`]; empty between turns.
    deferred: Vec<Message>,
    /// See [`TransportIo::unrouted`]; empty between turns.
    unrouted: Vec<Message>,
    status: watch::Sender<NodeStatus>,
    /// Ends every applied-index wait when the driver goes, however it goes.
    applied_waits: StopWaitsOnDrop,
    waiters: Waiters<O>,
    /// A snapshot being written on its own thread, recorded in the log once written.
    snapshot_job: Option<SnapshotJob>,
    /// The caller's runtime, which has the IO driver the peer links need (the driver's own
    /// runtime has timers only).
    peer_runtime: tokio::runtime::Handle,
    metrics: Arc<NodeMetrics>,
    /// The leader last published, to count and log leader changes.
    last_leader: Option<NodeId>,
    /// When the last late-heartbeat WARN went out (they are rate-limited).
    late_warned: Option<Instant>,
    /// The core's count of reads answered from the lease, as far as the metrics have it.
    lease_reads_counted: u64,
    /// When the last clock-divergence warning was logged.
    clock_warned: Option<Instant>,
    /// Clients' subscriptions to this member's applied events (the API's watch hub counts
    /// them): while there are any, the member tells its leader to hold nothing back from it.
    subscriptions: Arc<AtomicUsize>,
}

/// At most one WARN about late heartbeats this often; the counter counts every one.
const LATE_HEARTBEAT_WARN_INTERVAL_MS: u64 = 10_000;

/// Sends what the core hands over through the peer transport, and times the Ready's fsync
/// and apply steps for the metrics.
struct TransportIo<'a> {
    transport: &'a mut PeerTransport,
    /// A leader's appends without entries (they carry only the commit index), sent once the
    /// turn's answers are out: they are on no client's path, and on the direct lane each
    /// costs the driver a system call before it applies and answers.
    deferred: &'a mut Vec<Message>,
    /// Messages to nodes the transport has no link to, sent after the turn by
    /// `Driver::route_unrecorded` (a leader this member holds no record of yet).
    unrouted: &'a mut Vec<Message>,
    metrics: &'a NodeMetrics,
    fsync_warn_ms: u64,
    step_started: Option<Instant>,
}

impl ReadyIo for TransportIo<'_> {
    fn send(&mut self, message: Message) {
        if matches!(&message.body, MessageBody::Append { entries, .. } if entries.is_empty()) {
            self.deferred.push(message);
            return;
        }
        if !self.transport.has_peer(message.to) {
            self.unrouted.push(message);
            return;
        }
        if let Err(error) = self.transport.send(message) {
            tracing::debug!(%error, "peer message not sent");
        }
    }

    fn reached(&mut self, point: ReadyPoint, ready: &conclave_raft::Ready) -> bool {
        match point {
            ReadyPoint::BeforeSync | ReadyPoint::Sent => self.step_started = Some(Instant::now()),
            ReadyPoint::Persisted if ready.must_sync => {
                if let Some(started) = self.step_started.take() {
                    let took = started.elapsed();
                    self.metrics.wal_fsync_seconds.observe(took.as_secs_f64());
                    let took_ms = took.as_millis() as u64;
                    if took_ms >= self.fsync_warn_ms {
                        self.metrics.wal_fsyncs_slow.inc();
                        tracing::warn!(
                            took_ms,
                            expected_ms = self.fsync_warn_ms,
                            entries = ready.entries.len(),
                            "slow WAL fsync: the disk is slow; leaders may miss heartbeats"
                        );
                    }
                }
            }
            ReadyPoint::Applied if !ready.committed_entries.is_empty() => {
                if let Some(started) = self.step_started.take() {
                    self.metrics
                        .backend_commit_seconds
                        .observe(started.elapsed().as_secs_f64());
                }
            }
            _ => {}
        }
        true
    }
}

/// The Raft driver: the core, its duties and the shell around them.
struct Driver<M: ReplicatedMachine, D> {
    core: Core<M>,
    duties: D,
    shell: Shell<M::Output>,
}

/// The driver's thread; joining it gives the driver's exit.
pub(crate) type DriverThread = std::thread::JoinHandle<Result<(), Error>>;

/// The Raft core's settings from the server's configuration.
fn raft_config(config: &ServerConfig) -> Result<RaftConfig, Error> {
    let mut raft_config = RaftConfig::new(config.id);
    raft_config.election_ticks = config.election_ticks;
    raft_config.heartbeat_ticks = config.heartbeat_ticks;
    raft_config.max_uncommitted_bytes = (config.request_bytes_max as u64) * 64;
    raft_config.max_snapshot_bytes = config.snapshot_bytes_max;
    raft_config.lease_read_ms = config.lease_read_ms();
    // A follower whose clients wait for what it applies (watches, lock waits, streams) says
    // so in its responses and is never held back (`Shell::subscriptions`); the others get
    // committed entries in batches and commit indexes late, which saves the disk and the
    // leader work on every write (docs/performance.md, "A quorum first").
    raft_config.defer_commit_notice = true;
    raft_config.replicate_to_quorum_first = true;
    raft_config.seed = election_seed(config.id);
    raft_config
        .validate()
        .map_err(|reason| Error::InvalidConfig { reason })?;
    Ok(raft_config)
}

/// Starts the driver thread over `machine` (the state before the first entry; restored from
/// the newest snapshot if there is one). Returns the handle and a join handle whose result is
/// the driver's exit: `Ok` after a clean shutdown, the fatal error otherwise.
pub(crate) fn spawn<M: ReplicatedMachine, D: ShellDuties<M>>(
    config: ServerConfig,
    machine: M,
    duties: D,
    transport: PeerTransport,
    inbound: mpsc::Receiver<InboundMessage>,
    shutdown: oneshot::Receiver<()>,
) -> Result<(Handle<M, D::Request>, DriverThread), Error> {
    config.validate()?;
    let (store, machine, members, snapshot_bytes) = open_storage(&config, machine)?;
    let raft_config = raft_config(&config)?;
    let snapshot_index = store
        .first_index()
        .map_err(|e| Error::RaftStart(e.to_string()))?
        - 1;
    let raw = RawNode::new(raft_config, store).map_err(Error::RaftStart)?;
    let machine = Arc::new(RwLock::new(machine));
    let (status_sender, status_receiver) = watch::channel(NodeStatus::default());
    let applied_waits = Arc::new(AppliedWaits::default());
    let (request_sender, requests) = mpsc::channel(config.driver_queue_requests_max);
    let core = NodeCore::new(
        CoreSettings::from_config(&config),
        raw,
        machine.clone(),
        members,
        snapshot_index,
        now_ms(),
    )
    .with_snapshot_image_bytes(snapshot_bytes);
    let metrics = Arc::new(NodeMetrics::default());
    let subscriptions = Arc::new(AtomicUsize::new(0));
    let mut duties = duties;
    duties.attach_metrics(&metrics);
    duties.attach_subscriptions(&subscriptions);
    let shell = Shell {
        deferred: Vec::new(),
        unrouted: Vec::new(),
        metrics: metrics.clone(),
        last_leader: None,
        late_warned: None,
        lease_reads_counted: 0,
        clock_warned: None,
        subscriptions: subscriptions.clone(),
        config,
        transport,
        status: status_sender,
        applied_waits: StopWaitsOnDrop(applied_waits.clone()),
        waiters: Waiters::new(),
        snapshot_job: None,
        peer_runtime: tokio::runtime::Handle::try_current()
            .map_err(|e| Error::RaftStart(format!("no tokio runtime for the peer links: {e}")))?,
    };
    let mut driver = Driver {
        core,
        duties,
        shell,
    };
    driver.sync_peers();
    driver.publish_status();
    // Built here so that its handle can be given out before the thread runs: the peer
    // listener reads plain-TCP connections on it (`PeerListenerState::receive_on`).
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::RaftStart(format!("driver runtime: {e}")))?;
    let driver_runtime = runtime.handle().clone();
    let thread = std::thread::Builder::new()
        .name("conclave-raft".into())
        .spawn(move || {
            let result = runtime.block_on(driver.run(requests, inbound, shutdown));
            let reason = match &result {
                Ok(()) => String::new(),
                Err(e) => e.to_string(),
            };
            driver
                .shell
                .status
                .send_modify(|s| s.stopped = Some(reason));
            result
        })
        .map_err(|e| Error::RaftStart(format!("driver thread: {e}")))?;
    let handle = Handle {
        requests: request_sender,
        metrics,
        status: status_receiver,
        applied_waits,
        machine,
        driver_runtime,
        subscriptions,
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

/// The member's clock: milliseconds since the Unix epoch, read as the wall clock at the first
/// reading plus the monotonic time elapsed since. A step of the system clock while the member
/// runs (NTP, a VM restored or migrated, an operator's `date -s`) does not move it: a forward
/// step of a leader's wall clock would otherwise end every lease early by the step. The member
/// picks a corrected wall clock up when it restarts; [`Driver::check_clock_divergence`] warns
/// when the two have drifted apart.
///
/// The fault suite (docs/faults.md) skews a member's clock with the environment variable
/// `CONCLAVE_FAULTS_CLOCK_RATE` (a rate in (0, 10], e.g. `1.01` runs 1% fast from the first
/// reading on); unset or invalid, the elapsed time counts at the real rate.
pub(crate) fn now_ms() -> u64 {
    let anchor = clock_anchor();
    anchor.read_ms(anchor.monotonic.elapsed())
}

/// The anchor of [`now_ms`], taken at its first use in this process.
fn clock_anchor() -> &'static ClockAnchor {
    static ANCHOR: std::sync::OnceLock<ClockAnchor> = std::sync::OnceLock::new();
    ANCHOR.get_or_init(|| {
        let rate = std::env::var("CONCLAVE_FAULTS_CLOCK_RATE")
            .ok()
            .and_then(|rate| rate.parse::<f64>().ok())
            .filter(|rate| *rate > 0.0 && *rate <= 10.0);
        ClockAnchor {
            monotonic: Instant::now(),
            wall_since_epoch: wall_since_epoch(),
            rate,
        }
    })
}

/// The system's wall clock since the Unix epoch (zero if it is before it).
fn wall_since_epoch() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
}

/// Where the member's clock started: a wall-clock reading and the monotonic instant it was taken.
#[derive(Clone, Copy, Debug)]
struct ClockAnchor {
    monotonic: Instant,
    wall_since_epoch: Duration,
    /// The fault suite's clock rate, if set.
    rate: Option<f64>,
}

impl ClockAnchor {
    /// The member's clock `elapsed` (monotonic) after the anchor, in whole milliseconds. The sum
    /// is taken before truncating, so a reading of `t` means an instant in `[t, t + 1)` of the
    /// member's timeline, as `LEASE_CLOCK_RESOLUTION_MS` assumes.
    fn read_ms(&self, elapsed: Duration) -> u64 {
        let elapsed = match self.rate {
            None => elapsed,
            Some(rate) => elapsed.mul_f64(rate),
        };
        let millis = self.wall_since_epoch.saturating_add(elapsed).as_millis();
        u64::try_from(millis).unwrap_or(u64::MAX)
    }
}

/// How far the member's clock may drift from the system's wall clock before a warning: leader
/// clocks must agree to within the election timeout (docs/state.md), and a step this large on
/// one machine usually means its wall clock was set after the member started.
const CLOCK_DIVERGENCE_WARN_MS: u64 = 1_000;

/// At most one clock-divergence warning per this interval.
const CLOCK_DIVERGENCE_WARN_INTERVAL_MS: u64 = 60_000;

impl<M: ReplicatedMachine, D: ShellDuties<M>> Driver<M, D> {
    async fn run(
        &mut self,
        mut requests: mpsc::Receiver<NodeRequest<M, D::Request>>,
        mut inbound: mpsc::Receiver<InboundMessage>,
        mut shutdown: oneshot::Receiver<()>,
    ) -> Result<(), Error> {
        let mut ticker = tokio::time::interval(Duration::from_millis(self.shell.config.tick_ms));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        self.core.set_time(now_ms());
        self.core.start(&mut self.duties);
        let mut stopping_since: Option<Instant> = None;
        let mut last_tick = Instant::now();
        loop {
            tokio::select! {
                _ = &mut shutdown, if stopping_since.is_none() => {
                    stopping_since = Some(Instant::now());
                    if !self.core.begin_handoff() {
                        break;
                    }
                }
                _ = ticker.tick() => {
                    self.check_heartbeat_lateness(&mut last_tick);
                    self.check_clock_divergence();
                    self.core.set_time(now_ms());
                    self.core.tick();
                    let abandoned = self.shell.waiters.abandoned_reads();
                    self.core.forget_reads(&abandoned);
                }
                message = inbound.recv() => {
                    if let Some((_, message)) = message {
                        // A follower's read is answered from the lease only if it holds
                        // after the read arrived: the clock must not be older than the message.
                        self.core.set_time(now_ms());
                        self.core.step(message);
                    }
                }
                request = requests.recv() => match request {
                    Some(request) => {
                        self.core.set_time(now_ms());
                        self.handle_request(request);
                    }
                    // Every handle is gone: nobody can be served any more.
                    None => break,
                },
            }
            for _ in 0..DRAIN_BATCH_MAX {
                match inbound.try_recv() {
                    Ok((_, message)) => {
                        // Read after the message was taken, for the lease reads above.
                        self.core.set_time(now_ms());
                        self.core.step(message);
                    }
                    Err(_) => break,
                }
            }
            for _ in 0..DRAIN_BATCH_MAX {
                match requests.try_recv() {
                    Ok(request) => {
                        // After a pause (SIGSTOP, a long stall) the select may have woken on a
                        // peer message, which does not refresh the clock: a keepalive renewed
                        // at the pre-pause time would look covered by an old lease record.
                        self.core.set_time(now_ms());
                        self.handle_request(request);
                    }
                    Err(_) => break,
                }
            }
            self.core.set_time(now_ms());
            self.core
                .set_awaited(self.shell.subscriptions.load(Ordering::Relaxed) > 0);
            let mut io = TransportIo {
                transport: &mut self.shell.transport,
                deferred: &mut self.shell.deferred,
                unrouted: &mut self.shell.unrouted,
                metrics: &self.shell.metrics,
                fsync_warn_ms: self.shell.config.wal_fsync_warn_ms,
                step_started: None,
            };
            let end = self.core.turn(&mut self.duties, &mut io)?;
            debug_assert_eq!(end, TurnEnd::Done, "the transport never stops the core");
            self.deliver_outputs();
            for message in self.shell.deferred.drain(..) {
                if self.shell.transport.has_peer(message.to) {
                    if let Err(error) = self.shell.transport.send(message) {
                        tracing::debug!(%error, "peer message not sent");
                    }
                } else {
                    self.shell.unrouted.push(message);
                }
            }
            self.route_unrecorded();
            self.maybe_snapshot()?;
            self.publish_status();
            if let Some(since) = stopping_since {
                let waited = since.elapsed()
                    >= Duration::from_millis(self.shell.config.shutdown_transfer_timeout_ms);
                if self.core.role() != conclave_raft::Role::Leader || waited {
                    break;
                }
            }
        }
        self.core.fail_all_waiters(|| Error::Stopped);
        self.deliver_outputs();
        // A snapshot being written is recorded before the node lets go of its directory.
        self.finish_snapshot_job(true)?;
        let store = self.core.store_mut();
        if store.needs_sync() {
            store.sync()?;
        }
        Ok(())
    }

    /// Answers the core's settled proposals and reads, and re-dials peers if the member
    /// records changed.
    fn deliver_outputs(&mut self) {
        if self.core.take_members_changed() {
            self.sync_peers();
        }
        for output in self.core.take_outputs() {
            self.shell.waiters.deliver(output, &self.shell.metrics);
        }
    }

    /// A leader sends heartbeats from its ticks: a tick that comes more than a heartbeat
    /// interval late (a stalled thread, a slow fsync, a paused process) sent them late, and
    /// followers may have started an election meanwhile. Counted, and logged at WARN.
    fn check_heartbeat_lateness(&mut self, last_tick: &mut Instant) {
        let now = Instant::now();
        let gap_ms = now.duration_since(*last_tick).as_millis() as u64;
        *last_tick = now;
        let config = &self.shell.config;
        let heartbeat_ms = config.tick_ms * config.heartbeat_ticks;
        if self.core.role() != conclave_raft::Role::Leader
            || gap_ms <= config.tick_ms + heartbeat_ms
        {
            return;
        }
        self.shell.metrics.heartbeats_late.inc();
        let due = self.shell.late_warned.is_none_or(|at| {
            now.duration_since(at) >= Duration::from_millis(LATE_HEARTBEAT_WARN_INTERVAL_MS)
        });
        if due {
            self.shell.late_warned = Some(now);
            tracing::warn!(
                gap_ms,
                expected_ms = config.tick_ms,
                heartbeat_ms,
                "leader's heartbeats went out late: the Raft thread was stalled (slow disk or \
                 CPU starvation); followers may start an election"
            );
        }
    }

    /// The member's clock ignores steps of the system clock ([`now_ms`]); a large gap between
    /// the two means the wall clock was set after the member started, and only a restart makes
    /// the member follow it. Logged at WARN, at most once a minute.
    fn check_clock_divergence(&mut self) {
        let anchor = clock_anchor();
        if anchor.rate.is_some() {
            // The fault suite's skewed clock diverges by design.
            return;
        }
        let now = Instant::now();
        let due = self.shell.clock_warned.is_none_or(|at| {
            now.duration_since(at) >= Duration::from_millis(CLOCK_DIVERGENCE_WARN_INTERVAL_MS)
        });
        if !due {
            return;
        }
        let member_ms = anchor.read_ms(now.duration_since(anchor.monotonic));
        let wall_ms = u64::try_from(wall_since_epoch().as_millis()).unwrap_or(u64::MAX);
        let divergence_ms = member_ms.abs_diff(wall_ms);
        if divergence_ms <= CLOCK_DIVERGENCE_WARN_MS {
            return;
        }
        self.shell.clock_warned = Some(now);
        tracing::warn!(
            member_ms,
            wall_ms,
            divergence_ms,
            "the system clock was stepped since this member started; the member keeps its own \
             clock (a step must not end leases early) and follows the system clock again after \
             a restart"
        );
    }

    fn handle_request(&mut self, request: NodeRequest<M, D::Request>) {
        let core = &mut self.core;
        let waiters = &mut self.shell.waiters;
        match request {
            NodeRequest::Propose {
                command,
                origin,
                reply,
            } => {
                let proposed = match origin {
                    Some(origin) => core.propose_for(command, origin),
                    None => core.propose(command),
                };
                match proposed {
                    Ok(token) => waiters.command(token, reply),
                    Err(error) => {
                        let _ = reply.send(Err(error));
                    }
                }
            }
            NodeRequest::ReadIndex { reply } => match core.read_index() {
                Ok(token) => {
                    waiters.read(token, reply);
                }
                Err(error) => {
                    let _ = reply.send(Err(error));
                }
            },
            NodeRequest::ConfirmLeadership { term, reply } => {
                match core.read_index_as_leader(term) {
                    Ok(token) => {
                        waiters.read(token, reply);
                    }
                    Err(error) => {
                        let _ = reply.send(Err(error));
                    }
                }
            }
            NodeRequest::TransferLeader { target, reply } => {
                let _ = reply.send(core.transfer_leader(target));
            }
            NodeRequest::AddMember { peer_addr, reply } => {
                match core.propose_new_member(peer_addr) {
                    Ok((token, id)) => waiters.new_member(token, id, reply),
                    Err(error) => {
                        let _ = reply.send(Err(error));
                    }
                }
            }
            NodeRequest::UpdateMember { member, reply } => {
                match core.propose_member_update(&member) {
                    Ok(token) => waiters.done(token, reply),
                    Err(error) => {
                        let _ = reply.send(Err(error));
                    }
                }
            }
            NodeRequest::ChangeMembership { steps, reply } => match core.change_membership(steps) {
                Ok(token) => waiters.done(token, reply),
                Err(error) => {
                    let _ = reply.send(Err(error));
                }
            },
            NodeRequest::HandOff { reply } => {
                let _ = reply.send(Ok(core.begin_handoff()));
            }
            NodeRequest::PeerMatch { peer, reply } => {
                let _ = reply.send(core.peer_match(peer));
            }
            NodeRequest::Duty(request) => self.duties.request(core, waiters, request),
        }
        // Answers the core gave at once (answers to a request never wait for a Ready here).
        for output in self.core.take_outputs() {
            self.shell.waiters.deliver(output, &self.shell.metrics);
        }
    }

    /// Makes the transport dial exactly the recorded members other than this node.
    fn sync_peers(&mut self) {
        let _runtime = self.shell.peer_runtime.enter();
        let me = self.core.raw().id();
        let members = self.core.members();
        let transport = &mut self.shell.transport;
        let stale: Vec<NodeId> = transport
            .peers()
            .filter(|id| !members.contains_key(id))
            .collect();
        for id in stale {
            transport.remove_peer(id);
        }
        for member in members.values() {
            transport.note_member_name(member.id, &member.name);
        }
        for member in members.values().filter(|m| m.id != me) {
            if let Err(error) = transport.add_peer(member.id, member.peer_addr.clone()) {
                tracing::warn!(id = member.id, %error, "peer not added");
            }
        }
    }

    /// Sends the turn's messages to nodes without a link: a node this member holds no record
    /// of gets one to the peer address it announced in its authenticated handshake
    /// (`PeerTransport::add_announced_peer`). That node is a leader the core followed
    /// although this member's configuration predates it (it was away while the leader was
    /// added); without an answer the leader would never learn how far behind this member is,
    /// and this member would never catch up. The link goes at the next `sync_peers`, and comes
    /// back on the next message if the node is still unrecorded then.
    fn route_unrecorded(&mut self) {
        if self.shell.unrouted.is_empty() {
            return;
        }
        let _runtime = self.shell.peer_runtime.enter();
        let members = self.core.members();
        let transport = &mut self.shell.transport;
        for message in self.shell.unrouted.drain(..) {
            transport.add_announced_peer(message.to, |id| members.contains_key(&id));
            if let Err(error) = transport.send(message) {
                tracing::debug!(%error, "peer message not sent");
            }
        }
    }

    /// Writes the snapshot the core asks for on a helper thread, and records a finished one.
    fn maybe_snapshot(&mut self) -> Result<(), Error> {
        self.finish_snapshot_job(false)?;
        if self.shell.snapshot_job.is_some() {
            return Ok(());
        }
        let started = Instant::now();
        let Some(SnapshotPlan { meta, data }) = self.core.snapshot_due()? else {
            return Ok(());
        };
        let freeze_ms = started.elapsed().as_secs_f64() * 1e3;
        let index = meta.index;
        let writer = self.core.raw().store().begin_snapshot(meta)?;
        let mut pieces = SyncedPieceWriter::new(writer, SNAPSHOT_SYNC_CHUNK_BYTES);
        let (done, written) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("conclave-snapshot".into())
            .spawn(move || {
                lower_this_thread_priority(SNAPSHOT_THREAD_NICE);
                let writing = Instant::now();
                let file = match data.write_to(&mut pieces) {
                    Ok(()) => pieces.finish().map_err(Error::Storage),
                    // The file's own error, if it was the file that failed.
                    Err(encoder) => Err(pieces.take_error().map_or_else(
                        || Error::SnapshotEncode {
                            index,
                            reason: encoder.to_string(),
                        },
                        Error::Storage,
                    )),
                };
                let _ = done.send(SnapshotWritten {
                    file,
                    write_ms: writing.elapsed().as_secs_f64() * 1e3,
                });
            })
            .map_err(|e| Error::RaftStart(format!("cannot start the snapshot writer: {e}")))?;
        self.shell.snapshot_job = Some(SnapshotJob {
            index,
            started,
            freeze_ms,
            written,
        });
        Ok(())
    }

    /// Records the snapshot the helper thread wrote, if it is done (or, with `wait`, once it
    /// is). A snapshot from the leader installed meanwhile at or past its index supersedes it.
    fn finish_snapshot_job(&mut self, wait: bool) -> Result<(), Error> {
        let Some(job) = self.shell.snapshot_job.take() else {
            return Ok(());
        };
        let result = if wait {
            job.written.recv().ok()
        } else {
            match job.written.try_recv() {
                Ok(result) => Some(result),
                Err(std::sync::mpsc::TryRecvError::Empty) => {
                    self.shell.snapshot_job = Some(job);
                    return Ok(());
                }
                Err(std::sync::mpsc::TryRecvError::Disconnected) => None,
            }
        };
        let SnapshotWritten { file, write_ms } = result.ok_or_else(|| {
            Error::RaftStart(format!(
                "the snapshot writer for index {} stopped without an answer",
                job.index
            ))
        })?;
        let file = file?;
        let bytes = file.data_len_bytes;
        let recording = Instant::now();
        // The image is not kept in memory: the first follower that needs it has it read back
        // from the file.
        let recorded = self.core.snapshot_written(job.index, bytes, |store| {
            Ok(store.record_created_snapshot(file)?)
        })?;
        let record_ms = recording.elapsed().as_secs_f64() * 1e3;
        if recorded {
            self.shell
                .metrics
                .snapshot_save_seconds
                .observe(job.started.elapsed().as_secs_f64());
            tracing::info!(
                index = job.index,
                bytes,
                freeze_ms = job.freeze_ms,
                write_ms,
                record_ms,
                total_ms = job.started.elapsed().as_secs_f64() * 1e3,
                "snapshot taken, log compacted"
            );
        }
        Ok(())
    }

    fn publish_status(&mut self) {
        let served = self.core.raw().lease_reads_served();
        if served > self.shell.lease_reads_counted {
            self.shell
                .metrics
                .reads_from_lease
                .inc_by(served - self.shell.lease_reads_counted);
            self.shell.lease_reads_counted = served;
        }
        let status = self.core.status();
        if status.leader != self.shell.last_leader {
            if status.leader.is_some() {
                self.shell.metrics.leader_changes_seen.inc();
            }
            let (reason, votes) = self.core.raw().leader_change();
            let votes: Vec<String> = votes.iter().map(|id| format!("{id:x}")).collect();
            tracing::info!(
                previous = self
                    .shell
                    .last_leader
                    .map_or_else(|| "none".to_owned(), |l| format!("{l:x}")),
                leader = status
                    .leader
                    .map_or_else(|| "none".to_owned(), |l| format!("{l:x}")),
                term = status.term,
                reason = reason.as_str(),
                votes = votes.join(","),
                "leader changed"
            );
            self.shell.last_leader = status.leader;
        }
        let applied_index = status.applied_index;
        self.shell.status.send_if_modified(|current| {
            let wakes = status.wakes_receivers_against(current);
            *current = status;
            wakes
        });
        self.shell.applied_waits.0.advance(applied_index);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn anchor(wall_since_epoch: Duration, rate: Option<f64>) -> ClockAnchor {
        ClockAnchor {
            monotonic: Instant::now(),
            wall_since_epoch,
            rate,
        }
    }

    #[test]
    fn the_member_clock_truncates_the_sum_not_its_parts() {
        // Anchored 0.9 ms into a millisecond: 0.2 ms later it is in the next one. Truncating
        // the anchor first would read the old millisecond and let a lease end up to 1 ms early.
        let clock = anchor(Duration::from_micros(1_000_000_900), None);
        assert_eq!(clock.read_ms(Duration::ZERO), 1_000_000);
        assert_eq!(clock.read_ms(Duration::from_micros(200)), 1_000_001);
        assert_eq!(clock.read_ms(Duration::from_millis(3_000)), 1_003_000);
    }

    #[test]
    fn the_member_clock_counts_elapsed_time_at_the_fault_rate() {
        let clock = anchor(Duration::from_secs(100), Some(1.5));
        assert_eq!(clock.read_ms(Duration::from_secs(2)), 103_000);
        let real = anchor(Duration::from_secs(100), None);
        assert_eq!(real.read_ms(Duration::from_secs(2)), 102_000);
    }

    #[test]
    fn the_member_clock_follows_the_monotonic_clock() {
        let before = Instant::now();
        let start_ms = now_ms();
        std::thread::sleep(Duration::from_millis(30));
        let end_ms = now_ms();
        let elapsed_ms = before.elapsed().as_millis() as u64;
        // Between the two readings passed at most the monotonic time measured around them
        // (plus the millisecond a reading can truncate), and at least the sleep.
        assert!(end_ms - start_ms >= 29, "{start_ms} -> {end_ms}");
        assert!(
            end_ms - start_ms <= elapsed_ms + 1,
            "{start_ms} -> {end_ms}, {elapsed_ms} ms"
        );
    }
}
