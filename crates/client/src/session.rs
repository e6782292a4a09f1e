//! Exactly-once writes through client sessions (`conclave.v1.Session`).
//!
//! ```text
//!  write ─► take an idle session (or OpenSession) ─► position = (client id, next seq)
//!        ─► send with metadata conclave-session-client / -secret / -seq
//!        ─► transient failure: send again, same position (the state machine answers a
//!           position it already applied from its cache, so nothing applies twice)
//!        ─► answer or final error: the session goes back to the pool for the next write
//! ```
//!
//! The state machine keeps one cached answer per session, for its last sequence number, so a
//! session carries one request at a time: concurrent writers take different sessions from
//! the pool, which opens more as needed and keeps at most [`SESSIONS_IDLE_MAX`] idle. There
//! is no keepalive: every write refreshes its session, and a session idle for half the
//! server's `session_ttl_ms` is replaced rather than reused, so it is never forgotten under a
//! write in flight. A server without the Session service (etcd) gets plain writes.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::time::Instant;

/// Metadata key of the session's client id (the server's `SESSION_CLIENT_HEADER`).
pub(crate) const SESSION_CLIENT_HEADER: &str = "conclave-session-client";
/// Metadata key of the request's sequence number in its session.
pub(crate) const SESSION_SEQ_HEADER: &str = "conclave-session-seq";
/// Metadata key of the session's secret, 32 hex digits: the server acts on a session position
/// only with its session's secret.
pub(crate) const SESSION_SECRET_HEADER: &str = "conclave-session-secret";
/// Idle sessions kept for later writes; one more finished write closes its session instead.
pub const SESSIONS_IDLE_MAX: usize = 8;

/// Where a write stands in its session; [`Position::NONE`] for writes without one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Position(Option<(u64, u64, u128)>);

impl Position {
    pub(crate) const NONE: Position = Position(None);

    pub(crate) fn at(client_id: u64, seq: u64, secret: u128) -> Position {
        Position(Some((client_id, seq, secret)))
    }

    /// `(client id, sequence number)`, if any.
    #[cfg(test)]
    pub(crate) fn get(self) -> Option<(u64, u64)> {
        self.0.map(|(client_id, seq, _)| (client_id, seq))
    }

    /// A request carrying its deadline as `grpc-timeout` and this position as metadata.
    pub(crate) fn request<T>(self, message: T, timeout: Duration) -> tonic::Request<T> {
        let mut request = crate::conn::request(message, timeout);
        if let Some((client_id, seq, secret)) = self.0 {
            let metadata = request.metadata_mut();
            metadata.insert(SESSION_CLIENT_HEADER, client_id.into());
            metadata.insert(SESSION_SEQ_HEADER, seq.into());
            // Secret 0: a server from before secrets, which would not know the key.
            if secret != 0
                && let Ok(value) = format!("{secret:032x}").parse()
            {
                metadata.insert(SESSION_SECRET_HEADER, value);
            }
        }
        request
    }
}

/// One open session, held by at most one write at a time.
#[derive(Debug)]
pub(crate) struct Session {
    pub client_id: u64,
    /// From OpenSession; 0 when the server predates session secrets.
    pub secret: u128,
    /// The sequence number the next write takes (the first is 1).
    pub next_seq: u64,
    /// The server forgets the session after this long without a write.
    pub idle_ttl: Duration,
    /// When the last answer to a write in this session arrived.
    pub last_used: Instant,
}

impl Session {
    pub(crate) fn opened(client_id: u64, secret: u128, idle_ttl: Duration) -> Session {
        Session {
            client_id,
            secret,
            next_seq: 1,
            idle_ttl,
            last_used: Instant::now(),
        }
    }

    /// The secret as CloseSession carries it (empty for a server from before secrets).
    pub(crate) fn secret_bytes(&self) -> prost::bytes::Bytes {
        if self.secret == 0 {
            return prost::bytes::Bytes::new();
        }
        prost::bytes::Bytes::copy_from_slice(&self.secret.to_be_bytes())
    }

    /// Takes the next position.
    pub(crate) fn advance(&mut self) -> Position {
        let position = Position::at(self.client_id, self.next_seq, self.secret);
        self.next_seq = self.next_seq.saturating_add(1);
        position
    }

    /// Whether the server may have forgotten it (or soon will): idle for half its TTL. The
    /// half covers the client's clock running slow against the server leaders' and the time
    /// the next write spends in flight.
    fn stale(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.last_used) >= self.idle_ttl / 2
    }
}

/// The client's idle sessions.
#[derive(Debug, Default)]
pub(crate) struct SessionPool {
    idle: Mutex<Vec<Session>>,
    /// The server answered OpenSession with "unimplemented": write without sessions.
    unsupported: AtomicBool,
}

impl SessionPool {
    /// An idle session that is safe to use, if any. Stale ones are dropped (the server
    /// forgets them by itself).
    pub(crate) fn take(&self) -> Option<Session> {
        let now = Instant::now();
        let mut idle = self
            .idle
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        idle.retain(|session| !session.stale(now));
        idle.pop()
    }

    /// Returns a session after a write's final answer. Answers the session when the pool is
    /// full, for the caller to close.
    pub(crate) fn put_back(&self, mut session: Session) -> Option<Session> {
        session.last_used = Instant::now();
        let mut idle = self
            .idle
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if idle.len() >= SESSIONS_IDLE_MAX {
            return Some(session);
        }
        idle.push(session);
        None
    }

    /// Empties the pool (for closing).
    pub(crate) fn drain(&self) -> Vec<Session> {
        std::mem::take(
            &mut *self
                .idle
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        )
    }

    pub(crate) fn unsupported(&self) -> bool {
        self.unsupported.load(Ordering::Relaxed)
    }

    pub(crate) fn mark_unsupported(&self) {
        self.unsupported.store(true, Ordering::Relaxed);
    }
}

/// The secret from OpenSession's answer: 16 bytes, big-endian; anything else (a server from
/// before secrets sends none) is 0, and writes then carry no secret.
pub(crate) fn secret_from_bytes(bytes: &[u8]) -> u128 {
    <[u8; 16]>::try_from(bytes).map_or(0, u128::from_be_bytes)
}

/// Whether an error says the server no longer knows the write's session (expired after
/// `session_ttl_ms` idle, evicted beyond `sessions_max`, or closed). The state machine
/// checks the session before anything else, so the write that got this was not applied.
pub(crate) fn session_gone(error: &crate::Error) -> bool {
    matches!(error, crate::Error::NotFound(message) if message.contains("conclave: client session"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_travel_as_metadata() {
        let request = Position::at(7, 3, 0xabc).request((), Duration::from_secs(1));
        let metadata = request.metadata();
        assert_eq!(
            metadata
                .get(SESSION_CLIENT_HEADER)
                .and_then(|v| v.to_str().ok()),
            Some("7")
        );
        assert_eq!(
            metadata
                .get(SESSION_SEQ_HEADER)
                .and_then(|v| v.to_str().ok()),
            Some("3")
        );
        assert_eq!(
            metadata
                .get(SESSION_SECRET_HEADER)
                .and_then(|v| v.to_str().ok()),
            Some("00000000000000000000000000000abc")
        );
        let plain = Position::NONE.request((), Duration::from_secs(1));
        assert!(plain.metadata().get(SESSION_CLIENT_HEADER).is_none());
        assert!(plain.metadata().get(SESSION_SEQ_HEADER).is_none());
    }

    #[test]
    fn sequence_numbers_start_at_one_and_never_repeat() {
        let mut session = Session::opened(9, 1, Duration::from_secs(60));
        assert_eq!(session.advance().get(), Some((9, 1)));
        assert_eq!(session.advance().get(), Some((9, 2)));
        let pool = SessionPool::default();
        assert!(pool.put_back(session).is_none());
        let mut again = pool.take().expect("the idle session");
        assert_eq!(
            again.advance().get(),
            Some((9, 3)),
            "a reused session continues"
        );
        assert!(
            pool.take().is_none(),
            "a session is held by one write at a time"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn idle_sessions_are_replaced_before_the_server_forgets_them() {
        let pool = SessionPool::default();
        assert!(
            pool.put_back(Session::opened(1, 1, Duration::from_secs(10)))
                .is_none()
        );
        tokio::time::advance(Duration::from_millis(4_900)).await;
        let kept = pool.take().expect("fresh enough");
        assert!(pool.put_back(kept).is_none());
        tokio::time::advance(Duration::from_secs(5)).await;
        assert!(pool.take().is_none(), "idle for half the TTL: not reused");
    }

    #[test]
    fn the_pool_keeps_a_bounded_number_of_idle_sessions() {
        let pool = SessionPool::default();
        for id in 0..SESSIONS_IDLE_MAX as u64 {
            assert!(
                pool.put_back(Session::opened(id, 1, Duration::from_secs(60)))
                    .is_none()
            );
        }
        let extra = pool.put_back(Session::opened(99, 1, Duration::from_secs(60)));
        assert_eq!(extra.map(|s| s.client_id), Some(99), "returned for closing");
        assert_eq!(pool.drain().len(), SESSIONS_IDLE_MAX);
    }

    #[test]
    fn only_a_forgotten_session_counts_as_gone() {
        let gone = crate::Error::NotFound(
            "conclave: client session 5 not found (expired or never opened)".into(),
        );
        assert!(session_gone(&gone));
        assert!(!session_gone(&crate::Error::NotFound(
            "key not found".into()
        )));
        assert!(!session_gone(&crate::Error::Unavailable(
            "conclave: client session".into()
        )));
    }
}
