//! `bench put|get`: a load generator over the plain etcd v3 KV API (raw gRPC, no Conclave
//! extensions), so the same run can be pointed at etcd for a side-by-side comparison.

use std::io::{IsTerminal, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::{Args, Subcommand};
use conclave_proto::etcdserverpb::kv_client::KvClient;
use conclave_proto::etcdserverpb::{PutRequest, RangeRequest};
use hdrhistogram::Histogram;
use serde_json::json;
use tonic::transport::{Channel, Endpoint};

use super::{CmdResult, Ctx, Failure, parse_duration};

/// Most concurrent clients one bench run starts.
pub const BENCH_CLIENTS_MAX: usize = 10_000;
/// Largest value `--value-size` accepts (etcd's default request limit is 1.5 MiB).
pub const BENCH_VALUE_BYTES_MAX: usize = 1024 * 1024;
/// Clients share this many gRPC connections at most (HTTP/2 multiplexes the rest).
const BENCH_CONNECTIONS_MAX: usize = 16;
/// Latencies above this are clamped into the histogram's top bucket.
const LATENCY_MAX_US: u64 = 60_000_000;
/// How often the progress bar redraws.
const PROGRESS_EVERY: Duration = Duration::from_millis(200);

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Puts of --value-size bytes over --key-space keys.
    Put(BenchArgs),
    /// Linearizable (or --serializable) gets of keys written first.
    Get(BenchArgs),
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
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Put,
    Get,
}

fn key(i: u64) -> Vec<u8> {
    format!("bench/{i}").into_bytes()
}

pub async fn run(ctx: &Ctx, command: BenchCommand) -> CmdResult {
    let (kind, args) = match command {
        BenchCommand::Put(args) => (Kind::Put, args),
        BenchCommand::Get(args) => (Kind::Get, args),
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
    let target = ctx.connect().await?.current_endpoint().await?;
    let connections: Vec<Channel> = (0..args.clients.min(BENCH_CONNECTIONS_MAX))
        .map(|_| {
            Endpoint::from_shared(target.clone())
                .map(|e| e.connect_timeout(ctx.timeout).connect_lazy())
                .map_err(|e| Failure::invalid(format!("bad endpoint {target}: {e}")))
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
            let mut kv = KvClient::new(connections[client % connections.len()].clone());
            let value = value.clone();
            let done = done.clone();
            let failed = failed.clone();
            let key_space = args.key_space;
            let serializable = args.serializable;
            let timeout = ctx.timeout;
            tokio::spawn(async move {
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
    let op = if kind == Kind::Put { "put" } else { "get" };
    ctx.out.ok(
        json!({
            "op": op, "endpoint": target, "clients": args.clients,
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
