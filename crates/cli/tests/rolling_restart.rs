//! A rolling restart with SIGTERM under load loses no request: every member in turn (the
//! leader first) is stopped gracefully and started again while writers and linearizable
//! readers keep going through every member, and every request succeeds within its deadline.
//!
//! The clients behave like etcd's `clientv3` with every endpoint configured: a request the
//! HTTP/2 layer refused before any member processed it (connection refused; cancelled unsent
//! or refused by the GOAWAY of a member that is stopping) goes to the next member, as grpc-go
//! does transparently. Nothing else is retried: an error answer, a timeout or a connection
//! lost while a request was in flight is a failure. Writes are compare-and-swaps, so a write
//! that was applied and then sent again would fail its compare and count as a failure too.
//! The server's part: hand leadership over before stopping, finish every request it accepted,
//! and route around a leader that is handing over.

mod common;

use std::error::Error as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::Cluster;
use conclave_proto::etcdserverpb::compare::{CompareResult, CompareTarget, TargetUnion};
use conclave_proto::etcdserverpb::kv_client::KvClient;
use conclave_proto::etcdserverpb::request_op::Request as Op;
use conclave_proto::etcdserverpb::{Compare, PutRequest, RangeRequest, RequestOp, TxnRequest};
use tonic::transport::Channel;

const WRITERS: usize = 3;
const READERS: usize = 3;
/// Every request must succeed within this, wherever it is sent.
const REQUEST_DEADLINE: Duration = Duration::from_secs(5);
const ROUNDS: usize = 2;
const CATCH_UP_TIMEOUT: Duration = Duration::from_secs(20);
/// Load between one member's return and the next member's stop.
const SETTLE: Duration = Duration::from_millis(500);

/// Whether a request failed at the HTTP/2 layer before its member processed it, so the
/// client may send it to another member (grpc-go, under etcd's client, retries such streams
/// transparently; tonic reports them):
/// - the connection was refused: the member is down;
/// - hyper cancelled it unsent ("operation was canceled"), queued on a connection the
///   member closed after its GOAWAY;
/// - the member's final GOAWAY refused the stream: it was opened after the member's last
///   accepted stream (tonic reports it as "h2 protocol error").
///
/// The last one tonic cannot tell apart from a stream reset after processing, so every write
/// is a compare-and-swap: a write applied and then sent again fails its compare, and counts
/// as a failed request.
fn refused_unprocessed(status: &tonic::Status) -> Option<&'static str> {
    let chain = error_chain(status);
    match status.code() {
        tonic::Code::Unavailable
            if chain.contains("tcp connect error") || chain.contains("Connection refused") =>
        {
            Some("connection refused")
        }
        tonic::Code::Cancelled if chain.contains("operation was canceled") => {
            Some("cancelled unsent")
        }
        tonic::Code::Internal if chain.contains("h2 protocol error") => Some("refused stream"),
        _ => None,
    }
}

fn error_chain(status: &tonic::Status) -> String {
    let mut text = format!("{:?}: {}", status.code(), status.message());
    let mut source = status.source();
    while let Some(error) = source {
        text.push_str(&format!(" <- {error}"));
        source = error.source();
    }
    text
}

/// What the clients measured.
#[derive(Default)]
struct Figures {
    done: AtomicU64,
    writes: AtomicU64,
    reads: AtomicU64,
    /// Requests sent to another member because theirs was gone, by how the first try failed.
    redirected: Mutex<std::collections::BTreeMap<&'static str, u64>>,
    latencies_us: Mutex<Vec<u64>>,
    failures: Mutex<Vec<String>>,
}

/// A client holding a connection to every member; it starts with member `first`.
struct Client {
    members: Vec<KvClient<Channel>>,
    current: usize,
}

impl Client {
    fn new(cluster: &Cluster, first: usize) -> Client {
        let members = (1..=3)
            .map(|id| {
                let channel = Channel::from_shared(cluster.endpoint(id))
                    .expect("valid endpoint")
                    .connect_lazy();
                KvClient::new(channel)
            })
            .collect();
        Client {
            members,
            current: first,
        }
    }

    /// Sends one request through `call` until it is answered, moving to the next member only
    /// when the request was never sent. Returns the answer or the one failure.
    async fn request<T, F, Fut>(&mut self, figures: &Figures, mut call: F) -> Result<T, String>
    where
        F: FnMut(KvClient<Channel>, Duration) -> Fut,
        Fut: std::future::Future<Output = Result<T, tonic::Status>>,
    {
        let start = Instant::now();
        loop {
            let remaining = REQUEST_DEADLINE.saturating_sub(start.elapsed());
            if remaining.is_zero() {
                return Err(format!(
                    "no answer within {REQUEST_DEADLINE:?} (member {})",
                    self.current + 1
                ));
            }
            let client = self.members[self.current].clone();
            match call(client, remaining).await {
                Ok(answer) => {
                    let elapsed = start.elapsed();
                    figures
                        .latencies_us
                        .lock()
                        .expect("latencies")
                        .push(elapsed.as_micros() as u64);
                    figures.done.fetch_add(1, Ordering::SeqCst);
                    return Ok(answer);
                }
                Err(status) => match refused_unprocessed(&status) {
                    Some(kind) => {
                        *figures
                            .redirected
                            .lock()
                            .expect("redirect counts")
                            .entry(kind)
                            .or_default() += 1;
                        self.current = (self.current + 1) % self.members.len();
                        // A refused connection answers at once; do not spin on a member that
                        // is between stop and start.
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                    None => {
                        return Err(format!(
                            "member {} after {} ms: {}",
                            self.current + 1,
                            start.elapsed().as_millis(),
                            error_chain(&status)
                        ));
                    }
                },
            }
        }
    }
}

/// Sets `seq/<writer>` to 1, 2, 3, ..., each by a compare-and-swap on the previous number,
/// and publishes the last acknowledged number.
async fn writer(
    mut client: Client,
    index: usize,
    acked: Arc<Vec<AtomicU64>>,
    stop: Arc<AtomicBool>,
    figures: Arc<Figures>,
) {
    let key = format!("seq/{index}");
    let mut next = 1u64;
    while !stop.load(Ordering::SeqCst) {
        let txn = compare_and_swap(&key, next - 1, next);
        let result = client
            .request(&figures, |mut kv, timeout| {
                let mut request = tonic::Request::new(txn.clone());
                request.set_timeout(timeout);
                async move { kv.txn(request).await }
            })
            .await;
        match result {
            Ok(response) if response.get_ref().succeeded => {
                acked[index].fetch_max(next, Ordering::SeqCst);
                figures.writes.fetch_add(1, Ordering::SeqCst);
                next += 1;
            }
            Ok(_) => {
                figures.failures.lock().expect("failures").push(format!(
                    "{key}: {} -> {next} found another value (a write applied twice or lost)",
                    next - 1
                ));
                return;
            }
            Err(failure) => {
                figures
                    .failures
                    .lock()
                    .expect("failures")
                    .push(format!("put {key}={next}: {failure}"));
                return;
            }
        }
    }
}

fn compare_and_swap(key: &str, from: u64, to: u64) -> TxnRequest {
    TxnRequest {
        compare: vec![Compare {
            result: CompareResult::Equal as i32,
            target: CompareTarget::Value as i32,
            key: key.to_string().into(),
            target_union: Some(TargetUnion::Value(from.to_string().into())),
            range_end: Default::default(),
        }],
        success: vec![RequestOp {
            request: Some(Op::RequestPut(PutRequest {
                key: key.to_string().into(),
                value: to.to_string().into(),
                ..Default::default()
            })),
        }],
        failure: vec![],
    }
}

/// Reads `seq/<w>` linearizably and checks it shows at least the number acknowledged before
/// the read began.
async fn reader(
    mut client: Client,
    index: usize,
    acked: Arc<Vec<AtomicU64>>,
    stop: Arc<AtomicBool>,
    figures: Arc<Figures>,
) {
    let mut turn = index;
    while !stop.load(Ordering::SeqCst) {
        let w = turn % WRITERS;
        turn += 1;
        let key = format!("seq/{w}");
        let floor = acked[w].load(Ordering::SeqCst);
        let result = client
            .request(&figures, |mut kv, timeout| {
                let mut request = tonic::Request::new(RangeRequest {
                    key: key.clone().into(),
                    ..Default::default()
                });
                request.set_timeout(timeout);
                async move { kv.range(request).await }
            })
            .await;
        match result {
            Ok(response) => {
                figures.reads.fetch_add(1, Ordering::SeqCst);
                let seen: u64 = response
                    .into_inner()
                    .kvs
                    .first()
                    .map(|kv| String::from_utf8_lossy(&kv.value).parse().unwrap_or(0))
                    .unwrap_or(0);
                assert!(
                    seen >= floor,
                    "stale linearizable read of {key}: {seen}, but {floor} was acknowledged \
                     before the read began"
                );
            }
            Err(failure) => {
                figures
                    .failures
                    .lock()
                    .expect("failures")
                    .push(format!("get {key}: {failure}"));
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn rolling_restart_with_sigterm_under_load_fails_no_request() {
    let test_start = Instant::now();
    let mut cluster = Cluster::start(3).await;
    let acked: Arc<Vec<AtomicU64>> = Arc::new((0..WRITERS).map(|_| AtomicU64::new(0)).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let figures = Arc::new(Figures::default());
    for w in 0..WRITERS {
        let leader = cluster.wait_for_leader(CATCH_UP_TIMEOUT).await;
        cluster
            .put_until_acked(leader, &format!("seq/{w}"), "0", CATCH_UP_TIMEOUT)
            .await;
    }
    let mut tasks = Vec::new();
    for w in 0..WRITERS {
        let client = Client::new(&cluster, w % 3);
        tasks.push(tokio::spawn(writer(
            client,
            w,
            acked.clone(),
            stop.clone(),
            figures.clone(),
        )));
    }
    for r in 0..READERS {
        let client = Client::new(&cluster, r % 3);
        tasks.push(tokio::spawn(reader(
            client,
            r,
            acked.clone(),
            stop.clone(),
            figures.clone(),
        )));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;

    let mut restarts = Vec::new();
    for _ in 0..ROUNDS {
        // The leader first, so every round hands leadership over at least once.
        let leader = cluster.wait_for_leader(CATCH_UP_TIMEOUT).await;
        let order: Vec<u64> = std::iter::once(leader)
            .chain((1..=3).filter(|&id| id != leader))
            .collect();
        for id in order {
            let was_leader = cluster.wait_for_leader(CATCH_UP_TIMEOUT).await == id;
            let stopping = Instant::now();
            assert!(
                cluster.terminate(id),
                "member {id} did not exit cleanly on SIGTERM; logs in {}",
                cluster.root.display()
            );
            let stop_ms = stopping.elapsed().as_millis();
            cluster.spawn(id);
            cluster.wait_caught_up(id, CATCH_UP_TIMEOUT).await;
            let back_ms = stopping.elapsed().as_millis();
            restarts.push(format!(
                "member {id}{}: exited {stop_ms} ms after SIGTERM, caught up {back_ms} ms after",
                if was_leader { " (leader)" } else { "" }
            ));
            tokio::time::sleep(SETTLE).await;
        }
    }
    stop.store(true, Ordering::SeqCst);
    for task in tasks {
        task.await.expect("client task");
    }

    let mut latencies = std::mem::take(&mut *figures.latencies_us.lock().expect("latencies"));
    latencies.sort_unstable();
    let percentile = |p: f64| -> f64 {
        let index = ((latencies.len() as f64 - 1.0) * p).round() as usize;
        latencies.get(index).copied().unwrap_or(0) as f64 / 1000.0
    };
    for line in &restarts {
        println!("{line}");
    }
    println!(
        "rolling restart ({ROUNDS} rounds of 3 SIGTERM restarts, {WRITERS} writers and \
         {READERS} linearizable readers): {} requests ({} compare-and-swap puts, {} gets) done, \
         sent again to another member after {:?}, latency p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms; \
         test took {:.1} s",
        figures.done.load(Ordering::SeqCst),
        figures.writes.load(Ordering::SeqCst),
        figures.reads.load(Ordering::SeqCst),
        figures.redirected.lock().expect("redirect counts"),
        percentile(0.5),
        percentile(0.99),
        percentile(1.0),
        test_start.elapsed().as_secs_f64()
    );
    {
        let failures = figures.failures.lock().expect("failures");
        assert!(
            failures.is_empty(),
            "{} requests failed, the first ones: {:#?}; logs in {}",
            failures.len(),
            &failures[..failures.len().min(10)],
            cluster.root.display()
        );
    }
    assert!(
        figures.writes.load(Ordering::SeqCst) > 0 && figures.reads.load(Ordering::SeqCst) > 0,
        "the load made no progress"
    );
    // The last acknowledged number of every writer is there.
    let mut kv = cluster.kv(1).await;
    for (w, acked) in acked.iter().enumerate() {
        let response = kv
            .range(RangeRequest {
                key: format!("seq/{w}").into(),
                ..Default::default()
            })
            .await
            .expect("final read")
            .into_inner();
        let seen: u64 = response
            .kvs
            .first()
            .map(|kv| String::from_utf8_lossy(&kv.value).parse().unwrap_or(0))
            .unwrap_or(0);
        assert!(seen >= acked.load(Ordering::SeqCst));
    }
}
