//! The coordination machine's duties beside the core, with no I/O: the leader's lease duty
//! (deadlines, keepalives, expiry and checkpoint proposals), the timer duty (a `Tick` at the
//! machine's `next_timer_ms`, so handoff timeouts, settle windows and age retention happen)
//! and the applied events for watchers. The server's driver and the simulator both run it; the
//! times come from the core's clock ([`NodeCore::now_ms`]).

use conclave_raft::Role;
use conclave_state::{
    ApplyOutput, Event, GroupTimerMemo, LeaseCheckpoint, LeaseKeeper, Request, StateMachine,
};

use super::core::{Duties, NodeCore, NodeStore, Token};
use crate::error::Error;

/// Leases one `LeaseExpire` command revokes at most, so one entry stays small.
const LEASE_EXPIRE_BATCH_MAX: usize = 1000;
/// Checkpoints one `LeaseCheckpoint` command carries at most (a new leader anchors every lease).
const LEASE_CHECKPOINT_BATCH_MAX: usize = 1000;
/// An expiry proposal not applied within this long (lost to a leader change) is made again.
const LEASE_EXPIRE_RETRY_MS: u64 = 1000;
/// A timer `Tick` not applied within this long (lost to a leader change) is proposed again.
pub const TIMER_TICK_RETRY_MS: u64 = 1000;
/// How long a lease outlives a keepalive stream that ended without a goodbye (the kernel
/// closed a dead client's connection): time for a client that is alive to reconnect, through
/// any member, and renew. A client cut off by a partition closes nothing, so its lease keeps
/// the full TTL.
pub const LEASE_ORPHAN_GRACE_MS: u64 = 500;

/// A client request for the coordination machine, with the client's exactly-once session
/// position when it has one. The leader stamps its clock on it when it proposes.
#[derive(Debug, Clone)]
pub struct Proposal {
    pub request: Request,
    pub session: Option<conclave_state::SessionSeq>,
}

/// Where this node stands with the leases (only a leader keeps their deadlines).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LeaseRole {
    Follower,
    /// Leader, waiting to apply every entry up to `index` (its own term's first entry) so that
    /// it resumes the leases from the newest records earlier leaders left.
    Promoting {
        index: u64,
    },
    Leading,
}

/// A keepalive the leader accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Renewal {
    /// The lease's granted TTL, for the answer.
    pub ttl_ms: u64,
    /// When set, answer the client only once this proposal (a checkpoint) is settled:
    /// otherwise a later leader could resume the lease at an earlier deadline than promised.
    pub checkpoint: Option<Token>,
    /// Names this renewal for [`LeaderDuties::lease_orphan`].
    pub stamp: u64,
}

/// The coordination machine's duties; see the module documentation.
pub struct LeaderDuties {
    keeper: LeaseKeeper,
    role: LeaseRole,
    /// Applied index the keeper last adopted grants and revocations at.
    synced_index: u64,
    /// The last expiry proposal (index, leader time), until applied or given up on.
    expire_pending: Option<(u64, u64)>,
    /// The last timer `Tick` proposal (index, leader time), until applied or given up on.
    tick_pending: Option<(u64, u64)>,
    /// The leader time of the last `Tick` known applied: a timer at or before it that is still
    /// pending waits for the machine to move it, rather than drawing one `Tick` per turn.
    tick_fired_ms: Option<u64>,
    /// The earliest election-group timer, walked for again only when the groups changed.
    group_timers: GroupTimerMemo,
    /// Events of the batch being applied, taken by the shell after it.
    batch_events: Vec<Event>,
    /// The revision after the last command of the batch being applied.
    batch_revision: i64,
    /// Negative control: never propose the timer `Tick`.
    #[cfg(feature = "negative-controls")]
    pub skip_tick: bool,
}

impl LeaderDuties {
    pub fn new(config: &conclave_state::Config) -> Self {
        LeaderDuties {
            keeper: LeaseKeeper::new(config),
            role: LeaseRole::Follower,
            synced_index: 0,
            expire_pending: None,
            tick_pending: None,
            tick_fired_ms: None,
            group_timers: GroupTimerMemo::default(),
            batch_events: Vec::new(),
            batch_revision: 0,
            #[cfg(feature = "negative-controls")]
            skip_tick: false,
        }
    }

    /// The events of the last applied batch and the revision after it, if it had any.
    pub fn take_events(&mut self) -> Option<(i64, Vec<Event>)> {
        if self.batch_events.is_empty() {
            return None;
        }
        Some((self.batch_revision, std::mem::take(&mut self.batch_events)))
    }

    /// Why this node cannot serve lease deadlines now, if it cannot.
    fn lease_unavailable<S: NodeStore>(&self, core: &NodeCore<StateMachine, S>) -> Option<Error> {
        if core.role() != Role::Leader {
            return Some(Error::NotLeader {
                leader: core.leader(),
            });
        }
        // A fresh leader first resumes the leases (moments after its election); callers retry.
        (self.role != LeaseRole::Leading).then_some(Error::LeaderChanged)
    }

    /// A keepalive on the leader: `None` when the lease does not exist (or is past its
    /// deadline).
    pub fn lease_renew<S: NodeStore>(
        &mut self,
        core: &mut NodeCore<StateMachine, S>,
        id: i64,
    ) -> Result<Option<Renewal>, Error> {
        if let Some(error) = self.lease_unavailable(core) {
            return Err(error);
        }
        let now = core.now_ms();
        let renewal = self.keeper.renew(core.machine().leases(), id, now);
        // The keeper refuses only leases that are gone or past their deadline.
        let Ok(renewal) = renewal else {
            return Ok(None);
        };
        let checkpoint = match renewal.checkpoint_before_reply {
            Some(checkpoint) => Some(core.propose(Proposal {
                request: Request::LeaseCheckpoint {
                    checkpoints: vec![checkpoint],
                },
                session: None,
            })?),
            None => None,
        };
        Ok(Some(Renewal {
            ttl_ms: renewal.ttl_ms,
            checkpoint,
            stamp: renewal.stamp,
        }))
    }

    /// The keepalive stream that made renewal `stamp` of lease `id` ended without a goodbye:
    /// unless a keepalive came since, the lease ends [`LEASE_ORPHAN_GRACE_MS`] from now, and
    /// a checkpoint carries that deadline through the log. Answers whether it was shortened.
    /// Off the leader nothing happens: the TTL then runs as usual.
    pub fn lease_orphan<S: NodeStore>(
        &mut self,
        core: &mut NodeCore<StateMachine, S>,
        id: i64,
        stamp: u64,
    ) -> bool {
        if self.lease_unavailable(core).is_some() {
            return false;
        }
        let now = core.now_ms();
        let Some(checkpoint) = self.keeper.orphan(id, stamp, now, LEASE_ORPHAN_GRACE_MS) else {
            return false;
        };
        tracing::info!(
            lease = id,
            grace_ms = LEASE_ORPHAN_GRACE_MS,
            "keepalive stream ended without a goodbye; lease shortened"
        );
        Self::propose_duty(
            core,
            Request::LeaseCheckpoint {
                checkpoints: vec![checkpoint],
            },
        );
        true
    }

    /// How long ago this leader last renewed each lease (`None`: not since it leads).
    pub fn lease_renewal_ages_ms<S: NodeStore>(
        &self,
        core: &NodeCore<StateMachine, S>,
        ids: &[i64],
    ) -> Result<Vec<Option<u64>>, Error> {
        if let Some(error) = self.lease_unavailable(core) {
            return Err(error);
        }
        let now = core.now_ms();
        Ok(ids
            .iter()
            .map(|id| self.keeper.last_renewal_age_ms(*id, now))
            .collect())
    }

    /// The leader's remaining time to live of a lease; `None` when it does not exist.
    pub fn lease_remaining_ms<S: NodeStore>(
        &mut self,
        core: &NodeCore<StateMachine, S>,
        id: i64,
    ) -> Result<Option<u64>, Error> {
        if let Some(error) = self.lease_unavailable(core) {
            return Err(error);
        }
        let now = core.now_ms();
        let state = core.machine();
        let Some(lease) = state.lease(id) else {
            return Ok(None);
        };
        // A lease granted in this very turn is not synced into the keeper yet: its recorded
        // bound is where the keeper will put it.
        let interval_ms = state.config().lease_checkpoint_interval_ms;
        let remaining = self.keeper.remaining_ms(id, now).unwrap_or_else(|| {
            lease
                .resume
                .promise_bound_ms(lease.ttl_ms, interval_ms)
                .saturating_sub(now)
        });
        Ok(Some(remaining))
    }

    /// The leader's lease duty, once per turn: follow leadership changes (promote once the
    /// new term's first entry is applied, demote on losing it), adopt applied grants and
    /// revocations, and on ticks propose the expiry of leases past their deadline.
    fn drive_leases<S: NodeStore>(&mut self, core: &mut NodeCore<StateMachine, S>, ticked: bool) {
        let applied = core.applied_index();
        if core.role() != Role::Leader {
            if self.role != LeaseRole::Follower {
                self.keeper.demote();
                self.role = LeaseRole::Follower;
                self.expire_pending = None;
                self.tick_pending = None;
                self.tick_fired_ms = None;
                // Lets go of the groups it last saw; a follower does not ask.
                self.group_timers = GroupTimerMemo::default();
            }
            return;
        }
        match self.role {
            LeaseRole::Follower => {
                // The no-op of this term is at or below the last index now.
                self.role = LeaseRole::Promoting {
                    index: core.last_index(),
                };
                return;
            }
            LeaseRole::Promoting { index } if applied < index => return,
            LeaseRole::Promoting { .. } => {
                let checkpoints: Vec<LeaseCheckpoint> =
                    self.keeper.promote(core.machine().leases(), core.now_ms());
                self.role = LeaseRole::Leading;
                self.synced_index = applied;
                // Anchor what this leader decided, so the next one resumes from it rather than
                // granting another full grace (etcd issue 9888).
                for batch in checkpoints.chunks(LEASE_CHECKPOINT_BATCH_MAX) {
                    Self::propose_duty(
                        core,
                        Request::LeaseCheckpoint {
                            checkpoints: batch.to_vec(),
                        },
                    );
                }
                tracing::info!(leases = checkpoints.len(), "leases resumed as leader");
            }
            LeaseRole::Leading => {}
        }
        if applied > self.synced_index {
            self.keeper.sync(core.machine().leases());
            self.synced_index = applied;
        }
        if !ticked {
            return;
        }
        self.drive_timer(core);
        let now = core.now_ms();
        if let Some((index, at_ms)) = self.expire_pending {
            let lost = now >= at_ms.saturating_add(LEASE_EXPIRE_RETRY_MS);
            if applied < index && !lost {
                return;
            }
            self.expire_pending = None;
        }
        let ids = self.keeper.expired(now, LEASE_EXPIRE_BATCH_MAX);
        if ids.is_empty() {
            return;
        }
        tracing::debug!(?ids, "proposing lease expiry");
        if let Some(index) = Self::propose_duty(core, Request::LeaseExpire { ids }) {
            self.expire_pending = Some((index, now));
        }
    }

    /// The timer duty: a leader proposes `Tick` once the machine's earliest timer is due
    /// (docs/state.md), one at a time, again if one was lost to a leader change.
    fn drive_timer<S: NodeStore>(&mut self, core: &mut NodeCore<StateMachine, S>) {
        #[cfg(feature = "negative-controls")]
        if self.skip_tick {
            return;
        }
        let now = core.now_ms();
        let applied = core.applied_index();
        if let Some((index, at_ms)) = self.tick_pending {
            if applied >= index {
                self.tick_fired_ms = Some(at_ms);
            } else if now < at_ms.saturating_add(TIMER_TICK_RETRY_MS) {
                return;
            }
            self.tick_pending = None;
        }
        let fired = self.tick_fired_ms;
        let due = core
            .machine()
            .next_timer_ms_memo(&mut self.group_timers)
            .is_some_and(|at| at <= now && fired.is_none_or(|fired| at > fired));
        if !due {
            return;
        }
        if let Some(index) = Self::propose_duty(core, Request::Tick) {
            self.tick_pending = Some((index, now));
        }
    }

    /// Proposes a leader-made command nobody waits for; returns its index.
    fn propose_duty<S: NodeStore>(
        core: &mut NodeCore<StateMachine, S>,
        request: Request,
    ) -> Option<u64> {
        core.propose_untracked(Proposal {
            request,
            session: None,
        })
    }
}

impl<S: NodeStore> Duties<StateMachine, S> for LeaderDuties {
    fn turn(&mut self, core: &mut NodeCore<StateMachine, S>, ticked: bool) {
        self.drive_leases(core, ticked);
    }

    fn applied(&mut self, output: &ApplyOutput) {
        // A session retry reports the revision it was first applied at, not the store's.
        if !output.duplicate {
            self.batch_revision = output.revision;
        }
        self.batch_events.extend(output.events.iter().cloned());
    }
}
