//! Limits and timing parameters of the state machine.
//!
//! Every replica must run with the same `Config`: limits decide which commands fail, so they
//! are part of the replicated behaviour.

use crate::error::{Error, Result};

/// etcd's default `--max-request-bytes` (1.5 MiB).
pub const DEFAULT_REQUEST_BYTES_MAX: usize = 1536 * 1024;
/// etcd's default `--max-txn-ops`.
pub const DEFAULT_TXN_OPS_MAX: usize = 128;
/// etcd's `MaxLeaseTTL`: 9,000,000,000 seconds.
pub const LEASE_TTL_MS_MAX: u64 = 9_000_000_000 * 1000;

/// The most key and value bytes the Ranges of one Txn may answer, all together (see
/// [`crate::mvcc::range_answer_bytes`]). A Txn is applied by every member, so this is a
/// constant of the state machine, not a per-node setting: a Txn over it is refused
/// ([`Error::RangeTooLarge`]) before any of its writes, alike on every member. The same as
/// the default cap of a plain Range (`--range-response-bytes-max`).
pub const TXN_RANGE_BYTES_MAX: usize = 64 * 1024 * 1024;

/// State machine configuration. See [`Config::validate`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// The Raft election timeout. Leases are at least 1.5 × this long, and a new Raft leader
    /// gives every lease at least this much grace.
    pub election_timeout_ms: u64,
    /// Largest encoded command payload (keys + values + names) accepted.
    pub request_bytes_max: usize,
    /// Largest key.
    pub key_bytes_max: usize,
    /// Largest value (KV value, election value, topic message).
    pub value_bytes_max: usize,
    /// Most compares, and most operations per branch, in one Txn (nested Txns count separately).
    pub txn_ops_max: usize,
    /// Longest name for groups, candidates, topics and consumers.
    pub name_bytes_max: usize,
    /// A client session with no command for this long is forgotten.
    pub session_ttl_ms: u64,
    /// Most client sessions kept; past it the least recently active one is evicted.
    pub sessions_max: usize,
    /// Most leases at once.
    pub leases_max: usize,
    /// Most priority election groups.
    pub groups_max: usize,
    /// Most candidates in one group.
    pub group_candidates_max: usize,
    /// Most topics.
    pub topics_max: usize,
    /// Most messages kept per topic, whatever its retention says.
    pub topic_messages_max: u64,
    /// Most named consumers.
    pub consumers_max: usize,
    /// A keepalive more than this long after the lease's last "renewed" record commits a new
    /// one before it is answered. An abandoned lease ends by its last keepalive + TTL + this,
    /// however often the Raft leader changes; the cost is at most one (batchable) log entry per
    /// kept-alive lease per interval.
    pub lease_checkpoint_interval_ms: u64,
    /// Most work queues (their dead-letter queues not counted).
    pub queues_max: usize,
    /// Most jobs one work queue holds (ready, delayed and in flight together).
    pub queue_jobs_max: usize,
    /// Largest job payload.
    pub job_payload_bytes_max: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            election_timeout_ms: 1000,
            request_bytes_max: DEFAULT_REQUEST_BYTES_MAX,
            key_bytes_max: DEFAULT_REQUEST_BYTES_MAX,
            value_bytes_max: DEFAULT_REQUEST_BYTES_MAX,
            txn_ops_max: DEFAULT_TXN_OPS_MAX,
            name_bytes_max: 1024,
            session_ttl_ms: 60 * 60 * 1000,
            sessions_max: 100_000,
            lease_checkpoint_interval_ms: 1000,
            leases_max: 1_000_000,
            groups_max: 100_000,
            group_candidates_max: 10_000,
            topics_max: 100_000,
            topic_messages_max: 1_000_000,
            consumers_max: 100_000,
            queues_max: 10_000,
            queue_jobs_max: 100_000,
            job_payload_bytes_max: DEFAULT_REQUEST_BYTES_MAX,
        }
    }
}

impl Config {
    /// Shortest lease TTL: 1.5 × the election timeout, as in etcd. Shorter grants are raised.
    pub fn lease_ttl_ms_min(&self) -> u64 {
        self.election_timeout_ms.saturating_mul(3) / 2
    }

    /// Checks that the configuration is usable.
    pub fn validate(&self) -> Result<()> {
        let invalid = |what: &str| Err(Error::InvalidArgument(format!("config: {what}")));
        if self.election_timeout_ms == 0 {
            return invalid("election_timeout_ms must be > 0");
        }
        if self.request_bytes_max == 0 || self.key_bytes_max == 0 {
            return invalid("request_bytes_max and key_bytes_max must be > 0");
        }
        if self.txn_ops_max == 0 {
            return invalid("txn_ops_max must be > 0");
        }
        if self.name_bytes_max == 0 || self.sessions_max == 0 || self.session_ttl_ms == 0 {
            return invalid("name_bytes_max, sessions_max and session_ttl_ms must be > 0");
        }
        let bounds = [
            self.leases_max,
            self.groups_max,
            self.group_candidates_max,
            self.topics_max,
        ];
        if bounds.contains(&0) || self.consumers_max == 0 || self.topic_messages_max == 0 {
            return invalid("object limits must be > 0");
        }
        if self.queues_max == 0 || self.queue_jobs_max == 0 || self.job_payload_bytes_max == 0 {
            return invalid("queues_max, queue_jobs_max and job_payload_bytes_max must be > 0");
        }
        if self.lease_checkpoint_interval_ms == 0 {
            return invalid("lease_checkpoint_interval_ms must be > 0");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid_and_min_ttl_is_one_and_a_half_election_timeouts() {
        let config = Config::default();
        assert!(config.validate().is_ok());
        assert_eq!(config.lease_ttl_ms_min(), 1500);
        let broken = Config {
            election_timeout_ms: 0,
            ..Config::default()
        };
        assert!(broken.validate().is_err());
    }
}
