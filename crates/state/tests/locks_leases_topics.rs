//! Scenario tests for locks (FIFO, expired waiter, fenced unlock), leases, topics, sessions,
//! idempotent apply, limits and encoding.

mod common;

use bytes::Bytes;
use common::Driver;
use conclave_state::{
    Command, Config, Error, Event, EventKind, LeaseCheckpoint, LeaseKeeper, PutRequest,
    QueueStatus, RangeRequest, Request, RequestOp, Response, Retention, SessionSeq, StateMachine,
    TxnRequest,
};

#[test]
fn locks_are_granted_fifo_with_increasing_fences() {
    let mut driver = Driver::new();
    let leases: Vec<i64> = (0..3).map(|_| driver.grant(10_000)).collect();
    let grants: Vec<_> = leases
        .iter()
        .map(|lease| driver.lock("jobs", *lease))
        .collect();
    assert!(grants[0].owner && !grants[1].owner && !grants[2].owner);
    assert!(grants.windows(2).all(|pair| pair[0].fence < pair[1].fence));
    assert_eq!(
        grants[2].waiting_for.as_ref().map(|kv| &kv.key),
        Some(&grants[1].key)
    );
    // Locking again with the same lease is idempotent: same key, same fence.
    assert_eq!(driver.lock("jobs", leases[0]).fence, grants[0].fence);
    for (turn, grant) in grants.iter().enumerate() {
        let status = driver
            .machine
            .queue_status(b"jobs", &grant.key, grant.fence);
        assert_eq!(
            status,
            QueueStatus::Owner { fence: grant.fence },
            "turn {turn}"
        );
        let unlock = Request::Unlock {
            key: grant.key.clone(),
            fence: Some(grant.fence),
        };
        assert_eq!(driver.ok(unlock), Response::Unlocked { released: true });
    }
}

#[test]
fn a_waiter_whose_lease_ran_out_is_never_granted() {
    let mut driver = Driver::new();
    let holder = driver.grant(100_000);
    let waiter = driver.grant(2000); // anchored deadline at 2000
    let held = driver.lock("l", holder);
    let waiting = driver.lock("l", waiter);
    assert!(!waiting.owner);
    // The waiter's lease runs out while it queues; then the holder unlocks.
    driver.now_ms = 2500;
    driver.ok(Request::Unlock {
        key: held.key.clone(),
        fence: Some(held.fence),
    });
    assert_eq!(
        driver
            .machine
            .queue_status(b"l", &waiting.key, waiting.fence),
        QueueStatus::Lost
    );
    // Nor can it re-enter with the dead lease.
    assert_eq!(
        driver
            .apply(Request::Lock {
                name: "l".into(),
                lease: waiter
            })
            .result,
        Err(Error::LeaseNotFound)
    );
    driver.expire(waiter);
    assert!(driver.machine.kv().get(&waiting.key).is_none());
    assert_eq!(
        driver
            .machine
            .queue_status(b"l", &waiting.key, waiting.fence),
        QueueStatus::Lost
    );
}

#[test]
fn a_retried_unlock_cannot_release_a_later_holder() {
    let mut driver = Driver::new();
    let lease = driver.grant(10_000);
    let first = driver.lock("l", lease);
    driver.ok(Request::Unlock {
        key: first.key.clone(),
        fence: Some(first.fence),
    });
    let second = driver.lock("l", lease);
    assert_eq!(second.key, first.key, "same lease, same key name");
    assert!(second.fence > first.fence);
    let retried = Request::Unlock {
        key: first.key.clone(),
        fence: Some(first.fence),
    };
    assert_eq!(driver.ok(retried), Response::Unlocked { released: false });
    assert_eq!(
        driver.machine.queue_status(b"l", &second.key, second.fence),
        QueueStatus::Owner {
            fence: second.fence
        }
    );
}

#[test]
fn revoking_a_lease_deletes_its_keys_in_one_revision() {
    let mut driver = Driver::new();
    let lease = driver.grant(10_000);
    driver.put("a", "1", lease);
    driver.put("b", "2", lease);
    driver.put("c", "3", 0);
    let before = driver.machine.revision();
    let output = driver.apply(Request::LeaseRevoke { id: lease });
    assert_eq!(output.revision, before + 1);
    let deletes: Vec<_> = output
        .events
        .iter()
        .filter_map(|event| match event {
            Event::Kv(watch) if watch.kind == EventKind::Delete => Some(watch.kv.mod_revision),
            _ => None,
        })
        .collect();
    assert_eq!(deletes, vec![before + 1, before + 1]);
    assert!(driver.machine.lease(lease).is_none());
    let put = driver.apply(Request::Put(PutRequest {
        lease,
        ..PutRequest::new("x", "y")
    }));
    assert_eq!(put.result, Err(Error::LeaseNotFound));
    assert_eq!(
        driver.apply(Request::LeaseRevoke { id: lease }).result,
        Err(Error::LeaseNotFound)
    );
}

#[test]
fn lease_ttl_minimum_and_reattachment() {
    let mut driver = Driver::new();
    assert_eq!(
        driver.ok(Request::LeaseGrant { id: 77, ttl_ms: 1 }),
        Response::LeaseGranted {
            id: 77,
            ttl_ms: 1500
        }
    );
    assert_eq!(
        driver
            .apply(Request::LeaseGrant {
                id: 77,
                ttl_ms: 5000
            })
            .result,
        Err(Error::LeaseExists)
    );
    let other = driver.grant(5000);
    driver.put("k", "v", 77);
    driver.put("k", "v", other);
    assert!(
        driver
            .machine
            .lease(77)
            .is_some_and(|lease| lease.keys.is_empty())
    );
    driver.ok(Request::LeaseRevoke { id: 77 });
    assert!(
        driver.machine.kv().get(b"k").is_some(),
        "the key moved to another lease"
    );
}

#[test]
fn lease_survives_a_leader_change_and_expires_after_the_grace() {
    let mut driver = Driver::new();
    let lease = driver.grant(3000); // deadline 3000
    let mut old_leader = LeaseKeeper::new(driver.machine.config());
    old_leader.sync(driver.machine.leases());
    // Keepalive at 2000: the lease was anchored, so a "renewed" checkpoint commits first.
    let renewal = old_leader
        .renew(driver.machine.leases(), lease, 2000)
        .expect("renew");
    let checkpoint = renewal.checkpoint_before_reply.expect("checkpoint first");
    driver.now_ms = 2000;
    driver.ok(Request::LeaseCheckpoint {
        checkpoints: vec![checkpoint],
    });
    // The old leader dies; a new one is promoted at 4500. The promise was at most 2000 + 3000;
    // the log bounds it by the renewal record + checkpoint interval (1 s) + TTL = 6000.
    let mut new_leader = LeaseKeeper::new(driver.machine.config());
    driver.now_ms = 4500;
    let anchors = new_leader.promote(driver.machine.leases(), 4500);
    assert_eq!(
        anchors,
        vec![LeaseCheckpoint {
            id: lease,
            deadline_ms: Some(6000)
        }]
    );
    driver.ok(Request::LeaseCheckpoint {
        checkpoints: anchors,
    });
    assert!(
        new_leader.expired(5999, 100).is_empty(),
        "never before the promised TTL"
    );
    assert_eq!(new_leader.expired(6000, 100), vec![lease]);
    // Repeated leader changes without keepalives cannot push the deadline out.
    let mut third = LeaseKeeper::new(driver.machine.config());
    let anchors = third.promote(driver.machine.leases(), 5000);
    assert_eq!(anchors[0].deadline_ms, Some(6000));
    driver.now_ms = 6000;
    let output = driver.apply(Request::LeaseExpire {
        ids: new_leader.expired(6000, 100),
    });
    assert_eq!(
        output.result,
        Ok(Response::LeasesExpired {
            revoked: vec![lease]
        })
    );
}

#[test]
fn topics_sequence_inbox_ack_and_age_retention() {
    let mut driver = Driver::new();
    for i in 1..=3u64 {
        let response = driver.ok(Request::Publish {
            topic: "election:g".into(),
            data: Bytes::from(format!("m{i}")),
        });
        let Response::Published { seq, revision } = response else {
            panic!()
        };
        assert_eq!(seq, i);
        assert_eq!(revision, driver.machine.revision());
    }
    let ack = Request::Ack {
        consumer: "bot".into(),
        topic: "election:g".into(),
        seq: 2,
    };
    assert_eq!(driver.ok(ack), Response::Acked { cursor: 2 });
    let inbox = driver.machine.inbox("bot", &["election:g".to_owned()], 0);
    assert_eq!(
        inbox[0].messages.iter().map(|m| m.seq).collect::<Vec<_>>(),
        vec![3]
    );
    let beyond = Request::Ack {
        consumer: "bot".into(),
        topic: "election:g".into(),
        seq: 9,
    };
    assert!(matches!(
        driver.apply(beyond).result,
        Err(Error::AckBeyondEnd { .. })
    ));
    let retention = Retention {
        max_messages: None,
        max_age_ms: Some(1000),
    };
    driver.ok(Request::TopicConfigure {
        topic: "election:g".into(),
        retention,
    });
    assert_eq!(driver.machine.next_timer_ms(), Some(1000));
    driver.now_ms = 1000;
    driver.ok(Request::Tick);
    let read = driver.machine.topic_read("election:g", 1, 0);
    assert!(read.messages.is_empty());
    assert_eq!((read.first_seq, read.last_seq), (4, 3));
}

#[test]
fn session_retry_reports_the_revision_it_was_applied_at() {
    let mut driver = Driver::new();
    let Response::SessionOpened { client_id } = driver.ok(Request::OpenSession) else {
        panic!()
    };
    let put = Command {
        leader_time_ms: 0,
        session: Some(SessionSeq {
            client_id,
            seq: 1,
            secret: 0,
        }),
        request: Request::Put(PutRequest::new("k", "v")),
    };
    driver.index += 1;
    let first = driver.machine.apply(driver.index, &put);
    assert!(first.result.is_ok() && !first.duplicate, "{first:?}");
    // Other clients write before the retry arrives.
    driver.put("other", "1", 0);
    driver.put("other", "2", 0);
    assert_eq!(driver.machine.kv().revision(), first.revision + 2);
    driver.index += 1;
    let retry = driver.machine.apply(driver.index, &put);
    assert!(retry.duplicate);
    assert_eq!(
        retry.revision, first.revision,
        "a retry names its own revision"
    );
    // The remembered revision survives a snapshot.
    let bytes = driver.machine.snapshot_to_vec();
    let mut restored = StateMachine::restore(Config::default(), bytes.as_slice()).expect("restore");
    let after_restore = restored.apply(driver.index + 1, &put);
    assert!(after_restore.duplicate);
    assert_eq!(after_restore.revision, first.revision);
}

#[test]
fn session_retry_gets_the_first_answer_and_changes_nothing() {
    let mut driver = Driver::new();
    let Response::SessionOpened { client_id } = driver.ok(Request::OpenSession) else {
        panic!()
    };
    let put = Command {
        leader_time_ms: 0,
        session: Some(SessionSeq {
            client_id,
            seq: 1,
            secret: 0,
        }),
        request: Request::Put(PutRequest {
            prev_kv: true,
            ..PutRequest::new("k", "v")
        }),
    };
    let first = driver.machine.apply(10, &put);
    // A leader change later, the client retries the same seq.
    let retry = driver.machine.apply(11, &put);
    assert!(retry.duplicate);
    assert!(retry.events.is_empty());
    assert_eq!(retry.result, first.result);
    assert_eq!(driver.machine.kv().get(b"k").map(|kv| kv.version), Some(1));
    let expired = Command {
        leader_time_ms: 10 * 60 * 60 * 1000,
        ..put.clone()
    };
    assert!(matches!(
        driver.machine.apply(12, &expired).result,
        Err(Error::SessionNotFound { .. })
    ));
}

#[test]
fn apply_is_idempotent_for_old_indexes() {
    let mut driver = Driver::new();
    driver.put("k", "v", 0);
    let revision = driver.machine.revision();
    let replay = driver.machine.apply(
        1,
        &Command::new(0, Request::Put(PutRequest::new("k", "other"))),
    );
    assert!(matches!(
        replay.result,
        Err(Error::AlreadyApplied {
            index: 1,
            last_applied: 1
        })
    ));
    assert_eq!(driver.machine.revision(), revision);
    assert_eq!(
        driver.machine.kv().get(b"k").map(|kv| kv.value),
        Some(Bytes::from_static(b"v"))
    );
}

#[test]
fn limits_use_etcd_errors() {
    let mut driver = Driver::new();
    let ops = (0..129)
        .map(|i| RequestOp::Put(PutRequest::new(format!("k{i}"), "v")))
        .collect();
    let txn = Request::Txn(TxnRequest {
        success: ops,
        ..TxnRequest::default()
    });
    assert_eq!(driver.apply(txn).result, Err(Error::TooManyOps));
    let big = Request::Put(PutRequest::new("k", vec![0u8; 2 * 1024 * 1024]));
    assert_eq!(driver.apply(big).result, Err(Error::RequestTooLarge));
    assert_eq!(
        driver.apply(Request::Put(PutRequest::new("", "v"))).result,
        Err(Error::EmptyKey)
    );
    assert_eq!(
        driver.apply(Request::Range(RangeRequest::key(""))).result,
        Err(Error::EmptyKey)
    );
    let ignore = PutRequest {
        ignore_value: true,
        ..PutRequest::new("missing", "")
    };
    assert_eq!(
        driver.apply(Request::Put(ignore)).result,
        Err(Error::KeyNotFound)
    );
    let both = PutRequest {
        ignore_value: true,
        ..PutRequest::new("k", "v")
    };
    assert_eq!(
        driver.apply(Request::Put(both)).result,
        Err(Error::ValueProvided)
    );
    let future = RangeRequest {
        revision: 99,
        ..RangeRequest::key("k")
    };
    assert_eq!(
        driver.apply(Request::Range(future)).result,
        Err(Error::FutureRevision {
            current_revision: 1
        })
    );
    // A failed Txn writes nothing, even when an earlier op of its branch would have succeeded.
    let failing = Request::Txn(TxnRequest {
        success: vec![
            RequestOp::Put(PutRequest::new("ok", "v")),
            RequestOp::Put(PutRequest {
                lease: 12345,
                ..PutRequest::new("bad", "v")
            }),
        ],
        ..TxnRequest::default()
    });
    assert_eq!(driver.apply(failing).result, Err(Error::LeaseNotFound));
    assert!(driver.machine.kv().get(b"ok").is_none());
    assert_eq!(driver.machine.revision(), 1);
}

#[test]
fn commands_round_trip_and_garbage_does_not_decode() {
    let command = Command {
        leader_time_ms: 42,
        session: Some(SessionSeq {
            client_id: 1,
            seq: 2,
            secret: 0,
        }),
        request: Request::Txn(TxnRequest {
            success: vec![RequestOp::Put(PutRequest::new("k", "v"))],
            ..TxnRequest::default()
        }),
    };
    let bytes = command.encode();
    assert_eq!(Command::decode(&bytes), Ok(command));
    assert!(Command::decode(&[0xff; 7]).is_err());
    let mut trailing = bytes.clone();
    trailing.push(0);
    assert!(Command::decode(&trailing).is_err());
    for cut in 0..bytes.len() {
        assert!(Command::decode(&bytes[..cut]).is_err());
    }
}

#[test]
fn undecodable_entries_are_applied_as_errors() {
    let mut driver = Driver::new();
    let good = Command::new(0, Request::Put(PutRequest::new("k", "v"))).encode();
    assert!(driver.machine.apply_encoded(1, &good).result.is_ok());
    let bad = driver.machine.apply_encoded(2, &[0xff, 0xff, 0xff]);
    assert!(matches!(bad.result, Err(Error::Decode(_))));
    assert_eq!(driver.machine.last_applied(), 2);
    assert!(matches!(
        driver.machine.apply_encoded(2, &good).result,
        Err(Error::AlreadyApplied { .. })
    ));
}

#[test]
fn object_counts_are_bounded() {
    let config = conclave_state::Config {
        leases_max: 2,
        groups_max: 1,
        group_candidates_max: 1,
        topics_max: 1,
        topic_messages_max: 2,
        consumers_max: 1,
        ..conclave_state::Config::default()
    };
    let mut driver = Driver::with_config(config);
    let (first, second) = (driver.grant(10_000), driver.grant(10_000));
    let third = driver.apply(Request::LeaseGrant {
        id: 0,
        ttl_ms: 10_000,
    });
    assert!(matches!(
        third.result,
        Err(Error::LimitReached { limit: 2, .. })
    ));
    assert!(driver.register("g", "a", 1, first).result.is_ok());
    assert!(matches!(
        driver.register("g", "b", 1, second).result,
        Err(Error::LimitReached { .. })
    ));
    assert!(matches!(
        driver.register("h", "a", 1, second).result,
        Err(Error::LimitReached { .. })
    ));
    for i in 0..3 {
        driver.ok(Request::Publish {
            topic: "t".into(),
            data: Bytes::from(vec![i]),
        });
    }
    let read = driver.machine.topic_read("t", 1, 0);
    assert_eq!(
        (read.first_seq, read.last_seq),
        (2, 3),
        "the newest two are kept"
    );
    let other = driver.apply(Request::Publish {
        topic: "u".into(),
        data: Bytes::new(),
    });
    assert!(matches!(other.result, Err(Error::LimitReached { .. })));
    driver.ok(Request::Ack {
        consumer: "c1".into(),
        topic: "t".into(),
        seq: 1,
    });
    let second_consumer = driver.apply(Request::Ack {
        consumer: "c2".into(),
        topic: "t".into(),
        seq: 1,
    });
    assert!(matches!(
        second_consumer.result,
        Err(Error::LimitReached { .. })
    ));
}

#[test]
fn a_message_carries_its_sender_within_a_bounded_length() {
    let mut driver = Driver::new();
    let publish = |from: String| Request::PublishFrom {
        topic: "election:g".into(),
        data: Bytes::from_static(b"{}"),
        from,
    };
    driver.ok(publish("agent-7".into()));
    driver.ok(Request::Publish {
        topic: "election:g".into(),
        data: Bytes::from_static(b"{}"),
    });
    let longest = "x".repeat(conclave_state::MESSAGE_FROM_BYTES_MAX);
    driver.ok(publish(longest.clone()));
    let before = driver.machine.revision();
    let refused = driver.apply(publish(format!("{longest}x")));
    assert!(
        matches!(&refused.result, Err(Error::InvalidArgument(why)) if why.contains("sender")),
        "{:?}",
        refused.result
    );
    assert_eq!(
        refused.result.unwrap_err().code(),
        Error::InvalidArgument(String::new()).code()
    );
    assert_eq!(
        driver.machine.revision(),
        before,
        "a refused publish writes nothing"
    );
    let read = driver.machine.topic_read("election:g", 1, 0);
    let senders: Vec<&str> = read.messages.iter().map(|m| m.from.as_str()).collect();
    assert_eq!(senders, ["agent-7", "", longest.as_str()]);
    // The published event carries the sender too (subscribers are fed from the log, but
    // observers of events see the same message).
    let output = driver.apply(publish("agent-8".into()));
    assert!(
        output
            .events
            .iter()
            .any(|event| matches!(event, conclave_state::Event::Topic(m) if m.from == "agent-8"))
    );
}
