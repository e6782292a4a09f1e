//! `conclave.v1.Queue`: Push, Claim (with an optional wait), Ack, Nack, Extend, List, Stats.
//!
//! ```text
//!  Push / Claim / Ack / Nack / Extend ─► one replicated command each (routed to the leader,
//!                                        in the caller's exactly-once session if it sent one)
//!  Claim with wait_ms ─► wait (capped slot) until this member's state shows a claimable job
//!                        or the wait ends ─► then one Claim command, forwarded without the wait
//!  List / Stats ─► linearizable read of the state
//! ```
//!
//! A Claim that waited proposes once, even if the job it saw was taken meanwhile: the answer
//! is then empty and the client claims again with a new session position. One position, one
//! command, so a retried Claim (answer lost, leader changed) gets the first answer back.

use std::sync::Arc;
use std::time::Duration;

use conclave_proto::conclave::v1::queue_client::QueueClient;
use conclave_proto::conclave::v1::queue_server::{Queue, QueueServer};
use conclave_proto::conclave::v1::{self as cv1};
use conclave_state::queue::{JobPush, WorkQueue};
use conclave_state::{Job, Request, Response, StateMachine};
use tokio::time::Instant;
use tonic::{Status, async_trait};

use super::{header, invalid};
use crate::api::limits::Wait;
use crate::api::lock::wait_until;
use crate::api::route::leader_call;
use crate::api::watch_hub::Interest;
use crate::api::{Api, CallContext, answer, unexpected};

/// Longest a Claim waits for a job (`wait_ms`), besides the call's own deadline.
pub const CLAIM_WAIT_MAX_MS: u64 = 60_000;
/// Time a waiting Claim keeps for its proposal before the call's deadline.
pub const CLAIM_PROPOSE_RESERVE_MS: u64 = 1_000;
/// Jobs a List returns when the request says 0.
pub const LIST_LIMIT_DEFAULT: usize = 100;
/// Jobs a List returns at most, whatever the request says.
pub const LIST_LIMIT_MAX: usize = 1_000;
/// Queues one Stats answer covers at most (all queues: the first ones by name).
pub const STATS_QUEUES_MAX: usize = 1_000;

/// `conclave.v1.Queue`, ready for the gRPC router.
pub fn queue_server(api: &Arc<Api>, decode_max: usize) -> QueueServer<QueueService> {
    QueueServer::new(QueueService { api: api.clone() }).max_decoding_message_size(decode_max)
}

/// Work queues over the shared [`Api`].
pub struct QueueService {
    pub api: Arc<Api>,
}

/// A job as the API shows it (the leader clock is Unix milliseconds).
pub(crate) fn job_to_pb(queue: &str, job: &Job, now_ms: u64) -> cv1::Job {
    let state = match &job.claim {
        Some(_) => cv1::JobState::Claimed,
        None if job.not_before_ms > now_ms => cv1::JobState::Delayed,
        None => cv1::JobState::Ready,
    };
    let claim = job.claim.as_ref();
    cv1::Job {
        queue: queue.to_string(),
        id: job.id,
        payload: job.payload.clone(),
        priority: job.priority,
        enqueued_unix_ms: job.enqueued_ms,
        not_before_unix_ms: job.not_before_ms,
        dedup_key: job.dedup_key.clone().unwrap_or_default(),
        attempts: job.attempts,
        state: state.into(),
        fence: claim.map_or(0, |c| c.fence),
        worker: claim.map(|c| c.worker.clone()).unwrap_or_default(),
        deadline_unix_ms: claim.map_or(0, |c| c.deadline_ms),
    }
}

fn stats_to_pb(name: &str, queue: &WorkQueue) -> cv1::QueueStats {
    let stats = queue.stats();
    let c = stats.counters;
    cv1::QueueStats {
        queue: name.to_string(),
        ready: stats.ready,
        delayed: stats.delayed,
        in_flight: stats.in_flight,
        max_attempts: stats.max_attempts,
        pushed: c.pushed,
        deduplicated: c.deduplicated,
        claimed: c.claimed,
        acked: c.acked,
        nacked: c.nacked,
        timed_out: c.timed_out,
        dead_lettered: c.dead_lettered,
        dropped: c.dropped,
    }
}

fn need_queue(queue: &str) -> Result<(), Status> {
    if queue.is_empty() {
        return Err(invalid("queue name is empty"));
    }
    Ok(())
}

fn claimable(state: &StateMachine, queue: &str) -> bool {
    state
        .work_queue(queue)
        .is_some_and(|q| q.has_claimable(state.now_ms()))
}

#[async_trait]
impl Queue for QueueService {
    async fn push(
        &self,
        request: tonic::Request<cv1::QueuePushRequest>,
    ) -> Result<tonic::Response<cv1::QueuePushResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        let message = request.into_inner();
        need_queue(&message.queue)?;
        let api = &self.api;
        let command = Request::QueuePush(JobPush {
            queue: message.queue.clone(),
            payload: message.payload.clone(),
            priority: message.priority,
            delay_ms: message.delay_ms,
            dedup_key: Some(message.dedup_key.clone()).filter(|key| !key.is_empty()),
            max_attempts: message.max_attempts,
        });
        api.write_self_contained(
            &ctx,
            command,
            &message,
            leader_call!(QueueClient::push),
            |applied| match answer(&applied)? {
                Response::JobPushed { id, existing } => Ok(cv1::QueuePushResponse {
                    header: Some(header(api, applied.output.revision)),
                    job_id: *id,
                    existing: *existing,
                }),
                other => Err(unexpected(other)),
            },
        )
        .await
    }

    async fn claim(
        &self,
        request: tonic::Request<cv1::QueueClaimRequest>,
    ) -> Result<tonic::Response<cv1::QueueClaimResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        let client = request.remote_addr();
        let mut message = request.into_inner();
        need_queue(&message.queue)?;
        let api = &self.api;
        if message.wait_ms > 0 {
            // Held until the answer (queue_claim_waits_max).
            let _slot = api.limits.wait(Wait::QueueClaim, client)?;
            let wait = Duration::from_millis(message.wait_ms.min(CLAIM_WAIT_MAX_MS));
            let reserve = Duration::from_millis(CLAIM_PROPOSE_RESERVE_MS);
            let deadline = (Instant::now() + wait)
                .min(ctx.deadline.checked_sub(reserve).unwrap_or(ctx.deadline));
            let queue = message.queue.clone();
            // This member's state is only a hint of when to propose; the claim itself is
            // decided by the log.
            wait_until(
                api,
                deadline,
                |state| claimable(state, &queue).then_some(()),
                Interest::Queue(queue.clone()),
            )
            .await?;
            // The leader must not wait again if the call is forwarded.
            message.wait_ms = 0;
        }
        let command = Request::QueueClaim {
            queue: message.queue.clone(),
            worker: message.worker.clone(),
            visibility_timeout_ms: message.visibility_timeout_ms,
        };
        let queue = message.queue.clone();
        api.write_self_contained(
            &ctx,
            command,
            &message,
            leader_call!(QueueClient::claim),
            |applied| match answer(&applied)? {
                Response::JobClaimed(job) => Ok(cv1::QueueClaimResponse {
                    header: Some(header(api, applied.output.revision)),
                    job: job.as_ref().map(|job| {
                        let now_ms = job.claim.as_ref().map_or(0, |c| c.claimed_ms);
                        job_to_pb(&queue, job, now_ms)
                    }),
                }),
                other => Err(unexpected(other)),
            },
        )
        .await
    }

    async fn ack(
        &self,
        request: tonic::Request<cv1::QueueAckRequest>,
    ) -> Result<tonic::Response<cv1::QueueAckResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        let message = request.into_inner();
        need_queue(&message.queue)?;
        let api = &self.api;
        let command = Request::QueueAck {
            queue: message.queue.clone(),
            job_id: message.job_id,
            fence: message.fence,
        };
        api.write_self_contained(
            &ctx,
            command,
            &message,
            leader_call!(QueueClient::ack),
            |applied| match answer(&applied)? {
                Response::JobAcked => Ok(cv1::QueueAckResponse {
                    header: Some(header(api, applied.output.revision)),
                }),
                other => Err(unexpected(other)),
            },
        )
        .await
    }

    async fn nack(
        &self,
        request: tonic::Request<cv1::QueueNackRequest>,
    ) -> Result<tonic::Response<cv1::QueueNackResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        let message = request.into_inner();
        need_queue(&message.queue)?;
        let api = &self.api;
        let command = Request::QueueNack {
            queue: message.queue.clone(),
            job_id: message.job_id,
            fence: message.fence,
            delay_ms: message.delay_ms,
        };
        api.write_self_contained(
            &ctx,
            command,
            &message,
            leader_call!(QueueClient::nack),
            |applied| match answer(&applied)? {
                Response::JobNacked { dead_lettered } => Ok(cv1::QueueNackResponse {
                    header: Some(header(api, applied.output.revision)),
                    dead_lettered: *dead_lettered,
                }),
                other => Err(unexpected(other)),
            },
        )
        .await
    }

    async fn extend(
        &self,
        request: tonic::Request<cv1::QueueExtendRequest>,
    ) -> Result<tonic::Response<cv1::QueueExtendResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        let message = request.into_inner();
        need_queue(&message.queue)?;
        let api = &self.api;
        let command = Request::QueueExtend {
            queue: message.queue.clone(),
            job_id: message.job_id,
            fence: message.fence,
            visibility_timeout_ms: message.visibility_timeout_ms,
        };
        api.write_self_contained(
            &ctx,
            command,
            &message,
            leader_call!(QueueClient::extend),
            |applied| match answer(&applied)? {
                Response::JobExtended { deadline_ms } => Ok(cv1::QueueExtendResponse {
                    header: Some(header(api, applied.output.revision)),
                    deadline_unix_ms: *deadline_ms,
                }),
                other => Err(unexpected(other)),
            },
        )
        .await
    }

    async fn list(
        &self,
        request: tonic::Request<cv1::QueueListRequest>,
    ) -> Result<tonic::Response<cv1::QueueListResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        let message = request.into_inner();
        need_queue(&message.queue)?;
        self.api.check_read(&ctx, message.queue.as_bytes(), &[])?;
        self.api.linearizable_barrier(&ctx).await?;
        let limit = match usize::try_from(message.limit) {
            Ok(0) | Err(_) => LIST_LIMIT_DEFAULT,
            Ok(limit) => limit.min(LIST_LIMIT_MAX),
        };
        let (jobs, next_id, revision) = self.api.node.read_state(|state| {
            let now_ms = state.now_ms();
            let Some(queue) = state.work_queue(&message.queue) else {
                return (Vec::new(), 0, state.revision());
            };
            let mut page: Vec<cv1::Job> = queue
                .jobs_from(message.from_id, limit + 1)
                .map(|job| job_to_pb(&message.queue, job, now_ms))
                .collect();
            let next_id = if page.len() > limit {
                page.pop().map_or(0, |job| job.id)
            } else {
                0
            };
            (page, next_id, state.revision())
        });
        Ok(tonic::Response::new(cv1::QueueListResponse {
            header: Some(header(&self.api, revision)),
            jobs,
            next_id,
        }))
    }

    async fn stats(
        &self,
        request: tonic::Request<cv1::QueueStatsRequest>,
    ) -> Result<tonic::Response<cv1::QueueStatsResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        let message = request.into_inner();
        // Every queue at once is a read of the whole key space under auth (docs/security.md).
        if message.queue.is_empty() {
            self.api.check_read(&ctx, b"\0", b"\0")?;
        } else {
            self.api.check_read(&ctx, message.queue.as_bytes(), &[])?;
        }
        self.api.linearizable_barrier(&ctx).await?;
        let (queues, revision) = self.api.node.read_state(|state| {
            let queues: Vec<cv1::QueueStats> = if message.queue.is_empty() {
                state
                    .work_queue_names_from("")
                    .take(STATS_QUEUES_MAX)
                    .filter_map(|name| state.work_queue(name).map(|q| stats_to_pb(name, q)))
                    .collect()
            } else {
                state
                    .work_queue(&message.queue)
                    .map(|q| stats_to_pb(&message.queue, q))
                    .into_iter()
                    .collect()
            };
            (queues, state.revision())
        });
        Ok(tonic::Response::new(cv1::QueueStatsResponse {
            header: Some(header(&self.api, revision)),
            queues,
        }))
    }
}
