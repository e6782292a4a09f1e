//! The node core under the simulator: clean seeds pass, the same seed replays the same run, and
//! each deliberately broken core (`conclave_sim::Bug`) is caught within 200 seeds by the
//! checker meant for it.

use conclave_sim::{Bug, CoreSimulation, StorageKind, SwarmParams};

/// Seeds each control may use before it counts as missed.
const SEED_BUDGET: u64 = 200;

fn run(seed: u64, storage: StorageKind, bug: Option<Bug>) -> CoreSimulation {
    let mut params = SwarmParams::from_seed(seed, None);
    params.storage = storage;
    let mut sim = CoreSimulation::new(seed, params, bug);
    sim.run();
    sim
}

/// The first seed whose run reports a violation of `invariant` with `bug` switched on.
fn first_catching_seed(bug: Bug, invariant: &str) -> Option<u64> {
    (0..SEED_BUDGET).find(|&seed| {
        let sim = run(seed, StorageKind::Wal, Some(bug));
        sim.violations().iter().any(|v| v.invariant == invariant)
    })
}

#[test]
fn clean_seeds_pass_on_both_storages() {
    for seed in 0..8 {
        for storage in [StorageKind::Mem, StorageKind::Wal] {
            let sim = run(seed, storage, None);
            assert!(
                sim.violations().is_empty(),
                "seed {seed} ({storage:?}): {:?}\n{}",
                sim.violations(),
                sim.describe()
            );
            assert!(
                sim.stats.ops_acked > 0,
                "seed {seed}: no client got an answer"
            );
        }
    }
}

#[test]
fn a_seed_replays_to_the_same_trace() {
    for seed in [3, 11] {
        let first = run(seed, StorageKind::Wal, None);
        let second = run(seed, StorageKind::Wal, None);
        assert_eq!(first.trace_hash(), second.trace_hash(), "seed {seed}");
        assert_eq!(first.stats.events, second.stats.events, "seed {seed}");
    }
}

#[test]
fn answering_a_write_before_it_is_applied_is_caught() {
    let seed = first_catching_seed(Bug::AnswerBeforeApply, "Linearizability");
    assert!(
        seed.is_some(),
        "early answers went unnoticed for {SEED_BUDGET} seeds"
    );
    println!("caught at seed {seed:?}");
}

#[test]
fn applying_before_persisting_on_a_follower_is_caught() {
    let seed = first_catching_seed(Bug::ApplyBeforePersist, "ReadyOrder");
    assert!(
        seed.is_some(),
        "applying before persisting went unnoticed for {SEED_BUDGET} seeds"
    );
    println!("caught at seed {seed:?}");
}

#[test]
fn a_follower_acknowledging_before_it_persists_is_caught() {
    let seed = first_catching_seed(Bug::SendBeforePersist, "PersistBeforeSend");
    assert!(
        seed.is_some(),
        "sending before persisting went unnoticed for {SEED_BUDGET} seeds"
    );
    println!("caught at seed {seed:?}");
}

#[test]
fn a_leader_that_never_proposes_tick_is_caught() {
    // The publisher's messages never age out, so the run never settles.
    let seed = first_catching_seed(Bug::SkipTick, "Liveness");
    assert!(
        seed.is_some(),
        "a missing timer Tick went unnoticed for {SEED_BUDGET} seeds"
    );
    println!("caught at seed {seed:?}");
}

#[test]
fn a_deposed_leader_answering_keepalives_is_caught() {
    // Without the leadership confirmation, a leader cut off by a partition answers its
    // holders after the majority has elected another.
    let seed = first_catching_seed(Bug::KeepaliveWithoutConfirm, "KeepaliveLeadership");
    assert!(
        seed.is_some(),
        "keepalives answered by deposed leaders went unnoticed for {SEED_BUDGET} seeds"
    );
    println!("caught at seed {seed:?}");
}

#[test]
fn lease_seeds_mix_members_with_and_without_lease_reads() {
    let mut params = SwarmParams::from_seed(0, Some(5));
    params.lease_reads = true;
    let starts: Vec<bool> = (0..20)
        .flat_map(|seed| (1..=5).map(move |id| (seed, id)))
        .flat_map(|(seed, id)| (0..4).map(move |restarts| (seed, id, restarts)))
        .map(|(seed, id, restarts)| params.lease_reads_at_start(seed, id, restarts))
        .collect();
    let without = starts.iter().filter(|on| !**on).count();
    // About one start in four runs without the flag.
    assert!(
        (starts.len() / 8..starts.len() / 2).contains(&without),
        "{without} of {} starts without lease reads",
        starts.len()
    );
    params.lease_reads = false;
    assert!(!params.lease_reads_at_start(3, 1, 0));
}

#[test]
fn lease_reads_pass_and_spare_heartbeat_rounds() {
    let (mut messages_with, mut messages_without) = (0, 0);
    let (mut from_lease_with, mut from_lease_without) = (0, 0);
    for seed in 0..8 {
        let mut params = SwarmParams::from_seed(seed, Some(3));
        params.storage = StorageKind::Wal;
        params.check_quorum = true;
        for lease_reads in [true, false] {
            params.lease_reads = lease_reads;
            let mut sim = CoreSimulation::new(seed, params.clone(), None);
            sim.run();
            assert!(
                sim.violations().is_empty(),
                "seed {seed}, lease reads {lease_reads}: {:?}\n{}",
                sim.violations(),
                sim.describe()
            );
            assert!(
                sim.stats.reads_by_index > 0,
                "seed {seed}: no linearizable read"
            );
            if lease_reads {
                messages_with += sim.stats.messages_delivered;
                from_lease_with += sim.stats.reads_from_lease;
            } else {
                messages_without += sim.stats.messages_delivered;
                from_lease_without += sim.stats.reads_from_lease;
            }
        }
    }
    // Leaders answered reads from their lease only when they had one.
    assert!(
        from_lease_with > 0 && from_lease_without == 0,
        "reads from the lease: {from_lease_with} with lease reads, {from_lease_without} without"
    );
    // Reads and keepalive confirmations answered from the lease send no heartbeat round.
    assert!(
        messages_with < messages_without,
        "lease reads delivered {messages_with} messages, heartbeat rounds {messages_without}"
    );
}

#[test]
fn a_lease_that_never_runs_out_is_caught() {
    // A leader cut off by a partition keeps answering from its lease after the majority has
    // elected another: its keepalives (or reads) reflect a term that is over.
    let seed = (0..SEED_BUDGET).find(|&seed| {
        let sim = run(seed, StorageKind::Wal, Some(Bug::LeaseNeverExpires));
        sim.violations()
            .iter()
            .any(|v| v.invariant == "KeepaliveLeadership" || v.invariant == "Linearizability")
    });
    assert!(
        seed.is_some(),
        "a lease that never runs out went unnoticed for {SEED_BUDGET} seeds"
    );
    println!("caught at seed {seed:?}");
}
