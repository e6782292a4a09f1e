//! # conclave-sim
//!
//! A deterministic simulator for Conclave's Raft core. One seed drives everything: cluster
//! size, network faults (drops, duplicates, delays that reorder, symmetric, one-way and bridge
//! partitions), crashes at any point of Ready handling, restarts from exactly what was
//! persisted, clock skew, client proposals and reads, leadership transfers, membership changes
//! and snapshots. The checkers in [`checker`] run after every event.
//!
//! ## Layout
//! - [`node`]: a simulated node (core + durable disk + a hash-chain state machine).
//! - [`checker`]: Raft's safety invariants over the run's history.
//! - [`sim`]: the event loop, network, nemesis, clients and liveness phase.

pub mod checker;
pub mod node;
pub mod sim;

pub use node::StorageKind;
pub use sim::{ConfigHook, Profile, Simulation, Stats, SwarmParams};
