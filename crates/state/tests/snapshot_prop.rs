//! Snapshot property: apply N commands, snapshot, restore, apply M more — identical to applying
//! N+M straight through, including every response and event, and the final snapshot bytes.
//! Plus: a damaged snapshot is refused, never a panic.

use bytes::Bytes;
use conclave_state::{
    ApplyOutput, Command, Compare, CompareResult, CompareTarget, Config, DeleteRangeRequest,
    GroupPolicy, GroupRegister, LeaderKey, LeaseCheckpoint, PutRequest, RangeRequest, Request,
    RequestOp, Response, Retention, SessionSeq, StateMachine, TxnRequest,
};
use proptest::prelude::*;

/// A command before session slots are resolved to real client ids.
#[derive(Clone, Debug)]
struct Step {
    advance_ms: u64,
    session: Option<(usize, u64)>,
    request: Request,
}

fn key() -> impl Strategy<Value = Bytes> {
    prop_oneof![Just("a"), Just("b"), Just("c"), Just("q/1"), Just("q/2")].prop_map(Bytes::from)
}

fn name() -> impl Strategy<Value = String> {
    prop_oneof![Just("g1"), Just("g2")].prop_map(str::to_owned)
}

fn request() -> impl Strategy<Value = Request> {
    let lease = 1i64..5;
    prop_oneof![
        (key(), any::<u8>(), 0i64..3).prop_map(|(key, value, lease)| Request::Put(PutRequest {
            lease,
            prev_kv: true,
            ..PutRequest::new(key, vec![value])
        })),
        key().prop_map(|key| Request::DeleteRange(DeleteRangeRequest {
            key,
            range_end: Bytes::from_static(b"\0"),
            prev_kv: true
        })),
        (key(), 0i64..3, key()).prop_map(|(compare_key, version, put_key)| Request::Txn(
            TxnRequest {
                compare: vec![Compare::new(
                    compare_key,
                    CompareResult::Equal,
                    CompareTarget::Version(version)
                )],
                success: vec![RequestOp::Put(PutRequest::new(put_key, "t"))],
                failure: vec![RequestOp::Range(RangeRequest::prefix("q/"))],
            }
        )),
        (0i64..30).prop_map(|revision| Request::Compact { revision }),
        (lease.clone(), 0u64..60_000).prop_map(|(id, ttl_ms)| Request::LeaseGrant { id, ttl_ms }),
        lease.clone().prop_map(|id| Request::LeaseRevoke { id }),
        (lease.clone(), proptest::option::of(0u64..40_000)).prop_map(|(id, deadline_ms)| {
            Request::LeaseCheckpoint {
                checkpoints: vec![LeaseCheckpoint { id, deadline_ms }],
            }
        }),
        lease
            .clone()
            .prop_map(|id| Request::LeaseExpire { ids: vec![id] }),
        (lease.clone(), any::<u8>()).prop_map(|(lease, v)| Request::Campaign {
            name: Bytes::from_static(b"e"),
            lease,
            value: Bytes::from(vec![v])
        }),
        (lease.clone(), 0i64..30).prop_map(|(lease, rev)| Request::Resign {
            leader: LeaderKey {
                name: Bytes::from_static(b"e"),
                key: Bytes::from(format!("e/{lease:x}")),
                rev,
                lease
            }
        }),
        lease.clone().prop_map(|lease| Request::Lock {
            name: Bytes::from_static(b"l"),
            lease
        }),
        (lease.clone(), proptest::option::of(0i64..30)).prop_map(|(lease, fence)| {
            Request::Unlock {
                key: Bytes::from(format!("l/{lease:x}")),
                fence,
            }
        }),
        (name(), 0usize..3, 0i64..4, lease.clone(), any::<bool>()).prop_map(
            |(group, c, priority, lease_id, preempt)| {
                Request::GroupRegister(GroupRegister {
                    group,
                    candidate: format!("c{c}"),
                    priority,
                    value: Bytes::from(vec![c as u8]),
                    lease_id,
                    preempt,
                })
            }
        ),
        (name(), 0usize..3, lease.clone()).prop_map(|(group, c, lease_id)| Request::GroupResign {
            group,
            candidate: format!("c{c}"),
            lease_id
        }),
        (name(), 0usize..3, 0i64..30).prop_map(|(group, c, fence)| Request::GroupProclaim {
            group,
            candidate: format!("c{c}"),
            fence,
            value: Bytes::from_static(b"p")
        }),
        (
            name(),
            any::<bool>(),
            proptest::option::of(1u64..3000),
            proptest::option::of(1u64..500)
        )
            .prop_map(|(group, preempt, handoff_timeout_ms, settle_ms)| {
                Request::GroupConfigure {
                    group,
                    policy: GroupPolicy {
                        preempt_never: false,
                        preempt,
                        handoff_timeout_ms,
                        settle_ms,
                    },
                }
            }),
        (0usize..2, 0u64..6).prop_map(|(t, seq)| Request::Ack {
            consumer: "bot".into(),
            topic: format!("t{t}"),
            seq
        }),
        (
            0usize..2,
            proptest::option::of(1u64..5),
            proptest::option::of(1u64..5000)
        )
            .prop_map(|(t, max_messages, max_age_ms)| {
                Request::TopicConfigure {
                    topic: format!("t{t}"),
                    retention: Retention {
                        max_messages,
                        max_age_ms,
                    },
                }
            }),
        Just(Request::OpenSession),
        Just(Request::Tick),
    ]
}

fn step() -> impl Strategy<Value = Step> {
    let session = prop_oneof![4 => Just(None), 1 => (0usize..3, 1u64..4).prop_map(Some)];
    (0u64..300, session, request()).prop_map(|(advance_ms, session, request)| Step {
        advance_ms,
        session,
        request,
    })
}

/// Resolves session slots against the clients opened so far and applies; returns the concrete
/// commands and their outputs.
fn run_straight(steps: &[Step]) -> (Vec<Command>, Vec<ApplyOutput>, StateMachine) {
    let mut machine = StateMachine::new(Config::default());
    let mut clients: Vec<u64> = Vec::new();
    let mut now_ms = 0;
    let mut commands = Vec::new();
    let mut outputs = Vec::new();
    for (position, step) in steps.iter().enumerate() {
        now_ms += step.advance_ms;
        let session = step.session.and_then(|(slot, seq)| {
            clients
                .get(slot % clients.len().max(1))
                .map(|client_id| SessionSeq {
                    client_id: *client_id,
                    seq,
                    secret: 0,
                })
        });
        let command = Command {
            leader_time_ms: now_ms,
            session,
            request: step.request.clone(),
        };
        let output = machine.apply(position as u64 + 1, &command);
        if let Ok(Response::SessionOpened { client_id }) = output.result {
            clients.push(client_id);
        }
        commands.push(command);
        outputs.push(output);
    }
    (commands, outputs, machine)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn snapshot_restore_then_continue_equals_straight_run(
        steps in proptest::collection::vec(step(), 2..120),
        split in any::<proptest::sample::Index>(),
    ) {
        let (commands, outputs, straight) = run_straight(&steps);
        let split = split.index(commands.len());
        let mut first = StateMachine::new(Config::default());
        for (position, command) in commands[..split].iter().enumerate() {
            first.apply(position as u64 + 1, command);
        }
        let bytes = first.snapshot_to_vec();
        let mut restored = StateMachine::restore(Config::default(), bytes.as_slice()).expect("restore");
        prop_assert_eq!(restored.snapshot_to_vec(), bytes);
        for (position, command) in commands.iter().enumerate().skip(split) {
            let output = restored.apply(position as u64 + 1, command);
            prop_assert_eq!(&output, &outputs[position], "command {} {:?}", position, command);
        }
        // Replaying the already-applied prefix after a restore changes nothing.
        for (position, command) in commands[..split].iter().enumerate() {
            let replay = restored.apply(position as u64 + 1, command);
            prop_assert!(replay.result.is_err());
        }
        prop_assert_eq!(restored.snapshot_to_vec(), straight.snapshot_to_vec());
        straight.check_invariants();
    }
}

fn sample_snapshot() -> Vec<u8> {
    let steps: Vec<Step> = (0..40)
        .map(|i| Step {
            advance_ms: 10,
            session: None,
            request: match i % 4 {
                0 => Request::LeaseGrant {
                    id: 0,
                    ttl_ms: 5000,
                },
                1 => Request::Put(PutRequest {
                    lease: 1,
                    ..PutRequest::new(format!("k{i}"), "v")
                }),
                2 => Request::Publish {
                    topic: "t".into(),
                    data: Bytes::from_static(b"m"),
                },
                _ => Request::GroupRegister(GroupRegister {
                    group: "g".into(),
                    candidate: format!("c{i}"),
                    priority: i,
                    lease_id: 1,
                    ..GroupRegister::default()
                }),
            },
        })
        .collect();
    run_straight(&steps).2.snapshot_to_vec()
}

#[test]
fn every_flipped_byte_is_refused() {
    let bytes = sample_snapshot();
    assert!(StateMachine::restore(Config::default(), bytes.as_slice()).is_ok());
    for position in 0..bytes.len() {
        let mut damaged = bytes.clone();
        damaged[position] ^= 0x40;
        let result = StateMachine::restore(Config::default(), damaged.as_slice());
        assert!(result.is_err(), "flip at {position} went unnoticed");
    }
}

#[test]
fn every_truncation_is_refused() {
    let bytes = sample_snapshot();
    for length in 0..bytes.len() {
        assert!(
            StateMachine::restore(Config::default(), &bytes[..length]).is_err(),
            "cut at {length}"
        );
    }
}

#[test]
fn a_large_snapshot_spans_many_frames() {
    let steps: Vec<Step> = (0..3000)
        .map(|i| Step {
            advance_ms: 1,
            session: None,
            request: Request::Put(PutRequest::new(format!("key-{i:05}"), vec![7u8; 100])),
        })
        .collect();
    let (_, _, machine) = run_straight(&steps);
    let bytes = machine.snapshot_to_vec();
    assert!(bytes.len() > 4 * 64 * 1024);
    let restored = StateMachine::restore(Config::default(), bytes.as_slice()).expect("restore");
    assert_eq!(restored.kv().live_key_count(), 3000);
    assert_eq!(restored.revision(), machine.revision());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// Arbitrary bytes are an error, never a panic, for both decoders.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = Command::decode(&bytes);
        let mut framed = b"CNCLSTAT\x01\x00\x00\x00".to_vec();
        framed.extend_from_slice(&bytes);
        prop_assert!(StateMachine::restore(Config::default(), framed.as_slice()).is_err());
    }

    /// Mutated valid commands decode to something or fail cleanly, and whatever decodes
    /// re-encodes to a command that decodes to itself.
    #[test]
    fn mutated_commands_decode_cleanly(step in step(), position in any::<proptest::sample::Index>(), flip in 1u8..=255) {
        let command = Command { leader_time_ms: step.advance_ms, session: None, request: step.request };
        let mut bytes = command.encode();
        let at = position.index(bytes.len());
        bytes[at] ^= flip;
        if let Ok(decoded) = Command::decode(&bytes) {
            prop_assert_eq!(Command::decode(&decoded.encode()), Ok(decoded));
        }
    }
}
