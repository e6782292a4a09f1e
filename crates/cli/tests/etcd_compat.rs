//! The same etcdctl 3.4 script against a 3-node Conclave cluster and a real 3-member etcd 3.4
//! cluster (Debian's `etcd-server` and `etcd-client`), compared field by field.
//!
//! Every step records etcdctl's exit status, stdout and stderr on both sides. What legitimately
//! differs between two clusters (member and lease IDs, member names and addresses, raft terms
//! and indexes, versions, database sizes, remaining TTLs, client-side log timestamps) is
//! replaced by placeholders; revisions are compared as they are, since both clusters start
//! empty and run the same writes. JSON outputs are compared as `serde_json` values, text
//! outputs line by line (tables cell by cell). A difference fails the test unless [`ALLOWED`]
//! names it; each entry there is explained in `docs/etcd-compat.md`, and an entry that no
//! longer matches anything fails the test too, so the list stays current.
//!
//! This test fails, rather than skips, when etcd or etcdctl is missing: `.ci/run` installs them.

mod common;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use conclave_proto::etcdserverpb::StatusRequest;
use conclave_proto::etcdserverpb::maintenance_client::MaintenanceClient;
use serde_json::Value;

const ETCD: &str = "/usr/bin/etcd";
const ETCDCTL: &str = "/usr/bin/etcdctl";
const INSTALL: &str =
    "install it with `apt-get update && apt-get install -y etcd-server etcd-client` (.ci/run does)";

/// etcd's members listen on ports from this range. Conclave's test harnesses take theirs from
/// 20000-31999 (below the ephemeral range); no other test uses this one.
const ETCD_PORT_FIRST: u32 = 17_000;
const ETCD_PORT_SPAN: u32 = 2_000;
const ETCD_STARTUP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a step waits for a background etcdctl (watch, lock, elect) to show what it must.
const WAIT_TIMEOUT: Duration = Duration::from_secs(15);
/// How long a single foreground etcdctl may run before the test gives up on it.
const ETCDCTL_TIMEOUT: Duration = Duration::from_secs(20);

/// A difference the comparison accepts. `step` and `path` name it exactly as the comparer
/// reports it; `id` is the heading under which `docs/etcd-compat.md` gives the reason.
struct Allowed {
    id: &'static str,
    step: &'static str,
    path: &'static str,
    reason: &'static str,
}

const ALLOWED: &[Allowed] = &[Allowed {
    id: "minimum-lease-ttl",
    step: "lease grant below the minimum TTL",
    path: "stdout line 1",
    reason: "a lease TTL is raised to 1.5 election timeouts, and Conclave's election timeout \
             is shorter than etcd's default, so the minimum is 1 s rather than 2 s",
}];

/// Names of locks and elections the script uses: their keys end in a lease ID.
const LEASED_KEY_PREFIXES: &[&str] = &["cmp-lock/", "cmp-election/"];

// ---------------------------------------------------------------------------------------------
// The etcd cluster
// ---------------------------------------------------------------------------------------------

static NEXT_ETCD_PORT: AtomicU32 = AtomicU32::new(0);

fn free_etcd_port() -> u16 {
    let start = (std::process::id() * 37) % ETCD_PORT_SPAN;
    for _ in 0..ETCD_PORT_SPAN {
        let offset = (start + NEXT_ETCD_PORT.fetch_add(1, Ordering::SeqCst)) % ETCD_PORT_SPAN;
        let port = (ETCD_PORT_FIRST + offset) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!(
        "no free port in {ETCD_PORT_FIRST}..{}",
        ETCD_PORT_FIRST + ETCD_PORT_SPAN
    );
}

/// Three `/usr/bin/etcd` members on loopback, each with its own data directory; killed on drop.
struct EtcdCluster {
    root: PathBuf,
    clients: Vec<String>,
    peers: Vec<String>,
    children: Vec<Child>,
}

impl EtcdCluster {
    async fn start() -> EtcdCluster {
        assert!(Path::new(ETCD).exists(), "{ETCD} is missing: {INSTALL}");
        let root =
            std::env::temp_dir().join(format!("conclave-etcd-compat-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).expect("create the etcd test directory");
        let clients: Vec<String> = (0..3)
            .map(|_| format!("127.0.0.1:{}", free_etcd_port()))
            .collect();
        let peers: Vec<String> = (0..3)
            .map(|_| format!("127.0.0.1:{}", free_etcd_port()))
            .collect();
        let initial_cluster = peers
            .iter()
            .enumerate()
            .map(|(i, peer)| format!("etcd{}=http://{peer}", i + 1))
            .collect::<Vec<_>>()
            .join(",");
        let mut cluster = EtcdCluster {
            root,
            clients,
            peers,
            children: Vec::new(),
        };
        for i in 0..3 {
            let log = std::fs::File::create(cluster.root.join(format!("etcd{}.log", i + 1)))
                .expect("create the etcd log");
            let log_err = log.try_clone().expect("clone the log handle");
            let client = format!("http://{}", cluster.clients[i]);
            let peer = format!("http://{}", cluster.peers[i]);
            let child = Command::new(ETCD)
                .arg(format!("--name=etcd{}", i + 1))
                .arg(format!(
                    "--data-dir={}",
                    cluster.root.join(format!("etcd{}", i + 1)).display()
                ))
                .arg(format!("--listen-client-urls={client}"))
                .arg(format!("--advertise-client-urls={client}"))
                .arg(format!("--listen-peer-urls={peer}"))
                .arg(format!("--initial-advertise-peer-urls={peer}"))
                .arg(format!("--initial-cluster={initial_cluster}"))
                .arg("--initial-cluster-state=new")
                .arg("--initial-cluster-token=conclave-etcd-compat")
                .env_clear()
                .stdin(Stdio::null())
                .stdout(Stdio::from(log))
                .stderr(Stdio::from(log_err))
                .spawn()
                .expect("start etcd");
            cluster.children.push(child);
        }
        cluster.wait_for_leader().await;
        cluster
    }

    async fn wait_for_leader(&self) {
        let start = Instant::now();
        while start.elapsed() < ETCD_STARTUP_TIMEOUT {
            let mut leaders = Vec::new();
            for client in &self.clients {
                let channel = tonic::transport::Channel::from_shared(format!("http://{client}"))
                    .expect("valid endpoint")
                    .connect_lazy();
                let mut maintenance = MaintenanceClient::new(channel);
                if let Ok(status) = maintenance.status(StatusRequest {}).await {
                    leaders.push(status.into_inner().leader);
                }
            }
            if leaders.len() == 3 && leaders[0] != 0 && leaders.iter().all(|l| *l == leaders[0]) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!(
            "etcd elected no leader within {ETCD_STARTUP_TIMEOUT:?}; logs in {}",
            self.root.display()
        );
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Running the script
// ---------------------------------------------------------------------------------------------

/// One cluster the script runs against.
struct Side {
    name: &'static str,
    clients: Vec<String>,
    peers: Vec<String>,
    /// Scratch files for the lock step's commands.
    scratch: PathBuf,
}

/// What one etcdctl run printed; `exit` is `None` when the test killed it.
#[derive(Clone, Debug)]
struct Observation {
    step: String,
    kind: Kind,
    exit: Option<i32>,
    stdout: String,
    stderr: String,
}

/// How a step's output is normalised beyond the rules every output gets.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Plain,
    /// Lines (and JSON arrays) in no defined order: `lease list`.
    Unordered,
    /// `member list` rows: ID, status, name, peer URLs, client URLs, learner.
    Members,
    /// `endpoint status` rows: endpoint, ID, version, size, leader, learner, term, indexes.
    Status,
}

impl Side {
    fn etcdctl(&self, args: &[&str]) -> Command {
        assert!(
            Path::new(ETCDCTL).exists(),
            "{ETCDCTL} is missing: {INSTALL}"
        );
        let mut command = Command::new(ETCDCTL);
        command
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("ETCDCTL_API", "3")
            .env("CMP_DIR", &self.scratch)
            .arg(format!("--endpoints={}", self.clients.join(",")))
            .args(args);
        command
    }

    /// Runs etcdctl to completion with `stdin`.
    fn run(&self, step: &str, kind: Kind, args: &[&str], stdin: &str) -> Observation {
        let mut child = self
            .etcdctl(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start etcdctl");
        let mut input = child.stdin.take().expect("piped stdin");
        input
            .write_all(stdin.as_bytes())
            .expect("write etcdctl's stdin");
        drop(input);
        let background = Background::collect(step, kind, child);
        background.wait_exit(ETCDCTL_TIMEOUT)
    }

    fn spawn(&self, step: &str, kind: Kind, args: &[&str]) -> Background {
        let child = self
            .etcdctl(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start etcdctl");
        Background::collect(step, kind, child)
    }
}

/// An etcdctl process whose output is read as it comes.
struct Background {
    step: String,
    kind: Kind,
    child: Child,
    stdout: Arc<Mutex<Vec<u8>>>,
    stderr: Arc<Mutex<Vec<u8>>>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl Background {
    fn collect(step: &str, kind: Kind, mut child: Child) -> Background {
        let stdout = Arc::new(Mutex::new(Vec::new()));
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let mut readers = Vec::new();
        let out_pipe = child.stdout.take().expect("piped stdout");
        let err_pipe = child.stderr.take().expect("piped stderr");
        for (mut pipe, sink) in [
            (Box::new(out_pipe) as Box<dyn Read + Send>, stdout.clone()),
            (Box::new(err_pipe) as Box<dyn Read + Send>, stderr.clone()),
        ] {
            readers.push(std::thread::spawn(move || {
                let mut chunk = [0u8; 4096];
                while let Ok(n) = pipe.read(&mut chunk) {
                    if n == 0 {
                        break;
                    }
                    sink.lock()
                        .expect("output lock")
                        .extend_from_slice(&chunk[..n]);
                }
            }));
        }
        Background {
            step: step.to_string(),
            kind,
            child,
            stdout,
            stderr,
            readers,
        }
    }

    fn stdout_now(&self) -> String {
        String::from_utf8_lossy(&self.stdout.lock().expect("output lock")).into_owned()
    }

    /// Waits until stdout contains `text`.
    fn wait_for(&self, text: &str, side: &str) {
        let start = Instant::now();
        while !self.stdout_now().contains(text) {
            assert!(
                start.elapsed() < WAIT_TIMEOUT,
                "{side}: `{}` did not print {text:?} within {WAIT_TIMEOUT:?}; stdout so far:\n{}",
                self.step,
                self.stdout_now()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .args([&format!("-{name}"), &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{name} {}", self.child.id());
    }

    /// Waits for the process to exit by itself.
    fn wait_exit(mut self, timeout: Duration) -> Observation {
        let start = Instant::now();
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("poll etcdctl") {
                break status;
            }
            if start.elapsed() > timeout {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!(
                    "`{}` did not exit within {timeout:?}; stdout:\n{}",
                    self.step,
                    self.stdout_now()
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        self.finish(status.code())
    }

    /// Kills the process (SIGKILL) and returns what it printed.
    fn kill(mut self) -> Observation {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.finish(None)
    }

    fn finish(mut self, exit: Option<i32>) -> Observation {
        for reader in self.readers.drain(..) {
            let _ = reader.join();
        }
        let text = |sink: &Arc<Mutex<Vec<u8>>>| {
            String::from_utf8_lossy(&sink.lock().expect("output lock")).into_owned()
        };
        Observation {
            step: self.step.clone(),
            kind: self.kind,
            exit,
            stdout: text(&self.stdout),
            stderr: text(&self.stderr),
        }
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The script. Both clusters start empty, so the same steps give the same revisions.
fn run_script(side: &Side) -> Vec<Observation> {
    use Kind::*;
    let seen = std::cell::RefCell::new(Vec::new());
    let run = |step: &str, kind: Kind, args: &[&str], stdin: &str| {
        let observation = side.run(step, kind, args, stdin);
        seen.borrow_mut().push(observation.clone());
        observation
    };
    let keep = |observation: Observation| seen.borrow_mut().push(observation);

    // Membership and status first: every later ID is normalised with what these report.
    run(
        "member list -w json",
        Members,
        &["member", "list", "-w", "json"],
        "",
    );
    run("member list", Members, &["member", "list"], "");
    run(
        "member list -w table",
        Members,
        &["member", "list", "-w", "table"],
        "",
    );
    run(
        "endpoint status -w json",
        Status,
        &["endpoint", "status", "-w", "json"],
        "",
    );
    run(
        "endpoint status -w table",
        Status,
        &["endpoint", "status", "-w", "table"],
        "",
    );
    let cluster_json = ["endpoint", "status", "--cluster", "-w", "json"];
    run(
        "endpoint status --cluster -w json",
        Status,
        &cluster_json,
        "",
    );
    let cluster_table = ["endpoint", "status", "--cluster", "-w", "table"];
    run(
        "endpoint status --cluster -w table",
        Status,
        &cluster_table,
        "",
    );

    // KV.
    run("put a", Plain, &["put", "/cmp/a", "1"], "");
    run("put b", Plain, &["put", "/cmp/b", "2"], "");
    run("put c", Plain, &["put", "/cmp/c", "3"], "");
    run(
        "put a again -w json",
        Plain,
        &["put", "/cmp/a", "11", "-w", "json"],
        "",
    );
    run(
        "put a --prev-kv",
        Plain,
        &["put", "/cmp/a", "12", "--prev-kv"],
        "",
    );
    run("put from stdin", Plain, &["put", "/cmp/d"], "from stdin");
    run("get --prefix", Plain, &["get", "--prefix", "/cmp/"], "");
    run(
        "get --prefix -w json",
        Plain,
        &["get", "--prefix", "/cmp/", "-w", "json"],
        "",
    );
    run(
        "get -w fields",
        Plain,
        &["get", "/cmp/a", "-w", "fields"],
        "",
    );
    let limited = [
        "get",
        "--prefix",
        "/cmp/",
        "--limit=2",
        "--order=DESCEND",
        "--sort-by=MODIFY",
    ];
    run("get --limit --sort-by", Plain, &limited, "");
    let keys_only = ["get", "--prefix", "/cmp/", "--keys-only", "-w", "json"];
    run("get --keys-only -w json", Plain, &keys_only, "");
    run("get --rev", Plain, &["get", "/cmp/a", "--rev=2"], "");
    run("get a missing key", Plain, &["get", "/cmp/none"], "");
    run("del", Plain, &["del", "/cmp/b"], "");
    run(
        "del --prev-kv -w json",
        Plain,
        &["del", "--prev-kv", "/cmp/c", "-w", "json"],
        "",
    );
    run("del a missing key", Plain, &["del", "/cmp/none"], "");

    // Transactions, read from stdin as etcdctl reads them: compares, blank line, success
    // operations, blank line, failure operations, blank line.
    let txn_true = "value(\"/cmp/a\") = \"12\"\n\nput /cmp/t yes\n\nput /cmp/f no\n\n";
    run("txn that succeeds", Plain, &["txn"], txn_true);
    let txn_false = "mod(\"/cmp/a\") > \"100\"\nversion(\"/cmp/t\") = \"1\"\n\n\
                     put /cmp/t yes\n\nput /cmp/f no\ndel /cmp/t\nget /cmp/ --prefix\n\n";
    run("txn that fails", Plain, &["txn"], txn_false);
    run(
        "txn that fails -w json",
        Plain,
        &["txn", "-w", "json"],
        txn_false,
    );
    let txn_interactive = "create(\"/cmp/new\") = \"0\"\n\nput /cmp/new 1\n\n\n";
    run("txn -i", Plain, &["txn", "-i"], txn_interactive);

    // A watch from an old revision: history first, then a live event.
    let watch = side.spawn(
        "watch --rev",
        Plain,
        &["watch", "--prefix", "/cmp/", "--rev=2"],
    );
    watch.wait_for("/cmp/new\n1\n", side.name);
    run(
        "put while watching",
        Plain,
        &["put", "/cmp/live", "now"],
        "",
    );
    watch.wait_for("/cmp/live\nnow\n", side.name);
    keep(watch.kill());
    let watch_json = ["watch", "--prefix", "/cmp/", "--rev=7", "-w", "json"];
    let watch = side.spawn("watch --rev -w json", Plain, &watch_json);
    watch.wait_for("L2NtcC9saXZl", side.name); // base64 of /cmp/live
    keep(watch.kill());

    // Leases.
    let grant = run("lease grant", Plain, &["lease", "grant", "60"], "");
    let lease = grant
        .stdout
        .split_whitespace()
        .nth(1)
        .unwrap_or("")
        .to_string();
    run(
        "lease grant -w json",
        Plain,
        &["lease", "grant", "30", "-w", "json"],
        "",
    );
    run(
        "put with the lease",
        Plain,
        &["put", "--lease", &lease, "/cmp/l1", "x"],
        "",
    );
    run(
        "put another with it",
        Plain,
        &["put", "--lease", &lease, "/cmp/l2", "y"],
        "",
    );
    run(
        "lease keep-alive --once",
        Plain,
        &["lease", "keep-alive", "--once", &lease],
        "",
    );
    let keepalive_json = ["lease", "keep-alive", "--once", &lease, "-w", "json"];
    run(
        "lease keep-alive --once -w json",
        Plain,
        &keepalive_json,
        "",
    );
    run(
        "lease timetolive --keys",
        Plain,
        &["lease", "timetolive", "--keys", &lease],
        "",
    );
    let ttl_json = ["lease", "timetolive", "--keys", &lease, "-w", "json"];
    run("lease timetolive --keys -w json", Plain, &ttl_json, "");
    run("lease list", Unordered, &["lease", "list"], "");
    run(
        "lease list -w json",
        Unordered,
        &["lease", "list", "-w", "json"],
        "",
    );
    run("lease revoke", Plain, &["lease", "revoke", &lease], "");
    run(
        "get after the revoke",
        Plain,
        &["get", "--prefix", "/cmp/l", "-w", "json"],
        "",
    );
    run(
        "lease timetolive after the revoke",
        Plain,
        &["lease", "timetolive", &lease],
        "",
    );
    let expired_json = ["lease", "timetolive", &lease, "-w", "json"];
    run(
        "lease timetolive -w json after the revoke",
        Plain,
        &expired_json,
        "",
    );
    run(
        "lease grant below the minimum TTL",
        Plain,
        &["lease", "grant", "0"],
        "",
    );

    // Locks: the second etcdctl gets the lock only after the first one's command exits.
    let first_holder = "touch \"$CMP_DIR/held\"; echo \"first holds $ETCD_LOCK_KEY at \
                        $ETCD_LOCK_REV\"; sleep 1; rm \"$CMP_DIR/held\"; echo first releases";
    let second_holder = "if [ -e \"$CMP_DIR/held\" ]; then echo second overlapped; exit 9; fi; \
                         echo \"second holds $ETCD_LOCK_KEY at $ETCD_LOCK_REV\"; exit 3";
    let first = side.spawn(
        "lock, first holder",
        Plain,
        &["lock", "cmp-lock", "--", "sh", "-c", first_holder],
    );
    first.wait_for("first holds", side.name);
    let second = side.spawn(
        "lock, second holder",
        Plain,
        &["lock", "cmp-lock", "--", "sh", "-c", second_holder],
    );
    keep(first.wait_exit(WAIT_TIMEOUT));
    keep(second.wait_exit(WAIT_TIMEOUT));

    // Elections: a listener sees alice lead, then bob once alice resigns on SIGINT.
    let listener = side.spawn("elect -l", Plain, &["elect", "-l", "cmp-election"]);
    let alice = side.spawn("elect alice", Plain, &["elect", "cmp-election", "alice"]);
    alice.wait_for("alice\n", side.name);
    listener.wait_for("alice\n", side.name);
    let bob = side.spawn("elect bob", Plain, &["elect", "cmp-election", "bob"]);
    std::thread::sleep(Duration::from_millis(300)); // bob campaigns behind alice
    alice.signal("INT");
    keep(alice.wait_exit(WAIT_TIMEOUT));
    bob.wait_for("bob\n", side.name);
    listener.wait_for("bob\n", side.name);
    // The listener stops while bob still leads. etcdctl's `elect -l` is a Get-then-Watch
    // loop on the client (it never calls Election.Observe): once bob resigns it reads the
    // election again, and a SIGINT that lands during that read cancels it, which etcdctl's
    // retry interceptor logs on stderr ("retrying of unary invoker failed ... context
    // canceled") against any server. Stopped while it only waits on its watch, it exits
    // without a word.
    listener.signal("INT");
    keep(listener.wait_exit(WAIT_TIMEOUT));
    bob.signal("INT");
    keep(bob.wait_exit(WAIT_TIMEOUT));

    // Errors: exit status and message.
    run("compaction", Plain, &["compaction", "5"], "");
    run(
        "get at a compacted revision",
        Plain,
        &["get", "/cmp/a", "--rev=3"],
        "",
    );
    run(
        "get at a future revision",
        Plain,
        &["get", "/cmp/a", "--rev=100000"],
        "",
    );
    let watch = side.spawn(
        "watch at a compacted revision",
        Plain,
        &["watch", "/cmp/a", "--rev=3"],
    );
    keep(watch.wait_exit(WAIT_TIMEOUT));
    let watch_json = ["watch", "/cmp/a", "--rev=3", "-w", "json"];
    let watch = side.spawn("watch at a compacted revision -w json", Plain, &watch_json);
    keep(watch.wait_exit(WAIT_TIMEOUT));
    run(
        "compaction of a compacted revision",
        Plain,
        &["compaction", "4"],
        "",
    );
    run(
        "lease revoke of an unknown lease",
        Plain,
        &["lease", "revoke", "1234abcd"],
        "",
    );
    run(
        "lease revoke of a revoked lease",
        Plain,
        &["lease", "revoke", &lease],
        "",
    );
    let keepalive = ["lease", "keep-alive", "--once", &lease];
    run("lease keep-alive of a revoked lease", Plain, &keepalive, "");
    run(
        "lease grant too long",
        Plain,
        &["lease", "grant", "99999999999"],
        "",
    );
    run(
        "put with an unknown lease",
        Plain,
        &["put", "--lease=abc", "/cmp/x", "1"],
        "",
    );
    run("put an empty key", Plain, &["put", "", "1"], "");
    let bad_compare = "bogus(\"/cmp/a\") = \"1\"\n\nput /cmp/t yes\n\n\n";
    run("txn with a bad compare", Plain, &["txn"], bad_compare);
    let duplicate = "\nput /cmp/t 1\nput /cmp/t 2\n\n\n";
    run("txn with a duplicate key", Plain, &["txn"], duplicate);
    run(
        "member remove of an unknown member",
        Plain,
        &["member", "remove", "1234abcd"],
        "",
    );
    run(
        "get after everything",
        Plain,
        &["get", "--prefix", "/cmp/", "-w", "json"],
        "",
    );
    seen.into_inner()
}

// ---------------------------------------------------------------------------------------------
// Normalisation
// ---------------------------------------------------------------------------------------------

/// What a side's IDs and addresses are, learned from its own outputs.
#[derive(Default)]
struct Identities {
    members: Vec<u64>,
    member_names: Vec<String>,
    /// (address, placeholder), longest first so no address replaces part of another.
    addresses: Vec<(String, &'static str)>,
    /// Lease IDs in order of first appearance.
    leases: Vec<u64>,
}

impl Identities {
    fn learn(side: &Side, observations: &[Observation]) -> Identities {
        let mut ids = Identities::default();
        for client in &side.clients {
            ids.addresses.push((client.clone(), "<client-address>"));
        }
        for peer in &side.peers {
            ids.addresses.push((peer.clone(), "<peer-address>"));
        }
        ids.addresses
            .sort_by_key(|(a, _)| std::cmp::Reverse(a.len()));
        let members = observations
            .iter()
            .find(|o| o.step == "member list -w json")
            .expect("the script lists the members first");
        let members: Value = serde_json::from_str(members.stdout.trim()).unwrap_or_else(|e| {
            panic!(
                "{}: member list -w json is not JSON ({e}): {members:?}",
                side.name
            )
        });
        for member in members["members"].as_array().into_iter().flatten() {
            if let Some(id) = member["ID"].as_u64() {
                ids.members.push(id);
            }
            if let Some(name) = member["name"].as_str() {
                ids.member_names.push(name.to_string());
            }
        }
        for o in observations {
            for line in o.stdout.lines() {
                // `lease 694d77aa9e38260f granted with TTL(60s)`
                let words: Vec<&str> = line.split_whitespace().collect();
                if words.len() >= 3
                    && words[0] == "lease"
                    && words[2] == "granted"
                    && let Ok(id) = u64::from_str_radix(words[1], 16)
                {
                    ids.add_lease(id);
                }
                if let Ok(Value::Object(object)) = serde_json::from_str::<Value>(line)
                    && object.contains_key("TTL")
                    && let Some(id) = object.get("ID").and_then(Value::as_u64)
                {
                    ids.add_lease(id);
                }
            }
        }
        ids
    }

    fn add_lease(&mut self, id: u64) {
        if !self.leases.contains(&id) {
            self.leases.push(id);
        }
    }

    fn lease(&self, id: u64) -> Option<String> {
        let at = self.leases.iter().position(|l| *l == id)?;
        Some(format!("<lease-{}>", at + 1))
    }

    fn is_member(&self, id: u64) -> bool {
        self.members.contains(&id)
    }
}

/// A normalised output: JSON documents (one a line, as etcdctl prints them) or text lines.
#[derive(Clone, Debug, PartialEq)]
enum Normal {
    Json(Vec<Value>),
    Lines(Vec<String>),
}

#[derive(Debug)]
struct Normalised {
    step: String,
    exit: Option<i32>,
    stdout: Normal,
    stderr: Normal,
}

fn normalise(o: &Observation, ids: &Identities) -> Normalised {
    Normalised {
        step: o.step.clone(),
        exit: o.exit,
        stdout: normalise_stdout(&o.stdout, o.kind, ids),
        stderr: Normal::Lines(
            o.stderr
                .lines()
                .filter(|line| !line.trim().is_empty())
                .map(|line| normalise_stderr_line(line, ids))
                .collect(),
        ),
    }
}

fn normalise_stdout(stdout: &str, kind: Kind, ids: &Identities) -> Normal {
    let lines: Vec<&str> = stdout.lines().collect();
    let documents: Option<Vec<Value>> = if lines.is_empty() {
        None
    } else {
        lines
            .iter()
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                serde_json::from_str::<Value>(l)
                    .ok()
                    .filter(|v| v.is_object() || v.is_array())
            })
            .collect()
    };
    if let Some(documents) = documents {
        let sort = kind != Kind::Plain;
        return Normal::Json(
            documents
                .into_iter()
                .map(|d| normalise_json(d, "", sort, ids))
                .collect(),
        );
    }
    let mut out: Vec<String> = Vec::new();
    for line in lines {
        if line.starts_with('+') {
            continue; // table borders
        }
        let line = normalise_text(line, ids);
        let (cells, table) = if let Some(inner) = line.strip_prefix('|') {
            let cells: Vec<String> = inner
                .trim_end_matches('|')
                .split('|')
                .map(|c| c.trim().to_string())
                .collect();
            (cells, true)
        } else if matches!(kind, Kind::Members | Kind::Status) {
            (line.split(", ").map(str::to_string).collect(), false)
        } else {
            out.push(line);
            continue;
        };
        let cells = normalise_row(cells, kind, ids);
        out.push(cells.join(if table { " | " } else { ", " }));
    }
    if kind != Kind::Plain {
        // Member and status rows come in ID order, which differs between the clusters; the
        // table's header row sorts first either way (upper case before `<`).
        let header = out
            .first()
            .filter(|l| l.starts_with("ID") || l.starts_with("ENDPOINT"))
            .cloned();
        let mut rows: Vec<String> = out
            .into_iter()
            .filter(|l| Some(l) != header.as_ref())
            .collect();
        rows.sort();
        out = header.into_iter().chain(rows).collect();
    }
    Normal::Lines(out)
}

fn normalise_row(mut cells: Vec<String>, kind: Kind, ids: &Identities) -> Vec<String> {
    let member = |cell: &mut String| {
        if u64::from_str_radix(cell, 16).is_ok_and(|id| ids.is_member(id)) {
            *cell = "<member>".into();
        }
    };
    match kind {
        Kind::Members if cells.len() == 6 => {
            member(&mut cells[0]);
            if ids.member_names.contains(&cells[2]) {
                cells[2] = "<name>".into();
            }
        }
        Kind::Status if cells.len() == 10 && cells[0] != "ENDPOINT" => {
            member(&mut cells[1]);
            cells[2] = "<version>".into();
            cells[3] = "<size>".into();
            cells[6] = "<term>".into();
            cells[7] = "<index>".into();
            cells[8] = "<index>".into();
        }
        _ => {}
    }
    cells
}

/// Rules for every text line: addresses, lease IDs in their printed forms, `get -w fields`.
fn normalise_text(line: &str, ids: &Identities) -> String {
    let mut line = line.to_string();
    for (address, placeholder) in &ids.addresses {
        line = line.replace(address.as_str(), placeholder);
    }
    for (at, id) in ids.leases.iter().enumerate() {
        line = line.replace(&format!("{id:016x}"), &format!("<lease-{}>", at + 1));
    }
    for prefix in LEASED_KEY_PREFIXES {
        if let Some(at) = line.find(prefix) {
            let start = at + prefix.len();
            let end = line[start..]
                .find(|c: char| !c.is_ascii_hexdigit())
                .map_or(line.len(), |n| start + n);
            if end > start {
                line.replace_range(start..end, "<lease>");
            }
        }
    }
    // `lease ... granted with TTL(60s), remaining(59s)`: the remaining time depends on timing.
    if let Some(at) = line.find("remaining(") {
        let start = at + "remaining(".len();
        if let Some(end) = line[start..].find(')').map(|n| start + n)
            && line[start..end]
                .trim_end_matches('s')
                .parse::<i64>()
                .is_ok_and(|s| s > 0)
        {
            line.replace_range(start..end, "<remaining>");
        }
    }
    // etcd keeps a lease's keys in a Go map, so `attached keys([...])` comes in any order.
    if let Some(at) = line.find("attached keys([") {
        let start = at + "attached keys([".len();
        if let Some(end) = line[start..].find("])").map(|n| start + n) {
            let mut keys: Vec<&str> = line[start..end].split(' ').collect();
            keys.sort_unstable();
            let keys = keys.join(" ");
            line.replace_range(start..end, &keys);
        }
    }
    // `get -w fields`: `"MemberID" : 12345`.
    if let Some((key, value)) = line.split_once(" : ") {
        let number = value.trim().parse::<u64>().ok();
        let replacement = match (key, number) {
            ("\"ClusterID\"", _) => Some("<cluster>".to_string()),
            ("\"MemberID\"", Some(id)) if ids.is_member(id) => Some("<member>".to_string()),
            ("\"RaftTerm\"", _) => Some("<term>".to_string()),
            ("\"Lease\"", Some(id)) => ids.lease(id),
            _ => None,
        };
        if let Some(replacement) = replacement {
            line = format!("{key} : {replacement}");
        }
    }
    line
}

/// etcdctl's client library logs failed attempts as JSON on stderr: the message and the gRPC
/// error are compared, the timestamp, caller and dial target are not.
fn normalise_stderr_line(line: &str, ids: &Identities) -> String {
    match serde_json::from_str::<Value>(line) {
        Ok(Value::Object(log)) => format!(
            "<client log> {}: {}",
            log.get("msg").and_then(Value::as_str).unwrap_or(""),
            normalise_text(log.get("error").and_then(Value::as_str).unwrap_or(""), ids)
        ),
        _ => normalise_text(line, ids),
    }
}

fn normalise_json(value: Value, key: &str, sort: bool, ids: &Identities) -> Value {
    let placeholder = |s: &str| Value::String(s.to_string());
    match value {
        Value::Object(object) => {
            let is_member = object.contains_key("peerURLs") || object.contains_key("clientURLs");
            let mut out = serde_json::Map::new();
            for (k, v) in object {
                let v = match (k.as_str(), &v) {
                    ("cluster_id", _) => placeholder("<cluster>"),
                    ("raft_term" | "raftTerm", _) => placeholder("<term>"),
                    ("raftIndex" | "raftAppliedIndex", _) => placeholder("<index>"),
                    ("dbSize" | "dbSizeInUse", _) => placeholder("<size>"),
                    ("version", Value::String(_)) => placeholder("<version>"),
                    ("member_id" | "leader", Value::Number(n))
                        if n.as_u64().is_some_and(|id| ids.is_member(id)) =>
                    {
                        placeholder("<member>")
                    }
                    ("ID", Value::Number(n)) if is_member => {
                        if n.as_u64().is_some_and(|id| ids.is_member(id)) {
                            placeholder("<member>")
                        } else {
                            v
                        }
                    }
                    ("name", Value::String(name))
                        if is_member && ids.member_names.contains(name) =>
                    {
                        placeholder("<name>")
                    }
                    ("ID" | "id" | "lease", Value::Number(n)) => n
                        .as_u64()
                        .and_then(|id| ids.lease(id))
                        .map_or(v, Value::String),
                    // `lease timetolive`'s remaining seconds depend on timing; -1 (expired) not.
                    ("ttl", Value::Number(n)) if n.as_i64().is_some_and(|t| t > 0) => {
                        placeholder("<remaining>")
                    }
                    _ => normalise_json(v, &k, sort, ids),
                };
                out.insert(k, v);
            }
            Value::Object(out)
        }
        Value::Array(items) => {
            let mut items: Vec<Value> = items
                .into_iter()
                .map(|v| normalise_json(v, key, sort, ids))
                .collect();
            // A lease's `keys` (timetolive) come from a Go map in etcd: in no defined order.
            if sort || key == "keys" {
                items.sort_by_cached_key(|v| v.to_string());
            }
            Value::Array(items)
        }
        Value::String(s) => Value::String(normalise_text(&s, ids)),
        other => other,
    }
}

// ---------------------------------------------------------------------------------------------
// Comparison
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq)]
struct Difference {
    step: String,
    path: String,
    etcd: String,
    conclave: String,
}

fn compare(etcd: &[Normalised], conclave: &[Normalised]) -> Vec<Difference> {
    let mut differences = Vec::new();
    assert_eq!(
        etcd.iter().map(|n| &n.step).collect::<Vec<_>>(),
        conclave.iter().map(|n| &n.step).collect::<Vec<_>>(),
        "both sides ran the same steps"
    );
    for (e, c) in etcd.iter().zip(conclave) {
        let mut diff = |path: String, etcd: String, conclave: String| {
            differences.push(Difference {
                step: e.step.clone(),
                path,
                etcd,
                conclave,
            })
        };
        if e.exit != c.exit {
            diff(
                "exit".into(),
                format!("{:?}", e.exit),
                format!("{:?}", c.exit),
            );
        }
        compare_output("stdout", &e.stdout, &c.stdout, &mut diff);
        compare_output("stderr", &e.stderr, &c.stderr, &mut diff);
    }
    differences
}

fn compare_output(
    stream: &str,
    etcd: &Normal,
    conclave: &Normal,
    diff: &mut impl FnMut(String, String, String),
) {
    match (etcd, conclave) {
        (Normal::Json(e), Normal::Json(c)) => {
            if e.len() != c.len() {
                diff(
                    format!("{stream} documents"),
                    e.len().to_string(),
                    c.len().to_string(),
                );
            }
            for (i, (e, c)) in e.iter().zip(c).enumerate() {
                compare_json(&format!("{stream}[{i}]"), e, c, diff);
            }
        }
        (Normal::Lines(e), Normal::Lines(c)) => {
            for i in 0..e.len().max(c.len()) {
                let line =
                    |lines: &[String]| lines.get(i).cloned().unwrap_or_else(|| "<none>".into());
                if e.get(i) != c.get(i) {
                    diff(format!("{stream} line {}", i + 1), line(e), line(c));
                }
            }
        }
        (e, c) => diff(
            format!("{stream} format"),
            format!("{e:?}"),
            format!("{c:?}"),
        ),
    }
}

fn compare_json(
    path: &str,
    etcd: &Value,
    conclave: &Value,
    diff: &mut impl FnMut(String, String, String),
) {
    match (etcd, conclave) {
        (Value::Object(e), Value::Object(c)) => {
            let keys: std::collections::BTreeSet<&String> = e.keys().chain(c.keys()).collect();
            for key in keys {
                let path = format!("{path}.{key}");
                match (e.get(key), c.get(key)) {
                    (Some(e), Some(c)) => compare_json(&path, e, c, diff),
                    (e, c) => diff(path, show(e), show(c)),
                }
            }
        }
        (Value::Array(e), Value::Array(c)) => {
            for i in 0..e.len().max(c.len()) {
                let path = format!("{path}[{i}]");
                match (e.get(i), c.get(i)) {
                    (Some(e), Some(c)) => compare_json(&path, e, c, diff),
                    (e, c) => diff(path, show(e), show(c)),
                }
            }
        }
        (e, c) if e != c => diff(path.to_string(), e.to_string(), c.to_string()),
        _ => {}
    }
}

fn show(value: Option<&Value>) -> String {
    value.map_or_else(|| "<absent>".to_string(), Value::to_string)
}

/// Splits differences into those the allow-list accepts and those it does not; also returns
/// the allow-list entries that matched nothing.
fn judge(differences: Vec<Difference>) -> (Vec<Difference>, Vec<Difference>, Vec<&'static str>) {
    let mut used = vec![false; ALLOWED.len()];
    let (mut accepted, mut refused) = (Vec::new(), Vec::new());
    for difference in differences {
        match ALLOWED
            .iter()
            .position(|a| a.step == difference.step && a.path == difference.path)
        {
            Some(at) => {
                used[at] = true;
                accepted.push(difference);
            }
            None => refused.push(difference),
        }
    }
    let unused = ALLOWED
        .iter()
        .zip(used)
        .filter(|(_, used)| !used)
        .map(|(a, _)| a.id)
        .collect();
    (accepted, refused, unused)
}

fn report(differences: &[Difference]) -> String {
    differences
        .iter()
        .map(|d| {
            format!(
                "  [{}] {}:\n    etcd:     {}\n    conclave: {}",
                d.step, d.path, d.etcd, d.conclave
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

// ---------------------------------------------------------------------------------------------
// The tests
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn etcdctl_sees_the_same_outputs_from_conclave_as_from_etcd() {
    let started = Instant::now();
    assert!(Path::new(ETCD).exists(), "{ETCD} is missing: {INSTALL}");
    assert!(
        Path::new(ETCDCTL).exists(),
        "{ETCDCTL} is missing: {INSTALL}"
    );
    let (etcd, conclave) = tokio::join!(EtcdCluster::start(), common::Cluster::start(3));
    let startup = started.elapsed();

    let scratch = |name: &str| {
        let dir = std::env::temp_dir().join(format!(
            "conclave-etcd-compat-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create a scratch directory");
        dir
    };
    let etcd_side = Side {
        name: "etcd",
        clients: etcd.clients.clone(),
        peers: etcd.peers.clone(),
        scratch: scratch("etcd"),
    };
    let conclave_side = Side {
        name: "conclave",
        clients: conclave.nodes.iter().map(|n| n.client.clone()).collect(),
        peers: conclave.nodes.iter().map(|n| n.peer.clone()).collect(),
        scratch: scratch("conclave"),
    };

    // The two scripts run at the same time; each only touches its own cluster.
    let script_started = Instant::now();
    let (etcd_seen, conclave_seen) = std::thread::scope(|scope| {
        let etcd_run = scope.spawn(|| run_script(&etcd_side));
        let conclave_run = scope.spawn(|| run_script(&conclave_side));
        (
            etcd_run.join().expect("the etcd script"),
            conclave_run.join().expect("the conclave script"),
        )
    });
    let script = script_started.elapsed();

    let etcd_ids = Identities::learn(&etcd_side, &etcd_seen);
    let conclave_ids = Identities::learn(&conclave_side, &conclave_seen);
    assert_eq!(etcd_ids.members.len(), 3, "etcd lists its 3 members");
    assert_eq!(
        conclave_ids.members.len(),
        3,
        "Conclave lists its 3 members"
    );
    assert!(
        etcd_ids.leases.len() >= 3 && etcd_ids.leases.len() == conclave_ids.leases.len(),
        "both sides granted the same leases: etcd {:?}, conclave {:?}",
        etcd_ids.leases,
        conclave_ids.leases
    );
    let etcd_normal: Vec<Normalised> = etcd_seen.iter().map(|o| normalise(o, &etcd_ids)).collect();
    let conclave_normal: Vec<Normalised> = conclave_seen
        .iter()
        .map(|o| normalise(o, &conclave_ids))
        .collect();
    let (accepted, refused, unused) = judge(compare(&etcd_normal, &conclave_normal));

    println!(
        "etcd compat: {} steps on each side; clusters up in {startup:?}, scripts {script:?}, total {:?}",
        etcd_seen.len(),
        started.elapsed()
    );
    if !accepted.is_empty() {
        println!(
            "allowed differences (docs/etcd-compat.md):\n{}",
            report(&accepted)
        );
    }
    let _ = std::fs::remove_dir_all(&etcd_side.scratch);
    let _ = std::fs::remove_dir_all(&conclave_side.scratch);
    assert!(
        refused.is_empty(),
        "{} difference(s) between etcd and Conclave that docs/etcd-compat.md does not allow:\n{}",
        refused.len(),
        report(&refused)
    );
    assert!(
        unused.is_empty(),
        "allow-list entries that matched no difference (remove them here and in docs/etcd-compat.md): {unused:?}"
    );
    // Equal is not enough where both could be equally wrong: the reference must show the
    // behaviour the step exists for, and so must Conclave.
    for (side, seen) in [("etcd", &etcd_seen), ("conclave", &conclave_seen)] {
        let stdout = |step: &str| {
            seen.iter()
                .find(|o| o.step == step)
                .map(|o| o.stdout.clone())
                .unwrap_or_default()
        };
        assert!(
            stdout("lock, second holder").contains("second holds"),
            "{side}: the second lock holder ran only after the first exited"
        );
        let listened = stdout("elect -l");
        assert!(
            listened.contains("alice")
                && listened.contains("bob")
                && listened.find("alice") < listened.find("bob"),
            "{side}: the listener saw alice, then bob: {listened:?}"
        );
        assert!(
            stdout("endpoint status --cluster -w json").contains("\"leader\""),
            "{side}: endpoint status --cluster answered"
        );
    }
    // A sanity floor: the comparison saw real output, not two empty transcripts.
    let printed: usize = etcd_seen.iter().map(|o| o.stdout.len()).sum();
    assert!(
        printed > 2_000,
        "the etcd side printed only {printed} bytes"
    );
}

/// Every allow-list entry has its reason in docs/etcd-compat.md.
#[test]
fn every_allowed_difference_is_documented() {
    let doc_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/etcd-compat.md");
    let doc = std::fs::read_to_string(&doc_path).expect("docs/etcd-compat.md exists");
    for allowed in ALLOWED {
        assert!(
            doc.contains(&format!("`{}`", allowed.id)),
            "docs/etcd-compat.md does not explain the allowed difference `{}` ({})",
            allowed.id,
            allowed.reason
        );
        assert!(!allowed.reason.is_empty());
    }
}

/// Negative control: the comparer reports planted differences, and the normalisation hides only
/// what it should.
#[test]
fn the_comparer_reports_planted_differences() {
    let mut etcd_ids = Identities {
        members: vec![0x257a882f9b010441, 0xa7027c5861fe57ae, 0xfbee636cd012a3e0],
        member_names: vec!["etcd1".into(), "etcd2".into(), "etcd3".into()],
        ..Default::default()
    };
    etcd_ids
        .addresses
        .push(("127.0.0.1:17001".into(), "<client-address>"));
    etcd_ids.leases.push(0x694d77aa9e38260f);
    let mut conclave_ids = Identities {
        members: vec![1, 2, 3],
        member_names: vec!["node1".into(), "node2".into(), "node3".into()],
        ..Default::default()
    };
    conclave_ids
        .addresses
        .push(("127.0.0.1:20001".into(), "<client-address>"));
    conclave_ids.leases.push(1);

    let observation = |step: &str, kind: Kind, exit: i32, stdout: &str, stderr: &str| Observation {
        step: step.into(),
        kind,
        exit: Some(exit),
        stdout: stdout.into(),
        stderr: stderr.into(),
    };
    let etcd = [
        observation(
            "get",
            Kind::Plain,
            0,
            r#"{"header":{"cluster_id":1,"member_id":2700620664607409217,"revision":5,"raft_term":2},"kvs":[{"key":"YQ==","create_revision":2,"mod_revision":5,"version":2,"value":"MQ==","lease":7587852521871779343}],"count":1}"#,
            "",
        ),
        observation(
            "members",
            Kind::Members,
            0,
            "257a882f9b010441, started, etcd1, http://127.0.0.1:17002, http://127.0.0.1:17001, false\n",
            "",
        ),
        observation(
            "lease",
            Kind::Plain,
            0,
            "lease 694d77aa9e38260f granted with TTL(60s)\n",
            "",
        ),
        observation(
            "error",
            Kind::Plain,
            1,
            "",
            "Error: etcdserver: requested lease not found\n",
        ),
    ];
    let same_in_conclave = [
        observation(
            "get",
            Kind::Plain,
            0,
            r#"{"header":{"cluster_id":99,"member_id":3,"revision":5,"raft_term":7},"kvs":[{"key":"YQ==","create_revision":2,"mod_revision":5,"version":2,"value":"MQ==","lease":1}],"count":1}"#,
            "",
        ),
        observation(
            "members",
            Kind::Members,
            0,
            "3, started, node3, http://127.0.0.1:17002, http://127.0.0.1:20001, false\n",
            "",
        ),
        observation(
            "lease",
            Kind::Plain,
            0,
            "lease 0000000000000001 granted with TTL(60s)\n",
            "",
        ),
        observation(
            "error",
            Kind::Plain,
            1,
            "",
            "Error: etcdserver: requested lease not found\n",
        ),
    ];
    let normal = |observations: &[Observation], ids: &Identities| -> Vec<Normalised> {
        observations.iter().map(|o| normalise(o, ids)).collect()
    };
    // The peer address 17002 is not among either side's known addresses here, and it is the
    // same text on both sides, so it must not show up.
    let etcd_normal = normal(&etcd, &etcd_ids);
    let differences = compare(&etcd_normal, &normal(&same_in_conclave, &conclave_ids));
    assert_eq!(
        differences,
        vec![],
        "IDs, terms and addresses are normalised away"
    );

    // Plant one difference of each kind.
    let mut planted = same_in_conclave.clone();
    planted[0].stdout = planted[0]
        .stdout
        .replace("\"revision\":5", "\"revision\":6");
    planted[0].stdout = planted[0].stdout.replace("\"version\":2", "\"version\":3");
    planted[1].stdout = planted[1].stdout.replace("false", "true");
    planted[2].stdout.push_str("an extra line\n");
    planted[3].exit = Some(2);
    planted[3].stderr = "Error: etcdserver: lease not found\n".into();
    let differences = compare(&etcd_normal, &normal(&planted, &conclave_ids));
    let paths: Vec<(&str, &str)> = differences
        .iter()
        .map(|d| (d.step.as_str(), d.path.as_str()))
        .collect();
    assert_eq!(
        paths,
        vec![
            ("get", "stdout[0].header.revision"),
            ("get", "stdout[0].kvs[0].version"),
            ("members", "stdout line 1"),
            ("lease", "stdout line 2"),
            ("error", "exit"),
            ("error", "stderr line 1"),
        ],
        "{differences:#?}"
    );
    // A planted difference is refused unless the allow-list names it exactly.
    let (accepted, refused, unused) = judge(differences);
    assert!(accepted.is_empty());
    assert_eq!(refused.len(), 6);
    assert_eq!(
        unused.len(),
        ALLOWED.len(),
        "none of these matches an allowed difference"
    );
    // And a lease or member ID that is not the other side's counterpart is still a difference.
    let mut wrong_lease = same_in_conclave.clone();
    wrong_lease[0].stdout = wrong_lease[0].stdout.replace("\"lease\":1", "\"lease\":5");
    let differences = compare(&etcd_normal, &normal(&wrong_lease, &conclave_ids));
    assert_eq!(differences.len(), 1, "{differences:#?}");
    assert_eq!(differences[0].path, "stdout[0].kvs[0].lease");
}
