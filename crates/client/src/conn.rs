//! Connection management: endpoint selection (preferring the Raft leader), retries with capped
//! backoff, and per-request deadlines.

use std::future::Future;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use conclave_proto::conclave::v1 as cv1;
use conclave_proto::conclave::v1::session_client::SessionClient;
use conclave_proto::etcdserverpb::cluster_client::ClusterClient;
use conclave_proto::etcdserverpb::maintenance_client::MaintenanceClient;
use conclave_proto::etcdserverpb::{MemberListRequest, StatusRequest};
use tokio::time::Instant;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Endpoint;

use crate::auth::{Authenticator, Credentials, TokenInterceptor};
use crate::tls::TlsOptions;

/// A connection to one member that adds the client's auth token to every call.
pub(crate) type Channel = InterceptedService<tonic::transport::Channel, TokenInterceptor>;

use crate::error::{Error, ErrorContext, Result};
use crate::lease::LeaseSafety;
use crate::session::{Position, Session, SessionPool, session_gone};
use crate::socket::{Connector, Sockets};

/// Exponential backoff with a cap and jitter, used between retries of one request and between
/// reconnects of streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// Delay before the first retry.
    pub initial: Duration,
    /// No delay exceeds this.
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            initial: Duration::from_millis(25),
            max: Duration::from_millis(1_000),
        }
    }
}

impl Backoff {
    /// The delay before retry number `attempt` (0 = first retry): `initial * 2^attempt`, capped
    /// at `max`, then scaled into `[1/2, 1]` of that by `jitter` in `[0, 1]`, so clients that
    /// failed together do not retry in lockstep yet never wait less than half the nominal delay.
    pub fn delay_with_jitter(&self, attempt: u32, jitter: f64) -> Duration {
        let nominal = self
            .initial
            .checked_mul(1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX))
            .unwrap_or(self.max)
            .min(self.max);
        let jitter = if jitter.is_finite() {
            jitter.clamp(0.0, 1.0)
        } else {
            0.0
        };
        nominal.mul_f64(0.5 + 0.5 * jitter)
    }

    /// [`Backoff::delay_with_jitter`] with jitter taken from the clock's sub-second digits
    /// (good enough to spread retries; no randomness crate needed).
    pub fn delay(&self, attempt: u32) -> Duration {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        // Scramble the low bits so consecutive calls do not produce correlated jitter.
        let mixed =
            (u64::from(nanos) ^ (u64::from(attempt) << 32)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.delay_with_jitter(attempt, (mixed >> 11) as f64 / (1u64 << 53) as f64)
    }
}

/// How a client connects and how long it waits.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Total time one request may take, retries included (sent to the server as
    /// `grpc-timeout`, so the server answers before the client gives up).
    pub request_timeout: Duration,
    /// How long establishing a connection to one endpoint may take.
    pub connect_timeout: Duration,
    /// Delays between retries of idempotent requests and between stream reconnects.
    pub backoff: Backoff,
    /// How conservatively a lease holder judges its own lease (see [`LeaseSafety`]).
    pub lease_safety: LeaseSafety,
    /// Send writes that must not apply twice (put, delete, txn, publish, lease grant, ...) in
    /// an exactly-once client session, so they can be retried after a leader change or an
    /// unavailable member. Off: they are retried only when nothing was sent.
    pub exactly_once: bool,
    /// TLS settings (CA, client certificate); see [`TlsOptions`] for when they apply.
    pub tls: Option<TlsOptions>,
    /// Who the client is when the cluster has authentication on (see [`Credentials`]);
    /// `None` sends no token (fine while auth is off, or under common-name authentication
    /// with a client certificate).
    pub credentials: Option<Credentials>,
    /// Move to the Raft leader when the member reached knows one (on): writes then skip the
    /// member's forwarding hop. Off: stay on the first member that answers and knows a leader,
    /// so writes go through that member; for spreading clients over members, and for tests
    /// of the forwarding path.
    pub prefer_leader: bool,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            request_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(2),
            backoff: Backoff::default(),
            lease_safety: LeaseSafety::default(),
            exactly_once: true,
            tls: None,
            credentials: None,
            prefer_leader: true,
        }
    }
}

/// Whether a request may be sent again after an ambiguous failure (one where the server may
/// have applied it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Retry {
    /// Reads, and writes whose repetition changes nothing (fenced or keyed by the caller's own
    /// identity): retried on any transient error until the deadline.
    Idempotent,
    /// Writes whose repetition could apply twice (put, delete, txn, publish, lease grant):
    /// retried only when nothing was sent (no endpoint could be reached). Such writes go
    /// through [`Inner::call_in_session`], which retries them safely when it can.
    AtMostOnce,
}

/// Generation of a connection that failed and must be replaced before its next use.
const FORGOTTEN: u64 = u64::MAX;

/// The connection currently in use.
#[derive(Clone)]
pub(crate) struct Active {
    pub channel: Channel,
    pub endpoint: String,
    /// Increases at every reconnect, so concurrent failures of one connection reconnect once.
    pub generation: u64,
}

pub(crate) struct Inner {
    /// Configured endpoints first, then client URLs learned from MemberList.
    endpoints: RwLock<Vec<String>>,
    configured: Vec<String>,
    pub options: ClientOptions,
    active: RwLock<Option<Active>>,
    /// Serialises reconnects.
    reconnecting: tokio::sync::Mutex<u64>,
    /// Exactly-once sessions not in use by a write right now.
    sessions: SessionPool,
    /// The credentials and the token every call carries.
    auth: Authenticator,
    /// Every TCP connection made, so that giving a lease up can reset them all.
    pub(crate) sockets: Arc<Sockets>,
    /// A revision the cluster is known to have reached (raised by watches, see
    /// [`Inner::raise_revision_floor`]): a reconnect prefers members that have applied it.
    revision_floor: AtomicI64,
}

/// How well a probed member would serve, best first (see [`standing`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Standing {
    /// Knows a leader and has applied the client's revision floor (or is, or led us to, the
    /// leader).
    KeepsUp,
    /// Knows a leader but has not applied a revision the cluster is known to have: it may be
    /// a learner that never catches up and only hears heartbeats (docs/faults.md, finding 7).
    Behind,
    /// Knows no leader: it may be cut off for good (docs/faults.md, finding 6).
    Leaderless,
}

/// Where a probed member stands: `revision` is its applied revision, `None` when the probe
/// reached the leader itself, which applies what it commits.
pub(crate) fn standing(knows_leader: bool, revision: Option<i64>, floor: i64) -> Standing {
    match (knows_leader, revision) {
        (false, _) => Standing::Leaderless,
        (true, Some(revision)) if revision < floor => Standing::Behind,
        (true, _) => Standing::KeepsUp,
    }
}

/// Orders fallback candidates, smallest best: by standing, then the most advanced revision.
pub(crate) fn preference(standing: Standing, revision: i64) -> (Standing, std::cmp::Reverse<i64>) {
    (standing, std::cmp::Reverse(revision))
}

/// A member's answer to Status, as a watch's silence check uses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MemberStatus {
    /// The leader it knows; 0 for none.
    pub leader: u64,
    /// The revision of what it has applied.
    pub revision: i64,
}

/// What probing one endpoint found.
struct Probed {
    channel: tonic::transport::Channel,
    endpoint: String,
    knows_leader: bool,
    /// The member's applied revision; `None` when the probe moved on to the leader.
    revision: Option<i64>,
}

/// Adds a scheme when the endpoint has none (`127.0.0.1:2379` as etcdctl accepts): `https://`
/// when the client has TLS settings, `http://` otherwise.
pub(crate) fn normalize_endpoint(endpoint: &str, tls: bool) -> String {
    let trimmed = endpoint.trim().trim_end_matches('/');
    if trimmed.contains("://") {
        trimmed.to_string()
    } else if tls {
        format!("https://{trimmed}")
    } else {
        format!("http://{trimmed}")
    }
}

/// A request carrying its deadline as `grpc-timeout`.
pub(crate) fn request<T>(message: T, timeout: Duration) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(timeout);
    request
}

impl Inner {
    pub(crate) fn new(endpoints: &[String], options: ClientOptions) -> Result<Inner> {
        let configured: Vec<String> = endpoints
            .iter()
            .filter(|e| !e.trim().is_empty())
            .map(|e| normalize_endpoint(e, options.tls.is_some()))
            .collect();
        if configured.is_empty() {
            return Err(Error::InvalidArgument("no endpoints given".into()));
        }
        for endpoint in &configured {
            Endpoint::from_shared(endpoint.clone()).map_err(|e| {
                Error::InvalidArgument(format!("endpoint {endpoint:?} is not a valid URL: {e}"))
            })?;
        }
        let auth = Authenticator::new(options.credentials.clone())?;
        Ok(Inner {
            auth,
            endpoints: RwLock::new(configured.clone()),
            configured,
            options,
            active: RwLock::new(None),
            reconnecting: tokio::sync::Mutex::new(0),
            sessions: SessionPool::default(),
            sockets: Arc::new(Sockets::default()),
            revision_floor: AtomicI64::new(0),
        })
    }

    pub(crate) fn configured_endpoints(&self) -> &[String] {
        &self.configured
    }

    fn current(&self) -> Option<Active> {
        self.active
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    /// The connection to use, connecting if there is none.
    /// With a password and no token yet, authenticates first.
    pub(crate) async fn active(&self) -> Result<Active> {
        let active = match self.current() {
            Some(active) if active.generation != FORGOTTEN => active,
            Some(_) => self.reconnect(Some(FORGOTTEN)).await?,
            None => self.reconnect(None).await?,
        };
        self.auth
            .ensure(&active.channel, self.options.request_timeout)
            .await?;
        Ok(active)
    }

    /// Replaces the connection of generation `failed` (or establishes the first one). If
    /// another task already replaced it, returns that one instead of reconnecting again.
    pub(crate) async fn reconnect(&self, failed: Option<u64>) -> Result<Active> {
        let mut generation = self.reconnecting.lock().await;
        if let Some(current) = self.current()
            && Some(current.generation) != failed
        {
            return Ok(current);
        }
        let failed_endpoint = self.current().map(|a| a.endpoint);
        let endpoints = self
            .endpoints
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone();
        // Start after the endpoint that failed, so a dead member is tried last.
        let start = failed_endpoint
            .and_then(|failed| endpoints.iter().position(|e| *e == failed))
            .map_or(0, |i| i + 1);
        let mut reasons = Vec::new();
        let mut tls_failures = Vec::new();
        // A member that knows no leader is taken only when none does: it may be cut off for
        // good (a removed or stranded member still serving), and a watch opened there is
        // alive but silent (docs/faults.md, finding 6). A member behind the revision floor is
        // taken only when none keeps up, the most advanced first (finding 7).
        let floor = self.revision_floor();
        let mut fallback: Option<(Standing, i64, Probed)> = None;
        for i in 0..endpoints.len() {
            let endpoint = &endpoints[(start + i) % endpoints.len()];
            match self.probe(endpoint).await {
                Ok(probed) => {
                    let standing = standing(probed.knows_leader, probed.revision, floor);
                    if standing == Standing::KeepsUp {
                        return Ok(self.adopt(&mut generation, probed.channel, probed.endpoint));
                    }
                    let revision = probed.revision.unwrap_or(i64::MAX);
                    reasons.push(match standing {
                        Standing::Behind => {
                            format!("{endpoint}: at revision {revision}, behind {floor}")
                        }
                        _ => format!("{endpoint}: knows no leader"),
                    });
                    let better = fallback.as_ref().is_none_or(|(s, r, _)| {
                        preference(standing, revision) < preference(*s, *r)
                    });
                    if better {
                        fallback = Some((standing, revision, probed));
                    }
                }
                Err(reason) => {
                    let tls = endpoint.starts_with("https://");
                    let client_certificate = (self.options.tls.as_ref())
                        .is_some_and(|t| t.client_certificate_pem.is_some());
                    if let Some(sentence) =
                        crate::tls::explain_failure(&reason, tls, client_certificate)
                    {
                        tls_failures.push(format!("{endpoint}: {sentence}"));
                    } else if let Some(sentence) = self.ask_tls_refusal(endpoint).await {
                        tls_failures.push(format!("{endpoint}: {sentence}"));
                    } else if !tls
                        && crate::tls::speaks_tls(endpoint, self.options.connect_timeout).await
                    {
                        tls_failures.push(format!("{endpoint}: {}", crate::tls::SPEAKS_TLS));
                    }
                    reasons.push(format!("{endpoint}: {reason}"));
                }
            }
        }
        if let Some((standing, _, probed)) = fallback {
            tracing::debug!(?standing, %probed.endpoint, "conclave client takes the best it found");
            return Ok(self.adopt(&mut generation, probed.channel, probed.endpoint));
        }
        *self
            .active
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = None;
        // A TLS mismatch does not fix itself with retries; say what it is.
        if !tls_failures.is_empty() {
            return Err(Error::Tls(tls_failures.join("; ")));
        }
        Err(Error::ConnectionFailed {
            endpoints,
            reason: reasons.join("; "),
        })
    }

    /// For a TLS endpoint whose failure said nothing about TLS: the sentence for the refusal
    /// a bare handshake hears (see [`crate::tls::refusal_reason`]), if that is one.
    async fn ask_tls_refusal(&self, endpoint: &str) -> Option<String> {
        let options = self.options.tls.as_ref()?;
        let reason =
            crate::tls::refusal_reason(endpoint, options, self.options.connect_timeout).await?;
        crate::tls::explain_failure(&reason, true, options.client_certificate_pem.is_some())
    }

    /// Makes `channel` the connection in use, under a new generation.
    fn adopt(
        &self,
        generation: &mut u64,
        channel: tonic::transport::Channel,
        endpoint: String,
    ) -> Active {
        *generation += 1;
        let active = Active {
            channel: InterceptedService::new(channel, self.auth.interceptor()),
            endpoint,
            generation: *generation,
        };
        *self
            .active
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(active.clone());
        tracing::debug!(endpoint = %active.endpoint, "conclave client connected");
        active
    }

    async fn connect_channel(
        &self,
        endpoint: &str,
    ) -> std::result::Result<tonic::transport::Channel, String> {
        let timeout = self.options.connect_timeout;
        let mut builder = Endpoint::from_shared(endpoint.to_string()).map_err(|e| e.to_string())?;
        if endpoint.starts_with("https://") {
            let config = match &self.options.tls {
                Some(tls) => tls.config(),
                None => TlsOptions::default().config(),
            }
            .map_err(|e| e.to_string())?;
            builder = builder.tls_config(config).map_err(|e| source_chain(&e))?;
        }
        let builder = builder
            .connect_timeout(timeout)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_timeout(Duration::from_secs(5))
            .keep_alive_while_idle(true);
        let connector = Connector {
            sockets: self.sockets.clone(),
        };
        match tokio::time::timeout(timeout, builder.connect_with_connector(connector)).await {
            Ok(Ok(channel)) => Ok(channel),
            Ok(Err(e)) => Err(source_chain(&e)),
            Err(_) => Err(format!("no connection within {} ms", timeout.as_millis())),
        }
    }

    /// Connects to `endpoint` and asks for its status; when it knows a leader other than
    /// itself, tries to connect to the leader instead (writes then skip a forwarding hop),
    /// unless [`ClientOptions::prefer_leader`] is off. Learns the members' client URLs for
    /// later reconnects.
    async fn probe(&self, endpoint: &str) -> std::result::Result<Probed, String> {
        let channel = self.connect_channel(endpoint).await?;
        let timeout = self.options.connect_timeout;
        let status = MaintenanceClient::new(channel.clone())
            .status(request(StatusRequest {}, timeout))
            .await
            .map_err(|s| format!("{}: {}", Error::status(&s), source_chain(&s)))?
            .into_inner();
        let member_id = status.header.map_or(0, |h| h.member_id);
        let revision = status.header.map_or(0, |h| h.revision);
        let members = ClusterClient::new(channel.clone())
            .member_list(request(
                MemberListRequest {
                    linearizable: false,
                },
                timeout,
            ))
            .await
            .map(|r| r.into_inner().members)
            .unwrap_or_default();
        {
            let mut known = self
                .endpoints
                .write()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            for url in members.iter().flat_map(|m| m.client_ur_ls.iter()) {
                let url = normalize_endpoint(url, self.options.tls.is_some());
                if !known.contains(&url) {
                    known.push(url);
                }
            }
        }
        if self.options.prefer_leader && status.leader != 0 && status.leader != member_id {
            let leader_urls = members
                .iter()
                .find(|m| m.id == status.leader)
                .map(|m| m.client_ur_ls.clone())
                .unwrap_or_default();
            for url in leader_urls {
                let url = normalize_endpoint(&url, self.options.tls.is_some());
                if let Ok(leader_channel) = self.connect_channel(&url).await {
                    return Ok(Probed {
                        channel: leader_channel,
                        endpoint: url,
                        knows_leader: true,
                        revision: None,
                    });
                }
            }
        }
        Ok(Probed {
            channel,
            endpoint: endpoint.to_string(),
            knows_leader: status.leader != 0,
            // The leader applies what it commits; judge only the others by their revision.
            revision: (status.leader != member_id).then_some(revision),
        })
    }

    /// Runs `call` until it succeeds, fails for good, or `timeout` passes; see [`Retry`].
    pub(crate) async fn call<T, F, Fut>(
        &self,
        retry: Retry,
        context: ErrorContext,
        timeout: Duration,
        mut call: F,
    ) -> Result<T>
    where
        F: FnMut(Channel, Duration) -> Fut,
        Fut: Future<Output = std::result::Result<T, tonic::Status>>,
    {
        self.call_active(retry, context, timeout, |active, remaining| {
            call(active.channel.clone(), remaining)
        })
        .await
    }

    /// [`Inner::call`], handing the whole connection (with its generation) to `call`.
    pub(crate) async fn call_active<T, F, Fut>(
        &self,
        retry: Retry,
        context: ErrorContext,
        timeout: Duration,
        mut call: F,
    ) -> Result<T>
    where
        F: FnMut(&Active, Duration) -> Fut,
        Fut: Future<Output = std::result::Result<T, tonic::Status>>,
    {
        let deadline = Instant::now() + timeout;
        let mut attempt = 0u32;
        // The last transient failure: when the deadline ends the retries, it says why
        // (a cluster without a leader is `no_leader`, not a slow answer).
        let mut last_error: Option<Error> = None;
        // A refused token is renewed once per call; a second refusal is the answer.
        let mut renewed_token = false;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(out_of_time(last_error, timeout));
            }
            let error = match tokio::time::timeout(remaining, self.active()).await {
                Err(_) => {
                    return Err(Error::Timeout(format!(
                        "no endpoint reachable within {} ms",
                        timeout.as_millis()
                    )));
                }
                // Nothing was sent, so any request may try again.
                Ok(Err(error)) => error,
                Ok(Ok(active)) => {
                    let remaining = deadline.saturating_duration_since(Instant::now());
                    let call = call(&active, server_deadline(remaining));
                    match tokio::time::timeout(remaining, call).await {
                        Ok(Ok(answer)) => return Ok(answer),
                        Err(_) => {
                            if let Some(Error::NoLeader(_)) = last_error {
                                return Err(out_of_time(last_error, timeout));
                            }
                            return Err(Error::Timeout(format!(
                                "no answer from {} within {} ms",
                                active.endpoint,
                                timeout.as_millis()
                            )));
                        }
                        Ok(Err(status)) => {
                            let error = Error::from_status(&status, context);
                            // A retry after "no leader" that ran into the deadline still
                            // failed for want of a leader.
                            if matches!(error, Error::Timeout(_))
                                && matches!(last_error, Some(Error::NoLeader(_)))
                            {
                                return Err(out_of_time(last_error, timeout));
                            }
                            // An expired or revoked token (or auth turned on since the
                            // client learnt it was off): authenticate again and repeat the
                            // call, which the server refused before doing anything.
                            if matches!(error, Error::Unauthenticated(_))
                                && !renewed_token
                                && self.auth.renew()
                            {
                                renewed_token = true;
                                tracing::debug!(%error, "conclave client authenticating again");
                                continue;
                            }
                            if !error.is_transient() {
                                return Err(error);
                            }
                            // The member may be dead or partitioned: try another next time.
                            self.forget(active.generation);
                            if retry == Retry::AtMostOnce {
                                return Err(error);
                            }
                            error
                        }
                    }
                }
            };
            if !error.is_transient() {
                return Err(error);
            }
            let pause = self.options.backoff.delay(attempt);
            if Instant::now() + pause >= deadline {
                return Err(out_of_time(Some(error), timeout));
            }
            tracing::debug!(%error, attempt, "conclave client retrying");
            last_error = Some(error.clone());
            tokio::time::sleep(pause).await;
            attempt = attempt.saturating_add(1);
        }
    }

    /// Runs a write that must not apply twice in an exactly-once session: every attempt
    /// carries the same position, so it is retried on any transient error until `timeout`
    /// and the state machine answers a repeat from its cache. Without sessions (turned off,
    /// or a server that has none) the write is sent with the `fallback` policy.
    pub(crate) async fn call_in_session<T, F, Fut>(
        &self,
        fallback: Retry,
        context: ErrorContext,
        timeout: Duration,
        mut call: F,
    ) -> Result<T>
    where
        F: FnMut(Channel, Duration, Position) -> Fut,
        Fut: Future<Output = std::result::Result<T, tonic::Status>>,
    {
        let deadline = Instant::now() + timeout;
        let mut renewed = false;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let session = if self.options.exactly_once && !self.sessions.unsupported() {
                match self.sessions.take() {
                    Some(session) => Some(session),
                    None => self.open_session(remaining).await?,
                }
            } else {
                None
            };
            let Some(mut session) = session else {
                return self
                    .call(fallback, context, remaining, |channel, timeout| {
                        call(channel, timeout, Position::NONE)
                    })
                    .await;
            };
            let position = session.advance();
            let remaining = deadline.saturating_duration_since(Instant::now());
            let mut sent = 0u32;
            let result = self
                .call(Retry::Idempotent, context, remaining, |channel, timeout| {
                    sent = sent.saturating_add(1);
                    call(channel, timeout, position)
                })
                .await;
            match result {
                // The server forgot the session (idle past its TTL, evicted, closed). It checks
                // the session first, so the attempt that heard this applied nothing: when it
                // was the only one sent, a new session may try again.
                Err(error) if session_gone(&error) => {
                    if sent <= 1 && !renewed {
                        renewed = true;
                        continue;
                    }
                    return Err(Error::Unavailable(format!(
                        "the client session ended while the write was being retried, so whether \
                         it was applied is unknown ({error})"
                    )));
                }
                // Applied, refused, or given up on (a late copy of this position is then
                // refused as older than the next one): the session goes on.
                result => {
                    if let Some(extra) = self.sessions.put_back(session) {
                        self.close_later(extra);
                    }
                    return result;
                }
            }
        }
    }

    /// Opens a session; `None` when the server has no Session service (etcd).
    async fn open_session(&self, timeout: Duration) -> Result<Option<Session>> {
        // A repeated open leaves an unused session behind, which the server forgets by itself.
        let opened = self
            .call(
                Retry::Idempotent,
                ErrorContext::default(),
                timeout,
                |channel, timeout| async move {
                    let answer = SessionClient::new(channel)
                        .open_session(request(cv1::OpenSessionRequest {}, timeout))
                        .await;
                    match answer {
                        Err(status) if status.code() == tonic::Code::Unimplemented => Ok(None),
                        answer => answer.map(|a| Some(a.into_inner())),
                    }
                },
            )
            .await?;
        match opened {
            Some(opened) => Ok(Some(Session::opened(
                opened.client_id,
                crate::session::secret_from_bytes(&opened.session_secret),
                Duration::from_millis(opened.session_ttl_ms),
            ))),
            None => {
                tracing::debug!("the server has no client sessions; writes are sent at most once");
                self.sessions.mark_unsupported();
                Ok(None)
            }
        }
    }

    /// Closes a session the pool has no room for, in the background (best effort: an
    /// unclosed session expires by itself).
    fn close_later(&self, session: Session) {
        let (Some(active), Ok(runtime)) = (self.current(), tokio::runtime::Handle::try_current())
        else {
            return;
        };
        let timeout = self.options.request_timeout;
        runtime.spawn(async move {
            let message = cv1::CloseSessionRequest {
                client_id: session.client_id,
                session_secret: session.secret_bytes(),
            };
            let _ = SessionClient::new(active.channel)
                .close_session(request(message, timeout))
                .await;
        });
    }

    /// Closes every idle session now.
    pub(crate) async fn close_sessions(&self) -> Result<()> {
        for session in self.sessions.drain() {
            let message = cv1::CloseSessionRequest {
                client_id: session.client_id,
                session_secret: session.secret_bytes(),
            };
            let closed = self
                .call(
                    Retry::Idempotent,
                    ErrorContext::default(),
                    self.options.request_timeout,
                    |channel, timeout| {
                        let message = message.clone();
                        async move {
                            SessionClient::new(channel)
                                .close_session(request(message, timeout))
                                .await
                        }
                    },
                )
                .await;
            match closed {
                // Already forgotten (expired or closed by a retry): nothing left to close.
                Ok(_) | Err(Error::NotFound(_)) => {}
                Err(error) => return Err(error),
            }
        }
        Ok(())
    }

    /// The leader the member behind `channel` knows and the revision it has applied; an
    /// error when it does not answer within the connect timeout.
    pub(crate) async fn member_status(&self, channel: Channel) -> Result<MemberStatus> {
        let timeout = self.options.connect_timeout;
        let mut maintenance = MaintenanceClient::new(channel);
        let status = maintenance.status(request(StatusRequest {}, timeout));
        match tokio::time::timeout(timeout, status).await {
            Ok(Ok(status)) => {
                let status = status.into_inner();
                Ok(MemberStatus {
                    leader: status.leader,
                    revision: status.header.map_or(0, |h| h.revision),
                })
            }
            Ok(Err(status)) => Err(Error::status(&status)),
            Err(_) => Err(Error::Timeout(format!(
                "no status within {} ms",
                timeout.as_millis()
            ))),
        }
    }

    /// Records that the cluster has reached `revision`; never lowers what was recorded.
    pub(crate) fn raise_revision_floor(&self, revision: i64) {
        self.revision_floor.fetch_max(revision, Ordering::Relaxed);
    }

    fn revision_floor(&self) -> i64 {
        self.revision_floor.load(Ordering::Relaxed)
    }

    /// Drops the connection of `generation` so the next call picks an endpoint afresh.
    pub(crate) fn forget(&self, generation: u64) {
        let mut active = self
            .active
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if active.as_ref().is_some_and(|a| a.generation == generation) {
            // Keep the endpoint name so the next reconnect starts after it.
            if let Some(a) = active.as_mut() {
                a.generation = FORGOTTEN;
            }
        }
    }
}

/// A transport error with its causes ("transport error: tcp connect error: Connection
/// refused"), since tonic's top-level message alone says little.
/// The share of a call's remaining time kept back from the deadline the server is given,
/// so that a server which waited in vain (for a leader, a commit) says why before the
/// client's own clock ends the call: capped, and at most a fifth of what is left.
const SERVER_DEADLINE_MARGIN_MAX: Duration = Duration::from_millis(200);

fn server_deadline(remaining: Duration) -> Duration {
    remaining.saturating_sub(SERVER_DEADLINE_MARGIN_MAX.min(remaining / 5))
}

/// The shortest wait a Lock or Campaign asks the server for again after its previous call
/// ran out of server time. Each call keeps [`server_deadline`]'s margin back, so asking again
/// for what is left would shrink to calls of a millisecond or less; the client then drops
/// such a call before the server answers, the server withdraws the dropped call's queue key
/// while the next call has already found it, and that next call reports the key lost ("lease
/// not found") instead of a timeout. Less than this left means the wait has timed out.
pub(crate) const QUEUE_WAIT_SLICE_MIN: Duration = Duration::from_millis(250);

/// How long the next Lock or Campaign call of a wait ending at `give_up` (if any) may last:
/// `None` once what is left is under [`QUEUE_WAIT_SLICE_MIN`]; 30 s slices without one.
pub(crate) fn queue_wait_slice(give_up: Option<Instant>, first: bool) -> Option<Duration> {
    let Some(at) = give_up else {
        return Some(Duration::from_secs(30));
    };
    let left = at.saturating_duration_since(Instant::now());
    if left.is_zero() || (!first && left < QUEUE_WAIT_SLICE_MIN) {
        return None;
    }
    Some(left)
}

/// The error of a call whose retries ran out of time: `no_leader` when the last attempt
/// was refused for want of a leader, else a timeout that names the last failure.
fn out_of_time(last_error: Option<Error>, timeout: Duration) -> Error {
    match last_error {
        Some(Error::NoLeader(reason)) => Error::NoLeader(format!(
            "{reason} (still none after retrying for {} ms)",
            timeout.as_millis()
        )),
        Some(error) => Error::Timeout(format!(
            "no answer within {} ms; last failure: {error}",
            timeout.as_millis()
        )),
        None => Error::Timeout(format!("no answer within {} ms", timeout.as_millis())),
    }
}

/// Some layers print their cause in their own message too (hyper's "tcp connect error"
/// wraps an io error whose text repeats it); a cause already said is not said twice.
fn source_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let said = cause.to_string();
        if !said.is_empty() && !text.contains(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        source = cause.source();
    }
    text
}

/// The handle shared by every API object.
pub(crate) type Shared = Arc<Inner>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        let backoff = Backoff {
            initial: Duration::from_millis(10),
            max: Duration::from_millis(100),
        };
        let full: Vec<u128> = (0..6)
            .map(|a| backoff.delay_with_jitter(a, 1.0).as_millis())
            .collect();
        assert_eq!(full, [10, 20, 40, 80, 100, 100]);
        assert_eq!(backoff.delay_with_jitter(0, 0.0), Duration::from_millis(5));
        assert_eq!(
            backoff.delay_with_jitter(40, 0.0),
            Duration::from_millis(50)
        );
        assert_eq!(
            backoff.delay_with_jitter(u32::MAX, 1.0),
            Duration::from_millis(100)
        );
        // Out-of-range jitter is clamped rather than trusted.
        assert_eq!(backoff.delay_with_jitter(1, 7.0), Duration::from_millis(20));
        assert_eq!(
            backoff.delay_with_jitter(1, f64::NAN),
            Duration::from_millis(10)
        );
        for attempt in 0..50 {
            let d = backoff.delay(attempt);
            assert!(d <= backoff.max && d >= backoff.initial / 2, "{d:?}");
        }
    }

    #[test]
    fn a_reconnect_prefers_members_that_keep_up() {
        // No floor yet (no watch has checked the cluster): any member that knows a leader.
        assert_eq!(standing(true, Some(0), 0), Standing::KeepsUp);
        // The leader itself (or a member that led the probe to it) keeps up by definition.
        assert_eq!(standing(true, None, 900), Standing::KeepsUp);
        assert_eq!(standing(true, Some(900), 900), Standing::KeepsUp);
        // Names a leader but has not applied what the cluster is known to have.
        assert_eq!(standing(true, Some(12), 900), Standing::Behind);
        assert_eq!(standing(false, Some(950), 900), Standing::Leaderless);
        // Behind beats leaderless; among the behind, the most advanced wins.
        assert!(preference(Standing::Behind, 12) < preference(Standing::Leaderless, 950));
        assert!(preference(Standing::Behind, 800) < preference(Standing::Behind, 12));
        assert!(preference(Standing::KeepsUp, 0) < preference(Standing::Behind, 800));
    }

    #[test]
    fn endpoints_get_a_scheme() {
        assert_eq!(
            normalize_endpoint("127.0.0.1:2379", false),
            "http://127.0.0.1:2379"
        );
        assert_eq!(normalize_endpoint(" http://a:1/ ", true), "http://a:1");
        assert_eq!(normalize_endpoint("a:1", true), "https://a:1");
        assert!(Inner::new(&[], ClientOptions::default()).is_err());
        assert!(Inner::new(&["  ".into()], ClientOptions::default()).is_err());
    }

    #[tokio::test]
    async fn unreachable_endpoints_fail_with_connection_failed() {
        let options = ClientOptions {
            connect_timeout: Duration::from_millis(200),
            ..ClientOptions::default()
        };
        // Port 1 on loopback refuses connections.
        let inner = Inner::new(&["127.0.0.1:1".into()], options).expect("valid endpoint");
        let error = inner
            .active()
            .await
            .err()
            .expect("nothing listens on port 1");
        assert_eq!(error.code(), "connection_failed", "{error}");
    }
}
