//! Fuzzing the core with forged peer messages inside a running simulated cluster.
//!
//! Each case runs one simulator seed (a 3-member cluster with its usual workload: clients,
//! crashes, partitions, drops) and, at random moments of the fault phase, delivers forged
//! messages of every kind. Their fields are valid encodings with extreme values (0, 1,
//! u64::MAX, u64::MAX - 1, the limits, indexes around the target's log end and commit index,
//! terms around its term, random values), and random flags, entries and snapshot data.
//!
//! - From non-members (ids no configuration ever holds): nothing may panic and the
//!   simulator's safety checkers, liveness included, must stay green. The core refuses every
//!   such message. A leader's messages (Append, Heartbeat, SnapshotChunk) from a stranger go
//!   only to a node that follows a leader, at its term: Raft has a voter follow whoever leads
//!   a later term, member or not (a voter whose configuration predates its leader depends on
//!   it), so at a later term a stranger's are forgeries in a member's place, below.
//! - Claiming to come from a member: only "no panic" can be required. A member is trusted to
//!   speak Raft (until peers authenticate, anyone who can forge a member's id is that
//!   member), so a forged Append with a plausible term can replace uncommitted entries or
//!   commit a forged entry, and the checkers may rightly report it.
//!
//! `CONCLAVE_FUZZ_CASES` sets the number of cases per target (default: a CI-sized run).

use bytes::Bytes;
use conclave_raft::{
    ConfState, Entry, EntryKind, MAX_INDEX, MAX_TERM, Message, MessageBody, SnapshotMeta, Storage,
};
use conclave_sim::{Simulation, SwarmParams};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, FileFailurePersistence};

/// Cases per target in CI: the two targets run side by side in about 30 s of wall time (a
/// minute of CPU) in release; each case is one whole simulator seed.
const CI_CASES: u32 = 600;

#[allow(
    clippy::disallowed_methods,
    reason = "tests read the fuzz budget from the environment"
)]
fn cases() -> u32 {
    std::env::var("CONCLAVE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(CI_CASES)
}

fn proptest_config() -> ProptestConfig {
    ProptestConfig {
        cases: cases(),
        // The simulator is deterministic per seed: a failure prints its inputs to replay.
        failure_persistence: Some(Box::new(FileFailurePersistence::Off)),
        ..ProptestConfig::default()
    }
}

/// A value for a u64 field, chosen relative to the target's state when it is injected.
#[derive(Debug, Clone, Copy)]
enum Value {
    Zero,
    One,
    Max,
    MaxMinusOne,
    /// MAX_INDEX or MAX_TERM (the core's limits) plus a small offset.
    AtLimit(i8),
    /// The target's last index (or term) plus a small offset.
    AroundLast(i8),
    /// The target's commit index plus a small offset.
    AroundCommit(i8),
    /// For a term: the term of the target's last entry plus a small offset, so that a forged
    /// Append can match its log; for an index, the same as `AroundLast`.
    AroundLastTerm(i8),
    Random(u64),
}

fn value() -> impl Strategy<Value = Value> {
    // Values near the target's state weigh most: they get past the checks that merely
    // bound a field and reach the code that acts on it.
    prop_oneof![
        1 => Just(Value::Zero),
        1 => Just(Value::One),
        1 => Just(Value::Max),
        1 => Just(Value::MaxMinusOne),
        1 => (-2i8..=2).prop_map(Value::AtLimit),
        3 => (-3i8..=3).prop_map(Value::AroundLast),
        2 => (-3i8..=3).prop_map(Value::AroundCommit),
        3 => (-1i8..=1).prop_map(Value::AroundLastTerm),
        1 => any::<u64>().prop_map(Value::Random),
    ]
}

/// What the target looks like when a forged message is built for it.
#[derive(Clone, Copy)]
struct Anchor {
    last_index: u64,
    last_term: u64,
    commit: u64,
    term: u64,
}

fn offset(base: u64, delta: i8) -> u64 {
    base.saturating_add_signed(delta as i64)
}

impl Value {
    fn index(self, at: Anchor) -> u64 {
        self.resolve(at.last_index, at.commit, at.last_index, MAX_INDEX)
    }

    fn term(self, at: Anchor) -> u64 {
        self.resolve(at.term, at.term, at.last_term, MAX_TERM)
    }

    fn resolve(self, last: u64, commit: u64, last_term: u64, limit: u64) -> u64 {
        match self {
            Value::Zero => 0,
            Value::One => 1,
            Value::Max => u64::MAX,
            Value::MaxMinusOne => u64::MAX - 1,
            Value::AtLimit(d) => offset(limit, d),
            Value::AroundLast(d) => offset(last, d),
            Value::AroundCommit(d) => offset(commit, d),
            Value::AroundLastTerm(d) => offset(last_term, d),
            Value::Random(v) => v,
        }
    }
}

/// One forged message, before it is anchored to its target.
#[derive(Debug, Clone)]
struct Forged {
    /// Virtual ms to run the cluster before delivering it.
    wait_ms: u64,
    kind: u8,
    /// Index into the sender pool (members or strangers).
    sender: usize,
    to: u64,
    term: Value,
    a: Value,
    b: Value,
    c: Value,
    flags: (bool, bool, bool),
    /// Entries of an Append: (index, term, is a membership change, payload).
    entries: Vec<(Value, Value, bool, Vec<u8>)>,
    data: Vec<u8>,
}

fn forged() -> impl Strategy<Value = Forged> {
    let entry = (
        value(),
        value(),
        any::<bool>(),
        prop::collection::vec(any::<u8>(), 0..12),
    );
    (
        (0u64..400, 0u8..14, 0usize..8, 1u64..=3),
        (value(), value(), value(), value()),
        any::<(bool, bool, bool)>(),
        prop::collection::vec(entry, 0..4),
        prop::collection::vec(any::<u8>(), 0..64),
    )
        .prop_map(
            |((wait_ms, kind, sender, to), (term, a, b, c), flags, entries, data)| Forged {
                wait_ms,
                kind,
                sender,
                to,
                term,
                a,
                b,
                c,
                flags,
                entries,
                data,
            },
        )
}

impl Forged {
    fn message(&self, from: u64, at: Anchor) -> Message {
        let (f1, f2, f3) = self.flags;
        let context = Bytes::from(self.data.clone());
        if self.kind >= 11 {
            return self.plausible_append(from, at);
        }
        let body = match self.kind {
            0 => {
                let prev_index = self.a.index(at);
                let entries = self
                    .entries
                    .iter()
                    .enumerate()
                    .map(|(i, (index, term, conf, data))| Entry {
                        // Mostly contiguous from prev_index (valid shape), sometimes wild.
                        index: if f3 {
                            index.index(at)
                        } else {
                            prev_index.saturating_add(i as u64 + 1)
                        },
                        term: term.term(at),
                        kind: if *conf {
                            EntryKind::ConfChange
                        } else {
                            EntryKind::Normal
                        },
                        data: Bytes::from(data.clone()),
                    })
                    .collect();
                MessageBody::Append {
                    prev_index,
                    prev_term: self.b.term(at),
                    entries,
                    commit: self.c.index(at),
                }
            }
            1 => MessageBody::AppendResponse {
                index: self.a.index(at),
                reject: f1,
                hint_index: self.b.index(at),
                hint_term: self.c.term(at),
                awaited: f2,
            },
            2 => MessageBody::Vote {
                pre: f1,
                last_index: self.a.index(at),
                last_term: self.b.term(at),
                transfer: f2,
            },
            3 => MessageBody::VoteResponse {
                pre: f1,
                granted: f2,
            },
            4 => MessageBody::Heartbeat {
                commit: self.a.index(at),
                context: f1.then_some(context),
            },
            5 => MessageBody::HeartbeatResponse {
                context: f1.then_some(context),
                awaited: f2,
            },
            6 => {
                let data = Bytes::from(self.data.clone());
                let voters: &[u64] = if f3 { &[1, 2, 3] } else { &[1, 2, 3, from] };
                MessageBody::SnapshotChunk {
                    meta: SnapshotMeta {
                        index: self.a.index(at),
                        term: self.b.term(at),
                        conf_state: ConfState::with_voters(voters.iter().copied()),
                    },
                    offset: if f2 { 0 } else { self.c.index(at) },
                    // A right checksum half the time, so forged images also get installed.
                    image_crc32c: if f1 {
                        crc32c::crc32c(&data)
                    } else {
                        self.c.index(at) as u32
                    },
                    data,
                    done: f1 || f2,
                }
            }
            7 => MessageBody::SnapshotResponse {
                snapshot_index: self.a.index(at),
                next_offset: self.b.index(at),
                installed: f1,
                reject: f2,
            },
            8 => MessageBody::ReadIndexRequest { context },
            9 => MessageBody::ReadIndexResponse {
                context,
                index: self.a.index(at),
            },
            _ => MessageBody::TimeoutNow,
        };
        Message {
            from,
            to: self.to,
            term: self.term.term(at),
            body,
        }
    }
}

impl Forged {
    /// An Append a leader of the target's term (or the next) could have sent: it matches the
    /// target's last entry, its entries follow it, and it commits them. Kinds 12 and 13 then
    /// mutate one field to an extreme value. Random fields rarely line up like this, and only
    /// a message this plausible reaches the code that appends, commits and applies.
    fn plausible_append(&self, from: u64, at: Anchor) -> Message {
        let (f1, _, _) = self.flags;
        let term = at.term.saturating_add(f1 as u64).max(1);
        let mut prev_index = at.last_index;
        let mut prev_term = at.last_term;
        let mut entries: Vec<Entry> = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, (_, _, conf, data))| Entry {
                index: prev_index.saturating_add(i as u64 + 1),
                term,
                kind: if *conf {
                    EntryKind::ConfChange
                } else {
                    EntryKind::Normal
                },
                data: Bytes::from(data.clone()),
            })
            .collect();
        let mut commit = prev_index.saturating_add(entries.len() as u64);
        let mut message_term = term;
        if self.kind >= 12 {
            match self.data.len() % 5 {
                0 => prev_index = self.a.index(at),
                1 => prev_term = self.a.term(at),
                2 => commit = self.a.index(at),
                3 => message_term = self.a.term(at),
                _ => {
                    if let Some(first) = entries.first_mut() {
                        first.index = self.a.index(at);
                        first.term = self.b.term(at);
                    }
                }
            }
        }
        Message {
            from,
            to: self.to,
            term: message_term,
            body: MessageBody::Append {
                prev_index,
                prev_term,
                entries,
                commit,
            },
        }
    }
}

/// Ids that no configuration of the fuzzed cluster ever holds (membership changes are off
/// there), including the reserved 0 and the extremes.
const STRANGERS: [u64; 8] = [0, 4, 9, 100, 1 << 32, MAX_INDEX, u64::MAX - 1, u64::MAX];

/// Runs `seed` with `forged` delivered along the way; returns the simulation at its end.
fn run_with_forgeries(seed: u64, forged: &[Forged], members_forge: bool) -> (Simulation, u64) {
    let mut params = SwarmParams::from_seed(seed, Some(3));
    // A 3-member cluster whose configuration never changes: a node joining with an empty
    // configuration accepts any leader (see docs/security.md), so strangers are only
    // strangers while the membership is fixed.
    params.nodes = 3;
    params.membership_changes = false;
    let mut sim = Simulation::with_params(seed, params, true, None);
    let mut injected = 0;
    for forgery in forged {
        sim.run_for(forgery.wait_ms);
        let Some(target) = sim.node(forgery.to) else {
            continue;
        };
        let last_index = target.last_index();
        let anchor = Anchor {
            last_index,
            last_term: target.store().term(last_index).unwrap_or(0),
            commit: target.commit_index(),
            term: target.term(),
        };
        let follows_a_leader = target.leader().is_some();
        let from = if members_forge {
            // Mostly members; now and then a stranger at whatever term, which a voter may
            // follow like a member (see the module comment).
            if forgery.sender < 6 {
                1 + forgery.sender as u64 % 3
            } else {
                STRANGERS[1 + forgery.sender % 2]
            }
        } else {
            STRANGERS[forgery.sender % STRANGERS.len()]
        };
        let mut message = forgery.message(from, anchor);
        let leads = matches!(
            message.body,
            MessageBody::Append { .. }
                | MessageBody::Heartbeat { .. }
                | MessageBody::SnapshotChunk { .. }
        );
        if leads && !members_forge {
            // A second leader of the term the target follows someone in.
            if !follows_a_leader {
                continue;
            }
            message.term = anchor.term;
        }
        sim.inject(message);
        injected += 1;
    }
    sim.run();
    (sim, injected)
}

proptest! {
    #![proptest_config(proptest_config())]

    /// Strangers' forged messages change nothing: no panic, every checker green.
    #[test]
    fn forged_messages_from_non_members_leave_the_cluster_safe_and_live(
        seed in any::<u64>(),
        forged in prop::collection::vec(forged(), 1..40),
    ) {
        let (sim, injected) = run_with_forgeries(seed, &forged, false);
        let refused_at_least = sim.stats.refused_messages;
        prop_assert!(
            refused_at_least >= injected,
            "{injected} forged messages from strangers, only {refused_at_least} refused"
        );
        prop_assert!(
            sim.violations().is_empty(),
            "seed {seed}: {:?}\n{}",
            sim.violations(),
            sim.trace_tail().join("\n")
        );
    }

    /// Forged messages in members' names (and some strangers' at any term): the nodes must
    /// not panic, whatever the checkers make of the result.
    #[test]
    fn forged_messages_in_members_names_never_panic(
        seed in any::<u64>(),
        forged in prop::collection::vec(forged(), 1..40),
    ) {
        let _ = run_with_forgeries(seed, &forged, true);
    }
}
