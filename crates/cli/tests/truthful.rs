//! The CLI says what happened: every failure below once printed success, the wrong code, or a
//! garbled message. Each test drives the real binary against real `serve` processes.

mod cli_support;
mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use cli_support::{Streaming, run, run_until_ok};
use common::{Cluster, free_port, free_port_run};
use conclave_proto::etcdserverpb::{PutRequest, RangeRequest};

/// How long a process under test may take to do what it must, on a loaded machine.
const GENEROUS: Duration = Duration::from_secs(60);

fn conclave() -> Command {
    Command::new(env!("CARGO_BIN_EXE_conclave"))
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "conclave-truthful-{name}-{}-{}",
        std::process::id(),
        free_port()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create a temporary directory");
    dir
}

/// `daemon stop` on drop, so a failed assertion leaves no server behind.
struct Daemon(std::path::PathBuf);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = conclave()
            .args(["daemon", "stop", "--data-dir"])
            .arg(&self.0)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

fn daemon_start(dir: &Path, client: &str, peer: &str) -> std::process::Output {
    conclave()
        .args(["daemon", "start", "--json", "--data-dir"])
        .arg(dir)
        .args(["--listen-client", client, "--listen-peer", peer])
        .output()
        .expect("run daemon start")
}

#[test]
fn daemon_start_on_a_busy_client_port_fails_with_the_reason_from_the_log() {
    let root = temp_dir("daemon");
    let client = format!("127.0.0.1:{}", free_port());
    let first_dir = root.join("first");
    let first_daemon = Daemon(first_dir.clone());
    let first = daemon_start(&first_dir, &client, &format!("127.0.0.1:{}", free_port()));
    assert!(first.status.success(), "{first:?}");

    // Same member id (1, the default), same client port: the first server answers there as
    // the member the second would be, so only the process check can tell.
    let second_dir = root.join("second");
    let _second = Daemon(second_dir.clone());
    let second = daemon_start(&second_dir, &client, &format!("127.0.0.1:{}", free_port()));
    let stdout = String::from_utf8_lossy(&second.stdout);
    assert_ne!(second.status.code(), Some(0), "{stdout}");
    let doc: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON document");
    assert_eq!(doc["status"], "error", "{doc}");
    let message = doc["message"].as_str().unwrap_or_default();
    assert!(
        message.to_lowercase().contains("address") || message.to_lowercase().contains("in use"),
        "the reason from the log: {message}"
    );
    // Stopped before its directory (with the pid file `daemon stop` reads) goes.
    drop(first_daemon);
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn dev_on_busy_ports_exits_with_an_error_instead_of_showing_a_leader() {
    let root = temp_dir("dev");
    let base = free_port_run(6);
    let mut first = conclave()
        .args([
            "dev",
            "--nodes",
            "3",
            "--base-port",
            &base.to_string(),
            "--data-dir",
        ])
        .arg(root.join("first"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start dev");
    let stdout = first.stdout.take().expect("piped");
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    let began = Instant::now();
    loop {
        let line = lines
            .recv_timeout(GENEROUS.saturating_sub(began.elapsed()))
            .expect("the first dev cluster starts");
        if line.starts_with("status leader=node") {
            break;
        }
    }

    let second = conclave()
        .args([
            "dev",
            "--nodes",
            "3",
            "--base-port",
            &base.to_string(),
            "--data-dir",
        ])
        .arg(root.join("second"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the second dev");
    let pid = second.id();
    let watchdog = std::thread::spawn(move || {
        std::thread::sleep(GENEROUS);
        let _ = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
    });
    let output = second.wait_with_output().expect("wait for the second dev");
    drop(watchdog);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(
        !stdout.contains("status leader=node"),
        "no leader may be shown for nodes that are not ours: {stdout}"
    );
    assert!(
        stderr.contains("exited while starting") && stderr.to_lowercase().contains("address"),
        "{stderr}"
    );
    let _ = Command::new("kill")
        .args(["-TERM", &first.id().to_string()])
        .status();
    let _ = first.wait();
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn json_errors_keep_clap_s_whole_message() {
    for args in [
        vec!["--json", "get"],
        vec!["get", "-w", "json"],
        vec!["--write-out=json", "get"],
    ] {
        let out = conclave().args(&args).output().expect("run");
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let doc: serde_json::Value =
            serde_json::from_slice(&out.stdout).expect("one JSON document");
        assert_eq!(doc["code"], "invalid_argument", "{doc}");
        let message = doc["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("required arguments were not provided") && message.contains("<KEY>"),
            "{args:?}: {message}"
        );
        assert!(!message.contains("Usage:"), "{message}");
    }
}

#[test]
fn a_refused_connection_is_said_once() {
    let closed = format!("127.0.0.1:{}", free_port());
    let failed = run(&closed, &["get", "k", "--json", "--timeout", "1s"]);
    failed.assert_error("connection_failed", 12);
    let message = failed.json()["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(message.contains("tcp connect error"), "{message}");
    assert!(
        !message.contains("tcp connect error: tcp connect error"),
        "{message}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn losing_quorum_is_no_leader_not_timeout() {
    let mut cluster = Cluster::start(3).await;
    let eps = cluster.endpoints();
    run_until_ok(&eps, &["put", "k", "1", "--json"], GENEROUS).data();
    let survivor = 1;
    cluster.kill(2);
    cluster.kill(3);
    let only = cluster.endpoint(survivor).replace("http://", "");
    let failed = run(&only, &["put", "k", "2", "--json", "--timeout", "4s"]);
    failed.assert_error("no_leader", 10);
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_during_a_campaign_command_ends_with_an_interrupted_document_and_130() {
    let cluster = Cluster::start(1).await;
    let eps = cluster.endpoints();
    let mut campaign = Streaming::start(
        &eps,
        &[
            "elect", "campaign", "g", "--id", "a", "--json", "--", "sleep", "60",
        ],
    );
    let (_, elected) = campaign.next_json(GENEROUS).expect("elected");
    assert_eq!(elected["data"]["event"], "elected", "{elected}");
    campaign.signal("-TERM");
    let (_, last) = campaign.next_json(GENEROUS).expect("a final document");
    assert_eq!(campaign.wait_code(GENEROUS), Some(130));
    assert_eq!(last["status"], "error", "{last}");
    assert_eq!(last["code"], "interrupted", "{last}");
    // The seat was given back.
    let leader = run(&eps, &["elect", "leader", "g", "--json"]);
    leader.assert_error("not_found", 3);
}

#[tokio::test(flavor = "multi_thread")]
async fn lease_ids_read_the_same_in_output_and_errors() {
    let cluster = Cluster::start(1).await;
    let eps = cluster.endpoints();
    let granted = run_until_ok(&eps, &["lease", "grant", "30", "--json"], GENEROUS).data();
    let id = granted["id"].as_str().expect("hex id").to_string();
    assert_eq!(id.len(), 16, "{id}");
    run(&eps, &["lease", "revoke", &id, "--json"]).data();
    let refused = run(&eps, &["put", "k", "v", "--lease", &id, "--json"]);
    refused.assert_error("lease_expired", 7);
    let message = refused.json()["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(message.contains(&id), "{message} names {id}");
}

#[tokio::test(flavor = "multi_thread")]
async fn member_add_prints_flags_that_give_the_member_its_name() {
    let cluster = Cluster::start(3).await;
    let eps = cluster.endpoints();
    let peer = format!("127.0.0.1:{}", free_port());
    let client = format!("127.0.0.1:{}", free_port());
    let (_, flags) = cli_support::member_add_learner(&eps, "n4", &peer);
    let id = flags
        .iter()
        .position(|f| f == "--id")
        .and_then(|i| flags.get(i + 1))
        .cloned()
        .expect("--id");
    let clients: Vec<String> = cluster
        .nodes
        .iter()
        .map(|n| format!("{}={}", n.id, n.client))
        .chain(std::iter::once(format!("{id}={client}")))
        .collect();
    let dir = cluster.root.join("n4");
    let log = std::fs::File::create(cluster.root.join("n4.log")).expect("log");
    let mut n4 = conclave()
        .arg("serve")
        .args(&flags)
        .arg("--data-dir")
        .arg(&dir)
        .args(["--listen-client", &client])
        .args(["--initial-cluster-clients", &clients.join(",")])
        .arg("--peer-secret-file")
        .arg(cluster.peer_secret_file())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start n4");
    // The name it was added under is the name it has, so `promote n4` finds it.
    let promoted = run_until_ok(&eps, &["member", "promote", "n4", "--json"], GENEROUS);
    let _ = n4.kill();
    let _ = n4.wait();
    assert_eq!(promoted.data()["promoted"]["name"], "n4", "{promoted:?}");
}

/// The cause of etcdctl's `retrying of unary invoker failed ... context canceled` on `elect
/// -l`: a follower answered a forwarded write before applying it, so its watchers saw the
/// event after the writer had its answer (etcdctl's observer then read again just as it was
/// stopped). Now a write through a follower is visible there when the writer hears back.
#[tokio::test(flavor = "multi_thread")]
async fn a_write_through_a_follower_is_visible_there_when_it_is_acknowledged() {
    let cluster = Cluster::start(3).await;
    let leader = cluster.wait_for_leader(GENEROUS).await;
    let follower = cluster
        .live_ids()
        .into_iter()
        .find(|id| *id != leader)
        .expect("a follower");
    let mut kv = cluster.kv(follower).await;
    let began = Instant::now();
    while kv
        .put(PutRequest {
            key: b"warm".to_vec().into(),
            value: b"up".to_vec().into(),
            ..Default::default()
        })
        .await
        .is_err()
    {
        assert!(
            began.elapsed() < GENEROUS,
            "the follower never took a write"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for round in 0..30 {
        let value = format!("v{round}");
        kv.put(PutRequest {
            key: b"seen".to_vec().into(),
            value: value.clone().into_bytes().into(),
            ..Default::default()
        })
        .await
        .expect("put through the follower");
        let local = kv
            .range(RangeRequest {
                key: b"seen".to_vec().into(),
                serializable: true,
                ..Default::default()
            })
            .await
            .expect("serializable read")
            .into_inner();
        let got = local.kvs.first().map(|kv| kv.value.clone());
        assert_eq!(
            got.as_deref(),
            Some(value.as_bytes()),
            "round {round}: the follower answered before applying its write"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn even_sized_clusters_are_warned_about() {
    let root = temp_dir("even");
    let base = free_port_run(4);
    let mut dev = conclave()
        .args([
            "dev",
            "--nodes",
            "2",
            "--base-port",
            &base.to_string(),
            "--data-dir",
        ])
        .arg(&root)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start dev");
    let stderr = dev.stderr.take().expect("piped");
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    let warning = lines.recv_timeout(GENEROUS).expect("a line on stderr");
    assert!(
        warning.contains("warning") && warning.contains("2 members"),
        "{warning}"
    );
    // Each node's log (serve) says it too.
    let log = root.join("node1.log");
    let began = Instant::now();
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains("prefer an odd size") {
            break;
        }
        assert!(
            began.elapsed() < GENEROUS,
            "no warning in {}: {text}",
            log.display()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = Command::new("kill")
        .args(["-TERM", &dev.id().to_string()])
        .status();
    let _ = dev.wait();
    let _ = std::fs::remove_dir_all(&root);

    // Odd: no warning.
    let cluster = Cluster::start(3).await;
    let log = std::fs::read_to_string(cluster.root.join("node1.log")).unwrap_or_default();
    assert!(!log.contains("prefer an odd size"), "{log}");
}
