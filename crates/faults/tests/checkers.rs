//! The checkers against histories built by hand and at random: each anomaly they exist for is
//! caught (negative controls), and correct histories pass.

use conclave_faults::checkers::linearizable::{self, Entry, RegOp, Verdict};
use conclave_faults::checkers::{self, fence, lease, topic, watch};
use conclave_faults::history::{Event, Kind, Op, pair};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use serde_json::{Value, json};

#[allow(clippy::too_many_arguments)] // one line per history operation reads best in the tests
fn op(
    process: u64,
    f: &str,
    key: &str,
    args: Value,
    outcome: Kind,
    result: Value,
    invoke: u64,
    complete: u64,
) -> Op {
    Op {
        process,
        f: f.into(),
        key: key.into(),
        args,
        outcome,
        result,
        invoke_us: invoke,
        complete_us: if outcome == Kind::Info {
            u64::MAX
        } else {
            complete
        },
    }
}

fn entry(op: RegOp, invoke: u64, complete: Option<u64>, index: usize) -> Entry {
    Entry {
        op,
        invoke_us: invoke,
        complete_us: complete.unwrap_or(u64::MAX),
        required: complete.is_some(),
        index,
    }
}

// ---------- linearizability ----------

#[test]
fn a_sequential_register_history_is_linearizable() {
    let ops = vec![
        op(
            1,
            "write",
            "k",
            json!(1),
            Kind::Ok,
            json!({"rev": 2}),
            0,
            10,
        ),
        op(2, "read", "k", Value::Null, Kind::Ok, json!(1), 20, 30),
        op(
            1,
            "cas",
            "k",
            json!([1, 2]),
            Kind::Ok,
            json!({"succeeded": true, "rev": 3}),
            40,
            50,
        ),
        op(
            2,
            "cas",
            "k",
            json!([1, 3]),
            Kind::Ok,
            json!({"succeeded": false, "rev": 3}),
            60,
            70,
        ),
        op(2, "read", "k", Value::Null, Kind::Ok, json!(2), 80, 90),
    ];
    assert!(checkers::register(&ops).is_empty());
}

#[test]
fn negative_control_a_stale_read_is_caught() {
    // The read starts after the write of 2 completed, yet returns 1.
    let ops = vec![
        op(
            1,
            "write",
            "k",
            json!(1),
            Kind::Ok,
            json!({"rev": 2}),
            0,
            10,
        ),
        op(
            1,
            "write",
            "k",
            json!(2),
            Kind::Ok,
            json!({"rev": 3}),
            20,
            30,
        ),
        op(2, "read", "k", Value::Null, Kind::Ok, json!(1), 40, 50),
    ];
    let found = checkers::register(&ops);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("nonlinearizable"), "{found:?}");
}

#[test]
fn concurrent_operations_may_take_either_order() {
    // The read overlaps the write: old and new values are both fine.
    for seen in [Value::Null, json!(7)] {
        let ops = vec![
            op(
                1,
                "write",
                "k",
                json!(7),
                Kind::Ok,
                json!({"rev": 2}),
                0,
                100,
            ),
            op(2, "read", "k", Value::Null, Kind::Ok, seen, 10, 20),
        ];
        assert!(checkers::register(&ops).is_empty());
    }
}

#[test]
fn an_unknown_write_may_apply_late_but_a_failed_one_never() {
    let late = vec![
        op(
            1,
            "write",
            "k",
            json!(5),
            Kind::Info,
            json!("timeout"),
            0,
            0,
        ),
        op(2, "read", "k", Value::Null, Kind::Ok, Value::Null, 10, 20),
        op(2, "read", "k", Value::Null, Kind::Ok, json!(5), 1000, 1010),
    ];
    assert!(checkers::register(&late).is_empty());
    let mut failed = late.clone();
    failed[0] = op(
        1,
        "write",
        "k",
        json!(5),
        Kind::Fail,
        json!("connection_failed"),
        0,
        5,
    );
    assert_eq!(checkers::register(&failed).len(), 1);
}

#[test]
fn negative_control_a_value_that_goes_back_is_caught() {
    // Two sequential reads see 2 then 1 while only one write of each happened, 1 before 2.
    let ops = vec![
        op(
            1,
            "write",
            "k",
            json!(1),
            Kind::Ok,
            json!({"rev": 2}),
            0,
            10,
        ),
        op(
            1,
            "write",
            "k",
            json!(2),
            Kind::Ok,
            json!({"rev": 3}),
            20,
            200,
        ),
        op(2, "read", "k", Value::Null, Kind::Ok, json!(2), 30, 40),
        op(2, "read", "k", Value::Null, Kind::Ok, json!(1), 50, 60),
    ];
    assert_eq!(checkers::register(&ops).len(), 1);
}

fn arb_op() -> impl Strategy<Value = RegOp> {
    prop_oneof![
        (prop::option::of(0i64..3)).prop_map(RegOp::Read),
        (0i64..3).prop_map(RegOp::Write),
        (0i64..3, 0i64..3, prop::option::of(any::<bool>())).prop_map(|(from, to, succeeded)| {
            RegOp::Cas {
                from,
                to,
                succeeded,
            }
        }),
    ]
}

fn arb_history() -> impl Strategy<Value = Vec<Entry>> {
    prop::collection::vec((arb_op(), 0u64..40, 0u64..20, any::<bool>()), 0..7).prop_map(|ops| {
        let mut entries: Vec<Entry> = ops
            .into_iter()
            .enumerate()
            .map(|(i, (op, start, len, known))| {
                // Reads and CASes with a known result must be known; unknown ones are writes.
                let unknown = !known
                    && matches!(
                        op,
                        RegOp::Write(_)
                            | RegOp::Cas {
                                succeeded: None,
                                ..
                            }
                    );
                let op = match op {
                    RegOp::Cas {
                        from,
                        to,
                        succeeded: None,
                    } if !unknown => RegOp::Cas {
                        from,
                        to,
                        succeeded: Some(true),
                    },
                    other => other,
                };
                entry(op, start, (!unknown).then_some(start + len), i)
            })
            .collect();
        entries.sort_by_key(|e| e.invoke_us);
        entries
    })
}

/// A history produced by a real register: every operation takes effect at one instant
/// inside its interval, so it must be found linearizable.
fn arb_real_history() -> impl Strategy<Value = Vec<Entry>> {
    prop::collection::vec(
        (0u8..3, 0i64..3, 0i64..3, 0u64..10, 0u64..10, any::<bool>()),
        0..9,
    )
    .prop_map(|ops| {
        let mut value: Option<i64> = None;
        let mut entries = Vec::new();
        for (i, (kind, a, b, before, after, known)) in ops.into_iter().enumerate() {
            // Effect at time 10*i; the interval stretches around it, so intervals overlap.
            let at = 100 + 10 * i as u64;
            let (op, can_be_unknown) = match kind {
                0 => (RegOp::Read(value), false),
                1 => {
                    value = Some(a);
                    (RegOp::Write(a), true)
                }
                _ => {
                    let succeeded = value == Some(a);
                    if succeeded {
                        value = Some(b);
                    }
                    (
                        RegOp::Cas {
                            from: a,
                            to: b,
                            succeeded: Some(succeeded),
                        },
                        succeeded,
                    )
                }
            };
            let unknown = can_be_unknown && !known;
            let op = match op {
                RegOp::Cas { from, to, .. } if unknown => RegOp::Cas {
                    from,
                    to,
                    succeeded: None,
                },
                other => other,
            };
            entries.push(entry(
                op,
                at - before * 3,
                (!unknown).then_some(at + after * 3),
                i,
            ));
        }
        entries.sort_by_key(|e| e.invoke_us);
        entries
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    #[test]
    fn the_search_agrees_with_brute_force(entries in arb_history()) {
        let fast = linearizable::check(&entries);
        let slow = linearizable::brute_force(&entries);
        let decided = !matches!(fast, Verdict::Unknown { states: _ });
        prop_assert!(decided);
        prop_assert_eq!(fast == Verdict::Linearizable, slow, "{:?}", entries);
    }

    #[test]
    fn histories_of_a_real_register_pass(entries in arb_real_history()) {
        prop_assert_eq!(linearizable::check(&entries), Verdict::Linearizable, "{:?}", entries);
        prop_assert!(linearizable::brute_force(&entries));
    }
}

#[test]
fn the_random_histories_include_nonlinearizable_ones() {
    // Guards the property above against a generator that only makes easy cases.
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = arb_history();
    let mut bad = 0;
    for _ in 0..500 {
        let entries = strategy.new_tree(&mut runner).expect("a history").current();
        if !linearizable::brute_force(&entries) {
            bad += 1;
        }
    }
    assert!(
        bad > 50,
        "only {bad} of 500 random histories were not linearizable"
    );
}

// ---------- fencing ----------

fn write(process: u64, fence: u64, within: bool, accepted: bool, t: u64) -> Op {
    let kind = if accepted { Kind::Ok } else { Kind::Fail };
    op(
        process,
        "resource",
        "lock",
        json!({"fence": fence, "within_deadline": within}),
        kind,
        Value::Null,
        t,
        t + 1,
    )
}

fn acquire(process: u64, fence: u64, invoke: u64, complete: u64) -> Op {
    op(
        process,
        "acquire",
        "lock",
        Value::Null,
        Kind::Ok,
        json!({"fence": fence}),
        invoke,
        complete,
    )
}

#[test]
fn a_fenced_handover_passes() {
    let ops = vec![
        acquire(1, 10, 0, 5),
        write(1, 10, true, true, 10),
        acquire(2, 12, 15, 3000),
        write(2, 12, true, true, 3010),
        // The paused first holder wakes up: refused, and it knew its lease was over.
        write(1, 10, false, false, 4000),
    ];
    assert!(fence::check(&ops).is_empty());
}

#[test]
fn negative_control_an_unfenced_resource_lets_a_paused_holder_interleave() {
    let ops = vec![
        acquire(1, 10, 0, 5),
        write(1, 10, true, true, 10),
        acquire(2, 12, 15, 3000),
        write(2, 12, true, true, 3010),
        write(1, 10, false, true, 4000),
    ];
    let found = fence::check(&ops);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("interleaved"));
}

#[test]
fn negative_control_a_refused_holder_within_its_lease_is_an_exclusion_violation() {
    let ops = vec![
        acquire(1, 10, 0, 5),
        acquire(2, 12, 1, 6),
        write(2, 12, true, true, 7),
        write(1, 10, true, false, 8),
    ];
    assert!(
        fence::check(&ops)
            .iter()
            .any(|a| a.starts_with("exclusion"))
    );
}

/// A refused write `left_us` before the holder's deadline, at `t`.
fn refused_with_time_left(process: u64, fence: u64, left_us: u64, t: u64) -> Op {
    op(
        process,
        "resource",
        "election",
        json!({"fence": fence, "within_deadline": true, "deadline_left_us": left_us}),
        Kind::Fail,
        Value::Null,
        t,
        t + 1,
    )
}

/// The case of the 15-minute run of 2026-12-07 (seed 11): the only voter led with its clock at
/// rate 0.5 for 2.9 s and was then restarted at the real rate; a holder whose session it had
/// renewed was refused 0.6 s before its own deadline, as the leader resumed the lease at the
/// deadline the slow clock had stamped. Allowed for up to the clock's lag, and no further.
#[test]
fn a_refusal_a_slow_clocks_lag_explains_is_allowed_and_no_other() {
    const TTL_US: u64 = 2_000_000;
    let slow = lease::SlowClock {
        start_us: 597_611_141,
        end_us: 600_511_669,
        rate: 0.5,
    };
    // The clock's lag once it stopped: (end - (start - 0.2 s)) * 0.5, about 1.55 s.
    let lag_us = slow.lag_us(601_428_912);
    assert!((1_500_000..1_600_000).contains(&lag_us), "{lag_us}");
    let history = |left_us: u64| {
        vec![
            acquire(303, 152_270, 600_024_517, 600_457_583),
            acquire(302, 152_401, 600_681_901, 601_413_781),
            refused_with_time_left(303, 152_270, left_us, 601_428_912),
        ]
    };
    let exclusions = |ops: &[Op], clocks: &[lease::SlowClock]| {
        fence::check_with_slow_clocks(ops, clocks, TTL_US)
            .into_iter()
            .filter(|a| a.starts_with("exclusion"))
            .count()
    };
    assert_eq!(exclusions(&history(600_000), &[slow]), 0);
    assert_eq!(exclusions(&history(lag_us), &[slow]), 0);
    // Earlier than the lag allows, or without the slow clock, it is two holders at once.
    assert_eq!(exclusions(&history(lag_us + 1), &[slow]), 1);
    assert_eq!(exclusions(&history(600_000), &[]), 1);
    // A slow clock that was over more than a TTL before the refusal stamped nothing still
    // valid then.
    let long_over = lease::SlowClock {
        start_us: 590_000_000,
        end_us: 599_000_000,
        rate: 0.5,
    };
    assert_eq!(exclusions(&history(600_000), &[long_over]), 1);
    // A write recorded without the time left (older histories) is judged as before.
    assert_eq!(
        exclusions(
            &[
                acquire(1, 10, 0, 5),
                acquire(2, 12, 1, 6),
                write(1, 10, true, false, 600_500_000)
            ],
            &[slow]
        ),
        1
    );
}

#[test]
fn negative_control_reused_and_backward_fences_are_caught() {
    let reused = fence::check(&[acquire(1, 10, 0, 5), acquire(2, 10, 10, 15)]);
    assert!(
        reused.iter().any(|a| a.starts_with("fence-reused")),
        "{reused:?}"
    );
    assert!(
        reused.iter().any(|a| a.starts_with("fence-order")),
        "{reused:?}"
    );
    let backward = fence::check(&[acquire(1, 10, 0, 5), acquire(2, 9, 10, 15)]);
    assert!(
        backward.iter().any(|a| a.starts_with("fence-order")),
        "{backward:?}"
    );
}

// ---------- leases ----------

const BOUNDS: lease::LeaseBounds = lease::LeaseBounds {
    election_timeout_us: 300_000,
    slack_us: 2_000_000,
    clock_drift_ppm: 0,
};

fn lease_op(f: &str, outcome: Kind, result: Value, invoke: u64, complete: u64) -> Op {
    let args = if f == "grant" {
        json!({"ttl_ms": 3000})
    } else {
        Value::Null
    };
    op(1, f, "lease-1", args, outcome, result, invoke, complete)
}

#[test]
fn negative_control_the_early_expiry_of_the_issue_is_caught() {
    // Gone 2.996 s after the last keepalive was sent, with a 3 s TTL (issue 12's finding).
    let ops = vec![
        lease_op("grant", Kind::Ok, Value::Null, 0, 1_000),
        lease_op("keepalive", Kind::Ok, json!(3000), 1_000_000, 1_002_000),
        lease_op("stop", Kind::Ok, Value::Null, 1_003_000, 1_003_000),
        lease_op("probe", Kind::Ok, json!(true), 3_900_000, 3_901_000),
        lease_op("probe", Kind::Ok, json!(false), 3_990_000, 3_996_000),
    ];
    let found = lease::check(&ops, BOUNDS, &[]);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].starts_with("early-expiry") && found[0].contains("2.996"),
        "{found:?}"
    );
}

#[test]
fn an_expiry_just_after_the_ttl_passes_and_a_late_one_is_caught() {
    let on_time = vec![
        lease_op("grant", Kind::Ok, Value::Null, 0, 1_000),
        lease_op("keepalive", Kind::Ok, json!(3000), 1_000_000, 1_002_000),
        lease_op("stop", Kind::Ok, Value::Null, 1_003_000, 1_003_000),
        lease_op("probe", Kind::Ok, json!(true), 3_990_000, 3_995_000),
        lease_op("probe", Kind::Ok, json!(false), 4_000_000, 4_010_000),
    ];
    assert!(lease::check(&on_time, BOUNDS, &[]).is_empty());
    let mut late = on_time.clone();
    late[3] = lease_op("probe", Kind::Ok, json!(true), 7_000_000, 7_001_000);
    late[4] = lease_op("probe", Kind::Ok, json!(false), 7_100_000, 7_101_000);
    let found = lease::check(&late, BOUNDS, &[]);
    assert!(
        found.len() == 1 && found[0].starts_with("late-expiry"),
        "{found:?}"
    );
    // The same delay is fine when a fault kept the cluster from acting for long enough.
    assert!(lease::check(&late, BOUNDS, &[(2_000_000, 4_000_000)]).is_empty());
}

#[test]
fn negative_control_a_keepalive_refused_before_the_ttl_is_caught() {
    let ops = vec![
        lease_op("grant", Kind::Ok, Value::Null, 0, 1_000),
        lease_op("keepalive", Kind::Fail, json!("gone"), 2_000_000, 2_001_000),
    ];
    assert!(
        lease::check(&ops, BOUNDS, &[])
            .iter()
            .any(|a| a.starts_with("early-expiry"))
    );
}

// ---------- watches ----------

fn reg_write(value: i64, rev: i64) -> Op {
    op(
        1,
        "write",
        "k",
        json!(value),
        Kind::Ok,
        json!({"rev": rev}),
        rev as u64 * 10,
        rev as u64 * 10 + 5,
    )
}

fn watch_history(revs: &[(i64, i64)], from: i64, to: i64) -> Vec<Op> {
    let mut events = Vec::new();
    let mut t = 0;
    for (rev, value) in revs {
        t += 1;
        events.push(Event {
            process: 7,
            kind: Kind::Invoke,
            f: "event".into(),
            key: String::new(),
            value: Value::Null,
            time_us: t,
        });
        events.push(Event {
            process: 7,
            kind: Kind::Ok,
            f: "event".into(),
            key: String::new(),
            value: json!({"rev": rev, "key": "k", "value": value}),
            time_us: t,
        });
    }
    events.push(Event {
        process: 7,
        kind: Kind::Invoke,
        f: "cover".into(),
        key: String::new(),
        value: Value::Null,
        time_us: t + 1,
    });
    events.push(Event {
        process: 7,
        kind: Kind::Ok,
        f: "cover".into(),
        key: String::new(),
        value: json!({"from": from, "to": to}),
        time_us: t + 1,
    });
    pair(&events).expect("a well-formed history")
}

#[test]
fn watch_controls() {
    let writes = vec![reg_write(100, 2), reg_write(101, 3), reg_write(102, 4)];
    let good = watch_history(&[(2, 100), (3, 101), (4, 102)], 2, 4);
    assert!(watch::check(&good, &writes).is_empty());
    let missing = watch::check(&watch_history(&[(2, 100), (4, 102)], 2, 4), &writes);
    assert!(
        missing.len() == 1 && missing[0].starts_with("watch-missing"),
        "{missing:?}"
    );
    let duplicate = watch::check(
        &watch_history(&[(2, 100), (3, 101), (3, 101), (4, 102)], 2, 4),
        &writes,
    );
    assert!(
        duplicate.iter().any(|a| a.starts_with("watch-order")),
        "{duplicate:?}"
    );
    let reordered = watch::check(
        &watch_history(&[(3, 101), (2, 100), (4, 102)], 2, 4),
        &writes,
    );
    assert!(
        reordered.iter().any(|a| a.starts_with("watch-order")),
        "{reordered:?}"
    );
    let phantom = watch::check(
        &watch_history(&[(2, 100), (3, 999), (4, 102)], 2, 4),
        &writes,
    );
    assert!(
        phantom.iter().any(|a| a.starts_with("watch-phantom")),
        "{phantom:?}"
    );
    // Writes outside the covered range are not expected.
    assert!(watch::check(&watch_history(&[(3, 101), (4, 102)], 3, 4), &writes).is_empty());
}

// ---------- topics ----------

fn publish(process: u64, topic: &str, data: &str, seq: u64, invoke: u64, complete: u64) -> Op {
    op(
        process,
        "publish",
        topic,
        json!(data),
        Kind::Ok,
        json!({"seq": seq}),
        invoke,
        complete,
    )
}

fn inbox(process: u64, messages: Value, invoke: u64, complete: u64) -> Op {
    op(
        process,
        "inbox",
        "c",
        Value::Null,
        Kind::Ok,
        messages,
        invoke,
        complete,
    )
}

fn ack(process: u64, topic: &str, seq: u64, invoke: u64, complete: u64) -> Op {
    op(
        process,
        "ack",
        topic,
        json!({"seq": seq}),
        Kind::Ok,
        json!({"acked": seq}),
        invoke,
        complete,
    )
}

fn drained(process: u64, at: u64) -> Op {
    op(
        process,
        "drained",
        "c",
        Value::Null,
        Kind::Ok,
        Value::Null,
        at,
        at,
    )
}

/// Two publishes, read, acknowledged, then an empty inbox: correct.
fn topic_history() -> Vec<Op> {
    vec![
        publish(1, "t", "a", 1, 0, 10),
        publish(1, "t", "b", 2, 20, 30),
        inbox(9, json!([["t", 1, "a"], ["t", 2, "b"]]), 40, 50),
        ack(9, "t", 2, 60, 70),
        inbox(9, json!([]), 80, 90),
        drained(9, 100),
    ]
}

fn kinds(anomalies: &[String]) -> Vec<&str> {
    anomalies
        .iter()
        .map(|a| a.split(':').next().unwrap_or(""))
        .collect()
}

#[test]
fn topic_controls() {
    assert_eq!(topic::check(&topic_history()), Vec::<String>::new());
    // A consumer that acknowledged a message it never read: it is lost for it.
    let mut lost = topic_history();
    lost[2] = inbox(9, json!([["t", 1, "a"]]), 40, 50);
    assert_eq!(kinds(&topic::check(&lost)), ["topic-lost"]);
    // A message delivered again after its acknowledgement completed.
    let mut again = topic_history();
    again[4] = inbox(9, json!([["t", 2, "b"]]), 80, 90);
    assert_eq!(kinds(&topic::check(&again)), ["topic-duplicate"]);
    // Redelivery before the acknowledgement completed is allowed (at least once).
    let mut early = topic_history();
    early.insert(4, inbox(9, json!([["t", 2, "b"]]), 61, 65));
    assert_eq!(topic::check(&early), Vec::<String>::new());
    // Out of order within one answer, and a phantom.
    let mut reordered = topic_history();
    reordered[2] = inbox(9, json!([["t", 2, "b"], ["t", 1, "a"]]), 40, 50);
    assert_eq!(kinds(&topic::check(&reordered)), ["topic-order"]);
    let mut phantom = topic_history();
    phantom[4] = inbox(9, json!([["t", 3, "zz"]]), 80, 90);
    assert_eq!(kinds(&topic::check(&phantom)), ["topic-phantom"]);
    // A later publish with a lower seq, a seq given twice, a publish applied twice.
    let mut backwards = topic_history();
    backwards[1] = publish(1, "t", "b", 1, 20, 30);
    assert!(kinds(&topic::check(&backwards)).contains(&"topic-order"));
    assert!(kinds(&topic::check(&backwards)).contains(&"topic-seq"));
    let mut twice = topic_history();
    twice.push(publish(2, "t", "a", 3, 200, 210));
    assert!(kinds(&topic::check(&twice)).contains(&"topic-seq"));
    // A consumer that never drained is reported, never passed.
    let mut undrained = topic_history();
    undrained.pop();
    assert_eq!(kinds(&topic::check(&undrained)), ["topic-undrained"]);
}

#[test]
fn a_lease_stamped_by_a_slow_leader_may_end_early_by_its_lag_and_no_more() {
    // The TLS run's case: a 2 s lease granted while a member ran at rate 0.9 (restarted 3 s
    // before), gone 1.77 s after the grant's send once a member with a true clock led.
    let grant = |invoke: u64| {
        op(
            1,
            "grant",
            "lease-1",
            json!({"ttl_ms": 2000}),
            Kind::Ok,
            Value::Null,
            invoke,
            invoke + 1_000,
        )
    };
    let gone_at = |at: u64| {
        op(
            1,
            "probe",
            "lease-1",
            Value::Null,
            Kind::Ok,
            json!(false),
            at - 1_000,
            at,
        )
    };
    let slow = lease::SlowClock {
        start_us: 10_000_000,
        end_us: 13_300_000,
        rate: 0.9,
    };
    let ops = vec![grant(13_000_000), gone_at(14_770_000)];
    // Without the slow clock it is an early expiry...
    assert!(
        lease::check(&ops, BOUNDS, &[])
            .iter()
            .any(|a| a.starts_with("early-expiry")),
    );
    // ...with it, within the 0.35 s the clock can have lagged (rate 0.9 for 3.3 s, plus the
    // start margin).
    assert!(lease::check_with_slow_clocks(&ops, BOUNDS, &[], &[slow]).is_empty());
    // Earlier than the lag allows is still caught.
    let too_early = vec![grant(13_000_000), gone_at(14_500_000)];
    assert!(
        lease::check_with_slow_clocks(&too_early, BOUNDS, &[], &[slow])
            .iter()
            .any(|a| a.starts_with("early-expiry")),
    );
    // A slow clock that ended before the grant was sent excuses nothing, though its lag
    // (0.31 s) would cover this expiry.
    let over = lease::SlowClock {
        end_us: 12_900_000,
        ..slow
    };
    assert!(
        lease::check_with_slow_clocks(&ops, BOUNDS, &[], &[over])
            .iter()
            .any(|a| a.starts_with("early-expiry")),
    );
}

#[test]
fn slow_clocks_are_read_from_the_skew_faults() {
    let fault = |key: &str, value: &str| {
        op(
            0,
            "fault",
            key,
            json!(value),
            Kind::Ok,
            json!("healed"),
            1_000,
            2_000,
        )
    };
    let faults = vec![
        fault("member 1 restarted with its clock at rate 0.5", "skew"),
        fault("member 2 restarted with its clock at rate 1.01", "skew"),
        fault("kill -9 member 3", "kill"),
    ];
    assert_eq!(
        lease::SlowClock::from_faults(&faults),
        vec![lease::SlowClock {
            start_us: 1_000,
            end_us: 2_000,
            rate: 0.5
        }]
    );
}
