//! The node runtime: a sans-IO node core ([`core::NodeCore`]) that decides, and the driver
//! thread that does its I/O, generic over the replicated machine
//! ([`crate::ReplicatedMachine`]).
//!
//! ```text
//!  ticker (tick_ms) ─────────┐
//!  peers ─ serve_peers ─ mpsc ┼─► driver (shell) ─► NodeCore::turn ─┬─ 1. WAL append + hard state, fsync
//!  handle ─ NodeRequest ─ mpsc┘   (one OS thread,                   ├─ 2. ReadyIo::send ─► PeerTransport
//!                                  group commit: drains              ├─ 3. machine.apply ─► Output by token
//!                                  every queue, then one             ├─ 4. read states ─► Output by token
//!                                  turn, one fsync)                  └─ 5. advance; snapshot_due
//!  NodeStatus (watch) ◄── role, leader, term, members (wakes); commit, applied (silent)
//!  AppliedWaits ◄──────── applied index: each waiter woken once, when its index is reached
//! ```
//!
//! The driver runs on its own OS thread with a current-thread runtime, so an fsync blocks
//! only Raft, never the gRPC server. A proposal's waiter is keyed by (index, term) in the core
//! and by token in the shell: if the entry applied at that index carries another term, a new
//! leader overwrote it and the waiter gets
//! [`Error::LeaderChanged`](crate::Error::LeaderChanged) instead of hanging. The simulator
//! (`conclave-sim`) runs the same core with virtual time and a simulated disk.
//!
//! # Modules
//! - `core`: the sans-IO node core: Ready handling in the contract's order, apply, waiters
//!   keyed by tokens, ReadIndex completion, member records, snapshot policy and recording.
//!   The simulator (`conclave-sim`) runs this same core.
//! - `leader_duties`: the coordination machine's leader duties (leases, the timer `Tick`),
//!   sans-IO too.
//! - `driver`: the I/O shell around the core: clock, ticker, queues, peer transport, snapshot
//!   writer thread, reply channels; the `ShellDuties` seam for what one machine adds.
//! - `coordination`: Conclave's coordination machine on it (leader clock stamping, the lease
//!   duty, watch events) and the [`NodeHandle`] the etcd and `conclave.v1` services use.
//! - `applied_waits`: waits for the applied index to reach a point, one wake-up each.
//! - `entries`: how member records and machine bytes share the log and the snapshots.
//! - `identity`: the file that ties a data directory to its cluster and member.
//!
//! An embedding program uses [`crate::embed::Node`] instead.

use std::path::Path;

pub mod applied_waits;
mod coordination;
pub mod core;
pub(crate) mod driver;
mod entries;
mod identity;
pub mod leader_duties;

pub use coordination::{
    APPLIED_EVENTS_BUFFER_MAX, AppliedEvents, LeaseRenewal, NodeHandle, Proposal, open_storage,
    spawn, state_config,
};
pub use driver::{NodeStatus, PeerMatch};
pub(crate) use entries::MEMBER_FIELD_BYTES_MAX;

/// What a committed coordination command produced: the state machine's answer and the term.
pub type Applied = driver::Applied<conclave_state::ApplyOutput>;

/// The member's clock in milliseconds since the Unix epoch, the one the driver stamps commands
/// with: the wall clock at the member's start plus the monotonic time since (steps of the
/// system clock do not move it).
pub fn member_clock_ms() -> u64 {
    driver::now_ms()
}

/// The size of everything under `dir`, for Maintenance.Status's `dbSize`.
pub fn dir_size_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|entry| match entry.metadata() {
            Ok(meta) if meta.is_dir() => dir_size_bytes(&entry.path()),
            Ok(meta) => meta.len(),
            Err(_) => 0,
        })
        .sum()
}
