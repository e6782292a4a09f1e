//! The embedding API over real nodes in one process: three `conclave_server::Node`s on loopback
//! ports replicate a small machine of the test's own through the generic driver (WAL, peer
//! transport, snapshots every few entries), across a leader shutdown, a restart that catches
//! up by snapshot, and a restart of a lone node that can only recover from its own disk.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use conclave_server::{Error, MachineError, Node, NodeConfig, ReplicatedMachine, Role};
use conclave_storage::{OsDisk, StorageOptions, WalStorage};

/// How long a cluster may take to elect a leader or converge (the CI machine is slow).
const SETTLE_TIMEOUT: Duration = Duration::from_secs(20);
/// Snapshot (and compact the log) this often, so the test crosses many snapshots.
const SNAPSHOT_ENTRIES: u64 = 5;
/// Increments in each phase.
const INCREMENTS: i64 = 30;
/// How many times a node start may retry binding its peer port.
const START_ATTEMPTS: u32 = 10;

/// A counter that remembers every applied increment with its log index, so replicas can be
/// compared entry by entry, not just by their sum.
#[derive(Default, Debug)]
struct Tally {
    total: i64,
    applied: Vec<(u64, i64)>,
}

impl ReplicatedMachine for Tally {
    type Command = i64;
    /// The entry's index and the total after it.
    type Output = (u64, i64);

    fn encode(delta: i64) -> Vec<u8> {
        delta.to_be_bytes().to_vec()
    }

    fn apply(&mut self, index: u64, entry: &[u8]) -> Result<(u64, i64), MachineError> {
        let delta = i64::from_be_bytes(entry.try_into()?);
        if let Some(&(last, _)) = self.applied.last() {
            // The driver's promise: each index once, in order.
            assert!(index > last, "index {index} applied after {last}");
        }
        self.total += delta;
        self.applied.push((index, delta));
        Ok((index, self.total))
    }

    fn snapshot(&self) -> Vec<u8> {
        let mut image = self.total.to_be_bytes().to_vec();
        for (index, delta) in &self.applied {
            image.extend_from_slice(&index.to_be_bytes());
            image.extend_from_slice(&delta.to_be_bytes());
        }
        image
    }

    fn restore(&mut self, image: &[u8]) -> Result<(), MachineError> {
        let (total, rest) = image
            .split_at_checked(8)
            .ok_or("image shorter than 8 bytes")?;
        if rest.len() % 16 != 0 {
            return Err("image has a partial record".into());
        }
        self.total = i64::from_be_bytes(total.try_into()?);
        self.applied = rest
            .chunks_exact(16)
            .map(|pair| {
                let (index, delta) = pair.split_at(8);
                Ok((
                    u64::from_be_bytes(index.try_into()?),
                    i64::from_be_bytes(delta.try_into()?),
                ))
            })
            .collect::<Result<_, MachineError>>()?;
        Ok(())
    }
}

/// What a node's callbacks reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Called {
    Leader { term: u64 },
    Follower { leader: u64, term: u64 },
}

type CallLog = Arc<Mutex<Vec<(u64, Called)>>>;

struct Cluster {
    root: PathBuf,
    peers: Vec<(u64, String)>,
    nodes: Vec<Option<Node<Tally>>>,
    calls: CallLog,
}

impl Cluster {
    fn new() -> Cluster {
        static NEXT_DIR: AtomicU32 = AtomicU32::new(0);
        let root = std::env::temp_dir().join(format!(
            "conclave-embedded-{}-{}",
            std::process::id(),
            NEXT_DIR.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&root);
        let peers = (1..=3)
            .map(|id| (id, format!("127.0.0.1:{}", common::free_port())))
            .collect();
        Cluster {
            root,
            peers,
            nodes: vec![None, None, None],
            calls: CallLog::default(),
        }
    }

    fn data_dir(&self, id: u64) -> PathBuf {
        self.root.join(format!("node-{id}"))
    }

    /// Starts node `id`. Its peer port was chosen free, but something may hold it for a
    /// moment (a connection's source port); binding is retried briefly before giving up.
    async fn start(&mut self, id: u64) {
        let mut attempt = 1;
        loop {
            match self.try_start(id).await {
                Ok(node) => {
                    self.nodes[id as usize - 1] = Some(node);
                    return;
                }
                Err(error @ conclave_server::Error::PeerListen { .. })
                    if attempt < START_ATTEMPTS =>
                {
                    eprintln!("node {id} start attempt {attempt}: {error}; retrying");
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(error) => panic!("node {id} did not start: {error}"),
            }
        }
    }

    async fn try_start(&self, id: u64) -> Result<Node<Tally>, conclave_server::Error> {
        let mut config = NodeConfig::new(id, self.data_dir(id), self.peers.clone());
        config.snapshot_entries = SNAPSHOT_ENTRIES;
        let (leader_log, follower_log) = (self.calls.clone(), self.calls.clone());
        Node::builder(config, Tally::default())
            .on_leader(move |term| {
                leader_log
                    .lock()
                    .unwrap()
                    .push((id, Called::Leader { term }));
            })
            .on_follower(move |leader, term| {
                follower_log
                    .lock()
                    .unwrap()
                    .push((id, Called::Follower { leader, term }));
            })
            .start()
            .await
    }

    fn node(&self, id: u64) -> &Node<Tally> {
        self.nodes[id as usize - 1]
            .as_ref()
            .unwrap_or_else(|| panic!("node {id} is not running"))
    }

    fn running(&self) -> impl Iterator<Item = &Node<Tally>> {
        self.nodes.iter().flatten()
    }

    async fn stop(&mut self, id: u64) {
        let node = self.nodes[id as usize - 1].take().expect("running");
        node.shutdown()
            .await
            .unwrap_or_else(|e| panic!("node {id} did not stop cleanly: {e}"));
    }

    /// The one leader every running node agrees on (other than `not`).
    async fn leader(&self, not: Option<u64>) -> u64 {
        let started = Instant::now();
        loop {
            let leaders: Vec<u64> = self
                .running()
                .filter(|n| n.is_leader())
                .map(Node::id)
                .collect();
            let agreed = self
                .running()
                .all(|n| n.leader() == leaders.first().copied());
            if let [leader] = leaders[..]
                && agreed
                && Some(leader) != not
            {
                println!("leader {leader} after {:?}", started.elapsed());
                return leader;
            }
            assert!(
                started.elapsed() < SETTLE_TIMEOUT,
                "no single leader: {leaders:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until every running node applied exactly `expected`, in that order.
    async fn converged(&self, expected: &[i64]) -> Vec<(u64, i64)> {
        let started = Instant::now();
        loop {
            let histories: Vec<Vec<(u64, i64)>> = self
                .running()
                .map(|n| n.read_local(|t| t.applied.clone()))
                .collect();
            let deltas_match = histories
                .iter()
                .all(|h| h.iter().map(|&(_, d)| d).collect::<Vec<_>>() == expected);
            if deltas_match && histories.windows(2).all(|w| w[0] == w[1]) {
                return histories.into_iter().next().unwrap_or_default();
            }
            assert!(
                started.elapsed() < SETTLE_TIMEOUT,
                "replicas did not converge on {} increments: {histories:?}",
                expected.len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn calls(&self) -> Vec<(u64, Called)> {
        self.calls.lock().unwrap().clone()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.nodes.clear();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// Proposes `deltas` one after another through `node`, checking each acknowledgement.
async fn increment(node: &Node<Tally>, deltas: &[i64], acked: &mut Vec<i64>) {
    for &delta in deltas {
        let before: i64 = acked.iter().sum();
        let (index, total) = node
            .propose(delta)
            .await
            .unwrap_or_else(|e| panic!("increment {delta} through node {}: {e}", node.id()));
        assert_eq!(total, before + delta, "increment {delta} at index {index}");
        acked.push(delta);
    }
}

/// The log's first index in a stopped node's data directory (above 1 once compacted).
fn first_log_index(dir: &Path) -> u64 {
    let store = WalStorage::open(Arc::new(OsDisk), dir, StorageOptions::default())
        .unwrap_or_else(|e| panic!("open {}: {e}", dir.display()));
    use conclave_raft::Storage;
    store.first_index().expect("first index")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_embedded_nodes_replicate_fail_over_and_recover() {
    let mut cluster = Cluster::new();
    for id in 1..=3 {
        cluster.start(id).await;
    }
    let first = cluster.leader(None).await;
    let followers: Vec<u64> = (1..=3).filter(|&id| id != first).collect();

    // Phase 1: increments through the leader are applied in one order everywhere.
    let mut acked = Vec::new();
    let deltas: Vec<i64> = (1..=INCREMENTS).collect();
    increment(cluster.node(first), &deltas, &mut acked).await;
    let history = cluster.converged(&acked).await;
    assert!(history.windows(2).all(|w| w[0].0 < w[1].0));
    // A follower refuses proposals and names the leader.
    match cluster.node(followers[0]).propose(1).await {
        Err(Error::NotLeader { leader }) => assert_eq!(leader, Some(first)),
        other => panic!("a follower accepted a proposal: {other:?}"),
    }
    let sum: i64 = acked.iter().sum();
    let read = cluster.node(followers[1]).read(|t| t.total).await;
    assert_eq!(read.expect("linearizable read on a follower"), sum);

    let calls = cluster.calls();
    println!("callbacks so far: {calls:?}");
    assert!(
        calls
            .iter()
            .any(|&(id, call)| id == first && matches!(call, Called::Leader { .. })),
        "the leader's on_leader callback did not fire: {calls:?}"
    );
    for &id in &followers {
        assert!(
            calls.iter().any(|&(who, call)| who == id
                && matches!(call, Called::Follower { leader, .. } if leader == first)),
            "node {id}'s on_follower callback did not report leader {first}: {calls:?}"
        );
    }
    let first_term = cluster.node(first).status().term;

    // Phase 2: the leader shuts down (handing over); a survivor leads and nothing is lost.
    let mut roles = cluster.node(followers[0]).roles();
    let stop_started = Instant::now();
    cluster.stop(first).await;
    let second = cluster.leader(Some(first)).await;
    println!(
        "leader {first} stopped; {second} leads after {:?}",
        stop_started.elapsed()
    );
    let change = tokio::time::timeout(SETTLE_TIMEOUT, async {
        loop {
            let change = roles.next().await.expect("role stream open");
            if change.leader == Some(second) {
                return change;
            }
        }
    })
    .await
    .expect("the role stream reported the new leader");
    assert_eq!(
        change.role,
        if followers[0] == second {
            Role::Leader
        } else {
            Role::Follower
        }
    );
    let more: Vec<i64> = (INCREMENTS + 1..=2 * INCREMENTS).collect();
    increment(cluster.node(second), &more, &mut acked).await;
    cluster.converged(&acked).await;
    let calls = cluster.calls();
    assert!(
        calls.iter().any(|&(id, call)| id == second
            && matches!(call, Called::Leader { term } if term > first_term)),
        "node {second}'s on_leader callback did not fire for its new term: {calls:?}"
    );

    // Phase 3: the old leader restarts behind a compacted log and catches up by snapshot.
    cluster.start(first).await;
    let rejoin_started = Instant::now();
    let history = cluster.converged(&acked).await;
    println!("node {first} caught up in {:?}", rejoin_started.elapsed());
    assert_eq!(history.len(), acked.len());
    let calls = cluster.calls();
    assert!(
        calls.iter().any(|&(id, call)| id == first
            && matches!(call, Called::Follower { leader, .. } if leader == second)),
        "the restarted node's on_follower callback did not report leader {second}: {calls:?}"
    );
    let sum: i64 = acked.iter().sum();
    assert_eq!(
        cluster.node(first).read(|t| t.total).await.expect("read"),
        sum
    );

    // Phase 4: everything stops; one node alone (no quorum, so no leader and no peer to learn
    // from) must rebuild the whole state from its own snapshot and log.
    for id in 1..=3 {
        cluster.stop(id).await;
    }
    for id in 1..=3 {
        let first_index = first_log_index(&cluster.data_dir(id));
        println!("node {id}: log starts at {first_index}");
        assert!(first_index > 1, "node {id} never compacted its log");
    }
    let lone = followers[1];
    cluster.start(lone).await;
    let restored = cluster.converged(&acked).await;
    assert_eq!(
        restored, history,
        "node {lone} recovered a different history"
    );
    assert_eq!(cluster.node(lone).read_local(|t| t.total), sum);
    assert!(!cluster.node(lone).is_leader());
    cluster.stop(lone).await;
}
