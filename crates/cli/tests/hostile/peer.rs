//! Hostile input on the peer port: a raw peer built here speaks the wire format of
//! `conclave_server::transport::frame` and sends what no honest member would. Every test
//! writes keys first and checks afterwards that the node answers, that the keys read the same,
//! that a new write commits, and (where the issue saw a directory bricked) that the node
//! restarts from its data directory.

use std::time::{Duration, Instant};

use bytes::Bytes;
use conclave_proto::conclave::v1::PublishAttributesRequest;
use conclave_proto::conclave::v1::membership_client::MembershipClient;
use conclave_proto::etcdserverpb::MemberListRequest;
use conclave_proto::etcdserverpb::cluster_client::ClusterClient;
use conclave_raft::{ConfState, Entry, EntryKind, Message, MessageBody, SnapshotMeta};
use conclave_server::transport::PeerCall;
use conclave_server::transport::auth::{self, PeerKey, Transcript};
use conclave_server::transport::frame::{self, Frame, FrameReader, Hello, HelloProof};
use conclave_state::{Command, PutRequest, Request, SessionSeq};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tonic::transport::Channel;

use crate::common::{self, Cluster, TEST_PEER_SECRET, local_value};

/// How long a cluster may take to settle after an attack (elections, reconnects).
const RECOVERY_TIMEOUT: Duration = Duration::from_secs(20);
/// A node under these attacks stays far below this resident size.
const RSS_BOUND_KIB: u64 = 512 * 1024;
/// The node's default `handshake_timeout_ms`, plus slack for a loaded test machine.
const HANDSHAKE_CLOSE_WITHIN: Duration = Duration::from_millis(2_000 + 3_000);

fn secret_key() -> PeerKey {
    PeerKey::from_secret(TEST_PEER_SECRET.as_bytes()).expect("the harness secret is long enough")
}

/// A peer connection that passed (or tried) the handshake.
struct RawPeer {
    reader: FrameReader<TcpStream>,
}

impl RawPeer {
    /// Connects to `peer_addr` as node `from` and runs the handshake with `key`. `Err` with
    /// the node's reason when it refuses.
    async fn connect(
        peer_addr: &str,
        cluster_id: u64,
        from: u64,
        to: u64,
        key: &PeerKey,
    ) -> Result<RawPeer, String> {
        let stream = TcpStream::connect(peer_addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let mut peer = RawPeer {
            reader: FrameReader::new(stream),
        };
        let nonce = auth::new_nonce().expect("randomness");
        peer.send_frame(&Frame::Hello(Hello {
            cluster_id,
            from,
            to,
            nonce,
            name: String::new(),
            client_address: String::new(),
            vote_withheld_ms: 0,
            peer_address: String::new(),
        }))
        .await;
        let challenge = match peer.next().await {
            Some(Frame::HelloChallenge(challenge)) => challenge,
            Some(Frame::HelloRejected(rejected)) => return Err(rejected.reason),
            other => return Err(format!("unexpected answer to Hello: {other:?}")),
        };
        let transcript = Transcript {
            cluster_id,
            dialer: from,
            listener: to,
            dialer_nonce: &nonce,
            listener_nonce: &challenge.nonce,
            dialer_name: "",
            dialer_client_address: "",
            dialer_vote_withheld_ms: 0,
            dialer_peer_address: "",
        };
        peer.send_frame(&Frame::HelloProof(HelloProof {
            proof: transcript.dialer_proof(key),
        }))
        .await;
        match peer.next().await {
            Some(Frame::HelloAccepted(_)) => Ok(peer),
            Some(Frame::HelloRejected(rejected)) => Err(rejected.reason),
            other => Err(format!("unexpected answer to HelloProof: {other:?}")),
        }
    }

    async fn next(&mut self) -> Option<Frame> {
        tokio::time::timeout(Duration::from_secs(5), self.reader.next_frame())
            .await
            .ok()?
            .ok()?
    }

    /// Best effort: a refused connection may already be closed.
    async fn send_frame(&mut self, frame: &Frame) {
        let mut wire = Vec::new();
        frame::encode_frame(frame, &mut wire).expect("encodes");
        let _ = self.reader.get_mut().write_all(&wire).await;
    }

    async fn send(&mut self, message: Message) {
        self.send_frame(&Frame::Message(message)).await;
    }
}

/// The cluster id, term, leader and last index as node `id` reports them.
async fn status_of(cluster: &Cluster, id: u64) -> (u64, u64, u64, u64) {
    let start = Instant::now();
    loop {
        if let Some(status) = cluster.status(id).await {
            let header = status.header.unwrap_or_default();
            if status.leader != 0 {
                return (
                    header.cluster_id,
                    status.raft_term,
                    status.leader,
                    status.raft_index,
                );
            }
        }
        assert!(
            start.elapsed() < RECOVERY_TIMEOUT,
            "node {id} reports no leader; logs in {}",
            cluster.root.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Writes a few keys through node `via`; they must survive whatever follows.
async fn write_keys(cluster: &Cluster, via: u64, prefix: &str) -> Vec<(String, String)> {
    let mut keys = Vec::new();
    for i in 0..5 {
        let (key, value) = (format!("{prefix}-{i}"), format!("value-{i}"));
        cluster
            .put_until_acked(via, &key, &value, RECOVERY_TIMEOUT)
            .await;
        keys.push((key, value));
    }
    keys
}

/// Node `id` answers, still has every acknowledged key unchanged, and a new write through it
/// commits and is read back.
async fn assert_serving_with(cluster: &Cluster, id: u64, keys: &[(String, String)], tag: &str) {
    let client = cluster.nodes[(id - 1) as usize].client.clone();
    let start = Instant::now();
    for (key, value) in keys {
        loop {
            let got = local_value(&client, key).await;
            if got.as_deref() == Some(value.as_str()) {
                break;
            }
            assert!(
                start.elapsed() < RECOVERY_TIMEOUT,
                "node {id}: acknowledged {key}={value} reads {got:?}; logs in {}",
                cluster.root.display()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let key = format!("after-{tag}");
    cluster
        .put_until_acked(id, &key, "ok", RECOVERY_TIMEOUT)
        .await;
    let start = Instant::now();
    while local_value(&client, &key).await.as_deref() != Some("ok") {
        assert!(start.elapsed() < RECOVERY_TIMEOUT, "node {id} lost {key}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let rss = rss_kib(cluster, id);
    assert!(
        rss < RSS_BOUND_KIB,
        "node {id} holds {rss} KiB, over {RSS_BOUND_KIB}"
    );
}

fn rss_kib(cluster: &Cluster, id: u64) -> u64 {
    let pid = cluster.nodes[(id - 1) as usize]
        .child
        .as_ref()
        .map(|child| child.id())
        .expect("the node runs");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Kills node `id` with SIGKILL and starts it again over its data directory.
async fn restart(cluster: &mut Cluster, id: u64) {
    cluster.kill(id);
    cluster.spawn(id);
    let start = Instant::now();
    while cluster.status(id).await.is_none() {
        let exited = cluster.nodes[(id - 1) as usize]
            .child
            .as_mut()
            .is_some_and(|child| !matches!(child.try_wait(), Ok(None)));
        assert!(
            !exited,
            "node {id} exited on restart: its data directory is bricked; logs in {}",
            cluster.root.display()
        );
        assert!(
            start.elapsed() < RECOVERY_TIMEOUT,
            "node {id} did not come back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn log_of(cluster: &Cluster, id: u64) -> String {
    std::fs::read_to_string(cluster.root.join(format!("node{id}.log"))).unwrap_or_default()
}

fn put_entry(term: u64, index: u64, key: &str, value: &str) -> Entry {
    let command = Command::new(
        0,
        Request::Put(PutRequest {
            key: Bytes::from(key.to_string()),
            value: Bytes::from(value.to_string()),
            ..Default::default()
        }),
    );
    Entry {
        term,
        index,
        kind: EntryKind::Normal,
        data: Bytes::from(command.encode()),
    }
}

/// A follower of the current leader, and that leader.
async fn follower_and_leader(cluster: &Cluster) -> (u64, u64) {
    let leader = cluster.wait_for_leader(RECOVERY_TIMEOUT).await;
    let follower = if leader == 1 { 2 } else { 1 };
    (follower, leader)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_peer_without_the_secret_is_refused_before_any_message() {
    let cluster = Cluster::start(3).await;
    let keys = write_keys(&cluster, 1, "nosecret").await;
    let (follower, leader) = follower_and_leader(&cluster).await;
    let (cluster_id, term, ..) = status_of(&cluster, follower).await;
    let target = &cluster.nodes[(follower - 1) as usize].peer;

    let weak = PeerKey::weak_from_cluster_id(cluster_id);
    let wrong = PeerKey::from_secret(b"not-the-cluster-secret-at-all").expect("long enough");
    for (what, key) in [
        ("no secret (the weak key)", weak),
        ("a wrong secret", wrong),
    ] {
        let refused = RawPeer::connect(target, cluster_id, leader, follower, &key).await;
        let Err(reason) = refused else {
            panic!("a peer with {what} was accepted");
        };
        assert!(reason.contains("peer secret"), "{what}: {reason}");
    }

    // Whatever follows a refused proof on the same socket is never read: a Heartbeat that
    // would push the follower's term up by a million changes nothing.
    let stream = TcpStream::connect(target).await.expect("connect");
    let mut raw = RawPeer {
        reader: FrameReader::new(stream),
    };
    let nonce = auth::new_nonce().expect("randomness");
    raw.send_frame(&Frame::Hello(Hello {
        cluster_id,
        from: leader,
        to: follower,
        nonce,
        name: String::new(),
        client_address: String::new(),
        vote_withheld_ms: 0,
        peer_address: String::new(),
    }))
    .await;
    raw.send_frame(&Frame::HelloProof(HelloProof { proof: [0; 32] }))
        .await;
    raw.send(Message {
        from: leader,
        to: follower,
        term: term + 1_000_000,
        body: MessageBody::Heartbeat {
            commit: 0,
            context: None,
        },
    })
    .await;
    // A Raft message in place of the Hello is refused too.
    let mut early = RawPeer {
        reader: FrameReader::new(TcpStream::connect(target).await.expect("connect")),
    };
    early
        .send(Message {
            from: leader,
            to: follower,
            term: term + 1_000_000,
            body: MessageBody::Heartbeat {
                commit: 0,
                context: None,
            },
        })
        .await;
    assert!(
        matches!(early.next().await, Some(Frame::HelloRejected(_))),
        "a Message before the Hello must be refused"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;

    let (_, term_after, ..) = status_of(&cluster, follower).await;
    assert!(
        term_after < term + 1_000,
        "an unauthenticated Heartbeat moved the term from {term} to {term_after}"
    );
    assert_serving_with(&cluster, follower, &keys, "nosecret").await;
    assert!(
        log_of(&cluster, follower).contains("did not prove the cluster's peer secret"),
        "the refusal is logged with its reason"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_forged_append_from_a_non_member_is_not_applied() {
    let cluster = Cluster::start(1).await;
    let keys = write_keys(&cluster, 1, "nonmember").await;
    let (cluster_id, term, _, last_index) = status_of(&cluster, 1).await;
    let peer = &cluster.nodes[0].peer;
    let mut raw = RawPeer::connect(peer, cluster_id, 2, 1, &secret_key())
        .await
        .expect("the secret authenticates");
    // A higher term from "node 2", extending the real log with a put, committed at once.
    for (message_term, prev_index, prev_term) in [
        (term + 1, last_index, term),
        (term + 1, 0, 0),
        (term, last_index, term),
    ] {
        raw.send(Message {
            from: 2,
            to: 1,
            term: message_term,
            body: MessageBody::Append {
                prev_index,
                prev_term,
                entries: vec![put_entry(
                    message_term,
                    prev_index + 1,
                    "injected-by-peer",
                    "pwned",
                )],
                commit: prev_index + 1,
            },
        })
        .await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_serving_with(&cluster, 1, &keys, "nonmember").await;
    assert_eq!(
        local_value(&cluster.nodes[0].client, "injected-by-peer").await,
        None,
        "an Append from a non-member was applied"
    );
}

/// A peer call carrying a put, encoded as members encode a write they hand to the leader
/// (`api::peer_calls`: the request, then the optional session).
fn put_call(id: u64, key: &str, value: &str) -> Frame {
    let request = Request::Put(PutRequest {
        key: Bytes::from(key.to_string()),
        value: Bytes::from(value.to_string()),
        ..Default::default()
    });
    let payload = postcard::to_allocvec(&(request, None::<SessionSeq>)).expect("encodes");
    Frame::Call(PeerCall { id, payload })
}

#[tokio::test(flavor = "multi_thread")]
async fn a_write_handed_over_by_a_non_member_or_in_garbage_is_not_applied() {
    let cluster = Cluster::start(1).await;
    let keys = write_keys(&cluster, 1, "call").await;
    let (cluster_id, _, _, _) = status_of(&cluster, 1).await;
    let peer = &cluster.nodes[0].peer;
    let mut raw = RawPeer::connect(peer, cluster_id, 2, 1, &secret_key())
        .await
        .expect("the secret authenticates");
    raw.send_frame(&put_call(1, "injected-by-call", "pwned"))
        .await;
    for garbage in [Vec::new(), vec![0xff; 64], vec![7; 100_000]] {
        raw.send_frame(&Frame::Call(PeerCall {
            id: 2,
            payload: garbage,
        }))
        .await;
    }
    raw.send_frame(&Frame::Answer(PeerCall {
        id: 0,
        payload: vec![1, 2, 3],
    }))
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_serving_with(&cluster, 1, &keys, "call").await;
    assert_eq!(
        local_value(&cluster.nodes[0].client, "injected-by-call").await,
        None,
        "a write handed over by a non-member was applied"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_forged_append_response_with_the_largest_hint_index_is_dropped() {
    let cluster = Cluster::start(3).await;
    let keys = write_keys(&cluster, 1, "hint").await;
    let (follower, leader) = follower_and_leader(&cluster).await;
    let (cluster_id, term, ..) = status_of(&cluster, leader).await;
    let peer = &cluster.nodes[(leader - 1) as usize].peer;
    let mut raw = RawPeer::connect(peer, cluster_id, follower, leader, &secret_key())
        .await
        .expect("the secret authenticates");
    for reject in [true, false] {
        raw.send(Message {
            from: follower,
            to: leader,
            term,
            body: MessageBody::AppendResponse {
                index: u64::MAX,
                reject,
                hint_index: u64::MAX,
                hint_term: term,
                awaited: false,
            },
        })
        .await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let leader_now = cluster.wait_for_leader(RECOVERY_TIMEOUT).await;
    assert_serving_with(&cluster, leader_now, &keys, "hint").await;
    assert_serving_with(&cluster, leader, &keys, "hint-old-leader").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_forged_append_with_the_largest_prev_index_is_dropped() {
    let cluster = Cluster::start(3).await;
    let keys = write_keys(&cluster, 1, "previndex").await;
    let (follower, leader) = follower_and_leader(&cluster).await;
    let (cluster_id, term, ..) = status_of(&cluster, follower).await;
    let peer = &cluster.nodes[(follower - 1) as usize].peer;
    let mut raw = RawPeer::connect(peer, cluster_id, leader, follower, &secret_key())
        .await
        .expect("the secret authenticates");
    for entries in [vec![], vec![put_entry(term, 0, "injected-prev", "pwned")]] {
        raw.send(Message {
            from: leader,
            to: follower,
            term,
            body: MessageBody::Append {
                prev_index: u64::MAX,
                prev_term: term,
                entries,
                commit: u64::MAX,
            },
        })
        .await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_serving_with(&cluster, follower, &keys, "previndex").await;
    assert_eq!(
        local_value(
            &cluster.nodes[(follower - 1) as usize].client,
            "injected-prev"
        )
        .await,
        None
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_forged_conflicting_append_at_index_one_is_dropped() {
    let mut cluster = Cluster::start(3).await;
    let keys = write_keys(&cluster, 1, "conflict").await;
    let (follower, leader) = follower_and_leader(&cluster).await;
    let (cluster_id, term, ..) = status_of(&cluster, follower).await;
    let peer = cluster.nodes[(follower - 1) as usize].peer.clone();
    let mut raw = RawPeer::connect(&peer, cluster_id, leader, follower, &secret_key())
        .await
        .expect("the secret authenticates");
    // A newer term than entry 1 can have, so the entry conflicts with a committed one.
    raw.send(Message {
        from: leader,
        to: follower,
        term: term + 1,
        body: MessageBody::Append {
            prev_index: 0,
            prev_term: 0,
            entries: vec![put_entry(term + 1, 1, "injected-conflict", "pwned")],
            commit: 1,
        },
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    drop(raw);
    assert_serving_with(&cluster, follower, &keys, "conflict").await;
    restart(&mut cluster, follower).await;
    assert_serving_with(&cluster, follower, &keys, "conflict-restarted").await;
    for node in &cluster.nodes {
        assert_eq!(local_value(&node.client, "injected-conflict").await, None);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_forged_heartbeat_with_the_largest_term_does_not_brick_the_directory() {
    let mut cluster = Cluster::start(3).await;
    let keys = write_keys(&cluster, 1, "term").await;
    let (follower, leader) = follower_and_leader(&cluster).await;
    let (cluster_id, ..) = status_of(&cluster, follower).await;
    let peer = cluster.nodes[(follower - 1) as usize].peer.clone();
    let mut raw = RawPeer::connect(&peer, cluster_id, leader, follower, &secret_key())
        .await
        .expect("the secret authenticates");
    for term in [u64::MAX, u64::MAX - 1] {
        raw.send(Message {
            from: leader,
            to: follower,
            term,
            body: MessageBody::Heartbeat {
                commit: 0,
                context: None,
            },
        })
        .await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    drop(raw);
    restart(&mut cluster, follower).await;
    assert_serving_with(&cluster, follower, &keys, "term").await;
    let (_, term_after, ..) = status_of(&cluster, follower).await;
    assert!(term_after < u64::MAX / 2, "the forged term was taken");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_forged_snapshot_chunk_with_garbage_does_not_brick_the_directory() {
    let mut cluster = Cluster::start(3).await;
    let keys = write_keys(&cluster, 1, "snapshot").await;
    let (follower, leader) = follower_and_leader(&cluster).await;
    let (cluster_id, term, _, last_index) = status_of(&cluster, follower).await;
    let peer = cluster.nodes[(follower - 1) as usize].peer.clone();
    let mut raw = RawPeer::connect(&peer, cluster_id, leader, follower, &secret_key())
        .await
        .expect("the secret authenticates");
    let garbage: Vec<u8> = (0..4096u32).map(|i| (i * 31 % 251) as u8).collect();
    raw.send(Message {
        from: leader,
        to: follower,
        term,
        body: MessageBody::SnapshotChunk {
            meta: SnapshotMeta {
                index: last_index + 1_000,
                term,
                conf_state: ConfState::with_voters([1, 2, 3]),
            },
            offset: 0,
            data: Bytes::from(garbage),
            done: true,
            image_crc32c: 0x1234_5678,
        },
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    drop(raw);
    restart(&mut cluster, follower).await;
    assert_serving_with(&cluster, follower, &keys, "snapshot").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn forged_hellos_held_idle_do_not_keep_a_restarted_member_out() {
    const FLOOD_PER_NODE: usize = 64;
    let mut cluster = Cluster::start(3).await;
    let keys = write_keys(&cluster, 1, "flood").await;
    let (cluster_id, ..) = status_of(&cluster, 1).await;
    let restarted = 3;

    // 64 connections on each peer port, each with a Hello and nothing after it; replaced as
    // soon as the node closes one, for as long as the test runs.
    let targets: Vec<(u64, String)> = cluster
        .nodes
        .iter()
        .filter(|n| n.id != restarted)
        .map(|n| (n.id, n.peer.clone()))
        .collect();
    let closed_in_time = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut flood = tokio::task::JoinSet::new();
    for (id, address) in targets.clone() {
        for slot in 0..FLOOD_PER_NODE {
            let address = address.clone();
            let closed_in_time = closed_in_time.clone();
            flood.spawn(async move {
                loop {
                    let Ok(mut stream) = TcpStream::connect(&address).await else {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    };
                    let mut wire = Vec::new();
                    let hello = Frame::Hello(Hello {
                        cluster_id,
                        from: 100 + slot as u64,
                        to: id,
                        nonce: [slot as u8; 32],
                        name: String::new(),
                        client_address: String::new(),
                        vote_withheld_ms: 0,
                        peer_address: String::new(),
                    });
                    frame::encode_frame(&hello, &mut wire).expect("encodes");
                    let _ = stream.write_all(&wire).await;
                    // Read until the node gives up on us.
                    let opened = Instant::now();
                    let mut sink = [0u8; 1024];
                    while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
                    if opened.elapsed() <= HANDSHAKE_CLOSE_WITHIN {
                        closed_in_time.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            });
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;

    restart(&mut cluster, restarted).await;
    assert_serving_with(&cluster, restarted, &keys, "flood").await;
    for (id, _) in &targets {
        assert_serving_with(&cluster, *id, &keys, &format!("flood-{id}")).await;
    }
    // The idle handshakes were closed by the handshake timeout, not left to hold anything.
    let waited = Instant::now();
    while closed_in_time.load(std::sync::atomic::Ordering::Relaxed) < (2 * FLOOD_PER_NODE) as u64 {
        assert!(
            waited.elapsed() < HANDSHAKE_CLOSE_WITHIN * 2,
            "idle handshakes were not closed in time: {} of {}",
            closed_in_time.load(std::sync::atomic::Ordering::Relaxed),
            2 * FLOOD_PER_NODE
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    flood.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn publish_attributes_from_the_client_port_is_refused() {
    let mut cluster = Cluster::start(1).await;
    let keys = write_keys(&cluster, 1, "attrs").await;
    let client = cluster.nodes[0].client.clone();
    let channel = || {
        Channel::from_shared(format!("http://{client}"))
            .expect("valid endpoint")
            .connect_lazy()
    };
    let client_urls = |channel: Channel| async move {
        let members = ClusterClient::new(channel)
            .member_list(MemberListRequest::default())
            .await
            .expect("member list")
            .into_inner()
            .members;
        members
            .iter()
            .map(|m| (m.id, m.client_ur_ls.clone()))
            .collect::<Vec<_>>()
    };
    let before = client_urls(channel()).await;
    assert_eq!(before, vec![(1, vec![format!("http://{client}")])]);

    let attacker = format!("127.0.0.1:{}", common::free_port());
    let refused = MembershipClient::new(channel())
        .publish_attributes(PublishAttributesRequest {
            id: 1,
            name: "evil".into(),
            client_address: attacker,
        })
        .await
        .expect_err("PublishAttributes must not be served on the client port");
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    assert_eq!(client_urls(channel()).await, before);

    cluster.terminate(1);
    cluster.spawn(1);
    cluster.wait_for_leader(RECOVERY_TIMEOUT).await;
    assert_eq!(client_urls(channel()).await, before, "after a restart");
    assert_serving_with(&cluster, 1, &keys, "attrs").await;
}
