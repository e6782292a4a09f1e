//! Work queues (`conclave.v1.Queue`): push, claim (optionally waiting), ack, nack, extend,
//! list and stats.
//!
//! Push and Claim travel in an exactly-once session, so a retry after a leader change or a
//! lost answer gets the first answer: a claim never takes a second job for one call. Ack, nack
//! and extend carry the claim's fence; once the claim timed out (or another worker holds the
//! job) they fail with [`crate::Error::LeadershipLost`], and the worker must drop its result.

use std::time::Duration;

use conclave_proto::conclave::v1 as cv1;
use conclave_proto::conclave::v1::queue_client::QueueClient;
use tokio::time::Instant;

use crate::Client;
use crate::conn::{Retry, request};
use crate::error::{ErrorContext, Result};
use crate::session::Position;

/// Whether a job is claimable, waiting for its delay, or claimed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum JobState {
    #[default]
    Ready,
    Delayed,
    Claimed,
}

/// A job, as pushed, with its claim when it has one.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Job {
    pub queue: String,
    /// Unique across queues; kept when the job is dead-lettered.
    pub id: u64,
    pub payload: Vec<u8>,
    pub priority: i64,
    /// Leader clock, Unix ms.
    pub enqueued_unix_ms: u64,
    pub not_before_unix_ms: u64,
    /// Empty when the push gave none.
    pub dedup_key: String,
    /// Claims so far, the current one included.
    pub attempts: u32,
    pub state: JobState,
    /// The claim's fence (0 when not claimed): present it to ack, nack or extend.
    pub fence: u64,
    pub worker: String,
    /// When the claim runs out (leader clock, Unix ms; 0 when not claimed).
    pub deadline_unix_ms: u64,
}

impl From<cv1::Job> for Job {
    fn from(job: cv1::Job) -> Self {
        let state = match cv1::JobState::try_from(job.state) {
            Ok(cv1::JobState::Delayed) => JobState::Delayed,
            Ok(cv1::JobState::Claimed) => JobState::Claimed,
            _ => JobState::Ready,
        };
        Job {
            queue: job.queue,
            id: job.id,
            payload: job.payload.into(),
            priority: job.priority,
            enqueued_unix_ms: job.enqueued_unix_ms,
            not_before_unix_ms: job.not_before_unix_ms,
            dedup_key: job.dedup_key,
            attempts: job.attempts,
            state,
            fence: job.fence,
            worker: job.worker,
            deadline_unix_ms: job.deadline_unix_ms,
        }
    }
}

/// Options of [`Queues::push`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PushOptions {
    /// Higher is claimed first.
    pub priority: i64,
    /// Not claimable for this long.
    pub delay: Duration,
    /// While a job with this key is queued or in flight, a push answers that job.
    pub dedup_key: Option<String>,
    /// Sets the queue's max_attempts (0 keeps it; a new queue starts at 5).
    pub max_attempts: u32,
}

/// Answer of [`Queues::push`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pushed {
    pub job_id: u64,
    /// The dedup key named a job already queued or in flight.
    pub existing: bool,
}

/// Options of [`Queues::claim`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClaimOptions {
    /// Recorded with the claim, for listings.
    pub worker: String,
    /// How long the claim lasts (zero: the server's default, 30 s).
    pub visibility_timeout: Duration,
    /// With no job ready, wait up to this long for one.
    pub wait: Duration,
}

/// A queue's numbers.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct QueueStats {
    pub queue: String,
    pub ready: u64,
    pub delayed: u64,
    pub in_flight: u64,
    pub max_attempts: u32,
    pub pushed: u64,
    pub deduplicated: u64,
    pub claimed: u64,
    pub acked: u64,
    pub nacked: u64,
    pub timed_out: u64,
    pub dead_lettered: u64,
    pub dropped: u64,
}

impl From<cv1::QueueStats> for QueueStats {
    fn from(s: cv1::QueueStats) -> Self {
        QueueStats {
            queue: s.queue,
            ready: s.ready,
            delayed: s.delayed,
            in_flight: s.in_flight,
            max_attempts: s.max_attempts,
            pushed: s.pushed,
            deduplicated: s.deduplicated,
            claimed: s.claimed,
            acked: s.acked,
            nacked: s.nacked,
            timed_out: s.timed_out,
            dead_lettered: s.dead_lettered,
            dropped: s.dropped,
        }
    }
}

/// Work queues.
#[derive(Clone)]
pub struct Queues {
    client: Client,
}

fn queue_client(channel: crate::conn::Channel) -> QueueClient<crate::conn::Channel> {
    QueueClient::new(channel)
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

impl Queues {
    pub(crate) fn new(client: Client) -> Self {
        Queues { client }
    }

    /// Adds a job to `queue` (created by its first push).
    pub async fn push(
        &self,
        queue: &str,
        payload: impl Into<Vec<u8>>,
        options: PushOptions,
    ) -> Result<Pushed> {
        let message = cv1::QueuePushRequest {
            queue: queue.to_string(),
            payload: payload.into().into(),
            priority: options.priority,
            delay_ms: millis(options.delay),
            dedup_key: options.dedup_key.unwrap_or_default(),
            max_attempts: options.max_attempts,
        };
        let answer = self
            .client
            .call_in_session(
                Retry::AtMostOnce,
                ErrorContext::default(),
                |channel, timeout, at| {
                    let message = message.clone();
                    async move {
                        queue_client(channel)
                            .push(at.request(message, timeout))
                            .await
                    }
                },
            )
            .await?
            .into_inner();
        Ok(Pushed {
            job_id: answer.job_id,
            existing: answer.existing,
        })
    }

    /// Claims the best ready job of `queue`, waiting up to `options.wait` for one. `None`
    /// when none became ready in time.
    pub async fn claim(&self, queue: &str, options: ClaimOptions) -> Result<Option<Job>> {
        let until = Instant::now() + options.wait;
        loop {
            let wait = until.saturating_duration_since(Instant::now());
            let message = cv1::QueueClaimRequest {
                queue: queue.to_string(),
                worker: options.worker.clone(),
                visibility_timeout_ms: millis(options.visibility_timeout),
                wait_ms: millis(wait),
            };
            let timeout = self.client.inner.options.request_timeout + wait;
            // One session position per call: a retry of it is answered from the cache.
            let answer = self
                .client
                .inner
                .call_in_session(
                    Retry::AtMostOnce,
                    ErrorContext::default(),
                    timeout,
                    |channel, timeout, at| {
                        let message = message.clone();
                        async move {
                            queue_client(channel)
                                .claim(at.request(message, timeout))
                                .await
                        }
                    },
                )
                .await?
                .into_inner();
            if let Some(job) = answer.job {
                return Ok(Some(job.into()));
            }
            // Another worker took the job this call saw; claim again while time is left.
            if Instant::now() >= until {
                return Ok(None);
            }
        }
    }

    /// Marks the job claimed with `fence` done. [`crate::Error::LeadershipLost`] when the claim is
    /// no longer current (timed out, released, or the job is done).
    pub async fn ack(&self, queue: &str, job_id: u64, fence: u64) -> Result<()> {
        let message = cv1::QueueAckRequest {
            queue: queue.to_string(),
            job_id,
            fence,
        };
        self.fenced(|channel, timeout, at| {
            let message = message.clone();
            async move {
                queue_client(channel)
                    .ack(at.request(message, timeout))
                    .await
            }
        })
        .await
        .map(|_| ())
    }

    /// Gives the job claimed with `fence` back, claimable again after `delay`. Answers whether
    /// it used its attempts and went to the dead-letter queue.
    pub async fn nack(
        &self,
        queue: &str,
        job_id: u64,
        fence: u64,
        delay: Duration,
    ) -> Result<bool> {
        let message = cv1::QueueNackRequest {
            queue: queue.to_string(),
            job_id,
            fence,
            delay_ms: millis(delay),
        };
        self.fenced(|channel, timeout, at| {
            let message = message.clone();
            async move {
                queue_client(channel)
                    .nack(at.request(message, timeout))
                    .await
            }
        })
        .await
        .map(|answer| answer.into_inner().dead_lettered)
    }

    /// Makes the claim with `fence` run out `timeout` from now (zero: 30 s). Answers the new
    /// deadline (leader clock, Unix ms).
    pub async fn extend(
        &self,
        queue: &str,
        job_id: u64,
        fence: u64,
        timeout: Duration,
    ) -> Result<u64> {
        let message = cv1::QueueExtendRequest {
            queue: queue.to_string(),
            job_id,
            fence,
            visibility_timeout_ms: millis(timeout),
        };
        self.fenced(|channel, timeout, at| {
            let message = message.clone();
            async move {
                queue_client(channel)
                    .extend(at.request(message, timeout))
                    .await
            }
        })
        .await
        .map(|answer| answer.into_inner().deadline_unix_ms)
    }

    /// Fenced writes travel in a session too: a retry whose first copy was applied (answer
    /// lost) gets that answer from the cache, instead of being refused as stale.
    async fn fenced<T, F, Fut>(&self, call: F) -> Result<T>
    where
        F: FnMut(crate::conn::Channel, Duration, Position) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<T, tonic::Status>>,
    {
        self.client
            .call_in_session(Retry::AtMostOnce, ErrorContext::default(), call)
            .await
    }

    /// Jobs of `queue` from id `from_id` on, at most `limit` (0: the server's default).
    /// Answers the jobs and the id the next page starts at (0: none).
    pub async fn list(&self, queue: &str, from_id: u64, limit: u32) -> Result<(Vec<Job>, u64)> {
        let message = cv1::QueueListRequest {
            queue: queue.to_string(),
            from_id,
            limit,
        };
        let answer = self
            .client
            .call(
                Retry::Idempotent,
                ErrorContext::default(),
                |channel, timeout| {
                    let message = message.clone();
                    async move { queue_client(channel).list(request(message, timeout)).await }
                },
            )
            .await?
            .into_inner();
        Ok((
            answer.jobs.into_iter().map(Job::from).collect(),
            answer.next_id,
        ))
    }

    /// Numbers of `queue`, or of every queue when it is empty.
    pub async fn stats(&self, queue: &str) -> Result<Vec<QueueStats>> {
        let message = cv1::QueueStatsRequest {
            queue: queue.to_string(),
        };
        let answer = self
            .client
            .call(
                Retry::Idempotent,
                ErrorContext::default(),
                |channel, timeout| {
                    let message = message.clone();
                    async move { queue_client(channel).stats(request(message, timeout)).await }
                },
            )
            .await?
            .into_inner();
        Ok(answer.queues.into_iter().map(QueueStats::from).collect())
    }
}
