//! The simulation of what the server ships: every node runs the server's sans-IO node core
//! (`conclave_server::node::core::NodeCore`) with the real coordination state machine and the
//! leader's duties (`LeaderDuties`: leases and the timer `Tick`), over `MemStorage` or the
//! write-ahead log on a `SimDisk`. One seed drives the network, the nemesis and the clients in
//! virtual time; the checkers run as the run goes and at its end.
//!
//! Clients: key-value clients (puts and reads through the log, reads through ReadIndex on any
//! member) whose per-key histories must be linearizable; a session client whose retries must
//! apply at most once; lease holders that campaign in a priority election group and sometimes
//! fall silent (no lease may end before its TTL after the last keepalive the leader accepted,
//! and no two holders may share a fence); a publisher on a topic with age retention (the
//! leader's timer `Tick` must drop old messages).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt::Write as _;

use bytes::Bytes;
use conclave_raft::{ConfState, Config, Message, MessageBody, NodeId, Prng, Ready, Role};
use conclave_server::Error as NodeError;
use conclave_server::node::core::{
    CoreSettings, NodeCore, NodeStore, Output, ReadyIo, ReadyPoint, Token, TurnEnd,
};
use conclave_server::node::leader_duties::{LeaderDuties, Proposal};
use conclave_state::{
    GroupRegister, PutRequest, RangeRequest, Request, Response, Retention, SessionSeq, StateMachine,
};

use crate::checker::{Checker, Violation};
use crate::lin::{self, RegisterOp, Timed};
use crate::node::{NodeDisk, NodeStorage};
use crate::sim::{BASE_TICK_MS, ELECTION_TICKS, HEARTBEAT_TICKS, SwarmParams, TRACE_TAIL_LINES};

/// Keys the key-value clients use; each key's history is checked on its own.
pub const KV_KEYS: usize = 4;
/// Key-value clients, one operation in flight each.
pub const KV_CLIENTS: usize = 3;
/// Operations one key's history takes at most; clients move to other keys after.
pub const KEY_HISTORY_OPS_MAX: usize = 40;
/// A client gives up on an answer after this long; the operation stays open in the history.
pub const CLIENT_TIMEOUT_MS: u64 = 1_000;
/// Lease holders (each registers as a candidate of the election group).
pub const LEASE_HOLDERS: usize = 2;
/// The TTL lease holders ask for.
pub const LEASE_TTL_MS: u64 = 600;
/// How often a live holder sends a keepalive.
pub const KEEPALIVE_PERIOD_MS: u64 = 150;
/// Per client step, the chance (per mille) that a holder falls silent and lets its lease go.
pub const HOLDER_SILENCE_PER_MILLE: u64 = 10;
/// How old a message on the publisher's topic may get (age retention, needs the timer Tick).
pub const TOPIC_MAX_AGE_MS: u64 = 300;
/// The election group the holders campaign in.
const GROUP: &str = "sim-group";
/// The publisher's topic.
const TOPIC: &str = "sim-topic";

/// A deliberate bug in the node core or its duties, for the negative controls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bug {
    /// The core answers a write when it is proposed, before it is applied.
    AnswerBeforeApply,
    /// The core applies a Ready's committed entries before persisting its entries.
    ApplyBeforePersist,
    /// A follower sends its acknowledgements and votes before persisting what they vouch for.
    SendBeforePersist,
    /// The leader never proposes the state machine's timer `Tick`.
    SkipTick,
    /// A keepalive is answered as soon as the leader renewed it, without confirming in a
    /// ReadIndex round that the node still leads (a deposed leader answers).
    KeepaliveWithoutConfirm,
    /// With lease reads on in every run: a leader's lease never runs out once a quorum
    /// acknowledged one of its rounds (a deposed leader answers reads and keepalives).
    LeaseNeverExpires,
}

impl Bug {
    pub const ALL: [Bug; 6] = [
        Bug::AnswerBeforeApply,
        Bug::ApplyBeforePersist,
        Bug::SendBeforePersist,
        Bug::SkipTick,
        Bug::KeepaliveWithoutConfirm,
        Bug::LeaseNeverExpires,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Bug::AnswerBeforeApply => "answer-before-apply",
            Bug::ApplyBeforePersist => "apply-before-persist",
            Bug::SendBeforePersist => "send-before-persist",
            Bug::SkipTick => "skip-tick",
            Bug::KeepaliveWithoutConfirm => "keepalive-without-confirm",
            Bug::LeaseNeverExpires => "lease-never-expires",
        }
    }
}

type Core = NodeCore<StateMachine, NodeStorage>;

/// One simulated server: the node core and its duties, or nothing while down.
struct CoreNode {
    core: Option<Core>,
    duties: LeaderDuties,
    disk: NodeDisk,
    restarts: u64,
    /// Which client waits on each token of this node's core.
    waiting: BTreeMap<Token, (usize, u64)>,
}

#[derive(Debug, Clone)]
enum Event {
    Tick(NodeId),
    Deliver(Message),
    Nemesis,
    Client,
    Heal,
}

/// An operation a client has in flight.
#[derive(Debug, Clone)]
struct Inflight {
    serial: u64,
    started_ms: u64,
    op: ClientOp,
}

#[derive(Debug, Clone)]
enum ClientOp {
    Put {
        key: usize,
        slot: usize,
    },
    LogGet {
        key: usize,
        slot: usize,
    },
    IndexGet {
        key: usize,
        slot: usize,
    },
    OpenSession {
        secret: u128,
    },
    SessionPut {
        seq: u64,
    },
    Grant {
        index: u64,
    },
    Register,
    /// A keepalive's checkpoint on its way to commit; the confirmation round follows.
    Checkpoint {
        renewal: KeepaliveRenewal,
    },
    /// A keepalive's leadership confirmation (a leader-only ReadIndex round).
    Confirm {
        renewal: KeepaliveRenewal,
    },
    ConfigureTopic,
    Publish,
}

/// A keepalive a node renewed as leader, not answered yet.
#[derive(Debug, Clone, Copy)]
struct KeepaliveRenewal {
    lease: i64,
    requested_ms: u64,
    node: NodeId,
    /// The term the node led when it renewed.
    term: u64,
    /// The newest term any node had been elected leader in at the renewal.
    newest_leader_term: u64,
}

#[derive(Debug, Clone)]
enum ClientRole {
    Kv,
    Session {
        client_id: Option<u64>,
        secret: u128,
        /// The position being written (retried until answered).
        seq: u64,
        /// Whether `seq` was proposed at least once (so it must be finished).
        sent: bool,
        acked: BTreeSet<u64>,
    },
    Holder {
        name: String,
        lease: Option<(i64, u64)>,
        registered: bool,
        last_keepalive_ms: u64,
        /// Silent until this time; the lease is then given up.
        silent_until_ms: Option<u64>,
    },
    Publisher {
        configured: bool,
        last_publish_ms: u64,
    },
}

#[derive(Debug, Clone)]
struct Client {
    role: ClientRole,
    inflight: Option<Inflight>,
    next_serial: u64,
}

/// What the lease checker knows of one lease.
#[derive(Debug, Clone, Copy)]
struct LeaseTrack {
    /// The log index of its grant: a node that applied past it and lacks it saw it end.
    grant_index: u64,
    /// The lease may not end before this virtual time.
    promised_until_ms: u64,
    gone: bool,
}

/// Counters for reports.
#[derive(Debug, Default, Clone)]
pub struct CoreStats {
    pub events: u64,
    pub messages_delivered: u64,
    pub crashes: u64,
    pub ops_acked: u64,
    pub ops_open: u64,
    pub reads_by_index: u64,
    pub session_retries: u64,
    pub leases_expired: u64,
    pub seats_seen: u64,
    pub ticks_applied: u64,
    pub snapshots: u64,
    /// ReadIndex requests leaders answered from their lease (the core's `lease_reads_served`,
    /// summed over every node's runs).
    pub reads_from_lease: u64,
}

/// One run of the node core under faults.
pub struct CoreSimulation {
    pub seed: u64,
    pub params: SwarmParams,
    pub now_ms: u64,
    rng: Prng,
    queue: BTreeMap<(u64, u64), Event>,
    next_seq: u64,
    nodes: BTreeMap<NodeId, CoreNode>,
    blocked: BTreeSet<(NodeId, NodeId)>,
    faults_on: bool,
    bug: Option<Bug>,
    pub checker: Checker,
    pub stats: CoreStats,
    clients: Vec<Client>,
    /// Per key: the register history.
    histories: Vec<Vec<Timed>>,
    /// Slots of definite failures, dropped from the histories before checking.
    dropped: BTreeSet<(usize, usize)>,
    next_value: u64,
    leases: BTreeMap<i64, LeaseTrack>,
    /// The newest term any node has been elected leader in so far.
    newest_leader_term: u64,
    /// Per holder: the member its keepalives go to.
    keepalive_homes: BTreeMap<usize, NodeId>,
    /// Election-group fences ever seen, with their holder.
    fences: BTreeMap<i64, String>,
    trace_tail: VecDeque<String>,
    trace_hash: u64,
    print_trace: bool,
}

/// The core's view of the shell during one turn: messages out, crash points, contract checks.
struct SimIo {
    node: NodeId,
    crash_at: Option<ReadyPoint>,
    sent: Vec<Message>,
    persisted_in_ready: bool,
    persisted: Vec<conclave_raft::Entry>,
    violations: Vec<Violation>,
}

impl ReadyIo for SimIo {
    fn send(&mut self, message: Message) {
        // The Ready contract: persist before send. Only a leader's appends may leave before
        // its own write is durable (the core counts its copy once it is).
        let early = !self.persisted_in_ready && !matches!(message.body, MessageBody::Append { .. });
        if early {
            self.violations.push(Violation {
                invariant: "PersistBeforeSend",
                detail: format!(
                    "node {} sent {:?} to {} before persisting its Ready",
                    self.node, message.body, message.to
                ),
            });
        }
        self.sent.push(message);
    }

    fn reached(&mut self, point: ReadyPoint, ready: &Ready) -> bool {
        match point {
            ReadyPoint::BeforePersist => self.persisted_in_ready = false,
            ReadyPoint::Persisted => {
                self.persisted_in_ready = true;
                self.persisted.extend(ready.entries.iter().cloned());
            }
            ReadyPoint::Applied => {
                // The Ready contract: apply only what step 1 of this or an earlier Ready made
                // durable.
                let new = |index: u64| ready.entries.iter().any(|e| e.index == index);
                let early = !self.persisted_in_ready
                    && (ready.snapshot.is_some()
                        || ready.committed_entries.iter().any(|e| new(e.index)));
                if early {
                    self.violations.push(Violation {
                        invariant: "ReadyOrder",
                        detail: format!(
                            "node {} applied entries of a Ready before persisting them",
                            self.node
                        ),
                    });
                }
                self.persisted_in_ready = false;
            }
            ReadyPoint::BeforeSync | ReadyPoint::Sent => {}
        }
        self.crash_at != Some(point)
    }
}

impl NodeStore for NodeStorage {
    fn apply_snapshot(&mut self, snapshot: conclave_raft::Snapshot) -> Result<(), NodeError> {
        match self {
            NodeStorage::Mem(mem) => {
                mem.apply_snapshot(snapshot);
                Ok(())
            }
            NodeStorage::Wal(wal) => Ok(wal.apply_snapshot(snapshot)?),
        }
    }
    fn append(&mut self, entries: &[conclave_raft::Entry]) -> Result<(), NodeError> {
        match self {
            NodeStorage::Mem(mem) => mem.append(entries),
            NodeStorage::Wal(wal) => {
                wal.append(entries)?;
            }
        }
        Ok(())
    }
    fn set_hard_state(&mut self, hard_state: conclave_raft::HardState) -> Result<(), NodeError> {
        match self {
            NodeStorage::Mem(mem) => mem.set_hard_state(hard_state),
            NodeStorage::Wal(wal) => {
                wal.set_hard_state(hard_state)?;
            }
        }
        Ok(())
    }
    fn sync(&mut self) -> Result<(), NodeError> {
        if let NodeStorage::Wal(wal) = self {
            wal.sync()?;
        }
        Ok(())
    }
    fn needs_sync(&self) -> bool {
        match self {
            NodeStorage::Mem(_) => false,
            NodeStorage::Wal(wal) => wal.needs_sync(),
        }
    }
}

/// The state machine's settings in the simulator: the election timeout of its cores.
fn state_config() -> conclave_state::Config {
    conclave_state::Config {
        election_timeout_ms: ELECTION_TICKS * BASE_TICK_MS,
        lease_checkpoint_interval_ms: 500,
        ..conclave_state::Config::default()
    }
}

fn value_bytes(value: u64) -> Bytes {
    Bytes::from(format!("v{value}"))
}

fn value_of(bytes: &[u8]) -> u64 {
    std::str::from_utf8(bytes)
        .ok()
        .and_then(|s| s.strip_prefix('v'))
        .and_then(|s| s.parse().ok())
        .unwrap_or(u64::MAX)
}

fn key_name(key: usize) -> Bytes {
    Bytes::from(format!("k{key}"))
}

fn session_key(client_id: u64, seq: u64) -> Bytes {
    Bytes::from(format!("once/{client_id}/{seq}"))
}

/// Whether an error at proposal time means the command never entered any log.
fn refused_outright(error: &NodeError) -> bool {
    matches!(
        error,
        NodeError::NotLeader { .. } | NodeError::NoLeader | NodeError::TooManyRequests
    )
}

impl CoreSimulation {
    pub fn new(seed: u64, mut params: SwarmParams, bug: Option<Bug>) -> Self {
        if bug == Some(Bug::LeaseNeverExpires) {
            params.check_quorum = true;
            params.lease_reads = true;
        }
        let mut sim = CoreSimulation {
            seed,
            now_ms: 0,
            rng: Prng::new(seed ^ 0xC0DE_C0DE),
            queue: BTreeMap::new(),
            next_seq: 0,
            nodes: BTreeMap::new(),
            blocked: BTreeSet::new(),
            faults_on: true,
            bug,
            checker: Checker::default(),
            stats: CoreStats::default(),
            clients: Vec::new(),
            histories: vec![Vec::new(); KV_KEYS],
            dropped: BTreeSet::new(),
            next_value: 1,
            leases: BTreeMap::new(),
            newest_leader_term: 0,
            keepalive_homes: BTreeMap::new(),
            fences: BTreeMap::new(),
            trace_tail: VecDeque::new(),
            trace_hash: 0xcbf2_9ce4_8422_2325,
            print_trace: false,
            params,
        };
        let voters: Vec<NodeId> = (1..=sim.params.nodes as u64).collect();
        for &id in &voters {
            let disk_seed = seed.wrapping_mul(31).wrapping_add(id);
            let founding = Some(ConfState::with_voters(voters.clone()));
            let disk = match NodeDisk::new(sim.params.storage, disk_seed, founding) {
                Ok(disk) => disk,
                Err(e) => panic!("cannot create the disk of simulated node {id}: {e}"),
            };
            sim.nodes.insert(
                id,
                CoreNode {
                    core: None,
                    duties: LeaderDuties::new(&state_config()),
                    disk,
                    restarts: 0,
                    waiting: BTreeMap::new(),
                },
            );
            sim.start_node(id);
            let tick = sim.tick_period(id);
            let first = sim.rng.range(1, tick + 1);
            sim.schedule(first, Event::Tick(id));
        }
        for _ in 0..KV_CLIENTS {
            sim.add_client(ClientRole::Kv);
        }
        let secret = (u128::from(sim.rng.next_u64()) << 64 | u128::from(sim.rng.next_u64())) | 1;
        sim.add_client(ClientRole::Session {
            client_id: None,
            secret,
            seq: 1,
            sent: false,
            acked: BTreeSet::new(),
        });
        for i in 0..LEASE_HOLDERS {
            sim.add_client(ClientRole::Holder {
                name: format!("holder-{i}"),
                lease: None,
                registered: false,
                last_keepalive_ms: 0,
                silent_until_ms: None,
            });
        }
        sim.add_client(ClientRole::Publisher {
            configured: false,
            last_publish_ms: 0,
        });
        sim.schedule(1, Event::Nemesis);
        sim.schedule(1, Event::Client);
        sim.schedule(sim.params.fault_phase_ms, Event::Heal);
        sim
    }

    fn add_client(&mut self, role: ClientRole) {
        self.clients.push(Client {
            role,
            inflight: None,
            next_serial: 1,
        });
    }

    fn raft_config(&self, id: NodeId, restarts: u64) -> Config {
        let mut config = Config::new(id);
        config.election_ticks = ELECTION_TICKS;
        config.heartbeat_ticks = HEARTBEAT_TICKS;
        config.seed = self
            .seed
            .wrapping_mul(1_000_003)
            .wrapping_add(id)
            .wrapping_add(restarts.wrapping_mul(0x9E37_79B9));
        config.pre_vote = self.params.pre_vote;
        config.check_quorum = self.params.check_quorum;
        config.max_inflight_appends = self.params.max_inflight_appends;
        config.max_append_bytes = self.params.max_append_bytes;
        config.snapshot_chunk_bytes = 512;
        config.replicate_to_quorum_first = self.params.quorum_first;
        config.defer_commit_notice = self.params.defer_commit_notice;
        // The control for a lease that never runs out keeps every member on the lease: the
        // members started without it would only make the stale read rarer.
        let lease_reads = self.params.lease_reads_at_start(self.seed, id, restarts)
            || (self.params.lease_reads && self.bug == Some(Bug::LeaseNeverExpires));
        config.lease_read_ms = if lease_reads {
            self.params.lease_read_ms()
        } else {
            0
        };
        config.bugs.lease_never_expires = self.bug == Some(Bug::LeaseNeverExpires);
        config
    }

    /// Boots node `id` from its disk: the core restores the machine from the snapshot.
    fn start_node(&mut self, id: NodeId) -> bool {
        let restarts = self.nodes[&id].restarts;
        let config = self.raft_config(id, restarts);
        let settings = CoreSettings {
            proposals_inflight_max: 10_000,
            reads_inflight_max: 10_000,
            snapshot_entries: self.params.snapshot_every,
            // The server's rule on the seeds that snapshot every 10 entries; entries alone on
            // the others, so that snapshots stay frequent there.
            snapshot_log_percent: if self.params.snapshot_every == 10 {
                conclave_server::config::DEFAULT_SNAPSHOT_LOG_PERCENT
            } else {
                0
            },
        };
        let now = self.now_ms;
        let bug = self.bug;
        let node = self.nodes.get_mut(&id).expect("node exists");
        let opened = node.disk.open().and_then(|store| {
            NodeCore::open(
                settings,
                config,
                store,
                StateMachine::new(state_config()),
                Vec::new(),
                now,
            )
            .map_err(|e| e.to_string())
        });
        let mut core = match opened {
            Ok(core) => core,
            Err(e) => {
                self.checker.violations.push(Violation {
                    invariant: "Durability(storage)",
                    detail: format!("node {id} cannot restart: {e}"),
                });
                return false;
            }
        };
        core.bugs.answer_before_apply = bug == Some(Bug::AnswerBeforeApply);
        core.bugs.apply_before_persist = bug == Some(Bug::ApplyBeforePersist);
        core.bugs.send_before_persist = bug == Some(Bug::SendBeforePersist);
        node.duties = LeaderDuties::new(&state_config());
        node.duties.skip_tick = bug == Some(Bug::SkipTick);
        node.restarts += 1;
        node.waiting.clear();
        let hard_state = core.raw().hard_state();
        core.start(&mut node.duties);
        node.core = Some(core);
        self.checker.check_restart(id, hard_state);
        self.checker
            .observe_role(id, Role::Follower, hard_state.term);
        true
    }

    fn tick_period(&self, id: NodeId) -> u64 {
        self.params
            .tick_ms
            .get(id as usize - 1)
            .copied()
            .unwrap_or(BASE_TICK_MS)
    }

    fn schedule(&mut self, delay_ms: u64, event: Event) {
        self.next_seq += 1;
        self.queue
            .insert((self.now_ms + delay_ms, self.next_seq), event);
    }

    fn trace(&mut self, line: String) {
        for b in line.as_bytes() {
            self.trace_hash ^= *b as u64;
            self.trace_hash = self.trace_hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
        self.trace_hash ^= b'\n' as u64;
        if self.trace_tail.len() == TRACE_TAIL_LINES {
            self.trace_tail.pop_front();
        }
        let line = format!("{:>7}ms {line}", self.now_ms);
        if self.print_trace {
            eprintln!("{line}");
        }
        self.trace_tail.push_back(line);
    }

    /// Prints every trace line to stderr as the run goes (`conclave-sim --seed N --trace`).
    pub fn print_trace(&mut self, on: bool) {
        self.print_trace = on;
    }

    pub fn trace_hash(&self) -> u64 {
        self.trace_hash
    }

    pub fn trace_tail(&self) -> Vec<String> {
        self.trace_tail.iter().cloned().collect()
    }

    pub fn violations(&self) -> &[Violation] {
        &self.checker.violations
    }

    fn fail(&mut self, invariant: &'static str, detail: String) {
        self.checker
            .violations
            .push(Violation { invariant, detail });
    }

    /// Runs the seed: fault phase, heal, then until converged (or the liveness bound), then
    /// the history checks. Returns false on any violation.
    pub fn run(&mut self) -> bool {
        let end = self.params.fault_phase_ms + self.params.liveness_bound_ms;
        let mut converged = false;
        while self.now_ms < end && self.checker.violations.is_empty() {
            if self.now_ms > self.params.fault_phase_ms && self.converged() {
                converged = true;
                break;
            }
            if !self.step_once() {
                break;
            }
        }
        self.stats.reads_from_lease += self
            .nodes
            .values()
            .filter_map(|node| node.core.as_ref())
            .map(|core| core.raw().lease_reads_served())
            .sum::<u64>();
        if self.checker.violations.is_empty() && !converged {
            let detail = format!(
                "within {} ms of healing: no single leader with every member caught up, every \
                 client answered and no machine timer overdue; {}",
                self.params.liveness_bound_ms,
                self.describe_short()
            );
            self.fail("Liveness", detail);
        }
        if self.checker.violations.is_empty() {
            self.check_histories();
        }
        if self.checker.violations.is_empty() {
            self.check_sessions();
        }
        self.checker.violations.is_empty()
    }

    fn step_once(&mut self) -> bool {
        let Some(((at, _), event)) = self.queue.pop_first() else {
            return false;
        };
        self.now_ms = at;
        self.stats.events += 1;
        match event {
            Event::Tick(id) => {
                if let Some(core) = self.nodes.get_mut(&id).and_then(|n| n.core.as_mut()) {
                    core.set_time(at);
                    core.set_awaited(SwarmParams::awaited_at(self.seed, id, at));
                    core.tick();
                }
                self.turn(id);
                let period = self.tick_period(id);
                self.schedule(period, Event::Tick(id));
            }
            Event::Deliver(m) => self.deliver(m),
            Event::Nemesis => {
                if self.faults_on {
                    self.nemesis();
                    self.schedule(self.params.nemesis_period_ms, Event::Nemesis);
                }
            }
            Event::Client => {
                self.client_step();
                self.schedule(20, Event::Client);
            }
            Event::Heal => {
                self.trace("heal: restart all, reconnect all, reliable network".into());
                self.faults_on = false;
                self.blocked.clear();
                let down: Vec<NodeId> = self
                    .nodes
                    .iter()
                    .filter(|(_, n)| n.core.is_none())
                    .map(|(&id, _)| id)
                    .collect();
                for id in down {
                    self.restart(id);
                }
            }
        }
        true
    }

    // ---- the network -----------------------------------------------------------------------

    fn send(&mut self, m: Message) {
        if let MessageBody::VoteResponse {
            pre: false,
            granted: true,
        } = m.body
        {
            self.checker.observe_vote(m.from, m.term, m.to);
        }
        if self.blocked.contains(&(m.from, m.to)) {
            return;
        }
        if self.faults_on && self.rng.range(0, 1000) < self.params.drop_per_mille {
            return;
        }
        let copies = if self.faults_on && self.rng.range(0, 1000) < self.params.duplicate_per_mille
        {
            2
        } else {
            1
        };
        for _ in 0..copies {
            let delay =
                if self.faults_on && self.rng.range(0, 1000) < self.params.long_delay_per_mille {
                    self.rng.range(1, self.params.long_delay_max_ms + 1)
                } else {
                    self.rng.range(1, self.params.delay_max_ms.max(1) + 1)
                };
            self.schedule(delay, Event::Deliver(m.clone()));
        }
    }

    fn deliver(&mut self, m: Message) {
        if self.blocked.contains(&(m.from, m.to)) {
            return;
        }
        let to = m.to;
        let Some(core) = self.nodes.get_mut(&to).and_then(|n| n.core.as_mut()) else {
            return;
        };
        self.stats.messages_delivered += 1;
        let line = format!("{} -> {} t{} {}", m.from, m.to, m.term, m.body.name());
        core.set_time(self.now_ms);
        core.step(m);
        self.trace(line);
        self.turn(to);
    }

    // ---- nodes -----------------------------------------------------------------------------

    fn crash(&mut self, id: NodeId) {
        let Some(node) = self.nodes.get_mut(&id) else {
            return;
        };
        let Some(core) = node.core.take() else {
            return;
        };
        self.stats.reads_from_lease += core.raw().lease_reads_served();
        match &mut node.disk {
            // Whatever reached the store survives: MemStorage writes are durable at once.
            NodeDisk::Mem(disk) => {
                if let NodeStorage::Mem(mem) = core.raw().store() {
                    *disk = mem.clone();
                }
            }
            NodeDisk::Wal(disk) => {
                drop(core);
                // Unsynced bytes are lost; the last write may be torn.
                disk.crash();
            }
        }
        // Everything the node was to answer is lost with it: those clients time out.
        node.waiting.clear();
        self.stats.crashes += 1;
        self.trace(format!("crash {id}"));
    }

    fn restart(&mut self, id: NodeId) {
        if self.nodes.get(&id).is_none_or(|n| n.core.is_some()) {
            return;
        }
        if self.start_node(id) {
            self.trace(format!("restart {id}"));
            self.turn(id);
        }
    }

    /// Runs one turn of node `id`'s core: duties, Readies, then the answers and a snapshot.
    fn turn(&mut self, id: NodeId) {
        let crash_roll = self.rng.range(0, 1000);
        let point_roll = self.rng.range(0, 5);
        let crash_at =
            (self.faults_on && crash_roll < self.params.crash_in_ready_per_mille).then(|| {
                [
                    ReadyPoint::BeforePersist,
                    ReadyPoint::BeforeSync,
                    ReadyPoint::Persisted,
                    ReadyPoint::Sent,
                    ReadyPoint::Applied,
                ][point_roll as usize]
            });
        let now = self.now_ms;
        let Some(node) = self.nodes.get_mut(&id) else {
            return;
        };
        let Some(core) = node.core.as_mut() else {
            return;
        };
        core.set_time(now);
        let before = (core.role(), core.raw().term());
        let mut io = SimIo {
            node: id,
            crash_at,
            sent: Vec::new(),
            persisted_in_ready: false,
            persisted: Vec::new(),
            violations: Vec::new(),
        };
        let end = core.turn(&mut node.duties, &mut io);
        let outputs = core.take_outputs();
        let _ = core.take_members_changed();
        let _ = node.duties.take_events();
        let after = (core.role(), core.raw().term(), core.raw().commit_index());
        self.checker.violations.append(&mut io.violations);
        if !io.persisted.is_empty() {
            self.checker.observe_persisted(id, &io.persisted, None);
        }
        for m in io.sent {
            self.send(m);
        }
        match end {
            Ok(TurnEnd::Done) => {}
            Ok(TurnEnd::Stopped) => {
                self.trace(format!("crash {id} while handling a Ready ({crash_at:?})"));
                self.crash(id);
                return;
            }
            Err(error) => {
                self.fail(
                    "Durability(storage)",
                    format!("node {id} stopped on a storage error: {error}"),
                );
                self.crash(id);
                return;
            }
        }
        self.checker.observe_role(id, after.0, after.1);
        if after.0 == Role::Leader {
            self.newest_leader_term = self.newest_leader_term.max(after.1);
        }
        self.checker.observe_commit(after.2);
        if after.0 == Role::Leader && (before.0 != Role::Leader || before.1 != after.1) {
            self.trace(format!("{id} leads term {}", after.1));
        }
        for output in outputs {
            self.on_output(id, output);
        }
        self.maybe_snapshot(id);
        self.observe_machine(id);
    }

    fn maybe_snapshot(&mut self, id: NodeId) {
        let Some(core) = self.nodes.get_mut(&id).and_then(|n| n.core.as_mut()) else {
            return;
        };
        let plan = match core.snapshot_due() {
            Ok(Some(plan)) => plan,
            Ok(None) => return,
            Err(error) => {
                let detail = format!("node {id} cannot plan a snapshot: {error}");
                self.fail("Durability(storage)", detail);
                return;
            }
        };
        let index = plan.meta.index;
        // Encoded at once here; the real shell does it on a helper thread while it applies on,
        // which `conclave_state`'s tests show gives the same bytes.
        let data = plan.data.encode();
        let image_bytes = data.len() as u64;
        let recorded = core.snapshot_written(index, image_bytes, |store| match store {
            NodeStorage::Mem(mem) => {
                mem.create_snapshot(index, plan.meta.conf_state, data);
                Ok(())
            }
            NodeStorage::Wal(wal) => Ok(wal.create_snapshot(index, plan.meta.conf_state, data)?),
        });
        match recorded {
            Ok(_) => self.stats.snapshots += 1,
            Err(error) => {
                let detail = format!("node {id} failed to record a snapshot: {error}");
                self.fail("Durability(storage)", detail);
            }
        }
    }

    /// The lease and election-group checks against what node `id` has applied.
    fn observe_machine(&mut self, id: NodeId) {
        let Some(core) = self.nodes.get(&id).and_then(|n| n.core.as_ref()) else {
            return;
        };
        let applied = core.applied_index();
        let machine = core.machine();
        let mut failures = Vec::new();
        for (&lease, track) in self.leases.iter_mut() {
            if track.gone || applied < track.grant_index || machine.lease(lease).is_some() {
                continue;
            }
            track.gone = true;
            self.stats.leases_expired += 1;
            if self.now_ms < track.promised_until_ms {
                failures.push((
                    "LeaseSafety",
                    format!(
                        "node {id} saw lease {lease} end at {} ms, before {} ms (its last \
                         accepted keepalive + TTL)",
                        self.now_ms, track.promised_until_ms
                    ),
                ));
            }
        }
        if let Some(seat) = machine.group_leader(GROUP) {
            match self.fences.get(&seat.fence) {
                Some(holder) if *holder != seat.leader => failures.push((
                    "GroupSafety",
                    format!(
                        "fence {} held by {holder} and by {} (node {id})",
                        seat.fence, seat.leader
                    ),
                )),
                Some(_) => {}
                None => {
                    self.stats.seats_seen += 1;
                    self.fences.insert(seat.fence, seat.leader.clone());
                }
            }
            let lease = machine
                .group(GROUP)
                .and_then(|g| g.candidates.get(&seat.leader))
                .map(|c| c.lease_id);
            if lease.is_none_or(|l| machine.lease(l).is_none()) {
                failures.push((
                    "GroupSafety",
                    format!(
                        "node {id}: {} holds the seat without a registration and a live lease",
                        seat.leader
                    ),
                ));
            }
        }
        drop(machine);
        for (invariant, detail) in failures {
            self.fail(invariant, detail);
        }
    }

    // ---- answers ---------------------------------------------------------------------------

    fn on_output(&mut self, id: NodeId, output: Output<conclave_state::ApplyOutput>) {
        let token = match &output {
            Output::Settled { token, .. } | Output::ReadReady { token, .. } => *token,
        };
        let Some(node) = self.nodes.get_mut(&id) else {
            return;
        };
        let Some((client, serial)) = node.waiting.remove(&token) else {
            return;
        };
        let Some(inflight) = self.clients[client].inflight.clone() else {
            return;
        };
        if inflight.serial != serial {
            return;
        }
        match output {
            Output::Settled { result, .. } => {
                let result = result.map(|a| a.map(|applied| applied.output.result));
                self.settled(client, inflight, result);
            }
            Output::ReadReady { result, .. } => self.read_ready(client, id, inflight, result),
        }
    }

    /// A proposal settled: `Ok(None)` is an answer without an output (a member record, or a
    /// buggy core's early answer).
    fn settled(
        &mut self,
        client: usize,
        inflight: Inflight,
        result: Result<Option<conclave_state::Result<Response>>, NodeError>,
    ) {
        self.clients[client].inflight = None;
        let now = self.now_ms;
        match (&inflight.op, result) {
            (ClientOp::Put { key, slot }, Ok(_)) => {
                self.histories[*key][*slot].returned_ms = Some(now);
                self.stats.ops_acked += 1;
            }
            (ClientOp::LogGet { key, slot }, Ok(Some(Ok(Response::Range(range))))) => {
                let value = range.kvs.first().map_or(0, |kv| value_of(&kv.value));
                self.histories[*key][*slot].op = RegisterOp::Get(value);
                self.histories[*key][*slot].returned_ms = Some(now);
                self.stats.ops_acked += 1;
            }
            (ClientOp::LogGet { key, slot }, _) => {
                self.dropped.insert((*key, *slot));
            }
            (ClientOp::Put { .. }, Err(_)) => self.stats.ops_open += 1,
            (ClientOp::OpenSession { .. }, Ok(Some(Ok(Response::SessionOpened { client_id })))) => {
                if let ClientRole::Session { client_id: id, .. } = &mut self.clients[client].role {
                    *id = Some(client_id);
                }
            }
            (ClientOp::SessionPut { seq }, Ok(Some(Ok(_)))) => {
                if let ClientRole::Session {
                    seq: next,
                    acked,
                    sent,
                    ..
                } = &mut self.clients[client].role
                {
                    acked.insert(*seq);
                    *next = seq + 1;
                    *sent = false;
                }
            }
            (ClientOp::SessionPut { .. }, Ok(Some(Err(_)))) => {
                // The session is gone (expired): start another.
                if let ClientRole::Session {
                    client_id, sent, ..
                } = &mut self.clients[client].role
                {
                    *client_id = None;
                    *sent = false;
                }
            }
            (ClientOp::Grant { index }, Ok(Some(Ok(Response::LeaseGranted { id, ttl_ms })))) => {
                self.leases.insert(
                    id,
                    LeaseTrack {
                        grant_index: *index,
                        promised_until_ms: inflight.started_ms + ttl_ms,
                        gone: false,
                    },
                );
                if let ClientRole::Holder {
                    lease,
                    last_keepalive_ms,
                    ..
                } = &mut self.clients[client].role
                {
                    *lease = Some((id, ttl_ms));
                    *last_keepalive_ms = now;
                }
            }
            (ClientOp::Register, Ok(Some(Ok(_)))) => {
                if let ClientRole::Holder { registered, .. } = &mut self.clients[client].role {
                    *registered = true;
                }
            }
            (ClientOp::Checkpoint { renewal }, Ok(_)) => self.confirm(client, *renewal),
            (ClientOp::ConfigureTopic, Ok(Some(Ok(_)))) => {
                if let ClientRole::Publisher { configured, .. } = &mut self.clients[client].role {
                    *configured = true;
                }
            }
            _ => {}
        }
    }

    /// Asks the renewing node to confirm, in a leader-only ReadIndex round, that it still
    /// leads; the keepalive is answered (promised) once it has.
    fn confirm(&mut self, client: usize, renewal: KeepaliveRenewal) {
        if self.bug == Some(Bug::KeepaliveWithoutConfirm) {
            self.promise(renewal);
            return;
        }
        let now = self.now_ms;
        let Some(core) = self
            .nodes
            .get_mut(&renewal.node)
            .and_then(|n| n.core.as_mut())
        else {
            return;
        };
        let Ok(token) = core.read_index_as_leader(renewal.term) else {
            return;
        };
        let serial = self.clients[client].next_serial;
        self.clients[client].next_serial += 1;
        if let Some(n) = self.nodes.get_mut(&renewal.node) {
            n.waiting.insert(token, (client, serial));
        }
        self.clients[client].inflight = Some(Inflight {
            serial,
            started_ms: now,
            op: ClientOp::Confirm { renewal },
        });
    }

    /// A keepalive was answered: its lease may not end before its request time + TTL, and
    /// the node that answered must not have been deposed already when it renewed (a later
    /// leader may have resumed the lease at an earlier deadline).
    fn promise(&mut self, renewal: KeepaliveRenewal) {
        let KeepaliveRenewal {
            lease,
            requested_ms,
            ..
        } = renewal;
        if renewal.term < renewal.newest_leader_term {
            self.fail(
                "KeepaliveLeadership",
                format!(
                    "node {} answered a keepalive of lease {lease} renewed at {requested_ms} ms \
                     as leader of term {}, when term {} already had a leader",
                    renewal.node, renewal.term, renewal.newest_leader_term
                ),
            );
        }
        let ttl = self.clients.iter().find_map(|c| match &c.role {
            ClientRole::Holder {
                lease: Some((id, ttl)),
                ..
            } if *id == lease => Some(*ttl),
            _ => None,
        });
        if let (Some(track), Some(ttl)) = (self.leases.get_mut(&lease), ttl) {
            track.promised_until_ms = track.promised_until_ms.max(requested_ms + ttl);
            let line = format!("lease {lease} promised until {}", track.promised_until_ms);
            self.trace(line);
        }
    }

    fn read_ready(
        &mut self,
        client: usize,
        id: NodeId,
        inflight: Inflight,
        result: Result<(), NodeError>,
    ) {
        self.clients[client].inflight = None;
        if let ClientOp::Confirm { renewal } = inflight.op {
            // A failed round: the holder's etcd client would retry on the new leader.
            if result.is_ok() {
                self.promise(renewal);
            }
            return;
        }
        let ClientOp::IndexGet { key, slot } = inflight.op else {
            return;
        };
        if result.is_err() {
            self.dropped.insert((key, slot));
            return;
        }
        let Some(core) = self.nodes.get(&id).and_then(|n| n.core.as_ref()) else {
            self.dropped.insert((key, slot));
            return;
        };
        let value = core
            .machine()
            .kv()
            .get(&key_name(key))
            .map_or(0, |kv| value_of(&kv.value));
        self.histories[key][slot].op = RegisterOp::Get(value);
        self.histories[key][slot].returned_ms = Some(self.now_ms);
        self.stats.reads_by_index += 1;
        self.stats.ops_acked += 1;
    }

    // ---- clients ---------------------------------------------------------------------------

    /// A node that believes it leads (at random among them), else any live node.
    fn pick_node(&mut self) -> Option<NodeId> {
        let leaders: Vec<NodeId> = self
            .nodes
            .iter()
            .filter(|(_, n)| n.core.as_ref().is_some_and(|c| c.role() == Role::Leader))
            .map(|(&id, _)| id)
            .collect();
        if !leaders.is_empty() && self.rng.range(0, 10) != 0 {
            return Some(leaders[self.rng.range(0, leaders.len() as u64) as usize]);
        }
        let up: Vec<NodeId> = self
            .nodes
            .iter()
            .filter(|(_, n)| n.core.is_some())
            .map(|(&id, _)| id)
            .collect();
        (!up.is_empty()).then(|| up[self.rng.range(0, up.len() as u64) as usize])
    }

    fn client_step(&mut self) {
        for client in 0..self.clients.len() {
            if let Some(inflight) = &self.clients[client].inflight {
                if self.now_ms < inflight.started_ms + CLIENT_TIMEOUT_MS {
                    continue;
                }
                // No answer in time: the operation stays open (it may still happen).
                let inflight = inflight.clone();
                self.clients[client].inflight = None;
                if let ClientOp::LogGet { key, slot } | ClientOp::IndexGet { key, slot } =
                    inflight.op
                {
                    self.dropped.insert((key, slot));
                }
                if let ClientOp::Put { .. } = inflight.op {
                    self.stats.ops_open += 1;
                }
                if let ClientOp::SessionPut { .. } = inflight.op {
                    self.stats.session_retries += 1;
                }
            }
            if self.rng.range(0, 3) != 0 {
                continue;
            }
            self.client_act(client);
        }
    }

    fn client_act(&mut self, client: usize) {
        let now = self.now_ms;
        let faults_on = self.faults_on;
        let op = match self.clients[client].role.clone() {
            ClientRole::Kv => {
                if !faults_on {
                    return;
                }
                let open: Vec<usize> = (0..KV_KEYS)
                    .filter(|&k| self.histories[k].len() < KEY_HISTORY_OPS_MAX)
                    .collect();
                if open.is_empty() {
                    return;
                }
                let key = open[self.rng.range(0, open.len() as u64) as usize];
                let slot = self.histories[key].len();
                let kind = self.rng.range(0, 3);
                let op = match kind {
                    0 => {
                        let value = self.next_value;
                        self.next_value += 1;
                        RegisterOp::Put(value)
                    }
                    _ => RegisterOp::Get(0),
                };
                self.histories[key].push(Timed {
                    op,
                    called_ms: now,
                    returned_ms: None,
                });
                match kind {
                    0 => ClientOp::Put { key, slot },
                    1 => ClientOp::LogGet { key, slot },
                    _ => ClientOp::IndexGet { key, slot },
                }
            }
            ClientRole::Session {
                client_id, secret, ..
            } if client_id.is_none() => {
                if !faults_on {
                    return;
                }
                ClientOp::OpenSession { secret }
            }
            ClientRole::Session { seq, sent, .. } => {
                // Past the fault phase only a position already sent is finished.
                if !faults_on && !sent {
                    return;
                }
                if let ClientRole::Session { sent, .. } = &mut self.clients[client].role {
                    *sent = true;
                }
                ClientOp::SessionPut { seq }
            }
            ClientRole::Holder {
                lease,
                registered,
                last_keepalive_ms,
                silent_until_ms,
                ..
            } => {
                if let Some(until) = silent_until_ms {
                    if now < until {
                        return;
                    }
                    if let ClientRole::Holder {
                        lease,
                        registered,
                        silent_until_ms,
                        ..
                    } = &mut self.clients[client].role
                    {
                        *lease = None;
                        *registered = false;
                        *silent_until_ms = None;
                    }
                    return;
                }
                if !faults_on {
                    return;
                }
                match lease {
                    None => ClientOp::Grant { index: 0 },
                    Some((id, ttl)) => {
                        if self.rng.range(0, 1000) < HOLDER_SILENCE_PER_MILLE {
                            if let ClientRole::Holder {
                                silent_until_ms, ..
                            } = &mut self.clients[client].role
                            {
                                *silent_until_ms = Some(now + 3 * ttl);
                            }
                            self.trace(format!("holder {client} falls silent"));
                            return;
                        }
                        if !registered {
                            ClientOp::Register
                        } else if now >= last_keepalive_ms + KEEPALIVE_PERIOD_MS {
                            self.keepalive(client, id);
                            return;
                        } else {
                            return;
                        }
                    }
                }
            }
            ClientRole::Publisher {
                configured,
                last_publish_ms,
            } => {
                if !faults_on {
                    return;
                }
                if !configured {
                    ClientOp::ConfigureTopic
                } else if now >= last_publish_ms + 100 {
                    if let ClientRole::Publisher {
                        last_publish_ms, ..
                    } = &mut self.clients[client].role
                    {
                        *last_publish_ms = now;
                    }
                    ClientOp::Publish
                } else {
                    return;
                }
            }
        };
        self.start_op(client, op);
    }

    /// The request a client operation proposes.
    fn request_for(&self, client: usize, op: &ClientOp) -> Option<Proposal> {
        let plain = |request| {
            Some(Proposal {
                request,
                session: None,
            })
        };
        match op {
            ClientOp::Put { key, slot } => {
                let RegisterOp::Put(value) = self.histories[*key][*slot].op else {
                    return None;
                };
                plain(Request::Put(PutRequest::new(
                    key_name(*key),
                    value_bytes(value),
                )))
            }
            ClientOp::LogGet { key, .. } => {
                plain(Request::Range(RangeRequest::key(key_name(*key))))
            }
            ClientOp::IndexGet { .. } | ClientOp::Checkpoint { .. } | ClientOp::Confirm { .. } => {
                None
            }
            ClientOp::OpenSession { secret } => {
                plain(Request::OpenSessionWithSecret { secret: *secret })
            }
            ClientOp::SessionPut { seq } => {
                let ClientRole::Session {
                    client_id: Some(client_id),
                    secret,
                    ..
                } = self.clients[client].role
                else {
                    return None;
                };
                Some(Proposal {
                    request: Request::Put(PutRequest::new(session_key(client_id, *seq), "x")),
                    session: Some(SessionSeq {
                        client_id,
                        seq: *seq,
                        secret,
                    }),
                })
            }
            ClientOp::Grant { .. } => plain(Request::LeaseGrant {
                id: 0,
                ttl_ms: LEASE_TTL_MS,
            }),
            ClientOp::Register => {
                let ClientRole::Holder {
                    name,
                    lease: Some((lease, _)),
                    ..
                } = &self.clients[client].role
                else {
                    return None;
                };
                plain(Request::GroupRegister(GroupRegister {
                    group: GROUP.into(),
                    candidate: name.clone(),
                    priority: client as i64 % 2,
                    value: Bytes::from(name.clone()),
                    lease_id: *lease,
                    preempt: false,
                }))
            }
            ClientOp::ConfigureTopic => plain(Request::TopicConfigure {
                topic: TOPIC.into(),
                retention: Retention {
                    max_messages: None,
                    max_age_ms: Some(TOPIC_MAX_AGE_MS),
                },
            }),
            ClientOp::Publish => plain(Request::Publish {
                topic: TOPIC.into(),
                data: Bytes::from_static(b"m"),
            }),
        }
    }

    fn start_op(&mut self, client: usize, mut op: ClientOp) {
        let Some(node) = self.pick_node() else {
            if let ClientOp::Put { key, slot }
            | ClientOp::LogGet { key, slot }
            | ClientOp::IndexGet { key, slot } = op
            {
                self.dropped.insert((key, slot));
            }
            return;
        };
        let serial = self.clients[client].next_serial;
        self.clients[client].next_serial += 1;
        let proposal = self.request_for(client, &op);
        let now = self.now_ms;
        let core = self
            .nodes
            .get_mut(&node)
            .and_then(|n| n.core.as_mut())
            .expect("picked a live node");
        core.set_time(now);
        let result = match (&op, proposal) {
            (ClientOp::IndexGet { .. }, _) => core.read_index(),
            (_, Some(proposal)) => core.propose(proposal),
            (_, None) => return,
        };
        if let ClientOp::Grant { index } = &mut op {
            *index = core.last_index();
        }
        match result {
            Ok(token) => {
                let n = self.nodes.get_mut(&node).expect("node exists");
                n.waiting.insert(token, (client, serial));
                self.clients[client].inflight = Some(Inflight {
                    serial,
                    started_ms: now,
                    op,
                });
            }
            Err(error) => {
                if let ClientOp::Put { key, slot }
                | ClientOp::LogGet { key, slot }
                | ClientOp::IndexGet { key, slot } = op
                    && refused_outright(&error)
                {
                    self.dropped.insert((key, slot));
                }
            }
        }
        self.turn(node);
    }

    /// A holder's keepalive, served by the leader's lease duty. Like an etcd client's stream,
    /// it stays on the member it last used while that member believes it leads (so a holder
    /// keeps talking to a leader a partition has deposed).
    fn keepalive(&mut self, client: usize, lease: i64) {
        let home = self.keepalive_homes.get(&client).copied().filter(|id| {
            self.nodes
                .get(id)
                .and_then(|n| n.core.as_ref())
                .is_some_and(|c| c.role() == Role::Leader)
        });
        let Some(node) = home.or_else(|| self.pick_node()) else {
            return;
        };
        self.keepalive_homes.insert(client, node);
        let now = self.now_ms;
        let Some(n) = self.nodes.get_mut(&node) else {
            return;
        };
        let Some(core) = n.core.as_mut() else { return };
        core.set_time(now);
        let term = core.raw().term();
        let renewal = n.duties.lease_renew(core, lease);
        if let ClientRole::Holder {
            last_keepalive_ms, ..
        } = &mut self.clients[client].role
        {
            *last_keepalive_ms = now;
        }
        let pending = KeepaliveRenewal {
            lease,
            requested_ms: now,
            node,
            term,
            newest_leader_term: self.newest_leader_term,
        };
        let line = format!("keepalive of lease {lease} at {node}: {renewal:?}");
        self.trace(line);
        match renewal {
            Ok(Some(renewal)) => match renewal.checkpoint {
                None => self.confirm(client, pending),
                Some(token) => {
                    let serial = self.clients[client].next_serial;
                    self.clients[client].next_serial += 1;
                    if let Some(n) = self.nodes.get_mut(&node) {
                        n.waiting.insert(token, (client, serial));
                    }
                    self.clients[client].inflight = Some(Inflight {
                        serial,
                        started_ms: now,
                        op: ClientOp::Checkpoint { renewal: pending },
                    });
                }
            },
            Ok(None) => {
                // The leader says the lease is gone: start over.
                if let ClientRole::Holder {
                    lease, registered, ..
                } = &mut self.clients[client].role
                {
                    *lease = None;
                    *registered = false;
                }
            }
            Err(_) => {}
        }
        self.turn(node);
    }

    // ---- the nemesis -----------------------------------------------------------------------

    fn nemesis(&mut self) {
        let ids: Vec<NodeId> = self.nodes.keys().copied().collect();
        if self.rng.range(0, 1000) < self.params.crash_per_mille {
            let victim = ids[self.rng.range(0, ids.len() as u64) as usize];
            self.crash(victim);
            return;
        }
        if self.rng.range(0, 1000) < self.params.leader_crash_per_mille / 4 {
            let leader = self
                .nodes
                .iter()
                .find(|(_, n)| n.core.as_ref().is_some_and(|c| c.role() == Role::Leader))
                .map(|(&id, _)| id);
            if let Some(leader) = leader {
                self.crash(leader);
                return;
            }
        }
        if self.rng.range(0, 1000) < self.params.restart_per_mille {
            let down: Vec<NodeId> = self
                .nodes
                .iter()
                .filter(|(_, n)| n.core.is_none())
                .map(|(&id, _)| id)
                .collect();
            if !down.is_empty() {
                let id = down[self.rng.range(0, down.len() as u64) as usize];
                self.restart(id);
            }
        }
        if self.rng.range(0, 1000) < self.params.partition_per_mille {
            self.blocked.clear();
            let cut = self.rng.range(0, ids.len() as u64 + 1) as usize;
            let mut shuffled = ids.clone();
            for i in (1..shuffled.len()).rev() {
                let j = self.rng.range(0, i as u64 + 1) as usize;
                shuffled.swap(i, j);
            }
            let (left, right) = shuffled.split_at(cut);
            for &a in left {
                for &b in right {
                    self.blocked.insert((a, b));
                    self.blocked.insert((b, a));
                }
            }
            self.trace(format!("partition {left:?} | {right:?}"));
        }
    }

    // ---- the end ---------------------------------------------------------------------------

    /// After healing: one leader everyone follows and has caught up with, every client
    /// finished, and no machine timer overdue (the leader's Tick duty runs).
    pub fn converged(&self) -> bool {
        let leaders: Vec<(&NodeId, &Core)> = self
            .nodes
            .iter()
            .filter_map(|(id, n)| n.core.as_ref().map(|c| (id, c)))
            .filter(|(_, c)| c.role() == Role::Leader)
            .collect();
        let [(&leader, core)] = leaders[..] else {
            return false;
        };
        let raw = core.raw();
        let commit = raw.commit_index();
        if commit < raw.last_index() || self.clients.iter().any(|c| c.inflight.is_some()) {
            return false;
        }
        let session_pending = self.clients.iter().any(|c| match &c.role {
            ClientRole::Session { sent, .. } => *sent,
            _ => false,
        });
        if session_pending {
            return false;
        }
        // The publisher stops at healing, so its messages age out: a timer still set means
        // the leader's Tick duty has not run it yet.
        if core.machine().next_timer_ms().is_some() {
            return false;
        }
        let term = raw.term();
        self.nodes.values().all(|n| {
            n.core.as_ref().is_some_and(|c| {
                c.applied_index() == commit && c.raw().term() == term && c.leader() == Some(leader)
            })
        })
    }

    /// Every key's history must be linearizable.
    fn check_histories(&mut self) {
        for key in 0..KV_KEYS {
            let history: Vec<Timed> = self.histories[key]
                .iter()
                .enumerate()
                .filter(|(slot, _)| !self.dropped.contains(&(key, *slot)))
                .map(|(_, t)| *t)
                .collect();
            if !lin::linearizable(&history) {
                let detail = format!(
                    "key k{key}: no linear order explains {} operations: {history:?}",
                    history.len()
                );
                self.fail("Linearizability", detail);
            }
        }
    }

    /// Every session position applied at most once; every acknowledged one exactly once.
    fn check_sessions(&mut self) {
        let mut failures = Vec::new();
        for client in &self.clients {
            let ClientRole::Session {
                client_id: _,
                seq,
                acked,
                ..
            } = &client.role
            else {
                continue;
            };
            for node in self.nodes.values() {
                let Some(core) = node.core.as_ref() else {
                    continue;
                };
                let machine = core.machine();
                let written = machine
                    .range(&RangeRequest::prefix("once/"))
                    .map(|r| r.kvs)
                    .unwrap_or_default();
                for kv in &written {
                    if kv.version > 1 {
                        failures.push(format!(
                            "{} was applied {} times",
                            String::from_utf8_lossy(&kv.key),
                            kv.version
                        ));
                    }
                }
                let written = written.len();
                if written < acked.len() {
                    failures.push(format!(
                        "{} positions acknowledged but only {written} applied (up to {seq})",
                        acked.len()
                    ));
                }
            }
        }
        failures.dedup();
        for detail in failures {
            self.fail("ExactlyOnce", detail);
        }
    }

    fn describe_short(&self) -> String {
        let mut out = String::new();
        for (id, node) in &self.nodes {
            match node.core.as_ref() {
                None => {
                    let _ = write!(out, "[{id}: down] ");
                }
                Some(core) => {
                    let raw = core.raw();
                    let _ = write!(
                        out,
                        "[{id}: {:?} t{} commit={} applied={} last={} timer={:?}] ",
                        raw.role(),
                        raw.term(),
                        raw.commit_index(),
                        raw.applied_index(),
                        raw.last_index(),
                        core.machine().next_timer_ms()
                    );
                }
            }
        }
        let _ = write!(out, "now={}", self.now_ms);
        out
    }

    /// The run's parameters and the nodes' state, for failure reports.
    pub fn describe(&self) -> String {
        format!(
            "seed={} bug={:?} params={:?}\n  {}",
            self.seed,
            self.bug,
            self.params,
            self.describe_short()
        )
    }
}
