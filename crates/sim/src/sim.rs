//! The simulation: a cluster of Raft cores, a faulty network, a nemesis and clients, all
//! driven by one seed in virtual time, with the checkers run after every event.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt::Write as _;

use bytes::Bytes;
use conclave_raft::{
    ConfChangeStep, ConfState, Config, EntryKind, Message, MessageBody, NodeId, Prng, RawNode,
    Role, Storage,
};

use crate::checker::{Checker, LogView, Violation};
use crate::node::{CrashPoint, NodeDisk, NodeStorage, SimNode, StorageKind};

/// Virtual milliseconds between ticks of a node running at nominal speed.
pub const BASE_TICK_MS: u64 = 10;
/// Election timeout T, in ticks (timeouts fall in [T, 2T)).
pub const ELECTION_TICKS: u64 = 10;
pub const HEARTBEAT_TICKS: u64 = 2;
/// How long a node stays awaited or not ([`SwarmParams::awaited_at`]), in virtual ms.
pub const AWAITED_PERIOD_MS: u64 = 500;
/// How many trace lines a failure report shows.
pub const TRACE_TAIL_LINES: usize = 60;

/// Everything a seed randomises about a run: printed with every failure.
#[derive(Debug, Clone)]
pub struct SwarmParams {
    pub nodes: usize,
    pub drop_per_mille: u64,
    pub duplicate_per_mille: u64,
    pub delay_max_ms: u64,
    /// Share of messages held back much longer, so they arrive out of order.
    pub long_delay_per_mille: u64,
    pub long_delay_max_ms: u64,
    /// Per nemesis step: chance to crash a node / restart one / change partitions.
    pub crash_per_mille: u64,
    pub restart_per_mille: u64,
    /// Per nemesis step: chance to crash whichever node leads (Figure 8 churn).
    pub leader_crash_per_mille: u64,
    pub partition_per_mille: u64,
    /// Chance that handling one Ready crashes the node part-way through.
    pub crash_in_ready_per_mille: u64,
    /// Tick period of each node in ms (skewed clocks).
    pub tick_ms: Vec<u64>,
    pub snapshot_every: u64,
    /// Core settings varied per seed: PreVote, CheckQuorum, message size and window.
    pub pre_vote: bool,
    pub check_quorum: bool,
    pub max_append_bytes: u64,
    pub max_inflight_appends: usize,
    /// Virtual ms between nemesis steps.
    pub nemesis_period_ms: u64,
    pub membership_changes: bool,
    pub transfers: bool,
    pub fault_phase_ms: u64,
    /// The liveness bound: after healing, a leader and full agreement must come within this.
    pub liveness_bound_ms: u64,
    pub profile: Profile,
    pub storage: StorageKind,
    /// The node core's runs serve reads from a leader lease (`Config::lease_read_ms`, the
    /// server's `--lease-reads`), sized by [`SwarmParams::lease_read_ms`].
    pub lease_reads: bool,
    /// `Config::replicate_to_quorum_first` (on in the server).
    pub quorum_first: bool,
    /// `Config::defer_commit_notice` (on in the server).
    pub defer_commit_notice: bool,
}

impl SwarmParams {
    /// Draws parameters for `seed`; `nodes` fixes the cluster size if given.
    pub fn from_seed(seed: u64, nodes: Option<usize>) -> Self {
        let mut rng = Prng::new(seed ^ 0x5157_4152_4d00_0000);
        let nodes = nodes.unwrap_or([1, 3, 3, 5, 5, 7][rng.range(0, 6) as usize]);
        let skew = rng.range(0, 3) == 0;
        let tick_ms = (0..nodes + 2)
            .map(|_| {
                if skew {
                    rng.range(BASE_TICK_MS / 2, BASE_TICK_MS * 2 + 1)
                } else {
                    BASE_TICK_MS
                }
            })
            .collect();
        let mut params = SwarmParams {
            nodes,
            drop_per_mille: rng.range(0, 201),
            duplicate_per_mille: rng.range(0, 101),
            delay_max_ms: rng.range(1, 20),
            long_delay_per_mille: rng.range(0, 100),
            long_delay_max_ms: rng.range(50, 500),
            crash_per_mille: rng.range(0, 60),
            restart_per_mille: rng.range(100, 400),
            leader_crash_per_mille: if rng.range(0, 3) == 0 {
                rng.range(50, 400)
            } else {
                0
            },
            partition_per_mille: rng.range(0, 80),
            crash_in_ready_per_mille: rng.range(0, 8),
            tick_ms,
            snapshot_every: [0, 10, 50, 200][rng.range(0, 4) as usize],
            pre_vote: rng.range(0, 4) != 0,
            check_quorum: rng.range(0, 4) != 0,
            max_append_bytes: [1, 64, 1024][rng.range(0, 3) as usize],
            max_inflight_appends: [1, 8, 64][rng.range(0, 3) as usize],
            nemesis_period_ms: rng.range(10, 60),
            membership_changes: nodes >= 3 && rng.range(0, 2) == 0,
            transfers: rng.range(0, 2) == 0,
            fault_phase_ms: rng.range(5_000, 20_000),
            liveness_bound_ms: 10_000,
            profile: Profile::Swarm,
            storage: StorageKind::Mem,
            lease_reads: false,
            quorum_first: false,
            defer_commit_notice: false,
        };
        if rng.range(0, 4) == 0 {
            params.figure8_churn(nodes.clamp(5, 7), &mut rng);
        }
        // Drawn last, so every other parameter of a seed stays what it was before.
        params.lease_reads = params.check_quorum && rng.range(0, 2) == 0;
        // Each on in three seeds of four: the replication a server may turn on is the one
        // to exercise most.
        params.quorum_first = rng.range(0, 4) != 0;
        params.defer_commit_notice = rng.range(0, 4) != 0;
        params
    }

    /// Whether node `id` of `seed`'s run starts with lease reads after its `restarts`-th
    /// restart. On a seed with lease reads, one start in four runs without them, as during a
    /// rolling change of `--lease-reads`: members with and without the flag must be able to
    /// run side by side. A hash of the start, not a draw, so the seed's other parameters stay
    /// what they were.
    pub fn lease_reads_at_start(&self, seed: u64, id: u64, restarts: u64) -> bool {
        if !self.lease_reads {
            return false;
        }
        let start = (seed ^ id)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(restarts.wrapping_mul(0xC2B2_AE3D_27D4_EB4F));
        (start ^ (start >> 29)).wrapping_mul(0x1656_67B1_9E37_79F9) >> 62 != 0
    }

    /// Whether node `id` of `seed`'s run is awaited (clients wait there for what it applies,
    /// `RawNode::set_awaited`) at virtual time `now_ms`: it changes every
    /// [`AWAITED_PERIOD_MS`], on for about half of the periods. A hash, not a draw, so the
    /// seed's other parameters stay what they were.
    pub fn awaited_at(seed: u64, id: u64, now_ms: u64) -> bool {
        let period = now_ms / AWAITED_PERIOD_MS;
        let mixed = (seed ^ id.rotate_left(32))
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(period.wrapping_mul(0xC2B2_AE3D_27D4_EB4F));
        (mixed ^ (mixed >> 31)).wrapping_mul(0x1656_67B1_9E37_79F9) >> 63 != 0
    }

    /// The lease as the server sizes it ([`conclave_server::config::ServerConfig::lease_read_ms`]),
    /// from the shortest tick period any member has: the simulator's clock is exact, and a
    /// member with short ticks is one whose clock runs fast.
    pub fn lease_read_ms(&self) -> u64 {
        if !self.lease_reads {
            return 0;
        }
        let shortest_tick_ms = self.tick_ms.iter().copied().min().unwrap_or(BASE_TICK_MS);
        (ELECTION_TICKS - 1)
            * shortest_tick_ms
            * (100 - conclave_server::config::LEASE_READ_CLOCK_DRIFT_PERCENT)
            / 100
    }

    /// A fault-free network and no nemesis: named scenarios inject their own faults.
    pub fn reliable(nodes: usize) -> Self {
        SwarmParams {
            nodes,
            drop_per_mille: 0,
            duplicate_per_mille: 0,
            delay_max_ms: 5,
            long_delay_per_mille: 0,
            long_delay_max_ms: 1,
            crash_per_mille: 0,
            restart_per_mille: 0,
            leader_crash_per_mille: 0,
            partition_per_mille: 0,
            crash_in_ready_per_mille: 0,
            tick_ms: vec![BASE_TICK_MS; nodes + 4],
            snapshot_every: 0,
            pre_vote: true,
            check_quorum: true,
            max_append_bytes: 64 * 1024,
            max_inflight_appends: 64,
            nemesis_period_ms: 50,
            membership_changes: false,
            transfers: false,
            fault_phase_ms: 0,
            liveness_bound_ms: 10_000,
            profile: Profile::Swarm,
            storage: StorageKind::Mem,
            lease_reads: false,
            quorum_first: true,
            defer_commit_notice: true,
        }
    }

    /// The Figure 8 churn of the MIT 6.5840 tests: leaders crash moments after taking over,
    /// entries move one per message, so entries of old terms often reach a majority before
    /// the new leader's own entry does.
    fn figure8_churn(&mut self, nodes: usize, rng: &mut Prng) {
        self.profile = Profile::Figure8Churn;
        self.nodes = nodes;
        self.tick_ms.resize(nodes + 2, BASE_TICK_MS);
        self.drop_per_mille = rng.range(0, 50);
        self.duplicate_per_mille = 0;
        self.delay_max_ms = rng.range(1, 14);
        self.long_delay_per_mille = 0;
        self.crash_per_mille = 0;
        self.partition_per_mille = 0;
        self.leader_crash_per_mille = rng.range(300, 700);
        self.restart_per_mille = 700;
        self.snapshot_every = 0;
        self.max_append_bytes = 1;
        self.max_inflight_appends = 1;
        self.nemesis_period_ms = rng.range(5, 25);
        self.membership_changes = false;
        self.transfers = false;
    }
}

/// The flavour of fault schedule a seed drew.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    /// Everything at once, at moderate rates.
    Swarm,
    /// Leaders crash right after election; see [`SwarmParams::figure8_churn`].
    Figure8Churn,
}

#[derive(Debug, Clone)]
enum Event {
    Tick(NodeId),
    Deliver(Message),
    Nemesis,
    Client,
    Heal,
}

/// A value a client wants committed; retried until it is.
#[derive(Debug, Clone)]
struct ClientValue {
    data: Bytes,
    committed: bool,
    /// When it was last proposed; a client retries only after `CLIENT_RETRY_MS`.
    proposed_at_ms: Option<u64>,
}

/// How long a client waits for its value to commit before proposing it again.
pub const CLIENT_RETRY_MS: u64 = 300;

/// Counters for reports and benchmarks.
#[derive(Debug, Default, Clone)]
pub struct Stats {
    pub events: u64,
    pub messages_sent: u64,
    pub messages_delivered: u64,
    pub elections_won: u64,
    pub crashes: u64,
    pub snapshots_installed: u64,
    pub reads_served: u64,
    pub conf_changes_applied: u64,
    /// Messages sent, by kind (see `MessageBody::name`).
    pub sent_by_kind: BTreeMap<&'static str, u64>,
    /// Every read answered, as (node, context, read index), so scenarios can check them.
    pub served_reads: Vec<(NodeId, Bytes, u64)>,
    /// Messages a core refused (`Error::is_refused_message`): forged ones, and stale ones
    /// from nodes a configuration no longer holds.
    pub refused_messages: u64,
}

impl Stats {
    /// Requests sent (every message that is not a response): the 6.5840 "RPC count".
    pub fn requests_sent(&self) -> u64 {
        self.sent_by_kind
            .iter()
            .filter(|(k, _)| !k.ends_with("Response"))
            .map(|(_, n)| n)
            .sum()
    }
}

/// One simulated run.
pub struct Simulation {
    pub seed: u64,
    pub params: SwarmParams,
    pub now_ms: u64,
    rng: Prng,
    queue: BTreeMap<(u64, u64), Event>,
    next_seq: u64,
    pub nodes: BTreeMap<NodeId, SimNode>,
    /// Directed links that drop everything.
    blocked: BTreeSet<(NodeId, NodeId)>,
    faults_on: bool,
    pub checker: Checker,
    pub stats: Stats,
    clients: Vec<ClientValue>,
    read_seq: u64,
    trace_tail: VecDeque<String>,
    trace_hash: u64,
    config_hook: Option<ConfigHook>,
}

/// A hook that adjusts every node's configuration; negative-control tests use it to switch on
/// a deliberate bug.
pub type ConfigHook = fn(&mut Config);

impl Simulation {
    /// A run for `seed` with the swarm parameters it draws.
    pub fn new(seed: u64, nodes: Option<usize>) -> Self {
        Self::with_params(seed, SwarmParams::from_seed(seed, nodes), true, None)
    }

    /// A run with explicit parameters; `automatic` turns the nemesis and clients on.
    pub fn with_params(
        seed: u64,
        params: SwarmParams,
        automatic: bool,
        config_hook: Option<ConfigHook>,
    ) -> Self {
        let mut sim = Simulation {
            seed,
            now_ms: 0,
            rng: Prng::new(seed),
            queue: BTreeMap::new(),
            next_seq: 0,
            nodes: BTreeMap::new(),
            blocked: BTreeSet::new(),
            faults_on: automatic,
            checker: Checker::default(),
            stats: Stats::default(),
            clients: Vec::new(),
            read_seq: 0,
            trace_tail: VecDeque::new(),
            trace_hash: 0xcbf2_9ce4_8422_2325,
            config_hook,
            params,
        };
        let voters: Vec<NodeId> = (1..=sim.params.nodes as u64).collect();
        for &id in &voters {
            sim.add_node(id, Some(ConfState::with_voters(voters.clone())));
        }
        if automatic {
            sim.schedule(1, Event::Nemesis);
            sim.schedule(1, Event::Client);
            sim.schedule(sim.params.fault_phase_ms, Event::Heal);
        }
        sim
    }

    fn node_config(&self, id: NodeId) -> Config {
        let mut config = Config::new(id);
        config.election_ticks = ELECTION_TICKS;
        config.heartbeat_ticks = HEARTBEAT_TICKS;
        config.seed = self.seed.wrapping_mul(1_000_003).wrapping_add(id);
        config.pre_vote = self.params.pre_vote;
        config.check_quorum = self.params.check_quorum;
        config.max_inflight_appends = self.params.max_inflight_appends;
        config.max_append_bytes = self.params.max_append_bytes;
        config.snapshot_chunk_bytes = 40;
        config.replicate_to_quorum_first = self.params.quorum_first;
        config.defer_commit_notice = self.params.defer_commit_notice;
        if let Some(hook) = self.config_hook {
            hook(&mut config);
        }
        config
    }

    /// Starts node `id` on a fresh disk; founding members get the initial membership.
    pub fn add_node(&mut self, id: NodeId, founding: Option<ConfState>) {
        let config = self.node_config(id);
        let disk_seed = self.seed.wrapping_mul(31).wrapping_add(id);
        let node = NodeDisk::new(self.params.storage, disk_seed, founding)
            .and_then(|disk| SimNode::new(config, disk, self.params.snapshot_every));
        let node = match node {
            Ok(node) => node,
            Err(e) => panic!("cannot create simulated node {id}: {e}"),
        };
        self.checker.reset_state(id, node.state);
        self.nodes.insert(id, node);
        let tick = self.tick_period(id);
        let first = self.rng.range(1, tick + 1);
        self.schedule(first, Event::Tick(id));
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
        self.trace_tail
            .push_back(format!("{:>7}ms {line}", self.now_ms));
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

    /// Runs the seed to the end: fault phase, heal, then the liveness phase. Returns false on
    /// any violation (including a liveness failure).
    pub fn run(&mut self) -> bool {
        let end = self.params.fault_phase_ms + self.params.liveness_bound_ms;
        while self.now_ms < end && self.checker.violations.is_empty() {
            if self.now_ms > self.params.fault_phase_ms && self.converged() {
                return true;
            }
            if !self.step_once() {
                break;
            }
        }
        if self.checker.violations.is_empty() && !self.converged() {
            let detail = format!(
                "no leader with every client value committed and every member caught up within \
                 {} ms of healing",
                self.params.liveness_bound_ms
            );
            self.checker.violations.push(Violation {
                invariant: "Liveness",
                detail,
            });
        }
        self.checker.violations.is_empty()
    }

    /// Processes the next event. Returns false when nothing is scheduled.
    pub fn step_once(&mut self) -> bool {
        let Some(((at, _), event)) = self.queue.pop_first() else {
            return false;
        };
        self.now_ms = at;
        self.stats.events += 1;
        match event {
            Event::Tick(id) => {
                if let Some(raw) = self.nodes.get_mut(&id).and_then(|n| n.raw.as_mut()) {
                    raw.set_awaited(SwarmParams::awaited_at(self.seed, id, at));
                    raw.tick();
                }
                self.process(id);
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
                self.heal();
            }
        }
        true
    }

    /// Runs until virtual time `until_ms` (for scenario tests).
    pub fn run_until(&mut self, until_ms: u64) {
        while self
            .queue
            .first_key_value()
            .is_some_and(|(&(at, _), _)| at <= until_ms)
        {
            self.step_once();
        }
        self.now_ms = self.now_ms.max(until_ms);
    }

    /// Runs for `duration_ms` more virtual time.
    pub fn run_for(&mut self, duration_ms: u64) {
        self.run_until(self.now_ms + duration_ms);
    }

    // ---- the network -------------------------------------------------------------------

    fn send(&mut self, m: Message) {
        self.stats.messages_sent += 1;
        *self.stats.sent_by_kind.entry(m.body.name()).or_insert(0) += 1;
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
        let Some(raw) = self.nodes.get_mut(&to).and_then(|n| n.raw.as_mut()) else {
            return;
        };
        self.stats.messages_delivered += 1;
        let line = format!("{} -> {} t{} {}", m.from, m.to, m.term, m.body.name());
        // Errors here are operating errors: a refused message, or a TimeoutNow a node whose
        // term is exhausted cannot act on. Neither stops the node.
        if let Err(error) = raw.step(m)
            && error.is_refused_message()
        {
            self.stats.refused_messages += 1;
        }
        self.trace(line);
        self.process(to);
    }

    /// Delivers `m` now, as if it came off the network, for fuzzing with forged messages. It
    /// bypasses `send`, so the checker does not take a forged vote for one the sender cast.
    pub fn inject(&mut self, m: Message) {
        self.deliver(m);
    }

    /// Cuts every link between `a` and the rest, both ways.
    pub fn isolate(&mut self, a: NodeId) {
        let ids: Vec<NodeId> = self.nodes.keys().copied().collect();
        for b in ids.into_iter().filter(|&b| b != a) {
            self.blocked.insert((a, b));
            self.blocked.insert((b, a));
        }
        self.trace(format!("isolate {a}"));
    }

    /// Restores every link of `a`.
    pub fn reconnect(&mut self, a: NodeId) {
        self.blocked.retain(|&(x, y)| x != a && y != a);
        self.trace(format!("reconnect {a}"));
    }

    pub fn heal_network(&mut self) {
        self.blocked.clear();
    }

    fn heal(&mut self) {
        self.faults_on = false;
        self.blocked.clear();
        let down: Vec<NodeId> = self
            .nodes
            .iter()
            .filter(|(_, n)| !n.is_up())
            .map(|(&id, _)| id)
            .collect();
        for id in down {
            self.restart(id);
        }
    }

    // ---- nodes ---------------------------------------------------------------------------

    pub fn crash(&mut self, id: NodeId) {
        if let Some(node) = self.nodes.get_mut(&id)
            && node.is_up()
        {
            node.crash();
            self.stats.crashes += 1;
            self.trace(format!("crash {id}"));
        }
    }

    pub fn restart(&mut self, id: NodeId) {
        let Some(node) = self.nodes.get_mut(&id) else {
            return;
        };
        if node.is_up() {
            return;
        }
        if let Err(e) = node.start() {
            let detail = format!("node {id} cannot restart: {e}");
            self.checker.violations.push(Violation {
                invariant: "Durability(storage)",
                detail,
            });
            return;
        }
        let state = node.state;
        let term = node.term().unwrap_or(0);
        let hard_state = node
            .raw
            .as_ref()
            .map(|raw| raw.hard_state())
            .unwrap_or_default();
        self.checker.check_restart(id, hard_state);
        self.checker.reset_state(id, state);
        self.checker.observe_role(id, Role::Follower, term);
        self.trace(format!(
            "restart {id} at term {term} applied {}",
            state.applied
        ));
        self.process(id);
    }

    /// Handles every Ready the node has, routing messages and feeding the checkers.
    fn process(&mut self, id: NodeId) {
        for _ in 0..16 {
            let crash_roll = self.rng.range(0, 1000);
            let point_roll = self.rng.range(0, 12);
            let Some(node) = self.nodes.get_mut(&id) else {
                return;
            };
            let Some(raw) = node.raw.as_ref() else { return };
            if !raw.has_ready() {
                return;
            }
            let points = match self.params.storage {
                StorageKind::Mem => 3,
                StorageKind::Wal => 4,
            };
            let point_roll = point_roll % points;
            let crash_at = (self.faults_on && crash_roll < self.params.crash_in_ready_per_mille)
                .then(|| {
                    [
                        CrashPoint::BeforePersist,
                        CrashPoint::AfterPersist,
                        CrashPoint::AfterSend,
                        CrashPoint::BeforeSync,
                    ][point_roll as usize]
                });
            let outcome = node.handle_ready(crash_at);
            let after = node
                .raw
                .as_ref()
                .map(|raw| (raw.role(), raw.term(), raw.commit_index()));
            if let Some(first) = outcome.persisted.first() {
                let prev = node_prev_term(node, first.index);
                self.checker.observe_persisted(id, &outcome.persisted, prev);
            }
            if let Some(state) = outcome.installed_snapshot {
                self.stats.snapshots_installed += 1;
                self.checker.reset_state(id, state);
            }
            let node_term = after.map_or(0, |(_, term, _)| term);
            for (entry, hash) in &outcome.applied {
                self.checker.observe_applied(id, node_term, entry, *hash);
                if entry.kind == EntryKind::ConfChange {
                    self.stats.conf_changes_applied += 1;
                }
                if let Some(v) = self.clients.iter_mut().find(|v| v.data == entry.data) {
                    v.committed = true;
                }
            }
            for rs in &outcome.read_states {
                self.stats.reads_served += 1;
                self.stats
                    .served_reads
                    .push((id, rs.context.clone(), rs.index));
                self.checker.read_served(id, &rs.context, rs.index);
            }
            for m in outcome.messages {
                self.send(m);
            }
            if let Some(e) = outcome.storage_error {
                let detail = format!("node {id} storage failed: {e}");
                self.checker.violations.push(Violation {
                    invariant: "Durability(storage)",
                    detail,
                });
            }
            if outcome.crashed {
                self.stats.crashes += 1;
                self.trace(format!("crash {id} while handling a Ready ({crash_at:?})"));
                return;
            }
            if let Some((role, term, commit)) = after {
                self.checker.observe_role(id, role, term);
                self.checker.observe_commit(commit);
                let became_leader = outcome.soft_state.is_some_and(|s| s.role == Role::Leader);
                if became_leader {
                    self.stats.elections_won += 1;
                    self.trace(format!("{id} leads term {term}"));
                    let node = &self.nodes[&id];
                    if let Some(raw) = node.raw.as_ref() {
                        let view = LogView::new(raw.store());
                        self.checker.check_leader_completeness(id, term, &view);
                    }
                }
            }
        }
    }

    // ---- the nemesis and clients -----------------------------------------------------------

    fn nemesis(&mut self) {
        if self.params.profile == Profile::Figure8Churn {
            self.figure8_nemesis();
            return;
        }
        let roll = self.rng.range(0, 1000);
        let ids: Vec<NodeId> = self.nodes.keys().copied().collect();
        if roll < self.params.crash_per_mille {
            let victim = ids[self.rng.range(0, ids.len() as u64) as usize];
            self.crash(victim);
            return;
        }
        let roll = self.rng.range(0, 1000);
        if roll < self.params.leader_crash_per_mille
            && let Some(leader) = self.leader()
        {
            self.crash(leader);
            return;
        }
        let roll = self.rng.range(0, 1000);
        if roll < self.params.restart_per_mille {
            let down: Vec<NodeId> = self
                .nodes
                .iter()
                .filter(|(_, n)| !n.is_up())
                .map(|(&id, _)| id)
                .collect();
            if !down.is_empty() {
                let id = down[self.rng.range(0, down.len() as u64) as usize];
                self.restart(id);
            }
        }
        let roll = self.rng.range(0, 1000);
        if roll < self.params.partition_per_mille {
            self.random_partition(&ids);
        }
        let roll = self.rng.range(0, 1000);
        if self.params.transfers && roll < 20 {
            self.random_transfer();
        }
        let roll = self.rng.range(0, 1000);
        if self.params.membership_changes && roll < 30 {
            self.random_membership_change();
        }
    }

    /// One round of Figure 8 churn: every leader gets a throwaway proposal, the leader may
    /// crash at once, and a crashed node comes back only when a quorum is missing.
    fn figure8_nemesis(&mut self) {
        self.read_seq += 1;
        let noise = Bytes::from(format!("noise-{}", self.read_seq));
        for leader in self.leaders() {
            let _ = self.propose(leader, noise.clone());
        }
        if self.rng.range(0, 1000) < self.params.leader_crash_per_mille
            && let Some(leader) = self.leader()
        {
            self.crash(leader);
        }
        let up = self.nodes.values().filter(|n| n.is_up()).count();
        if up <= self.nodes.len() / 2 {
            let down: Vec<NodeId> = self
                .nodes
                .iter()
                .filter(|(_, n)| !n.is_up())
                .map(|(&id, _)| id)
                .collect();
            let id = down[self.rng.range(0, down.len() as u64) as usize];
            self.restart(id);
        }
    }

    fn random_partition(&mut self, ids: &[NodeId]) {
        self.blocked.clear();
        let kind = self.rng.range(0, 4);
        let mut shuffled = ids.to_vec();
        for i in (1..shuffled.len()).rev() {
            let j = self.rng.range(0, i as u64 + 1) as usize;
            shuffled.swap(i, j);
        }
        let cut = self.rng.range(0, shuffled.len() as u64 + 1) as usize;
        let (left, right) = shuffled.split_at(cut);
        match kind {
            0 => {
                self.trace("partition healed".into());
            }
            1 => {
                for &a in left {
                    for &b in right {
                        self.blocked.insert((a, b));
                        self.blocked.insert((b, a));
                    }
                }
                self.trace(format!("partition {left:?} | {right:?}"));
            }
            2 => {
                for &a in left {
                    for &b in right {
                        self.blocked.insert((a, b));
                    }
                }
                self.trace(format!("one-way partition {left:?} -> {right:?} blocked"));
            }
            _ => {
                // A bridge: the first node of `right` talks to both sides, which cannot
                // talk to each other.
                if let Some((&bridge, rest)) = right.split_first() {
                    for &a in left {
                        for &b in rest {
                            self.blocked.insert((a, b));
                            self.blocked.insert((b, a));
                        }
                    }
                    self.trace(format!("bridge {bridge} between {left:?} and {rest:?}"));
                }
            }
        }
    }

    fn leaders(&self) -> Vec<NodeId> {
        self.nodes
            .iter()
            .filter(|(_, n)| n.role() == Some(Role::Leader))
            .map(|(&id, _)| id)
            .collect()
    }

    fn random_transfer(&mut self) {
        let leaders = self.leaders();
        let Some(&leader) = leaders.first() else {
            return;
        };
        let voters: Vec<NodeId> = {
            let raw = self.nodes[&leader].raw.as_ref().expect("leader is up");
            raw.conf_state()
                .voters
                .iter()
                .copied()
                .filter(|&v| v != leader)
                .collect()
        };
        if voters.is_empty() {
            return;
        }
        let target = voters[self.rng.range(0, voters.len() as u64) as usize];
        let raw = self
            .nodes
            .get_mut(&leader)
            .and_then(|n| n.raw.as_mut())
            .expect("leader is up");
        let result = raw.transfer_leader(target);
        self.trace(format!("transfer {leader} -> {target}: {result:?}"));
        self.process(leader);
    }

    fn random_membership_change(&mut self) {
        let leaders = self.leaders();
        let Some(&leader) = leaders.first() else {
            return;
        };
        let conf = self.nodes[&leader]
            .raw
            .as_ref()
            .expect("leader is up")
            .conf_state()
            .clone();
        // Ids are never reused: a new node gets an id no node ever had.
        let max_id = self.params.nodes as u64 + 2;
        let spare = (1..=max_id).find(|id| !self.nodes.contains_key(id));
        let learner = conf.learners.iter().next().copied();
        let choice = self.rng.range(0, 3);
        let step = match (choice, spare, learner) {
            (0, Some(id), _) => ConfChangeStep::AddLearner(id),
            (1, _, Some(id)) => ConfChangeStep::AddVoter(id),
            (2, _, _) if conf.voters.len() > 2 => {
                let voters: Vec<NodeId> = conf.voters.iter().copied().collect();
                ConfChangeStep::RemoveNode(voters[self.rng.range(0, voters.len() as u64) as usize])
            }
            _ => return,
        };
        if let ConfChangeStep::AddLearner(id) = step {
            // A node joining from scratch: an empty disk that knows no members; it learns
            // everything from the leader.
            self.add_node(id, None);
        }
        let raw = self
            .nodes
            .get_mut(&leader)
            .and_then(|n| n.raw.as_mut())
            .expect("leader is up");
        let result = raw.propose_conf_change(vec![step]);
        self.trace(format!(
            "membership change {step:?} at {leader}: {result:?}"
        ));
        self.process(leader);
    }

    fn client_step(&mut self) {
        // New values only during the fault phase; pending ones are retried until committed.
        if self.faults_on && self.clients.iter().filter(|v| !v.committed).count() < 3 {
            let data = Bytes::from(format!("value-{}-{}", self.seed, self.clients.len()));
            self.clients.push(ClientValue {
                data,
                committed: false,
                proposed_at_ms: None,
            });
        }
        let leaders = self.leaders();
        if let Some(&leader) = leaders.get(self.rng.range(0, leaders.len().max(1) as u64) as usize)
        {
            let now = self.now_ms;
            let due = |v: &ClientValue| {
                !v.committed
                    && v.proposed_at_ms
                        .is_none_or(|at| now >= at + CLIENT_RETRY_MS)
            };
            let mut pending = Vec::new();
            for value in self.clients.iter_mut().filter(|v| due(v)) {
                value.proposed_at_ms = Some(now);
                pending.push(value.data.clone());
            }
            if let Some(raw) = self.nodes.get_mut(&leader).and_then(|n| n.raw.as_mut()) {
                for data in pending {
                    let _ = raw.propose(data);
                }
            }
            self.process(leader);
        }
        if self.rng.range(0, 3) == 0 {
            let ids: Vec<NodeId> = self.nodes.keys().copied().collect();
            let id = ids[self.rng.range(0, ids.len() as u64) as usize];
            self.read_seq += 1;
            let context = Bytes::from(format!("read-{}", self.read_seq));
            if let Some(raw) = self.nodes.get_mut(&id).and_then(|n| n.raw.as_mut())
                && raw.read_index(context.clone()).is_ok()
            {
                self.checker.read_started(id, &context);
            }
            self.process(id);
        }
    }

    /// After healing: one leader, every client value committed, every member caught up.
    pub fn converged(&self) -> bool {
        let leaders = self.leaders();
        let [leader] = leaders[..] else { return false };
        let Some(raw) = self.nodes[&leader].raw.as_ref() else {
            return false;
        };
        if raw.transferee().is_some() || raw.conf_state().is_joint() {
            return false;
        }
        let commit = raw.commit_index();
        if commit < raw.last_index() || self.clients.iter().any(|v| !v.committed) {
            return false;
        }
        let term = raw.term();
        raw.conf_state().members().iter().all(|id| {
            self.nodes
                .get(id)
                .and_then(|n| n.raw.as_ref())
                .is_some_and(|r| {
                    r.applied_index() == commit && r.term() == term && r.leader() == Some(leader)
                })
        })
    }

    /// A one-paragraph description of the run's parameters, for failure reports.
    pub fn describe(&self) -> String {
        let mut out = String::new();
        let _ = write!(out, "seed={} params={:?}", self.seed, self.params);
        for (id, node) in &self.nodes {
            let _ = write!(out, "\n  node {id}: ");
            match node.raw.as_ref() {
                None => {
                    let _ = write!(out, "down");
                }
                Some(raw) => {
                    let _ = write!(
                        out,
                        "{:?} term={} leader={:?} commit={} applied={} last={} conf={:?}",
                        raw.role(),
                        raw.term(),
                        raw.leader(),
                        raw.commit_index(),
                        raw.applied_index(),
                        raw.last_index(),
                        raw.conf_state()
                    );
                    for peer in raw.conf_state().members() {
                        if let Some((m, n)) = raw.peer_progress(peer) {
                            let _ = write!(out, " [{peer}: match={m} next={n}]");
                        }
                    }
                }
            }
        }
        let pending = self.clients.iter().filter(|v| !v.committed).count();
        let _ = write!(out, "\n  uncommitted client values: {pending}");
        out
    }

    // ---- helpers for named scenarios -------------------------------------------------------

    /// The node that is leader, if exactly one live node believes it leads in the highest term.
    pub fn leader(&self) -> Option<NodeId> {
        let mut best: Option<(u64, NodeId)> = None;
        for (&id, node) in &self.nodes {
            if let Some(raw) = node.raw.as_ref()
                && raw.role() == Role::Leader
                && best.is_none_or(|(t, _)| raw.term() > t)
            {
                best = Some((raw.term(), id));
            }
        }
        best.map(|(_, id)| id)
    }

    /// Proposes `data` at `node` and handles the resulting Ready.
    pub fn propose(&mut self, node: NodeId, data: Bytes) -> Result<u64, conclave_raft::Error> {
        self.on_node(node, |raw| raw.propose(data))
    }

    /// Calls `request` on the core of `node` (an error if it is down), then handles the Ready.
    fn on_node<T>(
        &mut self,
        node: NodeId,
        request: impl FnOnce(&mut RawNode<NodeStorage>) -> Result<T, conclave_raft::Error>,
    ) -> Result<T, conclave_raft::Error> {
        let raw = self
            .nodes
            .get_mut(&node)
            .and_then(|n| n.raw.as_mut())
            .ok_or(conclave_raft::Error::NoLeader)?;
        let result = request(raw);
        self.process(node);
        result
    }

    /// Starts a linearizable read at `node`.
    pub fn read(&mut self, node: NodeId, context: Bytes) -> Result<(), conclave_raft::Error> {
        // The read begins before the core sees it: record what was committed by then.
        let committed_before = self.checker.max_committed;
        let result = self.on_node(node, |raw| raw.read_index(context.clone()));
        if result.is_ok() {
            self.checker
                .read_started_at(node, &context, committed_before);
        }
        result
    }

    /// A run with no nemesis and no clients, for named scenarios that drive it by hand.
    pub fn scenario(seed: u64, params: SwarmParams, config_hook: Option<ConfigHook>) -> Self {
        Simulation::with_params(seed, params, false, config_hook)
    }

    /// Turns random network faults on (rates per mille) for scenario runs.
    pub fn set_network_faults(
        &mut self,
        drop: u64,
        duplicate: u64,
        long_delay: u64,
        long_delay_max_ms: u64,
    ) {
        self.params.drop_per_mille = drop;
        self.params.duplicate_per_mille = duplicate;
        self.params.long_delay_per_mille = long_delay;
        self.params.long_delay_max_ms = long_delay_max_ms.max(1);
        self.faults_on = drop + duplicate + long_delay > 0;
    }

    /// Drops everything from `from` to `to` (one direction).
    pub fn block(&mut self, from: NodeId, to: NodeId) {
        self.blocked.insert((from, to));
        self.trace(format!("block {from} -> {to}"));
    }

    /// Splits the cluster into groups that cannot talk across.
    pub fn partition(&mut self, groups: &[&[NodeId]]) {
        self.blocked.clear();
        for (i, a) in groups.iter().enumerate() {
            for b in groups.iter().skip(i + 1) {
                for &x in a.iter() {
                    for &y in b.iter() {
                        self.blocked.insert((x, y));
                        self.blocked.insert((y, x));
                    }
                }
            }
        }
        self.trace(format!("partition {groups:?}"));
    }

    /// The core of node `id`, if it is up.
    pub fn node(&self, id: NodeId) -> Option<&conclave_raft::RawNode<NodeStorage>> {
        self.nodes.get(&id).and_then(|n| n.raw.as_ref())
    }

    pub fn is_up(&self, id: NodeId) -> bool {
        self.nodes.get(&id).is_some_and(|n| n.is_up())
    }

    /// Asks leader `leader` to hand over to `target`.
    pub fn transfer_leader(
        &mut self,
        leader: NodeId,
        target: NodeId,
    ) -> Result<(), conclave_raft::Error> {
        self.on_node(leader, |raw| raw.transfer_leader(target))
    }

    /// Proposes a membership change at `leader`.
    pub fn propose_conf_change(
        &mut self,
        leader: NodeId,
        steps: Vec<ConfChangeStep>,
    ) -> Result<u64, conclave_raft::Error> {
        self.on_node(leader, |raw| raw.propose_conf_change(steps))
    }

    /// The term of the entry every node that applied `index` agreed on, if anyone applied it.
    pub fn applied_term(&self, index: u64) -> Option<u64> {
        self.checker.applied_term(index)
    }

    /// How many live nodes have applied an entry carrying `data`.
    pub fn applied_count(&self, data: &[u8]) -> usize {
        self.nodes
            .values()
            .filter(|n| n.is_up())
            .filter(|n| {
                n.raw
                    .as_ref()
                    .is_some_and(|raw| raw_holds_applied(raw, n.state.applied, data))
            })
            .count()
    }
}

fn raw_holds_applied(raw: &conclave_raft::RawNode<NodeStorage>, applied: u64, data: &[u8]) -> bool {
    let store = raw.store();
    let first = store.first_index().unwrap_or(1);
    let last = store.last_index().unwrap_or(0).min(applied);
    if first > last {
        return false;
    }
    store
        .entries(first, last + 1, u64::MAX)
        .map(|entries| entries.iter().any(|e| e.data.as_ref() == data))
        .unwrap_or(false)
}

/// The term just before `index` in the node's durable log, if known.
fn node_prev_term(node: &SimNode, index: u64) -> Option<u64> {
    let store = node.raw.as_ref()?.store();
    store.term(index.saturating_sub(1)).ok()
}
