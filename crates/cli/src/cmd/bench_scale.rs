//! `bench scale`: many sessions and election groups held at once, the scale run of
//! `docs/performance.md`.
//!
//! `--sessions N` leases are kept alive once a second over `--streams` LeaseKeepAlive streams
//! (etcd's protocol carries any number of lease ids on one stream, so 10,000 sessions need a
//! handful of HTTP/2 streams, not 10,000). `--groups G` priority election groups get three
//! candidates each, registered without waiting (Campaign with `wait: false`, the CLI's
//! `--no-wait`): group g's candidates sit on sessions g, g+1 and g+2 (mod N) with priorities
//! 3, 2 and 1. While the load runs, a sweep asks every group for its leader (Leader RPC), one
//! sweep after the other with `--sweep-pause` between them, and compares each group's fence
//! with the first complete sweep's, so a leader change anywhere is counted.
//!
//! Every `--report-every` (and at the end) it prints keepalives answered per second, their
//! p50/p99 latency, keepalives refused (TTL 0: the lease is gone) and groups without a leader.
//! The final report also carries the longest gap between two answers on any stream and every
//! sweep with its wall-clock times, so a script that kills a member at a known time can work
//! out how long keepalives and leaderships took to come back.
//!
//! It speaks the raw gRPC stubs (etcd's Lease API and Conclave's Election API), not the client
//! library, so one stream carries many leases and nothing retries behind its back.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Args;
use conclave_proto::conclave::v1::election_client::ElectionClient;
use conclave_proto::conclave::v1::{CampaignRequest, LeaderRequest};
use conclave_proto::etcdserverpb::lease_client::LeaseClient;
use conclave_proto::etcdserverpb::{LeaseGrantRequest, LeaseKeepAliveRequest, LeaseRevokeRequest};
use hdrhistogram::Histogram;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

use super::{CmdResult, Ctx, Failure, parse_duration};

/// Most sessions (leases) one run keeps alive.
pub const SCALE_SESSIONS_MAX: usize = 100_000;
/// Most election groups one run creates.
pub const SCALE_GROUPS_MAX: usize = 100_000;
/// Most LeaseKeepAlive streams one run opens.
pub const SCALE_STREAMS_MAX: usize = 64;
/// Candidates per group (the shape: three, on consecutive sessions).
const CANDIDATES_PER_GROUP: usize = 3;
/// How often each lease is renewed.
const KEEPALIVE_EVERY: Duration = Duration::from_secs(1);
/// A stream renews its leases in this many slices per `KEEPALIVE_EVERY`, so the load is
/// spread over the second instead of arriving as one burst.
const KEEPALIVE_SLICES: u64 = 20;
/// Requests in flight while granting leases, registering candidates, sweeping or revoking.
const SETUP_IN_FLIGHT: usize = 64;
/// Wait after a stream broke or could not connect before the next endpoint is tried.
const RECONNECT_PAUSE: Duration = Duration::from_millis(50);
/// Keepalive requests a stream may have queued for sending.
const STREAM_QUEUE: usize = 4096;
/// Latencies above this are clamped into the histogram's top bucket.
const LATENCY_MAX_US: u64 = 60_000_000;
/// Longest `--duration`, so a typo cannot start a day-long run.
const SCALE_DURATION_MAX: Duration = Duration::from_secs(6 * 3600);
/// Shortest lease TTL: at least a few renewal periods, so one late renewal is not an expiry.
const SCALE_TTL_MIN: Duration = Duration::from_secs(3);

#[derive(Args, Debug)]
pub struct ScaleArgs {
    /// Sessions (leases) kept alive once a second.
    #[arg(long, default_value_t = 1000)]
    pub sessions: usize,
    /// Priority election groups, three candidates each (default: as many as sessions).
    #[arg(long)]
    pub groups: Option<usize>,
    /// LeaseKeepAlive streams the sessions are spread over (one gRPC connection each).
    #[arg(long, default_value_t = 4)]
    pub streams: usize,
    /// How long to hold the load once everything is registered.
    #[arg(long, default_value = "60s")]
    pub duration: String,
    /// TTL of each session's lease.
    #[arg(long, default_value = "15s")]
    pub ttl: String,
    /// How often to print the figures so far.
    #[arg(long, default_value = "10s")]
    pub report_every: String,
    /// Pause between two sweeps over every group's leader.
    #[arg(long, default_value = "1s")]
    pub sweep_pause: String,
}

/// Keepalive figures shared by the streams.
struct Tally {
    interval_us: Histogram<u64>,
    total_us: Histogram<u64>,
    /// Answers with TTL 0: the lease was not found (expired or revoked).
    refused: u64,
    /// Keepalives sent on a stream that broke before answering them.
    unanswered: u64,
    /// Streams that broke or could not be opened.
    stream_errors: u64,
    /// Longest time between two answers on one stream, and when it ended.
    gap_max: Duration,
    gap_end_unix_ms: u64,
}

impl Tally {
    fn new() -> Tally {
        let histogram = || {
            Histogram::new_with_bounds(1, LATENCY_MAX_US, 3)
                .expect("constant histogram bounds are valid")
        };
        Tally {
            interval_us: histogram(),
            total_us: histogram(),
            refused: 0,
            unanswered: 0,
            stream_errors: 0,
            gap_max: Duration::ZERO,
            gap_end_unix_ms: 0,
        }
    }
}

/// One pass over every group's leader.
#[derive(Clone, Debug)]
struct Sweep {
    start_unix_ms: u64,
    end_unix_ms: u64,
    /// Groups that answered with no leader.
    leaderless: usize,
    /// Groups whose Leader call failed (no answer is not a leader).
    failed: usize,
    /// Groups whose leadership (fence) differs from the first complete sweep's.
    changed: usize,
}

impl Sweep {
    fn to_json(&self) -> Value {
        json!({
            "start_unix_ms": self.start_unix_ms, "end_unix_ms": self.end_unix_ms,
            "leaderless": self.leaderless, "failed": self.failed, "changed": self.changed,
        })
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

fn micros(elapsed: Duration) -> u64 {
    u64::try_from(elapsed.as_micros())
        .unwrap_or(LATENCY_MAX_US)
        .clamp(1, LATENCY_MAX_US)
}

fn status_failure(what: &str, status: &tonic::Status) -> Failure {
    Failure::new(
        "unavailable",
        format!("{what}: {}", status.message().trim_end_matches('.')),
    )
}

/// Runs `work(i)` for every i in 0..count with at most `SETUP_IN_FLIGHT` at once; the first
/// error ends the run.
async fn for_each_bounded<F, Fut, T>(count: usize, work: F) -> CmdResult<Vec<T>>
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = CmdResult<T>> + Send,
    T: Send + 'static,
{
    let work = Arc::new(work);
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::with_capacity(SETUP_IN_FLIGHT);
    for _ in 0..SETUP_IN_FLIGHT.min(count.max(1)) {
        let work = work.clone();
        let next = next.clone();
        tasks.push(tokio::spawn(async move {
            let mut done = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                if i >= count {
                    return Ok::<_, Failure>(done);
                }
                done.push((i, work(i).await?));
            }
        }));
    }
    let mut results: Vec<Option<T>> = (0..count).map(|_| None).collect();
    for task in tasks {
        let done = task
            .await
            .map_err(|e| Failure::io(format!("worker task failed: {e}")))??;
        for (i, value) in done {
            results[i] = Some(value);
        }
    }
    Ok(results.into_iter().flatten().collect())
}

pub async fn run(ctx: &Ctx, args: ScaleArgs) -> CmdResult {
    let sessions = args.sessions;
    let groups = args.groups.unwrap_or(sessions);
    if !(CANDIDATES_PER_GROUP..=SCALE_SESSIONS_MAX).contains(&sessions) {
        return Err(Failure::invalid(format!(
            "--sessions must be between {CANDIDATES_PER_GROUP} and {SCALE_SESSIONS_MAX}"
        )));
    }
    if groups > SCALE_GROUPS_MAX {
        return Err(Failure::invalid(format!(
            "--groups must be at most {SCALE_GROUPS_MAX}"
        )));
    }
    if args.streams == 0 || args.streams > SCALE_STREAMS_MAX || args.streams > sessions {
        return Err(Failure::invalid(format!(
            "--streams must be between 1 and {SCALE_STREAMS_MAX}, and at most --sessions"
        )));
    }
    let duration = parse_duration(&args.duration, "--duration")?;
    if duration.is_zero() || duration > SCALE_DURATION_MAX {
        return Err(Failure::invalid(format!(
            "--duration must be above 0 and at most {} s",
            SCALE_DURATION_MAX.as_secs()
        )));
    }
    let ttl = parse_duration(&args.ttl, "--ttl")?;
    if ttl < SCALE_TTL_MIN {
        return Err(Failure::invalid(format!(
            "--ttl must be at least {} s",
            SCALE_TTL_MIN.as_secs()
        )));
    }
    let report_every = parse_duration(&args.report_every, "--report-every")?;
    if report_every.is_zero() {
        return Err(Failure::invalid("--report-every must be above 0"));
    }
    let sweep_pause = parse_duration(&args.sweep_pause, "--sweep-pause")?;
    let endpoints = ctx.endpoints();
    if endpoints.is_empty() {
        return Err(Failure::invalid("--endpoints lists no endpoint"));
    }
    let channel = |i: usize| -> CmdResult<Channel> {
        Ok(
            conclave_client::endpoint(&endpoints[i % endpoints.len()], ctx.tls.as_ref())?
                .connect_timeout(ctx.timeout)
                .tcp_nodelay(true)
                .connect_lazy(),
        )
    };
    // Setup traffic goes to every member alike; followers forward writes to the leader.
    let setup: Vec<Channel> = (0..endpoints.len())
        .map(channel)
        .collect::<CmdResult<_>>()?;
    let timeout = ctx.timeout;
    let started = Instant::now();

    // 1. Sessions.
    let ttl_s = i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX);
    let lease_ids: Arc<Vec<i64>> = Arc::new({
        let setup = setup.clone();
        for_each_bounded(sessions, move |i| {
            let setup = setup.clone();
            async move {
                // A member that does not answer (not up yet, or killed) is skipped for the next.
                let mut last = None;
                for attempt in 0..setup.len() {
                    let mut lease = LeaseClient::new(setup[(i + attempt) % setup.len()].clone());
                    let mut request = tonic::Request::new(LeaseGrantRequest { ttl: ttl_s, id: 0 });
                    request.set_timeout(timeout);
                    match lease.lease_grant(request).await {
                        Ok(answer) => {
                            let answer = answer.into_inner();
                            if answer.id == 0 || !answer.error.is_empty() {
                                return Err(Failure::new(
                                    "unavailable",
                                    format!("granting a session's lease: {}", answer.error),
                                ));
                            }
                            return Ok(answer.id);
                        }
                        Err(status) => last = Some(status),
                    }
                }
                Err(status_failure(
                    "granting a session's lease",
                    &last.unwrap_or_else(|| tonic::Status::unavailable("no member")),
                ))
            }
        })
        .await?
    });
    let granted_s = started.elapsed().as_secs_f64();
    ctx.out.note(&format!(
        "{sessions} sessions granted in {granted_s:.1} s; keeping them alive over {} streams",
        args.streams
    ));

    // 2. Keepalive streams, started before the candidates so no lease lapses during setup.
    let tally = Arc::new(Mutex::new(Tally::new()));
    let answered = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut streams = Vec::with_capacity(args.streams);
    for s in 0..args.streams {
        let mine: Vec<i64> = lease_ids
            .iter()
            .copied()
            .skip(s)
            .step_by(args.streams)
            .collect();
        let channels: Vec<Channel> = (0..endpoints.len())
            .map(|e| channel(s + e))
            .collect::<CmdResult<_>>()?;
        streams.push(tokio::spawn(keep_alive(
            mine,
            channels,
            tally.clone(),
            answered.clone(),
            stop.clone(),
        )));
    }

    // 3. Candidates: group g on sessions g, g+1, g+2 with priorities 3, 2, 1, without waiting.
    let run_id = std::process::id();
    let group_name = move |g: usize| format!("bench-scale-{run_id}/g{g}");
    {
        let setup = setup.clone();
        let lease_ids = lease_ids.clone();
        for_each_bounded(groups * CANDIDATES_PER_GROUP, move |i| {
            let (g, c) = (i / CANDIDATES_PER_GROUP, i % CANDIDATES_PER_GROUP);
            let setup = setup.clone();
            let request = CampaignRequest {
                group: group_name(g),
                candidate_id: format!("c{c}"),
                priority: (CANDIDATES_PER_GROUP - c) as i64,
                value: Vec::new().into(),
                lease: lease_ids[(g + c) % lease_ids.len()],
                preempt: false,
                wait: false,
            };
            async move {
                // Campaign is idempotent for one candidate id, so a retry on the next member
                // cannot register twice.
                let mut last = None;
                for attempt in 0..setup.len() {
                    let channel = setup[(i + attempt) % setup.len()].clone();
                    let mut call = tonic::Request::new(request.clone());
                    call.set_timeout(timeout);
                    match ElectionClient::new(channel).campaign(call).await {
                        Ok(_) => return Ok(()),
                        // A refusal (the lease is gone) is the answer, not a member's outage.
                        Err(status)
                            if status.code() != tonic::Code::Unavailable
                                && status.code() != tonic::Code::DeadlineExceeded
                                && status.code() != tonic::Code::Unknown =>
                        {
                            return Err(status_failure("registering a candidate", &status));
                        }
                        Err(status) => last = Some(status),
                    }
                }
                Err(status_failure(
                    "registering a candidate",
                    &last.unwrap_or_else(|| tonic::Status::unavailable("no member")),
                ))
            }
        })
        .await?;
    }
    let registered_s = started.elapsed().as_secs_f64();
    ctx.out.note(&format!(
        "{groups} groups x {CANDIDATES_PER_GROUP} candidates registered in {:.1} s; holding for {duration:?}",
        registered_s - granted_s
    ));

    // 4. Sweeps over every group's leader, until the hold ends.
    let sweeps = Arc::new(Mutex::new(Vec::<Sweep>::new()));
    let sweeper = tokio::spawn(sweep_loop(
        setup.clone(),
        groups,
        run_id,
        timeout,
        sweep_pause,
        sweeps.clone(),
        stop.clone(),
    ));

    // 5. Hold, reporting as we go.
    let hold_start = Instant::now();
    let hold_end = hold_start + duration;
    let mut last_report = hold_start;
    let mut last_answered = answered.load(Ordering::Relaxed);
    {
        // Answers during setup are not part of the held rate.
        let mut t = tally.lock().expect("tally lock");
        t.interval_us.reset();
        t.total_us.reset();
    }
    loop {
        let now = Instant::now();
        if now >= hold_end {
            break;
        }
        tokio::time::sleep((last_report + report_every).min(hold_end) - now).await;
        let now = Instant::now();
        let count = answered.load(Ordering::Relaxed);
        let report = interval_report(
            &tally,
            &sweeps,
            count - last_answered,
            now - last_report,
            hold_start.elapsed(),
        );
        last_answered = count;
        last_report = now;
        print_report(ctx, &report);
    }
    let held = hold_start.elapsed();
    stop.store(true, Ordering::Relaxed);
    for stream in streams {
        let _ = stream.await;
    }
    let _ = sweeper.await;

    // 6. The final figures.
    let all_sweeps = sweeps.lock().expect("sweeps lock").clone();
    let summary = {
        let t = tally.lock().expect("tally lock");
        let ms = |q: f64| t.total_us.value_at_quantile(q) as f64 / 1000.0;
        let last = all_sweeps.last();
        json!({
            "op": "scale", "sessions": sessions, "groups": groups, "streams": args.streams,
            "ttl_s": ttl.as_secs_f64(),
            "setup_s": {"grant": granted_s, "register": registered_s - granted_s},
            "held_s": held.as_secs_f64(),
            "keepalives": t.total_us.len(),
            "keepalives_per_s": t.total_us.len() as f64 / held.as_secs_f64(),
            "keepalive_ms": {"p50": ms(0.5), "p99": ms(0.99), "p99_9": ms(0.999),
                              "max": t.total_us.max() as f64 / 1000.0},
            "refused": t.refused, "unanswered": t.unanswered, "stream_errors": t.stream_errors,
            "keepalive_gap_max_ms": t.gap_max.as_secs_f64() * 1000.0,
            "keepalive_gap_end_unix_ms": t.gap_end_unix_ms,
            "leaderless": last.map(|s| s.leaderless), "leader_failed": last.map(|s| s.failed),
            "leaders_changed": last.map(|s| s.changed),
            "sweeps": all_sweeps.iter().map(Sweep::to_json).collect::<Vec<_>>(),
        })
    };

    // 7. Clean up: revoking the sessions removes every candidate with them.
    {
        let setup = setup.clone();
        let lease_ids = lease_ids.clone();
        let revoked = for_each_bounded(sessions, move |i| {
            let setup = setup.clone();
            let id = lease_ids[i];
            async move {
                for attempt in 0..setup.len() {
                    let mut lease = LeaseClient::new(setup[(i + attempt) % setup.len()].clone());
                    let mut request = tonic::Request::new(LeaseRevokeRequest { id });
                    request.set_timeout(timeout);
                    if lease.lease_revoke(request).await.is_ok() {
                        return Ok(true);
                    }
                }
                Ok(false)
            }
        })
        .await?;
        let failed = revoked.iter().filter(|ok| !**ok).count();
        if failed > 0 {
            ctx.out.note(&format!(
                "{failed} sessions could not be revoked; they expire after their TTL"
            ));
        }
    }

    ctx.out.ok(summary.clone(), || {
        let f = |k: &str| summary[k].to_string();
        let l = |k: &str| format!("{:.2}", summary["keepalive_ms"][k].as_f64().unwrap_or(0.0));
        ctx.out.table(
            &[
                "SESSIONS",
                "GROUPS",
                "HELD S",
                "KEEPALIVES/S",
                "P50 MS",
                "P99 MS",
                "REFUSED",
                "UNANSWERED",
                "LONGEST GAP MS",
                "LEADERLESS",
                "LEADERS CHANGED",
            ],
            &[vec![
                f("sessions"),
                f("groups"),
                format!("{:.0}", held.as_secs_f64()),
                format!("{:.0}", summary["keepalives_per_s"].as_f64().unwrap_or(0.0)),
                l("p50"),
                l("p99"),
                f("refused"),
                f("unanswered"),
                format!(
                    "{:.0}",
                    summary["keepalive_gap_max_ms"].as_f64().unwrap_or(0.0)
                ),
                f("leaderless"),
                f("leaders_changed"),
            ]],
        )
    });
    let t = tally.lock().expect("tally lock");
    if t.total_us.is_empty() {
        return Err(Failure::new(
            "unavailable",
            "no keepalive was answered during the hold",
        ));
    }
    Ok(0)
}

fn interval_report(
    tally: &Mutex<Tally>,
    sweeps: &Mutex<Vec<Sweep>>,
    answered: u64,
    interval: Duration,
    at: Duration,
) -> Value {
    let mut t = tally.lock().expect("tally lock");
    let ms = |q: f64| t.interval_us.value_at_quantile(q) as f64 / 1000.0;
    let last = sweeps.lock().expect("sweeps lock").last().cloned();
    let report = json!({
        "at_s": at.as_secs_f64(),
        "keepalives_per_s": answered as f64 / interval.as_secs_f64().max(1e-9),
        "keepalive_ms": {"p50": ms(0.5), "p99": ms(0.99)},
        "refused": t.refused, "unanswered": t.unanswered, "stream_errors": t.stream_errors,
        "leaderless": last.as_ref().map(|s| s.leaderless),
        "leader_failed": last.as_ref().map(|s| s.failed),
        "leaders_changed": last.as_ref().map(|s| s.changed),
    });
    t.interval_us.reset();
    report
}

fn print_report(ctx: &Ctx, report: &Value) {
    if ctx.out.json {
        println!("{}", json!({"status": "progress", "data": report}));
    } else {
        let opt = |k: &str| match report[k].as_u64() {
            Some(v) => v.to_string(),
            None => "-".into(),
        };
        eprintln!(
            "{:>6.0} s  {:>7.0} keepalives/s  p50 {:.2} ms  p99 {:.2} ms  refused {}  unanswered {}  leaderless {}  leader errors {}  changed {}",
            report["at_s"].as_f64().unwrap_or(0.0),
            report["keepalives_per_s"].as_f64().unwrap_or(0.0),
            report["keepalive_ms"]["p50"].as_f64().unwrap_or(0.0),
            report["keepalive_ms"]["p99"].as_f64().unwrap_or(0.0),
            opt("refused"),
            opt("unanswered"),
            opt("leaderless"),
            opt("leader_failed"),
            opt("leaders_changed"),
        );
    }
}

/// One LeaseKeepAlive stream renewing `leases` every `KEEPALIVE_EVERY`, reopened on the next
/// member when it breaks.
async fn keep_alive(
    leases: Vec<i64>,
    channels: Vec<Channel>,
    tally: Arc<Mutex<Tally>>,
    answered: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
) {
    let slice_every = KEEPALIVE_EVERY / KEEPALIVE_SLICES as u32;
    let mut attempt = 0usize;
    let mut last_answer = Instant::now();
    let mut slice = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let mut client = LeaseClient::new(channels[attempt % channels.len()].clone());
        attempt += 1;
        let (sender, receiver) = mpsc::channel(STREAM_QUEUE);
        let mut answers = match client.lease_keep_alive(ReceiverStream::new(receiver)).await {
            Ok(answers) => answers.into_inner(),
            Err(_) => {
                tally.lock().expect("tally lock").stream_errors += 1;
                tokio::time::sleep(RECONNECT_PAUSE).await;
                continue;
            }
        };
        let mut pending: HashMap<i64, Instant> = HashMap::with_capacity(leases.len());
        let mut ticker = tokio::time::interval(slice_every);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            tokio::select! {
                _ = ticker.tick() => {
                    let now = Instant::now();
                    for (i, id) in leases.iter().enumerate() {
                        if i as u64 % KEEPALIVE_SLICES != slice {
                            continue;
                        }
                        // One renewal of a lease in flight at a time: a slow answer is late,
                        // not doubled.
                        if pending.contains_key(id) {
                            continue;
                        }
                        if sender.try_send(LeaseKeepAliveRequest { id: *id }).is_ok() {
                            pending.insert(*id, now);
                        }
                    }
                    slice = (slice + 1) % KEEPALIVE_SLICES;
                }
                message = answers.message() => match message {
                    Ok(Some(answer)) => {
                        let now = Instant::now();
                        let gap = now - last_answer;
                        last_answer = now;
                        let mut t = tally.lock().expect("tally lock");
                        if let Some(sent) = pending.remove(&answer.id) {
                            let us = micros(now - sent);
                            t.interval_us.saturating_record(us);
                            t.total_us.saturating_record(us);
                            answered.fetch_add(1, Ordering::Relaxed);
                        }
                        if answer.ttl <= 0 {
                            t.refused += 1;
                        }
                        if gap > t.gap_max {
                            t.gap_max = gap;
                            t.gap_end_unix_ms = unix_ms();
                        }
                    }
                    Ok(None) | Err(_) => {
                        {
                            let mut t = tally.lock().expect("tally lock");
                            t.stream_errors += 1;
                            t.unanswered += pending.len() as u64;
                        }
                        tokio::time::sleep(RECONNECT_PAUSE).await;
                        break;
                    }
                }
            }
        }
    }
}

/// Sweeps every group's leader until `stop`, recording each sweep.
async fn sweep_loop(
    channels: Vec<Channel>,
    groups: usize,
    run_id: u32,
    timeout: Duration,
    pause: Duration,
    sweeps: Arc<Mutex<Vec<Sweep>>>,
    stop: Arc<AtomicBool>,
) {
    let mut baseline: Option<Arc<Vec<u64>>> = None;
    while !stop.load(Ordering::Relaxed) {
        let start_unix_ms = unix_ms();
        let channels = channels.clone();
        // Each answer: Some(fence, 0 when leaderless) or None when the call failed.
        let answers = for_each_bounded(groups, move |g| {
            let channels = channels.clone();
            async move {
                // Members that do not answer (a killed one) are skipped for the next.
                for attempt in 0..channels.len() {
                    let channel = channels[(g + attempt) % channels.len()].clone();
                    let mut request = tonic::Request::new(LeaderRequest {
                        group: format!("bench-scale-{run_id}/g{g}"),
                    });
                    request.set_timeout(timeout);
                    if let Ok(answer) = ElectionClient::new(channel).leader(request).await {
                        let fence = answer.into_inner().leadership.map(|l| l.fence);
                        return Ok(Some(fence.unwrap_or(0)));
                    }
                }
                Ok(None)
            }
        })
        .await
        .unwrap_or_default();
        let failed = answers.iter().filter(|a| a.is_none()).count();
        let leaderless = answers.iter().filter(|a| **a == Some(0)).count();
        let fences: Vec<u64> = answers.iter().map(|a| a.unwrap_or(0)).collect();
        if baseline.is_none() && failed == 0 && fences.len() == groups {
            baseline = Some(Arc::new(fences.clone()));
        }
        let changed = match &baseline {
            Some(base) => answers
                .iter()
                .zip(base.iter())
                .filter(|(now, then)| matches!(now, Some(f) if f != *then))
                .count(),
            None => 0,
        };
        sweeps.lock().expect("sweeps lock").push(Sweep {
            start_unix_ms,
            end_unix_ms: unix_ms(),
            leaderless,
            failed,
            changed,
        });
        let resume = Instant::now() + pause;
        while Instant::now() < resume && !stop.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_millis(100).min(pause)).await;
        }
    }
}
