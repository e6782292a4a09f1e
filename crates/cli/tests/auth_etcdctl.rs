//! Authentication and permissions through etcdctl 3.4, against a 3-member Conclave cluster
//! and a real 3-member etcd 3.4 set up the same way in the same test: every refusal must be
//! the same exit status and the same `Error: ...` line etcdctl prints for etcd. Then the auth
//! state must survive a restart and reach a member that catches up by snapshot.
//!
//! Fails, rather than skips, when etcd or etcdctl is missing: `.ci/run` installs them.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{Cluster, EtcdctlLines, WRITES_PAST_HELD_APPENDS};
use conclave_proto::etcdserverpb::auth_client::AuthClient;
use conclave_proto::etcdserverpb::kv_client::KvClient;
use conclave_proto::etcdserverpb::{AuthenticateRequest, PutRequest};
use tonic::transport::Channel;

const ETCD: &str = "/usr/bin/etcd";
const ETCDCTL: &str = "/usr/bin/etcdctl";
/// A background etcdctl (elect, lock, watch) must print what it must within this long.
const WAIT_TIMEOUT: Duration = Duration::from_secs(20);
/// Longest one etcdctl may run, in seconds (a watch that is not canceled ends here).
const ETCDCTL_TIMEOUT_S: &str = "15";
const ETCD_STARTUP_TIMEOUT: Duration = Duration::from_secs(30);
/// etcd's ports come from here (Conclave's harness uses 20000-31999; etcd_compat 17000-18999).
const ETCD_PORT_FIRST: u16 = 19_000;

struct Etcd {
    root: PathBuf,
    clients: Vec<String>,
    children: Vec<Child>,
}

impl Etcd {
    fn start() -> Etcd {
        assert!(
            Path::new(ETCD).exists(),
            "{ETCD} is missing: apt-get install etcd-server"
        );
        let root = std::env::temp_dir().join(format!("conclave-auth-etcd-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).expect("create the etcd directory");
        let mut ports = (ETCD_PORT_FIRST + (std::process::id() % 400) as u16 * 2..)
            .filter(|port| std::net::TcpListener::bind(("127.0.0.1", *port)).is_ok());
        let mut next = || ports.next().expect("a free port");
        let clients: Vec<String> = (0..3).map(|_| format!("127.0.0.1:{}", next())).collect();
        let peers: Vec<String> = (0..3).map(|_| format!("127.0.0.1:{}", next())).collect();
        let initial = peers
            .iter()
            .enumerate()
            .map(|(i, peer)| format!("e{i}=http://{peer}"))
            .collect::<Vec<_>>()
            .join(",");
        let children = (0..3)
            .map(|i| {
                let log = std::fs::File::create(root.join(format!("e{i}.log"))).expect("log");
                Command::new(ETCD)
                    .arg(format!("--name=e{i}"))
                    .arg(format!(
                        "--data-dir={}",
                        root.join(format!("e{i}")).display()
                    ))
                    .arg(format!("--listen-client-urls=http://{}", clients[i]))
                    .arg(format!("--advertise-client-urls=http://{}", clients[i]))
                    .arg(format!("--listen-peer-urls=http://{}", peers[i]))
                    .arg(format!("--initial-advertise-peer-urls=http://{}", peers[i]))
                    .arg(format!("--initial-cluster={initial}"))
                    .arg("--initial-cluster-token=conclave-auth-test")
                    .arg("--bcrypt-cost=4")
                    .env_clear()
                    .stdin(Stdio::null())
                    .stdout(Stdio::from(log.try_clone().expect("clone")))
                    .stderr(Stdio::from(log))
                    .spawn()
                    .expect("start etcd")
            })
            .collect();
        let etcd = Etcd {
            root,
            clients,
            children,
        };
        let start = Instant::now();
        loop {
            let health = etcdctl(&etcd.endpoints(), &["endpoint", "health", "--cluster"]);
            if health.status.success() {
                break;
            }
            assert!(
                start.elapsed() < ETCD_STARTUP_TIMEOUT,
                "etcd did not start; logs in {}",
                etcd.root.display()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        etcd
    }

    fn endpoints(&self) -> String {
        self.clients.join(",")
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

fn etcdctl_command(endpoints: &str, args: &[&str]) -> Command {
    assert!(
        Path::new(ETCDCTL).exists(),
        "{ETCDCTL} is missing: apt-get install etcd-client"
    );
    // `timeout` bounds every etcdctl, watches included, so a wrong answer fails rather than
    // hangs the test.
    let mut command = Command::new("timeout");
    command
        .arg(ETCDCTL_TIMEOUT_S)
        .arg(ETCDCTL)
        .env_clear()
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={endpoints}"))
        .arg("--command-timeout=10s")
        .args(args)
        .stdin(Stdio::null());
    command
}

fn etcdctl(endpoints: &str, args: &[&str]) -> Output {
    etcdctl_command(endpoints, args)
        .output()
        .expect("run etcdctl")
}

/// What a user sees: the exit status, stdout, and the `Error:` line (etcdctl's client-side
/// retry log lines on stderr carry timestamps and are left out).
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    success: bool,
    stdout: String,
    error: String,
}

fn seen(output: &Output) -> Seen {
    let stderr = String::from_utf8_lossy(&output.stderr);
    Seen {
        success: output.status.success(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        error: stderr
            .lines()
            .filter(|line| line.starts_with("Error:"))
            .collect::<Vec<_>>()
            .join("\n"),
    }
}

/// The same etcdctl arguments on both systems; both must see the same thing. Returns it.
fn same(etcd: &str, conclave: &str, args: &[&str]) -> Seen {
    let on_etcd = seen(&etcdctl(etcd, args));
    let on_conclave = seen(&etcdctl(conclave, args));
    assert_eq!(
        on_conclave, on_etcd,
        "etcdctl {args:?}: Conclave differs from etcd"
    );
    on_conclave
}

/// Users root (root role), alice (read on a/), carol (readwrite on crew/); auth on.
const SETUP: &[&[&str]] = &[
    &["user", "add", "root:rootpw"],
    &["user", "grant-role", "root", "root"],
    &["role", "add", "reader"],
    &[
        "role",
        "grant-permission",
        "reader",
        "read",
        "a/",
        "--prefix=true",
    ],
    &["user", "add", "alice:alicepw"],
    &["user", "grant-role", "alice", "reader"],
    &["role", "add", "crew"],
    &[
        "role",
        "grant-permission",
        "crew",
        "readwrite",
        "crew/",
        "--prefix=true",
    ],
    &["user", "add", "carol:carolpw"],
    &["user", "grant-role", "carol", "crew"],
    &["auth", "enable"],
];

fn leased_key_prefix(line: &str) -> &str {
    line.rsplit_once('/').map_or(line, |(prefix, _)| prefix)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcdctl_sees_the_same_auth_as_on_etcd() {
    let etcd = Etcd::start();
    let mut cluster = Cluster::start_with_args(3, &["--bcrypt-cost", "4"]).await;
    let (e, c) = (etcd.endpoints(), cluster.endpoints());

    // Before auth: --user is accepted and ignored by both (Authenticate says "not enabled").
    same(&e, &c, &["--user=nobody:x", "put", "pre", "1"]);
    for step in SETUP {
        same(&e, &c, step);
    }
    let root = "--user=root:rootpw";
    let alice = "--user=alice:alicepw";
    let carol = "--user=carol:carolpw";

    // A reader reads its prefix, and nothing else; it writes nothing.
    same(&e, &c, &[root, "put", "a/x", "1"]);
    same(&e, &c, &[root, "put", "b/x", "2"]);
    let read = same(&e, &c, &[alice, "get", "a/x"]);
    assert_eq!(read.stdout, "a/x\n1\n");
    let refused = same(&e, &c, &[alice, "put", "a/x", "3"]);
    assert!(!refused.success);
    assert_eq!(refused.error, "Error: etcdserver: permission denied");
    let refused = same(&e, &c, &[alice, "get", "b/x"]);
    assert_eq!(refused.error, "Error: etcdserver: permission denied");
    same(&e, &c, &[alice, "get", "a/", "--prefix"]);
    let refused = same(&e, &c, &[alice, "get", "a", "--prefix"]);
    assert_eq!(refused.error, "Error: etcdserver: permission denied");
    let refused = same(&e, &c, &[alice, "del", "a/x"]);
    assert_eq!(refused.error, "Error: etcdserver: permission denied");
    // Credentials: none, a wrong password, an unknown user.
    let refused = same(&e, &c, &["get", "a/x"]);
    assert_eq!(refused.error, "Error: etcdserver: user name is empty");
    let refused = same(&e, &c, &["--user=alice:wrong", "get", "a/x"]);
    assert_eq!(
        refused.error,
        "Error: etcdserver: authentication failed, invalid user ID or password"
    );
    same(&e, &c, &["--user=mallory:x", "get", "a/x"]);
    // Auth management is root's; its errors are etcd's.
    let refused = same(&e, &c, &[alice, "user", "add", "eve:evepw"]);
    assert_eq!(refused.error, "Error: etcdserver: permission denied");
    same(&e, &c, &[root, "user", "get", "alice"]);
    same(&e, &c, &[root, "role", "get", "reader"]);
    same(&e, &c, &[root, "user", "list"]);
    same(&e, &c, &[root, "role", "list"]);
    let refused = same(&e, &c, &[root, "user", "delete", "root"]);
    assert_eq!(refused.error, "Error: etcdserver: invalid auth management");
    let refused = same(&e, &c, &[root, "user", "get", "nobody"]);
    assert_eq!(refused.error, "Error: etcdserver: user name not found");
    same(&e, &c, &[root, "user", "add", "alice:again"]);
    same(&e, &c, &[root, "role", "revoke-permission", "reader", "z/"]);
    same(&e, &c, &[root, "user", "revoke-role", "alice", "crew"]);
    same(&e, &c, &[root, "role", "add", "reader"]);
    // A deliberate difference: etcd 3.4 lets any user compact away everyone's history;
    // Conclave keeps compaction for the root role (docs/security.md).
    let compact = seen(&etcdctl(&c, &[alice, "compact", "1"]));
    assert_eq!(compact.error, "Error: etcdserver: permission denied");
    // Membership reads work for any user; the answer's members differ, the outcome not.
    for endpoints in [&e, &c] {
        let members = etcdctl(endpoints, &[alice, "member", "list"]);
        assert!(members.status.success(), "{members:?}");
    }

    // Elections and locks are writes under their name: carol campaigns in crew/ only.
    for endpoints in [&e, &c] {
        let elect = EtcdctlLines::start(endpoints, &[], &[carol, "elect", "crew/e", "me"]);
        let key = elect.wait_for("crew/e/", WAIT_TIMEOUT);
        assert_eq!(leased_key_prefix(&key), "crew/e");
        elect.wait_for("me", WAIT_TIMEOUT);
        let lock = EtcdctlLines::start(endpoints, &[], &[carol, "lock", "crew/l"]);
        lock.wait_for("crew/l/", WAIT_TIMEOUT);
        let put = etcdctl(endpoints, &[root, "put", "a/w", "seen"]);
        assert!(put.status.success());
        // From revision 1, so the put is seen however late the watch is created.
        let watch = EtcdctlLines::start(
            endpoints,
            &[],
            &[root, "watch", "a/", "--prefix", "--rev=1"],
        );
        watch.wait_for("a/w", WAIT_TIMEOUT);
    }
    let refused = same(&e, &c, &[carol, "elect", "ops", "me"]);
    assert!(!refused.success);
    assert!(refused.error.contains("permission denied"), "{refused:?}");
    let refused = same(&e, &c, &[carol, "lock", "ops"]);
    assert!(refused.error.contains("permission denied"), "{refused:?}");
    // A watch on a range the user cannot read is canceled with etcd's reason.
    same(&e, &c, &[alice, "watch", "b/", "--prefix"]);

    // The auth state survives a restart of every member.
    drop(etcd);
    for id in 1..=3 {
        cluster.terminate(id);
    }
    for id in 1..=3 {
        cluster.spawn(id);
    }
    let c = cluster.endpoints();
    let deadline = Instant::now() + WAIT_TIMEOUT;
    while !etcdctl(&c, &[alice, "get", "a/x"]).status.success() {
        assert!(
            Instant::now() < deadline,
            "the restarted cluster never served alice"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let refused = seen(&etcdctl(&c, &[alice, "put", "a/x", "4"]));
    assert_eq!(refused.error, "Error: etcdserver: permission denied");

    // A member that catches up by snapshot enforces the same permissions: a follower misses
    // a permission change and enough entries that the leader's log is compacted past all it
    // still holds for the follower (see `WRITES_PAST_HELD_APPENDS`), so only a snapshot can
    // bring it back.
    let leader = cluster.wait_for_leader(WAIT_TIMEOUT).await;
    let follower = (1..=3).find(|&id| id != leader).expect("a follower");
    cluster.kill(follower);
    let up = cluster.endpoint(leader);
    let granted = etcdctl(
        &cluster.node_client(leader),
        &[
            root,
            "role",
            "grant-permission",
            "reader",
            "read",
            "b/",
            "--prefix=true",
        ],
    );
    assert!(granted.status.success(), "{granted:?}");
    let channel = Channel::from_shared(up).expect("endpoint").connect_lazy();
    let token = AuthClient::new(channel.clone())
        .authenticate(AuthenticateRequest {
            name: "root".into(),
            password: "rootpw".into(),
        })
        .await
        .expect("root authenticates")
        .into_inner()
        .token;
    let mut kv = KvClient::new(channel);
    for i in 0..WRITES_PAST_HELD_APPENDS {
        let mut put = tonic::Request::new(PutRequest {
            key: format!("fill/{i:04}").into_bytes().into(),
            value: b"x".to_vec().into(),
            ..PutRequest::default()
        });
        put.metadata_mut()
            .insert("token", token.parse().expect("ascii token"));
        kv.put(put).await.expect("root writes with a quorum up");
    }
    cluster.spawn(follower);
    let three = cluster.node_client(follower);
    let deadline = Instant::now() + WAIT_TIMEOUT;
    loop {
        // Serializable: answered from member 3's own state and auth state.
        let got = etcdctl(&three, &[alice, "get", "b/x", "--consistency=s"]);
        if got.status.success() && String::from_utf8_lossy(&got.stdout) == "b/x\n2\n" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "member {follower} never learned the new permission"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let log = std::fs::read_to_string(cluster.root.join(format!("node{follower}.log")))
        .unwrap_or_default();
    assert!(
        log.contains("snapshot from the leader installed"),
        "member {follower} caught up without a snapshot; the test must make it need one"
    );
    let refused = seen(&etcdctl(&three, &[alice, "put", "b/x", "5"]));
    assert_eq!(refused.error, "Error: etcdserver: permission denied");
    let refused = seen(&etcdctl(&three, &[alice, "get", "c/x", "--consistency=s"]));
    assert_eq!(refused.error, "Error: etcdserver: permission denied");
}
