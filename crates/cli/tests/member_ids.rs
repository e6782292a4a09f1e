//! MemberAdd never gives an id twice (docs/faults.md, findings 5 and 9), over real processes:
//! removing the member with the highest id and adding a new one gives a fresh id, and so does
//! the next add after the removals are compacted into snapshots and every member restarted.
//! Each new member joins with `--initial-cluster-state existing` and catches up: a reused
//! founder's id would have given it another cluster id, and every peer would refuse it.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{Cluster, Node};
use conclave_proto::etcdserverpb::cluster_client::ClusterClient;
use conclave_proto::etcdserverpb::{MemberAddRequest, MemberListRequest, MemberRemoveRequest};
use tonic::transport::Channel;

/// Generous for a loaded 2-core machine: catching up may take a snapshot transfer.
const CATCH_UP_TIMEOUT: Duration = Duration::from_secs(60);
const CHANGE_TIMEOUT: Duration = Duration::from_secs(30);
const WRITE_TIMEOUT: Duration = Duration::from_secs(20);
const FOUNDERS: u64 = 3;
/// Writes between the changes: past every member's `--snapshot-entries 50` several times,
/// so the entries that named a removed id are compacted away.
const WRITES_PAST_SNAPSHOTS: usize = 120;

fn cluster_client(cluster: &Cluster, id: u64) -> ClusterClient<Channel> {
    ClusterClient::new(cluster.channel(id))
}

async fn write(cluster: &Cluster, prefix: &str) {
    let leader = cluster.wait_for_leader(WRITE_TIMEOUT).await;
    for i in 0..WRITES_PAST_SNAPSHOTS {
        let key = format!("{prefix}-{i}");
        cluster
            .put_until_acked(leader, &key, &key, WRITE_TIMEOUT)
            .await;
    }
}

/// The ids member `via` lists, or `None` when it does not answer.
async fn listed_ids(cluster: &Cluster, via: u64) -> Option<Vec<u64>> {
    let mut request = tonic::Request::new(MemberListRequest::default());
    request.set_timeout(Duration::from_secs(2));
    let answer = cluster_client(cluster, via)
        .member_list(request)
        .await
        .ok()?;
    let mut ids: Vec<u64> = answer.into_inner().members.iter().map(|m| m.id).collect();
    ids.sort_unstable();
    Some(ids)
}

/// Removes member `id` through another live member (the answer may be lost when `id` leads
/// and steps down; the member list is what counts), waits until `witness` no longer lists
/// it, then kills its process.
async fn remove(cluster: &mut Cluster, id: u64, witness: u64) {
    let start = Instant::now();
    loop {
        let mut request = tonic::Request::new(MemberRemoveRequest { id });
        request.set_timeout(Duration::from_secs(5));
        let _ = cluster_client(cluster, witness)
            .member_remove(request)
            .await;
        if let Some(ids) = listed_ids(cluster, witness).await
            && !ids.contains(&id)
        {
            break;
        }
        assert!(
            start.elapsed() < CHANGE_TIMEOUT,
            "member {id} still listed by {witness}; logs in {}",
            cluster.root.display()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    cluster.kill(id);
}

/// MemberAdd of a learner at a fresh peer address through member `via`; its id and address.
async fn add_learner(cluster: &Cluster, via: u64) -> (u64, String) {
    let peer = format!("127.0.0.1:{}", common::free_port());
    let mut request = tonic::Request::new(MemberAddRequest {
        peer_ur_ls: vec![format!("http://{peer}")],
        is_learner: true,
    });
    request.set_timeout(CHANGE_TIMEOUT);
    let added = cluster_client(cluster, via)
        .member_add(request)
        .await
        .unwrap_or_else(|status| panic!("member add: {status}; logs in {}", cluster.root.display()))
        .into_inner();
    (added.member.expect("the added member").id, peer)
}

/// A member `id` not started yet, at peer address `peer`, with fresh client and metrics ports.
fn fresh_node(cluster: &Cluster, id: u64, peer: String) -> Node {
    Node {
        id,
        client: format!("127.0.0.1:{}", common::free_port()),
        peer,
        metrics: format!("127.0.0.1:{}", common::free_port()),
        data_dir: cluster.root.join(format!("node{id}")),
        child: None,
    }
}

/// Starts (or restarts) the process of `node`, a member added by MemberAdd, joining with
/// `--initial-cluster-state existing`: the founding list exactly as the founders were started,
/// plus itself.
fn spawn_joined(cluster: &Cluster, node: &Node) -> std::process::Child {
    let founders = || cluster.nodes.iter().take(FOUNDERS as usize);
    let initial: Vec<String> = founders()
        .map(|n| format!("{}={}", n.id, n.peer))
        .chain(std::iter::once(format!("{}={}", node.id, node.peer)))
        .collect();
    let clients: Vec<String> = founders()
        .map(|n| format!("{}={}", n.id, n.client))
        .chain(std::iter::once(format!("{}={}", node.id, node.client)))
        .collect();
    let args = [
        "--id".to_string(),
        node.id.to_string(),
        "--listen-peer".into(),
        node.peer.clone(),
        "--initial-cluster".into(),
        initial.join(","),
        "--initial-cluster-clients".into(),
        clients.join(","),
        "--initial-cluster-state".into(),
        "existing".into(),
        "--snapshot-entries".into(),
        "50".into(),
        "--snapshot-log-percent".into(),
        "0".into(),
    ];
    cluster.spawn_serve(node, &args)
}

/// Adds a learner through `via`, checks its id was never used, starts it and waits until it
/// has applied what the leader had committed. Returns its id.
async fn add_and_join(cluster: &mut Cluster, via: u64, used: &[u64]) -> u64 {
    let (id, peer) = add_learner(cluster, via).await;
    assert!(
        !used.contains(&id),
        "MemberAdd gave id {id}, which was used before (used: {used:?}); logs in {}",
        cluster.root.display()
    );
    assert_eq!(
        id,
        used.iter().max().copied().unwrap_or(0) + 1,
        "ids continue after the highest ever used"
    );
    // The tests' cluster finds member `id` at index `id - 1`.
    assert_eq!(cluster.nodes.len() as u64 + 1, id);
    let mut node = fresh_node(cluster, id, peer);
    node.child = Some(spawn_joined(cluster, &node));
    cluster.nodes.push(node);
    cluster.wait_caught_up(id, CATCH_UP_TIMEOUT).await;
    id
}

#[tokio::test(flavor = "multi_thread")]
async fn member_add_never_reuses_the_id_of_a_removed_member() {
    let mut cluster = Cluster::start(FOUNDERS).await;
    let mut used: Vec<u64> = (1..=FOUNDERS).collect();
    write(&cluster, "founded").await;

    // Remove the member with the highest id: without a record of it, 3 looked free again.
    remove(&mut cluster, 3, 1).await;
    let fourth = add_and_join(&mut cluster, 1, &used).await;
    used.push(fourth);

    // Remove the newest member too, let snapshots compact every entry that named it, and
    // restart the founders that remain: only the snapshots still know which ids were used.
    remove(&mut cluster, fourth, 1).await;
    write(&cluster, "compacted").await;
    for id in [1, 2] {
        cluster.kill(id);
    }
    for id in [1, 2] {
        cluster.spawn(id);
    }
    let leader = cluster.wait_for_leader(CATCH_UP_TIMEOUT).await;
    let via = if leader == 1 { 2 } else { 1 };
    let fifth = add_and_join(&mut cluster, via, &used).await;
    used.push(fifth);

    // The cluster serves with its new member, which every member lists.
    write(&cluster, "joined").await;
    for id in [1, 2, fifth] {
        let start = Instant::now();
        while listed_ids(&cluster, id).await != Some(vec![1, 2, fifth]) {
            assert!(
                start.elapsed() < CATCH_UP_TIMEOUT,
                "member {id} lists {:?}; logs in {}",
                listed_ids(&cluster, id).await,
                cluster.root.display()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    cluster.wait_caught_up(fifth, CATCH_UP_TIMEOUT).await;
}

/// After a founder left, the founding list is gone from the cluster, and the current members
/// derive no longer to the cluster id. `conclave member add` prints the current members and
/// the cluster id apart (`--initial-cluster-id`), and a member started with exactly those
/// flags joins. Before, the printed list alone gave the new member another cluster id, and
/// every peer refused it.
#[tokio::test(flavor = "multi_thread")]
async fn a_member_started_with_the_flags_member_add_printed_joins_after_a_founder_left() {
    let mut cluster = Cluster::start(FOUNDERS).await;
    write(&cluster, "founded").await;
    remove(&mut cluster, 1, 2).await;
    let eps = format!("{},{}", cluster.endpoint(2), cluster.endpoint(3));

    let peer = format!("127.0.0.1:{}", common::free_port());
    let added = Command::new(env!("CARGO_BIN_EXE_conclave"))
        .args([
            "--endpoints",
            &eps,
            "member",
            "add",
            "n4",
            "--learner",
            "--json",
        ])
        .args(["--peer-url", &format!("http://{peer}")])
        .output()
        .expect("run conclave member add");
    assert!(added.status.success(), "member add failed: {added:?}");
    let added: serde_json::Value =
        serde_json::from_slice(&added.stdout).expect("member add prints JSON");
    let flags: Vec<String> = added["data"]["serve_flags"]
        .as_array()
        .unwrap_or_else(|| panic!("no serve_flags in {added}"))
        .iter()
        .filter_map(|flag| flag.as_str().map(str::to_string))
        .collect();
    let id: u64 = flags
        .iter()
        .position(|flag| flag == "--id")
        .and_then(|at| flags.get(at + 1))
        .and_then(|id| id.parse().ok())
        .unwrap_or_else(|| panic!("no --id in {flags:?}"));
    assert_eq!(cluster.nodes.len() as u64 + 1, id);

    let node = fresh_node(&cluster, id, peer);
    let child = cluster.spawn_serve(&node, &flags);
    cluster.nodes.push(Node {
        child: Some(child),
        ..node
    });
    cluster.wait_caught_up(id, CATCH_UP_TIMEOUT).await;
}
