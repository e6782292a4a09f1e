//! Leases: grant, revoke, time-to-live, listing, and a keepalive task that knows how long the
//! lease is certainly still alive.
//!
//! # Clock assumption
//!
//! The server starts a lease's countdown when it *processes* a keepalive, which is after the
//! client *sent* it; the state machine guarantees it never expires a lease before its last
//! acknowledged keepalive + TTL (docs/state.md, "never early"). So measured from the instant
//! the client sent the last acknowledged keepalive, the lease lives at least TTL of the
//! server's time. Wall clocks need not agree; what we assume is that the client's monotonic
//! clock does not run slower than the server leaders' clocks by more than
//! [`LeaseSafety::clock_drift_ppm`]. The local deadline is therefore
//!
//! ```text
//! deadline = sent_at_of_last_acked_keepalive + TTL × (1 − drift) − margin
//! ```
//!
//! and the margin also covers the delay between the deadline passing and the holder's code
//! noticing (a busy runtime). Past the deadline the client treats the lease as gone, even if
//! the server has not expired it yet: early, never late.
//!
//! # Giving a lease up
//!
//! When the local deadline passes unacknowledged, the client gives the lease up: before
//! anything reports it lost ([`LeaseKeepAlive::expired`], [`LeaseKeepAlive::state`], an
//! election's or a lock's loss) it resets every connection it has ([`crate::socket`]), and it
//! sends no keepalive for that lease again. A keepalive still queued in a connection cut by a
//! partition is thrown away with it, so it cannot reach the leader later and renew the lease
//! for one more TTL while its holder believes it gone.

use std::sync::{Arc, Once};
use std::time::Duration;

use conclave_proto::etcdserverpb::lease_client::LeaseClient;
use conclave_proto::etcdserverpb::{
    LeaseGrantRequest, LeaseKeepAliveRequest, LeaseLeasesRequest, LeaseRevokeRequest,
    LeaseTimeToLiveRequest,
};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;

use crate::Client;
use crate::conn::{Retry, Shared, request};
use crate::error::{Error, ErrorContext, Result};
use crate::socket::Sockets;

/// An etcd lease id.
pub type LeaseId = i64;

/// Safety margins applied to the local lease deadline (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseSafety {
    /// Subtracted from every deadline.
    pub margin: Duration,
    /// Largest rate by which the client's clock may run slow relative to the server's, in
    /// parts per million of the TTL.
    pub clock_drift_ppm: u32,
}

impl Default for LeaseSafety {
    fn default() -> Self {
        // 1% covers far worse than hardware clock drift (about 100 ppm) and leaves room for
        // a VM being descheduled; 200 ms covers the holder noticing late.
        LeaseSafety {
            margin: Duration::from_millis(200),
            clock_drift_ppm: 10_000,
        }
    }
}

impl LeaseSafety {
    /// Until when the client may assume a lease alive, given that a keepalive (or the grant)
    /// sent at `sent_at` was acknowledged with `ttl`. Never later than `sent_at + ttl`; equal
    /// to `sent_at` when the margins eat the whole TTL.
    pub fn local_deadline(&self, sent_at: Instant, ttl: Duration) -> Instant {
        let drift = ttl.mul_f64(f64::from(self.clock_drift_ppm.min(1_000_000)) / 1e6);
        let usable = ttl.saturating_sub(drift).saturating_sub(self.margin);
        sent_at + usable
    }
}

/// Answer of a lease grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseGrant {
    pub id: LeaseId,
    /// The TTL the server granted (it may raise small TTLs).
    pub ttl: Duration,
    /// When the grant request was sent: the lease lives at least `ttl` from here.
    pub sent_at: Instant,
}

/// Answer of a time-to-live query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseTimeToLive {
    pub id: LeaseId,
    /// Time left, in whole seconds as the server reports it.
    pub remaining: Duration,
    pub granted_ttl: Duration,
    /// Keys attached to the lease (only when asked for).
    pub keys: Vec<Vec<u8>>,
}

/// What a keepalive task knows about its lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseState {
    /// No keepalive acknowledged yet (a lease adopted by id, not granted here).
    Pending,
    /// Alive at least until `deadline` (already reduced by [`LeaseSafety`]).
    Alive {
        ttl: Duration,
        /// When the last acknowledged keepalive was sent.
        last_acked_sent_at: Instant,
        deadline: Instant,
    },
    /// Gone, or not known to be alive any more. Final.
    Expired { reason: String },
}

/// Whole seconds for the etcd wire, rounding up so a granted lease is never shorter than asked.
pub(crate) fn ttl_seconds(ttl: Duration) -> Result<i64> {
    if ttl.is_zero() {
        return Err(Error::InvalidArgument(
            "a lease TTL must be positive".into(),
        ));
    }
    let too_large = || Error::TooLarge(format!("lease TTL {ttl:?}"));
    let whole = ttl
        .as_secs()
        .checked_add(u64::from(ttl.subsec_nanos() > 0))
        .ok_or_else(too_large)?;
    i64::try_from(whole).map_err(|_| too_large())
}

fn seconds(ttl: i64) -> Duration {
    Duration::from_secs(u64::try_from(ttl).unwrap_or(0))
}

impl Client {
    /// Grants a lease of at least `ttl` (rounded up to whole seconds).
    pub async fn lease_grant(&self, ttl: Duration) -> Result<LeaseGrant> {
        let ttl_s = ttl_seconds(ttl)?;
        // In an exactly-once session a retry cannot grant a second lease. The answer to a
        // retry may be the first attempt's grant, whose TTL started when that attempt was
        // applied: so the lease is dated from before the first attempt, not the last.
        let sent_at = Instant::now();
        let answer = self
            .call_in_session(
                Retry::AtMostOnce,
                ErrorContext::default(),
                |channel, timeout, at| async move {
                    LeaseClient::new(channel)
                        .lease_grant(at.request(LeaseGrantRequest { ttl: ttl_s, id: 0 }, timeout))
                        .await
                },
            )
            .await?
            .into_inner();
        if !answer.error.is_empty() {
            return Err(Error::InvalidArgument(answer.error));
        }
        Ok(LeaseGrant {
            id: answer.id,
            ttl: seconds(answer.ttl),
            sent_at,
        })
    }

    /// Revokes a lease, deleting its keys and ending candidacies and locks held under it.
    pub async fn lease_revoke(&self, id: LeaseId) -> Result<()> {
        let context = ErrorContext {
            lease_id: id,
            revision: 0,
        };
        // In a session, so a retry after the revoke applied answers success, not "not found".
        self.call_in_session(
            Retry::Idempotent,
            context,
            |channel, timeout, at| async move {
                LeaseClient::new(channel)
                    .lease_revoke(at.request(LeaseRevokeRequest { id }, timeout))
                    .await
            },
        )
        .await?;
        Ok(())
    }

    /// Time left on a lease; [`Error::LeaseExpired`] when it does not exist.
    pub async fn lease_time_to_live(&self, id: LeaseId, keys: bool) -> Result<LeaseTimeToLive> {
        let context = ErrorContext {
            lease_id: id,
            revision: 0,
        };
        let answer = self
            .call(Retry::Idempotent, context, |channel, timeout| async move {
                LeaseClient::new(channel)
                    .lease_time_to_live(request(LeaseTimeToLiveRequest { id, keys }, timeout))
                    .await
            })
            .await?
            .into_inner();
        if answer.ttl < 0 {
            return Err(Error::LeaseExpired {
                lease_id: id,
                message: "the server does not know this lease".into(),
            });
        }
        Ok(LeaseTimeToLive {
            id,
            remaining: seconds(answer.ttl),
            granted_ttl: seconds(answer.granted_ttl),
            keys: answer.keys.into_iter().map(Vec::from).collect(),
        })
    }

    /// Ids of every live lease.
    pub async fn leases(&self) -> Result<Vec<LeaseId>> {
        let answer = self
            .call(
                Retry::Idempotent,
                ErrorContext::default(),
                |channel, timeout| async move {
                    LeaseClient::new(channel)
                        .lease_leases(request(LeaseLeasesRequest {}, timeout))
                        .await
                },
            )
            .await?
            .into_inner();
        Ok(answer.leases.into_iter().map(|l| l.id).collect())
    }

    /// Sends one keepalive and returns the renewed TTL (the CLI's `lease keepalive --once`).
    pub async fn lease_keep_alive_once(&self, id: LeaseId) -> Result<Duration> {
        let context = ErrorContext {
            lease_id: id,
            revision: 0,
        };
        let ttl = self
            .call(Retry::Idempotent, context, |channel, timeout| async move {
                let (tx, rx) = mpsc::channel(1);
                let _ = tx.send(LeaseKeepAliveRequest { id }).await;
                // Half-close after the one request: the server sees a goodbye, not a stream
                // cut off under it (which would shorten the lease to a short grace).
                drop(tx);
                let mut answers = LeaseClient::new(channel)
                    .lease_keep_alive(request(ReceiverStream::new(rx), timeout))
                    .await?
                    .into_inner();
                match answers.next().await {
                    Some(answer) => Ok(answer?.ttl),
                    None => Err(tonic::Status::unavailable("keepalive stream closed")),
                }
            })
            .await?;
        if ttl <= 0 {
            return Err(Error::LeaseExpired {
                lease_id: id,
                message: "the server reports the lease gone".into(),
            });
        }
        Ok(seconds(ttl))
    }

    /// Grants a lease and keeps it alive until the returned handle is dropped.
    pub async fn lease_grant_kept(&self, ttl: Duration) -> Result<LeaseKeepAlive> {
        let grant = self.lease_grant(ttl).await?;
        let safety = self.inner.options.lease_safety;
        let state = LeaseState::Alive {
            ttl: grant.ttl,
            last_acked_sent_at: grant.sent_at,
            deadline: safety.local_deadline(grant.sent_at, grant.ttl),
        };
        Ok(LeaseKeepAlive::start(
            self.inner.clone(),
            grant.id,
            state,
            true,
        ))
    }

    /// Keeps an existing lease alive (not revoked when the handle is dropped).
    pub fn lease_keep_alive(&self, id: LeaseId) -> LeaseKeepAlive {
        LeaseKeepAlive::start(self.inner.clone(), id, LeaseState::Pending, false)
    }
}

/// A running keepalive task. Dropping it stops the keepalives (and, for a lease granted with
/// [`Client::lease_grant_kept`], revokes the lease in the background).
pub struct LeaseKeepAlive {
    id: LeaseId,
    state: watch::Receiver<LeaseState>,
    give_up: Arc<GiveUp>,
    task: JoinHandle<()>,
    revoke_on_drop: bool,
    inner: Shared,
}

impl LeaseKeepAlive {
    fn start(inner: Shared, id: LeaseId, initial: LeaseState, revoke_on_drop: bool) -> Self {
        let (tx, rx) = watch::channel(initial);
        let give_up = Arc::new(GiveUp::new(inner.sockets.clone()));
        let task = tokio::spawn(keep_alive_task(inner.clone(), id, tx, give_up.clone()));
        LeaseKeepAlive {
            id,
            state: rx,
            give_up,
            task,
            revoke_on_drop,
            inner,
        }
    }

    pub fn id(&self) -> LeaseId {
        self.id
    }

    /// The state right now; an `Alive` whose deadline has passed is reported as `Expired`.
    pub fn state(&self) -> LeaseState {
        let state = self.state.borrow().clone();
        match state {
            LeaseState::Alive { deadline, .. } if Instant::now() >= deadline => {
                self.give_up.now(self.id);
                LeaseState::Expired {
                    reason: "no keepalive acknowledged in time (local deadline passed)".into(),
                }
            }
            other => other,
        }
    }

    /// The local deadline, if the lease is known alive.
    pub fn deadline(&self) -> Option<Instant> {
        match self.state() {
            LeaseState::Alive { deadline, .. } => Some(deadline),
            _ => None,
        }
    }

    /// Resolves when the lease must be considered gone: the server said so, or the local
    /// deadline passed without a fresher acknowledgement. Returns the reason.
    pub fn expired(&self) -> impl Future<Output = String> + Send + 'static {
        let mut state = self.state.clone();
        let give_up = self.give_up.clone();
        let id = self.id;
        async move { wait_expired(&mut state, &give_up, id).await }
    }

    /// A receiver of state changes, for tasks that outlive a borrow of this handle.
    pub(crate) fn subscribe(&self) -> watch::Receiver<LeaseState> {
        self.state.clone()
    }

    /// What gives this lease up at its local deadline, for [`wait_expired`] elsewhere.
    pub(crate) fn give_up_handle(&self) -> Arc<GiveUp> {
        self.give_up.clone()
    }

    /// Stops the keepalives without revoking (the lease then expires after its TTL).
    pub fn stop(mut self) {
        self.revoke_on_drop = false;
        self.task.abort();
    }

    /// Stops the keepalives and revokes the lease now.
    pub async fn revoke(mut self) -> Result<()> {
        self.revoke_on_drop = false;
        self.task.abort();
        Client {
            inner: self.inner.clone(),
        }
        .lease_revoke(self.id)
        .await
    }
}

impl Drop for LeaseKeepAlive {
    fn drop(&mut self) {
        self.task.abort();
        if self.revoke_on_drop
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            let client = Client {
                inner: self.inner.clone(),
            };
            let id = self.id;
            // Best effort: if it fails the lease still expires after its TTL.
            runtime.spawn(async move {
                let _ = client.lease_revoke(id).await;
            });
        }
    }
}

/// Gives lease `id` up when its local deadline passed unacknowledged (see the module docs):
/// the client's connections are reset, once, before anything reports the lease lost.
pub(crate) struct GiveUp {
    sockets: Arc<Sockets>,
    done: Once,
}

impl GiveUp {
    pub(crate) fn new(sockets: Arc<Sockets>) -> Self {
        GiveUp {
            sockets,
            done: Once::new(),
        }
    }

    /// Resets the client's connections the first time; later calls do nothing (connections
    /// made since carry nothing of this lease).
    pub(crate) fn now(&self, id: LeaseId) {
        self.done.call_once(|| {
            let reset = self.sockets.reset_all();
            tracing::debug!(
                lease = id,
                connections = reset,
                "lease given up at its local deadline; connections reset"
            );
        });
    }
}

/// Waits until `state` is expired (by the server's word or the local deadline); a lease past
/// its local deadline is given up through `give_up` before this returns.
pub(crate) async fn wait_expired(
    state: &mut watch::Receiver<LeaseState>,
    give_up: &GiveUp,
    id: LeaseId,
) -> String {
    loop {
        let current = state.borrow_and_update().clone();
        match current {
            LeaseState::Expired { reason } => return reason,
            LeaseState::Alive { deadline, .. } => {
                tokio::select! {
                    _ = tokio::time::sleep_until(deadline) => {
                        // A renewal may have landed at the same moment; look once more.
                        if let LeaseState::Alive { deadline: newer, .. } = &*state.borrow()
                            && *newer > Instant::now()
                        {
                            continue;
                        }
                        give_up.now(id);
                        return "no keepalive acknowledged in time (local deadline passed)".into();
                    }
                    changed = state.changed() => {
                        if changed.is_err() {
                            return "the keepalive task stopped".into();
                        }
                    }
                }
            }
            LeaseState::Pending => {
                if state.changed().await.is_err() {
                    return "the keepalive task stopped".into();
                }
            }
        }
    }
}

/// Request metadata that marks a keepalive stream whose connection is the client's liveness
/// (the server's `LEASE_LIVENESS_HEADER`): if the connection is closed under the stream
/// without a goodbye, the server shortens the lease to a short grace.
pub const LEASE_LIVENESS_HEADER: &str = "conclave-lease-liveness";

/// When the next keepalive is due after one acknowledged with `ttl`: every TTL/3, so two may
/// be lost before the lease is in danger.
pub(crate) fn keepalive_interval(ttl: Duration) -> Duration {
    (ttl / 3).max(Duration::from_millis(100))
}

/// Whether a keepalive that failed with `error` is tried again (until the lease's local
/// deadline) rather than ending the lease. A member that timed out (busy, or waiting for a
/// leadership check during an election) said nothing about the lease, so it is no reason to
/// report a lease lost that may still have seconds to live.
fn keepalive_may_retry(error: &Error) -> bool {
    error.is_transient() || matches!(error, Error::Timeout(_))
}

/// Renews lease `id` until the server says it is gone or its local deadline passes; then
/// the lease is given up and no further keepalive is sent, even one already on its way out
/// of a reconnect.
async fn keep_alive_task(
    inner: Shared,
    id: LeaseId,
    state: watch::Sender<LeaseState>,
    give_up: Arc<GiveUp>,
) {
    let mut watching = state.subscribe();
    tokio::select! {
        () = keep_alive_loop(inner, id, &state, &give_up) => {}
        reason = wait_expired(&mut watching, &give_up, id) => {
            state.send_if_modified(|current| match current {
                LeaseState::Expired { .. } => false,
                _ => {
                    *current = LeaseState::Expired { reason };
                    true
                }
            });
        }
    }
}

async fn keep_alive_loop(
    inner: Shared,
    id: LeaseId,
    state: &watch::Sender<LeaseState>,
    give_up: &GiveUp,
) {
    let safety = inner.options.lease_safety;
    let mut failures = 0u32;
    let current_deadline = |state: &watch::Sender<LeaseState>| match &*state.borrow() {
        LeaseState::Alive { deadline, .. } => Some(*deadline),
        _ => None,
    };
    'reconnect: loop {
        if let Some(deadline) = current_deadline(state)
            && Instant::now() >= deadline
        {
            give_up.now(id);
            let _ = state.send(LeaseState::Expired {
                reason: "no keepalive acknowledged before the local deadline".into(),
            });
            return;
        }
        let active = match inner.active().await {
            Ok(active) => active,
            Err(error) => {
                tracing::debug!(%error, lease = id, "keepalive: no endpoint");
                pause(&inner, state, failures).await;
                failures = failures.saturating_add(1);
                continue;
            }
        };
        let (tx, rx) = mpsc::channel(1);
        // This stream lives as long as this process: if its connection is closed under it
        // (the process died), the server may end the lease after a short grace instead of
        // the whole TTL.
        let mut stream = tonic::Request::new(ReceiverStream::new(rx));
        stream.metadata_mut().insert(
            LEASE_LIVENESS_HEADER,
            tonic::metadata::MetadataValue::from_static("connection"),
        );
        let mut answers = match LeaseClient::new(active.channel.clone())
            .lease_keep_alive(stream)
            .await
        {
            Ok(answers) => answers.into_inner(),
            Err(status) => {
                let error = Error::status(&status);
                if !keepalive_may_retry(&error) {
                    let _ = state.send(LeaseState::Expired {
                        reason: error.to_string(),
                    });
                    return;
                }
                inner.forget(active.generation);
                pause(&inner, state, failures).await;
                failures = failures.saturating_add(1);
                continue;
            }
        };
        loop {
            let sent_at = Instant::now();
            if tx.send(LeaseKeepAliveRequest { id }).await.is_err() {
                continue 'reconnect;
            }
            // Wait no longer than the lease is known alive (or one request timeout).
            let wait = current_deadline(state)
                .map_or(inner.options.request_timeout, |d| {
                    d.saturating_duration_since(Instant::now())
                })
                .min(inner.options.request_timeout);
            match tokio::time::timeout(wait, answers.next()).await {
                Ok(Some(Ok(answer))) if answer.ttl <= 0 => {
                    let _ = state.send(LeaseState::Expired {
                        reason: "the server reports the lease expired or revoked".into(),
                    });
                    return;
                }
                Ok(Some(Ok(answer))) => {
                    failures = 0;
                    let ttl = seconds(answer.ttl);
                    let _ = state.send(LeaseState::Alive {
                        ttl,
                        last_acked_sent_at: sent_at,
                        deadline: safety.local_deadline(sent_at, ttl),
                    });
                    tokio::time::sleep_until(sent_at + keepalive_interval(ttl)).await;
                }
                Ok(Some(Err(status))) => {
                    let error = Error::from_status(
                        &status,
                        ErrorContext {
                            lease_id: id,
                            revision: 0,
                        },
                    );
                    if !keepalive_may_retry(&error) {
                        let _ = state.send(LeaseState::Expired {
                            reason: error.to_string(),
                        });
                        return;
                    }
                    inner.forget(active.generation);
                    pause(&inner, state, failures).await;
                    failures = failures.saturating_add(1);
                    continue 'reconnect;
                }
                // Stream closed or no answer in time: the member may be gone.
                Ok(None) | Err(_) => {
                    inner.forget(active.generation);
                    pause(&inner, state, failures).await;
                    failures = failures.saturating_add(1);
                    continue 'reconnect;
                }
            }
        }
    }
}

/// Backs off before a reconnect, but never past the lease's local deadline, so the last
/// chance to renew is not slept through.
async fn pause(inner: &Shared, state: &watch::Sender<LeaseState>, failures: u32) {
    let mut delay = inner.options.backoff.delay(failures);
    if let LeaseState::Alive { deadline, .. } = &*state.borrow() {
        delay = delay.min(deadline.saturating_duration_since(Instant::now()));
    }
    tokio::time::sleep(delay).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_keepalive_timed_out_by_the_server_is_retried_not_taken_for_expiry() {
        assert!(keepalive_may_retry(&Error::Timeout(
            "request timed out".into()
        )));
        assert!(keepalive_may_retry(&Error::NoLeader("no leader".into())));
        assert!(!keepalive_may_retry(&Error::NotFound(
            "lease not found".into()
        )));
        assert!(!keepalive_may_retry(&Error::PermissionDenied(
            "denied".into()
        )));
    }

    #[test]
    fn local_deadline_subtracts_drift_and_margin() {
        let safety = LeaseSafety {
            margin: Duration::from_millis(200),
            clock_drift_ppm: 10_000,
        };
        let sent = Instant::now();
        // 10 s TTL: 1% drift is 100 ms, plus the 200 ms margin.
        assert_eq!(
            safety.local_deadline(sent, Duration::from_secs(10)),
            sent + Duration::from_millis(9_700)
        );
        // Margins larger than the TTL leave nothing: expired at once, never negative.
        assert_eq!(
            safety.local_deadline(sent, Duration::from_millis(150)),
            sent
        );
        let no_margin = LeaseSafety {
            margin: Duration::ZERO,
            clock_drift_ppm: 0,
        };
        assert_eq!(
            no_margin.local_deadline(sent, Duration::from_secs(3)),
            sent + Duration::from_secs(3)
        );
        // An absurd drift is capped at 100%, which leaves nothing either.
        let absurd = LeaseSafety {
            margin: Duration::ZERO,
            clock_drift_ppm: u32::MAX,
        };
        assert_eq!(absurd.local_deadline(sent, Duration::from_secs(3)), sent);
    }

    #[test]
    fn deadline_never_later_than_server_bound() {
        let safety = LeaseSafety::default();
        let sent = Instant::now();
        for ttl_s in 1..120 {
            let ttl = Duration::from_secs(ttl_s);
            let deadline = safety.local_deadline(sent, ttl);
            assert!(deadline < sent + ttl, "ttl {ttl_s}");
            // Keepalives at TTL/3 land well inside the local deadline.
            assert!(
                sent + keepalive_interval(ttl) < deadline || ttl_s == 1,
                "ttl {ttl_s}"
            );
        }
    }

    #[test]
    fn ttl_rounds_up_to_seconds() {
        assert_eq!(ttl_seconds(Duration::from_millis(1)), Ok(1));
        assert_eq!(ttl_seconds(Duration::from_secs(10)), Ok(10));
        assert_eq!(ttl_seconds(Duration::from_millis(10_001)), Ok(11));
        assert_eq!(
            ttl_seconds(Duration::ZERO).map_err(|e| e.code()),
            Err("invalid_argument")
        );
        assert_eq!(
            ttl_seconds(Duration::MAX).map_err(|e| e.code()),
            Err("too_large")
        );
    }

    #[tokio::test(start_paused = true)]
    async fn expiry_fires_at_the_local_deadline_unless_renewed() {
        let start = Instant::now();
        let (tx, rx) = watch::channel(LeaseState::Alive {
            ttl: Duration::from_secs(3),
            last_acked_sent_at: start,
            deadline: start + Duration::from_secs(2),
        });
        let mut waiter = rx.clone();
        let give_up = GiveUp::new(Arc::new(Sockets::default()));
        let handle = tokio::spawn(async move { wait_expired(&mut waiter, &give_up, 1).await });
        tokio::time::sleep(Duration::from_secs(1)).await;
        // A renewal pushes the deadline out.
        let _ = tx.send(LeaseState::Alive {
            ttl: Duration::from_secs(3),
            last_acked_sent_at: start + Duration::from_secs(1),
            deadline: start + Duration::from_secs(3),
        });
        let reason = handle.await.expect("waiter task");
        assert!(reason.contains("deadline"), "{reason}");
        assert_eq!(Instant::now(), start + Duration::from_secs(3));
        drop(tx);
    }

    #[tokio::test(start_paused = true)]
    async fn server_expiry_fires_at_once() {
        let (tx, mut rx) = watch::channel(LeaseState::Pending);
        let give_up = GiveUp::new(Arc::new(Sockets::default()));
        let handle = tokio::spawn(async move { wait_expired(&mut rx, &give_up, 1).await });
        let _ = tx.send(LeaseState::Expired {
            reason: "revoked".into(),
        });
        assert_eq!(handle.await.expect("waiter task"), "revoked");
    }
}
