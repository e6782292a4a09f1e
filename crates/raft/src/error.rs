//! The core's errors. Operating errors ([`Error`]) are part of normal life: the caller retries
//! elsewhere or later. Storage errors other than the named ones are fatal to the node.

use crate::types::{Index, NodeId};

/// Why the core refused a request. None of these harm the node; they tell the caller what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// Only the leader accepts proposals; `leader` is the current leader if known.
    #[error("not the leader (leader hint: {leader:?})")]
    NotLeader { leader: Option<NodeId> },
    /// The leader is handing its role to another node and accepts no proposals meanwhile.
    #[error("leadership transfer to node {target} in progress")]
    TransferInProgress { target: NodeId },
    /// Accepting the proposal would exceed `Config::max_uncommitted_bytes`.
    #[error("too many uncommitted bytes: {uncommitted} in flight, limit is {limit}")]
    UncommittedLimit { uncommitted: u64, limit: u64 },
    /// A proposal is larger than `Config::max_uncommitted_bytes`, so it could never be accepted.
    #[error("proposal of {size} bytes exceeds the limit of {limit} bytes")]
    ProposalTooLarge { size: u64, limit: u64 },
    /// A membership change is already pending; only one may be in flight at a time.
    #[error("a membership change is already in progress")]
    ConfChangeInProgress,
    /// The membership change makes no sense against the current configuration.
    #[error("invalid membership change: {0}")]
    InvalidConfChange(String),
    /// The target of a leadership transfer is not a voter, or is this node.
    #[error("cannot transfer leadership to node {0}")]
    InvalidTransferTarget(NodeId),
    /// No leader is known, so a follower cannot forward the request.
    #[error("no leader is known")]
    NoLeader,
    /// The message came from a node this core does not track; it was dropped.
    #[error("message from unknown node {0}")]
    UnknownPeer(NodeId),
    /// A peer answered about log entries past this leader's last one, which no follower of this
    /// leader can hold: typically a node started over another cluster's data directory. The
    /// message was dropped.
    #[error(
        "node {from} answered about entry {index}, past this leader's last entry {last_index}: \
         its log cannot come from this cluster"
    )]
    AppendResponseBeyondLog {
        from: NodeId,
        index: Index,
        last_index: Index,
    },
}

/// Errors of a [`crate::Storage`] implementation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StorageError {
    /// The requested index has been compacted into a snapshot.
    #[error("index {0} is compacted")]
    Compacted(Index),
    /// The requested index is beyond the last stored entry.
    #[error("index {0} is unavailable")]
    Unavailable(Index),
    /// The snapshot is being produced; ask again later.
    #[error("snapshot temporarily unavailable")]
    SnapshotTemporarilyUnavailable,
    /// Anything else: the storage is broken and the node must stop.
    #[error("storage failure: {0}")]
    Fatal(String),
}
