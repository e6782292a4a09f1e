//! Enforcement of [`ClientLimits`]: the slots a client resource takes while it lives, the
//! counters of what was refused, and the rate-limited WARN lines that say so.
//!
//! ```text
//!  accept ─► connection slot? ── no ─► close at once (counted, WARN)
//!        └─► IdleClosing stream: nothing read for client_idle_timeout_ms ─► closed (counted)
//!  Watch create / LeaseKeepAlive stream ─► slot? ── no ─► RESOURCE_EXHAUSTED (counted, WARN)
//!  Subscribe / Observe stream, waiting Lock / Campaign / queue Claim ─► Limits::wait(kind)? ── no ─► the same
//!  the slot is released when the connection, watch or stream ends
//! ```

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tonic::Status;
use tonic::transport::server::Connected;

use crate::config::ClientLimits;

/// At most one WARN line per kind of refusal this often; the counters count every one.
pub const LIMIT_WARN_INTERVAL_MS: u64 = 1_000;

/// How many times each cap refused something since the node started (metrics export is a
/// later issue; tests and debugging read them).
#[derive(Debug, Default)]
pub struct LimitStats {
    pub connections_refused: AtomicU64,
    pub connections_idle_closed: AtomicU64,
    pub watches_refused: AtomicU64,
    pub lease_keepalive_streams_refused: AtomicU64,
    pub inbox_requests_refused: AtomicU64,
    pub ranges_refused: AtomicU64,
}

/// Lets one WARN line through per [`LIMIT_WARN_INTERVAL_MS`].
#[derive(Debug)]
pub struct WarnGate {
    start: Instant,
    /// Milliseconds after `start` of the last line let through, plus one (0: none yet).
    last_ms: AtomicU64,
}

impl Default for WarnGate {
    fn default() -> Self {
        WarnGate {
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
        }
    }
}

impl WarnGate {
    /// Whether a line may be written now.
    pub fn allow(&self) -> bool {
        let now_ms = u64::try_from(self.start.elapsed().as_millis())
            .unwrap_or(u64::MAX)
            .saturating_add(1);
        let last_ms = self.last_ms.load(Ordering::Relaxed);
        if last_ms != 0 && now_ms.saturating_sub(last_ms) < LIMIT_WARN_INTERVAL_MS {
            return false;
        }
        self.last_ms
            .compare_exchange(last_ms, now_ms, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }
}

/// A long wait a node caps: a stream or a blocked call that holds the node's memory and a task
/// for as long as the client likes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    TopicSubscription,
    ElectionObserver,
    Lock,
    Campaign,
    QueueClaim,
}

impl Wait {
    pub const ALL: [Wait; 5] = [
        Wait::TopicSubscription,
        Wait::ElectionObserver,
        Wait::Lock,
        Wait::Campaign,
        Wait::QueueClaim,
    ];

    /// What the cap counts, for the refusal's sentence.
    fn what(self) -> &'static str {
        match self {
            Wait::TopicSubscription => "topic subscriptions open",
            Wait::ElectionObserver => "election observers open",
            Wait::Lock => "Lock calls waiting",
            Wait::Campaign => "Campaign calls waiting",
            Wait::QueueClaim => "queue Claim calls waiting",
        }
    }

    /// The serve flag that sets the cap.
    pub fn flag(self) -> &'static str {
        match self {
            Wait::TopicSubscription => "--topic-subscriptions-max",
            Wait::ElectionObserver => "--election-observers-max",
            Wait::Lock => "--lock-waits-max",
            Wait::Campaign => "--campaign-waits-max",
            Wait::QueueClaim => "--queue-claim-waits-max",
        }
    }

    fn limit(self, caps: &ClientLimits) -> usize {
        match self {
            Wait::TopicSubscription => caps.topic_subscriptions_max,
            Wait::ElectionObserver => caps.election_observers_max,
            Wait::Lock => caps.lock_waits_max,
            Wait::Campaign => caps.campaign_waits_max,
            Wait::QueueClaim => caps.queue_claim_waits_max,
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// The slots of one [`Wait`] cap, what it refused, and its WARN gate.
#[derive(Debug)]
struct WaitSlots {
    slots: Arc<Semaphore>,
    refused: AtomicU64,
    warn: WarnGate,
}

/// The node's client-resource slots and counters.
#[derive(Debug)]
pub struct Limits {
    pub caps: ClientLimits,
    pub stats: LimitStats,
    connections: Arc<Semaphore>,
    watches: Arc<Semaphore>,
    lease_keepalive_streams: Arc<Semaphore>,
    connection_warn: WarnGate,
    idle_warn: WarnGate,
    watch_warn: WarnGate,
    keepalive_warn: WarnGate,
    inbox_warn: WarnGate,
    waits: [WaitSlots; 5],
    range_warn: WarnGate,
}

impl Limits {
    pub fn new(caps: ClientLimits) -> Limits {
        Limits {
            connections: Arc::new(Semaphore::new(caps.client_connections_max)),
            watches: Arc::new(Semaphore::new(caps.watches_max)),
            lease_keepalive_streams: Arc::new(Semaphore::new(caps.lease_keepalive_streams_max)),
            waits: Wait::ALL.map(|kind| WaitSlots {
                slots: Arc::new(Semaphore::new(kind.limit(&caps))),
                refused: AtomicU64::new(0),
                warn: WarnGate::default(),
            }),
            caps,
            stats: LimitStats::default(),
            connection_warn: WarnGate::default(),
            idle_warn: WarnGate::default(),
            watch_warn: WarnGate::default(),
            keepalive_warn: WarnGate::default(),
            inbox_warn: WarnGate::default(),
            range_warn: WarnGate::default(),
        }
    }

    /// A slot for a newly accepted connection from `peer`, or `None` (counted and logged)
    /// when `client_connections_max` are open.
    pub fn connection(&self, peer: Option<SocketAddr>) -> Option<OwnedSemaphorePermit> {
        let permit = self.connections.clone().try_acquire_owned().ok();
        if permit.is_none() {
            self.stats
                .connections_refused
                .fetch_add(1, Ordering::Relaxed);
            if self.connection_warn.allow() {
                tracing::warn!(
                    client = ?peer,
                    limit = self.caps.client_connections_max,
                    refused = self.stats.connections_refused.load(Ordering::Relaxed),
                    "client connection closed: client_connections_max connections are open"
                );
            }
        }
        permit
    }

    fn idle_closed(&self, peer: Option<SocketAddr>) {
        self.stats
            .connections_idle_closed
            .fetch_add(1, Ordering::Relaxed);
        if self.idle_warn.allow() {
            tracing::warn!(
                client = ?peer,
                idle_timeout_ms = self.caps.client_idle_timeout_ms,
                closed = self.stats.connections_idle_closed.load(Ordering::Relaxed),
                "client connection closed: nothing received within client_idle_timeout_ms"
            );
        }
    }

    /// Watch slots left on this node.
    pub fn watches_available(&self) -> usize {
        self.watches.available_permits()
    }

    /// A slot for a new watch, or RESOURCE_EXHAUSTED (counted and logged).
    pub fn watch(&self, client: Option<SocketAddr>) -> Result<OwnedSemaphorePermit, Status> {
        self.watches.clone().try_acquire_owned().map_err(|_| {
            self.stats.watches_refused.fetch_add(1, Ordering::Relaxed);
            if self.watch_warn.allow() {
                tracing::warn!(
                    client = ?client,
                    limit = self.caps.watches_max,
                    refused = self.stats.watches_refused.load(Ordering::Relaxed),
                    "watch refused: watches_max watches are open on this node"
                );
            }
            Status::resource_exhausted(watches_exhausted_reason(self.caps.watches_max))
        })
    }

    /// A slot for a new LeaseKeepAlive stream, or RESOURCE_EXHAUSTED (counted and logged).
    pub fn lease_keepalive_stream(
        &self,
        client: Option<SocketAddr>,
    ) -> Result<OwnedSemaphorePermit, Status> {
        self.lease_keepalive_streams
            .clone()
            .try_acquire_owned()
            .map_err(|_| {
                let refused = &self.stats.lease_keepalive_streams_refused;
                refused.fetch_add(1, Ordering::Relaxed);
                let limit = self.caps.lease_keepalive_streams_max;
                if self.keepalive_warn.allow() {
                    tracing::warn!(
                        client = ?client,
                        limit,
                        refused = refused.load(Ordering::Relaxed),
                        "lease keepalive stream refused: lease_keepalive_streams_max are open"
                    );
                }
                Status::resource_exhausted(format!(
                    "conclave: this node has its maximum of {limit} lease keepalive streams open \
                     (--lease-keepalive-streams-max); send keepalives for many leases on one stream"
                ))
            })
    }

    /// A slot for a long wait of `kind`, held until the stream or wait ends, or
    /// RESOURCE_EXHAUSTED naming the cap and its flag (counted and logged).
    pub fn wait(
        &self,
        kind: Wait,
        client: Option<SocketAddr>,
    ) -> Result<OwnedSemaphorePermit, Status> {
        let slots = &self.waits[kind.index()];
        slots.slots.clone().try_acquire_owned().map_err(|_| {
            let limit = kind.limit(&self.caps);
            slots.refused.fetch_add(1, Ordering::Relaxed);
            if slots.warn.allow() {
                tracing::warn!(
                    client = ?client,
                    limit,
                    flag = kind.flag(),
                    refused = slots.refused.load(Ordering::Relaxed),
                    "{} refused: the node is at its cap",
                    kind.what()
                );
            }
            Status::resource_exhausted(format!(
                "conclave: this node has its maximum of {limit} {} ({}); retry when one ends",
                kind.what(),
                kind.flag()
            ))
        })
    }

    /// How many waits of `kind` were refused since the node started.
    pub fn waits_refused(&self, kind: Wait) -> u64 {
        self.waits[kind.index()].refused.load(Ordering::Relaxed)
    }

    /// Checks how many distinct topics an Inbox request names.
    pub fn inbox_topics(&self, client: Option<SocketAddr>, distinct: usize) -> Result<(), Status> {
        let limit = self.caps.topics_per_request_max;
        if distinct <= limit {
            return Ok(());
        }
        let refused = &self.stats.inbox_requests_refused;
        refused.fetch_add(1, Ordering::Relaxed);
        if self.inbox_warn.allow() {
            tracing::warn!(
                client = ?client,
                topics = distinct,
                limit,
                refused = refused.load(Ordering::Relaxed),
                "inbox refused: more topics than topics_per_request_max"
            );
        }
        Err(Status::resource_exhausted(format!(
            "conclave: an inbox request may name at most {limit} distinct topics \
             (--topics-per-request-max); it named {distinct}"
        )))
    }
}

impl Limits {
    /// Counts and logs a KV Range refused for passing `range_response_bytes_max` (the state
    /// stopped building it there), and the status the client gets.
    pub fn range_refused(&self, client: Option<SocketAddr>) -> Status {
        let limit = self.caps.range_response_bytes_max;
        let refused = &self.stats.ranges_refused;
        refused.fetch_add(1, Ordering::Relaxed);
        if self.range_warn.allow() {
            tracing::warn!(
                client = ?client,
                limit,
                refused = refused.load(Ordering::Relaxed),
                "range refused: answer larger than range_response_bytes_max"
            );
        }
        Status::resource_exhausted(format!(
            "conclave: range answer is larger than the cap of {limit} bytes \
             (--range-response-bytes-max); ask for fewer keys with `limit` or a narrower range"
        ))
    }
}

/// Why a watch was refused (also the cancel reason etcd clients read on a watch stream).
pub fn watches_exhausted_reason(limit: usize) -> String {
    format!(
        "conclave: resource exhausted: this node has its maximum of {limit} watches open \
         (--watches-max); cancel watches or watch from another member"
    )
}

/// A client connection that holds its slot while open and ends (an I/O error to the HTTP/2
/// server, which closes it) once nothing has been read from it for `idle`.
///
/// Only reads count as activity: the server's own writes (its SETTINGS, its pings) go out
/// whether or not anyone is there, while a live client answers the pings.
pub struct IdleClosing<S> {
    inner: S,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
    limits: Arc<Limits>,
    peer: Option<SocketAddr>,
    _slot: OwnedSemaphorePermit,
}

impl<S> IdleClosing<S> {
    pub fn new(
        inner: S,
        limits: Arc<Limits>,
        peer: Option<SocketAddr>,
        slot: OwnedSemaphorePermit,
    ) -> Self {
        let idle = Duration::from_millis(limits.caps.client_idle_timeout_ms);
        IdleClosing {
            inner,
            idle,
            deadline: Box::pin(tokio::time::sleep(idle)),
            limits,
            peer,
            _slot: slot,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for IdleClosing<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    let next = Instant::now() + this.idle;
                    this.deadline.as_mut().reset(next);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(error)) => Poll::Ready(Err(error)),
            Poll::Pending => match this.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    this.limits.idle_closed(this.peer);
                    Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "client connection idle past client_idle_timeout_ms",
                    )))
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for IdleClosing<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bytes: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, bytes)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl<S: Connected> Connected for IdleClosing<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_run_out_and_come_back() {
        let caps = ClientLimits {
            watches_max: 2,
            ..ClientLimits::default()
        };
        let limits = Limits::new(caps);
        let first = limits.watch(None).expect("a slot");
        let _second = limits.watch(None).expect("a slot");
        let refused = limits.watch(None).expect_err("full");
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        assert_eq!(limits.stats.watches_refused.load(Ordering::Relaxed), 1);
        drop(first);
        assert!(limits.watch(None).is_ok(), "a released slot is reused");
    }

    #[test]
    fn each_wait_has_its_own_cap_and_names_its_flag() {
        let limits = Limits::new(ClientLimits {
            topic_subscriptions_max: 1,
            election_observers_max: 2,
            lock_waits_max: 3,
            campaign_waits_max: 4,
            queue_claim_waits_max: 5,
            ..ClientLimits::default()
        });
        for (kind, cap) in Wait::ALL.into_iter().zip(1..) {
            let held: Vec<_> = (0..cap)
                .map(|_| limits.wait(kind, None).expect("a slot"))
                .collect();
            let refused = limits.wait(kind, None).expect_err("full");
            assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
            assert!(refused.message().contains(kind.flag()), "{refused:?}");
            assert!(refused.message().contains(&format!("maximum of {cap} ")));
            assert_eq!(limits.waits_refused(kind), 1);
            drop(held);
            assert!(limits.wait(kind, None).is_ok(), "released slots are reused");
        }
    }

    #[test]
    fn inbox_topics_are_capped() {
        let limits = Limits::new(ClientLimits {
            topics_per_request_max: 3,
            ..ClientLimits::default()
        });
        assert!(limits.inbox_topics(None, 3).is_ok());
        let refused = limits.inbox_topics(None, 4).expect_err("too many");
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
    }

    #[test]
    fn the_warn_gate_lets_one_line_through_per_interval() {
        let gate = WarnGate::default();
        assert!(gate.allow());
        assert!(!gate.allow());
    }
}
