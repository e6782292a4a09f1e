//! TLS on both ports with real processes: a 3-member cluster with client TLS (client
//! certificates required) and peer mutual TLS, used by etcdctl 3.4, the `conclave` CLI and
//! `conclave-client`; the refusals each client gets (code `tls`); a peer whose certificate
//! another CA signed, which never gets a Raft message accepted; and certificate reload on
//! SIGHUP. etcdctl is installed by `.ci/run` (`apt-get install -y etcd-client`).

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{Cluster, TestTls};
use conclave_client::{Client, ClientOptions, GetOptions, PutOptions, TlsOptions, WatchOptions};
use serde_json::Value;

const ETCDCTL: &str = "/usr/bin/etcdctl";
const WAIT: Duration = Duration::from_secs(20);

fn https_endpoints(cluster: &Cluster) -> String {
    cluster
        .nodes
        .iter()
        .map(|n| format!("https://{}", n.client))
        .collect::<Vec<_>>()
        .join(",")
}

fn etcdctl_command(tls: &TestTls, endpoints: &str) -> Command {
    assert!(
        Path::new(ETCDCTL).exists(),
        "{ETCDCTL} is missing: install it with `apt-get install -y etcd-client` (.ci/run does)"
    );
    let mut command = Command::new(ETCDCTL);
    command
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={endpoints}"))
        .arg("--command-timeout=5s")
        .args(tls.client_args());
    command
}

fn etcdctl(tls: &TestTls, endpoints: &str, args: &[&str]) -> String {
    let output = etcdctl_command(tls, endpoints)
        .args(args)
        .output()
        .expect("run etcdctl");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "etcdctl {args:?} failed: {stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// `conclave --json ARGS` with `client_args`; (exit code, the JSON document).
fn conclave(endpoints: &str, client_args: &[String], args: &[&str]) -> (i32, Value) {
    let output = Command::new(env!("CARGO_BIN_EXE_conclave"))
        .args(["--endpoints", endpoints, "--json", "--timeout", "5s"])
        .args(client_args)
        .args(args)
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

/// A refusal the server's certificate check makes (a client certificate it does not take)
/// and one the client makes alike get `tls`: the client asks the server for its alert when
/// the HTTP/2 connection only saw a reset (`tls::refusal_reason`), so never
/// `connection_failed`.
fn assert_tls_refusal(endpoints: &str, client_args: &[String], expected: &str) {
    let (code, document) = conclave(endpoints, client_args, &["get", "k"]);
    assert_eq!(document["code"], "tls", "{document}");
    assert_eq!(code, 15, "{document}");
    let message = document["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(expected),
        "expected {expected:?} in {message:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn etcdctl_conclave_and_the_client_library_work_over_client_and_peer_tls() {
    let cluster = Cluster::start_tls(3).await;
    let tls = cluster.tls.clone().expect("a TLS cluster");
    let all = https_endpoints(&cluster);
    let first = format!("https://{}", cluster.nodes[0].client);

    // etcdctl 3.4: put/get, watch, lock, elect, member list.
    assert_eq!(etcdctl(&tls, &all, &["put", "/tls/a", "1"]).trim(), "OK");
    assert_eq!(etcdctl(&tls, &first, &["get", "/tls/a"]), "/tls/a\n1\n");
    let watch = etcdctl_command(&tls, &first)
        .args(["watch", "--prefix", "/tls/", "--rev=1"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("start etcdctl watch");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(etcdctl(&tls, &all, &["put", "/tls/b", "2"]).trim(), "OK");
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let _ = Command::new("kill").arg(watch.id().to_string()).status();
    let watched = watch.wait_with_output().expect("etcdctl watch output");
    let watched = String::from_utf8_lossy(&watched.stdout);
    assert_eq!(
        watched, "PUT\n/tls/a\n1\nPUT\n/tls/b\n2\n",
        "etcdctl watch saw {watched:?}"
    );
    let locked = etcdctl(&tls, &all, &["lock", "tls-lock", "echo", "held"]);
    assert_eq!(locked.trim(), "held", "{locked}");
    let elect = etcdctl_command(&tls, &all)
        .args(["elect", "tls-group", "proposal-1"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("start etcdctl elect");
    let leader = {
        let start = Instant::now();
        loop {
            // `elect -l` observes until stopped: `timeout` ends it after its first answers.
            let out = Command::new("timeout")
                .args(["2", ETCDCTL])
                .env("ETCDCTL_API", "3")
                .arg(format!("--endpoints={all}"))
                .args(tls.client_args())
                .args(["elect", "-l", "tls-group"])
                .output()
                .expect("etcdctl elect -l");
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            if text.contains("proposal-1") {
                break text;
            }
            assert!(start.elapsed() < WAIT, "no elected leader: {text}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    assert!(leader.starts_with("tls-group/"), "{leader}");
    let _ = Command::new("kill").arg(elect.id().to_string()).status();
    let _ = elect.wait_with_output();
    let members = etcdctl(&tls, &first, &["member", "list"]);
    for node in &cluster.nodes {
        let line = format!(
            "{:x}, started, node{}, http://{}, https://{}, false",
            node.id, node.id, node.peer, node.client
        );
        assert!(members.contains(&line), "missing {line:?} in\n{members}");
    }

    // The conclave CLI, bare endpoints (TLS because --cacert is given) and https:// alike.
    let flags = tls.client_args();
    let bare = cluster.endpoints();
    let (code, put) = conclave(&bare, &flags, &["put", "/tls/c", "3"]);
    assert_eq!(code, 0, "{put}");
    let (code, got) = conclave(&all, &flags, &["get", "/tls/c"]);
    assert_eq!(code, 0, "{got}");
    assert_eq!(got["data"]["kvs"][0]["value"], "3", "{got}");
    let (code, lock) = conclave(&all, &flags, &["lock", "tls-cli-lock", "--", "true"]);
    assert_eq!(code, 0, "{lock}");
    let (code, members) = conclave(&all, &flags, &["member", "list"]);
    assert_eq!(code, 0, "{members}");
    assert!(
        members
            .to_string()
            .contains(&format!("https://{}", cluster.nodes[2].client)),
        "{members}"
    );

    // conclave-client: put, get and a watch.
    let options = ClientOptions {
        tls: Some(
            TlsOptions::from_files(Some(&tls.ca), Some(&tls.client_cert), Some(&tls.client_key))
                .expect("read the certificates"),
        ),
        ..ClientOptions::default()
    };
    let client = Client::connect_with(all.split(','), options)
        .await
        .expect("connect over TLS");
    let mut watcher = client
        .watch("/lib/", WatchOptions::prefix())
        .await
        .expect("watch over TLS");
    client
        .put("/lib/x", "y", PutOptions::default())
        .await
        .expect("put over TLS");
    let got = client
        .get("/lib/x", GetOptions::default())
        .await
        .expect("get over TLS");
    assert_eq!(got.kvs[0].value, b"y");
    let event = tokio::time::timeout(WAIT, watcher.next())
        .await
        .expect("a watch event in time")
        .expect("the watch is open")
        .expect("a watch event");
    assert_eq!(event.kv.key, b"/lib/x");
    let guard = client
        .mutex()
        .lock("tls-lib-lock", Default::default())
        .await
        .expect("lock over TLS");
    assert!(guard.fence() > 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn clients_that_do_not_fit_the_tls_setup_get_the_tls_code() {
    let cluster = Cluster::start_tls(1).await;
    let tls = cluster.tls.clone().expect("a TLS cluster");
    let bare = cluster.endpoints();
    let https = https_endpoints(&cluster);

    // Plaintext against a TLS server.
    assert_tls_refusal(&bare, &[], "the server speaks TLS");
    // A CA that did not sign the server's certificate.
    let other = cluster.root.join("other-ca");
    TestTls::certs(&["init", other.to_str().expect("UTF-8")]);
    TestTls::certs(&[
        "issue",
        "--ca",
        other.to_str().expect("UTF-8"),
        "--name",
        "intruder",
        "--kind",
        "client",
    ]);
    let other_ca = other.join("ca.pem").display().to_string();
    assert_tls_refusal(
        &https,
        &["--cacert".into(), other_ca],
        "not signed by the CA in --cacert",
    );
    // A client certificate from another CA.
    assert_tls_refusal(
        &https,
        &[
            "--cacert".into(),
            tls.ca.display().to_string(),
            "--cert".into(),
            other.join("intruder-client.pem").display().to_string(),
            "--key".into(),
            other.join("intruder-client-key.pem").display().to_string(),
        ],
        "refused this client's certificate",
    );
    // An expired client certificate from the right CA.
    let ca_dir = tls.dir.to_str().expect("UTF-8");
    TestTls::certs(&[
        "issue",
        "--ca",
        ca_dir,
        "--name",
        "expired",
        "--kind",
        "client",
        "--not-after",
        "2001-01-01",
    ]);
    assert_tls_refusal(
        &https,
        &[
            "--cacert".into(),
            tls.ca.display().to_string(),
            "--cert".into(),
            tls.dir.join("expired-client.pem").display().to_string(),
            "--key".into(),
            tls.dir.join("expired-client-key.pem").display().to_string(),
        ],
        "expired",
    );
    // The right certificates work against the same node (the refusals were about them).
    let (code, answer) = conclave(&https, &tls.client_args(), &["get", "k"]);
    assert_eq!(code, 0, "{answer}");
}

/// Starts member `id` (added by MemberAdd) on `peer` with peer TLS from `cert_dir`
/// (`node<id>-peer.pem`), trusting the cluster's CA; its client port is plaintext.
fn start_joining_member(
    cluster: &Cluster,
    id: u64,
    peer: &str,
    client: &str,
    cert_dir: &Path,
) -> std::process::Child {
    let tls = cluster.tls.as_ref().expect("a TLS cluster");
    let founders: Vec<String> = cluster
        .nodes
        .iter()
        .map(|n| format!("{}={}", n.id, n.peer))
        .collect();
    let clients: Vec<String> = cluster
        .nodes
        .iter()
        .map(|n| format!("{}={}", n.id, n.client))
        .chain(std::iter::once(format!("{id}={client}")))
        .collect();
    let data_dir = cluster.root.join(format!("node{id}"));
    let _ = std::fs::remove_dir_all(&data_dir);
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(cluster.root.join(format!("node{id}.log")))
        .expect("log");
    let log_err = log.try_clone().expect("clone the log handle");
    Command::new(env!("CARGO_BIN_EXE_conclave"))
        .arg("serve")
        .args(["--id", &id.to_string()])
        .arg("--data-dir")
        .arg(&data_dir)
        .args(["--listen-client", client, "--listen-peer", peer])
        .args([
            "--initial-cluster",
            &format!("{},{id}={peer}", founders.join(",")),
        ])
        .args(["--initial-cluster-clients", &clients.join(",")])
        .args(["--initial-cluster-state", "existing"])
        .arg("--peer-secret-file")
        .arg(cluster.peer_secret_file())
        .arg("--peer-cert-file")
        .arg(cert_dir.join(format!("node{id}-peer.pem")))
        .arg("--peer-key-file")
        .arg(cert_dir.join(format!("node{id}-peer-key.pem")))
        .arg("--peer-trusted-ca-file")
        .arg(&tls.ca)
        .env("CONCLAVE_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(log_err))
        .spawn()
        .expect("start the joining member")
}

fn log_of(cluster: &Cluster, id: u64) -> String {
    std::fs::read_to_string(cluster.root.join(format!("node{id}.log"))).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_peer_certified_by_another_ca_gets_no_raft_message_accepted_and_a_certified_one_joins() {
    use conclave_proto::etcdserverpb::MemberAddRequest;
    use conclave_proto::etcdserverpb::cluster_client::ClusterClient;

    let cluster = Cluster::start_tls(3).await;
    let tls = cluster.tls.clone().expect("a TLS cluster");
    let leader = cluster.wait_for_leader(WAIT).await;
    cluster.put_until_acked(leader, "before", "v", WAIT).await;

    let peer = format!("127.0.0.1:{}", common::free_port());
    let client = format!("127.0.0.1:{}", common::free_port());
    let added = ClusterClient::new(cluster.channel(leader))
        .member_add(MemberAddRequest {
            peer_ur_ls: vec![format!("http://{peer}")],
            is_learner: true,
        })
        .await
        .expect("member add")
        .into_inner();
    let id = added.member.expect("the added member").id;
    assert_eq!(id, 4);

    // The intruder: the right id, address and peer secret, a certificate naming node4, but
    // signed by another CA.
    let other = cluster.root.join("other-ca");
    let other_dir = other.to_str().expect("UTF-8");
    TestTls::certs(&["init", other_dir]);
    TestTls::certs(&[
        "issue",
        "--ca",
        other_dir,
        "--name",
        "node4",
        "--kind",
        "peer",
        "--ip",
        "127.0.0.1",
    ]);
    let mut intruder = start_joining_member(&cluster, id, &peer, &client, &other);
    tokio::time::sleep(Duration::from_secs(5)).await;
    let intruder_log = log_of(&cluster, id);
    assert!(
        intruder.try_wait().expect("poll the intruder").is_none(),
        "the intruder exited: {intruder_log}"
    );
    // It applied nothing: the leader's messages never reached it, nor did it reach a member.
    assert_eq!(
        common::local_value(&client, "before").await,
        None,
        "the intruder applied the cluster's entries"
    );
    let status = {
        let mut maintenance =
            conclave_proto::etcdserverpb::maintenance_client::MaintenanceClient::connect(format!(
                "http://{client}"
            ))
            .await
            .expect("the intruder's client port");
        maintenance
            .status(conclave_proto::etcdserverpb::StatusRequest {})
            .await
            .expect("the intruder's status")
            .into_inner()
    };
    assert_eq!(
        status.leader, 0,
        "the intruder learned of a leader: {status:?}"
    );
    assert_eq!(status.raft_applied_index, 0, "{status:?}");
    let refusals: usize = (1..=3)
        .map(|member| log_of(&cluster, member).matches("peer TLS refused").count())
        .sum();
    assert!(refusals > 0, "no member logged a TLS refusal");
    assert!(
        !intruder_log.contains("connected to peer"),
        "the intruder completed a peer handshake:\n{intruder_log}"
    );
    let _ = intruder.kill();
    let _ = intruder.wait();

    // The control: the same member with a certificate the cluster's CA signed joins and
    // catches up, so the intruder was stopped by its certificate alone.
    let ca_dir = tls.dir.to_str().expect("UTF-8");
    TestTls::certs(&[
        "issue",
        "--ca",
        ca_dir,
        "--name",
        "node4",
        "--kind",
        "peer",
        "--ip",
        "127.0.0.1",
    ]);
    let mut member = start_joining_member(&cluster, id, &peer, &client, &tls.dir);
    let start = Instant::now();
    while common::local_value(&client, "before").await.as_deref() != Some("v") {
        assert!(
            start.elapsed() < WAIT,
            "the certified member did not catch up; logs in {}",
            cluster.root.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = member.kill();
    let _ = member.wait();
}

#[tokio::test(flavor = "multi_thread")]
async fn sighup_reloads_the_client_port_certificate() {
    let cluster = Cluster::start_tls(1).await;
    let tls = cluster.tls.clone().expect("a TLS cluster");
    let https = https_endpoints(&cluster);

    // A second CA and a server certificate it signed.
    let next = cluster.root.join("next-ca");
    let next_dir = next.to_str().expect("UTF-8");
    TestTls::certs(&["init", next_dir]);
    TestTls::certs(&[
        "issue",
        "--ca",
        next_dir,
        "--name",
        "server",
        "--kind",
        "server",
        "--ip",
        "127.0.0.1",
    ]);
    let trusting_next = vec![
        "--cacert".to_string(),
        next.join("ca.pem").display().to_string(),
        "--cert".into(),
        tls.client_cert.display().to_string(),
        "--key".into(),
        tls.client_key.display().to_string(),
    ];
    // Before the reload the node still presents the first CA's certificate.
    assert_tls_refusal(&https, &trusting_next, "not signed by the CA in --cacert");

    for file in ["server-server.pem", "server-server-key.pem"] {
        std::fs::copy(next.join(file), tls.dir.join(file)).expect("replace the server certificate");
    }
    let pid = cluster.nodes[0].child.as_ref().expect("running").id();
    let _ = Command::new("kill")
        .args(["-HUP", &pid.to_string()])
        .status();
    let start = Instant::now();
    loop {
        let (code, answer) = conclave(&https, &trusting_next, &["get", "k"]);
        if code == 0 {
            break;
        }
        assert!(
            start.elapsed() < WAIT,
            "the new certificate was never served: {answer}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The first CA no longer verifies the node, and the node did not restart.
    assert_tls_refusal(
        &https,
        &tls.client_args(),
        "not signed by the CA in --cacert",
    );
    assert!(log_of(&cluster, 1).contains("client port certificates reloaded"));
    assert_eq!(
        log_of(&cluster, 1).matches("conclave node started").count(),
        1
    );
}
