//! etcd's Lease service: LeaseGrant, LeaseRevoke, LeaseKeepAlive, LeaseTimeToLive, LeaseLeases.
//!
//! ```text
//!  Grant / Revoke ─► Api::write (through the log; followers forward)
//!  KeepAlive stream ─► up to KEEPALIVE_STREAM_IN_FLIGHT_MAX keepalives at once, each answered
//!                     as soon as it completes (etcd clients match answers by lease id):
//!                   ─► leader: NodeHandle::lease_renew (LeaseKeeper, not the log) and a
//!                      ReadIndex round of the renewing term the driver starts at once ─► TTL;
//!                      when the keeper asks for a checkpoint, it commits first and then
//!                      confirm_leadership runs the round
//!                   └► follower: one upstream KeepAlive stream to the leader per client
//!                      stream, carrying the same keepalives at once (answers matched by id),
//!                      re-opened on the new leader when leadership moves
//!  KeepAlive stream ends without a goodbye (the client's connection closed under it, not a
//!  cancel or a half-close) ─► leader: LeaseKeeper::orphan for the leases this stream renewed
//!                   last (lease ends LEASE_ORPHAN_GRACE_MS later unless renewed, checkpointed)
//!                   └► follower: ORPHANED_STREAM_MARK_ID on the upstream, so the leader's
//!                      end of that stream does the same
//!  TimeToLive ─► the leader's remaining TTL (forwarded; confirmed like a keepalive) + granted
//!                TTL and keys from the state
//!  Leases ─► linearizable read of the lease table
//! ```
//!
//! etcd's wire unit is the second: granted TTLs are rounded up to whole seconds and never
//! below the minimum (1.5 × the election timeout) rounded up, as etcd does; remaining TTLs are
//! truncated, as etcd reports them.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use conclave_proto::etcdserverpb::{
    self as pb, lease_client::LeaseClient, lease_server::Lease, lease_server::LeaseServer,
};
use conclave_raft::NodeId;
use conclave_state::{Request, Response};
use tokio::sync::{mpsc, oneshot};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming, async_trait};

use super::route::{leader_call, mark_forwarded};
use super::{Api, CallContext, FORWARDED_HEADER, Serve, Target, answer, to_status, unexpected};
use crate::error::Error;
use crate::node::state_config;

/// Keepalive answers queued for one client stream before we stop reading its requests.
pub const KEEPALIVE_STREAM_RESPONSES_MAX: usize = 16;
/// Keepalives of one client stream in flight at once; further requests are not read until one
/// is answered. A keepalive that needs a checkpoint waits for that record to commit and for a
/// ReadIndex round (a few milliseconds on a quiet cluster, tens under load), and those waits
/// overlap: the driver puts every checkpoint proposed in one turn into one append and one
/// ReadIndex round serves every read asked in one turn. With one keepalive at a time a stream
/// carried about one keepalive per commit (about 250/s); 128 at once allow some 10,000/s per
/// stream even at 10 ms a round, more than a member answers in all, while bounding what one
/// stream can queue on the leader: 128 small tasks and at most 128 checkpoint proposals, about
/// 1% of the driver's 10,000 in-flight proposals.
pub const KEEPALIVE_STREAM_IN_FLIGHT_MAX: usize = 128;
/// Keepalive requests queued for the upstream stream to the leader: a client stream has at
/// most [`KEEPALIVE_STREAM_IN_FLIGHT_MAX`] in flight, and the slack lets the orphan mark in too,
/// so a send never waits long.
const KEEPALIVE_UPSTREAM_REQUESTS_MAX: usize = KEEPALIVE_STREAM_IN_FLIGHT_MAX + 4;
const MS_PER_SECOND: u64 = 1000;
/// Sent by a follower on its upstream keepalive stream, in place of a lease id, when the
/// client behind it vanished (its connection closed without a goodbye); the leader's end of
/// the stream then shortens the leases that stream renewed last. Lease ids are never 0, and
/// the mark touches only leases renewed on the very stream it arrives on, which their holder
/// could revoke anyway.
pub const ORPHANED_STREAM_MARK_ID: i64 = 0;
/// Request metadata of a keepalive stream whose client's connection is its liveness: when
/// such a stream ends without a goodbye, the leases it renewed last are shortened to the
/// orphan grace. Conclave's client sets it on the streams that keep a lease alive for as long
/// as its process runs; etcd clients do not (etcdctl's `keep-alive --once` exits with its
/// stream open), so their leases always keep the TTL.
pub const LEASE_LIVENESS_HEADER: &str = "conclave-lease-liveness";
/// How long a follower waits for the leader to take the mark before it drops the upstream.
const ORPHANED_STREAM_MARK_WAIT_MS: u64 = 1000;
/// How long we wait to learn how a client's stream ended once its answers can no longer be
/// sent.
const STREAM_END_PROBE_MS: u64 = 1000;

/// Renewals made on this node as leader for one keepalive stream: lease -> stamp of the
/// newest one.
type StreamRenewals = Mutex<BTreeMap<i64, u64>>;

/// One keepalive's answer.
type KeepAliveAnswer = Result<pb::LeaseKeepAliveResponse, Status>;

/// Keepalives a follower sent up its stream to the leader and not yet answered: lease id ->
/// the callers waiting for an answer of that id, oldest first.
type Waiting = BTreeMap<i64, VecDeque<oneshot::Sender<KeepAliveAnswer>>>;

/// How a client's keepalive stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StreamEnd {
    /// The client half-closed or cancelled it, or the server ended it: leases keep their TTL.
    Goodbye,
    /// The client's connection was closed under the stream (a process that died: the kernel
    /// closed its socket). Leases it renewed last are shortened to the orphan grace when the
    /// client opted in ([`LEASE_LIVENESS_HEADER`]).
    Vanished,
    /// A follower's [`ORPHANED_STREAM_MARK_ID`]: its opted-in client vanished.
    Marked,
}

impl StreamEnd {
    /// A stream error means the client vanished when its connection was closed under the
    /// stream (the kernel closes a dead process's socket: hyper reports a broken pipe or a
    /// reset). A stream the client cancelled (RST_STREAM) said goodbye, and a connection that
    /// timed out got no FIN at all: a partition, which the TTL is for.
    fn of(status: &Status) -> StreamEnd {
        if status.code() == tonic::Code::Cancelled {
            return StreamEnd::Goodbye;
        }
        let described = format!("{status:?}").to_ascii_lowercase();
        let closed = [
            "broken pipe",
            "brokenpipe",
            "connection reset",
            "connectionreset",
        ]
        .iter()
        .any(|cause| described.contains(cause));
        match closed {
            true => StreamEnd::Vanished,
            false => StreamEnd::Goodbye,
        }
    }
}

/// The Lease gRPC server, refusing requests above `decode_max_bytes` before decoding them.
pub fn server(api: &Arc<Api>, decode_max_bytes: usize) -> LeaseServer<LeaseService> {
    LeaseServer::new(LeaseService {
        shared: Arc::new(Shared { api: api.clone() }),
    })
    .max_decoding_message_size(decode_max_bytes)
}

pub struct LeaseService {
    shared: Arc<Shared>,
}

struct Shared {
    api: Arc<Api>,
}

/// The leader's stream a follower forwards one client's keepalives on, several at once. A
/// reader task hands the n-th answer for a lease id to the n-th keepalive of that id sent up
/// the stream ([`deliver_upstream_answer`]): the leader answers different ids out of order and
/// each keepalive exactly once, with the lease's granted TTL (or 0 once it is gone). So when
/// the n-th keepalive is answered, n of them were renewed, one of them sent no earlier than it:
/// the lease's deadline counts from after its send.
struct Upstream {
    leader: NodeId,
    requests: mpsc::Sender<pb::LeaseKeepAliveRequest>,
    /// `None` once the stream ended or was given up: a stream that failed once is not trusted
    /// again, and every keepalive still waiting on it failed with it.
    waiting: Arc<Mutex<Option<Waiting>>>,
    /// Reads the leader's answers; ends when the leader ends the stream.
    reader: JoinHandle<()>,
}

impl Upstream {
    fn new(
        leader: NodeId,
        requests: mpsc::Sender<pb::LeaseKeepAliveRequest>,
        responses: Streaming<pb::LeaseKeepAliveResponse>,
    ) -> Upstream {
        let waiting = Arc::new(Mutex::new(Some(Waiting::new())));
        let reader = tokio::spawn(read_upstream(responses, waiting.clone()));
        Upstream {
            leader,
            requests,
            waiting,
            reader,
        }
    }

    fn is_open(&self) -> bool {
        self.waiting.lock().is_ok_and(|waiting| waiting.is_some())
    }

    /// Queues `waiter` for the next answer of lease `id`; false when the stream has ended.
    fn wait_for(&self, id: i64, waiter: oneshot::Sender<KeepAliveAnswer>) -> bool {
        let Ok(mut waiting) = self.waiting.lock() else {
            return false;
        };
        let Some(waiting) = waiting.as_mut() else {
            return false;
        };
        waiting.entry(id).or_default().push_back(waiter);
        true
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.reader.abort();
        // Dropping the waiters fails the keepalives still waiting: their routing loop retries
        // them on a new stream while their deadline lasts.
        if let Ok(mut waiting) = self.waiting.lock() {
            waiting.take();
        }
    }
}

/// The reader of an [`Upstream`]: passes each answer to the oldest keepalive waiting for its
/// lease id, and when the leader ends the stream fails every keepalive still waiting with
/// that end (an error status, or a leader change when it ended cleanly: it stepped down).
async fn read_upstream(
    mut responses: Streaming<pb::LeaseKeepAliveResponse>,
    waiting: Arc<Mutex<Option<Waiting>>>,
) {
    let ended = loop {
        match responses.message().await {
            Ok(Some(response)) => {
                let Ok(mut guard) = waiting.lock() else {
                    return;
                };
                let Some(waiting) = guard.as_mut() else {
                    return;
                };
                deliver_upstream_answer(waiting, response);
            }
            Ok(None) => break to_status(Error::LeaderChanged),
            Err(status) => break status,
        }
    };
    let Ok(mut guard) = waiting.lock() else {
        return;
    };
    for waiter in guard
        .take()
        .into_iter()
        .flat_map(BTreeMap::into_values)
        .flatten()
    {
        let _ = waiter.send(Err(ended.clone()));
    }
}

/// Hands one of the leader's answers to the oldest keepalive of its lease id still queued.
///
/// Each keepalive sent up the stream draws one answer, so the oldest waiter's slot is used up
/// even when that waiter is gone (it gave up at its deadline): the answer is then dropped, not
/// passed to a younger waiter. Passed on, it could acknowledge a keepalive sent *after* the
/// leader renewed the lease for the older one, and the holder, counting its TTL from the
/// younger keepalive's send time, would expect the lease to live longer than the leader's
/// deadline.
fn deliver_upstream_answer(waiting: &mut Waiting, response: pb::LeaseKeepAliveResponse) {
    let id = response.id;
    let Some(queue) = waiting.get_mut(&id) else {
        // Nobody waits for it any more.
        return;
    };
    if let Some(waiter) = queue.pop_front() {
        // A waiter gone since ignores the send's failure: its answer goes with it.
        let _ = waiter.send(Ok(response));
    }
    if queue.is_empty() {
        waiting.remove(&id);
    }
}

/// etcd's TTL seconds to the state machine's milliseconds: at least the minimum TTL rounded up
/// to a whole second (etcd's `minLeaseTTL`); negative asks count as 0, so they get it too.
fn grant_ttl_ms(ttl_seconds: i64, ttl_min_ms: u64) -> u64 {
    let min_seconds = ttl_min_ms.div_ceil(MS_PER_SECOND);
    let seconds = u64::try_from(ttl_seconds).unwrap_or(0).max(min_seconds);
    // Saturates far above the state machine's maximum, which then refuses it with etcd's error.
    seconds.saturating_mul(MS_PER_SECOND)
}

/// A granted TTL in etcd's whole seconds.
fn ttl_seconds(ttl_ms: u64) -> i64 {
    i64::try_from(ttl_ms.div_ceil(MS_PER_SECOND)).unwrap_or(i64::MAX)
}

impl Shared {
    fn context<T>(&self, request: &tonic::Request<T>) -> CallContext {
        CallContext::new(request, self.api.config.request_timeout_ms)
    }

    /// One keepalive on this node as leader.
    async fn renew_here(
        &self,
        ctx: &CallContext,
        renewed: &StreamRenewals,
        id: i64,
    ) -> Result<pb::LeaseKeepAliveResponse, Status> {
        let renewal = tokio::time::timeout(ctx.remaining(), self.api.node.lease_renew(id))
            .await
            .map_err(|_| to_status(Error::Timeout))?
            .map_err(to_status)?;
        let Some(renewal) = renewal else {
            // etcd answers a keepalive of a missing lease with TTL 0, not an error.
            return Ok(pb::LeaseKeepAliveResponse {
                header: Some(self.api.read_header()),
                id,
                ttl: 0,
            });
        };
        if let Some(committed) = renewal.checkpoint {
            match tokio::time::timeout(ctx.remaining(), committed).await {
                Err(_) => return Err(to_status(Error::Timeout)),
                Ok(Err(_)) => return Err(to_status(Error::Stopped)),
                Ok(Ok(Err(error))) => return Err(to_status(error)),
                Ok(Ok(Ok(_))) => {}
            }
        }
        if !renewal.leadership_confirmed {
            self.confirm_leadership(ctx, renewal.term).await?;
        }
        if let Ok(mut renewed) = renewed.lock() {
            // Keepalives of one lease on one stream may finish out of order: the orphan logic
            // needs the newest renewal (stamps grow with each renewal).
            let newest = renewed.entry(id).or_insert(renewal.stamp);
            *newest = (*newest).max(renewal.stamp);
        }
        Ok(pb::LeaseKeepAliveResponse {
            header: Some(self.api.read_header()),
            id,
            ttl: ttl_seconds(renewal.ttl_ms),
        })
    }

    /// Holds a keepalive's answer until a quorum has confirmed, in a
    /// ReadIndex round started after the renewal was recorded, that this node still leads
    /// the term it renewed in.
    ///
    /// Why: a leader that was paused (SIGSTOP, a long stall) or cut off still believes it
    /// leads until it hears a higher term, and would answer keepalives buffered meanwhile
    /// with a full TTL that the real leader never saw. With the round: the renewal happened
    /// at time t, and a quorum acknowledged this term after t. Any later leader needs votes
    /// from a member of that quorum, which refuses older terms once it has voted, so it is
    /// elected after t; `LeaseKeeper::promote` then resumes the lease no earlier than the
    /// bound the log records (the renewal lies within one checkpoint interval of a committed
    /// "renewed" record, so that bound is at least t + TTL) and a TTL after its promotion
    /// (after t), so the promise t + TTL holds. If the round fails the client gets the usual retriable
    /// not-leader error and its etcd client retries on the new leader. The core batches
    /// every read asked for in one turn into one round, so many keepalives share it.
    async fn confirm_leadership(&self, ctx: &CallContext, term: u64) -> Result<(), Status> {
        tokio::time::timeout(ctx.remaining(), self.api.node.confirm_leadership(term))
            .await
            .map_err(|_| to_status(Error::Timeout))?
            .map_err(to_status)
    }

    /// One keepalive through the leader's stream, opening it when needed. Several keepalives
    /// of one client stream share the upstream stream at once; the lock is held only to open
    /// it and to queue for an answer, not across the leader's round trip.
    async fn renew_at(
        &self,
        ctx: &CallContext,
        upstream: &tokio::sync::Mutex<Option<Upstream>>,
        leader: NodeId,
        id: i64,
    ) -> Result<pb::LeaseKeepAliveResponse, Status> {
        let (waiter, answer) = oneshot::channel();
        let (requests, waiting) = {
            let mut upstream = upstream.lock().await;
            if upstream
                .as_ref()
                .is_none_or(|u| u.leader != leader || !u.is_open())
            {
                *upstream = None;
                let (requests, outgoing) = mpsc::channel(KEEPALIVE_UPSTREAM_REQUESTS_MAX);
                // No gRPC timeout: the stream lives as long as the client's.
                let mut request = tonic::Request::new(ReceiverStream::new(outgoing));
                mark_forwarded(&mut request, &self.api.forwarding_context(ctx));
                let mut client = LeaseClient::new(self.api.channel(leader)?);
                let opened =
                    tokio::time::timeout(ctx.remaining(), client.lease_keep_alive(request))
                        .await
                        .map_err(|_| to_status(Error::Timeout))??;
                *upstream = Some(Upstream::new(leader, requests, opened.into_inner()));
            }
            let Some(stream) = upstream.as_ref() else {
                return Err(to_status(Error::LeaderChanged));
            };
            // Queued before the request leaves, so that its answer always finds a waiter.
            if !stream.wait_for(id, waiter) {
                *upstream = None;
                return Err(to_status(Error::LeaderChanged));
            }
            (stream.requests.clone(), stream.waiting.clone())
        };
        let exchange = async {
            if requests
                .send(pb::LeaseKeepAliveRequest { id })
                .await
                .is_err()
            {
                return Err(to_status(Error::LeaderChanged));
            }
            // A dropped waiter: the stream was given up (by a keepalive that failed on it).
            answer
                .await
                .unwrap_or_else(|_| Err(to_status(Error::LeaderChanged)))
        };
        let answer = tokio::time::timeout(ctx.remaining(), exchange)
            .await
            .unwrap_or_else(|_| Err(to_status(Error::Timeout)));
        if answer.is_err() {
            // A stream that failed once is not trusted again, unless it was replaced already.
            let mut upstream = upstream.lock().await;
            if upstream
                .as_ref()
                .is_some_and(|u| Arc::ptr_eq(&u.waiting, &waiting))
            {
                *upstream = None;
            }
        }
        answer
    }

    /// One keepalive wherever the leader is, retried across leader changes until the deadline.
    async fn keep_alive_once(
        &self,
        ctx: &CallContext,
        upstream: &tokio::sync::Mutex<Option<Upstream>>,
        renewed: &StreamRenewals,
        id: i64,
    ) -> Result<pb::LeaseKeepAliveResponse, Status> {
        self.api
            .route(ctx, Serve::Leader, |target| async move {
                match target {
                    Target::Here => self.renew_here(ctx, renewed, id).await,
                    Target::Leader(leader) => self.renew_at(ctx, upstream, leader, id).await,
                }
            })
            .await
    }

    /// The client of a keepalive stream vanished: the leases this node renewed for it as
    /// leader are shortened (unless renewed since through another stream), and a follower
    /// passes the news up its stream to the leader.
    async fn client_vanished(
        &self,
        upstream: &tokio::sync::Mutex<Option<Upstream>>,
        renewed: &StreamRenewals,
    ) {
        let renewed = renewed
            .lock()
            .map(|mut renewed| std::mem::take(&mut *renewed))
            .unwrap_or_default();
        for (id, stamp) in renewed {
            let shortened = self.api.node.lease_orphaned(id, stamp).await;
            tracing::debug!(
                lease = id,
                shortened,
                "keepalive stream ended without a goodbye"
            );
        }
        let Some(mut stream) = upstream.lock().await.take() else {
            return;
        };
        let mark = pb::LeaseKeepAliveRequest {
            id: ORPHANED_STREAM_MARK_ID,
        };
        if stream.requests.send(mark).await.is_ok() {
            // The leader ends the stream once it took the mark (and the reader with it);
            // dropping it sooner could reset the stream before the mark is read.
            let wait = Duration::from_millis(ORPHANED_STREAM_MARK_WAIT_MS);
            let _ = tokio::time::timeout(wait, &mut stream.reader).await;
        }
    }

    /// LeaseTimeToLive answered by this node as leader.
    async fn time_to_live_here(
        &self,
        ctx: &CallContext,
        message: &pb::LeaseTimeToLiveRequest,
    ) -> Result<pb::LeaseTimeToLiveResponse, Status> {
        // Answered once a quorum has confirmed this node's term after the reading: a deposed
        // leader's remaining TTL may be one the cluster has already ended.
        let remaining_ms = tokio::time::timeout(
            ctx.remaining(),
            self.api.node.lease_remaining_ms(message.id),
        )
        .await
        .map_err(|_| to_status(Error::Timeout))?
        .map_err(to_status)?;
        let found = self.api.node.read_state(|state| {
            let revision = state.revision();
            let lease = state.lease(message.id).map(|lease| {
                let keys = if message.keys {
                    lease.keys.iter().cloned().collect()
                } else {
                    Vec::new()
                };
                (lease.ttl_ms, keys)
            });
            (revision, lease)
        });
        let (revision, lease) = found;
        let response = match (remaining_ms, lease) {
            (Some(remaining_ms), Some((ttl_ms, keys))) => pb::LeaseTimeToLiveResponse {
                header: Some(self.api.header(revision)),
                id: message.id,
                // etcd truncates the remaining seconds.
                ttl: i64::try_from(remaining_ms / MS_PER_SECOND).unwrap_or(i64::MAX),
                granted_ttl: ttl_seconds(ttl_ms),
                keys,
            },
            // etcd answers a missing lease with TTL -1, not an error.
            _ => pb::LeaseTimeToLiveResponse {
                header: Some(self.api.header(revision)),
                id: message.id,
                ttl: -1,
                granted_ttl: 0,
                keys: Vec::new(),
            },
        };
        Ok(response)
    }
}

/// The client's side of a keepalive stream took no more answers: how it went (its request
/// stream tells) says whether it said goodbye.
async fn probe_end(incoming: &mut Streaming<pb::LeaseKeepAliveRequest>) -> StreamEnd {
    let probe = Duration::from_millis(STREAM_END_PROBE_MS);
    match tokio::time::timeout(probe, incoming.next()).await {
        Ok(Some(Err(status))) => StreamEnd::of(&status),
        _ => StreamEnd::Goodbye,
    }
}

#[async_trait]
impl Lease for LeaseService {
    async fn lease_grant(
        &self,
        request: tonic::Request<pb::LeaseGrantRequest>,
    ) -> Result<tonic::Response<pb::LeaseGrantResponse>, Status> {
        let shared = &self.shared;
        let ctx = shared.context(&request);
        let message = request.into_inner();
        let api = &shared.api;
        let ttl_min_ms = state_config(&api.config).lease_ttl_ms_min();
        let command = Request::LeaseGrant {
            id: message.id,
            ttl_ms: grant_ttl_ms(message.ttl, ttl_min_ms),
        };
        api.write(
            &ctx,
            command,
            &message,
            leader_call!(LeaseClient::lease_grant),
            |applied| match answer(&applied)? {
                Response::LeaseGranted { id, ttl_ms } => Ok(pb::LeaseGrantResponse {
                    header: Some(api.header(applied.output.revision)),
                    id: *id,
                    ttl: ttl_seconds(*ttl_ms),
                    error: String::new(),
                }),
                other => Err(unexpected(other)),
            },
        )
        .await
    }

    async fn lease_revoke(
        &self,
        request: tonic::Request<pb::LeaseRevokeRequest>,
    ) -> Result<tonic::Response<pb::LeaseRevokeResponse>, Status> {
        let shared = &self.shared;
        let ctx = shared.context(&request);
        let message = request.into_inner();
        let api = &shared.api;
        let command = Request::LeaseRevoke { id: message.id };
        api.write_self_contained(
            &ctx,
            command,
            &message,
            leader_call!(LeaseClient::lease_revoke),
            |applied| match answer(&applied)? {
                Response::LeaseRevoked => Ok(pb::LeaseRevokeResponse {
                    header: Some(api.header(applied.output.revision)),
                }),
                other => Err(unexpected(other)),
            },
        )
        .await
    }

    type LeaseKeepAliveStream = ReceiverStream<Result<pb::LeaseKeepAliveResponse, Status>>;

    async fn lease_keep_alive(
        &self,
        request: tonic::Request<Streaming<pb::LeaseKeepAliveRequest>>,
    ) -> Result<tonic::Response<Self::LeaseKeepAliveStream>, Status> {
        let forwarded = request.metadata().get(FORWARDED_HEADER).is_some();
        let liveness = request.metadata().get(LEASE_LIVENESS_HEADER).is_some();
        let caller = CallContext::new(&request, 0);
        let (token, cert_user) = (caller.token, caller.cert_user);
        // Held by the stream's task until the stream ends (lease_keepalive_streams_max).
        let slot = self
            .shared
            .api
            .limits
            .lease_keepalive_stream(request.remote_addr())?;
        let mut incoming = request.into_inner();
        let (responses, output) = mpsc::channel(KEEPALIVE_STREAM_RESPONSES_MAX);
        let shared = self.shared.clone();
        tokio::spawn(async move {
            let _slot = slot;
            // Shared by the keepalives in flight; the lock only lets them open it and queue.
            let upstream = Arc::new(tokio::sync::Mutex::new(None));
            let renewed = Arc::new(StreamRenewals::default());
            // Up to KEEPALIVE_STREAM_IN_FLIGHT_MAX keepalives run at once, each answered when
            // it completes: etcd's clients match answers by lease id. Keepalives of one lease
            // may run together too: the keeper renews them one after the other, each answer
            // is a TTL that renewal promised, and `renew_here` records the newest stamp.
            let mut in_flight: JoinSet<KeepAliveAnswer> = JoinSet::new();
            // How the client's side of the stream ended: a goodbye unless it says otherwise.
            let mut end = StreamEnd::Goodbye;
            // The requests ended (how: `end`); no more are read.
            let mut input_done = false;
            // The client's side takes answers; false once a send failed.
            let mut answering = true;
            // The first keepalive that failed. No more requests are read; the keepalives
            // still in flight finish and are answered, then the stream ends with this error.
            let mut failure: Option<Status> = None;
            let draining = shared.api.draining();
            tokio::pin!(draining);
            loop {
                let reading = !input_done && answering && failure.is_none();
                if !reading && in_flight.is_empty() {
                    break;
                }
                tokio::select! {
                    // Shutdown first, then answers before new requests.
                    biased;
                    // A member shutting down ends its streams itself: the clients are alive
                    // and move to another member, so their leases keep the full TTL. The
                    // keepalives still in flight are abandoned unanswered (dropping the set
                    // aborts them); the clients send them again on their new stream.
                    () = &mut draining => break,
                    Some(done) = in_flight.join_next(), if !in_flight.is_empty() => {
                        // A keepalive task that panicked fails like any other keepalive.
                        let answer = done.unwrap_or_else(|_| Err(to_status(Error::Stopped)));
                        let response = match answer {
                            Ok(response) => response,
                            // A failed keepalive ends the stream with its error; clients open
                            // a new one. Later failures add nothing to it.
                            Err(status) => {
                                failure.get_or_insert(status);
                                continue;
                            }
                        };
                        // Once the client's side is gone the remaining keepalives still run
                        // to the end, so that every renewal they made is recorded for the
                        // orphan logic below.
                        if answering && responses.send(Ok(response)).await.is_err() {
                            answering = false;
                            if !input_done {
                                input_done = true;
                                end = probe_end(&mut incoming).await;
                            }
                        }
                    }
                    // Backpressure: no request is read while the stream's keepalives in flight
                    // are at the cap, or while an answer waits for room in the answers queue.
                    next = incoming.next(),
                        if reading && in_flight.len() < KEEPALIVE_STREAM_IN_FLIGHT_MAX =>
                    {
                        let message = match next {
                            Some(Ok(message)) => message,
                            Some(Err(status)) => {
                                tracing::debug!(?status, "keepalive stream failed");
                                end = StreamEnd::of(&status);
                                input_done = true;
                                continue;
                            }
                            None => {
                                input_done = true;
                                continue;
                            }
                        };
                        if forwarded && message.id == ORPHANED_STREAM_MARK_ID {
                            end = StreamEnd::Marked;
                            input_done = true;
                            continue;
                        }
                        // Each keepalive gets the request timeout; the stream itself has none.
                        let ctx = CallContext {
                            deadline: Instant::now()
                                + Duration::from_millis(shared.api.config.request_timeout_ms),
                            forwarded,
                            forwarded_by: None,
                            session: None,
                            fence: None,
                            token: token.clone(),
                            cert_user: cert_user.clone(),
                        };
                        let (keeper, upstream, renewed) =
                            (shared.clone(), upstream.clone(), renewed.clone());
                        in_flight.spawn(async move {
                            keeper
                                .keep_alive_once(&ctx, &upstream, &renewed, message.id)
                                .await
                        });
                    }
                }
            }
            if let Some(status) = failure
                && answering
                && responses.send(Err(status)).await.is_err()
                && !input_done
            {
                end = probe_end(&mut incoming).await;
            }
            // A forwarded stream that broke lost a member, not the client: only the mark
            // speaks for a client behind a follower.
            let vanished = match end {
                StreamEnd::Marked => true,
                StreamEnd::Vanished => liveness && !forwarded,
                StreamEnd::Goodbye => false,
            };
            if vanished {
                shared.client_vanished(&upstream, &renewed).await;
            }
        });
        Ok(tonic::Response::new(ReceiverStream::new(output)))
    }

    async fn lease_time_to_live(
        &self,
        request: tonic::Request<pb::LeaseTimeToLiveRequest>,
    ) -> Result<tonic::Response<pb::LeaseTimeToLiveResponse>, Status> {
        let shared = &self.shared;
        let ctx = shared.context(&request);
        let message = request.into_inner();
        // The remaining TTL lives only in the leader's memory.
        shared
            .api
            .serve(
                &ctx,
                &message,
                leader_call!(LeaseClient::lease_time_to_live),
                || shared.time_to_live_here(&ctx, &message),
            )
            .await
    }

    async fn lease_leases(
        &self,
        request: tonic::Request<pb::LeaseLeasesRequest>,
    ) -> Result<tonic::Response<pb::LeaseLeasesResponse>, Status> {
        let shared = &self.shared;
        let ctx = shared.context(&request);
        shared.api.linearizable_barrier(&ctx).await?;
        let (revision, leases) = shared.api.node.read_state(|state| {
            let leases = state
                .leases()
                .iter()
                .map(|lease| pb::LeaseStatus { id: lease.id })
                .collect();
            (state.revision(), leases)
        });
        Ok(tonic::Response::new(pb::LeaseLeasesResponse {
            header: Some(shared.api.header(revision)),
            leases,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttls_follow_etcds_seconds() {
        // Election timeout 150 ms: minimum 225 ms, which etcd rounds up to 1 s.
        assert_eq!(grant_ttl_ms(0, 225), 1000);
        assert_eq!(grant_ttl_ms(-5, 225), 1000);
        assert_eq!(grant_ttl_ms(5, 225), 5000);
        assert_eq!(grant_ttl_ms(1, 1500), 2000);
        assert_eq!(grant_ttl_ms(i64::MAX, 225), u64::MAX);
        assert_eq!(ttl_seconds(5000), 5);
        assert_eq!(ttl_seconds(1500), 2);
    }

    fn answer(id: i64) -> pb::LeaseKeepAliveResponse {
        pb::LeaseKeepAliveResponse {
            id,
            ttl: 5,
            ..Default::default()
        }
    }

    #[test]
    fn an_answer_for_a_keepalive_that_gave_up_is_not_passed_to_a_younger_one() {
        let mut waiting = Waiting::new();
        let (older, older_answer) = oneshot::channel();
        let (younger, mut younger_answer) = oneshot::channel();
        waiting.entry(7).or_default().push_back(older);
        waiting.entry(7).or_default().push_back(younger);
        // The older keepalive gave up before the leader's answer to it arrived.
        drop(older_answer);
        deliver_upstream_answer(&mut waiting, answer(7));
        assert!(
            younger_answer.try_recv().is_err(),
            "the older keepalive's answer acknowledged the younger one"
        );
        // The younger keepalive's own answer reaches it.
        deliver_upstream_answer(&mut waiting, answer(7));
        let received = younger_answer.try_recv().expect("its own answer");
        assert_eq!(received.map(|r| r.id).ok(), Some(7));
        assert!(waiting.is_empty());
    }

    #[test]
    fn answers_go_to_the_oldest_keepalive_of_their_lease() {
        let mut waiting = Waiting::new();
        let (first, mut first_answer) = oneshot::channel();
        let (second, mut second_answer) = oneshot::channel();
        let (other, mut other_answer) = oneshot::channel();
        waiting.entry(7).or_default().push_back(first);
        waiting.entry(7).or_default().push_back(second);
        waiting.entry(9).or_default().push_back(other);
        deliver_upstream_answer(&mut waiting, answer(9));
        deliver_upstream_answer(&mut waiting, answer(7));
        assert!(other_answer.try_recv().is_ok());
        assert!(first_answer.try_recv().is_ok());
        assert!(second_answer.try_recv().is_err());
        // An answer nobody waits for is dropped.
        deliver_upstream_answer(&mut waiting, answer(11));
        assert_eq!(waiting.len(), 1);
    }
}
