//! `bench put|get|txn|lock|publish|queue|elect`: a load generator. `put`, `get` and `txn` use
//! the plain etcd v3 KV API (raw gRPC) and `lock` etcd's v3lock API, so those runs can be
//! pointed at etcd for a side-by-side comparison; `publish` and `queue` load Conclave's topics
//! and work queues; `elect` measures Conclave's failover time. With `--spread` the clients'
//! connections go to every endpoint in turn, as etcd's clients spread theirs, so writes also
//! take the path through a follower.

use std::io::{IsTerminal, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::{Args, Subcommand};
use conclave_client::{CampaignOptions, Client, LockOptions};
use conclave_proto::conclave::v1 as cv1;
use conclave_proto::conclave::v1::queue_client::QueueClient;
use conclave_proto::conclave::v1::topic_client::TopicClient;
use conclave_proto::etcdserverpb::compare::{CompareResult, CompareTarget, TargetUnion};
use conclave_proto::etcdserverpb::kv_client::KvClient;
use conclave_proto::etcdserverpb::request_op::Request as RequestOpKind;
use conclave_proto::etcdserverpb::{Compare, PutRequest, RangeRequest, RequestOp, TxnRequest};
use hdrhistogram::Histogram;
use serde_json::json;
use tonic::transport::Channel;

use super::{CmdResult, Ctx, Failure, parse_duration};

/// Most concurrent clients one bench run starts.
pub const BENCH_CLIENTS_MAX: usize = 10_000;
/// Largest value `--value-size` accepts (etcd's default request limit is 1.5 MiB).
pub const BENCH_VALUE_BYTES_MAX: usize = 1024 * 1024;
/// Clients share this many gRPC connections at most (HTTP/2 multiplexes the rest).
const BENCH_CONNECTIONS_MAX: usize = 16;
/// Latencies above this are clamped into the histogram's top bucket.
const LATENCY_MAX_US: u64 = 60_000_000;
/// TTL of each `bench lock` client's lease.
const LOCK_LEASE_TTL: Duration = Duration::from_secs(10);
/// How often `bench elect` checks that the next candidate registered.
const POLL_CANDIDATES: Duration = Duration::from_millis(20);
/// How often the progress bar redraws.
const PROGRESS_EVERY: Duration = Duration::from_millis(200);

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Puts of --value-size bytes over --key-space keys.
    Put(BenchArgs),
    /// Linearizable (or --serializable) gets of keys written first.
    Get(BenchArgs),
    /// Transactions: compare a key's mod revision, then put it.
    Txn(BenchArgs),
    /// Lock and unlock (etcd v3lock) over --key-space lock names.
    Lock(BenchArgs),
    /// Topic publishes of --value-size bytes over --key-space topics.
    Publish(BenchArgs),
    /// Work-queue rounds, each a push of --value-size bytes, a claim and an ack, on a queue
    /// of the client's own.
    Queue(BenchArgs),
    /// Failover time: kill a leader's session, time the next candidate's election.
    Elect(ElectBenchArgs),
    /// Scale run: N sessions kept alive once a second and N election groups of 3 candidates,
    /// held for --duration, with keepalive rate and latency and leaderless groups reported.
    Scale(super::bench_scale::ScaleArgs),
}

#[derive(Args, Debug)]
pub struct ElectBenchArgs {
    /// Leader changes to measure.
    #[arg(long, default_value_t = 5)]
    pub rounds: u32,
    /// TTL of each candidate's lease (the failover time is at most about this).
    #[arg(long, default_value = "2s")]
    pub ttl: String,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Concurrent clients, each with one request in flight.
    #[arg(long, default_value_t = 16)]
    pub clients: usize,
    /// How long to run.
    #[arg(long, default_value = "10s")]
    pub duration: String,
    /// Bytes per value.
    #[arg(long, default_value_t = 256)]
    pub value_size: usize,
    /// Distinct keys used (`bench/0` .. `bench/N-1`).
    #[arg(long, default_value_t = 1000)]
    pub key_space: u64,
    /// gets only: serve reads from the answering member without a leader round trip.
    #[arg(long)]
    pub serializable: bool,
    /// Open the connections to every endpoint of --endpoints in turn, not only to the leader
    /// the client library finds: writes sent to a follower then go through it to the leader.
    #[arg(long)]
    pub spread: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Put,
    Get,
    Txn,
    Lock,
    Publish,
    Queue,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Put => "put",
            Kind::Get => "get",
            Kind::Txn => "txn",
            Kind::Lock => "lock",
            Kind::Publish => "publish",
            Kind::Queue => "queue",
        }
    }
}

fn key(i: u64) -> Vec<u8> {
    format!("bench/{i}").into_bytes()
}

pub async fn run(ctx: &Ctx, command: BenchCommand) -> CmdResult {
    let (kind, args) = match command {
        BenchCommand::Put(args) => (Kind::Put, args),
        BenchCommand::Get(args) => (Kind::Get, args),
        BenchCommand::Txn(args) => (Kind::Txn, args),
        BenchCommand::Lock(args) => (Kind::Lock, args),
        BenchCommand::Publish(args) => (Kind::Publish, args),
        BenchCommand::Queue(args) => (Kind::Queue, args),
        BenchCommand::Elect(args) => return elect(ctx, args).await,
        BenchCommand::Scale(args) => return super::bench_scale::run(ctx, args).await,
    };
    if args.clients == 0 || args.clients > BENCH_CLIENTS_MAX {
        return Err(Failure::invalid(format!(
            "--clients must be between 1 and {BENCH_CLIENTS_MAX}"
        )));
    }
    if args.value_size > BENCH_VALUE_BYTES_MAX {
        return Err(Failure::new(
            "too_large",
            format!("--value-size is over {BENCH_VALUE_BYTES_MAX} bytes"),
        ));
    }
    if args.key_space == 0 {
        return Err(Failure::invalid("--key-space must be at least 1"));
    }
    let duration = parse_duration(&args.duration, "--duration")?;
    // The client library finds the Raft leader (Status + MemberList, which etcd serves too).
    let cluster = ctx.connect().await?;
    let target = cluster.current_endpoint().await?;
    let targets = if args.spread {
        cluster.endpoints().to_vec()
    } else {
        vec![target.clone()]
    };
    let connections: Vec<Channel> = (0..args.clients.min(BENCH_CONNECTIONS_MAX))
        .map(|n| {
            conclave_client::endpoint(&targets[n % targets.len()], ctx.tls.as_ref())
                .map(|e| e.connect_timeout(ctx.timeout).connect_lazy())
                .map_err(Failure::from)
        })
        .collect::<CmdResult<_>>()?;
    let value = vec![b'x'; args.value_size];
    if kind == Kind::Get {
        // Reads need something to read: write the key space once.
        let mut kv = KvClient::new(connections[0].clone());
        for i in 0..args.key_space {
            kv.put(PutRequest {
                key: key(i).into(),
                value: value.clone().into(),
                ..Default::default()
            })
            .await
            .map_err(|s| {
                Failure::from(conclave_client::Error::from_status(&s, Default::default()))
            })?;
        }
    }
    let done = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let stop_at = start + duration;
    let workers: Vec<_> = (0..args.clients)
        .map(|client| {
            let channel = connections[client % connections.len()].clone();
            let mut kv = KvClient::new(channel.clone());
            let mut topics = TopicClient::new(channel.clone());
            let mut queues = QueueClient::new(channel);
            let value = value.clone();
            let done = done.clone();
            let failed = failed.clone();
            let key_space = args.key_space;
            let serializable = args.serializable;
            let timeout = ctx.timeout;
            let cluster = cluster.clone();
            tokio::spawn(async move {
                // Locks: one lease per client, kept alive by the library, for every round.
                let lease = match kind {
                    Kind::Lock => match cluster.lease_grant_kept(LOCK_LEASE_TTL).await {
                        Ok(keeper) => Some(keeper),
                        Err(_) => return None,
                    },
                    _ => None,
                };
                let mutex = cluster.mutex();
                let mut histogram = Histogram::<u64>::new_with_bounds(1, LATENCY_MAX_US, 3).ok();
                let mut i = client as u64;
                while Instant::now() < stop_at {
                    let sent = Instant::now();
                    let k = key(i % key_space);
                    i = i.wrapping_add(7919);
                    let ok = match kind {
                        Kind::Put => {
                            let mut request = tonic::Request::new(PutRequest {
                                key: k.into(),
                                value: value.clone().into(),
                                ..Default::default()
                            });
                            request.set_timeout(timeout);
                            kv.put(request).await.is_ok()
                        }
                        Kind::Get => {
                            let mut request = tonic::Request::new(RangeRequest {
                                key: k.into(),
                                serializable,
                                ..Default::default()
                            });
                            request.set_timeout(timeout);
                            kv.range(request).await.is_ok()
                        }
                        Kind::Txn => {
                            // etcd's own txn benchmark shape: a compare that always holds.
                            let mut request = tonic::Request::new(TxnRequest {
                                compare: vec![Compare {
                                    result: CompareResult::Greater as i32,
                                    target: CompareTarget::Mod as i32,
                                    key: k.clone().into(),
                                    target_union: Some(TargetUnion::ModRevision(-1)),
                                    range_end: Default::default(),
                                }],
                                success: vec![RequestOp {
                                    request: Some(RequestOpKind::RequestPut(PutRequest {
                                        key: k.into(),
                                        value: value.clone().into(),
                                        ..Default::default()
                                    })),
                                }],
                                failure: vec![],
                            });
                            request.set_timeout(timeout);
                            kv.txn(request).await.is_ok()
                        }
                        Kind::Publish => {
                            let mut request = tonic::Request::new(cv1::PublishRequest {
                                topic: format!("bench/{}", i % key_space),
                                data: value.clone().into(),
                                from: String::new(),
                            });
                            request.set_timeout(timeout);
                            topics.publish(request).await.is_ok()
                        }
                        Kind::Queue => queue_round(&mut queues, client, &value, timeout).await,
                        Kind::Lock => {
                            let name = format!("bench-lock/{}", i % key_space);
                            let options = LockOptions {
                                lease: lease.as_ref().map(|l| l.id()),
                                timeout: Some(timeout),
                                ..LockOptions::default()
                            };
                            match mutex.lock(&name, options).await {
                                Ok(guard) => guard.unlock().await.is_ok(),
                                Err(_) => false,
                            }
                        }
                    };
                    if ok {
                        let micros = u64::try_from(sent.elapsed().as_micros())
                            .unwrap_or(LATENCY_MAX_US)
                            .clamp(1, LATENCY_MAX_US);
                        if let Some(h) = histogram.as_mut() {
                            let _ = h.record(micros);
                        }
                        done.fetch_add(1, Ordering::Relaxed);
                    } else {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
                histogram
            })
        })
        .collect();
    let progress = !ctx.out.json && std::io::stderr().is_terminal();
    let bar = {
        let done = done.clone();
        tokio::spawn(async move {
            if !progress {
                return;
            }
            loop {
                tokio::time::sleep(PROGRESS_EVERY).await;
                let elapsed = start.elapsed().min(duration);
                let fraction = elapsed.as_secs_f64() / duration.as_secs_f64();
                let filled = (fraction * 30.0) as usize;
                let mut stderr = std::io::stderr().lock();
                let _ = write!(
                    stderr,
                    "\r[{}{}] {:>5.1}s {} ops",
                    "#".repeat(filled),
                    " ".repeat(30usize.saturating_sub(filled)),
                    elapsed.as_secs_f64(),
                    done.load(Ordering::Relaxed)
                );
                let _ = stderr.flush();
                if elapsed >= duration {
                    return;
                }
            }
        })
    };
    let mut total = Histogram::<u64>::new_with_bounds(1, LATENCY_MAX_US, 3)
        .map_err(|e| Failure::io(format!("histogram: {e}")))?;
    for worker in workers {
        if let Ok(Some(h)) = worker.await {
            let _ = total.add(&h);
        }
    }
    let elapsed = start.elapsed();
    bar.abort();
    if progress {
        eprintln!();
    }
    let ops = done.load(Ordering::Relaxed);
    let errors = failed.load(Ordering::Relaxed);
    let rate = ops as f64 / elapsed.as_secs_f64();
    let ms = |q: f64| total.value_at_quantile(q) as f64 / 1000.0;
    let latency = json!({
        "p50": ms(0.5), "p90": ms(0.9), "p99": ms(0.99), "p99_9": ms(0.999),
        "max": total.max() as f64 / 1000.0,
    });
    let op = kind.name();
    ctx.out.ok(
        json!({
            "op": op, "endpoint": target, "endpoints": targets, "clients": args.clients,
            "duration_s": elapsed.as_secs_f64(), "value_size": args.value_size,
            "ops": ops, "errors": errors, "ops_per_s": rate, "latency_ms": latency,
        }),
        || {
            let rows = vec![vec![
                op.to_string(),
                args.clients.to_string(),
                ops.to_string(),
                errors.to_string(),
                format!("{rate:.0}"),
                format!("{:.2}", ms(0.5)),
                format!("{:.2}", ms(0.9)),
                format!("{:.2}", ms(0.99)),
                format!("{:.2}", ms(0.999)),
                format!("{:.2}", total.max() as f64 / 1000.0),
            ]];
            ctx.out.table(
                &[
                    "OP", "CLIENTS", "OPS", "ERRORS", "OPS/S", "P50 MS", "P90 MS", "P99 MS",
                    "P99.9 MS", "MAX MS",
                ],
                &rows,
            )
        },
    );
    if ops == 0 && errors > 0 {
        return Err(Failure::new(
            "unavailable",
            format!("every one of {errors} requests failed"),
        ));
    }
    Ok(0)
}

/// One `bench queue` round on the client's own queue: push a job, claim it, ack it. True when
/// all three succeeded and the claim returned a job.
async fn queue_round(
    queues: &mut QueueClient<Channel>,
    client: usize,
    payload: &[u8],
    timeout: Duration,
) -> bool {
    let queue = format!("bench-queue/{client}");
    let mut push = tonic::Request::new(cv1::QueuePushRequest {
        queue: queue.clone(),
        payload: payload.to_vec().into(),
        ..Default::default()
    });
    push.set_timeout(timeout);
    if queues.push(push).await.is_err() {
        return false;
    }
    let mut claim = tonic::Request::new(cv1::QueueClaimRequest {
        queue: queue.clone(),
        worker: format!("bench-{client}"),
        ..Default::default()
    });
    claim.set_timeout(timeout);
    let Some(job) = queues
        .claim(claim)
        .await
        .ok()
        .and_then(|c| c.into_inner().job)
    else {
        return false;
    };
    let mut ack = tonic::Request::new(cv1::QueueAckRequest {
        queue,
        job_id: job.id,
        fence: job.fence,
    });
    ack.set_timeout(timeout);
    queues.ack(ack).await.is_ok()
}

/// Percentiles of `values` (sorted here), in milliseconds.
fn percentiles_ms(values: &mut [Duration]) -> serde_json::Value {
    values.sort();
    let at = |q: f64| {
        let index = ((values.len() as f64 * q).ceil() as usize).clamp(1, values.len().max(1)) - 1;
        values
            .get(index)
            .map(|d| d.as_secs_f64() * 1000.0)
            .unwrap_or(0.0)
    };
    json!({"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": at(1.0)})
}

/// `bench elect`: a leader in one group stops heartbeating (its session is killed, as by
/// kill -9); the time until the waiting candidate's campaign returns is one sample.
async fn elect(ctx: &Ctx, args: ElectBenchArgs) -> CmdResult {
    if args.rounds == 0 {
        return Err(Failure::invalid("--rounds must be at least 1"));
    }
    let ttl = parse_duration(&args.ttl, "--ttl")?;
    let client: Client = ctx.connect().await?;
    let group = format!("bench-elect-{}", std::process::id());
    let election = client.election();
    let options = CampaignOptions {
        ttl,
        ..CampaignOptions::default()
    };
    let mut leader = election
        .campaign(&group, "bench-0", 1, Vec::new(), options.clone())
        .await?;
    let mut samples = Vec::new();
    let mut fences = vec![leader.fence()];
    for round in 1..=args.rounds {
        let next = {
            let election = election.clone();
            let group = group.clone();
            let options = options.clone();
            tokio::spawn(async move {
                election
                    .campaign(&group, &format!("bench-{round}"), 1, Vec::new(), options)
                    .await
            })
        };
        // Let the candidate register before the leader goes.
        let registered = Instant::now();
        while election.candidates(&group).await?.len() < 2 {
            if registered.elapsed() > ctx.timeout {
                return Err(Failure::new(
                    "timeout",
                    "the next candidate did not register",
                ));
            }
            tokio::time::sleep(POLL_CANDIDATES).await;
        }
        let killed = Instant::now();
        leader.abandon();
        leader = next
            .await
            .map_err(|e| Failure::io(format!("campaign task failed: {e}")))??;
        samples.push(killed.elapsed());
        fences.push(leader.fence());
        ctx.out.note(&format!(
            "round {round}: {:?} to the next election (fence {})",
            killed.elapsed(),
            leader.fence()
        ));
    }
    let _ = leader.resign().await;
    let latency = percentiles_ms(&mut samples);
    ctx.out.ok(
        json!({"op": "elect", "rounds": args.rounds, "ttl_s": ttl.as_secs_f64(), "fences": fences, "failover_ms": latency}),
        || {
            let f = |k: &str| format!("{:.0}", latency[k].as_f64().unwrap_or(0.0));
            ctx.out.table(
                &["OP", "ROUNDS", "TTL", "P50 MS", "P90 MS", "P99 MS", "MAX MS"],
                &[vec![
                    "elect".into(),
                    args.rounds.to_string(),
                    format!("{ttl:?}"),
                    f("p50"),
                    f("p90"),
                    f("p99"),
                    f("max"),
                ]],
            )
        },
    );
    Ok(0)
}
