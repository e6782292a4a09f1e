//! etcd's Lease service: LeaseGrant, LeaseRevoke, LeaseKeepAlive, LeaseTimeToLive, LeaseLeases.
//!
//! ```text
//!  Grant / Revoke ─► Api::write (through the log; followers forward)
//!  KeepAlive stream ─► leader: NodeHandle::lease_renew (LeaseKeeper, not the log; a checkpoint
//!                      commits first when the keeper asks) ─► confirm_leadership (a
//!                      ReadIndex round of the renewing term) ─► TTL
//!                   └► follower: one upstream KeepAlive stream to the leader per client
//!                      stream, re-opened on the new leader when leadership moves
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

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use conclave_proto::etcdserverpb::{
    self as pb, lease_client::LeaseClient, lease_server::Lease, lease_server::LeaseServer,
};
use conclave_raft::NodeId;
use conclave_state::{Request, Response};
use tokio::sync::mpsc;
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
/// Keepalive requests queued for the upstream stream to the leader (one is in flight at a
/// time; the slack lets a send never wait).
const KEEPALIVE_UPSTREAM_REQUESTS_MAX: usize = 4;
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

/// Renewals made on this node as leader for one keepalive stream: lease -> stamp.
type StreamRenewals = Mutex<BTreeMap<i64, u64>>;

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

/// The leader's stream a follower forwards one client's keepalives on.
struct Upstream {
    leader: NodeId,
    requests: mpsc::Sender<pb::LeaseKeepAliveRequest>,
    responses: Streaming<pb::LeaseKeepAliveResponse>,
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
        self.confirm_leadership(ctx, renewal.term).await?;
        if let Ok(mut renewed) = renewed.lock() {
            renewed.insert(id, renewal.stamp);
        }
        Ok(pb::LeaseKeepAliveResponse {
            header: Some(self.api.read_header()),
            id,
            ttl: ttl_seconds(renewal.ttl_ms),
        })
    }

    /// Holds a keepalive's (or TimeToLive's) answer until a quorum has confirmed, in a
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

    /// One keepalive through the leader's stream, opening it when needed.
    async fn renew_at(
        &self,
        ctx: &CallContext,
        upstream: &tokio::sync::Mutex<Option<Upstream>>,
        leader: NodeId,
        id: i64,
    ) -> Result<pb::LeaseKeepAliveResponse, Status> {
        let mut upstream = upstream.lock().await;
        if upstream.as_ref().is_none_or(|u| u.leader != leader) {
            *upstream = None;
            let (requests, outgoing) = mpsc::channel(KEEPALIVE_UPSTREAM_REQUESTS_MAX);
            // No gRPC timeout: the stream lives as long as the client's.
            let mut request = tonic::Request::new(ReceiverStream::new(outgoing));
            mark_forwarded(&mut request, &self.api.forwarding_context(ctx));
            let mut client = LeaseClient::new(self.api.channel(leader)?);
            let opened = tokio::time::timeout(ctx.remaining(), client.lease_keep_alive(request))
                .await
                .map_err(|_| to_status(Error::Timeout))??;
            *upstream = Some(Upstream {
                leader,
                requests,
                responses: opened.into_inner(),
            });
        }
        let Some(stream) = upstream.as_mut() else {
            return Err(to_status(Error::LeaderChanged));
        };
        let sent = stream.requests.send(pb::LeaseKeepAliveRequest { id }).await;
        let answer = match sent {
            Err(_) => Err(to_status(Error::LeaderChanged)),
            Ok(()) => match tokio::time::timeout(ctx.remaining(), stream.responses.message()).await
            {
                Err(_) => Err(to_status(Error::Timeout)),
                Ok(Ok(Some(response))) => Ok(response),
                // The leader ended the stream: it stepped down or went away.
                Ok(Ok(None)) => Err(to_status(Error::LeaderChanged)),
                Ok(Err(status)) => Err(status),
            },
        };
        if answer.is_err() {
            // A stream that failed once is not trusted again.
            *upstream = None;
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
        renewed: StreamRenewals,
    ) {
        let renewed = renewed.into_inner().unwrap_or_default();
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
            // The leader ends the stream once it took the mark; dropping it sooner could
            // reset the stream before the mark is read.
            let wait = Duration::from_millis(ORPHANED_STREAM_MARK_WAIT_MS);
            let _ = tokio::time::timeout(wait, stream.responses.message()).await;
        }
    }

    /// LeaseTimeToLive answered by this node as leader.
    async fn time_to_live_here(
        &self,
        ctx: &CallContext,
        message: &pb::LeaseTimeToLiveRequest,
    ) -> Result<pb::LeaseTimeToLiveResponse, Status> {
        let (remaining_ms, term) = tokio::time::timeout(
            ctx.remaining(),
            self.api.node.lease_remaining_ms(message.id),
        )
        .await
        .map_err(|_| to_status(Error::Timeout))?
        .map_err(to_status)?;
        // A deposed leader's remaining TTL may be one the cluster has already ended.
        self.confirm_leadership(ctx, term).await?;
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
        api.write(
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
            // Used by one keepalive at a time; the lock only lets the routing loop lend it out.
            let upstream = tokio::sync::Mutex::new(None);
            let renewed = StreamRenewals::default();
            // Keepalives on one stream are answered in order, one at a time, as etcd does.
            let end = loop {
                let next = tokio::select! {
                    next = incoming.next() => next,
                    // A member shutting down ends its streams itself: the clients are alive
                    // and move to another member, so their leases keep the full TTL.
                    () = shared.api.draining() => break StreamEnd::Goodbye,
                };
                let message = match next {
                    Some(Ok(message)) => message,
                    Some(Err(status)) => {
                        tracing::debug!(?status, "keepalive stream failed");
                        break StreamEnd::of(&status);
                    }
                    None => break StreamEnd::Goodbye,
                };
                if forwarded && message.id == ORPHANED_STREAM_MARK_ID {
                    break StreamEnd::Marked;
                }
                // Each keepalive gets the request timeout; the stream itself has none.
                let ctx = CallContext {
                    deadline: Instant::now()
                        + Duration::from_millis(shared.api.config.request_timeout_ms),
                    forwarded,
                    session: None,
                    fence: None,
                    token: token.clone(),
                    cert_user: cert_user.clone(),
                };
                let answer = shared
                    .keep_alive_once(&ctx, &upstream, &renewed, message.id)
                    .await;
                let failed = answer.is_err();
                if responses.send(answer).await.is_err() {
                    // The client's side is gone; how it went says whether it said goodbye.
                    let probe = Duration::from_millis(STREAM_END_PROBE_MS);
                    break match tokio::time::timeout(probe, incoming.next()).await {
                        Ok(Some(Err(status))) => StreamEnd::of(&status),
                        _ => StreamEnd::Goodbye,
                    };
                }
                // A failed keepalive ends the stream with its error; clients open a new one.
                if failed {
                    break StreamEnd::Goodbye;
                }
            };
            // A forwarded stream that broke lost a member, not the client: only the mark
            // speaks for a client behind a follower.
            let vanished = match end {
                StreamEnd::Marked => true,
                StreamEnd::Vanished => liveness && !forwarded,
                StreamEnd::Goodbye => false,
            };
            if vanished {
                shared.client_vanished(&upstream, renewed).await;
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
}
