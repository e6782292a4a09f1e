//! `etcd-bench` measures what it says: against a `put-floor` leader, which logs every put
//! before it answers, the puts the generator counts are the puts the leader logged, on one
//! thread and on several; and bad arguments or an unreachable endpoint get one sentence.

mod common;

use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::{floor, logged_records, scratch_dir};

/// How long put-floor's leader may take to listen.
const START_WAIT: Duration = Duration::from_secs(20);

fn bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_etcd-bench"))
        .args(args)
        .output()
        .expect("run etcd-bench")
}

fn wait_listening(addr: SocketAddr) {
    let started = Instant::now();
    while TcpStream::connect(addr).is_err() {
        assert!(
            started.elapsed() < START_WAIT,
            "put-floor's leader at {addr} did not listen"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn counted_puts_are_logged_puts(threads: &str) {
    let dir = scratch_dir(&format!("threads-{threads}"));
    let (_processes, leader) = floor(&dir, false);
    wait_listening(leader);
    let output = bench(&[
        "--endpoints",
        &leader.to_string(),
        "--op",
        "put",
        "--clients",
        "4",
        "--threads",
        threads,
        "--value-size",
        "16",
        "--duration",
        "300ms",
        "--json",
    ]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "etcd-bench failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("one JSON object");
    assert_eq!(report["errors"], 0, "{stdout}");
    let ops = report["ops"].as_u64().expect("an op count");
    assert!(ops > 0, "no put answered in 300 ms: {stdout}");
    // Every put the generator counted was answered, so the leader logged it first; and the
    // generator sent nothing else.
    let logged = logged_records(&dir.join("leader").join("log")).len();
    assert_eq!(
        logged as u64, ops,
        "puts logged by the leader against puts counted"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn on_one_thread_the_counted_puts_are_the_logged_puts() {
    counted_puts_are_logged_puts("1");
}

#[test]
fn on_two_threads_the_counted_puts_are_the_logged_puts() {
    counted_puts_are_logged_puts("2");
}

#[test]
fn a_thread_count_out_of_range_is_refused() {
    let output = bench(&["--op", "put", "--threads", "0"]);
    assert!(!output.status.success(), "--threads 0 was accepted");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--threads must be 1 to 64"), "{stderr}");
}

#[test]
fn an_unreachable_endpoint_is_one_sentence() {
    // Port 1 (tcpmux) below the ephemeral range: no other test's server is handed it, and
    // the client's own source port cannot be it (a port freed for this test was once taken
    // by a concurrent test's server, which then answered).
    let closed = "127.0.0.1:1".to_string();
    let output = bench(&["--endpoints", &closed, "--op", "put", "--duration", "100ms"]);
    assert!(!output.status.success(), "a run without a server succeeded");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.starts_with(&format!("etcd-bench: cannot connect to {closed}: ")),
        "{stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
}
