//! Message budgets, after 6.5840's TestCount: an election, a run of agreements and an idle
//! second must each cost a bounded number of messages. Heartbeats every 5 ticks (50 ms) and
//! an election timeout of 15 ticks, as the lab's 100 ms heartbeat budget implies.

use bytes::Bytes;
use conclave_raft::{Config, Role};
use conclave_sim::{Simulation, SwarmParams};

use crate::common::*;

fn lab_timing(config: &mut Config) {
    config.election_ticks = 15;
    config.heartbeat_ticks = 5;
}

/// A 3-node cluster with a settled leader that every node follows.
fn settled(seed: u64) -> (Simulation, u64) {
    let mut sim = Simulation::scenario(seed, SwarmParams::reliable(3), Some(lab_timing));
    let leader = one_leader(&mut sim, &[1, 2, 3]);
    (sim, leader)
}

#[test]
fn message_budget_election() {
    /// 6.5840's bound for electing a leader among three. Measured: 11 to 21 messages of every
    /// kind (PreVote and Vote rounds, their responses, the leader's first Appends and acks).
    const BUDGET: u64 = 30;
    let (mut best, mut worst) = (u64::MAX, 0);
    for seed in 0..20 {
        let mut sim = Simulation::scenario(seed, SwarmParams::reliable(3), Some(lab_timing));
        // Until a leader exists and both followers know it.
        while !(1..=3).all(|id| sim.node(id).and_then(|r| r.leader()).is_some()) {
            assert!(sim.now_ms < 5_000, "seed {seed}: no leader within 5 s");
            sim.run_for(1);
        }
        let sent = sim.stats.messages_sent;
        assert!(
            sent <= BUDGET,
            "seed {seed}: the election took {sent} messages, more than {BUDGET}: {:?}",
            sim.stats.sent_by_kind
        );
        best = best.min(sent);
        worst = worst.max(sent);
        assert_no_violations(&sim);
    }
    println!("message_budget_election: {best} to {worst} messages over 20 seeds (budget {BUDGET})");
}

#[test]
fn message_budget_agreement() {
    /// Measured over seeds 100..110: 30 to 40 requests, almost all Appends (one per follower
    /// per proposal, plus a few that carry the new commit index), at most 2 heartbeats. The
    /// bound is 6.5840's (n + 1 + 3) * 3 formula for n = 12, 20% above the worst seed.
    const AGREEMENTS: u64 = 12;
    const BUDGET: u64 = (AGREEMENTS + 1 + 3) * 3;
    let mut worst = 0;
    for seed in 0..10 {
        let (mut sim, leader) = settled(100 + seed);
        let before = sim.stats.requests_sent();
        let start = sim.now_ms;
        for i in 0..AGREEMENTS {
            sim.propose(leader, Bytes::from(value("count", i)))
                .expect("leader accepts");
        }
        while !(0..AGREEMENTS).all(|i| n_committed(&sim, &value("count", i)) == 3) {
            assert!(
                sim.now_ms < start + 2_000,
                "seed {seed}: agreements did not finish"
            );
            sim.run_for(1);
        }
        assert_eq!(
            sim.node(leader).unwrap().role(),
            Role::Leader,
            "leadership changed"
        );
        let spent = sim.stats.requests_sent() - before;
        assert!(
            spent <= BUDGET,
            "seed {seed}: {AGREEMENTS} agreements took {spent} requests, more than {BUDGET}"
        );
        worst = worst.max(spent);
        assert_no_violations(&sim);
    }
    println!(
        "message_budget_agreement: worst of 10 seeds {worst} requests for {AGREEMENTS} \
         agreements (budget {BUDGET})"
    );
}

#[test]
fn message_budget_idle() {
    /// Heartbeats every 50 ms to 2 followers are 40 requests a second (measured: exactly 40 on
    /// every seed); 6.5840 allows 3 * 20.
    const BUDGET: u64 = 60;
    let mut worst = 0;
    for seed in 0..10 {
        let (mut sim, leader) = settled(200 + seed);
        sim.run_for(500);
        let before = sim.stats.requests_sent();
        sim.run_for(1_000);
        let spent = sim.stats.requests_sent() - before;
        assert_eq!(sim.leader(), Some(leader), "leadership changed while idle");
        assert!(
            spent <= BUDGET,
            "seed {seed}: 1 s idle cost {spent} requests"
        );
        worst = worst.max(spent);
        assert_no_violations(&sim);
    }
    println!(
        "message_budget_idle: worst of 10 seeds {worst} requests per idle second (budget {BUDGET})"
    );
}
