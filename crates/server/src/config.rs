//! A node's configuration: who the members are, where to listen, how fast to tick, and every
//! limit the runtime enforces. [`ServerConfig::validate`] checks it before anything starts, so
//! a bad value stops the node with one sentence rather than a panic later.

use std::collections::BTreeSet;
use std::path::PathBuf;

use conclave_raft::NodeId;

use crate::error::Error;

/// etcd's default `--max-request-bytes`: larger requests fail with "request is too large".
pub const REQUEST_BYTES_MAX: usize = 1536 * 1024;
/// gRPC framing and protobuf overhead allowed on top of [`REQUEST_BYTES_MAX`] before tonic
/// refuses to decode a message at all (so oversized requests get etcd's error, not a codec one).
pub const GRPC_DECODE_SLACK_BYTES: usize = 512 * 1024;
/// etcd's limit on what one gRPC response may carry (math.MaxInt32 in etcd; we are stricter).
pub const GRPC_RESPONSE_BYTES_MAX: usize = 256 * 1024 * 1024;

/// One member of the cluster as every node sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub id: NodeId,
    pub name: String,
    /// `host:port` other members dial for Raft traffic.
    pub peer_addr: String,
    /// `host:port` of the member's gRPC API, where a follower forwards writes.
    pub client_addr: String,
}

/// Everything a node needs to run. Times are in milliseconds, sizes in bytes.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// This node's id; must be one of `members`.
    pub id: NodeId,
    pub data_dir: PathBuf,
    /// Where the gRPC API listens (etcd's client port).
    pub listen_client: String,
    /// Where peers connect for Raft messages.
    pub listen_peer: String,
    /// The founding members (used to bootstrap a fresh data directory and to route).
    pub members: Vec<Member>,
    /// Length of one Raft tick.
    pub tick_ms: u64,
    /// Election timeout in ticks (randomized in [T, 2T) by the core).
    pub election_ticks: u64,
    /// Heartbeat interval in ticks.
    pub heartbeat_ticks: u64,
    /// Answer linearizable reads and lease keepalives on the leader from a leader lease,
    /// with no heartbeat round (`--lease-reads`; off by default). See
    /// [`ServerConfig::lease_read_ms`]. Members may differ in it; they must not differ in
    /// `tick_ms` and `election_ticks` (a member with a lease refuses peers whose vote window,
    /// [`ServerConfig::vote_withheld_ms`], is shorter than its own).
    pub lease_reads: bool,
    /// Take a snapshot (and compact the log) every this many applied entries...
    pub snapshot_entries: u64,
    /// ...once the entries applied since the last snapshot also add up to this percentage of
    /// that snapshot's size (`--snapshot-log-percent`; 0: entries alone decide). See
    /// [`DEFAULT_SNAPSHOT_LOG_PERCENT`].
    pub snapshot_log_percent: u64,
    /// The largest snapshot this node accepts from a leader (`--snapshot-bytes-max`): a
    /// follower assembles an incoming snapshot in memory, and a transfer that grows past this
    /// is refused and discarded. Set it alike on every member, above the state's snapshot size.
    pub snapshot_bytes_max: u64,
    /// Longest a request waits (for a leader, a commit, a read) when the client set no
    /// shorter gRPC deadline.
    pub request_timeout_ms: u64,
    /// Proposals waiting for their commit on this node; more fail with "too many requests".
    pub proposals_inflight_max: usize,
    /// Linearizable reads waiting for their read index on this node.
    pub reads_inflight_max: usize,
    /// Client requests queued for the Raft driver before callers wait.
    pub driver_queue_requests_max: usize,
    /// Peer messages queued for the Raft driver before the transport slows down.
    pub driver_queue_messages_max: usize,
    /// Largest client request (etcd's `--max-request-bytes`).
    pub request_bytes_max: usize,
    /// How long a leader shutting down waits for its successor before it just stops.
    pub shutdown_transfer_timeout_ms: u64,
    /// This node joins a running cluster (etcd's `--initial-cluster-state existing`): a fresh
    /// data directory is not bootstrapped, the leader sends a snapshot, and `members` is the
    /// founding list plus this node, which the cluster id leaves out.
    pub join: bool,
    /// The id of the cluster a joining node joins (`--initial-cluster-id`, from `member add`).
    /// When given, `members` may be the current members rather than the founding list; when
    /// not, the id is derived from `members` as the founders derived it.
    pub cluster_id_given: Option<u64>,
    /// The file holding the cluster's peer secret (`--peer-secret-file`), the same on every
    /// member. Without one, peers authenticate with a key derived from the cluster id, which
    /// anyone who can read a response header knows (see docs/security.md, The peer port).
    pub peer_secret_file: Option<PathBuf>,
    /// TLS on the client port (`--cert-file --key-file [--trusted-ca-file --client-cert-auth]`).
    pub client_tls: Option<crate::tls::ClientTlsFiles>,
    /// Mutual TLS on the peer port (`--peer-cert-file --peer-key-file --peer-trusted-ca-file`).
    pub peer_tls: Option<crate::tls::PeerTlsFiles>,
    /// What clients may hold on this node (connections, streams, watches, ...).
    pub client_limits: ClientLimits,
    /// Automatic history compaction (`--auto-compaction-mode`, `--auto-compaction-retention`).
    pub auto_compaction: crate::compactor::AutoCompaction,
    /// Password hashing and auth tokens (`docs/security.md`, Authentication).
    pub auth: AuthConfig,
    /// Where the metrics listener serves `/metrics`, `/health`, `/readyz` and the `/ui`
    /// dashboard (`--listen-metrics`); `None`: not at all. The CLI's default is the client
    /// host with the client port plus `http::METRICS_PORT_OFFSET`.
    pub listen_metrics: Option<String>,
    /// The metrics address is the default, not asked for: if it cannot be bound (the port
    /// is taken), the node logs a WARN and runs without it instead of refusing to start.
    pub listen_metrics_optional: bool,
    /// A WAL fsync slower than this is logged at WARN and counted
    /// (`conclave_wal_fsyncs_slow_total`); etcd warns at one second too.
    pub wal_fsync_warn_ms: u64,
}

/// The slowest bcrypt cost accepted (each step doubles the work; 31 is bcrypt's own limit).
pub const BCRYPT_COST_MAX: u32 = 31;
/// The fastest bcrypt cost accepted (bcrypt's own floor).
pub const BCRYPT_COST_MIN: u32 = 4;
/// The longest auth token lifetime accepted: one day.
pub const AUTH_TOKEN_TTL_MS_MAX: u64 = 24 * 60 * 60 * 1000;

/// Password hashing and auth tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthConfig {
    /// bcrypt cost of new password hashes (etcd's `--bcrypt-cost`, default 10).
    pub bcrypt_cost: u32,
    /// How long a token from Authenticate is accepted (etcd's `--auth-token-ttl`, 300 s).
    pub token_ttl_ms: u64,
    /// `--client-cert-auth`: a verified client certificate's common name is the user of a call
    /// that carries no token.
    pub client_cert_auth: bool,
}

impl Default for AuthConfig {
    fn default() -> Self {
        AuthConfig {
            bcrypt_cost: 10,
            token_ttl_ms: 300_000,
            client_cert_auth: false,
        }
    }
}

/// The default `wal_fsync_warn_ms`.
pub const DEFAULT_WAL_FSYNC_WARN_MS: u64 = 1_000;

/// Caps on what clients may hold or make a node copy, so that no client (or crowd of them)
/// can exhaust a node. Each is a serve flag of the same name (`--watches-max`); hitting one
/// gives the client RESOURCE_EXHAUSTED (or etcd's own answer) with one sentence, never memory
/// growth. `docs/security.md` lists them with their defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientLimits {
    /// Client TCP connections open at once; a connection beyond it is closed on accept.
    pub client_connections_max: usize,
    /// A client connection from which nothing arrives for this long is closed. The server's
    /// HTTP/2 pings (every third of it) make a live client answer, so only a silent socket
    /// reaches it.
    pub client_idle_timeout_ms: u64,
    /// gRPC calls (HTTP/2 streams) open at once on one connection (`max_concurrent_streams`).
    pub grpc_streams_per_connection_max: u32,
    /// Watches open at once on this node, over all streams and clients.
    pub watches_max: usize,
    /// LeaseKeepAlive streams open at once on this node.
    pub lease_keepalive_streams_max: usize,
    /// Distinct topics one Inbox request may name.
    pub topics_per_request_max: usize,
    /// Message bytes one Read or Inbox answer copies out of the state (at least one message
    /// is always returned, so a reader makes progress).
    pub read_response_bytes_max: usize,
    /// Topic Subscribe streams open at once on this node.
    pub topic_subscriptions_max: usize,
    /// Election Observe streams (etcd's and Conclave's) open at once on this node.
    pub election_observers_max: usize,
    /// Lock calls waiting for their turn at once on this node.
    pub lock_waits_max: usize,
    /// Campaign calls (etcd's, and Conclave's with `wait`) in progress at once on this node.
    pub campaign_waits_max: usize,
    /// Queue Claim calls waiting for a job (`wait_ms`) at once on this node.
    pub queue_claim_waits_max: usize,
    /// Key and value bytes one KV Range answer may hold (serializable or linearizable, read
    /// from this node's applied state); a Range past it is refused with RESOURCE_EXHAUSTED
    /// while it is being built. At most `GRPC_RESPONSE_BYTES_MAX`. The Ranges of a Txn have
    /// the state machine's own cap (`conclave_state::TXN_RANGE_BYTES_MAX`), the same on
    /// every member.
    pub range_response_bytes_max: usize,
}

impl Default for ClientLimits {
    fn default() -> Self {
        ClientLimits {
            client_connections_max: 4096,
            client_idle_timeout_ms: 90_000,
            grpc_streams_per_connection_max: 1024,
            watches_max: 16_384,
            lease_keepalive_streams_max: 4096,
            topics_per_request_max: 256,
            read_response_bytes_max: 4 * 1024 * 1024,
            topic_subscriptions_max: 4096,
            election_observers_max: 4096,
            lock_waits_max: 4096,
            campaign_waits_max: 4096,
            queue_claim_waits_max: 4096,
            range_response_bytes_max: conclave_state::TXN_RANGE_BYTES_MAX,
        }
    }
}

impl ClientLimits {
    /// Every cap must allow at least one of what it bounds.
    pub fn validate(&self) -> Result<(), Error> {
        let zero = [
            ("client_connections_max", self.client_connections_max == 0),
            ("client_idle_timeout_ms", self.client_idle_timeout_ms == 0),
            (
                "grpc_streams_per_connection_max",
                self.grpc_streams_per_connection_max == 0,
            ),
            ("watches_max", self.watches_max == 0),
            (
                "lease_keepalive_streams_max",
                self.lease_keepalive_streams_max == 0,
            ),
            ("topics_per_request_max", self.topics_per_request_max == 0),
            ("read_response_bytes_max", self.read_response_bytes_max == 0),
            ("topic_subscriptions_max", self.topic_subscriptions_max == 0),
            ("election_observers_max", self.election_observers_max == 0),
            ("lock_waits_max", self.lock_waits_max == 0),
            ("campaign_waits_max", self.campaign_waits_max == 0),
            ("queue_claim_waits_max", self.queue_claim_waits_max == 0),
            (
                "range_response_bytes_max",
                self.range_response_bytes_max == 0,
            ),
        ];
        if let Some((name, _)) = zero.iter().find(|(_, is_zero)| *is_zero) {
            return Err(Error::InvalidConfig {
                reason: format!("{name} must be at least 1"),
            });
        }
        if self.range_response_bytes_max > GRPC_RESPONSE_BYTES_MAX {
            return Err(Error::InvalidConfig {
                reason: format!(
                    "range_response_bytes_max must be at most {GRPC_RESPONSE_BYTES_MAX} (the largest gRPC answer)"
                ),
            });
        }
        Ok(())
    }
}

/// The longest Raft tick: slower ticks make failure detection coarser than any deployment wants.
pub const TICK_MS_MAX: u64 = 1_000;
/// The longest heartbeat interval.
pub const HEARTBEAT_MS_MAX: u64 = 10_000;
/// The longest election timeout (etcd allows 50 s); it also keeps `tick_ms * election_ticks`
/// and the core's randomized `2 * election_ticks` far from overflow.
pub const ELECTION_TIMEOUT_MS_MAX: u64 = 60_000;
/// The longest a request may wait by default.
pub const REQUEST_TIMEOUT_MS_MAX: u64 = 600_000;
/// The longest a leader shutting down waits for its successor.
pub const SHUTDOWN_TRANSFER_TIMEOUT_MS_MAX: u64 = 60_000;
/// The most applied entries between snapshots (the log between them is kept on disk).
pub const SNAPSHOT_ENTRIES_MAX: u64 = 100_000_000;
/// The default `snapshot_bytes_max`: the Raft core's own default (4 GiB).
pub const DEFAULT_SNAPSHOT_BYTES_MAX: u64 = conclave_raft::DEFAULT_MAX_SNAPSHOT_BYTES;
/// The smallest `snapshot_bytes_max`: an empty state's snapshot is far below it, and a
/// smaller cap would only keep followers from ever catching up.
pub const SNAPSHOT_BYTES_MAX_MIN: u64 = 1024 * 1024;
/// The largest `snapshot_bytes_max`: an incoming snapshot is held in memory.
pub const SNAPSHOT_BYTES_MAX_LIMIT: u64 = 64 * 1024 * 1024 * 1024;
/// The most proposals, reads or queued driver requests/messages a limit may allow.
pub const QUEUE_LIMIT_MAX: usize = 1_000_000;
/// The largest client request a node may accept: the largest WAL record, less framing.
pub const REQUEST_BYTES_LIMIT_MAX: usize = 32 * 1024 * 1024;

/// Snapshot the state machine every this many applied entries unless told otherwise (etcd's
/// default too). The Raft driver thread only freezes the state; a helper thread encodes and
/// writes it, at the lowest CPU priority, and more often still costs CPU; see
/// docs/performance.md.
pub const DEFAULT_SNAPSHOT_ENTRIES: u64 = 100_000;

/// By default a snapshot also waits until the log since the last one is twice as large as that
/// snapshot. Writing an image costs time in proportion to its size, and the image keeps
/// growing with the key-value history; with a fixed entry count alone every write paid more
/// and more for snapshots as the history grew. Waiting for a multiple of its size in log bounds
/// the snapshot bytes written per byte of log (here a half), however large the state gets: the
/// snapshot's writes share the disk with the log's syncs, which slow down while it writes.
/// The price, for a large state: a log on disk (and to replay at a restart) up to about twice
/// the snapshot's size. See docs/performance.md, "Snapshots in proportion to the log" and
/// "Half as many snapshot bytes per byte of log".
pub const DEFAULT_SNAPSHOT_LOG_PERCENT: u64 = 200;
/// With `--lease-reads`, how much faster than real time the lease allows any member's clock
/// (or slower any other's) to run: the lease is this share shorter than the least time a
/// successor takes to be elected. Far above what a working clock drifts; a member whose clock
/// runs off by more (a paused and resumed virtual machine, a clock rate fault) may serve a
/// stale read.
pub const LEASE_READ_CLOCK_DRIFT_PERCENT: u64 = 20;

/// The largest `snapshot_log_percent`: ten times the snapshot's size in log.
pub const SNAPSHOT_LOG_PERCENT_MAX: u64 = 1_000;

impl ServerConfig {
    /// A single-node configuration with Conclave's defaults.
    pub fn single(data_dir: impl Into<PathBuf>, listen_client: &str, listen_peer: &str) -> Self {
        ServerConfig {
            id: 1,
            data_dir: data_dir.into(),
            listen_client: listen_client.to_string(),
            listen_peer: listen_peer.to_string(),
            members: vec![Member {
                id: 1,
                name: "default".to_string(),
                peer_addr: listen_peer.to_string(),
                client_addr: listen_client.to_string(),
            }],
            tick_ms: 10,
            election_ticks: 15,
            heartbeat_ticks: 5,
            lease_reads: false,
            snapshot_entries: DEFAULT_SNAPSHOT_ENTRIES,
            snapshot_log_percent: DEFAULT_SNAPSHOT_LOG_PERCENT,
            snapshot_bytes_max: DEFAULT_SNAPSHOT_BYTES_MAX,
            request_timeout_ms: 5_000,
            proposals_inflight_max: 10_000,
            reads_inflight_max: 10_000,
            driver_queue_requests_max: 4096,
            driver_queue_messages_max: 4096,
            request_bytes_max: REQUEST_BYTES_MAX,
            shutdown_transfer_timeout_ms: 1_000,
            join: false,
            cluster_id_given: None,
            peer_secret_file: None,
            client_tls: None,
            peer_tls: None,
            client_limits: ClientLimits::default(),
            auth: AuthConfig::default(),
            auto_compaction: crate::compactor::AutoCompaction::Off,
            listen_metrics: None,
            listen_metrics_optional: false,
            wal_fsync_warn_ms: DEFAULT_WAL_FSYNC_WARN_MS,
        }
    }

    /// The election timeout T in milliseconds (a follower campaigns after [T, 2T) of silence).
    pub fn election_timeout_ms(&self) -> u64 {
        // Saturating: a configuration that fails validation must not panic while it is reported.
        self.tick_ms.saturating_mul(self.election_ticks)
    }

    /// The leader lease for reads in milliseconds, 0 with lease reads off. A voter that
    /// heard from the leader withholds its vote until `election_ticks` ticks later, and the
    /// first of those may come at once, so no successor can be elected for
    /// `(election_ticks - 1) * tick_ms` after a heartbeat left the leader; the lease is that,
    /// less [`LEASE_READ_CLOCK_DRIFT_PERCENT`] for clocks that run at different rates.
    pub fn lease_read_ms(&self) -> u64 {
        if !self.lease_reads {
            return 0;
        }
        self.vote_withheld_ms()
            .saturating_mul(100 - LEASE_READ_CLOCK_DRIFT_PERCENT)
            / 100
    }

    /// The least real time this member withholds its vote after it heard from a leader or
    /// started: `election_ticks` ticks, the first of which may come at once. Announced to
    /// peers in the handshake, whose leases rely on it.
    pub fn vote_withheld_ms(&self) -> u64 {
        self.election_ticks
            .saturating_sub(1)
            .saturating_mul(self.tick_ms)
    }

    /// The member entry of this node.
    pub fn this_member(&self) -> Option<&Member> {
        self.member(self.id)
    }

    pub fn member(&self, id: NodeId) -> Option<&Member> {
        self.members.iter().find(|m| m.id == id)
    }

    /// A cluster id every founding member derives alike: FNV-1a over the sorted
    /// `id=peer_addr` list. It keeps two clusters' peers from talking to each other.
    pub fn cluster_id(&self) -> u64 {
        if let Some(given) = self.cluster_id_given {
            return given;
        }
        let mut members: Vec<_> = self
            .members
            .iter()
            // A joining node derives the id of the cluster it joins, which it is not part of.
            .filter(|m| !(self.join && m.id == self.id))
            .map(|m| format!("{}={}", m.id, m.peer_addr))
            .collect();
        members.sort();
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for byte in members.join(",").bytes() {
            hash ^= byte as u64;
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
        hash.max(1)
    }

    /// Checks every value, naming the first one that is wrong.
    pub fn validate(&self) -> Result<(), Error> {
        let invalid = |reason: String| Err(Error::InvalidConfig { reason });
        if self.members.is_empty() {
            return invalid("the initial cluster lists no members".into());
        }
        match self.cluster_id_given {
            Some(0) => return invalid("--initial-cluster-id must not be 0".into()),
            Some(_) if !self.join => {
                return invalid(
                    "--initial-cluster-id is for a joining member (--initial-cluster-state existing); founders derive the id from --initial-cluster"
                        .into(),
                );
            }
            _ => {}
        }
        let mut ids = BTreeSet::new();
        let mut names = BTreeSet::new();
        for member in &self.members {
            if member.id == 0 {
                return invalid(format!(
                    "member {:?} has id 0, which is reserved",
                    member.name
                ));
            }
            if !ids.insert(member.id) {
                return invalid(format!("member id {} appears twice", member.id));
            }
            if !names.insert(member.name.as_str()) {
                return invalid(format!("member name {:?} appears twice", member.name));
            }
        }
        if self.this_member().is_none() {
            return invalid(format!(
                "this node (id {}) is not in the initial cluster",
                self.id
            ));
        }
        in_range("tick_ms", self.tick_ms, 1, TICK_MS_MAX)?;
        let heartbeat_ms = self.tick_ms.saturating_mul(self.heartbeat_ticks);
        in_range(
            "the heartbeat interval in ms (tick_ms * heartbeat_ticks)",
            heartbeat_ms,
            1,
            HEARTBEAT_MS_MAX,
        )?;
        let election_ms = self.election_timeout_ms();
        in_range(
            "the election timeout in ms (tick_ms * election_ticks)",
            election_ms,
            1,
            ELECTION_TIMEOUT_MS_MAX,
        )?;
        if self.heartbeat_ticks == 0 || self.election_ticks <= self.heartbeat_ticks {
            return invalid(format!(
                "the election timeout ({} ticks) must exceed the heartbeat interval ({} ticks)",
                self.election_ticks, self.heartbeat_ticks
            ));
        }
        if self.lease_reads
            && self.lease_read_ms() <= self.tick_ms.saturating_mul(self.heartbeat_ticks)
        {
            return invalid(format!(
                "--lease-reads needs a lease ({} ms: 80% of the election timeout less a tick) \
                 longer than the heartbeat interval ({} ms), or a lease round could never hold",
                self.lease_read_ms(),
                self.tick_ms.saturating_mul(self.heartbeat_ticks)
            ));
        }
        in_range(
            "snapshot_entries",
            self.snapshot_entries,
            1,
            SNAPSHOT_ENTRIES_MAX,
        )?;
        in_range(
            "snapshot_log_percent",
            self.snapshot_log_percent,
            0,
            SNAPSHOT_LOG_PERCENT_MAX,
        )?;
        in_range(
            "snapshot_bytes_max",
            self.snapshot_bytes_max,
            SNAPSHOT_BYTES_MAX_MIN,
            SNAPSHOT_BYTES_MAX_LIMIT,
        )?;
        in_range(
            "request_timeout_ms",
            self.request_timeout_ms,
            1,
            REQUEST_TIMEOUT_MS_MAX,
        )?;
        in_range(
            "bcrypt_cost",
            u64::from(self.auth.bcrypt_cost),
            u64::from(BCRYPT_COST_MIN),
            u64::from(BCRYPT_COST_MAX),
        )?;
        in_range(
            "auth_token_ttl_ms",
            self.auth.token_ttl_ms,
            1,
            AUTH_TOKEN_TTL_MS_MAX,
        )?;
        in_range(
            "shutdown_transfer_timeout_ms",
            self.shutdown_transfer_timeout_ms,
            0,
            SHUTDOWN_TRANSFER_TIMEOUT_MS_MAX,
        )?;
        for (name, value) in [
            ("proposals_inflight_max", self.proposals_inflight_max),
            ("reads_inflight_max", self.reads_inflight_max),
            ("driver_queue_requests_max", self.driver_queue_requests_max),
            ("driver_queue_messages_max", self.driver_queue_messages_max),
        ] {
            in_range(name, value as u64, 1, QUEUE_LIMIT_MAX as u64)?;
        }
        in_range(
            "request_bytes_max",
            self.request_bytes_max as u64,
            1,
            REQUEST_BYTES_LIMIT_MAX as u64,
        )?;
        self.client_limits.validate()?;
        if self.wal_fsync_warn_ms == 0 {
            return Err(Error::InvalidConfig {
                reason: "wal_fsync_warn_ms must be at least 1".into(),
            });
        }
        Ok(())
    }
}

/// `Ok` if `value` lies in `[min, max]`, else the one sentence naming `name` and the range.
fn in_range(name: &str, value: u64, min: u64, max: u64) -> Result<(), Error> {
    if (min..=max).contains(&value) {
        Ok(())
    } else {
        Err(Error::InvalidConfig {
            reason: format!("{name} must be between {min} and {max}, not {value}"),
        })
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn the_lease_is_shorter_than_the_least_time_to_elect_a_successor() {
        let mut config =
            ServerConfig::single(std::path::Path::new("/tmp/x"), "127.0.0.1:1", "127.0.0.1:2");
        assert_eq!(config.lease_read_ms(), 0, "off unless asked for");
        config.lease_reads = true;
        // 15 ticks of 10 ms: a voter waits at least 14 ticks, 140 ms; 80% of that.
        assert_eq!(config.lease_read_ms(), 112);
        assert!(config.lease_read_ms() < (config.election_ticks - 1) * config.tick_ms);
        assert!(config.validate().is_ok());
        // Peers learn the window in the handshake; a member with a lease checks theirs.
        let transport = crate::server::transport_config(&config).expect("no files to read");
        assert_eq!(transport.vote_withheld_ms, 140);
        assert_eq!(transport.lease_read_ms, 112);
        // A lease no longer than the heartbeat interval would lapse between rounds.
        config.election_ticks = 6;
        assert!(config.validate().is_err());
        config.lease_reads = false;
        assert!(config.validate().is_ok());
    }
    use super::*;

    #[test]
    fn defaults_validate_and_cluster_id_ignores_member_order() {
        let mut config = ServerConfig::single("/tmp/x", "127.0.0.1:2379", "127.0.0.1:2380");
        assert!(config.validate().is_ok());
        let second = Member {
            id: 2,
            name: "b".into(),
            peer_addr: "127.0.0.1:2382".into(),
            client_addr: "127.0.0.1:2381".into(),
        };
        config.members.push(second.clone());
        let id = config.cluster_id();
        config.members.rotate_left(1);
        assert_eq!(config.cluster_id(), id);
        config.members.push(second);
        assert!(config.validate().is_err());
    }

    #[test]
    fn a_joining_node_derives_the_founders_cluster_id() {
        let founder = ServerConfig::single("/tmp/x", "127.0.0.1:2379", "127.0.0.1:2380");
        let mut joiner = ServerConfig::single("/tmp/y", "127.0.0.1:2381", "127.0.0.1:2382");
        joiner.id = 2;
        joiner.join = true;
        joiner.members = founder.members.clone();
        joiner.members.push(Member {
            id: 2,
            name: "b".into(),
            peer_addr: "127.0.0.1:2382".into(),
            client_addr: "127.0.0.1:2381".into(),
        });
        assert!(joiner.validate().is_ok());
        assert_eq!(joiner.cluster_id(), founder.cluster_id());
    }

    #[test]
    fn unknown_self_and_bad_timing_are_refused() {
        let mut config = ServerConfig::single("/tmp/x", "127.0.0.1:2379", "127.0.0.1:2380");
        config.id = 7;
        assert!(config.validate().is_err());
        config.id = 1;
        config.election_ticks = config.heartbeat_ticks;
        assert!(config.validate().is_err());
    }

    #[test]
    fn every_value_out_of_its_range_is_refused_without_overflow() {
        let base = ServerConfig::single("/tmp/x", "127.0.0.1:2379", "127.0.0.1:2380");
        type Spoil = fn(&mut ServerConfig);
        let cases: [(&str, Spoil); 13] = [
            ("tick_ms", |c| c.tick_ms = TICK_MS_MAX + 1),
            ("election timeout", |c| {
                c.tick_ms = 1;
                c.election_ticks = u64::MAX;
            }),
            ("election timeout", |c| c.election_ticks = u64::MAX / 2),
            ("heartbeat", |c| c.heartbeat_ticks = u64::MAX),
            ("snapshot_entries", |c| c.snapshot_entries = 0),
            ("snapshot_log_percent", |c| {
                c.snapshot_log_percent = SNAPSHOT_LOG_PERCENT_MAX + 1
            }),
            ("snapshot_bytes_max", |c| c.snapshot_bytes_max = 0),
            ("snapshot_bytes_max", |c| c.snapshot_bytes_max = u64::MAX),
            ("request_timeout_ms", |c| c.request_timeout_ms = u64::MAX),
            ("shutdown_transfer_timeout_ms", |c| {
                c.shutdown_transfer_timeout_ms = u64::MAX
            }),
            ("proposals_inflight_max", |c| {
                c.proposals_inflight_max = usize::MAX
            }),
            ("driver_queue_messages_max", |c| {
                c.driver_queue_messages_max = 0
            }),
            ("request_bytes_max", |c| c.request_bytes_max = usize::MAX),
        ];
        for (name, spoil) in cases {
            let mut config = base.clone();
            spoil(&mut config);
            let error = config.validate().expect_err(name).to_string();
            assert!(error.contains(name), "{name}: {error}");
            assert!(error.contains("between"), "{name}: {error}");
        }
    }
}
