//! Pins the binary encoding of commands: Raft logs and snapshots outlive a build, so a change
//! here must be deliberate (append new variants at the end, never reorder).

use bytes::Bytes;
use conclave_state::{
    Command, Compare, CompareResult, CompareTarget, GroupPolicy, GroupRegister, LeaseCheckpoint,
    PutRequest, Request, RequestOp, SessionSeq, TxnRequest,
};

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

#[test]
fn command_encoding_is_stable() {
    let cases: Vec<(Command, &str)> = vec![
        (
            Command::new(1000, Request::Put(PutRequest::new("k", "v"))),
            "e8070001016b017600000000",
        ),
        (
            Command {
                leader_time_ms: 7,
                session: Some(SessionSeq {
                    client_id: 3,
                    seq: 9,
                    secret: 0,
                }),
                request: Request::Txn(TxnRequest {
                    compare: vec![Compare::new(
                        "k",
                        CompareResult::Equal,
                        CompareTarget::Version(0),
                    )],
                    success: vec![RequestOp::Put(PutRequest::new("k", "v"))],
                    failure: vec![],
                }),
            },
            "070103090301016b000000000101016b01760000000000",
        ),
        (
            Command::new(
                1,
                Request::LeaseGrant {
                    id: 5,
                    ttl_ms: 3000,
                },
            ),
            "0100050ab817",
        ),
        (
            Command::new(
                1,
                Request::LeaseCheckpoint {
                    checkpoints: vec![LeaseCheckpoint {
                        id: 5,
                        deadline_ms: Some(9),
                    }],
                },
            ),
            "010007010a0109",
        ),
        (
            Command::new(
                1,
                Request::GroupRegister(GroupRegister {
                    group: "g".into(),
                    candidate: "c".into(),
                    priority: -1,
                    value: Bytes::from_static(b"x"),
                    lease_id: 5,
                    preempt: true,
                }),
            ),
            "01000e016701630101780a01",
        ),
        (
            Command::new(
                1,
                Request::GroupConfigure {
                    group: "g".into(),
                    policy: GroupPolicy {
                        preempt_never: false,
                        preempt: true,
                        handoff_timeout_ms: Some(10),
                        settle_ms: None,
                    },
                },
            ),
            "010011016701010a00",
        ),
        (
            Command::new(
                1,
                Request::Publish {
                    topic: "t".into(),
                    data: Bytes::from_static(b"d"),
                },
            ),
            "01001201740164",
        ),
        (
            Command::new(
                1,
                Request::PublishFrom {
                    topic: "t".into(),
                    data: Bytes::from_static(b"d"),
                    from: "a".into(),
                },
            ),
            "010021017401640161",
        ),
        (
            Command::new(
                1,
                Request::GroupConfigurePreempt {
                    group: "g".into(),
                    policy: GroupPolicy::default(),
                    preempt_policy: conclave_state::PreemptPolicy::Never,
                },
            ),
            "010022016700000002",
        ),
        (Command::new(1, Request::Tick), "010017"),
    ];
    for (command, expected) in &cases {
        let encoded = hex(&command.encode());
        assert_eq!(&encoded, expected, "{command:?}");
    }
}
