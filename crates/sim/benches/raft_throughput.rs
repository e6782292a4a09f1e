//! In-process throughput of the Raft core: 3 nodes, in-memory storage, an instant in-memory
//! network, no fsync. Reports committed proposals per second for 1, 64 and 256 concurrent
//! proposers (each keeps one proposal outstanding), next to a reference measured in the same
//! run: the same proposals applied straight to the state machine without consensus.
//! Also reports what an election costs in ticks and messages.
//!
//! Run: `cargo bench -p conclave-sim --bench raft_throughput`

use std::collections::{BTreeMap, VecDeque};
use std::hint::black_box;
use std::time::{Duration, Instant};

use bytes::Bytes;
use conclave_raft::{ConfState, Config, Entry, MemStorage, Message, RawNode, Role};
use conclave_sim::node::AppState;

/// How long each throughput row runs.
const MEASURE: Duration = Duration::from_millis(1500);
/// Bytes per proposal (a small etcd put).
const PROPOSAL_BYTES: usize = 64;

struct Cluster {
    nodes: BTreeMap<u64, RawNode<MemStorage>>,
    states: BTreeMap<u64, AppState>,
    inbox: VecDeque<Message>,
    messages: u64,
}

impl Cluster {
    fn new(size: u64) -> Self {
        let voters: Vec<u64> = (1..=size).collect();
        let nodes = voters
            .iter()
            .map(|&id| {
                let store = MemStorage::new_with_conf_state(ConfState::with_voters(voters.clone()));
                let mut config = Config::new(id);
                config.election_ticks = 10;
                config.heartbeat_ticks = 2;
                config.max_inflight_appends = 256;
                (id, RawNode::new(config, store).expect("valid config"))
            })
            .collect();
        let states = voters.iter().map(|&id| (id, AppState::default())).collect();
        Cluster {
            nodes,
            states,
            inbox: VecDeque::new(),
            messages: 0,
        }
    }

    /// Handles every node's Ready once; returns entries applied on `watch`.
    fn process(&mut self, watch: u64) -> Vec<Entry> {
        let mut applied_on_watch = Vec::new();
        for (&id, node) in self.nodes.iter_mut() {
            if !node.has_ready() {
                continue;
            }
            let ready = node.ready();
            let store = node.store_mut();
            if let Some(snapshot) = &ready.snapshot {
                store.apply_snapshot(snapshot.clone());
            }
            store.append(&ready.entries);
            if let Some(hard_state) = ready.hard_state {
                store.set_hard_state(hard_state);
            }
            self.messages += ready.messages.len() as u64;
            self.inbox.extend(ready.messages.iter().cloned());
            let state = self.states.get_mut(&id).expect("state per node");
            state.applied = state.applied.max(1);
            for entry in &ready.committed_entries {
                if entry.index > state.applied {
                    state.apply(entry);
                }
                if id == watch {
                    applied_on_watch.push(entry.clone());
                }
            }
            node.advance(ready);
        }
        applied_on_watch
    }

    fn deliver(&mut self) {
        while let Some(m) = self.inbox.pop_front() {
            if let Some(node) = self.nodes.get_mut(&m.to) {
                let _ = node.step(m);
            }
        }
    }

    fn leader(&self) -> Option<u64> {
        self.nodes
            .iter()
            .find(|(_, n)| n.role() == Role::Leader)
            .map(|(&id, _)| id)
    }

    /// Ticks everyone until a leader emerges; returns (ticks, messages).
    fn elect(&mut self) -> (u64, u64) {
        let start_messages = self.messages;
        for tick in 1..=1000 {
            for node in self.nodes.values_mut() {
                node.tick();
            }
            for _ in 0..4 {
                self.process(0);
                self.deliver();
            }
            if let Some(leader) = self.leader() {
                // Let the new leader's empty entry commit everywhere.
                for _ in 0..4 {
                    self.process(leader);
                    self.deliver();
                }
                return (tick, self.messages - start_messages);
            }
        }
        panic!("no leader after 1000 ticks");
    }
}

/// Committed proposals per second with `proposers` each keeping one proposal outstanding.
fn throughput(proposers: usize) -> (f64, f64) {
    let mut cluster = Cluster::new(3);
    cluster.elect();
    let leader = cluster.leader().expect("leader elected");
    let payload = Bytes::from(vec![7u8; PROPOSAL_BYTES]);
    let mut outstanding: BTreeMap<u64, usize> = BTreeMap::new();
    let mut idle: Vec<usize> = (0..proposers).collect();
    let mut committed = 0u64;
    let mut rounds = 0u64;
    let start = Instant::now();
    while start.elapsed() < MEASURE {
        let node = cluster.nodes.get_mut(&leader).expect("leader exists");
        for proposer in idle.drain(..) {
            let index = node.propose(payload.clone()).expect("leader accepts");
            outstanding.insert(index, proposer);
        }
        for entry in cluster.process(leader) {
            if let Some(proposer) = outstanding.remove(&entry.index) {
                idle.push(proposer);
                committed += 1;
            }
        }
        cluster.deliver();
        rounds += 1;
        if rounds.is_multiple_of(64) {
            for node in cluster.nodes.values_mut() {
                node.tick();
            }
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    (
        committed as f64 / seconds,
        cluster.messages as f64 / committed.max(1) as f64,
    )
}

/// The reference: the same entries applied to the state machine directly.
fn direct_apply_rate() -> f64 {
    let payload = Bytes::from(vec![7u8; PROPOSAL_BYTES]);
    let mut state = AppState::default();
    let mut index = 0u64;
    let start = Instant::now();
    while start.elapsed() < MEASURE {
        for _ in 0..1024 {
            index += 1;
            let entry = Entry {
                term: 1,
                index,
                kind: conclave_raft::EntryKind::Normal,
                data: payload.clone(),
            };
            state.apply(black_box(&entry));
        }
    }
    index as f64 / start.elapsed().as_secs_f64()
}

fn main() {
    let mut election = Cluster::new(3);
    let (ticks, messages) = election.elect();
    println!("election (3 nodes, PreVote on): {ticks} ticks, {messages} messages");
    let reference = direct_apply_rate();
    println!();
    println!("| proposers | committed/s | messages per commit | vs direct apply |");
    println!("|---:|---:|---:|---:|");
    for proposers in [1, 64, 256] {
        let (rate, per_commit) = throughput(proposers);
        println!(
            "| {proposers} | {rate:.0} | {per_commit:.2} | {:.3} |",
            rate / reference
        );
    }
    println!("| reference: direct apply, no consensus | {reference:.0} | - | 1.000 |");
}
