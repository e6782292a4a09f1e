//! # conclave-sim
//!
//! A deterministic simulator for Conclave's Raft core. One seed drives everything: cluster
//! size, network faults (drops, duplicates, delays that reorder, symmetric, one-way and bridge
//! partitions), crashes at any point of Ready handling, restarts from exactly what was
//! persisted, clock skew, client proposals and reads, leadership transfers, membership changes
//! and snapshots. The checkers in [`checker`] run after every event.
//!
//! Two machines: by default [`core_sim`] runs the server's own node core
//! (`conclave_server::node::core`) with the real coordination state machine, its leader
//! duties and clients whose histories are checked; [`sim`] runs the bare Raft core with a
//! hash-chain machine, cheaper, for the Raft-level scenarios and benchmarks.
//!
//! ## Layout
//! - [`core_sim`]: the node core under faults, with linearizability, lease, election-group,
//!   exactly-once, timer and Ready-order checks; [`core_sim::Bug`] are its negative controls.
//! - [`lin`]: the per-key linearizability search.
//! - [`node`]: a simulated node (core + durable disk + a hash-chain state machine).
//! - [`checker`]: Raft's safety invariants over the run's history.
//! - [`sim`]: the event loop, network, nemesis, clients and liveness phase.

pub mod checker;
pub mod core_sim;
pub mod lin;
pub mod node;
pub mod sim;

pub use core_sim::{Bug, CoreSimulation};
pub use node::StorageKind;
pub use sim::{ConfigHook, Profile, Simulation, Stats, SwarmParams};
