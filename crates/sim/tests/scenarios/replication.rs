//! Log replication under partitions: 6.5840's TestFailNoAgree, TestRejoin and TestBackup.

use conclave_raft::Prng;
use conclave_sim::{Simulation, SwarmParams};

use crate::common::*;

#[test]
fn fail_no_agree() {
    for_each_seed("fail_no_agree", 10000, 50, fail_no_agree_seed);
}

fn fail_no_agree_seed(seed: u64) {
    let mut sim = Simulation::scenario(seed, SwarmParams::reliable(5), None);
    let mut net = Net::all(&sim);
    one(&mut sim, &net, b"10", 5);

    // Three of five followers gone: the leader can append but never commit.
    let leader = one_leader(&mut sim, &net.ids());
    for k in 1..=3 {
        net.disconnect(&mut sim, (leader + k - 1) % 5 + 1);
    }
    let index = sim.propose(leader, "20".into()).expect("leader accepts");
    sim.run_for(2 * ELECTION_MS);
    assert_eq!(
        n_committed(&sim, b"20"),
        0,
        "an entry committed without a majority"
    );
    for id in 1..=5 {
        let commit = sim.node(id).unwrap().commit_index();
        assert!(
            commit < index,
            "node {id} has commit index {commit} >= {index}"
        );
    }

    // Back together: new entries commit everywhere.
    net.connect_all(&mut sim);
    let leader2 = one_leader(&mut sim, &net.ids());
    let index2 = sim.propose(leader2, "30".into()).expect("leader accepts");
    assert!(
        index2 >= index,
        "index {index2} went backwards past {index}"
    );
    one(&mut sim, &net, b"1000", 5);
    assert_eq!(n_committed(&sim, b"30"), 5);
    wait_all_agree(&mut sim, 2_000);
    assert_no_violations(&sim);
}

#[test]
fn rejoin() {
    for_each_seed("rejoin", 11000, 50, rejoin_seed);
}

fn rejoin_seed(seed: u64) {
    let mut sim = Simulation::scenario(seed, SwarmParams::reliable(3), None);
    let mut net = Net::all(&sim);
    one(&mut sim, &net, b"101", 3);

    // The leader is cut off and appends entries no one else sees.
    let leader1 = one_leader(&mut sim, &net.ids());
    net.disconnect(&mut sim, leader1);
    let stale = [b"102-stale", b"103-stale", b"104-stale"];
    for data in stale {
        sim.propose(leader1, data.as_slice().into())
            .expect("stale leader still accepts");
    }

    // The other two elect a leader and commit something else at those indices.
    one(&mut sim, &net, b"103", 2);

    // The new leader leaves, the old one returns: its log is behind, so it cannot win,
    // and its stale entries are overwritten.
    let leader2 = one_leader(&mut sim, &net.ids());
    net.disconnect(&mut sim, leader2);
    net.connect(&mut sim, leader1);
    one(&mut sim, &net, b"104", 2);

    net.connect(&mut sim, leader2);
    one(&mut sim, &net, b"105", 3);
    wait_all_agree(&mut sim, 2_000);
    for data in stale {
        assert_eq!(
            n_committed(&sim, data),
            0,
            "a minority leader's entry was applied"
        );
    }
    for data in [&b"101"[..], b"103", b"104", b"105"] {
        assert_eq!(n_committed(&sim, data), 3);
    }
    assert_no_violations(&sim);
}

/// 6.5840's TestBackup: two long diverging suffixes must be repaired quickly.
#[test]
fn backup_over_50_conflicting_entries() {
    for_each_seed(
        "backup_over_50_conflicting_entries",
        12000,
        30,
        backup_over_50_conflicting_entries_seed,
    );
}

fn backup_over_50_conflicting_entries_seed(seed: u64) {
    const BATCH: u64 = 50;
    let mut sim = Simulation::scenario(seed, SwarmParams::reliable(5), None);
    let mut net = Net::all(&sim);
    let mut rng = Prng::new(seed);
    one(&mut sim, &net, b"first", 5);

    // The leader and one follower in a minority: 50 entries that never commit.
    let leader1 = one_leader(&mut sim, &net.ids());
    let nth = |k: u64| (leader1 + k - 1) % 5 + 1;
    for k in 2..=4 {
        net.disconnect(&mut sim, nth(k));
    }
    for i in 0..BATCH {
        let _ = sim.propose(leader1, value("lost-a", i).into());
    }
    sim.run_for(ELECTION_MS / 2);

    // Swap: the other three elect a leader and commit 50.
    net.disconnect(&mut sim, nth(0));
    net.disconnect(&mut sim, nth(1));
    for k in 2..=4 {
        net.connect(&mut sim, nth(k));
    }
    for i in 0..BATCH {
        one(&mut sim, &net, &value("kept-a", i), 3);
    }

    // Now that leader and one follower of it split off too: 50 more that never commit.
    let leader2 = one_leader(&mut sim, &net.ids());
    let other = (2..=4).map(nth).find(|&id| id != leader2).unwrap();
    net.disconnect(&mut sim, other);
    for i in 0..BATCH {
        let _ = sim.propose(leader2, value("lost-b", i).into());
    }
    sim.run_for(ELECTION_MS / 2);

    // The first leader's pair comes back with `other`: the pair's 50 stale entries must be
    // overwritten, and 50 new ones commit among these three.
    for id in 1..=5 {
        net.disconnect(&mut sim, id);
    }
    net.connect(&mut sim, nth(0));
    net.connect(&mut sim, nth(1));
    net.connect(&mut sim, other);
    for i in 0..BATCH {
        one(&mut sim, &net, &value("kept-b", i), 3);
    }

    // Everyone: one log.
    net.connect_all(&mut sim);
    let last = value("last", rng.next_u64() % 10_000);
    one(&mut sim, &net, &last, 5);
    let applied = wait_all_agree(&mut sim, 2_000);
    for i in 0..BATCH {
        assert_eq!(n_committed(&sim, &value("kept-a", i)), 5);
        assert_eq!(n_committed(&sim, &value("kept-b", i)), 5);
        assert_eq!(
            n_committed(&sim, &value("lost-a", i)),
            0,
            "a minority entry committed"
        );
        assert_eq!(
            n_committed(&sim, &value("lost-b", i)),
            0,
            "a minority entry committed"
        );
    }
    println!("backup_over_50_conflicting_entries: all 5 agree up to index {applied}");
    assert_no_violations(&sim);
}
