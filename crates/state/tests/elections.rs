//! Scenario tests for priority election groups and etcd's Election recipe.

mod common;

use bytes::Bytes;
use common::{Driver, election_events};
use conclave_state::{
    Compare, CompareResult, CompareTarget, ElectionEventKind, Error, GroupPolicy, LeaderKey,
    LeaseCheckpoint, PutRequest, QueueStatus, Request, RequestOp, Response, TxnRequest,
    group_leader_key,
};

#[test]
fn ties_go_to_the_smallest_id_whatever_the_arrival_order() {
    for order in [["b", "a", "c"], ["c", "b", "a"], ["a", "c", "b"]] {
        let mut driver = Driver::new();
        let leases: Vec<i64> = order.iter().map(|_| driver.grant(10_000)).collect();
        // The first arrival takes the empty seat (stability keeps it there). When it goes,
        // the successor among equals must be the smallest id, whatever the arrival order.
        for (candidate, lease) in order.iter().zip(&leases) {
            driver.register("g", candidate, 5, *lease);
        }
        let first = order[0];
        assert_eq!(
            driver.leader_of("g").as_deref(),
            Some(first),
            "the first arrival takes an empty seat"
        );
        driver.expire(leases[0]);
        let survivors: Vec<&str> = order[1..].to_vec();
        let expected = survivors.iter().min().copied();
        assert_eq!(
            driver.leader_of("g").as_deref(),
            expected,
            "order {order:?}"
        );
        let succession: Vec<String> = driver
            .machine
            .group_succession("g")
            .iter()
            .map(|c| c.id.clone())
            .collect();
        let mut sorted: Vec<String> = survivors.iter().map(|s| s.to_string()).collect();
        sorted.sort();
        assert_eq!(succession, sorted);
    }
}

#[test]
fn highest_priority_wins_an_empty_seat() {
    let mut driver = Driver::new();
    let low = driver.grant(10_000);
    let high = driver.grant(10_000);
    let holder = driver.grant(10_000);
    driver.register("g", "holder", 100, holder);
    driver.register("g", "low", 1, low);
    driver.register("g", "high", 9, high);
    driver.ok(Request::GroupResign {
        group: "g".into(),
        candidate: "holder".into(),
        lease_id: holder,
    });
    assert_eq!(driver.leader_of("g").as_deref(), Some("high"));
}

#[test]
fn sitting_leader_keeps_the_seat_without_preemption() {
    let mut driver = Driver::new();
    let (low, high) = (driver.grant(10_000), driver.grant(10_000));
    driver.register("g", "low", 1, low);
    let output = driver.register("g", "high", 9, high);
    assert_eq!(driver.leader_of("g").as_deref(), Some("low"));
    assert!(
        !election_events(&output.events)
            .iter()
            .any(|kind| matches!(kind, ElectionEventKind::HandoffRequested { .. }))
    );
}

#[test]
fn preemption_hands_off_only_when_the_incumbent_resigns() {
    let mut driver = Driver::new();
    driver.configure(
        "g",
        GroupPolicy {
            preempt_never: false,
            preempt: true,
            handoff_timeout_ms: None,
            settle_ms: None,
        },
    );
    let (low, high) = (driver.grant(10_000), driver.grant(10_000));
    driver.register("g", "low", 1, low);
    let first_seat = driver.machine.group_leader("g").cloned().expect("seat");
    let output = driver.register("g", "high", 9, high);
    let kinds = election_events(&output.events);
    assert!(kinds.iter().any(|kind| matches!(kind, ElectionEventKind::HandoffRequested { challenger, .. } if challenger == "high")));
    // Still exactly one leader, the incumbent, now in handoff.
    let seat = driver.machine.group_leader("g").cloned().expect("seat");
    assert_eq!(seat.leader, "low");
    assert_eq!(
        seat.handoff.as_ref().map(|h| h.challenger.as_str()),
        Some("high")
    );
    let output = driver.apply(Request::GroupResign {
        group: "g".into(),
        candidate: "low".into(),
        lease_id: low,
    });
    let seat = driver.machine.group_leader("g").cloned().expect("seat");
    assert_eq!(seat.leader, "high");
    assert!(seat.fence > first_seat.fence);
    assert_eq!(driver.machine.group("g").map(|g| g.term), Some(2));
    let kinds = election_events(&output.events);
    assert!(
        kinds.iter().any(
            |kind| matches!(kind, ElectionEventKind::Elected { leader, .. } if leader == "high")
        )
    );
}

/// Group "g" preempts with a 500 ms handoff timeout, and "low" (priority 1) holds its seat.
/// Returns the leases of "low" and of a "high" candidate not registered yet.
fn group_with_handoff_timeout(driver: &mut Driver) -> (i64, i64) {
    driver.configure(
        "g",
        GroupPolicy {
            preempt_never: false,
            preempt: true,
            handoff_timeout_ms: Some(500),
            settle_ms: None,
        },
    );
    let (low, high) = (driver.grant(100_000), driver.grant(100_000));
    driver.register("g", "low", 1, low);
    (low, high)
}

#[test]
fn handoff_timeout_moves_the_seat_on_tick() {
    let mut driver = Driver::new();
    let (_, high) = group_with_handoff_timeout(&mut driver);
    driver.now_ms = 1000;
    driver.register("g", "high", 9, high);
    assert_eq!(driver.machine.next_timer_ms(), Some(1500));
    driver.now_ms = 1499;
    driver.ok(Request::Tick);
    assert_eq!(driver.leader_of("g").as_deref(), Some("low"));
    driver.now_ms = 1500;
    driver.ok(Request::Tick);
    assert_eq!(driver.leader_of("g").as_deref(), Some("high"));
}

#[test]
fn the_group_timer_memo_walks_again_only_after_a_change_and_agrees_with_the_walk() {
    let mut driver = Driver::new();
    let mut memo = conclave_state::GroupTimerMemo::default();
    let expect = |driver: &Driver, memo: &mut conclave_state::GroupTimerMemo, want| {
        assert_eq!(driver.machine.next_timer_ms(), want);
        assert_eq!(driver.machine.next_timer_ms_memo(memo), want);
    };
    expect(&driver, &mut memo, None);
    let (_, high) = group_with_handoff_timeout(&mut driver);
    expect(&driver, &mut memo, None);
    let walks = memo.walks();
    // Asked again with nothing changed: no walk.
    expect(&driver, &mut memo, None);
    expect(&driver, &mut memo, None);
    assert_eq!(memo.walks(), walks, "no group changed, so no walk");
    // A write that touches no group leaves the memo alone too.
    driver.ok(Request::Put(conclave_state::PutRequest {
        key: Bytes::from_static(b"unrelated"),
        value: Bytes::from_static(b"v"),
        ..Default::default()
    }));
    expect(&driver, &mut memo, None);
    assert_eq!(memo.walks(), walks, "a put touches no group");
    // Same group count, a timer appears: the challenger starts a handoff.
    driver.now_ms = 1000;
    driver.register("g", "high", 9, high);
    expect(&driver, &mut memo, Some(1500));
    assert_eq!(memo.walks(), walks + 1);
    // The handoff completes on the Tick and the timer is gone again.
    driver.now_ms = 1500;
    driver.ok(Request::Tick);
    expect(&driver, &mut memo, None);
    assert_eq!(driver.leader_of("g").as_deref(), Some("high"));
}

#[test]
fn challenger_preempt_flag_works_in_a_non_preempting_group() {
    let mut driver = Driver::new();
    let (low, high) = (driver.grant(10_000), driver.grant(10_000));
    driver.register("g", "low", 1, low);
    driver.ok(Request::GroupRegister(conclave_state::GroupRegister {
        group: "g".into(),
        candidate: "high".into(),
        priority: 9,
        value: Bytes::new(),
        lease_id: high,
        preempt: true,
    }));
    let seat = driver.machine.group_leader("g").cloned().expect("seat");
    assert_eq!(seat.handoff.map(|h| h.challenger), Some("high".to_owned()));
}

#[test]
fn leader_lease_expiry_during_handoff_elects_the_challenger() {
    let mut driver = Driver::new();
    driver.configure(
        "g",
        GroupPolicy {
            preempt_never: false,
            preempt: true,
            handoff_timeout_ms: Some(60_000),
            settle_ms: None,
        },
    );
    let (low, high) = (driver.grant(10_000), driver.grant(10_000));
    driver.register("g", "low", 1, low);
    driver.register("g", "high", 9, high);
    assert!(
        driver
            .machine
            .group_leader("g")
            .is_some_and(|seat| seat.handoff.is_some())
    );
    let output = driver.apply(Request::LeaseExpire { ids: vec![low] });
    let seat = driver.machine.group_leader("g").cloned().expect("seat");
    assert_eq!(seat.leader, "high");
    assert!(seat.handoff.is_none());
    // Exactly one Elected, no Vacant in between: never two leaders, never a needless gap.
    let kinds = election_events(&output.events);
    assert_eq!(
        kinds
            .iter()
            .filter(|k| matches!(k, ElectionEventKind::Elected { .. }))
            .count(),
        1
    );
    assert!(!kinds.iter().any(|k| matches!(k, ElectionEventKind::Vacant)));
}

#[test]
fn last_candidate_leaving_makes_the_seat_vacant() {
    let mut driver = Driver::new();
    let lease = driver.grant(10_000);
    driver.register("g", "only", 1, lease);
    let output = driver.apply(Request::LeaseRevoke { id: lease });
    assert!(driver.machine.group_leader("g").is_none());
    assert!(
        election_events(&output.events)
            .iter()
            .any(|k| matches!(k, ElectionEventKind::Vacant))
    );
    assert!(driver.machine.kv().get(&group_leader_key("g")).is_none());
    assert_eq!(driver.machine.group("g").map(|g| g.term), Some(2));
}

#[test]
fn candidate_id_is_unique_under_live_leases_and_reusable_after_expiry() {
    let mut driver = Driver::new();
    let first = driver.grant(2000); // anchored deadline at 2000
    let second = driver.grant(10_000);
    driver.register("g", "agent", 1, first);
    let old_fence = driver
        .machine
        .group_leader("g")
        .map(|seat| seat.fence)
        .expect("seat");
    let taken = driver.register("g", "agent", 1, second);
    assert!(
        matches!(taken.result, Err(Error::CandidateIdTaken { lease_id, .. }) if lease_id == first)
    );
    // The first lease runs out (its anchored deadline passes) before the expiry command lands:
    // the agent, restarted with a new lease, takes its id back as a new incarnation.
    driver.now_ms = 2000;
    driver.ok(Request::LeaseCheckpoint {
        checkpoints: vec![LeaseCheckpoint {
            id: second,
            deadline_ms: None,
        }],
    });
    let output = driver.register("g", "agent", 1, second);
    assert!(output.result.is_ok());
    let seat = driver.machine.group_leader("g").cloned().expect("seat");
    assert_eq!(seat.leader, "agent");
    assert!(seat.fence > old_fence, "a new incarnation gets a new fence");
    // The old lease's expiry no longer touches the registration.
    driver.expire(first);
    assert_eq!(driver.leader_of("g").as_deref(), Some("agent"));
}

#[test]
fn same_lease_re_registration_updates_in_place() {
    let mut driver = Driver::new();
    let lease = driver.grant(10_000);
    driver.register("g", "agent", 1, lease);
    let seat = driver.machine.group_leader("g").cloned().expect("seat");
    driver.register("g", "agent", 7, lease);
    assert_eq!(driver.machine.group_leader("g"), Some(&seat));
    assert_eq!(driver.machine.group_succession("g")[0].priority, 7);
}

#[test]
fn fences_increase_across_groups_and_locks() {
    let mut driver = Driver::new();
    let lease = driver.grant(10_000);
    let mut fences = Vec::new();
    for round in 0..3 {
        driver.register(&format!("g{round}"), "a", 1, lease);
        fences.push(
            driver
                .machine
                .group_leader(&format!("g{round}"))
                .map(|s| s.fence)
                .expect("seat"),
        );
        fences.push(driver.lock(&format!("lock{round}"), lease).fence);
    }
    // Two groups elected by one command still get distinct fences.
    let other = driver.grant(10_000);
    driver.register("x", "b", 1, other);
    driver.register("y", "b", 1, other);
    let (keep_x, keep_y) = (driver.grant(10_000), driver.grant(10_000));
    driver.register("x", "c", 0, keep_x);
    driver.register("y", "c", 0, keep_y);
    driver.expire(other);
    fences.push(
        driver
            .machine
            .group_leader("x")
            .map(|s| s.fence)
            .expect("seat"),
    );
    fences.push(
        driver
            .machine
            .group_leader("y")
            .map(|s| s.fence)
            .expect("seat"),
    );
    assert!(
        fences.windows(2).all(|pair| pair[0] < pair[1]),
        "{fences:?}"
    );
}

#[test]
fn a_deposed_leader_cannot_write_through_a_fenced_txn() {
    let mut driver = Driver::new();
    driver.configure(
        "g",
        GroupPolicy {
            preempt_never: false,
            preempt: true,
            handoff_timeout_ms: Some(10),
            settle_ms: None,
        },
    );
    let (old, new) = (driver.grant(10_000), driver.grant(10_000));
    driver.register("g", "old", 1, old);
    let old_fence = driver
        .machine
        .group_leader("g")
        .map(|s| s.fence)
        .expect("seat");
    let fenced_write = |fence: i64, value: &'static str| {
        Request::Txn(TxnRequest {
            compare: vec![Compare::new(
                group_leader_key("g"),
                CompareResult::Equal,
                CompareTarget::Create(fence),
            )],
            success: vec![RequestOp::Put(PutRequest::new("config", value))],
            failure: vec![],
        })
    };
    let Response::Txn(response) = driver.ok(fenced_write(old_fence, "v1")) else {
        panic!()
    };
    assert!(response.succeeded);
    driver.register("g", "new", 9, new);
    driver.now_ms = 10;
    driver.ok(Request::Tick);
    let new_fence = driver
        .machine
        .group_leader("g")
        .map(|s| s.fence)
        .expect("seat");
    let Response::Txn(response) = driver.ok(fenced_write(old_fence, "stale")) else {
        panic!()
    };
    assert!(!response.succeeded, "the deposed leader's write must fail");
    let Response::Txn(response) = driver.ok(fenced_write(new_fence, "v2")) else {
        panic!()
    };
    assert!(response.succeeded);
    // The mirror key is read-only for clients.
    let put = driver.apply(Request::Put(PutRequest::new(group_leader_key("g"), "me")));
    assert_eq!(put.result, Err(Error::ReservedKey));
}

#[test]
fn proclaim_is_fenced() {
    let mut driver = Driver::new();
    let lease = driver.grant(10_000);
    driver.register("g", "a", 1, lease);
    let fence = driver
        .machine
        .group_leader("g")
        .map(|s| s.fence)
        .expect("seat");
    let stale = driver.apply(Request::GroupProclaim {
        group: "g".into(),
        candidate: "a".into(),
        fence: fence - 1,
        value: Bytes::from_static(b"x"),
    });
    assert!(matches!(stale.result, Err(Error::NotGroupLeader { .. })));
    let output = driver.apply(Request::GroupProclaim {
        group: "g".into(),
        candidate: "a".into(),
        fence,
        value: Bytes::from_static(b"new"),
    });
    assert!(election_events(&output.events).iter().any(
        |k| matches!(k, ElectionEventKind::ValueChanged { value, .. } if value.as_ref() == b"new")
    ));
}

#[test]
fn etcd_election_recipe_lowest_create_revision_leads() {
    let mut driver = Driver::new();
    let (first, second) = (driver.grant(10_000), driver.grant(10_000));
    assert_eq!(
        driver.machine.election_leader(b"svc"),
        Err(Error::ElectionNoLeader)
    );
    let campaign =
        |driver: &mut Driver, lease: i64, value: &'static str| match driver.ok(Request::Campaign {
            name: Bytes::from_static(b"svc"),
            lease,
            value: Bytes::from_static(value.as_bytes()),
        }) {
            Response::Campaign(response) => response,
            other => panic!("{other:?}"),
        };
    let one = campaign(&mut driver, first, "one");
    assert!(one.owner);
    assert_eq!(one.key, Bytes::from(format!("svc/{first:x}")));
    let two = campaign(&mut driver, second, "two");
    assert!(!two.owner);
    assert_eq!(
        two.waiting_for.as_ref().map(|kv| kv.key.clone()),
        Some(one.key.clone())
    );
    let leader = driver.machine.election_leader(b"svc").expect("leader");
    assert_eq!(leader.value, Bytes::from_static(b"one"));
    let not_leader = driver.apply(Request::Proclaim {
        leader: LeaderKey {
            name: "svc".into(),
            key: two.key.clone(),
            rev: two.fence + 1,
            lease: second,
        },
        value: Bytes::from_static(b"x"),
    });
    assert_eq!(not_leader.result, Err(Error::ElectionNotLeader));
    let resign = LeaderKey {
        name: "svc".into(),
        key: one.key.clone(),
        rev: one.fence,
        lease: first,
    };
    assert_eq!(
        driver.ok(Request::Resign {
            leader: resign.clone()
        }),
        Response::Resigned { resigned: true }
    );
    assert_eq!(
        driver.ok(Request::Resign { leader: resign }),
        Response::Resigned { resigned: false }
    );
    assert_eq!(
        driver.machine.queue_status(b"svc", &two.key, two.fence),
        QueueStatus::Owner { fence: two.fence }
    );
}

#[test]
fn settling_makes_the_first_leader_independent_of_arrival_order() {
    for order in [["b", "a", "c"], ["c", "b", "a"], ["a", "c", "b"]] {
        let mut driver = Driver::new();
        let policy = GroupPolicy {
            preempt_never: false,
            preempt: false,
            handoff_timeout_ms: None,
            settle_ms: Some(200),
        };
        driver.configure("g", policy);
        for (arrival, candidate) in order.iter().enumerate() {
            driver.now_ms = arrival as u64 * 50;
            let lease = driver.grant(10_000);
            driver.register("g", candidate, 5, lease);
            assert!(
                driver.leader_of("g").is_none(),
                "nobody leads while the seat settles"
            );
        }
        assert_eq!(driver.machine.next_timer_ms(), Some(200));
        driver.now_ms = 200;
        let output = driver.apply(Request::Tick);
        assert_eq!(
            driver.leader_of("g").as_deref(),
            Some("a"),
            "order {order:?}"
        );
        assert_eq!(
            election_events(&output.events)
                .iter()
                .filter(|kind| matches!(kind, ElectionEventKind::Elected { .. }))
                .count(),
            1
        );
        assert_eq!(driver.machine.next_timer_ms(), None);
    }
}

#[test]
fn settling_restarts_when_everyone_leaves() {
    let mut driver = Driver::new();
    let policy = GroupPolicy {
        preempt_never: false,
        preempt: false,
        handoff_timeout_ms: None,
        settle_ms: Some(200),
    };
    driver.configure("g", policy);
    let early = driver.grant(10_000);
    driver.register("g", "early", 1, early);
    driver.ok(Request::GroupResign {
        group: "g".into(),
        candidate: "early".into(),
        lease_id: early,
    });
    driver.now_ms = 1000;
    let late = driver.grant(10_000);
    driver.register("g", "late", 1, late);
    assert!(
        driver.leader_of("g").is_none(),
        "a new settling period starts at 1000"
    );
    driver.now_ms = 1200;
    driver.ok(Request::Tick);
    assert_eq!(driver.leader_of("g").as_deref(), Some("late"));
}

/// The three preempt policies through the machine: a higher-priority challenger that asks
/// with its own `preempt` gets a handoff under `higher` and `always`, none under `never`,
/// where it takes the seat only when the leader resigns. `never` survives a snapshot, and a
/// group switched to it drops a pending handoff.
#[test]
fn never_keeps_the_leader_until_it_resigns_and_survives_a_snapshot() {
    use conclave_state::{Config, GroupRegister, PreemptPolicy, StateMachine};
    for policy in [
        PreemptPolicy::Higher,
        PreemptPolicy::Always,
        PreemptPolicy::Never,
    ] {
        let mut driver = Driver::new();
        driver.ok(Request::GroupConfigurePreempt {
            group: "g".into(),
            policy: GroupPolicy::default(),
            preempt_policy: policy,
        });
        assert_eq!(driver.machine.group_policy("g").preempt_policy(), policy);
        let (low, high) = (driver.grant(10_000), driver.grant(10_000));
        driver.register("g", "low", 1, low);
        let output = driver.apply(Request::GroupRegister(GroupRegister {
            group: "g".into(),
            candidate: "high".into(),
            priority: 9,
            value: Bytes::new(),
            lease_id: high,
            preempt: true,
        }));
        let asked = election_events(&output.events)
            .iter()
            .any(|kind| matches!(kind, ElectionEventKind::HandoffRequested { .. }));
        assert_eq!(asked, policy != PreemptPolicy::Never, "{policy:?}");
        let seat = driver.machine.group_leader("g").cloned().expect("seat");
        assert_eq!(
            seat.leader, "low",
            "{policy:?}: the seat stays until a resign"
        );
        assert_eq!(seat.handoff.is_some(), policy != PreemptPolicy::Never);

        let image = driver.machine.snapshot_to_vec();
        let mut restored =
            StateMachine::restore(Config::default(), image.as_slice()).expect("the snapshot loads");
        assert_eq!(restored.group_policy("g").preempt_policy(), policy);
        assert_eq!(restored.snapshot_to_vec(), image);

        driver.ok(Request::GroupResign {
            group: "g".into(),
            candidate: "low".into(),
            lease_id: low,
        });
        assert_eq!(driver.leader_of("g").as_deref(), Some("high"), "{policy:?}");
        // The replica restored from the snapshot decides the same.
        let resign = Request::GroupResign {
            group: "g".into(),
            candidate: "low".into(),
            lease_id: low,
        };
        let index = driver.machine.last_applied() + 1;
        restored.apply(index, &conclave_state::Command::new(driver.now_ms, resign));
        assert_eq!(
            restored.group_leader("g").map(|seat| seat.leader.as_str()),
            Some("high")
        );
    }

    // `higher` with a pending handoff, then `never`: the handoff is cancelled.
    let mut driver = Driver::new();
    let (low, high) = (driver.grant(10_000), driver.grant(10_000));
    driver.register("g", "low", 1, low);
    driver.apply(Request::GroupRegister(GroupRegister {
        group: "g".into(),
        candidate: "high".into(),
        priority: 9,
        value: Bytes::new(),
        lease_id: high,
        preempt: true,
    }));
    assert!(
        driver
            .machine
            .group_leader("g")
            .expect("seat")
            .handoff
            .is_some()
    );
    driver.ok(Request::GroupConfigurePreempt {
        group: "g".into(),
        policy: GroupPolicy::default(),
        preempt_policy: PreemptPolicy::Never,
    });
    let seat = driver.machine.group_leader("g").expect("seat");
    assert_eq!(
        (seat.leader.as_str(), seat.handoff.is_none()),
        ("low", true)
    );
    // The older command can only say `higher` or `always`: it lifts `never`.
    driver.configure(
        "g",
        GroupPolicy {
            preempt_never: true,
            preempt: false,
            handoff_timeout_ms: None,
            settle_ms: None,
        },
    );
    assert_eq!(
        driver.machine.group_policy("g").preempt_policy(),
        PreemptPolicy::Higher
    );
}
