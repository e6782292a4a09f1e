//! Priority election groups: Conclave's own leader election for swarms.
//!
//! ```text
//!   register / resign / lease end / handoff timeout / configure
//!        │
//!        ▼
//!   Group::decide(now, lease liveness) ──► Decision ──► StateMachine executes it:
//!        Elect(id)        seat := id, term += 1, fence := new revision (mirror key re-created)
//!        Vacate           seat := none, term += 1, mirror key deleted
//!        RequestHandoff   seat.handoff := challenger (observers see it)
//!        CancelHandoff    the challenger left or lost its edge
//!        Keep
//! ```
//!
//! The rules, all decided from the candidates alone so any agent can predict them:
//! - An empty seat goes to the live candidate with the highest priority; ties go to the smallest
//!   candidate id (bytewise).
//! - A sitting leader keeps the seat while it is registered (its lease lives).
//! - A strictly higher-priority challenger, when the group (`always`) or the challenger
//!   (`higher`, the default) asks for preemption, puts the seat into handoff; under `never`
//!   no challenger does. The seat moves when the incumbent resigns or its
//!   lease ends, or when the handoff timeout (if any) passes. There is one seat, so there are
//!   never two leaders.

use std::collections::BTreeMap;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// A registered candidate.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Candidate {
    /// Unique within the group.
    pub id: String,
    /// Higher wins.
    pub priority: i64,
    /// Opaque value published while leading (e.g. an address).
    pub value: Bytes,
    /// The candidate's heartbeat: the registration ends with the lease.
    pub lease_id: i64,
    /// Ask to preempt a lower-priority leader even if the group does not.
    pub preempt: bool,
    /// Store revision of the (latest) registration.
    pub registered_revision: i64,
}

/// Who may displace a sitting leader.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum PreemptPolicy {
    /// A strictly higher-priority challenger that registered with `preempt`.
    #[default]
    Higher,
    /// Every strictly higher-priority challenger.
    Always,
    /// No challenger: the leader keeps its seat until it resigns or its lease ends, and a
    /// pending handoff is cancelled when the group switches to it.
    Never,
}

/// A group's policy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupPolicy {
    /// Every strictly higher-priority challenger may request a handoff
    /// ([`PreemptPolicy::Always`]); ignored when `preempt_never` is set.
    pub preempt: bool,
    /// No challenger may request a handoff ([`PreemptPolicy::Never`]), whatever `preempt`
    /// and the challenger's own flag say. Kept out of this struct's encoding so that logs and
    /// images written before it existed still decode: it travels in
    /// [`crate::Request::GroupConfigurePreempt`] and in a snapshot section of its own.
    #[serde(skip)]
    pub preempt_never: bool,
    /// If set, a requested handoff completes after this long even if the incumbent stays.
    pub handoff_timeout_ms: Option<u64>,
    /// If set, an empty seat is filled this long after the first live candidate shows up, from
    /// everyone registered by then. Agents that start together then get the leader the rules
    /// predict, not whichever registered first.
    pub settle_ms: Option<u64>,
}

impl GroupPolicy {
    /// The three-valued policy the two flags encode.
    pub fn preempt_policy(&self) -> PreemptPolicy {
        if self.preempt_never {
            PreemptPolicy::Never
        } else if self.preempt {
            PreemptPolicy::Always
        } else {
            PreemptPolicy::Higher
        }
    }

    /// Sets both flags from `policy`.
    pub fn set_preempt_policy(&mut self, policy: PreemptPolicy) {
        self.preempt = policy == PreemptPolicy::Always;
        self.preempt_never = policy == PreemptPolicy::Never;
    }
}

/// A pending handoff of the seat.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Handoff {
    /// The candidate that will take the seat.
    pub challenger: String,
    /// Leader-clock time the handoff was requested.
    pub requested_ms: u64,
    /// When the seat moves regardless of the incumbent, if the group has a timeout.
    pub deadline_ms: Option<u64>,
}

/// The group's seat when occupied.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Seat {
    /// The leader's candidate id.
    pub leader: String,
    /// The fencing token: the store revision at which this leadership was granted, which is
    /// also the `create_revision` of the mirror key `/_conclave/elect/<group>/leader`.
    pub fence: i64,
    /// Leader-clock time the seat was granted.
    pub since_ms: u64,
    /// A requested handoff, if any.
    pub handoff: Option<Handoff>,
}

/// One priority election group.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Group {
    /// The group's policy.
    pub policy: GroupPolicy,
    /// +1 at every change of leader (including to vacant).
    pub term: u64,
    /// Registered candidates by id.
    pub candidates: BTreeMap<String, Candidate>,
    /// The seat.
    pub seat: Option<Seat>,
    /// With `settle_ms`: when the first live candidate showed up at the empty seat.
    pub settling_since_ms: Option<u64>,
}

/// What the group must do next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Decision {
    Keep,
    StartSettling,
    StopSettling,
    Elect(String),
    Vacate,
    RequestHandoff {
        challenger: String,
        deadline_ms: Option<u64>,
    },
    CancelHandoff,
}

/// Succession order: highest priority first, then smallest id.
pub(crate) fn succession_key(candidate: &Candidate) -> (std::cmp::Reverse<i64>, &str) {
    (std::cmp::Reverse(candidate.priority), candidate.id.as_str())
}

impl Group {
    /// Candidates in order of succession (highest priority, then smallest id).
    pub fn succession(&self) -> Vec<&Candidate> {
        let mut candidates: Vec<&Candidate> = self.candidates.values().collect();
        candidates.sort_by(|a, b| succession_key(a).cmp(&succession_key(b)));
        candidates
    }

    /// The best live candidate, if any.
    fn best(&self, is_live: &dyn Fn(i64) -> bool) -> Option<&Candidate> {
        self.candidates
            .values()
            .filter(|candidate| is_live(candidate.lease_id))
            .min_by(|a, b| succession_key(a).cmp(&succession_key(b)))
    }

    /// The next step for the group at leader-clock time `now_ms`.
    pub(crate) fn decide(&self, now_ms: u64, is_live: &dyn Fn(i64) -> bool) -> Decision {
        let best = self.best(is_live);
        let Some(seat) = &self.seat else {
            let Some(best) = best else {
                // Everyone left while the seat was settling: start afresh next time.
                return match self.settling_since_ms {
                    Some(_) => Decision::StopSettling,
                    None => Decision::Keep,
                };
            };
            return match (self.policy.settle_ms, self.settling_since_ms) {
                (None, _) => Decision::Elect(best.id.clone()),
                (Some(_), None) => Decision::StartSettling,
                (Some(settle_ms), Some(since_ms))
                    if now_ms >= since_ms.saturating_add(settle_ms) =>
                {
                    Decision::Elect(best.id.clone())
                }
                (Some(_), Some(_)) => Decision::Keep,
            };
        };
        let Some(leader) = self.candidates.get(&seat.leader) else {
            // The leader resigned or its lease ended: succession, or an empty seat.
            return match best {
                Some(best) => Decision::Elect(best.id.clone()),
                None => Decision::Vacate,
            };
        };
        let challenger = best.filter(|best| {
            best.priority > leader.priority
                && match self.policy.preempt_policy() {
                    PreemptPolicy::Never => false,
                    PreemptPolicy::Always => true,
                    PreemptPolicy::Higher => best.preempt,
                }
        });
        match (challenger, &seat.handoff) {
            (Some(challenger), None) => Decision::RequestHandoff {
                challenger: challenger.id.clone(),
                deadline_ms: self
                    .policy
                    .handoff_timeout_ms
                    .map(|timeout_ms| now_ms.saturating_add(timeout_ms)),
            },
            (Some(challenger), Some(handoff)) => {
                if handoff
                    .deadline_ms
                    .is_some_and(|deadline_ms| now_ms >= deadline_ms)
                {
                    Decision::Elect(challenger.id.clone())
                } else if handoff.challenger != challenger.id {
                    // A better challenger arrived: it is now the one waiting; the clock keeps
                    // running from the original request.
                    Decision::RequestHandoff {
                        challenger: challenger.id.clone(),
                        deadline_ms: handoff.deadline_ms,
                    }
                } else {
                    Decision::Keep
                }
            }
            (None, Some(_)) => Decision::CancelHandoff,
            (None, None) => Decision::Keep,
        }
    }

    /// When a `Tick` would next change the group: a handoff timeout or the end of settling.
    pub fn timer_ms(&self) -> Option<u64> {
        match &self.seat {
            Some(seat) => seat.handoff.as_ref()?.deadline_ms,
            None => {
                let settle_ms = self.policy.settle_ms?;
                Some(self.settling_since_ms?.saturating_add(settle_ms))
            }
        }
    }
}

/// A candidate as observers see it in a `CandidatesChanged` event.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CandidateSummary {
    /// The candidate id.
    pub id: String,
    /// Its priority.
    pub priority: i64,
}

/// What happened in a group.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ElectionEventKind {
    /// A new leader holds the seat.
    Elected {
        /// The leader's candidate id.
        leader: String,
        /// Its priority.
        priority: i64,
        /// Its value.
        value: Bytes,
        /// Its fencing token.
        fence: i64,
    },
    /// A higher-priority challenger asked for the seat; the incumbent should finish up and
    /// resign.
    HandoffRequested {
        /// The incumbent.
        leader: String,
        /// The challenger.
        challenger: String,
        /// The challenger's priority.
        challenger_priority: i64,
        /// When the seat moves regardless, if the group has a timeout.
        deadline_ms: Option<u64>,
    },
    /// The pending handoff is off (the challenger left or lost its edge).
    HandoffCancelled {
        /// The incumbent, who keeps the seat.
        leader: String,
    },
    /// Nobody holds the seat.
    Vacant,
    /// The leader published a new value (proclaim).
    ValueChanged {
        /// The leader.
        leader: String,
        /// The new value.
        value: Bytes,
        /// Its fencing token.
        fence: i64,
    },
    /// Registrations changed; the list is in order of succession.
    CandidatesChanged {
        /// Candidates, highest priority first.
        candidates: Vec<CandidateSummary>,
    },
}

/// An event of a priority election group.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ElectionEvent {
    /// The group.
    pub group: String,
    /// The group's term after the event.
    pub term: u64,
    /// The store revision when it happened.
    pub revision: i64,
    /// What happened.
    pub kind: ElectionEventKind,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate(id: &str, priority: i64, lease_id: i64) -> Candidate {
        Candidate {
            id: id.into(),
            priority,
            value: Bytes::new(),
            lease_id,
            preempt: false,
            registered_revision: 0,
        }
    }

    fn group(candidates: &[Candidate]) -> Group {
        Group {
            candidates: candidates
                .iter()
                .map(|c| (c.id.clone(), c.clone()))
                .collect(),
            ..Group::default()
        }
    }

    #[test]
    fn empty_seat_goes_to_highest_priority_then_smallest_id() {
        let all_live = |_: i64| true;
        let g = group(&[
            candidate("b", 5, 1),
            candidate("a", 5, 2),
            candidate("c", 1, 3),
        ]);
        assert_eq!(g.decide(0, &all_live), Decision::Elect("a".into()));
        let only_b_live = |lease: i64| lease == 1;
        assert_eq!(g.decide(0, &only_b_live), Decision::Elect("b".into()));
        let ids: Vec<&str> = g.succession().iter().map(|c| c.id.as_str()).collect();
        assert_eq!(ids, ["a", "b", "c"]);
    }

    #[test]
    fn incumbent_is_stable_unless_preemption_is_asked() {
        let all_live = |_: i64| true;
        let mut g = group(&[candidate("low", 1, 1), candidate("high", 9, 2)]);
        g.seat = Some(Seat {
            leader: "low".into(),
            fence: 5,
            since_ms: 0,
            handoff: None,
        });
        assert_eq!(g.decide(0, &all_live), Decision::Keep);
        g.policy = GroupPolicy {
            preempt: true,
            handoff_timeout_ms: Some(100),
            settle_ms: None,
            preempt_never: false,
        };
        assert_eq!(
            g.decide(10, &all_live),
            Decision::RequestHandoff {
                challenger: "high".into(),
                deadline_ms: Some(110)
            }
        );
    }

    /// Each policy against a higher-priority challenger with and without its own `preempt`.
    #[test]
    fn each_preempt_policy_decides_who_may_ask_for_the_seat() {
        let all_live = |_: i64| true;
        let handoff = Decision::RequestHandoff {
            challenger: "high".into(),
            deadline_ms: None,
        };
        for (policy, plain, asking) in [
            (PreemptPolicy::Higher, Decision::Keep, handoff.clone()),
            (PreemptPolicy::Always, handoff.clone(), handoff.clone()),
            (PreemptPolicy::Never, Decision::Keep, Decision::Keep),
        ] {
            for (asks, expected) in [(false, plain), (true, asking)] {
                let mut high = candidate("high", 9, 2);
                high.preempt = asks;
                let mut g = group(&[candidate("low", 1, 1), high]);
                g.policy.set_preempt_policy(policy);
                assert_eq!(g.policy.preempt_policy(), policy);
                g.seat = Some(Seat {
                    leader: "low".into(),
                    fence: 5,
                    since_ms: 0,
                    handoff: None,
                });
                assert_eq!(g.decide(0, &all_live), expected, "{policy:?}, asks {asks}");
                // Under every policy the seat moves once the leader is gone.
                g.candidates.remove("low");
                assert_eq!(g.decide(0, &all_live), Decision::Elect("high".into()));
            }
        }
        // A pending handoff is cancelled when the group switches to `never`.
        let mut high = candidate("high", 9, 2);
        high.preempt = true;
        let mut g = group(&[candidate("low", 1, 1), high]);
        g.seat = Some(Seat {
            leader: "low".into(),
            fence: 5,
            since_ms: 0,
            handoff: Some(Handoff {
                challenger: "high".into(),
                requested_ms: 0,
                deadline_ms: None,
            }),
        });
        assert_eq!(g.decide(0, &all_live), Decision::Keep);
        g.policy.set_preempt_policy(PreemptPolicy::Never);
        assert_eq!(g.decide(0, &all_live), Decision::CancelHandoff);
    }
}
