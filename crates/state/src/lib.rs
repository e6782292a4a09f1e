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
//! - [`queue`]: work queues with fenced claims and dead letters.
//! - [`auth`]: users, roles and key-range permissions (etcd's auth store).
//! - [`command`]: commands, responses, events and their encoding.
//! - [`machine`]: [`StateMachine`], which ties it together (and etcd's Election and Lock
//!   recipes).
//! - [`snapshot`]: snapshot and restore.
//!
//! `docs/state.md` states the semantics of every command.
//!
//! # Example
//!
//! ```
//! use conclave_state::{
//!     Command, Compare, CompareResult, CompareTarget, Config, GroupRegister, PutRequest, Request,
//!     RequestOp, Response, StateMachine, TxnRequest, group_leader_key,
//! };
//!
//! let mut machine = StateMachine::new(Config::default());
//! // The server applies committed entries in log order, with the leader's clock inside.
//! let mut index = 0;
//! let mut apply = |machine: &mut StateMachine, now_ms: u64, request: Request| {
//!     index += 1;
//!     machine.apply(index, &Command::new(now_ms, request))
//! };
//!
//! // A lease, and a candidate in a priority election group holding it.
//! let granted = apply(&mut machine, 0, Request::LeaseGrant { id: 0, ttl_ms: 10_000 });
//! let Ok(Response::LeaseGranted { id: lease, .. }) = granted.result else { panic!() };
//! let register = GroupRegister {
//!     group: "workers".into(),
//!     candidate: "agent-1".into(),
//!     priority: 10,
//!     lease_id: lease,
//!     ..GroupRegister::default()
//! };
//! apply(&mut machine, 1, Request::GroupRegister(register));
//! let fence = machine.group_leader("workers").map(|seat| seat.fence).expect("elected");
//!
//! // The leader writes only while it still leads: the Txn compares the seat's fence.
//! let fenced_put = TxnRequest {
//!     compare: vec![Compare::new(
//!         group_leader_key("workers"),
//!         CompareResult::Equal,
//!         CompareTarget::Create(fence),
//!     )],
//!     success: vec![RequestOp::Put(PutRequest::new("/config/owner", "agent-1"))],
//!     failure: vec![],
//! };
//! let output = apply(&mut machine, 2, Request::Txn(fenced_put));
//! assert!(matches!(output.result, Ok(Response::Txn(ref txn)) if txn.succeeded));
//!
//! // Watchers that start in the past replay from the history.
//! let events = machine.events_since(1, b"/config/", b"/config0").expect("not compacted");
//! assert_eq!(events.len(), 1);
//!
//! // Snapshots are streamed through std::io and restore to the identical state.
//! let bytes = machine.snapshot(Vec::new()).expect("in memory");
//! let restored = StateMachine::restore(Config::default(), bytes.as_slice()).expect("valid");
//! assert_eq!(restored.revision(), machine.revision());
//! ```

#![deny(missing_docs)]

pub mod auth;
pub mod command;
pub mod config;
pub mod election;
pub mod error;
mod history;
pub mod lease;
pub mod machine;
pub mod mvcc;
pub mod queue;
pub mod session;
pub mod snapshot;
pub mod topic;
pub mod txn;

pub use auth::{
    Access, AuthRequest, AuthState, KeyPermission, PermissionKind, ROOT_ROLE, ROOT_USER, Role, User,
};
pub use command::{
    ApplyOutput, Command, Event, GroupRegister, GroupStatus, LeaderKey, QueueResponse, Request,
    Response, SessionSeq,
};
pub use config::{Config, TXN_RANGE_BYTES_MAX};
pub use election::{ElectionEvent, ElectionEventKind, GroupPolicy, PreemptPolicy, Seat};
pub use error::{Error, Result};
pub use lease::{LeaseCheckpoint, LeaseKeeper, LeaseResume, Renewal};
pub use machine::{
    GroupTimerMemo, QueueStatus, RESERVED_PREFIX, StateMachine, group_leader_key, queue_key,
};
pub use mvcc::{
    EventKind, KeyValue, RangeRequest, RangeResponse, SortOrder, SortTarget, WatchEvent,
    range_answer_bytes,
};
pub use queue::{Job, JobClaim, JobPush, QueueCounters, QueueStats, WorkQueue};
pub use topic::{MESSAGE_FROM_BYTES_MAX, Message, ReadBudget, Retention, TopicRead};
pub use txn::{
    Compare, CompareResult, CompareTarget, DeleteRangeRequest, DeleteRangeResponse, PutRequest,
    PutResponse, RequestOp, ResponseOp, TxnRequest, TxnResponse,
};
