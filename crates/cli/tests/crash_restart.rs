//! kill -9 of every member under a steady write load, then a restart of them all: the
//! revision never goes backwards and every acknowledged write is there with its value and
//! its revision. Several rounds, so a cluster that already recovered once is killed again
//! (the harness snapshots every 50 entries, so recovery runs from a snapshot plus the log).

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::Cluster;
use conclave_proto::etcdserverpb::kv_client::KvClient;
use conclave_proto::etcdserverpb::{PutRequest, RangeRequest};
use tonic::transport::Channel;

const ROUNDS: usize = 3;
/// Writers, spread over the members (followers forward to the leader).
const WRITERS: u64 = 6;
const WRITE_TIMEOUT: Duration = Duration::from_secs(1);
const RECOVERY_TIMEOUT: Duration = Duration::from_secs(20);

/// A write the cluster acknowledged: its key, value and the revision the answer carried.
#[derive(Debug, Clone)]
struct Acked {
    key: String,
    value: String,
    revision: i64,
}

/// Writes unique keys through member `id` until `stop`, recording every acknowledged one.
async fn writer(
    cluster_endpoint: String,
    round: usize,
    writer: u64,
    stop: Arc<AtomicBool>,
    acked: Arc<Mutex<Vec<Acked>>>,
) -> usize {
    let channel = Channel::from_shared(cluster_endpoint)
        .expect("valid endpoint")
        .connect_lazy();
    let mut kv = KvClient::new(channel);
    let mut failed = 0;
    let mut i = 0u64;
    while !stop.load(Ordering::SeqCst) {
        let key = format!("crash/r{round}/w{writer}/{i:06}");
        let value = format!("value-{round}-{writer}-{i}");
        i += 1;
        let mut request = tonic::Request::new(PutRequest {
            key: key.clone().into(),
            value: value.clone().into(),
            ..Default::default()
        });
        request.set_timeout(WRITE_TIMEOUT);
        match kv.put(request).await {
            Ok(response) => {
                let revision = response.into_inner().header.expect("header").revision;
                acked.lock().expect("acked list").push(Acked {
                    key,
                    value,
                    revision,
                });
            }
            // Unacknowledged: it may or may not be applied; nothing is promised about it.
            Err(_) => {
                failed += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }
    failed
}

async fn linearizable_get(
    cluster: &Cluster,
    kv: &mut KvClient<Channel>,
    id: u64,
    key: &str,
) -> RangeRequestAnswer {
    let deadline = Instant::now() + RECOVERY_TIMEOUT;
    loop {
        let mut request = tonic::Request::new(RangeRequest {
            key: key.to_string().into(),
            ..Default::default()
        });
        request.set_timeout(Duration::from_secs(2));
        match kv.range(request).await {
            Ok(response) => {
                let response = response.into_inner();
                let revision = response.header.expect("header").revision;
                let kv = response.kvs.first().map(|kv| {
                    (
                        String::from_utf8_lossy(&kv.value).into_owned(),
                        kv.mod_revision,
                    )
                });
                return RangeRequestAnswer { revision, kv };
            }
            Err(status) => assert!(
                Instant::now() < deadline,
                "member {id} cannot serve a read of {key} after the restart: {status}; logs in {}",
                cluster.root.display()
            ),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

struct RangeRequestAnswer {
    /// The header's revision: the store's revision when the read was served.
    revision: i64,
    /// The key's value and mod revision, if it exists.
    kv: Option<(String, i64)>,
}

#[tokio::test(flavor = "multi_thread")]
async fn kill_all_members_under_load_and_restart_loses_no_acknowledged_write() {
    let started = Instant::now();
    let mut cluster = Cluster::start(3).await;
    let mut all_acked: Vec<Acked> = Vec::new();
    let mut highest_acked = 0i64;
    for round in 0..ROUNDS {
        let stop = Arc::new(AtomicBool::new(false));
        let acked = Arc::new(Mutex::new(Vec::new()));
        let writers: Vec<_> = (0..WRITERS)
            .map(|w| {
                tokio::spawn(writer(
                    cluster.endpoint(w % 3 + 1),
                    round,
                    w,
                    stop.clone(),
                    acked.clone(),
                ))
            })
            .collect();
        // Vary the moment of the kill between rounds.
        tokio::time::sleep(Duration::from_millis(1_000 + 400 * round as u64)).await;
        let before_kill = acked.lock().expect("acked list").len();
        for id in 1..=3 {
            cluster.kill(id);
        }
        stop.store(true, Ordering::SeqCst);
        let mut unacknowledged = 0;
        for task in writers {
            unacknowledged += task.await.expect("writer task");
        }
        let acked = std::mem::take(&mut *acked.lock().expect("acked list"));
        assert!(
            before_kill > 0,
            "round {round}: no write was acknowledged before the kill; logs in {}",
            cluster.root.display()
        );
        let round_highest = acked.iter().map(|a| a.revision).max().unwrap_or(0);
        assert!(
            round_highest > highest_acked,
            "round {round}: revisions did not advance past {highest_acked}"
        );
        highest_acked = round_highest;
        all_acked.extend(acked.iter().cloned());

        let restart = Instant::now();
        for id in 1..=3 {
            cluster.spawn(id);
        }
        let leader = cluster.wait_for_leader(RECOVERY_TIMEOUT).await;
        let elected_ms = restart.elapsed().as_millis();
        // Every member reports at least the highest acknowledged revision (linearizable reads,
        // so each waits until it has applied what the new leader committed).
        let mut reported = Vec::new();
        for id in 1..=3 {
            let mut kv = cluster.kv(id).await;
            let answer = linearizable_get(&cluster, &mut kv, id, "crash/none").await;
            assert!(
                answer.revision >= highest_acked,
                "round {round}: member {id} reports revision {} after the restart, below the \
                 acknowledged {highest_acked}; logs in {}",
                answer.revision,
                cluster.root.display()
            );
            reported.push(answer.revision);
        }
        let mut kv = cluster.kv(leader).await;
        let fresh = kv
            .put(PutRequest {
                key: format!("crash/after-round-{round}").into(),
                value: "x".into(),
                ..Default::default()
            })
            .await
            .expect("a write after the restart")
            .into_inner()
            .header
            .expect("header")
            .revision;
        assert!(
            fresh > highest_acked,
            "round {round}: a new write got revision {fresh}, not above the acknowledged \
             {highest_acked}"
        );
        highest_acked = fresh;
        println!(
            "round {round}: {} writes acknowledged ({} refused or timed out around the kill), \
             highest acknowledged revision {round_highest}; after restart: leader {leader} \
             elected in {elected_ms} ms, members report revisions {reported:?}, next write \
             revision {fresh}",
            acked.len(),
            unacknowledged,
        );
    }

    // Every acknowledged write of every round, with its value and the revision it was given,
    // read linearizably through the members in turn.
    let mut clients = Vec::new();
    for id in 1..=3 {
        clients.push(cluster.kv(id).await);
    }
    for (n, acked) in all_acked.iter().enumerate() {
        let id = n as u64 % 3 + 1;
        let kv = &mut clients[(id - 1) as usize];
        let answer = linearizable_get(&cluster, kv, id, &acked.key).await;
        match answer.kv {
            Some((value, mod_revision)) => {
                assert_eq!(value, acked.value, "{} has another value", acked.key);
                assert_eq!(
                    mod_revision, acked.revision,
                    "{} was acknowledged at revision {} but is stored at {mod_revision}",
                    acked.key, acked.revision
                );
            }
            None => panic!(
                "acknowledged write {} (revision {}) is missing after the restarts; logs in {}",
                acked.key,
                acked.revision,
                cluster.root.display()
            ),
        }
    }
    println!(
        "{ROUNDS} kill/restart rounds: {} acknowledged writes all present with their values and \
         revisions; test took {:.1} s",
        all_acked.len(),
        started.elapsed().as_secs_f64()
    );
}
