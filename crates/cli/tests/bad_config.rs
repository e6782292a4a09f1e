//! `conclave serve` refuses bad configuration at start with one sentence and a non-zero exit:
//! a data directory another node holds open, a data directory of another cluster, a port in
//! use and a name that is not a member.

mod common;

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::free_port;

/// How long a refused start may take.
const REFUSAL_TIMEOUT: Duration = Duration::from_secs(10);

fn serve(data_dir: &Path, client: &str, peer: &str, extra: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_conclave"));
    command
        .arg("serve")
        .arg("--data-dir")
        .arg(data_dir)
        .args(["--listen-client", client, "--listen-peer", peer])
        .args(extra)
        .env_remove("CONCLAVE_CONFIG")
        .stdin(Stdio::null());
    command
}

/// Runs a start that must be refused; returns its output once it exits.
fn refused(mut command: Command) -> Output {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start conclave serve");
    let started = Instant::now();
    loop {
        if child.try_wait().expect("wait").is_some() {
            let output = child.wait_with_output().expect("output");
            println!(
                "refused in {} ms: {}",
                started.elapsed().as_millis(),
                String::from_utf8_lossy(&output.stderr).trim()
            );
            return output;
        }
        if started.elapsed() > REFUSAL_TIMEOUT {
            let _ = child.kill();
            let output = child.wait_with_output().expect("output");
            panic!(
                "serve was not refused within {REFUSAL_TIMEOUT:?}: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The one error line (log lines may precede it on stderr).
fn error_line(output: &Output) -> String {
    assert!(!output.status.success(), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let errors: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("conclave: error: "))
        .collect();
    assert_eq!(errors.len(), 1, "one error sentence expected: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    errors[0].to_string()
}

struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_listening(address: &str) {
    let started = Instant::now();
    while std::net::TcpStream::connect(address).is_err() {
        assert!(
            started.elapsed() < REFUSAL_TIMEOUT,
            "{address} never listened"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn wait_for_file(path: &Path) {
    let started = Instant::now();
    while !path.exists() {
        assert!(
            started.elapsed() < REFUSAL_TIMEOUT,
            "{} was never written",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_data_directory_in_use_or_of_another_cluster_is_refused() {
    let root = std::env::temp_dir().join(format!("conclave-bad-config-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let data_dir = root.join("node");
    let client = format!("127.0.0.1:{}", free_port());
    let peer = format!("127.0.0.1:{}", free_port());
    let founding = format!("default={peer}");

    let first = Running(
        serve(&data_dir, &client, &peer, &["--initial-cluster", &founding])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the first node"),
    );
    wait_listening(&client);
    // The client port opens before the node has recorded which cluster made the directory;
    // killing it in between would leave a directory any flags may adopt.
    wait_for_file(&data_dir.join("IDENTITY"));

    // A second node over the same directory, on other ports.
    let (client2, peer2) = (
        format!("127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
    );
    let line = error_line(&refused(serve(&data_dir, &client2, &peer2, &[])));
    assert!(line.contains("locked by another process"), "{line}");
    drop(first);

    // The same directory under another cluster's flags.
    let other = format!("default={peer},other={}", free_port_address());
    let line = error_line(&refused(serve(
        &data_dir,
        &client,
        &peer,
        &["--initial-cluster", &other],
    )));
    assert!(line.contains("belongs to member"), "{line}");
    assert!(line.contains("its own data directory"), "{line}");

    // With the flags it was made with, it starts again.
    let again = Running(
        serve(&data_dir, &client, &peer, &["--initial-cluster", &founding])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("restart the node"),
    );
    wait_listening(&client);
    drop(again);
    let _ = std::fs::remove_dir_all(&root);
}

fn free_port_address() -> String {
    format!("127.0.0.1:{}", free_port())
}

#[test]
fn a_port_in_use_or_a_name_outside_the_cluster_is_refused() {
    let root = std::env::temp_dir().join(format!("conclave-bad-ports-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let taken = std::net::TcpListener::bind(("127.0.0.1", free_port())).expect("hold a port");
    let taken_address = taken.local_addr().expect("address").to_string();
    let peer = free_port_address();

    let line = error_line(&refused(serve(&root.join("a"), &taken_address, &peer, &[])));
    assert!(line.contains("cannot listen for clients"), "{line}");
    assert!(line.contains(&taken_address), "{line}");

    let line = error_line(&refused(serve(
        &root.join("b"),
        &free_port_address(),
        &peer,
        &[
            "--name",
            "stranger",
            "--initial-cluster",
            &format!("n1={peer}"),
        ],
    )));
    assert!(
        line.contains("is not a member of --initial-cluster"),
        "{line}"
    );
    drop(taken);
    let _ = std::fs::remove_dir_all(&root);
}
