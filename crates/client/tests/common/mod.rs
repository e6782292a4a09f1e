//! Starts real `conclave serve` processes for the integration tests.
//!
//! The binary belongs to another package, so `CARGO_BIN_EXE_*` is not available. Under
//! `cargo test --workspace` cargo has just built `conclave` next to this test binary (the CLI's
//! own tests need it), so that one is taken when it is newer than every source file it is built
//! from; otherwise (`cargo test -p conclave-client` after an edit) we run `cargo build -p
//! conclave-cli` and take `<target>/debug/conclave`. A second build would cost a whole debug
//! tree of disk and minutes in CI. `CONCLAVE_BIN` overrides the path.

#![allow(dead_code)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use conclave_client::{Client, ClientOptions, Error};

fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target"),
    }
}

/// Builds (once per test binary) and locates the server binary.
pub fn server_binary() -> PathBuf {
    static BINARY: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let found = BINARY.get_or_init(|| {
        if let Some(path) = std::env::var_os("CONCLAVE_BIN") {
            return Ok(PathBuf::from(path));
        }
        if let Some(path) = fresh_sibling_binary() {
            return Ok(path);
        }
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = Command::new(cargo)
            .args(["build", "-q", "-p", "conclave-cli"])
            .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."))
            .env("CARGO_TARGET_DIR", target_dir())
            .status()
            .map_err(|e| format!("cannot run cargo: {e}"))?;
        if !status.success() {
            return Err(format!("cargo build -p conclave-cli failed: {status}"));
        }
        let path = target_dir().join("debug").join("conclave");
        if path.exists() {
            Ok(path)
        } else {
            Err(format!("{} was not built", path.display()))
        }
    });
    match found {
        Ok(path) => path.clone(),
        Err(reason) => panic!("the Conclave server binary is not available: {reason}"),
    }
}

/// The crates whose sources go into the `conclave` binary.
const SERVER_SOURCE_DIRS: [&str; 7] = [
    "cli", "client", "proto", "raft", "server", "state", "storage",
];

/// `conclave` in this test binary's own profile directory (`<target>/release/deps/..`), if it is
/// newer than every file under the server's crates and `proto/`.
fn fresh_sibling_binary() -> Option<PathBuf> {
    let test_exe = std::env::current_exe().ok()?;
    let binary = test_exe.parent()?.parent()?.join("conclave");
    let built = std::fs::metadata(&binary).ok()?.modified().ok()?;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut sources: Vec<PathBuf> = SERVER_SOURCE_DIRS
        .iter()
        .map(|krate| root.join("crates").join(krate))
        .collect();
    sources.push(root.join("proto"));
    let newest_source = sources
        .iter()
        .filter_map(|dir| newest_modification(dir))
        .max()?;
    (built >= newest_source).then_some(binary)
}

/// The latest modification time of any file under `dir`, skipping `tests/`, `benches/` and `examples/` (they are not
/// part of the binary).
fn newest_modification(dir: &Path) -> Option<std::time::SystemTime> {
    let mut newest = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        let modified = if path.is_dir() {
            if path
                .file_name()
                .is_some_and(|name| name == "tests" || name == "benches" || name == "examples")
            {
                continue;
            }
            newest_modification(&path)
        } else {
            entry.metadata().ok().and_then(|meta| meta.modified().ok())
        };
        newest = newest.max(modified);
    }
    newest
}

/// A port nothing listens on right now (the OS picks it; a tiny race is acceptable in tests).
/// Ports for test nodes come from below Linux's ephemeral range (32768 and up) and are handed
/// out once per test process: an ephemeral port freed by a killed node could otherwise be
/// taken by a node of another test running in parallel, and the restarted node's clients
/// would talk to a stranger's cluster.
const TEST_PORT_FIRST: u32 = 20_000;
const TEST_PORT_SPAN: u32 = 12_000;
static NEXT_PORT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
/// How many times a cluster start may begin again on fresh ports.
const START_ATTEMPTS: u32 = 3;

/// A port nothing listens on right now, unique within this test process.
pub fn free_port() -> u16 {
    use std::sync::atomic::Ordering;
    // Spread concurrent test processes apart by their pid.
    let start = (std::process::id().wrapping_mul(193)) % TEST_PORT_SPAN;
    loop {
        let offset = (start + NEXT_PORT.fetch_add(1, Ordering::SeqCst)) % TEST_PORT_SPAN;
        let port = (TEST_PORT_FIRST + offset) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// One `conclave serve` process.
pub struct Node {
    pub name: String,
    pub client_addr: String,
    pub peer_addr: String,
    pub data_dir: PathBuf,
    args: Vec<String>,
    child: Option<Child>,
}

impl Node {
    fn spawn(&mut self) {
        let log = std::fs::File::create(self.data_dir.with_extension("log")).expect("log file");
        let child = Command::new(server_binary())
            .args(&self.args)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("start conclave serve");
        self.child = Some(child);
    }

    /// SIGKILL, as a crash.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts again on the same ports and data.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A cluster of `n` nodes on fresh ports and a fresh data directory.
pub struct Cluster {
    pub nodes: Vec<Node>,
    root: PathBuf,
}

impl Cluster {
    /// Starts `n` nodes and waits until each listens. A node that exits first (its port was
    /// taken between choosing and binding it) makes the whole cluster start over on fresh
    /// ports, a few times at most.
    pub fn start(n: usize) -> Cluster {
        for attempt in 1..=START_ATTEMPTS {
            let mut cluster = Cluster::start_once(n);
            if cluster.wait_listening() {
                return cluster;
            }
            eprintln!("cluster start attempt {attempt} lost a node; starting over on new ports");
        }
        panic!("no cluster of {n} started in {START_ATTEMPTS} attempts");
    }

    /// True once every node accepts connections on its client and peer ports; false as soon
    /// as a node's process has exited.
    fn wait_listening(&mut self) -> bool {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let exited = self.nodes.iter_mut().any(|node| {
                node.child
                    .as_mut()
                    .is_some_and(|child| !matches!(child.try_wait(), Ok(None)))
            });
            if exited {
                return false;
            }
            let listening = self.nodes.iter().all(|node| {
                [&node.client_addr, &node.peer_addr].iter().all(|addr| {
                    addr.parse()
                        .ok()
                        .and_then(|addr| {
                            std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200))
                                .ok()
                        })
                        .is_some()
                })
            });
            if listening {
                return true;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the cluster's nodes did not listen within 20 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn start_once(n: usize) -> Cluster {
        let root = std::env::temp_dir().join(format!(
            "conclave-client-test-{}-{}",
            std::process::id(),
            free_port()
        ));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).expect("test data directory");
        let addrs: Vec<(String, String)> = (0..n)
            .map(|_| {
                (
                    format!("127.0.0.1:{}", free_port()),
                    format!("127.0.0.1:{}", free_port()),
                )
            })
            .collect();
        let initial_cluster = addrs
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("n{}={peer}", i + 1))
            .collect::<Vec<_>>()
            .join(",");
        let clients = addrs
            .iter()
            .enumerate()
            .map(|(i, (client, _))| format!("n{}={client}", i + 1))
            .collect::<Vec<_>>()
            .join(",");
        let mut nodes = Vec::new();
        for (i, (client, peer)) in addrs.into_iter().enumerate() {
            let name = format!("n{}", i + 1);
            let data_dir = root.join(&name);
            let args = vec![
                "serve".to_string(),
                "--name".into(),
                name.clone(),
                "--data-dir".into(),
                data_dir.display().to_string(),
                "--listen-client".into(),
                client.clone(),
                "--listen-peer".into(),
                peer.clone(),
                "--initial-cluster".into(),
                initial_cluster.clone(),
                "--initial-cluster-clients".into(),
                clients.clone(),
            ];
            let mut node = Node {
                name,
                client_addr: client,
                peer_addr: peer,
                data_dir,
                args,
                child: None,
            };
            node.spawn();
            nodes.push(node);
        }
        Cluster { nodes, root }
    }

    pub fn endpoints(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.client_addr.clone()).collect()
    }

    /// Connects, waiting for the cluster to come up and elect a leader.
    pub async fn client(&self) -> Client {
        self.client_with(test_options()).await
    }

    pub async fn client_with(&self, options: ClientOptions) -> Client {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            match Client::connect_with(self.endpoints(), options.clone()).await {
                Ok(client) => match client.status().await {
                    Ok(status) if status.leader != 0 => return client,
                    _ => {}
                },
                Err(error) if tokio::time::Instant::now() > deadline => {
                    panic!("cluster did not come up: {error}")
                }
                Err(_) => {}
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "cluster has no leader after 20 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            node.kill();
        }
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

pub fn test_options() -> ClientOptions {
    ClientOptions {
        request_timeout: Duration::from_secs(5),
        connect_timeout: Duration::from_millis(500),
        ..ClientOptions::default()
    }
}

/// Unwraps a result, failing with a clear message when the server lacks the service.
pub fn supported<T>(result: Result<T, Error>, what: &str) -> T {
    match result {
        Ok(value) => value,
        Err(error) if error.to_string().contains("does not implement") => {
            panic!("the server does not implement {what} yet, so this test cannot pass: {error}")
        }
        Err(error) => panic!("{what} failed: {error} (code {})", error.code()),
    }
}
