//! Failover under a steady write load, over many trials: SIGKILL the leader of a 3-node
//! cluster while a writer keeps putting through a follower, and measure from the last write
//! acknowledged before the kill to the first one acknowledged after it (answers already in
//! flight when the leader died do not count: the longest silence is measured). Every acknowledged
//! write must survive. The figures are printed (docs/performance.md quotes them); the only
//! bound asserted is the generous one of issue 5 (5 s).
//!
//! `CONCLAVE_FAILOVER_TRIALS` sets the number of trials (default 20).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::Cluster;
use conclave_proto::etcdserverpb::{PutRequest, RangeRequest};

const TRIALS_DEFAULT: usize = 20;
/// Writes before the kill, so the writer is in its steady state when the leader dies.
const STEADY_BEFORE_KILL: Duration = Duration::from_millis(300);
/// Each put's own deadline; the server retries across the leader change within it.
const PUT_TIMEOUT: Duration = Duration::from_secs(2);
/// The bound issue 5 sets; the measured figures are far below it.
const FAILOVER_BOUND: Duration = Duration::from_secs(5);

/// One acknowledged put: when the answer arrived, and its key.
type Ack = (Instant, String);

/// Puts `{prefix}{n}` for n = 0, 1, … through member `via` until `stop`, one at a time.
async fn steady_writer(
    mut kv: conclave_proto::etcdserverpb::kv_client::KvClient<tonic::transport::Channel>,
    prefix: String,
    stop: Arc<AtomicBool>,
) -> Vec<Ack> {
    let mut acks = Vec::new();
    let mut n = 0u64;
    while !stop.load(Ordering::SeqCst) {
        let key = format!("{prefix}{n:06}");
        n += 1;
        let mut request = tonic::Request::new(PutRequest {
            key: key.clone().into(),
            value: "v".into(),
            ..Default::default()
        });
        request.set_timeout(PUT_TIMEOUT);
        if kv.put(request).await.is_ok() {
            acks.push((Instant::now(), key));
        }
    }
    acks
}

fn percentile(sorted: &[Duration], fraction: f64) -> Duration {
    let index = ((sorted.len() as f64 - 1.0) * fraction).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

#[tokio::test(flavor = "multi_thread")]
async fn leader_kill_under_steady_writes_fails_over_fast_and_loses_nothing() {
    let trials: usize = std::env::var("CONCLAVE_FAILOVER_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(TRIALS_DEFAULT);
    failover_trials(Cluster::start(3).await, trials).await;
}

/// The same with client TLS and peer mutual TLS on every member (fewer trials: the plaintext
/// run above is the one that measures).
#[tokio::test(flavor = "multi_thread")]
async fn leader_kill_with_tls_on_both_ports_fails_over_and_loses_nothing() {
    failover_trials(Cluster::start_tls(3).await, TLS_TRIALS).await;
}

/// Trials of the TLS variant.
const TLS_TRIALS: usize = 5;

async fn failover_trials(mut cluster: Cluster, trials: usize) {
    let mut failovers = Vec::new();
    let mut acknowledged: Vec<String> = Vec::new();

    for trial in 0..trials {
        let leader = cluster.wait_for_leader(Duration::from_secs(10)).await;
        let via = (1..=3).find(|&id| id != leader).expect("a follower");
        let stop = Arc::new(AtomicBool::new(false));
        let writer = tokio::spawn(steady_writer(
            cluster.kv(via).await,
            format!("trial{trial:02}/"),
            stop.clone(),
        ));
        tokio::time::sleep(STEADY_BEFORE_KILL).await;
        let killed_at = Instant::now();
        cluster.kill(leader);
        // Only live nodes are asked, so this is the new leader; then let the writer get a few
        // writes through it.
        cluster.wait_for_leader(FAILOVER_BOUND * 2).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        stop.store(true, Ordering::SeqCst);
        let acks = writer.await.expect("writer task");

        // The writer waits for each answer, so its acknowledgements are in time order. An
        // answer already on its way when the leader died can arrive just after the kill; the
        // failover is the longest silence from the last acknowledgement before the kill on.
        let times: Vec<Instant> = acks.iter().map(|(at, _)| *at).collect();
        let last_before = times
            .iter()
            .rposition(|at| *at < killed_at)
            .expect("writes were acknowledged before the kill");
        assert!(
            times.last().is_some_and(|at| *at > killed_at),
            "trial {trial}: no write acknowledged after the kill"
        );
        let failover = times[last_before..]
            .windows(2)
            .map(|pair| pair[1] - pair[0])
            .max()
            .expect("an acknowledgement after the kill");
        println!(
            "trial {trial:2}: killed leader {leader}, writes through {via}: failover {} ms ({} writes acknowledged)",
            failover.as_millis(),
            acks.len()
        );
        assert!(
            failover < FAILOVER_BOUND,
            "trial {trial}: failover took {failover:?}"
        );
        failovers.push(failover);
        acknowledged.extend(acks.into_iter().map(|(_, key)| key));

        // Bring the killed node back and let it catch up before the next trial, so every
        // trial starts from a healthy three-node cluster.
        cluster.spawn(leader);
        let last_key = acknowledged.last().expect("an acknowledged key").clone();
        let mut kv = cluster.kv(leader).await;
        let caught_up_by = Instant::now() + Duration::from_secs(20);
        loop {
            let read = kv
                .range(RangeRequest {
                    key: last_key.clone().into(),
                    serializable: true,
                    ..Default::default()
                })
                .await;
            if matches!(&read, Ok(r) if r.get_ref().count == 1) {
                break;
            }
            assert!(
                Instant::now() < caught_up_by,
                "restarted node {leader} did not catch up: {read:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    // No acknowledged write was lost: each one is on every member (serializable reads, so
    // each member answers from its own state, after the cluster has settled).
    let leader = cluster.wait_for_leader(Duration::from_secs(10)).await;
    let mut kv = cluster.kv(leader).await;
    let newest = kv
        .range(RangeRequest {
            key: acknowledged
                .last()
                .expect("acknowledged writes")
                .clone()
                .into(),
            ..Default::default()
        })
        .await
        .expect("linearizable read of the newest key")
        .into_inner();
    assert_eq!(newest.count, 1);
    let settle_by = Instant::now() + Duration::from_secs(20);
    for id in 1..=3 {
        let mut kv = cluster.kv(id).await;
        loop {
            let all = kv
                .range(RangeRequest {
                    key: "trial".into(),
                    range_end: "triam".into(),
                    keys_only: true,
                    serializable: true,
                    ..Default::default()
                })
                .await
                .expect("range on every member")
                .into_inner();
            let present: std::collections::HashSet<Vec<u8>> =
                all.kvs.iter().map(|kv| kv.key.to_vec()).collect();
            let missing: Vec<&String> = acknowledged
                .iter()
                .filter(|key| !present.contains(key.as_bytes()))
                .collect();
            if missing.is_empty() {
                break;
            }
            assert!(
                Instant::now() < settle_by,
                "member {id} lacks {} acknowledged writes, e.g. {:?}",
                missing.len(),
                &missing[..missing.len().min(5)]
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    failovers.sort();
    println!(
        "failover over {} trials (SIGKILL of the leader, last ack before to first ack after): min {} ms, median {} ms, p90 {} ms, max {} ms; {} acknowledged writes all present on every member",
        failovers.len(),
        failovers[0].as_millis(),
        percentile(&failovers, 0.5).as_millis(),
        percentile(&failovers, 0.9).as_millis(),
        failovers[failovers.len() - 1].as_millis(),
        acknowledged.len()
    );
}
