//! Black-box tests: real `conclave serve` processes on loopback ports, driven through the
//! etcd v3 gRPC API with tonic.

mod common;

use std::time::{Duration, Instant};

use common::{Cluster, WRITES_PAST_HELD_APPENDS};
use conclave_proto::etcdserverpb::compare::{CompareResult, CompareTarget, TargetUnion};
use conclave_proto::etcdserverpb::request_op::Request as Op;
use conclave_proto::etcdserverpb::{
    Compare, DeleteRangeRequest, PutRequest, RangeRequest, RequestOp, StatusRequest, TxnRequest,
};
use tonic::Code;

fn put(key: &str, value: &str) -> PutRequest {
    PutRequest {
        key: key.to_string().into(),
        value: value.to_string().into(),
        ..Default::default()
    }
}

fn get(key: &str) -> RangeRequest {
    RangeRequest {
        key: key.to_string().into(),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn single_node_put_get_delete_txn_with_etcd_headers_and_errors() {
    let cluster = Cluster::start(1).await;
    let mut kv = cluster.kv(1).await;

    let first = kv.put(put("a", "1")).await.expect("put").into_inner();
    let header = first.header.expect("header");
    assert_eq!(header.member_id, 1);
    assert_ne!(header.cluster_id, 0);
    assert!(header.raft_term >= 1);
    assert_eq!(
        header.revision, 2,
        "the first write makes revision 2, as in etcd"
    );
    kv.put(put("ab", "2")).await.expect("put");

    let read = kv.range(get("a")).await.expect("range").into_inner();
    assert_eq!(read.kvs.len(), 1);
    assert_eq!(&read.kvs[0].value[..], b"1");
    assert_eq!(read.header.expect("header").revision, 3);

    let mut prefix = get("a");
    prefix.range_end = "b".into();
    prefix.serializable = true;
    let read = kv.range(prefix).await.expect("range").into_inner();
    assert_eq!(read.count, 2);

    // Txn: compare a's value, then swap it.
    let txn = TxnRequest {
        compare: vec![Compare {
            result: CompareResult::Equal as i32,
            target: CompareTarget::Value as i32,
            key: "a".into(),
            target_union: Some(TargetUnion::Value("1".into())),
            range_end: Default::default(),
        }],
        success: vec![RequestOp {
            request: Some(Op::RequestPut(put("a", "swapped"))),
        }],
        failure: vec![],
    };
    let answer = kv.txn(txn.clone()).await.expect("txn").into_inner();
    assert!(answer.succeeded);
    let again = kv.txn(txn).await.expect("txn").into_inner();
    assert!(!again.succeeded, "the compare no longer holds");
    let read = kv.range(get("a")).await.expect("range").into_inner();
    assert_eq!(&read.kvs[0].value[..], b"swapped");

    let deleted = kv
        .delete_range(DeleteRangeRequest {
            key: "a".into(),
            range_end: "b".into(),
            prev_kv: true,
        })
        .await
        .expect("delete")
        .into_inner();
    assert_eq!(deleted.deleted, 2);
    assert_eq!(deleted.prev_kvs.len(), 2);
    assert_eq!(
        kv.range(get("a")).await.expect("range").into_inner().count,
        0
    );

    // etcd's exact errors and codes.
    let error = kv.put(put("", "x")).await.expect_err("empty key");
    assert_eq!(error.code(), Code::InvalidArgument);
    assert_eq!(error.message(), "etcdserver: key is not provided");
    // Above 1.5 MiB but within the gRPC slack, so the server (not the codec) refuses it.
    let too_large = "x".repeat(1600 * 1024);
    let error = kv.put(put("big", &too_large)).await.expect_err("too large");
    assert_eq!(error.code(), Code::InvalidArgument);
    assert_eq!(error.message(), "etcdserver: request is too large");
    let mut future = get("a");
    future.revision = 1_000;
    let error = kv.range(future).await.expect_err("future revision");
    assert_eq!(error.code(), Code::OutOfRange);
    assert_eq!(
        error.message(),
        "etcdserver: mvcc: required revision is a future revision"
    );

    let status = cluster
        .maintenance(1)
        .await
        .status(StatusRequest {})
        .await
        .expect("status")
        .into_inner();
    assert_eq!(status.leader, 1);
    assert!(status.version.starts_with("3.4"));
    assert!(status.raft_index >= status.raft_applied_index.min(status.raft_index));
}

#[tokio::test(flavor = "multi_thread")]
async fn single_node_keeps_acknowledged_writes_across_restart_and_snapshots() {
    let mut cluster = Cluster::start(1).await;
    let mut kv = cluster.kv(1).await;
    // More than --snapshot-entries (50), so the log is compacted behind a snapshot.
    for i in 0..120 {
        kv.put(put(&format!("k{i:03}"), &i.to_string()))
            .await
            .expect("put");
    }
    assert!(cluster.terminate(1), "SIGTERM ends the node cleanly");
    cluster.spawn(1);
    cluster.wait_for_leader(common::STARTUP_TIMEOUT).await;
    let mut kv = cluster.kv(1).await;
    let mut all = get("k");
    all.range_end = "l".into();
    let read = kv.range(all).await.expect("range").into_inner();
    assert_eq!(read.count, 120);
    assert_eq!(read.header.expect("header").revision, 121);
}

#[tokio::test(flavor = "multi_thread")]
async fn three_nodes_write_anywhere_read_everywhere_and_fail_over_after_kill() {
    let mut cluster = Cluster::start(3).await;

    // Writes through every member (followers forward to the leader).
    for id in 1..=3 {
        let mut kv = cluster.kv(id).await;
        kv.put(put(&format!("from{id}"), "v")).await.expect("put");
    }
    for id in 1..=3 {
        let mut kv = cluster.kv(id).await;
        let mut all = get("from");
        all.range_end = "fron".into();
        // Linearizable: every acknowledged write is visible from every member at once.
        let read = kv.range(all).await.expect("range").into_inner();
        assert_eq!(read.count, 3, "member {id} sees every write");
    }

    // Kill the leader without warning and time the first write a new leader acknowledges.
    let mut acked = Vec::new();
    for i in 0..20 {
        let key = format!("before{i}");
        cluster
            .put_until_acked(1, &key, "v", Duration::from_secs(5))
            .await;
        acked.push(key);
    }
    let leader = cluster.wait_for_leader(Duration::from_secs(5)).await;
    let survivor = (1..=3).find(|&id| id != leader).expect("a follower");
    let last_ack = Instant::now();
    cluster.kill(leader);
    cluster
        .put_until_acked(survivor, "after-kill", "v", Duration::from_secs(10))
        .await;
    let failover = last_ack.elapsed();
    acked.push("after-kill".to_string());
    println!(
        "failover: {} ms from SIGKILL of leader {leader} to the first write acknowledged through member {survivor}",
        failover.as_millis()
    );
    assert!(
        failover < Duration::from_secs(5),
        "failover took {failover:?}"
    );
    let new_leader = cluster.wait_for_leader(Duration::from_secs(5)).await;
    assert_ne!(new_leader, leader);

    // Nothing acknowledged was lost, and the killed node catches up after a restart.
    cluster.spawn(leader);
    for id in 1..=3 {
        let mut kv = cluster.kv(id).await;
        for key in &acked {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                match kv.range(get(key)).await {
                    Ok(read) if read.get_ref().count == 1 => break,
                    _ if Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(20)).await
                    }
                    other => panic!("member {id} lost acknowledged key {key}: {other:?}"),
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn requests_fail_with_no_leader_when_quorum_is_lost() {
    let mut cluster = Cluster::start(3).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(5)).await;
    let survivor = (1..=3).find(|&id| id != leader).expect("a follower");
    for id in (1..=3).filter(|&id| id != survivor) {
        cluster.kill(id);
    }
    // Wait until the survivor has noticed that its leader is gone (election timeout).
    let noticed = Instant::now();
    while cluster.status(survivor).await.map(|s| s.leader) != Some(0) {
        assert!(
            noticed.elapsed() < Duration::from_secs(30),
            "the survivor never noticed its leader was gone"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut kv = cluster.kv(survivor).await;
    let mut request = tonic::Request::new(put("k", "v"));
    request.set_timeout(Duration::from_millis(800));
    let started = Instant::now();
    let error = kv.put(request).await.expect_err("no quorum");
    assert_eq!(error.code(), Code::Unavailable, "{error:?}");
    assert_eq!(error.message(), "etcdserver: no leader");
    // Answered at its 800 ms deadline (generous for a loaded machine), not held on.
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_follower_restarted_after_compaction_catches_up_by_snapshot() {
    // Enough writes that the leader's log is compacted past everything it still holds for
    // the stopped follower: only a snapshot can bring it back.
    const WRITES: usize = WRITES_PAST_HELD_APPENDS;
    let mut cluster = Cluster::start(3).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(5)).await;
    let follower = (1..=3).find(|&id| id != leader).expect("a follower");
    cluster.kill(follower);

    let mut kv = cluster.kv(leader).await;
    for i in 0..WRITES {
        kv.put(put(&format!("compacted/{i:04}"), "v"))
            .await
            .expect("put with two of three members up");
    }

    cluster.spawn(follower);
    cluster
        .wait_caught_up(follower, Duration::from_secs(20))
        .await;
    let log = std::fs::read_to_string(cluster.root.join(format!("node{follower}.log")))
        .expect("the follower's log");
    assert!(
        log.contains("snapshot from the leader installed"),
        "member {follower} caught up without installing a snapshot"
    );
    // A serializable read answers from the follower's own state: all of it is there.
    let mut local = cluster.kv(follower).await;
    let mut all = get("compacted/");
    all.range_end = "compacted0".into();
    all.serializable = true;
    let read = local.range(all).await.expect("range").into_inner();
    assert_eq!(
        read.count, WRITES as i64,
        "the restarted follower has every write"
    );
    println!("member {follower} restored from a snapshot and holds all {WRITES} writes");
}
