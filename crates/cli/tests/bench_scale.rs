//! `conclave bench scale` against a real 3-member cluster: sessions and election groups are
//! held through a SIGKILL of the Raft leader with no lease lost and no group leaderless, and
//! (the negative control) revoking the sessions under the tool shows up as refused keepalives
//! and leaderless groups, so those zeros are measured, not assumed.

mod cli_support;
mod common;

use std::time::Duration;

use cli_support::{Streaming, run};
use common::Cluster;
use serde_json::Value;

/// How long the tool may take to register everything and print its first report.
const FIRST_REPORT_WAIT: Duration = Duration::from_secs(60);
/// How long the tool may take, after the last report, to print its summary.
const SUMMARY_WAIT: Duration = Duration::from_secs(60);
const SESSIONS: u64 = 30;
const GROUPS: u64 = 10;

fn start(eps: &str, duration: &str) -> Streaming {
    Streaming::start(
        eps,
        &[
            "--timeout",
            "5s",
            "--json",
            "bench",
            "scale",
            "--sessions",
            &SESSIONS.to_string(),
            "--groups",
            &GROUPS.to_string(),
            "--streams",
            "3",
            "--duration",
            duration,
            "--report-every",
            "1s",
            "--sweep-pause",
            "200ms",
        ],
    )
}

/// Waits for the first progress report.
fn first_report(tool: &Streaming) -> Value {
    let (_, line) = tool
        .next_json(FIRST_REPORT_WAIT)
        .expect("a first progress report");
    assert_eq!(line["status"], "progress", "{line}");
    line["data"].clone()
}

/// Reads lines to the final summary's data.
fn summary(tool: &mut Streaming) -> Value {
    loop {
        let (_, line) = tool.next_json(SUMMARY_WAIT).expect("the final summary");
        match line["status"].as_str() {
            Some("progress") => continue,
            Some("ok") => {
                assert_eq!(tool.wait_code(SUMMARY_WAIT), Some(0));
                return line["data"].clone();
            }
            _ => panic!("unexpected line {line}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn bench_scale_holds_every_session_and_group_across_a_leader_kill() {
    let mut cluster = Cluster::start(3).await;
    let eps = cluster.endpoints();
    let leader = cluster.wait_for_leader(Duration::from_secs(10)).await;

    // Phase 1: the Raft leader is killed under load; no lease may lapse and no group may lose
    // or change its leader (leases and elections are replicated state).
    let mut tool = start(&eps, "10s");
    let report = first_report(&tool);
    assert!(
        report["keepalives_per_s"].as_f64().is_some_and(|r| r > 0.0),
        "{report}"
    );
    std::thread::sleep(Duration::from_secs(2));
    cluster.kill(leader);
    let done = summary(&mut tool);
    assert_eq!(done["sessions"], SESSIONS);
    assert_eq!(done["groups"], GROUPS);
    // Generous: about SESSIONS per second are sent; a failover costs a second or two.
    let rate = done["keepalives_per_s"].as_f64().unwrap_or(0.0);
    assert!(
        rate > SESSIONS as f64 / 3.0 && rate < SESSIONS as f64 * 2.0,
        "{done}"
    );
    assert_eq!(done["refused"], 0, "{done}");
    assert_eq!(done["leaderless"], 0, "{done}");
    assert_eq!(done["leader_failed"], 0, "{done}");
    assert_eq!(done["leaders_changed"], 0, "{done}");
    let sweeps = done["sweeps"].as_array().expect("sweeps");
    assert!(sweeps.len() >= 2, "{done}");
    // No keepalive is answered between the kill and the next leader's election (at least one
    // 150 ms election timeout later): the gap is seen.
    assert!(
        done["keepalive_gap_max_ms"]
            .as_f64()
            .is_some_and(|g| g > 100.0),
        "{done}"
    );

    // Phase 2 (negative control): the sessions are revoked under the tool; its keepalives
    // are refused and every group is left without a leader, and the report says so.
    let mut tool = start(&eps, "20s");
    first_report(&tool);
    let listed = run(&eps, &["lease", "list", "--json"]).data();
    let leases = listed["leases"].as_array().expect("leases").clone();
    assert!(leases.len() as u64 >= SESSIONS, "{listed}");
    for id in leases {
        let id = id.as_str().expect("hex lease id");
        run(&eps, &["lease", "revoke", id, "--json"]).data();
    }
    let done = summary(&mut tool);
    assert!(done["refused"].as_u64().is_some_and(|r| r > 0), "{done}");
    assert_eq!(done["leaderless"], GROUPS, "{done}");
    assert_eq!(done["leaders_changed"], GROUPS, "{done}");

    // Bad input: one clear error, no panic.
    run(&eps, &["bench", "scale", "--sessions", "2", "--json"]).assert_error("invalid_argument", 2);
    run(&eps, &["bench", "scale", "--streams", "0", "--json"]).assert_error("invalid_argument", 2);
    run(&eps, &["bench", "scale", "--ttl", "1s", "--json"]).assert_error("invalid_argument", 2);
}
