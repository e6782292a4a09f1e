//! The `conclave` client commands against a real 3-node cluster, in human and `--json` modes,
//! and their error cases.

mod cli_support;
mod common;

use std::time::Duration;

use cli_support::{Streaming, run, run_until_ok, run_with_stdin};
use common::Cluster;

/// How long a streaming command may take to print its next line.
const LINE_TIMEOUT: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread")]
async fn kv_txn_and_watch_in_both_output_modes() {
    let cluster = Cluster::start(3).await;
    let eps = cluster.endpoints();
    let eps = eps.as_str();

    assert_eq!(run(eps, &["put", "app/a", "1"]).ok(), "OK\n");
    let first = run(eps, &["put", "app/b", "2", "--json"]).data();
    let rev_b = first["revision"].as_i64().expect("revision");
    assert_eq!(first["key"], "app/b");
    run(eps, &["put", "app/b", "3"]).ok();

    assert_eq!(run(eps, &["get", "app/a"]).ok(), "app/a\n1\n");
    let all = run(eps, &["get", "app/", "--prefix", "--json"]).data();
    assert_eq!(all["count"], 2);
    assert_eq!(all["kvs"][1]["key"], "app/b");
    assert_eq!(all["kvs"][1]["value"], "3");
    assert_eq!(all["kvs"][1]["version"], 2);
    let limited = run(eps, &["get", "app/", "--prefix", "--limit", "1", "--json"]).data();
    assert_eq!(limited["kvs"].as_array().map(Vec::len), Some(1));
    assert_eq!(limited["more"], true);
    let old = run(
        eps,
        &["get", "app/b", "--rev", &rev_b.to_string(), "--json"],
    )
    .data();
    assert_eq!(old["kvs"][0]["value"], "2");
    // Global flags work before the command too.
    let missing = run(eps, &["--json", "get", "app/none"]).data();
    assert_eq!(missing["count"], 0);

    let txn = "value(\"app/a\") = \"1\"\n\nput app/a swapped\nget app/a\n\nget app/a\n";
    let human = run_with_stdin(eps, &["txn"], txn.as_bytes());
    assert_eq!(human.ok(), "SUCCESS\n\nOK\n\napp/a\nswapped\n");
    let json = run_with_stdin(eps, &["txn", "--json"], txn.as_bytes()).data();
    assert_eq!(json["succeeded"], false, "the compare no longer holds");
    assert_eq!(json["responses"][0]["get"]["kvs"][0]["value"], "swapped");
    let bad = run_with_stdin(eps, &["txn", "--json"], b"size(\"a\") = \"1\"\n");
    bad.assert_error("invalid_argument", 2);

    // Watches from a past revision replay history, so there is no race with the writes.
    let watch = Streaming::start(
        eps,
        &[
            "watch",
            "app/",
            "--prefix",
            "--rev",
            &rev_b.to_string(),
            "--json",
        ],
    );
    let (_, event) = watch.next_json(LINE_TIMEOUT).expect("a watch event");
    assert_eq!(event["status"], "ok");
    assert_eq!(event["data"]["type"], "PUT");
    assert_eq!(event["data"]["kv"]["value"], "2");
    let (_, event) = watch.next_json(LINE_TIMEOUT).expect("a watch event");
    assert_eq!(event["data"]["kv"]["value"], "3");
    run(eps, &["del", "app/a"]).ok();
    let (_, event) = watch
        .next_json(LINE_TIMEOUT)
        .expect("the swap, then the delete");
    assert_eq!(event["data"]["kv"]["value"], "swapped");
    let (_, event) = watch.next_json(LINE_TIMEOUT).expect("the delete");
    assert_eq!(event["data"]["type"], "DELETE");
    assert_eq!(event["data"]["kv"]["key"], "app/a");
    let human_watch = Streaming::start(eps, &["watch", "app/b", "--rev", &rev_b.to_string()]);
    let lines: Vec<String> = (0..3)
        .filter_map(|_| human_watch.lines.recv_timeout(LINE_TIMEOUT).ok())
        .map(|(_, line)| line)
        .collect();
    assert_eq!(lines, ["PUT", "app/b", "2"]);

    assert_eq!(run(eps, &["del", "app/", "--prefix"]).ok(), "1\n");
    let deleted = run(eps, &["del", "app/", "--prefix", "--json"]).data();
    assert_eq!(deleted["deleted"], 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_input_gives_one_sentence_and_a_distinct_exit_code() {
    let cluster = Cluster::start(3).await;
    let eps = cluster.endpoints();
    let eps = eps.as_str();

    // A negative TTL: one sentence on stderr, nothing on stdout, exit 2.
    let human = run(eps, &["lease", "grant", "-3"]);
    assert_eq!(human.code, 2, "{human:?}");
    assert!(human.stdout.is_empty(), "{human:?}");
    assert_eq!(human.stderr.lines().count(), 1, "{human:?}");
    assert!(human.stderr.contains("must be positive"), "{human:?}");
    run(eps, &["lease", "grant", "-3", "--json"]).assert_error("invalid_argument", 2);
    run(eps, &["lock", "l", "--ttl", "-3", "--json"]).assert_error("invalid_argument", 2);

    // A value over the server's request limit (1.5 MiB), through stdin.
    let big = vec![b'x'; 2 * 1024 * 1024];
    run_with_stdin(eps, &["put", "big", "--json"], &big).assert_error("too_large", 6);
    let human = run_with_stdin(eps, &["put", "big"], &big);
    assert_eq!(human.code, 6, "{human:?}");
    assert_eq!(human.stderr.lines().count(), 1, "{human:?}");

    // An endpoint that refuses connections.
    let refused = format!("127.0.0.1:{}", common::free_port());
    run(&refused, &["get", "k", "--json"]).assert_error("connection_failed", 12);
    let human = run(&refused, &["get", "k"]);
    assert_eq!(human.code, 12, "{human:?}");
    assert_eq!(human.stderr.lines().count(), 1, "{human:?}");
    assert!(human.stderr.starts_with("conclave: error: "), "{human:?}");

    // Malformed ids, flags and durations.
    run(eps, &["lease", "revoke", "zz", "--json"]).assert_error("invalid_argument", 2);
    run(eps, &["get", "k", "--bogus", "--json"]).assert_error("invalid_argument", 2);
    run(eps, &["get", "k", "--timeout", "soon", "--json"]).assert_error("invalid_argument", 2);
    run(eps, &["get", "", "--json"]).assert_error("invalid_argument", 2);
    let future = run(eps, &["get", "k", "--rev", "1000000", "--json"]);
    assert_eq!(future.json()["status"], "error", "{future:?}");
    assert_ne!(future.code, 0);

    // The exit codes are documented in --help.
    let help = run(eps, &["--help"]);
    for code in [
        "no_leader",
        "unavailable",
        "timeout",
        "not_found",
        "invalid_argument",
        "compacted",
        "lease_expired",
        "already_exists",
        "leadership_lost",
        "too_large",
        "connection_failed",
    ] {
        assert!(help.ok().contains(code), "{code} missing from --help");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn cluster_commands_in_both_output_modes() {
    let cluster = Cluster::start(3).await;
    let eps = cluster.endpoints();
    let eps = eps.as_str();

    let members = run(eps, &["member", "list", "--json"]).data();
    assert_eq!(members["members"].as_array().map(Vec::len), Some(3));
    assert!(run(eps, &["member", "list"]).ok().starts_with("ID  NAME"));

    let status = run(eps, &["status", "--json"]).data();
    assert_eq!(status["healthy_members"], 3, "{status}");
    let leader = status["leader"].as_str().expect("a leader").to_string();
    let leaders = status["members"]
        .as_array()
        .map(|m| m.iter().filter(|m| m["is_leader"] == true).count());
    assert_eq!(leaders, Some(1));
    for member in status["members"].as_array().into_iter().flatten() {
        assert!(member["raft_index"].as_u64().is_some_and(|i| i > 0));
        assert!(member["applied_index"].as_u64().is_some());
        assert!(member["db_size"].as_i64().is_some());
    }
    let table = run(eps, &["status"]);
    assert!(table.ok().contains("RAFT INDEX"), "{table:?}");
    assert_eq!(table.stdout.matches("leader").count(), 1, "{table:?}");

    // Hand leadership to a follower.
    let target = status["members"]
        .as_array()
        .and_then(|m| m.iter().find(|m| m["is_leader"] == false))
        .and_then(|m| m["id"].as_str())
        .expect("a follower")
        .to_string();
    let moved = run(eps, &["transfer-leader", &target, "--json"]).data();
    assert_eq!(moved["leader"], target.as_str());
    assert_eq!(moved["previous_leader"], leader.as_str());
    let after = run_until_ok(eps, &["status", "--json"], Duration::from_secs(5)).data();
    assert_eq!(after["leader"], target.as_str());
    run(eps, &["transfer-leader", "nobody", "--json"]).assert_error("not_found", 3);

    run(eps, &["put", "snap/k", "v"]).ok();
    let file = cluster.root.join("backup.snap");
    let file_arg = file.to_string_lossy().to_string();
    let saved = run(eps, &["snapshot", "save", &file_arg, "--json"]).data();
    let bytes = saved["bytes"].as_u64().expect("bytes");
    assert!(bytes > 0);
    assert_eq!(std::fs::metadata(&file).map(|m| m.len()).ok(), Some(bytes));
}

#[tokio::test(flavor = "multi_thread")]
async fn bench_reports_throughput_and_latency_percentiles() {
    let cluster = Cluster::start(3).await;
    let eps = cluster.endpoints();
    let eps = eps.as_str();
    for op in ["put", "get", "txn", "lock", "publish", "queue"] {
        let report = run(
            eps,
            &[
                "bench",
                op,
                "--clients",
                "4",
                "--duration",
                "1s",
                "--key-space",
                "20",
                "--json",
            ],
        )
        .data();
        assert_eq!(report["op"], op);
        assert!(report["ops"].as_u64().is_some_and(|n| n > 0), "{report}");
        assert_eq!(report["errors"], 0, "{report}");
        assert!(report["ops_per_s"].as_f64().is_some_and(|r| r > 0.0));
        let latency = &report["latency_ms"];
        let p = |k: &str| latency[k].as_f64().unwrap_or(-1.0);
        assert!(0.0 < p("p50") && p("p50") <= p("p90") && p("p90") <= p("p99"));
        assert!(p("p99") <= p("p99_9") && p("p99_9") <= p("max"), "{report}");
    }
    // --spread: the clients' connections go to every member, followers included.
    for op in ["put", "publish", "queue"] {
        let report = run(
            eps,
            &[
                "bench",
                op,
                "--clients",
                "6",
                "--duration",
                "500ms",
                "--spread",
                "--json",
            ],
        )
        .data();
        assert_eq!(
            report["endpoints"].as_array().map(Vec::len),
            Some(3),
            "{report}"
        );
        assert!(report["ops"].as_u64().is_some_and(|n| n > 0), "{report}");
        assert_eq!(report["errors"], 0, "{report}");
    }
    let table = run(
        eps,
        &["bench", "put", "--clients", "2", "--duration", "500ms"],
    );
    assert!(table.ok().starts_with("OP   CLIENTS"), "{table:?}");
    run(eps, &["bench", "put", "--clients", "0", "--json"]).assert_error("invalid_argument", 2);

    // Failover: each round's leader stops heartbeating; the next is elected within the TTL.
    let report = run(
        eps,
        &["bench", "elect", "--rounds", "2", "--ttl", "1s", "--json"],
    )
    .data();
    let fences: Vec<u64> = report["fences"]
        .as_array()
        .map(|f| f.iter().filter_map(|x| x.as_u64()).collect())
        .unwrap_or_default();
    assert_eq!(fences.len(), 3, "{report}");
    assert!(fences.windows(2).all(|w| w[0] < w[1]), "{report}");
    let max = report["failover_ms"]["max"].as_f64().unwrap_or(f64::MAX);
    assert!(max > 0.0 && max <= 2000.0, "{report}");
}

#[test]
fn daemon_start_status_stop_with_pid_and_log_files() {
    let dir = std::env::temp_dir().join(format!("conclave-cli-daemon-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let port = || format!("127.0.0.1:{}", common::free_port());
    let (client, peer) = (port(), port());
    let dir_arg = dir.to_string_lossy().to_string();
    let started = run(
        "unused:1",
        &[
            "daemon",
            "start",
            "--data-dir",
            &dir_arg,
            "--listen-client",
            &client,
            "--listen-peer",
            &peer,
            "--json",
        ],
    )
    .data();
    assert!(started["pid"].as_u64().is_some());
    assert!(dir.join("conclave.pid").exists() && dir.join("conclave.log").exists());
    run(&client, &["put", "k", "v"]).ok();
    let again = run(
        "unused:1",
        &[
            "daemon",
            "start",
            "--data-dir",
            &dir_arg,
            "--listen-client",
            &client,
            "--listen-peer",
            &peer,
            "--json",
        ],
    );
    again.assert_error("already_exists", 4);
    let status = run(
        "unused:1",
        &["daemon", "status", "--data-dir", &dir_arg, "--json"],
    )
    .data();
    assert_eq!(status["running"], true);
    let stopped = run(
        "unused:1",
        &["daemon", "stop", "--data-dir", &dir_arg, "--json"],
    )
    .data();
    assert_eq!(stopped["stopped"], true);
    run(
        "unused:1",
        &["daemon", "status", "--data-dir", &dir_arg, "--json"],
    )
    .assert_error("not_found", 3);
    assert!(!dir.join("conclave.pid").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A member streams at most 4 snapshots at once (`SNAPSHOT_CALLS_MAX`), each encoded while it
/// is read: a fifth call is refused with RESOURCE_EXHAUSTED, a client that walks away frees
/// its place, and a stream read to its end is the whole image, counting down to zero.
#[tokio::test(flavor = "multi_thread")]
async fn snapshot_streams_are_bounded_and_count_down_to_zero() {
    use conclave_proto::etcdserverpb::kv_client::KvClient;
    use conclave_proto::etcdserverpb::maintenance_client::MaintenanceClient;
    use conclave_proto::etcdserverpb::{PutRequest, SnapshotRequest};

    let cluster = Cluster::start(1).await;
    let mut kv = KvClient::new(cluster.channel(1));
    // 8 MB of values: far more than one call may encode ahead of its client.
    for i in 0..80 {
        kv.put(PutRequest {
            key: format!("snapshot/{i}").into_bytes().into(),
            value: vec![b'v'; 100 * 1024].into(),
            ..Default::default()
        })
        .await
        .expect("put");
    }
    // Each call on a connection of its own: streams nobody reads hold their connection's
    // HTTP/2 window, which would stall any other stream on it.
    let maintenance = || MaintenanceClient::new(cluster.channel(1));
    let mut unread = Vec::new();
    for _ in 0..4 {
        let stream = maintenance()
            .snapshot(SnapshotRequest {})
            .await
            .expect("one of the four snapshot calls")
            .into_inner();
        unread.push(stream);
    }
    let refused = maintenance()
        .snapshot(SnapshotRequest {})
        .await
        .expect_err("a fifth snapshot call while four stream");
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );

    drop(unread.pop());
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut stream = loop {
        match maintenance().snapshot(SnapshotRequest {}).await {
            Ok(response) => break response.into_inner(),
            Err(status) if status.code() == tonic::Code::ResourceExhausted => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the place of the abandoned call was never freed"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(status) => panic!("snapshot: {status:?}"),
        }
    };
    let mut received: u64 = 0;
    let mut expected_total = None;
    let mut last_remaining = u64::MAX;
    while let Some(blob) = stream.message().await.expect("the stream reads to its end") {
        received += blob.blob.len() as u64;
        let total = *expected_total.get_or_insert(received + blob.remaining_bytes);
        assert_eq!(
            received + blob.remaining_bytes,
            total,
            "remaining_bytes after {received}"
        );
        last_remaining = blob.remaining_bytes;
    }
    assert_eq!(last_remaining, 0, "the stream ended where the image does");
    assert!(
        received > 8_000_000,
        "the image holds the values: {received} bytes"
    );
}
