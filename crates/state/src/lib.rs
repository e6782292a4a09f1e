//! Conclave's coordination state machine.
//!
//! The replicated log orders [`Command`]s; this crate gives them meaning. It is pure and
//! deterministic: no I/O, no clocks, no threads. The same committed commands give the same
//! state and the same responses on every node, byte for byte. Time enters only as the Raft
//! leader's clock reading carried in each command.
//!
//! ```text
//!   server ──propose──► Raft log ──committed (index, Command)──► StateMachine::apply
//!                                                                   │
//!        ◄── ApplyOutput { revision, result, events } ◄─────────────┘
//!   server: answers the client, fans `events` out to watchers / observers
//!   server (leader only): LeaseKeeper ── keepalives, expiry, checkpoints ──► proposals
//!   reads: StateMachine::{range, events_since, queue_status, group_leader, topic_read, inbox, ..}
//! ```
//!
//! # Layout
//! - [`mvcc`]: the multi-version KV store (revisions, ranges, compaction, watch replay).
//! - [`txn`]: etcd Put/DeleteRange/Txn requests and the Txn checks.
//! - [`lease`]: the lease table and the leader-side [`LeaseKeeper`].
//! - [`election`]: priority election groups.
//! - [`topic`]: topics with consumer cursors.
//! - [`session`]: exactly-once client sessions.
//! - [`command`]: commands, responses, events and their encoding.
//! - [`machine`]: [`StateMachine`], which ties it together (and etcd's Election and Lock
//!   recipes).
//! - [`snapshot`]: snapshot and restore.
//!
//! `docs/state.md` states the semantics of every command.

#![deny(missing_docs)]

pub mod command;
pub mod config;
pub mod election;
pub mod error;
pub mod lease;
pub mod machine;
pub mod mvcc;
pub mod session;
pub mod snapshot;
pub mod topic;
pub mod txn;

pub use command::{
    ApplyOutput, Command, Event, GroupRegister, GroupStatus, LeaderKey, QueueResponse, Request,
    Response, SessionSeq,
};
pub use config::Config;
pub use election::{ElectionEvent, ElectionEventKind, GroupPolicy, Seat};
pub use error::{Error, Result};
pub use lease::{LeaseCheckpoint, LeaseKeeper, LeaseResume, Renewal};
pub use machine::{QueueStatus, RESERVED_PREFIX, StateMachine, group_leader_key, queue_key};
pub use mvcc::{
    EventKind, KeyValue, RangeRequest, RangeResponse, SortOrder, SortTarget, WatchEvent,
};
pub use topic::{Message, Retention, TopicRead};
pub use txn::{
    Compare, CompareResult, CompareTarget, DeleteRangeRequest, DeleteRangeResponse, PutRequest,
    PutResponse, RequestOp, ResponseOp, TxnRequest, TxnResponse,
};
