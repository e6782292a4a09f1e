//! Negative controls: deliberately broken cores that the checkers must catch within 200 seeds.
//! A checker that lets one of these through does not count.

use conclave_raft::Config;
use conclave_sim::{ConfigHook, Simulation, SwarmParams};

/// Seeds each control may use before it counts as missed.
const SEED_BUDGET: u64 = 200;

/// Runs seeds until one violates `invariant`; returns that seed.
fn first_catching_seed(hook: ConfigHook, invariant: &str) -> Option<u64> {
    (0..SEED_BUDGET).find(|&seed| {
        let params = SwarmParams::from_seed(seed, None);
        let mut sim = Simulation::with_params(seed, params, true, Some(hook));
        sim.run();
        sim.violations()
            .iter()
            .any(|v| v.invariant.starts_with(invariant))
    })
}

#[test]
fn committing_an_earlier_term_entry_by_count_is_caught() {
    fn hook(config: &mut Config) {
        config.bugs.commit_earlier_term_by_count = true;
    }
    let seed = first_catching_seed(hook, "");
    assert!(
        seed.is_some(),
        "no checker caught Figure-8 commits within {SEED_BUDGET} seeds"
    );
    println!("caught at seed {seed:?}");
}

#[test]
fn forgetting_to_persist_the_vote_is_caught() {
    fn hook(config: &mut Config) {
        config.bugs.forget_to_persist_vote = true;
    }
    let seed = first_catching_seed(hook, "Durability(vote)");
    assert!(
        seed.is_some(),
        "a forgotten vote went unnoticed for {SEED_BUDGET} seeds"
    );
    println!("caught at seed {seed:?}");
}

#[test]
fn read_index_without_a_quorum_check_is_caught() {
    fn hook(config: &mut Config) {
        config.bugs.read_index_without_quorum_check = true;
    }
    let seed = first_catching_seed(hook, "ReadSafety");
    assert!(
        seed.is_some(),
        "stale reads went unnoticed for {SEED_BUDGET} seeds"
    );
    println!("caught at seed {seed:?}");
}

/// Not a gate: how many of the budget's seeds catch each control (run with --ignored --nocapture
/// to see the catch rates when tuning the swarm).
#[test]
fn catch_rates() {
    fn figure8(config: &mut Config) {
        config.bugs.commit_earlier_term_by_count = true;
    }
    fn vote(config: &mut Config) {
        config.bugs.forget_to_persist_vote = true;
    }
    fn read(config: &mut Config) {
        config.bugs.read_index_without_quorum_check = true;
    }
    for (name, hook) in [
        ("figure8", figure8 as ConfigHook),
        ("vote", vote),
        ("read", read),
    ] {
        let mut caught = std::collections::BTreeMap::new();
        for seed in 0..SEED_BUDGET {
            let params = SwarmParams::from_seed(seed, None);
            let mut sim = Simulation::with_params(seed, params, true, Some(hook));
            sim.run();
            for v in sim.violations() {
                *caught.entry(v.invariant).or_insert(0) += 1;
            }
        }
        println!("{name}: {caught:?}");
    }
}
