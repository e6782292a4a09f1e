//! `etcd-bench`: a load generator for any server of the etcd v3 gRPC API, etcd itself or
//! Conclave, so the two are measured by the same tool. It is deliberately not built on
//! Conclave's client: it speaks the wire API through tonic's generated stubs of etcd's own
//! `.proto` files (the `etcd-client` crate would do the same, but its build script needs
//! `protoc`, which this project's builds do without).
//!
//! Each of `--clients` clients keeps one request in flight for `--duration` and records every
//! latency in an HDR histogram; the output is ops/s and p50/p99/p99.9/max, as a table row or
//! (`--json`) one JSON object.
//!
//! The generator runs on the machine it measures, so its own CPU is taken from the members':
//! by default every client runs on one thread (`--threads`), and requests go straight to an
//! HTTP/2 connection (src/conn.rs) rather than through tonic's balancing channel.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use conclave_proto::etcdserverpb::compare::{CompareResult, CompareTarget, TargetUnion};
use conclave_proto::etcdserverpb::kv_client::KvClient;
use conclave_proto::etcdserverpb::lease_client::LeaseClient;
use conclave_proto::etcdserverpb::request_op::Request as RequestOpKind;
use conclave_proto::etcdserverpb::watch_client::WatchClient;
use conclave_proto::etcdserverpb::watch_request::RequestUnion;
use conclave_proto::etcdserverpb::{
    Compare, LeaseGrantRequest, LeaseKeepAliveRequest, PutRequest, RangeRequest, RequestOp,
    TxnRequest, WatchCreateRequest, WatchRequest,
};
use hdrhistogram::Histogram;
use serde_json::json;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

mod conn;
use conn::Conn;

/// Most concurrent clients (or watchers) one run starts.
const CLIENTS_MAX: usize = 10_000;
/// Most gRPC connections one run opens; HTTP/2 multiplexes the clients over them.
const CONNECTIONS_MAX: usize = 256;
/// Most `--threads`.
const THREADS_MAX: usize = 64;
/// Largest `--value-size` (etcd's default request limit is 1.5 MiB).
const VALUE_BYTES_MAX: usize = 1024 * 1024;
/// Longest `--duration`, so a typo cannot start an hour-long run.
const DURATION_MAX: Duration = Duration::from_secs(3600);
/// Latencies above this are clamped into the histogram's top bucket.
const LATENCY_MAX_US: u64 = 60_000_000;
/// TTL of the leases the keepalive op renews; far longer than any renewal gap.
const KEEPALIVE_LEASE_TTL_S: i64 = 60;
/// How long to wait for a connection or a watch's creation before giving up.
const SETUP_TIMEOUT: Duration = Duration::from_secs(10);
/// Most puts in one `fill` transaction: etcd's and Conclave's default `max-txn-ops`.
const FILL_BATCH_MAX: usize = 128;
/// Highest `--rate` of the watch writer, in puts per second.
const WATCH_RATE_MAX: u64 = 100_000;
/// How long watchers may still receive after the writer's last put, at most.
const WATCH_DRAIN_MAX: Duration = Duration::from_secs(30);
/// How often the drain checks whether every event has arrived.
const WATCH_DRAIN_POLL: Duration = Duration::from_millis(20);
/// Prefix of every key this tool writes.
const KEY_PREFIX: &str = "etcd-bench/";

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Op {
    /// Put of --value-size bytes to one of --key-space keys.
    Put,
    /// Linearizable get of one of --key-space keys (written first).
    Get,
    /// Serializable get (answered by the member asked, no leader round trip).
    GetSerializable,
    /// Compare-and-swap txn: if the client's own key has the mod revision last seen, put it.
    TxnCas,
    /// Lease keepalive round trips, one lease and one stream per client.
    LeaseKeepalive,
    /// Watch fan-out: --clients watchers on one prefix, one writer putting under it; the
    /// latency is from the put's send to each watcher's receipt, ops are delivered events.
    Watch,
    /// Bulk load: writes keys 0..--key-space once each, --batch puts per Txn, --clients
    /// transactions in flight; ends when every key is written (--duration is a cap). Ops are
    /// keys written; latencies are per transaction.
    Fill,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Put => "put",
            Op::Get => "get",
            Op::GetSerializable => "get-serializable",
            Op::TxnCas => "txn-cas",
            Op::LeaseKeepalive => "lease-keepalive",
            Op::Watch => "watch",
            Op::Fill => "fill",
        }
    }
}

#[derive(Parser, Debug)]
#[command(
    name = "etcd-bench",
    about = "Load generator for the etcd v3 gRPC API (etcd or Conclave)"
)]
struct Args {
    /// Comma-separated host:port list; connections are spread over them round-robin.
    #[arg(long, default_value = "127.0.0.1:2379")]
    endpoints: String,
    /// The operation to measure.
    #[arg(long, value_enum)]
    op: Op,
    /// Concurrent clients, each with one request in flight (watchers, for `watch`).
    #[arg(long, default_value_t = 16)]
    clients: usize,
    /// How long to measure, like `5s` or `500ms`.
    #[arg(long, default_value = "5s")]
    duration: String,
    /// Bytes per value written.
    #[arg(long, default_value_t = 256)]
    value_size: usize,
    /// Distinct keys used by put and get.
    #[arg(long, default_value_t = 1000)]
    key_space: u64,
    /// watch: the writer's puts per second (0: one put in flight, as fast as answered).
    #[arg(long, default_value_t = 0)]
    rate: u64,
    /// watch: each watcher watches a prefix of its own (`…/watch/<n>/`) and the writer's puts
    /// take the watchers' prefixes in turn, so each put reaches one watcher (thousands of
    /// agents each watching their own keys). Without it every watcher shares one prefix.
    #[arg(long)]
    watch_own_prefix: bool,
    /// fill: puts per transaction.
    #[arg(long, default_value_t = 100)]
    batch: usize,
    /// gRPC connections (default: one per client, at most 16).
    #[arg(long)]
    connections: Option<usize>,
    /// Threads running the clients. One thread (the default) spends the least CPU per
    /// request: the members measured share this machine's cores with the load generator, and
    /// more threads mostly add wake-ups between them.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// A name for the system measured, printed with the figures.
    #[arg(long, default_value = "")]
    label: String,
    /// Print one JSON object instead of a table row.
    #[arg(long)]
    json: bool,
    /// Print the table's header line first (ignored with --json).
    #[arg(long)]
    header: bool,
}

#[derive(Debug, thiserror::Error)]
enum BenchError {
    #[error("invalid argument: {0}")]
    Usage(String),
    #[error("cannot connect to {endpoint}: {reason}")]
    Connect { endpoint: String, reason: String },
    #[error("setup failed: {0}")]
    Setup(String),
}

/// What one client measured.
struct Tally {
    latencies_us: Histogram<u64>,
    errors: u64,
}

impl Tally {
    fn new() -> Tally {
        Tally {
            latencies_us: Histogram::new_with_bounds(1, LATENCY_MAX_US, 3)
                .expect("constant histogram bounds are valid"),
            errors: 0,
        }
    }

    fn record(&mut self, elapsed: Duration) {
        let us = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
        self.latencies_us
            .saturating_record(us.clamp(1, LATENCY_MAX_US));
    }
}

fn parse_duration(text: &str) -> Result<Duration, BenchError> {
    let bad = || BenchError::Usage(format!("duration {text:?}: expected like 5s or 500ms"));
    let duration = if let Some(ms) = text.strip_suffix("ms") {
        Duration::from_millis(ms.parse().map_err(|_| bad())?)
    } else if let Some(s) = text.strip_suffix('s') {
        Duration::from_secs_f64(s.parse::<f64>().map_err(|_| bad())?.clamp(0.0, 1e6))
    } else {
        return Err(bad());
    };
    if duration.is_zero() || duration > DURATION_MAX {
        return Err(BenchError::Usage(format!(
            "duration {text:?} must be above 0 and at most {} s",
            DURATION_MAX.as_secs()
        )));
    }
    Ok(duration)
}

async fn connect(endpoints: &[String], count: usize) -> Result<Vec<Conn>, BenchError> {
    let mut channels = Vec::with_capacity(count);
    for i in 0..count {
        let endpoint = &endpoints[i % endpoints.len()];
        let failed = |reason: String| BenchError::Connect {
            endpoint: endpoint.clone(),
            reason,
        };
        let channel = tokio::time::timeout(SETUP_TIMEOUT, Conn::connect(endpoint))
            .await
            .map_err(|_| failed(format!("no connection within {SETUP_TIMEOUT:?}")))?
            .map_err(failed)?;
        channels.push(channel);
    }
    Ok(channels)
}

/// A small per-client generator for key choice (no need for a crypto-grade source).
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn key(index: u64) -> Vec<u8> {
    format!("{KEY_PREFIX}k/{index}").into_bytes()
}

/// Writes every key of the key space once, so gets find values.
async fn fill_keys(channels: &[Conn], args: &Args) -> Result<(), BenchError> {
    let value = vec![b'v'; args.value_size];
    let workers = channels.len().max(1) as u64;
    let mut tasks = Vec::new();
    for w in 0..workers {
        let mut kv = KvClient::new(channels[w as usize % channels.len()].clone());
        let value = value.clone();
        let key_space = args.key_space;
        tasks.push(tokio::spawn(async move {
            let mut index = w;
            while index < key_space {
                kv.put(PutRequest {
                    key: key(index).into(),
                    value: value.clone().into(),
                    ..Default::default()
                })
                .await
                .map_err(|status| BenchError::Setup(format!("filling keys: {status}")))?;
                index += workers;
            }
            Ok::<(), BenchError>(())
        }));
    }
    for task in tasks {
        task.await.map_err(|e| BenchError::Setup(e.to_string()))??;
    }
    Ok(())
}

/// Runs one closed-loop client: `step` issues one request and says whether it succeeded.
async fn closed_loop<F, Fut>(deadline: Instant, mut step: F) -> Tally
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let mut tally = Tally::new();
    while Instant::now() < deadline {
        let start = Instant::now();
        if step().await {
            tally.record(start.elapsed());
        } else {
            tally.errors += 1;
        }
    }
    tally
}

async fn run_client(
    op: Op,
    id: usize,
    channel: Conn,
    args: Arc<Args>,
    deadline: Instant,
) -> Result<Tally, BenchError> {
    let value: tonic::codegen::Bytes = vec![b'v'; args.value_size].into();
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15 ^ (id as u64 + 1).wrapping_mul(0x2545_f491));
    let key_space = args.key_space.max(1);
    match op {
        Op::Put => {
            let kv = KvClient::new(channel);
            Ok(closed_loop(deadline, || {
                let mut kv = kv.clone();
                let request = PutRequest {
                    key: key(rng.next() % key_space).into(),
                    value: value.clone(),
                    ..Default::default()
                };
                async move { kv.put(request).await.is_ok() }
            })
            .await)
        }
        Op::Get | Op::GetSerializable => {
            let kv = KvClient::new(channel);
            let serializable = op == Op::GetSerializable;
            Ok(closed_loop(deadline, || {
                let mut kv = kv.clone();
                let request = RangeRequest {
                    key: key(rng.next() % key_space).into(),
                    serializable,
                    ..Default::default()
                };
                async move {
                    kv.range(request)
                        .await
                        .is_ok_and(|answer| answer.into_inner().kvs.len() == 1)
                }
            })
            .await)
        }
        Op::TxnCas => {
            let mut kv = KvClient::new(channel);
            let own_key: tonic::codegen::Bytes =
                format!("{KEY_PREFIX}cas/{id}").into_bytes().into();
            let first = kv
                .put(PutRequest {
                    key: own_key.clone(),
                    value: value.clone(),
                    ..Default::default()
                })
                .await
                .map_err(|status| BenchError::Setup(format!("txn-cas first put: {status}")))?;
            let mut seen = first.into_inner().header.map_or(0, |h| h.revision);
            let mut tally = Tally::new();
            while Instant::now() < deadline {
                let start = Instant::now();
                let request = TxnRequest {
                    compare: vec![Compare {
                        result: CompareResult::Equal as i32,
                        target: CompareTarget::Mod as i32,
                        key: own_key.clone(),
                        target_union: Some(TargetUnion::ModRevision(seen)),
                        ..Default::default()
                    }],
                    success: vec![RequestOp {
                        request: Some(RequestOpKind::RequestPut(PutRequest {
                            key: own_key.clone(),
                            value: value.clone(),
                            ..Default::default()
                        })),
                    }],
                    failure: vec![RequestOp {
                        request: Some(RequestOpKind::RequestRange(RangeRequest {
                            key: own_key.clone(),
                            ..Default::default()
                        })),
                    }],
                };
                match kv.txn(request).await {
                    Ok(answer) => {
                        let answer = answer.into_inner();
                        let revision = answer.header.map_or(0, |h| h.revision);
                        if answer.succeeded {
                            seen = revision;
                            tally.record(start.elapsed());
                        } else {
                            // Only this client writes its key, so a failed compare is a bug
                            // in the server (or a lost answer): count it, resynchronise.
                            tally.errors += 1;
                            seen = revision;
                        }
                    }
                    Err(_) => tally.errors += 1,
                }
            }
            Ok(tally)
        }
        Op::LeaseKeepalive => {
            let mut lease = LeaseClient::new(channel);
            let granted = lease
                .lease_grant(LeaseGrantRequest {
                    ttl: KEEPALIVE_LEASE_TTL_S,
                    id: 0,
                })
                .await
                .map_err(|status| BenchError::Setup(format!("lease grant: {status}")))?
                .into_inner();
            // The first request goes in before the call: etcd sends the response headers only
            // once the stream carries a message, so awaiting the call first would deadlock.
            let (sender, receiver) = mpsc::channel(1);
            let keepalive = LeaseKeepAliveRequest { id: granted.id };
            sender
                .send(keepalive)
                .await
                .map_err(|_| BenchError::Setup("keepalive channel closed".into()))?;
            let mut start = Instant::now();
            let mut answers = lease
                .lease_keep_alive(ReceiverStream::new(receiver))
                .await
                .map_err(|status| BenchError::Setup(format!("keepalive stream: {status}")))?
                .into_inner();
            let mut tally = Tally::new();
            loop {
                match answers.message().await {
                    Ok(Some(answer)) if answer.ttl > 0 => tally.record(start.elapsed()),
                    Ok(Some(_)) => tally.errors += 1,
                    Ok(None) | Err(_) => {
                        tally.errors += 1;
                        break;
                    }
                }
                if Instant::now() >= deadline {
                    break;
                }
                start = Instant::now();
                if sender.send(keepalive).await.is_err() {
                    tally.errors += 1;
                    break;
                }
            }
            drop(sender);
            let _ = lease
                .lease_revoke(conclave_proto::etcdserverpb::LeaseRevokeRequest { id: granted.id })
                .await;
            Ok(tally)
        }
        Op::Watch => unreachable!("watch runs through run_watch"),
        Op::Fill => unreachable!("fill runs through run_fill"),
    }
}

/// Deliveries a watch run owes for `puts` acknowledged puts: each put reaches every watcher,
/// or one with `--watch-own-prefix`.
fn expected_deliveries(args: &Args, puts: u64) -> u64 {
    if args.watch_own_prefix {
        puts
    } else {
        puts * args.clients as u64
    }
}

/// Watch fan-out: every watcher receives every put of one writer (or its share of them, with
/// `--watch-own-prefix`); a put's value starts with its send time (µs since `epoch`), so each
/// receipt yields one latency.
async fn run_watch(
    channels: &[Conn],
    args: Arc<Args>,
    duration: Duration,
) -> Result<(Vec<Tally>, u64), BenchError> {
    let prefix = format!("{KEY_PREFIX}watch/");
    let epoch = Instant::now();
    let mut watchers = Vec::with_capacity(args.clients);
    let (ready_sender, mut ready) = mpsc::channel::<()>(args.clients);
    let stop = Arc::new(tokio::sync::Notify::new());
    let delivered = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let watched = |watcher: usize| {
        if args.watch_own_prefix {
            format!("{prefix}{watcher}/")
        } else {
            prefix.clone()
        }
    };
    for i in 0..args.clients {
        let mut client = WatchClient::new(channels[i % channels.len()].clone());
        let (sender, receiver) = mpsc::channel(1);
        let watched_prefix = watched(i);
        sender
            .send(WatchRequest {
                request_union: Some(RequestUnion::CreateRequest(WatchCreateRequest {
                    key: watched_prefix.clone().into_bytes().into(),
                    range_end: prefix_end(watched_prefix.as_bytes()).into(),
                    ..Default::default()
                })),
            })
            .await
            .map_err(|_| BenchError::Setup("watch request channel closed".into()))?;
        let ready_sender = ready_sender.clone();
        let stop = stop.clone();
        let delivered = delivered.clone();
        watchers.push(tokio::spawn(async move {
            let _keep_open = sender;
            let mut tally = Tally::new();
            let mut stream = match client.watch(ReceiverStream::new(receiver)).await {
                Ok(stream) => stream.into_inner(),
                Err(_) => {
                    tally.errors += 1;
                    return tally;
                }
            };
            let stopped = stop.notified();
            tokio::pin!(stopped);
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    message = stream.message() => match message {
                        Ok(Some(answer)) => {
                            if answer.created {
                                let _ = ready_sender.send(()).await;
                            }
                            let now_us = epoch.elapsed().as_micros() as u64;
                            delivered.fetch_add(
                                answer.events.len() as u64,
                                std::sync::atomic::Ordering::Relaxed,
                            );
                            for event in answer.events {
                                let sent = event.kv.as_ref().and_then(|kv| {
                                    kv.value.get(..8).map(|b| {
                                        u64::from_le_bytes(b.try_into().expect("8 bytes"))
                                    })
                                });
                                match sent {
                                    Some(sent_us) => tally.record(Duration::from_micros(
                                        now_us.saturating_sub(sent_us),
                                    )),
                                    None => tally.errors += 1,
                                }
                            }
                        }
                        Ok(None) | Err(_) => {
                            tally.errors += 1;
                            break;
                        }
                    }
                }
            }
            tally
        }));
    }
    drop(ready_sender);
    for _ in 0..args.clients {
        tokio::time::timeout(SETUP_TIMEOUT, ready.recv())
            .await
            .ok()
            .flatten()
            .ok_or_else(|| BenchError::Setup("a watch was not created in time".into()))?;
    }
    // One writer, one put in flight, for the whole duration.
    let mut kv = KvClient::new(channels[0].clone());
    let deadline = Instant::now() + duration;
    let mut puts = 0u64;
    let mut index = 0u64;
    let mut sent = 0u64;
    let value_len = args.value_size.max(8);
    let pace = (args.rate > 0).then(|| Duration::from_secs_f64(1.0 / args.rate as f64));
    let writer_start = Instant::now();
    while Instant::now() < deadline {
        if let Some(pace) = pace {
            // Fixed rate: the n-th put leaves at n × pace, whatever the answers' latency.
            let due = writer_start + pace * u32::try_from(puts).unwrap_or(u32::MAX);
            tokio::time::sleep_until(due.into()).await;
        }
        let mut value = vec![b'w'; value_len];
        value[..8].copy_from_slice(&(epoch.elapsed().as_micros() as u64).to_le_bytes());
        index = (index + 1) % args.key_space.max(1);
        // With own prefixes, the n-th put goes to watcher n mod clients.
        let watcher = usize::try_from(sent % args.clients.max(1) as u64).unwrap_or(0);
        sent += 1;
        if kv
            .put(PutRequest {
                key: format!("{}{index}", watched(watcher)).into_bytes().into(),
                value: value.into(),
                ..Default::default()
            })
            .await
            .is_ok()
        {
            puts += 1;
        }
    }
    // Let the last events arrive (each put reaches its watchers), then stop every watcher.
    let expected = expected_deliveries(&args, puts);
    let drain_end = Instant::now() + WATCH_DRAIN_MAX;
    while delivered.load(std::sync::atomic::Ordering::Relaxed) < expected
        && Instant::now() < drain_end
    {
        tokio::time::sleep(WATCH_DRAIN_POLL).await;
    }
    stop.notify_waiters();
    let mut tallies = Vec::with_capacity(watchers.len());
    for watcher in watchers {
        tallies.push(
            watcher
                .await
                .map_err(|e| BenchError::Setup(e.to_string()))?,
        );
    }
    Ok((tallies, puts))
}

/// Bulk load: every key of the key space written once, `--batch` puts per Txn, `--clients`
/// transactions in flight. A tally's count is keys written; its latencies are per
/// transaction (recorded once per key, so quantiles weigh every key alike).
async fn run_fill(
    channels: &[Conn],
    args: Arc<Args>,
    duration: Duration,
) -> Result<Vec<Tally>, BenchError> {
    if args.batch == 0 || args.batch > FILL_BATCH_MAX {
        return Err(BenchError::Usage(format!(
            "--batch must be 1 to {FILL_BATCH_MAX}"
        )));
    }
    let deadline = Instant::now() + duration;
    let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tasks = Vec::with_capacity(args.clients);
    for id in 0..args.clients {
        let mut kv = KvClient::new(channels[id % channels.len()].clone());
        let next = next.clone();
        let args = args.clone();
        tasks.push(tokio::spawn(async move {
            let value: tonic::codegen::Bytes = vec![b'v'; args.value_size].into();
            let mut tally = Tally::new();
            while Instant::now() < deadline {
                let first = next.fetch_add(args.batch as u64, std::sync::atomic::Ordering::Relaxed);
                if first >= args.key_space {
                    break;
                }
                let last = (first + args.batch as u64).min(args.key_space);
                let success = (first..last)
                    .map(|index| RequestOp {
                        request: Some(RequestOpKind::RequestPut(PutRequest {
                            key: key(index).into(),
                            value: value.clone(),
                            ..Default::default()
                        })),
                    })
                    .collect();
                let start = Instant::now();
                let request = TxnRequest {
                    compare: vec![],
                    success,
                    failure: vec![],
                };
                match kv.txn(request).await {
                    Ok(_) => {
                        let elapsed = start.elapsed();
                        for _ in first..last {
                            tally.record(elapsed);
                        }
                    }
                    // A key range lost to an error stays unwritten: counted, not retried, so
                    // the figure never hides a failure.
                    Err(_) => tally.errors += last - first,
                }
            }
            tally
        }));
    }
    let mut tallies = Vec::with_capacity(tasks.len());
    for task in tasks {
        tallies.push(task.await.map_err(|e| BenchError::Setup(e.to_string()))?);
    }
    Ok(tallies)
}

fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

async fn run(args: Args) -> Result<(), BenchError> {
    let duration = parse_duration(&args.duration)?;
    if args.clients == 0 || args.clients > CLIENTS_MAX {
        return Err(BenchError::Usage(format!(
            "--clients must be 1 to {CLIENTS_MAX}"
        )));
    }
    if args.value_size > VALUE_BYTES_MAX {
        return Err(BenchError::Usage(format!(
            "--value-size must be at most {VALUE_BYTES_MAX}"
        )));
    }
    if args.rate > WATCH_RATE_MAX {
        return Err(BenchError::Usage(format!(
            "--rate must be at most {WATCH_RATE_MAX} puts per second"
        )));
    }
    let endpoints: Vec<String> = args
        .endpoints
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(String::from)
        .collect();
    if endpoints.is_empty() {
        return Err(BenchError::Usage("--endpoints is empty".into()));
    }
    let connections = args.connections.unwrap_or(args.clients.min(16));
    if connections == 0 || connections > CONNECTIONS_MAX {
        return Err(BenchError::Usage(format!(
            "--connections must be 1 to {CONNECTIONS_MAX}"
        )));
    }
    let channels = connect(&endpoints, connections).await?;
    let args = Arc::new(args);
    if matches!(args.op, Op::Get | Op::GetSerializable) {
        fill_keys(&channels, &args).await?;
    }
    let started = Instant::now();
    let (tallies, extra) = if args.op == Op::Fill {
        (run_fill(&channels, args.clone(), duration).await?, None)
    } else if args.op == Op::Watch {
        let (tallies, puts) = run_watch(&channels, args.clone(), duration).await?;
        (tallies, Some(puts))
    } else {
        let deadline = Instant::now() + duration;
        let mut tasks = Vec::with_capacity(args.clients);
        for id in 0..args.clients {
            tasks.push(tokio::spawn(run_client(
                args.op,
                id,
                channels[id % channels.len()].clone(),
                args.clone(),
                deadline,
            )));
        }
        let mut tallies = Vec::with_capacity(tasks.len());
        for task in tasks {
            tallies.push(task.await.map_err(|e| BenchError::Setup(e.to_string()))??);
        }
        (tallies, None)
    };
    let elapsed = if args.op == Op::Watch {
        duration
    } else {
        started.elapsed()
    };
    let mut total = Tally::new();
    for tally in &tallies {
        total
            .latencies_us
            .add(&tally.latencies_us)
            .expect("histograms share bounds");
        total.errors += tally.errors;
    }
    let ops = total.latencies_us.len();
    let ops_per_s = ops as f64 / elapsed.as_secs_f64();
    let ms = |q: f64| total.latencies_us.value_at_quantile(q) as f64 / 1000.0;
    let max_ms = total.latencies_us.max() as f64 / 1000.0;
    if args.json {
        let mut out = json!({
            "label": args.label,
            "op": args.op.name(),
            "clients": args.clients,
            "connections": connections,
            "duration_s": elapsed.as_secs_f64(),
            "ops": ops,
            "ops_per_s": ops_per_s,
            "errors": total.errors,
            "latency_ms": {"p50": ms(0.5), "p99": ms(0.99), "p99_9": ms(0.999), "max": max_ms},
        });
        if let Some(puts) = extra {
            out["writer_puts"] = json!(puts);
            // Every watcher should have received every acknowledged put under its prefix.
            let expected = expected_deliveries(&args, puts);
            out["expected_deliveries"] = json!(expected);
            out["missed"] = json!(expected.saturating_sub(ops));
            out["writer_rate"] = json!(args.rate);
        }
        println!("{out}");
    } else {
        if args.header {
            println!(
                "{:<10} {:<17} {:>7} {:>10} {:>8} {:>8} {:>8} {:>8} {:>7}",
                "label",
                "op",
                "clients",
                "ops/s",
                "p50 ms",
                "p99 ms",
                "p99.9 ms",
                "max ms",
                "errors"
            );
        }
        println!(
            "{:<10} {:<17} {:>7} {:>10.0} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>7}",
            args.label,
            args.op.name(),
            args.clients,
            ops_per_s,
            ms(0.5),
            ms(0.99),
            ms(0.999),
            max_ms,
            total.errors
        );
    }
    if ops == 0 {
        return Err(BenchError::Setup(format!(
            "no operation succeeded ({} errors)",
            total.errors
        )));
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.threads == 0 || args.threads > THREADS_MAX {
        eprintln!("etcd-bench: invalid argument: --threads must be 1 to {THREADS_MAX}");
        return ExitCode::FAILURE;
    }
    let runtime = if args.threads == 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(args.threads)
            .enable_all()
            .build()
    };
    let runtime = match runtime {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("etcd-bench: cannot start the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("etcd-bench: {error}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_and_out_of_range_ones_are_refused() {
        assert_eq!(parse_duration("5s").unwrap(), Duration::from_secs(5));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("5").is_err());
        assert!(parse_duration("2h").is_err());
        assert!(parse_duration("7200s").is_err());
    }

    #[test]
    fn prefix_end_is_etcds() {
        assert_eq!(prefix_end(b"a/"), b"a0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff"), vec![0]);
    }
}
