//! `--lease-reads` on a real 3-member cluster: the leader answers linearizable reads from its
//! lease (its `conclave_reads_from_lease_total` counts them; crates/raft/tests/lease_reads.rs
//! and the simulator check the rule itself), and every member still reads every write
//! acknowledged before the read began, across a SIGKILL of the leader; a member restarted with
//! a shorter election timeout is refused by the members that read from a lease.

mod common;

use std::time::Duration;

use common::{Cluster, http_get};
use conclave_proto::etcdserverpb::RangeRequest;

const WAIT: Duration = Duration::from_secs(10);
/// Writes per round; each is read back on every live member at once.
const WRITES_PER_ROUND: usize = 20;

/// A linearizable Range of `key` on member `id`: its value, retried while no leader answers.
async fn linearizable_value(cluster: &Cluster, id: u64, key: &str) -> Option<String> {
    let mut kv = cluster.kv(id).await;
    for _ in 0..200 {
        let mut request = tonic::Request::new(RangeRequest {
            key: key.to_string().into(),
            ..Default::default()
        });
        request.set_timeout(Duration::from_secs(1));
        match kv.range(request).await {
            Ok(answer) => {
                return answer
                    .into_inner()
                    .kvs
                    .first()
                    .map(|kv| String::from_utf8_lossy(&kv.value).into_owned());
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    panic!("member {id} never answered a read of {key}");
}

/// The leader's count of reads answered from its lease.
async fn reads_from_lease(cluster: &Cluster, id: u64) -> f64 {
    let url = format!("{}/metrics", cluster.metrics_url(id));
    let Some((200, scrape)) = http_get(&url).await else {
        panic!("member {id}'s metrics did not answer");
    };
    scrape
        .lines()
        .find_map(|line| line.strip_prefix("conclave_reads_from_lease_total "))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or_else(|| panic!("no conclave_reads_from_lease_total from member {id}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn with_lease_reads_every_member_reads_every_acknowledged_write_across_a_failover() {
    let mut cluster = Cluster::start_with_args(3, &["--lease-reads"]).await;
    let mut leader = cluster.wait_for_leader(WAIT).await;
    for round in 0..2 {
        let live = cluster.live_ids();
        for i in 0..WRITES_PER_ROUND {
            let key = format!("lease-read/{round}/{i}");
            let value = format!("v{round}-{i}");
            // Through each member in turn, so followers forward some of the writes.
            let via = live[i % live.len()];
            cluster.put_until_acked(via, &key, &value, WAIT).await;
            for &id in &live {
                assert_eq!(
                    linearizable_value(&cluster, id, &key).await.as_deref(),
                    Some(value.as_str()),
                    "member {id} read {key} without the write acknowledged before the read \
                     (round {round}, leader {leader})"
                );
            }
        }
        assert!(
            reads_from_lease(&cluster, leader).await > 0.0,
            "leader {leader} answered no read from its lease (round {round})"
        );
        if round == 0 {
            cluster.kill(leader);
            let old = leader;
            leader = cluster.wait_for_leader(WAIT).await;
            assert_ne!(leader, old);
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_member_restarted_with_a_shorter_election_timeout_is_refused_by_lease_readers() {
    let mut cluster = Cluster::start_with_args(3, &["--lease-reads"]).await;
    let leader = cluster.wait_for_leader(WAIT).await;
    let hasty = (1..=3).find(|&id| id != leader).expect("three members");
    cluster.kill(hasty);
    // Without the flag and with 60 ms elections: it would vote 50 ms after hearing from a
    // leader whose lease runs 112 ms.
    let flags: Vec<String> = ["--election-timeout-ms", "60", "--heartbeat-ms", "20"]
        .map(String::from)
        .into();
    cluster.spawn_with_args(hasty, &flags);
    let leader_log = cluster.root.join(format!("node{leader}.log"));
    let hasty_log = cluster.root.join(format!("node{hasty}.log"));
    let refusal = format!("node {hasty} withholds its vote for 50 ms after it hears from a leader");
    let started = std::time::Instant::now();
    let logged = |path: &std::path::Path| {
        std::fs::read_to_string(path).is_ok_and(|log| log.contains(&refusal))
    };
    while !(logged(&leader_log) && logged(&hasty_log)) {
        assert!(
            started.elapsed() < WAIT,
            "no refusal naming the vote windows in {} and {}",
            leader_log.display(),
            hasty_log.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The two members that agree go on serving.
    cluster
        .put_until_acked(leader, "lease-read/after-refusal", "v", WAIT)
        .await;
    assert_eq!(
        linearizable_value(&cluster, leader, "lease-read/after-refusal").await,
        Some("v".to_string())
    );
}
