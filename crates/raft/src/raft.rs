//! The Raft protocol: roles, elections, replication, reads, transfers, membership, snapshots.
//!
//! [`Raft::step`] applies the term rules to every message first, then dispatches on the role.
//! Nothing here does I/O; outgoing messages collect in `msgs` and leave through a Ready.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use bytes::{Bytes, BytesMut};

use crate::config::Config;
use crate::error::{Error, Refusal, StorageError};
use crate::log::RaftLog;
use crate::prng::Prng;
use crate::progress::{Progress, ReplicationMode};
use crate::quorum::{self, VoteResult};
use crate::storage::Storage;
use crate::types::*;
use crate::{MAX_INDEX, MAX_TERM};

/// Why a node starts an election.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CampaignKind {
    /// Its election timer ran out (starts with PreVote when enabled).
    Timeout,
    /// Its PreVote round succeeded: now the real election.
    PreVoteWon,
    /// The leader ordered it (TimeoutNow): no PreVote, and voters drop their leader lease.
    Transfer,
}

/// Lease rounds remembered at most; at one round a heartbeat interval, far more than a lease
/// lasts.
const LEASE_ROUNDS_MAX: usize = 64;

/// With `Config::replicate_to_quorum_first`: a spare follower that lacks this many committed
/// entries is sent them at the next commit or acknowledgement; fewer wait for the leader's
/// next tick. Each send costs the spare a disk sync that competes with the quorum's.
pub const SPARE_LAG_ENTRIES_MAX: u64 = 32;

/// Heartbeat contexts of lease rounds start with these bytes and carry the round after them
/// (big-endian u64). Read contexts of that shape are refused, so the two never mix.
const LEASE_CONTEXT_TAG: [u8; 2] = [0xff, b'L'];

fn lease_round_context(round: u64) -> Bytes {
    let mut context = Vec::with_capacity(LEASE_CONTEXT_TAG.len() + 8);
    context.extend_from_slice(&LEASE_CONTEXT_TAG);
    context.extend_from_slice(&round.to_be_bytes());
    Bytes::from(context)
}

/// The round of a lease round's context; `None` for any other context.
fn lease_round_of(context: &[u8]) -> Option<u64> {
    let round = context.strip_prefix(&LEASE_CONTEXT_TAG)?;
    Some(u64::from_be_bytes(round.try_into().ok()?))
}

/// A linearizable read waiting for its heartbeat round.
#[derive(Debug)]
struct PendingRead {
    context: Bytes,
    /// The commit index when the read arrived: the read may be served once this is applied.
    index: Index,
    /// Who asked: this node, or a follower to answer with `ReadIndexResponse`.
    requester: NodeId,
    acks: BTreeSet<NodeId>,
}

/// The fields of one `SnapshotChunk`, as handed to the follower's assembly.
struct IncomingChunk {
    meta: SnapshotMeta,
    offset: u64,
    data: Bytes,
    done: bool,
    image_crc32c: u32,
}

/// A snapshot arriving in chunks from the leader.
#[derive(Debug)]
struct IncomingSnapshot {
    meta: SnapshotMeta,
    data: BytesMut,
    /// The checksum the transfer's first chunk announced for the whole image.
    image_crc32c: u32,
}

/// The Raft state machine of one node.
pub struct Raft<S> {
    pub id: NodeId,
    pub term: Term,
    pub vote: Option<NodeId>,
    pub log: RaftLog<S>,
    pub role: Role,
    pub leader: Option<NodeId>,
    pub conf: ConfState,
    /// Replication state per member other than self (leader only; rebuilt on election).
    pub progress: BTreeMap<NodeId, Progress>,
    votes: BTreeMap<NodeId, bool>,
    /// Why the known leader last changed, and who granted the winning votes (when this
    /// node won) or whom this node voted for; see [`Raft::leader_change`].
    change_reason: LeaderChangeReason,
    change_votes: Vec<NodeId>,
    /// The current campaign was ordered by a transfer.
    campaign_transfer: bool,
    /// The vote this node granted in its current term came from a transfer's campaign.
    vote_transfer: bool,
    pub msgs: Vec<Message>,
    pub read_states: Vec<ReadState>,
    election_elapsed: u64,
    heartbeat_elapsed: u64,
    randomized_election_ticks: u64,
    /// The node a leadership transfer is handing over to.
    pub transferee: Option<NodeId>,
    /// Index of the latest membership change entry; no new one until it is applied.
    pending_conf_index: Index,
    uncommitted_bytes: u64,
    /// Reads waiting for a heartbeat quorum, oldest first.
    pending_reads: VecDeque<PendingRead>,
    /// Reads that arrived before this leader committed an entry of its term.
    reads_awaiting_commit: Vec<(Bytes, NodeId)>,
    incoming_snapshot: Option<IncomingSnapshot>,
    /// Proposals are appended at once but broadcast when the application next asks for a
    /// Ready, so that many proposals travel in one message.
    broadcast_pending: bool,
    /// The last index at the previous leader tick if it was not committed then
    /// (`replicate_to_quorum_first`'s stall check).
    uncommitted_at_last_tick: Option<Index>,
    /// Clients of this node wait for what it applies ([`Raft::set_awaited`]); every response
    /// to a leader says so.
    awaited: bool,
    /// The application's clock, in milliseconds ([`Raft::set_now_ms`]); only lease reads
    /// use it.
    now_ms: u64,
    /// Ticks since this node started, counted up to `election_ticks`: with CheckQuorum, a
    /// node withholds its vote until then, since before it restarted it may have
    /// acknowledged a leader whose lease still runs (whatever its own lease setting).
    ticks_since_start: u64,
    /// Leader with lease reads on: the heartbeat rounds sent and not yet too old to extend
    /// the lease, as (round, `now_ms` when sent), oldest first.
    lease_rounds: VecDeque<(u64, u64)>,
    /// The number the next lease round gets.
    lease_round_next: u64,
    /// This leader began a leadership transfer in its term: its successor may be elected at
    /// once (voters grant a transfer's campaign despite their lease), so no read is answered
    /// from the lease again in this term.
    lease_void: bool,
    /// ReadIndex requests this node answered from its lease, over its whole life.
    pub lease_reads_served: u64,
    pub config: Config,
    prng: Prng,
}

impl<S: Storage> Raft<S> {
    pub fn new(config: Config, store: S) -> Result<Self, String> {
        config.validate()?;
        let (hard_state, conf) = store
            .initial_state()
            .map_err(|e| format!("cannot read initial state: {e}"))?;
        let log = RaftLog::new(store, hard_state.commit);
        let mut raft = Raft {
            id: config.id,
            term: hard_state.term,
            vote: hard_state.vote,
            log,
            role: Role::Follower,
            leader: None,
            conf,
            progress: BTreeMap::new(),
            votes: BTreeMap::new(),
            change_reason: LeaderChangeReason::Start,
            change_votes: Vec::new(),
            campaign_transfer: false,
            vote_transfer: false,
            msgs: Vec::new(),
            read_states: Vec::new(),
            election_elapsed: 0,
            heartbeat_elapsed: 0,
            randomized_election_ticks: config.election_ticks,
            transferee: None,
            pending_conf_index: 0,
            uncommitted_bytes: 0,
            pending_reads: VecDeque::new(),
            reads_awaiting_commit: Vec::new(),
            incoming_snapshot: None,
            uncommitted_at_last_tick: None,
            awaited: false,
            broadcast_pending: false,
            now_ms: 0,
            // A node that never went past the bootstrap term never acknowledged a leader (the
            // term of any acknowledgement is durable before it is sent): it has no lease to
            // respect, and a fresh cluster elects its first leader without waiting.
            ticks_since_start: if hard_state.term <= crate::storage::BOOTSTRAP_TERM {
                config.election_ticks
            } else {
                0
            },
            lease_rounds: VecDeque::new(),
            lease_round_next: 0,
            lease_void: false,
            lease_reads_served: 0,
            prng: Prng::new(config.seed),
            config,
        };
        raft.become_follower(raft.term, None);
        Ok(raft)
    }

    pub fn hard_state(&self) -> HardState {
        HardState {
            term: self.term,
            vote: self.vote,
            commit: self.log.committed,
        }
    }

    pub fn soft_state(&self) -> SoftState {
        SoftState {
            role: self.role,
            leader: self.leader,
            term: self.term,
        }
    }

    /// Whether this node may become leader: it votes in the current configuration.
    pub fn promotable(&self) -> bool {
        self.conf.is_voter(self.id)
    }

    // ---- roles -------------------------------------------------------------------------

    fn reset(&mut self, term: Term) {
        if self.term != term {
            assert!(
                term > self.term,
                "term going backwards: {} -> {term}",
                self.term
            );
            self.term = term;
            self.vote = None;
        }
        self.leader = None;
        self.election_elapsed = 0;
        self.heartbeat_elapsed = 0;
        self.randomized_election_ticks = self
            .prng
            .range(self.config.election_ticks, 2 * self.config.election_ticks);
        self.votes.clear();
        self.transferee = None;
        self.pending_reads.clear();
        self.reads_awaiting_commit.clear();
        self.lease_rounds.clear();
        self.lease_void = false;
        self.broadcast_pending = false;
        self.uncommitted_at_last_tick = None;
        self.uncommitted_bytes = 0;
        let next = self.log.last_index() + 1;
        self.progress = self
            .conf
            .members()
            .into_iter()
            .filter(|&id| id != self.id)
            .map(|id| (id, Progress::new(next)))
            .collect();
    }

    pub fn become_follower(&mut self, term: Term, leader: Option<NodeId>) {
        self.reset(term);
        self.role = Role::Follower;
        self.leader = leader;
    }

    fn become_pre_candidate(&mut self) {
        assert_ne!(
            self.role,
            Role::Leader,
            "invalid transition leader -> pre-candidate"
        );
        // PreVote changes neither term nor vote: a node that cannot win disturbs nobody.
        self.role = Role::PreCandidate;
        self.votes.clear();
        self.leader = None;
    }

    fn become_candidate(&mut self) {
        assert_ne!(
            self.role,
            Role::Leader,
            "invalid transition leader -> candidate"
        );
        self.reset(self.term + 1);
        self.vote = Some(self.id);
        self.role = Role::Candidate;
    }

    fn become_leader(&mut self) {
        assert_ne!(
            self.role,
            Role::Follower,
            "invalid transition follower -> leader"
        );
        self.change_votes = self
            .votes
            .iter()
            .filter(|(_, granted)| **granted)
            .map(|(&id, _)| id)
            .collect();
        self.change_reason = if self.campaign_transfer {
            LeaderChangeReason::Transfer
        } else {
            LeaderChangeReason::ElectionTimeout
        };
        self.reset(self.term);
        self.role = Role::Leader;
        self.leader = Some(self.id);
        for pr in self.progress.values_mut() {
            pr.recent_active = true;
        }
        // Any membership change still in the log must be applied before another is accepted.
        self.pending_conf_index = self.log.last_index();
        // The empty entry of our term is what lets earlier-term entries commit (§5.4.2).
        let index = self.log.last_index() + 1;
        let noop = Entry {
            term: self.term,
            index,
            kind: EntryKind::Normal,
            data: Bytes::new(),
        };
        self.log.append(&[noop]);
        self.maybe_commit();
        self.broadcast_append();
        if self.config.lease_read_ms > 0 {
            self.broadcast_lease_round();
        }
    }

    // ---- ticks ---------------------------------------------------------------------------

    pub fn tick(&mut self) {
        if self.ticks_since_start < self.config.election_ticks {
            self.ticks_since_start += 1;
        }
        match self.role {
            Role::Leader => self.tick_leader(),
            _ => self.tick_election(),
        }
    }

    fn tick_election(&mut self) {
        self.election_elapsed = self.election_elapsed.saturating_add(1);
        // A node that cannot campaign keeps counting, so its leader lease runs out and it
        // will vote for others once the leader is gone.
        if self.promotable() && self.election_elapsed >= self.randomized_election_ticks {
            self.election_elapsed = 0;
            if self.leader.is_some() {
                self.note_change(LeaderChangeReason::LeaderSilent);
            }
            // An exhausted term is reported where the application asks to campaign; a timer
            // has nobody to report to, and the node goes on following.
            let _ = self.campaign(CampaignKind::Timeout);
        }
    }

    fn tick_leader(&mut self) {
        if self.config.defer_commit_notice || self.config.replicate_to_quorum_first {
            self.send_held_back();
        }
        self.heartbeat_elapsed += 1;
        self.election_elapsed += 1;
        if self.election_elapsed >= self.config.election_ticks {
            self.election_elapsed = 0;
            if self.config.check_quorum && !self.quorum_recently_active() {
                self.become_follower(self.term, None);
                self.note_change(LeaderChangeReason::CheckQuorum);
                return;
            }
            // A transfer that did not finish within an election timeout is abandoned.
            self.transferee = None;
        }
        if self.heartbeat_elapsed >= self.config.heartbeat_ticks {
            self.heartbeat_elapsed = 0;
            if self.config.lease_read_ms > 0 {
                self.broadcast_lease_round();
            } else {
                self.broadcast_heartbeat(None);
            }
        }
    }

    fn quorum_recently_active(&mut self) -> bool {
        let mut votes = BTreeMap::new();
        votes.insert(self.id, true);
        for (&id, pr) in self.progress.iter_mut() {
            if pr.recent_active {
                votes.insert(id, true);
            }
            pr.recent_active = false;
        }
        // Absent voters count as "no" once the round is over.
        for id in self.conf.members() {
            votes.entry(id).or_insert(false);
        }
        quorum::vote_result(&self.conf, &votes) == VoteResult::Won
    }

    // ---- elections -----------------------------------------------------------------------

    /// Starts an election: a PreVote round first when configured, unless `kind` says the
    /// PreVote already succeeded or a leadership transfer ordered it.
    pub fn campaign(&mut self, kind: CampaignKind) -> Result<(), Error> {
        if !self.promotable() || self.has_unapplied_conf_change() {
            return Ok(());
        }
        // Both rounds ask for votes in `term + 1`, which must stay within MAX_TERM.
        if self.term >= MAX_TERM {
            return Err(Error::TermExhausted { term: self.term });
        }
        let pre = self.config.pre_vote && kind == CampaignKind::Timeout;
        let transfer = kind == CampaignKind::Transfer;
        if kind != CampaignKind::PreVoteWon {
            self.campaign_transfer = transfer;
        }
        if pre {
            self.become_pre_candidate();
        } else {
            self.become_candidate();
        }
        let vote_term = if pre { self.term + 1 } else { self.term };
        self.votes.insert(self.id, true);
        if self.tally_votes() == VoteResult::Won {
            return self.on_election_won(pre);
        }
        let last_index = self.log.last_index();
        let last_term = self.log.last_term();
        let voters: BTreeSet<NodeId> = self
            .conf
            .voters
            .union(&self.conf.voters_outgoing)
            .copied()
            .collect();
        for id in voters.into_iter().filter(|&id| id != self.id) {
            let body = MessageBody::Vote {
                pre,
                last_index,
                last_term,
                transfer,
            };
            self.msgs.push(Message {
                from: self.id,
                to: id,
                term: vote_term,
                body,
            });
        }
        Ok(())
    }

    fn tally_votes(&self) -> VoteResult {
        quorum::vote_result(&self.conf, &self.votes)
    }

    fn on_election_won(&mut self, pre: bool) -> Result<(), Error> {
        if pre {
            self.campaign(CampaignKind::PreVoteWon)
        } else {
            self.become_leader();
            Ok(())
        }
    }

    fn has_unapplied_conf_change(&self) -> bool {
        if self.log.committed <= self.log.applied || !self.log.has_next_committed() {
            return false;
        }
        let low = self.log.applied + 1;
        match self.log.entries(low, self.log.committed + 1, u64::MAX) {
            Ok(entries) => entries.iter().any(|e| e.kind == EntryKind::ConfChange),
            Err(_) => false,
        }
    }

    // ---- the step function ---------------------------------------------------------------

    pub fn step(&mut self, m: Message) -> Result<(), Error> {
        // Every field a peer controls is checked before the message can change anything.
        if let Err(reason) = self.check_message(&m) {
            return Err(Error::RefusedMessage {
                from: m.from,
                kind: m.body.name(),
                reason,
            });
        }
        if m.term > self.term {
            if self.leader.is_some() && !matches!(m.body, MessageBody::Vote { pre: true, .. }) {
                self.note_change(LeaderChangeReason::HigherTerm);
            }
            // A node that just started may have acknowledged, before it went down, a leader
            // whose lease still runs: it waits as if it had heard from it. This holds whether
            // or not this node reads from leases itself, so that a member restarted with
            // other flags (a rolling change of `--lease-reads`) cannot elect a new leader
            // under a lease it helped grant.
            let withheld_after_start = self.ticks_since_start < self.config.election_ticks;
            let in_lease = self.config.check_quorum
                && (self.leader.is_some() || withheld_after_start)
                && self.election_elapsed < self.config.election_ticks;
            match &m.body {
                MessageBody::Vote { transfer, .. } if in_lease && !transfer => {
                    // A leader is alive: ignore a disruptive candidate without raising our term.
                    return Ok(());
                }
                MessageBody::Vote { pre: true, .. } => {}
                MessageBody::VoteResponse {
                    pre: true,
                    granted: true,
                } => {}
                MessageBody::Append { .. }
                | MessageBody::Heartbeat { .. }
                | MessageBody::SnapshotChunk { .. } => {
                    self.become_follower(m.term, Some(m.from));
                }
                MessageBody::Vote { .. } => {
                    // Only hearing from a leader or granting a vote resets the election timer
                    // (Raft §5.2): a node whose clock runs fast must not keep a better
                    // candidate from ever timing out by raising the term.
                    let elapsed = self.election_elapsed;
                    self.become_follower(m.term, None);
                    self.election_elapsed = elapsed;
                }
                _ => self.become_follower(m.term, None),
            }
        } else if m.term < self.term {
            match m.body {
                MessageBody::Append { .. } | MessageBody::Heartbeat { .. } => {
                    // A stale leader learns our term from this and steps down. Answered
                    // whatever the settings: a node whose term ran ahead and that cannot
                    // campaign (a learner in its own configuration, which still lists
                    // removed members whose vote requests raised its term) would otherwise
                    // ignore the leader of a lower term forever.
                    let body = MessageBody::AppendResponse {
                        index: 0,
                        reject: true,
                        hint_index: 0,
                        hint_term: 0,
                        awaited: self.awaited,
                    };
                    self.send(m.from, body);
                }
                MessageBody::Vote { pre: true, .. } => {
                    self.send(
                        m.from,
                        MessageBody::VoteResponse {
                            pre: true,
                            granted: false,
                        },
                    );
                }
                _ => {}
            }
            return Ok(());
        }

        if let MessageBody::Vote {
            pre,
            last_index,
            last_term,
            transfer,
        } = m.body
        {
            let voted = self.vote;
            self.handle_vote(&m, pre, last_index, last_term);
            if self.vote != voted {
                self.vote_transfer = transfer;
            }
            return Ok(());
        }
        match self.role {
            Role::Leader => self.step_leader(m),
            Role::Candidate | Role::PreCandidate => self.step_candidate(m),
            Role::Follower => self.step_follower(m),
        }
    }

    /// The checks a message must pass before `step` acts on it. They read the node's state
    /// and change none of it, so a refused message leaves no trace.
    fn check_message(&self, m: &Message) -> Result<(), Refusal> {
        if m.from == 0 || m.from == self.id {
            return Err(Refusal::InvalidSender);
        }
        if m.to != self.id {
            return Err(Refusal::WrongRecipient { to: m.to });
        }
        if m.term > MAX_TERM {
            return Err(Refusal::TermTooLarge { term: m.term });
        }
        self.check_sender(m)?;
        self.check_body(m)
    }

    /// Whether the sender may send this kind of message, by this node's configuration.
    fn check_sender(&self, m: &Message) -> Result<(), Refusal> {
        match &m.body {
            // Only voters elect: a learner or a stranger neither asks for votes nor casts one.
            MessageBody::Vote { .. } | MessageBody::VoteResponse { .. } => {
                if !self.conf.is_voter(m.from) {
                    return Err(Refusal::NotAVoter);
                }
            }
            MessageBody::Append { .. }
            | MessageBody::Heartbeat { .. }
            | MessageBody::SnapshotChunk { .. } => {
                self.check_leader(m)?;
            }
            // Only the leader this node follows, in its term, hands out reads or transfers.
            MessageBody::TimeoutNow | MessageBody::ReadIndexResponse { .. } => {
                if !self.conf.contains(m.from) {
                    return Err(Refusal::NotAMember);
                }
                if m.term >= self.term && self.leader != Some(m.from) {
                    return Err(Refusal::NotTheLeader);
                }
            }
            MessageBody::AppendResponse { .. }
            | MessageBody::HeartbeatResponse { .. }
            | MessageBody::SnapshotResponse { .. }
            | MessageBody::ReadIndexRequest { .. } => {
                if !self.conf.contains(m.from) {
                    return Err(Refusal::NotAMember);
                }
            }
        }
        Ok(())
    }

    /// Whether the sender of this Append, Heartbeat or SnapshotChunk may act as this node's
    /// leader (the refusal says why not). A member may, and so may anyone while this node
    /// does not vote in its own configuration (a joining node starts knowing no member at
    /// all, and a learner may have caught up from a snapshot taken before its leader joined):
    /// it cannot vote or count toward a commit, and it learns the membership from what it is
    /// sent.
    ///
    /// A voter follows a node outside its configuration as Raft asks (whoever leads this
    /// term or a later one), with two exceptions:
    /// - the message is of this node's term and this node already follows (or is) another
    ///   leader of that term: one term has at most one leader;
    /// - the other voters of its configuration are not a quorum without it, and it holds no
    ///   change naming the sender: every change after its configuration needed its own
    ///   acknowledgement, so it holds them all, and a leader it does not know cannot exist
    ///   (a cluster of one refuses every stranger).
    ///
    /// Otherwise a voter that was away while the change adding the current leader committed
    /// learns that change only from that leader: refusing it kept such a voter out for good,
    /// and the cluster stalled once the voter was needed for a quorum. What keeps strangers
    /// from speaking for a leader is the peer handshake, which only a holder of the
    /// cluster's peer secret passes (docs/security.md).
    fn check_leader(&self, m: &Message) -> Result<(), Refusal> {
        if self.conf.contains(m.from) || !self.conf.is_voter(self.id) {
            return Ok(());
        }
        if m.term == self.term && self.leader.is_some_and(|leader| leader != m.from) {
            return Err(Refusal::NotTheLeader);
        }
        if self.others_are_a_quorum() || self.named_in_unapplied_conf_change(m.from) {
            Ok(())
        } else {
            Err(Refusal::NotAMember)
        }
    }

    /// Whether the voters of the configuration other than this node make a quorum of it.
    fn others_are_a_quorum(&self) -> bool {
        let others: BTreeMap<NodeId, bool> = self
            .conf
            .voters
            .iter()
            .chain(self.conf.voters_outgoing.iter())
            .map(|&id| (id, id != self.id))
            .collect();
        quorum::vote_result(&self.conf, &others) == VoteResult::Won
    }

    fn named_in_unapplied_conf_change(&self, id: NodeId) -> bool {
        let last = self.log.last_index();
        if self.log.applied >= last {
            return false;
        }
        let Ok(entries) = self.log.entries(self.log.applied + 1, last + 1, u64::MAX) else {
            return false;
        };
        entries
            .iter()
            .filter(|e| e.kind == EntryKind::ConfChange)
            .filter_map(|e| ConfChange::decode(&e.data))
            .any(|change| match change {
                ConfChange::Enter(steps) => steps.iter().any(|step| {
                    matches!(*step, ConfChangeStep::AddVoter(added)
                        | ConfChangeStep::AddLearner(added) if added == id)
                }),
                ConfChange::Leave => false,
            })
    }

    /// Bounds on the body's fields that hold whatever the node's role.
    fn check_body(&self, m: &Message) -> Result<(), Refusal> {
        let index_bound = |field: &'static str, index: Index, bound: Index| {
            if index > bound {
                Err(Refusal::IndexBeyondBound {
                    field,
                    index,
                    bound,
                })
            } else {
                Ok(())
            }
        };
        let term_bound = |field: &'static str, term: Term| {
            if term > m.term {
                Err(Refusal::TermAhead {
                    field,
                    term,
                    message_term: m.term,
                })
            } else {
                Ok(())
            }
        };
        match &m.body {
            MessageBody::Append {
                prev_index,
                prev_term,
                entries,
                commit,
            } => {
                index_bound("prev_index", *prev_index, MAX_INDEX)?;
                index_bound("commit", *commit, MAX_INDEX)?;
                term_bound("prev_term", *prev_term)?;
                self.check_entries(*prev_index, *prev_term, entries, m.term)?;
            }
            MessageBody::AppendResponse {
                index,
                hint_index,
                hint_term,
                ..
            } => {
                index_bound("index", *index, MAX_INDEX)?;
                index_bound("hint_index", *hint_index, MAX_INDEX)?;
                term_bound("hint_term", *hint_term)?;
            }
            MessageBody::Vote {
                last_index,
                last_term,
                ..
            } => {
                index_bound("last_index", *last_index, MAX_INDEX)?;
                term_bound("last_term", *last_term)?;
            }
            MessageBody::Heartbeat { commit, .. } => index_bound("commit", *commit, MAX_INDEX)?,
            MessageBody::SnapshotChunk {
                meta, offset, data, ..
            } => {
                index_bound("snapshot index", meta.index, MAX_INDEX)?;
                term_bound("snapshot term", meta.term)?;
                if meta.index > 0 && meta.conf_state.voters.is_empty() {
                    return Err(Refusal::SnapshotWithoutVoters);
                }
                let limit = self.config.max_snapshot_bytes;
                let chunk_end = offset.saturating_add(data.len() as u64);
                if chunk_end > limit {
                    return Err(Refusal::SnapshotTooLarge {
                        size: chunk_end,
                        limit,
                    });
                }
            }
            MessageBody::SnapshotResponse {
                snapshot_index,
                next_offset,
                ..
            } => {
                index_bound("snapshot_index", *snapshot_index, MAX_INDEX)?;
                index_bound("next_offset", *next_offset, self.config.max_snapshot_bytes)?;
            }
            MessageBody::ReadIndexResponse { index, .. } => {
                index_bound("read index", *index, MAX_INDEX)?
            }
            MessageBody::VoteResponse { .. }
            | MessageBody::HeartbeatResponse { .. }
            | MessageBody::ReadIndexRequest { .. }
            | MessageBody::TimeoutNow => {}
        }
        Ok(())
    }

    /// An Append's entries must follow `prev_index` one by one with terms from `prev_term` up
    /// to the message's term, as in any leader's log; and none may contradict an entry this
    /// node knows committed (Leader Completeness: a real leader holds every committed entry).
    fn check_entries(
        &self,
        prev_index: Index,
        prev_term: Term,
        entries: &[Entry],
        message_term: Term,
    ) -> Result<(), Refusal> {
        let mut expected_index = prev_index;
        let mut floor_term = prev_term;
        for (position, entry) in entries.iter().enumerate() {
            expected_index = expected_index
                .checked_add(1)
                .filter(|&index| index <= MAX_INDEX)
                .ok_or(Refusal::IndexBeyondBound {
                    field: "entry index",
                    index: entry.index,
                    bound: MAX_INDEX,
                })?;
            if entry.index != expected_index || entry.term < floor_term {
                return Err(Refusal::EntriesNotContiguous {
                    position,
                    index: entry.index,
                });
            }
            if entry.term > message_term {
                return Err(Refusal::TermAhead {
                    field: "entry term",
                    term: entry.term,
                    message_term,
                });
            }
            if entry.kind == EntryKind::ConfChange && ConfChange::decode(&entry.data).is_none() {
                return Err(Refusal::UndecodableConfChange { index: entry.index });
            }
            floor_term = entry.term;
            let committed = self.log.committed;
            if entry.index <= committed
                && entry.index >= self.log.first_index()
                && !self.log.match_term(entry.index, entry.term)
            {
                return Err(Refusal::ConflictBelowCommit {
                    index: entry.index,
                    committed,
                });
            }
        }
        Ok(())
    }

    fn handle_vote(&mut self, m: &Message, pre: bool, last_index: Index, last_term: Term) {
        let can_vote = self.vote == Some(m.from)
            || (self.vote.is_none() && self.leader.is_none())
            || (pre && m.term > self.term);
        let granted = can_vote && self.log.is_up_to_date(last_index, last_term);
        // A granted PreVote answers in the candidate's future term so that it counts there.
        let term = if pre && granted { m.term } else { self.term };
        if granted && !pre {
            self.election_elapsed = 0;
            self.vote = Some(m.from);
        }
        let body = MessageBody::VoteResponse { pre, granted };
        self.msgs.push(Message {
            from: self.id,
            to: m.from,
            term,
            body,
        });
    }

    fn step_candidate(&mut self, m: Message) -> Result<(), Error> {
        match m.body {
            MessageBody::Append { .. }
            | MessageBody::Heartbeat { .. }
            | MessageBody::SnapshotChunk { .. } => {
                self.become_follower(m.term, Some(m.from));
                self.step_follower(m)
            }
            MessageBody::VoteResponse { pre, granted } => {
                if pre != (self.role == Role::PreCandidate) {
                    return Ok(());
                }
                self.votes.insert(m.from, granted);
                match self.tally_votes() {
                    VoteResult::Won => self.on_election_won(pre),
                    VoteResult::Lost => {
                        self.become_follower(self.term, None);
                        Ok(())
                    }
                    VoteResult::Pending => Ok(()),
                }
            }
            _ => Ok(()),
        }
    }

    fn step_follower(&mut self, m: Message) -> Result<(), Error> {
        match m.body {
            MessageBody::Append {
                prev_index,
                prev_term,
                entries,
                commit,
            } => {
                self.election_elapsed = 0;
                self.leader = Some(m.from);
                self.handle_append(m.from, prev_index, prev_term, &entries, commit);
            }
            MessageBody::Heartbeat { commit, context } => {
                self.election_elapsed = 0;
                self.leader = Some(m.from);
                self.log.commit_to(commit.min(self.log.last_index()));
                let awaited = self.awaited;
                self.send(m.from, MessageBody::HeartbeatResponse { context, awaited });
            }
            MessageBody::SnapshotChunk {
                meta,
                offset,
                data,
                done,
                image_crc32c,
            } => {
                self.election_elapsed = 0;
                self.leader = Some(m.from);
                let chunk = IncomingChunk {
                    meta,
                    offset,
                    data,
                    done,
                    image_crc32c,
                };
                if let Err(reason) = self.handle_snapshot_chunk(m.from, chunk) {
                    return Err(Error::RefusedMessage {
                        from: m.from,
                        kind: "SnapshotChunk",
                        reason,
                    });
                }
            }
            MessageBody::TimeoutNow => return self.campaign(CampaignKind::Transfer),
            MessageBody::ReadIndexResponse { context, index } => {
                self.read_states.push(ReadState { index, context });
            }
            _ => {}
        }
        Ok(())
    }

    fn handle_append(
        &mut self,
        from: NodeId,
        prev_index: Index,
        prev_term: Term,
        entries: &[Entry],
        commit: Index,
    ) {
        if prev_index < self.log.committed {
            // Everything up to our commit index is known to match; answer with it.
            let body = MessageBody::AppendResponse {
                index: self.log.committed,
                reject: false,
                hint_index: 0,
                hint_term: 0,
                awaited: self.awaited,
            };
            self.send(from, body);
            return;
        }
        match self.log.maybe_append(prev_index, prev_term, entries) {
            Some(last_new) => {
                self.log.commit_to(commit.min(last_new));
                let body = MessageBody::AppendResponse {
                    index: last_new,
                    reject: false,
                    hint_index: 0,
                    hint_term: 0,
                    awaited: self.awaited,
                };
                self.send(from, body);
            }
            None => {
                let hint_index = self
                    .log
                    .find_conflict_by_term(prev_index.min(self.log.last_index()), prev_term);
                let hint_term = self.log.term_or_zero(hint_index);
                let body = MessageBody::AppendResponse {
                    index: prev_index,
                    reject: true,
                    hint_index,
                    hint_term,
                    awaited: self.awaited,
                };
                self.send(from, body);
            }
        }
    }

    /// Assembles a snapshot chunk by chunk. A chunk that cannot belong to the transfer (an
    /// offset past what arrived, another checksum, a size past the cap) or an image whose
    /// checksum does not match is refused; the node keeps its log and answers so that a real
    /// leader resumes or starts over.
    fn handle_snapshot_chunk(&mut self, from: NodeId, chunk: IncomingChunk) -> Result<(), Refusal> {
        let IncomingChunk {
            meta,
            offset,
            data,
            done,
            image_crc32c,
        } = chunk;
        let index = meta.index;
        if index <= self.log.committed {
            // We already have everything it covers.
            self.incoming_snapshot = None;
            let body = MessageBody::SnapshotResponse {
                snapshot_index: index,
                next_offset: 0,
                installed: true,
                reject: false,
            };
            self.send(from, body);
            return Ok(());
        }
        if offset == 0 {
            self.incoming_snapshot = Some(IncomingSnapshot {
                meta: meta.clone(),
                data: BytesMut::new(),
                image_crc32c,
            });
        }
        let Some(incoming) = self.incoming_snapshot.as_mut().filter(|s| s.meta == meta) else {
            // A chunk of a snapshot we are not receiving: ask the leader to start over.
            self.reject_snapshot(from, index);
            return Ok(());
        };
        if incoming.image_crc32c != image_crc32c {
            self.incoming_snapshot = None;
            self.reject_snapshot(from, index);
            return Err(Refusal::SnapshotChecksumChanged);
        }
        let received = incoming.data.len() as u64;
        if offset > received {
            // Tell the leader where to resume; the chunk itself cannot be placed.
            let body = MessageBody::SnapshotResponse {
                snapshot_index: index,
                next_offset: received,
                installed: false,
                reject: false,
            };
            self.send(from, body);
            return Err(Refusal::SnapshotOffsetBeyondReceived { offset, received });
        }
        if offset == received {
            incoming.data.extend_from_slice(&data);
        }
        let next_offset = incoming.data.len() as u64;
        // `offset + len` is bounded by `max_snapshot_bytes` (checked in `check_body`).
        let chunk_end = offset.saturating_add(data.len() as u64);
        if !(done && chunk_end == next_offset) {
            let body = MessageBody::SnapshotResponse {
                snapshot_index: index,
                next_offset,
                installed: false,
                reject: false,
            };
            self.send(from, body);
            return Ok(());
        }
        let Some(incoming) = self.incoming_snapshot.take() else {
            return Ok(());
        };
        let computed = crc32c::crc32c(&incoming.data);
        if computed != incoming.image_crc32c {
            // Nothing reaches the log or the application: ask for the whole snapshot again.
            self.reject_snapshot(from, index);
            return Err(Refusal::SnapshotChecksumMismatch {
                expected: incoming.image_crc32c,
                computed,
            });
        }
        let snapshot = Snapshot {
            meta: incoming.meta,
            data: incoming.data.freeze(),
        };
        self.restore(snapshot);
        let body = MessageBody::SnapshotResponse {
            snapshot_index: index,
            next_offset,
            installed: true,
            reject: false,
        };
        self.send(from, body);
        Ok(())
    }

    fn reject_snapshot(&mut self, to: NodeId, snapshot_index: Index) {
        let body = MessageBody::SnapshotResponse {
            snapshot_index,
            next_offset: 0,
            installed: false,
            reject: true,
        };
        self.send(to, body);
    }

    /// Replaces this follower's log and membership with a snapshot from the leader.
    fn restore(&mut self, snapshot: Snapshot) {
        let meta = &snapshot.meta;
        if self.log.match_term(meta.index, meta.term) {
            // Our log already holds the snapshot's last entry: just fast-forward the commit.
            self.log.commit_to(meta.index);
            return;
        }
        self.conf = meta.conf_state.clone();
        self.log.restore(snapshot);
    }

    fn step_leader(&mut self, m: Message) -> Result<(), Error> {
        match m.body {
            MessageBody::AppendResponse {
                index,
                reject,
                hint_index,
                hint_term,
                awaited,
            } => {
                // Success names the last entry the follower matched, a rejection echoes the
                // previous index this leader sent: neither can be past the leader's own log.
                let last_index = self.log.last_index();
                if index > last_index {
                    return Err(Error::AppendResponseBeyondLog {
                        from: m.from,
                        index,
                        last_index,
                    });
                }
                // A rejection's hint points into the follower's log no further than the
                // rejected previous index; `hint_index + 1` below relies on it.
                let hint_bound = if reject { index } else { last_index };
                if hint_index > hint_bound {
                    return Err(Error::RefusedMessage {
                        from: m.from,
                        kind: "AppendResponse",
                        reason: Refusal::IndexBeyondBound {
                            field: "hint_index",
                            index: hint_index,
                            bound: hint_bound,
                        },
                    });
                }
                let newly_awaited = self.note_awaited(m.from, awaited);
                self.handle_append_response(m.from, index, reject, hint_index, hint_term);
                if newly_awaited {
                    self.send_owed(m.from);
                }
            }
            MessageBody::HeartbeatResponse { context, awaited } => {
                let newly_awaited = self.note_awaited(m.from, awaited);
                let Some(pr) = self.progress.get_mut(&m.from) else {
                    return Err(Error::UnknownPeer(m.from));
                };
                pr.recent_active = true;
                pr.probe_sent = false;
                // Pipelined appends may have been lost: a full window would stall this
                // follower forever, so each heartbeat reply frees one slot to probe again.
                if pr.mode == ReplicationMode::Replicate
                    && pr.inflight.len() >= self.config.max_inflight_appends
                {
                    pr.inflight.pop_front();
                }
                let needs_more = pr.match_index < self.log.last_index();
                if let ReplicationMode::Snapshot { .. } = pr.mode {
                    // Resend the outstanding chunk, which may have been lost.
                    self.send_snapshot_chunk(m.from);
                } else if needs_more {
                    self.send_append(m.from);
                }
                if newly_awaited {
                    self.send_owed(m.from);
                }
                match context.as_deref().map(lease_round_of) {
                    Some(Some(round)) => self.ack_lease_round(m.from, round),
                    Some(None) => {
                        if let Some(context) = context {
                            self.ack_read(m.from, &context);
                        }
                    }
                    None => {}
                }
            }
            MessageBody::SnapshotResponse {
                snapshot_index,
                next_offset,
                installed,
                reject,
            } => {
                self.handle_snapshot_response(
                    m.from,
                    snapshot_index,
                    next_offset,
                    installed,
                    reject,
                );
            }
            MessageBody::ReadIndexRequest { context }
                if self.conf.contains(m.from) && lease_round_of(&context).is_none() =>
            {
                self.leader_read_index(context, m.from);
            }
            _ => {}
        }
        Ok(())
    }

    fn handle_append_response(
        &mut self,
        from: NodeId,
        index: Index,
        reject: bool,
        hint_index: Index,
        hint_term: Term,
    ) {
        let next_probe = if reject && hint_term > 0 {
            self.log.find_conflict_by_term(hint_index, hint_term) + 1
        } else {
            hint_index + 1
        };
        let last_index = self.log.last_index();
        let Some(pr) = self.progress.get_mut(&from) else {
            return;
        };
        pr.recent_active = true;
        if reject {
            if index == 0 {
                // A term-rule rejection from a node with a higher term; nothing to learn here.
                return;
            }
            if pr.maybe_decrease_to(index, next_probe) {
                self.send_append(from);
            }
            return;
        }
        let was_paused = pr.is_paused(self.config.max_inflight_appends);
        if !pr.maybe_update(index) {
            if was_paused && !pr.is_paused(self.config.max_inflight_appends) {
                self.send_append(from);
            }
            return;
        }
        if pr.catching_up && pr.match_index >= self.log.applied {
            pr.catching_up = false;
        }
        match pr.mode {
            ReplicationMode::Probe => pr.become_replicate(),
            ReplicationMode::Snapshot { ref meta, .. } if pr.match_index >= meta.index => {
                pr.become_probe()
            }
            _ => {}
        }
        let caught_up = pr.match_index == last_index;
        // More goes out only if the follower lacks something: entries not sent yet (after a
        // probe, or appended while it was paused), or a commit index a broadcast skipped
        // while it was paused. Otherwise the last broadcast already carried the commit, and
        // an empty append would only buy another acknowledgement: two messages and two
        // wake-ups per follower per commit.
        let lacks_something = was_paused || pr.next_index <= last_index;
        // A spare is sent entries as it acknowledges only while it lags far behind.
        let lacks_something = if self.spare_followers().contains(&from) {
            self.spare_lags_too_far(&self.progress[&from])
        } else {
            lacks_something
        };
        if self.maybe_commit() {
            self.announce_commit();
        } else if lacks_something {
            self.send_append(from);
        }
        if caught_up && self.transferee == Some(from) {
            self.send(from, MessageBody::TimeoutNow);
        }
    }

    fn handle_snapshot_response(
        &mut self,
        from: NodeId,
        snapshot_index: Index,
        next_offset: u64,
        installed: bool,
        reject: bool,
    ) {
        let Some(pr) = self.progress.get_mut(&from) else {
            return;
        };
        pr.recent_active = true;
        let ReplicationMode::Snapshot {
            meta,
            next_offset: expected,
            ..
        } = &mut pr.mode
        else {
            return;
        };
        if meta.index != snapshot_index {
            return;
        }
        if installed {
            pr.match_index = pr.match_index.max(snapshot_index);
            pr.become_probe();
            pr.catching_up = pr.match_index < self.log.applied;
            self.send_append(from);
            return;
        }
        *expected = if reject { 0 } else { next_offset };
        self.send_snapshot_chunk(from);
    }

    // ---- replication ---------------------------------------------------------------------

    fn send(&mut self, to: NodeId, body: MessageBody) {
        self.msgs.push(Message {
            from: self.id,
            to,
            term: self.term,
            body,
        });
    }

    pub fn broadcast_append(&mut self) {
        self.broadcast_pending = false;
        let ids: Vec<NodeId> = self.progress.keys().copied().collect();
        let spares = self.spare_followers();
        for id in ids {
            // A spare whose client waits for a new entry gets it now, with the quorum, so
            // that its own sync overlaps theirs instead of following the commit.
            let pr = &self.progress[&id];
            if !spares.contains(&id) || pr.commit_wanted >= pr.next_index {
                self.send_append(id);
            }
        }
    }

    /// With `replicate_to_quorum_first`, the followers a new entry does not go to at once:
    /// every voter beyond the fewest that make a quorum with the leader, those chosen awaited
    /// first, then by the highest match index, then by the lowest id; never an awaited one.
    /// None in a joint configuration, during a leadership transfer, or while fewer than that
    /// many followers are in replicate mode.
    fn spare_followers(&self) -> Vec<NodeId> {
        if !self.config.replicate_to_quorum_first
            || self.role != Role::Leader
            || self.conf.is_joint()
            || !self.conf.voters.contains(&self.id)
            || self.transferee.is_some()
        {
            return Vec::new();
        }
        let followers_needed = self.conf.voters.len() / 2;
        let mut replicating: Vec<(bool, Index, NodeId)> = self
            .conf
            .voters
            .iter()
            .filter(|&&id| id != self.id)
            .filter_map(|&id| {
                let pr = self.progress.get(&id)?;
                matches!(pr.mode, ReplicationMode::Replicate).then_some((
                    pr.awaited,
                    pr.match_index,
                    id,
                ))
            })
            .collect();
        if replicating.len() <= followers_needed {
            return Vec::new();
        }
        // Awaited followers get every entry at once anyway, so they are counted on first.
        replicating.sort_by(|a, b| b.0.cmp(&a.0).then(b.1.cmp(&a.1)).then(a.2.cmp(&b.2)));
        replicating[followers_needed..]
            .iter()
            .filter(|&&(awaited, _, _)| !awaited)
            .map(|&(_, _, id)| id)
            .collect()
    }

    /// Records whether follower `from` is awaited (its latest response says); true when it
    /// just became so, and may lack what this leader held back from it.
    fn note_awaited(&mut self, from: NodeId, awaited: bool) -> bool {
        let Some(pr) = self.progress.get_mut(&from) else {
            return false;
        };
        let newly = awaited && !pr.awaited;
        pr.awaited = awaited;
        newly
    }

    /// Says whether clients of this node wait for what it applies (watches and other
    /// subscriptions on a follower). A leader holds nothing back from an awaited follower:
    /// it is never a spare of `replicate_to_quorum_first`, and hears of each commit at once
    /// whatever `defer_commit_notice` says. The leader learns it from this node's responses.
    pub fn set_awaited(&mut self, awaited: bool) {
        self.awaited = awaited;
    }

    /// Broadcasts appends held back for batching, if any (called before building a Ready).
    pub fn flush_broadcast(&mut self) {
        if self.broadcast_pending && self.role == Role::Leader {
            self.broadcast_append();
        }
    }

    pub fn has_pending_broadcast(&self) -> bool {
        self.broadcast_pending && self.role == Role::Leader
    }

    fn send_append(&mut self, to: NodeId) {
        let max_inflight = self.config.max_inflight_appends;
        let Some(pr) = self.progress.get(&to) else {
            return;
        };
        if pr.is_paused(max_inflight) {
            return;
        }
        let next = pr.next_index;
        let prev_index = next - 1;
        let last_index = self.log.last_index();
        let prev_term = self.log.term(prev_index);
        let entries = self
            .log
            .entries(next, last_index + 1, self.config.max_append_bytes);
        let (prev_term, entries) = match (prev_term, entries) {
            (Ok(term), Ok(entries)) => (term, entries),
            (Err(StorageError::Compacted(_)), _) | (_, Err(StorageError::Compacted(_))) => {
                self.start_snapshot(to);
                return;
            }
            (Err(e), _) | (_, Err(e)) => panic!("conclave-raft: cannot read log for {to}: {e}"),
        };
        let last_sent = prev_index + entries.len() as u64;
        let count = entries.len();
        let commit = self.log.committed.min(last_sent.max(pr.match_index));
        let body = MessageBody::Append {
            prev_index,
            prev_term,
            entries,
            commit,
        };
        self.send(to, body);
        if let Some(pr) = self.progress.get_mut(&to) {
            pr.sent_append(last_sent, count);
            pr.commit_sent = pr.commit_sent.max(commit);
        }
    }

    /// Tells the followers of a commit index that just advanced. A follower still missing
    /// entries gets them (the append carries the commit), a spare only once it lacks
    /// [`SPARE_LAG_ENTRIES_MAX`] committed ones; one that holds everything gets an empty
    /// append, unless `defer_commit_notice` leaves the index to the next message.
    fn announce_commit(&mut self) {
        let last_index = self.log.last_index();
        let spares = self.spare_followers();
        let ids: Vec<NodeId> = self.progress.keys().copied().collect();
        let committed = self.log.committed;
        for id in ids {
            let pr = &self.progress[&id];
            let wanted = pr.commit_wanted > pr.commit_sent && pr.commit_wanted <= committed;
            let send = if spares.contains(&id) {
                wanted || self.spare_lags_too_far(pr)
            } else {
                wanted
                    || pr.awaited
                    || pr.next_index <= last_index
                    || !self.config.defer_commit_notice
            };
            if send {
                self.send_append(id);
            }
        }
    }

    /// Follower `to` is to hear that `index` committed as soon as it does, with the entries
    /// up to it, whatever `defer_commit_notice` and `replicate_to_quorum_first` hold back: a
    /// client that wrote through `to` waits there for it.
    pub fn hasten_commit_notice(&mut self, to: NodeId, index: Index) {
        if self.role != Role::Leader || to == self.id {
            return;
        }
        let Some(pr) = self.progress.get_mut(&to) else {
            return;
        };
        pr.commit_wanted = pr.commit_wanted.max(index);
        if index <= self.log.committed {
            self.send_owed(to);
        }
    }

    fn spare_lags_too_far(&self, pr: &Progress) -> bool {
        // Committed entries not sent yet: committed - (next_index - 1).
        self.log.committed.saturating_add(1) >= pr.next_index.saturating_add(SPARE_LAG_ENTRIES_MAX)
    }

    /// What a leader holds back for a tick at most: commit indexes `defer_commit_notice` did
    /// not send, committed entries a spare lacks, and, after a stall, everything.
    fn send_held_back(&mut self) {
        let ids: Vec<NodeId> = self.progress.keys().copied().collect();
        for id in ids {
            self.send_owed(id);
        }
        if self.config.replicate_to_quorum_first {
            self.resend_if_stalled();
        }
    }

    /// Sends every follower what it lacks when an entry that was already waiting at the
    /// last tick is still not committed: the followers a quorum-first broadcast counted on
    /// are not answering, so the spares are asked too (and, answering, become the ones new
    /// entries go to first).
    fn resend_if_stalled(&mut self) {
        let last_index = self.log.last_index();
        let stalled = self
            .uncommitted_at_last_tick
            .is_some_and(|waiting| self.log.committed < waiting);
        if stalled {
            let ids: Vec<NodeId> = self.progress.keys().copied().collect();
            for id in ids {
                if self.progress[&id].next_index <= last_index {
                    self.send_append(id);
                }
            }
        }
        self.uncommitted_at_last_tick = (self.log.committed < last_index).then_some(last_index);
    }

    /// Sends `to` committed entries it was not sent, or the commit index of entries it holds
    /// when it was not told it.
    fn send_owed(&mut self, to: NodeId) {
        let committed = self.log.committed;
        let Some(pr) = self.progress.get(&to) else {
            return;
        };
        if matches!(pr.mode, ReplicationMode::Replicate)
            && (pr.next_index <= committed || pr.commit_sent < committed.min(pr.match_index))
        {
            self.send_append(to);
        }
    }

    fn start_snapshot(&mut self, to: NodeId) {
        let snapshot = match self.log.snapshot() {
            Ok(snapshot) => snapshot,
            Err(StorageError::SnapshotTemporarilyUnavailable) => return,
            Err(e) => panic!("conclave-raft: cannot read snapshot: {e}"),
        };
        assert!(
            !snapshot.is_empty(),
            "log compacted but no snapshot to send to {to}"
        );
        let image_crc32c = crc32c::crc32c(&snapshot.data);
        if let Some(pr) = self.progress.get_mut(&to) {
            pr.become_snapshot(snapshot.meta, snapshot.data, image_crc32c);
        }
        self.send_snapshot_chunk(to);
    }

    /// Sends the next chunk of the snapshot held for `to`. A transfer always finishes the
    /// snapshot it began, even when storage has recorded newer ones since: once installed,
    /// the follower continues from the log, or gets the newest snapshot if the entries after
    /// the one it installed are gone.
    fn send_snapshot_chunk(&mut self, to: NodeId) {
        let Some(ReplicationMode::Snapshot {
            meta,
            next_offset,
            image_crc32c,
            image,
        }) = self.progress.get(&to).map(|pr| pr.mode.clone())
        else {
            return;
        };
        let total = image.len() as u64;
        let start = next_offset.min(total);
        let end = start
            .saturating_add(self.config.snapshot_chunk_bytes)
            .min(total);
        let data = image.slice(start as usize..end as usize);
        let body = MessageBody::SnapshotChunk {
            meta,
            offset: start,
            data,
            done: end == total,
            image_crc32c,
        };
        self.send(to, body);
    }

    fn broadcast_heartbeat(&mut self, context: Option<Bytes>) {
        let ids: Vec<NodeId> = self.progress.keys().copied().collect();
        for id in ids {
            let Some(pr) = self.progress.get_mut(&id) else {
                continue;
            };
            let commit = self.log.committed.min(pr.match_index);
            pr.commit_sent = pr.commit_sent.max(commit);
            self.send(
                id,
                MessageBody::Heartbeat {
                    commit,
                    context: context.clone(),
                },
            );
        }
    }

    /// Advances the commit index to what a quorum stores, counting only entries of the current
    /// term (§5.4.2). Returns whether it moved.
    pub fn maybe_commit(&mut self) -> bool {
        if self.role != Role::Leader {
            return false;
        }
        let progress = &self.progress;
        let id = self.id;
        let persisted = self.log.persisted;
        let acked = |node: NodeId| -> Index {
            if node == id {
                persisted
            } else {
                progress.get(&node).map_or(0, |pr| pr.match_index)
            }
        };
        let index = quorum::committed_index(&self.conf, &acked);
        if index <= self.log.committed || index == Index::MAX {
            return false;
        }
        let term_ok = self.log.term_or_zero(index) == self.term;
        #[cfg(feature = "negative-controls")]
        let term_ok = term_ok || self.config.bugs.commit_earlier_term_by_count;
        if !term_ok {
            return false;
        }
        self.log.commit_to(index);
        self.on_commit_advanced();
        true
    }

    fn on_commit_advanced(&mut self) {
        if self.log.term_or_zero(self.log.committed) != self.term {
            return;
        }
        // Reads that waited for this leader's first commit can now start their round.
        for (context, requester) in std::mem::take(&mut self.reads_awaiting_commit) {
            self.leader_read_index(context, requester);
        }
    }

    // ---- proposals -------------------------------------------------------------------------

    pub fn propose(&mut self, kind: EntryKind, data: Bytes) -> Result<Index, Error> {
        if self.role != Role::Leader {
            return Err(Error::NotLeader {
                leader: self.leader,
            });
        }
        if let Some(target) = self.transferee {
            return Err(Error::TransferInProgress { target });
        }
        let size = data.len() as u64;
        let limit = self.config.max_uncommitted_bytes;
        if size > limit {
            // It could never fit, however empty the pipeline.
            return Err(Error::ProposalTooLarge { size, limit });
        }
        if self.uncommitted_bytes > 0 && self.uncommitted_bytes + size > limit {
            return Err(Error::UncommittedLimit {
                uncommitted: self.uncommitted_bytes,
                limit,
            });
        }
        self.uncommitted_bytes += size;
        let index = self.log.last_index() + 1;
        self.log.append(&[Entry {
            term: self.term,
            index,
            kind,
            data,
        }]);
        self.broadcast_pending = true;
        // A cluster of one commits as soon as the entry is durable (see `on_persisted`).
        Ok(index)
    }

    pub fn propose_conf_change(&mut self, change: ConfChange) -> Result<Index, Error> {
        if self.role != Role::Leader {
            return Err(Error::NotLeader {
                leader: self.leader,
            });
        }
        if self.pending_conf_index > self.log.applied {
            return Err(Error::ConfChangeInProgress);
        }
        match &change {
            ConfChange::Enter(steps) => {
                if self.conf.is_joint() {
                    return Err(Error::ConfChangeInProgress);
                }
                apply_steps(&self.conf, steps).map_err(Error::InvalidConfChange)?;
            }
            ConfChange::Leave => {
                if !self.conf.is_joint() {
                    return Err(Error::InvalidConfChange(
                        "not in a joint configuration".into(),
                    ));
                }
            }
        }
        let index = self.propose(EntryKind::ConfChange, change.encode())?;
        self.pending_conf_index = index;
        Ok(index)
    }

    /// After an `Enter` is applied, the leader leaves the joint configuration by itself.
    fn maybe_auto_leave(&mut self) {
        if self.role == Role::Leader
            && self.conf.is_joint()
            && self.pending_conf_index <= self.log.applied
            && self.transferee.is_none()
        {
            let index = self.log.last_index() + 1;
            let data = ConfChange::Leave.encode();
            let entry = Entry {
                term: self.term,
                index,
                kind: EntryKind::ConfChange,
                data,
            };
            self.log.append(&[entry]);
            self.pending_conf_index = index;
            self.broadcast_pending = true;
        }
    }

    /// Applies a committed membership change (called as the application applies it).
    ///
    /// A real leader only proposes changes it decoded and validated against this same
    /// configuration, so neither failure below happens between honest members. A member's
    /// forged entry could still get here: it is skipped, the same way on every node (all
    /// apply the same entries in the same order), rather than stopping the node.
    fn apply_conf_change(&mut self, entry: &Entry) {
        let Some(change) = ConfChange::decode(&entry.data) else {
            return;
        };
        let new_conf = match change {
            ConfChange::Enter(steps) => match apply_steps(&self.conf, &steps) {
                Ok(conf) => conf,
                Err(_) => return,
            },
            ConfChange::Leave => {
                let mut conf = self.conf.clone();
                conf.voters_outgoing.clear();
                conf
            }
        };
        self.conf = new_conf;
        let next = self.log.last_index() + 1;
        let members = self.conf.members();
        self.progress.retain(|id, _| members.contains(id));
        if self.role == Role::Leader {
            for &id in members.iter().filter(|&&id| id != self.id) {
                self.progress.entry(id).or_insert_with(|| {
                    let mut pr = Progress::new(next);
                    pr.recent_active = true;
                    pr
                });
            }
            if !self.conf.is_voter(self.id) {
                self.step_down_after_removal();
                return;
            }
            if self.maybe_commit() {
                self.broadcast_append();
            } else {
                self.broadcast_pending = true;
            }
        }
    }

    /// A leader no longer in the configuration hands over to the most up-to-date voter, then
    /// becomes a follower, so the cluster does not wait a whole election timeout.
    fn step_down_after_removal(&mut self) {
        let best = self
            .conf
            .voters
            .iter()
            .filter_map(|id| self.progress.get(id).map(|pr| (pr.match_index, *id)))
            .max();
        if let Some((match_index, id)) = best
            && match_index == self.log.last_index()
        {
            self.send(id, MessageBody::TimeoutNow);
        }
        self.become_follower(self.term, None);
        self.note_change(LeaderChangeReason::Removed);
    }

    fn note_change(&mut self, reason: LeaderChangeReason) {
        self.change_reason = reason;
        self.change_votes.clear();
    }

    /// Why the leader this node knows of last changed, and who voted: the voters that
    /// elected this node when it leads, the node it voted for when it follows the winner it
    /// voted for.
    pub fn leader_change(&self) -> (LeaderChangeReason, Vec<NodeId>) {
        match self.leader {
            Some(leader) if leader == self.id => (self.change_reason, self.change_votes.clone()),
            Some(leader) if self.vote == Some(leader) => {
                let reason = if self.vote_transfer {
                    LeaderChangeReason::Transfer
                } else {
                    LeaderChangeReason::ElectionTimeout
                };
                (reason, vec![self.id])
            }
            Some(_) => (LeaderChangeReason::LeaderHeard, Vec::new()),
            None => (self.change_reason, Vec::new()),
        }
    }

    // ---- reads -----------------------------------------------------------------------------

    pub fn read_index(&mut self, context: Bytes) -> Result<(), Error> {
        if lease_round_of(&context).is_some() {
            return Err(Error::ReservedReadContext);
        }
        match self.role {
            Role::Leader => {
                self.leader_read_index(context, self.id);
                Ok(())
            }
            _ => match self.leader {
                Some(leader) if self.role == Role::Follower => {
                    self.send(leader, MessageBody::ReadIndexRequest { context });
                    Ok(())
                }
                _ => Err(Error::NoLeader),
            },
        }
    }

    fn leader_read_index(&mut self, context: Bytes, requester: NodeId) {
        let index = self.log.committed;
        #[cfg(feature = "negative-controls")]
        if self.config.bugs.read_index_without_quorum_check {
            self.release_read(context, index, requester);
            return;
        }
        if self.log.term_or_zero(index) != self.term {
            // Our commit index may lag the cluster's until an entry of our term commits.
            self.reads_awaiting_commit.push((context, requester));
            return;
        }
        if self.lease_holds() {
            self.lease_reads_served += 1;
            self.release_read(context, index, requester);
            return;
        }
        let single_voter = self.conf.voters_outgoing.is_empty()
            && self.conf.voters.len() == 1
            && self.conf.voters.contains(&self.id);
        if single_voter {
            self.release_read(context, index, requester);
            return;
        }
        let mut acks = BTreeSet::new();
        acks.insert(self.id);
        self.pending_reads.push_back(PendingRead {
            context: context.clone(),
            index,
            requester,
            acks,
        });
        self.broadcast_heartbeat(Some(context));
    }

    fn ack_read(&mut self, from: NodeId, context: &Bytes) {
        let Some(pos) = self.pending_reads.iter().position(|r| r.context == context) else {
            return;
        };
        self.pending_reads[pos].acks.insert(from);
        let votes: BTreeMap<NodeId, bool> = self.pending_reads[pos]
            .acks
            .iter()
            .map(|&id| (id, true))
            .collect();
        if quorum::vote_result(&self.conf, &votes) != VoteResult::Won {
            return;
        }
        // Confirming this round confirms every earlier one too.
        for read in self.pending_reads.drain(..=pos).collect::<Vec<_>>() {
            self.release_read(read.context, read.index, read.requester);
        }
    }

    /// The application's clock moved to `now_ms` (a monotonic clock in milliseconds; a
    /// reading older than the last is ignored). Lease reads measure the lease with it, so
    /// the application sets it before it asks for a read.
    pub fn set_now_ms(&mut self, now_ms: u64) {
        self.now_ms = self.now_ms.max(now_ms);
    }

    /// Sends a heartbeat round that extends the lease once a quorum acknowledges it.
    fn broadcast_lease_round(&mut self) {
        let round = self.lease_round_next;
        self.lease_round_next += 1;
        let lease_ms = self.config.lease_read_ms;
        let now_ms = self.now_ms;
        // A round older than the lease can no longer extend it.
        while self
            .lease_rounds
            .front()
            .is_some_and(|&(_, sent_ms)| sent_ms.saturating_add(lease_ms) <= now_ms)
            || self.lease_rounds.len() >= LEASE_ROUNDS_MAX
        {
            self.lease_rounds.pop_front();
        }
        self.lease_rounds.push_back((round, now_ms));
        self.broadcast_heartbeat(Some(lease_round_context(round)));
    }

    /// `from` acknowledged lease round `round`: it heard from this leader no earlier than the
    /// round was sent.
    fn ack_lease_round(&mut self, from: NodeId, round: u64) {
        let Some(&(_, sent_ms)) = self.lease_rounds.iter().find(|(r, _)| *r == round) else {
            return;
        };
        if let Some(pr) = self.progress.get_mut(&from) {
            pr.lease_acked_ms = Some(pr.lease_acked_ms.map_or(sent_ms, |t| t.max(sent_ms)));
        }
    }

    /// Whether this leader may answer a read from its lease now: lease reads are on, it has
    /// not begun a transfer in this term, and a quorum (itself included) acknowledged lease
    /// rounds sent less than `lease_read_ms` ago. No other leader can have been elected since
    /// such a round was sent: every member of that quorum withholds its vote for an election
    /// timeout after hearing it (or after restarting).
    fn lease_holds(&self) -> bool {
        if self.config.lease_read_ms == 0
            || self.role != Role::Leader
            || self.lease_void
            || self.transferee.is_some()
            || !self.conf.is_voter(self.id)
        {
            return false;
        }
        let now_ms = self.now_ms;
        // Shifted by one so that "never acknowledged" (0) sorts below every real send time.
        let acked = |node: NodeId| -> u64 {
            if node == self.id {
                now_ms.saturating_add(1)
            } else {
                self.progress
                    .get(&node)
                    .and_then(|pr| pr.lease_acked_ms)
                    .map_or(0, |sent_ms| sent_ms.saturating_add(1))
            }
        };
        let quorum_since = quorum::committed_index(&self.conf, &acked);
        if quorum_since == 0 {
            return false;
        }
        #[cfg(feature = "negative-controls")]
        if self.config.bugs.lease_never_expires {
            return true;
        }
        (quorum_since - 1).saturating_add(self.config.lease_read_ms) > now_ms
    }

    fn release_read(&mut self, context: Bytes, index: Index, requester: NodeId) {
        if requester == self.id {
            self.read_states.push(ReadState { index, context });
        } else {
            // The follower serves the read once it has applied up to `index`, so it needs
            // the entries and the commit index up to it; what was held back goes out first.
            self.send_owed(requester);
            self.send(requester, MessageBody::ReadIndexResponse { context, index });
        }
    }

    // ---- leadership transfer ---------------------------------------------------------------

    pub fn transfer_leader(&mut self, target: NodeId) -> Result<(), Error> {
        if self.role != Role::Leader {
            return Err(Error::NotLeader {
                leader: self.leader,
            });
        }
        if target == self.id {
            self.transferee = None;
            return Ok(());
        }
        if !self.conf.is_voter(target) || !self.progress.contains_key(&target) {
            return Err(Error::InvalidTransferTarget(target));
        }
        if self.transferee == Some(target) {
            return Ok(());
        }
        self.transferee = Some(target);
        self.lease_void = true;
        self.election_elapsed = 0;
        let caught_up = self.progress[&target].match_index == self.log.last_index();
        if caught_up {
            self.send(target, MessageBody::TimeoutNow);
        } else {
            self.send_append(target);
        }
        Ok(())
    }

    // ---- persistence and application feedback ----------------------------------------------

    /// The application made entries up to (`index`, `term`) durable.
    pub fn on_persisted(&mut self, index: Index, term: Term) {
        self.log.stable_to(index, term);
        if self.maybe_commit() {
            self.announce_commit();
        }
    }

    pub fn on_snapshot_installed(&mut self, index: Index) {
        self.log.stable_snapshot_to(index);
        self.log.applied_to(index);
    }

    /// The application applied `entries` (committed, in order). Membership changes among them
    /// take effect here.
    pub fn on_applied(&mut self, entries: &[Entry]) {
        for entry in entries {
            assert_eq!(
                entry.index,
                self.log.applied + 1,
                "entries applied out of order"
            );
            self.log.applied_to(entry.index);
            if entry.kind == EntryKind::ConfChange {
                self.apply_conf_change(entry);
            }
            if self.role == Role::Leader && entry.term == self.term {
                self.uncommitted_bytes =
                    self.uncommitted_bytes.saturating_sub(entry.payload_size());
            }
        }
        self.maybe_auto_leave();
    }
}

/// The configuration after applying `steps` to `conf`, entering joint consensus when the
/// voter set changes.
pub fn apply_steps(conf: &ConfState, steps: &[ConfChangeStep]) -> Result<ConfState, String> {
    if steps.is_empty() {
        return Err("a membership change needs at least one step".into());
    }
    let mut voters = conf.voters.clone();
    let mut learners = conf.learners.clone();
    for step in steps {
        match *step {
            ConfChangeStep::AddVoter(0) | ConfChangeStep::AddLearner(0) => {
                return Err("node id 0 is reserved".into());
            }
            ConfChangeStep::AddVoter(id) => {
                learners.remove(&id);
                voters.insert(id);
            }
            ConfChangeStep::AddLearner(id) => {
                if voters.contains(&id) {
                    return Err(format!(
                        "node {id} is a voter; remove it before adding it as a learner"
                    ));
                }
                learners.insert(id);
            }
            ConfChangeStep::RemoveNode(id) => {
                voters.remove(&id);
                learners.remove(&id);
            }
        }
    }
    if voters.is_empty() {
        return Err("the change would leave no voters".into());
    }
    let voters_outgoing = if voters != conf.voters {
        conf.voters.clone()
    } else {
        BTreeSet::new()
    };
    Ok(ConfState {
        voters,
        learners,
        voters_outgoing,
    })
}
