//! A client-resumed watch does not settle on a member that knows no leader (docs/faults.md,
//! finding 6). Such a member — here the survivor of a second cluster whose other members are
//! gone, in the fault run a replacement member that could not join — accepts the watch, answers
//! HTTP/2 pings and Status, and applies nothing, so a stream there is silent for good.

mod common;

use std::time::{Duration, Instant};

use common::Cluster;
use conclave_client::{Client, ClientOptions, WatchOptions};

/// Writes made after the watcher's member was killed; every one must reach the watcher.
const WRITES: usize = 20;

#[tokio::test(flavor = "multi_thread")]
async fn a_resumed_watch_leaves_a_member_that_knows_no_leader() {
    let mut cluster = Cluster::start(3).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(5)).await;

    // A member that answers but knows no leader: the last one of a cluster of three.
    let mut stranded = Cluster::start(3).await;
    stranded.kill(2);
    stranded.kill(3);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let status = stranded.status(1).await;
        if status.as_ref().is_some_and(|s| s.leader == 0) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the survivor still names a leader: the test tests nothing ({status:?})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The leader first, so the watch starts there; the stranded member next, so the resume
    // after the leader dies tries it first (the client moves on to the endpoint after the one
    // that failed), as the fault run's resume tried the member after the killed one.
    let endpoints = vec![cluster.endpoint(leader), stranded.endpoint(1)];
    let options = ClientOptions {
        request_timeout: Duration::from_secs(3),
        connect_timeout: Duration::from_millis(500),
        ..ClientOptions::default()
    };
    let client = Client::connect_with(&endpoints, options)
        .await
        .expect("connect to the leader");
    let mut watcher = client
        .watch("lw/", WatchOptions::prefix())
        .await
        .expect("a watch");
    cluster
        .put_until_acked(leader, "lw/first", "v", Duration::from_secs(10))
        .await;
    let first = tokio::time::timeout(Duration::from_secs(10), watcher.next())
        .await
        .expect("the first event in time")
        .expect("the watch goes on")
        .expect("an event");
    assert_eq!(first.kv.key_str(), "lw/first");

    cluster.kill(leader);
    let survivor = (1..=3).find(|&id| id != leader).expect("a survivor");
    for i in 0..WRITES {
        cluster
            .put_until_acked(
                survivor,
                &format!("lw/{i:02}"),
                "v",
                Duration::from_secs(20),
            )
            .await;
    }

    // A put retried after a lost answer may apply twice, so count distinct keys.
    let mut keys: Vec<String> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while keys.len() < WRITES {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(next) = tokio::time::timeout(left, watcher.next()).await else {
            panic!(
                "the watcher got {} of the {WRITES} writes made after its member was killed \
                 within 20 s: its stream stayed on a member that knows no leader",
                keys.len()
            );
        };
        let event = next.expect("the watch goes on").expect("an event");
        let key = event.kv.key_str().to_string();
        if key != "lw/first" && !keys.contains(&key) {
            keys.push(key);
        }
    }
    let expected: Vec<String> = (0..WRITES).map(|i| format!("lw/{i:02}")).collect();
    assert_eq!(keys, expected, "every write, in order");
    println!("the resumed watch left the leaderless member and got all {WRITES} writes");
}
