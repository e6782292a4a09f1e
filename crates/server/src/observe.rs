//! What the dashboard (`/ui`) and `conclave top` show: one JSON document with the members,
//! the election groups, the locks, the topics and the write rate, built by one task per node
//! and pushed to every viewer (server-sent events on `/ui/events`, one shot on
//! `/api/v1/overview`).
//!
//! The members' rows come from each member's own Maintenance.Status (asked over the client
//! port with a short deadline), so a member that is down or cut off shows as unreachable
//! rather than with stale figures.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use conclave_proto::etcdserverpb::StatusRequest;
use conclave_proto::etcdserverpb::maintenance_client::MaintenanceClient;
use conclave_raft::{NodeId, Role};
use conclave_state::{LeaseResume, RESERVED_PREFIX, RangeRequest};
use serde_json::{Value, json};
use tokio::sync::{broadcast, watch};
use tonic::transport::{Channel, Endpoint};

use crate::api::Api;

/// How long the overview waits for another member's status before it shows it unreachable.
pub const MEMBER_STATUS_TIMEOUT_MS: u64 = 400;
/// The overview is rebuilt at least this often, even when nothing happened (ages move).
pub const OVERVIEW_REFRESH_MS: u64 = 1_000;
/// And at most this often, however busy the node is: a leader change still shows well
/// within a second.
pub const OVERVIEW_SPACING_MS: u64 = 150;
/// Keys the lock view scans at most (keys only, in key order); past it the view says it is
/// partial rather than stall the node's apply lock on a huge store.
pub const LOCK_SCAN_KEYS_MAX: i64 = 100_000;
/// Rows of each kind (groups, locks, topics) the overview lists at most.
pub const OVERVIEW_ROWS_MAX: usize = 200;
/// Samples of the put rate the chart keeps (one per rebuild, at most one a second).
pub const RATE_HISTORY_MAX: usize = 120;

/// A lock (or etcd election) queue: keys `<name>/<lease hex>` on that lease, oldest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockQueue {
    pub name: String,
    /// (key, lease, create revision) in order of arrival; the first holds the lock.
    pub waiters: Vec<(String, i64, i64)>,
}

/// The lock queues in the applied state, and whether the scan stopped at its cap.
pub fn lock_queues(api: &Api) -> Vec<LockQueue> {
    lock_queues_capped(api).0
}

fn lock_queues_capped(api: &Api) -> (Vec<LockQueue>, bool) {
    let request = RangeRequest {
        key: bytes::Bytes::from_static(b"\0"),
        range_end: bytes::Bytes::from_static(b"\0"),
        limit: LOCK_SCAN_KEYS_MAX,
        keys_only: true,
        ..RangeRequest::default()
    };
    let Ok(answer) = api.node.read_state(|state| state.range(&request)) else {
        return (Vec::new(), false);
    };
    let mut queues: BTreeMap<String, Vec<(String, i64, i64)>> = BTreeMap::new();
    for kv in &answer.kvs {
        if kv.lease == 0 || kv.key.starts_with(RESERVED_PREFIX) {
            continue;
        }
        let key = String::from_utf8_lossy(&kv.key).into_owned();
        let suffix = format!("/{:x}", kv.lease);
        if let Some(name) = key.strip_suffix(&suffix).filter(|n| !n.is_empty()) {
            queues.entry(name.to_owned()).or_default().push((
                key.clone(),
                kv.lease,
                kv.create_revision,
            ));
        }
    }
    let queues = queues
        .into_iter()
        .map(|(name, mut waiters)| {
            waiters.sort_by_key(|w| w.2);
            LockQueue { name, waiters }
        })
        .collect();
    (queues, answer.more)
}

/// One put-rate sample for the chart.
#[derive(Debug, Clone, Copy)]
struct RateSample {
    at_ms: u64,
    puts_per_s: f64,
    put_latency_ms: f64,
}

/// Builds the overview and keeps what it needs between builds: channels to the other
/// members and the put counters of the last build.
pub struct Overview {
    api: Arc<Api>,
    channels: Mutex<HashMap<NodeId, (String, Channel)>>,
    last_puts: Mutex<Option<(Instant, u64, u64)>>,
    history: Mutex<VecDeque<RateSample>>,
}

impl Overview {
    pub fn new(api: Arc<Api>) -> Arc<Overview> {
        Arc::new(Overview {
            api,
            channels: Mutex::new(HashMap::new()),
            last_puts: Mutex::new(None),
            history: Mutex::new(VecDeque::new()),
        })
    }

    /// A lazily connected channel to member `id`'s client port, kept between calls.
    pub fn member_channel(&self, id: NodeId) -> Option<Channel> {
        let address = self.api.client_address(id)?;
        let mut channels = self
            .channels
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some((known, channel)) = channels.get(&id)
            && *known == address
        {
            return Some(channel.clone());
        }
        let channel = Endpoint::from_shared(format!("http://{address}"))
            .ok()?
            .connect_timeout(Duration::from_millis(MEMBER_STATUS_TIMEOUT_MS))
            .connect_lazy();
        channels.insert(id, (address, channel.clone()));
        Some(channel)
    }

    /// Every member's row: this node's from its own status, the others' from their
    /// Maintenance.Status, asked in parallel.
    async fn members(&self) -> Vec<Value> {
        let status = self.api.node.status();
        let mut ids: Vec<NodeId> = status
            .conf_state
            .voters
            .iter()
            .chain(status.conf_state.learners.iter())
            .copied()
            .collect();
        ids.sort_unstable();
        ids.dedup();
        let names: BTreeMap<NodeId, String> = status
            .members
            .iter()
            .map(|m| (m.id, m.name.clone()))
            .collect();
        let mut asks = Vec::new();
        for &id in &ids {
            let channel = (id != status.id).then(|| self.member_channel(id)).flatten();
            asks.push(tokio::spawn(async move {
                let channel = channel?;
                let mut client = MaintenanceClient::new(channel);
                let ask = client.status(StatusRequest {});
                match tokio::time::timeout(Duration::from_millis(MEMBER_STATUS_TIMEOUT_MS), ask)
                    .await
                {
                    Ok(Ok(answer)) => Some(Ok(answer.into_inner())),
                    Ok(Err(status)) => Some(Err(status.message().to_owned())),
                    Err(_) => Some(Err("no answer in time".to_owned())),
                }
            }));
        }
        let leader_commit = status.commit_index;
        let mut rows = Vec::new();
        for (id, ask) in ids.into_iter().zip(asks) {
            let name = names.get(&id).cloned().unwrap_or_default();
            let learner = status.conf_state.learners.contains(&id);
            if id == status.id {
                let role = match status.role {
                    Some(Role::Leader) => "leader",
                    Some(Role::Candidate) | Some(Role::PreCandidate) => "candidate",
                    _ if learner => "learner",
                    _ => "follower",
                };
                rows.push(json!({
                    "id": format!("{id:x}"), "name": name, "self": true,
                    "reachable": true, "role": role, "term": status.term,
                    "leader": status.leader.map(|l| format!("{l:x}")),
                    "commit": status.commit_index, "applied": status.applied_index,
                    "healthy": status.leader.is_some() && status.stopped.is_none(),
                    "lag": leader_commit.saturating_sub(status.applied_index),
                }));
                continue;
            }
            let answer = ask.await.ok().flatten();
            match answer {
                Some(Ok(peer)) => {
                    let role = if peer.leader == id {
                        "leader"
                    } else if peer.is_learner {
                        "learner"
                    } else {
                        "follower"
                    };
                    rows.push(json!({
                        "id": format!("{id:x}"), "name": name, "self": false,
                        "reachable": true, "role": role, "term": peer.raft_term,
                        "leader": (peer.leader != 0).then(|| format!("{:x}", peer.leader)),
                        "commit": peer.raft_index, "applied": peer.raft_applied_index,
                        "healthy": peer.leader != 0 && peer.errors.is_empty(),
                        "lag": leader_commit.saturating_sub(peer.raft_applied_index),
                    }));
                }
                Some(Err(error)) => rows.push(json!({
                    "id": format!("{id:x}"), "name": name, "self": false,
                    "reachable": false, "role": "unreachable", "healthy": false,
                    "error": error,
                })),
                None => rows.push(json!({
                    "id": format!("{id:x}"), "name": name, "self": false,
                    "reachable": false, "role": "unknown", "healthy": false,
                    "error": "no client address known",
                })),
            }
        }
        rows
    }

    fn groups(&self) -> Vec<Value> {
        self.api.node.read_state(|state| {
            let now_ms = state.now_ms();
            let age = |lease_id: i64| -> Option<u64> {
                match state.lease(lease_id)?.resume {
                    LeaseResume::Renewed { at_ms } => Some(now_ms.saturating_sub(at_ms)),
                    LeaseResume::Deadline { .. } => None,
                }
            };
            state
                .group_names()
                .take(OVERVIEW_ROWS_MAX)
                .filter_map(|name| {
                    let group = state.group(name)?;
                    let candidates: Vec<Value> = group
                        .succession()
                        .into_iter()
                        .map(|c| {
                            json!({
                                "id": c.id, "priority": c.priority,
                                "lease": format!("{:x}", c.lease_id),
                                "keepalive_age_ms": age(c.lease_id),
                            })
                        })
                        .collect();
                    let seat = group.seat.as_ref();
                    let leader = seat.and_then(|s| group.candidates.get(&s.leader));
                    Some(json!({
                        "name": name,
                        "leader": seat.map(|s| s.leader.clone()),
                        "priority": leader.map(|c| c.priority),
                        "fence": seat.map(|s| s.fence),
                        "term": group.term,
                        "leader_since_ms": seat.map(|s| now_ms.saturating_sub(s.since_ms)),
                        "leader_keepalive_age_ms": leader.and_then(|c| age(c.lease_id)),
                        "handoff_to": seat.and_then(|s| s.handoff.as_ref()).map(|h| h.challenger.clone()),
                        "candidates": candidates,
                    }))
                })
                .collect()
        })
    }

    fn locks(&self) -> (Vec<Value>, bool) {
        let (queues, partial) = lock_queues_capped(&self.api);
        let rows = queues
            .into_iter()
            .take(OVERVIEW_ROWS_MAX)
            .map(|queue| {
                let holder = queue.waiters.first();
                json!({
                    "name": queue.name,
                    "holder": holder.map(|h| h.0.clone()),
                    "lease": holder.map(|h| format!("{:x}", h.1)),
                    "fence": holder.map(|h| h.2),
                    "waiting": queue.waiters.len().saturating_sub(1),
                })
            })
            .collect();
        (rows, partial)
    }

    fn topics(&self) -> Vec<Value> {
        self.api.node.read_state(|state| {
            let topics = state.topics();
            let mut consumers: BTreeMap<&str, Vec<(&str, u64)>> = BTreeMap::new();
            for (consumer, topic, seq) in topics.cursors() {
                consumers.entry(topic).or_default().push((consumer, seq));
            }
            topics
                .names()
                .take(OVERVIEW_ROWS_MAX)
                .map(|name| {
                    let read = topics.read(name, u64::MAX, 1);
                    let depth = read
                        .last_seq
                        .saturating_sub(read.first_seq.saturating_sub(1));
                    let lags: Vec<Value> = consumers
                        .get(name)
                        .map(|list| {
                            list.iter()
                                .take(OVERVIEW_ROWS_MAX)
                                .map(|(consumer, seq)| {
                                    json!({"consumer": consumer, "acked": seq,
                                           "lag": read.last_seq.saturating_sub(*seq)})
                                })
                                .collect()
                        })
                        .unwrap_or_default();
                    json!({"name": name, "first_seq": read.first_seq, "last_seq": read.last_seq,
                           "depth": depth, "consumers": lags})
                })
                .collect()
        })
    }

    /// Puts per second and their mean latency since the last build, kept for the chart.
    fn rates(&self) -> Value {
        let metrics = self.api.node.metrics();
        let puts = metrics.kv_puts.get();
        let micros = metrics.kv_put_micros.get();
        let now = Instant::now();
        let mut last = self
            .last_puts
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut history = self
            .history
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some((at, last_puts, last_micros)) = *last {
            let seconds = now.duration_since(at).as_secs_f64();
            if seconds >= 1.0 {
                let done = puts.saturating_sub(last_puts);
                let sample = RateSample {
                    at_ms: crate::node::member_clock_ms(),
                    puts_per_s: done as f64 / seconds,
                    put_latency_ms: if done == 0 {
                        0.0
                    } else {
                        micros.saturating_sub(last_micros) as f64 / done as f64 / 1e3
                    },
                };
                if history.len() == RATE_HISTORY_MAX {
                    history.pop_front();
                }
                history.push_back(sample);
                *last = Some((now, puts, micros));
            }
        } else {
            *last = Some((now, puts, micros));
        }
        let samples: Vec<Value> = history
            .iter()
            .map(|s| json!({"at_ms": s.at_ms, "puts_per_s": s.puts_per_s, "put_latency_ms": s.put_latency_ms}))
            .collect();
        json!({"puts_total": puts, "samples": samples})
    }

    /// The whole overview document.
    pub async fn build(&self) -> Value {
        let status = self.api.node.status();
        let members = self.members().await;
        let (locks, locks_partial) = self.locks();
        json!({
            "cluster_id": format!("{:x}", self.api.cluster_id),
            "member": format!("{:x}", status.id),
            "leader": status.leader.map(|l| format!("{l:x}")),
            "term": status.term,
            "time_ms": crate::node::member_clock_ms(),
            "members": members,
            "groups": self.groups(),
            "locks": locks,
            "locks_partial": locks_partial,
            "topics": self.topics(),
            "rates": self.rates(),
        })
    }

    /// While someone watches, rebuilds the overview whenever the node's status or applied
    /// state changes (at most every [`OVERVIEW_SPACING_MS`], at least every
    /// [`OVERVIEW_REFRESH_MS`]) and publishes it on `out`, until the node stops.
    pub async fn publish(self: Arc<Self>, out: watch::Sender<Arc<String>>) {
        let mut status = self.api.node.status.clone();
        let mut events = self.api.node.events.subscribe();
        loop {
            // The listener keeps one receiver itself; without a viewer nothing is built, so
            // an unwatched member pays nothing for the dashboard.
            if out.receiver_count() <= 1 {
                if status.has_changed().is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(OVERVIEW_SPACING_MS)).await;
                continue;
            }
            let document = self.build().await;
            if out.send(Arc::new(document.to_string())).is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(OVERVIEW_SPACING_MS)).await;
            let refresh = tokio::time::sleep(Duration::from_millis(
                OVERVIEW_REFRESH_MS.saturating_sub(OVERVIEW_SPACING_MS),
            ));
            tokio::select! {
                _ = refresh => {}
                changed = status.changed() => if changed.is_err() { return },
                event = events.recv() => if let Err(broadcast::error::RecvError::Closed) = event { return },
                _ = out.closed() => return,
            }
        }
    }
}
