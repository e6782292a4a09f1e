//! Hostile input on the disk and configuration surface: see `main.rs`.
//!
//! A damaged end of the log is dropped with one WARN line saying where and how much, and the
//! node catches up from its peers; damage before the end stops `serve` with a sentence naming
//! `conclave repair`, whose dry run changes nothing and whose cut lets the node start; data
//! directories and files are the owner's alone; a configuration value out of range is one
//! sentence and exit code 2, never a panic.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use conclave_storage::wal::record::{self, Frame};
use conclave_storage::wal::segment::SEGMENT_HEADER_BYTES;

use crate::common::{self, Cluster, local_value};

/// How long a node may take to catch up after a restart.
const CATCH_UP_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a refused start or a repair may take.
const EXIT_TIMEOUT: Duration = Duration::from_secs(15);
/// The body's first byte of an entry record (crates/storage/src/wal/record.rs).
const ENTRY_RECORD_KIND: u8 = 3;
/// A node that was never fed anything hostile stays well under this.
const RSS_BYTES_MAX: u64 = 512 << 20;

/// The segment files of a data directory, oldest first.
fn segments(data_dir: &Path) -> Vec<PathBuf> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(data_dir.join("wal"))
        .expect("read the wal directory")
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "wal"))
        .collect();
    paths.sort();
    paths
}

/// The records of a segment: (offset, frame length, record kind).
fn frames(bytes: &[u8]) -> Vec<(usize, usize, u8)> {
    let mut out = Vec::new();
    let mut offset = SEGMENT_HEADER_BYTES;
    while let Frame::Valid { body, frame_len } = record::read_frame(&bytes[offset..]) {
        out.push((offset, frame_len, body[0]));
        offset += frame_len;
    }
    out
}

fn node_log(cluster: &Cluster, id: u64) -> String {
    std::fs::read_to_string(cluster.root.join(format!("node{id}.log"))).unwrap_or_default()
}

fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .map_or(0, |kb| kb * 1024)
}

/// Waits for node `id`'s process to exit by itself; its exit status.
fn wait_for_exit(cluster: &mut Cluster, id: u64) -> std::process::ExitStatus {
    let started = Instant::now();
    let node = &mut cluster.nodes[(id - 1) as usize];
    let child = node.child.as_mut().expect("node started");
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            node.child = None;
            return status;
        }
        assert!(
            started.elapsed() < EXIT_TIMEOUT,
            "node {id} kept running over a damaged log"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn conclave(args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_conclave"))
        .args(args)
        .env_remove("CONCLAVE_CONFIG")
        .env_remove("CONCLAVE_DATA_DIR")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start conclave");
    let started = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if started.elapsed() > EXIT_TIMEOUT {
            let _ = child.kill();
            panic!("conclave {args:?} did not finish within {EXIT_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

/// Writes `count` keys through the leader, each acknowledged, and waits until node `id` has
/// applied them all.
async fn acked_writes(cluster: &Cluster, id: u64, prefix: &str, count: usize) -> Vec<String> {
    let leader = cluster.wait_for_leader(common::STARTUP_TIMEOUT).await;
    let keys: Vec<String> = (0..count).map(|i| format!("{prefix}{i:03}")).collect();
    for key in &keys {
        cluster
            .put_until_acked(leader, key, &format!("v-{key}"), CATCH_UP_TIMEOUT)
            .await;
    }
    let client = cluster.nodes[(id - 1) as usize].client.clone();
    for key in &keys {
        wait_for_local_value(&client, key, &format!("v-{key}")).await;
    }
    keys
}

async fn wait_for_local_value(client: &str, key: &str, value: &str) {
    let started = Instant::now();
    loop {
        if local_value(client, key).await.as_deref() == Some(value) {
            return;
        }
        assert!(
            started.elapsed() < CATCH_UP_TIMEOUT,
            "{key} never reached {value} on {client}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A follower of a running cluster.
async fn a_follower(cluster: &Cluster) -> u64 {
    let leader = cluster.wait_for_leader(common::STARTUP_TIMEOUT).await;
    if leader == 1 { 2 } else { 1 }
}

/// Waits until a restarted node that lost the end of its log has it back from the same
/// leader. The node rejects the leader's probe at an index it had acknowledged; the leader
/// believes it and sends those entries again (no leader change is needed).
async fn rejoin(cluster: &mut Cluster, id: u64, marker: &str) {
    let leader = cluster.wait_for_leader(common::STARTUP_TIMEOUT).await;
    assert_ne!(
        leader, id,
        "a node that lost its tail cannot win an election"
    );
    cluster
        .put_until_acked(leader, marker, &format!("v-{marker}"), CATCH_UP_TIMEOUT)
        .await;
    cluster.wait_caught_up(id, CATCH_UP_TIMEOUT).await;
    let client = cluster.nodes[(id - 1) as usize].client.clone();
    wait_for_local_value(&client, marker, &format!("v-{marker}")).await;
}

/// Every acknowledged write has its value on node `id`, and the node's memory stayed bounded.
async fn assert_all_writes_on(cluster: &Cluster, id: u64, keys: &[String]) {
    let client = cluster.nodes[(id - 1) as usize].client.clone();
    for key in keys {
        wait_for_local_value(&client, key, &format!("v-{key}")).await;
    }
    let pid = cluster.nodes[(id - 1) as usize]
        .child
        .as_ref()
        .expect("running")
        .id();
    let rss = rss_bytes(pid);
    assert!(rss < RSS_BYTES_MAX, "node {id} RSS {rss} bytes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_byte_in_the_last_wal_record_is_dropped_with_a_warn_and_the_write_survives() {
    let mut cluster = Cluster::start(3).await;
    let follower = a_follower(&cluster).await;
    let keys = acked_writes(&cluster, follower, "tail/", 10).await;
    assert!(cluster.terminate(follower), "follower {follower} stopped");
    let data_dir = cluster.nodes[(follower - 1) as usize].data_dir.clone();
    let segment = segments(&data_dir).pop().expect("a segment");
    let mut bytes = std::fs::read(&segment).expect("read the segment");
    let records = frames(&bytes);
    // The last acknowledged entry becomes the last record, as if the hard states written after
    // it never reached the disk; then one of its bytes flips.
    let &(offset, len, _) = records
        .iter()
        .rev()
        .find(|(_, _, kind)| *kind == ENTRY_RECORD_KIND)
        .expect("an entry record");
    bytes[offset + len..].fill(0);
    bytes[offset + len / 2] ^= 0x20;
    std::fs::write(&segment, &bytes).expect("damage the segment");
    // What the WARN must count: the frame up to its last non-zero byte (the zeros after it
    // cannot be told from never-written space).
    let dropped_bytes = bytes[offset..]
        .iter()
        .rposition(|&b| b != 0)
        .map_or(0, |last| last + 1);
    assert!(dropped_bytes > len / 2);

    cluster.spawn(follower);
    rejoin(&mut cluster, follower, "tail/after-restart").await;
    let log = node_log(&cluster, follower);
    let warn = log
        .lines()
        .find(|line| line.contains("WARN") && line.contains("recovery dropped"))
        .unwrap_or_else(|| panic!("no WARN line about the dropped tail in:\n{log}"));
    for field in [
        format!("file={}", segment.display()),
        format!("offset={offset}"),
        "records=1".to_string(),
        format!("bytes={dropped_bytes}"),
    ] {
        assert!(warn.contains(&field), "{field} missing from: {warn}");
    }
    // The others had the write: the restarted node has every acknowledged one again.
    assert_all_writes_on(&cluster, follower, &keys).await;
    // And it restarts again from what it now holds, without dropping anything.
    assert!(cluster.terminate(follower));
    cluster.spawn(follower);
    cluster.wait_caught_up(follower, CATCH_UP_TIMEOUT).await;
    assert_all_writes_on(&cluster, follower, &keys).await;
    let warnings = node_log(&cluster, follower)
        .matches("recovery dropped")
        .count();
    assert_eq!(warnings, 1, "the second restart found an intact log");
}

/// The bytes of every file in the wal directory, to show a dry run changed nothing.
fn wal_snapshot(data_dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    segments(data_dir)
        .into_iter()
        .map(|path| {
            let bytes = std::fs::read(&path).expect("read");
            (path, bytes)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mid_log_corruption_stops_serve_naming_repair_which_cuts_it_and_the_node_rejoins() {
    let mut cluster = Cluster::start(3).await;
    let follower = a_follower(&cluster).await;
    let keys = acked_writes(&cluster, follower, "mid/", 20).await;
    assert!(cluster.terminate(follower), "follower {follower} stopped");
    let data_dir = cluster.nodes[(follower - 1) as usize].data_dir.clone();
    let segment = segments(&data_dir).pop().expect("a segment");
    let mut bytes = std::fs::read(&segment).expect("read the segment");
    let records = frames(&bytes);
    let entries: Vec<_> = records
        .iter()
        .filter(|(_, _, kind)| *kind == ENTRY_RECORD_KIND)
        .collect();
    assert!(entries.len() >= 10, "want entries after the damage");
    let &&(offset, _, _) = &entries[entries.len() / 2];
    bytes[offset + 12] ^= 0x01;
    std::fs::write(&segment, &bytes).expect("damage the segment");
    let data_dir_text = data_dir.display().to_string();

    // serve refuses, with one sentence naming the command.
    cluster.spawn(follower);
    let status = wait_for_exit(&mut cluster, follower);
    assert!(!status.success(), "serve started over a damaged log");
    let log = node_log(&cluster, follower);
    let error = log
        .lines()
        .rfind(|line| line.starts_with("conclave: error:"))
        .unwrap_or_else(|| panic!("no error line in:\n{log}"));
    assert!(
        error.contains(&format!("conclave repair --data-dir {data_dir_text}")),
        "{error}"
    );
    assert!(error.contains(&segment.display().to_string()), "{error}");
    assert!(!log.contains("panicked"), "{log}");

    // A dry run says what would be cut, and changes nothing.
    let before = wal_snapshot(&data_dir);
    let dry = conclave(&[
        "repair",
        "--data-dir",
        &data_dir_text,
        "--dry-run",
        "--json",
    ]);
    assert!(dry.status.success(), "{dry:?}");
    let document: serde_json::Value =
        serde_json::from_slice(&dry.stdout).expect("one JSON document");
    let cut = &document["data"]["cuts"][0];
    assert_eq!(cut["file"], segment.display().to_string(), "{document}");
    assert_eq!(cut["offset"], offset as u64, "{document}");
    assert!(cut["records_lost"].as_u64() >= Some(1), "{document}");
    assert!(cut["entries_lost"]["last"].as_u64().is_some(), "{document}");
    assert_eq!(document["data"]["changed"], false);
    assert_eq!(
        wal_snapshot(&data_dir),
        before,
        "the dry run changed the log"
    );
    let human = conclave(&["repair", "--data-dir", &data_dir_text, "--dry-run"]);
    let text = String::from_utf8_lossy(&human.stdout);
    assert!(
        text.contains(&format!("at offset {offset}")) && text.contains("nothing changed"),
        "{text}"
    );
    assert_eq!(
        wal_snapshot(&data_dir),
        before,
        "the dry run changed the log"
    );

    // The repair cuts, says so, and the node then starts and catches up.
    let repaired = conclave(&["repair", "--data-dir", &data_dir_text]);
    assert!(repaired.status.success(), "{repaired:?}");
    let text = String::from_utf8_lossy(&repaired.stdout);
    assert!(
        text.contains(&format!("{} was cut to {offset} bytes", segment.display())),
        "{text}"
    );
    assert_eq!(
        std::fs::metadata(&segment).expect("segment").len(),
        offset as u64
    );
    cluster.spawn(follower);
    rejoin(&mut cluster, follower, "mid/after-repair").await;
    assert_all_writes_on(&cluster, follower, &keys).await;
    // A repaired log needs no second repair.
    assert!(cluster.terminate(follower));
    let again = conclave(&["repair", "--data-dir", &data_dir_text]);
    assert!(
        String::from_utf8_lossy(&again.stdout).contains("nothing to repair"),
        "{again:?}"
    );
    cluster.spawn(follower);
    cluster.wait_caught_up(follower, CATCH_UP_TIMEOUT).await;
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path)
        .expect("metadata")
        .permissions()
        .mode()
        & 0o777
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_directories_are_0700_and_their_files_0600_and_older_ones_are_tightened() {
    let mut cluster = Cluster::start(1).await;
    let keys = acked_writes(&cluster, 1, "perm/", 3).await;
    let data_dir = cluster.nodes[0].data_dir.clone();
    let check = |data_dir: &Path| {
        let mut files = 0;
        for sub in ["", "wal", "snap"] {
            let dir = data_dir.join(sub);
            assert_eq!(mode(&dir), 0o700, "{}", dir.display());
            for entry in std::fs::read_dir(&dir).expect("list") {
                let path = entry.expect("entry").path();
                if path.is_file() {
                    assert_eq!(mode(&path), 0o600, "{}", path.display());
                    files += 1;
                }
            }
        }
        // IDENTITY, LOCK, a segment and the bootstrap snapshot at least.
        assert!(files >= 4, "{files} files");
    };
    check(&data_dir);
    assert!(data_dir.join("IDENTITY").is_file());
    // A running node's log is not repaired under it: repair takes the same lock as serve.
    let data_dir_text = data_dir.display().to_string();
    for args in [vec!["--dry-run"], vec![]] {
        let mut argv = vec!["repair", "--data-dir", data_dir_text.as_str()];
        argv.extend(args);
        let refused = conclave(&argv);
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert_eq!(refused.status.code(), Some(11), "{argv:?}: {stderr}");
        assert!(stderr.contains("stop the node"), "{stderr}");
    }

    // As an older version left it: readable by everyone.
    assert!(cluster.terminate(1));
    std::fs::set_permissions(&data_dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let identity = data_dir.join("IDENTITY");
    std::fs::set_permissions(&identity, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    cluster.spawn(1);
    cluster.wait_for_leader(common::STARTUP_TIMEOUT).await;
    check(&data_dir);
    let log = node_log(&cluster, 1);
    assert!(
        log.lines()
            .any(|line| line.contains("WARN") && line.contains(&identity.display().to_string())),
        "no WARN naming the tightened file in:\n{log}"
    );
    assert_all_writes_on(&cluster, 1, &keys).await;
}

/// Runs `serve` with `args` on a fresh directory and free ports; it must refuse to start.
fn refused_serve(args: &[&str], config: Option<&str>) -> (Output, PathBuf) {
    let root = std::env::temp_dir().join(format!(
        "conclave-hostile-config-{}-{}",
        std::process::id(),
        common::free_port()
    ));
    std::fs::create_dir_all(&root).expect("create");
    let data_dir = root.join("data");
    let client = format!("127.0.0.1:{}", common::free_port());
    let peer = format!("127.0.0.1:{}", common::free_port());
    let mut argv: Vec<String> = vec![
        "serve".into(),
        "--data-dir".into(),
        data_dir.display().to_string(),
        "--listen-client".into(),
        client,
        "--listen-peer".into(),
        peer,
    ];
    argv.extend(args.iter().map(|a| a.to_string()));
    if let Some(text) = config {
        let path = root.join("conclave.toml");
        std::fs::write(&path, text).expect("write the config file");
        argv.extend(["--config".into(), path.display().to_string()]);
    }
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    let output = conclave(&argv);
    (output, root)
}

#[test]
fn an_overflowing_election_timeout_is_one_sentence_and_exit_2_not_a_panic() {
    let huge = u64::MAX.to_string();
    let cases: Vec<(Vec<&str>, Option<String>, &str)> = vec![
        (
            vec!["--tick-ms", "1", "--election-timeout-ms", &huge],
            None,
            "--election-timeout-ms",
        ),
        (vec!["--tick-ms", &huge], None, "--tick-ms"),
        (vec!["--heartbeat-ms", &huge], None, "--heartbeat-ms"),
        (
            vec!["--request-timeout-ms", "0"],
            None,
            "--request-timeout-ms",
        ),
        (
            vec!["--snapshot-entries", &huge],
            None,
            "--snapshot-entries",
        ),
        (
            vec![],
            Some(format!("tick-ms = 1\nelection-timeout-ms = {huge}\n")),
            "--election-timeout-ms",
        ),
        (
            vec!["--snapshot-bytes-max", &huge],
            None,
            "--snapshot-bytes-max",
        ),
        (
            vec![],
            Some("snapshot-bytes-max = 0\n".to_string()),
            "--snapshot-bytes-max",
        ),
        (
            vec!["--range-response-bytes-max", "0"],
            None,
            "--range-response-bytes-max",
        ),
        (
            vec!["--range-response-bytes-max", &huge],
            None,
            "--range-response-bytes-max",
        ),
    ];
    for (args, config, flag) in cases {
        let (output, root) = refused_serve(&args, config.as_deref());
        let stderr = String::from_utf8_lossy(&output.stderr).to_string();
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{args:?}: one sentence, got {stderr}");
        assert!(
            lines[0].starts_with(&format!("conclave: error: {flag} must be between ")),
            "{args:?}: {stderr}"
        );
        // Nothing was created for a configuration that never started.
        assert!(!root.join("data").exists(), "{args:?}");
        let _ = std::fs::remove_dir_all(&root);
    }
}
