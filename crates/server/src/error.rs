//! The server's one error type.
//!
//! Variants fall in two groups, told apart by [`Error::is_fatal`]:
//! - operating errors concern one message or one connection; the caller logs them and carries
//!   on (Raft tolerates lost messages, and a broken connection is simply reopened);
//! - fatal errors mean the node cannot run as configured and must stop with one clear sentence.

use std::io;

use conclave_raft::NodeId;

/// Everything that can go wrong in the server.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    // ---- Operating errors ----
    /// The Raft core addressed a node the transport has no address for.
    #[error("peer {peer} is not known to the transport")]
    UnknownPeer { peer: NodeId },

    /// The bounded send queue to `peer` is full, so the newest message was dropped.
    #[error("send queue to peer {peer} is full; the message was dropped")]
    PeerQueueFull { peer: NodeId },

    /// A frame (sent or received) is over [`crate::transport::MAX_PEER_FRAME_BYTES`].
    #[error("peer frame of {size_bytes} bytes exceeds the {max_bytes}-byte limit")]
    FrameTooLarge { size_bytes: u64, max_bytes: u64 },

    /// A received frame's body does not match its CRC32C.
    #[error("peer frame checksum mismatch: header {expected:#010x}, body {actual:#010x}")]
    FrameChecksum { expected: u32, actual: u32 },

    /// A received frame uses a wire format version this node does not speak.
    #[error("peer frame has wire version {version}; this node speaks version {supported}")]
    FrameVersion { version: u8, supported: u8 },

    /// A received frame is structurally wrong: unknown kind, undecodable body, trailing bytes.
    #[error("malformed peer frame: {reason}")]
    FrameMalformed { reason: String },

    /// The connection ended in the middle of a frame.
    #[error("peer connection closed in the middle of a frame")]
    FrameTruncated,

    /// A well-formed frame arrived that the protocol does not allow at this point.
    #[error("peer protocol violation: {reason}")]
    ProtocolViolation { reason: String },

    /// The other side refused our handshake (or we refused theirs), for example because the
    /// cluster ids differ.
    #[error("peer handshake rejected: {reason}")]
    HandshakeRejected { reason: String },

    /// The other side of a peer handshake did not prove it knows the cluster's peer key.
    #[error("peer authentication failed: {reason}")]
    PeerAuthentication { reason: String },

    /// An authenticated peer connection carried no frame for too long.
    #[error("peer connection idle for {timeout_ms} ms")]
    PeerIdle { timeout_ms: u64 },

    /// The other side did not finish the handshake in time.
    #[error("peer handshake did not complete within {timeout_ms} ms")]
    HandshakeTimeout { timeout_ms: u64 },

    /// Opening a TCP connection to a peer took too long.
    #[error("connecting to peer {peer} at {address} timed out after {timeout_ms} ms")]
    ConnectTimeout {
        peer: NodeId,
        address: String,
        timeout_ms: u64,
    },

    /// The other side closed the connection.
    #[error("peer closed the connection")]
    ConnectionClosed,

    /// A socket operation on a peer connection failed.
    #[error("peer connection failed: {0}")]
    PeerIo(#[from] io::Error),

    // ---- Operating errors of client requests (etcd's strings: clients match on them) ----
    /// No leader is known, and none appeared before the request's deadline.
    #[error("etcdserver: no leader")]
    NoLeader,

    /// This node is not the leader; the caller forwards to `leader` (or waits for one).
    #[error("etcdserver: not leader (leader hint: {leader:?})")]
    NotLeader { leader: Option<NodeId> },

    /// The proposal or read was lost to a leader change; the caller may retry.
    #[error("etcdserver: leader changed")]
    LeaderChanged,

    /// The request did not complete before its deadline.
    #[error("etcdserver: request timed out")]
    Timeout,

    /// Too many proposals or reads are waiting on this node.
    #[error("etcdserver: too many requests")]
    TooManyRequests,

    /// The Raft core refused a proposal (uncommitted limit, transfer in progress, ...).
    #[error("etcdserver: {0}")]
    Raft(conclave_raft::Error),

    /// The node's driver has stopped (shutdown or a fatal error); nothing more is served.
    #[error("etcdserver: server stopped")]
    Stopped,

    /// The replicated machine refused the committed entry's bytes (every member skips it
    /// alike); only a proposer that encodes badly can cause it.
    #[error("entry {index} was rejected by the replicated machine: {reason}")]
    EntryRejected { index: u64, reason: String },

    // ---- Fatal errors ----
    /// A configuration value is out of range.
    #[error("invalid configuration: {reason}")]
    InvalidConfig { reason: String },

    /// The peer address cannot be listened on (in use, not local, no permission).
    #[error("cannot listen for peers on {address}: {source}")]
    PeerListen { address: String, source: io::Error },

    /// The client address cannot be listened on.
    #[error("cannot listen for clients on {address}: {source}")]
    ClientListen { address: String, source: io::Error },

    /// The metrics address cannot be listened on.
    #[error(
        "cannot listen for metrics on {address} (--listen-metrics; `none` turns it off): {source}"
    )]
    MetricsListen { address: String, source: io::Error },

    /// The write-ahead log or a snapshot failed (I/O, corruption, directory locked).
    #[error("storage: {0}")]
    Storage(#[from] conclave_storage::Error),

    /// The write-ahead log is damaged before its end, where no torn write can explain it; only
    /// an operator may decide to cut it.
    #[error(
        "storage: {corruption}; the log is damaged before its end, so the node will not start: \
         `conclave repair --data-dir {data_dir} --dry-run` shows what cutting it there loses and \
         `conclave repair --data-dir {data_dir}` cuts it (the node then catches up from its peers)"
    )]
    CorruptLog {
        corruption: String,
        data_dir: String,
    },

    /// The data directory was made by another cluster, or by another member of this one.
    #[error(
        "data directory {data_dir} belongs to member {found_member} of cluster {found_cluster:016x}, \
         not to member {member} of cluster {cluster:016x} (as --initial-cluster and the member id \
         say); give this node its own data directory or start it with the flags it was created with"
    )]
    OtherCluster {
        data_dir: String,
        found_cluster: u64,
        found_member: u64,
        cluster: u64,
        member: u64,
    },

    /// The data directory's identity file cannot be read or written.
    #[error("data directory identity file {path}: {reason}")]
    Identity { path: String, reason: String },

    /// The state machine could not be rebuilt from a snapshot.
    #[error("state machine snapshot cannot be restored: {0}")]
    StateRestore(String),

    /// The machine's encoder failed while writing a snapshot's image (the file itself did not:
    /// that is [`Error::Storage`]).
    #[error(
        "the state machine's image for the snapshot at index {index} cannot be encoded: {reason}"
    )]
    SnapshotEncode { index: u64, reason: String },

    /// The Raft core cannot start over the stored state.
    #[error("raft core cannot start: {0}")]
    RaftStart(String),

    /// A peer's TLS handshake failed, or its certificate does not name the member it claims.
    #[error("peer TLS refused: {reason}")]
    PeerTls { reason: String },

    /// The gRPC server failed.
    #[error("client API server failed: {0}")]
    ClientServe(String),
}

impl Error {
    /// Whether the node must stop: the error does not concern one message or connection but
    /// the node's configuration or environment.
    pub fn is_fatal(&self) -> bool {
        match self {
            Error::InvalidConfig { .. }
            | Error::PeerListen { .. }
            | Error::ClientListen { .. }
            | Error::MetricsListen { .. }
            | Error::Storage(_)
            | Error::CorruptLog { .. }
            | Error::OtherCluster { .. }
            | Error::Identity { .. }
            | Error::StateRestore(_)
            | Error::SnapshotEncode { .. }
            | Error::RaftStart(_)
            | Error::ClientServe(_) => true,
            Error::NoLeader
            | Error::NotLeader { .. }
            | Error::LeaderChanged
            | Error::Timeout
            | Error::TooManyRequests
            | Error::Raft(_)
            | Error::Stopped
            | Error::EntryRejected { .. } => false,
            Error::UnknownPeer { .. }
            | Error::PeerQueueFull { .. }
            | Error::FrameTooLarge { .. }
            | Error::FrameChecksum { .. }
            | Error::FrameVersion { .. }
            | Error::FrameMalformed { .. }
            | Error::FrameTruncated
            | Error::ProtocolViolation { .. }
            | Error::HandshakeRejected { .. }
            | Error::HandshakeTimeout { .. }
            | Error::PeerAuthentication { .. }
            | Error::PeerTls { .. }
            | Error::PeerIdle { .. }
            | Error::ConnectTimeout { .. }
            | Error::ConnectionClosed
            | Error::PeerIo(_) => false,
        }
    }
}
