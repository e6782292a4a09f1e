//! A watcher on a member that catches up by installing the leader's snapshot still receives
//! every revision the snapshot covered: real `conclave serve` processes, one of them paused
//! (SIGSTOP) while the leader writes and compacts its log past it. Both with a write after
//! the catch-up and without one (docs/faults.md, findings 1 and 6). And a waiting call there
//! (an inbox long poll) is woken by the install. And a watch opened on a member after a spell
//! with no subscription there, while the member published none of its applied batches, misses
//! nothing either.

mod common;

use std::collections::BTreeSet;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Cluster, http_get};
use conclave_proto::etcdserverpb::lease_client::LeaseClient;
use conclave_proto::etcdserverpb::watch_client::WatchClient;
use conclave_proto::etcdserverpb::watch_request::RequestUnion;
use conclave_proto::etcdserverpb::{
    LeaseGrantRequest, PutRequest, WatchCreateRequest, WatchRequest, WatchResponse,
};
use tokio::sync::mpsc;
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

/// Writes while the watcher's member is paused: with a snapshot every 50 entries (the
/// harness's `--snapshot-entries`), the leader's log is compacted far past the paused member.
const WRITES: usize = 1000;

fn put(key: &str) -> PutRequest {
    PutRequest {
        key: key.to_string().into(),
        value: "v".into(),
        ..Default::default()
    }
}

fn signal(cluster: &Cluster, id: u64, name: &str) {
    let pid = cluster.nodes[(id - 1) as usize]
        .child
        .as_ref()
        .expect("the member runs")
        .id();
    let status = Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{name} {pid}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_watcher_on_a_member_that_installs_a_snapshot_misses_no_revision() {
    let cluster = Cluster::start(3).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(5)).await;
    let follower = (1..=3).find(|&id| id != leader).expect("a follower");

    let (_requests, mut watch, _) = open_watch(
        &cluster,
        follower,
        WatchCreateRequest {
            key: "gap/".into(),
            range_end: "gap0".into(),
            ..Default::default()
        },
    )
    .await;

    let mut kv = cluster.kv(leader).await;
    kv.put(put("gap/before")).await.expect("put before");
    // The watch is live on the follower before it is cut off.
    let first = tokio::time::timeout(Duration::from_secs(10), watch.message())
        .await
        .expect("the first event in time")
        .expect("the stream open")
        .expect("a response");
    assert_eq!(first.events.len(), 1, "{first:?}");

    signal(&cluster, follower, "STOP");
    for i in 0..WRITES {
        kv.put(put(&format!("gap/{i:04}")))
            .await
            .expect("put with two of three members up");
    }
    signal(&cluster, follower, "CONT");
    cluster
        .wait_caught_up(follower, Duration::from_secs(30))
        .await;
    let log = std::fs::read_to_string(cluster.root.join(format!("node{follower}.log")))
        .expect("the follower's log");
    assert!(
        log.contains("snapshot from the leader installed"),
        "member {follower} caught up without installing a snapshot: the test tests nothing"
    );
    kv.put(put("gap/after")).await.expect("put after");

    let mut keys = BTreeSet::new();
    let mut revisions = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !keys.contains("gap/after") {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(message) = tokio::time::timeout(left, watch.message()).await else {
            panic!(
                "the watcher got {} of the {WRITES} writes made while its member was cut off, \
                 and then nothing",
                keys.len()
            );
        };
        let response = message.expect("the stream open").expect("a response");
        assert!(
            !response.canceled,
            "history is not compacted, so the watch goes on: {response:?}"
        );
        for event in response.events {
            let kv = event.kv.expect("an event's key");
            keys.insert(String::from_utf8(kv.key.to_vec()).expect("utf-8 key"));
            revisions.push(kv.mod_revision);
        }
    }
    let during = keys.iter().filter(|key| *key != "gap/after").count();
    assert_eq!(
        during, WRITES,
        "every write made while the member was cut off"
    );
    assert!(
        revisions.windows(2).all(|pair| pair[1] == pair[0] + 1),
        "one event per revision, in order, none twice or skipped"
    );
    println!("the watcher on member {follower} got all {WRITES} writes across a snapshot install");
}

/// Entries without a KV event written after the puts: with a snapshot every 50 entries, the
/// leader's newest snapshot then covers the last put, so the paused member catches up by that
/// snapshot and entries that carry no event for the watch.
const QUIET_ENTRIES: usize = 150;

/// Finding 6: the watch noticed the revisions a snapshot jumped over only when a later write
/// with an event was applied. When the cluster goes quiet in the KV store after the snapshot
/// (here: only lease grants; in the fault run: the end of the run, with topic drains and
/// session traffic going on), the watcher waited for good for revisions its member held.
#[tokio::test(flavor = "multi_thread")]
async fn a_watcher_gets_the_revisions_of_an_installed_snapshot_with_no_later_write() {
    let cluster = Cluster::start(3).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(5)).await;
    let follower = (1..=3).find(|&id| id != leader).expect("a follower");

    let (requests, mut watch, _) = open_watch(
        &cluster,
        follower,
        WatchCreateRequest {
            key: "quiet/".into(),
            range_end: "quiet0".into(),
            ..Default::default()
        },
    )
    .await;

    let mut kv = cluster.kv(leader).await;
    kv.put(put("quiet/before")).await.expect("put before");
    let first = tokio::time::timeout(Duration::from_secs(10), watch.message())
        .await
        .expect("the first event in time")
        .expect("the stream open")
        .expect("a response");
    assert_eq!(first.events.len(), 1, "{first:?}");

    signal(&cluster, follower, "STOP");
    for i in 0..WRITES {
        kv.put(put(&format!("quiet/{i:04}")))
            .await
            .expect("put with two of three members up");
    }
    let lease_channel = Channel::from_shared(cluster.endpoint(leader))
        .expect("valid endpoint")
        .connect_lazy();
    let mut leases = LeaseClient::new(lease_channel);
    for _ in 0..QUIET_ENTRIES {
        leases
            .lease_grant(LeaseGrantRequest { ttl: 600, id: 0 })
            .await
            .expect("lease grant with two of three members up");
    }
    signal(&cluster, follower, "CONT");
    cluster
        .wait_caught_up(follower, Duration::from_secs(30))
        .await;
    let log = std::fs::read_to_string(cluster.root.join(format!("node{follower}.log")))
        .expect("the follower's log");
    assert!(
        log.contains("snapshot from the leader installed"),
        "member {follower} caught up without installing a snapshot: the test tests nothing"
    );

    // No write follows: what the member holds must reach the watcher anyway.
    let mut revisions = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while revisions.len() < WRITES {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(message) = tokio::time::timeout(left, watch.message()).await else {
            panic!(
                "member {follower} caught up by a snapshot, but its watcher got {} of the \
                 {WRITES} writes made while it was cut off within 20 s, with no write after",
                revisions.len()
            );
        };
        let response = message.expect("the stream open").expect("a response");
        assert!(
            !response.canceled,
            "history is not compacted, so the watch goes on: {response:?}"
        );
        revisions.extend(
            response
                .events
                .iter()
                .map(|event| event.kv.as_ref().map_or(0, |kv| kv.mod_revision)),
        );
    }
    assert_eq!(revisions.len(), WRITES, "no event twice");
    assert!(
        revisions.windows(2).all(|pair| pair[1] == pair[0] + 1),
        "one event per revision, in order, none twice or skipped"
    );
    drop(requests);
    println!(
        "the watcher on member {follower} got all {WRITES} writes of the installed snapshot \
         with no write after it"
    );
}

/// A waiting call on a member that catches up by installing the leader's snapshot is woken
/// by the install: a topic inbox long poll whose message was published while its member was
/// paused, and compacted into the snapshot, answers within seconds of the catch-up. Waits used
/// to re-check only on a batch with an event they wait on, and the install carries none, so
/// this one slept to its deadline and answered empty.
#[tokio::test(flavor = "multi_thread")]
async fn an_inbox_wait_is_answered_by_a_snapshot_install() {
    use conclave_proto::conclave::v1::topic_client::TopicClient;
    use conclave_proto::conclave::v1::{InboxRequest, PublishRequest};

    // The wait must outlast the pause and the catch-up by far: a longer request timeout.
    let cluster = Cluster::start_with_args(3, &["--request-timeout-ms", "60000"]).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(5)).await;
    let follower = (1..=3).find(|&id| id != leader).expect("a follower");
    let topics_on = |id: u64| {
        TopicClient::new(
            Channel::from_shared(cluster.endpoint(id))
                .expect("valid endpoint")
                .connect_lazy(),
        )
    };
    let wait_ms: u32 = 40_000;
    let mut inbox = topics_on(follower);
    let waiting = tokio::spawn(async move {
        let mut request = tonic::Request::new(InboxRequest {
            consumer: "agent-7".into(),
            topics: vec!["orders".into()],
            wait_ms,
            ..Default::default()
        });
        request.set_timeout(Duration::from_secs(55));
        inbox.inbox(request).await
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !waiting.is_finished(),
        "nothing is published yet: the inbox waits"
    );

    signal(&cluster, follower, "STOP");
    // The paused member's socket still takes the leader's first appends, which it applies
    // one by one on resuming; these puts fill that window, so the leader holds back what
    // follows, and the publish reaches the member only inside a snapshot.
    let mut kv = cluster.kv(leader).await;
    for i in 0..WRITES {
        kv.put(put(&format!("before/{i:04}")))
            .await
            .expect("put with two of three members up");
    }
    topics_on(leader)
        .publish(PublishRequest {
            topic: "orders".into(),
            data: "order 1".into(),
            ..Default::default()
        })
        .await
        .expect("publish with two of three members up");
    for i in 0..QUIET_ENTRIES {
        kv.put(put(&format!("after/{i:04}")))
            .await
            .expect("put with two of three members up");
    }
    signal(&cluster, follower, "CONT");
    let resumed = Instant::now();
    cluster
        .wait_caught_up(follower, Duration::from_secs(30))
        .await;
    let log = std::fs::read_to_string(cluster.root.join(format!("node{follower}.log")))
        .expect("the follower's log");
    assert!(
        log.contains("snapshot from the leader installed"),
        "member {follower} caught up without installing a snapshot: the test tests nothing"
    );

    let answer = tokio::time::timeout(Duration::from_secs(50), waiting)
        .await
        .expect("the inbox answers before its own deadline")
        .expect("the waiting task")
        .expect("an inbox answer")
        .into_inner();
    let waited = resumed.elapsed();
    let data: Vec<_> = answer.messages.iter().map(|m| m.data.to_vec()).collect();
    assert_eq!(
        data,
        vec![b"order 1".to_vec()],
        "the message published during the pause"
    );
    assert!(
        waited < Duration::from_secs(15),
        "answered {waited:?} after the member resumed, not at the catch-up (the wait was \
         {wait_ms} ms)"
    );
    println!("the inbox on member {follower} answered {waited:?} after its member resumed");
}

/// Puts in each step of the quiet-spell test.
const STEP_PUTS: usize = 10;

/// Opens a watch on member `id` and waits until it is created; the member's revision then is
/// the last the watch does not report. Dropping both halves ends it.
async fn open_watch(
    cluster: &Cluster,
    id: u64,
    create: WatchCreateRequest,
) -> (
    mpsc::Sender<WatchRequest>,
    tonic::Streaming<WatchResponse>,
    i64,
) {
    let (requests, receiver) = mpsc::channel(4);
    requests
        .send(WatchRequest {
            request_union: Some(RequestUnion::CreateRequest(create)),
        })
        .await
        .expect("queue the create");
    let channel = Channel::from_shared(cluster.endpoint(id))
        .expect("valid endpoint")
        .connect_lazy();
    let mut watch = WatchClient::new(channel)
        .watch(ReceiverStream::new(receiver))
        .await
        .expect("a watch stream")
        .into_inner();
    let created = watch.message().await.expect("created").expect("a response");
    assert!(created.created && !created.canceled, "{created:?}");
    let revision = created.header.as_ref().map_or(0, |header| header.revision);
    (requests, watch, revision)
}

/// The revisions of the next `count` events on `watch`.
async fn next_revisions(
    watch: &mut tonic::Streaming<WatchResponse>,
    count: usize,
    what: &str,
) -> Vec<i64> {
    let mut revisions = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while revisions.len() < count {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(message) = tokio::time::timeout(left, watch.message()).await else {
            panic!("{what}: {} of {count} events within 10 s", revisions.len());
        };
        let response = message.expect("the stream open").expect("a response");
        assert!(!response.canceled, "{what}: {response:?}");
        revisions.extend(
            response
                .events
                .iter()
                .map(|event| event.kv.as_ref().map_or(0, |kv| kv.mod_revision)),
        );
    }
    assert_eq!(revisions.len(), count, "{what}: no event twice");
    revisions
}

/// Member `id`'s `conclave_subscriptions` gauge.
async fn subscriptions(cluster: &Cluster, id: u64) -> u64 {
    let url = format!("{}/metrics", cluster.metrics_url(id));
    let Some((200, body)) = http_get(&url).await else {
        panic!("scrape of member {id} failed");
    };
    body.lines()
        .find_map(|line| line.strip_prefix("conclave_subscriptions "))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or_else(|| panic!("conclave_subscriptions missing from member {id}"))
}

/// Puts `count` keys under `prefix` through `kv`; their revisions.
async fn put_keys(
    kv: &mut conclave_proto::etcdserverpb::kv_client::KvClient<Channel>,
    prefix: &str,
    count: usize,
) -> Vec<i64> {
    let mut revisions = Vec::new();
    for i in 0..count {
        let answer = kv
            .put(put(&format!("{prefix}{i:02}")))
            .await
            .expect("put")
            .into_inner();
        revisions.push(answer.header.expect("a header").revision);
    }
    revisions
}

/// A member publishes its applied batches to its watch hub only while a client subscribes
/// there (`conclave_subscriptions` above 0), so that a hub a past watch started does not wake
/// for every write for good. A watch opened after such a spell, from now or from a revision
/// inside the spell, must still get every event after where it starts, on the leader and on
/// a follower.
#[tokio::test(flavor = "multi_thread")]
async fn a_watch_opened_after_a_spell_without_subscriptions_misses_no_revision() {
    let cluster = Cluster::start(3).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(5)).await;
    let follower = (1..=3).find(|&id| id != leader).expect("a follower");
    let mut kv = cluster.kv(leader).await;
    for member in [follower, leader] {
        let prefix = format!("spell{member}/");
        let create = |start_revision| WatchCreateRequest {
            key: prefix.clone().into(),
            range_end: format!("spell{member}0").into(),
            start_revision,
            ..Default::default()
        };
        // A first watch starts the member's hub, then goes.
        let (requests, mut first, _) = open_watch(&cluster, member, create(0)).await;
        let written = put_keys(&mut kv, &format!("{prefix}a"), 1).await;
        assert_eq!(
            next_revisions(&mut first, 1, "the first watch").await,
            written
        );
        drop((requests, first));
        let start = Instant::now();
        while subscriptions(&cluster, member).await != 0 {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "member {member} still counts a subscription 10 s after its watch closed"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }

        // The spell: writes the member applies with nobody subscribed.
        let spell = put_keys(&mut kv, &format!("{prefix}b"), STEP_PUTS).await;
        // A watch from now alone, then one from inside the spell beside it. A follower may
        // not have applied the whole spell yet when the watch starts: "now" is its revision.
        let (_from_now_requests, mut from_now, now) = open_watch(&cluster, member, create(0)).await;
        let after = put_keys(&mut kv, &format!("{prefix}c"), STEP_PUTS).await;
        let expected: Vec<i64> = (spell.iter().chain(&after))
            .copied()
            .filter(|&revision| revision > now)
            .collect();
        assert_eq!(
            next_revisions(&mut from_now, expected.len(), "the watch from now").await,
            expected,
            "member {member}: the watch opened after the spell, at revision {now}"
        );
        let (_back_requests, mut from_spell, _) =
            open_watch(&cluster, member, create(spell[0])).await;
        let last = put_keys(&mut kv, &format!("{prefix}d"), STEP_PUTS).await;
        assert_eq!(
            next_revisions(&mut from_now, STEP_PUTS, "the watch from now").await,
            last,
            "member {member}: the watch from now, with a second watch beside it"
        );
        let expected: Vec<i64> = [spell, after, last].concat();
        assert_eq!(
            next_revisions(&mut from_spell, expected.len(), "the watch from the spell").await,
            expected,
            "member {member}: the watch from a revision inside the spell"
        );
    }
}
