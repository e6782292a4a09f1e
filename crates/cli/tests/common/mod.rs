//! A harness that runs real `conclave serve` processes on loopback ports.

#![allow(dead_code)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use conclave_proto::etcdserverpb::kv_client::KvClient;
use conclave_proto::etcdserverpb::maintenance_client::MaintenanceClient;
use conclave_proto::etcdserverpb::{PutRequest, StatusRequest, StatusResponse};
use tonic::transport::Channel;

/// How long a cluster may take to elect its first leader.
pub const STARTUP_TIMEOUT: Duration = Duration::from_secs(15);

/// Writes, one at a time, that a stopped follower must miss for only a snapshot to bring it
/// back. The leader keeps sending appends to a member it cannot reach, up to its in-flight
/// limit (256, one entry each for a lone sequential writer), and its transport holds them
/// for the reconnect; so a restarted follower first catches up through those. With the
/// harness compacting every 50 entries, 1,000 writes leave the leader's log compacted far
/// past anything they carry. (300 did not: the follower caught up from the held appends and
/// the leader's uncompacted tail.)
pub const WRITES_PAST_HELD_APPENDS: usize = 1000;

static NEXT_DIR: AtomicU32 = AtomicU32::new(0);

/// Ports for test nodes come from below Linux's ephemeral range (32768 and up), so a restarted
/// node never finds its port taken by some client connection's source port.
const TEST_PORT_FIRST: u32 = 20_000;
const TEST_PORT_SPAN: u32 = 12_000;
static NEXT_PORT: AtomicU32 = AtomicU32::new(0);
/// How many times a cluster start may begin again on fresh ports.
const START_ATTEMPTS: u32 = 3;

/// A port nothing listens on right now, unique within this test process.
pub fn free_port() -> u16 {
    // Spread concurrent test processes apart by their pid.
    let start = (std::process::id() * 97) % TEST_PORT_SPAN;
    loop {
        let offset = (start + NEXT_PORT.fetch_add(1, Ordering::SeqCst)) % TEST_PORT_SPAN;
        let port = (TEST_PORT_FIRST + offset) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// The first of `len` consecutive ports nothing listens on right now (for `conclave dev`,
/// which numbers its nodes' ports from one base), unique within this test process.
pub fn free_port_run(len: u16) -> u16 {
    let start = (std::process::id() * 97) % TEST_PORT_SPAN;
    loop {
        let offset =
            (start + NEXT_PORT.fetch_add(u32::from(len), Ordering::SeqCst)) % TEST_PORT_SPAN;
        let first = TEST_PORT_FIRST + offset;
        if first + u32::from(len) > TEST_PORT_FIRST + TEST_PORT_SPAN {
            continue;
        }
        let all_free = (0..u32::from(len))
            .all(|i| TcpListener::bind(("127.0.0.1", (first + i) as u16)).is_ok());
        if all_free {
            return first as u16;
        }
    }
}

pub struct Node {
    pub id: u64,
    pub client: String,
    pub peer: String,
    /// The metrics listener (`--listen-metrics`): /metrics, /health, /readyz, /ui.
    pub metrics: String,
    pub data_dir: PathBuf,
    pub child: Option<Child>,
}

pub struct Cluster {
    pub root: PathBuf,
    pub nodes: Vec<Node>,
    initial_cluster: String,
    /// Serve flags every node gets besides the harness's own (e.g. a smaller cap).
    extra_args: Vec<String>,
    /// Client TLS and peer mutual TLS on every node ([`Cluster::start_tls`]).
    pub tls: Option<TestTls>,
}

/// The certificates of a TLS harness cluster, made with `conclave certs` in `<root>/tls`.
#[derive(Debug, Clone)]
pub struct TestTls {
    pub dir: PathBuf,
    pub ca: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

impl TestTls {
    /// Runs `conclave certs ARGS`, panicking with its stderr on failure.
    pub fn certs(args: &[&str]) {
        let output = Command::new(env!("CARGO_BIN_EXE_conclave"))
            .arg("certs")
            .args(args)
            .output()
            .expect("run conclave certs");
        assert!(
            output.status.success(),
            "conclave certs {args:?} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }

    /// A CA in `dir` with a server certificate for 127.0.0.1, a client certificate `client`
    /// and a peer certificate for each member name.
    pub fn make(dir: &std::path::Path, members: &[String]) -> TestTls {
        let d = dir.to_str().expect("UTF-8 test path");
        TestTls::certs(&["init", d]);
        TestTls::certs(&[
            "issue",
            "--ca",
            d,
            "--name",
            "server",
            "--kind",
            "server",
            "--ip",
            "127.0.0.1",
            "--dns",
            "localhost",
        ]);
        TestTls::certs(&["issue", "--ca", d, "--name", "client", "--kind", "client"]);
        for member in members {
            TestTls::certs(&[
                "issue",
                "--ca",
                d,
                "--name",
                member,
                "--kind",
                "peer",
                "--ip",
                "127.0.0.1",
            ]);
        }
        TestTls {
            dir: dir.to_path_buf(),
            ca: dir.join("ca.pem"),
            client_cert: dir.join("client-client.pem"),
            client_key: dir.join("client-client-key.pem"),
        }
    }

    /// The serve flags of member `name`: client TLS with client certificates required, and
    /// peer mutual TLS.
    pub fn serve_args(&self, name: &str) -> Vec<String> {
        let path = |file: String| self.dir.join(file).display().to_string();
        let ca = self.ca.display().to_string();
        vec![
            "--cert-file".into(),
            path("server-server.pem".into()),
            "--key-file".into(),
            path("server-server-key.pem".into()),
            "--trusted-ca-file".into(),
            ca.clone(),
            "--client-cert-auth".into(),
            "--peer-cert-file".into(),
            path(format!("{name}-peer.pem")),
            "--peer-key-file".into(),
            path(format!("{name}-peer-key.pem")),
            "--peer-trusted-ca-file".into(),
            ca,
        ]
    }

    /// The client flags of `conclave` (and etcdctl).
    pub fn client_args(&self) -> Vec<String> {
        vec![
            "--cacert".into(),
            self.ca.display().to_string(),
            "--cert".into(),
            self.client_cert.display().to_string(),
            "--key".into(),
            self.client_key.display().to_string(),
        ]
    }

    /// tonic's client configuration with the client certificate.
    pub fn client_config(&self) -> tonic::transport::ClientTlsConfig {
        let read = |p: &PathBuf| std::fs::read(p).expect("read a test certificate");
        tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(read(&self.ca)))
            .identity(tonic::transport::Identity::from_pem(
                read(&self.client_cert),
                read(&self.client_key),
            ))
    }
}

/// The peer secret every harness cluster's members share (`--peer-secret-file`).
pub const TEST_PEER_SECRET: &str = "harness-peer-secret-0123456789abcdef";

impl Cluster {
    /// Starts `size` nodes and waits until one of them leads. A node that exits during
    /// start-up (its port was taken between choosing and binding it) makes the whole cluster
    /// start over on fresh ports, a few times at most.
    pub async fn start(size: u64) -> Cluster {
        Cluster::start_with_args(size, &[]).await
    }

    /// [`Cluster::start`] with more serve flags for every node.
    pub async fn start_with_args(size: u64, extra_args: &[&str]) -> Cluster {
        Cluster::start_with(size, extra_args, false).await
    }

    /// [`Cluster::start`] with client TLS (client certificates required) and peer mutual TLS
    /// on every node; the harness's own clients ([`Cluster::kv`], ...) use TLS too.
    pub async fn start_tls(size: u64) -> Cluster {
        Cluster::start_with(size, &[], true).await
    }

    /// [`Cluster::start_tls`] with more serve flags for every node.
    pub async fn start_tls_with_args(size: u64, extra_args: &[&str]) -> Cluster {
        Cluster::start_with(size, extra_args, true).await
    }

    async fn start_with(size: u64, extra_args: &[&str], tls: bool) -> Cluster {
        for attempt in 1..=START_ATTEMPTS {
            let extra_args = extra_args.iter().map(|arg| arg.to_string()).collect();
            let mut cluster = Cluster::start_once(size, extra_args, tls);
            if cluster.wait_for_start(STARTUP_TIMEOUT).await {
                return cluster;
            }
            eprintln!(
                "cluster start attempt {attempt} lost a node (logs in {}); starting over on new ports",
                cluster.root.display()
            );
        }
        panic!("no cluster of {size} started in {START_ATTEMPTS} attempts");
    }

    fn start_once(size: u64, extra_args: Vec<String>, tls: bool) -> Cluster {
        let root = std::env::temp_dir().join(format!(
            "conclave-cli-test-{}-{}",
            std::process::id(),
            NEXT_DIR.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).expect("create the test directory");
        write_peer_secret(&root);
        let nodes: Vec<Node> = (1..=size)
            .map(|id| Node {
                id,
                client: format!("127.0.0.1:{}", free_port()),
                peer: format!("127.0.0.1:{}", free_port()),
                metrics: format!("127.0.0.1:{}", free_port()),
                data_dir: root.join(format!("node{id}")),
                child: None,
            })
            .collect();
        let initial_cluster = nodes
            .iter()
            .map(|n| format!("{}={}", n.id, n.peer))
            .collect::<Vec<_>>()
            .join(",");
        let tls = tls.then(|| {
            let names: Vec<String> = nodes.iter().map(|n| format!("node{}", n.id)).collect();
            TestTls::make(&root.join("tls"), &names)
        });
        let mut cluster = Cluster {
            root,
            nodes,
            initial_cluster,
            extra_args,
            tls,
        };
        for id in 1..=size {
            cluster.spawn(id);
        }
        cluster
    }

    /// True once a node leads; false as soon as a node's process has exited.
    async fn wait_for_start(&mut self, timeout: Duration) -> bool {
        let start = Instant::now();
        while start.elapsed() < timeout {
            let exited = self.nodes.iter_mut().any(|node| {
                node.child
                    .as_mut()
                    .is_some_and(|child| !matches!(child.try_wait(), Ok(None)))
            });
            if exited {
                return false;
            }
            if self.leader_now().await.is_some() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!(
            "no leader within {timeout:?}; logs in {}",
            self.root.display()
        );
    }

    fn node(&self, id: u64) -> &Node {
        &self.nodes[(id - 1) as usize]
    }

    /// (Re)starts node `id`'s process over its data directory.
    pub fn spawn(&mut self, id: u64) {
        let extra_args = self.extra_args.clone();
        self.spawn_with_args(id, &extra_args);
    }

    /// (Re)starts node `id` with `extra_args` in place of the flags the cluster's other
    /// members got (a member restarted with other settings).
    pub fn spawn_with_args(&mut self, id: u64, extra_args: &[String]) {
        let clients = self
            .nodes
            .iter()
            .map(|n| format!("{}={}", n.id, n.client))
            .collect::<Vec<_>>()
            .join(",");
        let node = &self.nodes[(id - 1) as usize];
        let mut args = vec![
            "--id".to_string(),
            id.to_string(),
            "--listen-peer".into(),
            node.peer.clone(),
            "--initial-cluster".into(),
            self.initial_cluster.clone(),
            "--initial-cluster-clients".into(),
            clients,
            "--snapshot-entries".into(),
            "50".into(),
            // Every 50 entries whatever the state's size: the tests count on compaction.
            "--snapshot-log-percent".into(),
            "0".into(),
        ];
        args.extend(extra_args.iter().cloned());
        if let Some(tls) = &self.tls {
            args.extend(tls.serve_args(&format!("node{id}")));
        }
        let child = self.spawn_serve(node, &args);
        self.nodes[(id - 1) as usize].child = Some(child);
    }

    /// Starts `conclave serve` for `node` with its client and metrics addresses, data
    /// directory, log and the cluster's peer secret, plus `args` (its id and cluster flags).
    /// [`Cluster::spawn`] uses it for the harness's members; tests use it for members added
    /// by MemberAdd.
    pub fn spawn_serve(&self, node: &Node, args: &[String]) -> Child {
        let log_path = self.root.join(format!("node{}.log", node.id));
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .expect("open the node log");
        let log_err = log.try_clone().expect("clone the log handle");
        Command::new(env!("CARGO_BIN_EXE_conclave"))
            .arg("serve")
            .arg("--data-dir")
            .arg(&node.data_dir)
            .args(["--listen-client", &node.client])
            .args(["--listen-metrics", &node.metrics])
            .arg("--peer-secret-file")
            .arg(self.peer_secret_file())
            .args(args)
            .env("CONCLAVE_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log_err))
            .spawn()
            .expect("start conclave serve")
    }

    /// SIGKILL: no goodbye, no leadership transfer.
    pub fn kill(&mut self, id: u64) {
        if let Some(mut child) = self.nodes[(id - 1) as usize].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM and wait for the process to exit; returns its exit status success.
    pub fn terminate(&mut self, id: u64) -> bool {
        let Some(mut child) = self.nodes[(id - 1) as usize].child.take() else {
            return false;
        };
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        child.wait().map(|s| s.success()).unwrap_or(false)
    }

    /// The file holding [`TEST_PEER_SECRET`]; joining members must be given it too.
    pub fn peer_secret_file(&self) -> PathBuf {
        self.root.join("peer-secret")
    }

    pub fn endpoint(&self, id: u64) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.node(id).client)
    }

    /// A lazy channel to node `id`, over TLS when the cluster has it.
    pub fn channel(&self, id: u64) -> Channel {
        let mut endpoint = Channel::from_shared(self.endpoint(id)).expect("valid endpoint");
        if let Some(tls) = &self.tls {
            endpoint = endpoint
                .tls_config(tls.client_config())
                .expect("valid TLS configuration");
        }
        endpoint.connect_lazy()
    }

    /// Member `id`'s client address, `host:port`.
    pub fn node_client(&self, id: u64) -> String {
        self.node(id).client.clone()
    }

    /// The base URL of node `id`'s metrics listener.
    pub fn metrics_url(&self, id: u64) -> String {
        format!("http://{}", self.node(id).metrics)
    }

    pub fn endpoints(&self) -> String {
        self.nodes
            .iter()
            .map(|n| n.client.clone())
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn live_ids(&self) -> Vec<u64> {
        self.nodes
            .iter()
            .filter(|n| n.child.is_some())
            .map(|n| n.id)
            .collect()
    }

    /// Stops every running member but `keep` with SIGSTOP, until the guards are dropped.
    pub fn pause_all_but(&self, keep: u64) -> Vec<Paused> {
        self.nodes
            .iter()
            .filter(|n| n.id != keep)
            .filter_map(|n| n.child.as_ref())
            .map(|child| Paused::new(child.id()))
            .collect()
    }

    pub async fn kv(&self, id: u64) -> KvClient<Channel> {
        KvClient::new(self.channel(id))
    }

    pub async fn maintenance(&self, id: u64) -> MaintenanceClient<Channel> {
        MaintenanceClient::new(self.channel(id))
    }

    /// The leader as a live node reports it of itself, waiting up to `timeout`.
    pub async fn wait_for_leader(&self, timeout: Duration) -> u64 {
        let start = Instant::now();
        while start.elapsed() < timeout {
            if let Some(leader) = self.leader_now().await {
                return leader;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!(
            "no leader within {timeout:?}; logs in {}",
            self.root.display()
        );
    }

    /// A live node that reports itself the leader right now, if any.
    async fn leader_now(&self) -> Option<u64> {
        for id in self.live_ids() {
            if let Some(status) = self.status(id).await {
                let member = status.header.map(|h| h.member_id).unwrap_or(0);
                if status.leader == member && member != 0 {
                    return Some(member);
                }
            }
        }
        None
    }

    /// Maintenance.Status of node `id`, or `None` when it does not answer within a second.
    pub async fn status(&self, id: u64) -> Option<StatusResponse> {
        let mut request = tonic::Request::new(StatusRequest {});
        request.set_timeout(Duration::from_secs(1));
        let mut client = self.maintenance(id).await;
        match tokio::time::timeout(Duration::from_secs(1), client.status(request)).await {
            Ok(Ok(response)) => Some(response.into_inner()),
            _ => None,
        }
    }

    /// Waits until node `id` knows a leader and has applied everything the leader had
    /// committed when the wait began, so it can take its share of the load again.
    pub async fn wait_caught_up(&self, id: u64, timeout: Duration) {
        let start = Instant::now();
        let leader = self.wait_for_leader(timeout).await;
        let mut target = None;
        while start.elapsed() < timeout {
            if target.is_none() {
                target = self.status(leader).await.map(|s| s.raft_index);
            }
            if let (Some(target), Some(status)) = (target, self.status(id).await)
                && status.leader != 0
                && status.raft_applied_index >= target
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!(
            "node {id} did not catch up within {timeout:?}; logs in {}",
            self.root.display()
        );
    }

    /// Puts through node `id`, retrying on errors until `timeout`; returns when acknowledged.
    pub async fn put_until_acked(&self, id: u64, key: &str, value: &str, timeout: Duration) {
        let start = Instant::now();
        let mut client = self.kv(id).await;
        loop {
            let mut request = tonic::Request::new(PutRequest {
                key: key.to_string().into(),
                value: value.to_string().into(),
                ..Default::default()
            });
            request.set_timeout(Duration::from_secs(1));
            match client.put(request).await {
                Ok(_) => return,
                Err(status) if start.elapsed() < timeout => {
                    let _ = status;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err(status) => panic!("put {key} not acknowledged within {timeout:?}: {status}"),
            }
        }
    }
}

/// GET `url` over plain HTTP/1 (the metrics listener): (status, body), `None` when it fails
/// or takes over 3 s.
pub async fn http_get(url: &str) -> Option<(u16, String)> {
    use http_body_util::{BodyExt, Empty};
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<bytes::Bytes>>();
    let uri: hyper::Uri = url.parse().ok()?;
    let answer = tokio::time::timeout(Duration::from_secs(3), client.get(uri))
        .await
        .ok()?
        .ok()?;
    let status = answer.status().as_u16();
    let body = answer.into_body().collect().await.ok()?.to_bytes();
    Some((status, String::from_utf8_lossy(&body).into_owned()))
}

/// Writes [`TEST_PEER_SECRET`] into `root/peer-secret`, readable by its owner only.
fn write_peer_secret(root: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt;
    let path = root.join("peer-secret");
    std::fs::write(&path, format!("{TEST_PEER_SECRET}\n")).expect("write the peer secret");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
        .expect("make the peer secret private");
}

/// `key` as the member at `client` (`host:port`) has applied it: a serializable read,
/// answered from that member's own state. `None` if it is absent or the member does not answer.
pub async fn local_value(client: &str, key: &str) -> Option<String> {
    let channel = Channel::from_shared(format!("http://{client}"))
        .ok()?
        .connect()
        .await
        .ok()?;
    let response = KvClient::new(channel)
        .range(conclave_proto::etcdserverpb::RangeRequest {
            key: key.to_string().into(),
            serializable: true,
            ..Default::default()
        })
        .await
        .ok()?
        .into_inner();
    response
        .kvs
        .first()
        .map(|kv| String::from_utf8_lossy(&kv.value).into_owned())
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(mut child) = node.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }
}

/// Stops a process with SIGSTOP; SIGCONT when dropped (also when the test fails).
pub struct Paused(u32);

impl Paused {
    pub fn new(pid: u32) -> Paused {
        let stopped = Command::new("kill")
            .args(["-STOP", &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(stopped.success(), "SIGSTOP {pid}");
        // kill(2) returns once the signal is queued; a thread that is running stops a moment
        // later. Tests count on nothing being handled after this returns, so wait until every
        // thread of the process is stopped.
        let started = Instant::now();
        while !all_threads_stopped(pid) {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "process {pid} did not stop within 5 s of SIGSTOP"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        Paused(pid)
    }
}

/// Whether every thread of process `pid` is stopped (state `T` in `/proc`). A thread that
/// has exited meanwhile is not in the way.
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(threads) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    threads.flatten().all(|thread| {
        let Ok(stat) = std::fs::read_to_string(thread.path().join("stat")) else {
            return true;
        };
        // The state follows the command name, which is in parentheses and may hold spaces.
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
            .is_some_and(|state| state == 'T' || state == 't')
    })
}

impl Drop for Paused {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-CONT", &self.0.to_string()])
            .status();
    }
}

/// Debian's etcdctl (package etcd-client), for the tests that compare with etcd.
pub const ETCDCTL_PATH: &str = "/usr/bin/etcdctl";

/// An etcdctl left running (`elect`, `lock`, `watch`) whose stdout lines arrive on a channel;
/// killed when dropped.
pub struct EtcdctlLines {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl EtcdctlLines {
    /// Starts `etcdctl --endpoints=ENDPOINTS FLAGS... ARGS...` with a clean environment. Started
    /// directly, not under `timeout`, so that dropping it kills etcdctl itself.
    pub fn start(endpoints: &str, flags: &[String], args: &[&str]) -> EtcdctlLines {
        use std::io::{BufRead, BufReader};
        let mut child = Command::new(ETCDCTL_PATH)
            .env_clear()
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={endpoints}"))
            .args(flags)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start etcdctl");
        let stdout = child.stdout.take().expect("piped");
        let (sender, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
        EtcdctlLines { child, lines }
    }

    /// Waits up to `wait` for a line that starts with `prefix`, and returns it.
    pub fn wait_for(&self, prefix: &str, wait: Duration) -> String {
        let deadline = Instant::now() + wait;
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match self.lines.recv_timeout(left) {
                Ok(line) if line.starts_with(prefix) => return line,
                Ok(_) => {}
                Err(_) => break,
            }
        }
        panic!("no line starting with {prefix:?} within {wait:?}");
    }
}

impl Drop for EtcdctlLines {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
