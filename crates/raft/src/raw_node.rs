//! [`RawNode`]: the application's handle on one Raft core, and [`Ready`], the batch of work
//! the core hands back.

use bytes::Bytes;

use crate::config::Config;
use crate::error::{Error, StorageError};
use crate::raft::{CampaignKind, Raft};
use crate::storage::Storage;
use crate::types::*;

/// Everything the application must do before the core can move on, in the order given here.
///
/// Handle a Ready in this order, then call [`RawNode::advance`] with it:
///
/// 1. **Persist** `snapshot` (if any), then `entries`, then `hard_state` (if any). When
///    `must_sync` is true the writes must be durable (fsync) before step 2.
/// 2. **Send** `messages`. They may depend on step 1: a vote granted, an append acknowledged
///    or a vote asked for itself are only true once persisted ("persist before send").
///    One relaxation is safe: a leader may send its `Append` messages before its own
///    `entries` are durable, because the core counts the leader's own copy toward the commit
///    quorum only once `advance` reports it durable.
/// 3. **Apply**: install `snapshot` into the state machine (if any), then apply
///    `committed_entries` in order. Committed entries never include anything not covered by
///    step 1 of this or an earlier Ready.
/// 4. **Serve reads**: each of `read_states` may be answered once the state machine has
///    applied up to its index.
/// 5. Call `advance(ready)`.
///
/// A crash at any point is safe as long as what step 1 wrote is what survives.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
#[must_use = "a Ready must be handled and passed back to advance()"]
pub struct Ready {
    /// Role, leader or term changed since the last Ready. Volatile: nothing to persist.
    pub soft_state: Option<SoftState>,
    /// Term, vote or commit changed: persist before sending any message.
    pub hard_state: Option<HardState>,
    /// A snapshot from the leader that replaces the log: persist before the entries, then
    /// restore the state machine from it before applying committed entries.
    pub snapshot: Option<Snapshot>,
    /// Entries to append to stable storage, replacing any stored suffix from the first one's
    /// index on. Persist before sending messages.
    pub entries: Vec<Entry>,
    /// Whether step 1 needs an fsync: true whenever term, vote or entries changed. A commit
    /// index change alone does not need one.
    pub must_sync: bool,
    /// Messages to send after step 1 is durable.
    pub messages: Vec<Message>,
    /// Committed entries to apply, in order, after step 1.
    pub committed_entries: Vec<Entry>,
    /// Linearizable reads that became safe to serve once applied up to their index.
    pub read_states: Vec<ReadState>,
}

impl Ready {
    /// Whether there is nothing in it.
    pub fn is_empty(&self) -> bool {
        self.soft_state.is_none()
            && self.hard_state.is_none()
            && self.snapshot.is_none()
            && self.entries.is_empty()
            && self.messages.is_empty()
            && self.committed_entries.is_empty()
            && self.read_states.is_empty()
    }
}

/// The application-facing Raft node. Not thread-safe: one task owns it.
pub struct RawNode<S> {
    raft: Raft<S>,
    prev_soft_state: SoftState,
    prev_hard_state: HardState,
    /// A Ready was handed out and not yet advanced.
    ready_outstanding: bool,
}

/// At most this many bytes of committed entries are handed out in one Ready, so that a node
/// catching up applies in bounded batches.
pub const MAX_COMMITTED_BYTES_PER_READY: u64 = 16 * 1024 * 1024;

impl<S: Storage> RawNode<S> {
    /// Creates a node over `store`, resuming from whatever it holds (hard state, snapshot,
    /// log). Fails with one sentence if the configuration or the storage is unusable.
    pub fn new(config: Config, store: S) -> Result<Self, String> {
        let raft = Raft::new(config, store)?;
        let prev_soft_state = raft.soft_state();
        let prev_hard_state = raft.hard_state();
        Ok(RawNode {
            raft,
            prev_soft_state,
            prev_hard_state,
            ready_outstanding: false,
        })
    }

    /// Advances the logical clock by one tick.
    pub fn tick(&mut self) {
        self.raft.tick();
    }

    /// Starts an election now (for tests and for bootstrapping a single node quickly).
    /// Fails only with [`Error::TermExhausted`], when the term cannot grow any more.
    pub fn campaign(&mut self) -> Result<(), Error> {
        self.raft.campaign(CampaignKind::Timeout)
    }

    /// Feeds a message from a peer. A message that fails the core's checks is dropped and
    /// comes back as [`Error::RefusedMessage`] (or one of the older refusals,
    /// [`Error::is_refused_message`]); the node's state is as if it never arrived. Refusals
    /// are never fatal: log, count and carry on.
    pub fn step(&mut self, message: Message) -> Result<(), Error> {
        self.raft.step(message)
    }

    /// Proposes `data` for the log. Returns the index it will have if it commits; it may
    /// still be lost if leadership changes before then, so callers match on (index, term).
    pub fn propose(&mut self, data: Bytes) -> Result<Index, Error> {
        self.raft.propose(EntryKind::Normal, data)
    }

    /// Proposes a membership change. Every change runs through joint consensus; the leader
    /// leaves the joint configuration by itself once the change is applied.
    pub fn propose_conf_change(&mut self, steps: Vec<ConfChangeStep>) -> Result<Index, Error> {
        self.raft.propose_conf_change(ConfChange::Enter(steps))
    }

    /// Asks for a linearizable read tagged `context` (which the caller keeps unique). The
    /// answer arrives as a [`ReadState`] in a later Ready, on this node. With lease reads on
    /// ([`crate::Config::lease_read_ms`]), set the clock first ([`RawNode::set_now_ms`]).
    pub fn read_index(&mut self, context: Bytes) -> Result<(), Error> {
        self.raft.read_index(context)
    }

    /// ReadIndex requests this node answered from its leader lease, over its whole life.
    pub fn lease_reads_served(&self) -> u64 {
        self.raft.lease_reads_served
    }

    /// The application's monotonic clock, in milliseconds; only lease reads use it. Readings
    /// never go back (an older one is ignored).
    pub fn set_now_ms(&mut self, now_ms: u64) {
        self.raft.set_now_ms(now_ms);
    }

    /// Hands leadership to `target`: catches it up, then tells it to campaign at once.
    pub fn transfer_leader(&mut self, target: NodeId) -> Result<(), Error> {
        self.raft.transfer_leader(target)
    }

    /// Follower `to` hears that `index` committed as soon as it does (see
    /// [`crate::Config::defer_commit_notice`]): a client that wrote through it waits there.
    pub fn hasten_commit_notice(&mut self, to: NodeId, index: Index) {
        self.raft.hasten_commit_notice(to, index);
    }

    /// Whether clients of this node wait for what it applies (see
    /// [`crate::Config::replicate_to_quorum_first`]); its responses tell the leader.
    pub fn set_awaited(&mut self, awaited: bool) {
        self.raft.set_awaited(awaited);
    }

    /// Whether a Ready would carry anything.
    pub fn has_ready(&self) -> bool {
        let r = &self.raft;
        r.soft_state() != self.prev_soft_state
            || self.visible_hard_state() != self.prev_hard_state
            || r.log.unstable_snapshot().is_some()
            || !r.log.unstable_entries().is_empty()
            || !r.msgs.is_empty()
            || r.log.has_next_committed()
            || !r.read_states.is_empty()
            || r.has_pending_broadcast()
    }

    /// The hard state as handed to the application (the negative control can hide the vote).
    fn visible_hard_state(&self) -> HardState {
        #[allow(unused_mut)]
        let mut hard_state = self.raft.hard_state();
        #[cfg(feature = "negative-controls")]
        if self.raft.config.bugs.forget_to_persist_vote {
            hard_state.vote = self
                .prev_hard_state
                .vote
                .filter(|_| hard_state.term == self.prev_hard_state.term);
        }
        hard_state
    }

    /// Collects the work to do. Call [`RawNode::advance`] with it before the next `ready()`.
    pub fn ready(&mut self) -> Ready {
        assert!(
            !self.ready_outstanding,
            "ready() called twice without advance()"
        );
        self.raft.flush_broadcast();
        let r = &mut self.raft;
        let soft_state = r.soft_state();
        let hard_state = self.visible_hard_state();
        let r = &mut self.raft;
        let entries = r.log.unstable_entries().to_vec();
        let snapshot = r.log.unstable_snapshot().cloned();
        let term_or_vote_changed = hard_state.term != self.prev_hard_state.term
            || hard_state.vote != self.prev_hard_state.vote;
        let ready = Ready {
            soft_state: (soft_state != self.prev_soft_state).then_some(soft_state),
            hard_state: (hard_state != self.prev_hard_state).then_some(hard_state),
            must_sync: term_or_vote_changed || !entries.is_empty() || snapshot.is_some(),
            snapshot,
            entries,
            messages: std::mem::take(&mut r.msgs),
            committed_entries: r.log.next_committed_entries(MAX_COMMITTED_BYTES_PER_READY),
            read_states: std::mem::take(&mut r.read_states),
        };
        self.prev_soft_state = soft_state;
        if let Some(hard_state) = ready.hard_state {
            self.prev_hard_state = hard_state;
        }
        self.ready_outstanding = true;
        ready
    }

    /// Reports that `ready` was handled as its documentation says: persisted, sent, applied.
    pub fn advance(&mut self, ready: Ready) {
        assert!(self.ready_outstanding, "advance() without a Ready");
        self.ready_outstanding = false;
        if let Some(snapshot) = &ready.snapshot {
            self.raft.on_snapshot_installed(snapshot.meta.index);
        }
        if let Some(last) = ready.entries.last() {
            self.raft.on_persisted(last.index, last.term);
        }
        if !ready.committed_entries.is_empty() {
            self.raft.on_applied(&ready.committed_entries);
        }
    }

    /// This node's id.
    pub fn id(&self) -> NodeId {
        self.raft.id
    }

    pub fn role(&self) -> Role {
        self.raft.role
    }

    pub fn term(&self) -> Term {
        self.raft.term
    }

    /// The leader this node knows of, if any.
    pub fn leader(&self) -> Option<NodeId> {
        self.raft.leader
    }

    /// Why the known leader last changed, and who voted (see `LeaderChangeReason`): the
    /// voters that elected this node when it leads, this node itself when it follows the
    /// candidate it voted for, nobody otherwise.
    pub fn leader_change(&self) -> (LeaderChangeReason, Vec<NodeId>) {
        self.raft.leader_change()
    }

    pub fn hard_state(&self) -> HardState {
        self.raft.hard_state()
    }

    pub fn commit_index(&self) -> Index {
        self.raft.log.committed
    }

    pub fn applied_index(&self) -> Index {
        self.raft.log.applied
    }

    pub fn last_index(&self) -> Index {
        self.raft.log.last_index()
    }

    /// This node's log entries in `[low, high)`, persisted or not yet, at most `max_bytes` of
    /// payload (but at least one); `high` may be at most `last_index() + 1`. Fails with
    /// `Compacted` below the snapshot.
    pub fn entries(
        &self,
        low: Index,
        high: Index,
        max_bytes: u64,
    ) -> Result<Vec<Entry>, StorageError> {
        self.raft.log.entries(low, high, max_bytes)
    }

    /// The membership as of the applied index (what a snapshot taken now must record).
    pub fn conf_state(&self) -> &ConfState {
        &self.raft.conf
    }

    /// The node a leadership transfer is handing over to, if one is under way.
    pub fn transferee(&self) -> Option<NodeId> {
        self.raft.transferee
    }

    /// The replication progress of `peer` as (match index, next index), on a leader.
    pub fn peer_progress(&self, peer: NodeId) -> Option<(Index, Index)> {
        self.raft
            .progress
            .get(&peer)
            .map(|pr| (pr.match_index, pr.next_index))
    }

    /// On a leader, the lowest log index a follower being brought back by a snapshot still
    /// needs (the index of the snapshot it is receiving, or what it matched since installing
    /// one, until it reaches the applied index): a snapshot recorded
    /// past it compacts entries that follower would need, and it would need another snapshot.
    /// The application may postpone its snapshots while this is below the index it would
    /// snapshot at. `None` on a follower or when no follower is catching up.
    pub fn snapshot_catch_up_floor(&self) -> Option<Index> {
        if self.raft.role != Role::Leader {
            return None;
        }
        self.raft
            .progress
            .iter()
            .filter(|(id, _)| **id != self.raft.id)
            .filter_map(|(_, pr)| pr.catch_up_floor())
            .min()
    }

    /// The durable storage, for reading.
    pub fn store(&self) -> &S {
        &self.raft.log.store
    }

    /// The durable storage, for the application's writes while handling a Ready and for
    /// recording snapshots it takes.
    pub fn store_mut(&mut self) -> &mut S {
        &mut self.raft.log.store
    }
}
