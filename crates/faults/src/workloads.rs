//! Client workloads. Each logical process runs one operation at a time and records it in its
//! workload's history (invoke, then ok / fail / info).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use conclave_client::{
    CampaignOptions, Client, Compare, CompareOp, Error as ClientError, GetOptions, LeaseSafety,
    Op as TxnOp, PutOptions, Txn, WatchOptions,
};
use conclave_proto::etcdserverpb::RangeRequest;
use conclave_proto::etcdserverpb::kv_client::KvClient;
use conclave_proto::v3lockpb::LockRequest;
use conclave_proto::v3lockpb::lock_client::LockClient;
use serde_json::{Value, json};

use crate::history::{Kind, Recorder};
use crate::rng::Rng;

/// Key prefix of the register workload (the watch workload watches it).
pub const REGISTER_PREFIX: &str = "faults/reg/";
/// Registers (keys) of the register workload.
pub const REGISTER_KEYS: u64 = 5;
/// TTL of the leases behind locks, seats and the lease workload.
pub const HOLD_TTL: Duration = Duration::from_secs(2);
/// How long a holder stays paused past its TTL before acting again.
pub const PAUSE_PAST_TTL: Duration = Duration::from_millis(1500);
/// Deadline of one client request, retries included.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(3);

/// What every workload needs.
#[derive(Clone)]
pub struct Ctx {
    pub client: Client,
    pub endpoints: Vec<String>,
    /// The harness's client TLS, for the calls that dial one member themselves.
    pub tls: Option<conclave_client::TlsOptions>,
    pub until: std::time::Instant,
    pub seed: u64,
}

impl Ctx {
    fn running(&self) -> bool {
        std::time::Instant::now() < self.until
    }
}

/// Outcome of a failed call: `fail` only when the request certainly took no effect.
fn outcome_of(error: &ClientError) -> Kind {
    match error {
        ClientError::ConnectionFailed { .. }
        | ClientError::InvalidArgument(_)
        | ClientError::TooLarge(_)
        | ClientError::LeaseExpired { .. }
        | ClientError::NotFound(_) => Kind::Fail,
        _ => Kind::Info,
    }
}

fn parse_register(value: &[u8]) -> Value {
    std::str::from_utf8(value)
        .ok()
        .and_then(|s| s.parse::<i64>().ok())
        .map_or(
            Value::String(String::from_utf8_lossy(value).into()),
            Value::from,
        )
}

/// Serializable reads pinned to one member: the negative control of the register checker.
#[derive(Clone)]
pub struct PinnedReads {
    pub channels: Vec<tonic::transport::Channel>,
}

impl PinnedReads {
    pub fn new(endpoints: &[String], tls: Option<&conclave_client::TlsOptions>) -> PinnedReads {
        let channels = endpoints
            .iter()
            .filter_map(|e| {
                crate::tls::endpoint(e, tls).map(|ep| {
                    ep.connect_timeout(Duration::from_millis(500))
                        .connect_lazy()
                })
            })
            .collect();
        PinnedReads { channels }
    }
}

/// Reads, writes and compare-and-sets on a few registers through the etcd KV API.
pub async fn register(ctx: Ctx, process: u64, history: Recorder, pinned: Option<PinnedReads>) {
    let mut rng = Rng::new(ctx.seed ^ (process * 0x9e37));
    let mut counter = 0i64;
    let mut last_seen: Vec<Option<i64>> = vec![None; REGISTER_KEYS as usize];
    while ctx.running() {
        let k = rng.below(REGISTER_KEYS) as usize;
        let key = format!("{REGISTER_PREFIX}k{k}");
        let dice = rng.below(10);
        counter += 1;
        let unique = (process as i64) * 1_000_000 + counter;
        if dice < 4 {
            history.record(process, Kind::Invoke, "read", &key, Value::Null);
            let result = match &pinned {
                Some(pinned) => {
                    let channel =
                        pinned.channels[rng.below(pinned.channels.len() as u64) as usize].clone();
                    let request = RangeRequest {
                        key: key.clone().into_bytes().into(),
                        serializable: true,
                        ..Default::default()
                    };
                    match tokio::time::timeout(
                        Duration::from_millis(500),
                        KvClient::new(channel).range(request),
                    )
                    .await
                    {
                        Ok(Ok(answer)) => Ok(answer
                            .into_inner()
                            .kvs
                            .first()
                            .map(|kv| parse_register(&kv.value))
                            .unwrap_or(Value::Null)),
                        _ => Err(()),
                    }
                }
                None => ctx
                    .client
                    .get(key.clone(), GetOptions::default())
                    .await
                    .map(|r| {
                        r.kvs
                            .first()
                            .map(|kv| parse_register(&kv.value))
                            .unwrap_or(Value::Null)
                    })
                    .map_err(|_| ()),
            };
            match result {
                Ok(value) => {
                    last_seen[k] = value.as_i64();
                    history.record(process, Kind::Ok, "read", &key, value);
                }
                // A read changes nothing: a failed one is simply dropped by the checker.
                Err(()) => {
                    history.record(process, Kind::Fail, "read", &key, Value::Null);
                }
            }
        } else if dice < 7 || last_seen[k].is_none() {
            history.record(process, Kind::Invoke, "write", &key, json!(unique));
            match ctx
                .client
                .put(key.clone(), unique.to_string(), PutOptions::default())
                .await
            {
                Ok(answer) => {
                    history.record(
                        process,
                        Kind::Ok,
                        "write",
                        &key,
                        json!({"rev": answer.revision}),
                    );
                }
                Err(error) => {
                    history.record(
                        process,
                        outcome_of(&error),
                        "write",
                        &key,
                        json!(error.code()),
                    );
                }
            }
        } else {
            let from = last_seen[k].unwrap_or(0);
            history.record(process, Kind::Invoke, "cas", &key, json!([from, unique]));
            let txn = Txn::new()
                .when([Compare::value(
                    key.clone(),
                    CompareOp::Equal,
                    from.to_string(),
                )])
                .and_then([TxnOp::put(
                    key.clone(),
                    unique.to_string(),
                    PutOptions::default(),
                )]);
            match ctx.client.txn(txn).await {
                Ok(answer) => {
                    history.record(
                        process,
                        Kind::Ok,
                        "cas",
                        &key,
                        json!({"succeeded": answer.succeeded, "rev": answer.revision}),
                    );
                }
                Err(error) => {
                    history.record(
                        process,
                        outcome_of(&error),
                        "cas",
                        &key,
                        json!(error.code()),
                    );
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.below(20))).await;
    }
}

/// Watches the register prefix from `from_revision`. `restart_every` drops the stream now and
/// then and resumes it from the last delivered revision + 1 itself. `drop_one` forgets one
/// delivered event (the watch checker's negative control).
pub async fn watch(
    ctx: Ctx,
    process: u64,
    history: Recorder,
    from_revision: i64,
    restart_every: Option<Duration>,
    drop_one: bool,
    finished: tokio::sync::watch::Receiver<(i64, bool)>,
) {
    let mut last = from_revision - 1;
    let mut dropped = !drop_one;
    let mut delivered = 0u64;
    'outer: loop {
        let options = WatchOptions {
            start_revision: last + 1,
            ..WatchOptions::prefix()
        };
        let mut watcher = match ctx.client.watch(REGISTER_PREFIX, options).await {
            Ok(watcher) => watcher,
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
                if stop_at(&finished, last) {
                    break;
                }
                continue;
            }
        };
        let restart_at = restart_every.map(|d| Instant::now() + d);
        loop {
            if stop_at(&finished, last) {
                break 'outer;
            }
            let next = tokio::time::timeout(Duration::from_millis(200), watcher.next()).await;
            match next {
                Ok(Some(Ok(event))) => {
                    let rev = event.revision();
                    last = last.max(rev);
                    delivered += 1;
                    if !dropped && delivered == 20 {
                        dropped = true;
                        continue;
                    }
                    history.record(process, Kind::Invoke, "event", "", Value::Null);
                    history.record(
                        process,
                        Kind::Ok,
                        "event",
                        "",
                        json!({"rev": rev, "key": event.kv.key_str(), "value": parse_register(&event.kv.value)}),
                    );
                }
                Ok(Some(Err(_))) | Ok(None) => continue 'outer,
                Err(_) => {}
            }
            if restart_at.is_some_and(|at| Instant::now() >= at) {
                continue 'outer;
            }
        }
    }
    history.record(process, Kind::Invoke, "cover", "", Value::Null);
    let to = finished.borrow().0;
    history.record(
        process,
        Kind::Ok,
        "cover",
        "",
        json!({"from": from_revision, "to": to}),
    );
}

/// True once the run is over and the watcher has delivered everything up to the final
/// revision, or has had a generous time to.
fn stop_at(finished: &tokio::sync::watch::Receiver<(i64, bool)>, last: i64) -> bool {
    let (target, give_up) = *finished.borrow();
    give_up || (target > 0 && last >= target)
}

/// A resource that remembers the highest fence it accepted and, when fenced, refuses older
/// ones. The unfenced variant accepts everything (what a lock without fencing gives you).
pub struct Resource {
    pub fenced: bool,
    highest: std::sync::Mutex<u64>,
}

impl Resource {
    pub fn new(fenced: bool) -> Arc<Resource> {
        Arc::new(Resource {
            fenced,
            highest: std::sync::Mutex::new(0),
        })
    }

    /// One write under `fence`, recorded with the time left before the holder's conservative
    /// lease deadline (`None`: past it); true when accepted.
    pub fn write(
        &self,
        history: &Recorder,
        process: u64,
        key: &str,
        fence: u64,
        deadline_left: Option<Duration>,
    ) -> bool {
        let mut highest = self.highest.lock().unwrap_or_else(|p| p.into_inner());
        let args = match deadline_left {
            Some(left) => json!({
                "fence": fence,
                "within_deadline": true,
                "deadline_left_us": left.as_micros() as u64,
            }),
            None => json!({"fence": fence, "within_deadline": false}),
        };
        history.record(process, Kind::Invoke, "resource", key, args);
        let accepted = !self.fenced || fence >= *highest;
        if accepted {
            *highest = (*highest).max(fence);
        }
        let kind = if accepted { Kind::Ok } else { Kind::Fail };
        history.record(process, kind, "resource", key, Value::Null);
        accepted
    }
}

/// The time from now until `deadline`; `None` once it has passed.
fn time_left(deadline: Instant) -> Option<Duration> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|left| !left.is_zero())
}

/// Lock holders writing to a fenced resource. Each keeps its own lease alive by hand, so a
/// pause (no keepalives, no work) is a pause of the whole holder, as a stopped process.
pub async fn lock(
    ctx: Ctx,
    process: u64,
    history: Recorder,
    resource: Arc<Resource>,
    pause_per_mille: u64,
) {
    let mut rng = Rng::new(ctx.seed ^ (process * 0x51ed));
    let safety = LeaseSafety::default();
    let channels = PinnedReads::new(&ctx.endpoints, ctx.tls.as_ref()).channels;
    let name = "faults-lock";
    while ctx.running() {
        let Ok(grant) = ctx.client.lease_grant(HOLD_TTL).await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let lease = grant.id;
        let mut last_ack_sent = grant.sent_at;
        history.record(
            process,
            Kind::Invoke,
            "acquire",
            name,
            json!({"lease": lease}),
        );
        // Lock is idempotent under one lease: ask members in turn until it answers.
        let mut key = None;
        let started = Instant::now();
        while key.is_none() && started.elapsed() < Duration::from_secs(10) {
            let channel = channels[rng.below(channels.len() as u64) as usize].clone();
            let sent = Instant::now();
            // A TTL of 0 says the lease is gone: no promise to count from.
            if ctx
                .client
                .lease_keep_alive_once(lease)
                .await
                .is_ok_and(|ttl| !ttl.is_zero())
            {
                last_ack_sent = sent;
            }
            let request = LockRequest {
                name: name.as_bytes().to_vec().into(),
                lease,
            };
            if let Ok(Ok(answer)) = tokio::time::timeout(
                Duration::from_millis(600),
                LockClient::new(channel).lock(request),
            )
            .await
            {
                key = Some(answer.into_inner().key.to_vec());
            }
        }
        let fence = match &key {
            Some(key) => ctx
                .client
                .get(key.clone(), GetOptions::default())
                .await
                .ok()
                .and_then(|r| {
                    r.kvs
                        .first()
                        .filter(|kv| kv.lease == lease)
                        .map(|kv| kv.create_revision as u64)
                }),
            None => None,
        };
        let (Some(key), Some(fence)) = (key, fence) else {
            history.record(process, Kind::Info, "acquire", name, Value::Null);
            let _ = ctx.client.lease_revoke(lease).await;
            continue;
        };
        history.record(process, Kind::Ok, "acquire", name, json!({"fence": fence}));
        let hold_until = Instant::now() + Duration::from_millis(300 + rng.below(1200));
        let pause = rng.below(1000) < pause_per_mille;
        let mut next_keepalive = Instant::now();
        while Instant::now() < hold_until {
            if Instant::now() >= next_keepalive {
                let sent = Instant::now();
                if ctx
                    .client
                    .lease_keep_alive_once(lease)
                    .await
                    .is_ok_and(|ttl| !ttl.is_zero())
                {
                    last_ack_sent = sent;
                }
                next_keepalive = sent + HOLD_TTL / 4;
            }
            let left = time_left(safety.local_deadline(last_ack_sent, HOLD_TTL));
            if left.is_none() {
                break;
            }
            resource.write(&history, process, name, fence, left);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if pause {
            // A stopped holder: no keepalives, no work, then one write with its old fence.
            tokio::time::sleep(HOLD_TTL + PAUSE_PAST_TTL).await;
            let left = time_left(safety.local_deadline(last_ack_sent, HOLD_TTL));
            resource.write(&history, process, name, fence, left);
        }
        // Release: delete our key only if it is still ours, then end the lease.
        let unlock = Txn::new()
            .when([Compare::create_revision(
                key.clone(),
                CompareOp::Equal,
                fence as i64,
            )])
            .and_then([TxnOp::delete(key.clone(), Default::default())]);
        let _ = ctx.client.txn(unlock).await;
        let _ = ctx.client.lease_revoke(lease).await;
    }
}

/// Candidates of one priority group acting on a fenced resource while elected.
pub async fn election(
    ctx: Ctx,
    process: u64,
    history: Recorder,
    resource: Arc<Resource>,
    pause_per_mille: u64,
) {
    let mut rng = Rng::new(ctx.seed ^ (process * 0x7f4a));
    let group = "faults-election";
    let candidate = format!("candidate-{process}");
    let priority = 10 * (process as i64 % 5 + 1);
    while ctx.running() {
        history.record(
            process,
            Kind::Invoke,
            "acquire",
            group,
            json!({"priority": priority}),
        );
        let options = CampaignOptions {
            ttl: HOLD_TTL,
            timeout: Some(Duration::from_secs(8)),
            ..Default::default()
        };
        let leadership = match ctx
            .client
            .election()
            .campaign(group, &candidate, priority, "faults", options)
            .await
        {
            Ok(leadership) => leadership,
            Err(error) => {
                // A campaign that timed out may still be registered; the lease ends it.
                history.record(process, Kind::Info, "acquire", group, json!(error.code()));
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let fence = leadership.fence();
        history.record(process, Kind::Ok, "acquire", group, json!({"fence": fence}));
        let hold_until = Instant::now() + Duration::from_millis(300 + rng.below(1500));
        let pause = rng.below(1000) < pause_per_mille;
        while Instant::now() < hold_until {
            let left = leadership
                .lease_deadline()
                .filter(|_| leadership.lost_reason().is_none())
                .and_then(time_left);
            if left.is_none() {
                break;
            }
            resource.write(&history, process, group, fence, left);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if pause {
            let deadline = leadership.lease_deadline();
            leadership.abandon();
            tokio::time::sleep(HOLD_TTL + PAUSE_PAST_TTL).await;
            resource.write(
                &history,
                process,
                group,
                fence,
                deadline.and_then(time_left),
            );
        } else {
            let _ = leadership.resign().await;
        }
        // Lower priorities get a turn now and then.
        tokio::time::sleep(Duration::from_millis(rng.below(400))).await;
    }
}

/// Leases kept alive at irregular intervals (some close to the TTL), probed by linearizable
/// reads of a key attached to them, then left to expire. `claimed_extra` adds to the TTL the
/// history states (the lease checker's negative control).
pub async fn lease(ctx: Ctx, process: u64, history: Recorder, claimed_extra: Duration) {
    let mut rng = Rng::new(ctx.seed ^ (process * 0x3c6e));
    while ctx.running() {
        let lease_key = format!("lease-{process}-{}", rng.below(u64::MAX >> 1));
        let claimed = HOLD_TTL + claimed_extra;
        history.record(
            process,
            Kind::Invoke,
            "grant",
            &lease_key,
            json!({"ttl_ms": claimed.as_millis() as u64}),
        );
        let grant = match ctx.client.lease_grant(HOLD_TTL).await {
            Ok(grant) => grant,
            Err(error) => {
                history.record(
                    process,
                    outcome_of(&error),
                    "grant",
                    &lease_key,
                    json!(error.code()),
                );
                continue;
            }
        };
        history.record(
            process,
            Kind::Ok,
            "grant",
            &lease_key,
            json!({"id": grant.id}),
        );
        let key = format!("faults/lease/{}", grant.id);
        if ctx
            .client
            .put(
                key.clone(),
                "x",
                PutOptions {
                    lease: grant.id,
                    prev_kv: false,
                },
            )
            .await
            .is_err()
        {
            let _ = ctx.client.lease_revoke(grant.id).await;
            continue;
        }
        let probe = |history: Recorder| {
            let client = ctx.client.clone();
            let key = key.clone();
            let lease_key = lease_key.clone();
            async move {
                history.record(process, Kind::Invoke, "probe", &lease_key, Value::Null);
                match client.get(key, GetOptions::default()).await {
                    Ok(answer) => {
                        let present = !answer.kvs.is_empty();
                        history.record(process, Kind::Ok, "probe", &lease_key, json!(present));
                        Some(present)
                    }
                    Err(_) => {
                        history.record(process, Kind::Fail, "probe", &lease_key, Value::Null);
                        None
                    }
                }
            }
        };
        let mut alive = true;
        // Send time of the last acknowledged renewal: the TTL counts from there at the latest.
        let mut last_ack_sent = grant.sent_at;
        for _ in 0..(2 + rng.below(4)) {
            if rng.below(3) == 0 {
                // A renewal a few milliseconds before the TTL runs out, with no probe in the
                // way: a lease that ends even slightly early refuses it.
                let before_ttl = Duration::from_millis(5 + rng.below(35));
                tokio::time::sleep_until(last_ack_sent + HOLD_TTL - before_ttl).await;
            } else {
                let wait = HOLD_TTL.mul_f64(0.3 + rng.below(600) as f64 / 1000.0);
                tokio::time::sleep(wait).await;
                if probe(history.clone()).await == Some(false) {
                    alive = false;
                    break;
                }
            }
            let sent = Instant::now();
            history.record(process, Kind::Invoke, "keepalive", &lease_key, Value::Null);
            match ctx.client.lease_keep_alive_once(grant.id).await {
                Ok(ttl) if !ttl.is_zero() => {
                    last_ack_sent = sent;
                    history.record(
                        process,
                        Kind::Ok,
                        "keepalive",
                        &lease_key,
                        json!(ttl.as_millis() as u64),
                    );
                }
                Ok(_) | Err(ClientError::LeaseExpired { .. }) => {
                    history.record(process, Kind::Fail, "keepalive", &lease_key, json!("gone"));
                    alive = false;
                    break;
                }
                Err(error) => {
                    history.record(
                        process,
                        Kind::Info,
                        "keepalive",
                        &lease_key,
                        json!(error.code()),
                    );
                }
            }
        }
        if !alive {
            continue;
        }
        history.record(process, Kind::Invoke, "stop", &lease_key, Value::Null);
        history.record(process, Kind::Ok, "stop", &lease_key, Value::Null);
        // Probe back to back from shortly before the TTL ends, so an early end is seen within
        // a round trip; more slowly once the TTL has passed.
        tokio::time::sleep_until(last_ack_sent + HOLD_TTL - Duration::from_millis(100)).await;
        let give_up = Instant::now() + Duration::from_secs(30);
        while Instant::now() < give_up {
            if probe(history.clone()).await == Some(false) {
                break;
            }
            if Instant::now() < last_ack_sent + HOLD_TTL + Duration::from_millis(200) {
                continue;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

/// Topics the topic workload publishes to.
pub const TOPICS: &[&str] = &["faults-topic-0", "faults-topic-1"];
/// Messages one inbox read asks for.
const INBOX_LIMIT: u32 = 50;
/// How long a consumer may take to drain its inbox once the run is over.
const DRAIN_MAX: Duration = Duration::from_secs(30);

/// Publishes unique messages to the topics, in exactly-once sessions (the client's own).
pub async fn publisher(ctx: Ctx, process: u64, history: Recorder) {
    let mut rng = Rng::new(ctx.seed ^ (process * 0x2b79));
    let topics = ctx.client.topics();
    let mut counter = 0u64;
    while ctx.running() {
        counter += 1;
        let topic = TOPICS[rng.below(TOPICS.len() as u64) as usize];
        let data = format!("p{process}-{counter}");
        history.record(process, Kind::Invoke, "publish", topic, json!(data));
        match topics.publish(topic, data.clone()).await {
            Ok(seq) => {
                history.record(process, Kind::Ok, "publish", topic, json!({"seq": seq}));
            }
            Err(error) => {
                history.record(
                    process,
                    outcome_of(&error),
                    "publish",
                    topic,
                    json!(error.code()),
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.below(20))).await;
    }
}

/// A consumer: reads its inbox on every topic, then acknowledges what it read (at least once
/// delivery). Once the run is over it drains its inbox and records that it did.
/// `ack_unread` acknowledges one message before reading it (the topic checker's negative
/// control: that message is never delivered).
pub async fn consumer(ctx: Ctx, process: u64, history: Recorder, ack_unread: bool) {
    let topics_api = ctx.client.topics();
    let name = format!("faults-consumer-{process}");
    let mut cheated = !ack_unread;
    let mut reads_with_messages = 0u64;
    let mut empty_in_a_row = 0;
    let mut drain_deadline: Option<Instant> = None;
    loop {
        if !ctx.running() && drain_deadline.is_none() {
            drain_deadline = Some(Instant::now() + DRAIN_MAX);
            empty_in_a_row = 0;
        }
        if let Some(deadline) = drain_deadline {
            if empty_in_a_row >= 2 {
                history.record(process, Kind::Invoke, "drained", &name, Value::Null);
                history.record(process, Kind::Ok, "drained", &name, Value::Null);
                return;
            }
            if Instant::now() >= deadline {
                return;
            }
        }
        history.record(process, Kind::Invoke, "inbox", &name, Value::Null);
        let options = conclave_client::InboxOptions {
            limit: INBOX_LIMIT,
            ack: false,
            wait: Duration::from_millis(200),
        };
        let messages = match topics_api.inbox(&name, TOPICS, options).await {
            Ok(messages) => messages,
            Err(_) => {
                // A read changes nothing: the checker ignores failed ones.
                history.record(process, Kind::Fail, "inbox", &name, Value::Null);
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let delivered: Vec<Value> = messages
            .iter()
            .map(|m| json!([m.topic, m.seq, String::from_utf8_lossy(&m.data)]))
            .collect();
        history.record(process, Kind::Ok, "inbox", &name, Value::Array(delivered));
        if messages.is_empty() {
            empty_in_a_row += 1;
            continue;
        }
        empty_in_a_row = 0;
        reads_with_messages += 1;
        for topic in TOPICS {
            let Some(last) = messages
                .iter()
                .filter(|m| m.topic == *topic)
                .map(|m| m.seq)
                .max()
            else {
                continue;
            };
            let mut seq = last;
            if !cheated && reads_with_messages >= 10 {
                // Acknowledge the next message before it was read (it may not exist yet:
                // then the ack is refused and the consumer tries again next time).
                seq = last + 1;
            }
            history.record(process, Kind::Invoke, "ack", topic, json!({"seq": seq}));
            match topics_api.ack(&name, topic, seq).await {
                Ok(acked) => {
                    if seq > last {
                        cheated = true;
                    }
                    history.record(process, Kind::Ok, "ack", topic, json!({"acked": acked}));
                }
                Err(error) => {
                    history.record(
                        process,
                        outcome_of(&error),
                        "ack",
                        topic,
                        json!(error.code()),
                    );
                }
            }
        }
    }
}

/// The work queue the queue workload pushes to and claims from.
pub const QUEUE: &str = "faults-queue";
/// How long a claim lasts: short, so a paused or partitioned worker's job is claimed again.
const QUEUE_CLAIM_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a claim waits for a job to become ready.
const QUEUE_CLAIM_WAIT: Duration = Duration::from_millis(200);
/// Claims allowed per job before it is dead-lettered: the most a queue allows
/// (`MAX_ATTEMPTS_MAX` in `conclave_state::queue`), so that faults never move a job out of the
/// queue the workers drain.
const QUEUE_MAX_ATTEMPTS: u32 = 10_000;
/// How long the workers may take to empty the queue once the run is over.
const QUEUE_DRAIN_MAX: Duration = Duration::from_secs(30);
/// Jobs waiting (ready or claimed) at which producers hold off. The workers are slower than
/// the producers (two calls per job, and one claim in twenty dawdles past its timeout), so
/// without a cap the backlog grows with the run's length: a 15-minute run left 100,000 jobs,
/// more than the workers drain in `QUEUE_DRAIN_MAX`, and the checker could not judge lost jobs.
const QUEUE_BACKLOG_MAX: u64 = 2_000;
/// Pushes between two looks at the backlog.
const QUEUE_BACKLOG_CHECK_EVERY: u64 = 50;
/// How long a producer holding off waits before it looks again.
const QUEUE_BACKLOG_WAIT: Duration = Duration::from_millis(200);

/// Pushes unique jobs (`p<process>-<n>`) to the queue, in the client's exactly-once session.
pub async fn producer(ctx: Ctx, process: u64, history: Recorder) {
    let mut rng = Rng::new(ctx.seed ^ (process * 0x51ed));
    let queues = ctx.client.queues();
    let mut counter = 0u64;
    while ctx.running() {
        counter += 1;
        if counter.is_multiple_of(QUEUE_BACKLOG_CHECK_EVERY) {
            // Stats that cannot be read (a fault) do not hold the producer up.
            while ctx.running()
                && queues.stats(QUEUE).await.is_ok_and(|stats| {
                    stats
                        .iter()
                        .map(|queue| queue.ready + queue.in_flight)
                        .sum::<u64>()
                        >= QUEUE_BACKLOG_MAX
                })
            {
                tokio::time::sleep(QUEUE_BACKLOG_WAIT).await;
            }
        }
        let payload = format!("p{process}-{counter}");
        history.record(process, Kind::Invoke, "push", QUEUE, json!(payload));
        let options = conclave_client::PushOptions {
            max_attempts: QUEUE_MAX_ATTEMPTS,
            ..Default::default()
        };
        match queues.push(QUEUE, payload.clone(), options).await {
            Ok(pushed) => {
                history.record(
                    process,
                    Kind::Ok,
                    "push",
                    QUEUE,
                    json!({"id": pushed.job_id}),
                );
            }
            Err(error) => {
                history.record(
                    process,
                    outcome_of(&error),
                    "push",
                    QUEUE,
                    json!(error.code()),
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.below(20))).await;
    }
}

/// A worker: claims a job, records it as delivered, and acknowledges it with the claim's
/// fence; now and then it dawdles past the claim's timeout first, so its late ack must be
/// refused. Once the run is over it drains the queue and records that it did.
/// `ack_unrecorded` acknowledges one job without recording its claim (the queue checker's
/// negative control: that job is done but was never delivered).
pub async fn queue_worker(ctx: Ctx, process: u64, history: Recorder, ack_unrecorded: bool) {
    let mut rng = Rng::new(ctx.seed ^ (process * 0x7a3b));
    let queues = ctx.client.queues();
    let worker = format!("faults-worker-{process}");
    let mut cheated = !ack_unrecorded;
    let mut claims = 0u64;
    let mut drain_deadline: Option<Instant> = None;
    let mut empty_since: Option<Instant> = None;
    loop {
        if !ctx.running() && drain_deadline.is_none() {
            drain_deadline = Some(Instant::now() + QUEUE_DRAIN_MAX);
            empty_since = None;
        }
        if let Some(deadline) = drain_deadline {
            // Empty for longer than a claim lasts: no claim that was lost in flight can
            // still hold a job back.
            let empty_for = empty_since.map(|since| since.elapsed());
            if empty_for.is_some_and(|d| d > QUEUE_CLAIM_TIMEOUT * 3) {
                history.record(process, Kind::Invoke, "drained", &worker, Value::Null);
                history.record(process, Kind::Ok, "drained", &worker, Value::Null);
                return;
            }
            if Instant::now() >= deadline {
                return;
            }
        }
        let options = conclave_client::ClaimOptions {
            worker: worker.clone(),
            visibility_timeout: QUEUE_CLAIM_TIMEOUT,
            wait: QUEUE_CLAIM_WAIT,
        };
        let hide = !cheated && claims >= 10;
        if !hide {
            history.record(process, Kind::Invoke, "claim", QUEUE, Value::Null);
        }
        let job = match queues.claim(QUEUE, options).await {
            Ok(Some(job)) => job,
            Ok(None) => {
                if !hide {
                    history.record(process, Kind::Ok, "claim", QUEUE, Value::Null);
                }
                empty_since.get_or_insert_with(Instant::now);
                continue;
            }
            Err(error) => {
                if !hide {
                    history.record(
                        process,
                        outcome_of(&error),
                        "claim",
                        QUEUE,
                        json!(error.code()),
                    );
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        empty_since = None;
        claims += 1;
        let payload = String::from_utf8_lossy(&job.payload).to_string();
        if !hide {
            let delivered = json!({"id": job.id, "payload": payload, "fence": job.fence});
            history.record(process, Kind::Ok, "claim", QUEUE, delivered);
        }
        if !hide && drain_deadline.is_none() && rng.below(20) == 0 {
            tokio::time::sleep(QUEUE_CLAIM_TIMEOUT + Duration::from_millis(300)).await;
        }
        let acked = json!({"id": job.id, "fence": job.fence});
        history.record(process, Kind::Invoke, "ack", QUEUE, acked);
        match queues.ack(QUEUE, job.id, job.fence).await {
            Ok(()) => {
                // The hidden job is done now, and lost to the history if no claim delivered
                // it before (its first attempt). Otherwise, or when the ack is refused and the
                // job is claimed again, the control tries with the next one.
                cheated |= hide && job.attempts == 1;
                history.record(process, Kind::Ok, "ack", QUEUE, Value::Null)
            }
            // A refused fence: the claim ran out and the ack certainly did nothing.
            Err(ClientError::LeadershipLost(_)) => {
                history.record(process, Kind::Fail, "ack", QUEUE, json!("stale"))
            }
            Err(error) => history.record(
                process,
                outcome_of(&error),
                "ack",
                QUEUE,
                json!(error.code()),
            ),
        };
    }
}
