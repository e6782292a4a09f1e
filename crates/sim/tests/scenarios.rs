//! Named scenario tests in the spirit of the MIT 6.5840 Raft lab, run in the deterministic
//! simulator's virtual time. Each drives faults by hand through the scenario API and asserts
//! a property of its own; every one also ends by asserting that the invariant checkers, which
//! run after every event, saw no violation.

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
