//! A client-resumed watch keeps delivering when the member its stream is on is paused
//! (SIGSTOP) and continued (docs/faults.md, finding 7): every write made during and after the
//! pause reaches the watcher, in order, whether the watch moved to another member or stayed.

mod common;

use std::time::{Duration, Instant};

use common::{Cluster, Paused};
use conclave_client::{Client, ClientOptions, WatchOptions};

/// Writes made while the watcher's member is stopped, then as many after it is continued.
const WRITES: usize = 20;
/// How long the member stays stopped: past the client's 2 s silence check, as in the run.
const PAUSE: Duration = Duration::from_millis(3000);

#[tokio::test(flavor = "multi_thread")]
async fn a_resumed_watch_delivers_every_write_across_a_pause_of_its_follower() {
    watch_across_a_pause(false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_resumed_watch_delivers_every_write_across_a_pause_of_its_leader() {
    watch_across_a_pause(true).await;
}

/// Watches on one member, stops it for [`PAUSE`] while writes go through another, continues
/// it, writes again, and checks the watcher got every write. With `watch_leader` the stopped
/// member is the leader (the others elect a new one during the pause).
async fn watch_across_a_pause(watch_leader: bool) {
    let cluster = Cluster::start(3).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(5)).await;
    let follower = (1..=3).find(|&id| id != leader).expect("a follower");
    let (watched, writer) = if watch_leader {
        (leader, follower)
    } else {
        (follower, leader)
    };
    let other = (1..=3)
        .find(|&id| id != watched && id != writer)
        .expect("a third member");

    // The watched member first, so the stream starts there.
    let endpoints = vec![
        cluster.endpoint(watched),
        cluster.endpoint(other),
        cluster.endpoint(writer),
    ];
    let options = ClientOptions {
        request_timeout: Duration::from_secs(3),
        connect_timeout: Duration::from_millis(500),
        ..ClientOptions::default()
    };
    let client = Client::connect_with(&endpoints, options)
        .await
        .expect("connect to the follower");
    let mut watcher = client
        .watch("pw/", WatchOptions::prefix())
        .await
        .expect("a watch");
    cluster
        .put_until_acked(writer, "pw/first", "v", Duration::from_secs(10))
        .await;
    let first = tokio::time::timeout(Duration::from_secs(10), watcher.next())
        .await
        .expect("the first event in time")
        .expect("the watch goes on")
        .expect("an event");
    assert_eq!(first.kv.key_str(), "pw/first");

    let pid = cluster.nodes[(watched - 1) as usize]
        .child
        .as_ref()
        .expect("the watched member runs")
        .id();
    let paused = Paused::new(pid);
    let pause_ends = Instant::now() + PAUSE;
    for i in 0..WRITES {
        cluster
            .put_until_acked(writer, &format!("pw/{i:02}"), "v", Duration::from_secs(20))
            .await;
    }
    tokio::time::sleep_until(pause_ends.into()).await;
    drop(paused);
    for i in WRITES..2 * WRITES {
        cluster
            .put_until_acked(writer, &format!("pw/{i:02}"), "v", Duration::from_secs(20))
            .await;
    }

    // A put retried after a lost answer may apply twice, so count distinct keys.
    let mut keys: Vec<String> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while keys.len() < 2 * WRITES {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(next) = tokio::time::timeout(left, watcher.next()).await else {
            panic!(
                "the watcher got {} of the {} writes made during and after its member's \
                 pause within 20 s",
                keys.len(),
                2 * WRITES
            );
        };
        let event = next.expect("the watch goes on").expect("an event");
        let key = event.kv.key_str().to_string();
        if key != "pw/first" && !keys.contains(&key) {
            keys.push(key);
        }
    }
    let expected: Vec<String> = (0..2 * WRITES).map(|i| format!("pw/{i:02}")).collect();
    assert_eq!(keys, expected, "every write, in order");
    println!(
        "the watch delivered all {} writes across its member's pause",
        2 * WRITES
    );
}
