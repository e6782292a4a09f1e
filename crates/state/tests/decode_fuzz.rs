//! Decoder fuzz: bytes that arrive from a peer's log entries or a snapshot file are hostile.
//! Random bytes and mutations of valid encodings into `Command::decode`,
//! `StateMachine::apply_encoded` and `StateMachine::restore` never panic; valid commands
//! round-trip through their encoding. Plus the session guards at the machine's surface: a
//! foreign secret reads and moves nothing.
//!
//! `PROPTEST_CASES` raises the number of cases for a longer run.

use bytes::Bytes;
use conclave_state::{
    Command, Config, GroupPolicy, PreemptPolicy, PutRequest, RangeRequest, Request, Response,
    Retention, SessionSeq, StateMachine, TxnRequest, command::SECRET_COMMAND_PREFIX,
};
use proptest::prelude::*;

fn request() -> impl Strategy<Value = Request> {
    let bytes = proptest::collection::vec(any::<u8>(), 0..12).prop_map(Bytes::from);
    let text = "[a-z/]{0,8}";
    prop_oneof![
        (bytes.clone(), bytes.clone(), any::<i64>()).prop_map(|(key, value, lease)| {
            Request::Put(PutRequest {
                lease,
                ..PutRequest::new(key, value)
            })
        }),
        (bytes.clone(), bytes.clone(), any::<i64>()).prop_map(|(key, range_end, revision)| {
            Request::Range(RangeRequest {
                key,
                range_end,
                revision,
                ..RangeRequest::default()
            })
        }),
        Just(Request::Txn(TxnRequest::default())),
        any::<i64>().prop_map(|revision| Request::Compact { revision }),
        (any::<i64>(), any::<u64>()).prop_map(|(id, ttl_ms)| Request::LeaseGrant { id, ttl_ms }),
        proptest::collection::vec(any::<i64>(), 0..4).prop_map(|ids| Request::LeaseExpire { ids }),
        (text, bytes.clone()).prop_map(|(topic, data)| Request::Publish { topic, data }),
        (text, 0u8..3).prop_map(|(group, policy)| Request::GroupConfigurePreempt {
            group,
            policy: GroupPolicy::default(),
            preempt_policy: [
                PreemptPolicy::Higher,
                PreemptPolicy::Always,
                PreemptPolicy::Never
            ][usize::from(policy)],
        }),
        (text, bytes.clone(), text).prop_map(|(topic, data, from)| Request::PublishFrom {
            topic,
            data,
            from
        }),
        (text, text, any::<u64>()).prop_map(|(consumer, topic, seq)| Request::Ack {
            consumer,
            topic,
            seq
        }),
        (
            text,
            proptest::option::of(any::<u64>()),
            proptest::option::of(any::<u64>())
        )
            .prop_map(
                |(topic, max_messages, max_age_ms)| Request::TopicConfigure {
                    topic,
                    retention: Retention {
                        max_messages,
                        max_age_ms
                    },
                }
            ),
        Just(Request::OpenSession),
        any::<u64>().prop_map(|client_id| Request::CloseSession { client_id }),
        any::<u128>().prop_map(|secret| Request::OpenSessionWithSecret { secret }),
        (any::<u64>(), any::<u128>())
            .prop_map(|(client_id, secret)| Request::CloseSessionWithSecret { client_id, secret }),
        Just(Request::Tick),
    ]
}

fn command() -> impl Strategy<Value = Command> {
    let session =
        proptest::option::of((any::<u64>(), any::<u64>(), any::<u128>())).prop_map(|session| {
            session.map(|(client_id, seq, secret)| SessionSeq {
                client_id,
                seq,
                secret,
            })
        });
    (any::<u64>(), session, request()).prop_map(|(leader_time_ms, session, request)| Command {
        leader_time_ms,
        session,
        request,
    })
}

/// A valid encoding with some bytes flipped, some cut off or some appended.
fn mutated(valid: Vec<u8>) -> impl Strategy<Value = Vec<u8>> {
    let len = valid.len().max(1);
    (
        proptest::collection::vec((0..len, any::<u8>()), 0..4),
        0..=valid.len(),
        proptest::collection::vec(any::<u8>(), 0..4),
    )
        .prop_map(move |(flips, keep, tail)| {
            let mut bytes = valid.clone();
            for (at, byte) in flips {
                if let Some(slot) = bytes.get_mut(at) {
                    *slot ^= byte;
                }
            }
            bytes.truncate(keep);
            bytes.extend(tail);
            bytes
        })
}

/// A small machine with a little of everything, for snapshot mutation.
fn populated_snapshot() -> Vec<u8> {
    let mut machine = StateMachine::new(Config::default());
    let requests = [
        Request::Put(PutRequest::new("k", "v")),
        Request::LeaseGrant {
            id: 0,
            ttl_ms: 5000,
        },
        Request::Publish {
            topic: "t".into(),
            data: Bytes::from_static(b"m"),
        },
        Request::PublishFrom {
            topic: "t".into(),
            data: Bytes::from_static(b"n"),
            from: "agent".into(),
        },
        Request::OpenSessionWithSecret { secret: 99 },
        Request::OpenSession,
    ];
    for (index, request) in requests.into_iter().enumerate() {
        let index = u64::try_from(index).expect("small") + 1;
        machine.apply(index, &Command::new(index, request));
    }
    machine.snapshot_to_vec()
}

/// Cases per property: 2,000 in CI, `PROPTEST_CASES` for a longer run.
// The lint keeps the machine's configuration out of the environment; this sets only how long
// the test runs.
#[allow(clippy::disallowed_methods)]
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|cases| cases.parse().ok())
        .unwrap_or(2_000)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn commands_round_trip(command in command()) {
        let bytes = command.encode();
        let secret_format = command.session.is_some_and(|at| at.secret != 0);
        prop_assert_eq!(bytes.starts_with(SECRET_COMMAND_PREFIX), secret_format);
        prop_assert_eq!(Command::decode(&bytes), Ok(command));
    }

    #[test]
    fn random_bytes_never_panic_the_decoder_or_the_machine(
        bytes in proptest::collection::vec(any::<u8>(), 0..256),
    ) {
        let _ = Command::decode(&bytes);
        let mut prefixed = SECRET_COMMAND_PREFIX.to_vec();
        prefixed.extend_from_slice(&bytes);
        let _ = Command::decode(&prefixed);
        let mut machine = StateMachine::new(Config::default());
        let output = machine.apply_encoded(1, &bytes);
        prop_assert_eq!(machine.last_applied(), 1);
        let _ = output;
        let _ = StateMachine::restore(Config::default(), bytes.as_slice());
    }

    #[test]
    fn mutated_commands_never_panic(
        (valid, bytes) in command().prop_flat_map(|command| {
            let valid = command.encode();
            (Just(valid.clone()), mutated(valid))
        }),
    ) {
        let mut machine = StateMachine::new(Config::default());
        machine.apply_encoded(1, &valid);
        machine.apply_encoded(2, &bytes);
        prop_assert_eq!(machine.last_applied(), 2);
    }

    #[test]
    fn mutated_snapshots_are_refused_or_restored_never_a_panic(
        bytes in mutated(populated_snapshot()),
    ) {
        if let Ok(machine) = StateMachine::restore(Config::default(), bytes.as_slice()) {
            // Whatever restored must snapshot again (its invariants hold).
            let _ = machine.snapshot_to_vec();
        }
    }
}

#[test]
fn a_foreign_secret_neither_reads_the_cached_answer_nor_blocks_the_owner() {
    let mut machine = StateMachine::new(Config::default());
    let secret = 0x5eed_u128 << 64 | 0xfeed;
    let opened = machine.apply(
        1,
        &Command::new(1, Request::OpenSessionWithSecret { secret }),
    );
    let Ok(Response::SessionOpened { client_id }) = opened.result else {
        panic!("{opened:?}")
    };
    let owner = |seq| SessionSeq {
        client_id,
        seq,
        secret,
    };
    let put = |session: SessionSeq, value: &'static str| Command {
        leader_time_ms: 2,
        session: Some(session),
        request: Request::Put(PutRequest {
            prev_kv: true,
            ..PutRequest::new("k", value)
        }),
    };
    machine.apply(2, &put(owner(1), "first"));
    machine.apply(3, &put(owner(2), "second"));
    // The attacker knows the id and guesses secrets: its retry of seq 2 must not get the
    // owner's cached answer (which holds "first" as prev_kv), and u64::MAX must not stick.
    for (index, guess) in [(4, 0), (6, secret ^ 1), (8, 1)] {
        let foreign = SessionSeq {
            client_id,
            seq: 2,
            secret: guess,
        };
        let replay = machine.apply(index, &put(foreign, "attacker"));
        assert!(!replay.duplicate);
        assert!(
            matches!(
                replay.result,
                Err(conclave_state::Error::SessionNotFound { .. })
            ),
            "{replay:?}"
        );
        let block = SessionSeq {
            seq: u64::MAX,
            ..foreign
        };
        assert!(
            machine
                .apply(index + 1, &put(block, "attacker"))
                .result
                .is_err()
        );
    }
    // The owner's own jump to u64::MAX is refused too, and the owner carries on.
    let jump = machine.apply(20, &put(owner(u64::MAX), "jump"));
    assert!(matches!(
        jump.result,
        Err(conclave_state::Error::SessionSeqTooFar { .. })
    ));
    let next = machine.apply(21, &put(owner(3), "third"));
    assert!(next.result.is_ok() && !next.duplicate, "{next:?}");
    let closed = machine.apply(
        22,
        &Command::new(
            22,
            Request::CloseSessionWithSecret {
                client_id,
                secret: secret ^ 1,
            },
        ),
    );
    assert!(closed.result.is_err(), "closed by a foreign secret");
    assert_eq!(machine.session_count(), 1);
    // Snapshots keep the secret.
    let restored =
        StateMachine::restore(Config::default(), machine.snapshot_to_vec().as_slice()).unwrap();
    let mut restored = restored;
    let retry = restored.apply(23, &put(owner(3), "third"));
    assert!(retry.duplicate);
    let foreign = restored.apply(
        24,
        &put(
            SessionSeq {
                client_id,
                seq: 3,
                secret: 7,
            },
            "x",
        ),
    );
    assert!(!foreign.duplicate && foreign.result.is_err());
}

/// Bytes of the work queues' section of a snapshot without queues.
const EMPTY_QUEUES_BYTES: usize = 4;
/// Bytes of format 5's sections (message senders, `never` groups) when both are empty.
const EMPTY_SENDERS_BYTES: usize = 2;

#[test]
fn a_format_1_snapshot_still_restores() {
    // Without sessions, formats 1, 2 and 3 encode the state alike; only the version differs.
    // Format 4 appends the auth state (37 bytes when empty) and then the work queues' section
    // (EMPTY_QUEUES_BYTES when empty); format 5 the message senders and `never` groups (EMPTY_SENDERS_BYTES).
    let mut machine = StateMachine::new(Config::default());
    machine.apply(1, &Command::new(1, Request::Put(PutRequest::new("k", "v"))));
    let image = machine.snapshot_to_vec();
    assert_eq!(&image[8..12], &5u32.to_le_bytes());
    let length = usize::try_from(u32::from_le_bytes(image[12..16].try_into().unwrap())).unwrap();
    let body = &image[20..20 + length - 37 - EMPTY_QUEUES_BYTES - EMPTY_SENDERS_BYTES];
    let mut bytes = image[..8].to_vec();
    bytes.extend_from_slice(&3u32.to_le_bytes());
    bytes.extend_from_slice(&u32::try_from(body.len()).unwrap().to_le_bytes());
    bytes.extend_from_slice(&crc32c::crc32c(body).to_le_bytes());
    bytes.extend_from_slice(body);
    bytes.extend_from_slice(&0u32.to_le_bytes());
    bytes.extend_from_slice(&crc32c::crc32c(body).to_le_bytes());
    for older in [1u32, 2, 3] {
        bytes[8..12].copy_from_slice(&older.to_le_bytes());
        let restored = StateMachine::restore(Config::default(), bytes.as_slice())
            .unwrap_or_else(|error| panic!("format {older}: {error}"));
        assert_eq!(restored.revision(), machine.revision());
    }
    bytes[8..12].copy_from_slice(&6u32.to_le_bytes());
    assert!(matches!(
        StateMachine::restore(Config::default(), bytes.as_slice()),
        Err(conclave_state::Error::SnapshotVersion { .. })
    ));
}
