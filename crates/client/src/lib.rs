//! Rust client for Conclave: the etcd v3 KV, watch and lease API, Conclave's priority elections
//! with fencing tokens, locks, and topics.
//!
//! ```no_run
//! # async fn demo() -> Result<(), conclave_client::Error> {
//! use std::time::Duration;
//! use conclave_client::{CampaignOptions, Client};
//!
//! let client = Client::connect(["127.0.0.1:2379"]).await?;
//! client.put("greeting", "hello", Default::default()).await?;
//! let leadership = client
//!     .election()
//!     .campaign("workers", "agent-1", 10, "http://agent-1", CampaignOptions::default())
//!     .await?;
//! println!("leading term {} with fence {}", leadership.term(), leadership.fence());
//! leadership.lost().await;
//! # Ok(()) }
//! ```
//!
//! Requests that can safely be repeated (reads, fenced or self-keyed writes) are retried on
//! "no leader" and unavailable members with capped backoff until the request deadline. Writes
//! that could apply twice (put, delete, txn, publish, lease grant) travel in an exactly-once
//! client session, so they are retried the same way and still applied once. See
//! `docs/client.md`.

mod auth;
mod conn;
mod election;
mod error;
mod etcd_election;
mod kv;
mod lease;
mod lock;
mod queue;
mod session;
mod socket;
mod tls;
mod topic;
mod watch;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

pub use auth::{Auth, Credentials, Permission, PermissionKind, TOKEN_METADATA_KEY};
pub use conn::{Backoff, ClientOptions};
pub use election::{
    CampaignOptions, Candidate, Election, ElectionEvent, ElectionEventKind, ElectionEvents,
    GroupPolicy, LeaderInfo, Leadership, LossReason, PreemptPolicy, Registration, group_leader_key,
};
pub use error::{Error, ErrorContext, Result};
pub use etcd_election::{EtcdElection, EtcdLeaderKey};
pub use kv::{
    Compare, CompareOp, DeleteOptions, DeleteResponse, GetOptions, GetResponse, KeyValue, Op,
    OpResponse, PutOptions, PutResponse, SortOrder, SortTarget, Txn, TxnResponse, prefix_end,
};
pub use lease::{LeaseGrant, LeaseId, LeaseKeepAlive, LeaseSafety, LeaseState, LeaseTimeToLive};
pub use lock::{LockGuard, LockOptions, Mutex};
pub use queue::{ClaimOptions, Job, JobState, PushOptions, Pushed, QueueStats, Queues};
pub use session::SESSIONS_IDLE_MAX;
pub use tls::{TlsOptions, endpoint};
pub use topic::{InboxOptions, ReadResponse, TopicMessage, TopicSubscription, Topics};
pub use watch::{EventType, WatchEvent, WatchOptions, Watcher};

use conclave_proto::etcdserverpb::cluster_client::ClusterClient;
use conclave_proto::etcdserverpb::maintenance_client::MaintenanceClient;
use conclave_proto::etcdserverpb::{Member, MemberListRequest, StatusRequest, StatusResponse};
use conn::{Inner, Retry, Shared, request};
use session::Position;

/// A connection to a Conclave cluster. Cheap to clone; clones share the connection.
#[derive(Clone)]
pub struct Client {
    inner: Shared,
}

impl Client {
    /// Connects with default options to the first reachable endpoint (preferring the Raft
    /// leader). Endpoints are `host:port` or URLs.
    pub async fn connect<I, S>(endpoints: I) -> Result<Client>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        Client::connect_with(endpoints, ClientOptions::default()).await
    }

    /// Connects with explicit options.
    pub async fn connect_with<I, S>(endpoints: I, options: ClientOptions) -> Result<Client>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let endpoints: Vec<String> = endpoints
            .into_iter()
            .map(|e| e.as_ref().to_string())
            .collect();
        let client = Client {
            inner: Arc::new(Inner::new(&endpoints, options)?),
        };
        client.inner.active().await?;
        Ok(client)
    }

    /// The options this client was built with.
    pub fn options(&self) -> &ClientOptions {
        &self.inner.options
    }

    /// The endpoint requests currently go to (after a failover, another one).
    pub async fn current_endpoint(&self) -> Result<String> {
        Ok(self.inner.active().await?.endpoint)
    }

    /// The endpoints given at connect time, normalised to URLs.
    pub fn endpoints(&self) -> &[String] {
        self.inner.configured_endpoints()
    }

    /// Status of the member the client talks to (leader id, term, indexes, db size).
    pub async fn status(&self) -> Result<StatusResponse> {
        Ok(self
            .call(
                Retry::Idempotent,
                ErrorContext::default(),
                |channel, timeout| async move {
                    MaintenanceClient::new(channel)
                        .status(request(StatusRequest {}, timeout))
                        .await
                },
            )
            .await?
            .into_inner())
    }

    /// The cluster's members with their client URLs.
    pub async fn member_list(&self) -> Result<Vec<Member>> {
        Ok(self
            .call(
                Retry::Idempotent,
                ErrorContext::default(),
                |channel, timeout| async move {
                    ClusterClient::new(channel)
                        .member_list(request(MemberListRequest { linearizable: true }, timeout))
                        .await
                },
            )
            .await?
            .into_inner()
            .members)
    }

    /// Priority election groups (`conclave.v1.Election`).
    pub fn election(&self) -> Election {
        Election::new(self.clone())
    }

    /// etcd's plain election service (`v3electionpb`), for interoperability.
    pub fn etcd_election(&self) -> EtcdElection {
        EtcdElection::new(self.clone())
    }

    /// Locks with fencing tokens (etcd's `v3lockpb`).
    pub fn mutex(&self) -> Mutex {
        Mutex::new(self.clone())
    }

    /// Topics and consumer inboxes (`conclave.v1.Topic`).
    pub fn topics(&self) -> Topics {
        Topics::new(self.clone())
    }

    /// Work queues: push, claim under a visibility timeout, fenced ack / nack / extend.
    pub fn queues(&self) -> Queues {
        Queues::new(self.clone())
    }

    /// Authentication: turn it on and off, manage users and roles (etcd's Auth service).
    pub fn auth(&self) -> Auth {
        Auth::new(self.clone())
    }

    /// Closes the client's idle exactly-once sessions at once instead of leaving them to
    /// expire on the server (after its `session_ttl_ms`, 1 h by default). Later writes open
    /// new ones.
    pub async fn close_sessions(&self) -> Result<()> {
        self.inner.close_sessions().await
    }

    /// A write that must not apply twice, in an exactly-once session, with the default
    /// deadline; see [`Inner::call_in_session`].
    async fn call_in_session<T, F, Fut>(
        &self,
        fallback: Retry,
        context: ErrorContext,
        call: F,
    ) -> Result<T>
    where
        F: FnMut(crate::conn::Channel, Duration, Position) -> Fut,
        Fut: Future<Output = std::result::Result<T, tonic::Status>>,
    {
        self.inner
            .call_in_session(fallback, context, self.inner.options.request_timeout, call)
            .await
    }

    /// One request with the default deadline.
    async fn call<T, F, Fut>(&self, retry: Retry, context: ErrorContext, call: F) -> Result<T>
    where
        F: FnMut(crate::conn::Channel, Duration) -> Fut,
        Fut: Future<Output = std::result::Result<T, tonic::Status>>,
    {
        self.inner
            .call(retry, context, self.inner.options.request_timeout, call)
            .await
    }
}
