//! Inbound side: accept peer connections, authenticate them, and hand their messages to the
//! Raft driver.
//!
//! ```text
//!  peer ──TCP──► accept ──► handshake (pre-auth slot,  ──► authenticated slot ──► frames ──► driver
//!                            handshake_timeout_ms,          (one per member id;   (from/to checked,
//!                            small frames only)             idle timeout)          else dropped)
//! ```
//!
//! A connection that has not proved knowledge of the peer key holds only one of the
//! `peer_handshakes_max` pre-auth slots, and only for `handshake_timeout_ms`; the
//! `peer_connections_max` slots are for authenticated members, one each, and a member's new
//! connection replaces its old one (a restarted peer is never locked out by its own stale
//! connection).

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use conclave_raft::{Message, NodeId};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc, oneshot, watch};
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use super::TransportConfig;
use super::auth::{self, Transcript};
use super::frame::{
    self, Frame, FrameReader, HANDSHAKE_FRAME_BYTES_MAX, Hello, HelloAccepted, HelloChallenge,
    HelloRejected, MAX_PEER_FRAME_BYTES, PeerCall,
};
use super::outbound::frame_name;
use crate::error::Error;
use rustls_pki_types::CertificateDer;

/// A message received from a peer: the authenticated sender and the message itself.
pub type InboundMessage = (NodeId, Message);

/// A call or an answer received from a peer (see [`PeerCalls`](super::PeerCalls)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerCallInput {
    Call(PeerCall),
    Answer(PeerCall),
}

/// A [`PeerCallInput`] and the authenticated member it came from.
pub type InboundCall = (NodeId, PeerCallInput);

/// At most one WARN line per this many milliseconds for each kind of dropped input; the
/// rest are counted and the count is reported with the next line.
pub const DROP_WARN_INTERVAL_MS: u64 = 1000;

/// What an authenticated member announced about itself in its Hello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerAttributes {
    pub name: String,
    pub client_address: String,
    /// Where the member listens for peers; the driver dials it there when it must answer a
    /// member it holds no record of (see `PeerTransport::route_unrecorded_by`).
    pub peer_address: String,
}

/// Counters of what the listener refused or dropped; all only grow.
#[derive(Debug, Default)]
pub struct InboundStats {
    /// Hellos refused for the wrong cluster, the wrong addressee or an impossible sender id.
    pub handshakes_refused: AtomicU64,
    /// Dialers whose proof did not verify.
    pub authentication_failures: AtomicU64,
    /// Connections that did not finish the handshake within `handshake_timeout_ms`.
    pub handshake_timeouts: AtomicU64,
    /// Connections closed unanswered because every pre-auth slot was taken.
    pub handshakes_over_limit: AtomicU64,
    /// Authenticated connections refused because `peer_connections_max` ids held a slot.
    pub connections_over_limit: AtomicU64,
    /// Authenticated connections closed because the same member connected again.
    pub connections_replaced: AtomicU64,
    /// Authenticated connections closed after `peer_idle_timeout_ms` without a frame.
    pub connections_idle_closed: AtomicU64,
    /// Connections refused by peer TLS: a failed TLS handshake (no certificate, or one the
    /// CA did not sign) or a certificate that does not name the member the Hello claims.
    pub tls_refusals: AtomicU64,
    /// Messages dropped because their `from` was not the connection's member.
    pub messages_wrong_sender: AtomicU64,
    /// Messages dropped because their `to` was not this node.
    pub messages_wrong_recipient: AtomicU64,
    /// Calls and answers dropped because nothing takes them or their queue was full.
    pub calls_dropped: AtomicU64,
}

/// Logs one WARN per interval and counts the rest.
#[derive(Debug)]
struct WarnLimiter {
    start: Instant,
    /// Milliseconds since `start` of the last line, plus one (0: never).
    last_ms: AtomicU64,
    suppressed: AtomicU64,
}

impl WarnLimiter {
    fn new() -> Self {
        WarnLimiter {
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// `Some(lines suppressed since the last one)` when a line may be logged now.
    fn allow(&self) -> Option<u64> {
        let now_ms = u64::try_from(self.start.elapsed().as_millis())
            .unwrap_or(u64::MAX)
            .saturating_add(1);
        let last = self.last_ms.load(Ordering::Relaxed);
        let due = last == 0 || now_ms.saturating_sub(last) >= DROP_WARN_INTERVAL_MS;
        if due
            && self
                .last_ms
                .compare_exchange(last, now_ms, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            return Some(self.suppressed.swap(0, Ordering::Relaxed));
        }
        self.suppressed.fetch_add(1, Ordering::Relaxed);
        None
    }
}

/// What the listener shares with the rest of the node: its counters, and the attributes that
/// authenticated members announced (the leader records them, see `api::cluster`).
#[derive(Debug)]
pub struct PeerListenerState {
    pub stats: InboundStats,
    announced: watch::Sender<BTreeMap<NodeId, PeerAttributes>>,
    handshake_warns: WarnLimiter,
    message_warns: WarnLimiter,
    /// Where calls and answers go; unset, they are dropped (a node without peer calls).
    calls: std::sync::OnceLock<mpsc::Sender<InboundCall>>,
    /// The Raft driver's runtime, once it runs: connections accepted from then on are read
    /// on the driver's own thread (see [`PeerListenerState::receive_on`]).
    receive_runtime: std::sync::OnceLock<tokio::runtime::Handle>,
}

impl PeerListenerState {
    pub fn new() -> Arc<Self> {
        Arc::new(PeerListenerState {
            stats: InboundStats::default(),
            announced: watch::Sender::new(BTreeMap::new()),
            handshake_warns: WarnLimiter::new(),
            message_warns: WarnLimiter::new(),
            calls: std::sync::OnceLock::new(),
            receive_runtime: std::sync::OnceLock::new(),
        })
    }

    /// Reads connections accepted from now on in `runtime`, the Raft driver's: a message then
    /// reaches the driver without waking a worker thread to hand it over. A plain-TCP
    /// connection moves there at once; a TLS one after its handshake, whose CPU (and that of
    /// any stranger trying one) stays on the listener's runtime. Only the first runtime set is
    /// kept.
    pub fn receive_on(&self, runtime: tokio::runtime::Handle) {
        let _ = self.receive_runtime.set(runtime);
    }

    /// Sends every call and answer members send here to `sink` from now on. Only the first
    /// sink set is kept.
    pub fn take_calls_into(&self, sink: mpsc::Sender<InboundCall>) {
        let _ = self.calls.set(sink);
    }

    /// Hands a call or answer to the sink without waiting: a full sink drops it (the caller's
    /// deadline then ends the call), so one slow consumer never holds up Raft messages.
    fn deliver_call(&self, peer: NodeId, input: PeerCallInput) {
        let delivered = self
            .calls
            .get()
            .is_some_and(|sink| sink.try_send((peer, input)).is_ok());
        if !delivered {
            self.stats.calls_dropped.fetch_add(1, Ordering::Relaxed);
            if let Some(suppressed) = self.message_warns.allow() {
                warn!(peer, suppressed, "dropped a peer call: no room to take it");
            }
        }
    }

    /// The latest attributes each authenticated member announced, updated as they connect.
    pub fn announced(&self) -> watch::Receiver<BTreeMap<NodeId, PeerAttributes>> {
        self.announced.subscribe()
    }

    fn announce(&self, member: NodeId, attributes: PeerAttributes) {
        self.announced.send_if_modified(|announced| {
            if announced.get(&member) == Some(&attributes) {
                return false;
            }
            announced.insert(member, attributes);
            true
        });
    }

    fn warn_handshake(&self, remote: &std::net::SocketAddr, error: &Error) {
        if let Some(suppressed) = self.handshake_warns.allow() {
            warn!(%remote, %error, suppressed, "refused a peer connection");
        }
    }
}

/// Binds the peer listener. A failure here is fatal: the address is in use or not ours.
pub async fn bind_peer_listener(address: &str) -> Result<TcpListener, Error> {
    TcpListener::bind(address)
        .await
        .map_err(|source| Error::PeerListen {
            address: address.to_string(),
            source,
        })
}

/// [`serve_peers_with`] with state nobody else reads.
pub async fn serve_peers(
    listener: TcpListener,
    config: TransportConfig,
    inbound: mpsc::Sender<InboundMessage>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), Error> {
    serve_peers_with(
        listener,
        config,
        inbound,
        PeerListenerState::new(),
        shutdown,
    )
    .await
}

/// The authenticated connection of each member, so a new one can replace it.
#[derive(Default)]
struct Slots {
    next_generation: u64,
    held: HashMap<NodeId, (u64, oneshot::Sender<()>)>,
}

/// Accepts peer connections on `listener` and forwards every received message to `inbound`
/// until `shutdown` resolves or the receiving end of `inbound` is dropped. Returning closes
/// every accepted connection.
///
/// Each connection must complete the authenticated handshake (see [`super::auth`]) naming
/// this cluster and this node; anything else is answered with `HelloRejected` and closed. A
/// bad frame (checksum, size, version, undecodable) closes its connection; a message whose
/// `from` is not the authenticated member or whose `to` is not this node is dropped, counted
/// and warned about.
pub async fn serve_peers_with(
    listener: TcpListener,
    config: TransportConfig,
    inbound: mpsc::Sender<InboundMessage>,
    state: Arc<PeerListenerState>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), Error> {
    config.validate()?;
    let config = Arc::new(config);
    let handshakes = Arc::new(Semaphore::new(config.peer_handshakes_max));
    let slots = Arc::new(Mutex::new(Slots::default()));
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        // Reap finished connection tasks so the set does not grow with churn.
        while connections.try_join_next().is_some() {}
        let accepted = tokio::select! {
            () = &mut shutdown => break,
            () = inbound.closed() => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, remote) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                // Usually descriptor exhaustion; pausing lets connections close.
                warn!(%error, "accepting a peer connection failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(handshake_slot) = Arc::clone(&handshakes).try_acquire_owned() else {
            state
                .stats
                .handshakes_over_limit
                .fetch_add(1, Ordering::Relaxed);
            if let Some(suppressed) = state.handshake_warns.allow() {
                warn!(%remote, max = config.peer_handshakes_max, suppressed,
                    "too many peer connections in the handshake; closing the new one");
            }
            continue;
        };
        let receive_runtime = match (&config.tls, state.receive_runtime.get()) {
            (None, Some(runtime)) => Some(runtime.clone()),
            _ => None,
        };
        let inbound = inbound.clone();
        let connection = Connection {
            config: Arc::clone(&config),
            state: Arc::clone(&state),
            slots: Arc::clone(&slots),
            remote,
        };
        let serve = move |stream: TcpStream| async move {
            if let Err(error) = connection.run(stream, handshake_slot, &inbound).await {
                debug!(%remote, %error, "peer connection closed");
            }
        };
        match receive_runtime {
            Some(runtime) => {
                // The socket moves to the driver's reactor: leave this one, join that one.
                let stream = match stream.into_std() {
                    Ok(stream) => stream,
                    Err(error) => {
                        warn!(%remote, %error, "cannot hand a peer connection to the driver");
                        continue;
                    }
                };
                connections.spawn_on(
                    async move {
                        match TcpStream::from_std(stream) {
                            Ok(stream) => serve(stream).await,
                            Err(error) => debug!(%remote, %error, "peer connection closed"),
                        }
                    },
                    &runtime,
                );
            }
            None => {
                connections.spawn(async move { serve(stream).await });
            }
        }
    }
    info!("peer listener stopped");
    connections.shutdown().await;
    Ok(())
}

#[derive(Clone)]
struct Connection {
    config: Arc<TransportConfig>,
    state: Arc<PeerListenerState>,
    slots: Arc<Mutex<Slots>>,
    remote: std::net::SocketAddr,
}

/// A connection whose handshake is done, ready to be read.
enum Handshaken {
    Plain(FrameReader<TcpStream>),
    /// Boxed: a TLS session is kilobytes.
    Tls(Box<FrameReader<tokio_rustls::server::TlsStream<TcpStream>>>),
}

impl Connection {
    /// Runs one inbound connection to its end. `Ok` on a clean close by the peer, the driver
    /// or a newer connection of the same member.
    async fn run(
        &self,
        stream: TcpStream,
        handshake_slot: tokio::sync::OwnedSemaphorePermit,
        inbound: &mpsc::Sender<InboundMessage>,
    ) -> Result<(), Error> {
        stream.set_nodelay(true)?;
        let timeout_ms = self.config.handshake_timeout_ms;
        // TLS (when on) and the Hello exchange share one deadline: a connection that has not
        // proved itself by then is closed, whichever step it stalls in.
        let handshake = tokio::time::timeout(Duration::from_millis(timeout_ms), async {
            match &self.config.tls {
                Some(tls) => {
                    let (stream, certificate) = tls.accept(stream).await?;
                    let mut reader = FrameReader::new(stream);
                    reader.set_frame_bytes_max(HANDSHAKE_FRAME_BYTES_MAX);
                    let outcome = self.handshake(&mut reader, Some(&certificate)).await?;
                    Ok::<_, Error>((Handshaken::Tls(Box::new(reader)), outcome))
                }
                None => {
                    let mut reader = FrameReader::new(stream);
                    reader.set_frame_bytes_max(HANDSHAKE_FRAME_BYTES_MAX);
                    let outcome = self.handshake(&mut reader, None).await?;
                    Ok((Handshaken::Plain(reader), outcome))
                }
            }
        })
        .await;
        drop(handshake_slot);
        let (reader, (hello, replaced)) = match handshake {
            Err(_) => {
                self.state
                    .stats
                    .handshake_timeouts
                    .fetch_add(1, Ordering::Relaxed);
                let error = Error::HandshakeTimeout { timeout_ms };
                self.state.warn_handshake(&self.remote, &error);
                return Err(error);
            }
            Ok(Err(error)) => {
                if matches!(error, Error::PeerTls { .. }) {
                    self.state
                        .stats
                        .tls_refusals
                        .fetch_add(1, Ordering::Relaxed);
                }
                self.state.warn_handshake(&self.remote, &error);
                return Err(error);
            }
            Ok(Ok((_, None))) => return Ok(()),
            Ok(Ok((reader, Some(authenticated)))) => (reader, authenticated),
        };
        let peer = hello.from;
        let generation = replaced.generation;
        let outcome = match (reader, self.state.receive_runtime.get()) {
            (Handshaken::Plain(mut reader), _) => {
                self.receive(&mut reader, peer, replaced, inbound).await
            }
            (Handshaken::Tls(reader), Some(runtime)) => {
                self.receive_on_driver(*reader, runtime, peer, replaced, inbound)
                    .await
            }
            (Handshaken::Tls(mut reader), None) => {
                self.receive(&mut *reader, peer, replaced, inbound).await
            }
        };
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        if slots
            .held
            .get(&peer)
            .is_some_and(|(held, _)| *held == generation)
        {
            slots.held.remove(&peer);
        }
        outcome
    }

    /// Moves a handshaken TLS connection to `runtime`, the Raft driver's, and reads it there
    /// until it ends: its records are opened on the driver's thread, so a message reaches the
    /// driver without a worker thread waking to hand it over.
    async fn receive_on_driver(
        &self,
        reader: FrameReader<tokio_rustls::server::TlsStream<TcpStream>>,
        runtime: &tokio::runtime::Handle,
        peer: NodeId,
        claimed: Claimed,
        inbound: &mpsc::Sender<InboundMessage>,
    ) -> Result<(), Error> {
        let mut moved = None;
        let reader = reader.map_stream(|stream| {
            let (socket, session) = stream.into_inner();
            moved = Some(socket.into_std());
            OpenedRecords {
                socket: None,
                session,
            }
        });
        // Leave this runtime's reactor; the task joins the driver's below.
        let socket = moved.ok_or(Error::ConnectionClosed)??;
        let connection = self.clone();
        let inbound = inbound.clone();
        let receiving = runtime.spawn(async move {
            let mut reader = reader;
            reader.get_mut().socket = Some(TcpStream::from_std(socket)?);
            connection
                .receive(&mut reader, peer, claimed, &inbound)
                .await
        });
        // Dropping this task (the listener stopping) must stop the reading too.
        let mut receiving = AbortOnDrop(receiving);
        match (&mut receiving.0).await {
            Ok(outcome) => outcome,
            Err(_) => Err(Error::ConnectionClosed),
        }
    }

    /// The listener's side of the handshake. `None` when the dialer closed before a Hello.
    async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
        &self,
        reader: &mut FrameReader<S>,
        certificate: Option<&CertificateDer<'static>>,
    ) -> Result<Option<(Hello, Claimed)>, Error> {
        let config = &*self.config;
        let stats = &self.state.stats;
        let hello = match reader.next_frame().await? {
            Some(Frame::Hello(hello)) => hello,
            Some(other) => {
                stats.handshakes_refused.fetch_add(1, Ordering::Relaxed);
                let reason = format!("expected Hello, got {}", frame_name(&other));
                return Err(reject(reader, reason).await);
            }
            None => return Ok(None),
        };
        let refusal = if hello.cluster_id != config.cluster_id {
            Some(format!(
                "cluster id mismatch: node {} belongs to cluster {:#x}, node {} to cluster {:#x}",
                hello.from, hello.cluster_id, config.node_id, config.cluster_id
            ))
        } else if hello.to != config.node_id {
            Some(format!(
                "node {} dialed node {} but reached node {}",
                hello.from, hello.to, config.node_id
            ))
        } else if hello.from == 0 || hello.from == config.node_id {
            Some(format!(
                "node id {} cannot be a peer of node {}",
                hello.from, config.node_id
            ))
        } else {
            None
        };
        if let Some(reason) = refusal {
            stats.handshakes_refused.fetch_add(1, Ordering::Relaxed);
            return Err(reject(reader, reason).await);
        }
        if let (Some(tls), Some(certificate)) = (&config.tls, certificate)
            && let Some(reason) = tls.check_claim(certificate, hello.from, &hello.name)
        {
            stats.handshakes_refused.fetch_add(1, Ordering::Relaxed);
            let _ = reject(reader, reason.clone()).await;
            return Err(Error::PeerTls { reason });
        }
        if let Some(tls) = &config.tls
            && tls.member_name(hello.from).is_none()
        {
            // A member added at run time is named in the cluster's records only once it has
            // announced itself; until then its CA-signed certificate names it, so this node
            // can check the certificate when it dials the member back.
            tls.note_member_name(hello.from, &hello.name);
        }
        let listener_nonce = auth::new_nonce()?;
        let transcript = Transcript {
            cluster_id: config.cluster_id,
            dialer: hello.from,
            listener: config.node_id,
            dialer_nonce: &hello.nonce,
            listener_nonce: &listener_nonce,
            dialer_name: &hello.name,
            dialer_client_address: &hello.client_address,
            dialer_vote_withheld_ms: hello.vote_withheld_ms,
            dialer_peer_address: &hello.peer_address,
        };
        let challenge = HelloChallenge {
            cluster_id: config.cluster_id,
            node_id: config.node_id,
            nonce: listener_nonce,
            proof: transcript.listener_proof(&config.peer_key),
        };
        write_frame(reader, &Frame::HelloChallenge(challenge)).await?;
        let proof = match reader.next_frame().await? {
            Some(Frame::HelloProof(proof)) => proof,
            Some(other) => {
                stats.handshakes_refused.fetch_add(1, Ordering::Relaxed);
                let reason = format!("expected HelloProof, got {}", frame_name(&other));
                return Err(reject(reader, reason).await);
            }
            None => return Err(Error::ConnectionClosed),
        };
        if !transcript.verify_dialer(&config.peer_key, &proof.proof) {
            stats
                .authentication_failures
                .fetch_add(1, Ordering::Relaxed);
            let reason = format!(
                "node {} did not prove the cluster's peer secret (check --peer-secret-file)",
                hello.from
            );
            let _ = reject(reader, reason.clone()).await;
            return Err(Error::PeerAuthentication { reason });
        }
        if let Some(reason) = config.lease_unsafe_with(&hello) {
            stats.handshakes_refused.fetch_add(1, Ordering::Relaxed);
            return Err(reject(reader, reason).await);
        }
        let Some(claimed) = self.claim_slot(hello.from) else {
            stats.connections_over_limit.fetch_add(1, Ordering::Relaxed);
            let reason = format!(
                "too many peer connections: {} members already hold a slot",
                config.peer_connections_max
            );
            return Err(reject(reader, reason).await);
        };
        let accepted = HelloAccepted {
            cluster_id: config.cluster_id,
            node_id: config.node_id,
        };
        write_frame(reader, &Frame::HelloAccepted(accepted)).await?;
        debug!(peer = hello.from, "peer authenticated");
        if !hello.name.is_empty()
            || !hello.client_address.is_empty()
            || !hello.peer_address.is_empty()
        {
            self.state.announce(
                hello.from,
                PeerAttributes {
                    name: hello.name.clone(),
                    client_address: hello.client_address.clone(),
                    peer_address: hello.peer_address.clone(),
                },
            );
        }
        Ok(Some((hello, claimed)))
    }

    /// Takes the slot of `peer`, closing the member's previous connection if it has one.
    /// `None` when every slot is held by other members.
    fn claim_slot(&self, peer: NodeId) -> Option<Claimed> {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        if !slots.held.contains_key(&peer) && slots.held.len() >= self.config.peer_connections_max {
            return None;
        }
        slots.next_generation = slots.next_generation.wrapping_add(1);
        let generation = slots.next_generation;
        let (replace, replaced) = oneshot::channel();
        if let Some((_, previous)) = slots.held.insert(peer, (generation, replace)) {
            self.state
                .stats
                .connections_replaced
                .fetch_add(1, Ordering::Relaxed);
            let _ = previous.send(());
        }
        Some(Claimed {
            generation,
            replaced,
        })
    }

    /// Forwards the messages of authenticated member `peer` until the connection ends.
    async fn receive<R: AsyncRead + Unpin>(
        &self,
        reader: &mut FrameReader<R>,
        peer: NodeId,
        claimed: Claimed,
        inbound: &mpsc::Sender<InboundMessage>,
    ) -> Result<(), Error> {
        reader.set_frame_bytes_max(MAX_PEER_FRAME_BYTES);
        let idle_ms = self.config.peer_idle_timeout_ms;
        let idle = Duration::from_millis(idle_ms);
        let stats = &self.state.stats;
        let mut replaced = claimed.replaced;
        loop {
            let next = tokio::select! {
                biased;
                _ = &mut replaced => {
                    debug!(peer, "a newer connection of the peer replaced this one");
                    return Ok(());
                }
                next = tokio::time::timeout(idle, reader.next_frame()) => next,
            };
            let Ok(frame) = next else {
                stats
                    .connections_idle_closed
                    .fetch_add(1, Ordering::Relaxed);
                return Err(Error::PeerIdle {
                    timeout_ms: idle_ms,
                });
            };
            let message = match frame? {
                None => return Ok(()),
                Some(Frame::Keepalive) => continue,
                Some(Frame::Message(message)) => message,
                Some(Frame::Call(call)) => {
                    self.state.deliver_call(peer, PeerCallInput::Call(call));
                    continue;
                }
                Some(Frame::Answer(answer)) => {
                    self.state.deliver_call(peer, PeerCallInput::Answer(answer));
                    continue;
                }
                Some(other) => {
                    return Err(Error::ProtocolViolation {
                        reason: format!("expected Message, got {}", frame_name(&other)),
                    });
                }
            };
            let wrong = if message.from != peer {
                stats.messages_wrong_sender.fetch_add(1, Ordering::Relaxed);
                Some("its sender is not the member that authenticated the connection")
            } else if message.to != self.config.node_id {
                stats
                    .messages_wrong_recipient
                    .fetch_add(1, Ordering::Relaxed);
                Some("it is addressed to another node")
            } else {
                None
            };
            if let Some(reason) = wrong {
                if let Some(suppressed) = self.state.message_warns.allow() {
                    warn!(
                        peer, remote = %self.remote, from = message.from, to = message.to,
                        kind = message.body.name(), suppressed,
                        "dropped a peer message: {reason}"
                    );
                }
                continue;
            }
            if inbound.send((peer, message)).await.is_err() {
                // The driver is gone: the node is shutting down.
                return Ok(());
            }
        }
    }
}

/// An authenticated member's slot.
struct Claimed {
    generation: u64,
    /// Fires when a newer connection of the same member takes the slot.
    replaced: oneshot::Receiver<()>,
}

async fn write_frame<S: AsyncRead + AsyncWrite + Unpin>(
    reader: &mut FrameReader<S>,
    frame: &Frame,
) -> Result<(), Error> {
    let mut answer = Vec::new();
    frame::encode_frame(frame, &mut answer)?;
    let stream = reader.get_mut();
    stream.write_all(&answer).await?;
    stream.flush().await?;
    Ok(())
}

/// Tells the dialer why, then yields the error to log. The answer is best effort: the
/// connection closes either way.
async fn reject<S: AsyncRead + AsyncWrite + Unpin>(
    reader: &mut FrameReader<S>,
    reason: String,
) -> Error {
    let rejected = Frame::HelloRejected(HelloRejected {
        reason: reason.clone(),
    });
    let _ = write_frame(reader, &rejected).await;
    Error::HandshakeRejected { reason }
}

/// Aborts the task when dropped.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A TLS connection past its handshake, read by opening its records with its session here:
/// unlike tokio-rustls's stream, it can be taken apart on one runtime and put together on
/// another. The listener writes nothing after the handshake, so it only reads.
struct OpenedRecords {
    /// `None` only between leaving one runtime and joining the other.
    socket: Option<TcpStream>,
    session: tokio_rustls::rustls::ServerConnection,
}

impl AsyncRead for OpenedRecords {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        context: &mut std::task::Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::io::{ErrorKind, Read};
        use std::task::Poll;
        let this = self.get_mut();
        let Some(socket) = this.socket.as_ref() else {
            return Poll::Ready(Err(ErrorKind::NotConnected.into()));
        };
        loop {
            // What is opened already goes first.
            match this.session.reader().read(out.initialize_unfilled()) {
                Ok(count) => {
                    out.advance(count);
                    return Poll::Ready(Ok(()));
                }
                Err(error) if error.kind() == ErrorKind::WouldBlock => {}
                // The stream ended without the closing alert, or the session failed.
                Err(error) => return Poll::Ready(Err(error)),
            }
            if let Err(error) = std::task::ready!(socket.poll_read_ready(context)) {
                return Poll::Ready(Err(error));
            }
            match this.session.read_tls(&mut TryRead(socket)) {
                // End of stream: the next read above says whether it was a clean close.
                Ok(_) => {
                    if let Err(error) = this.session.process_new_packets() {
                        return Poll::Ready(Err(std::io::Error::new(
                            ErrorKind::InvalidData,
                            error,
                        )));
                    }
                }
                Err(error) if error.kind() == ErrorKind::WouldBlock => {}
                Err(error) => return Poll::Ready(Err(error)),
            }
        }
    }
}

/// A socket as a non-blocking `std::io::Read`, for the TLS session to read from.
struct TryRead<'a>(&'a TcpStream);

impl std::io::Read for TryRead<'_> {
    fn read(&mut self, bytes: &mut [u8]) -> std::io::Result<usize> {
        self.0.try_read(bytes)
    }
}
