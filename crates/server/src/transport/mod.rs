//! Peer transport: Raft messages between Conclave nodes over TCP.
//!
//! ```text
//!   node 1                                                   node 2
//!  ┌────────────────┐  send(msg to 2)                        ┌───────────────────┐
//!  │ Raft driver    │──► PeerTransport ── queue ── task ─TCP─► serve_peers        │
//!  │                │                                        │  └► mpsc ─► driver │
//!  │  ◄─ mpsc ◄─ serve_peers ◄─TCP─ task ── queue ── PeerTransport ◄─ send(msg to 1)
//!  └────────────────┘                                        └───────────────────┘
//! ```
//!
//! Each direction of each pair of nodes has its own long-lived connection, opened by the
//! sender: a node dials every peer it sends to ([`PeerTransport`]) and accepts connections
//! from every peer that sends to it ([`serve_peers`]). Messages are pipelined (nothing waits
//! for an acknowledgement; Raft's own responses are the acknowledgements) and batched (the
//! sender drains its queue into one buffer per write). Snapshot chunks are ordinary messages:
//! the Raft core already cuts snapshots into `SnapshotChunk`s.
//!
//! The wire format is in [`frame`] and `docs/transport.md`.
//!
//! # Use from the Raft driver
//!
//! ```no_run
//! # async fn example(ready_messages: Vec<conclave_raft::Message>) -> Result<(), conclave_server::Error> {
//! use conclave_server::transport::{PeerTransport, TransportConfig, bind_peer_listener, serve_peers};
//!
//! let config = TransportConfig::new(0xC0C1, 1);
//! let listener = bind_peer_listener("127.0.0.1:2380").await?;
//! let (inbound_sender, mut inbound) = tokio::sync::mpsc::channel(4096);
//! tokio::spawn(serve_peers(listener, config.clone(), inbound_sender, std::future::pending()));
//!
//! let mut transport = PeerTransport::new(config)?;
//! transport.add_peer(2, "127.0.0.1:2382")?;
//! for message in ready_messages {
//!     // Never blocks; a full queue drops the message, which Raft recovers from.
//!     let _ = transport.send(message);
//! }
//! while let Some((from, message)) = inbound.recv().await {
//!     // raw_node.step(message) ...
//! #   let _ = (from, message);
//! }
//! # Ok(()) }
//! ```

pub mod auth;
pub mod frame;
mod inbound;
mod outbound;
pub mod tls;

pub use auth::PeerKey;
pub use frame::PeerCall;
pub use frame::{MAX_PEER_FRAME_BYTES, WIRE_VERSION};
pub use inbound::{
    InboundCall, InboundMessage, InboundStats, PeerAttributes, PeerCallInput, PeerListenerState,
    bind_peer_listener, serve_peers, serve_peers_with,
};
pub use outbound::{CallTicket, PeerCalls, PeerStats, PeerTransport};
pub use tls::PeerTls;

use conclave_raft::NodeId;

use crate::error::Error;

/// Settings shared by both directions of the transport. Every bound has its unit in its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransportConfig {
    /// Both ends of a connection must agree on it; it keeps two clusters from mixing.
    pub cluster_id: u64,
    /// This node's id; never 0.
    pub node_id: NodeId,
    /// Messages that may wait for one peer before new ones are dropped.
    pub queue_messages_max: usize,
    /// Estimated bytes that may wait for one peer before new messages are dropped.
    pub queue_bytes_max: usize,
    /// A batch is written to the socket once its encoding reaches this many bytes.
    pub batch_bytes_max: usize,
    /// First wait after a failed connect; doubles on each further failure.
    pub reconnect_backoff_initial_ms: u64,
    /// The longest wait between connection attempts.
    pub reconnect_backoff_max_ms: u64,
    pub connect_timeout_ms: u64,
    /// A dialed connection whose sent data stays unacknowledged this long is dropped by the
    /// kernel (TCP_USER_TIMEOUT, Linux) and dialed again. Without it a connection cut by a
    /// partition that drops packets stays open, and the kernel's retransmission backoff
    /// (doubling up to two minutes) delays the first message after the partition heals by
    /// seconds; a new connection starts with a fresh timer.
    pub unacked_timeout_ms: u64,
    /// Time allowed for the whole authenticated Hello exchange on a new connection, in both
    /// directions; a connection that has not proved itself by then is closed.
    pub handshake_timeout_ms: u64,
    /// Authenticated inbound connections at once (one per member id: a member's new
    /// connection replaces its old one); a connection from a further id is refused.
    pub peer_connections_max: usize,
    /// Inbound connections still in the handshake at once; more are closed unanswered. They
    /// never hold one of the `peer_connections_max` slots.
    pub peer_handshakes_max: usize,
    /// An authenticated inbound connection that receives no frame for this long is closed.
    pub peer_idle_timeout_ms: u64,
    /// A dialer with nothing to send sends a keepalive after this long, well inside the
    /// listener's `peer_idle_timeout_ms`.
    pub keepalive_interval_ms: u64,
    /// What both ends prove they know in the handshake.
    pub peer_key: PeerKey,
    /// This node's member name and client address, announced in every Hello so the leader
    /// can record them (empty: nothing to announce).
    pub own_name: String,
    pub own_client_address: String,
    /// This node's peer address (`host:port`), announced in every Hello so that a member
    /// holding no record of this node yet can answer it (empty: nothing to announce).
    pub own_peer_address: String,
    /// How long this member withholds its vote after it heard from a leader or started, as
    /// its ticks measure it (`(election ticks - 1) * tick_ms`); announced in every Hello.
    /// 0 announces nothing.
    pub vote_withheld_ms: u64,
    /// This member's read lease (`--lease-reads`; 0 when off). With a lease, the listener
    /// refuses a member whose announced vote window is shorter than its own: that member
    /// could help elect a successor while this member's lease still runs.
    pub lease_read_ms: u64,
    /// Mutual TLS on the peer port (`--peer-cert-file ...`); `None` is plaintext. The HMAC
    /// handshake runs either way, inside TLS when it is on.
    pub tls: Option<std::sync::Arc<PeerTls>>,
    /// Lets the Raft driver write a message straight to a plain-TCP link's socket when
    /// nothing is queued ahead of it (see `outbound.rs`, `DirectLane`), instead of handing
    /// every message to the link's task.
    pub direct_writes: bool,
}

impl TransportConfig {
    /// Conclave's defaults for node `node_id` of cluster `cluster_id`, with the weak peer key
    /// derived from the cluster id (see [`PeerKey::weak_from_cluster_id`]); set `peer_key`
    /// for a real secret.
    ///
    /// The backoff cap is short because the failover target is well under a second: a peer
    /// that comes back must be reached again within a heartbeat or two, not after seconds.
    pub fn new(cluster_id: u64, node_id: NodeId) -> Self {
        TransportConfig {
            cluster_id,
            node_id,
            queue_messages_max: 4096,
            queue_bytes_max: 64 * 1024 * 1024,
            batch_bytes_max: 256 * 1024,
            reconnect_backoff_initial_ms: 10,
            reconnect_backoff_max_ms: 500,
            connect_timeout_ms: 1000,
            unacked_timeout_ms: 1000,
            handshake_timeout_ms: 2000,
            peer_connections_max: 64,
            peer_handshakes_max: 128,
            peer_idle_timeout_ms: 30_000,
            keepalive_interval_ms: 5_000,
            peer_key: PeerKey::weak_from_cluster_id(cluster_id),
            own_name: String::new(),
            own_client_address: String::new(),
            own_peer_address: String::new(),
            vote_withheld_ms: 0,
            lease_read_ms: 0,
            tls: None,
            direct_writes: true,
        }
    }

    /// Checks every field, naming the first one out of range.
    pub fn validate(&self) -> Result<(), Error> {
        let invalid = |reason: &str| {
            Err(Error::InvalidConfig {
                reason: reason.to_string(),
            })
        };
        if self.node_id == 0 {
            return invalid("node_id 0 is reserved");
        }
        if self.queue_messages_max == 0 || self.queue_bytes_max == 0 {
            return invalid("queue_messages_max and queue_bytes_max must be at least 1");
        }
        if self.batch_bytes_max == 0 || self.batch_bytes_max > MAX_PEER_FRAME_BYTES {
            return invalid("batch_bytes_max must be in 1..=MAX_PEER_FRAME_BYTES");
        }
        if self.reconnect_backoff_initial_ms == 0
            || self.reconnect_backoff_initial_ms > self.reconnect_backoff_max_ms
        {
            return invalid("reconnect backoff must satisfy 0 < initial_ms <= max_ms");
        }
        if self.connect_timeout_ms == 0
            || self.handshake_timeout_ms == 0
            || self.unacked_timeout_ms == 0
        {
            return invalid(
                "connect_timeout_ms, handshake_timeout_ms and unacked_timeout_ms must be at least 1",
            );
        }
        if self.peer_connections_max == 0 || self.peer_handshakes_max == 0 {
            return invalid("peer_connections_max and peer_handshakes_max must be at least 1");
        }
        if self.keepalive_interval_ms == 0
            || self.keepalive_interval_ms >= self.peer_idle_timeout_ms
        {
            return invalid(
                "keepalive_interval_ms must be at least 1 and below peer_idle_timeout_ms",
            );
        }
        Ok(())
    }

    /// Why a dialer that announced `hello` must be refused for this member's lease reads, if
    /// it must: its vote window is shorter than this member's, so the lease (sized from this
    /// member's window) could outlast it.
    pub fn lease_unsafe_with(&self, hello: &frame::Hello) -> Option<String> {
        if self.lease_read_ms == 0 || hello.vote_withheld_ms >= self.vote_withheld_ms {
            return None;
        }
        Some(format!(
            "node {} withholds its vote for {} ms after it hears from a leader, node {} for {} \
             ms and reads from a {} ms lease that relies on every member waiting as long; give \
             every member the same --tick-ms and --election-timeout-ms",
            hello.from,
            hello.vote_withheld_ms,
            self.node_id,
            self.vote_withheld_ms,
            self.lease_read_ms
        ))
    }
}
