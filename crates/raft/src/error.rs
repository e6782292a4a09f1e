//! The core's errors. Operating errors ([`Error`]) are part of normal life: the caller retries
//! elsewhere or later. Storage errors other than the named ones are fatal to the node.

use std::fmt;

use crate::types::{Index, NodeId, Term};

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
    /// A read's context has the shape the core keeps for its lease rounds.
    #[error("read contexts starting with 0xff 'L' and 8 more bytes are reserved for lease rounds")]
    ReservedReadContext,
    /// The message came from a node this core does not track; it was dropped.
    #[error("message from unknown node {0}")]
    UnknownPeer(NodeId),
    /// A peer's message failed a check: `step` dropped it without changing the node's state
    /// (at most an answer is queued, such as a snapshot reject asking the leader to resend).
    /// Never fatal: the application logs it, counts it and carries on.
    #[error("{kind} from node {from} refused: {reason}")]
    RefusedMessage {
        from: NodeId,
        kind: &'static str,
        reason: Refusal,
    },
    /// This node's term has reached [`crate::MAX_TERM`] (a forged term must have been
    /// accepted and persisted): it cannot start an election, as the next term would overflow.
    /// It still follows a leader of its term.
    #[error("term {term} is at the limit; this node cannot campaign")]
    TermExhausted { term: Term },
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

/// Why a peer's message was refused (see [`Error::RefusedMessage`]). Each names the field
/// that failed and the bound it broke.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The sender id is 0 (reserved) or this node's own id.
    InvalidSender,
    /// The message is addressed to another node.
    WrongRecipient { to: NodeId },
    /// The sender is in none of the roles of this node's configuration.
    NotAMember,
    /// A vote request or vote answer from a node that does not vote in this configuration.
    NotAVoter,
    /// Only the leader this node follows may send this (TimeoutNow, ReadIndexResponse, and
    /// a leader's messages of the term from anyone else).
    NotTheLeader,
    /// The message term is past [`crate::MAX_TERM`].
    TermTooLarge { term: Term },
    /// A term field of the body is past the message's own term, which no honest sender
    /// can produce (a log never holds entries of a term later than its owner's).
    TermAhead {
        field: &'static str,
        term: Term,
        message_term: Term,
    },
    /// An index field is past the bound it can legitimately reach.
    IndexBeyondBound {
        field: &'static str,
        index: Index,
        bound: Index,
    },
    /// The entries of an Append are not numbered `prev_index + 1, prev_index + 2, ...`, or
    /// their terms go backwards.
    EntriesNotContiguous { position: usize, index: Index },
    /// An Append carries a membership-change entry that does not decode.
    UndecodableConfChange { index: Index },
    /// An Append would replace an entry at or below the commit index.
    ConflictBelowCommit { index: Index, committed: Index },
    /// A snapshot chunk starts past the bytes received so far.
    SnapshotOffsetBeyondReceived { offset: u64, received: u64 },
    /// The snapshot would grow past `Config::max_snapshot_bytes`.
    SnapshotTooLarge { size: u64, limit: u64 },
    /// A chunk of a snapshot transfer names another checksum than the transfer's first chunk.
    SnapshotChecksumChanged,
    /// The assembled snapshot's crc32c does not match the one the leader sent.
    SnapshotChecksumMismatch { expected: u32, computed: u32 },
    /// The snapshot's configuration has no voters, which no cluster can run from.
    SnapshotWithoutVoters,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::InvalidSender => write!(f, "sender id is 0 or this node's own id"),
            Refusal::WrongRecipient { to } => write!(f, "addressed to node {to}"),
            Refusal::NotAMember => write!(f, "sender is not a member of the configuration"),
            Refusal::NotAVoter => write!(f, "sender is not a voter of the configuration"),
            Refusal::NotTheLeader => write!(f, "sender is not the leader this node follows"),
            Refusal::TermTooLarge { term } => {
                write!(f, "term {term} is past the limit {}", crate::MAX_TERM)
            }
            Refusal::TermAhead {
                field,
                term,
                message_term,
            } => write!(
                f,
                "{field} {term} is past the message's term {message_term}"
            ),
            Refusal::IndexBeyondBound {
                field,
                index,
                bound,
            } => write!(f, "{field} {index} is past {bound}"),
            Refusal::EntriesNotContiguous { position, index } => write!(
                f,
                "entry {position} has index {index}: entries must follow prev_index one by one \
                 with terms that never go back"
            ),
            Refusal::UndecodableConfChange { index } => {
                write!(
                    f,
                    "entry {index} is a membership change that does not decode"
                )
            }
            Refusal::ConflictBelowCommit { index, committed } => write!(
                f,
                "entry {index} conflicts with the log at or below the commit index {committed}"
            ),
            Refusal::SnapshotOffsetBeyondReceived { offset, received } => write!(
                f,
                "snapshot chunk at offset {offset}, but only {received} bytes received"
            ),
            Refusal::SnapshotTooLarge { size, limit } => {
                write!(
                    f,
                    "snapshot of {size} bytes exceeds the limit of {limit} bytes"
                )
            }
            Refusal::SnapshotChecksumChanged => {
                write!(f, "snapshot chunk checksum differs from the transfer's")
            }
            Refusal::SnapshotChecksumMismatch { expected, computed } => write!(
                f,
                "snapshot crc32c is {computed:#010x}, the leader sent {expected:#010x}"
            ),
            Refusal::SnapshotWithoutVoters => write!(f, "snapshot configuration has no voters"),
        }
    }
}

impl Error {
    /// Whether `step` dropped a peer's message (as opposed to refusing a local request).
    pub fn is_refused_message(&self) -> bool {
        matches!(
            self,
            Error::RefusedMessage { .. }
                | Error::UnknownPeer(_)
                | Error::AppendResponseBeyondLog { .. }
        )
    }
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
