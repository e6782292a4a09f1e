//! etcdctl 3.4 (Debian's `etcd-client`) against a 3-node Conclave cluster. This test fails,
//! rather than skips, when etcdctl is missing: `.ci/run` installs it.

mod common;

use std::process::Command;

use common::Cluster;

const ETCDCTL: &str = "/usr/bin/etcdctl";

fn etcdctl(endpoints: &str, args: &[&str]) -> String {
    assert!(
        std::path::Path::new(ETCDCTL).exists(),
        "{ETCDCTL} is missing: install it with `apt-get update && apt-get install -y etcd-client` (.ci/run does)"
    );
    let output = Command::new(ETCDCTL)
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={endpoints}"))
        .args(["--command-timeout=5s"])
        .args(args)
        .output()
        .expect("run etcdctl");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "etcdctl {args:?} failed: {}{}",
        stdout,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

#[tokio::test(flavor = "multi_thread")]
async fn etcdctl_put_get_prefix_del_status_and_member_list() {
    let cluster = Cluster::start(3).await;
    let first = cluster.nodes[0].client.clone();
    let last = cluster.nodes[2].client.clone();
    let all = cluster.endpoints();

    assert_eq!(etcdctl(&first, &["put", "/app/a", "1"]).trim(), "OK");
    assert_eq!(etcdctl(&last, &["put", "/app/b", "2"]).trim(), "OK");
    assert_eq!(etcdctl(&all, &["put", "/other", "3"]).trim(), "OK");
    assert_eq!(etcdctl(&last, &["get", "/app/a"]), "/app/a\n1\n");
    assert_eq!(
        etcdctl(&first, &["get", "--prefix", "/app/"]),
        "/app/a\n1\n/app/b\n2\n"
    );
    assert_eq!(
        etcdctl(
            &first,
            &["get", "--prefix", "/app/", "--consistency=s", "--keys-only"]
        ),
        "/app/a\n\n/app/b\n\n"
    );
    assert_eq!(etcdctl(&last, &["del", "--prefix", "/app/"]).trim(), "2");
    assert_eq!(etcdctl(&first, &["get", "--prefix", "/app/"]), "");

    let status = etcdctl(&all, &["endpoint", "status"]);
    let lines: Vec<&str> = status.lines().collect();
    assert_eq!(lines.len(), 3, "{status}");
    let leaders = lines
        .iter()
        .filter(|l| l.contains(", true, false,"))
        .count();
    assert_eq!(
        leaders, 1,
        "exactly one member reports itself leader:\n{status}"
    );
    assert!(lines.iter().all(|l| l.contains("3.4.0")), "{status}");

    let members = etcdctl(&first, &["member", "list"]);
    assert_eq!(members.lines().count(), 3, "{members}");
    for node in &cluster.nodes {
        let line = format!(
            "{:x}, started, node{}, http://{}, http://{}, false",
            node.id, node.id, node.peer, node.client
        );
        assert!(members.contains(&line), "missing {line:?} in\n{members}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn etcdctl_watch_replays_history_and_streams_live_events_from_a_follower() {
    let cluster = Cluster::start(3).await;
    let leader = cluster
        .wait_for_leader(std::time::Duration::from_secs(5))
        .await;
    let follower = cluster
        .nodes
        .iter()
        .find(|n| n.id != leader)
        .expect("a follower")
        .client
        .clone();
    let writer = cluster.nodes[(leader - 1) as usize].client.clone();
    assert_eq!(etcdctl(&writer, &["put", "/w/a", "1"]).trim(), "OK");

    assert!(
        std::path::Path::new(ETCDCTL).exists(),
        "{ETCDCTL} is missing"
    );
    // The watch starts at revision 1 (history) and keeps streaming until `timeout` stops it.
    let watcher = Command::new("timeout")
        .args(["3", ETCDCTL])
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={follower}"))
        .args(["watch", "--prefix", "/w/", "--rev=1"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start etcdctl watch");
    tokio::time::sleep(std::time::Duration::from_millis(1000)).await;
    assert_eq!(etcdctl(&writer, &["put", "/w/b", "2"]).trim(), "OK");
    assert_eq!(etcdctl(&writer, &["del", "/w/a"]).trim(), "1");
    let output = watcher.wait_with_output().expect("etcdctl watch ends");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(
        stdout, "PUT\n/w/a\n1\nPUT\n/w/b\n2\nDELETE\n/w/a\n\n",
        "watch output"
    );
}

/// `etcdctl snapshot save` takes a member's snapshot: the stream ends, as etcd's do, with the
/// image padded to a multiple of 512 bytes and a SHA-256, which etcdctl checks for.
#[tokio::test(flavor = "multi_thread")]
async fn etcdctl_snapshot_save_accepts_the_stream() {
    let cluster = Cluster::start(1).await;
    let endpoint = cluster.nodes[0].client.clone();
    assert_eq!(etcdctl(&endpoint, &["put", "/backup/k", "v"]).trim(), "OK");
    let file = cluster.root.join("etcdctl.snap");
    let file_arg = file.to_string_lossy().to_string();
    let saved = etcdctl(&endpoint, &["snapshot", "save", &file_arg]);
    assert!(saved.contains("Snapshot saved at"), "{saved}");
    let bytes = std::fs::read(&file).expect("the saved snapshot");
    assert_eq!(bytes.len() % 512, 32, "image, padding, SHA-256");
    assert!(bytes.starts_with(b"CNCLSTAT"), "a Conclave state image");
}
