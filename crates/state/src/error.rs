//! The crate's one error type.
//!
//! Operating errors are answers to a request: they are part of the replicated result (a session
//! caches them like any response), so they are plain data and serializable. Where etcd has the
//! same error, the message is etcd's exact string so etcd clients recognise it.

use serde::{Deserialize, Serialize};

/// Everything a request or a snapshot can fail with.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum Error {
    /// A key is required and was empty.
    #[error("etcdserver: key is not provided")]
    EmptyKey,
    /// `ignore_value` was set together with a value.
    #[error("etcdserver: value is provided")]
    ValueProvided,
    /// `ignore_lease` was set together with a lease.
    #[error("etcdserver: lease is provided")]
    LeaseProvided,
    /// `ignore_value`/`ignore_lease` on a key that does not exist.
    #[error("etcdserver: key not found")]
    KeyNotFound,
    /// A Txn has more compares or operations in one list than allowed.
    #[error("etcdserver: too many operations in txn request")]
    TooManyOps,
    /// A Txn writes the same key twice (or puts a key that one of its deletes covers).
    #[error("etcdserver: duplicate key given in txn request")]
    DuplicateKey,
    /// The request, a key or a value is over its size limit.
    #[error("etcdserver: request is too large")]
    RequestTooLarge,
    /// A read, watch or compaction asked for a revision below the compaction point.
    #[error("etcdserver: mvcc: required revision has been compacted")]
    Compacted {
        /// The revision the store is compacted at; history from here on is kept.
        compact_revision: i64,
    },
    /// A read or compaction asked for a revision beyond the current one.
    #[error("etcdserver: mvcc: required revision is a future revision")]
    FutureRevision {
        /// The store's current revision.
        current_revision: i64,
    },
    /// The lease does not exist (never granted, revoked or expired).
    #[error("etcdserver: requested lease not found")]
    LeaseNotFound,
    /// A grant named an ID that is already in use.
    #[error("etcdserver: lease already exists")]
    LeaseExists,
    /// A grant asked for a TTL above the maximum.
    #[error("etcdserver: too large lease TTL")]
    LeaseTtlTooLarge,
    /// etcd Election: the caller does not hold the leadership it names.
    #[error("election: not leader")]
    ElectionNotLeader,
    /// etcd Election: nobody holds the election.
    #[error("election: no leader")]
    ElectionNoLeader,
    /// A write touched the reserved `/_conclave/` prefix, which only the state machine writes.
    #[error("conclave: key is reserved for the state machine (prefix /_conclave/)")]
    ReservedKey,
    /// A priority-group candidate id is already registered under another live lease.
    #[error(
        "conclave: candidate id {candidate:?} is already registered in group {group:?} under lease {lease_id:x}"
    )]
    CandidateIdTaken {
        /// The group.
        group: String,
        /// The contested candidate id.
        candidate: String,
        /// The lease the id is held under.
        lease_id: i64,
    },
    /// The group or candidate does not exist.
    #[error("conclave: candidate {candidate:?} is not registered in group {group:?}")]
    CandidateNotFound {
        /// The group.
        group: String,
        /// The candidate id.
        candidate: String,
    },
    /// A leader-only operation was asked by a candidate that does not hold the seat with that fence.
    #[error("conclave: not the leader of group {group:?} with fence {fence}")]
    NotGroupLeader {
        /// The group.
        group: String,
        /// The fence the caller presented.
        fence: i64,
    },
    /// An ack named a sequence number that was never published.
    #[error(
        "conclave: ack of seq {seq} beyond the last published seq {last_seq} of topic {topic:?}"
    )]
    AckBeyondEnd {
        /// The topic.
        topic: String,
        /// The acknowledged sequence number.
        seq: u64,
        /// The topic's last sequence number.
        last_seq: u64,
    },
    /// Creating this object would pass one of the configured bounds.
    #[error("conclave: limit reached: at most {limit} {what}")]
    LimitReached {
        /// What is bounded (e.g. "leases").
        what: String,
        /// The bound.
        limit: u64,
    },
    /// A request argument is out of its domain (the message says which).
    #[error("conclave: invalid argument: {0}")]
    InvalidArgument(String),
    /// The client session is unknown: it expired or was never opened.
    #[error("conclave: client session {client_id} not found (expired or never opened)")]
    SessionNotFound {
        /// The client id presented.
        client_id: u64,
    },
    /// A client retried a sequence number older than the last one applied; its answer is gone.
    #[error(
        "conclave: client {client_id} sequence {seq} is older than the last applied {last_seq}"
    )]
    SessionSeqStale {
        /// The client id.
        client_id: u64,
        /// The sequence number presented.
        seq: u64,
        /// The last sequence number applied for this client.
        last_seq: u64,
    },
    /// `apply` was given an index at or below the last applied one; nothing changed.
    #[error("conclave: index {index} was already applied (last applied {last_applied})")]
    AlreadyApplied {
        /// The index given.
        index: u64,
        /// The last applied index.
        last_applied: u64,
    },
    /// Bytes that should hold a command or snapshot do not decode.
    #[error("conclave: decode failed: {0}")]
    Decode(String),
    /// A snapshot failed its checksum or framing checks.
    #[error("conclave: snapshot corrupt: {0}")]
    SnapshotCorrupt(String),
    /// A snapshot was written by a format version this build cannot read.
    #[error(
        "conclave: snapshot format version {found} is not supported (this build reads {supported})"
    )]
    SnapshotVersion {
        /// The version in the snapshot header.
        found: u32,
        /// The version this build reads.
        supported: u32,
    },
    /// Reading or writing a snapshot stream failed.
    #[error("conclave: snapshot stream: {0}")]
    SnapshotIo(String),
    /// A sequence number further ahead of the session's last applied one than
    /// `session::SESSION_SEQ_AHEAD_MAX` allows (a client numbers its requests one by one).
    #[error(
        "conclave: client {client_id} sequence {seq} is too far ahead of the last applied {last_seq}"
    )]
    SessionSeqTooFar {
        /// The client id.
        client_id: u64,
        /// The sequence number presented.
        seq: u64,
        /// The last sequence number applied for this client.
        last_seq: u64,
    },
    /// A Range (alone or in a Txn) would answer more key and value bytes than its cap
    /// (`--range-response-bytes-max` for a read, [`crate::config::TXN_RANGE_BYTES_MAX`] in a
    /// Txn). The server answers RESOURCE_EXHAUSTED, which etcd clients read as "too large".
    #[error(
        "conclave: range answer is larger than the cap of {bytes_max} bytes; ask for fewer keys with `limit` or a narrower range"
    )]
    RangeTooLarge {
        /// The cap that was passed, in bytes.
        bytes_max: u64,
    },
    /// An ack, nack or extend named a claim that no longer holds: it timed out, was released
    /// or the job is done (perhaps by another worker).
    #[error(
        "conclave: job {job_id} of queue {queue:?} is not claimed with fence {fence} any more (the claim timed out or ended); its result must not be used"
    )]
    QueueClaimStale {
        /// The queue.
        queue: String,
        /// The job.
        job_id: u64,
        /// The fence presented.
        fence: u64,
    },
    /// AuthEnable without a `root` user.
    #[error("etcdserver: root user does not exist")]
    RootUserNotExist,
    /// AuthEnable while the `root` user lacks the `root` role.
    #[error("etcdserver: root user does not have root role")]
    RootRoleNotExist,
    /// UserAdd of a name already taken.
    #[error("etcdserver: user name already exists")]
    UserAlreadyExist,
    /// A user name is required and was empty (also: a request without credentials while auth
    /// is enabled, as etcd answers it).
    #[error("etcdserver: user name is empty")]
    UserEmpty,
    /// The user does not exist.
    #[error("etcdserver: user name not found")]
    UserNotFound,
    /// RoleAdd of a name already taken.
    #[error("etcdserver: role name already exists")]
    RoleAlreadyExist,
    /// The role does not exist.
    #[error("etcdserver: role name not found")]
    RoleNotFound,
    /// A role name is required and was empty.
    #[error("etcdserver: role name is empty")]
    RoleEmpty,
    /// Authenticate with an unknown user or a wrong password.
    #[error("etcdserver: authentication failed, invalid user ID or password")]
    AuthFailed,
    /// The caller's roles do not cover what the request touches.
    #[error("etcdserver: permission denied")]
    PermissionDenied,
    /// UserRevokeRole of a role the user does not hold.
    #[error("etcdserver: role is not granted to the user")]
    RoleNotGranted,
    /// RoleRevokePermission of a range the role does not hold.
    #[error("etcdserver: permission is not granted to the role")]
    PermissionNotGranted,
    /// Authenticate while auth is disabled.
    #[error("etcdserver: authentication is not enabled")]
    AuthNotEnabled,
    /// A token that is malformed, forged, expired or for a changed user.
    #[error("etcdserver: invalid auth token")]
    InvalidAuthToken,
    /// A change that would lock the root user out while auth is enabled.
    #[error("etcdserver: invalid auth management")]
    InvalidAuthMgmt,
}

impl Error {
    /// A stable numeric code for the error, for wire formats and metrics. Codes never change
    /// meaning; new errors get new codes.
    pub fn code(&self) -> u32 {
        match self {
            Error::EmptyKey => 1001,
            Error::ValueProvided => 1002,
            Error::LeaseProvided => 1003,
            Error::KeyNotFound => 1004,
            Error::TooManyOps => 1005,
            Error::DuplicateKey => 1006,
            Error::RequestTooLarge => 1007,
            Error::Compacted { .. } => 1008,
            Error::FutureRevision { .. } => 1009,
            Error::LeaseNotFound => 1101,
            Error::LeaseExists => 1102,
            Error::LeaseTtlTooLarge => 1103,
            Error::ElectionNotLeader => 1201,
            Error::ElectionNoLeader => 1202,
            Error::ReservedKey => 1301,
            Error::CandidateIdTaken { .. } => 1302,
            Error::CandidateNotFound { .. } => 1303,
            Error::NotGroupLeader { .. } => 1304,
            Error::AckBeyondEnd { .. } => 1401,
            Error::InvalidArgument(_) => 1402,
            Error::LimitReached { .. } => 1403,
            Error::SessionNotFound { .. } => 1501,
            Error::SessionSeqStale { .. } => 1502,
            Error::AlreadyApplied { .. } => 1503,
            Error::Decode(_) => 1601,
            Error::SnapshotCorrupt(_) => 1602,
            Error::SnapshotVersion { .. } => 1603,
            Error::SnapshotIo(_) => 1604,
            Error::SessionSeqTooFar { .. } => 1504,
            Error::RangeTooLarge { .. } => 1010,
            Error::QueueClaimStale { .. } => 1801,
            Error::RootUserNotExist => 1701,
            Error::RootRoleNotExist => 1702,
            Error::UserAlreadyExist => 1703,
            Error::UserEmpty => 1704,
            Error::UserNotFound => 1705,
            Error::RoleAlreadyExist => 1706,
            Error::RoleNotFound => 1707,
            Error::RoleEmpty => 1708,
            Error::AuthFailed => 1709,
            Error::PermissionDenied => 1710,
            Error::RoleNotGranted => 1711,
            Error::PermissionNotGranted => 1712,
            Error::AuthNotEnabled => 1713,
            Error::InvalidAuthToken => 1714,
            Error::InvalidAuthMgmt => 1715,
        }
    }
}

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etcd_strings_are_exact() {
        let compacted = Error::Compacted {
            compact_revision: 3,
        };
        assert_eq!(
            compacted.to_string(),
            "etcdserver: mvcc: required revision has been compacted"
        );
        let future = Error::FutureRevision {
            current_revision: 3,
        };
        assert_eq!(
            future.to_string(),
            "etcdserver: mvcc: required revision is a future revision"
        );
        assert_eq!(
            Error::LeaseNotFound.to_string(),
            "etcdserver: requested lease not found"
        );
        assert_eq!(
            Error::DuplicateKey.to_string(),
            "etcdserver: duplicate key given in txn request"
        );
        assert_eq!(
            Error::TooManyOps.to_string(),
            "etcdserver: too many operations in txn request"
        );
        assert_eq!(
            Error::RequestTooLarge.to_string(),
            "etcdserver: request is too large"
        );
        assert_eq!(
            Error::EmptyKey.to_string(),
            "etcdserver: key is not provided"
        );
        assert_eq!(
            Error::LeaseExists.to_string(),
            "etcdserver: lease already exists"
        );
    }

    #[test]
    fn codes_are_unique() {
        let all = [
            Error::EmptyKey,
            Error::ValueProvided,
            Error::LeaseProvided,
            Error::KeyNotFound,
            Error::TooManyOps,
            Error::DuplicateKey,
            Error::RequestTooLarge,
            Error::Compacted {
                compact_revision: 0,
            },
            Error::FutureRevision {
                current_revision: 0,
            },
            Error::LeaseNotFound,
            Error::LeaseExists,
            Error::LeaseTtlTooLarge,
            Error::ElectionNotLeader,
            Error::ElectionNoLeader,
            Error::ReservedKey,
            Error::CandidateIdTaken {
                group: String::new(),
                candidate: String::new(),
                lease_id: 0,
            },
            Error::CandidateNotFound {
                group: String::new(),
                candidate: String::new(),
            },
            Error::NotGroupLeader {
                group: String::new(),
                fence: 0,
            },
            Error::AckBeyondEnd {
                topic: String::new(),
                seq: 0,
                last_seq: 0,
            },
            Error::InvalidArgument(String::new()),
            Error::LimitReached {
                what: String::new(),
                limit: 0,
            },
            Error::SessionNotFound { client_id: 0 },
            Error::SessionSeqStale {
                client_id: 0,
                seq: 0,
                last_seq: 0,
            },
            Error::AlreadyApplied {
                index: 0,
                last_applied: 0,
            },
            Error::Decode(String::new()),
            Error::SnapshotCorrupt(String::new()),
            Error::SnapshotVersion {
                found: 0,
                supported: 0,
            },
            Error::SnapshotIo(String::new()),
            Error::SessionSeqTooFar {
                client_id: 0,
                seq: 0,
                last_seq: 0,
            },
            Error::RangeTooLarge { bytes_max: 0 },
            Error::QueueClaimStale {
                queue: String::new(),
                job_id: 0,
                fence: 0,
            },
            Error::RootUserNotExist,
            Error::RootRoleNotExist,
            Error::UserAlreadyExist,
            Error::UserEmpty,
            Error::UserNotFound,
            Error::RoleAlreadyExist,
            Error::RoleNotFound,
            Error::RoleEmpty,
            Error::AuthFailed,
            Error::PermissionDenied,
            Error::RoleNotGranted,
            Error::PermissionNotGranted,
            Error::AuthNotEnabled,
            Error::InvalidAuthToken,
            Error::InvalidAuthMgmt,
        ];
        let codes: std::collections::BTreeSet<u32> = all.iter().map(Error::code).collect();
        assert_eq!(codes.len(), all.len());
    }
}
