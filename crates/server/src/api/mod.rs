//! The client API: etcd v3 gRPC services over the node runtime.
//!
//! ```text
//!  gRPC request ─► CallContext (deadline from grpc-timeout, forwarded?, session) ─► Api
//!    write:  Api::write ─► route ─► leader here ─► NodeHandle::propose ─► apply ─► convert
//!                                └► leader elsewhere ─► the same method on the leader
//!                                └► none ─► wait for one until the deadline, "no leader"
//!    linearizable read: Api::linearizable_barrier (route; the core asks the leader) ─► read
//!    serializable read: read the local state at once
//! ```
//!
//! Leader wait, forwarding, retries and the forwarded metadata live in [`route`] only.

pub mod auth;
pub mod cluster;
pub mod coalesce;
pub mod conclave;
pub mod convert;
pub mod election;
pub mod kv;
pub mod lease;
pub mod limits;
pub mod lock;
pub mod maintenance;
pub mod peer_calls;
pub mod route;
pub mod tls;
pub mod watch;
pub mod watch_hub;

pub use route::{
    ERROR_CODE_HEADER, ErrorCode, MemberChannels, Serve, Served, Target, answer, is_retriable,
    to_status, unexpected,
};

use std::sync::Arc;
use std::time::Duration;

use conclave_proto::etcdserverpb::ResponseHeader;
use conclave_raft::NodeId;
use conclave_state::SessionSeq;
use tokio::time::Instant;
use tonic::Status;

use crate::config::ServerConfig;
use crate::node::NodeHandle;

/// Metadata key marking a request a follower forwarded, so the receiver never forwards again.
pub const FORWARDED_HEADER: &str = "conclave-forwarded";
/// Metadata key naming the member that forwarded a write, in decimal: the leader has that
/// member hear of the commit at once, so it can answer its client (a hint: a wrong or absent
/// one only costs the forwarding member a wait of up to a tick).
pub const FORWARDED_BY_HEADER: &str = "conclave-forwarded-by";
/// Metadata keys of an exactly-once client session: the client id `OpenSession` returned and
/// the request's sequence number in that session. A write carrying them is applied at most
/// once however often it is retried (the state machine replays its cached answer).
pub const SESSION_CLIENT_HEADER: &str = "conclave-session-client";
pub const SESSION_SEQ_HEADER: &str = "conclave-session-seq";
/// Metadata key of the session's secret (32 lowercase hex digits), without which a session
/// position addresses only a session opened before secrets existed.
pub const SESSION_SECRET_HEADER: &str = "conclave-session-secret";
/// Answers are sent this long before the client's own deadline, so the client sees our error
/// ("no leader") rather than its own "deadline exceeded".
const DEADLINE_MARGIN_MS: u64 = 50;

/// What every handler knows about its call.
#[derive(Debug, Clone)]
pub struct CallContext {
    pub deadline: Instant,
    /// The request came from a follower; do not forward it again.
    pub forwarded: bool,
    /// The member that forwarded the call, as it said ([`FORWARDED_BY_HEADER`]).
    pub forwarded_by: Option<NodeId>,
    /// The client's exactly-once session position, when it sent one.
    pub session: Option<SessionSeq>,
    /// The lock fence the call carries (`conclave-fence`, set by the handler that checked
    /// it), passed on to the leader with the call.
    pub fence: Option<i64>,
    /// The etcd auth token the client sent (`token` metadata), passed on when forwarded; the
    /// member that proposes or serves the call verifies it (see [`auth`]).
    pub token: Option<Arc<str>>,
    /// The common name of the client's verified certificate, when `--client-cert-auth` is on
    /// and the connection carried one; the user when no token is sent.
    pub cert_user: Option<Arc<str>>,
}

impl CallContext {
    pub fn new<T>(request: &tonic::Request<T>, default_timeout_ms: u64) -> Self {
        let metadata = request.metadata();
        let mut timeout = Duration::from_millis(default_timeout_ms);
        if let Some(client) = metadata
            .get("grpc-timeout")
            .and_then(|v| v.to_str().ok())
            .and_then(parse_grpc_timeout)
        {
            let margin = Duration::from_millis(DEADLINE_MARGIN_MS);
            timeout = timeout.min(client.saturating_sub(margin).max(margin));
        }
        CallContext {
            deadline: Instant::now() + timeout,
            forwarded: metadata.get(FORWARDED_HEADER).is_some(),
            forwarded_by: metadata
                .get(FORWARDED_BY_HEADER)
                .and_then(|value| value.to_str().ok()?.parse().ok()),
            session: session_from_metadata(metadata),
            fence: None,
            token: metadata
                .get(auth::TOKEN_METADATA)
                .and_then(|value| value.to_str().ok())
                .filter(|token| token.len() <= auth::TOKEN_BYTES_MAX)
                .map(Arc::from),
            // Used as the user only with --client-cert-auth (docs/security.md).
            cert_user: tls::client_common_name(request).map(Arc::from),
        }
    }

    pub fn remaining(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }
}

/// The session position of a request. Both numeric keys must be present and numeric, and the
/// secret, when present, 32 hex digits; anything else means no session (the request is then
/// applied like an etcd request, at least once). A missing secret is secret 0, which only a
/// session opened before secrets existed has.
fn session_from_metadata(metadata: &tonic::metadata::MetadataMap) -> Option<SessionSeq> {
    let number = |key: &str| -> Option<u64> { metadata.get(key)?.to_str().ok()?.parse().ok() };
    let secret = match metadata.get(SESSION_SECRET_HEADER) {
        None => 0,
        Some(value) => parse_session_secret(value.to_str().ok()?)?,
    };
    Some(SessionSeq {
        client_id: number(SESSION_CLIENT_HEADER)?,
        seq: number(SESSION_SEQ_HEADER)?,
        secret,
    })
}

/// A session secret as it travels in metadata: exactly 32 hex digits.
pub fn parse_session_secret(text: &str) -> Option<u128> {
    if text.len() != 32 || !text.bytes().all(|byte| byte.is_ascii_hexdigit()) {
        return None;
    }
    u128::from_str_radix(text, 16).ok()
}

/// A session secret as it travels in metadata.
pub fn session_secret_hex(secret: u128) -> String {
    format!("{secret:032x}")
}

/// A session secret as it travels in protobuf: 16 bytes, big-endian; empty means 0 (no
/// secret). Any other length is refused.
pub fn session_secret_from_bytes(bytes: &[u8]) -> Result<u128, Status> {
    if bytes.is_empty() {
        return Ok(0);
    }
    let array: [u8; 16] = bytes
        .try_into()
        .map_err(|_| Status::invalid_argument("conclave: a session secret is 16 bytes"))?;
    Ok(u128::from_be_bytes(array))
}

/// A fresh session secret: 128 bits from the operating system's generator, never 0 (0 marks
/// sessions from before secrets).
pub fn new_session_secret() -> Result<u128, Status> {
    loop {
        let mut bytes = [0u8; 16];
        getrandom::fill(&mut bytes)
            .map_err(|error| Status::internal(format!("conclave: no randomness: {error}")))?;
        let secret = u128::from_be_bytes(bytes);
        if secret != 0 {
            return Ok(secret);
        }
    }
}

/// Parses gRPC's `grpc-timeout` header: up to 8 digits and a unit (H, M, S, m, u, n).
fn parse_grpc_timeout(value: &str) -> Option<Duration> {
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    let amount: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(amount.saturating_mul(3600)),
        "M" => Duration::from_secs(amount.saturating_mul(60)),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return None,
    })
}

/// Shared by every service.
pub struct Api {
    pub node: NodeHandle,
    pub config: ServerConfig,
    pub cluster_id: u64,
    /// Lazily connected channels to other members' client addresses.
    channels: MemberChannels,
    /// Set when a graceful shutdown starts draining the client API: long waits and streams
    /// end then, so they cannot hold the drain up, while ordinary requests finish.
    draining: tokio::sync::watch::Sender<bool>,
    /// Slots and counters of the client caps.
    pub limits: Arc<limits::Limits>,
    /// Writes go to the leader over the peer link when set (see [`peer_calls`]).
    peer_calls: std::sync::OnceLock<crate::transport::PeerCalls>,
    /// This member's writes waiting for the leader's answer.
    pending_calls: peer_calls::PendingCalls,
    /// Hands each applied batch to the watches it concerns.
    pub(crate) watch_hub: Arc<watch_hub::WatchHub>,
}

impl Api {
    pub fn new(node: NodeHandle, config: ServerConfig) -> Arc<Api> {
        let limits = Arc::new(limits::Limits::new(config.client_limits.clone()));
        let watch_hub = Arc::new(watch_hub::WatchHub::counting_into(node.subscriptions()));
        Arc::new(Api {
            cluster_id: config.cluster_id(),
            node,
            config,
            channels: MemberChannels::default(),
            draining: tokio::sync::watch::Sender::new(false),
            limits,
            peer_calls: std::sync::OnceLock::new(),
            pending_calls: peer_calls::PendingCalls::default(),
            watch_hub,
        })
    }

    /// Graceful shutdown: from now on streams and long waits end (see `lock::node_stopped`).
    pub fn begin_drain(&self) {
        self.draining.send_replace(true);
    }

    /// Resolves once [`Api::begin_drain`] was called.
    pub async fn draining(&self) {
        let mut draining = self.draining.subscribe();
        // The sender lives as long as `self`, so the wait cannot fail while we are borrowed.
        let _ = draining.wait_for(|&draining| draining).await;
    }

    /// etcd's response header: who answered, at which revision and term.
    pub fn header(&self, revision: i64) -> ResponseHeader {
        ResponseHeader {
            cluster_id: self.cluster_id,
            member_id: self.config.id,
            revision,
            raft_term: self.node.status.borrow().term,
        }
    }

    /// The header of a read: the current revision.
    pub fn read_header(&self) -> ResponseHeader {
        let revision = self.node.read_state(|s| s.revision());
        self.header(revision)
    }

    /// Where member `id` serves clients: its replicated member record (a member added at run
    /// time publishes its own, see `cluster::publish_own_attributes`), else the startup
    /// configuration. `None` when neither knows.
    pub fn client_address(&self, id: NodeId) -> Option<String> {
        let recorded = self
            .node
            .status
            .borrow()
            .members
            .iter()
            .find(|m| m.id == id && !m.client_addr.is_empty())
            .map(|m| m.client_addr.clone());
        recorded.or_else(|| {
            self.config
                .member(id)
                .filter(|m| !m.client_addr.is_empty())
                .map(|m| m.client_addr.clone())
        })
    }
}

/// The gRPC status etcd returns for each state-machine error, with etcd's exact strings.
pub fn state_status(error: &conclave_state::Error) -> Status {
    use conclave_state::Error as E;
    let message = error.to_string();
    match error {
        E::Compacted { .. } | E::FutureRevision { .. } | E::LeaseTtlTooLarge => {
            Status::out_of_range(message)
        }
        E::LeaseNotFound => Status::not_found(message),
        E::LeaseExists => Status::failed_precondition(message),
        E::ElectionNotLeader => Status::failed_precondition(message),
        E::ElectionNoLeader => Status::not_found(message),
        E::NotGroupLeader { .. } => Status::failed_precondition(message),
        E::QueueClaimStale { .. } => Status::failed_precondition(message),
        E::CandidateIdTaken { .. } => Status::already_exists(message),
        E::CandidateNotFound { .. } | E::SessionNotFound { .. } => Status::not_found(message),
        // etcd clients read RESOURCE_EXHAUSTED as "response too large".
        E::RangeTooLarge { .. } => Status::resource_exhausted(message),
        E::PermissionDenied => Status::permission_denied(message),
        // etcd clients fetch a new token on UNAUTHENTICATED "invalid auth token".
        E::InvalidAuthToken => Status::unauthenticated(message),
        E::RootUserNotExist
        | E::RootRoleNotExist
        | E::UserAlreadyExist
        | E::UserNotFound
        | E::RoleAlreadyExist
        | E::RoleNotFound
        | E::RoleNotGranted
        | E::PermissionNotGranted
        | E::AuthNotEnabled => Status::failed_precondition(message),
        E::Decode(_)
        | E::SnapshotCorrupt(_)
        | E::SnapshotVersion { .. }
        | E::SnapshotIo(_)
        | E::AlreadyApplied { .. } => Status::internal(message),
        _ => Status::invalid_argument(message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeout_units() {
        assert_eq!(parse_grpc_timeout("5S"), Some(Duration::from_secs(5)));
        assert_eq!(
            parse_grpc_timeout("4999971u"),
            Some(Duration::from_micros(4_999_971))
        );
        assert_eq!(parse_grpc_timeout("10m"), Some(Duration::from_millis(10)));
        assert_eq!(parse_grpc_timeout("x"), None);
        assert_eq!(parse_grpc_timeout(""), None);
    }

    #[test]
    fn session_position_needs_both_numeric_keys() {
        let mut request = tonic::Request::new(());
        assert_eq!(CallContext::new(&request, 1000).session, None);
        request
            .metadata_mut()
            .insert(SESSION_CLIENT_HEADER, 7u64.into());
        assert_eq!(CallContext::new(&request, 1000).session, None);
        request
            .metadata_mut()
            .insert(SESSION_SEQ_HEADER, "x".parse().unwrap());
        assert_eq!(CallContext::new(&request, 1000).session, None);
        request
            .metadata_mut()
            .insert(SESSION_SEQ_HEADER, 3u64.into());
        let ctx = CallContext::new(&request, 1000);
        assert_eq!(
            ctx.session,
            Some(SessionSeq {
                client_id: 7,
                seq: 3,
                secret: 0,
            })
        );
        request
            .metadata_mut()
            .insert(SESSION_SECRET_HEADER, "not hex".parse().unwrap());
        assert_eq!(CallContext::new(&request, 1000).session, None);
        let secret = 0xabcd_u128 << 100 | 5;
        request.metadata_mut().insert(
            SESSION_SECRET_HEADER,
            session_secret_hex(secret).parse().unwrap(),
        );
        let ctx = CallContext::new(&request, 1000);
        assert_eq!(ctx.session.map(|at| at.secret), Some(secret));
        // A forwarded copy carries the same position to the leader.
        let forwarded = Api::forwarded_request((), &ctx);
        assert_eq!(CallContext::new(&forwarded, 1000).session, ctx.session);
        assert!(CallContext::new(&forwarded, 1000).forwarded);
    }

    #[test]
    fn etcd_error_strings_and_codes() {
        let status = state_status(&conclave_state::Error::Compacted {
            compact_revision: 3,
        });
        assert_eq!(status.code(), tonic::Code::OutOfRange);
        assert_eq!(
            status.message(),
            "etcdserver: mvcc: required revision has been compacted"
        );
        let status = state_status(&conclave_state::Error::EmptyKey);
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
    }
}
