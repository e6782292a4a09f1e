//! The Raft driver, generic over the replicated machine: one thread that owns the core, the
//! write-ahead log, the peer transport, the proposal and read waiters, the member records and
//! the snapshots. What is particular to one machine (the coordination machine's lease duties
//! and watch fan-out, an embedding program's role callbacks) plugs in through [`Duties`].

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use conclave_raft::{
    ConfChange, ConfChangeStep, ConfState, Config as RaftConfig, EntryKind, Message, MessageBody,
    NodeId, RawNode, Ready, Role, Snapshot, Storage,
};
use conclave_storage::{OsDisk, RecoveryReport, StorageOptions, WalStorage};
use tokio::sync::{mpsc, oneshot, watch};

use super::entries::{self, EntryBody};
use crate::config::{Member, ServerConfig};
use crate::error::Error;
use crate::machine::ReplicatedMachine;
use crate::transport::{InboundMessage, PeerTransport};

/// Requests and messages the driver takes from its queues before it handles a Ready, so one
/// fsync covers a whole batch (group commit) without starving the ticker.
const DRAIN_BATCH_MAX: usize = 1024;

/// What a committed proposal produced.
#[derive(Debug, Clone)]
pub struct Applied<O> {
    /// The machine's answer.
    pub output: O,
    /// The Raft term the entry was committed in.
    pub term: u64,
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
    /// Peer messages the Raft core refused (forged, out of bounds, from a non-member) and
    /// the driver dropped, since the node started.
    pub refused_peer_messages: u64,
}

/// At most one WARN line per this many milliseconds about refused peer messages; the ones
/// in between are only counted, and the next line says how many were not logged.
const REFUSED_MESSAGE_WARN_INTERVAL_MS: u64 = 1_000;

/// Where a proposal's answer goes.
pub(crate) type ProposeReply<O> = oneshot::Sender<Result<Applied<O>, Error>>;
/// Who waits for a linearizable read to become safe.
pub(crate) type ReadWaiter = oneshot::Sender<Result<(), Error>>;

/// What a handle asks of the driver. `R` is the machine's own requests ([`Duties::Request`]).
pub(crate) enum NodeRequest<M: ReplicatedMachine, R> {
    /// Replicate `command`; the reply comes once it is applied (or lost).
    Propose {
        command: M::Command,
        reply: ProposeReply<M::Output>,
    },
    /// Answer once the machine has applied up to a quorum-confirmed commit index.
    ReadIndex { reply: ReadWaiter },
    /// Hand leadership to `target` (Maintenance.MoveLeader, shutdown).
    TransferLeader {
        target: NodeId,
        reply: oneshot::Sender<Result<(), Error>>,
    },
    /// Replicate a member record (the membership table lives next to the machine); answered
    /// once applied here. Leader only.
    ProposeMember {
        member: Member,
        /// Changes an existing record (ignored if its member is gone) rather than creating one.
        update: bool,
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

/// A peer's replication progress as its leader sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerMatch {
    /// The highest log index known to be on the peer.
    pub matched: u64,
    /// The leader's own last log index.
    pub leader_last: u64,
}

/// What runs beside the replicated machine on the driver thread without being replicated
/// itself: leader-only duties, requests only the driver thread can answer, and fan-out of
/// what was applied. Every hook has a default that does nothing.
pub(crate) trait Duties<M: ReplicatedMachine>: Send + 'static {
    /// Requests a handle queues for these duties ([`NodeRequest::Duty`]).
    type Request: Send + 'static;

    /// Handles one [`NodeRequest::Duty`].
    fn request(&mut self, core: &mut Core<M>, request: Self::Request);

    /// Once per loop turn, after the queues are drained and before the Ready is handled;
    /// `ticked` when a Raft tick happened in this turn.
    fn turn(&mut self, _core: &mut Core<M>, _ticked: bool) {}

    /// The node's role, known leader or term changed (and once at start).
    fn role_changed(&mut self, _role: Role, _leader: Option<NodeId>, _term: u64) {}

    /// One entry was applied (the machine is locked for the batch; keep it short).
    fn applied(&mut self, _output: &M::Output) {}

    /// A batch of entries was applied and the machine unlocked; the proposers have not been
    /// answered yet, so whatever this publishes is visible before they are.
    fn batch_applied(&mut self) {}
}

/// The handle API layers hold: queue into the driver, watch its status, read the machine.
pub(crate) struct Handle<M: ReplicatedMachine, R> {
    pub requests: mpsc::Sender<NodeRequest<M, R>>,
    pub status: watch::Receiver<NodeStatus>,
    /// The applied state. The driver holds the write lock only while applying a batch.
    pub machine: Arc<RwLock<M>>,
}

impl<M: ReplicatedMachine, R> Clone for Handle<M, R> {
    fn clone(&self) -> Self {
        Handle {
            requests: self.requests.clone(),
            status: self.status.clone(),
            machine: self.machine.clone(),
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
        self.ask(|reply| NodeRequest::Propose { command, reply })
            .await
    }

    pub async fn read_index(&self) -> Result<(), Error> {
        self.ask(|reply| NodeRequest::ReadIndex { reply }).await
    }

    pub async fn transfer_leader(&self, target: NodeId) -> Result<(), Error> {
        self.ask(|reply| NodeRequest::TransferLeader { target, reply })
            .await
    }

    pub async fn propose_member(&self, member: Member) -> Result<(), Error> {
        self.ask(|reply| NodeRequest::ProposeMember {
            member,
            update: false,
            reply,
        })
        .await
    }

    /// Proposes a change to an existing member record; once applied, the record holds it
    /// unless the member was removed first.
    pub async fn update_member(&self, member: Member) -> Result<(), Error> {
        self.ask(|reply| NodeRequest::ProposeMember {
            member,
            update: true,
            reply,
        })
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
/// Returns the member records too: the snapshot's, or the founding members.
pub(crate) fn open_storage<M: ReplicatedMachine>(
    config: &ServerConfig,
    mut machine: M,
) -> Result<(WalStorage, M, BTreeMap<NodeId, Member>), Error> {
    let mut store = WalStorage::open(
        Arc::new(OsDisk),
        &config.data_dir,
        StorageOptions::default(),
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
        .snapshot()
        .map_err(|e| Error::StateRestore(e.to_string()))?;
    let members = restore_machine(&mut machine, &snapshot)?;
    let members = members
        .unwrap_or_else(|| config.members.clone())
        .into_iter()
        .map(|m| (m.id, m))
        .collect();
    Ok((store, machine, members))
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

/// Restores `machine` from a snapshot; returns the snapshot's member records, if it has them.
fn restore_machine<M: ReplicatedMachine>(
    machine: &mut M,
    snapshot: &Snapshot,
) -> Result<Option<Vec<Member>>, Error> {
    if snapshot.data.is_empty() {
        // The bootstrap snapshot carries membership only: the machine stays as it started.
        return Ok(None);
    }
    let (members, image) = entries::split_snapshot(&snapshot.data[..])
        .ok_or_else(|| Error::StateRestore("malformed member records in the snapshot".into()))?;
    machine
        .restore(image)
        .map_err(|e| Error::StateRestore(e.to_string()))?;
    Ok(members)
}

struct ProposalWaiter<O> {
    term: u64,
    reply: Reply<O>,
}

/// Who waits for an entry: a machine command wants its output; a member record or a
/// membership change only that it was applied.
enum Reply<O> {
    Command(ProposeReply<O>),
    Done(oneshot::Sender<Result<(), Error>>),
}

/// What applying the entry at a waiter's index produced.
enum Outcome<O> {
    /// A member record or a membership change.
    Done,
    /// A machine command's output.
    Output(Applied<O>),
    /// The machine refused the entry's bytes.
    Rejected(Error),
}

impl<O> ProposalWaiter<O> {
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

    fn answer(self, entry_term: u64, outcome: Outcome<O>) {
        if self.term != entry_term {
            return self.fail(Error::LeaderChanged);
        }
        match (self.reply, outcome) {
            (Reply::Command(reply), Outcome::Output(applied)) => {
                let _ = reply.send(Ok(applied));
            }
            (Reply::Done(reply), Outcome::Done) => {
                let _ = reply.send(Ok(()));
            }
            (reply, Outcome::Rejected(error)) => ProposalWaiter { term: 0, reply }.fail(error),
            // Another kind of entry took the index: what was waited for is lost.
            (reply, _) => ProposalWaiter { term: 0, reply }.fail(Error::LeaderChanged),
        }
    }
}

/// Everything the driver owns but the duties: what [`Duties`] hooks may look at and propose
/// through.
pub(crate) struct Core<M: ReplicatedMachine> {
    config: ServerConfig,
    raw: RawNode<WalStorage>,
    transport: PeerTransport,
    machine: Arc<RwLock<M>>,
    status: watch::Sender<NodeStatus>,
    /// Invariant: keys are indexes this node proposed as leader and has not applied yet.
    proposals: BTreeMap<u64, ProposalWaiter<M::Output>>,
    /// Reads asked for in this loop turn; they share one ReadIndex round.
    reads_unsent: Vec<ReadWaiter>,
    /// Reads whose round is under way, by context.
    reads_sent: HashMap<u64, Vec<ReadWaiter>>,
    /// Reads confirmed at an index the machine has not reached yet.
    reads_confirmed: Vec<(u64, Vec<ReadWaiter>)>,
    next_read_context: u64,
    snapshot_index: u64,
    /// A snapshot being written on its own thread, recorded in the log once written.
    snapshot_job: Option<SnapshotJob>,
    /// The replicated member records, by id: founding members or the snapshot's, then
    /// applied member entries. The peer transport dials every one of them but this node.
    members: BTreeMap<NodeId, Member>,
    /// Nodes a membership change removes; their records go once the configuration no longer
    /// holds them (the joint configuration still needs them).
    removals: BTreeSet<NodeId>,
    /// The caller's runtime, which has the IO driver the peer links need (the driver's own
    /// runtime has timers only).
    peer_runtime: tokio::runtime::Handle,
    refused: RefusedMessages,
}

/// Counts the peer messages the core refused and rate-limits their WARN lines, so a flood
/// of forged messages costs a counter increment each, not a log line each.
#[derive(Default)]
struct RefusedMessages {
    total: u64,
    /// Refused since the last WARN line, not logged one by one.
    unlogged: u64,
    last_warn: Option<Instant>,
}

impl RefusedMessages {
    fn record(&mut self, error: &conclave_raft::Error) {
        self.total = self.total.saturating_add(1);
        let interval = Duration::from_millis(REFUSED_MESSAGE_WARN_INTERVAL_MS);
        let now = Instant::now();
        if self
            .last_warn
            .is_some_and(|last| now.duration_since(last) < interval)
        {
            self.unlogged = self.unlogged.saturating_add(1);
            return;
        }
        let sender = match error {
            conclave_raft::Error::RefusedMessage { from, .. }
            | conclave_raft::Error::AppendResponseBeyondLog { from, .. }
            | conclave_raft::Error::UnknownPeer(from) => Some(*from),
            _ => None,
        };
        tracing::warn!(
            sender,
            reason = %error,
            not_logged_since_last = self.unlogged,
            total_refused = self.total,
            "peer message refused and dropped"
        );
        self.unlogged = 0;
        self.last_warn = Some(now);
    }
}

/// A snapshot whose file a helper thread writes: encoding the machine needs the driver
/// thread, writing and syncing the file does not.
struct SnapshotJob {
    index: u64,
    data: Bytes,
    started: Instant,
    encode_ms: f64,
    written:
        std::sync::mpsc::Receiver<Result<conclave_storage::SnapshotFile, conclave_storage::Error>>,
}

/// The Raft driver. Owned by one thread; see the module documentation.
struct Driver<M: ReplicatedMachine, D> {
    core: Core<M>,
    duties: D,
}

/// The driver's thread; joining it gives the driver's exit.
pub(crate) type DriverThread = std::thread::JoinHandle<Result<(), Error>>;

/// Starts the driver thread over `machine` (the state before the first entry; restored from
/// the newest snapshot if there is one). Returns the handle and a join handle whose result is
/// the driver's exit: `Ok` after a clean shutdown, the fatal error otherwise.
pub(crate) fn spawn<M: ReplicatedMachine, D: Duties<M>>(
    config: ServerConfig,
    machine: M,
    duties: D,
    transport: PeerTransport,
    inbound: mpsc::Receiver<InboundMessage>,
    shutdown: oneshot::Receiver<()>,
) -> Result<(Handle<M, D::Request>, DriverThread), Error> {
    config.validate()?;
    let (store, machine, members) = open_storage(&config, machine)?;
    let mut raft_config = RaftConfig::new(config.id);
    raft_config.election_ticks = config.election_ticks;
    raft_config.heartbeat_ticks = config.heartbeat_ticks;
    raft_config.max_uncommitted_bytes = (config.request_bytes_max as u64) * 64;
    raft_config.max_snapshot_bytes = config.snapshot_bytes_max;
    raft_config.seed = election_seed(config.id);
    raft_config
        .validate()
        .map_err(|reason| Error::InvalidConfig { reason })?;
    let snapshot_index = store
        .first_index()
        .map_err(|e| Error::RaftStart(e.to_string()))?
        - 1;
    let raw = RawNode::new(raft_config, store).map_err(Error::RaftStart)?;
    let machine = Arc::new(RwLock::new(machine));
    let (status_sender, status_receiver) = watch::channel(NodeStatus::default());
    let (request_sender, requests) = mpsc::channel(config.driver_queue_requests_max);
    let core = Core {
        config,
        raw,
        transport,
        machine: machine.clone(),
        status: status_sender,
        proposals: BTreeMap::new(),
        reads_unsent: Vec::new(),
        reads_sent: HashMap::new(),
        reads_confirmed: Vec::new(),
        next_read_context: 1,
        snapshot_index,
        snapshot_job: None,
        members,
        removals: BTreeSet::new(),
        refused: RefusedMessages::default(),
        peer_runtime: tokio::runtime::Handle::try_current()
            .map_err(|e| Error::RaftStart(format!("no tokio runtime for the peer links: {e}")))?,
    };
    let mut driver = Driver { core, duties };
    driver.core.sync_peers();
    driver.core.publish_status();
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
            driver.core.status.send_modify(|s| s.stopped = Some(reason));
            result
        })
        .map_err(|e| Error::RaftStart(format!("driver thread: {e}")))?;
    let handle = Handle {
        requests: request_sender,
        status: status_receiver,
        machine,
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

/// Wall-clock milliseconds since the Unix epoch (0 if the clock is before it).
///
/// The fault suite (docs/faults.md) skews a member's clock with the environment variable
/// `CONCLAVE_FAULTS_CLOCK_RATE` (a rate in (0, 10], e.g. `1.01` runs 1% fast from the first
/// reading on); unset or invalid, this is the system clock.
pub(crate) fn now_ms() -> u64 {
    static SKEW: std::sync::OnceLock<Option<(f64, u64)>> = std::sync::OnceLock::new();
    let real = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    let skew = SKEW.get_or_init(|| {
        std::env::var("CONCLAVE_FAULTS_CLOCK_RATE")
            .ok()
            .and_then(|rate| rate.parse::<f64>().ok())
            .filter(|rate| *rate > 0.0 && *rate <= 10.0)
            .map(|rate| (rate, real))
    });
    match *skew {
        None => real,
        Some((rate, origin)) => origin + (real.saturating_sub(origin) as f64 * rate) as u64,
    }
}

impl<M: ReplicatedMachine, D: Duties<M>> Driver<M, D> {
    async fn run(
        &mut self,
        mut requests: mpsc::Receiver<NodeRequest<M, D::Request>>,
        mut inbound: mpsc::Receiver<InboundMessage>,
        mut shutdown: oneshot::Receiver<()>,
    ) -> Result<(), Error> {
        let core = &mut self.core;
        let mut ticker = tokio::time::interval(Duration::from_millis(core.config.tick_ms));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        self.duties
            .role_changed(core.raw.role(), core.raw.leader(), core.raw.term());
        // A one-member cluster need not wait out an election timeout.
        if core.raw.conf_state().voters.len() == 1
            && core.raw.conf_state().is_voter(core.raw.id())
            && let Err(error) = core.raw.campaign()
        {
            tracing::warn!(%error, "not campaigning");
        }
        let mut stopping_since: Option<Instant> = None;
        loop {
            let mut ticked = false;
            tokio::select! {
                _ = &mut shutdown, if stopping_since.is_none() => {
                    stopping_since = Some(Instant::now());
                    if !self.core.begin_handoff() {
                        break;
                    }
                }
                _ = ticker.tick() => {
                    self.core.raw.tick();
                    self.core.drop_abandoned_waiters();
                    ticked = true;
                }
                message = inbound.recv() => {
                    if let Some((_, message)) = message {
                        self.core.step(message);
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
                    Ok((_, message)) => self.core.step(message),
                    Err(_) => break,
                }
            }
            for _ in 0..DRAIN_BATCH_MAX {
                match requests.try_recv() {
                    Ok(request) => self.handle_request(request),
                    Err(_) => break,
                }
            }
            self.core.flush_reads();
            self.duties.turn(&mut self.core, ticked);
            while self.core.raw.has_ready() {
                self.core.handle_ready(&mut self.duties)?;
            }
            self.core.maybe_snapshot()?;
            self.core.publish_status();
            if let Some(since) = stopping_since {
                let waited = since.elapsed()
                    >= Duration::from_millis(self.core.config.shutdown_transfer_timeout_ms);
                if self.core.raw.role() != Role::Leader || waited {
                    break;
                }
            }
        }
        self.core.fail_all_waiters(|| Error::Stopped);
        // A snapshot being written is recorded before the node lets go of its directory.
        self.core.finish_snapshot_job(true)?;
        if self.core.raw.store().needs_sync() {
            self.core.raw.store_mut().sync()?;
        }
        Ok(())
    }

    fn handle_request(&mut self, request: NodeRequest<M, D::Request>) {
        let core = &mut self.core;
        match request {
            NodeRequest::Propose { command, reply } => core.propose(command, reply),
            NodeRequest::ReadIndex { reply } => {
                let pending: usize = core.reads_unsent.len()
                    + core.reads_sent.values().map(Vec::len).sum::<usize>()
                    + core
                        .reads_confirmed
                        .iter()
                        .map(|(_, r)| r.len())
                        .sum::<usize>();
                if pending >= core.config.reads_inflight_max {
                    let _ = reply.send(Err(Error::TooManyRequests));
                } else {
                    core.reads_unsent.push(reply);
                }
            }
            NodeRequest::TransferLeader { target, reply } => {
                let result = core.raw.transfer_leader(target).map_err(raft_error);
                let _ = reply.send(result);
            }
            NodeRequest::ProposeMember {
                member,
                update,
                reply,
            } => {
                let data = Bytes::from(if update {
                    entries::member_update_entry(&member)
                } else {
                    entries::member_entry(&member)
                });
                core.propose_tracked(Reply::Done(reply), |raw| raw.propose(data));
            }
            NodeRequest::ChangeMembership { steps, reply } => {
                core.propose_tracked(Reply::Done(reply), |raw| raw.propose_conf_change(steps));
            }
            NodeRequest::HandOff { reply } => {
                let _ = reply.send(Ok(core.begin_handoff()));
            }
            NodeRequest::PeerMatch { peer, reply } => {
                let answer = if core.raw.role() == Role::Leader {
                    Ok(core.raw.peer_progress(peer).map(|(matched, _)| PeerMatch {
                        matched,
                        leader_last: core.raw.last_index(),
                    }))
                } else {
                    Err(Error::NotLeader {
                        leader: core.raw.leader(),
                    })
                };
                let _ = reply.send(answer);
            }
            NodeRequest::Duty(request) => self.duties.request(core, request),
        }
    }
}

impl<M: ReplicatedMachine> Core<M> {
    /// This node's Raft role.
    pub fn role(&self) -> Role {
        self.raw.role()
    }

    /// The leader this node knows of.
    pub fn leader(&self) -> Option<NodeId> {
        self.raw.leader()
    }

    /// The index of the last entry the machine applied.
    pub fn applied_index(&self) -> u64 {
        self.raw.applied_index()
    }

    /// The index of the last entry in this node's log.
    pub fn last_index(&self) -> u64 {
        self.raw.last_index()
    }

    /// The applied machine, read-locked.
    pub fn machine(&self) -> RwLockReadGuard<'_, M> {
        self.machine
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn machine_mut(&self) -> RwLockWriteGuard<'_, M> {
        self.machine
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Proposes `command` as leader; `reply` hears the output once it is applied here.
    pub fn propose(&mut self, command: M::Command, reply: ProposeReply<M::Output>) {
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
        // Encoded here, on the leader at proposal time, so the machine may stamp its clock.
        let data = Bytes::from(entries::machine_entry(M::encode(command)));
        match self.raw.propose(data) {
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

    /// Proposes a command nobody waits for (a leader's own duty); returns its index.
    pub fn propose_untracked(&mut self, command: M::Command) -> Option<u64> {
        let data = Bytes::from(entries::machine_entry(M::encode(command)));
        match self.raw.propose(data) {
            Ok(index) => Some(index),
            Err(error) => {
                tracing::warn!(%error, "leader duty not proposed");
                None
            }
        }
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

    /// Steps a peer's message into the core. A refusal drops the message, never the node.
    fn step(&mut self, message: conclave_raft::Message) {
        match self.raw.step(message) {
            Ok(()) => {}
            Err(error) if error.is_refused_message() => self.refused.record(&error),
            // A TimeoutNow the node cannot act on (its term is exhausted).
            Err(error) => tracing::warn!(%error, "peer message not acted on"),
        }
    }

    /// Proposes with `propose` as leader and keeps `reply` until the entry is applied.
    fn propose_tracked(
        &mut self,
        reply: Reply<M::Output>,
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
    fn handle_ready(&mut self, duties: &mut impl Duties<M>) -> Result<(), Error> {
        let ready: Ready = self.raw.ready();
        if let Some(soft) = ready.soft_state {
            tracing::info!(role = ?soft.role, leader = ?soft.leader, term = soft.term, "raft role");
            // Read rounds do not survive a leader change; let their callers retry at once.
            for (_, readers) in self.reads_sent.drain() {
                for reader in readers {
                    let _ = reader.send(Err(Error::LeaderChanged));
                }
            }
            duties.role_changed(soft.role, soft.leader, soft.term);
        }
        // A leader's appends go out before its own write, so the followers' fsyncs overlap
        // the leader's instead of following it: the Ready contract allows it, as the core
        // counts the leader's copy toward a quorum only once `advance` reports it durable
        // (the simulator crashes leaders in that window).
        let leader = self.raw.role() == Role::Leader;
        let sent_early =
            |message: &Message| leader && matches!(message.body, MessageBody::Append { .. });
        for message in ready.messages.iter().filter(|m| sent_early(m)) {
            if let Err(error) = self.transport.send(message.clone()) {
                tracing::debug!(%error, "peer message not sent");
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
        for message in ready.messages.iter().filter(|m| !sent_early(m)) {
            if let Err(error) = self.transport.send(message.clone()) {
                tracing::debug!(%error, "peer message not sent");
            }
        }
        // 3. Apply: a snapshot from the leader replaces the state, then committed entries.
        if let Some(snapshot) = &ready.snapshot {
            let members = restore_machine(&mut *self.machine_mut(), snapshot)?;
            if let Some(members) = members {
                self.members = members.into_iter().map(|m| (m.id, m)).collect();
                self.sync_peers();
            }
            self.snapshot_index = snapshot.meta.index;
            tracing::info!(
                index = snapshot.meta.index,
                term = snapshot.meta.term,
                "snapshot from the leader installed"
            );
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
        self.apply_entries(&ready, duties);
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

    fn apply_entries(&mut self, ready: &Ready, duties: &mut impl Duties<M>) {
        if ready.committed_entries.is_empty() {
            return;
        }
        let mut answers = Vec::new();
        let mut members_changed = false;
        {
            let mut machine = self
                .machine
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
                        answers.push((waiter, entry.term, Outcome::Done));
                    }
                    continue;
                }
                let outcome = match entries::entry_body(&entry.data) {
                    EntryBody::Empty => {
                        // A leader's no-op: whatever waited at this index was overwritten.
                        if let Some(waiter) = waiter {
                            waiter.fail(Error::LeaderChanged);
                        }
                        continue;
                    }
                    EntryBody::Member(Some(member)) => {
                        self.members.insert(member.id, member);
                        members_changed = true;
                        Outcome::Done
                    }
                    EntryBody::MemberUpdate(Some(member)) => {
                        let present = self.members.contains_key(&member.id)
                            && !self.removals.contains(&member.id)
                            && self.raw.conf_state().contains(member.id);
                        if present {
                            self.members.insert(member.id, member);
                            members_changed = true;
                        } else {
                            tracing::info!(
                                id = member.id,
                                "update of a member no longer in the configuration ignored"
                            );
                        }
                        Outcome::Done
                    }
                    EntryBody::Member(None) | EntryBody::MemberUpdate(None) => {
                        tracing::error!(index = entry.index, "bad member record skipped");
                        Outcome::Done
                    }
                    EntryBody::Machine(bytes) => match machine.apply(entry.index, bytes) {
                        Ok(output) => {
                            duties.applied(&output);
                            Outcome::Output(Applied {
                                output,
                                term: entry.term,
                            })
                        }
                        Err(error) => {
                            // Every replica decodes the same bytes the same way, so skipping
                            // keeps them identical; it can only be a bug in the proposer.
                            tracing::error!(index = entry.index, %error, "entry rejected by the machine");
                            Outcome::Rejected(Error::EntryRejected {
                                index: entry.index,
                                reason: error.to_string(),
                            })
                        }
                    },
                };
                if let Some(waiter) = waiter {
                    answers.push((waiter, entry.term, outcome));
                }
            }
        }
        duties.batch_applied();
        if members_changed {
            self.sync_peers();
        }
        for (waiter, term, outcome) in answers {
            waiter.answer(term, outcome);
        }
        // Anything still waiting below the last applied index was overwritten.
        let applied = ready.committed_entries.last().map_or(0, |e| e.index);
        let stale: Vec<u64> = self.proposals.range(..=applied).map(|(&i, _)| i).collect();
        for index in stale {
            if let Some(waiter) = self.proposals.remove(&index) {
                waiter.fail(Error::LeaderChanged);
            }
        }
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

    /// Every `snapshot_entries` applied entries, snapshot the machine and let the storage
    /// drop the log below it.
    fn maybe_snapshot(&mut self) -> Result<(), Error> {
        self.finish_snapshot_job(false)?;
        let applied = self.raw.applied_index();
        if self.snapshot_job.is_some()
            || applied < self.snapshot_index + self.config.snapshot_entries
        {
            return Ok(());
        }
        let started = Instant::now();
        let image = self.machine().snapshot();
        let data = Bytes::from(entries::snapshot_bytes(self.members.values(), &image));
        let encode_ms = started.elapsed().as_secs_f64() * 1e3;
        let term =
            self.raw.store().term(applied).map_err(|e| {
                Error::RaftStart(format!("no term for applied entry {applied}: {e}"))
            })?;
        let meta = conclave_raft::SnapshotMeta {
            index: applied,
            term,
            conf_state: self.raw.conf_state().clone(),
        };
        let mut writer = self.raw.store().begin_snapshot(meta)?;
        let (done, written) = std::sync::mpsc::channel();
        let bytes = data.clone();
        std::thread::Builder::new()
            .name("conclave-snapshot".into())
            .spawn(move || {
                let result = writer.write_chunk(&bytes).and_then(|()| writer.finish());
                let _ = done.send(result);
            })
            .map_err(|e| Error::RaftStart(format!("cannot start the snapshot writer: {e}")))?;
        self.snapshot_job = Some(SnapshotJob {
            index: applied,
            data,
            started,
            encode_ms,
            written,
        });
        Ok(())
    }

    /// Records the snapshot the helper thread wrote, if it is done (or, with `wait`, once it
    /// is). A snapshot from the leader installed meanwhile at or past its index supersedes it.
    fn finish_snapshot_job(&mut self, wait: bool) -> Result<(), Error> {
        let Some(job) = self.snapshot_job.take() else {
            return Ok(());
        };
        let result = if wait {
            job.written.recv().ok()
        } else {
            match job.written.try_recv() {
                Ok(result) => Some(result),
                Err(std::sync::mpsc::TryRecvError::Empty) => {
                    self.snapshot_job = Some(job);
                    return Ok(());
                }
                Err(std::sync::mpsc::TryRecvError::Disconnected) => None,
            }
        };
        let file = result.ok_or_else(|| {
            Error::RaftStart(format!(
                "the snapshot writer for index {} stopped without an answer",
                job.index
            ))
        })??;
        let bytes = job.data.len();
        let store = self.raw.store_mut();
        let stored = store
            .first_index()
            .map_err(|e| Error::RaftStart(e.to_string()))?
            - 1;
        if stored >= job.index {
            tracing::info!(
                index = job.index,
                stored,
                "snapshot superseded by the leader's before it was recorded"
            );
            return Ok(());
        }
        store.record_created_snapshot_with_data(file, job.data)?;
        tracing::info!(
            index = job.index,
            bytes,
            encode_ms = job.encode_ms,
            total_ms = job.started.elapsed().as_secs_f64() * 1e3,
            "snapshot taken, log compacted"
        );
        self.snapshot_index = job.index;
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
            refused_peer_messages: self.refused.total,
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
