//! The node's metrics in Prometheus' text format (`/metrics` on the metrics listener).
//!
//! Names follow etcd's where the meaning is the same, so etcd's dashboards and alert rules
//! work unchanged (`etcd_server_has_leader`, `etcd_disk_wal_fsync_duration_seconds`,
//! `grpc_server_handled_total`, ...); Conclave's own start with `conclave_`. docs/operations.md
//! lists every one.
//!
//! Two kinds of value: events the node counts as they happen ([`NodeMetrics`]: leader
//! changes, failed proposals, fsync and apply durations, gRPC calls), and values read from
//! the node's status, the applied state and the refusal counters when a scrape comes
//! ([`render`]).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::api::Api;
use crate::api::limits::Wait;
use crate::transport::PeerListenerState;

/// Distinct election groups `conclave_election_leader_changes_total` names; changes in
/// further groups are counted under `group="other"`, so a swarm that makes a group per task
/// cannot grow the scrape without bound.
pub const ELECTION_GROUP_LABELS_MAX: usize = 64;
/// The label that stands for every group past [`ELECTION_GROUP_LABELS_MAX`].
pub const OTHER_GROUP_LABEL: &str = "other";

/// etcd's buckets for disk durations: 1 ms to about 8 s, doubling.
fn disk_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.001, 2.0, 14)
}

/// Buckets for gRPC handling times: 0.1 ms to about 6.5 s, doubling.
fn grpc_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.0001, 2.0, 17)
}

/// etcd's labels of `grpc_server_handled_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GrpcLabels {
    pub grpc_type: &'static str,
    pub grpc_service: String,
    pub grpc_method: String,
    pub grpc_code: &'static str,
}

/// The labels of `grpc_server_handling_seconds`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GrpcMethodLabels {
    pub grpc_type: &'static str,
    pub grpc_service: String,
    pub grpc_method: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GroupLabels {
    group: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: &'static str,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn grpc_histogram() -> Histogram {
    Histogram::new(grpc_buckets())
}

/// What the node counts as it happens. One per node, shared by the driver thread, the gRPC
/// layer and the metrics listener; every field is a cheap atomic.
pub struct NodeMetrics {
    /// Leader changes this node saw (a new leader id, or none after one).
    pub leader_changes_seen: Counter,
    /// Proposals that failed (lost to a leader change, refused, timed out in the core).
    pub proposals_failed: Counter,
    /// WAL fsyncs, in seconds.
    pub wal_fsync_seconds: Histogram,
    /// Applying one batch of committed entries to the state machine, in seconds (etcd's
    /// backend commit).
    pub backend_commit_seconds: Histogram,
    /// Encoding and writing one snapshot, in seconds.
    pub snapshot_save_seconds: Histogram,
    /// Fsyncs over `wal_fsync_warn_ms` (each logged at WARN).
    pub wal_fsyncs_slow: Counter,
    /// Driver turns that started later than a heartbeat interval after the previous one: the
    /// leader's heartbeats went out late (each logged at WARN, rate-limited).
    pub heartbeats_late: Counter,
    /// ReadIndex requests the leader answered from its lease (`--lease-reads`).
    pub reads_from_lease: Counter,
    /// gRPC calls handled, by etcd's labels.
    pub grpc_handled: Family<GrpcLabels, Counter>,
    /// How long gRPC calls took, by method.
    pub grpc_handling_seconds: HistogramFamily<GrpcMethodLabels>,
    /// KV Put calls handled, and their summed handling time in microseconds, for the
    /// dashboard's chart.
    pub kv_puts: Counter,
    pub kv_put_micros: Counter,
    /// New leaders of priority election groups, by group (capped; see
    /// [`ELECTION_GROUP_LABELS_MAX`]).
    election_leader_changes: Mutex<BTreeMap<String, u64>>,
}

impl Default for NodeMetrics {
    fn default() -> Self {
        NodeMetrics {
            leader_changes_seen: Counter::default(),
            proposals_failed: Counter::default(),
            wal_fsync_seconds: Histogram::new(disk_buckets()),
            backend_commit_seconds: Histogram::new(disk_buckets()),
            snapshot_save_seconds: Histogram::new(disk_buckets()),
            wal_fsyncs_slow: Counter::default(),
            heartbeats_late: Counter::default(),
            reads_from_lease: Counter::default(),
            grpc_handled: Family::default(),
            kv_puts: Counter::default(),
            kv_put_micros: Counter::default(),
            grpc_handling_seconds: Family::new_with_constructor(grpc_histogram),
            election_leader_changes: Mutex::new(BTreeMap::new()),
        }
    }
}

impl NodeMetrics {
    /// Counts a new leader in election group `group`; past the cap, under "other".
    pub fn election_leader_changed(&self, group: &str) {
        let mut changes = self
            .election_leader_changes
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let known = changes.contains_key(group);
        // One slot is kept for "other" itself.
        let label = if known || changes.len() < ELECTION_GROUP_LABELS_MAX {
            group
        } else {
            OTHER_GROUP_LABEL
        };
        *changes.entry(label.to_owned()).or_insert(0) += 1;
    }

    /// The election leader changes by group label, as exported.
    pub fn election_leader_changes(&self) -> BTreeMap<String, u64> {
        self.election_leader_changes
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    /// Records one gRPC call's outcome and duration.
    pub fn grpc_call(&self, method: GrpcMethodLabels, code: &'static str, took: Duration) {
        self.grpc_handled
            .get_or_create(&GrpcLabels {
                grpc_type: method.grpc_type,
                grpc_service: method.grpc_service.clone(),
                grpc_method: method.grpc_method.clone(),
                grpc_code: code,
            })
            .inc();
        self.grpc_handling_seconds
            .get_or_create(&method)
            .observe(took.as_secs_f64());
    }
}

/// The state-machine figures a scrape and the dashboard report.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StateFigures {
    pub election_groups: u64,
    pub locks_held: u64,
    pub topics: u64,
    pub topic_messages: u64,
    pub sessions: u64,
    pub queues: u64,
    /// Jobs held over all work queues: ready, delayed (not yet claimable), claimed.
    pub queue_jobs_ready: u64,
    pub queue_jobs_delayed: u64,
    pub queue_jobs_in_flight: u64,
    pub leases: u64,
    pub keys: u64,
    pub revision: i64,
}

/// Reads [`StateFigures`] from the applied state.
pub fn state_figures(api: &Api) -> StateFigures {
    let locks = crate::observe::lock_queues(api);
    api.node.read_state(|state| {
        let topics = state.topics();
        let topic_messages = topics
            .names()
            .map(|name| {
                let read = topics.read(name, u64::MAX, 1);
                read.last_seq
                    .saturating_sub(read.first_seq.saturating_sub(1))
            })
            .sum();
        let (mut queues, mut ready, mut delayed, mut in_flight) = (0u64, 0u64, 0u64, 0u64);
        for name in state.work_queue_names_from("") {
            if let Some(queue) = state.work_queue(name) {
                let stats = queue.stats();
                queues += 1;
                ready += stats.ready;
                delayed += stats.delayed;
                in_flight += stats.in_flight;
            }
        }
        StateFigures {
            queues,
            queue_jobs_ready: ready,
            queue_jobs_delayed: delayed,
            queue_jobs_in_flight: in_flight,
            election_groups: state.group_names().count() as u64,
            locks_held: locks.iter().filter(|q| !q.waiters.is_empty()).count() as u64,
            topics: topics.len() as u64,
            topic_messages,
            sessions: state.session_count() as u64,
            leases: state.leases().len() as u64,
            keys: state.kv().live_key_count() as u64,
            revision: state.revision(),
        }
    })
}

fn gauge(value: i64) -> Gauge {
    let gauge = Gauge::default();
    gauge.set(value);
    gauge
}

/// The whole scrape, in the OpenMetrics text format (which Prometheus reads).
pub fn render(api: &Api, peers: &PeerListenerState) -> String {
    let metrics = api.node.metrics();
    let status = api.node.status();
    let figures = state_figures(api);
    let mut registry = Registry::default();

    // ---- etcd's names ----------------------------------------------------------------------
    registry.register(
        "etcd_server_has_leader",
        "Whether or not a leader exists. 1 is existence, 0 is not.",
        gauge(i64::from(
            status.leader.is_some() && status.stopped.is_none(),
        )),
    );
    registry.register(
        "etcd_server_is_leader",
        "Whether or not this member is a leader. 1 if is, 0 otherwise.",
        gauge(i64::from(
            status.leader.is_some() && status.leader == Some(status.id),
        )),
    );
    registry.register(
        "etcd_server_leader_changes_seen",
        "The number of leader changes seen.",
        metrics.leader_changes_seen.clone(),
    );
    // etcd exports these two as gauges holding the commit and applied index.
    registry.register(
        "etcd_server_proposals_committed_total",
        "The total number of consensus proposals committed.",
        gauge(status.commit_index as i64),
    );
    registry.register(
        "etcd_server_proposals_applied_total",
        "The total number of consensus proposals applied.",
        gauge(status.applied_index as i64),
    );
    registry.register(
        "etcd_server_proposals_pending",
        "The current number of pending proposals to commit.",
        gauge(status.proposals_pending as i64),
    );
    registry.register(
        "etcd_server_proposals_failed",
        "The total number of failed proposals seen.",
        metrics.proposals_failed.clone(),
    );
    registry.register(
        "etcd_server_id",
        "Server or member ID in hexadecimal format. 1 for 'server_id' label with current ID.",
        {
            let family = Family::<Vec<(String, String)>, Gauge>::default();
            family
                .get_or_create(&vec![("server_id".into(), format!("{:x}", status.id))])
                .set(1);
            family
        },
    );
    registry.register(
        "etcd_disk_wal_fsync_duration_seconds",
        "The latency distributions of fsync called by WAL.",
        metrics.wal_fsync_seconds.clone(),
    );
    registry.register(
        "etcd_disk_backend_commit_duration_seconds",
        "The latency distributions of commit called by backend (here: applying a batch of \
         committed entries to the state machine).",
        metrics.backend_commit_seconds.clone(),
    );
    registry.register(
        "etcd_debugging_snap_save_total_duration_seconds",
        "The total latency distributions of save called by snapshot.",
        metrics.snapshot_save_seconds.clone(),
    );
    let db_bytes = crate::node::dir_size_bytes(&api.config.data_dir) as i64;
    registry.register(
        "etcd_mvcc_db_total_size_in_bytes",
        "Total size of the underlying database physically allocated in bytes (here: the data \
         directory: WAL segments and snapshots).",
        gauge(db_bytes),
    );
    registry.register(
        "etcd_debugging_mvcc_keys_total",
        "Total number of keys.",
        gauge(figures.keys as i64),
    );
    registry.register(
        "etcd_debugging_mvcc_current_revision",
        "The current revision of store.",
        gauge(figures.revision),
    );
    registry.register(
        "etcd_debugging_lease_total",
        "The number of leases.",
        gauge(figures.leases as i64),
    );
    registry.register(
        "grpc_server_handled",
        "Total number of RPCs completed on the server, regardless of success or failure.",
        metrics.grpc_handled.clone(),
    );
    registry.register(
        "grpc_server_handling_seconds",
        "Histogram of response latency (seconds) of gRPC that had been application-level \
         handled by the server.",
        metrics.grpc_handling_seconds.clone(),
    );

    // ---- Conclave's own --------------------------------------------------------------------
    registry.register(
        "conclave_raft_term",
        "The Raft term this member is in.",
        gauge(status.term as i64),
    );
    registry.register(
        "conclave_raft_last_index",
        "The index of the last entry in this member's log.",
        gauge(status.last_index as i64),
    );
    registry.register(
        "conclave_election_groups",
        "Priority election groups in the applied state.",
        gauge(figures.election_groups as i64),
    );
    let groups = Family::<GroupLabels, Counter>::default();
    for (group, changes) in metrics.election_leader_changes() {
        groups.get_or_create(&GroupLabels { group }).inc_by(changes);
    }
    registry.register(
        "conclave_election_leader_changes",
        "New leaders of priority election groups this member applied, by group (at most 64 \
         groups by name, the rest as group=\"other\").",
        groups,
    );
    registry.register(
        "conclave_locks_held",
        "Lock and etcd-election queues (keys <name>/<lease hex> on a lease) with a holder.",
        gauge(figures.locks_held as i64),
    );
    registry.register(
        "conclave_topics",
        "Topics in the applied state.",
        gauge(figures.topics as i64),
    );
    registry.register(
        "conclave_topic_messages",
        "Messages retained over all topics.",
        gauge(figures.topic_messages as i64),
    );
    registry.register(
        "conclave_queues",
        "Work queues in the applied state (dead-letter queues included).",
        gauge(figures.queues as i64),
    );
    let queue_depth = Family::<StateLabels, Gauge>::default();
    for (state, jobs) in [
        ("ready", figures.queue_jobs_ready),
        ("delayed", figures.queue_jobs_delayed),
        ("in_flight", figures.queue_jobs_in_flight),
    ] {
        queue_depth
            .get_or_create(&StateLabels { state })
            .set(jobs as i64);
    }
    registry.register(
        "conclave_queue_depth",
        "Jobs held over all work queues, by state: ready, delayed, in_flight (claimed).",
        queue_depth,
    );
    registry.register(
        "conclave_sessions",
        "Exactly-once client sessions in the applied state.",
        gauge(figures.sessions as i64),
    );
    registry.register(
        "conclave_subscriptions",
        "Clients' live subscriptions to this member's applied events: watches, election \
         observers, and calls waiting for a change (lock, campaign, queue claim, inbox).",
        gauge(api.node.subscriptions().load(Ordering::Relaxed) as i64),
    );
    registry.register(
        "conclave_wal_fsyncs_slow",
        "WAL fsyncs slower than wal_fsync_warn_ms (each logged at WARN).",
        metrics.wal_fsyncs_slow.clone(),
    );
    registry.register(
        "conclave_heartbeats_late",
        "Driver turns that came more than a heartbeat interval late, so a leader's \
         heartbeats went out late (each logged at WARN, rate-limited).",
        metrics.heartbeats_late.clone(),
    );
    registry.register(
        "conclave_reads_from_lease",
        "ReadIndex requests (all of one driver turn's reads on a member, or a follower's \
         request) the leader answered from its lease with no heartbeat round (--lease-reads).",
        metrics.reads_from_lease.clone(),
    );

    let peer_refusals = Family::<ReasonLabels, Counter>::default();
    let stats = &peers.stats;
    let peer_reasons: [(&'static str, u64); 9] = [
        ("core_refused", status.refused_peer_messages),
        (
            "handshake_refused",
            stats.handshakes_refused.load(Ordering::Relaxed),
        ),
        (
            "authentication_failed",
            stats.authentication_failures.load(Ordering::Relaxed),
        ),
        (
            "handshake_timeout",
            stats.handshake_timeouts.load(Ordering::Relaxed),
        ),
        (
            "handshakes_over_limit",
            stats.handshakes_over_limit.load(Ordering::Relaxed),
        ),
        (
            "connections_over_limit",
            stats.connections_over_limit.load(Ordering::Relaxed),
        ),
        (
            "connection_idle_closed",
            stats.connections_idle_closed.load(Ordering::Relaxed),
        ),
        (
            "wrong_sender",
            stats.messages_wrong_sender.load(Ordering::Relaxed),
        ),
        (
            "wrong_recipient",
            stats.messages_wrong_recipient.load(Ordering::Relaxed),
        ),
    ];
    for (reason, value) in peer_reasons {
        peer_refusals
            .get_or_create(&ReasonLabels { reason })
            .inc_by(value);
    }
    registry.register(
        "conclave_peer_refused",
        "Peer connections and messages refused or dropped, by reason.",
        peer_refusals,
    );

    let client_refusals = Family::<ReasonLabels, Counter>::default();
    let limits = &api.limits;
    let client_stats = &limits.stats;
    let mut client_reasons: Vec<(&'static str, u64)> = vec![
        (
            "connections_max",
            client_stats.connections_refused.load(Ordering::Relaxed),
        ),
        (
            "idle_timeout",
            client_stats.connections_idle_closed.load(Ordering::Relaxed),
        ),
        (
            "watches_max",
            client_stats.watches_refused.load(Ordering::Relaxed),
        ),
        (
            "lease_keepalive_streams_max",
            client_stats
                .lease_keepalive_streams_refused
                .load(Ordering::Relaxed),
        ),
        (
            "topics_per_request_max",
            client_stats.inbox_requests_refused.load(Ordering::Relaxed),
        ),
        (
            "range_response_bytes_max",
            client_stats.ranges_refused.load(Ordering::Relaxed),
        ),
    ];
    for kind in Wait::ALL {
        let reason = match kind {
            Wait::TopicSubscription => "topic_subscriptions_max",
            Wait::ElectionObserver => "election_observers_max",
            Wait::Lock => "lock_waits_max",
            Wait::QueueClaim => "queue_claim_waits_max",
            Wait::Campaign => "campaign_waits_max",
        };
        client_reasons.push((reason, limits.waits_refused(kind)));
    }
    for (reason, value) in client_reasons {
        client_refusals
            .get_or_create(&ReasonLabels { reason })
            .inc_by(value);
    }
    registry.register(
        "conclave_client_refused",
        "Client connections and requests refused by a cap, by the cap's flag.",
        client_refusals,
    );
    registry.register(
        "conclave_up",
        "1 while this member's Raft driver runs.",
        gauge(i64::from(status.stopped.is_none())),
    );

    let mut text = String::new();
    // Writing into a String cannot fail.
    let _ = encode(&mut text, &registry);
    text
}
