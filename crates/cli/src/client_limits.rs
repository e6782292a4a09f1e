//! The serve flags of the client caps (`conclave_server::config::ClientLimits`), each also a
//! config-file key of the same name. Unset flags keep the server's defaults, which
//! `docs/security.md` lists.

use std::ffi::OsString;

use clap::Args;
use conclave_server::config::ClientLimits;

/// Caps on what clients may hold on this node; hitting one gives the client
/// RESOURCE_EXHAUSTED (or etcd's own answer) with one sentence.
#[derive(Args, Debug, Clone, Default)]
pub struct ClientLimitArgs {
    /// Client TCP connections open at once; more are closed on accept [default: 4096].
    #[arg(long, env = "CONCLAVE_CLIENT_CONNECTIONS_MAX")]
    pub client_connections_max: Option<usize>,
    /// Close a client connection that sends nothing for this long [default: 90000].
    #[arg(long, env = "CONCLAVE_CLIENT_IDLE_TIMEOUT_MS")]
    pub client_idle_timeout_ms: Option<u64>,
    /// gRPC calls open at once on one client connection [default: 1024].
    #[arg(long, env = "CONCLAVE_GRPC_STREAMS_PER_CONNECTION_MAX")]
    pub grpc_streams_per_connection_max: Option<u32>,
    /// Watches open at once on this node, over all clients [default: 16384].
    #[arg(long, env = "CONCLAVE_WATCHES_MAX")]
    pub watches_max: Option<usize>,
    /// LeaseKeepAlive streams open at once on this node [default: 4096].
    #[arg(long, env = "CONCLAVE_LEASE_KEEPALIVE_STREAMS_MAX")]
    pub lease_keepalive_streams_max: Option<usize>,
    /// Distinct topics one Inbox request may name [default: 256].
    #[arg(long, env = "CONCLAVE_TOPICS_PER_REQUEST_MAX")]
    pub topics_per_request_max: Option<usize>,
    /// Message bytes one topic Read or Inbox answer carries [default: 4194304].
    #[arg(long, env = "CONCLAVE_READ_RESPONSE_BYTES_MAX")]
    pub read_response_bytes_max: Option<usize>,
    /// Topic Subscribe streams open at once on this node [default: 4096].
    #[arg(long, env = "CONCLAVE_TOPIC_SUBSCRIPTIONS_MAX")]
    pub topic_subscriptions_max: Option<usize>,
    /// Election Observe streams open at once on this node [default: 4096].
    #[arg(long, env = "CONCLAVE_ELECTION_OBSERVERS_MAX")]
    pub election_observers_max: Option<usize>,
    /// Lock calls waiting for their turn at once on this node [default: 4096].
    #[arg(long, env = "CONCLAVE_LOCK_WAITS_MAX")]
    pub lock_waits_max: Option<usize>,
    /// Campaign calls waiting to be elected at once on this node [default: 4096].
    #[arg(long, env = "CONCLAVE_CAMPAIGN_WAITS_MAX")]
    pub campaign_waits_max: Option<usize>,
    /// Queue Claim calls waiting for a job at once on this node [default: 4096].
    #[arg(long, env = "CONCLAVE_QUEUE_CLAIM_WAITS_MAX")]
    pub queue_claim_waits_max: Option<usize>,
    /// Key and value bytes one KV Range answer may hold; a larger one is refused with
    /// RESOURCE_EXHAUSTED (1 to 268435456) [default: 67108864].
    #[arg(long, env = "CONCLAVE_RANGE_RESPONSE_BYTES_MAX")]
    pub range_response_bytes_max: Option<usize>,
}

impl ClientLimitArgs {
    /// The server's caps with these flags applied.
    pub fn to_limits(&self) -> ClientLimits {
        let mut limits = ClientLimits::default();
        let ClientLimitArgs {
            client_connections_max,
            client_idle_timeout_ms,
            grpc_streams_per_connection_max,
            watches_max,
            lease_keepalive_streams_max,
            topics_per_request_max,
            read_response_bytes_max,
            topic_subscriptions_max,
            election_observers_max,
            lock_waits_max,
            campaign_waits_max,
            queue_claim_waits_max,
            range_response_bytes_max,
        } = self.clone();
        macro_rules! set {
            ($($field:ident),*) => {
                $(if let Some(value) = $field {
                    limits.$field = value;
                })*
            };
        }
        set!(
            client_connections_max,
            client_idle_timeout_ms,
            grpc_streams_per_connection_max,
            watches_max,
            lease_keepalive_streams_max,
            topics_per_request_max,
            read_response_bytes_max,
            topic_subscriptions_max,
            election_observers_max,
            lock_waits_max,
            campaign_waits_max,
            queue_claim_waits_max,
            range_response_bytes_max
        );
        limits
    }

    /// The flags that reproduce these arguments (for `daemon start`).
    pub fn to_args(&self) -> Vec<OsString> {
        let ClientLimitArgs {
            client_connections_max,
            client_idle_timeout_ms,
            grpc_streams_per_connection_max,
            watches_max,
            lease_keepalive_streams_max,
            topics_per_request_max,
            read_response_bytes_max,
            topic_subscriptions_max,
            election_observers_max,
            lock_waits_max,
            campaign_waits_max,
            queue_claim_waits_max,
            range_response_bytes_max,
        } = self;
        let flags = [
            (
                "--client-connections-max",
                client_connections_max.map(|v| v.to_string()),
            ),
            (
                "--client-idle-timeout-ms",
                client_idle_timeout_ms.map(|v| v.to_string()),
            ),
            (
                "--grpc-streams-per-connection-max",
                grpc_streams_per_connection_max.map(|v| v.to_string()),
            ),
            ("--watches-max", watches_max.map(|v| v.to_string())),
            (
                "--lease-keepalive-streams-max",
                lease_keepalive_streams_max.map(|v| v.to_string()),
            ),
            (
                "--topics-per-request-max",
                topics_per_request_max.map(|v| v.to_string()),
            ),
            (
                "--read-response-bytes-max",
                read_response_bytes_max.map(|v| v.to_string()),
            ),
            (
                "--topic-subscriptions-max",
                topic_subscriptions_max.map(|v| v.to_string()),
            ),
            (
                "--election-observers-max",
                election_observers_max.map(|v| v.to_string()),
            ),
            ("--lock-waits-max", lock_waits_max.map(|v| v.to_string())),
            (
                "--campaign-waits-max",
                campaign_waits_max.map(|v| v.to_string()),
            ),
            (
                "--queue-claim-waits-max",
                queue_claim_waits_max.map(|v| v.to_string()),
            ),
            (
                "--range-response-bytes-max",
                range_response_bytes_max.map(|v| v.to_string()),
            ),
        ];
        let mut args = Vec::new();
        for (flag, value) in flags {
            if let Some(value) = value {
                args.extend([OsString::from(flag), OsString::from(value)]);
            }
        }
        args
    }
}
