//! `conclave daemon start` joins a running cluster: a member added with `member add --learner`
//! is started as a daemon with the flags `member add` printed, catches up, is promoted and
//! serves; and `daemon start` accepts every flag `serve` accepts.

mod cli_support;
mod common;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use cli_support::{command, run, run_until_ok};
use common::{Cluster, free_port, local_value};

const CATCH_UP_TIMEOUT: Duration = Duration::from_secs(30);

/// Kills the daemon of a data directory if the test ends without stopping it.
struct DaemonGuard {
    dir: PathBuf,
}

impl Drop for DaemonGuard {
    fn drop(&mut self) {
        let pid = std::fs::read_to_string(self.dir.join("conclave.pid")).unwrap_or_default();
        if let Ok(pid) = pid.trim().parse::<i32>() {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_daemon_joins_a_running_cluster_as_a_learner_and_is_promoted() {
    let cluster = Cluster::start(3).await;
    let eps = cluster.endpoints();
    let eps = eps.as_str();
    run_until_ok(eps, &["put", "before", "1", "--json"], CATCH_UP_TIMEOUT).data();

    let client = format!("127.0.0.1:{}", free_port());
    let peer = format!("127.0.0.1:{}", free_port());
    let (_, flags) = cli_support::member_add_learner(eps, "n4", &peer);
    let id = flags
        .iter()
        .position(|f| f == "--id")
        .and_then(|i| flags.get(i + 1))
        .cloned()
        .expect("member add prints the new member's --id");
    // The others' client addresses, for forwarding writes to the leader.
    let clients: Vec<String> = cluster
        .nodes
        .iter()
        .map(|n| format!("{}={}", n.id, n.client))
        .chain(std::iter::once(format!("{id}={client}")))
        .collect();

    let dir = cluster.root.join("daemon-n4");
    let dir_arg = dir.display().to_string();
    let _guard = DaemonGuard { dir: dir.clone() };
    let mut start: Vec<String> = vec!["daemon".into(), "start".into()];
    start.extend(flags.iter().cloned());
    start.extend([
        "--data-dir".into(),
        dir_arg.clone(),
        "--listen-client".into(),
        client.clone(),
        "--initial-cluster-clients".into(),
        clients.join(","),
        "--peer-secret-file".into(),
        cluster.peer_secret_file().display().to_string(),
        "--json".into(),
    ]);
    let start: Vec<&str> = start.iter().map(String::as_str).collect();
    let started = run("unused:1", &start).data();
    assert_eq!(started["initial_cluster_state"], "existing", "{started}");
    assert!(started["pid"].as_u64().is_some(), "{started}");
    let log = std::fs::read_to_string(dir.join("conclave.log")).unwrap_or_default();
    assert!(!log.contains("panicked"), "{log}");

    // The learner catches up with what was written before it joined.
    let began = Instant::now();
    while local_value(&client, "before").await.as_deref() != Some("1") {
        assert!(
            began.elapsed() < CATCH_UP_TIMEOUT,
            "the daemon never applied the cluster's data; log in {}",
            dir.join("conclave.log").display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("daemon learner caught up {:?} after start", began.elapsed());

    // Promoted to voter (the leader may refuse until it has caught up: retry).
    let promoted = run_until_ok(eps, &["member", "promote", &id, "--json"], CATCH_UP_TIMEOUT);
    assert!(promoted.data()["promoted"].is_object(), "{promoted:?}");
    let list = run(eps, &["member", "list", "--json"]).data();
    let members = list["members"].as_array().cloned().unwrap_or_default();
    assert_eq!(members.len(), 4, "{list}");
    assert!(members.iter().all(|m| m["learner"] == false), "{list}");

    // It serves as a full member: a write through it reaches the others, and theirs reach it.
    run_until_ok(
        &client,
        &["put", "via-daemon", "2", "--json"],
        CATCH_UP_TIMEOUT,
    )
    .data();
    let got = run(eps, &["get", "via-daemon", "--json"]).data();
    assert_eq!(got["kvs"][0]["value"], "2", "{got}");
    run_until_ok(eps, &["put", "after", "3", "--json"], CATCH_UP_TIMEOUT).data();
    let began = Instant::now();
    while local_value(&client, "after").await.as_deref() != Some("3") {
        assert!(
            began.elapsed() < CATCH_UP_TIMEOUT,
            "the daemon stopped following"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

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
    assert_eq!(stopped["stopped"], true, "{stopped}");
}

/// The long flags a `--help` text lists.
fn long_flags(args: &[&str]) -> BTreeSet<String> {
    let output = command("unused:1", args)
        .output()
        .expect("run conclave --help");
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    text.split_whitespace()
        .filter(|word| word.starts_with("--") && word.len() > 2)
        .map(|word| {
            word.trim_end_matches(|c: char| !c.is_ascii_alphanumeric())
                .split(['=', '[', '<'])
                .next()
                .unwrap_or("")
                .to_string()
        })
        .collect()
}

#[test]
fn daemon_start_accepts_every_serve_flag() {
    let serve = long_flags(&["serve", "--help"]);
    let daemon = long_flags(&["daemon", "start", "--help"]);
    assert!(
        serve.contains("--initial-cluster-state") && serve.contains("--data-dir"),
        "{serve:?}"
    );
    let missing: Vec<&String> = serve.difference(&daemon).collect();
    assert!(
        missing.is_empty(),
        "serve flags daemon start does not take: {missing:?}"
    );
}
