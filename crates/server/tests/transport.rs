//! The peer transport over real loopback sockets.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use conclave_raft::{ConfState, Entry, EntryKind, Message, MessageBody, SnapshotMeta};
use conclave_server::Error;
use conclave_server::tls::PeerTlsFiles;
use conclave_server::transport::auth::{self, PeerKey, Transcript};
use conclave_server::transport::frame::{self, Frame, FrameReader, Hello, HelloProof};
use conclave_server::transport::{
    InboundCall, InboundMessage, MAX_PEER_FRAME_BYTES, PeerCall, PeerCallInput, PeerListenerState,
    PeerTls, PeerTransport, TransportConfig, bind_peer_listener, serve_peers_with,
};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

const CLUSTER_ID: u64 = 0xC0C1_A7E5;
const WAIT: Duration = Duration::from_secs(10);

struct Listener {
    address: SocketAddr,
    inbound: mpsc::Receiver<InboundMessage>,
    stop: oneshot::Sender<()>,
    task: JoinHandle<Result<(), Error>>,
    state: Arc<PeerListenerState>,
}

impl Listener {
    async fn start(node_id: u64, address: &str) -> Listener {
        Listener::start_with(TransportConfig::new(CLUSTER_ID, node_id), address).await
    }

    async fn start_with(config: TransportConfig, address: &str) -> Listener {
        Listener::start_with_capacity(config, address, 1024).await
    }

    /// A listener that stops reading its sockets once `capacity` messages wait unreceived.
    async fn start_with_capacity(
        config: TransportConfig,
        address: &str,
        capacity: usize,
    ) -> Listener {
        Listener::start_with_state(config, address, capacity, PeerListenerState::new()).await
    }

    async fn start_with_state(
        config: TransportConfig,
        address: &str,
        capacity: usize,
        state: Arc<PeerListenerState>,
    ) -> Listener {
        let listener = bind_peer_listener(address).await.expect("loopback binds");
        let address = listener.local_addr().expect("bound socket has an address");
        let (sender, inbound) = mpsc::channel(capacity);
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(serve_peers_with(
            listener,
            config,
            sender,
            state.clone(),
            async {
                let _ = stopped.await;
            },
        ));
        Listener {
            address,
            inbound,
            stop,
            task,
            state,
        }
    }

    async fn stop(self) -> mpsc::Receiver<InboundMessage> {
        let _ = self.stop.send(());
        self.task
            .await
            .expect("listener task ends")
            .expect("listener ends cleanly");
        self.inbound
    }

    async fn receive(&mut self) -> InboundMessage {
        tokio::time::timeout(WAIT, self.inbound.recv())
            .await
            .expect("a message arrives in time")
            .expect("listener still running")
    }
}

/// One of every kind of message, from node 1 to node 2, tagged with `seq` so order shows.
fn sample_message(seq: u64) -> Message {
    let context = Bytes::from(seq.to_be_bytes().to_vec());
    let body = match seq % 8 {
        0 => MessageBody::Append {
            prev_index: seq,
            prev_term: 1,
            entries: vec![
                Entry {
                    term: 2,
                    index: seq + 1,
                    kind: EntryKind::Normal,
                    data: context.clone(),
                },
                Entry {
                    term: 2,
                    index: seq + 2,
                    kind: EntryKind::ConfChange,
                    data: Bytes::new(),
                },
            ],
            commit: seq,
        },
        1 => MessageBody::AppendResponse {
            index: seq,
            reject: seq.is_multiple_of(3),
            hint_index: 4,
            hint_term: 1,
            awaited: seq.is_multiple_of(2),
        },
        2 => MessageBody::Vote {
            pre: true,
            last_index: seq,
            last_term: 2,
            transfer: false,
        },
        3 => MessageBody::VoteResponse {
            pre: false,
            granted: true,
        },
        4 => MessageBody::Heartbeat {
            commit: seq,
            context: Some(context),
        },
        5 => MessageBody::SnapshotChunk {
            meta: SnapshotMeta {
                index: seq,
                term: 2,
                conf_state: ConfState::with_voters([1, 2, 3]),
            },
            offset: seq * 10,
            data: Bytes::from(vec![7u8; 1000]),
            done: seq.is_multiple_of(2),
            image_crc32c: seq as u32,
        },
        6 => MessageBody::ReadIndexResponse {
            context,
            index: seq,
        },
        _ => MessageBody::TimeoutNow,
    };
    Message {
        from: 1,
        to: 2,
        term: seq,
        body,
    }
}

/// Sends through the transport, waiting out a full queue (tests want every message).
async fn send_all(transport: &PeerTransport, messages: impl IntoIterator<Item = Message>) {
    for message in messages {
        loop {
            match transport.send(message.clone()) {
                Ok(()) => break,
                Err(Error::PeerQueueFull { .. }) => {
                    tokio::time::sleep(Duration::from_millis(1)).await
                }
                Err(other) => panic!("unexpected send error: {other}"),
            }
        }
    }
}

async fn wait_until(mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !condition() {
        assert!(
            Instant::now() < deadline,
            "condition not met within {WAIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_messages_arrive_in_order_and_intact() {
    let mut listener = Listener::start(2, "127.0.0.1:0").await;
    let mut transport =
        PeerTransport::new(TransportConfig::new(CLUSTER_ID, 1)).expect("valid config");
    transport
        .add_peer(2, listener.address.to_string())
        .expect("valid peer");

    const COUNT: u64 = 20_000;
    let sender = tokio::spawn(async move {
        send_all(&transport, (0..COUNT).map(sample_message)).await;
        transport
    });
    for seq in 0..COUNT {
        let (from, message) = listener.receive().await;
        assert_eq!(from, 1);
        assert_eq!(message, sample_message(seq));
    }
    let transport = sender.await.expect("sender finishes");
    let stats = transport.peer_stats(2).expect("peer 2 was added");
    assert_eq!(stats.sent_messages, COUNT);
    assert_eq!(stats.connections, 1);
    assert!(stats.connected);
    listener.stop().await;
}

/// An append from node 1 to node 2 with one entry of `bytes` bytes, tagged with `seq`.
fn large_append(seq: u64, bytes: usize) -> Message {
    let mut data = vec![(seq % 251) as u8; bytes];
    data[..8].copy_from_slice(&seq.to_be_bytes());
    Message {
        from: 1,
        to: 2,
        term: 2,
        body: MessageBody::Append {
            prev_index: seq,
            prev_term: 2,
            entries: vec![Entry {
                term: 2,
                index: seq + 1,
                kind: EntryKind::Normal,
                data: Bytes::from(data),
            }],
            commit: seq,
        },
    }
}

/// With nothing queued, the sender writes a message to the socket itself. A socket too full
/// to take all of one leaves the rest to the link's task, and everything sent after it waits
/// in the queue behind it: every message still arrives whole and in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_writes_that_fill_the_socket_leave_the_rest_to_the_link_in_order() {
    direct_writes_fill_the_socket(
        TransportConfig::new(CLUSTER_ID, 2),
        TransportConfig::new(CLUSTER_ID, 1),
        PeerListenerState::new(),
        None,
    )
    .await;
}

/// The same on a TLS link: the sender seals each direct write with the link's session, the
/// link's task writes what the socket did not take and seals its own batches after it, and
/// the listener, given a runtime as a server gives its Raft driver's, moves the connection
/// there after the handshake and opens every record in order on one connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_writes_on_a_tls_link_are_sealed_in_order_with_the_links_own() {
    let reader = ReaderRuntime::start();
    let state = PeerListenerState::new();
    state.receive_on(reader.handle.clone());
    let certificates = TestCertificates::new("direct-tls");
    let mut listener_config = TransportConfig::new(CLUSTER_ID, 2);
    listener_config.own_name = "n2".into();
    listener_config.tls = Some(certificates.peer_tls("n2"));
    let mut sender_config = TransportConfig::new(CLUSTER_ID, 1);
    sender_config.own_name = "n1".into();
    let sender_tls = certificates.peer_tls("n1");
    sender_tls.note_member_name(2, "n2");
    sender_config.tls = Some(sender_tls);
    direct_writes_fill_the_socket(listener_config, sender_config, state, Some(&reader.handle))
        .await;
    reader.stop();
}

/// A current-thread runtime on its own thread, standing in for the Raft driver's.
struct ReaderRuntime {
    handle: tokio::runtime::Handle,
    stop: oneshot::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

impl ReaderRuntime {
    fn start() -> ReaderRuntime {
        let (handle_sender, handle_receiver) = std::sync::mpsc::channel();
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime builds");
            handle_sender
                .send(runtime.handle().clone())
                .expect("the test waits for the handle");
            runtime.block_on(async {
                let _ = stopped.await;
            });
        });
        let handle = handle_receiver.recv().expect("the reader runtime starts");
        ReaderRuntime {
            handle,
            stop,
            thread,
        }
    }

    fn stop(self) {
        let _ = self.stop.send(());
        self.thread.join().expect("the reader thread ends");
    }
}

/// A CA and peer certificates signed by it, in a directory removed on drop.
struct TestCertificates {
    dir: std::path::PathBuf,
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
}

impl TestCertificates {
    fn new(tag: &str) -> TestCertificates {
        let dir = std::env::temp_dir().join(format!(
            "conclave-transport-{tag}-{}-{}",
            std::process::id(),
            auth::new_nonce().expect("randomness")[0]
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "test CA");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
        ];
        let key = rcgen::KeyPair::generate().expect("CA key");
        let ca_pem = params.self_signed(&key).expect("CA certificate").pem();
        let issuer = rcgen::Issuer::new(params, key);
        std::fs::write(dir.join("ca.pem"), &ca_pem).expect("write CA");
        TestCertificates { dir, issuer }
    }

    /// Peer TLS for member `name`: a certificate naming it, for both directions.
    fn peer_tls(&self, name: &str) -> Arc<PeerTls> {
        let mut params = rcgen::CertificateParams::new(vec![name.to_string()]).expect("params");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        params.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.issuer).expect("certificate");
        let cert_file = self.dir.join(format!("{name}.pem"));
        let key_file = self.dir.join(format!("{name}-key.pem"));
        std::fs::write(&cert_file, cert.pem()).expect("write certificate");
        std::fs::write(&key_file, key.serialize_pem()).expect("write key");
        PeerTls::load(PeerTlsFiles {
            cert_file,
            key_file,
            trusted_ca_file: self.dir.join("ca.pem"),
        })
        .expect("peer TLS loads")
    }
}

impl Drop for TestCertificates {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Sends 2,000 appends of 48 KiB from `sender_config`'s node 1 to a listener of
/// `listener_config` that drains in spurts, so direct writes fill the socket, leave tails and
/// race the link's task; every message must arrive whole and in order on one connection.
async fn direct_writes_fill_the_socket(
    listener_config: TransportConfig,
    sender_config: TransportConfig,
    state: Arc<PeerListenerState>,
    reader: Option<&tokio::runtime::Handle>,
) {
    // The listener stops reading after two unreceived messages, so the socket fills.
    let mut listener = Listener::start_with_state(listener_config, "127.0.0.1:0", 2, state).await;
    let mut transport = PeerTransport::new(sender_config).expect("valid config");
    transport
        .add_peer(2, listener.address.to_string())
        .expect("valid peer");
    // The link's first write opens the direct lane.
    send_all(&transport, [large_append(0, 100)]).await;
    assert_eq!(listener.receive().await.1, large_append(0, 100));
    wait_until(|| {
        transport
            .peer_stats(2)
            .is_some_and(|s| s.sent_messages == 1)
    })
    .await;

    // The receiver drains in spurts while the sender goes on, so the link's task finishes
    // tails and queued messages while new messages look for the direct lane.
    const COUNT: u64 = 2_000;
    const ENTRY_BYTES: usize = 48 * 1024;
    let receiver = tokio::spawn(async move {
        for seq in 1..=COUNT {
            let (from, message) = listener.receive().await;
            assert_eq!(from, 1);
            assert!(
                message == large_append(seq, ENTRY_BYTES),
                "message {seq} arrived out of order or damaged"
            );
            if seq % 64 == 0 {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        listener
    });
    // Sends the queue refused (at its byte bound, behind a slow receiver) and the test
    // repeated; each is counted as a dropped message.
    let mut refused = 0;
    for seq in 1..=COUNT {
        // A receiver that saw a message out of order has stopped reading: stop sending.
        while !receiver.is_finished() {
            match transport.send(large_append(seq, ENTRY_BYTES)) {
                Ok(()) => break,
                Err(Error::PeerQueueFull { .. }) => {
                    refused += 1;
                    tokio::time::sleep(Duration::from_millis(1)).await
                }
                Err(other) => panic!("unexpected send error: {other}"),
            }
        }
        if seq % 8 == 0 {
            tokio::task::yield_now().await;
        }
    }
    let listener = receiver
        .await
        .expect("every message arrives whole and in order");
    let stats = transport.peer_stats(2).expect("peer 2 was added");
    assert!(
        stats.direct_messages > 0,
        "no message took the direct lane: {stats:?}"
    );
    assert!(stats.direct_tails > 0, "the socket never filled: {stats:?}");
    assert!(
        stats.direct_messages < COUNT,
        "no message waited in the queue: {stats:?}"
    );
    assert_eq!(
        stats.dropped_messages, refused,
        "a message was lost: {stats:?}"
    );
    wait_until(|| {
        transport
            .peer_stats(2)
            .is_some_and(|s| s.sent_messages == COUNT + 1 && s.queued_messages == 0)
    })
    .await;
    let stats = transport.peer_stats(2).expect("peer 2 was added");
    assert_eq!(stats.connections, 1, "the stream stayed whole: {stats:?}");
    if let Some(reader) = reader {
        assert_eq!(
            reader.metrics().num_alive_tasks(),
            1,
            "the connection is not read on the given runtime"
        );
    }
    listener.stop().await;
    if let Some(reader) = reader {
        wait_until(|| reader.metrics().num_alive_tasks() == 0).await;
    }
}

/// Given a runtime (a server gives its Raft driver's), the listener reads plain-TCP
/// connections in tasks of that runtime, and their messages arrive as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_read_on_the_runtime_given_to_the_listener() {
    let reader = ReaderRuntime::start();
    let state = PeerListenerState::new();
    state.receive_on(reader.handle.clone());
    let mut listener = Listener::start_with_state(
        TransportConfig::new(CLUSTER_ID, 2),
        "127.0.0.1:0",
        1024,
        state,
    )
    .await;
    assert_eq!(reader.handle.metrics().num_alive_tasks(), 0);
    let mut transport =
        PeerTransport::new(TransportConfig::new(CLUSTER_ID, 1)).expect("valid config");
    transport
        .add_peer(2, listener.address.to_string())
        .expect("valid peer");
    send_all(&transport, (0..200).map(sample_message)).await;
    for seq in 0..200 {
        assert_eq!(listener.receive().await, (1, sample_message(seq)));
    }
    assert_eq!(
        reader.handle.metrics().num_alive_tasks(),
        1,
        "the connection is not read on the given runtime"
    );
    drop(transport);
    listener.stop().await;
    reader.stop();
}

/// Transports for nodes 1 and 2, each with the other's listener as its peer.
fn linked_transports(node1: &Listener, node2: &Listener) -> (PeerTransport, PeerTransport) {
    let mut transport1 = PeerTransport::new(TransportConfig::new(CLUSTER_ID, 1)).expect("valid");
    let mut transport2 = PeerTransport::new(TransportConfig::new(CLUSTER_ID, 2)).expect("valid");
    transport1
        .add_peer(2, node2.address.to_string())
        .expect("valid peer");
    transport2
        .add_peer(1, node1.address.to_string())
        .expect("valid peer");
    (transport1, transport2)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_directions_between_two_nodes() {
    let mut node1 = Listener::start(1, "127.0.0.1:0").await;
    let mut node2 = Listener::start(2, "127.0.0.1:0").await;
    let (transport1, transport2) = linked_transports(&node1, &node2);
    for seq in 0..100 {
        let to_2 = sample_message(seq);
        let to_1 = Message {
            from: 2,
            to: 1,
            ..sample_message(seq)
        };
        send_all(&transport1, [to_2.clone()]).await;
        send_all(&transport2, [to_1.clone()]).await;
        assert_eq!(node2.receive().await, (1, to_2));
        assert_eq!(node1.receive().await, (2, to_1));
    }
    assert!(matches!(
        transport1.send(Message {
            to: 9,
            ..sample_message(0)
        }),
        Err(Error::UnknownPeer { peer: 9 })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnects_after_the_listener_restarts() {
    let mut listener = Listener::start(2, "127.0.0.1:0").await;
    let address = listener.address;
    let mut transport = PeerTransport::new(TransportConfig::new(CLUSTER_ID, 1)).expect("valid");
    transport
        .add_peer(2, address.to_string())
        .expect("valid peer");
    send_all(&transport, [sample_message(1)]).await;
    assert_eq!(listener.receive().await.1, sample_message(1));

    listener.stop().await;
    wait_until(|| {
        transport
            .peer_stats(2)
            .is_some_and(|stats| !stats.connected)
    })
    .await;
    // Sent while the peer is down: queued, maybe lost; Raft tolerates either.
    send_all(&transport, [sample_message(2)]).await;

    let mut listener = Listener::start(2, &address.to_string()).await;
    wait_until(|| {
        transport
            .peer_stats(2)
            .is_some_and(|stats| stats.connections == 2)
    })
    .await;
    send_all(&transport, (100..200).map(sample_message)).await;
    let mut received = Vec::new();
    while received.last() != Some(&sample_message(199)) {
        received.push(listener.receive().await.1);
    }
    let expected: Vec<Message> = (100..200).map(sample_message).collect();
    assert!(
        received.ends_with(&expected),
        "messages after the reconnect all arrive in order"
    );
    listener.stop().await;
}

async fn receive_call(calls: &mut mpsc::Receiver<InboundCall>) -> InboundCall {
    tokio::time::timeout(WAIT, calls.recv())
        .await
        .expect("a call arrives in time")
        .expect("the listener still runs")
}

fn call(id: u64) -> PeerCall {
    PeerCall {
        id,
        payload: id.to_be_bytes().to_vec(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_and_answers_travel_beside_messages_and_a_call_from_before_a_link_failure_never_arrives()
 {
    let node1 = Listener::start(1, "127.0.0.1:0").await;
    let mut node2 = Listener::start(2, "127.0.0.1:0").await;
    let (sink1, mut calls_at_1) = mpsc::channel(16);
    node1.state.take_calls_into(sink1);
    let (sink2, mut calls_at_2) = mpsc::channel(16);
    node2.state.take_calls_into(sink2);
    let (mut transport1, transport2) = linked_transports(&node1, &node2);
    let (calls1, calls2) = (transport1.calls(), transport2.calls());
    // A call made before the link is up is given up at once (see below).
    wait_until(|| {
        transport1
            .peer_stats(2)
            .is_some_and(|stats| stats.connected)
    })
    .await;

    // A call and a Raft message share the link and its order.
    calls1.call(2, call(1)).expect("queued");
    send_all(&transport1, [sample_message(5)]).await;
    assert_eq!(
        receive_call(&mut calls_at_2).await,
        (1, PeerCallInput::Call(call(1)))
    );
    assert_eq!(node2.receive().await, (1, sample_message(5)));
    calls2.answer(1, call(1)).expect("queued");
    assert_eq!(
        receive_call(&mut calls_at_1).await,
        (2, PeerCallInput::Answer(call(1)))
    );
    assert!(matches!(
        calls1.call(9, call(2)),
        Err(Error::UnknownPeer { peer: 9 })
    ));

    // The peer goes away: a call made now is reported lost at once (queued, it would wait for
    // the next connect attempt while its caller may know a new leader), and it is not
    // delivered when the peer is back (its caller may have retried elsewhere).
    let address = node2.address;
    let _ = node2.stop().await;
    drop(calls_at_2);
    wait_until(|| {
        transport1
            .peer_stats(2)
            .is_some_and(|stats| !stats.connected)
    })
    .await;
    let ticket = calls1
        .call(2, call(2))
        .expect("queued while the peer is down");
    tokio::time::timeout(Duration::from_millis(1), calls1.link_failed(ticket))
        .await
        .expect("a call made while the link is down is reported lost at once");
    let node2 = Listener::start(2, &address.to_string()).await;
    let (sink2, mut calls_at_2) = mpsc::channel(16);
    node2.state.take_calls_into(sink2);
    wait_until(|| {
        transport1
            .peer_stats(2)
            .is_some_and(|stats| stats.connected)
    })
    .await;
    let ticket = calls1.call(2, call(3)).expect("queued");
    assert_eq!(
        receive_call(&mut calls_at_2).await,
        (1, PeerCallInput::Call(call(3))),
        "the call from before the failure must not arrive"
    );
    // The link that delivered it has not failed.
    assert!(
        tokio::time::timeout(Duration::from_millis(200), calls1.link_failed(ticket))
            .await
            .is_err()
    );

    // A member that takes no calls drops them and counts them.
    let bare = Listener::start(3, "127.0.0.1:0").await;
    transport1
        .add_peer(3, bare.address.to_string())
        .expect("valid peer");
    wait_until(|| {
        transport1
            .peer_stats(3)
            .is_some_and(|stats| stats.connected)
    })
    .await;
    calls1.call(3, call(4)).expect("queued");
    wait_until(|| bare.state.stats.calls_dropped.load(Ordering::Relaxed) == 1).await;
    // Removing a peer fails its calls at once.
    let ticket = calls1.call(3, call(5)).expect("queued");
    transport1.remove_peer(3);
    tokio::time::timeout(WAIT, calls1.link_failed(ticket))
        .await
        .expect("a removed peer's calls are lost");
}

/// Calls queued by a burst of tasks that became ready together leave in one write, not one
/// write each: on a single worker tokio runs the link's task right after the first call wakes
/// it, unless the link first lets the other ready tasks run.
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn calls_queued_by_tasks_ready_together_share_a_write() {
    const BURST: u64 = 32;
    let node1 = Listener::start(1, "127.0.0.1:0").await;
    let node2 = Listener::start(2, "127.0.0.1:0").await;
    let (sink2, mut calls_at_2) = mpsc::channel(64);
    node2.state.take_calls_into(sink2);
    let (transport1, _transport2) = linked_transports(&node1, &node2);
    let calls1 = transport1.calls();
    wait_until(|| {
        transport1
            .peer_stats(2)
            .is_some_and(|stats| stats.connected)
    })
    .await;
    calls1.call(2, call(0)).expect("queued");
    assert_eq!(
        receive_call(&mut calls_at_2).await,
        (1, PeerCallInput::Call(call(0)))
    );
    let before = transport1.peer_stats(2).expect("peer 2 added");

    let (go, ready) = tokio::sync::watch::channel(false);
    let callers: Vec<_> = (1..=BURST)
        .map(|id| {
            let calls = calls1.clone();
            let mut ready = ready.clone();
            tokio::spawn(async move {
                ready
                    .wait_for(|go| *go)
                    .await
                    .expect("the test holds the sender");
                calls.call(2, call(id)).expect("queued");
            })
        })
        .collect();
    go.send(true).expect("callers wait");
    for caller in callers {
        caller.await.expect("caller ends");
    }
    // The callers ran in whatever order the worker took them; each call arrives once.
    let mut arrived = std::collections::BTreeSet::new();
    for _ in 1..=BURST {
        match receive_call(&mut calls_at_2).await {
            (1, PeerCallInput::Call(received)) => {
                assert_eq!(received, call(received.id), "a call arrives intact");
                assert!(
                    arrived.insert(received.id),
                    "call {} arrived twice",
                    received.id
                );
            }
            other => panic!("expected a call from member 1, got {other:?}"),
        }
    }
    assert_eq!(arrived, (1..=BURST).collect());
    let after = transport1.peer_stats(2).expect("peer 2 added");
    assert_eq!(after.sent_messages - before.sent_messages, BURST);
    let writes = after.sent_writes - before.sent_writes;
    assert!(
        writes <= 2,
        "{BURST} calls queued in one pass of the worker took {writes} writes"
    );
}

/// A raw connection after the handshake with the cluster's (weak) key, for feeding hand-made
/// frames; the answer is the listener's last handshake frame.
async fn handshaken(address: SocketAddr, hello: Hello) -> (TcpStream, Option<Frame>) {
    handshaken_with(address, hello, &PeerKey::weak_from_cluster_id(CLUSTER_ID)).await
}

async fn handshaken_with(
    address: SocketAddr,
    hello: Hello,
    key: &PeerKey,
) -> (TcpStream, Option<Frame>) {
    let mut stream = TcpStream::connect(address).await.expect("listener accepts");
    let mut buffer = Vec::new();
    frame::encode_frame(&Frame::Hello(hello.clone()), &mut buffer).expect("encodes");
    stream.write_all(&buffer).await.expect("writes");
    let answer = tokio::time::timeout(WAIT, FrameReader::new(&mut stream).next_frame())
        .await
        .expect("answer in time")
        .expect("a well-formed answer");
    let Some(Frame::HelloChallenge(challenge)) = answer else {
        return (stream, answer);
    };
    let transcript = Transcript {
        cluster_id: hello.cluster_id,
        dialer: hello.from,
        listener: hello.to,
        dialer_nonce: &hello.nonce,
        listener_nonce: &challenge.nonce,
        dialer_name: &hello.name,
        dialer_client_address: &hello.client_address,
        dialer_vote_withheld_ms: hello.vote_withheld_ms,
        dialer_peer_address: &hello.peer_address,
    };
    buffer.clear();
    let proof = Frame::HelloProof(HelloProof {
        proof: transcript.dialer_proof(key),
    });
    frame::encode_frame(&proof, &mut buffer).expect("encodes");
    stream.write_all(&buffer).await.expect("writes");
    let answer = tokio::time::timeout(WAIT, FrameReader::new(&mut stream).next_frame())
        .await
        .expect("answer in time")
        .expect("a well-formed answer");
    (stream, answer)
}

fn good_hello() -> Hello {
    Hello {
        cluster_id: CLUSTER_ID,
        from: 1,
        to: 2,
        nonce: auth::new_nonce().expect("randomness"),
        name: "node1".into(),
        client_address: "127.0.0.1:2379".into(),
        vote_withheld_ms: 140,
        peer_address: "127.0.0.1:2380".into(),
    }
}

/// The listener closes the connection: reading yields end of stream (or a reset).
async fn assert_closed_by_listener(stream: &mut TcpStream) {
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(WAIT, stream.read(&mut byte))
        .await
        .expect("closed in time");
    assert!(
        matches!(read, Ok(0) | Err(_)),
        "expected the listener to close, read {read:?}"
    );
}

fn encoded(message: &Message) -> Vec<u8> {
    let mut buffer = Vec::new();
    frame::encode_message(message, &mut buffer).expect("encodes");
    buffer
}

#[tokio::test]
async fn corrupt_frame_closes_the_connection_cleanly() {
    let mut listener = Listener::start(2, "127.0.0.1:0").await;
    let (mut stream, answer) = handshaken(listener.address, good_hello()).await;
    assert!(matches!(answer, Some(Frame::HelloAccepted(_))));

    stream
        .write_all(&encoded(&sample_message(1)))
        .await
        .expect("writes");
    assert_eq!(listener.receive().await.1, sample_message(1));

    let mut corrupt = encoded(&sample_message(2));
    let last = corrupt.len() - 1;
    corrupt[last] ^= 0xFF;
    stream.write_all(&corrupt).await.expect("writes");
    assert_closed_by_listener(&mut stream).await;

    // The listener itself is unharmed and serves the next connection.
    let (mut stream, answer) = handshaken(listener.address, good_hello()).await;
    assert!(matches!(answer, Some(Frame::HelloAccepted(_))));
    stream
        .write_all(&encoded(&sample_message(3)))
        .await
        .expect("writes");
    assert_eq!(listener.receive().await.1, sample_message(3));
    assert!(
        listener.inbound.try_recv().is_err(),
        "the corrupt frame was not forwarded"
    );
}

#[tokio::test]
async fn oversize_frame_closes_the_connection_before_allocating() {
    let mut listener = Listener::start(2, "127.0.0.1:0").await;
    let (mut stream, _) = handshaken(listener.address, good_hello()).await;
    let mut header = Vec::new();
    header.extend_from_slice(&(MAX_PEER_FRAME_BYTES as u32 + 1).to_be_bytes());
    header.extend_from_slice(&0u32.to_be_bytes());
    stream.write_all(&header).await.expect("writes");
    assert_closed_by_listener(&mut stream).await;
    assert!(listener.inbound.try_recv().is_err());
}

#[tokio::test]
async fn spoofed_sender_or_recipient_is_dropped_and_counted() {
    let mut listener = Listener::start(2, "127.0.0.1:0").await;
    let (mut stream, _) = handshaken(listener.address, good_hello()).await;
    let spoofed = Message {
        from: 3,
        ..sample_message(1)
    };
    let misaddressed = Message {
        to: 7,
        ..sample_message(2)
    };
    stream.write_all(&encoded(&spoofed)).await.expect("writes");
    stream
        .write_all(&encoded(&misaddressed))
        .await
        .expect("writes");
    stream
        .write_all(&encoded(&sample_message(3)))
        .await
        .expect("writes");
    // Only the honest message arrives; the connection stays up.
    assert_eq!(listener.receive().await.1, sample_message(3));
    assert!(listener.inbound.try_recv().is_err());
    let stats = &listener.state.stats;
    assert_eq!(stats.messages_wrong_sender.load(Ordering::Relaxed), 1);
    assert_eq!(stats.messages_wrong_recipient.load(Ordering::Relaxed), 1);
}

#[tokio::test]
async fn a_wrong_secret_is_refused_and_nothing_after_it_is_read() {
    let config = TransportConfig {
        peer_key: PeerKey::from_secret(b"the-real-cluster-secret").expect("long enough"),
        ..TransportConfig::new(CLUSTER_ID, 2)
    };
    let listener = Listener::start_with(config, "127.0.0.1:0").await;
    for key in [
        PeerKey::weak_from_cluster_id(CLUSTER_ID),
        PeerKey::from_secret(b"some-other-secret-here").expect("long enough"),
    ] {
        let (mut stream, answer) = handshaken_with(listener.address, good_hello(), &key).await;
        let Some(Frame::HelloRejected(rejected)) = answer else {
            panic!("expected a rejection, got {answer:?}");
        };
        assert!(
            rejected.reason.contains("peer secret"),
            "{}",
            rejected.reason
        );
        let _ = stream.write_all(&encoded(&sample_message(1))).await;
        assert_closed_by_listener(&mut stream).await;
    }
    assert_eq!(
        listener
            .state
            .stats
            .authentication_failures
            .load(Ordering::Relaxed),
        2
    );
    let mut inbound = listener.stop().await;
    assert!(inbound.try_recv().is_err(), "no message was forwarded");
}

#[tokio::test]
async fn a_member_reading_from_a_lease_refuses_a_peer_that_would_vote_sooner() {
    let leased = |vote_withheld_ms, lease_read_ms| TransportConfig {
        vote_withheld_ms,
        lease_read_ms,
        ..TransportConfig::new(CLUSTER_ID, 2)
    };
    // Listener: 140 ms of withheld vote (15 ticks of 10 ms), a 112 ms lease.
    let listener = Listener::start_with(leased(140, 112), "127.0.0.1:0").await;
    let hasty = Hello {
        vote_withheld_ms: 40,
        ..good_hello()
    };
    let (mut stream, answer) = handshaken(listener.address, hasty).await;
    let Some(Frame::HelloRejected(rejected)) = answer else {
        panic!("expected a rejection, got {answer:?}");
    };
    assert!(
        rejected
            .reason
            .contains("node 1 withholds its vote for 40 ms")
            && rejected.reason.contains("--election-timeout-ms"),
        "{}",
        rejected.reason
    );
    assert_closed_by_listener(&mut stream).await;
    assert_eq!(
        listener
            .state
            .stats
            .handshakes_refused
            .load(Ordering::Relaxed),
        1
    );
    // The same window, or a longer one, is accepted.
    for vote_withheld_ms in [140, 290] {
        let hello = Hello {
            vote_withheld_ms,
            ..good_hello()
        };
        let (_stream, answer) = handshaken(listener.address, hello).await;
        assert!(
            matches!(answer, Some(Frame::HelloAccepted(_))),
            "{answer:?}"
        );
    }
    // Without a lease of its own, the listener has nothing to protect.
    let plain = Listener::start_with(leased(140, 0), "127.0.0.1:0").await;
    let hasty = Hello {
        vote_withheld_ms: 40,
        ..good_hello()
    };
    let (_stream, answer) = handshaken(plain.address, hasty).await;
    assert!(
        matches!(answer, Some(Frame::HelloAccepted(_))),
        "{answer:?}"
    );
}

#[tokio::test]
async fn idle_handshakes_time_out_and_never_hold_a_member_slot() {
    let config = TransportConfig {
        handshake_timeout_ms: 300,
        peer_connections_max: 1,
        peer_handshakes_max: 8,
        ..TransportConfig::new(CLUSTER_ID, 2)
    };
    let mut listener = Listener::start_with(config, "127.0.0.1:0").await;
    // More idle Hellos than member slots, none finishing the handshake.
    let mut idle = Vec::new();
    for from in 10..15 {
        let mut stream = TcpStream::connect(listener.address).await.expect("accepts");
        let mut buffer = Vec::new();
        let hello = Hello {
            from,
            ..good_hello()
        };
        frame::encode_frame(&Frame::Hello(hello), &mut buffer).expect("encodes");
        stream.write_all(&buffer).await.expect("writes");
        idle.push(stream);
    }
    // A real member still gets in while they are held.
    let (mut stream, answer) = handshaken(listener.address, good_hello()).await;
    assert!(
        matches!(answer, Some(Frame::HelloAccepted(_))),
        "{answer:?}"
    );
    stream
        .write_all(&encoded(&sample_message(1)))
        .await
        .expect("writes");
    assert_eq!(listener.receive().await.1, sample_message(1));
    // And the idle ones are closed by the handshake timeout.
    for stream in &mut idle {
        let mut sink = [0u8; 256];
        let closed = tokio::time::timeout(WAIT, async {
            while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
        })
        .await;
        assert!(closed.is_ok(), "an idle handshake outlived its timeout");
    }
    assert_eq!(
        listener
            .state
            .stats
            .handshake_timeouts
            .load(Ordering::Relaxed),
        5
    );
}

#[tokio::test]
async fn a_members_new_connection_replaces_its_old_one_and_idle_ones_close() {
    let config = TransportConfig {
        peer_connections_max: 1,
        peer_idle_timeout_ms: 400,
        keepalive_interval_ms: 100,
        ..TransportConfig::new(CLUSTER_ID, 2)
    };
    let mut listener = Listener::start_with(config, "127.0.0.1:0").await;
    let (mut old, _) = handshaken(listener.address, good_hello()).await;
    let (mut new, answer) = handshaken(listener.address, good_hello()).await;
    assert!(
        matches!(answer, Some(Frame::HelloAccepted(_))),
        "{answer:?}"
    );
    assert_closed_by_listener(&mut old).await;
    new.write_all(&encoded(&sample_message(1)))
        .await
        .expect("writes");
    assert_eq!(listener.receive().await.1, sample_message(1));
    // Another member is refused while the only slot is held...
    let (_, answer) = handshaken(
        listener.address,
        Hello {
            from: 3,
            ..good_hello()
        },
    )
    .await;
    assert!(
        matches!(&answer, Some(Frame::HelloRejected(r)) if r.reason.contains("too many")),
        "{answer:?}"
    );
    // ...until the holder goes idle and is closed.
    assert_closed_by_listener(&mut new).await;
    let (_, answer) = handshaken(
        listener.address,
        Hello {
            from: 3,
            ..good_hello()
        },
    )
    .await;
    assert!(
        matches!(answer, Some(Frame::HelloAccepted(_))),
        "{answer:?}"
    );
    let stats = &listener.state.stats;
    assert_eq!(stats.connections_replaced.load(Ordering::Relaxed), 1);
    assert!(stats.connections_idle_closed.load(Ordering::Relaxed) >= 1);
    // The announced attributes are there for the leader to record.
    let announced = listener.state.announced().borrow().clone();
    assert_eq!(announced.get(&1).map(|a| a.name.as_str()), Some("node1"));
}

#[tokio::test]
async fn keepalives_hold_an_idle_link_open() {
    let config = TransportConfig {
        peer_idle_timeout_ms: 300,
        keepalive_interval_ms: 50,
        ..TransportConfig::new(CLUSTER_ID, 2)
    };
    let mut listener = Listener::start_with(config.clone(), "127.0.0.1:0").await;
    let mut transport = PeerTransport::new(TransportConfig {
        node_id: 1,
        ..config
    })
    .expect("valid");
    transport
        .add_peer(2, listener.address.to_string())
        .expect("valid peer");
    send_all(&transport, [sample_message(1)]).await;
    assert_eq!(listener.receive().await.1, sample_message(1));
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    send_all(&transport, [sample_message(2)]).await;
    assert_eq!(listener.receive().await.1, sample_message(2));
    assert_eq!(transport.peer_stats(2).expect("added").connections, 1);
    assert_eq!(
        listener
            .state
            .stats
            .connections_idle_closed
            .load(Ordering::Relaxed),
        0
    );
}

#[tokio::test]
async fn handshake_mismatches_are_rejected_with_a_reason() {
    let listener = Listener::start(2, "127.0.0.1:0").await;
    let cases = [
        (
            Hello {
                cluster_id: CLUSTER_ID + 1,
                ..good_hello()
            },
            "cluster id mismatch",
        ),
        (
            Hello {
                to: 5,
                ..good_hello()
            },
            "dialed node 5",
        ),
        (
            Hello {
                from: 2,
                ..good_hello()
            },
            "cannot be a peer",
        ),
    ];
    for (hello, expected) in cases {
        let (mut stream, answer) = handshaken(listener.address, hello).await;
        let Some(Frame::HelloRejected(rejected)) = answer else {
            panic!("expected a rejection, got {answer:?}");
        };
        assert!(rejected.reason.contains(expected), "{}", rejected.reason);
        assert_closed_by_listener(&mut stream).await;
    }

    // A transport configured for another cluster never gets a connection up.
    let mut transport = PeerTransport::new(TransportConfig::new(CLUSTER_ID + 1, 1)).expect("valid");
    transport
        .add_peer(2, listener.address.to_string())
        .expect("valid peer");
    let _ = transport.send(sample_message(1));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let stats = transport.peer_stats(2).expect("added");
    assert_eq!(stats.connections, 0);
    assert!(!stats.connected);
    let mut inbound = listener.stop().await;
    assert!(inbound.try_recv().is_err());
}

#[tokio::test]
async fn a_full_queue_drops_the_newest_and_counts_it() {
    // Nobody listens at this address, so nothing leaves the queue.
    let unused = bind_peer_listener("127.0.0.1:0").await.expect("binds");
    let address = unused.local_addr().expect("has an address");
    drop(unused);
    let config = TransportConfig {
        queue_messages_max: 8,
        ..TransportConfig::new(CLUSTER_ID, 1)
    };
    let mut transport = PeerTransport::new(config).expect("valid");
    transport
        .add_peer(2, address.to_string())
        .expect("valid peer");
    let results: Vec<_> = (0..20)
        .map(|seq| transport.send(sample_message(seq)))
        .collect();
    assert!(results[..8].iter().all(Result::is_ok));
    assert!(
        results[8..]
            .iter()
            .all(|result| matches!(result, Err(Error::PeerQueueFull { peer: 2 })))
    );
    let stats = transport.peer_stats(2).expect("added");
    assert_eq!(stats.dropped_messages, 12);
    assert_eq!(stats.queued_messages, 8);
}

#[tokio::test]
async fn invalid_configuration_and_busy_address_are_fatal() {
    let config = TransportConfig {
        node_id: 0,
        ..TransportConfig::new(CLUSTER_ID, 1)
    };
    let error = PeerTransport::new(config)
        .err()
        .expect("node id 0 is refused");
    assert!(error.is_fatal());
    let taken = bind_peer_listener("127.0.0.1:0").await.expect("binds");
    let address = taken.local_addr().expect("has an address").to_string();
    let error = bind_peer_listener(&address)
        .await
        .expect_err("address in use");
    assert!(error.is_fatal());
    assert!(error.to_string().contains(&address));
}
