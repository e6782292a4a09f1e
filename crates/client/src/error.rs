//! The client's one error type, with the stable codes the `conclave` CLI prints.

use tonic::Code;

/// Everything a client call can fail with.
///
/// [`Error::code`] is stable: scripts and the CLI's `--json` output match on it, so variants
/// may gain fields but codes never change meaning.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The cluster has no Raft leader (election in progress or no quorum).
    #[error("the cluster has no leader: {0}")]
    NoLeader(String),
    /// The member or the connection to it failed mid-request; the request may or may not
    /// have been applied unless the call is idempotent.
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// The request's deadline passed.
    #[error("timed out: {0}")]
    Timeout(String),
    /// The key, group, candidate or member does not exist.
    #[error("not found: {0}")]
    NotFound(String),
    /// The request was refused as malformed (empty key, negative TTL, future revision, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The requested revision was compacted away.
    #[error("revision {requested_revision} was compacted (compacted up to {compact_revision})")]
    Compacted {
        requested_revision: i64,
        compact_revision: i64,
    },
    /// The lease is gone (expired, revoked, or never existed).
    // 16 hex digits, as `conclave lease grant` and etcdctl print lease ids.
    #[error("lease {:016x} expired or does not exist: {message}", *.lease_id as u64)]
    LeaseExpired { lease_id: i64, message: String },
    /// The lease id or candidate id is already taken.
    #[error("already exists: {0}")]
    AlreadyExists(String),
    /// The caller no longer leads (or holds) what it acted on: a stale fence.
    #[error("leadership lost: {0}")]
    LeadershipLost(String),
    /// The request, key, value or TTL is over a limit.
    #[error("too large: {0}")]
    TooLarge(String),
    /// The server needs credentials the call did not carry, or refused them (no user, wrong
    /// password, expired or forged token).
    #[error("not authenticated: {0}")]
    Unauthenticated(String),
    /// The caller's roles do not allow the call.
    #[error("permission denied: {0}")]
    PermissionDenied(String),
    /// TLS failed: the server's certificate is not trusted or has expired, the server refused
    /// this client's certificate, or one side speaks TLS and the other does not.
    #[error("TLS failed: {0}")]
    Tls(String),
    /// No endpoint could be reached.
    #[error("cannot connect to any of {endpoints:?}: {reason}")]
    ConnectionFailed {
        endpoints: Vec<String>,
        reason: String,
    },
}

impl Error {
    /// Stable machine-readable code, as printed by `conclave --json`.
    pub fn code(&self) -> &'static str {
        match self {
            Error::NoLeader(_) => "no_leader",
            Error::Unavailable(_) => "unavailable",
            Error::Timeout(_) => "timeout",
            Error::NotFound(_) => "not_found",
            Error::InvalidArgument(_) => "invalid_argument",
            Error::Compacted { .. } => "compacted",
            Error::LeaseExpired { .. } => "lease_expired",
            Error::AlreadyExists(_) => "already_exists",
            Error::LeadershipLost(_) => "leadership_lost",
            Error::TooLarge(_) => "too_large",
            Error::ConnectionFailed { .. } => "connection_failed",
            Error::Unauthenticated(_) => "unauthenticated",
            Error::PermissionDenied(_) => "permission_denied",
            Error::Tls(_) => "tls",
        }
    }

    /// Every code [`Error::code`] can return, for documentation and exhaustive CLI tables.
    pub const CODES: [&'static str; 14] = [
        "no_leader",
        "unavailable",
        "timeout",
        "not_found",
        "invalid_argument",
        "compacted",
        "lease_expired",
        "already_exists",
        "leadership_lost",
        "too_large",
        "connection_failed",
        "unauthenticated",
        "permission_denied",
        "tls",
    ];

    /// Whether trying again (on the same or another member) may succeed. Only idempotent
    /// requests are retried automatically.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            Error::NoLeader(_) | Error::Unavailable(_) | Error::ConnectionFailed { .. }
        )
    }

    /// Maps a gRPC status from a Conclave (or etcd) server to the client's error. `context`
    /// supplies what the status alone does not say (the lease or revision the call was about).
    pub fn from_status(status: &tonic::Status, context: ErrorContext) -> Error {
        let message = status.message().to_string();
        let lower = message.to_ascii_lowercase();
        match status.code() {
            Code::PermissionDenied => Error::PermissionDenied(message),
            Code::Unauthenticated => Error::Unauthenticated(message),
            // etcd answers these two INVALID_ARGUMENT; they are about credentials.
            Code::InvalidArgument
                if lower.contains("user name is empty")
                    || lower.contains("authentication failed") =>
            {
                Error::Unauthenticated(message)
            }
            Code::Unavailable if lower.contains("no leader") => Error::NoLeader(message),
            Code::Unavailable if lower.contains("request timed out") => Error::Timeout(message),
            // tonic's own deadline (the request's `timeout`) ends the call this way.
            Code::Cancelled | Code::Unavailable if lower.contains("timeout expired") => {
                Error::Timeout(message)
            }
            Code::Unavailable
            | Code::Cancelled
            | Code::Aborted
            | Code::Internal
            | Code::DataLoss => Error::Unavailable(describe(status)),
            Code::Unknown if lower.contains("no leader") => Error::NoLeader(message),
            // tonic reports a broken HTTP/2 connection as Unknown with a transport message.
            Code::Unknown => Error::Unavailable(describe(status)),
            Code::DeadlineExceeded => Error::Timeout(describe(status)),
            Code::ResourceExhausted if lower.contains("too large") => Error::TooLarge(message),
            Code::ResourceExhausted => Error::Unavailable(message),
            Code::Unimplemented => Error::Unavailable(format!(
                "the server does not implement this call yet ({message})"
            )),
            Code::OutOfRange if lower.contains("compacted") => Error::Compacted {
                requested_revision: context.revision,
                compact_revision: 0,
            },
            // "too large lease TTL", and tonic's own "decoded message length too large".
            Code::OutOfRange if lower.contains("too large") => Error::TooLarge(message),
            Code::NotFound | Code::InvalidArgument | Code::FailedPrecondition
                if lower.contains("lease not found") =>
            {
                Error::LeaseExpired {
                    lease_id: context.lease_id,
                    message,
                }
            }
            Code::NotFound => Error::NotFound(message),
            Code::InvalidArgument if lower.contains("too large") || lower.contains("too many") => {
                Error::TooLarge(message)
            }
            Code::FailedPrecondition | Code::InvalidArgument | Code::AlreadyExists
                if lower.contains("already exists") || lower.contains("already registered") =>
            {
                Error::AlreadyExists(message)
            }
            Code::AlreadyExists => Error::AlreadyExists(message),
            // A queue claim that timed out or ended is a stale fence too.
            Code::FailedPrecondition
                if lower.contains("not leader")
                    || lower.contains("not the leader")
                    || lower.contains("not claimed with fence") =>
            {
                Error::LeadershipLost(message)
            }
            Code::FailedPrecondition | Code::InvalidArgument | Code::OutOfRange | Code::Ok => {
                Error::InvalidArgument(message)
            }
        }
    }

    /// A status with no context (no lease, no revision involved).
    pub(crate) fn status(status: &tonic::Status) -> Error {
        Error::from_status(status, ErrorContext::default())
    }
}

/// What a call was about, to fill the fields a gRPC status does not carry.
#[derive(Debug, Clone, Copy, Default)]
pub struct ErrorContext {
    pub lease_id: i64,
    pub revision: i64,
}

/// A status message, falling back to its code when the message is empty (transport errors
/// sometimes are).
fn describe(status: &tonic::Status) -> String {
    if status.message().is_empty() {
        format!("{:?}", status.code())
    } else {
        status.message().to_string()
    }
}

/// Shorthand used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Status;

    fn map(status: Status) -> Error {
        Error::from_status(
            &status,
            ErrorContext {
                lease_id: 0x42,
                revision: 7,
            },
        )
    }

    #[test]
    fn etcd_strings_map_to_stable_codes() {
        let cases = [
            (Status::unavailable("etcdserver: no leader"), "no_leader"),
            (
                Status::unavailable("etcdserver: leader changed"),
                "unavailable",
            ),
            (
                Status::unavailable("etcdserver: request timed out"),
                "timeout",
            ),
            (Status::deadline_exceeded("Deadline expired"), "timeout"),
            (
                Status::permission_denied("etcdserver: permission denied"),
                "permission_denied",
            ),
            (
                Status::unauthenticated("etcdserver: invalid auth token"),
                "unauthenticated",
            ),
            (
                Status::invalid_argument("etcdserver: user name is empty"),
                "unauthenticated",
            ),
            (
                Status::invalid_argument(
                    "etcdserver: authentication failed, invalid user ID or password",
                ),
                "unauthenticated",
            ),
            (Status::unknown("transport error"), "unavailable"),
            (Status::internal("h2 protocol error"), "unavailable"),
            (Status::unimplemented(""), "unavailable"),
            (
                Status::out_of_range("etcdserver: mvcc: required revision has been compacted"),
                "compacted",
            ),
            (
                Status::out_of_range("etcdserver: mvcc: required revision is a future revision"),
                "invalid_argument",
            ),
            (
                Status::out_of_range("etcdserver: too large lease TTL"),
                "too_large",
            ),
            (
                Status::not_found("etcdserver: requested lease not found"),
                "lease_expired",
            ),
            (Status::not_found("election: no leader"), "not_found"),
            (
                Status::failed_precondition(
                    "conclave: job 3 of queue \"q\" is not claimed with fence 7 any more (the claim timed out or ended); its result must not be used",
                ),
                "leadership_lost",
            ),
            (
                Status::invalid_argument("etcdserver: key is not provided"),
                "invalid_argument",
            ),
            (
                Status::invalid_argument("etcdserver: request is too large"),
                "too_large",
            ),
            (
                Status::invalid_argument("etcdserver: too many operations in txn request"),
                "too_large",
            ),
            (
                Status::resource_exhausted("message length too large: found 9 bytes"),
                "too_large",
            ),
            (
                Status::resource_exhausted("etcdserver: too many requests"),
                "unavailable",
            ),
            (
                Status::failed_precondition("etcdserver: lease already exists"),
                "already_exists",
            ),
            (
                Status::already_exists("conclave: candidate id \"a\" is already registered"),
                "already_exists",
            ),
            (
                Status::failed_precondition("election: not leader"),
                "leadership_lost",
            ),
            (
                Status::failed_precondition("conclave: not the leader of group \"g\" with fence 3"),
                "leadership_lost",
            ),
        ];
        for (status, code) in cases {
            let message = status.message().to_string();
            assert_eq!(map(status).code(), code, "{message}");
        }
    }

    #[test]
    fn context_fills_lease_and_revision() {
        let lease = map(Status::not_found("etcdserver: requested lease not found"));
        assert_eq!(
            lease,
            Error::LeaseExpired {
                lease_id: 0x42,
                message: "etcdserver: requested lease not found".into()
            }
        );
        let compacted = map(Status::out_of_range(
            "etcdserver: mvcc: required revision has been compacted",
        ));
        assert!(matches!(
            compacted,
            Error::Compacted {
                requested_revision: 7,
                ..
            }
        ));
    }

    #[test]
    fn codes_are_distinct_and_listed() {
        let errors = [
            Error::NoLeader(String::new()),
            Error::Unavailable(String::new()),
            Error::Timeout(String::new()),
            Error::NotFound(String::new()),
            Error::InvalidArgument(String::new()),
            Error::Compacted {
                requested_revision: 0,
                compact_revision: 0,
            },
            Error::LeaseExpired {
                lease_id: 0,
                message: String::new(),
            },
            Error::AlreadyExists(String::new()),
            Error::LeadershipLost(String::new()),
            Error::TooLarge(String::new()),
            Error::ConnectionFailed {
                endpoints: vec![],
                reason: String::new(),
            },
            Error::Unauthenticated(String::new()),
            Error::PermissionDenied(String::new()),
            Error::Tls(String::new()),
        ];
        let codes: Vec<_> = errors.iter().map(Error::code).collect();
        assert_eq!(codes, Error::CODES);
        assert!(errors[0].is_transient() && errors[1].is_transient() && errors[10].is_transient());
        assert!(!errors[3].is_transient());
    }
}
