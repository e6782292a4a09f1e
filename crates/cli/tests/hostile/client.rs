//! Hostile input on the client port: another client's session, runaway sequence numbers, an
//! Inbox naming one topic 30,000 times, a Range over a big prefix, and crowds of connections, streams, watches,
//! keepalive streams, topic subscriptions, election observers and waiting Lock and Campaign
//! calls beyond their caps. Each test runs a single member with small caps (serve
//! flags), sends what no honest client would with raw gRPC from `conclave_proto`, then checks
//! that the node still answers, that acknowledged writes are intact, that a put completes
//! within [`PUT_BOUND`] and, for exhaustion, that the node's RSS stayed under [`RSS_BOUND_KB`].

use std::time::{Duration, Instant};

use conclave_proto::conclave::v1::election_client::ElectionClient as GroupClient;
use conclave_proto::conclave::v1::session_client::SessionClient;
use conclave_proto::conclave::v1::topic_client::TopicClient;
use conclave_proto::conclave::v1::{
    CampaignRequest as GroupCampaignRequest, CandidatesRequest, InboxRequest, ObserveRequest,
    OpenSessionRequest, PublishRequest, SubscribeRequest,
};
use conclave_proto::etcdserverpb::kv_client::KvClient;
use conclave_proto::etcdserverpb::lease_client::LeaseClient;
use conclave_proto::etcdserverpb::request_op::Request;
use conclave_proto::etcdserverpb::watch_client::WatchClient;
use conclave_proto::etcdserverpb::watch_request::RequestUnion;
use conclave_proto::etcdserverpb::{
    LeaseGrantRequest, LeaseKeepAliveRequest, PutRequest, RangeRequest, RequestOp, TxnRequest,
    WatchCreateRequest, WatchRequest, WatchResponse,
};
use conclave_proto::v3electionpb::election_client::ElectionClient as EtcdElectionClient;
use conclave_proto::v3electionpb::{
    CampaignRequest as EtcdCampaignRequest, LeaderRequest as EtcdLeaderRequest,
};
use conclave_proto::v3lockpb::LockRequest;
use conclave_proto::v3lockpb::lock_client::LockClient;
use tokio::io::AsyncReadExt;
use tokio::sync::mpsc;
use tonic::Code;
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

use crate::common::Cluster;

/// A put after the attack must be acknowledged within this.
const PUT_BOUND: Duration = Duration::from_secs(2);
/// The node's resident memory after an exhaustion attempt stays under this (an idle node uses
/// about 20 MB; the Inbox attack without its guards went to 8.4 GB).
const RSS_BOUND_KB: u64 = 300 * 1024;

const SESSION_CLIENT: &str = "conclave-session-client";
const SESSION_SEQ: &str = "conclave-session-seq";
const SESSION_SECRET: &str = "conclave-session-secret";

fn channel(cluster: &Cluster) -> Channel {
    Channel::from_shared(cluster.endpoint(1))
        .expect("valid endpoint")
        .connect_lazy()
}

fn rss_kb(cluster: &Cluster) -> u64 {
    let pid = cluster.nodes[0].child.as_ref().expect("running").id();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

/// The node answers, `key` still holds `value`, and a new put completes within the bound.
async fn assert_healthy(cluster: &Cluster, key: &str, value: &str) {
    let mut kv = cluster.kv(1).await;
    let range = kv
        .range(RangeRequest {
            key: key.to_string().into(),
            ..Default::default()
        })
        .await
        .expect("the node answers a read")
        .into_inner();
    let held = range.kvs.first().map(|kv| kv.value.to_vec());
    assert_eq!(
        held.as_deref(),
        Some(value.as_bytes()),
        "acknowledged write"
    );
    let start = Instant::now();
    let mut put = tonic::Request::new(PutRequest {
        key: "after".into(),
        value: "attack".into(),
        ..Default::default()
    });
    put.set_timeout(PUT_BOUND);
    kv.put(put).await.expect("a put after the attack");
    assert!(
        start.elapsed() < PUT_BOUND,
        "put took {:?}",
        start.elapsed()
    );
}

async fn start(extra_args: &[&str]) -> Cluster {
    let cluster = Cluster::start_with_args(1, extra_args).await;
    cluster.wait_for_leader(Duration::from_secs(10)).await;
    cluster
        .put_until_acked(1, "acked", "before", Duration::from_secs(5))
        .await;
    cluster
}

/// A session as OpenSession answered it.
#[derive(Clone, Copy)]
struct Session {
    client_id: u64,
    secret: Option<u128>,
}

async fn open_session(cluster: &Cluster) -> Session {
    let opened = SessionClient::new(channel(cluster))
        .open_session(OpenSessionRequest {})
        .await
        .expect("open")
        .into_inner();
    let secret: [u8; 16] = opened.session_secret[..].try_into().expect("16 bytes");
    Session {
        client_id: opened.client_id,
        secret: Some(u128::from_be_bytes(secret)),
    }
}

/// A put with `prev_kv` at `seq` in `session`.
async fn session_put(
    cluster: &Cluster,
    session: Session,
    seq: u64,
    value: &str,
) -> Result<Option<String>, tonic::Status> {
    let mut request = tonic::Request::new(PutRequest {
        key: "sessioned".into(),
        value: value.to_string().into(),
        prev_kv: true,
        ..Default::default()
    });
    request.set_timeout(Duration::from_secs(3));
    let metadata = request.metadata_mut();
    metadata.insert(SESSION_CLIENT, session.client_id.into());
    metadata.insert(SESSION_SEQ, seq.into());
    if let Some(secret) = session.secret {
        let hex = format!("{secret:032x}");
        metadata.insert(SESSION_SECRET, hex.parse().expect("ASCII"));
    }
    let answer = cluster.kv(1).await.put(request).await?.into_inner();
    Ok(answer
        .prev_kv
        .map(|kv| String::from_utf8_lossy(&kv.value).into_owned()))
}

#[tokio::test(flavor = "multi_thread")]
async fn another_clients_session_id_does_not_read_its_cached_answer() {
    let cluster = start(&[]).await;
    let owner = open_session(&cluster).await;
    session_put(&cluster, owner, 1, "private-1")
        .await
        .expect("put 1");
    let cached = session_put(&cluster, owner, 2, "private-2")
        .await
        .expect("put 2");
    assert_eq!(cached.as_deref(), Some("private-1"));
    // The attacker knows (or guesses) the client id, which is a small log index, and
    // replays the owner's last sequence number: without the secret, or with a wrong one.
    for secret in [None, Some(0), Some(1), owner.secret.map(|s| s ^ 1)] {
        let attacker = Session {
            client_id: owner.client_id,
            secret,
        };
        match session_put(&cluster, attacker, 2, "attacker").await {
            Err(status) => assert_eq!(status.code(), Code::NotFound, "{status:?}"),
            Ok(leaked) => panic!("the attacker's replay was answered: {leaked:?}"),
        }
    }
    // The owner's retry still gets its own answer, and the value is the owner's.
    let retry = session_put(&cluster, owner, 2, "private-2").await;
    assert_eq!(retry.expect("owner retry").as_deref(), Some("private-1"));
    assert_healthy(&cluster, "sessioned", "private-2").await;
    assert_healthy(&cluster, "acked", "before").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sequence_number_of_u64_max_does_not_block_the_real_client() {
    let cluster = start(&[]).await;
    let owner = open_session(&cluster).await;
    session_put(&cluster, owner, 1, "one").await.expect("put 1");
    // Another client pushes the owner's session to u64::MAX, without and with a guess.
    for secret in [None, Some(7)] {
        let attacker = Session {
            client_id: owner.client_id,
            secret,
        };
        let refused = session_put(&cluster, attacker, u64::MAX, "x").await;
        assert_eq!(refused.expect_err("refused").code(), Code::NotFound);
    }
    // Even the owner's own jump is refused (at most 2^20 ahead), and it carries on at 2.
    let jump = session_put(&cluster, owner, u64::MAX, "jump").await;
    let jump = jump.expect_err("too far ahead");
    assert_eq!(jump.code(), Code::InvalidArgument, "{jump:?}");
    assert!(jump.message().contains("too far ahead"), "{jump:?}");
    let next = session_put(&cluster, owner, 2, "two").await;
    assert_eq!(next.expect("the owner goes on").as_deref(), Some("one"));
    assert_healthy(&cluster, "sessioned", "two").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_inbox_naming_one_topic_30000_times_copies_it_once() {
    let cluster = start(&["--topics-per-request-max", "64"]).await;
    let mut topics = TopicClient::new(channel(&cluster));
    for i in 0..50 {
        topics
            .publish(PublishRequest {
                topic: "t".into(),
                data: vec![i as u8; 4096].into(),
                from: String::new(),
            })
            .await
            .expect("publish");
    }
    let before_kb = rss_kb(&cluster);
    let start_inbox = Instant::now();
    let answer = topics
        .inbox(InboxRequest {
            consumer: "c".into(),
            topics: vec!["t".into(); 30_000],
            limit: 0,
            ack: false,
            wait_ms: 0,
        })
        .await
        .expect("the deduplicated inbox")
        .into_inner();
    assert!(start_inbox.elapsed() < Duration::from_secs(2));
    let mut seqs: Vec<u64> = answer.messages.iter().map(|m| m.seq).collect();
    let returned = seqs.len();
    seqs.dedup();
    assert_eq!(seqs.len(), returned, "each message once");
    assert!((1..=50).contains(&returned), "{returned} messages");
    // Many distinct topics: refused with one sentence.
    let many: Vec<String> = (0..65).map(|i| format!("t{i}")).collect();
    let refused = topics
        .inbox(InboxRequest {
            consumer: "c".into(),
            topics: many,
            ..Default::default()
        })
        .await
        .expect_err("over the cap");
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    let after_kb = rss_kb(&cluster);
    assert!(
        after_kb < RSS_BOUND_KB,
        "RSS {before_kb} kB -> {after_kb} kB"
    );
    assert_healthy(&cluster, "acked", "before").await;
}

/// Whether the server has closed `stream` by now (what it wrote first is read and skipped).
fn closed_now(stream: &tokio::net::TcpStream) -> bool {
    let mut buffer = [0u8; 4096];
    loop {
        match stream.try_read(&mut buffer) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(_) => return true,
        }
    }
}

/// Whether the server closed `stream` within `within` (EOF or an error; what the server
/// writes first, its HTTP/2 SETTINGS, is read and skipped).
async fn closed_within(stream: &mut tokio::net::TcpStream, within: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    let mut buffer = [0u8; 4096];
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buffer)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn connections_beyond_the_cap_are_closed_and_idle_ones_time_out() {
    const CAP: usize = 40;
    const OPENED: usize = 200;
    let cluster = start(&[
        "--client-connections-max",
        "40",
        "--client-idle-timeout-ms",
        "1500",
    ])
    .await;
    let address = cluster.nodes[0].client.clone();
    let mut idle = Vec::new();
    for _ in 0..OPENED {
        idle.push(
            tokio::net::TcpStream::connect(&address)
                .await
                .expect("connect"),
        );
    }
    // Beyond the cap: closed at once. (The harness's own channel may hold a slot or two.)
    tokio::time::sleep(Duration::from_millis(300)).await;
    let closed_at_once = idle.iter().filter(|stream| closed_now(stream)).count();
    assert!(
        closed_at_once >= OPENED - CAP,
        "{closed_at_once} of {OPENED} closed at once"
    );
    // The silent rest: closed after the idle timeout.
    for stream in &mut idle {
        assert!(
            closed_within(stream, Duration::from_secs(4)).await,
            "idle kept"
        );
    }
    // A live client that answers pings keeps its idle connection: a watch opened now still
    // delivers an event after twice the idle timeout.
    let (requests, receiver) = mpsc::channel(4);
    requests
        .send(create_watch("acked"))
        .await
        .expect("queue the create");
    let mut watch = WatchClient::new(channel(&cluster))
        .watch(ReceiverStream::new(receiver))
        .await
        .expect("a watch stream")
        .into_inner();
    let created = watch.message().await.expect("created").expect("a response");
    assert!(created.created && !created.canceled);
    tokio::time::sleep(Duration::from_secs(3)).await;
    cluster
        .put_until_acked(1, "acked", "after", Duration::from_secs(5))
        .await;
    let event = tokio::time::timeout(Duration::from_secs(2), watch.message())
        .await
        .expect("the event in time")
        .expect("the stream still open")
        .expect("a response");
    assert_eq!(event.events.len(), 1, "{event:?}");
    drop(requests);
    assert!(rss_kb(&cluster) < RSS_BOUND_KB);
    assert_healthy(&cluster, "acked", "after").await;
}

fn create_watch(key: &str) -> WatchRequest {
    WatchRequest {
        request_union: Some(RequestUnion::CreateRequest(WatchCreateRequest {
            key: key.to_string().into(),
            ..Default::default()
        })),
    }
}

/// Opens a Watch stream on `channel` and creates one watch on it.
async fn open_watch_stream(
    channel: Channel,
    key: &str,
) -> Result<(mpsc::Sender<WatchRequest>, tonic::Streaming<WatchResponse>), tonic::Status> {
    let (requests, receiver) = mpsc::channel(4);
    requests
        .send(create_watch(key))
        .await
        .expect("queue the create");
    let stream = WatchClient::new(channel)
        .watch(ReceiverStream::new(receiver))
        .await?
        .into_inner();
    Ok((requests, stream))
}

#[tokio::test(flavor = "multi_thread")]
async fn streams_beyond_max_concurrent_streams_wait_for_a_free_one() {
    let cluster = start(&["--grpc-streams-per-connection-max", "8"]).await;
    let shared = Channel::from_shared(cluster.endpoint(1))
        .expect("valid endpoint")
        .connect()
        .await
        .expect("connect");
    let mut open = Vec::new();
    for _ in 0..8 {
        open.push(
            open_watch_stream(shared.clone(), "k")
                .await
                .expect("within the cap"),
        );
    }
    // The ninth call on the same connection is not served until a stream ends.
    let ninth = tokio::spawn(open_watch_stream(shared.clone(), "k"));
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(!ninth.is_finished(), "a ninth stream was served at once");
    // Other connections are not affected.
    assert_healthy(&cluster, "acked", "before").await;
    drop(open.pop());
    let served = tokio::time::timeout(Duration::from_secs(5), ninth)
        .await
        .expect("served once a stream ended")
        .expect("task");
    assert!(served.is_ok());
    assert!(rss_kb(&cluster) < RSS_BOUND_KB);
}

#[tokio::test(flavor = "multi_thread")]
async fn watches_beyond_the_node_cap_get_resource_exhausted() {
    const CAP: usize = 100;
    let cluster = start(&["--watches-max", "100"]).await;
    let (requests, receiver) = mpsc::channel(256);
    for i in 0..CAP + 20 {
        requests
            .send(create_watch(&format!("w{i}")))
            .await
            .expect("queue");
    }
    let mut stream = WatchClient::new(channel(&cluster))
        .watch(ReceiverStream::new(receiver))
        .await
        .expect("a stream")
        .into_inner();
    let (mut created, mut refused) = (0, 0);
    while created + refused < CAP + 20 {
        let response = tokio::time::timeout(Duration::from_secs(5), stream.message())
            .await
            .expect("an answer per create")
            .expect("stream open")
            .expect("a response");
        if response.canceled {
            assert!(
                response.cancel_reason.contains("resource exhausted"),
                "{response:?}"
            );
            refused += 1;
        } else if response.created {
            created += 1;
        }
    }
    assert_eq!((created, refused), (CAP, 20));
    // A new stream while the node is full: RESOURCE_EXHAUSTED.
    let full = open_watch_stream(channel(&cluster), "k").await;
    let Err(status) = full else {
        panic!("a watch stream opened on a full node")
    };
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    // Slots come back when the stream ends.
    drop(requests);
    drop(stream);
    let start_retry = Instant::now();
    loop {
        match open_watch_stream(channel(&cluster), "k").await {
            Ok(_) => break,
            Err(_) if start_retry.elapsed() < Duration::from_secs(5) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(status) => panic!("slots not released: {status:?}"),
        }
    }
    assert!(rss_kb(&cluster) < RSS_BOUND_KB);
    assert_healthy(&cluster, "acked", "before").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn lease_keepalive_streams_beyond_the_cap_get_resource_exhausted() {
    let cluster = start(&["--lease-keepalive-streams-max", "4"]).await;
    let mut leases = LeaseClient::new(channel(&cluster));
    let lease = leases
        .lease_grant(LeaseGrantRequest { ttl: 60, id: 0 })
        .await
        .expect("grant")
        .into_inner()
        .id;
    let mut open = Vec::new();
    for _ in 0..4 {
        let (requests, receiver) = mpsc::channel(4);
        requests
            .send(LeaseKeepAliveRequest { id: lease })
            .await
            .expect("queue");
        let mut stream = leases
            .lease_keep_alive(ReceiverStream::new(receiver))
            .await
            .expect("within the cap")
            .into_inner();
        let answer = stream.message().await.expect("answer").expect("a response");
        assert!(answer.ttl > 0);
        open.push((requests, stream));
    }
    let (_requests, receiver) = mpsc::channel(4);
    let refused = leases
        .lease_keep_alive(ReceiverStream::new(receiver))
        .await
        .expect_err("over the cap");
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(rss_kb(&cluster) < RSS_BOUND_KB);
    assert_healthy(&cluster, "acked", "before").await;
}

/// A lease of a minute, for locks and campaigns.
async fn grant(cluster: &Cluster) -> i64 {
    LeaseClient::new(channel(cluster))
        .lease_grant(LeaseGrantRequest { ttl: 60, id: 0 })
        .await
        .expect("grant")
        .into_inner()
        .id
}

/// How many keys start with `prefix`.
async fn keys_under(cluster: &Cluster, prefix: &str) -> i64 {
    let mut end = prefix.as_bytes().to_vec();
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    cluster
        .kv(1)
        .await
        .range(RangeRequest {
            key: prefix.to_string().into(),
            range_end: end.into(),
            count_only: true,
            ..Default::default()
        })
        .await
        .expect("range")
        .into_inner()
        .count
}

/// Waits until `prefix` holds `count` keys.
async fn until_keys_under(cluster: &Cluster, prefix: &str, count: i64) {
    let start = Instant::now();
    while keys_under(cluster, prefix).await != count {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{prefix} never held {count} keys"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A refusal by a wait cap: RESOURCE_EXHAUSTED, one sentence naming the flag.
fn assert_refused_by(status: &tonic::Status, flag: &str) {
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains(flag), "{status:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn topic_subscriptions_beyond_the_cap_get_resource_exhausted() {
    const CAP: usize = 3;
    let cluster = start(&["--topic-subscriptions-max", "3"]).await;
    let mut topics = TopicClient::new(channel(&cluster));
    let subscribe = |topics: &mut TopicClient<Channel>| {
        let mut topics = topics.clone();
        async move {
            topics
                .subscribe(SubscribeRequest {
                    topic: "t".into(),
                    from_seq: 0,
                })
                .await
        }
    };
    let mut open = Vec::new();
    for _ in 0..CAP {
        open.push(subscribe(&mut topics).await.expect("within the cap"));
    }
    let refused = subscribe(&mut topics).await.expect_err("over the cap");
    assert_refused_by(&refused, "--topic-subscriptions-max");
    // The streams within the cap still deliver.
    topics
        .publish(PublishRequest {
            topic: "t".into(),
            data: "m".into(),
            from: String::new(),
        })
        .await
        .expect("publish");
    for stream in &mut open {
        let delivered = tokio::time::timeout(Duration::from_secs(5), stream.get_mut().message())
            .await
            .expect("a delivery")
            .expect("stream open")
            .expect("a response");
        assert_eq!(delivered.messages.len(), 1);
    }
    // A slot comes back when a stream ends.
    drop(open.pop());
    let start_retry = Instant::now();
    while let Err(status) = subscribe(&mut topics).await {
        assert!(
            start_retry.elapsed() < Duration::from_secs(5),
            "slot not released: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(rss_kb(&cluster) < RSS_BOUND_KB);
    assert_healthy(&cluster, "acked", "before").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn election_observers_beyond_the_cap_get_resource_exhausted() {
    let cluster = start(&["--election-observers-max", "3"]).await;
    let mut etcd = EtcdElectionClient::new(channel(&cluster));
    let mut groups = GroupClient::new(channel(&cluster));
    let observe_etcd = EtcdLeaderRequest { name: "e".into() };
    let observe_group = ObserveRequest {
        group: "g".into(),
        start_revision: 0,
    };
    // etcd's and Conclave's Observe share the cap.
    let _first = etcd.observe(observe_etcd.clone()).await.expect("within");
    let _second = etcd.observe(observe_etcd.clone()).await.expect("within");
    let mut third = groups
        .observe(observe_group.clone())
        .await
        .expect("within")
        .into_inner();
    let refused = etcd.observe(observe_etcd).await.expect_err("over the cap");
    assert_refused_by(&refused, "--election-observers-max");
    let refused = groups
        .observe(observe_group.clone())
        .await
        .expect_err("over the cap");
    assert_refused_by(&refused, "--election-observers-max");
    // The streams within the cap still answer (CURRENT first).
    let current = tokio::time::timeout(Duration::from_secs(5), third.message())
        .await
        .expect("an answer")
        .expect("stream open")
        .expect("a response");
    assert_eq!(current.events.len(), 1);
    drop(third);
    let start_retry = Instant::now();
    while let Err(status) = groups.observe(observe_group.clone()).await {
        assert!(
            start_retry.elapsed() < Duration::from_secs(5),
            "slot not released: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(rss_kb(&cluster) < RSS_BOUND_KB);
    assert_healthy(&cluster, "acked", "before").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn waiting_locks_beyond_the_cap_get_resource_exhausted_and_leave_no_key() {
    const CAP: i64 = 2;
    let cluster = start(&["--lock-waits-max", "2"]).await;
    let mut locks = LockClient::new(channel(&cluster));
    let lock = |lease| LockRequest {
        name: "lk".into(),
        lease,
    };
    // The holder does not wait, so it takes no slot.
    let holder = grant(&cluster).await;
    locks.lock(lock(holder)).await.expect("the first lock");
    let mut waiters = Vec::new();
    for _ in 0..CAP {
        let (mut client, request) = (locks.clone(), lock(grant(&cluster).await));
        waiters.push(tokio::spawn(async move { client.lock(request).await }));
    }
    until_keys_under(&cluster, "lk/", 1 + CAP).await;
    let refused = locks
        .lock(lock(grant(&cluster).await))
        .await
        .expect_err("over the cap");
    assert_refused_by(&refused, "--lock-waits-max");
    // The refused call's queue key is removed; the waiters keep their places.
    until_keys_under(&cluster, "lk/", 1 + CAP).await;
    assert!(waiters.iter().all(|waiter| !waiter.is_finished()));
    assert!(rss_kb(&cluster) < RSS_BOUND_KB);
    assert_healthy(&cluster, "acked", "before").await;
    for waiter in waiters {
        waiter.abort();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn waiting_campaigns_beyond_the_cap_get_resource_exhausted() {
    const CAP: i64 = 2;
    let cluster = start(&["--campaign-waits-max", "2"]).await;
    let mut etcd = EtcdElectionClient::new(channel(&cluster));
    let campaign = |lease| EtcdCampaignRequest {
        name: "el".into(),
        lease,
        value: "v".into(),
    };
    // The first is elected at once and takes no slot.
    let leader = grant(&cluster).await;
    etcd.campaign(campaign(leader)).await.expect("elected");
    let mut waiters = Vec::new();
    for _ in 0..CAP {
        let (mut client, request) = (etcd.clone(), campaign(grant(&cluster).await));
        waiters.push(tokio::spawn(async move { client.campaign(request).await }));
    }
    until_keys_under(&cluster, "el/", 1 + CAP).await;
    let refused = etcd
        .campaign(campaign(grant(&cluster).await))
        .await
        .expect_err("over the cap");
    assert_refused_by(&refused, "--campaign-waits-max");
    until_keys_under(&cluster, "el/", 1 + CAP).await;
    // Conclave's Campaign with `wait` shares the cap and is refused before it registers.
    let refused = GroupClient::new(channel(&cluster))
        .campaign(GroupCampaignRequest {
            group: "g".into(),
            candidate_id: "c".into(),
            priority: 1,
            value: "v".into(),
            lease: grant(&cluster).await,
            preempt: false,
            wait: true,
        })
        .await
        .expect_err("over the cap");
    assert_refused_by(&refused, "--campaign-waits-max");
    let candidates = GroupClient::new(channel(&cluster))
        .candidates(CandidatesRequest { group: "g".into() })
        .await
        .expect("candidates")
        .into_inner();
    assert!(candidates.candidates.is_empty(), "{candidates:?}");
    assert!(waiters.iter().all(|waiter| !waiter.is_finished()));
    assert!(rss_kb(&cluster) < RSS_BOUND_KB);
    assert_healthy(&cluster, "acked", "before").await;
    for waiter in waiters {
        waiter.abort();
    }
}

/// A KV client that accepts answers as large as the server may send, so that only the
/// server's range budget can refuse a read.
fn kv_unbounded(cluster: &Cluster, id: u64) -> KvClient<Channel> {
    let channel = Channel::from_shared(cluster.endpoint(id))
        .expect("valid endpoint")
        .connect_lazy();
    KvClient::new(channel).max_decoding_message_size(usize::MAX)
}

/// Resident memory of member `id`.
fn member_rss_kb(cluster: &Cluster, id: u64) -> u64 {
    let pid = cluster.nodes[(id - 1) as usize]
        .child
        .as_ref()
        .expect("running")
        .id();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

/// A member holding 65 MiB of values and the whole state twice over (applied state and log)
/// stays under this.
const BIG_RANGE_RSS_BOUND_KB: u64 = 1024 * 1024;

fn prefix_range(prefix: &str) -> RangeRequest {
    let mut end = prefix.as_bytes().to_vec();
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    RangeRequest {
        key: prefix.to_string().into(),
        range_end: end.into(),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_range_over_the_byte_budget_is_refused_while_narrower_reads_work() {
    // A 16 MiB budget for plain reads; a Txn's Ranges have the state machine's 64 MiB.
    let range_cap = 16 * 1024 * 1024;
    let cap = range_cap.to_string();
    let cluster = Cluster::start_with_args(3, &["--range-response-bytes-max", &cap]).await;
    cluster.wait_for_leader(Duration::from_secs(10)).await;
    cluster
        .put_until_acked(1, "acked", "before", Duration::from_secs(5))
        .await;
    // 65 values of 1 MiB: more than TXN_RANGE_BYTES_MAX (64 MiB) with their keys.
    let values = 65;
    let mut kv = kv_unbounded(&cluster, 1);
    for i in 0..values {
        let mut put = tonic::Request::new(PutRequest {
            key: format!("/big/{i:03}").into(),
            value: vec![b'v'; 1024 * 1024].into(),
            ..Default::default()
        });
        put.set_timeout(Duration::from_secs(20));
        kv.put(put).await.expect("a 1 MiB put");
    }
    for id in 1..=3 {
        cluster.wait_caught_up(id, Duration::from_secs(30)).await;
    }

    for id in 1..=3 {
        let mut kv = kv_unbounded(&cluster, id);
        for serializable in [true, false] {
            let started = Instant::now();
            let answer = kv
                .range(RangeRequest {
                    serializable,
                    ..prefix_range("/big/")
                })
                .await;
            // Not `expect_err`: it would print the 65 MiB answer.
            let refused = match answer {
                Ok(answer) => panic!(
                    "member {id} served {} keys past a 16 MiB budget",
                    answer.get_ref().kvs.len()
                ),
                Err(status) => status,
            };
            assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
            let message = refused.message();
            assert!(
                message.contains(&cap)
                    && message.contains("--range-response-bytes-max")
                    && message.contains("limit"),
                "names the cap and the way out: {message}"
            );
            assert!(
                started.elapsed() < Duration::from_secs(3),
                "refused in {:?}",
                started.elapsed()
            );
        }
        // A limited read, keys only and a count work on the same range.
        let limited = kv
            .range(RangeRequest {
                limit: 2,
                ..prefix_range("/big/")
            })
            .await
            .expect("a limited read")
            .into_inner();
        assert_eq!(limited.kvs.len(), 2);
        assert!(limited.more);
        assert_eq!(limited.count, values);
        assert_eq!(limited.kvs[1].value.len(), 1024 * 1024);
        let keys = kv
            .range(RangeRequest {
                keys_only: true,
                ..prefix_range("/big/")
            })
            .await
            .expect("keys only")
            .into_inner();
        assert_eq!(keys.kvs.len() as i64, values);
        assert!(keys.kvs.iter().all(|kv| kv.value.is_empty()));
        let counted = kv
            .range(RangeRequest {
                count_only: true,
                ..prefix_range("/big/")
            })
            .await
            .expect("count only")
            .into_inner();
        assert_eq!(counted.count, values);
    }

    // A Txn whose Range passes the state machine's cap is refused by the state machine, so
    // alike on every member, and its write is applied nowhere.
    let txn = TxnRequest {
        success: vec![
            RequestOp {
                request: Some(Request::RequestPut(PutRequest {
                    key: "txn-marker".into(),
                    value: "written".into(),
                    ..Default::default()
                })),
            },
            RequestOp {
                request: Some(Request::RequestRange(prefix_range("/big/"))),
            },
        ],
        ..Default::default()
    };
    for id in 1..=3 {
        let started = Instant::now();
        let refused = match kv_unbounded(&cluster, id).txn(txn.clone()).await {
            Ok(_) => panic!("member {id} answered a Txn reading 65 MiB"),
            Err(status) => status,
        };
        assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
        assert!(
            refused.message().contains(&(64 * 1024 * 1024).to_string()),
            "{refused:?}"
        );
        assert!(started.elapsed() < Duration::from_secs(5));
    }
    // A Txn with a limited Range goes through: the cap is on bytes, not on the range.
    let narrow = TxnRequest {
        success: vec![RequestOp {
            request: Some(Request::RequestRange(RangeRequest {
                limit: 1,
                ..prefix_range("/big/")
            })),
        }],
        ..Default::default()
    };
    kv_unbounded(&cluster, 2)
        .txn(narrow)
        .await
        .expect("a Txn with a limited Range");
    let leader = cluster.wait_for_leader(Duration::from_secs(5)).await;
    // Every member applied up to the leader's index (the refused Txns included).
    for id in 1..=3 {
        cluster.wait_caught_up(id, Duration::from_secs(10)).await;
        let local = kv_unbounded(&cluster, id)
            .range(RangeRequest {
                key: "txn-marker".into(),
                serializable: true,
                ..Default::default()
            })
            .await
            .expect("a local read")
            .into_inner();
        assert_eq!(
            local.count, 0,
            "member {id} (leader {leader}) applied the refused Txn's put"
        );
        let rss = member_rss_kb(&cluster, id);
        assert!(rss < BIG_RANGE_RSS_BOUND_KB, "member {id}: RSS {rss} kB");
    }
    assert_healthy(&cluster, "acked", "before").await;
}
