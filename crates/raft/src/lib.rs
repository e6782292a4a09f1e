//! # conclave-raft
//!
//! Conclave's Raft consensus core. It is a pure state machine: messages and ticks go in;
//! entries to persist, messages to send and entries to apply come out as a [`Ready`]. It does
//! no I/O, reads no clock and takes its randomness from [`Config::seed`], so one seed replays a
//! whole cluster exactly (the simulator in `conclave-sim` depends on that).
//!
//! See `docs/raft.md` for the API walk-through and the Ready ordering contract.
//!
//! ## Layout
//! - [`types`]: entries, hard state, snapshots, membership, messages.
//! - [`storage`]: the read-only [`Storage`] trait and [`MemStorage`].
//! - `log`: the log as the core sees it: durable part (storage) + unstable tail.
//! - `progress`: the leader's per-follower replication state and in-flight window.
//! - `quorum`: majority and joint-majority arithmetic.
//! - `raft`: the protocol itself.
//! - `raw_node`: [`RawNode`] and [`Ready`], the application-facing API.

pub mod config;
pub mod error;
mod log;
pub mod prng;
mod progress;
mod quorum;
mod raft;
mod raw_node;
pub mod storage;
pub mod types;

pub use config::{Config, DEFAULT_MAX_SNAPSHOT_BYTES};
pub use error::{Error, Refusal, StorageError};
pub use prng::Prng;
pub use raft::{SPARE_LAG_ENTRIES_MAX, apply_steps};
pub use raw_node::{MAX_COMMITTED_BYTES_PER_READY, RawNode, Ready};
pub use storage::{BOOTSTRAP_TERM, MemStorage, Storage, bootstrap_snapshot};
pub use types::*;

/// The highest term the core accepts in a message or moves to. Unreachable by elections (one
/// per term), and far enough below `u64::MAX` that `term + 1` can never overflow: a message
/// with a higher term is refused, and a node whose persisted term is at or past it refuses to
/// campaign ([`Error::TermExhausted`]) instead of overflowing.
pub const MAX_TERM: Term = 1 << 62;

/// The highest log index the core accepts in a message. No log reaches it (one entry per
/// nanosecond would take 146 years), and index arithmetic on a checked value (`index + 1`,
/// `prev_index + entries.len()`) cannot overflow below it.
pub const MAX_INDEX: Index = 1 << 62;

/// Switches for deliberately broken behaviour, used only by the simulator's negative-control
/// tests to prove its checkers catch each bug.
#[cfg(feature = "negative-controls")]
#[derive(Debug, Clone, Copy, Default)]
pub struct Bugs {
    /// Commit an entry of an earlier term once a majority stores it (ignores Raft §5.4.2).
    pub commit_earlier_term_by_count: bool,
    /// Leave the vote out of the hard state handed to the application to persist.
    pub forget_to_persist_vote: bool,
    /// Answer ReadIndex at once from the local commit index, without a heartbeat round.
    pub read_index_without_quorum_check: bool,
    /// With lease reads on: a leader's lease, once a quorum acknowledged one of its
    /// heartbeats, never runs out.
    pub lease_never_expires: bool,
}
