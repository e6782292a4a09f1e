//! Named scenario tests in the spirit of the MIT 6.5840 Raft lab, run in the deterministic
//! simulator's virtual time. Each drives faults by hand through the scenario API and asserts
//! a property of its own; every one also ends by asserting that the invariant checkers, which
//! run after every event, saw no violation.
//!
//! Each scenario runs over a fixed range of seeds of its own (20–50; the suite takes about
//! 10 s in release). `SIM_SEED=<n>` replays one seed, `SIM_SCENARIO_SEEDS=<k>` runs `k`
//! seeds per scenario: 200 per scenario passed in about 90 s.

mod common;

#[path = "scenarios/budget.rs"]
mod budget;
#[path = "scenarios/crashes.rs"]
mod crashes;
#[path = "scenarios/elections.rs"]
mod elections;
#[path = "scenarios/features.rs"]
mod features;
#[path = "scenarios/replication.rs"]
mod replication;
