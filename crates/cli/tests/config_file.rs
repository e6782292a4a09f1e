//! `conclave serve --config FILE` and `conclave daemon start --config FILE` as real processes:
//! the file sets what no flag or environment variable set, flags and `CONCLAVE_<KEY>` beat it,
//! and a bad file stops the process at once with one sentence.

mod cli_support;
mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use cli_support::{run, run_until_ok};
use common::free_port;

/// How long a single node may take to answer after its process starts.
const READY_TIMEOUT: Duration = Duration::from_secs(15);
/// How long a process with a bad config file may take to exit (it should be milliseconds).
const BAD_FILE_EXIT_TIMEOUT: Duration = Duration::from_secs(5);

static NEXT_DIR: AtomicU32 = AtomicU32::new(0);

/// A scratch directory, removed on drop unless the test failed (its logs are there).
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Scratch {
        let dir = std::env::temp_dir().join(format!(
            "conclave-config-test-{}-{}",
            std::process::id(),
            NEXT_DIR.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the scratch directory");
        Scratch(dir)
    }

    fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, text).expect("write the config file");
        path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// `conclave ARGS` with none of the caller's `CONCLAVE_*` variables, plus `env`.
fn conclave(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_conclave"));
    for (key, _) in std::env::vars() {
        if key.starts_with("CONCLAVE_") {
            command.env_remove(key);
        }
    }
    command
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null());
    command
}

/// A running `conclave serve`, killed on drop.
struct Serve(Child);

impl Serve {
    fn start(args: &[&str], env: &[(&str, &str)], log: &Path) -> Serve {
        let log = std::fs::File::create(log).expect("create the log");
        let log_err = log.try_clone().expect("clone the log handle");
        let mut all = vec!["serve"];
        all.extend_from_slice(args);
        let child = conclave(&all, env)
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log_err))
            .spawn()
            .expect("start conclave serve");
        Serve(child)
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn address() -> String {
    format!("127.0.0.1:{}", free_port())
}

/// Waits until `client` answers `status` with a leader, and returns its only member's record.
fn member_when_ready(client: &str) -> serde_json::Value {
    let started = Instant::now();
    loop {
        // `status` answers before the first election too: wait for the leader as well.
        let status = run_until_ok(client, &["status", "--json"], READY_TIMEOUT);
        let data = status.data();
        if data["leader"].is_string() {
            println!("{client} has a leader after {:?}", started.elapsed());
            let members = data["members"].as_array().expect("members").clone();
            assert_eq!(members.len(), 1, "{data}");
            return members[0].clone();
        }
        assert!(
            started.elapsed() < READY_TIMEOUT,
            "no leader within {READY_TIMEOUT:?}: {data}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn nothing_listens_on(address: &str) -> bool {
    std::net::TcpStream::connect(address).is_err()
}

#[test]
fn serve_takes_its_addresses_data_dir_and_name_from_the_file() {
    let scratch = Scratch::new();
    let (client, peer) = (address(), address());
    let data_dir = scratch.0.join("data");
    let file = scratch.write(
        "node.toml",
        &format!(
            "# a one-node cluster\nname = \"alpha\"\ndata-dir = {:?}\nlisten-client = \"{client}\"\nlisten-peer = \"{peer}\"\nheartbeat-ms = 40\nelection-timeout-ms = 200\n",
            data_dir.display().to_string()
        ),
    );
    let file_arg = file.display().to_string();
    let _node = Serve::start(&["--config", &file_arg], &[], &scratch.0.join("node.log"));
    let member = member_when_ready(&client);
    assert_eq!(member["name"], "alpha", "{member}");
    assert_eq!(
        member["client_urls"][0],
        format!("http://{client}"),
        "{member}"
    );
    assert_eq!(member["peer_urls"][0], format!("http://{peer}"), "{member}");
    run(&client, &["put", "greeting", "hello"]).ok();
    let got = run(&client, &["get", "greeting", "--json"]).data();
    assert_eq!(got["kvs"][0]["value"], "hello", "{got}");
    assert!(
        data_dir.join("wal").is_dir(),
        "the log lives under the file's data-dir"
    );
}

#[test]
fn a_flag_beats_the_file() {
    let scratch = Scratch::new();
    let (file_client, flag_client, peer) = (address(), address(), address());
    let file = scratch.write(
        "node.toml",
        &format!(
            "data-dir = {:?}\nlisten-client = \"{file_client}\"\nlisten-peer = \"{peer}\"\nname = \"from-file\"\n",
            scratch.0.join("data").display().to_string()
        ),
    );
    let file_arg = file.display().to_string();
    let _node = Serve::start(
        &["--config", &file_arg, "--listen-client", &flag_client],
        &[],
        &scratch.0.join("node.log"),
    );
    let member = member_when_ready(&flag_client);
    assert_eq!(member["client_urls"][0], format!("http://{flag_client}"));
    // Keys the flags did not mention still come from the file.
    assert_eq!(member["name"], "from-file", "{member}");
    assert_eq!(member["peer_urls"][0], format!("http://{peer}"), "{member}");
    assert!(
        nothing_listens_on(&file_client),
        "the file's address was used"
    );
}

#[test]
fn an_environment_variable_beats_the_file_which_conclave_config_names() {
    let scratch = Scratch::new();
    let (file_client, env_client, peer) = (address(), address(), address());
    let file = scratch.write(
        "node.toml",
        &format!(
            "data-dir = {:?}\nlisten-client = \"{file_client}\"\nlisten-peer = \"{peer}\"\nname = \"from-file\"\n",
            scratch.0.join("data").display().to_string()
        ),
    );
    let file_arg = file.display().to_string();
    let _node = Serve::start(
        &[],
        &[
            ("CONCLAVE_CONFIG", &file_arg),
            ("CONCLAVE_LISTEN_CLIENT", &env_client),
        ],
        &scratch.0.join("node.log"),
    );
    let member = member_when_ready(&env_client);
    assert_eq!(member["client_urls"][0], format!("http://{env_client}"));
    assert_eq!(member["name"], "from-file", "{member}");
    assert!(
        nothing_listens_on(&file_client),
        "the file's address was used"
    );
}

/// Runs `conclave ARGS` with a bad file and returns its exit code and stderr, checking it
/// exits quickly with one line and without a panic.
fn fails_at_once(args: &[&str]) -> (i32, String) {
    let started = Instant::now();
    let mut child = conclave(args, &[])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start conclave");
    while child.try_wait().expect("poll the child").is_none() {
        if started.elapsed() > BAD_FILE_EXIT_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            panic!("conclave {args:?} still runs after {BAD_FILE_EXIT_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let output = child.wait_with_output().expect("collect the output");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    println!(
        "conclave {args:?} exited after {:?}: {stderr}",
        started.elapsed()
    );
    assert_eq!(stderr.lines().count(), 1, "one line expected: {stderr:?}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    (output.status.code().unwrap_or(-1), stderr)
}

#[test]
fn bad_files_stop_serve_at_once_with_one_sentence_naming_the_problem() {
    let scratch = Scratch::new();
    let unknown = scratch.write("unknown.toml", "name = \"a\"\nheartbeat = 50\n");
    let syntax = scratch.write(
        "syntax.toml",
        "name = \"a\"\n\nlisten-client = \"127.0.0.1:1\n",
    );
    let wrong_type = scratch.write("type.toml", "heartbeat-ms = \"fast\"\n");
    let missing = scratch.0.join("missing.toml");
    let cases: [(&Path, &[&str]); 4] = [
        (&unknown, &["line 2", "unknown field `heartbeat`"]),
        (&syntax, &["line 3"]),
        (&wrong_type, &["line 1", "\"fast\"", "u64"]),
        (&missing, &["cannot read"]),
    ];
    for (file, words) in cases {
        let file_arg = file.display().to_string();
        let (code, stderr) = fails_at_once(&["serve", "--config", &file_arg]);
        assert_eq!(code, 2, "invalid_argument's exit code: {stderr}");
        assert!(stderr.contains(&file_arg), "names the file: {stderr}");
        for word in words {
            assert!(stderr.contains(word), "{word:?} missing: {stderr}");
        }
    }
}

/// Stops (SIGKILL) the daemon of a data directory on drop, should the test fail before it
/// stopped it itself.
struct DaemonGuard(PathBuf);

impl Drop for DaemonGuard {
    fn drop(&mut self) {
        let pid = std::fs::read_to_string(self.0.join("conclave.pid"))
            .ok()
            .and_then(|text| text.trim().parse::<i32>().ok());
        if let Some(pid) = pid {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
    }
}

#[test]
fn daemon_start_stop_and_status_read_the_file() {
    let scratch = Scratch::new();
    let (client, peer) = (address(), address());
    let data_dir = scratch.0.join("daemon-data");
    let file = scratch.write(
        "daemon.toml",
        &format!(
            "name = \"beta\"\ndata-dir = {:?}\nlisten-client = \"{client}\"\nlisten-peer = \"{peer}\"\n",
            data_dir.display().to_string()
        ),
    );
    let file_arg = file.display().to_string();
    let _guard = DaemonGuard(data_dir.clone());
    let started = conclave(&["daemon", "start", "--config", &file_arg, "--json"], &[])
        .output()
        .expect("run daemon start");
    let started = String::from_utf8_lossy(&started.stdout).into_owned();
    let doc: serde_json::Value = serde_json::from_str(started.trim()).expect("one JSON document");
    assert_eq!(doc["status"], "ok", "{doc}");
    assert_eq!(doc["data"]["listen_client"], client, "{doc}");
    assert!(
        data_dir.join("conclave.pid").is_file(),
        "pid file in the file's data-dir"
    );
    let member = member_when_ready(&client);
    assert_eq!(member["name"], "beta", "{member}");
    let status = conclave(&["daemon", "status", "--config", &file_arg], &[])
        .output()
        .expect("run daemon status");
    assert!(
        status.status.success(),
        "daemon status finds the daemon through the file"
    );
    let stopped = conclave(&["daemon", "stop", "--config", &file_arg], &[])
        .output()
        .expect("run daemon stop");
    assert!(
        stopped.status.success(),
        "daemon stop finds the daemon through the file"
    );
    assert!(!data_dir.join("conclave.pid").exists());
    assert!(nothing_listens_on(&client));

    // A bad file fails `daemon start` the same way, as a JSON document with --json.
    let bad = scratch.write("bad.toml", "listen-client = 2379\n");
    let bad_arg = bad.display().to_string();
    let output = conclave(&["daemon", "start", "--config", &bad_arg, "--json"], &[])
        .output()
        .expect("run daemon start");
    let doc: serde_json::Value = serde_json::from_slice(&output.stdout).expect("one JSON document");
    assert_eq!(output.status.code(), Some(2), "{doc}");
    assert_eq!(doc["code"], "invalid_argument", "{doc}");
    let message = doc["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(&bad_arg) && message.contains("line 1"),
        "{message}"
    );
}
