//! Snapshots, leadership transfer, membership change, ReadIndex, flow control and
//! determinism, each through the simulator with its checkers on.

use std::collections::BTreeSet;

use bytes::Bytes;
use conclave_raft::{ConfChangeStep, Config, Error, NodeId, Role, Storage};
use conclave_sim::{Simulation, SwarmParams};

use crate::common::*;

/// Proposes at `leader` and waits until every node in `among` applied that index with the
/// proposal's term. Unlike `one`, this does not look entries up in the log, which a snapshot
/// may already have compacted.
fn commit_at(sim: &mut Simulation, leader: NodeId, data: Vec<u8>, among: &[NodeId]) -> u64 {
    let term = sim.node(leader).unwrap().term();
    let index = sim
        .propose(leader, Bytes::from(data))
        .expect("leader accepts");
    let deadline = sim.now_ms + 2_000;
    while !among
        .iter()
        .all(|&id| sim.node(id).is_some_and(|r| r.applied_index() >= index))
    {
        assert!(
            sim.now_ms < deadline,
            "index {index} did not commit\n{}",
            sim.describe()
        );
        sim.run_for(5);
    }
    assert_eq!(
        sim.applied_term(index),
        Some(term),
        "index {index} holds another entry"
    );
    index
}

#[test]
fn snapshots_lagging_follower() {
    for_each_seed(
        "snapshots_lagging_follower",
        70000,
        50,
        snapshots_lagging_follower_seed,
    );
}

fn snapshots_lagging_follower_seed(seed: u64) {
    let mut params = SwarmParams::reliable(3);
    params.snapshot_every = 10;
    let mut sim = Simulation::scenario(seed, params, None);
    let mut net = Net::all(&sim);
    let leader = one_leader(&mut sim, &net.ids());
    let lagging = leader % 3 + 1;
    let peer = lagging % 3 + 1;
    commit_at(&mut sim, leader, b"before".to_vec(), &[1, 2, 3]);

    net.disconnect(&mut sim, lagging);
    let mut last = 0;
    for i in 0..100 {
        last = commit_at(&mut sim, leader, value("snap", i), &[leader, peer]);
    }
    let first_kept = sim.node(leader).unwrap().store().first_index().unwrap();
    let lag_last = sim.node(lagging).unwrap().last_index();
    assert!(
        first_kept > lag_last + 1,
        "the leader kept entries from {first_kept}, the follower needs {}: no snapshot needed",
        lag_last + 1
    );
    assert_eq!(sim.stats.snapshots_installed, 0);

    net.connect(&mut sim, lagging);
    let start = sim.now_ms;
    while sim.node(lagging).unwrap().applied_index() < last {
        assert!(
            sim.now_ms < start + 3_000,
            "follower did not catch up\n{}",
            sim.describe()
        );
        sim.run_for(10);
    }
    let caught_up_ms = sim.now_ms - start;
    assert!(
        sim.stats.snapshots_installed > 0,
        "caught up without InstallSnapshot"
    );
    // Snapshots travel in chunks of 40 bytes in the simulator, so one takes several.
    let chunks = sim
        .stats
        .sent_by_kind
        .get("SnapshotChunk")
        .copied()
        .unwrap_or(0);
    assert!(chunks > 1, "{chunks} snapshot chunks sent");
    let applied = wait_all_agree(&mut sim, 2_000);
    let lag = sim.node(lagging).unwrap();
    assert_eq!(lag.applied_index(), lag.commit_index());
    println!(
        "snapshots_lagging_follower: follower {lagging} behind at {lag_last}, leader kept from \
         {first_kept}; caught up in {caught_up_ms} ms with {} snapshot installs ({chunks} chunks); all at \
         {applied}",
        sim.stats.snapshots_installed
    );
    assert_no_violations(&sim);
}

#[test]
fn snapshot_transfer_outlasts_newer_snapshots() {
    for_each_seed(
        "snapshot_transfer_outlasts_newer_snapshots",
        75000,
        30,
        snapshot_transfer_outlasts_newer_snapshots_seed,
    );
}

/// A follower behind a compacted log gets a snapshot while the leader records a newer one
/// every few milliseconds, far faster than a transfer of 4-byte chunks (about 30 round trips)
/// takes. Each transfer must finish the snapshot it began: restarting with every newer one,
/// the follower never installed any.
fn snapshot_transfer_outlasts_newer_snapshots_seed(seed: u64) {
    /// Virtual ms the write load goes on after the follower reconnects.
    const LOADED_MS: u64 = 3_000;
    /// Virtual ms between two proposals of the load (a snapshot every 2 entries).
    const PROPOSAL_PERIOD_MS: u64 = 5;
    fn tiny_chunks(config: &mut Config) {
        config.snapshot_chunk_bytes = 4;
    }
    let mut params = SwarmParams::reliable(3);
    params.snapshot_every = 2;
    let mut sim = Simulation::scenario(seed, params, Some(tiny_chunks));
    let mut net = Net::all(&sim);
    let leader = one_leader(&mut sim, &net.ids());
    let lagging = leader % 3 + 1;
    let peer = lagging % 3 + 1;
    commit_at(&mut sim, leader, b"before".to_vec(), &[1, 2, 3]);
    net.disconnect(&mut sim, lagging);
    for i in 0..20 {
        commit_at(&mut sim, leader, value("behind", i), &[leader, peer]);
    }
    net.connect(&mut sim, lagging);
    let start = sim.now_ms;
    let mut i = 0;
    while sim.now_ms < start + LOADED_MS {
        if sim.node(leader).is_some_and(|r| r.role() == Role::Leader) {
            let _ = sim.propose(leader, Bytes::from(value("load", i)));
            i += 1;
        }
        sim.run_for(PROPOSAL_PERIOD_MS);
    }
    let installed = sim.stats.snapshots_installed;
    assert!(
        installed > 0,
        "follower {lagging} installed no snapshot in {LOADED_MS} ms of load ({i} proposals)\n{}",
        sim.describe()
    );
    let applied = wait_all_agree(&mut sim, 3_000);
    println!(
        "snapshot_transfer_outlasts_newer_snapshots: {installed} installs under load \
         ({i} proposals); all at {applied}"
    );
    assert_no_violations(&sim);
}

#[test]
fn leadership_transfer() {
    for_each_seed("leadership_transfer", 80000, 50, leadership_transfer_seed);
}

fn leadership_transfer_seed(seed: u64) {
    let mut sim = Simulation::scenario(seed, SwarmParams::reliable(3), None);
    let mut net = Net::all(&sim);
    let leader = one_leader(&mut sim, &net.ids());
    one(&mut sim, &net, b"before-transfer", 3);

    // To an up-to-date follower: it leads within 1 s, one term later.
    let term = sim.node(leader).unwrap().term();
    let target = leader % 3 + 1;
    sim.transfer_leader(leader, target)
        .expect("transfer starts");
    let start = sim.now_ms;
    while sim.leader() != Some(target) {
        assert!(
            sim.now_ms < start + 1_000,
            "{target} did not take over within 1 s"
        );
        sim.run_for(1);
    }
    let took_ms = sim.now_ms - start;
    assert_eq!(sim.node(target).unwrap().term(), term + 1);
    one(&mut sim, &net, b"after-transfer", 3);
    assert_eq!(sim.leader(), Some(target));
    assert_eq!(sim.node(leader).unwrap().leader(), Some(target));

    // To a follower that fell behind: the leader catches it up first, and refuses
    // proposals while it hands over.
    let lagging = target % 3 + 1;
    net.disconnect(&mut sim, lagging);
    for i in 0..20 {
        one(&mut sim, &net, &value("while-away", i), 2);
    }
    net.connect(&mut sim, lagging);
    sim.transfer_leader(target, lagging)
        .expect("transfer starts");
    assert!(matches!(
        sim.propose(target, "refused".into()),
        Err(Error::TransferInProgress { target: t }) if t == lagging
    ));
    let start = sim.now_ms;
    while sim.leader() != Some(lagging) {
        assert!(
            sim.now_ms < start + 1_000,
            "{lagging} did not take over within 1 s"
        );
        sim.run_for(1);
    }
    let lagging_took_ms = sim.now_ms - start;
    one(&mut sim, &net, b"after-second-transfer", 3);
    for i in 0..20 {
        assert_eq!(n_committed(&sim, &value("while-away", i)), 3);
    }
    wait_all_agree(&mut sim, 2_000);
    println!(
        "leadership_transfer: {leader} -> {target} in {took_ms} ms, {target} -> {lagging} \
         (20 entries behind) in {lagging_took_ms} ms"
    );
    assert_no_violations(&sim);
}

/// Proposes a membership change, retrying while an earlier one is still being finished
/// (the leader leaves a joint configuration by itself, which briefly blocks the next change).
fn change(sim: &mut Simulation, leader: NodeId, steps: Vec<ConfChangeStep>) {
    for _ in 0..200 {
        match sim.propose_conf_change(leader, steps.clone()) {
            Ok(_) => return,
            Err(Error::ConfChangeInProgress) => sim.run_for(10),
            Err(e) => panic!("membership change {steps:?} refused: {e}"),
        }
    }
    panic!("membership change {steps:?} still blocked after 2 s");
}

/// Waits until every node in `among` has applied a non-joint configuration with these voters
/// and learners.
fn wait_conf(sim: &mut Simulation, among: &[NodeId], voters: &[NodeId], learners: &[NodeId]) {
    let voters: BTreeSet<NodeId> = voters.iter().copied().collect();
    let learners: BTreeSet<NodeId> = learners.iter().copied().collect();
    let start = sim.now_ms;
    loop {
        let done = among.iter().all(|&id| {
            sim.node(id).is_some_and(|r| {
                let conf = r.conf_state();
                !conf.is_joint()
                    && conf.voters.iter().copied().collect::<BTreeSet<_>>() == voters
                    && conf.learners.iter().copied().collect::<BTreeSet<_>>() == learners
            })
        });
        if done {
            return;
        }
        assert!(
            sim.now_ms < start + 3_000,
            "membership did not reach voters {voters:?} learners {learners:?}\n{}",
            sim.describe()
        );
        sim.run_for(10);
    }
}

#[test]
fn membership_add_promote_remove() {
    for_each_seed(
        "membership_add_promote_remove",
        90000,
        50,
        membership_add_promote_remove_seed,
    );
}

fn membership_add_promote_remove_seed(seed: u64) {
    let mut sim = Simulation::scenario(seed, SwarmParams::reliable(3), None);
    let mut net = Net::all(&sim);
    let leader = one_leader(&mut sim, &net.ids());
    one(&mut sim, &net, b"three", 3);

    // Node 4 joins with an empty disk, first as a learner: it replicates but does not vote.
    sim.add_node(4, None);
    net.connect(&mut sim, 4);
    change(&mut sim, leader, vec![ConfChangeStep::AddLearner(4)]);
    wait_conf(&mut sim, &[1, 2, 3, 4], &[1, 2, 3], &[4]);
    one(&mut sim, &net, b"with-learner", 4);
    assert_eq!(sim.node(4).unwrap().role(), Role::Follower);

    // Promoted to voter.
    change(&mut sim, leader, vec![ConfChangeStep::AddVoter(4)]);
    wait_conf(&mut sim, &[1, 2, 3, 4], &[1, 2, 3, 4], &[]);
    assert_eq!(sim.leader(), Some(leader));
    one(&mut sim, &net, b"four-voters", 4);

    // The leader removes itself: it steps down and the other three carry on.
    let term = sim.node(leader).unwrap().term();
    change(&mut sim, leader, vec![ConfChangeStep::RemoveNode(leader)]);
    let remaining: Vec<NodeId> = (1..=4).filter(|&id| id != leader).collect();
    let voters = remaining.clone();
    wait_conf(&mut sim, &remaining, &voters, &[]);
    let start = sim.now_ms;
    while sim.node(leader).unwrap().role() == Role::Leader {
        assert!(
            sim.now_ms < start + 1_000,
            "the removed leader did not step down"
        );
        sim.run_for(10);
    }
    let new_leader = one_leader(&mut sim, &remaining);
    assert_ne!(new_leader, leader);
    assert!(sim.node(new_leader).unwrap().term() > term);
    one(&mut sim, &net, b"without-the-old-leader", 3);
    // The removed node must not disturb the new configuration.
    sim.run_for(1_000);
    assert_eq!(sim.leader(), Some(new_leader));
    for &id in &remaining {
        let conf = sim.node(id).unwrap().conf_state();
        assert!(!conf.voters.contains(&leader) && !conf.learners.contains(&leader));
    }
    println!(
        "membership_add_promote_remove: leader {leader} removed itself, {new_leader} leads \
         voters {voters:?}; {} membership entries applied across nodes",
        sim.stats.conf_changes_applied
    );
    assert_no_violations(&sim);
}

/// The read index served for `context`, if it was served.
fn served(sim: &Simulation, context: &[u8]) -> Option<u64> {
    sim.stats
        .served_reads
        .iter()
        .find(|(_, c, _)| c.as_ref() == context)
        .map(|&(_, _, index)| index)
}

fn max_commit(sim: &Simulation) -> u64 {
    sim.nodes
        .keys()
        .filter_map(|&id| sim.node(id).map(|r| r.commit_index()))
        .max()
        .unwrap_or(0)
}

#[test]
fn read_index_linearizable() {
    for_each_seed(
        "read_index_linearizable",
        100000,
        50,
        read_index_linearizable_seed,
    );
}

fn read_index_linearizable_seed(seed: u64) {
    let mut sim = Simulation::scenario(seed, SwarmParams::reliable(3), None);
    let mut net = Net::all(&sim);
    let leader = one_leader(&mut sim, &net.ids());
    one(&mut sim, &net, b"r-first", 3);
    let follower = leader % 3 + 1;
    for i in 0..20 {
        // Writes in flight while the reads run, so the commit index keeps moving.
        let _ = sim.propose(leader, Bytes::from(value("r-write", i)));
        let committed_at_start = max_commit(&sim);
        let on_leader = value("read-leader", i);
        let on_follower = value("read-follower", i);
        sim.read(leader, on_leader.clone().into())
            .expect("leader read");
        sim.read(follower, on_follower.clone().into())
            .expect("follower read");
        let start = sim.now_ms;
        while served(&sim, &on_leader).is_none() || served(&sim, &on_follower).is_none() {
            assert!(sim.now_ms < start + 1_000, "read {i} not served within 1 s");
            sim.run_for(1);
        }
        for ctx in [&on_leader, &on_follower] {
            let index = served(&sim, ctx).unwrap();
            assert!(
                index >= committed_at_start,
                "read served at {index}, but {committed_at_start} was committed when it began"
            );
        }
    }

    // A leader cut off from the rest may still think it leads; its read must never come back,
    // since the others elect a leader and commit writes it cannot see.
    let stale = one_leader(&mut sim, &net.ids());
    net.disconnect(&mut sim, stale);
    assert_eq!(sim.node(stale).unwrap().role(), Role::Leader);
    sim.read(stale, "stale-read".into())
        .expect("a leader accepts the read");
    let new_leader = one_leader(&mut sim, &net.ids());
    assert_ne!(new_leader, stale);
    one(&mut sim, &net, b"r-after-partition", 2);
    sim.run_for(2_000);
    assert_eq!(
        served(&sim, b"stale-read"),
        None,
        "a cut-off leader served a read"
    );
    net.connect(&mut sim, stale);
    sim.run_for(1_000);
    assert_eq!(
        served(&sim, b"stale-read"),
        None,
        "a deposed leader served an old read"
    );
    println!(
        "read_index_linearizable: {} reads served, the cut-off leader's read never was",
        sim.stats.reads_served
    );
    assert_no_violations(&sim);
}

#[test]
fn uncommitted_limit_rejects() {
    for_each_seed(
        "uncommitted_limit_rejects",
        110000,
        50,
        uncommitted_limit_rejects_seed,
    );
}

fn uncommitted_limit_rejects_seed(seed: u64) {
    const LIMIT: u64 = 1_000;
    const SIZE: usize = 100;
    fn small_limit(config: &mut Config) {
        config.max_uncommitted_bytes = LIMIT;
    }
    let mut sim = Simulation::scenario(seed, SwarmParams::reliable(3), Some(small_limit));
    let mut net = Net::all(&sim);
    let leader = one_leader(&mut sim, &net.ids());
    one(&mut sim, &net, b"u-first", 3);

    // Followers cut off: nothing commits, so the leader must start refusing.
    for id in (1..=3).filter(|&id| id != leader) {
        net.disconnect(&mut sim, id);
    }
    let last_before = sim.node(leader).unwrap().last_index();
    let (mut accepted, mut rejected) = (0u64, 0u64);
    for round in 0..5 {
        for i in 0..100 {
            match sim.propose(leader, Bytes::from(vec![round as u8 + i as u8; SIZE])) {
                Ok(_) => accepted += 1,
                Err(Error::UncommittedLimit { uncommitted, limit }) => {
                    assert_eq!(limit, LIMIT);
                    assert!(uncommitted <= LIMIT);
                    rejected += 1;
                }
                // CheckQuorum deposed it: nothing more can be appended anyway.
                Err(Error::NotLeader { .. }) => {}
                Err(e) => panic!("unexpected error {e}"),
            }
        }
        sim.run_for(20);
    }
    let grown = sim.node(leader).unwrap().last_index() - last_before;
    assert!(
        accepted <= LIMIT / SIZE as u64,
        "{accepted} proposals accepted past the limit"
    );
    assert!(rejected > 0, "nothing was rejected");
    assert!(
        grown <= LIMIT / SIZE as u64,
        "the log grew by {grown} entries"
    );
    assert!(matches!(
        sim.propose(leader, Bytes::from(vec![0; LIMIT as usize + 1])),
        Err(Error::ProposalTooLarge { .. } | Error::NotLeader { .. })
    ));

    // Once the cluster is whole, proposals flow again.
    net.connect_all(&mut sim);
    for i in 0..30 {
        one(&mut sim, &net, &value("u-after", i), 3);
    }
    wait_all_agree(&mut sim, 2_000);
    println!(
        "uncommitted_limit_rejects: {accepted} accepted, {rejected} rejected, log grew by {grown}"
    );
    assert_no_violations(&sim);
}

#[test]
fn determinism() {
    let mut hashes = BTreeSet::new();
    for seed in [3, 17, 1234] {
        let mut a = Simulation::new(seed, None);
        let ok_a = a.run();
        let mut b = Simulation::new(seed, None);
        let ok_b = b.run();
        assert!(ok_a && ok_b, "seed {seed} failed: {:?}", a.violations());
        assert_eq!(
            a.trace_hash(),
            b.trace_hash(),
            "seed {seed} is not deterministic"
        );
        assert_eq!(a.stats.events, b.stats.events);
        assert_eq!(a.now_ms, b.now_ms);
        hashes.insert(a.trace_hash());
        assert_no_violations(&a);
    }
    assert_eq!(hashes.len(), 3, "different seeds gave the same trace");
}
