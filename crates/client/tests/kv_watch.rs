//! KV, watch and connection behaviour against real `conclave serve` processes.

mod common;

use std::time::Duration;

use common::{Cluster, supported, test_options};
use conclave_client::{
    Client, ClientOptions, Compare, CompareOp, DeleteOptions, EventType, GetOptions, Op,
    OpResponse, PutOptions, Txn, WatchOptions,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn put_get_delete_and_txn() {
    let cluster = Cluster::start(1);
    let client = cluster.client().await;

    let first = supported(
        client.put("jobs/1", "a", PutOptions::default()).await,
        "KV Put",
    );
    client
        .put("jobs/2", "b", PutOptions::default())
        .await
        .expect("put");
    let replaced = client
        .put(
            "jobs/1",
            "a2",
            PutOptions {
                lease: 0,
                prev_kv: true,
            },
        )
        .await
        .expect("put with prev_kv");
    assert_eq!(replaced.prev_kv.map(|kv| kv.value), Some(b"a".to_vec()));

    let all = client
        .get("jobs/", GetOptions::prefix())
        .await
        .expect("prefix get");
    assert_eq!(all.count, 2);
    assert_eq!(all.kvs[0].value_str(), "a2");
    let limited = client
        .get(
            "jobs/",
            GetOptions {
                prefix: true,
                limit: 1,
                ..Default::default()
            },
        )
        .await
        .expect("limited get");
    assert!(limited.more && limited.kvs.len() == 1);
    let old = client
        .get(
            "jobs/1",
            GetOptions {
                revision: first.revision,
                ..Default::default()
            },
        )
        .await
        .expect("historic get");
    assert_eq!(old.kvs[0].value_str(), "a");

    let txn = Txn::new()
        .when([Compare::value("jobs/1", CompareOp::Equal, "a2")])
        .and_then([Op::put("jobs/3", "c", PutOptions::default())])
        .or_else([Op::get("jobs/1", GetOptions::default())]);
    let answer = client.txn(txn).await.expect("txn");
    assert!(answer.succeeded);
    let txn = Txn::new()
        .when([Compare::version("jobs/9", CompareOp::Greater, 0)])
        .or_else([Op::get("jobs/", GetOptions::prefix())]);
    let answer = client.txn(txn).await.expect("failing txn");
    assert!(!answer.succeeded);
    match &answer.responses[0] {
        OpResponse::Get(get) => assert_eq!(get.count, 3),
        other => panic!("expected a range answer, got {other:?}"),
    }

    let deleted = client
        .delete("jobs/", DeleteOptions::prefix())
        .await
        .expect("delete");
    assert_eq!(deleted.deleted, 3);
    assert!(
        client
            .get("jobs/1", GetOptions::default())
            .await
            .expect("get")
            .kvs
            .is_empty()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_have_stable_codes() {
    let cluster = Cluster::start(1);
    let client = cluster.client().await;
    let empty = client
        .get("", GetOptions::default())
        .await
        .expect_err("empty key");
    assert_eq!(empty.code(), "invalid_argument", "{empty}");
    let future = client
        .get(
            "k",
            GetOptions {
                revision: 1_000_000,
                ..Default::default()
            },
        )
        .await
        .expect_err("future revision");
    assert_eq!(future.code(), "invalid_argument", "{future}");
    let too_large = client
        .put("big", vec![0u8; 2 * 1024 * 1024], PutOptions::default())
        .await
        .expect_err("value over the limit");
    assert_eq!(too_large.code(), "too_large", "{too_large}");

    let refused = Client::connect_with(
        [format!("127.0.0.1:{}", common::free_port())],
        ClientOptions {
            connect_timeout: Duration::from_millis(300),
            ..Default::default()
        },
    )
    .await
    .err()
    .expect("nothing listens there");
    assert_eq!(refused.code(), "connection_failed", "{refused}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_resumes_after_the_server_restarts() {
    let mut cluster = Cluster::start(1);
    let client = cluster.client().await;
    let mut watcher = supported(client.watch("w/", WatchOptions::prefix()).await, "Watch");
    for i in 0..3 {
        client
            .put(format!("w/{i}"), "v", PutOptions::default())
            .await
            .expect("put");
    }
    let mut seen = Vec::new();
    for _ in 0..3 {
        let event = tokio::time::timeout(Duration::from_secs(5), watcher.next())
            .await
            .expect("event in time")
            .expect("stream open")
            .expect("event");
        assert_eq!(event.kind, EventType::Put);
        seen.push(event.revision());
    }

    // Crash and restart the only node: the watch must reconnect and continue after the last
    // revision it delivered, without repeats or gaps.
    cluster.nodes[0].restart();
    let writer = cluster.client().await;
    let kept = writer
        .get("w/", GetOptions::prefix())
        .await
        .expect("read after restart");
    assert_eq!(
        kept.count, 3,
        "server bug: acknowledged writes were lost across a kill -9 restart (store now at \
         revision {}), so the watch cannot resume",
        kept.revision
    );
    for i in 3..6 {
        writer
            .put(format!("w/{i}"), "v", PutOptions::default())
            .await
            .expect("put");
    }
    for _ in 3..6 {
        let event = tokio::time::timeout(Duration::from_secs(15), watcher.next())
            .await
            .expect("event after reconnect in time")
            .expect("stream open")
            .expect("event");
        seen.push(event.revision());
    }
    for pair in seen.windows(2) {
        assert_eq!(
            pair[1],
            pair[0] + 1,
            "revisions {seen:?} have a gap or repeat"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_fail_over_to_another_member() {
    let mut cluster = Cluster::start(3);
    let client = cluster.client().await;
    client
        .put("k", "v", PutOptions::default())
        .await
        .expect("put");
    let used = client.current_endpoint().await.expect("endpoint");
    let index = cluster
        .nodes
        .iter()
        .position(|n| used.ends_with(&n.client_addr))
        .expect("the endpoint is one of ours");
    cluster.nodes[index].kill();
    // The read is idempotent: it is retried on another member until the deadline.
    let answer = client
        .get("k", GetOptions::default())
        .await
        .expect("read after failover");
    assert_eq!(answer.kvs[0].value_str(), "v");
    let now_used = client.current_endpoint().await.expect("endpoint");
    assert_ne!(now_used, used);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_does_not_prefer_the_leader_writes_through_its_member() {
    let cluster = Cluster::start(3);
    // A client that connected while no member knew a leader yet (or just before a second
    // election of the cluster's first moments) stays where it landed; one that connects
    // once a leader is known must sit on it. A broken preference fails within the deadline.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let on_leader = loop {
        let client = cluster.client().await;
        let status = client.status().await.expect("status");
        let header = status.header.expect("a status header");
        if header.member_id == status.leader {
            break client;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "a client that prefers the leader sits on it: member {} answered, the leader is {}",
            header.member_id,
            status.leader
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let leader_endpoint = on_leader.current_endpoint().await.expect("endpoint");
    let follower = cluster
        .nodes
        .iter()
        .find(|n| !leader_endpoint.ends_with(&n.client_addr))
        .expect("a follower")
        .client_addr
        .clone();

    // Control: given only the follower, a client that prefers the leader moves to it.
    let moved = Client::connect_with([follower.clone()], test_options())
        .await
        .expect("connect through the follower");
    let moved_to = moved.current_endpoint().await.expect("endpoint");
    assert_eq!(
        moved_to, leader_endpoint,
        "the default client moves to the leader"
    );

    let options = ClientOptions {
        prefer_leader: false,
        ..test_options()
    };
    let through_follower = Client::connect_with([follower.clone()], options)
        .await
        .expect("connect to the follower");
    let stays_on = through_follower.current_endpoint().await.expect("endpoint");
    assert!(
        stays_on.ends_with(&follower),
        "the client stays on {follower}, not {stays_on}"
    );
    let answered_by = through_follower.status().await.expect("status");
    let follower_id = answered_by.header.expect("a status header").member_id;
    assert_ne!(
        follower_id, answered_by.leader,
        "the member answering is a follower"
    );

    // Its writes go through the follower and are the cluster's.
    through_follower
        .put("through-a-follower", "v1", PutOptions::default())
        .await
        .expect("put through the follower");
    let read = on_leader
        .get("through-a-follower", GetOptions::default())
        .await
        .expect("get on the leader");
    assert_eq!(read.kvs[0].value_str(), "v1");
}
