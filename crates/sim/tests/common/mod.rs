//! Helpers for the named scenarios, after the MIT 6.5840 Raft lab's `config.go`: a view of
//! which nodes are connected, `one` (propose until a value commits on enough nodes), and
//! leader checks restricted to the connected part of the cluster.

#![allow(dead_code)] // each test binary uses a different subset

use std::collections::{BTreeMap, BTreeSet};

use bytes::Bytes;
use conclave_raft::{NodeId, Role};
use conclave_sim::Simulation;

/// Generous upper bound on how long one election takes, in virtual ms (timeouts are
/// 100–200 ms; split votes and PreVote rounds can take a few of them).
pub const ELECTION_MS: u64 = 1_000;

/// Which nodes can talk to each other. A node outside `connected` talks to nobody, as with
/// 6.5840's `disconnect(i)`. Kept here rather than in the simulator so that reconnecting one
/// node never silently reconnects it to another node that is still cut off.
pub struct Net {
    pub connected: BTreeSet<NodeId>,
}

impl Net {
    pub fn all(sim: &Simulation) -> Net {
        Net {
            connected: sim.nodes.keys().copied().collect(),
        }
    }

    pub fn disconnect(&mut self, sim: &mut Simulation, id: NodeId) {
        self.connected.remove(&id);
        self.apply(sim);
    }

    pub fn connect(&mut self, sim: &mut Simulation, id: NodeId) {
        self.connected.insert(id);
        self.apply(sim);
    }

    pub fn connect_all(&mut self, sim: &mut Simulation) {
        self.connected = sim.nodes.keys().copied().collect();
        self.apply(sim);
    }

    fn apply(&self, sim: &mut Simulation) {
        sim.heal_network();
        let ids: Vec<NodeId> = sim.nodes.keys().copied().collect();
        for id in ids {
            if !self.connected.contains(&id) {
                sim.isolate(id);
            }
        }
    }

    pub fn ids(&self) -> Vec<NodeId> {
        self.connected.iter().copied().collect()
    }
}

/// Leaders among `among` (live nodes only), by term. Fails the test if two lead one term.
pub fn leaders_by_term(sim: &Simulation, among: &[NodeId]) -> BTreeMap<u64, NodeId> {
    let mut by_term = BTreeMap::new();
    for &id in among {
        if let Some(raw) = sim.node(id)
            && raw.role() == Role::Leader
            && let Some(other) = by_term.insert(raw.term(), id)
        {
            panic!("term {} has two leaders: {other} and {id}", raw.term());
        }
    }
    by_term
}

/// 6.5840's `checkOneLeader`: waits (up to 5 s) until the nodes in `among` have a leader and
/// returns the one of the latest term.
pub fn one_leader(sim: &mut Simulation, among: &[NodeId]) -> NodeId {
    for _ in 0..50 {
        sim.run_for(100);
        if let Some((_, &id)) = leaders_by_term(sim, among).last_key_value() {
            return id;
        }
    }
    panic!("no leader among {among:?} within 5 s\n{}", sim.describe());
}

/// 6.5840's `checkNoLeader`: no node in `among` believes it leads.
pub fn assert_no_leader(sim: &Simulation, among: &[NodeId]) {
    let leaders = leaders_by_term(sim, among);
    assert!(
        leaders.is_empty(),
        "expected no leader among {among:?}, found {leaders:?}"
    );
}

/// How many live nodes applied an entry carrying `data`.
pub fn n_committed(sim: &Simulation, data: &[u8]) -> usize {
    sim.applied_count(data)
}

/// 6.5840's `one`: proposes `data` at whichever connected node leads, retrying for up to 10 s
/// virtual, until at least `expected` live nodes have applied it. Returns the index the last
/// accepted proposal got.
pub fn one(sim: &mut Simulation, net: &Net, data: &[u8], expected: usize) -> u64 {
    let start = sim.now_ms;
    while sim.now_ms < start + 10_000 {
        let mut index = None;
        for id in net.ids() {
            if sim.node(id).is_some_and(|r| r.role() == Role::Leader)
                && let Ok(i) = sim.propose(id, Bytes::copy_from_slice(data))
            {
                index = Some(i);
                break;
            }
        }
        match index {
            Some(index) => {
                // Give this proposal 2 s to commit before trying again.
                for _ in 0..100 {
                    sim.run_for(20);
                    if n_committed(sim, data) >= expected {
                        return index;
                    }
                }
            }
            None => sim.run_for(50),
        }
    }
    panic!(
        "value {:?} did not commit on {expected} nodes within 10 s\n{}",
        String::from_utf8_lossy(data),
        sim.describe()
    );
}

/// Waits up to `within_ms` for every live node to have applied the same state (index and
/// hash chain), equal to the leader's commit index. Returns that index.
pub fn wait_all_agree(sim: &mut Simulation, within_ms: u64) -> u64 {
    let start = sim.now_ms;
    loop {
        if let Some(index) = all_agree(sim) {
            return index;
        }
        assert!(
            sim.now_ms < start + within_ms,
            "nodes did not converge on one log within {within_ms} ms\n{}",
            sim.describe()
        );
        sim.run_for(20);
    }
}

/// Some(applied index) if every node is up and applied the same entries up to the commit
/// index of the one leader.
pub fn all_agree(sim: &Simulation) -> Option<u64> {
    let leader = sim.leader()?;
    let commit = sim.node(leader)?.commit_index();
    let first = sim.nodes.values().next()?;
    let (applied, hash) = (first.state.applied, first.state.hash);
    let same = sim.nodes.values().all(|n| {
        n.is_up() && n.state.applied == applied && n.state.hash == hash && applied == commit
    });
    same.then_some(applied)
}

/// Fails the test with the first invariant violations, if any.
pub fn assert_no_violations(sim: &Simulation) {
    assert!(
        sim.violations().is_empty(),
        "invariant violations: {:?}\n{}\ntrace tail:\n{}",
        &sim.violations()[..sim.violations().len().min(5)],
        sim.describe(),
        sim.trace_tail().join("\n")
    );
}

/// A value unique within a test.
pub fn value(tag: &str, i: u64) -> Vec<u8> {
    format!("{tag}-{i}").into_bytes()
}

/// The seeds a scenario runs. `SIM_SEED=<n>` replays one seed; `SIM_SCENARIO_SEEDS=<k>` runs
/// `k` seeds per scenario (for long nightly runs); otherwise `default` seeds, chosen so that
/// the whole suite stays around half a minute on two cores.
pub fn seeds(base: u64, default: u64) -> Vec<u64> {
    if let Some(seed) = std::env::var("SIM_SEED").ok().and_then(|s| s.parse().ok()) {
        return vec![seed];
    }
    let count = std::env::var("SIM_SCENARIO_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default);
    (base..base + count).collect()
}

/// Runs `scenario` once per seed, naming the seed on stderr first so that a failure shows
/// how to replay it.
pub fn for_each_seed(name: &str, base: u64, default: u64, scenario: fn(u64)) {
    for seed in seeds(base, default) {
        eprintln!("{name}: seed {seed} (replay with SIM_SEED={seed})");
        scenario(seed);
    }
}
