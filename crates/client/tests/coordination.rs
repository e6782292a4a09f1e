//! Leases, priority elections, locks and topics against a real `conclave serve`.
//!
//! These need services the server may not serve yet; such a test fails with "the server does
//! not implement ... yet" rather than passing vacuously.

mod common;

use std::time::Duration;

use common::{Cluster, supported};
use conclave_client::{
    CampaignOptions, ElectionEventKind, GetOptions, InboxOptions, LockOptions, LossReason, Op,
    PutOptions, Txn,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_keepalive_keeps_keys_and_expiry_removes_them() {
    let cluster = Cluster::start(1);
    let client = cluster.client().await;
    let kept = supported(
        client.lease_grant_kept(Duration::from_secs(2)).await,
        "LeaseGrant",
    );
    client
        .put(
            "session",
            "me",
            PutOptions {
                lease: kept.id(),
                prev_kv: false,
            },
        )
        .await
        .expect("put with lease");
    assert!(client.leases().await.expect("leases").contains(&kept.id()));
    // Three TTLs: only the keepalives keep it.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let ttl = client
        .lease_time_to_live(kept.id(), true)
        .await
        .expect("ttl");
    assert!(ttl.remaining > Duration::ZERO && ttl.keys == vec![b"session".to_vec()]);
    assert!(kept.deadline().is_some());

    let id = kept.id();
    kept.stop();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let gone = client
        .lease_time_to_live(id, false)
        .await
        .expect_err("expired lease");
    assert_eq!(gone.code(), "lease_expired", "{gone}");
    assert!(
        client
            .get("session", GetOptions::default())
            .await
            .expect("get")
            .kvs
            .is_empty()
    );
    let once = client
        .lease_keep_alive_once(id)
        .await
        .expect_err("keepalive of a dead lease");
    assert_eq!(once.code(), "lease_expired", "{once}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn election_hands_over_with_a_higher_fence() {
    let cluster = Cluster::start(1);
    let client = cluster.client().await;
    // Campaigns run under a lease; say so if that is what is missing.
    let probe = supported(
        client.lease_grant(Duration::from_secs(5)).await,
        "etcdserverpb.Lease/LeaseGrant (needed by elections)",
    );
    client.lease_revoke(probe.id).await.expect("revoke");
    let election = client.election();
    let options = CampaignOptions {
        ttl: Duration::from_secs(2),
        timeout: Some(Duration::from_secs(10)),
        ..Default::default()
    };
    let first = supported(
        election
            .campaign("g", "high", 10, "h", options.clone())
            .await,
        "conclave.v1.Election/Campaign",
    );
    let mut events = election.observe("g").await.expect("observe");
    let current = events.next().await.expect("first event").expect("event");
    assert_eq!(current.kind, ElectionEventKind::Current);

    let contender = client.clone();
    let opts = options.clone();
    let second = tokio::spawn(async move {
        let opts = CampaignOptions {
            timeout: Some(Duration::from_secs(15)),
            ..opts
        };
        contender
            .election()
            .campaign("g", "low", 1, "l", opts)
            .await
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let candidates = election.candidates("g").await.expect("candidates");
    let ids: Vec<_> = candidates.iter().map(|c| c.candidate_id.as_str()).collect();
    assert_eq!(ids, ["high", "low"]);
    let leader = election
        .leader("g")
        .await
        .expect("leader")
        .expect("a leader");
    assert_eq!(
        (leader.leader.candidate_id.as_str(), leader.fence),
        ("high", first.fence())
    );

    // The fenced write succeeds while leading.
    let fenced = Txn::new().when([first.fence_compare()]).and_then([Op::put(
        "owner",
        "high",
        PutOptions::default(),
    )]);
    assert!(
        client
            .txn(fenced.clone())
            .await
            .expect("fenced txn")
            .succeeded
    );

    // Crash the leader (no resign): the lease expires and "low" takes over.
    let lost = first.lost();
    let old_fence = first.fence();
    first.abandon();
    let reason = tokio::time::timeout(Duration::from_secs(5), lost).await;
    assert!(
        matches!(reason, Ok(LossReason::LeaseExpired { .. })),
        "{reason:?}"
    );
    let second = second.await.expect("task").expect("low elected");
    assert!(second.fence() > old_fence && second.term() > 1);
    // The old leader's fenced write is now refused.
    assert!(!client.txn(fenced).await.expect("stale txn").succeeded);

    // Resigning ends the leadership and fires lost().
    let lost = second.lost();
    assert!(second.resign().await.expect("resign"));
    assert_eq!(lost.await, LossReason::Resigned);
    assert!(election.leader("g").await.expect("leader").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_is_exclusive_and_fenced() {
    let cluster = Cluster::start(1);
    let client = cluster.client().await;
    let probe = supported(
        client.lease_grant(Duration::from_secs(5)).await,
        "etcdserverpb.Lease/LeaseGrant (needed by locks)",
    );
    client.lease_revoke(probe.id).await.expect("revoke");
    let mutex = client.mutex();
    let first = supported(
        mutex.lock("jobs", LockOptions::default()).await,
        "v3lockpb.Lock",
    );
    let waiter = {
        let mutex = client.mutex();
        tokio::spawn(async move { mutex.lock("jobs", LockOptions::default()).await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiter.is_finished(), "the second locker must wait");
    let first_fence = first.fence();
    assert!(first.unlock().await.expect("unlock"));
    let second = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("second acquires after unlock")
        .expect("task")
        .expect("lock");
    assert!(second.fence() > first_fence);
    // A wait that runs out is a timeout, every time: the client once split the last moments
    // of a wait into ever shorter calls, and a dropped one could withdraw the queue key the
    // next had found, which then read as "lease not found" (lease_expired).
    for timeout_ms in [1000, 300, 700, 250, 1000] {
        let timed_out = mutex
            .lock(
                "jobs",
                LockOptions {
                    timeout: Some(Duration::from_millis(timeout_ms)),
                    ..Default::default()
                },
            )
            .await
            .err()
            .expect("held by the second");
        assert_eq!(timed_out.code(), "timeout", "{timeout_ms} ms: {timed_out}");
    }
    drop(second);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topics_publish_read_subscribe_inbox_ack() {
    let cluster = Cluster::start(1);
    let client = cluster.client().await;
    let topics = client.topics();
    let seq = supported(
        topics.publish("t", "one").await,
        "conclave.v1.Topic/Publish",
    );
    assert_eq!(seq, 1);
    topics
        .publish_from("t", "two", "agent-2")
        .await
        .expect("publish");
    let read = topics.read("t", 0, 0).await.expect("read");
    assert_eq!(read.messages.len(), 2);
    assert_eq!(read.next_seq, 3);
    let senders: Vec<&str> = read.messages.iter().map(|m| m.from.as_str()).collect();
    assert_eq!(senders, ["", "agent-2"]);
    let overlong = topics
        .publish_from("t", "never", &"x".repeat(257))
        .await
        .expect_err("a sender over 256 bytes");
    assert_eq!(overlong.code(), "invalid_argument", "{overlong}");
    assert_eq!(topics.read("t", 0, 0).await.expect("read").next_seq, 3);

    let mut subscription = topics.subscribe("t", 1).await.expect("subscribe");
    topics.publish("t", "three").await.expect("publish");
    let mut seqs = Vec::new();
    for _ in 0..3 {
        let message = tokio::time::timeout(Duration::from_secs(5), subscription.next())
            .await
            .expect("message in time")
            .expect("open")
            .expect("message");
        seqs.push(message.seq);
    }
    assert_eq!(seqs, [1, 2, 3]);

    let inbox = topics
        .inbox("worker", &["t"], InboxOptions::default())
        .await
        .expect("inbox");
    assert_eq!(inbox.len(), 3);
    assert_eq!(topics.ack("worker", "t", 2).await.expect("ack"), 2);
    let inbox = topics
        .inbox("worker", &["t"], InboxOptions::default())
        .await
        .expect("inbox");
    assert_eq!(inbox.iter().map(|m| m.seq).collect::<Vec<_>>(), [3]);
    let beyond = topics
        .ack("worker", "t", 99)
        .await
        .expect_err("ack beyond the end");
    assert_eq!(beyond.code(), "invalid_argument", "{beyond}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preempting_challenger_is_announced_to_the_leader_and_seated_when_it_resigns() {
    let cluster = Cluster::start(3);
    let client = cluster.client().await;
    let election = client.election();
    // Leases far longer than the test's bounds: only the handoff can move the seat in time.
    let options = CampaignOptions {
        ttl: Duration::from_secs(60),
        timeout: Some(Duration::from_secs(20)),
        ..Default::default()
    };
    let low = supported(
        election.campaign("p", "low", 1, "l", options.clone()).await,
        "conclave.v1.Election/Campaign",
    );
    assert_eq!(low.handoff(), None);
    let asked = low.handoff_requested();
    let lost = low.lost();

    // A higher priority without preempt waits for the next election and asks nothing.
    let patient = {
        let election = client.election();
        let options = options.clone();
        tokio::spawn(async move { election.campaign("p", "mid", 5, "m", options).await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(low.handoff(), None, "no handoff without preempt");

    let started = tokio::time::Instant::now();
    let challenger = {
        let election = client.election();
        let options = CampaignOptions {
            preempt: true,
            ..options.clone()
        };
        tokio::spawn(async move { election.campaign("p", "high", 9, "h", options).await })
    };
    let wanted = tokio::time::timeout(Duration::from_secs(10), asked)
        .await
        .expect("the leader is told about the handoff");
    let told = started.elapsed();
    assert_eq!((wanted.candidate_id.as_str(), wanted.priority), ("high", 9));
    assert_eq!(low.handoff().map(|c| c.candidate_id), Some("high".into()));
    // Told, but still leading: the seat moves only when the incumbent lets go.
    let seated = election
        .leader("p")
        .await
        .expect("leader")
        .expect("a leader");
    assert_eq!(seated.fence, low.fence());
    assert_eq!(
        seated.handoff_to.map(|c| c.candidate_id),
        Some("high".into())
    );
    assert!(
        !challenger.is_finished(),
        "no second leader while the first leads"
    );

    let old_fence = low.fence();
    assert!(low.resign().await.expect("resign"));
    assert_eq!(lost.await, LossReason::Resigned);
    let high = tokio::time::timeout(Duration::from_secs(10), challenger)
        .await
        .expect("the challenger is elected once the incumbent resigned")
        .expect("task")
        .expect("campaign");
    let moved = started.elapsed();
    eprintln!(
        "preemption (library): leader told after {told:?}, challenger seated after {moved:?}"
    );
    assert!(high.fence() > old_fence && high.term() > 1);
    assert_eq!(high.handoff(), None);
    assert!(moved < Duration::from_secs(15));

    // The seat went to the challenger, not to the higher-ranked-than-low bystander.
    let now = election
        .leader("p")
        .await
        .expect("leader")
        .expect("a leader");
    assert_eq!(now.leader.candidate_id, "high");
    patient.abort();
}
