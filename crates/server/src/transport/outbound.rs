//! Outbound side: one task and one long-lived connection per peer.
//!
//! ```text
//!  Raft driver ── send(msg) ──► bounded queue ──► peer task ──► TCP ──► peer's listener
//!                 (never blocks;  (messages and   (connect, handshake,
//!                  full: drop      bytes bounded)  batch-encode, write;
//!                  newest)                         on error: back off, reconnect)
//!        │                                            ▲
//!        └── direct lane: a link with nothing queued or being written takes the driver's
//!            message in one non-blocking write on the driver's own thread (sealed first
//!            when the link is TLS); what the socket does not take is left for the peer
//!            task to finish first
//! ```

use std::collections::{BTreeMap, HashMap};
use std::io::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use conclave_raft::{Message, MessageBody, NodeId};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::{ReadHalf, WriteHalf};
use tokio::sync::{Notify, mpsc, watch};
use tokio::task::JoinHandle;
use tokio_rustls::rustls::ClientConnection;
use tracing::{debug, info, warn};

use super::auth::{self, Transcript};
use super::frame::{
    self, Frame, FrameReader, HANDSHAKE_FRAME_BYTES_MAX, Hello, HelloProof, PeerCall,
};
use super::{PeerAttributes, TransportConfig};
use crate::error::Error;

/// Messages taken from the queue in one go; they are encoded into one buffer and written with
/// as few system calls as the batch byte limit allows.
const BATCH_MESSAGES_MAX: usize = 256;

/// Messages estimated larger than this always go through the queue, so the driver never
/// spends its turn encoding a snapshot chunk or a long catch-up append.
pub const DIRECT_WRITE_BYTES_MAX: u64 = 64 * 1024;

/// Sends Raft messages to the other members.
///
/// Each peer gets its own task, holding one outbound TCP connection (messages from the peer
/// to us arrive on the connection *it* opens, see [`super::serve_peers`]). Sending never blocks:
/// the message joins a bounded per-peer queue, and when the queue is full it is dropped and
/// counted. Raft tolerates loss, and the core re-sends what a follower misses.
///
/// The queue drops the *newest* message rather than the oldest: what is already queued stays
/// a contiguous run that the follower can still use, whereas evicting the head would punch a
/// hole that makes every queued append after it fail the log-matching check. It is also
/// lock-free (a full bounded channel simply refuses).
///
/// Dropping a `PeerTransport` stops every peer task and closes their connections.
pub struct PeerTransport {
    config: Arc<TransportConfig>,
    peers: HashMap<NodeId, Peer>,
    /// The same queues, for [`PeerCalls`] held outside the driver.
    call_queues: Arc<RwLock<HashMap<NodeId, CallQueue>>>,
    /// What authenticated dialers announced about themselves (the peer listener's record),
    /// for reaching a node this member holds no record of; see
    /// [`PeerTransport::route_unrecorded_by`].
    announced: Option<watch::Receiver<BTreeMap<NodeId, PeerAttributes>>>,
}

/// At most this many links to nodes this member holds no member record of (see
/// [`PeerTransport::add_announced_peer`]). An honest cluster needs one: the leader added
/// while this member was away, until this member applies that addition.
pub const UNRECORDED_PEER_LINKS_MAX: usize = 4;

struct Peer {
    address: String,
    queue: mpsc::Sender<Outgoing>,
    counters: Arc<PeerCounters>,
    lane: Arc<DirectLane>,
    task: JoinHandle<()>,
}

/// The driver's own way onto a peer's socket.
///
/// A put at one client crosses threads at every step: the driver queues its appends, the
/// async worker wakes to write them, and on a machine with few CPUs that wake-up can come
/// after the driver's own fsync instead of during it. When the link is connected and nothing
/// is queued or being written, the driver writes the message itself with one non-blocking
/// `write` on a duplicate of the socket's descriptor. On a TLS link the session lives here,
/// under the same lock, and every byte either side writes is sealed by it first: the
/// records' sequence numbers then follow the order of the writes. Writes never interleave:
/// the driver writes only while holding the lock and only while `pump_writing` is false, and
/// the peer task sets `pump_writing` under the lock before any write of its own and clears it
/// only when the queue is empty. Raft messages are queued under the same lock, so none is
/// written directly ahead of an older one still queued.
#[derive(Default)]
struct DirectLane {
    state: Mutex<LaneState>,
    /// Wakes the peer task when a direct write left a tail for it.
    tail_left: Notify,
}

#[derive(Default)]
struct LaneState {
    /// A duplicate of the connected socket, while the link is up.
    socket: Option<std::net::TcpStream>,
    /// The TLS session of the connection, when the link is TLS and up. Sealed bytes it has
    /// not written yet are the TLS form of `tail`: the next bytes on the stream.
    tls: Option<ClientConnection>,
    /// The peer task has bytes to write, or is writing; the driver queues.
    pump_writing: bool,
    /// What a direct write left unwritten of its frame: the next bytes on the stream.
    tail: Vec<u8>,
    /// Reused for encoding direct writes.
    buffer: Vec<u8>,
}

impl DirectLane {
    fn lock(&self) -> MutexGuard<'_, LaneState> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The peer task is about to write: from now on the driver queues. Returns the tail a
    /// direct write left, which must be written before anything else.
    fn begin_pump_write(&self) -> Vec<u8> {
        let mut state = self.lock();
        state.pump_writing = true;
        std::mem::take(&mut state.tail)
    }

    /// The peer task wrote what it had; the driver may write directly again once the queue
    /// is empty (checked under the lock the driver queues under).
    fn end_pump_write(&self, queue: &mpsc::Receiver<Outgoing>) {
        let mut state = self.lock();
        let sealed_left = state.tls.as_ref().is_some_and(|tls| tls.wants_write());
        if queue.is_empty() && state.tail.is_empty() && !sealed_left {
            state.pump_writing = false;
        }
    }

    /// A new connection: direct writes go to `socket` (a duplicate of the link's own; `None`
    /// where descriptors cannot be duplicated), sealed by `tls` when the link is TLS, once the
    /// queue drains.
    fn connected(&self, socket: Option<std::net::TcpStream>, tls: Option<ClientConnection>) {
        let mut state = self.lock();
        state.socket = socket;
        state.tls = tls;
        state.pump_writing = true;
        state.tail.clear();
    }

    /// The connection ended: drop the duplicate, so the socket really closes, and whatever
    /// frame was half-written on it.
    fn disconnected(&self) {
        let mut state = self.lock();
        state.socket = None;
        state.tls = None;
        state.pump_writing = true;
        state.tail.clear();
    }
}

#[derive(Clone)]
struct CallQueue {
    queue: mpsc::Sender<Outgoing>,
    counters: Arc<PeerCounters>,
}

/// What waits in a peer's queue.
enum Outgoing {
    Raft(Message),
    /// A [`Frame::Call`] or [`Frame::Answer`]. A call carries the link epoch it was queued in
    /// and is dropped unsent once the epoch moved on: its caller was told the link failed
    /// and may have tried elsewhere, so a late delivery could apply a write twice.
    Call {
        frame: Frame,
        epoch: Option<u64>,
    },
}

/// Sends [`PeerCall`]s (client writes a follower hands to the leader, and their answers)
/// over the same links and queues as the Raft messages. Cloned freely; held by the client API.
#[derive(Clone)]
pub struct PeerCalls {
    queues: Arc<RwLock<HashMap<NodeId, CallQueue>>>,
}

/// Where a call went: wait on [`PeerCalls::link_failed`] with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallTicket {
    pub peer: NodeId,
    epoch: u64,
}

impl PeerCalls {
    /// Queues `call` for `peer`. It is written on the link's current connection or a later
    /// one of the same epoch, or never; [`PeerCalls::link_failed`] says when it may be lost.
    /// On a link that is down the call is given up at once (the epoch moves, so it is never
    /// written and `link_failed` resolves now): it would otherwise wait for the link's next
    /// connect attempt, up to `reconnect_backoff_max_ms` away, while its caller may by then
    /// know a new leader to call (a dead leader's link stays down).
    /// Errors (operating): `UnknownPeer`, `PeerQueueFull`.
    pub fn call(&self, peer: NodeId, call: PeerCall) -> Result<CallTicket, Error> {
        let queue = self.queue(peer)?;
        let connected = queue.counters.connected.load(Ordering::Acquire);
        let epoch = queue.counters.link_epoch.load(Ordering::Acquire);
        queue
            .queue
            .try_send(Outgoing::Call {
                frame: Frame::Call(call),
                epoch: Some(epoch),
            })
            .map_err(|_| Error::PeerQueueFull { peer })?;
        if !connected {
            queue.counters.link_failed();
        }
        Ok(CallTicket { peer, epoch })
    }

    /// Queues the answer to a call `peer` made.
    pub fn answer(&self, peer: NodeId, answer: PeerCall) -> Result<(), Error> {
        self.queue(peer)?
            .queue
            .try_send(Outgoing::Call {
                frame: Frame::Answer(answer),
                epoch: None,
            })
            .map_err(|_| Error::PeerQueueFull { peer })
    }

    /// Resolves once the link a call went out on has failed since (a connection lost, or a
    /// connect attempt failed, or the peer was removed): the call may not have arrived, and
    /// its answer will not come on that link. Like a gRPC call whose connection broke.
    pub async fn link_failed(&self, ticket: CallTicket) {
        let Ok(queue) = self.queue(ticket.peer) else {
            return;
        };
        loop {
            let changed = queue.counters.link_changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if queue.counters.link_epoch.load(Ordering::Acquire) != ticket.epoch
                || queue.queue.is_closed()
            {
                return;
            }
            changed.await;
        }
    }

    fn queue(&self, peer: NodeId) -> Result<CallQueue, Error> {
        self.queues
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(&peer)
            .cloned()
            .ok_or(Error::UnknownPeer { peer })
    }
}

/// Shared between the sending side and the peer task.
#[derive(Default)]
struct PeerCounters {
    /// Estimated bytes of queued messages. Invariant: <= config.queue_bytes_max plus one
    /// message's estimate (a racing send may overshoot by one message before it backs out).
    queued_bytes: AtomicU64,
    sent_messages: AtomicU64,
    sent_bytes: AtomicU64,
    sent_writes: AtomicU64,
    dropped_messages: AtomicU64,
    direct_messages: AtomicU64,
    direct_tails: AtomicU64,
    connections: AtomicU64,
    connected: AtomicBool,
    /// Moves on every failed connect and lost connection; see [`PeerCalls::link_failed`].
    link_epoch: AtomicU64,
    link_changed: Notify,
}

impl PeerCounters {
    fn link_failed(&self) {
        self.link_epoch.fetch_add(1, Ordering::AcqRel);
        self.link_changed.notify_waiters();
    }
}

/// A point-in-time view of one peer's link, for metrics and status pages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerStats {
    pub address: String,
    /// Whether a handshaken connection is up right now.
    pub connected: bool,
    /// Messages waiting in the queue.
    pub queued_messages: usize,
    pub queued_bytes: u64,
    /// Messages written to a socket (not necessarily received: a connection may die after).
    pub sent_messages: u64,
    /// Frame bytes written to a socket.
    pub sent_bytes: u64,
    /// Batches written to a socket: `sent_messages / sent_writes` is how many messages share
    /// one write (and, on a busy link, one system call).
    pub sent_writes: u64,
    /// Messages dropped because the queue was full or the message was too large.
    pub dropped_messages: u64,
    /// Messages the sender wrote to the socket itself (see `TransportConfig::direct_writes`);
    /// also counted in `sent_messages`.
    pub direct_messages: u64,
    /// Direct writes the socket took only part of, finished by the link's task.
    pub direct_tails: u64,
    /// Successful handshakes so far; more than one means reconnects.
    pub connections: u64,
}

impl PeerTransport {
    /// A transport with no peers yet. Fails only on a configuration out of range.
    pub fn new(config: TransportConfig) -> Result<Self, Error> {
        config.validate()?;
        Ok(PeerTransport {
            config: Arc::new(config),
            peers: HashMap::new(),
            call_queues: Arc::new(RwLock::new(HashMap::new())),
            announced: None,
        })
    }

    /// Lets [`PeerTransport::add_announced_peer`] dial nodes at the peer address they
    /// announced in an authenticated handshake (`PeerListenerState::announced`). A member
    /// that was away while another was added and came to lead learns of the newcomer only
    /// from the newcomer's own messages, and must answer them before it holds its record.
    pub fn route_unrecorded_by(
        &mut self,
        announced: watch::Receiver<BTreeMap<NodeId, PeerAttributes>>,
    ) {
        self.announced = Some(announced);
    }

    /// Whether messages to `peer` have a link.
    pub fn has_peer(&self, peer: NodeId) -> bool {
        self.peers.contains_key(&peer)
    }

    /// Starts a link to `peer`, which is none of `recorded` (the members this node holds
    /// records of), at the peer address it announced when it last authenticated here. Does
    /// nothing and returns false when it announced none, when a link exists, or when
    /// [`UNRECORDED_PEER_LINKS_MAX`] links to unrecorded nodes are up already. Must be called
    /// inside a tokio runtime.
    pub fn add_announced_peer(&mut self, peer: NodeId, recorded: impl Fn(NodeId) -> bool) -> bool {
        if recorded(peer) || self.peers.contains_key(&peer) {
            return false;
        }
        let Some(attributes) = self
            .announced
            .as_ref()
            .and_then(|announced| announced.borrow().get(&peer).cloned())
        else {
            return false;
        };
        if attributes.peer_address.is_empty()
            || self.peers.keys().filter(|id| !recorded(**id)).count() >= UNRECORDED_PEER_LINKS_MAX
        {
            return false;
        }
        if let Some(tls) = &self.config.tls
            && !attributes.name.is_empty()
        {
            tls.note_member_name(peer, &attributes.name);
        }
        if self
            .add_peer(peer, attributes.peer_address.clone())
            .is_err()
        {
            return false;
        }
        info!(
            peer,
            address = %attributes.peer_address,
            "dialing a node this member holds no record of, at the address it announced"
        );
        true
    }

    /// A handle that sends [`PeerCall`]s to the peers this transport has.
    pub fn calls(&self) -> PeerCalls {
        PeerCalls {
            queues: Arc::clone(&self.call_queues),
        }
    }

    /// Starts sending to `peer` at `address` (`host:port`, resolved on every connect so a
    /// renamed host is followed). Re-adding a peer with another address restarts its link;
    /// with the same address it does nothing. Must be called inside a tokio runtime.
    ///
    /// Fails (fatal: a configuration error) for id 0 or this node's own id.
    pub fn add_peer(&mut self, peer: NodeId, address: impl Into<String>) -> Result<(), Error> {
        let address = address.into();
        if peer == 0 || peer == self.config.node_id {
            return Err(Error::InvalidConfig {
                reason: format!("node {} cannot have peer id {peer}", self.config.node_id),
            });
        }
        if self
            .peers
            .get(&peer)
            .is_some_and(|existing| existing.address == address)
        {
            return Ok(());
        }
        self.remove_peer(peer);
        let (queue, receiver) = mpsc::channel(self.config.queue_messages_max);
        let counters = Arc::new(PeerCounters::default());
        let lane = Arc::new(DirectLane::default());
        let link = PeerLink {
            config: Arc::clone(&self.config),
            peer,
            address: address.clone(),
            counters: Arc::clone(&counters),
            lane: Arc::clone(&lane),
        };
        let task = tokio::spawn(link.run(receiver));
        self.call_queues
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(
                peer,
                CallQueue {
                    queue: queue.clone(),
                    counters: Arc::clone(&counters),
                },
            );
        self.peers.insert(
            peer,
            Peer {
                address,
                queue,
                counters,
                lane,
                task,
            },
        );
        Ok(())
    }

    /// Stops sending to `peer`, dropping whatever is queued for it.
    pub fn remove_peer(&mut self, peer: NodeId) {
        self.call_queues
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .remove(&peer);
        if let Some(removed) = self.peers.remove(&peer) {
            removed.task.abort();
            removed.counters.link_failed();
        }
    }

    /// The peers messages can be sent to.
    /// Records what the cluster calls member `id`, which its peer certificate must name when
    /// peer TLS is on (a no-op without it).
    pub fn note_member_name(&self, id: NodeId, name: &str) {
        if let Some(tls) = &self.config.tls {
            tls.note_member_name(id, name);
        }
    }

    pub fn peers(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.peers.keys().copied()
    }

    /// Queues `message` for `message.to` and returns at once.
    ///
    /// Errors (both operating, the message is gone): `UnknownPeer` if `to` was never added,
    /// `PeerQueueFull` if the peer's queue is at its message or byte bound.
    pub fn send(&self, message: Message) -> Result<(), Error> {
        let peer_id = message.to;
        let Some(peer) = self.peers.get(&peer_id) else {
            return Err(Error::UnknownPeer { peer: peer_id });
        };
        let estimate_bytes = estimated_size_bytes(&message);
        // Held until the message is written or queued; see `DirectLane`.
        let mut lane = peer.lane.lock();
        if self.config.direct_writes
            && !lane.pump_writing
            && estimate_bytes <= DIRECT_WRITE_BYTES_MAX
            && let LaneState {
                socket: Some(socket),
                tls,
                pump_writing,
                tail,
                buffer,
            } = &mut *lane
        {
            let open = OpenLane {
                socket,
                tls: tls.as_mut(),
                pump_writing,
                tail,
                buffer,
            };
            return write_direct(open, &peer.lane, &peer.counters, message);
        }
        let queued_before = peer
            .counters
            .queued_bytes
            .fetch_add(estimate_bytes, Ordering::Relaxed);
        // An empty queue always admits one message, so a single message above the byte bound
        // still moves (the frame limit is what bounds a single message).
        let over_bytes = queued_before > 0
            && queued_before + estimate_bytes > self.config.queue_bytes_max as u64;
        if over_bytes || peer.queue.try_send(Outgoing::Raft(message)).is_err() {
            peer.counters
                .queued_bytes
                .fetch_sub(estimate_bytes, Ordering::Relaxed);
            peer.counters
                .dropped_messages
                .fetch_add(1, Ordering::Relaxed);
            return Err(Error::PeerQueueFull { peer: peer_id });
        }
        drop(lane);
        Ok(())
    }

    /// The link state of `peer`, if it was added.
    pub fn peer_stats(&self, peer: NodeId) -> Option<PeerStats> {
        let entry = self.peers.get(&peer)?;
        let counters = &entry.counters;
        Some(PeerStats {
            address: entry.address.clone(),
            connected: counters.connected.load(Ordering::Relaxed),
            queued_messages: entry.queue.max_capacity() - entry.queue.capacity(),
            queued_bytes: counters.queued_bytes.load(Ordering::Relaxed),
            sent_messages: counters.sent_messages.load(Ordering::Relaxed),
            sent_bytes: counters.sent_bytes.load(Ordering::Relaxed),
            sent_writes: counters.sent_writes.load(Ordering::Relaxed),
            dropped_messages: counters.dropped_messages.load(Ordering::Relaxed),
            direct_messages: counters.direct_messages.load(Ordering::Relaxed),
            direct_tails: counters.direct_tails.load(Ordering::Relaxed),
            connections: counters.connections.load(Ordering::Relaxed),
        })
    }
}

impl Drop for PeerTransport {
    fn drop(&mut self) {
        for peer in self.peers.values() {
            peer.task.abort();
            peer.counters.link_failed();
        }
    }
}

/// A [`LaneState`] with a socket, borrowed under the lane's lock for one direct write.
struct OpenLane<'a> {
    socket: &'a mut std::net::TcpStream,
    tls: Option<&'a mut ClientConnection>,
    pump_writing: &'a mut bool,
    tail: &'a mut Vec<u8>,
    buffer: &'a mut Vec<u8>,
}

/// Writes `message` on the driver's thread (see [`DirectLane`]). Whatever the socket does not
/// take at once is left as the lane's tail for the peer task, which writes it before anything
/// else; a socket error drops the message (the peer task sees the connection fail and
/// reconnects, and Raft sends again what was lost).
fn write_direct(
    lane: OpenLane<'_>,
    wake: &DirectLane,
    counters: &PeerCounters,
    message: Message,
) -> Result<(), Error> {
    let OpenLane {
        socket,
        tls,
        pump_writing,
        tail,
        buffer,
    } = lane;
    buffer.clear();
    if let Err(error) = frame::encode_message(&message, buffer) {
        counters.dropped_messages.fetch_add(1, Ordering::Relaxed);
        warn!(peer = message.to, kind = message.body.name(), %error, "dropping message");
        return Ok(());
    }
    let written = match tls {
        Some(tls) => seal_and_write(tls, socket, buffer),
        None => write_plain(socket, buffer),
    };
    let left_for_task = match written {
        Ok(left_for_task) => left_for_task,
        Err((error, stream_broken)) => {
            counters.dropped_messages.fetch_add(1, Ordering::Relaxed);
            if stream_broken {
                // Half a frame is on the wire, or the session sealed records the peer will
                // never see: nothing after it can be read there, and the peer task must
                // reconnect.
                let _ = socket.shutdown(std::net::Shutdown::Both);
            }
            return Err(Error::PeerIo(error));
        }
    };
    counters.sent_messages.fetch_add(1, Ordering::Relaxed);
    counters.direct_messages.fetch_add(1, Ordering::Relaxed);
    counters.sent_writes.fetch_add(1, Ordering::Relaxed);
    counters
        .sent_bytes
        .fetch_add(buffer.len() as u64, Ordering::Relaxed);
    if let Some(unwritten) = left_for_task {
        counters.direct_tails.fetch_add(1, Ordering::Relaxed);
        tail.extend_from_slice(&buffer[unwritten..]);
        *pump_writing = true;
        wake.tail_left.notify_one();
    }
    Ok(())
}

/// What a direct write left for the link's task: `Some(offset)` when the frame's bytes from
/// `offset` on are the lane's tail (on a TLS link the session holds its sealed remainder and
/// the offset is the frame's end). The error says whether the stream is broken.
type DirectWritten = Result<Option<usize>, (std::io::Error, bool)>;

/// Writes `frame` as it is, without blocking.
fn write_plain(socket: &mut std::net::TcpStream, frame: &[u8]) -> DirectWritten {
    let mut written = 0;
    while written < frame.len() {
        match socket.write(&frame[written..]) {
            Ok(0) => break,
            Ok(n) => written += n,
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(error) => return Err((error, written > 0)),
        }
    }
    Ok((written < frame.len()).then_some(written))
}

/// Seals `frame` with the link's TLS session and writes what the socket takes without
/// blocking; sealed bytes the socket did not take stay in the session.
fn seal_and_write(
    tls: &mut ClientConnection,
    socket: &mut std::net::TcpStream,
    frame: &[u8],
) -> DirectWritten {
    // Any error once sealing began leaves records the peer will never see.
    let broken = |error| Err((error, true));
    if let Err(error) = tls.writer().write_all(frame) {
        return broken(error);
    }
    while tls.wants_write() {
        match tls.write_tls(socket) {
            // A non-blocking socket takes nothing only when it is full.
            Ok(0) => return Ok(Some(frame.len())),
            Ok(_) => {}
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {
                return Ok(Some(frame.len()));
            }
            Err(error) => return broken(error),
        }
    }
    Ok(None)
}

/// What a queued message is charged against the byte bound: its payload plus a fixed
/// allowance for the envelope. An estimate, so `send` need not encode.
fn estimated_size_bytes(message: &Message) -> u64 {
    const ENVELOPE_BYTES: u64 = 64;
    const ENTRY_OVERHEAD_BYTES: u64 = 24;
    let payload_bytes = match &message.body {
        MessageBody::Append { entries, .. } => entries
            .iter()
            .map(|entry| entry.payload_size() + ENTRY_OVERHEAD_BYTES)
            .sum(),
        MessageBody::SnapshotChunk { data, meta, .. } => {
            data.len() as u64 + 8 * meta.conf_state.members().len() as u64
        }
        MessageBody::Heartbeat { context, .. } | MessageBody::HeartbeatResponse { context, .. } => {
            context.as_ref().map_or(0, |context| context.len() as u64)
        }
        MessageBody::ReadIndexRequest { context }
        | MessageBody::ReadIndexResponse { context, .. } => context.len() as u64,
        MessageBody::AppendResponse { .. }
        | MessageBody::Vote { .. }
        | MessageBody::VoteResponse { .. }
        | MessageBody::SnapshotResponse { .. }
        | MessageBody::TimeoutNow => 0,
    };
    ENVELOPE_BYTES + payload_bytes
}

/// How a connection ended without an error.
enum LinkEnd {
    /// The transport dropped this peer: stop for good.
    QueueClosed,
}

/// The task behind one peer.
struct PeerLink {
    config: Arc<TransportConfig>,
    peer: NodeId,
    address: String,
    counters: Arc<PeerCounters>,
    lane: Arc<DirectLane>,
}

impl PeerLink {
    async fn run(self, mut queue: mpsc::Receiver<Outgoing>) {
        let mut backoff_ms = self.config.reconnect_backoff_initial_ms;
        let mut failures_in_row = 0u64;
        loop {
            let (stream, direct, tls) = match self.connect().await {
                Ok(connected) => connected,
                Err(error) => {
                    failures_in_row += 1;
                    self.counters.link_failed();
                    // Say it once loudly; a peer that stays down would otherwise flood the log.
                    if failures_in_row == 1 {
                        warn!(peer = self.peer, address = %self.address, %error, "cannot reach peer; retrying with backoff");
                    } else {
                        debug!(peer = self.peer, %error, failures_in_row, "peer still unreachable");
                    }
                    if matches!(error, Error::HandshakeRejected { .. }) {
                        // A rejection will not fix itself quickly; wait the longest step.
                        backoff_ms = self.config.reconnect_backoff_max_ms;
                    }
                    tokio::time::sleep(Duration::from_millis(backoff_ms)).await;
                    backoff_ms = (backoff_ms * 2).min(self.config.reconnect_backoff_max_ms);
                    continue;
                }
            };
            info!(peer = self.peer, address = %self.address, "connected to peer");
            failures_in_row = 0;
            self.counters.connections.fetch_add(1, Ordering::Relaxed);
            self.counters.connected.store(true, Ordering::Release);
            let connected_at = Instant::now();
            self.lane.connected(direct, tls);
            let outcome = self.pump(stream, &mut queue).await;
            self.lane.disconnected();
            self.counters.connected.store(false, Ordering::Release);
            self.counters.link_failed();
            match outcome {
                Ok(LinkEnd::QueueClosed) => return,
                Err(error) => {
                    warn!(peer = self.peer, %error, "peer connection lost; reconnecting");
                    // Only a connection that lived a while resets the backoff, so a peer that
                    // accepts and then drops us at once is retried ever more slowly.
                    let lived_ms = connected_at.elapsed().as_millis() as u64;
                    if lived_ms >= self.config.reconnect_backoff_max_ms {
                        backoff_ms = self.config.reconnect_backoff_initial_ms;
                    }
                    tokio::time::sleep(Duration::from_millis(backoff_ms)).await;
                    backoff_ms = (backoff_ms * 2).min(self.config.reconnect_backoff_max_ms);
                }
            }
        }
    }

    /// Opens a connection and completes the handshake (TLS when on, then the Hello). Returns
    /// the socket, a duplicate of it for the driver's direct writes, and on a TLS link the
    /// session that seals every byte written to it from now on.
    async fn connect(&self) -> Result<ConnectedLink, Error> {
        let timeout = Duration::from_millis(self.config.connect_timeout_ms);
        let stream = tokio::time::timeout(timeout, TcpStream::connect(&self.address))
            .await
            .map_err(|_| Error::ConnectTimeout {
                peer: self.peer,
                address: self.address.clone(),
                timeout_ms: self.config.connect_timeout_ms,
            })??;
        // We batch ourselves; Nagle would only add latency to heartbeats and votes.
        stream.set_nodelay(true)?;
        set_unacked_timeout(&stream, self.config.unacked_timeout_ms)?;
        let handshake_timeout = Duration::from_millis(self.config.handshake_timeout_ms);
        let timed_out = |_| Error::HandshakeTimeout {
            timeout_ms: self.config.handshake_timeout_ms,
        };
        match &self.config.tls {
            Some(tls) => {
                let mut stream =
                    tokio::time::timeout(handshake_timeout, tls.connect(self.peer, stream))
                        .await
                        .map_err(timed_out)??;
                self.introduce(&mut stream).await?;
                // The listener sends nothing after its verdict, so the session holds no
                // record unread; from here on the link seals and writes by itself.
                let (socket, mut session) = stream.into_inner();
                // What the session buffers is bounded by the link's batch and the direct
                // lane's message size, not by rustls's default.
                session.set_buffer_limit(None);
                let direct = duplicate_socket(&socket)?;
                Ok((socket, direct, Some(session)))
            }
            None => {
                let mut stream = stream;
                self.introduce(&mut stream).await?;
                let direct = duplicate_socket(&stream)?;
                Ok((stream, direct, None))
            }
        }
    }

    /// The dialer's Hello and the proofs after it, within the handshake deadline.
    async fn introduce<S: AsyncRead + AsyncWrite + Unpin>(
        &self,
        stream: &mut S,
    ) -> Result<(), Error> {
        let handshake_timeout = Duration::from_millis(self.config.handshake_timeout_ms);
        let timed_out = |_| Error::HandshakeTimeout {
            timeout_ms: self.config.handshake_timeout_ms,
        };
        let dialer_nonce = auth::new_nonce()?;
        let hello = Hello {
            cluster_id: self.config.cluster_id,
            from: self.config.node_id,
            to: self.peer,
            nonce: dialer_nonce,
            name: self.config.own_name.clone(),
            client_address: self.config.own_client_address.clone(),
            vote_withheld_ms: self.config.vote_withheld_ms,
            peer_address: self.config.own_peer_address.clone(),
        };
        let mut buffer = Vec::new();
        frame::encode_frame(&Frame::Hello(hello), &mut buffer)?;
        stream.write_all(&buffer).await?;
        stream.flush().await?;
        tokio::time::timeout(handshake_timeout, self.authenticate(stream, &dialer_nonce))
            .await
            .map_err(timed_out)?
    }

    /// The dialer's side of the handshake after its Hello: check the listener's proof, send
    /// ours, wait for the verdict.
    async fn authenticate<S: AsyncRead + AsyncWrite + Unpin>(
        &self,
        stream: &mut S,
        dialer_nonce: &auth::Nonce,
    ) -> Result<(), Error> {
        // The reader may buffer past an answer only if the listener sent more than one frame
        // in a row, which it never does before the verdict, and nothing after it.
        let mut reader = FrameReader::new(&mut *stream);
        reader.set_frame_bytes_max(HANDSHAKE_FRAME_BYTES_MAX);
        let challenge = match reader.next_frame().await? {
            Some(Frame::HelloChallenge(challenge))
                if challenge.cluster_id == self.config.cluster_id
                    && challenge.node_id == self.peer =>
            {
                challenge
            }
            Some(Frame::HelloChallenge(challenge)) => {
                return Err(Error::HandshakeRejected {
                    reason: format!(
                        "expected node {} of cluster {:#x}, reached node {} of cluster {:#x}",
                        self.peer, self.config.cluster_id, challenge.node_id, challenge.cluster_id
                    ),
                });
            }
            other => return Err(handshake_answer_error(other)),
        };
        let transcript = Transcript {
            cluster_id: self.config.cluster_id,
            dialer: self.config.node_id,
            listener: self.peer,
            dialer_nonce,
            listener_nonce: &challenge.nonce,
            dialer_name: &self.config.own_name,
            dialer_client_address: &self.config.own_client_address,
            dialer_vote_withheld_ms: self.config.vote_withheld_ms,
            dialer_peer_address: &self.config.own_peer_address,
        };
        if !transcript.verify_listener(&self.config.peer_key, &challenge.proof) {
            return Err(Error::PeerAuthentication {
                reason: format!(
                    "node {} at {} did not prove the cluster's peer secret (check --peer-secret-file)",
                    self.peer, self.address
                ),
            });
        }
        let proof = HelloProof {
            proof: transcript.dialer_proof(&self.config.peer_key),
        };
        let mut buffer = Vec::new();
        frame::encode_frame(&Frame::HelloProof(proof), &mut buffer)?;
        reader.get_mut().write_all(&buffer).await?;
        reader.get_mut().flush().await?;
        match reader.next_frame().await? {
            Some(Frame::HelloAccepted(accepted))
                if accepted.cluster_id == self.config.cluster_id
                    && accepted.node_id == self.peer =>
            {
                Ok(())
            }
            other => Err(handshake_answer_error(other)),
        }
    }

    /// Moves messages from the queue to the socket until either side ends.
    async fn pump(
        &self,
        mut stream: TcpStream,
        queue: &mut mpsc::Receiver<Outgoing>,
    ) -> Result<LinkEnd, Error> {
        let sealed = self.lane.lock().tls.is_some();
        let (mut read_half, mut write_half) = stream.split();
        let mut batch = Vec::with_capacity(BATCH_MESSAGES_MAX);
        let mut buffer = Vec::with_capacity(self.config.batch_bytes_max);
        // The listener closes a connection idle for peer_idle_timeout_ms; a link with
        // nothing to say (between two followers, say) says so before that.
        let keepalive_interval = Duration::from_millis(self.config.keepalive_interval_ms);
        let keepalive_due = tokio::time::sleep(keepalive_interval);
        tokio::pin!(keepalive_due);
        loop {
            tokio::select! {
                received = queue.recv_many(&mut batch, BATCH_MESSAGES_MAX) => {
                    if received == 0 {
                        return Ok(LinkEnd::QueueClosed);
                    }
                    if batch.iter().any(|outgoing| matches!(outgoing, Outgoing::Call { .. })) {
                        gather_same_turn(queue, &mut batch).await;
                    }
                    let tail = self.lane.begin_pump_write();
                    write_half.write_all(&tail).await?;
                    self.write_batch(&mut batch, &mut buffer, &mut write_half, sealed).await?;
                    self.lane.end_pump_write(queue);
                    keepalive_due.as_mut().reset(tokio::time::Instant::now() + keepalive_interval);
                }
                () = self.lane.tail_left.notified() => {
                    let tail = self.lane.begin_pump_write();
                    write_half.write_all(&tail).await?;
                    if sealed {
                        self.write_sealed(&mut write_half).await?;
                    }
                    self.lane.end_pump_write(queue);
                }
                () = &mut keepalive_due => {
                    let tail = self.lane.begin_pump_write();
                    write_half.write_all(&tail).await?;
                    buffer.clear();
                    frame::encode_frame(&Frame::Keepalive, &mut buffer)?;
                    self.write_out(&buffer, &mut write_half, sealed).await?;
                    buffer.clear();
                    self.lane.end_pump_write(queue);
                    keepalive_due.as_mut().reset(tokio::time::Instant::now() + keepalive_interval);
                }
                // The listener never talks after the handshake, so any readiness here is the
                // connection closing; noticing it now beats losing the next batch into a
                // dead socket.
                closed = wait_closed(&mut read_half, sealed.then_some(&*self.lane)) => {
                    return Err(closed);
                }
            }
        }
    }

    async fn write_batch(
        &self,
        batch: &mut Vec<Outgoing>,
        buffer: &mut Vec<u8>,
        socket: &mut WriteHalf<'_>,
        sealed: bool,
    ) -> Result<(), Error> {
        buffer.clear();
        let mut messages_in_buffer = 0u64;
        for outgoing in batch.drain(..) {
            let encoded = match outgoing {
                Outgoing::Raft(message) => {
                    let estimate_bytes = estimated_size_bytes(&message);
                    self.counters
                        .queued_bytes
                        .fetch_sub(estimate_bytes, Ordering::Relaxed);
                    frame::encode_message(&message, buffer)
                        .map_err(|error| (message.body.name(), error))
                }
                Outgoing::Call { frame, epoch } => {
                    if epoch.is_some_and(|epoch| {
                        epoch != self.counters.link_epoch.load(Ordering::Acquire)
                    }) {
                        // Queued before the link failed; its caller has given up on it.
                        continue;
                    }
                    frame::encode_frame(&frame, buffer).map_err(|error| (frame_name(&frame), error))
                }
            };
            if let Err((kind, error)) = encoded {
                // Only an oversize message gets here; dropping it is all we can do.
                self.counters
                    .dropped_messages
                    .fetch_add(1, Ordering::Relaxed);
                warn!(peer = self.peer, kind, %error, "dropping message");
                continue;
            }
            messages_in_buffer += 1;
            if buffer.len() >= self.config.batch_bytes_max {
                self.flush(buffer, messages_in_buffer, socket, sealed)
                    .await?;
                messages_in_buffer = 0;
            }
        }
        self.flush(buffer, messages_in_buffer, socket, sealed).await
    }

    async fn flush(
        &self,
        buffer: &mut Vec<u8>,
        messages: u64,
        socket: &mut WriteHalf<'_>,
        sealed: bool,
    ) -> Result<(), Error> {
        if buffer.is_empty() {
            return Ok(());
        }
        self.write_out(buffer, socket, sealed).await?;
        self.counters
            .sent_messages
            .fetch_add(messages, Ordering::Relaxed);
        self.counters
            .sent_bytes
            .fetch_add(buffer.len() as u64, Ordering::Relaxed);
        self.counters.sent_writes.fetch_add(1, Ordering::Relaxed);
        buffer.clear();
        Ok(())
    }

    /// Writes `plaintext` to the peer: as it is on plain TCP, sealed by the lane's session
    /// on a TLS link (after whatever it holds sealed already).
    async fn write_out(
        &self,
        plaintext: &[u8],
        socket: &mut WriteHalf<'_>,
        sealed: bool,
    ) -> Result<(), Error> {
        if !sealed {
            socket.write_all(plaintext).await?;
            return Ok(());
        }
        {
            let mut lane = self.lane.lock();
            let tls = lane.tls.as_mut().ok_or(Error::ConnectionClosed)?;
            tls.writer().write_all(plaintext)?;
        }
        self.write_sealed(socket).await
    }

    /// Writes everything the lane's TLS session holds sealed, waiting for room on the socket
    /// without holding the lane's lock.
    async fn write_sealed(&self, socket: &mut WriteHalf<'_>) -> Result<(), Error> {
        loop {
            {
                let mut lane = self.lane.lock();
                let tls = lane.tls.as_mut().ok_or(Error::ConnectionClosed)?;
                loop {
                    if !tls.wants_write() {
                        return Ok(());
                    }
                    match tls.write_tls(&mut TryWrite(socket)) {
                        Ok(0) => break,
                        Ok(_) => {}
                        Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => break,
                        Err(error) => return Err(Error::PeerIo(error)),
                    }
                }
            }
            socket.writable().await?;
        }
    }
}

/// A link's write half as a non-blocking `std::io::Write`, for the TLS session to write into.
struct TryWrite<'a, 'b>(&'a WriteHalf<'b>);

impl std::io::Write for TryWrite<'_, '_> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.try_write(bytes)
    }

    fn write_vectored(&mut self, slices: &[std::io::IoSlice<'_>]) -> std::io::Result<usize> {
        self.0.try_write_vectored(slices)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A connected link: its socket, a duplicate for direct writes, and its TLS session if any.
type ConnectedLink = (
    TcpStream,
    Option<std::net::TcpStream>,
    Option<ClientConnection>,
);

/// Lets the tasks that are ready on this worker queue their calls before the link writes.
///
/// Tokio runs a task woken by the running one next, on the same worker. So when a burst of
/// tasks each queue one call or answer (the answers to the calls one Raft turn applied, a
/// follower's clients' writes), the first one's wake-up made this link write that message
/// alone, then the next, one system call each. Yielding once puts the link behind the tasks
/// already ready; what they queued meanwhile goes out in the same write. Only a batch that
/// holds a call waits: the Raft driver queues all of a turn's messages at once, from its own
/// thread, so its appends and heartbeats gain nothing by waiting and go out at once.
async fn gather_same_turn(queue: &mut mpsc::Receiver<Outgoing>, batch: &mut Vec<Outgoing>) {
    tokio::task::yield_now().await;
    while batch.len() < BATCH_MESSAGES_MAX {
        match queue.try_recv() {
            Ok(outgoing) => batch.push(outgoing),
            Err(_) => break,
        }
    }
}

/// A second descriptor for the same socket (it shares the socket's non-blocking mode), for
/// the driver's direct writes. `None` where descriptors cannot be duplicated this way.
#[cfg(unix)]
fn duplicate_socket(stream: &TcpStream) -> Result<Option<std::net::TcpStream>, Error> {
    use std::os::fd::AsFd;
    let duplicate = stream.as_fd().try_clone_to_owned()?;
    Ok(Some(std::net::TcpStream::from(duplicate)))
}

#[cfg(not(unix))]
fn duplicate_socket(_stream: &TcpStream) -> Result<Option<std::net::TcpStream>, Error> {
    Ok(None)
}

/// Resolves when the read half reports end of stream, an error, or unexpected bytes. On a
/// TLS link (`tls_lane`) the bytes are records for the lane's session: the peer's closing
/// alert ends the link, and a post-handshake message (a session ticket, a key update) is
/// taken in and the wait goes on.
async fn wait_closed(read_half: &mut ReadHalf<'_>, tls_lane: Option<&DirectLane>) -> Error {
    let mut received = [0u8; 4096];
    loop {
        let count = match read_half.read(&mut received).await {
            Ok(0) => return Error::ConnectionClosed,
            Ok(count) => count,
            Err(error) => return Error::PeerIo(error),
        };
        let Some(lane) = tls_lane else {
            return Error::ProtocolViolation {
                reason: "listener sent data after the handshake".into(),
            };
        };
        let mut lane = lane.lock();
        let Some(tls) = lane.tls.as_mut() else {
            return Error::ConnectionClosed;
        };
        let mut records = &received[..count];
        while !records.is_empty() {
            if let Err(error) = tls.read_tls(&mut records) {
                return Error::PeerIo(error);
            }
            match tls.process_new_packets() {
                Err(error) => {
                    return Error::PeerTls {
                        reason: format!("the peer's TLS records could not be read: {error}"),
                    };
                }
                Ok(state) if state.plaintext_bytes_to_read() > 0 => {
                    return Error::ProtocolViolation {
                        reason: "listener sent data after the handshake".into(),
                    };
                }
                Ok(state) if state.peer_has_closed() => return Error::ConnectionClosed,
                Ok(_) => {}
            }
        }
    }
}

/// The error for a handshake answer other than the one expected.
fn handshake_answer_error(answer: Option<Frame>) -> Error {
    match answer {
        Some(Frame::HelloRejected(rejected)) => Error::HandshakeRejected {
            reason: rejected.reason,
        },
        Some(Frame::HelloAccepted(accepted)) => Error::HandshakeRejected {
            reason: format!(
                "node {} of cluster {:#x} accepted a handshake it should not have",
                accepted.node_id, accepted.cluster_id
            ),
        },
        Some(other) => Error::ProtocolViolation {
            reason: format!("expected a handshake answer, got {}", frame_name(&other)),
        },
        None => Error::ConnectionClosed,
    }
}

pub(super) fn frame_name(frame: &Frame) -> &'static str {
    match frame {
        Frame::Hello(_) => "Hello",
        Frame::HelloAccepted(_) => "HelloAccepted",
        Frame::HelloRejected(_) => "HelloRejected",
        Frame::Message(_) => "Message",
        Frame::HelloChallenge(_) => "HelloChallenge",
        Frame::HelloProof(_) => "HelloProof",
        Frame::Keepalive => "Keepalive",
        Frame::Call(_) => "Call",
        Frame::Answer(_) => "Answer",
    }
}

/// Bounds how long data sent on `stream` may stay unacknowledged before the kernel drops the
/// connection (see `TransportConfig::unacked_timeout_ms`). Elsewhere than Linux the kernel's
/// own retransmission limits apply.
#[cfg(any(target_os = "linux", target_os = "android"))]
fn set_unacked_timeout(stream: &TcpStream, timeout_ms: u64) -> std::io::Result<()> {
    socket2::SockRef::from(stream).set_tcp_user_timeout(Some(Duration::from_millis(timeout_ms)))
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn set_unacked_timeout(_stream: &TcpStream, _timeout_ms: u64) -> std::io::Result<()> {
    Ok(())
}
