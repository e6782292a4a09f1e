//! The metrics listener of real members: `/metrics` counters move with the load and with a
//! leader change, `etcd_server_has_leader` drops to 0 on a member left without a quorum, and
//! `/health`, `/readyz` and `grpc.health.v1` on the client port say so too.

mod common;

use std::time::{Duration, Instant};

use common::{Cluster, http_get as get};
use conclave_proto::etcdserverpb::PutRequest;
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// Puts of the load phase, spread over concurrent writers.
const PUTS: u64 = 400;
const WRITERS: u64 = 8;
/// Generous bounds for a shared, noisy machine.
const SETTLE: Duration = Duration::from_secs(20);

/// The value of the sample named exactly `sample` (labels included) in a scrape.
fn sample(scrape: &str, sample: &str) -> Option<f64> {
    scrape.lines().find_map(|line| {
        let rest = line.strip_prefix(sample)?;
        rest.strip_prefix(' ')?.trim().parse().ok()
    })
}

async fn scrape(cluster: &Cluster, id: u64) -> String {
    let url = format!("{}/metrics", cluster.metrics_url(id));
    match get(&url).await {
        Some((200, body)) => body,
        other => panic!("scrape of member {id} failed: {other:?}"),
    }
}

async fn metric(cluster: &Cluster, id: u64, name: &str) -> f64 {
    let text = scrape(cluster, id).await;
    sample(&text, name).unwrap_or_else(|| panic!("{name} missing from member {id}:\n{text}"))
}

/// Waits until `check` holds for member `id`'s metric `name`; returns the value.
async fn wait_metric(cluster: &Cluster, id: u64, name: &str, check: impl Fn(f64) -> bool) -> f64 {
    let start = Instant::now();
    loop {
        let value = metric(cluster, id, name).await;
        if check(value) {
            return value;
        }
        assert!(
            start.elapsed() < SETTLE,
            "{name} of member {id} stuck at {value}; logs in {}",
            cluster.root.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn grpc_health(cluster: &Cluster, id: u64) -> Option<ServingStatus> {
    let channel = Channel::from_shared(cluster.endpoint(id))
        .ok()?
        .connect_lazy();
    let mut client = HealthClient::new(channel);
    let mut request = tonic::Request::new(HealthCheckRequest {
        service: String::new(),
    });
    request.set_timeout(Duration::from_secs(1));
    let answer = client.check(request).await.ok()?.into_inner();
    ServingStatus::try_from(answer.status).ok()
}

#[tokio::test(flavor = "multi_thread")]
async fn metrics_follow_load_leader_changes_and_lost_quorum() {
    let mut cluster = Cluster::start(3).await;
    let leader = cluster.wait_for_leader(SETTLE).await;
    let follower = (1..=3).find(|&id| id != leader).unwrap();
    // Every member knows the leader once it has heard from it.
    for id in 1..=3 {
        wait_metric(&cluster, id, "etcd_server_has_leader", |v| v == 1.0).await;
    }

    // ---- load: committed proposals rise by at least the number of puts -----------------
    let committed_before = metric(&cluster, leader, "etcd_server_proposals_committed_total").await;
    let puts_label = "grpc_server_handled_total{grpc_type=\"unary\",grpc_service=\"etcdserverpb.KV\",grpc_method=\"Put\",grpc_code=\"OK\"}";
    let puts_before = sample(&scrape(&cluster, follower).await, puts_label).unwrap_or(0.0);
    let mut writers = Vec::new();
    for writer in 0..WRITERS {
        let mut kv = cluster.kv(follower).await;
        writers.push(tokio::spawn(async move {
            for n in 0..PUTS / WRITERS {
                let mut request = tonic::Request::new(PutRequest {
                    key: format!("load/{writer}/{n}").into(),
                    value: "v".into(),
                    ..Default::default()
                });
                request.set_timeout(Duration::from_secs(5));
                kv.put(request).await.expect("put under load");
            }
        }));
    }
    for writer in writers {
        writer.await.expect("writer");
    }
    let committed = wait_metric(
        &cluster,
        leader,
        "etcd_server_proposals_committed_total",
        |v| v >= committed_before + PUTS as f64,
    )
    .await;
    let applied = wait_metric(
        &cluster,
        follower,
        "etcd_server_proposals_applied_total",
        |v| v >= committed_before + PUTS as f64,
    )
    .await;
    let puts_after = sample(&scrape(&cluster, follower).await, puts_label).unwrap_or(0.0);
    assert!(
        puts_after - puts_before >= PUTS as f64,
        "grpc_server_handled_total for Put rose by {} only",
        puts_after - puts_before
    );
    let fsyncs = metric(
        &cluster,
        leader,
        "etcd_disk_wal_fsync_duration_seconds_count",
    )
    .await;
    assert!(fsyncs >= 1.0, "the leader's fsyncs are not timed");
    eprintln!(
        "committed {committed_before} -> {committed}, follower applied {applied}, {fsyncs} fsyncs timed"
    );

    // ---- a leader kill: every survivor sees exactly one more leader -----------------------
    let changes_before = metric(&cluster, follower, "etcd_server_leader_changes_seen_total").await;
    cluster.kill(leader);
    let new_leader = cluster.wait_for_leader(SETTLE).await;
    assert_ne!(new_leader, leader);
    let changes = wait_metric(
        &cluster,
        follower,
        "etcd_server_leader_changes_seen_total",
        |v| v > changes_before,
    )
    .await;
    // Split votes may elect nobody for a round, but a leader seen is counted once.
    assert!(
        changes - changes_before <= 2.0,
        "one kill counted {} leader changes",
        changes - changes_before
    );
    assert_eq!(
        grpc_health(&cluster, follower).await,
        Some(ServingStatus::Serving)
    );
    let (status, body) = get(&format!("{}/health", cluster.metrics_url(follower)))
        .await
        .expect("health answers");
    assert_eq!(
        (status, body.trim()),
        (200, r#"{"health":"true","reason":""}"#)
    );

    // ---- lost quorum: the last member has no leader, and every endpoint says so -----------
    let last = (1..=3)
        .find(|&id| id != leader && id != new_leader)
        .unwrap();
    cluster.kill(new_leader);
    wait_metric(&cluster, last, "etcd_server_has_leader", |v| v == 0.0).await;
    let (status, body) = get(&format!("{}/health", cluster.metrics_url(last)))
        .await
        .expect("health answers");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains(r#""health":"false""#), "{body}");
    let (status, body) = get(&format!("{}/readyz", cluster.metrics_url(last)))
        .await
        .expect("readyz answers");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("no leader"), "{body}");
    let start = Instant::now();
    while grpc_health(&cluster, last).await != Some(ServingStatus::NotServing) {
        assert!(
            start.elapsed() < SETTLE,
            "grpc.health.v1 still SERVING without a leader"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn readyz_and_top_json_answer_on_a_healthy_cluster() {
    let cluster = Cluster::start(3).await;
    let leader = cluster.wait_for_leader(SETTLE).await;
    let start = Instant::now();
    for id in 1..=3 {
        loop {
            let answer = get(&format!("{}/readyz", cluster.metrics_url(id))).await;
            if matches!(&answer, Some((200, body)) if body.trim() == "ok") {
                break;
            }
            assert!(
                start.elapsed() < SETTLE,
                "member {id} never ready: {answer:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_conclave"))
        .args(["top", "--json", "--metrics", &cluster.nodes[0].metrics])
        .output()
        .expect("run conclave top");
    assert!(output.status.success(), "{output:?}");
    let document: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("top --json prints one JSON document");
    let members = document["data"]["members"].as_array().expect("members");
    assert_eq!(members.len(), 3, "{document}");
    assert_eq!(
        document["data"]["leader"].as_str(),
        Some(format!("{leader:x}").as_str())
    );
    let (status, _) = get(&format!("{}/nope", cluster.metrics_url(1)))
        .await
        .expect("answers");
    assert_eq!(status, 404);
}

/// The work queue gauges follow pushes and claims on every member (each reads its own applied
/// state, so a follower shows them once it has applied them).
#[tokio::test(flavor = "multi_thread")]
async fn queue_depth_follows_pushes_and_claims() {
    let cluster = Cluster::start(3).await;
    cluster.wait_for_leader(SETTLE).await;
    let conclave = |args: &[&str]| {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_conclave"))
            .args(["--json", "--endpoints", &cluster.endpoints()])
            .args(args)
            .output()
            .expect("run conclave");
        assert!(output.status.success(), "{args:?}: {output:?}");
    };
    for n in 0..3 {
        conclave(&[
            "queue",
            "push",
            "depth",
            "--data",
            &format!("{{\"n\":{n}}}"),
        ]);
    }
    conclave(&["queue", "claim", "depth", "--worker", "w1"]);
    for id in 1..=3 {
        wait_metric(&cluster, id, "conclave_queue_depth{state=\"ready\"}", |v| {
            v == 2.0
        })
        .await;
        wait_metric(
            &cluster,
            id,
            "conclave_queue_depth{state=\"in_flight\"}",
            |v| v == 1.0,
        )
        .await;
        assert_eq!(metric(&cluster, id, "conclave_queues").await, 1.0);
    }
}

/// `conclave_election_leader_changes_total{group}` counts every new leader of a priority
/// election group, on every member, as the member applies the election.
#[tokio::test(flavor = "multi_thread")]
async fn election_leader_changes_are_counted_per_group_on_every_member() {
    let cluster = Cluster::start(3).await;
    cluster.wait_for_leader(SETTLE).await;
    // Each campaign wins the empty group, runs `true` and resigns.
    let campaign = |candidate: &str| {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_conclave"))
            .args(["--json", "--endpoints", &cluster.endpoints()])
            .args(["elect", "campaign", "workers", "--id", candidate])
            .args(["--priority", "1", "--", "true"])
            .output()
            .expect("run conclave");
        assert!(output.status.success(), "{candidate}: {output:?}");
    };
    campaign("a");
    campaign("b");
    for id in 1..=3 {
        wait_metric(
            &cluster,
            id,
            "conclave_election_leader_changes_total{group=\"workers\"}",
            |v| v == 2.0,
        )
        .await;
    }
}
