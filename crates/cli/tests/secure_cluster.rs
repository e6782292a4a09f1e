//! Every protection on at once, with real processes: a 3-member cluster with client TLS
//! (client certificates required, `--client-cert-auth`), peer mutual TLS and authentication
//! enabled. etcdctl 3.4 with `--cacert --cert --key --user`, the `conclave` CLI and
//! `conclave-client` each put, get, watch, lock, campaign and list members; every refusal
//! etcdctl prints is compared with what it prints for a real etcd 3.4 given the same TLS and
//! auth setup in the same test, common-name authentication included. The CLI's refusals carry
//! their distinct codes, and the client renews a token the server let expire.
//!
//! (A peer certified by another CA is refused on this same TLS setup in `tls.rs`.)
//!
//! Fails, rather than skips, when etcd or etcdctl is missing: `.ci/run` installs them.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{Cluster, EtcdctlLines, TestTls};
use conclave_client::{
    CampaignOptions, Client, ClientOptions, Credentials, Error, GetOptions, PutOptions, TlsOptions,
    WatchOptions,
};
use serde_json::Value;

const ETCD: &str = "/usr/bin/etcd";
const ETCDCTL: &str = "/usr/bin/etcdctl";
/// Anything a background process must print, it prints within this long.
const WAIT: Duration = Duration::from_secs(20);
/// Longest one etcdctl may run, in seconds.
const ETCDCTL_TIMEOUT_S: &str = "15";
const ETCD_STARTUP_TIMEOUT: Duration = Duration::from_secs(30);
/// etcd's ports come from here (Conclave's harness uses 20000-31999, etcd_compat 17000-18999,
/// auth_etcdctl 19000-19799).
const ETCD_PORT_FIRST: u16 = 19_800;
/// Tokens Conclave hands out live this long here, so the test sees one expire.
const TOKEN_TTL_S: u64 = 3;

/// One etcd 3.4 member with the same client TLS as the Conclave cluster.
struct Etcd {
    root: PathBuf,
    client: String,
    child: Child,
}

impl Etcd {
    fn start(tls: &TestTls) -> Etcd {
        assert!(
            Path::new(ETCD).exists(),
            "{ETCD} is missing: apt-get install etcd-server"
        );
        let root =
            std::env::temp_dir().join(format!("conclave-secure-etcd-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).expect("create the etcd directory");
        let mut ports = (ETCD_PORT_FIRST + (std::process::id() % 90) as u16 * 2..)
            .filter(|port| std::net::TcpListener::bind(("127.0.0.1", *port)).is_ok());
        let client = format!("127.0.0.1:{}", ports.next().expect("a free port"));
        let peer = format!("127.0.0.1:{}", ports.next().expect("a free port"));
        let file = |name: &str| tls.dir.join(name).display().to_string();
        let log = std::fs::File::create(root.join("etcd.log")).expect("log");
        let child = Command::new(ETCD)
            .arg("--name=e0")
            .arg(format!("--data-dir={}", root.join("e0").display()))
            .arg(format!("--listen-client-urls=https://{client}"))
            .arg(format!("--advertise-client-urls=https://{client}"))
            .arg(format!("--listen-peer-urls=http://{peer}"))
            .arg(format!("--initial-advertise-peer-urls=http://{peer}"))
            .arg(format!("--initial-cluster=e0=http://{peer}"))
            .arg(format!("--cert-file={}", file("server-server.pem")))
            .arg(format!("--key-file={}", file("server-server-key.pem")))
            .arg(format!("--trusted-ca-file={}", tls.ca.display()))
            .arg("--client-cert-auth")
            .arg("--bcrypt-cost=4")
            .env_clear()
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone().expect("clone")))
            .stderr(Stdio::from(log))
            .spawn()
            .expect("start etcd");
        let etcd = Etcd {
            root,
            client: format!("https://{client}"),
            child,
        };
        let start = Instant::now();
        while !etcdctl(tls, &etcd.client, &["endpoint", "health"])
            .status
            .success()
        {
            assert!(
                start.elapsed() < ETCD_STARTUP_TIMEOUT,
                "etcd did not start; log in {}",
                etcd.root.display()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        etcd
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// The client flags with another client certificate of the test CA (`NAME-client.pem`).
fn client_args_as(tls: &TestTls, cert_name: &str) -> Vec<String> {
    vec![
        "--cacert".into(),
        tls.ca.display().to_string(),
        "--cert".into(),
        tls.dir
            .join(format!("{cert_name}-client.pem"))
            .display()
            .to_string(),
        "--key".into(),
        tls.dir
            .join(format!("{cert_name}-client-key.pem"))
            .display()
            .to_string(),
    ]
}

fn etcdctl_as(cert_flags: &[String], endpoints: &str, args: &[&str]) -> Output {
    assert!(
        Path::new(ETCDCTL).exists(),
        "{ETCDCTL} is missing: apt-get install etcd-client"
    );
    Command::new("timeout")
        .arg(ETCDCTL_TIMEOUT_S)
        .arg(ETCDCTL)
        .env_clear()
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={endpoints}"))
        .arg("--command-timeout=10s")
        .args(cert_flags)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run etcdctl")
}

fn etcdctl(tls: &TestTls, endpoints: &str, args: &[&str]) -> Output {
    etcdctl_as(&tls.client_args(), endpoints, args)
}

/// What a user sees: the exit status, stdout and the `Error:` line.
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

/// The same etcdctl command (same certificate) against etcd and Conclave: the same outcome.
fn same_as(cert_flags: &[String], etcd: &str, conclave: &str, args: &[&str]) -> Seen {
    let on_etcd = seen(&etcdctl_as(cert_flags, etcd, args));
    let on_conclave = seen(&etcdctl_as(cert_flags, conclave, args));
    assert_eq!(
        on_conclave, on_etcd,
        "etcdctl {args:?}: Conclave differs from etcd"
    );
    on_conclave
}

/// An etcdctl left running with the TLS client flags.
fn background(tls: &TestTls, endpoints: &str, args: &[&str]) -> EtcdctlLines {
    EtcdctlLines::start(endpoints, &tls.client_args(), args)
}

/// `conclave --json ARGS` with `flags` and `env`; (exit code, the first JSON document).
fn conclave(
    endpoints: &str,
    flags: &[String],
    env: &[(&str, &str)],
    args: &[&str],
) -> (i32, Value) {
    let output = Command::new(env!("CARGO_BIN_EXE_conclave"))
        .args(["--endpoints", endpoints, "--json", "--timeout", "10s"])
        .args(flags)
        .args(args)
        .env_remove("CONCLAVE_USER")
        .env_remove("CONCLAVE_PASSWORD")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .expect("run conclave");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let document =
        serde_json::from_str(stdout.lines().next().unwrap_or("null")).unwrap_or_else(|e| {
            panic!(
                "conclave {args:?} printed no JSON ({e}): {stdout}{}",
                String::from_utf8_lossy(&output.stderr)
            )
        });
    (output.status.code().unwrap_or(-1), document)
}

/// Asserts a CLI refusal: the exit code, the stable code, and one sentence containing `says`.
fn assert_cli_refusal(answer: (i32, Value), exit: i32, code: &str, says: &str) {
    let (status, document) = answer;
    assert_eq!(document["code"], code, "{document}");
    assert_eq!(status, exit, "{document}");
    let message = document["message"].as_str().unwrap_or_default();
    assert!(message.contains(says), "{says:?} not in {message:?}");
    assert_eq!(message.lines().count(), 1, "one sentence: {message:?}");
}

fn https_endpoints(cluster: &Cluster) -> String {
    cluster
        .nodes
        .iter()
        .map(|n| format!("https://{}", n.client))
        .collect::<Vec<_>>()
        .join(",")
}

fn library_tls(tls: &TestTls) -> TlsOptions {
    TlsOptions::from_files(Some(&tls.ca), Some(&tls.client_cert), Some(&tls.client_key))
        .expect("read the certificates")
}

async fn library_client(endpoints: &str, tls: &TestTls, credentials: Credentials) -> Client {
    let options = ClientOptions {
        tls: Some(library_tls(tls)),
        credentials: Some(credentials),
        ..ClientOptions::default()
    };
    Client::connect_with(endpoints.split(','), options)
        .await
        .expect("connect over TLS")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_with_tls_mtls_and_auth_serves_etcdctl_the_cli_and_the_client_as_etcd_would() {
    let ttl = TOKEN_TTL_S.to_string();
    let cluster =
        Cluster::start_tls_with_args(3, &["--bcrypt-cost", "4", "--auth-token-ttl", &ttl]).await;
    let tls = cluster.tls.clone().expect("a TLS cluster");
    let d = tls.dir.to_str().expect("UTF-8 path");
    // Client certificates whose common names are users (alice, carol) and an expired one.
    for name in ["alice", "carol"] {
        TestTls::certs(&["issue", "--ca", d, "--name", name, "--kind", "client"]);
    }
    TestTls::certs(&[
        "issue",
        "--ca",
        d,
        "--name",
        "expired",
        "--kind",
        "client",
        "--not-after",
        "2001-01-01",
    ]);
    let etcd = Etcd::start(&tls);
    let e = etcd.client.clone();
    let c = https_endpoints(&cluster);
    let flags = tls.client_args();

    // The same users and roles on both: etcd's with etcdctl, Conclave's with the CLI.
    let setup: &[&[&str]] = &[
        &["user", "add", "root:rootpw"],
        &["user", "grant-role", "root", "root"],
        &["role", "add", "reader"],
        &[
            "role",
            "grant-permission",
            "reader",
            "read",
            "a/",
            "--prefix",
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
            "--prefix",
        ],
        &["user", "add", "carol:carolpw"],
        &["user", "grant-role", "carol", "crew"],
    ];
    for step in setup {
        let mut on_etcd: Vec<&str> = step.to_vec();
        if on_etcd.last() == Some(&"--prefix") {
            on_etcd.pop();
            on_etcd.push("--prefix=true");
        }
        let done = etcdctl(&tls, &e, &on_etcd);
        assert!(done.status.success(), "etcdctl {on_etcd:?}: {done:?}");
        let (code, answer) = conclave(&c, &flags, &[], step);
        assert_eq!(code, 0, "conclave {step:?}: {answer}");
    }
    let (code, role) = conclave(&c, &flags, &[], &["role", "get", "crew"]);
    assert_eq!(code, 0, "{role}");
    assert_eq!(
        role["data"]["permissions"][0]["kind"], "readwrite",
        "{role}"
    );
    assert_eq!(role["data"]["permissions"][0]["key"], "crew/", "{role}");
    assert_eq!(
        role["data"]["permissions"][0]["range_end"], "crew0",
        "{role}"
    );
    assert!(etcdctl(&tls, &e, &["auth", "enable"]).status.success());
    let (code, enabled) = conclave(&c, &flags, &[], &["auth", "enable"]);
    assert_eq!(code, 0, "{enabled}");
    let root_env: &[(&str, &str)] = &[("CONCLAVE_USER", "root"), ("CONCLAVE_PASSWORD", "rootpw")];
    let (code, status) = conclave(&c, &flags, root_env, &["auth", "status"]);
    assert_eq!(code, 0, "{status}");
    assert_eq!(status["data"]["enabled"], true, "{status}");
    // Root's view of the users through the CLI.
    let (code, users) = conclave(&c, &flags, root_env, &["user", "list"]);
    assert_eq!(code, 0, "{users}");
    assert_eq!(
        users["data"]["users"],
        serde_json::json!(["alice", "carol", "root"])
    );
    let (code, alice) = conclave(&c, &flags, root_env, &["user", "get", "alice"]);
    assert_eq!(code, 0, "{alice}");
    assert_eq!(alice["data"]["roles"], serde_json::json!(["reader"]));

    // etcdctl 3.4 with --cacert --cert --key --user, on both.
    let root = "--user=root:rootpw";
    let alice = "--user=alice:alicepw";
    let carol = "--user=carol:carolpw";
    let same = |args: &[&str]| same_as(&flags, &e, &c, args);
    assert_eq!(same(&[root, "put", "a/x", "1"]).stdout, "OK\n");
    same(&[root, "put", "b/x", "2"]);
    assert_eq!(same(&[alice, "get", "a/x"]).stdout, "a/x\n1\n");
    let refused = same(&[alice, "put", "a/x", "3"]);
    assert!(!refused.success);
    assert_eq!(refused.error, "Error: etcdserver: permission denied");
    let refused = same(&[alice, "get", "b/x"]);
    assert_eq!(refused.error, "Error: etcdserver: permission denied");
    let refused = same(&["--user=alice:wrong", "get", "a/x"]);
    assert_eq!(
        refused.error,
        "Error: etcdserver: authentication failed, invalid user ID or password"
    );
    // No --user: the certificate's common name (`client`) is the user, and it has no roles.
    let refused = same(&["get", "a/x"]);
    assert!(!refused.success, "{refused:?}");
    for endpoints in [&e, &c] {
        let members = etcdctl(&tls, endpoints, &[alice, "member", "list"]);
        assert!(members.status.success(), "{members:?}");
        let elect = background(&tls, endpoints, &[carol, "elect", "crew/e", "me"]);
        assert!(elect.wait_for("crew/e/", WAIT).starts_with("crew/e/"));
        elect.wait_for("me", WAIT);
        let lock = background(&tls, endpoints, &[carol, "lock", "crew/l"]);
        lock.wait_for("crew/l/", WAIT);
        let watch = background(
            &tls,
            endpoints,
            &[alice, "watch", "a/", "--prefix", "--rev=1"],
        );
        watch.wait_for("a/x", WAIT);
    }
    // A role limited to crew/ campaigns and locks there and nowhere else.
    let refused = same(&[carol, "elect", "ops", "me"]);
    assert!(!refused.success);
    assert!(refused.error.contains("permission denied"), "{refused:?}");
    let refused = same(&[carol, "lock", "ops"]);
    assert!(refused.error.contains("permission denied"), "{refused:?}");
    let members = etcdctl(&tls, &c, &[alice, "member", "list"]);
    let members = String::from_utf8_lossy(&members.stdout);
    for node in &cluster.nodes {
        assert!(
            members.contains(&format!("https://{}", node.client)),
            "{members}"
        );
    }

    // Common-name authentication: a certificate with CN alice acts as alice, no password.
    let leader = cluster.wait_for_leader(WAIT).await;
    let leader_endpoint = format!("https://{}", cluster.nodes[(leader - 1) as usize].client);
    let as_alice = client_args_as(&tls, "alice");
    let cn = |args: &[&str]| same_as(&as_alice, &e, &leader_endpoint, args);
    assert_eq!(cn(&["get", "a/x"]).stdout, "a/x\n1\n");
    assert_eq!(
        cn(&["put", "a/x", "9"]).error,
        "Error: etcdserver: permission denied"
    );
    assert_eq!(
        cn(&["get", "b/x"]).error,
        "Error: etcdserver: permission denied"
    );
    let as_carol = client_args_as(&tls, "carol");
    let written = same_as(
        &as_carol,
        &e,
        &leader_endpoint,
        &["put", "crew/cn", "by-cert"],
    );
    assert_eq!(written.stdout, "OK\n");
    // Through a follower too: the call is forwarded to the leader with carol's identity
    // (a token the follower signs for her), not the follower's own certificate.
    let follower = cluster
        .nodes
        .iter()
        .find(|node| node.id != leader)
        .expect("a 3-member cluster has followers");
    let follower_endpoint = format!("https://{}", follower.client);
    for attempt in ["by-cert-via-follower", "again"] {
        let written = same_as(
            &as_carol,
            &e,
            &follower_endpoint,
            &["put", "crew/cn", attempt],
        );
        assert_eq!(written.stdout, "OK\n", "{written:?}");
    }
    let refused = same_as(&as_alice, &e, &follower_endpoint, &["put", "a/x", "9"]);
    assert_eq!(refused.error, "Error: etcdserver: permission denied");
    // A token, when sent, wins over the certificate's name (both systems).
    let refused = same_as(
        &as_carol,
        &e,
        &leader_endpoint,
        &[alice, "put", "crew/cn", "x"],
    );
    assert_eq!(refused.error, "Error: etcdserver: permission denied");

    // The conclave CLI: --user NAME:PASSWORD, or CONCLAVE_USER and CONCLAVE_PASSWORD.
    let carol_env: &[(&str, &str)] =
        &[("CONCLAVE_USER", "carol"), ("CONCLAVE_PASSWORD", "carolpw")];
    let (code, put) = conclave(&c, &flags, carol_env, &["put", "crew/c", "3"]);
    assert_eq!(code, 0, "{put}");
    let (code, got) = conclave(&c, &flags, carol_env, &["get", "crew/c"]);
    assert_eq!(code, 0, "{got}");
    assert_eq!(got["data"]["kvs"][0]["value"], "3", "{got}");
    let (code, lock) = conclave(&c, &flags, carol_env, &["lock", "crew/cli", "--", "true"]);
    assert_eq!(code, 0, "{lock}");
    let (code, elected) = conclave(
        &c,
        &flags,
        carol_env,
        &["elect", "campaign", "crew/g", "--id", "c1", "--", "true"],
    );
    assert_eq!(code, 0, "{elected}");
    let (code, members) = conclave(&c, &flags, carol_env, &["member", "list"]);
    assert_eq!(code, 0, "{members}");
    let watch = Command::new("timeout")
        .args(["3", env!("CARGO_BIN_EXE_conclave")])
        .args(["--endpoints", &c, "--json", "--user", "alice:alicepw"])
        .args(&flags)
        .args(["watch", "a/", "--prefix", "--rev", "1"])
        .stdin(Stdio::null())
        .output()
        .expect("run conclave watch");
    let watched = String::from_utf8_lossy(&watch.stdout);
    assert!(
        watched.contains("\"a/x\""),
        "conclave watch saw {watched:?}"
    );
    // Its refusals: one sentence and a distinct code each.
    assert_cli_refusal(
        conclave(
            &c,
            &flags,
            carol_env,
            &["elect", "campaign", "ops", "--id", "c1", "--", "true"],
        ),
        14,
        "permission_denied",
        "permission denied",
    );
    let alice_flag = ["--user".to_string(), "alice:alicepw".to_string()];
    let alice_flags: Vec<String> = flags.iter().chain(alice_flag.iter()).cloned().collect();
    assert_cli_refusal(
        conclave(&c, &alice_flags, &[], &["put", "a/x", "4"]),
        14,
        "permission_denied",
        "permission denied",
    );
    assert_cli_refusal(
        conclave(&c, &flags, &[], &["--user", "alice:wrong", "get", "a/x"]),
        13,
        "unauthenticated",
        "wrong password",
    );
    assert_cli_refusal(
        conclave(&c, &flags, &[("CONCLAVE_USER", "alice")], &["get", "a/x"]),
        2,
        "invalid_argument",
        "CONCLAVE_PASSWORD",
    );
    assert_cli_refusal(
        conclave(
            &cluster.endpoints(),
            &[],
            &[],
            &["--user", "alice:alicepw", "get", "a/x"],
        ),
        15,
        "tls",
        "the server speaks TLS",
    );
    assert_cli_refusal(
        conclave(
            &c,
            &client_args_as(&tls, "expired"),
            &[],
            &["--user", "alice:alicepw", "get", "a/x"],
        ),
        15,
        "tls",
        "expired",
    );

    // conclave-client with a user and password.
    let carol = library_client(&c, &tls, Credentials::password("carol", "carolpw")).await;
    let mut watcher = carol
        .watch("crew/lib/", WatchOptions::prefix())
        .await
        .expect("carol watches crew/");
    carol
        .put("crew/lib/x", "y", PutOptions::default())
        .await
        .expect("carol writes crew/");
    let event = tokio::time::timeout(WAIT, watcher.next())
        .await
        .expect("a watch event in time")
        .expect("the watch is open")
        .expect("a watch event");
    assert_eq!(event.kv.key, b"crew/lib/x");
    let guard = carol
        .mutex()
        .lock("crew/lib-lock", Default::default())
        .await
        .expect("carol locks in crew/");
    assert!(guard.fence() > 0);
    let leadership = carol
        .election()
        .campaign("crew/lib-group", "c1", 0, "v", CampaignOptions::default())
        .await
        .expect("carol campaigns in crew/");
    assert!(leadership.fence() > 0);
    let refused = carol
        .election()
        .campaign("ops", "c1", 0, "v", CampaignOptions::default())
        .await
        .err()
        .expect("carol may not campaign in ops");
    assert!(matches!(refused, Error::PermissionDenied(_)), "{refused}");
    let refused = carol
        .get("a/x", GetOptions::default())
        .await
        .expect_err("carol may not read a/");
    assert!(matches!(refused, Error::PermissionDenied(_)), "{refused}");
    assert!(!carol.member_list().await.expect("members").is_empty());
    let options = ClientOptions {
        tls: Some(library_tls(&tls)),
        credentials: Some(Credentials::password("carol", "wrong")),
        ..ClientOptions::default()
    };
    let refused = match Client::connect_with(c.split(','), options).await {
        Ok(client) => client
            .get("crew/c", GetOptions::default())
            .await
            .expect_err("a wrong password reads nothing"),
        Err(error) => error,
    };
    assert!(matches!(refused, Error::Unauthenticated(_)), "{refused}");

    // Tokens expire (a fixed token is refused after the TTL), and a client with a password
    // authenticates again by itself.
    let alice = library_client(&c, &tls, Credentials::password("alice", "alicepw")).await;
    alice
        .get("a/x", GetOptions::default())
        .await
        .expect("alice reads a/");
    let token = {
        let endpoint = conclave_client::endpoint(&leader_endpoint, Some(&library_tls(&tls)))
            .expect("an endpoint");
        let channel = endpoint.connect().await.expect("connect");
        conclave_proto::etcdserverpb::auth_client::AuthClient::new(channel)
            .authenticate(conclave_proto::etcdserverpb::AuthenticateRequest {
                name: "alice".into(),
                password: "alicepw".into(),
            })
            .await
            .expect("alice authenticates")
            .into_inner()
            .token
    };
    let fixed = library_client(&c, &tls, Credentials::Token(token)).await;
    fixed
        .get("a/x", GetOptions::default())
        .await
        .expect("a fresh token works");
    tokio::time::sleep(Duration::from_secs(TOKEN_TTL_S + 1)).await;
    let expired = fixed
        .get("a/x", GetOptions::default())
        .await
        .expect_err("the token expired");
    assert!(matches!(expired, Error::Unauthenticated(_)), "{expired}");
    let renewed = alice
        .get("a/x", GetOptions::default())
        .await
        .expect("alice's client authenticates again");
    assert_eq!(renewed.kvs[0].value, b"1");
    drop(etcd);
    drop(cluster);
}
