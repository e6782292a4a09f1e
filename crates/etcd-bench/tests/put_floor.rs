//! `put-floor` does the work it claims to measure: each answered put is in the leader's log
//! and in both followers' logs, and the answers count up.

mod common;

use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{floor, logged_records, scratch_dir};

use conclave_proto::etcdserverpb::PutRequest;
use conclave_proto::etcdserverpb::kv_client::KvClient;
use prost::Message;

/// How long a put or a log's catching up may take before the test fails.
const ANSWER_WAIT: Duration = Duration::from_secs(10);

async fn connect(addr: SocketAddr) -> KvClient<tonic::transport::Channel> {
    let started = Instant::now();
    loop {
        match KvClient::connect(format!("http://{addr}")).await {
            Ok(client) => return client,
            Err(error) if started.elapsed() > Duration::from_secs(20) => {
                panic!("put-floor's leader at {addr} did not answer: {error}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

async fn every_put_is_in_three_logs(inline: bool) {
    let dir = scratch_dir(if inline {
        "floor-inline"
    } else {
        "floor-writer"
    });
    let (_processes, leader) = floor(&dir, inline);
    let mut client = connect(leader).await;
    let mut sent = Vec::new();
    for i in 1..=3u8 {
        let request = PutRequest {
            key: format!("floor/{i}").into_bytes().into(),
            value: vec![i; 256].into(),
            ..Default::default()
        };
        let answer = tokio::time::timeout(ANSWER_WAIT, client.put(request.clone()))
            .await
            .expect("put-floor answers a put within the wait")
            .expect("put")
            .into_inner();
        let revision = answer.header.expect("a header").revision;
        assert_eq!(revision, i64::from(i), "one frame per put, one client");
        sent.push(request.encode_to_vec());
    }
    // The leader answered after one follower's acknowledgement; the other may lag a little.
    let started = Instant::now();
    for name in ["leader", "f1", "f2"] {
        let log = dir.join(name).join("log");
        let logged = loop {
            let records = logged_records(&log);
            if records.len() >= sent.len() {
                break records[..sent.len()].to_vec();
            }
            assert!(
                started.elapsed() < ANSWER_WAIT,
                "{name}'s log lacks the three puts"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(logged, sent, "{name}'s log");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_through_the_writer_thread_is_in_three_logs() {
    every_put_is_in_three_logs(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inline_put_is_in_three_logs() {
    every_put_is_in_three_logs(true).await;
}

/// Runs put-floor with `args`, which it must refuse, and returns what it said.
fn refused(args: &[&str]) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_put-floor"))
        .args(args)
        .output()
        .expect("run put-floor");
    assert!(!output.status.success(), "put-floor accepted {args:?}");
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn a_log_size_out_of_range_is_refused() {
    let stderr = refused(&[
        "follower",
        "--listen",
        "127.0.0.1:0",
        "--dir",
        "/nonexistent",
        "--log-mib",
        "0",
    ]);
    assert!(
        stderr.contains("--log-mib must be 1 to 4096, got 0"),
        "{stderr}"
    );
}

#[test]
fn a_leader_needs_two_followers() {
    let stderr = refused(&[
        "leader",
        "--listen",
        "127.0.0.1:0",
        "--followers",
        "127.0.0.1:1",
        "--dir",
        "/nonexistent",
    ]);
    assert!(
        stderr.contains("--followers needs two addresses, got 1"),
        "{stderr}"
    );
}
