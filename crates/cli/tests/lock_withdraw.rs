//! A dropped Lock call withdraws its waiter's key only while that key is still waiting.
//!
//! Lock is idempotent under one lease: a client that gives up on a call and retries on another
//! member gets the same key back. If the first call's member was paused with the call waiting
//! on it, it notices the cancellation only when continued, possibly after the retry was told
//! it holds the lock; withdrawing the key then would hand the lock to the next waiter while the
//! holder's lease is still valid (the fault suite's campaign saw two holders at once this way).

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{Cluster, Paused};
use conclave_proto::etcdserverpb::lease_client::LeaseClient;
use conclave_proto::etcdserverpb::{LeaseGrantRequest, RangeRequest};
use conclave_proto::v3lockpb::lock_client::LockClient;
use conclave_proto::v3lockpb::{LockRequest, UnlockRequest};
use tonic::transport::Channel;

const NAME: &str = "withdraw-lock";

fn channel(cluster: &Cluster, id: u64) -> Channel {
    Channel::from_shared(cluster.endpoint(id))
        .expect("valid endpoint")
        .connect_lazy()
}

async fn grant(cluster: &Cluster, via: u64) -> i64 {
    LeaseClient::new(channel(cluster, via))
        .lease_grant(LeaseGrantRequest { ttl: 60, id: 0 })
        .await
        .expect("grant")
        .into_inner()
        .id
}

/// Sends a Lock call on its own connection to `via` and leaves it running.
fn lock_call(
    cluster: &Cluster,
    via: u64,
    lease: i64,
) -> tokio::task::JoinHandle<Result<Bytes, tonic::Status>> {
    let mut client = LockClient::new(channel(cluster, via));
    tokio::spawn(async move {
        client
            .lock(LockRequest {
                name: NAME.into(),
                lease,
            })
            .await
            .map(|answer| answer.into_inner().key)
    })
}

/// Whether `key` exists, by a linearizable read through `via` (retried for a few seconds).
async fn exists(cluster: &Cluster, via: u64, key: &Bytes) -> bool {
    let start = Instant::now();
    loop {
        let mut kv = cluster.kv(via).await;
        let read = kv.range(RangeRequest {
            key: key.clone(),
            ..Default::default()
        });
        if let Ok(Ok(answer)) = tokio::time::timeout(Duration::from_secs(1), read).await {
            return !answer.into_inner().kvs.is_empty();
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no answer from {via}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn lock_key(lease: i64) -> Bytes {
    Bytes::from(format!("{NAME}/{lease:x}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dropped_lock_call_never_withdraws_a_key_its_retry_holds() {
    let cluster = Cluster::start(3).await;
    let old = cluster.wait_for_leader(Duration::from_secs(10)).await;
    let holder = grant(&cluster, old).await;
    let waiter = grant(&cluster, old).await;
    let behind = grant(&cluster, old).await;
    let held = lock_call(&cluster, old, holder)
        .await
        .expect("task")
        .expect("first lock is free");
    assert_eq!(held, lock_key(holder));

    // The waiter's first call waits on the leader; a second waiter queues behind it.
    let first = lock_call(&cluster, old, waiter);
    let queued = Instant::now();
    while !exists(&cluster, old, &lock_key(waiter)).await {
        assert!(
            queued.elapsed() < Duration::from_secs(10),
            "waiter never queued"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let third = lock_call(&cluster, old, behind);
    while !exists(&cluster, old, &lock_key(behind)).await {
        assert!(
            queued.elapsed() < Duration::from_secs(10),
            "third never queued"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The leader stops with both calls waiting on it; both clients give up (their cancellations
    // wait in its socket) and the waiter retries on the new leader.
    let pid = cluster.nodes[(old - 1) as usize]
        .child
        .as_ref()
        .expect("leader running")
        .id();
    let paused = Paused::new(pid);
    first.abort();
    third.abort();
    let others: Vec<u64> = cluster
        .live_ids()
        .into_iter()
        .filter(|&id| id != old)
        .collect();
    let start = Instant::now();
    let new = loop {
        let mut leader = None;
        for &id in &others {
            if let Some(status) = cluster.status(id).await
                && status.header.map(|h| h.member_id) == Some(status.leader)
            {
                leader = Some(id);
            }
        }
        if let Some(leader) = leader {
            break leader;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no new leader while {old} was paused"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let retry = lock_call(&cluster, new, waiter);
    LockClient::new(channel(&cluster, new))
        .unlock(UnlockRequest { key: held })
        .await
        .expect("holder unlocks");
    let got = tokio::time::timeout(Duration::from_secs(10), retry)
        .await
        .expect("the retry is answered once the holder unlocked")
        .expect("task")
        .expect("the retry holds the lock");
    assert_eq!(got, lock_key(waiter), "the retry got the waiter's key back");

    // The old leader is continued and sees both cancellations. The waiter's key now owns the
    // lock and its holder was told so: it must stay. The third key is still waiting: it goes.
    drop(paused);
    let continued = Instant::now();
    let mut third_gone = false;
    while continued.elapsed() < Duration::from_secs(5) {
        assert!(
            exists(&cluster, new, &lock_key(waiter)).await,
            "the holder's lock key was withdrawn by its abandoned first call {:?} after {old} was continued",
            continued.elapsed()
        );
        third_gone = third_gone || !exists(&cluster, new, &lock_key(behind)).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        third_gone,
        "the abandoned call of a key still waiting did not withdraw it"
    );
}
