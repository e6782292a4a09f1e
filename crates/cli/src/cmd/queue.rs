//! `queue push|claim|ack|nack|extend|list|stats`: work queues.
//!
//! A claim prints the job with its `fence`; ack, nack and extend need it back. A worker whose
//! claim ran out gets `leadership_lost` (exit 8) from ack: another worker may own the job now,
//! so its result must be dropped.

use std::time::Duration;

use clap::{Args, Subcommand};
use conclave_client::{ClaimOptions, Job, JobState, PushOptions, QueueStats};
use serde_json::{Value, json};

use super::kv::{PUT_STDIN_BYTES_MAX, read_stdin};
use super::output::text;
use super::{CmdResult, Ctx, Failure, parse_duration};

#[derive(Subcommand, Debug)]
pub enum QueueCommand {
    /// Add a job to QUEUE (created by its first push); the payload is --data or stdin.
    Push(PushArgs),
    /// Take the best ready job of QUEUE under a visibility timeout; prints it with its fence.
    Claim(ClaimArgs),
    /// The job is done (needs the claim's fence).
    Ack(FencedArgs),
    /// Give the job back: claimable again (after --delay), or dead-lettered after its
    /// queue's max attempts.
    Nack(NackArgs),
    /// Make the claim last longer, counted from now.
    Extend(ExtendArgs),
    /// The jobs of QUEUE in id order.
    List(ListArgs),
    /// Counts of QUEUE, or of every queue.
    Stats(StatsArgs),
}

#[derive(Args, Debug)]
pub struct PushArgs {
    pub queue: String,
    /// The payload (JSON or any text); read from stdin when omitted.
    #[arg(long, value_name = "DATA")]
    pub data: Option<String>,
    /// Higher is claimed first.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub priority: i64,
    /// Not claimable for this long (e.g. 30s).
    #[arg(long, value_name = "DURATION")]
    pub delay: Option<String>,
    /// While a job with this key is queued or in flight, answer that job instead.
    #[arg(long, value_name = "KEY")]
    pub dedup_key: Option<String>,
    /// Set the queue's max attempts before dead-lettering (default for a new queue: 5).
    #[arg(long, value_name = "N")]
    pub max_attempts: Option<u32>,
}

#[derive(Args, Debug)]
pub struct ClaimArgs {
    pub queue: String,
    /// Recorded with the claim (default: pid-<process id>).
    #[arg(long, value_name = "NAME")]
    pub worker: Option<String>,
    /// How long the claim lasts before the job is visible again (default 30s).
    #[arg(long, value_name = "DURATION")]
    pub visibility: Option<String>,
    /// With no job ready, wait this long for one.
    #[arg(long, value_name = "DURATION")]
    pub wait: Option<String>,
}

#[derive(Args, Debug)]
pub struct FencedArgs {
    pub queue: String,
    pub job_id: u64,
    /// The fence the claim printed.
    #[arg(long)]
    pub fence: u64,
}

#[derive(Args, Debug)]
pub struct NackArgs {
    #[command(flatten)]
    pub job: FencedArgs,
    /// Claimable again only after this long.
    #[arg(long, value_name = "DURATION")]
    pub delay: Option<String>,
}

#[derive(Args, Debug)]
pub struct ExtendArgs {
    #[command(flatten)]
    pub job: FencedArgs,
    /// The claim now runs out this long from now (default 30s).
    #[arg(long, value_name = "DURATION")]
    pub visibility: Option<String>,
}

#[derive(Args, Debug)]
pub struct ListArgs {
    pub queue: String,
    /// First job id to list.
    #[arg(long, value_name = "ID", default_value_t = 0)]
    pub from: u64,
    /// At most N jobs (0: the server's default, 100).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub limit: u32,
}

#[derive(Args, Debug)]
pub struct StatsArgs {
    /// One queue; every queue when omitted.
    pub queue: Option<String>,
}

/// A payload that is JSON stays JSON in `--json` output; anything else is a string.
fn payload_json(payload: &[u8]) -> Value {
    serde_json::from_slice(payload).unwrap_or_else(|_| Value::String(text(payload)))
}

fn state_name(state: JobState) -> &'static str {
    match state {
        JobState::Ready => "ready",
        JobState::Delayed => "delayed",
        JobState::Claimed => "claimed",
    }
}

fn job_json(job: &Job) -> Value {
    json!({
        "queue": job.queue,
        "id": job.id,
        "state": state_name(job.state),
        "fence": job.fence,
        "attempts": job.attempts,
        "priority": job.priority,
        "payload": payload_json(&job.payload),
        "dedup_key": job.dedup_key,
        "worker": job.worker,
        "enqueued_unix_ms": job.enqueued_unix_ms,
        "not_before_unix_ms": job.not_before_unix_ms,
        "deadline_unix_ms": job.deadline_unix_ms,
    })
}

fn stats_json(s: &QueueStats) -> Value {
    json!({
        "queue": s.queue,
        "ready": s.ready,
        "delayed": s.delayed,
        "in_flight": s.in_flight,
        "max_attempts": s.max_attempts,
        "pushed": s.pushed,
        "deduplicated": s.deduplicated,
        "claimed": s.claimed,
        "acked": s.acked,
        "nacked": s.nacked,
        "timed_out": s.timed_out,
        "dead_lettered": s.dead_lettered,
        "dropped": s.dropped,
    })
}

fn check_queue(queue: &str) -> CmdResult<()> {
    if queue.is_empty() {
        return Err(Failure::invalid("the queue name must not be empty"));
    }
    Ok(())
}

fn duration(text: Option<&str>, what: &str) -> CmdResult<Duration> {
    text.map(|t| parse_duration(t, what))
        .transpose()
        .map(Option::unwrap_or_default)
}

pub async fn run(ctx: &Ctx, command: QueueCommand) -> CmdResult {
    match command {
        QueueCommand::Push(args) => push(ctx, args).await,
        QueueCommand::Claim(args) => claim(ctx, args).await,
        QueueCommand::Ack(args) => ack(ctx, args).await,
        QueueCommand::Nack(args) => nack(ctx, args).await,
        QueueCommand::Extend(args) => extend(ctx, args).await,
        QueueCommand::List(args) => list(ctx, args).await,
        QueueCommand::Stats(args) => stats(ctx, args).await,
    }
}

async fn push(ctx: &Ctx, args: PushArgs) -> CmdResult {
    check_queue(&args.queue)?;
    let options = PushOptions {
        priority: args.priority,
        delay: duration(args.delay.as_deref(), "--delay")?,
        dedup_key: args.dedup_key.clone(),
        max_attempts: args.max_attempts.unwrap_or(0),
    };
    if args.max_attempts == Some(0) {
        return Err(Failure::invalid("--max-attempts must be at least 1"));
    }
    let payload = match args.data {
        Some(data) => data.into_bytes(),
        None => read_stdin(PUT_STDIN_BYTES_MAX).await?,
    };
    let client = ctx.connect().await?;
    let pushed = client.queues().push(&args.queue, payload, options).await?;
    ctx.out.ok(
        json!({"queue": args.queue, "id": pushed.job_id, "existing": pushed.existing}),
        || {
            let how = if pushed.existing {
                "already queued as"
            } else {
                "pushed"
            };
            format!("{how} {} job {}", args.queue, pushed.job_id)
        },
    );
    Ok(0)
}

async fn claim(ctx: &Ctx, args: ClaimArgs) -> CmdResult {
    check_queue(&args.queue)?;
    let options = ClaimOptions {
        worker: args
            .worker
            .clone()
            .unwrap_or_else(|| format!("pid-{}", std::process::id())),
        visibility_timeout: duration(args.visibility.as_deref(), "--visibility")?,
        wait: duration(args.wait.as_deref(), "--wait")?,
    };
    let client = ctx.connect().await?;
    let Some(job) = client.queues().claim(&args.queue, options).await? else {
        return Err(Failure::new(
            "not_found",
            format!("no job is ready in queue {}", args.queue),
        ));
    };
    ctx.out.ok(job_json(&job), || {
        format!(
            "claimed {} job {} (fence {}, attempt {}): {}",
            job.queue,
            job.id,
            job.fence,
            job.attempts,
            text(&job.payload)
        )
    });
    Ok(0)
}

async fn ack(ctx: &Ctx, args: FencedArgs) -> CmdResult {
    check_queue(&args.queue)?;
    let client = ctx.connect().await?;
    client
        .queues()
        .ack(&args.queue, args.job_id, args.fence)
        .await?;
    ctx.out.ok(
        json!({"queue": args.queue, "id": args.job_id, "acked": true}),
        || format!("acked {} job {}", args.queue, args.job_id),
    );
    Ok(0)
}

async fn nack(ctx: &Ctx, args: NackArgs) -> CmdResult {
    let job = &args.job;
    check_queue(&job.queue)?;
    let delay = duration(args.delay.as_deref(), "--delay")?;
    let client = ctx.connect().await?;
    let dead = client
        .queues()
        .nack(&job.queue, job.job_id, job.fence, delay)
        .await?;
    ctx.out.ok(
        json!({"queue": job.queue, "id": job.job_id, "dead_lettered": dead}),
        || {
            if dead {
                format!(
                    "{} job {} used its attempts: moved to {}.dead",
                    job.queue, job.job_id, job.queue
                )
            } else {
                format!("gave back {} job {}", job.queue, job.job_id)
            }
        },
    );
    Ok(0)
}

async fn extend(ctx: &Ctx, args: ExtendArgs) -> CmdResult {
    let job = &args.job;
    check_queue(&job.queue)?;
    let visibility = duration(args.visibility.as_deref(), "--visibility")?;
    let client = ctx.connect().await?;
    let deadline = client
        .queues()
        .extend(&job.queue, job.job_id, job.fence, visibility)
        .await?;
    ctx.out.ok(
        json!({"queue": job.queue, "id": job.job_id, "deadline_unix_ms": deadline}),
        || {
            format!(
                "extended {} job {} to {deadline} (Unix ms)",
                job.queue, job.job_id
            )
        },
    );
    Ok(0)
}

async fn list(ctx: &Ctx, args: ListArgs) -> CmdResult {
    check_queue(&args.queue)?;
    let client = ctx.connect().await?;
    let (jobs, next_id) = client
        .queues()
        .list(&args.queue, args.from, args.limit)
        .await?;
    ctx.out.ok(
        json!({
            "queue": args.queue,
            "jobs": jobs.iter().map(job_json).collect::<Vec<_>>(),
            "next_id": next_id,
        }),
        || {
            let rows: Vec<Vec<String>> = jobs
                .iter()
                .map(|j| {
                    vec![
                        j.id.to_string(),
                        state_name(j.state).to_string(),
                        j.priority.to_string(),
                        j.attempts.to_string(),
                        if j.fence == 0 {
                            String::new()
                        } else {
                            j.fence.to_string()
                        },
                        j.worker.clone(),
                        text(&j.payload),
                    ]
                })
                .collect();
            ctx.out.table(
                &[
                    "ID", "STATE", "PRIORITY", "ATTEMPTS", "FENCE", "WORKER", "PAYLOAD",
                ],
                &rows,
            )
        },
    );
    Ok(0)
}

async fn stats(ctx: &Ctx, args: StatsArgs) -> CmdResult {
    let queue = args.queue.unwrap_or_default();
    let client = ctx.connect().await?;
    let all = client.queues().stats(&queue).await?;
    if !queue.is_empty() && all.is_empty() {
        return Err(Failure::new(
            "not_found",
            format!("queue {queue} does not exist (nothing was pushed to it)"),
        ));
    }
    ctx.out.ok(
        json!({"queues": all.iter().map(stats_json).collect::<Vec<_>>()}),
        || {
            let rows: Vec<Vec<String>> = all
                .iter()
                .map(|s| {
                    [
                        s.queue.clone(),
                        s.ready.to_string(),
                        s.delayed.to_string(),
                        s.in_flight.to_string(),
                        s.pushed.to_string(),
                        s.acked.to_string(),
                        s.timed_out.to_string(),
                        s.dead_lettered.to_string(),
                    ]
                    .to_vec()
                })
                .collect();
            ctx.out.table(
                &[
                    "QUEUE",
                    "READY",
                    "DELAYED",
                    "IN FLIGHT",
                    "PUSHED",
                    "ACKED",
                    "TIMED OUT",
                    "DEAD",
                ],
                &rows,
            )
        },
    );
    Ok(0)
}
