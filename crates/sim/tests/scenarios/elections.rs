//! Leader election: 6.5840's TestInitialElection, TestReElection, TestManyElections, and a
//! cluster without a quorum.

use conclave_raft::Prng;
use conclave_sim::{Simulation, SwarmParams};

use crate::common::*;

#[test]
fn initial_election() {
    for_each_seed("initial_election", 1000, 50, initial_election_seed);
}

fn initial_election_seed(seed: u64) {
    let mut sim = Simulation::scenario(seed, SwarmParams::reliable(3), None);
    let mut elected_at = None;
    while sim.now_ms < 5_000 {
        sim.run_for(10);
        if sim.leader().is_some() {
            elected_at = Some(sim.now_ms);
            break;
        }
    }
    let elected_at = elected_at.expect("no leader within 5 s");
    // Let followers hear from it, then every node must agree on leader and term.
    sim.run_for(200);
    let leader = sim.leader().expect("leader");
    let term = sim.node(leader).unwrap().term();
    assert!(term >= 1);
    for id in 1..=3 {
        let raw = sim.node(id).unwrap();
        assert_eq!(raw.term(), term, "node {id} disagrees on the term");
        assert_eq!(
            raw.leader(),
            Some(leader),
            "node {id} follows another leader"
        );
    }
    // With no faults the term must not move over a further 2 s.
    sim.run_for(2_000);
    assert_eq!(
        sim.leader(),
        Some(leader),
        "leadership changed without faults"
    );
    for id in 1..=3 {
        assert_eq!(
            sim.node(id).unwrap().term(),
            term,
            "term moved without faults"
        );
    }
    println!("initial_election: leader {leader} at {elected_at} ms, term {term}");
    assert_no_violations(&sim);
}

#[test]
fn reelection() {
    for_each_seed("reelection", 2000, 50, reelection_seed);
}

fn reelection_seed(seed: u64) {
    let mut sim = Simulation::scenario(seed, SwarmParams::reliable(3), None);
    let mut net = Net::all(&sim);
    let leader1 = one_leader(&mut sim, &net.ids());

    // The leader leaves: the other two elect a new one.
    net.disconnect(&mut sim, leader1);
    let leader2 = one_leader(&mut sim, &net.ids());
    assert_ne!(leader2, leader1);
    let term2 = sim.node(leader2).unwrap().term();

    // The old leader rejoins: still one leader, and PreVote keeps it from raising the term.
    net.connect(&mut sim, leader1);
    let leader3 = one_leader(&mut sim, &net.ids());
    sim.run_for(500);
    assert_eq!(sim.leader(), Some(leader3));
    for id in 1..=3 {
        let raw = sim.node(id).unwrap();
        assert_eq!(
            raw.term(),
            term2,
            "node {id}: the rejoining ex-leader disrupted the term"
        );
    }

    // Two of three cut off: nobody may lead.
    let other = leader3 % 3 + 1;
    net.disconnect(&mut sim, leader3);
    net.disconnect(&mut sim, other);
    sim.run_for(2 * ELECTION_MS);
    assert_no_leader(&sim, &[1, 2, 3]);

    // A quorum returns: a leader again.
    net.connect(&mut sim, other);
    one_leader(&mut sim, &net.ids());
    // Everyone back: still exactly one leader.
    net.connect(&mut sim, leader3);
    let last = one_leader(&mut sim, &net.ids());
    sim.run_for(500);
    assert_eq!(sim.leader(), Some(last));
    assert_no_violations(&sim);
}

#[test]
fn no_quorum_no_leader() {
    for_each_seed("no_quorum_no_leader", 3000, 50, no_quorum_no_leader_seed);
}

fn no_quorum_no_leader_seed(seed: u64) {
    let mut sim = Simulation::scenario(seed, SwarmParams::reliable(3), None);
    let mut net = Net::all(&sim);
    let leader = one_leader(&mut sim, &net.ids());
    let term = sim.node(leader).unwrap().term();

    // Every node on its own: 1 of 3 is never a quorum.
    for id in 1..=3 {
        net.disconnect(&mut sim, id);
    }
    sim.run_for(3_000);
    assert_no_leader(&sim, &[1, 2, 3]);
    // CheckQuorum made the old leader step down, and PreVote kept every term where it was:
    // a node that cannot win does not bump its term.
    for id in 1..=3 {
        assert_eq!(
            sim.node(id).unwrap().term(),
            term,
            "node {id} raised its term alone"
        );
    }

    net.connect_all(&mut sim);
    let again = one_leader(&mut sim, &net.ids());
    println!("no_quorum_no_leader: leader {leader} (term {term}) then {again}");
    assert_no_violations(&sim);
}

#[test]
fn many_elections_seven_nodes() {
    for_each_seed(
        "many_elections_seven_nodes",
        4000,
        30,
        many_elections_seven_nodes_seed,
    );
}

fn many_elections_seven_nodes_seed(seed: u64) {
    let mut sim = Simulation::scenario(seed, SwarmParams::reliable(7), None);
    let mut net = Net::all(&sim);
    let mut rng = Prng::new(seed ^ 0x6_5840);
    one_leader(&mut sim, &net.ids());
    let mut leaders = Vec::new();
    for _ in 0..10 {
        // Cut three distinct random nodes; the other four are a majority of seven.
        let mut cut = Vec::new();
        while cut.len() < 3 {
            let id = rng.range(1, 8);
            if !cut.contains(&id) {
                cut.push(id);
            }
        }
        for &id in &cut {
            net.disconnect(&mut sim, id);
        }
        let leader = one_leader(&mut sim, &net.ids());
        assert!(!cut.contains(&leader));
        leaders.push(leader);
        for &id in &cut {
            net.connect(&mut sim, id);
        }
    }
    one_leader(&mut sim, &net.ids());
    println!("many_elections_seven_nodes: leaders {leaders:?}");
    assert_no_violations(&sim);
}
