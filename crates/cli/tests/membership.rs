//! Membership changes over real processes: a learner joins a running 3-node cluster with an
//! empty data directory, catches up by snapshot, is promoted, and original members are
//! removed (a follower, then the leader), while writes and reads continue.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{Cluster, Node};
use conclave_proto::conclave::v1::PublishAttributesRequest;
use conclave_proto::conclave::v1::membership_client::MembershipClient;
use conclave_proto::etcdserverpb::cluster_client::ClusterClient;
use conclave_proto::etcdserverpb::{
    Member, MemberAddRequest, MemberListRequest, MemberPromoteRequest, MemberRemoveRequest,
    MoveLeaderRequest, PutRequest,
};
use tonic::Code;
use tonic::transport::Channel;

const CATCH_UP_TIMEOUT: Duration = Duration::from_secs(20);
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

fn cluster_client(cluster: &Cluster, id: u64) -> ClusterClient<Channel> {
    let channel = Channel::from_shared(cluster.endpoint(id))
        .expect("valid endpoint")
        .connect_lazy();
    ClusterClient::new(channel)
}

async fn members(cluster: &Cluster, id: u64) -> Vec<Member> {
    let mut client = cluster_client(cluster, id);
    let mut members = client
        .member_list(MemberListRequest::default())
        .await
        .expect("member list")
        .into_inner()
        .members;
    members.sort_by_key(|m| m.id);
    members
}

/// Waits until node `id` lists exactly `expected` as (id, is_learner).
async fn wait_for_members(cluster: &Cluster, id: u64, expected: &[(u64, bool)]) {
    let start = Instant::now();
    loop {
        let listed: Vec<(u64, bool)> = members(cluster, id)
            .await
            .iter()
            .map(|m| (m.id, m.is_learner))
            .collect();
        if listed == expected {
            return;
        }
        assert!(
            start.elapsed() < CATCH_UP_TIMEOUT,
            "node {id} lists {listed:?}, expected {expected:?}; logs in {}",
            cluster.root.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `key` as member `id` has applied it.
async fn serializable_get(cluster: &Cluster, id: u64, key: &str) -> Option<String> {
    let node = cluster.nodes.iter().find(|n| n.id == id)?;
    common::local_value(&node.client, key).await
}

/// Waits until node `id` has applied `key` = `value`.
async fn wait_for_value(cluster: &Cluster, id: u64, key: &str, value: &str) {
    let start = Instant::now();
    while serializable_get(cluster, id, key).await.as_deref() != Some(value) {
        assert!(
            start.elapsed() < CATCH_UP_TIMEOUT,
            "node {id} never applied {key}={value}; logs in {}",
            cluster.root.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Writes `count` keys `prefix-i` through the leader and checks every live member applies
/// them.
async fn write_and_check(cluster: &Cluster, prefix: &str, count: usize) {
    let leader = cluster.wait_for_leader(WRITE_TIMEOUT).await;
    for i in 0..count {
        let key = format!("{prefix}-{i}");
        cluster
            .put_until_acked(leader, &key, &key, WRITE_TIMEOUT)
            .await;
    }
    let last = format!("{prefix}-{}", count - 1);
    for id in cluster.live_ids() {
        wait_for_value(cluster, id, &last, &last).await;
    }
}

/// Adds a learner through member `via` and starts it with an empty data directory and
/// `--initial-cluster-state existing`. Returns its id.
async fn add_and_start_learner(cluster: &mut Cluster, via: u64) -> u64 {
    let (id, peer) = add_learner(cluster, via).await;
    start_joining_node(cluster, id, peer);
    id
}

/// Adds a learner through member `via` (no process yet). Returns its id and peer address.
async fn add_learner(cluster: &Cluster, via: u64) -> (u64, String) {
    let peer_port = common::free_port();
    let peer = format!("127.0.0.1:{peer_port}");
    let added = cluster_client(cluster, via)
        .member_add(MemberAddRequest {
            peer_ur_ls: vec![format!("http://{peer}")],
            is_learner: true,
        })
        .await
        .expect("member add")
        .into_inner();
    let member = added.member.expect("the added member");
    assert!(member.is_learner);
    let id = member.id;
    assert_eq!(
        id,
        cluster.nodes.len() as u64 + 1,
        "ids continue after the founders"
    );
    assert!(added.members.iter().any(|m| m.id == id));
    (id, peer)
}

/// Starts the node MemberAdd made `id`, on `peer`, joining the running cluster.
fn start_joining_node(cluster: &mut Cluster, id: u64, peer: String) {
    let client_port = common::free_port();
    let founders: Vec<String> = cluster
        .nodes
        .iter()
        .map(|n| format!("{}={}", n.id, n.peer))
        .collect();
    let initial_cluster = format!("{},{id}={peer}", founders.join(","));
    let client = format!("127.0.0.1:{client_port}");
    let clients: Vec<String> = cluster
        .nodes
        .iter()
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
        .arg("--peer-secret-file")
        .arg(cluster.peer_secret_file())
        .env("CONCLAVE_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(log_err))
        .spawn()
        .expect("start the joining node");
    cluster.nodes.push(Node {
        id,
        client,
        peer,
        metrics: format!("127.0.0.1:{}", common::free_port()),
        data_dir,
        child: Some(child),
    });
}

/// Starts 3 nodes, writes, adds and starts a learner, waits for it to catch up, promotes it.
async fn cluster_with_promoted_fourth() -> Cluster {
    let mut cluster = Cluster::start(3).await;
    // Past --snapshot-entries, so the newcomer catches up from a compacted log.
    write_and_check(&cluster, "before", 120).await;
    let leader = cluster.wait_for_leader(WRITE_TIMEOUT).await;
    let via = if leader == 1 { 2 } else { 1 }; // a follower forwards the change
    let id = add_and_start_learner(&mut cluster, via).await;
    wait_for_members(
        &cluster,
        1,
        &[(1, false), (2, false), (3, false), (id, true)],
    )
    .await;
    wait_for_value(&cluster, id, "before-119", "before-119").await;
    write_and_check(&cluster, "learner", 20).await;

    let mut client = cluster_client(&cluster, via);
    client
        .member_promote(MemberPromoteRequest { id })
        .await
        .expect("promote the learner");
    for node in 1..=id {
        wait_for_members(
            &cluster,
            node,
            &[(1, false), (2, false), (3, false), (id, false)],
        )
        .await;
    }
    write_and_check(&cluster, "promoted", 20).await;
    cluster
}

#[tokio::test(flavor = "multi_thread")]
async fn learner_joins_is_promoted_and_a_follower_is_removed() {
    let mut cluster = cluster_with_promoted_fourth().await;
    let mut client = cluster_client(&cluster, 1);

    // etcd's refusals, word for word.
    let again = client
        .member_promote(MemberPromoteRequest { id: 4 })
        .await
        .expect_err("a voter cannot be promoted");
    assert_eq!(again.code(), Code::FailedPrecondition);
    assert_eq!(
        again.message(),
        "etcdserver: can only promote a learner member"
    );
    let unknown = client
        .member_promote(MemberPromoteRequest { id: 99 })
        .await
        .expect_err("unknown member");
    assert_eq!(unknown.code(), Code::NotFound);
    assert_eq!(unknown.message(), "etcdserver: member not found");
    let duplicate = client
        .member_add(MemberAddRequest {
            peer_ur_ls: vec![format!("http://{}", cluster.nodes[3].peer)],
            is_learner: true,
        })
        .await
        .expect_err("duplicate peer URL");
    assert_eq!(duplicate.message(), "etcdserver: Peer URLs already exists");

    let etcdctl = std::path::Path::new("/usr/bin/etcdctl");
    if etcdctl.exists() {
        let output = Command::new(etcdctl)
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", &cluster.endpoints(), "member", "list"])
            .output()
            .expect("run etcdctl");
        let listed = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "etcdctl member list: {listed}");
        assert_eq!(listed.lines().count(), 4, "etcdctl member list: {listed}");
        assert!(listed.contains(&cluster.nodes[3].peer), "{listed}");
    }

    // Remove a founding follower; the rest carry on.
    let leader = cluster.wait_for_leader(WRITE_TIMEOUT).await;
    let removed = (1..=3).find(|&id| id != leader).expect("a follower");
    let remaining: Vec<(u64, bool)> = (1..=4)
        .filter(|&id| id != removed)
        .map(|id| (id, false))
        .collect();
    client = cluster_client(&cluster, leader);
    client
        .member_remove(MemberRemoveRequest { id: removed })
        .await
        .expect("remove a follower");
    cluster.kill(removed);
    for id in cluster.live_ids() {
        wait_for_members(&cluster, id, &remaining).await;
    }
    write_and_check(&cluster, "after-removal", 20).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_leader_can_be_removed() {
    let mut cluster = cluster_with_promoted_fourth().await;
    let leader = cluster.wait_for_leader(WRITE_TIMEOUT).await;
    let remaining: Vec<(u64, bool)> = (1..=4)
        .filter(|&id| id != leader)
        .map(|id| (id, false))
        .collect();
    // The answer may be lost as the leader steps down; the membership is what counts.
    let _ = cluster_client(&cluster, leader)
        .member_remove(MemberRemoveRequest { id: leader })
        .await;
    let witness = (1..=4).find(|&id| id != leader).expect("another member");
    wait_for_members(&cluster, witness, &remaining).await;
    cluster.kill(leader);
    let new_leader = cluster.wait_for_leader(WRITE_TIMEOUT).await;
    assert_ne!(new_leader, leader);
    for id in cluster.live_ids() {
        wait_for_members(&cluster, id, &remaining).await;
    }
    write_and_check(&cluster, "after-leader-removal", 20).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_member_added_later_leads_and_the_founders_forward_to_it() {
    let cluster = cluster_with_promoted_fourth().await;
    let newcomer = &cluster.nodes[3];
    let client_url = format!("http://{}", newcomer.client);
    // The newcomer published its name and client address into the replicated records, so
    // every founder lists them (MemberAdd knew only the peer address).
    for id in 1..=3 {
        let start = Instant::now();
        loop {
            let listed = members(&cluster, id).await;
            let fourth = listed.iter().find(|m| m.id == 4).expect("member 4 listed");
            if fourth.client_ur_ls == vec![client_url.clone()] && fourth.name == "node4" {
                break;
            }
            assert!(
                start.elapsed() < CATCH_UP_TIMEOUT,
                "member {id} lists member 4 as {fourth:?}; logs in {}",
                cluster.root.display()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    // Make the newcomer lead, then write through each founder: they forward to it.
    let leader = cluster.wait_for_leader(WRITE_TIMEOUT).await;
    if leader != 4 {
        cluster
            .maintenance(leader)
            .await
            .move_leader(MoveLeaderRequest { target_id: 4 })
            .await
            .expect("move the leadership to member 4");
    }
    assert_eq!(cluster.wait_for_leader(WRITE_TIMEOUT).await, 4);
    for id in 1..=3 {
        let mut kv = cluster.kv(id).await;
        let mut request = tonic::Request::new(PutRequest {
            key: format!("through-{id}").into(),
            value: "v".into(),
            ..Default::default()
        });
        request.set_timeout(WRITE_TIMEOUT);
        let answer = kv
            .put(request)
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "a write through founder {id} to leader 4 failed: {e}; logs in {}",
                    cluster.root.display()
                )
            })
            .into_inner();
        // The founder hands the write to leader 4 over the peer link and answers itself.
        assert_eq!(
            answer.header.expect("header").member_id,
            id,
            "the founder asked answers"
        );
    }
    for id in 1..=4 {
        wait_for_value(&cluster, id, "through-3", "v").await;
    }

    // ClusterStatus through a founder probes every current member, the newcomer included.
    let channel = tonic::transport::Channel::from_shared(cluster.endpoint(1))
        .expect("valid endpoint")
        .connect_lazy();
    let status = conclave_proto::conclave::v1::status_client::StatusClient::new(channel)
        .cluster_status(conclave_proto::conclave::v1::ClusterStatusRequest {})
        .await
        .expect("cluster status through member 1")
        .into_inner();
    assert_eq!(status.leader_id, 4);
    let fourth = status
        .members
        .iter()
        .find(|m| m.id == 4)
        .unwrap_or_else(|| panic!("member 4 missing from {:?}", status.members));
    assert_eq!(fourth.name, "node4");
    assert!(fourth.healthy, "member 4 probed healthy: {fourth:?}");
    assert_eq!(status.members.len(), 4, "{:?}", status.members);

    // Member 4's name and client address came in its authenticated peer handshake; the
    // client port does not take them (crates/cli/tests/hostile/peer.rs tests the refusal).
    let channel = tonic::transport::Channel::from_shared(cluster.endpoint(1))
        .expect("valid endpoint")
        .connect_lazy();
    let refused = MembershipClient::new(channel)
        .publish_attributes(PublishAttributesRequest {
            id: 4,
            name: "node4".into(),
            client_address: "127.0.0.1:1".into(),
        })
        .await
        .expect_err("PublishAttributes is not served on the client port");
    assert_eq!(refused.code(), Code::PermissionDenied);
}

/// A member that was down while another joined, and came back after the newcomer took the
/// lead, holds a configuration without its leader and no record of where it listens. It must
/// follow the newcomer, catch up, and count toward a quorum again. Before, it refused the
/// newcomer as a stranger and stayed out for good.
///
/// With `writes_while_led` well below `--snapshot-entries` the newcomer's log still holds
/// what the member lacks: it sends appends and must hear the member's answers, which go to
/// the peer address the newcomer announced in its authenticated handshake (the log line is
/// checked). With more, the newcomer compacted what the member lacks and sends a snapshot
/// (checked too), after which the member holds the newcomer's record.
async fn a_member_away_while_its_leader_joined_follows_it(writes_while_led: usize, expect: &str) {
    let mut cluster = Cluster::start(3).await;
    write_and_check(&cluster, "before", 5).await;
    let first_leader = cluster.wait_for_leader(WRITE_TIMEOUT).await;
    let away = if first_leader == 3 { 2 } else { 3 };
    cluster.kill(away);
    let id = add_and_start_learner(&mut cluster, first_leader).await;
    let present: Vec<u64> = (1..=3).filter(|&n| n != away).collect();
    wait_for_members(
        &cluster,
        present[0],
        &[(1, false), (2, false), (3, false), (id, true)],
    )
    .await;
    write_and_check(&cluster, "learner", 3).await;
    cluster_client(&cluster, present[0])
        .member_promote(MemberPromoteRequest { id })
        .await
        .expect("promote the learner");
    let four_voters = [(1, false), (2, false), (3, false), (id, false)];
    for &node in present.iter().chain([&id]) {
        wait_for_members(&cluster, node, &four_voters).await;
    }
    lead_with(&cluster, id).await;
    write_and_check(&cluster, "led", writes_while_led).await;
    // The first leader's link to the absent member still queues the appends it sent before
    // the handover (the changes adding the newcomer among them), which would reach the member
    // when it is back; a restart drops them, so all the member hears is the newcomer.
    cluster.kill(first_leader);
    cluster.spawn(first_leader);
    write_and_check(&cluster, "first-leader-back", 3).await;
    // Three of four voters were up while it restarted, so an election may have moved the lead.
    lead_with(&cluster, id).await;

    cluster.spawn(away);
    let last = format!("led-{}", writes_while_led - 1);
    wait_for_value(&cluster, away, &last, &last).await;
    wait_for_members(&cluster, away, &four_voters).await;
    let log = std::fs::read_to_string(cluster.root.join(format!("node{away}.log")))
        .expect("the log of the member that came back");
    assert!(
        log.contains(expect),
        "member {away} never logged {expect:?}; logs in {}",
        cluster.root.display()
    );
    // With another founder gone, the returning member is part of the only quorum left.
    let other = present
        .iter()
        .copied()
        .find(|&n| n != id)
        .expect("a founder");
    cluster.kill(other);
    write_and_check(&cluster, "needs-the-returning-member", 10).await;
}

/// Moves the leadership to member `id` unless it leads already.
async fn lead_with(cluster: &Cluster, id: u64) {
    let leader = cluster.wait_for_leader(WRITE_TIMEOUT).await;
    if leader != id {
        cluster
            .maintenance(leader)
            .await
            .move_leader(MoveLeaderRequest { target_id: id })
            .await
            .unwrap_or_else(|e| panic!("move the leadership from {leader} to {id}: {e}"));
    }
    assert_eq!(cluster.wait_for_leader(WRITE_TIMEOUT).await, id);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_member_away_while_its_leader_joined_answers_it_at_its_announced_address() {
    a_member_away_while_its_leader_joined_follows_it(
        5,
        "dialing a node this member holds no record of",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_member_away_while_its_leader_joined_takes_its_snapshot() {
    a_member_away_while_its_leader_joined_follows_it(120, "snapshot from the leader installed")
        .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_learner_is_promoted_only_once_it_has_caught_up() {
    let mut cluster = Cluster::start(3).await;
    write_and_check(&cluster, "before", 30).await;
    let leader = cluster.wait_for_leader(WRITE_TIMEOUT).await;
    let via = if leader == 1 { 2 } else { 1 };
    // Added but not started: it has none of the log.
    let (id, peer) = add_learner(&cluster, via).await;
    let refused = cluster_client(&cluster, via)
        .member_promote(MemberPromoteRequest { id })
        .await
        .expect_err("a learner with an empty log cannot be promoted");
    assert_eq!(refused.code(), Code::FailedPrecondition);
    assert_eq!(
        refused.message(),
        "etcdserver: can only promote a learner member which is in sync with leader"
    );
    wait_for_members(
        &cluster,
        via,
        &[(1, false), (2, false), (3, false), (id, true)],
    )
    .await;

    // Started, it catches up by snapshot and the log; then the promotion goes through.
    start_joining_node(&mut cluster, id, peer);
    wait_for_value(&cluster, id, "before-29", "before-29").await;
    let start = Instant::now();
    loop {
        match cluster_client(&cluster, via)
            .member_promote(MemberPromoteRequest { id })
            .await
        {
            Ok(_) => break,
            // The leader may not have heard from the learner since it caught up.
            Err(status)
                if status.message().ends_with("in sync with leader")
                    && start.elapsed() < CATCH_UP_TIMEOUT =>
            {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(status) => panic!(
                "promoting the caught-up learner failed: {status}; logs in {}",
                cluster.root.display()
            ),
        }
    }
    println!(
        "learner {id} promoted {} ms after it had applied the last write",
        start.elapsed().as_millis()
    );
    wait_for_members(
        &cluster,
        via,
        &[(1, false), (2, false), (3, false), (id, false)],
    )
    .await;
    write_and_check(&cluster, "promoted", 10).await;
}

/// A learner joins while a steady write load makes the leader snapshot several times a second
/// (`--snapshot-entries 50`) and the image takes many 1 MiB chunks: it must install a snapshot
/// and then follow the log while the load goes on. Before, the leader restarted the transfer
/// with each newer snapshot and the learner never applied anything.
#[tokio::test(flavor = "multi_thread")]
async fn a_learner_catches_up_while_the_leader_snapshots_faster_than_it_can_send_one() {
    /// Values of 1 MB each make the snapshot image about this many MiB (and chunks).
    const IMAGE_MB: usize = 12;
    /// The learner must apply writes made after it started, under load, within this.
    const LOADED_CATCH_UP_TIMEOUT: Duration = Duration::from_secs(90);
    let mut cluster = Cluster::start(3).await;
    let leader = cluster.wait_for_leader(WRITE_TIMEOUT).await;
    let big_value = "x".repeat(1_000_000);
    for i in 0..IMAGE_MB {
        cluster
            .put_until_acked(leader, &format!("big-{i}"), &big_value, WRITE_TIMEOUT)
            .await;
    }

    // The load: one small put after another through the leader, each counter value in turn.
    let written = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = {
        let (written, stop) = (written.clone(), stop.clone());
        let mut client = cluster.kv(leader).await;
        tokio::spawn(async move {
            let mut counter = 0u64;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let mut request = tonic::Request::new(PutRequest {
                    key: b"load".to_vec().into(),
                    value: (counter + 1).to_string().into_bytes().into(),
                    ..Default::default()
                });
                request.set_timeout(Duration::from_secs(2));
                if client.put(request).await.is_ok() {
                    counter += 1;
                    written.store(counter, std::sync::atomic::Ordering::SeqCst);
                } else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        })
    };
    // Let the load make several snapshots before the learner asks for one.
    while written.load(std::sync::atomic::Ordering::SeqCst) < 200 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let via = if leader == 1 { 2 } else { 1 };
    let id = add_and_start_learner(&mut cluster, via).await;
    let started = Instant::now();
    // Twice: the first wait sees a snapshot installed, the second that the log follows.
    let mut waits_ms = Vec::new();
    for _ in 0..2 {
        let target = written.load(std::sync::atomic::Ordering::SeqCst);
        let wait_start = Instant::now();
        loop {
            let applied = serializable_get(&cluster, id, "load")
                .await
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
            if applied >= target {
                break;
            }
            assert!(
                started.elapsed() < LOADED_CATCH_UP_TIMEOUT,
                "learner {id} applied load {applied}, not {target}, {} s after it started \
                 ({} writes of load so far); logs in {}",
                started.elapsed().as_secs(),
                written.load(std::sync::atomic::Ordering::SeqCst),
                cluster.root.display()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        waits_ms.push(wait_start.elapsed().as_millis());
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    load.await.expect("the load task");
    println!(
        "learner {id} under load: first caught up in {} ms, again in {} ms ({} writes)",
        waits_ms[0],
        waits_ms[1],
        written.load(std::sync::atomic::Ordering::SeqCst)
    );
}

/// MemberList with etcd's `linearizable` flag answers only once a quorum has confirmed the
/// commit index the list must include; without it, a member answers from what it has applied,
/// even cut off from everyone.
#[tokio::test(flavor = "multi_thread")]
async fn a_linearizable_member_list_needs_a_quorum_and_a_serializable_one_does_not() {
    let cluster = Cluster::start(3).await;
    cluster.wait_for_leader(WRITE_TIMEOUT).await;
    let asked = 1;
    let mut client = cluster_client(&cluster, asked);
    // The connection is up before the others stop.
    assert_eq!(members(&cluster, asked).await.len(), 3);
    let paused = cluster.pause_all_but(asked);
    let serializable = tokio::time::timeout(
        Duration::from_millis(1500),
        client.member_list(MemberListRequest {
            linearizable: false,
        }),
    )
    .await;
    let linearizable = tokio::time::timeout(
        Duration::from_millis(1500),
        client.member_list(MemberListRequest { linearizable: true }),
    )
    .await;
    drop(paused);
    let listed = serializable
        .expect("a serializable list answers at once")
        .expect("serializable list")
        .into_inner()
        .members;
    assert_eq!(listed.len(), 3, "{listed:?}");
    assert!(
        !matches!(linearizable, Ok(Ok(_))),
        "member {asked} answered a linearizable MemberList with no quorum reachable: {linearizable:?}"
    );
}
