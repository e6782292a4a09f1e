//! Leases: the replicated table, and the leader-side keeper that decides when they expire.
//!
//! ```text
//!   client keepalive ──► LeaseKeeper::renew (leader only, not in the log)
//!                            │ first keepalive after an anchored deadline, or more than
//!                            │ `lease_checkpoint_interval_ms` after the last "renewed" record:
//!                            └─► propose LeaseCheckpoint{deadline: None}; reply once committed
//!   leader timer ──► LeaseKeeper::expired(now) ──► propose LeaseExpire{ids}
//!   new leader ──► LeaseKeeper::promote(table, now) ──► propose the returned checkpoints
//! ```
//!
//! The replicated table records, for every lease, a bound on the deadline its holder was
//! promised ([`LeaseResume`]): either "renewed at leader time `at`", which means every
//! acknowledged keepalive happened before `at + interval` so the promise ends before
//! `at + interval + TTL`; or an anchored deadline. A new leader resumes each lease at that
//! bound (never sooner than one election timeout from now: a leader change alone never expires a
//! lease) and immediately anchors what it decided. So:
//! - never early: no leader expires a lease before the last acknowledged keepalive + TTL;
//! - never forever: an abandoned lease ends by its last keepalive + TTL + the checkpoint
//!   interval, or one election timeout after the last promotion if that is later, however
//!   often leaders change (etcd issue 9888).
//!
//! The price is at most one (batchable) log entry per lease per checkpoint interval while it is
//! kept alive.

use std::collections::{BTreeMap, BTreeSet};

use bytes::Bytes;
use imbl::OrdMap;
use serde::{Deserialize, Serialize};

use crate::config::{Config, LEASE_TTL_MS_MAX};
use crate::error::{Error, Result};

/// What the log knows about a lease's deadline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LeaseResume {
    /// The holder renewed it; the record was committed at leader time `at_ms`. Keepalives are
    /// acknowledged without a new record only until `at_ms + lease_checkpoint_interval_ms`, so
    /// the holder was promised at most `at_ms + interval + TTL`.
    Renewed {
        /// Leader-clock time of the record.
        at_ms: u64,
    },
    /// It ends at this deadline on the leader clock (the clock that stamps commands), unless
    /// renewed.
    Deadline {
        /// Leader-clock deadline in milliseconds.
        deadline_ms: u64,
    },
}

impl LeaseResume {
    /// The latest deadline any holder of the lease can have been promised.
    pub fn promise_bound_ms(&self, ttl_ms: u64, checkpoint_interval_ms: u64) -> u64 {
        match *self {
            LeaseResume::Renewed { at_ms } => at_ms
                .saturating_add(checkpoint_interval_ms)
                .saturating_add(ttl_ms),
            LeaseResume::Deadline { deadline_ms } => deadline_ms,
        }
    }
}

/// One checkpoint entry of a `LeaseCheckpoint` command.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseCheckpoint {
    /// The lease.
    pub id: i64,
    /// `Some`: the lease ends at this leader-clock deadline. `None`: it was just renewed (the
    /// record takes the command's timestamp).
    pub deadline_ms: Option<u64>,
}

/// A granted lease.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    /// The lease ID (positive).
    pub id: i64,
    /// The granted TTL (after raising it to the minimum).
    pub ttl_ms: u64,
    /// How a new leader resumes it.
    pub resume: LeaseResume,
    /// Keys attached to the lease; revoking it deletes them.
    pub keys: BTreeSet<Bytes>,
    /// Priority-group registrations (group, candidate) held under the lease.
    pub candidates: BTreeSet<(String, String)>,
}

/// The replicated lease table.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LeaseTable {
    leases: OrdMap<i64, Lease>,
    /// Next ID to try for grants that let the state machine choose. Invariant: > 0.
    next_id: i64,
    /// Moves on every grant and removal, so the leader's [`LeaseKeeper::sync`] can tell a
    /// batch that changed which leases exist (rare) from one that only renewed them (every
    /// keepalive's checkpoint) without walking the table. Local bookkeeping, not replicated
    /// state: not in snapshots and not compared.
    #[serde(skip)]
    generation: u64,
}

impl PartialEq for LeaseTable {
    fn eq(&self, other: &Self) -> bool {
        self.leases == other.leases && self.next_id == other.next_id
    }
}

impl Eq for LeaseTable {}

impl Default for LeaseTable {
    fn default() -> Self {
        LeaseTable::new()
    }
}

impl LeaseTable {
    /// An empty table.
    pub fn new() -> Self {
        LeaseTable {
            leases: OrdMap::new(),
            next_id: 1,
            generation: 0,
        }
    }

    /// Grants a lease. `id == 0` lets the table choose one. Returns the ID and the TTL granted.
    pub(crate) fn grant(
        &mut self,
        id: i64,
        ttl_ms: u64,
        now_ms: u64,
        config: &Config,
    ) -> Result<(i64, u64)> {
        if id < 0 {
            return Err(Error::InvalidArgument("lease ID must be positive".into()));
        }
        if ttl_ms > LEASE_TTL_MS_MAX {
            return Err(Error::LeaseTtlTooLarge);
        }
        if self.leases.len() >= config.leases_max {
            return Err(Error::LimitReached {
                what: "leases".into(),
                limit: config.leases_max as u64,
            });
        }
        let id = if id == 0 { self.choose_id() } else { id };
        if self.leases.contains_key(&id) {
            return Err(Error::LeaseExists);
        }
        // As etcd: a TTL below the minimum is raised, not refused.
        let ttl_ms = ttl_ms.max(config.lease_ttl_ms_min());
        let resume = LeaseResume::Deadline {
            deadline_ms: now_ms.saturating_add(ttl_ms),
        };
        let lease = Lease {
            id,
            ttl_ms,
            resume,
            keys: BTreeSet::new(),
            candidates: BTreeSet::new(),
        };
        self.leases.insert(id, lease);
        self.generation = self.generation.wrapping_add(1);
        Ok((id, ttl_ms))
    }

    fn choose_id(&mut self) -> i64 {
        // IDs are never reused while the counter moves on, so a stale key name `<name>/<id hex>`
        // cannot collide with a later lease; client-chosen IDs are skipped.
        loop {
            let candidate = self.next_id;
            self.next_id = if self.next_id == i64::MAX {
                1
            } else {
                self.next_id + 1
            };
            if !self.leases.contains_key(&candidate) {
                return candidate;
            }
        }
    }

    /// The lease, if granted and not yet revoked or expired by command.
    pub fn get(&self, id: i64) -> Option<&Lease> {
        self.leases.get(&id)
    }

    /// Every lease, by ID.
    pub fn iter(&self) -> impl Iterator<Item = &Lease> {
        self.leases.values()
    }

    /// Number of leases.
    pub fn len(&self) -> usize {
        self.leases.len()
    }

    /// True when no lease exists.
    pub fn is_empty(&self) -> bool {
        self.leases.is_empty()
    }

    /// True when the lease exists and `now_ms` is before the latest deadline its holder can
    /// have been promised. A lease past that bound is dead for grants (locks, elections) even
    /// before the leader's expiry command removes it.
    pub fn is_live(&self, id: i64, now_ms: u64, checkpoint_interval_ms: u64) -> bool {
        self.leases.get(&id).is_some_and(|lease| {
            now_ms
                < lease
                    .resume
                    .promise_bound_ms(lease.ttl_ms, checkpoint_interval_ms)
        })
    }

    pub(crate) fn remove(&mut self, id: i64) -> Option<Lease> {
        let removed = self.leases.remove(&id);
        if removed.is_some() {
            self.generation = self.generation.wrapping_add(1);
        }
        removed
    }

    /// Which leases exist changes this (see the field); nothing else does.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    pub(crate) fn checkpoint(&mut self, checkpoint: &LeaseCheckpoint, now_ms: u64) {
        // Unknown IDs are leases revoked since the leader proposed this: nothing to record.
        if let Some(lease) = self.leases.get_mut(&checkpoint.id) {
            lease.resume = match checkpoint.deadline_ms {
                None => LeaseResume::Renewed { at_ms: now_ms },
                Some(deadline_ms) => LeaseResume::Deadline { deadline_ms },
            };
        }
    }

    pub(crate) fn attach_key(&mut self, id: i64, key: &Bytes) {
        if let Some(lease) = self.leases.get_mut(&id)
            && !lease.keys.contains(key)
        {
            // A private copy, so a shared request buffer is not kept alive.
            lease.keys.insert(Bytes::copy_from_slice(key));
        }
    }

    pub(crate) fn detach_key(&mut self, id: i64, key: &[u8]) {
        if let Some(lease) = self.leases.get_mut(&id) {
            lease.keys.remove(key);
        }
    }

    pub(crate) fn attach_candidate(&mut self, id: i64, group: &str, candidate: &str) {
        if let Some(lease) = self.leases.get_mut(&id) {
            lease
                .candidates
                .insert((group.to_owned(), candidate.to_owned()));
        }
    }

    pub(crate) fn detach_candidate(&mut self, id: i64, group: &str, candidate: &str) {
        if let Some(lease) = self.leases.get_mut(&id) {
            lease
                .candidates
                .remove(&(group.to_owned(), candidate.to_owned()));
        }
    }
}

/// What a keepalive yields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Renewal {
    /// The TTL to report to the client.
    pub ttl_ms: u64,
    /// When `Some`, propose this checkpoint and answer the keepalive only after it commits.
    pub checkpoint_before_reply: Option<LeaseCheckpoint>,
    /// Names this renewal among all renewals this keeper accepted: a keepalive stream that
    /// ends without a goodbye may shorten the lease only while its renewal is still the last
    /// one ([`LeaseKeeper::orphan`]).
    pub stamp: u64,
}

/// The leader clock's resolution. A reading of `t` ms means some instant in `[t, t + 1)`, so
/// a keepalive handled at reading `t` is promised TTL from `t + 1`: counting from `t` would let
/// the lease end up to a millisecond before its TTL had run from the moment it was handled.
pub const LEASE_CLOCK_RESOLUTION_MS: u64 = 1;

/// The keeper's deadlines, by lease ID and in time order. A leader asks every tick which
/// deadlines have passed; a walk of every deadline costs in proportion to the leases kept
/// alive, and the time order makes the question a range lookup. Every change goes through
/// here, so the two orders always hold the same pairs.
#[derive(Clone, Debug, Default)]
struct Deadlines {
    by_id: BTreeMap<i64, u64>,
    by_time: BTreeSet<(u64, i64)>,
}

impl Deadlines {
    fn clear(&mut self) {
        self.by_id.clear();
        self.by_time.clear();
    }

    fn len(&self) -> usize {
        self.by_id.len()
    }

    fn get(&self, id: i64) -> Option<u64> {
        self.by_id.get(&id).copied()
    }

    fn set(&mut self, id: i64, deadline_ms: u64) {
        if let Some(old_ms) = self.by_id.insert(id, deadline_ms) {
            self.by_time.remove(&(old_ms, id));
        }
        self.by_time.insert((deadline_ms, id));
    }

    /// The deadline of `id`, set to `deadline_ms()` first if it has none.
    fn get_or_set(&mut self, id: i64, deadline_ms: impl FnOnce() -> u64) -> u64 {
        match self.get(id) {
            Some(kept_ms) => kept_ms,
            None => {
                let deadline_ms = deadline_ms();
                self.set(id, deadline_ms);
                deadline_ms
            }
        }
    }

    fn retain(&mut self, mut keep: impl FnMut(i64) -> bool) {
        let Deadlines { by_id, by_time } = self;
        by_id.retain(|&id, &mut deadline_ms| {
            let kept = keep(id);
            if !kept {
                by_time.remove(&(deadline_ms, id));
            }
            kept
        });
    }

    /// Up to `max_count` leases whose deadline is at or before `now_ms`, the earliest
    /// deadlines first, returned in ID order.
    fn passed(&self, now_ms: u64, max_count: usize) -> Vec<i64> {
        let mut ids: Vec<i64> = self
            .by_time
            .range(..=(now_ms, i64::MAX))
            .map(|&(_, id)| id)
            .take(max_count)
            .collect();
        ids.sort_unstable();
        ids
    }

    fn earliest_ms(&self) -> Option<u64> {
        self.by_time.first().map(|&(deadline_ms, _)| deadline_ms)
    }
}

/// Leader-side lease deadlines. Pure: the server feeds it the leader clock and proposes what it
/// returns. Only the Raft leader keeps one; followers drop theirs ([`LeaseKeeper::demote`]).
#[derive(Clone, Debug, Default)]
pub struct LeaseKeeper {
    election_timeout_ms: u64,
    checkpoint_interval_ms: u64,
    /// Lease ID -> leader-clock deadline.
    deadlines: Deadlines,
    /// Lease ID -> the deadline it resumed at on promotion: what a deposed leader may still
    /// have promised its holder, so a keepalive here never moves the deadline below it.
    floors: BTreeMap<i64, u64>,
    /// Leader time of the last [`LeaseKeeper::promote`]. A "renewed" record older than it
    /// does not cover a keepalive: the promotion's own checkpoint (a deadline) replaces it.
    promoted_at_ms: u64,
    /// Lease ID -> (stamp, leader time) of the last renewal this keeper accepted.
    last_renewals: BTreeMap<i64, (u64, u64)>,
    /// The last stamp handed out; never reset, so a stamp from an earlier leadership of this
    /// keeper can never match a later renewal.
    renewal_stamp: u64,
    /// The table's [`LeaseTable::generation`] at the last full walk, while leading.
    synced_generation: Option<u64>,
}

impl LeaseKeeper {
    /// A keeper for the given configuration, holding no leases.
    pub fn new(config: &Config) -> Self {
        LeaseKeeper {
            election_timeout_ms: config.election_timeout_ms,
            checkpoint_interval_ms: config.lease_checkpoint_interval_ms,
            deadlines: Deadlines::default(),
            floors: BTreeMap::new(),
            promoted_at_ms: 0,
            last_renewals: BTreeMap::new(),
            renewal_stamp: 0,
            synced_generation: None,
        }
    }

    /// Call when this node becomes Raft leader, before serving keepalives. Resumes every lease
    /// at the latest deadline its holder can have been promised (but no later than a TTL plus
    /// one checkpoint interval from now, which bounds what a leader clock running ahead can
    /// leave) with at least one election timeout of grace, and returns checkpoints to propose
    /// at once so that the next leader resumes from these deadlines.
    ///
    /// The cap may not be a bare TTL: a deposed leader that has not noticed yet answers
    /// keepalives without a checkpoint for one interval after the last "renewed" record, and
    /// each promises a full TTL from its own time, which can be later than this promotion
    /// (the simulator's lease checker caught leases ending up to 150 ms early that way).
    pub fn promote(&mut self, table: &LeaseTable, now_ms: u64) -> Vec<LeaseCheckpoint> {
        self.deadlines.clear();
        self.floors.clear();
        self.last_renewals.clear();
        self.synced_generation = Some(table.generation());
        self.promoted_at_ms = now_ms;
        let grace_until_ms = now_ms.saturating_add(self.election_timeout_ms);
        let mut checkpoints = Vec::with_capacity(table.len());
        for lease in table.iter() {
            let bound_ms = lease
                .resume
                .promise_bound_ms(lease.ttl_ms, self.checkpoint_interval_ms);
            let cap_ms = now_ms
                .saturating_add(LEASE_CLOCK_RESOLUTION_MS)
                .saturating_add(lease.ttl_ms)
                .saturating_add(self.checkpoint_interval_ms);
            let deadline_ms = bound_ms.min(cap_ms).max(grace_until_ms);
            self.deadlines.set(lease.id, deadline_ms);
            self.floors.insert(lease.id, deadline_ms);
            checkpoints.push(LeaseCheckpoint {
                id: lease.id,
                deadline_ms: Some(deadline_ms),
            });
        }
        checkpoints
    }

    /// Call when this node stops being leader.
    pub fn demote(&mut self) {
        self.deadlines.clear();
        self.floors.clear();
        self.last_renewals.clear();
        self.synced_generation = None;
    }

    /// Call after applying committed commands: adopts newly granted leases at their recorded
    /// bound and forgets revoked ones. Answers whether it had to walk the table: batches that
    /// granted or removed no lease (most of them, keepalive checkpoints) leave it alone, which
    /// keeps a leader with 10,000 sessions from walking them all after every batch. The key
    /// count is compared too, so a table replaced under the keeper (its generation starts
    /// again from 0) is walked even if the counters happen to agree.
    pub fn sync(&mut self, table: &LeaseTable) -> bool {
        if self.synced_generation == Some(table.generation()) && self.deadlines.len() == table.len()
        {
            return false;
        }
        self.synced_generation = Some(table.generation());
        self.deadlines.retain(|id| table.get(id).is_some());
        self.floors.retain(|id, _| table.get(*id).is_some());
        self.last_renewals.retain(|id, _| table.get(*id).is_some());
        for lease in table.iter() {
            let bound_ms = lease
                .resume
                .promise_bound_ms(lease.ttl_ms, self.checkpoint_interval_ms);
            self.deadlines.get_or_set(lease.id, || bound_ms);
        }
        true
    }

    /// A keepalive at `now_ms`. Fails for leases that do not exist or are already past their
    /// deadline (their expiry is on its way; renewing would resurrect them).
    pub fn renew(&mut self, table: &LeaseTable, id: i64, now_ms: u64) -> Result<Renewal> {
        let lease = table.get(id).ok_or(Error::LeaseNotFound)?;
        let interval_ms = self.checkpoint_interval_ms;
        let deadline_ms = self.deadlines.get_or_set(id, || {
            lease.resume.promise_bound_ms(lease.ttl_ms, interval_ms)
        });
        if deadline_ms <= now_ms {
            return Err(Error::LeaseNotFound);
        }
        // Never below what this leader resumed the lease at: a deposed leader may have
        // promised the holder that much (the simulator caught a keepalive on the new leader
        // shortening a promise the old one had made moments before).
        let floor_ms = self.floors.get(&id).copied().unwrap_or(0);
        let renewed_ms = now_ms
            .saturating_add(LEASE_CLOCK_RESOLUTION_MS)
            .saturating_add(lease.ttl_ms)
            .max(floor_ms);
        self.deadlines.set(id, renewed_ms);
        // Without a fresh enough "renewed" record, a later leader could resume the lease at a
        // deadline earlier than the one just promised. A record from before this leader's
        // promotion does not count: the promotion's deadline checkpoint overwrites it, and a
        // next leader would resume from that deadline (the simulator's lease checker found
        // a keepalive answered in that window and expired early).
        let recorded = match lease.resume {
            LeaseResume::Renewed { at_ms } => {
                at_ms >= self.promoted_at_ms && now_ms < at_ms.saturating_add(interval_ms)
            }
            LeaseResume::Deadline { .. } => false,
        };
        let checkpoint_before_reply = (!recorded).then_some(LeaseCheckpoint {
            id,
            deadline_ms: None,
        });
        self.renewal_stamp += 1;
        self.last_renewals.insert(id, (self.renewal_stamp, now_ms));
        Ok(Renewal {
            ttl_ms: lease.ttl_ms,
            checkpoint_before_reply,
            stamp: self.renewal_stamp,
        })
    }

    /// The keepalive stream that made renewal `stamp` of lease `id` ended without a goodbye
    /// (its client's connection was closed under it). If no keepalive came since, the lease
    /// ends `grace_ms` from `now_ms` unless renewed; returns the checkpoint to propose so a
    /// later leader resumes it at that deadline too. `None`: another renewal came since (the
    /// client went on through another stream), the lease is gone, or it ends sooner anyway.
    pub fn orphan(
        &mut self,
        id: i64,
        stamp: u64,
        now_ms: u64,
        grace_ms: u64,
    ) -> Option<LeaseCheckpoint> {
        if self.last_renewals.get(&id).map(|(last, _)| *last) != Some(stamp) {
            return None;
        }
        let deadline_ms = self.deadlines.get(id)?;
        let shortened_ms = now_ms.saturating_add(grace_ms);
        if deadline_ms <= shortened_ms {
            return None;
        }
        self.deadlines.set(id, shortened_ms);
        // The floor kept a deposed leader's promise; the holder that had it is gone.
        self.floors.remove(&id);
        Some(LeaseCheckpoint {
            id,
            deadline_ms: Some(shortened_ms),
        })
    }

    /// How long ago (leader clock) this keeper last renewed lease `id`; `None` when it has
    /// not since it became leader.
    pub fn last_renewal_age_ms(&self, id: i64, now_ms: u64) -> Option<u64> {
        self.last_renewals
            .get(&id)
            .map(|(_, at_ms)| now_ms.saturating_sub(*at_ms))
    }

    /// Leases whose deadline has passed, in ID order; propose `LeaseExpire` with them. At
    /// most `max_count` (those past their deadline longest), to bound one command.
    pub fn expired(&self, now_ms: u64, max_count: usize) -> Vec<i64> {
        self.deadlines.passed(now_ms, max_count)
    }

    /// Remaining time to live on this leader, for `LeaseTimeToLive`.
    pub fn remaining_ms(&self, id: i64, now_ms: u64) -> Option<u64> {
        self.deadlines
            .get(id)
            .map(|deadline_ms| deadline_ms.saturating_sub(now_ms))
    }

    /// The earliest deadline kept, for the leader's timer.
    pub fn next_deadline_ms(&self) -> Option<u64> {
        self.deadlines.earliest_ms()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum DeadlineStep {
        Set(i64, u64),
        GetOrSet(i64, u64),
        /// Keeps the IDs whose bit is set.
        Retain(u32),
        Clear,
    }

    fn deadline_step() -> impl Strategy<Value = DeadlineStep> {
        prop_oneof![
            8 => (0i64..24, 0u64..60).prop_map(|(id, ms)| DeadlineStep::Set(id, ms)),
            3 => (0i64..24, 0u64..60).prop_map(|(id, ms)| DeadlineStep::GetOrSet(id, ms)),
            1 => any::<u32>().prop_map(DeadlineStep::Retain),
            1 => Just(DeadlineStep::Clear),
        ]
    }

    proptest! {
        /// The time order answers as a walk of every deadline would: after any sequence of
        /// changes, the leases past their deadline at any time, the earliest deadline, and
        /// (when fewer may be taken) those past their deadline longest.
        #[test]
        fn the_deadline_index_answers_as_a_walk_of_every_deadline(
            steps in proptest::collection::vec(deadline_step(), 0..200),
        ) {
            let mut deadlines = Deadlines::default();
            let mut model: BTreeMap<i64, u64> = BTreeMap::new();
            for step in steps {
                match step {
                    DeadlineStep::Set(id, ms) => {
                        deadlines.set(id, ms);
                        model.insert(id, ms);
                    }
                    DeadlineStep::GetOrSet(id, ms) => {
                        let kept = deadlines.get_or_set(id, || ms);
                        prop_assert_eq!(kept, *model.entry(id).or_insert(ms));
                    }
                    DeadlineStep::Retain(mask) => {
                        deadlines.retain(|id| mask & (1 << id) != 0);
                        model.retain(|id, _| mask & (1 << id) != 0);
                    }
                    DeadlineStep::Clear => {
                        deadlines.clear();
                        model.clear();
                    }
                }
                prop_assert_eq!(deadlines.len(), model.len());
                prop_assert_eq!(deadlines.earliest_ms(), model.values().min().copied());
                for now_ms in [0, 10, 30, 59, 60] {
                    let walked: Vec<i64> = model
                        .iter()
                        .filter(|&(_, &ms)| ms <= now_ms)
                        .map(|(&id, _)| id)
                        .collect();
                    prop_assert_eq!(&deadlines.passed(now_ms, usize::MAX), &walked);
                    let few = deadlines.passed(now_ms, 3);
                    prop_assert_eq!(few.len(), walked.len().min(3));
                    prop_assert!(few.windows(2).all(|pair| pair[0] < pair[1]));
                    let latest_taken = few.iter().map(|id| model[id]).max();
                    for id in walked.iter().filter(|id| !few.contains(id)) {
                        prop_assert!(latest_taken.is_some_and(|ms| ms <= model[id]));
                    }
                }
            }
        }
    }

    fn config() -> Config {
        Config {
            election_timeout_ms: 1000,
            lease_checkpoint_interval_ms: 10_000,
            ..Config::default()
        }
    }

    /// Snapshot images written before the table became a persistent map must still load, and
    /// images must not change: it encodes exactly as the `BTreeMap` it replaced.
    #[test]
    fn the_lease_map_encodes_exactly_as_a_btreemap() {
        let mut table = LeaseTable::new();
        for _ in 0..300 {
            let (id, _) = table.grant(0, 5000, 0, &config()).expect("grant");
            table.leases.get_mut(&id).expect("granted").keys =
                [Bytes::from(format!("key/{id}"))].into();
        }
        let as_btree: BTreeMap<i64, Lease> = table
            .leases
            .iter()
            .map(|(id, lease)| (*id, lease.clone()))
            .collect();
        let bytes = postcard::to_allocvec(&as_btree).expect("in memory");
        assert_eq!(
            postcard::to_allocvec(&table.leases).expect("in memory"),
            bytes
        );
        let decoded: OrdMap<i64, Lease> = postcard::from_bytes(&bytes).expect("decodes");
        assert_eq!(decoded, table.leases);
    }

    #[test]
    fn grant_raises_short_ttls_and_refuses_duplicates() {
        let mut table = LeaseTable::new();
        assert_eq!(table.grant(0, 10, 0, &config()), Ok((1, 1500)));
        assert_eq!(table.grant(1, 5000, 0, &config()), Err(Error::LeaseExists));
        assert_eq!(table.grant(2, 5000, 0, &config()), Ok((2, 5000)));
        assert_eq!(table.grant(0, 5000, 0, &config()), Ok((3, 5000)));
        assert_eq!(
            table.grant(0, LEASE_TTL_MS_MAX + 1, 0, &config()),
            Err(Error::LeaseTtlTooLarge)
        );
    }

    #[test]
    fn an_orphaned_stream_shortens_only_its_own_last_renewal() {
        let mut table = LeaseTable::new();
        let (id, _) = table.grant(0, 10_000, 0, &config()).expect("grant");
        let mut keeper = LeaseKeeper::new(&config());
        keeper.promote(&table, 0);
        let first = keeper.renew(&table, id, 100).expect("renew").stamp;
        let second = keeper.renew(&table, id, 200).expect("renew").stamp;
        assert_ne!(first, second);
        // The client went on through another stream: the first stream's end changes nothing.
        assert_eq!(keeper.orphan(id, first, 300, 500), None);
        assert_eq!(keeper.remaining_ms(id, 300), Some(9_901));
        assert_eq!(keeper.last_renewal_age_ms(id, 300), Some(100));
        // The stream of the last renewal ended: the lease ends 500 ms later, recorded.
        assert_eq!(
            keeper.orphan(id, second, 300, 500),
            Some(LeaseCheckpoint {
                id,
                deadline_ms: Some(800)
            })
        );
        assert_eq!(keeper.expired(799, 10), Vec::<i64>::new());
        assert_eq!(keeper.expired(800, 10), vec![id]);
        // A keepalive within the grace restores the full TTL.
        let third = keeper
            .renew(&table, id, 700)
            .expect("renew within the grace");
        assert!(third.checkpoint_before_reply.is_some());
        assert_eq!(keeper.remaining_ms(id, 700), Some(10_001));
        // A stamp from before a change of leadership never matches.
        keeper.demote();
        keeper.promote(&table, 1000);
        assert_eq!(keeper.orphan(id, third.stamp, 1000, 500), None);
    }

    #[test]
    fn new_leader_gives_grace_and_anchors_what_it_decided() {
        let mut table = LeaseTable::new();
        let (id, _) = table.grant(0, 3000, 0, &config()).expect("grant");
        let mut keeper = LeaseKeeper::new(&config());
        // Deadline recorded at 3000. A leader promoted at 2900 keeps it to 3900 (grace).
        let checkpoints = keeper.promote(&table, 2900);
        assert_eq!(
            checkpoints,
            vec![LeaseCheckpoint {
                id,
                deadline_ms: Some(3900)
            }]
        );
        for checkpoint in &checkpoints {
            table.checkpoint(checkpoint, 2900);
        }
        // Churn: the next leader, promoted later, resumes from the anchored deadline plus grace.
        let mut next = LeaseKeeper::new(&config());
        next.promote(&table, 3500);
        assert_eq!(next.remaining_ms(id, 3500), Some(1000));
        assert_eq!(next.expired(4499, 10), Vec::<i64>::new());
        assert_eq!(next.expired(4500, 10), vec![id]);
    }

    #[test]
    fn a_new_leader_records_its_first_renewal_even_inside_the_interval() {
        let mut table = LeaseTable::new();
        let (id, _) = table.grant(0, 3000, 0, &config()).expect("grant");
        let renewed = LeaseCheckpoint {
            id,
            deadline_ms: None,
        };
        table.checkpoint(&renewed, 1000);
        // A new leader promoted inside the interval of that record: its promotion checkpoint
        // (a deadline) will replace the record, so a keepalive must record itself again, or a
        // next leader resumes the lease before the TTL this keepalive promises.
        let mut keeper = LeaseKeeper::new(&config());
        keeper.promote(&table, 1500);
        let renewal = keeper.renew(&table, id, 1600).expect("renew");
        assert_eq!(renewal.checkpoint_before_reply, Some(renewed));
    }

    #[test]
    fn a_keepalive_on_a_new_leader_keeps_what_the_old_one_may_have_promised() {
        let mut table = LeaseTable::new();
        let (id, _) = table.grant(0, 3000, 0, &config()).expect("grant");
        table.checkpoint(
            &LeaseCheckpoint {
                id,
                deadline_ms: None,
            },
            1000,
        );
        // The old leader may answer keepalives without a record until 11 000, each promising
        // a TTL: up to 14 000. A keepalive on the new leader at 2000 keeps that.
        let mut keeper = LeaseKeeper::new(&config());
        keeper.promote(&table, 1500);
        keeper.renew(&table, id, 2000).expect("renew");
        assert_eq!(keeper.expired(13_999, 10), Vec::<i64>::new());
        assert_eq!(keeper.expired(14_000, 10), vec![id]);
    }

    #[test]
    fn sync_walks_the_table_only_when_leases_came_or_went() {
        let mut table = LeaseTable::new();
        let mut keeper = LeaseKeeper::new(&config());
        keeper.promote(&table, 0);
        let (first, _) = table.grant(0, 3000, 0, &config()).expect("grant");
        let (second, _) = table.grant(0, 3000, 0, &config()).expect("grant");
        assert!(keeper.sync(&table), "two grants must be adopted");
        assert_eq!(keeper.expired(3000, 10), vec![first, second]);
        // Renewal records change no membership: nothing to walk, nothing lost.
        for at_ms in [100, 200] {
            table.checkpoint(
                &LeaseCheckpoint {
                    id: first,
                    deadline_ms: None,
                },
                at_ms,
            );
            assert!(!keeper.sync(&table));
        }
        assert_eq!(keeper.remaining_ms(second, 0), Some(3000));
        // A removal and a grant in one batch keep the count but move the generation.
        table.remove(first).expect("present");
        let (third, _) = table.grant(0, 3000, 0, &config()).expect("grant");
        assert!(keeper.sync(&table));
        assert_eq!(keeper.remaining_ms(first, 0), None);
        assert_eq!(keeper.expired(3000, 10), vec![second, third]);
        assert!(!keeper.sync(&table));
        // A table restored from a snapshot starts its generation again from 0 (it is not
        // replicated) but still compares equal; with a lease more than the keeper knows, it
        // is walked although its generation could match an old one.
        let bytes = postcard::to_allocvec(&table).expect("encode");
        let mut restored: LeaseTable = postcard::from_bytes(&bytes).expect("decode");
        assert_eq!(restored, table);
        assert_eq!(restored.generation(), 0);
        let (fourth, _) = restored.grant(0, 3000, 0, &config()).expect("grant");
        assert!(keeper.sync(&restored));
        assert_eq!(keeper.expired(3000, 10), vec![second, third, fourth]);
    }

    #[test]
    fn renewals_record_themselves_once_per_interval() {
        let mut table = LeaseTable::new();
        let (id, _) = table.grant(0, 3000, 0, &config()).expect("grant");
        let mut keeper = LeaseKeeper::new(&config());
        keeper.sync(&table);
        let renewal = keeper.renew(&table, id, 1000).expect("renew");
        assert_eq!(
            renewal.checkpoint_before_reply,
            Some(LeaseCheckpoint {
                id,
                deadline_ms: None
            })
        );
        table.checkpoint(
            &LeaseCheckpoint {
                id,
                deadline_ms: None,
            },
            1000,
        );
        let renewal = keeper.renew(&table, id, 2000).expect("renew");
        assert_eq!(renewal.checkpoint_before_reply, None);
        // TTL from the end of the millisecond read (LEASE_CLOCK_RESOLUTION_MS).
        assert_eq!(keeper.remaining_ms(id, 2000), Some(3001));
        for now_ms in [4500, 7000, 9500] {
            let renewal = keeper.renew(&table, id, now_ms).expect("renew");
            assert_eq!(renewal.checkpoint_before_reply, None);
        }
        // The interval (10 s here) has passed since the record: record again.
        let renewal = keeper.renew(&table, id, 11_000).expect("renew");
        assert!(renewal.checkpoint_before_reply.is_some());
        // Past the deadline a keepalive cannot resurrect the lease.
        assert_eq!(keeper.renew(&table, id, 20_000), Err(Error::LeaseNotFound));
        // A new leader resumes a renewed lease at the bound a deposed leader may have
        // promised (record 1000 + interval 10 000 + TTL 3000), not a bare TTL from now: a
        // keepalive the old leader answered at 10 999 promised 14 000 (to the end of its ms).
        let mut next = LeaseKeeper::new(&config());
        next.promote(&table, 5000);
        assert_eq!(next.remaining_ms(id, 5000), Some(9000));
        // The bound is capped at a TTL and an interval from now (a clock that ran ahead).
        let mut next = LeaseKeeper::new(&config());
        next.promote(&table, 0);
        assert_eq!(next.remaining_ms(id, 0), Some(13_001));
    }

    /// Two leader changes in quick succession, with a keepalive answered by the middle leader
    /// before its anchor was applied: the third leader must not end the lease before the
    /// promise the middle one made (it did, by 100 ms, when a record from the first leader
    /// still counted as fresh).
    #[test]
    fn a_keepalive_before_the_new_leaders_anchor_applies_is_recorded() {
        let config = Config {
            election_timeout_ms: 150,
            lease_checkpoint_interval_ms: 500,
            ..Config::default()
        };
        let ttl_ms = 3000;
        let mut table = LeaseTable::new();
        let (id, _) = table.grant(0, ttl_ms, 0, &config).expect("grant");
        // Leader 1 renews at 0 and records it.
        let mut first = LeaseKeeper::new(&config);
        first.sync(&table);
        let renewal = first.renew(&table, id, 0).expect("renew");
        if let Some(checkpoint) = renewal.checkpoint_before_reply {
            table.checkpoint(&checkpoint, 0);
        }
        // Leader 2 is promoted at 200 and proposes its anchor; a keepalive at 300 is answered
        // before the anchor is applied, promising 300 + TTL.
        let mut second = LeaseKeeper::new(&config);
        let anchor = second.promote(&table, 200);
        let renewal = second.renew(&table, id, 300).expect("renew");
        let promised_ms = 300 + LEASE_CLOCK_RESOLUTION_MS + ttl_ms;
        let remaining_ms = second.remaining_ms(id, 300).expect("kept");
        assert!(remaining_ms >= promised_ms - 300, "{remaining_ms}");
        // In log order: the anchor (proposed first), then the renewal's record, if any (the
        // reply waits for it).
        for checkpoint in &anchor {
            table.checkpoint(checkpoint, 200);
        }
        if let Some(checkpoint) = renewal.checkpoint_before_reply {
            table.checkpoint(&checkpoint, 300);
        }
        // Leader 2 dies; leader 3 is promoted at 500.
        let mut third = LeaseKeeper::new(&config);
        third.promote(&table, 500);
        assert_eq!(
            third.expired(promised_ms - 1, 10),
            Vec::<i64>::new(),
            "expired before the promise of {promised_ms} ms"
        );
        assert!(third.remaining_ms(id, 500).expect("kept") >= promised_ms - 500);
    }

    /// A keepalive handled at clock reading 1000 may have been handled at 1000.9 ms: the
    /// lease lives until 4000.9 at least, so the leader may not end it at reading 4000 (which
    /// can be 4000.0). It did when the TTL counted from the reading.
    #[test]
    fn the_ttl_counts_from_the_end_of_the_millisecond_read() {
        let mut table = LeaseTable::new();
        let (id, _) = table.grant(0, 3000, 0, &config()).expect("grant");
        let mut keeper = LeaseKeeper::new(&config());
        keeper.sync(&table);
        let renewal = keeper.renew(&table, id, 1000).expect("renew");
        if let Some(checkpoint) = renewal.checkpoint_before_reply {
            table.checkpoint(&checkpoint, 1000);
        }
        assert_eq!(keeper.expired(4000, 10), Vec::<i64>::new());
        assert_eq!(keeper.expired(4001, 10), vec![id]);
        // A new leader's cap counts the same way.
        let mut next = LeaseKeeper::new(&config());
        next.promote(&table, 1000);
        assert_eq!(next.expired(4000, 10), Vec::<i64>::new());
    }

    #[test]
    fn leases_past_their_promise_bound_are_dead_for_grants() {
        let mut table = LeaseTable::new();
        let (id, _) = table.grant(0, 3000, 100, &config()).expect("grant");
        assert!(table.is_live(id, 3099, 10_000));
        assert!(!table.is_live(id, 3100, 10_000));
        table.checkpoint(
            &LeaseCheckpoint {
                id,
                deadline_ms: None,
            },
            5000,
        );
        assert!(table.is_live(id, 17_999, 10_000));
        assert!(!table.is_live(id, 18_000, 10_000));
        assert!(!table.is_live(id + 1, 0, 10_000));
    }
}
