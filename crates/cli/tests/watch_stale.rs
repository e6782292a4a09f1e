//! A client-resumed watch does not settle on a member that names the leader but does not keep
//! up (docs/faults.md, finding 7). Such a member — here a learner that refuses the leader's
//! snapshot as larger than its `--snapshot-bytes-max`, in the fault run a replacement learner
//! that never finished a snapshot transfer — hears the leader's heartbeats, so its Status names
//! a leader, yet it applies nothing: a watch re-created there waits for good.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{Cluster, Node};
use conclave_client::{Client, ClientOptions, WatchOptions};
use conclave_proto::etcdserverpb::MemberAddRequest;
use conclave_proto::etcdserverpb::cluster_client::ClusterClient;

/// Writes made after the watcher's member was killed; every one must reach the watcher.
const WRITES: usize = 20;
/// The learner's snapshot cap: the smallest the server allows.
const LEARNER_SNAPSHOT_BYTES_MAX: usize = 1024 * 1024;
/// Values written before the learner joins, so the leader's snapshot outgrows that cap.
const FILL_VALUE_BYTES: usize = 40 * 1024;
const FILL_WRITES: usize = 40;
/// Small writes after the fill, so the leader takes a snapshot holding it (the harness
/// snapshots every 50 entries) and compacts its log past what an empty learner needs.
const SMALL_WRITES: usize = 60;
/// Long enough that the learner still names the killed leader when the watch resumes (the
/// client follows a named leader it can reach, which would spare it the stale learner).
const ELECTION_TIMEOUT_MS: &str = "1000";
const WAIT: Duration = Duration::from_secs(30);

/// A value of `len` bytes that does not repeat in short cycles.
fn fill_value(seed: usize, len: usize) -> String {
    let mut state = (seed as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            char::from(b'a' + (state % 26) as u8)
        })
        .collect()
}

/// Adds a learner through `via` and starts it with an empty data directory and a snapshot cap
/// below the leader's snapshot. Returns its id.
async fn add_learner_that_cannot_catch_up(cluster: &mut Cluster, via: u64) -> u64 {
    let peer = format!("127.0.0.1:{}", common::free_port());
    let channel = cluster.channel(via);
    let added = ClusterClient::new(channel)
        .member_add(MemberAddRequest {
            peer_ur_ls: vec![format!("http://{peer}")],
            is_learner: true,
        })
        .await
        .expect("member add")
        .into_inner();
    let id = added.member.expect("the added member").id;
    let founders: Vec<String> = (cluster.nodes.iter())
        .map(|n| format!("{}={}", n.id, n.peer))
        .collect();
    let initial_cluster = format!("{},{id}={peer}", founders.join(","));
    let client = format!("127.0.0.1:{}", common::free_port());
    let clients: Vec<String> = (cluster.nodes.iter())
        .map(|n| format!("{}={}", n.id, n.client))
        .chain(std::iter::once(format!("{id}={client}")))
        .collect();
    let data_dir = cluster.root.join(format!("node{id}"));
    let log = std::fs::File::create(cluster.root.join(format!("node{id}.log"))).expect("log");
    let log_err = log.try_clone().expect("clone the log handle");
    let child = Command::new(env!("CARGO_BIN_EXE_conclave"))
        .arg("serve")
        .args(["--id", &id.to_string()])
        .arg("--data-dir")
        .arg(&data_dir)
        .args(["--listen-client", &client])
        .args(["--listen-peer", &peer])
        .args(["--initial-cluster", &initial_cluster])
        .args(["--initial-cluster-clients", &clients.join(",")])
        .args(["--initial-cluster-state", "existing"])
        .args(["--snapshot-entries", "50"])
        .args(["--snapshot-log-percent", "0"])
        .args(["--election-timeout-ms", ELECTION_TIMEOUT_MS])
        .args([
            "--snapshot-bytes-max",
            &LEARNER_SNAPSHOT_BYTES_MAX.to_string(),
        ])
        .arg("--peer-secret-file")
        .arg(cluster.peer_secret_file())
        .env("CONCLAVE_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(log_err))
        .spawn()
        .expect("start the learner");
    assert_eq!(
        id,
        cluster.nodes.len() as u64 + 1,
        "ids follow the founders"
    );
    cluster.nodes.push(Node {
        id,
        client,
        peer,
        metrics: format!("127.0.0.1:{}", common::free_port()),
        data_dir,
        child: Some(child),
    });
    id
}

#[tokio::test(flavor = "multi_thread")]
async fn a_resumed_watch_leaves_a_learner_that_names_the_leader_but_does_not_catch_up() {
    let mut cluster =
        Cluster::start_with_args(3, &["--election-timeout-ms", ELECTION_TIMEOUT_MS]).await;
    let leader = cluster.wait_for_leader(WAIT).await;
    for i in 0..FILL_WRITES {
        let value = fill_value(i, FILL_VALUE_BYTES);
        (cluster.put_until_acked(leader, &format!("ws-fill/{i:02}"), &value, WAIT)).await;
    }
    for i in 0..SMALL_WRITES {
        (cluster.put_until_acked(leader, &format!("ws-small/{i:02}"), "v", WAIT)).await;
    }
    // The premise needs the fill compacted out of the leader's log before the learner joins.
    // The snapshot writer runs at the lowest CPU priority, so on a busy machine it may finish
    // well after the writes are acknowledged; a learner added before it catches up from the log.
    let leader_log = cluster.root.join(format!("node{leader}.log"));
    let deadline = Instant::now() + WAIT;
    while !std::fs::read_to_string(&leader_log)
        .is_ok_and(|log| log.contains("snapshot taken, log compacted"))
    {
        assert!(
            Instant::now() < deadline,
            "leader {leader} took no snapshot within {WAIT:?}; logs in {}",
            cluster.root.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let learner = add_learner_that_cannot_catch_up(&mut cluster, leader).await;

    // The premise: the learner refuses the snapshot, yet names the leader.
    let learner_log = cluster.root.join(format!("node{learner}.log"));
    let deadline = Instant::now() + WAIT;
    loop {
        let refused = std::fs::read_to_string(&learner_log)
            .is_ok_and(|log| log.contains("exceeds the limit of"));
        let status = cluster.status(learner).await;
        if refused && status.as_ref().is_some_and(|s| s.leader == leader) {
            let revision = status.and_then(|s| s.header).map_or(0, |h| h.revision);
            assert!(
                revision < (FILL_WRITES + SMALL_WRITES) as i64,
                "the learner caught up after all (revision {revision}): the test tests nothing"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "learner {learner} did not both refuse the snapshot and name leader {leader} \
             within {WAIT:?} ({status:?}); logs in {}",
            cluster.root.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The leader first, so the watch starts there; the learner next, so the resume after the
    // leader dies tries it first (the client moves on to the endpoint after the one that
    // failed), as the fault run's resume tried the member after the paused one.
    let endpoints = vec![cluster.endpoint(leader), cluster.endpoint(learner)];
    let options = ClientOptions {
        request_timeout: Duration::from_secs(3),
        connect_timeout: Duration::from_millis(500),
        ..ClientOptions::default()
    };
    let client = Client::connect_with(&endpoints, options)
        .await
        .expect("connect to the leader");
    let mut watcher = client
        .watch("ws/", WatchOptions::prefix())
        .await
        .expect("a watch");
    (cluster.put_until_acked(leader, "ws/first", "v", WAIT)).await;
    let first = tokio::time::timeout(WAIT, watcher.next())
        .await
        .expect("the first event in time")
        .expect("the watch goes on")
        .expect("an event");
    assert_eq!(first.kv.key_str(), "ws/first");

    cluster.kill(leader);
    let survivor = (1..=3).find(|&id| id != leader).expect("a survivor");
    for i in 0..WRITES {
        (cluster.put_until_acked(survivor, &format!("ws/{i:02}"), "v", WAIT)).await;
    }

    // A put retried after a lost answer may apply twice, so count distinct keys.
    let mut keys: Vec<String> = Vec::new();
    let deadline = Instant::now() + WAIT;
    while keys.len() < WRITES {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(next) = tokio::time::timeout(left, watcher.next()).await else {
            panic!(
                "the watcher got {} of the {WRITES} writes made after its member was killed \
                 within {WAIT:?}: its stream stayed on a learner that does not catch up; logs \
                 in {}",
                keys.len(),
                cluster.root.display()
            );
        };
        let event = next.expect("the watch goes on").expect("an event");
        let key = event.kv.key_str().to_string();
        if key != "ws/first" && !keys.contains(&key) {
            keys.push(key);
        }
    }
    let expected: Vec<String> = (0..WRITES).map(|i| format!("ws/{i:02}")).collect();
    assert_eq!(keys, expected, "every write, in order");
    println!("the resumed watch left the stale learner and got all {WRITES} writes");
}
