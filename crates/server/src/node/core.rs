//! The node core: everything that decides, with no I/O of its own.
//!
//! The core owns the Raft core, the applied machine, the proposal and read waiters (keyed by
//! [`Token`]s the shell maps to its own reply channels), the member records and the snapshot
//! policy. It takes inputs (the time, a tick, a peer message, a client request, a written
//! snapshot) and produces outputs: messages through [`ReadyIo::send`], answers in
//! [`NodeCore::take_outputs`], a snapshot to write from [`NodeCore::snapshot_due`]. It reads
//! no clock, spawns nothing and touches files only through its [`NodeStore`] (the write-ahead
//! log over the storage crate's `Disk` seam). The server's driver thread is one shell around
//! it; the simulator (`conclave-sim`) is another, over a simulated disk and virtual time.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Write;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use bytes::Bytes;
use conclave_raft::{
    ConfChange, ConfChangeStep, ConfState, Entry, EntryKind, HardState, Message, MessageBody,
    NodeId, RawNode, Ready, Role, Snapshot, SnapshotMeta, Storage,
};
use conclave_storage::WalStorage;

use super::entries::{self, EntryBody};
use crate::config::{Member, ServerConfig};
use crate::error::Error;
use crate::machine::{FrozenImage, ReplicatedMachine};

/// At most one WARN line per this many milliseconds about refused peer messages; the ones
/// in between are only counted, and the next line says how many were not logged.
const REFUSED_MESSAGE_WARN_INTERVAL_MS: u64 = 1_000;

/// How many entries past `snapshot_entries` a leader lets its log grow before it snapshots
/// anyway while a follower catching up from a snapshot still needs the log
/// ([`NodeCore::snapshot_due`]). It bounds the log (on disk, and the replay at restart) when
/// that follower is gone or too slow: 100,000 entries of the usual size are a few tens of MB.
pub const SNAPSHOT_POSTPONE_MAX_ENTRIES: u64 = 100_000;

/// How much later than the snapshot rules a member takes its first snapshot, in percent of
/// their thresholds: its place among the voters (by id) over their number, so three members
/// snapshot a third of an interval apart. A member that is not a voter does not wait.
pub fn snapshot_stagger_percent(conf_state: &ConfState, id: NodeId) -> u64 {
    let voters = &conf_state.voters;
    match voters.iter().position(|&voter| voter == id) {
        Some(place) => place as u64 * 100 / voters.len() as u64,
        None => 0,
    }
}

/// A role's name for logs and metrics.
pub fn role_name(role: Role) -> &'static str {
    match role {
        Role::Leader => "leader",
        Role::Follower => "follower",
        Role::Candidate => "candidate",
        Role::PreCandidate => "pre-candidate",
        #[allow(unreachable_patterns)]
        _ => "other",
    }
}

/// Names one waiter: a proposal or a read the shell keeps a reply channel for.
pub type Token = u64;

/// What a committed proposal produced.
#[derive(Debug, Clone)]
pub struct Applied<O> {
    /// The machine's answer.
    pub output: O,
    /// The Raft term the entry was committed in.
    pub term: u64,
}

/// The node's public view, refreshed by the shell after every turn.
///
/// Receivers of the status watch are woken only when what they wait on changes: the role,
/// leader, term, configuration, member records, or the node stopping
/// ([`NodeStatus::wakes_receivers_against`]). The counters (commit, applied and last index,
/// pending proposals, refused messages) are current on every read but wake nobody: they move
/// every turn, and waking every watching task each turn cost more than the turn's own work.
/// To wait for the applied index, use [`AppliedWaits`](super::applied_waits::AppliedWaits).
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
    /// the node dropped, since it started.
    pub refused_peer_messages: u64,
    /// Proposals waiting for their entry to be applied here (etcd's `proposals_pending`).
    pub proposals_pending: u64,
}

impl NodeStatus {
    /// Whether replacing `previous` with this status must wake the watch's receivers:
    /// anything but the counters changed.
    pub fn wakes_receivers_against(&self, previous: &NodeStatus) -> bool {
        // Spelled out field by field, so a new field must be sorted into one kind or the other.
        let NodeStatus {
            id,
            role,
            leader,
            term,
            conf_state,
            members,
            stopped,
            commit_index: _,
            applied_index: _,
            last_index: _,
            refused_peer_messages: _,
            proposals_pending: _,
        } = self;
        *id != previous.id
            || *role != previous.role
            || *leader != previous.leader
            || *term != previous.term
            || *conf_state != previous.conf_state
            || *members != previous.members
            || *stopped != previous.stopped
    }
}

/// A peer's replication progress as its leader sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerMatch {
    /// The highest log index known to be on the peer.
    pub matched: u64,
    /// The leader's own last log index.
    pub leader_last: u64,
}

/// An answer the shell hands to whoever holds the token.
#[derive(Debug)]
pub enum Output<O> {
    /// A proposal is settled: `Some` carries a machine command's output, `None` says a member
    /// record or a membership change was applied.
    Settled {
        token: Token,
        result: Result<Option<Applied<O>>, Error>,
    },
    /// A linearizable read may now run against the applied machine (or failed).
    ReadReady {
        token: Token,
        result: Result<(), Error>,
    },
}

/// The write side of the storage under the core; reads go through [`Storage`].
pub trait NodeStore: Storage {
    fn apply_snapshot(&mut self, snapshot: Snapshot) -> Result<(), Error>;
    fn append(&mut self, entries: &[Entry]) -> Result<(), Error>;
    fn set_hard_state(&mut self, hard_state: HardState) -> Result<(), Error>;
    fn sync(&mut self) -> Result<(), Error>;
    /// Whether something written is not yet synced.
    fn needs_sync(&self) -> bool;
}

impl NodeStore for WalStorage {
    fn apply_snapshot(&mut self, snapshot: Snapshot) -> Result<(), Error> {
        Ok(WalStorage::apply_snapshot(self, snapshot)?)
    }
    fn append(&mut self, entries: &[Entry]) -> Result<(), Error> {
        WalStorage::append(self, entries)?;
        Ok(())
    }
    fn set_hard_state(&mut self, hard_state: HardState) -> Result<(), Error> {
        WalStorage::set_hard_state(self, hard_state)?;
        Ok(())
    }
    fn sync(&mut self) -> Result<(), Error> {
        WalStorage::sync(self)?;
        Ok(())
    }
    fn needs_sync(&self) -> bool {
        WalStorage::needs_sync(self)
    }
}

/// Where the core stands within one Ready, for a shell that wants to stop it there (the
/// simulator crashes nodes at these points).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadyPoint {
    /// Before anything of the Ready is persisted (a leader's appends may be out already).
    BeforePersist,
    /// Written, not yet synced.
    BeforeSync,
    /// Durable.
    Persisted,
    /// Every message sent.
    Sent,
    /// Committed entries applied.
    Applied,
}

/// The shell's side of handling a Ready.
pub trait ReadyIo {
    /// Sends one message to its peer (best effort: the network may lose it).
    fn send(&mut self, message: Message);
    /// The core reached `point` of `ready`. Returning false stops the node right there, as a
    /// crash would; the shell must then drop the core and reopen its storage.
    fn reached(&mut self, _point: ReadyPoint, _ready: &Ready) -> bool {
        true
    }
}

/// How handling the Readies of one turn ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TurnEnd {
    Done,
    /// [`ReadyIo::reached`] stopped the node.
    Stopped,
}

/// Limits and policy the core applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CoreSettings {
    /// Proposals waiting to be applied at most; more are refused with `TooManyRequests`.
    pub proposals_inflight_max: usize,
    /// Linearizable reads waiting at most.
    pub reads_inflight_max: usize,
    /// Snapshot once this many entries were applied since the last snapshot...
    pub snapshot_entries: u64,
    /// ...and the entries applied since then are at least this percentage of the last
    /// snapshot's size in bytes (0: entries alone decide). Writing a snapshot costs time in
    /// proportion to the image, which keeps growing with the key-value history; waiting for
    /// as many bytes of log keeps that cost per applied byte bounded however large the state
    /// gets. The price is a longer log on disk, and to replay at restart, when the state is
    /// large.
    pub snapshot_log_percent: u64,
}

impl CoreSettings {
    pub fn from_config(config: &ServerConfig) -> Self {
        CoreSettings {
            proposals_inflight_max: config.proposals_inflight_max,
            reads_inflight_max: config.reads_inflight_max,
            snapshot_entries: config.snapshot_entries,
            snapshot_log_percent: config.snapshot_log_percent,
        }
    }
}

/// Deliberate bugs the simulator's negative controls switch on, to prove its checkers catch
/// them. Compiled only with the `negative-controls` feature; all off by default.
#[cfg(feature = "negative-controls")]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CoreBugs {
    /// Answer a machine command as soon as it is proposed, before it commits and applies.
    pub answer_before_apply: bool,
    /// On a follower, apply committed entries before persisting the Ready's entries.
    pub apply_before_persist: bool,
    /// On a follower, send the Ready's messages (its acknowledgements and votes) before
    /// persisting what they vouch for, as a leader may send its appends.
    pub send_before_persist: bool,
    /// The leader never proposes the machine's timer `Tick` (see `LeaderDuties`).
    pub skip_tick: bool,
}

/// What runs beside the replicated machine without being replicated itself: leader-only
/// duties and what follows what was applied. Every hook has a default that does nothing.
pub trait Duties<M: ReplicatedMachine, S: NodeStore> {
    /// Once per turn, before the Readies are handled; `ticked` when a Raft tick happened.
    fn turn(&mut self, _core: &mut NodeCore<M, S>, _ticked: bool) {}

    /// The node's role, known leader or term changed (and once at start).
    fn role_changed(&mut self, _role: Role, _leader: Option<NodeId>, _term: u64) {}

    /// One entry was applied (the machine is locked for the batch; keep it short).
    fn applied(&mut self, _output: &M::Output) {}

    /// A batch of entries was applied and the machine unlocked; the proposers have not been
    /// answered yet, so whatever this publishes is visible before they are.
    fn batch_applied(&mut self) {}

    /// A snapshot from the leader replaced the machine (unlocked again). Whatever follows
    /// applied entries must hear of it: the revisions the snapshot jumped over were never
    /// applied one by one, and no later entry need come to reveal them.
    fn snapshot_installed(&mut self, _machine: &M) {}
}

/// What a waiter wants from the entry at its index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wants {
    /// A machine command's output.
    Output,
    /// Only that a member record or a membership change was applied.
    Done,
}

struct Waiter {
    token: Token,
    term: u64,
    wants: Wants,
}

/// What applying the entry at a waiter's index produced.
enum Outcome<O> {
    Done,
    Output(Applied<O>),
    Rejected(Error),
}

/// Counts the peer messages the core refused and rate-limits their WARN lines, so a flood
/// of forged messages costs a counter increment each, not a log line each.
#[derive(Default)]
struct RefusedMessages {
    total: u64,
    /// Refused since the last WARN line, not logged one by one.
    unlogged: u64,
    last_warn_ms: Option<u64>,
}

impl RefusedMessages {
    fn record(&mut self, error: &conclave_raft::Error, now_ms: u64) {
        self.total = self.total.saturating_add(1);
        if self
            .last_warn_ms
            .is_some_and(|last| now_ms.saturating_sub(last) < REFUSED_MESSAGE_WARN_INTERVAL_MS)
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
        self.last_warn_ms = Some(now_ms);
    }
}

/// A snapshot the shell should write: the machine's image behind the member records.
#[derive(Debug)]
pub struct SnapshotPlan {
    pub meta: SnapshotMeta,
    pub data: SnapshotData,
}

/// A snapshot's bytes before they are encoded: the member records and the machine's state as
/// of the snapshot's index. Encoding may run on another thread while the node goes on.
#[derive(Debug)]
pub struct SnapshotData {
    member_id_high: NodeId,
    members: Vec<Member>,
    image: FrozenImage,
}

impl SnapshotData {
    /// The snapshot's bytes in memory: the member header (`entries::write_snapshot_header`),
    /// then the machine's image.
    pub fn encode(self) -> Bytes {
        let mut out = Vec::new();
        // Writing into memory fails only if the machine's encoder does, which it does not.
        self.write_to(&mut out)
            .expect("a snapshot encodes into memory");
        Bytes::from(out)
    }

    /// Writes the bytes [`SnapshotData::encode`] gives to `out` as they are encoded: the
    /// shell streams them into the snapshot file, with no image-sized buffer in between.
    pub fn write_to(self, out: &mut dyn Write) -> std::io::Result<()> {
        let mut header = Vec::new();
        entries::write_snapshot_header(&mut header, self.member_id_high, self.members.iter());
        out.write_all(&header)?;
        self.image.write_to(out)
    }
}

/// The member table: the records and the highest id ever used. Both are replicated: every
/// node derives them from the same snapshots and log entries.
#[derive(Debug, Clone, Default)]
pub struct MemberTable {
    /// The member records, by id.
    pub records: BTreeMap<NodeId, Member>,
    /// The highest member id the cluster ever used, founders included: recorded in snapshots,
    /// raised by every applied member record and configuration change that names a higher
    /// one. A removed member's record goes, its id stays used, so MemberAdd never gives it
    /// again (a removed node still running, or its messages in flight, would speak as the new
    /// member).
    pub id_high: NodeId,
}

/// What a snapshot restored about the members.
#[derive(Debug)]
pub(crate) struct RestoredMembers {
    /// The snapshot's member records; `None` when it has none (then the founders' stand).
    pub records: Option<Vec<Member>>,
    /// The highest member id used up to the snapshot: the one it recorded, and every id its
    /// configuration and records name (a bootstrap snapshot's configuration is the founders,
    /// and an older snapshot recorded no highest id).
    pub id_high: NodeId,
}

impl RestoredMembers {
    /// The table a node opens with: the snapshot's records, or `founders` when it has none.
    pub(crate) fn into_table(self, founders: Vec<Member>) -> MemberTable {
        MemberTable {
            records: self
                .records
                .unwrap_or(founders)
                .into_iter()
                .map(|m| (m.id, m))
                .collect(),
            id_high: self.id_high,
        }
    }
}

/// The member ids a configuration change adds (the ones it removes were added before).
fn conf_change_added_ids(steps: &[ConfChangeStep]) -> impl Iterator<Item = NodeId> + '_ {
    steps.iter().filter_map(|step| match step {
        ConfChangeStep::AddVoter(id) | ConfChangeStep::AddLearner(id) => Some(*id),
        _ => None,
    })
}

/// The sans-IO node; see the module documentation.
pub struct NodeCore<M: ReplicatedMachine, S: NodeStore> {
    settings: CoreSettings,
    raw: RawNode<S>,
    machine: Arc<RwLock<M>>,
    /// The shell's clock, milliseconds since the Unix epoch (virtual time in the simulator).
    now_ms: u64,
    ticked: bool,
    next_token: Token,
    /// Invariant: keys are indexes this node proposed as leader and has not applied yet.
    proposals: BTreeMap<u64, Waiter>,
    /// Reads asked for in this turn; they share one ReadIndex round.
    reads_unsent: Vec<Token>,
    /// Leadership confirmations asked for in this turn, with the term they must confirm; they
    /// join the same round, or fail if this node no longer leads that term when it starts.
    leader_reads_unsent: Vec<(Token, u64)>,
    /// Reads whose round is under way, by context.
    reads_sent: HashMap<u64, Vec<Token>>,
    /// Reads confirmed at an index the machine has not reached yet.
    reads_confirmed: Vec<(u64, Vec<Token>)>,
    next_read_context: u64,
    snapshot_index: u64,
    /// How much later than the snapshot rules say this member takes its first snapshot since
    /// it started, in percent of their thresholds: its place among the voters spread over one
    /// interval. Every member applies the same log, so without it all of them would encode an
    /// image at the same index, on the same CPUs, at once. The offset then holds under the entry
    /// rule (equal intervals) and drifts slowly under the log rule, whose interval follows each
    /// member's own last image. Zero after this member's first snapshot.
    snapshot_stagger_percent: u64,
    /// The index of a snapshot the shell is writing, until it reports it written.
    snapshot_pending: Option<u64>,
    /// Bytes of entries applied since the core started.
    applied_bytes: u64,
    /// `applied_bytes` when the state of the last snapshot was taken.
    snapshot_applied_bytes: u64,
    /// `applied_bytes` when the state of the pending snapshot was taken.
    snapshot_pending_applied_bytes: u64,
    /// The size of the last snapshot taken, installed or started from (0: none yet).
    snapshot_image_bytes: u64,
    /// The replicated member records, by id: founding members or the snapshot's, then
    /// applied member entries.
    members: BTreeMap<NodeId, Member>,
    /// See [`MemberTable::id_high`].
    member_id_high: NodeId,
    /// Set when `members` changed; the shell re-dials its peers.
    members_changed: bool,
    /// Nodes a membership change removes; their records go once the configuration no longer
    /// holds them (the joint configuration still needs them).
    removals: BTreeSet<NodeId>,
    refused: RefusedMessages,
    outputs: Vec<Output<M::Output>>,
    #[cfg(feature = "negative-controls")]
    pub bugs: CoreBugs,
}

/// How many bytes of log entries [`NodeCore::next_member_id`] reads at a time.
const MEMBER_ID_SCAN_BYTES_MAX: u64 = 1 << 20;

/// The highest member id a log entry names (a member record or a configuration change that
/// adds one); 0 for any other entry.
fn entry_member_id_high(entry: &Entry) -> NodeId {
    if entry.kind == EntryKind::ConfChange {
        return match ConfChange::decode(&entry.data) {
            Some(ConfChange::Enter(steps)) => conf_change_added_ids(&steps).max().unwrap_or(0),
            _ => 0,
        };
    }
    match entries::entry_body(&entry.data) {
        EntryBody::Member(Some(member)) => member.id,
        _ => 0,
    }
}

/// The core's operating errors as the Raft core reports them.
pub(crate) fn raft_error(error: conclave_raft::Error) -> Error {
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

/// Restores `machine` from a snapshot; returns what the snapshot says about the members.
pub(crate) fn restore_machine<M: ReplicatedMachine>(
    machine: &mut M,
    snapshot: &Snapshot,
) -> Result<RestoredMembers, Error> {
    let conf_high = snapshot.meta.conf_state.members().into_iter().max();
    if snapshot.data.is_empty() {
        // The bootstrap snapshot carries membership only: the machine stays as it started.
        return Ok(RestoredMembers {
            records: None,
            id_high: conf_high.unwrap_or(0),
        });
    }
    let (members, image) = entries::split_snapshot(&snapshot.data[..])
        .ok_or_else(|| Error::StateRestore("malformed member records in the snapshot".into()))?;
    machine
        .restore(image)
        .map_err(|e| Error::StateRestore(e.to_string()))?;
    let Some(members) = members else {
        return Ok(RestoredMembers {
            records: None,
            id_high: conf_high.unwrap_or(0),
        });
    };
    let id_high = members
        .records
        .iter()
        .map(|m| m.id)
        .chain(conf_high)
        .chain(members.member_id_high)
        .max()
        .unwrap_or(0);
    Ok(RestoredMembers {
        records: Some(members.records),
        id_high,
    })
}

impl<M: ReplicatedMachine, S: NodeStore> NodeCore<M, S> {
    /// A core over `raw`, whose storage holds a snapshot at `snapshot_index`; `machine` is
    /// already restored from it and `members` is its member table (with the founders' records
    /// when it has none).
    pub fn new(
        settings: CoreSettings,
        raw: RawNode<S>,
        machine: Arc<RwLock<M>>,
        members: MemberTable,
        snapshot_index: u64,
        now_ms: u64,
    ) -> Self {
        let snapshot_stagger_percent = snapshot_stagger_percent(raw.conf_state(), raw.id());
        NodeCore {
            settings,
            raw,
            machine,
            now_ms,
            ticked: false,
            next_token: 1,
            proposals: BTreeMap::new(),
            reads_unsent: Vec::new(),
            leader_reads_unsent: Vec::new(),
            reads_sent: HashMap::new(),
            reads_confirmed: Vec::new(),
            next_read_context: 1,
            snapshot_index,
            snapshot_stagger_percent,
            snapshot_pending: None,
            applied_bytes: 0,
            snapshot_applied_bytes: 0,
            snapshot_pending_applied_bytes: 0,
            snapshot_image_bytes: 0,
            members: members.records,
            member_id_high: members.id_high,
            members_changed: true,
            removals: BTreeSet::new(),
            refused: RefusedMessages::default(),
            outputs: Vec::new(),
            #[cfg(feature = "negative-controls")]
            bugs: CoreBugs::default(),
        }
    }

    /// Sets the size of the snapshot the storage starts from: the next snapshot waits until
    /// that much log was applied (see [`CoreSettings::snapshot_log_percent`]).
    pub fn with_snapshot_image_bytes(mut self, image_bytes: u64) -> Self {
        self.snapshot_image_bytes = image_bytes;
        self
    }

    /// Opens a core over `store` (restoring `machine` from its snapshot). `founders` are the
    /// member records when the snapshot has none.
    pub fn open(
        settings: CoreSettings,
        raft_config: conclave_raft::Config,
        store: S,
        mut machine: M,
        founders: Vec<Member>,
        now_ms: u64,
    ) -> Result<Self, Error> {
        let snapshot = store
            .snapshot()
            .map_err(|e| Error::StateRestore(e.to_string()))?;
        let members = restore_machine(&mut machine, &snapshot)?.into_table(founders);
        let snapshot_index = snapshot.meta.index;
        let image_bytes = snapshot.data.len() as u64;
        let raw = RawNode::new(raft_config, store).map_err(Error::RaftStart)?;
        Ok(NodeCore::new(
            settings,
            raw,
            Arc::new(RwLock::new(machine)),
            members,
            snapshot_index,
            now_ms,
        )
        .with_snapshot_image_bytes(image_bytes))
    }

    /// The first turn: tells the duties where the node stands, and a one-member cluster
    /// campaigns at once rather than waiting out an election timeout.
    pub fn start(&mut self, duties: &mut impl Duties<M, S>) {
        duties.role_changed(self.raw.role(), self.raw.leader(), self.raw.term());
        if self.raw.conf_state().voters.len() == 1
            && self.raw.conf_state().is_voter(self.raw.id())
            && let Err(error) = self.raw.campaign()
        {
            tracing::warn!(%error, "not campaigning");
        }
    }

    // ---- inputs ----------------------------------------------------------------------------

    /// The shell's clock moved to `now_ms` (called at every turn, before anything else, and
    /// before stepping peer messages: with lease reads on, the core answers a follower's read
    /// from its lease only if the lease holds at a time after the read arrived).
    pub fn set_time(&mut self, now_ms: u64) {
        self.now_ms = now_ms;
        self.raw.set_now_ms(now_ms);
    }

    /// Says whether clients of this member wait for what it applies (watches, lock waits,
    /// election and topic streams): a leader then holds back nothing from it (see
    /// `RawNode::set_awaited`).
    pub fn set_awaited(&mut self, awaited: bool) {
        self.raw.set_awaited(awaited);
    }

    /// One Raft tick.
    pub fn tick(&mut self) {
        self.raw.tick();
        self.ticked = true;
    }

    /// Steps a peer's message into the core. A refusal drops the message, never the node.
    pub fn step(&mut self, message: Message) {
        match self.raw.step(message) {
            Ok(()) => {}
            Err(error) if error.is_refused_message() => {
                self.refused.record(&error, self.now_ms);
            }
            // A TimeoutNow the node cannot act on (its term is exhausted).
            Err(error) => tracing::warn!(%error, "peer message not acted on"),
        }
    }

    fn new_token(&mut self) -> Token {
        let token = self.next_token;
        self.next_token += 1;
        token
    }

    /// Proposes `command` as leader; the token's [`Output::Settled`] carries its output once
    /// it is applied here (or the reason it was lost).
    pub fn propose(&mut self, command: M::Command) -> Result<Token, Error> {
        // Encoded here, on the leader at proposal time, so the machine may stamp its clock.
        let now_ms = self.now_ms;
        let token = self.propose_tracked(Wants::Output, |raw| {
            raw.propose(Bytes::from(entries::machine_entry(M::encode_at(
                command, now_ms,
            ))))
        })?;
        #[cfg(feature = "negative-controls")]
        if self.bugs.answer_before_apply
            && let Some((&index, _)) = self.proposals.iter().find(|(_, w)| w.token == token)
        {
            // The bug: the proposer hears "done" before anything committed.
            self.proposals.remove(&index);
            self.outputs.push(Output::Settled {
                token,
                result: Ok(None),
            });
        }
        Ok(token)
    }

    /// [`NodeCore::propose`] for a client of follower `origin` (a write it handed to this
    /// leader): `origin` hears of the commit at once, with the entry, so it can answer its
    /// client without waiting for what the leader holds back.
    pub fn propose_for(&mut self, command: M::Command, origin: NodeId) -> Result<Token, Error> {
        let token = self.propose(command)?;
        let index = self.raw.last_index();
        self.raw.hasten_commit_notice(origin, index);
        Ok(token)
    }

    /// Proposes a command nobody waits for (a leader's own duty); returns its index.
    pub fn propose_untracked(&mut self, command: M::Command) -> Option<u64> {
        let data = Bytes::from(entries::machine_entry(M::encode_at(command, self.now_ms)));
        match self.raw.propose(data) {
            Ok(index) => Some(index),
            Err(error) => {
                tracing::warn!(%error, "leader duty not proposed");
                None
            }
        }
    }

    /// Replicates the record of a new member at `peer_addr` under an id never used before
    /// (see [`NodeCore::next_member_id`]); returns the token, settled once the record is
    /// applied here, and the id. Leader only.
    pub fn propose_new_member(&mut self, peer_addr: String) -> Result<(Token, NodeId), Error> {
        if self.raw.role() != Role::Leader {
            return Err(Error::NotLeader {
                leader: self.raw.leader(),
            });
        }
        let id = self.next_member_id()?;
        let member = Member {
            id,
            name: String::new(),
            peer_addr,
            client_addr: String::new(),
        };
        let data = Bytes::from(entries::member_entry(&member));
        let token = self.propose_tracked(Wants::Done, |raw| raw.propose(data))?;
        Ok((token, id))
    }

    /// Replicates a change to an existing member record (ignored where its member is gone by
    /// then); settled once applied here. Leader only.
    pub fn propose_member_update(&mut self, member: &Member) -> Result<Token, Error> {
        let data = Bytes::from(entries::member_update_entry(member));
        self.propose_tracked(Wants::Done, |raw| raw.propose(data))
    }

    /// The id the next new member gets, on the leader: one above the highest id the cluster
    /// ever used, every record and configuration member, and every id a member record or
    /// configuration change names in this node's log past what it applied. That tail holds
    /// whatever may commit before a new entry: an earlier leader's entries a new leader has
    /// not applied yet, and this leader's own records still in flight (a MemberAdd that gave
    /// up waiting), so no id is given twice even before they apply.
    pub fn next_member_id(&self) -> Result<NodeId, Error> {
        let mut high = self
            .members
            .keys()
            .copied()
            .chain(self.raw.conf_state().members())
            .fold(self.member_id_high, NodeId::max);
        let last = self.raw.last_index();
        let mut next = self.raw.applied_index() + 1;
        while next <= last {
            let batch = self
                .raw
                .entries(next, last + 1, MEMBER_ID_SCAN_BYTES_MAX)
                .map_err(|e| Error::RaftStart(format!("reading the log past {next}: {e}")))?;
            let Some(end) = batch.last().map(|e| e.index) else {
                break;
            };
            for entry in &batch {
                high = high.max(entry_member_id_high(entry));
            }
            next = end + 1;
        }
        high.checked_add(1).ok_or_else(|| {
            Error::Raft(conclave_raft::Error::InvalidConfChange(format!(
                "no member id is left above {high}"
            )))
        })
    }

    /// Proposes one membership change; settled once its entry is applied here. Leader only.
    pub fn change_membership(&mut self, steps: Vec<ConfChangeStep>) -> Result<Token, Error> {
        self.propose_tracked(Wants::Done, |raw| raw.propose_conf_change(steps))
    }

    /// Proposes with `propose` as leader and keeps a waiter until the entry is applied.
    fn propose_tracked(
        &mut self,
        wants: Wants,
        propose: impl FnOnce(&mut RawNode<S>) -> Result<u64, conclave_raft::Error>,
    ) -> Result<Token, Error> {
        if self.raw.role() != Role::Leader {
            return Err(Error::NotLeader {
                leader: self.raw.leader(),
            });
        }
        if self.proposals.len() >= self.settings.proposals_inflight_max {
            return Err(Error::TooManyRequests);
        }
        let term = self.raw.term();
        let index = propose(&mut self.raw).map_err(raft_error)?;
        let token = self.new_token();
        self.proposals.insert(index, Waiter { token, term, wants });
        Ok(token)
    }

    /// Asks for a linearizable read; the token's [`Output::ReadReady`] says when the machine
    /// has applied up to a quorum-confirmed commit index.
    pub fn read_index(&mut self) -> Result<Token, Error> {
        self.check_reads_room()?;
        let token = self.new_token();
        self.reads_unsent.push(token);
        Ok(token)
    }

    /// Like [`NodeCore::read_index`], but only as the leader of `term`: the round is started
    /// by this node as leader of `term` (never forwarded to another leader), so its
    /// [`Output::ReadReady`] success means a quorum acknowledged this node's leadership of
    /// `term` after the call. Fails with `LeaderChanged` when this node no longer leads `term`
    /// when the round starts, or loses leadership before it completes.
    pub fn read_index_as_leader(&mut self, term: u64) -> Result<Token, Error> {
        self.check_reads_room()?;
        let token = self.new_token();
        self.leader_reads_unsent.push((token, term));
        Ok(token)
    }

    fn check_reads_room(&self) -> Result<(), Error> {
        let pending: usize = self.reads_unsent.len()
            + self.leader_reads_unsent.len()
            + self.reads_sent.values().map(Vec::len).sum::<usize>()
            + self
                .reads_confirmed
                .iter()
                .map(|(_, r)| r.len())
                .sum::<usize>();
        if pending >= self.settings.reads_inflight_max {
            return Err(Error::TooManyRequests);
        }
        Ok(())
    }

    /// Forgets reads whose caller gave up, so a round whose answer was lost cannot pin memory.
    pub fn forget_reads(&mut self, abandoned: &BTreeSet<Token>) {
        if abandoned.is_empty() {
            return;
        }
        self.reads_sent.retain(|_, readers| {
            readers.retain(|r| !abandoned.contains(r));
            !readers.is_empty()
        });
    }

    /// Hands leadership to `target` (Maintenance.MoveLeader).
    pub fn transfer_leader(&mut self, target: NodeId) -> Result<(), Error> {
        self.raw.transfer_leader(target).map_err(raft_error)
    }

    /// How far the leader has replicated to `peer`. Leader only.
    pub fn peer_match(&self, peer: NodeId) -> Result<Option<PeerMatch>, Error> {
        if self.raw.role() != Role::Leader {
            return Err(Error::NotLeader {
                leader: self.raw.leader(),
            });
        }
        Ok(self.raw.peer_progress(peer).map(|(matched, _)| PeerMatch {
            matched,
            leader_last: self.raw.last_index(),
        }))
    }

    /// On shutdown a leader hands over to its most up-to-date voter, so a rolling restart
    /// loses no request. Returns false when there is nobody to hand over to.
    pub fn begin_handoff(&mut self) -> bool {
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

    // ---- the turn --------------------------------------------------------------------------

    /// After a batch of inputs: one ReadIndex round for the new reads, the duties, then every
    /// Ready in the contract's order. Fatal storage errors stop the node.
    pub fn turn(
        &mut self,
        duties: &mut impl Duties<M, S>,
        io: &mut impl ReadyIo,
    ) -> Result<TurnEnd, Error> {
        self.flush_reads();
        let ticked = std::mem::take(&mut self.ticked);
        duties.turn(self, ticked);
        while self.raw.has_ready() {
            if self.handle_ready(duties, io)? == TurnEnd::Stopped {
                return Ok(TurnEnd::Stopped);
            }
        }
        Ok(TurnEnd::Done)
    }

    /// Starts one ReadIndex round for every read asked for since the last one.
    fn flush_reads(&mut self) {
        let leads = self.raw.role() == Role::Leader;
        let term = self.raw.term();
        for (token, wanted) in std::mem::take(&mut self.leader_reads_unsent) {
            if leads && wanted == term {
                self.reads_unsent.push(token);
            } else {
                self.outputs.push(Output::ReadReady {
                    token,
                    result: Err(Error::LeaderChanged),
                });
            }
        }
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
                for token in readers {
                    self.outputs.push(Output::ReadReady {
                        token,
                        result: Err(clone_error(&error)),
                    });
                }
            }
        }
    }

    /// Handles one Ready in the order its documentation prescribes.
    fn handle_ready(
        &mut self,
        duties: &mut impl Duties<M, S>,
        io: &mut impl ReadyIo,
    ) -> Result<TurnEnd, Error> {
        let ready: Ready = self.raw.ready();
        if let Some(soft) = ready.soft_state {
            tracing::info!(
                role = role_name(soft.role),
                leader = soft
                    .leader
                    .map_or_else(|| "none".to_owned(), |l| format!("{l:x}")),
                term = soft.term,
                "raft role"
            );
            // Read rounds do not survive a leader change; let their callers retry at once.
            for (_, readers) in self.reads_sent.drain() {
                for token in readers {
                    self.outputs.push(Output::ReadReady {
                        token,
                        result: Err(Error::LeaderChanged),
                    });
                }
            }
            duties.role_changed(soft.role, soft.leader, soft.term);
        }
        // A leader's appends go out before its own write, so the followers' fsyncs overlap
        // the leader's instead of following it: the Ready contract allows it, as the core
        // counts the leader's copy toward a quorum only once `advance` reports it durable
        // (the simulator crashes leaders in that window).
        let leader = self.raw.role() == Role::Leader;
        #[cfg(feature = "negative-controls")]
        let follower_sends_early = self.bugs.send_before_persist && !leader;
        #[cfg(not(feature = "negative-controls"))]
        let follower_sends_early = false;
        let sent_early = |message: &Message| {
            follower_sends_early || (leader && matches!(message.body, MessageBody::Append { .. }))
        };
        for message in ready.messages.iter().filter(|m| sent_early(m)) {
            io.send(message.clone());
        }
        #[cfg(feature = "negative-controls")]
        let apply_early = self.bugs.apply_before_persist && !leader;
        #[cfg(feature = "negative-controls")]
        if apply_early {
            // The bug: the Ready's committed entries are applied before its entries are
            // durable, and the rest of the contract then runs as usual.
            self.apply_snapshot_and_entries(&ready, duties)?;
            if !io.reached(ReadyPoint::Applied, &ready) {
                return Ok(TurnEnd::Stopped);
            }
        }
        if !io.reached(ReadyPoint::BeforePersist, &ready) {
            return Ok(TurnEnd::Stopped);
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
        if !io.reached(ReadyPoint::BeforeSync, &ready) {
            return Ok(TurnEnd::Stopped);
        }
        if ready.must_sync {
            self.raw.store_mut().sync()?;
        }
        if !io.reached(ReadyPoint::Persisted, &ready) {
            return Ok(TurnEnd::Stopped);
        }
        // 2. Send: everything a message depends on is durable now.
        for message in ready.messages.iter().filter(|m| !sent_early(m)) {
            io.send(message.clone());
        }
        if !io.reached(ReadyPoint::Sent, &ready) {
            return Ok(TurnEnd::Stopped);
        }
        // 3. Apply: a snapshot from the leader replaces the state, then committed entries.
        #[cfg(feature = "negative-controls")]
        let applied_already = apply_early;
        #[cfg(not(feature = "negative-controls"))]
        let applied_already = false;
        if !applied_already {
            self.apply_snapshot_and_entries(&ready, duties)?;
            if !io.reached(ReadyPoint::Applied, &ready) {
                return Ok(TurnEnd::Stopped);
            }
        }
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
        Ok(TurnEnd::Done)
    }

    fn apply_snapshot_and_entries(
        &mut self,
        ready: &Ready,
        duties: &mut impl Duties<M, S>,
    ) -> Result<(), Error> {
        if let Some(snapshot) = &ready.snapshot {
            let restored = restore_machine(&mut *self.machine_mut(), snapshot)?;
            duties.snapshot_installed(&self.machine());
            // The snapshot's highest id covers the log before it, which this node applied
            // only a prefix of; an older snapshot may know less than this node did.
            self.member_id_high = self.member_id_high.max(restored.id_high);
            if let Some(records) = restored.records {
                self.members = records.into_iter().map(|m| (m.id, m)).collect();
                self.members_changed = true;
            }
            self.snapshot_index = snapshot.meta.index;
            self.snapshot_applied_bytes = self.applied_bytes;
            self.snapshot_image_bytes = snapshot.data.len() as u64;
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
                    self.fail(waiter, Error::LeaderChanged);
                }
            }
        }
        self.apply_entries(ready, duties);
        Ok(())
    }

    fn fail(&mut self, waiter: Waiter, error: Error) {
        self.outputs.push(Output::Settled {
            token: waiter.token,
            result: Err(error),
        });
    }

    fn answer(&mut self, waiter: Waiter, entry_term: u64, outcome: Outcome<M::Output>) {
        if waiter.term != entry_term {
            return self.fail(waiter, Error::LeaderChanged);
        }
        let result = match (waiter.wants, outcome) {
            (Wants::Output, Outcome::Output(applied)) => Ok(Some(applied)),
            (Wants::Done, Outcome::Done) => Ok(None),
            (_, Outcome::Rejected(error)) => Err(error),
            // Another kind of entry took the index: what was waited for is lost.
            _ => Err(Error::LeaderChanged),
        };
        self.outputs.push(Output::Settled {
            token: waiter.token,
            result,
        });
    }

    fn apply_entries(&mut self, ready: &Ready, duties: &mut impl Duties<M, S>) {
        if ready.committed_entries.is_empty() {
            return;
        }
        let batch_bytes: usize = ready.committed_entries.iter().map(|e| e.data.len()).sum();
        self.applied_bytes = self.applied_bytes.saturating_add(batch_bytes as u64);
        let mut answers = Vec::new();
        // Members a change earlier in this batch added: the core's configuration takes them
        // in only at advance, and a record update after the change must still find them (a
        // follower that gets entries in batches applies both in one turn).
        let mut added_in_batch = BTreeSet::new();
        {
            let mut machine = self
                .machine
                .write()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            for entry in &ready.committed_entries {
                let waiter = self.proposals.remove(&entry.index);
                if entry.kind == EntryKind::ConfChange {
                    // The core applies it at advance; the shell follows with the peers.
                    if let Some(ConfChange::Enter(steps)) = ConfChange::decode(&entry.data) {
                        added_in_batch.extend(conf_change_added_ids(&steps));
                        self.member_id_high =
                            conf_change_added_ids(&steps).fold(self.member_id_high, NodeId::max);
                        for step in steps {
                            if let ConfChangeStep::RemoveNode(id) = step {
                                self.removals.insert(id);
                            }
                        }
                        self.members_changed = true;
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
                            answers.push((waiter, 0, Outcome::Done));
                        }
                        continue;
                    }
                    EntryBody::Member(Some(member)) => {
                        self.member_id_high = self.member_id_high.max(member.id);
                        self.members.insert(member.id, member);
                        self.members_changed = true;
                        Outcome::Done
                    }
                    EntryBody::MemberUpdate(Some(member)) => {
                        let present = self.members.contains_key(&member.id)
                            && !self.removals.contains(&member.id)
                            && (self.raw.conf_state().contains(member.id)
                                || added_in_batch.contains(&member.id));
                        if present {
                            self.members.insert(member.id, member);
                            self.members_changed = true;
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
        for (waiter, term, outcome) in answers {
            // Term 0 marks a waiter whose index a no-op took (no entry has term 0).
            self.answer(waiter, term, outcome);
        }
        // Anything still waiting below the last applied index was overwritten.
        let applied = ready.committed_entries.last().map_or(0, |e| e.index);
        let stale: Vec<u64> = self.proposals.range(..=applied).map(|(&i, _)| i).collect();
        for index in stale {
            if let Some(waiter) = self.proposals.remove(&index) {
                self.fail(waiter, Error::LeaderChanged);
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
            for token in readers {
                self.outputs.push(Output::ReadReady {
                    token,
                    result: Ok(()),
                });
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
        self.members_changed = true;
    }

    /// Fails every waiter (the node stops).
    pub fn fail_all_waiters(&mut self, error: impl Fn() -> Error) {
        for (_, waiter) in std::mem::take(&mut self.proposals) {
            self.fail(waiter, error());
        }
        let mut readers: Vec<Token> = std::mem::take(&mut self.reads_unsent);
        readers.extend(
            std::mem::take(&mut self.leader_reads_unsent)
                .into_iter()
                .map(|(token, _)| token),
        );
        readers.extend(self.reads_sent.drain().flat_map(|(_, r)| r));
        readers.extend(
            std::mem::take(&mut self.reads_confirmed)
                .into_iter()
                .flat_map(|(_, r)| r),
        );
        for token in readers {
            self.outputs.push(Output::ReadReady {
                token,
                result: Err(error()),
            });
        }
    }

    // ---- outputs ---------------------------------------------------------------------------

    /// The answers produced since the last call, in order.
    pub fn take_outputs(&mut self) -> Vec<Output<M::Output>> {
        std::mem::take(&mut self.outputs)
    }

    /// Whether the member records changed since the last call (the shell re-dials its peers).
    pub fn take_members_changed(&mut self) -> bool {
        std::mem::take(&mut self.members_changed)
    }

    /// Every `snapshot_entries` applied entries, once as many bytes of log as
    /// `snapshot_log_percent` asks were applied too: the snapshot the shell should
    /// write now. Only one at a time; [`NodeCore::snapshot_written`] records it.
    ///
    /// A leader postpones it, by up to [`SNAPSHOT_POSTPONE_MAX_ENTRIES`] more entries, while a
    /// follower being brought back by a snapshot still needs the log past that snapshot:
    /// recording one compacts the log up to it, and that follower would then need yet another
    /// snapshot, which a leader that snapshots faster than it can send one never finishes.
    pub fn snapshot_due(&mut self) -> Result<Option<SnapshotPlan>, Error> {
        let applied = self.raw.applied_index();
        let entries = self.settings.snapshot_entries;
        let due_at = self.snapshot_index
            + entries
            + entries.saturating_mul(self.snapshot_stagger_percent) / 100;
        if self.snapshot_pending.is_some()
            || self.settings.snapshot_entries == 0
            || applied < due_at
            || !self.enough_log_for_a_snapshot()
        {
            return Ok(None);
        }
        let follower_needs_log = self
            .raw
            .snapshot_catch_up_floor()
            .is_some_and(|floor| floor < applied);
        if follower_needs_log && applied < due_at.saturating_add(SNAPSHOT_POSTPONE_MAX_ENTRIES) {
            return Ok(None);
        }
        // Only the freezing happens here (for the coordination machine a clone of persistent
        // maps); the encoding is the shell's, on whichever thread it likes.
        let data = SnapshotData {
            member_id_high: self.member_id_high,
            members: self.members.values().cloned().collect(),
            image: self.machine().snapshot_frozen(),
        };
        let term =
            self.raw.store().term(applied).map_err(|e| {
                Error::RaftStart(format!("no term for applied entry {applied}: {e}"))
            })?;
        let meta = SnapshotMeta {
            index: applied,
            term,
            conf_state: self.raw.conf_state().clone(),
        };
        self.snapshot_pending = Some(applied);
        self.snapshot_pending_applied_bytes = self.applied_bytes;
        Ok(Some(SnapshotPlan { meta, data }))
    }

    /// Whether the log applied since the last snapshot is large enough, against that
    /// snapshot's size, for the next (see [`CoreSettings::snapshot_log_percent`]).
    fn enough_log_for_a_snapshot(&self) -> bool {
        let log_bytes = self
            .applied_bytes
            .saturating_sub(self.snapshot_applied_bytes);
        let wanted_bytes = self
            .snapshot_image_bytes
            .saturating_mul(self.settings.snapshot_log_percent)
            / 100;
        let stagger_bytes = wanted_bytes.saturating_mul(self.snapshot_stagger_percent) / 100;
        log_bytes >= wanted_bytes.saturating_add(stagger_bytes)
    }

    /// The shell wrote the snapshot at `index`; `record` makes the storage adopt it (and drop
    /// the log below it) unless a snapshot from the leader installed meanwhile supersedes it.
    /// Returns whether it was recorded. `image_bytes` is the snapshot's size.
    pub fn snapshot_written(
        &mut self,
        index: u64,
        image_bytes: u64,
        record: impl FnOnce(&mut S) -> Result<(), Error>,
    ) -> Result<bool, Error> {
        assert_eq!(
            self.snapshot_pending.take(),
            Some(index),
            "a snapshot was reported written that the core did not ask for"
        );
        let store = self.raw.store_mut();
        let stored = store
            .first_index()
            .map_err(|e| Error::RaftStart(e.to_string()))?
            - 1;
        if stored >= index {
            tracing::info!(
                index,
                stored,
                "snapshot superseded by the leader's before it was recorded"
            );
            return Ok(false);
        }
        record(store)?;
        self.snapshot_index = index;
        self.snapshot_stagger_percent = 0;
        self.snapshot_applied_bytes = self.snapshot_pending_applied_bytes;
        self.snapshot_image_bytes = image_bytes;
        Ok(true)
    }

    /// The index of the snapshot the shell is writing, if any.
    pub fn snapshot_pending(&self) -> Option<u64> {
        self.snapshot_pending
    }

    pub fn status(&self) -> NodeStatus {
        NodeStatus {
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
            proposals_pending: self.proposals.len() as u64,
        }
    }

    // ---- views -----------------------------------------------------------------------------

    /// The shell's clock as last given.
    pub fn now_ms(&self) -> u64 {
        self.now_ms
    }

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

    /// The Raft core (read only).
    pub fn raw(&self) -> &RawNode<S> {
        &self.raw
    }

    /// The storage, for a shell's own bookkeeping (durability, shutdown sync).
    pub fn store_mut(&mut self) -> &mut S {
        self.raw.store_mut()
    }

    /// The member records, by id.
    pub fn members(&self) -> &BTreeMap<NodeId, Member> {
        &self.members
    }

    /// The highest member id the cluster ever used (see [`MemberTable::id_high`]).
    pub fn member_id_high(&self) -> NodeId {
        self.member_id_high
    }

    /// Proposals waiting to be applied.
    pub fn proposals_waiting(&self) -> usize {
        self.proposals.len()
    }

    /// The shared machine the shell's readers lock.
    pub fn machine_handle(&self) -> Arc<RwLock<M>> {
        self.machine.clone()
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
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use conclave_storage::{OsDisk, StorageOptions};

    use super::*;
    use crate::machine::MachineError;

    /// A machine with nothing to replicate: these tests are about the member table.
    #[derive(Default)]
    struct Nothing;

    impl ReplicatedMachine for Nothing {
        type Command = ();
        type Output = ();
        fn encode(_command: ()) -> Vec<u8> {
            b"nothing".to_vec()
        }
        fn apply(&mut self, _index: u64, _entry: &[u8]) -> Result<(), MachineError> {
            Ok(())
        }
        fn snapshot(&self) -> Vec<u8> {
            b"nothing".to_vec()
        }
        fn restore(&mut self, _image: &[u8]) -> Result<(), MachineError> {
            Ok(())
        }
    }

    #[test]
    fn the_status_wakes_its_watchers_on_shape_changes_only() {
        let before = NodeStatus {
            id: 1,
            role: Some(Role::Follower),
            leader: Some(2),
            term: 3,
            commit_index: 10,
            applied_index: 9,
            last_index: 11,
            ..NodeStatus::default()
        };
        let counters_moved = NodeStatus {
            commit_index: 12,
            applied_index: 12,
            last_index: 13,
            refused_peer_messages: 1,
            proposals_pending: 4,
            ..before.clone()
        };
        assert!(!counters_moved.wakes_receivers_against(&before));
        let changes: [fn(&mut NodeStatus); 6] = [
            |s| s.role = Some(Role::Leader),
            |s| s.leader = None,
            |s| s.term += 1,
            |s| {
                s.conf_state.voters.insert(4);
            },
            |s| {
                s.members.push(Member {
                    id: 4,
                    name: "four".into(),
                    peer_addr: "127.0.0.1:1".into(),
                    client_addr: String::new(),
                })
            },
            |s| s.stopped = Some(String::new()),
        ];
        for (i, change) in changes.iter().enumerate() {
            let mut after = counters_moved.clone();
            change(&mut after);
            assert!(after.wakes_receivers_against(&before), "change {i}");
        }
    }

    struct NoDuties;
    impl<M: ReplicatedMachine, S: NodeStore> Duties<M, S> for NoDuties {}

    /// A single voter has no peers to send to.
    struct NoPeers;
    impl ReadyIo for NoPeers {
        fn send(&mut self, _message: Message) {}
    }

    type TestCore = NodeCore<Nothing, WalStorage>;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("conclave-core-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the test directory");
        dir
    }

    fn member(id: NodeId) -> Member {
        Member {
            id,
            name: format!("n{id}"),
            peer_addr: format!("127.0.0.1:{}", 7000 + id),
            client_addr: String::new(),
        }
    }

    /// Opens (bootstrapping on first use) a one-voter cluster of member 1 over `dir` and
    /// runs it until it leads.
    fn open_leader(dir: &Path) -> TestCore {
        open_leader_with(dir, 0)
    }

    /// [`open_leader`] with a snapshot after every entry, once the log since the last one
    /// is `snapshot_log_percent` of it.
    fn open_leader_with(dir: &Path, snapshot_log_percent: u64) -> TestCore {
        let mut store = WalStorage::open(Arc::new(OsDisk), dir, StorageOptions::default())
            .expect("open the log");
        if store.is_fresh() {
            store
                .bootstrap(ConfState::with_voters([1]))
                .expect("bootstrap");
        }
        let settings = CoreSettings {
            proposals_inflight_max: 100,
            reads_inflight_max: 100,
            snapshot_entries: 1,
            snapshot_log_percent,
        };
        let mut core = NodeCore::open(
            settings,
            conclave_raft::Config::new(1),
            store,
            Nothing,
            vec![member(1)],
            0,
        )
        .expect("open the core");
        core.start(&mut NoDuties);
        run(&mut core);
        assert_eq!(core.role(), Role::Leader);
        core
    }

    fn run(core: &mut TestCore) {
        assert_eq!(
            core.turn(&mut NoDuties, &mut NoPeers).expect("turn"),
            TurnEnd::Done
        );
    }

    /// Adds a learner through the core the way MemberAdd does; its id.
    fn add_learner(core: &mut TestCore, peer_addr: &str) -> NodeId {
        let (_, id) = core
            .propose_new_member(peer_addr.to_string())
            .expect("record proposed");
        run(core);
        change(core, ConfChangeStep::AddLearner(id));
        id
    }

    fn change(core: &mut TestCore, step: ConfChangeStep) {
        core.change_membership(vec![step]).expect("change proposed");
        run(core);
        assert!(!core.raw().conf_state().is_joint(), "left the joint phase");
    }

    fn take_snapshot(core: &mut TestCore) {
        let plan = core.snapshot_due().expect("snapshot").expect("one is due");
        write_snapshot(core, plan);
    }

    fn write_snapshot(core: &mut TestCore, plan: SnapshotPlan) {
        let index = plan.meta.index;
        let writer = core
            .raw()
            .store()
            .begin_snapshot(plan.meta)
            .expect("begin the snapshot");
        // Streamed into the file in small pieces, as the shell's snapshot thread does.
        let mut pieces = conclave_storage::SyncedPieceWriter::new(writer, 1 << 10);
        plan.data.write_to(&mut pieces).expect("write the snapshot");
        let file = pieces.finish().expect("finish the snapshot");
        let recorded = core
            .snapshot_written(index, file.data_len_bytes, |store| {
                Ok(store.record_created_snapshot(file)?)
            })
            .expect("record the snapshot");
        assert!(recorded);
    }

    #[test]
    fn a_removed_members_id_is_never_given_again_even_after_a_snapshot_and_a_restart() {
        let dir = temp_dir("member-ids");
        let mut core = open_leader(&dir);
        assert_eq!(add_learner(&mut core, "127.0.0.1:7002"), 2);
        assert_eq!(add_learner(&mut core, "127.0.0.1:7003"), 3);
        // Removing the member with the highest id drops its record once the configuration no
        // longer holds it: nothing but the high-water mark remembers id 3.
        change(&mut core, ConfChangeStep::RemoveNode(3));
        assert!(!core.members().contains_key(&3));
        assert!(!core.raw().conf_state().contains(3));
        assert_eq!(core.member_id_high(), 3);
        assert_eq!(core.next_member_id().expect("an id"), 4, "id 3 was used");

        // The snapshot covers every entry that named id 3; the log below it is dropped.
        take_snapshot(&mut core);
        drop(core);
        let mut core = open_leader(&dir);
        assert!(!core.members().contains_key(&3));
        assert_eq!(core.member_id_high(), 3, "restored from the snapshot");
        assert_eq!(add_learner(&mut core, "127.0.0.1:7004"), 4);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A follower that gets entries in batches (a quorum-first spare) applies a membership
    /// change and the new member's record update in one turn; the update must find the
    /// member its own batch added, though the core's configuration takes it in only after.
    #[test]
    fn a_record_update_applied_in_the_same_batch_as_its_members_addition_is_kept() {
        let dir = temp_dir("member-update-same-batch");
        let mut core = open_leader(&dir);
        let (_, id) = core
            .propose_new_member("127.0.0.1:7002".into())
            .expect("record proposed");
        run(&mut core);
        core.change_membership(vec![ConfChangeStep::AddLearner(id)])
            .expect("change proposed");
        let announced = Member {
            name: "two".into(),
            client_addr: "127.0.0.1:8002".into(),
            ..member(id)
        };
        core.propose_member_update(&announced)
            .expect("update proposed");
        // One turn commits and applies both entries.
        run(&mut core);
        assert!(core.raw().conf_state().contains(id));
        assert_eq!(core.members().get(&id), Some(&announced));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn records_proposed_but_not_applied_yet_take_their_ids() {
        let dir = temp_dir("member-ids-in-flight");
        let mut core = open_leader(&dir);
        // Two adds whose records are both still in the log, unapplied (a MemberAdd that gave
        // up waiting, then another; or a new leader's unapplied entries of its predecessor).
        let (_, first) = core
            .propose_new_member("127.0.0.1:7002".into())
            .expect("first record");
        let (_, second) = core
            .propose_new_member("127.0.0.1:7003".into())
            .expect("second record");
        assert_eq!((first, second), (2, 3));
        run(&mut core);
        assert_eq!(core.member_id_high(), 3);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_snapshot_streamed_is_the_header_then_the_image() {
        let members = vec![member(1), member(2)];
        let image: Vec<u8> = (0..10_000u32).flat_map(|i| i.to_le_bytes()).collect();
        let expected = entries::snapshot_bytes(7, members.iter(), &image);
        let frozen: [fn(Vec<u8>) -> FrozenImage; 3] = [
            FrozenImage::ready,
            |image| FrozenImage::deferred(move || image),
            |image| {
                // Written in uneven pieces, as a streaming encoder does.
                FrozenImage::deferred_to(move |out| {
                    image.chunks(777).try_for_each(|piece| out.write_all(piece))
                })
            },
        ];
        for (kind, make) in frozen.iter().enumerate() {
            let data = || SnapshotData {
                member_id_high: 7,
                members: members.clone(),
                image: make(image.clone()),
            };
            assert_eq!(data().encode(), expected, "image kind {kind}, in memory");
            let mut streamed = Vec::new();
            data().write_to(&mut streamed).expect("written");
            assert_eq!(streamed, expected, "image kind {kind}, streamed");
        }
    }

    /// Entries applied one at a time until a snapshot is due, which it then takes; how many
    /// it took.
    fn entries_until_a_snapshot_is_due(core: &mut TestCore) -> usize {
        for entries in 1..=10_000 {
            core.propose(()).expect("proposed");
            run(core);
            if let Some(plan) = core.snapshot_due().expect("snapshot check") {
                write_snapshot(core, plan);
                return entries;
            }
        }
        panic!("no snapshot came due in 10,000 entries");
    }

    fn stored_snapshot_bytes(core: &TestCore) -> usize {
        core.raw()
            .store()
            .snapshot()
            .expect("stored snapshot")
            .data
            .len()
    }

    /// A one-voter leader over `dir` that applied one entry and took a snapshot of it.
    fn leader_after_a_snapshot(dir: &Path, snapshot_log_percent: u64) -> TestCore {
        let mut core = open_leader_with(dir, snapshot_log_percent);
        core.propose(()).expect("proposed");
        run(&mut core);
        take_snapshot(&mut core);
        core
    }

    #[test]
    fn members_take_their_first_snapshot_a_share_of_an_interval_apart() {
        let three = ConfState::with_voters([4, 9, 17]);
        let stagger: Vec<u64> = [4, 9, 17]
            .iter()
            .map(|&id| snapshot_stagger_percent(&three, id))
            .collect();
        assert_eq!(stagger, [0, 33, 66]);
        assert_eq!(snapshot_stagger_percent(&three, 5), 0, "not a voter");
        assert_eq!(snapshot_stagger_percent(&ConfState::with_voters([1]), 1), 0);
    }

    #[test]
    fn the_first_snapshot_waits_for_the_stagger_and_later_ones_do_not() {
        let dir = temp_dir("snapshot-stagger");
        let mut core = open_leader(&dir);
        core.settings.snapshot_entries = 10;
        core.snapshot_stagger_percent = 50;
        let behind = core.applied_index() - core.snapshot_index;
        let waited = entries_until_a_snapshot_is_due(&mut core);
        assert_eq!(
            waited as u64 + behind,
            15,
            "ten entries and half as many again"
        );
        assert_eq!(core.snapshot_stagger_percent, 0);
        assert_eq!(entries_until_a_snapshot_is_due(&mut core), 10);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_snapshot_waits_for_as_much_log_as_the_last_image() {
        let dir = temp_dir("snapshot-log-ratio");
        let mut core = leader_after_a_snapshot(&dir, 100);
        let image_bytes = stored_snapshot_bytes(&core);
        let entry_bytes = entries::machine_entry(Nothing::encode(())).len();
        // The first entry past `snapshot_entries` does not carry as many bytes as the image:
        // the rule holds the snapshot back until the log is as large.
        assert!(entry_bytes < image_bytes, "{entry_bytes} < {image_bytes}");
        let waited = entries_until_a_snapshot_is_due(&mut core);
        assert_eq!(
            waited,
            image_bytes.div_ceil(entry_bytes),
            "entries of {entry_bytes} bytes against an image of {image_bytes}"
        );
        // After a restart the size comes from the snapshot on disk (the leader's no-op of the
        // new term is an empty entry and counts nothing).
        let image_bytes = stored_snapshot_bytes(&core);
        drop(core);
        let mut core = open_leader_with(&dir, 100);
        assert_eq!(
            entries_until_a_snapshot_is_due(&mut core),
            image_bytes.div_ceil(entry_bytes)
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn without_the_log_rule_a_snapshot_is_due_after_snapshot_entries() {
        // The control for the test above: the same cluster with the rule off.
        let dir = temp_dir("snapshot-log-ratio-off");
        let mut core = leader_after_a_snapshot(&dir, 0);
        assert_eq!(entries_until_a_snapshot_is_due(&mut core), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
