//! The values that cross the core's boundary: log entries, persistent state, snapshots and
//! messages. All of them are plain data with `serde` derives so that the server can put them
//! on the wire and the storage can put them on disk in whatever framing it chooses.

use std::collections::BTreeSet;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// Identifies a member of the cluster. `0` is never a valid id; the core uses it nowhere.
pub type NodeId = u64;
/// A Raft term. Terms start at 0 on a fresh node and only grow.
pub type Term = u64;
/// A log index. The first real entry has index 1; index 0 is the empty log's sentinel.
pub type Index = u64;

/// What an entry carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum EntryKind {
    /// An application command (or, with empty data, a new leader's no-op entry).
    Normal,
    /// A membership change; `data` is an encoded [`ConfChange`] (see [`ConfChange::encode`]).
    ConfChange,
}

/// One entry of the replicated log.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Entry {
    pub term: Term,
    pub index: Index,
    pub kind: EntryKind,
    pub data: Bytes,
}

impl Entry {
    /// The bytes this entry counts for in message-size and uncommitted-size limits.
    pub fn payload_size(&self) -> u64 {
        self.data.len() as u64
    }
}

/// The state that must be on stable storage before the node answers anyone.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HardState {
    /// The latest term this node has seen.
    pub term: Term,
    /// The candidate this node voted for in `term`, if any. At most one per term, ever.
    pub vote: Option<NodeId>,
    /// The highest index known committed. Persisting it is an optimisation (faster restart),
    /// not a safety requirement: a node that forgets it learns it again from the leader.
    pub commit: Index,
}

/// The membership of the cluster at some point of the log.
///
/// Outside a membership change `voters_outgoing` is empty. During a joint-consensus change the
/// cluster is in the joint configuration `voters` (new) + `voters_outgoing` (old): elections and
/// commitment need a majority of each.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ConfState {
    pub voters: BTreeSet<NodeId>,
    pub learners: BTreeSet<NodeId>,
    /// The old voter set while a joint change is in progress; empty otherwise.
    pub voters_outgoing: BTreeSet<NodeId>,
}

impl ConfState {
    /// A configuration of voters only.
    pub fn with_voters(voters: impl IntoIterator<Item = NodeId>) -> Self {
        ConfState {
            voters: voters.into_iter().collect(),
            ..Default::default()
        }
    }

    /// Whether the configuration is joint (a change is half done).
    pub fn is_joint(&self) -> bool {
        !self.voters_outgoing.is_empty()
    }

    /// Whether `id` votes in either half of the configuration.
    pub fn is_voter(&self, id: NodeId) -> bool {
        self.voters.contains(&id) || self.voters_outgoing.contains(&id)
    }

    /// Whether `id` is a member in any role.
    pub fn contains(&self, id: NodeId) -> bool {
        self.is_voter(id) || self.learners.contains(&id)
    }

    /// Every member, voters and learners, in ascending order.
    pub fn members(&self) -> BTreeSet<NodeId> {
        let mut all = self.voters.clone();
        all.extend(self.voters_outgoing.iter().copied());
        all.extend(self.learners.iter().copied());
        all
    }
}

/// Where a snapshot sits in the log and what membership it carries.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SnapshotMeta {
    /// The index of the last entry the snapshot covers.
    pub index: Index,
    /// The term of that entry.
    pub term: Term,
    /// The membership as of `index`.
    pub conf_state: ConfState,
}

/// A point-in-time image of the application state, replacing the log up to `meta.index`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Snapshot {
    pub meta: SnapshotMeta,
    /// The application's own encoding of its state. Opaque to the core.
    pub data: Bytes,
}

impl Snapshot {
    /// The empty snapshot of a fresh log (index 0).
    pub fn is_empty(&self) -> bool {
        self.meta.index == 0
    }
}

/// One step of a membership change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ConfChangeStep {
    /// Add a voter, or promote a learner to voter.
    AddVoter(NodeId),
    /// Add a non-voting learner, or demote a voter to learner.
    AddLearner(NodeId),
    /// Remove a node in whatever role it has.
    RemoveNode(NodeId),
}

/// A membership change as carried in a [`EntryKind::ConfChange`] entry.
///
/// Every change goes through joint consensus: an `Enter` entry switches the cluster into the
/// joint configuration (old and new voters must both agree), and once it is committed the
/// leader proposes the matching `Leave` entry by itself, which switches to the new
/// configuration alone.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ConfChange {
    Enter(Vec<ConfChangeStep>),
    Leave,
}

impl ConfChange {
    /// Encodes the change for an entry's data. The format is the core's own and stable:
    /// tag byte (1 = enter, 2 = leave), then for enter a count and (kind, id) pairs, big-endian.
    pub fn encode(&self) -> Bytes {
        let mut out = Vec::new();
        match self {
            ConfChange::Leave => out.push(2),
            ConfChange::Enter(steps) => {
                out.push(1);
                out.extend_from_slice(&(steps.len() as u32).to_be_bytes());
                for step in steps {
                    let (kind, id) = match *step {
                        ConfChangeStep::AddVoter(id) => (1u8, id),
                        ConfChangeStep::AddLearner(id) => (2u8, id),
                        ConfChangeStep::RemoveNode(id) => (3u8, id),
                    };
                    out.push(kind);
                    out.extend_from_slice(&id.to_be_bytes());
                }
            }
        }
        Bytes::from(out)
    }

    /// Decodes what [`ConfChange::encode`] wrote; `None` for anything else.
    pub fn decode(data: &[u8]) -> Option<ConfChange> {
        let (&tag, rest) = data.split_first()?;
        match tag {
            2 if rest.is_empty() => Some(ConfChange::Leave),
            1 => {
                let count = u32::from_be_bytes(rest.get(..4)?.try_into().ok()?) as usize;
                let body = rest.get(4..)?;
                if body.len() != count.checked_mul(9)? {
                    return None;
                }
                let mut steps = Vec::with_capacity(count);
                for chunk in body.chunks_exact(9) {
                    let id = u64::from_be_bytes(chunk[1..9].try_into().ok()?);
                    steps.push(match chunk[0] {
                        1 => ConfChangeStep::AddVoter(id),
                        2 => ConfChangeStep::AddLearner(id),
                        3 => ConfChangeStep::RemoveNode(id),
                        _ => return None,
                    });
                }
                Some(ConfChange::Enter(steps))
            }
            _ => None,
        }
    }
}

/// A Raft message between two members.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub from: NodeId,
    pub to: NodeId,
    /// The sender's term. Every message carries it; the receiver applies the term rules first.
    pub term: Term,
    pub body: MessageBody,
}

/// What a message says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MessageBody {
    /// Leader → follower: append `entries` after (`prev_index`, `prev_term`).
    Append {
        prev_index: Index,
        prev_term: Term,
        entries: Vec<Entry>,
        commit: Index,
    },
    /// Follower → leader: the outcome of an `Append`.
    ///
    /// On success `index` is the last index now known to match the leader's log. On rejection
    /// `index` echoes the rejected `prev_index` and (`hint_index`, `hint_term`) point at the
    /// last entry of the follower's log that might match, so the leader can skip a whole term
    /// of conflicting entries in one round trip.
    ///
    /// `awaited` says clients of this follower wait for what it applies (see
    /// [`crate::RawNode::set_awaited`]).
    AppendResponse {
        index: Index,
        reject: bool,
        hint_index: Index,
        hint_term: Term,
        awaited: bool,
    },
    /// Candidate → voter. `pre` marks a PreVote round, which changes no state on the voter.
    /// `transfer` marks an election started by a leadership transfer, which voters honour even
    /// while they still hear from the current leader.
    Vote {
        pre: bool,
        last_index: Index,
        last_term: Term,
        transfer: bool,
    },
    VoteResponse {
        pre: bool,
        granted: bool,
    },
    /// Leader → follower: "I am still leader". `context` tags a ReadIndex confirmation round.
    Heartbeat {
        commit: Index,
        context: Option<Bytes>,
    },
    /// Follower → leader; `awaited` as in `AppendResponse`.
    HeartbeatResponse {
        context: Option<Bytes>,
        awaited: bool,
    },
    /// Leader → follower: one chunk of a snapshot. Chunks are sent in order, one at a time.
    /// Every chunk carries `image_crc32c`, the crc32c of the whole image (`Snapshot::data`):
    /// the follower checks the assembled image against it before handing it to the
    /// application, and asks for the snapshot again when it does not match.
    SnapshotChunk {
        meta: SnapshotMeta,
        offset: u64,
        data: Bytes,
        done: bool,
        image_crc32c: u32,
    },
    /// Follower → leader: the chunk ending at `next_offset` arrived (or the follower asks to
    /// restart from `next_offset`, which may be 0). `installed` is true once the whole snapshot
    /// is in place.
    SnapshotResponse {
        snapshot_index: Index,
        next_offset: u64,
        installed: bool,
        reject: bool,
    },
    /// Follower → leader: please confirm a linearizable read for `context`.
    ReadIndexRequest {
        context: Bytes,
    },
    /// Leader → follower: the read for `context` may be served once `index` is applied.
    ReadIndexResponse {
        context: Bytes,
        index: Index,
    },
    /// Leader → transfer target: start an election now, skipping PreVote.
    TimeoutNow,
}

impl MessageBody {
    /// A short name for traces and metrics.
    pub fn name(&self) -> &'static str {
        match self {
            MessageBody::Append { .. } => "Append",
            MessageBody::AppendResponse { .. } => "AppendResponse",
            MessageBody::Vote { pre: true, .. } => "PreVote",
            MessageBody::Vote { pre: false, .. } => "Vote",
            MessageBody::VoteResponse { pre: true, .. } => "PreVoteResponse",
            MessageBody::VoteResponse { pre: false, .. } => "VoteResponse",
            MessageBody::Heartbeat { .. } => "Heartbeat",
            MessageBody::HeartbeatResponse { .. } => "HeartbeatResponse",
            MessageBody::SnapshotChunk { .. } => "SnapshotChunk",
            MessageBody::SnapshotResponse { .. } => "SnapshotResponse",
            MessageBody::ReadIndexRequest { .. } => "ReadIndexRequest",
            MessageBody::ReadIndexResponse { .. } => "ReadIndexResponse",
            MessageBody::TimeoutNow => "TimeoutNow",
        }
    }
}

/// The role a node plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Role {
    Follower,
    PreCandidate,
    Candidate,
    Leader,
}

/// The volatile view of who leads, reported in [`crate::Ready::soft_state`] when it changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SoftState {
    pub role: Role,
    pub leader: Option<NodeId>,
    pub term: Term,
}

/// A linearizable read that became safe: once the application has applied every entry up to
/// `index`, a read tagged `context` may be answered from its state.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ReadState {
    pub index: Index,
    pub context: Bytes,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conf_change_round_trips_and_rejects_garbage() {
        let changes = [
            ConfChange::Leave,
            ConfChange::Enter(vec![]),
            ConfChange::Enter(vec![
                ConfChangeStep::AddVoter(4),
                ConfChangeStep::AddLearner(u64::MAX),
                ConfChangeStep::RemoveNode(1),
            ]),
        ];
        for change in changes {
            assert_eq!(ConfChange::decode(&change.encode()), Some(change));
        }
        assert_eq!(ConfChange::decode(&[]), None);
        assert_eq!(ConfChange::decode(&[2, 0]), None);
        assert_eq!(ConfChange::decode(&[1, 0, 0, 0, 1, 1]), None);
        assert_eq!(
            ConfChange::decode(&[1, 0, 0, 0, 1, 9, 0, 0, 0, 0, 0, 0, 0, 1]),
            None
        );
        assert_eq!(ConfChange::decode(&[7]), None);
    }
}

/// Why the leader this node knows of last changed, as far as this node can tell; for the
/// shell's log line and metrics (the core stays silent).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LeaderChangeReason {
    /// No change seen since the node started.
    #[default]
    Start,
    /// A candidate whose election timer ran out won (this node, or one it voted for).
    ElectionTimeout,
    /// The old leader handed over (TimeoutNow): a transfer.
    Transfer,
    /// The leader stepped down: it had not heard from a quorum within an election timeout.
    CheckQuorum,
    /// The leader stepped down: it was removed from the configuration.
    Removed,
    /// A message of a higher term arrived: a newer election is under way or over.
    HigherTerm,
    /// This node's election timer ran out without a word from the leader.
    LeaderSilent,
    /// A leader of this term announced itself (this node did not vote for it).
    LeaderHeard,
}

impl LeaderChangeReason {
    /// A short name for logs and labels.
    pub fn as_str(self) -> &'static str {
        match self {
            LeaderChangeReason::Start => "start",
            LeaderChangeReason::ElectionTimeout => "election timeout",
            LeaderChangeReason::Transfer => "transfer",
            LeaderChangeReason::CheckQuorum => "check-quorum step-down",
            LeaderChangeReason::Removed => "removed",
            LeaderChangeReason::HigherTerm => "higher term",
            LeaderChangeReason::LeaderSilent => "leader silent (election timeout)",
            LeaderChangeReason::LeaderHeard => "new leader heard",
        }
    }
}
