//! Commands (what goes into Raft entries), responses and events.
//!
//! A [`Command`] is an envelope: the Raft leader's clock reading, the optional client session
//! (for exactly-once retries) and the [`Request`]. Commands encode to a compact binary form
//! (postcard) with [`Command::encode`] / [`Command::decode`].

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::auth::AuthRequest;
use crate::election::{ElectionEvent, GroupPolicy, PreemptPolicy, Seat};
use crate::error::{Error, Result};
use crate::lease::LeaseCheckpoint;
use crate::mvcc::{KeyValue, RangeRequest, RangeResponse, WatchEvent};
use crate::queue::{Job, JobPush};
use crate::topic::{Message, Retention};
use crate::txn::{
    DeleteRangeRequest, DeleteRangeResponse, PutRequest, PutResponse, TxnRequest, TxnResponse,
};

/// The exact length of `value`'s postcard encoding, so an entry's bytes are allocated once
/// instead of grown several times while they are written: on the put path, on every member.
fn encoded_len<T: Serialize>(value: &T) -> usize {
    postcard::serialize_with_flavor(value, postcard::ser_flavors::Size::default()).unwrap_or(0)
}

/// Largest encoded command `decode` accepts (a guard against hostile lengths; real commands
/// are bounded by `Config::request_bytes_max` plus framing).
pub const ENCODED_COMMAND_BYTES_MAX: usize = 64 * 1024 * 1024;

/// Starts the encoding of a command whose session carries a secret. A command in the older
/// format cannot start with it (leader time 0, then the invalid option tag 2), so both formats
/// decode without a version field and commands without a secret keep their old bytes.
pub const SECRET_COMMAND_PREFIX: &[u8] = b"\x00\x02";

/// The client's position in its session: retries carry the same `seq`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionSeq {
    /// From `OpenSession`'s response.
    pub client_id: u64,
    /// Strictly increasing per client, one per distinct request.
    pub seq: u64,
    /// The session's secret from `OpenSession`'s response: a command whose secret differs
    /// from the session's is answered as if the session did not exist. 0 only for sessions
    /// opened by [`Request::OpenSession`] (entries written before secrets existed).
    pub secret: u128,
}

/// [`SessionSeq`] as encoded before sessions had secrets.
#[derive(Clone, Copy, Serialize, Deserialize)]
struct LegacySessionSeq {
    client_id: u64,
    seq: u64,
}

/// [`Command`] as encoded before sessions had secrets (every command without a secret still is).
#[derive(Serialize)]
struct LegacyCommandRef<'a> {
    leader_time_ms: u64,
    session: Option<LegacySessionSeq>,
    request: &'a Request,
}

#[derive(Deserialize)]
struct LegacyCommand {
    leader_time_ms: u64,
    session: Option<LegacySessionSeq>,
    request: Request,
}

/// A replicated command.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Command {
    /// The Raft leader's clock when it proposed the command, in ms. The state machine's notion
    /// of "now" is the largest of these seen, so it never goes back.
    pub leader_time_ms: u64,
    /// Exactly-once bookkeeping; `None` for commands without a client session.
    pub session: Option<SessionSeq>,
    /// What to do.
    pub request: Request,
}

impl Command {
    /// A command without a session.
    pub fn new(leader_time_ms: u64, request: Request) -> Self {
        Command {
            leader_time_ms,
            session: None,
            request,
        }
    }

    /// Compact binary encoding for a Raft entry: [`SECRET_COMMAND_PREFIX`] and the command
    /// when its session has a secret, otherwise the older format, byte for byte.
    pub fn encode(&self) -> Vec<u8> {
        // Encoding plain data into a Vec cannot fail; a failure is a bug in a serde derive.
        match self.session {
            Some(session) if session.secret != 0 => {
                let mut out = Vec::with_capacity(SECRET_COMMAND_PREFIX.len() + encoded_len(self));
                out.extend_from_slice(SECRET_COMMAND_PREFIX);
                postcard::to_extend(self, out).expect("command encoding is infallible")
            }
            _ => {
                let legacy = LegacyCommandRef {
                    leader_time_ms: self.leader_time_ms,
                    session: self.session.map(|at| LegacySessionSeq {
                        client_id: at.client_id,
                        seq: at.seq,
                    }),
                    request: &self.request,
                };
                let out = Vec::with_capacity(encoded_len(&legacy));
                postcard::to_extend(&legacy, out).expect("command encoding is infallible")
            }
        }
    }

    /// Decodes [`Command::encode`]'s output. Never panics on arbitrary bytes.
    pub fn decode(bytes: &[u8]) -> Result<Command> {
        if bytes.len() > ENCODED_COMMAND_BYTES_MAX {
            return Err(Error::Decode(format!(
                "command of {} bytes is too large",
                bytes.len()
            )));
        }
        let (command, rest) = match bytes.strip_prefix(SECRET_COMMAND_PREFIX) {
            Some(body) => {
                let (command, rest) = postcard::take_from_bytes::<Command>(body)
                    .map_err(|error| Error::Decode(error.to_string()))?;
                // Only the older format may carry a session without a secret, so that a
                // command has exactly one encoding.
                if command.session.is_some_and(|at| at.secret == 0) {
                    return Err(Error::Decode(
                        "session secret 0 in the secret format".into(),
                    ));
                }
                (command, rest)
            }
            None => {
                let (legacy, rest) = postcard::take_from_bytes::<LegacyCommand>(bytes)
                    .map_err(|error| Error::Decode(error.to_string()))?;
                let command = Command {
                    leader_time_ms: legacy.leader_time_ms,
                    session: legacy.session.map(|at| SessionSeq {
                        client_id: at.client_id,
                        seq: at.seq,
                        secret: 0,
                    }),
                    request: legacy.request,
                };
                (command, rest)
            }
        };
        if !rest.is_empty() {
            return Err(Error::Decode(format!(
                "{} trailing bytes after command",
                rest.len()
            )));
        }
        Ok(command)
    }
}

/// Identifies a leadership in etcd's Election service (`v3electionpb.LeaderKey`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaderKey {
    /// The election name (key prefix without the trailing `/`).
    pub name: Bytes,
    /// The leader's key, `<name>/<lease hex>`.
    pub key: Bytes,
    /// The key's create revision when leadership was won.
    pub rev: i64,
    /// The lease the key is attached to.
    pub lease: i64,
}

/// A priority-group registration.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupRegister {
    /// The group.
    pub group: String,
    /// The candidate id, unique in the group.
    pub candidate: String,
    /// Higher wins.
    pub priority: i64,
    /// Published while leading.
    pub value: Bytes,
    /// The candidate's heartbeat lease.
    pub lease_id: i64,
    /// Preempt a lower-priority incumbent even if the group does not.
    pub preempt: bool,
}

/// Everything the state machine can be asked to do through the log.
///
/// Encoded by variant position (postcard): entries already in logs and snapshots must keep
/// decoding, so new variants go at the end and existing ones are never reordered or changed.
/// `tests/encoding.rs` pins the encoding.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// etcd Range (a linearizable read through the log).
    Range(RangeRequest),
    /// etcd Put.
    Put(PutRequest),
    /// etcd DeleteRange.
    DeleteRange(DeleteRangeRequest),
    /// etcd Txn.
    Txn(TxnRequest),
    /// etcd Compact: drop history below `revision`.
    Compact {
        /// First revision to keep.
        revision: i64,
    },
    /// etcd LeaseGrant. `id == 0` lets the state machine choose.
    LeaseGrant {
        /// Requested ID, or 0.
        id: i64,
        /// Requested TTL; raised to 1.5 × the election timeout if shorter.
        ttl_ms: u64,
    },
    /// etcd LeaseRevoke: the lease and every attached key go, in one revision.
    LeaseRevoke {
        /// The lease.
        id: i64,
    },
    /// Leader-proposed: record how a future leader must resume these leases.
    LeaseCheckpoint {
        /// One entry per lease.
        checkpoints: Vec<LeaseCheckpoint>,
    },
    /// Leader-proposed: these leases ran out; revoke those still present.
    LeaseExpire {
        /// The leases.
        ids: Vec<i64>,
    },
    /// etcd Election Campaign: join the election `name` with a key bound to `lease`.
    Campaign {
        /// Election name.
        name: Bytes,
        /// The candidate's lease.
        lease: i64,
        /// The candidate's value.
        value: Bytes,
    },
    /// etcd Election Proclaim: the leader updates its value.
    Proclaim {
        /// The leadership.
        leader: LeaderKey,
        /// New value.
        value: Bytes,
    },
    /// etcd Election Resign.
    Resign {
        /// The leadership.
        leader: LeaderKey,
    },
    /// etcd Lock: queue for the lock `name` with a key bound to `lease`.
    Lock {
        /// Lock name.
        name: Bytes,
        /// The waiter's lease.
        lease: i64,
    },
    /// etcd Unlock, fenced: with `fence`, only the key created at that revision is released.
    Unlock {
        /// The lock key from the Lock response.
        key: Bytes,
        /// The fence from the Lock response (etcd clients send none).
        fence: Option<i64>,
    },
    /// Register (or update) a candidate in a priority election group.
    GroupRegister(GroupRegister),
    /// Leave a priority election group (releases the seat if held).
    GroupResign {
        /// The group.
        group: String,
        /// The candidate id.
        candidate: String,
        /// Must match the registration's lease.
        lease_id: i64,
    },
    /// The group leader publishes a new value; fenced.
    GroupProclaim {
        /// The group.
        group: String,
        /// The leader's candidate id.
        candidate: String,
        /// The leader's fence.
        fence: i64,
        /// New value.
        value: Bytes,
    },
    /// Set a group's policy.
    GroupConfigure {
        /// The group.
        group: String,
        /// New policy.
        policy: GroupPolicy,
    },
    /// Append to a topic.
    Publish {
        /// The topic.
        topic: String,
        /// Payload.
        data: Bytes,
    },
    /// Move a consumer's cursor on a topic.
    Ack {
        /// The consumer.
        consumer: String,
        /// The topic.
        topic: String,
        /// Last processed seq.
        seq: u64,
    },
    /// Set a topic's retention.
    TopicConfigure {
        /// The topic.
        topic: String,
        /// New retention.
        retention: Retention,
    },
    /// Open a client session; the response carries the client id.
    OpenSession,
    /// Close a client session.
    CloseSession {
        /// The client.
        client_id: u64,
    },
    /// Let time pass: handoff timeouts, topic age retention, session expiry.
    Tick,
    /// Open a client session guarded by `secret` (random, chosen by the member that serves
    /// OpenSession, so every replica stores the same one); the response carries the client id.
    OpenSessionWithSecret {
        /// 128 random bits, never 0; every command in the session must carry them.
        secret: u128,
    },
    /// Close a client session, if `secret` is its secret.
    CloseSessionWithSecret {
        /// The client.
        client_id: u64,
        /// The session's secret.
        secret: u128,
    },
    /// Add a job to a work queue (created by its first push).
    QueuePush(JobPush),
    /// Hand the best ready job of a queue to one worker under a visibility timeout.
    QueueClaim {
        /// The queue.
        queue: String,
        /// Who claims (recorded for listings).
        worker: String,
        /// How long the claim lasts; 0 for the default.
        visibility_timeout_ms: u64,
    },
    /// The job claimed with `fence` is done.
    QueueAck {
        /// The queue.
        queue: String,
        /// The job.
        job_id: u64,
        /// The claim's fence.
        fence: u64,
    },
    /// Give the job claimed with `fence` back, claimable again after `delay_ms`.
    QueueNack {
        /// The queue.
        queue: String,
        /// The job.
        job_id: u64,
        /// The claim's fence.
        fence: u64,
        /// Not claimable for this long.
        delay_ms: u64,
    },
    /// Make the claim with `fence` run out `visibility_timeout_ms` from now.
    QueueExtend {
        /// The queue.
        queue: String,
        /// The job.
        job_id: u64,
        /// The claim's fence.
        fence: u64,
        /// New timeout from now; 0 for the default.
        visibility_timeout_ms: u64,
    },
    /// A change to users, roles, permissions or the auth switch (root only once enabled).
    Auth(AuthRequest),
    /// A client's request with the identity the serving member verified (empty: none). The
    /// state machine checks the user's permissions for `request` when it applies it, so a
    /// permission revoked earlier in the log refuses it on every member. Never nested.
    AsUser {
        /// The user name, or empty for a call without credentials.
        user: String,
        /// The request.
        request: Box<Request>,
    },
    /// Append to a topic, naming the sender ([`crate::topic::MESSAGE_FROM_BYTES_MAX`] bytes at
    /// most). Members propose [`Request::Publish`] when there is no sender, so a publish
    /// without one stays readable by builds that predate this variant.
    PublishFrom {
        /// The topic.
        topic: String,
        /// Payload.
        data: Bytes,
        /// The sender, as the publisher names itself.
        from: String,
    },
    /// Set a group's policy with its three-valued preempt policy (`policy.preempt` and
    /// `policy.preempt_never` are set from `preempt_policy`). Members propose
    /// [`Request::GroupConfigure`] for `higher` and `always`, so only `never` needs a build
    /// that knows this variant.
    GroupConfigurePreempt {
        /// The group.
        group: String,
        /// New policy.
        policy: GroupPolicy,
        /// Who may displace a sitting leader.
        preempt_policy: PreemptPolicy,
    },
}

/// etcd Campaign / Lock outcome.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueResponse {
    /// The caller's key `<name>/<lease hex>`.
    pub key: Bytes,
    /// Its create revision: the fencing token once it leads / holds.
    pub fence: i64,
    /// True if the caller leads / holds now.
    pub owner: bool,
    /// Otherwise, the key just ahead of the caller: wait for its deletion, then ask again.
    pub waiting_for: Option<KeyValue>,
}

/// A group's observable state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupStatus {
    /// The group.
    pub group: String,
    /// Its term.
    pub term: u64,
    /// The seat, if held.
    pub seat: Option<Seat>,
}

/// Successful answers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Response {
    /// Answer to Range.
    Range(RangeResponse),
    /// Answer to Put.
    Put(PutResponse),
    /// Answer to DeleteRange.
    DeleteRange(DeleteRangeResponse),
    /// Answer to Txn.
    Txn(TxnResponse),
    /// Compaction done.
    Compacted,
    /// Lease granted.
    LeaseGranted {
        /// Its ID.
        id: i64,
        /// Its TTL.
        ttl_ms: u64,
    },
    /// Lease revoked.
    LeaseRevoked,
    /// Checkpoints recorded.
    LeaseCheckpointed,
    /// Which of the named leases were still present and are now revoked.
    LeasesExpired {
        /// Revoked IDs.
        revoked: Vec<i64>,
    },
    /// Answer to Campaign.
    Campaign(QueueResponse),
    /// Proclaimed.
    Proclaimed,
    /// Answer to Resign: whether the key was deleted.
    Resigned {
        /// False when the caller no longer led.
        resigned: bool,
    },
    /// Answer to Lock.
    Lock(QueueResponse),
    /// Answer to Unlock.
    Unlocked {
        /// False when the key was gone or belonged to a later holder.
        released: bool,
    },
    /// A group's state after a group command.
    Group(GroupStatus),
    /// Published.
    Published {
        /// The message's seq.
        seq: u64,
        /// The store revision.
        revision: i64,
    },
    /// The consumer's cursor after an ack.
    Acked {
        /// Cursor.
        cursor: u64,
    },
    /// Topic configured.
    TopicConfigured,
    /// Session opened.
    SessionOpened {
        /// Use this id in every later command's `SessionSeq`.
        client_id: u64,
    },
    /// Session closed.
    SessionClosed,
    /// Time passed.
    Ticked,
    /// Answer to a queue push.
    JobPushed {
        /// The job's id.
        id: u64,
        /// True when the dedup key named a job already queued or in flight (this one).
        existing: bool,
    },
    /// Answer to a claim: the job with its claim (fence, deadline), or none ready.
    JobClaimed(Option<Job>),
    /// The job is done.
    JobAcked,
    /// The job was given back.
    JobNacked {
        /// True when it used its attempts and went to the dead-letter queue.
        dead_lettered: bool,
    },
    /// The claim was extended.
    JobExtended {
        /// The claim's new deadline (leader clock).
        deadline_ms: u64,
    },
    /// An auth change was applied.
    AuthChanged {
        /// The auth revision after it.
        auth_revision: u64,
    },
}

/// Something observers may want to hear about.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Event {
    /// A key changed (watch).
    Kv(WatchEvent),
    /// A priority election group changed.
    Election(ElectionEvent),
    /// A topic got a message.
    Topic(Message),
    /// A work queue changed (a job pushed, released, dead-lettered or claimed).
    Queue(String),
}

/// The result of applying one command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApplyOutput {
    /// The store revision after the command (the response header revision).
    pub revision: i64,
    /// The answer (cached and replayed for a session retry).
    pub result: Result<Response>,
    /// Events, in order. Empty for a retried command: its events went out the first time.
    pub events: Vec<Event>,
    /// True when this was a session retry answered from the cache.
    pub duplicate: bool,
}
