//! Client sessions for exactly-once commands (Raft dissertation §6.3).
//!
//! A client opens a session (its id is the log index of the `OpenSession` entry, its secret
//! 128 random bits chosen by the member that served the call and carried in the entry) and
//! numbers its requests. Every command in the session carries the secret; one whose secret
//! differs is answered as if the session did not exist, so knowing (or guessing) a client id
//! neither reads that client's cached answer nor moves its sequence. A sequence number may run
//! at most [`SESSION_SEQ_AHEAD_MAX`] past the last applied one. The state machine remembers, per client, the last sequence number applied and
//! its answer. A retry of that number gets the remembered answer and changes nothing; an older
//! number is refused (its answer is gone). One request in flight per client is the contract.
//! Sessions idle for `session_ttl_ms` (leader clock) are forgotten, as is the least recently
//! active one when there are more than `sessions_max`.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::command::{Response, SessionSeq};
use crate::error::{Error, Result};

/// How far past the last applied sequence number a command's may run. A client numbers its
/// requests one by one and skips a number only for a request it gave up on, so a bigger jump
/// is a bug or an attack; refusing it keeps a session from being pushed to `u64::MAX`, where
/// it could take no further request.
pub const SESSION_SEQ_AHEAD_MAX: u64 = 1 << 20;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct ClientSession {
    /// Every command in the session must carry it; 0 for a session from before secrets.
    secret: u128,
    last_seq: u64,
    last_active_ms: u64,
    /// The answer to `last_seq`; `None` before the first request.
    last_result: Option<Result<Response>>,
    /// The store revision right after `last_seq` was applied, which its retry reports in the
    /// response header; 0 when unknown (restored from a snapshot written before it was kept).
    last_revision: i64,
}

/// A session as snapshot format version 2 stored it, before the answer's revision was kept.
#[derive(Deserialize)]
struct ClientSessionV2 {
    secret: u128,
    last_seq: u64,
    last_active_ms: u64,
    last_result: Option<Result<Response>>,
}

/// [`Sessions`] as snapshot format version 2 stored them. A retry of a restored answer
/// reports the revision current at the retry, as version 2 builds did.
#[derive(Deserialize)]
pub(crate) struct SessionsV2 {
    clients: BTreeMap<u64, ClientSessionV2>,
    by_activity: BTreeSet<(u64, u64)>,
}

impl From<SessionsV2> for Sessions {
    fn from(old: SessionsV2) -> Sessions {
        let clients = old
            .clients
            .into_iter()
            .map(|(client_id, session)| {
                let session = ClientSession {
                    secret: session.secret,
                    last_seq: session.last_seq,
                    last_active_ms: session.last_active_ms,
                    last_result: session.last_result,
                    last_revision: 0,
                };
                (client_id, session)
            })
            .collect();
        Sessions {
            clients,
            by_activity: old.by_activity,
        }
    }
}

/// A session as snapshot format version 1 stored it, before secrets.
#[derive(Deserialize)]
struct ClientSessionV1 {
    last_seq: u64,
    last_active_ms: u64,
    last_result: Option<Result<Response>>,
}

/// [`Sessions`] as snapshot format version 1 stored them. They restore with secret 0, the
/// secret of sessions opened by entries from before secrets, so replicas still agree.
#[derive(Deserialize)]
pub(crate) struct SessionsV1 {
    clients: BTreeMap<u64, ClientSessionV1>,
    by_activity: BTreeSet<(u64, u64)>,
}

impl From<SessionsV1> for Sessions {
    fn from(old: SessionsV1) -> Sessions {
        let clients = old
            .clients
            .into_iter()
            .map(|(client_id, session)| {
                let session = ClientSession {
                    secret: 0,
                    last_seq: session.last_seq,
                    last_active_ms: session.last_active_ms,
                    last_result: session.last_result,
                    last_revision: 0,
                };
                (client_id, session)
            })
            .collect();
        Sessions {
            clients,
            by_activity: old.by_activity,
        }
    }
}

/// What to do with a sessioned command.
#[derive(Debug)]
pub(crate) enum SessionCheck {
    /// A new request: apply it, then [`Sessions::record`] the answer.
    Fresh,
    /// A retry: answer with this and change nothing.
    Duplicate {
        /// The first answer.
        result: Result<Response>,
        /// The revision the first answer was given at; 0 when unknown.
        revision: i64,
    },
}

/// All client sessions.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sessions {
    clients: BTreeMap<u64, ClientSession>,
    /// (last_active_ms, client_id) for expiry and eviction in a deterministic order.
    /// Invariant: one entry per client, matching `clients`.
    by_activity: BTreeSet<(u64, u64)>,
}

impl Sessions {
    /// Number of open sessions.
    pub fn len(&self) -> usize {
        self.clients.len()
    }

    /// True when no session is open.
    pub fn is_empty(&self) -> bool {
        self.clients.is_empty()
    }

    pub(crate) fn open(&mut self, client_id: u64, secret: u128, now_ms: u64, sessions_max: usize) {
        while self.clients.len() >= sessions_max {
            let Some(&(_, oldest)) = self.by_activity.first() else {
                break;
            };
            self.forget(oldest);
        }
        let session = ClientSession {
            secret,
            last_seq: 0,
            last_active_ms: now_ms,
            last_result: None,
            last_revision: 0,
        };
        if let Some(old) = self.clients.insert(client_id, session) {
            self.by_activity.remove(&(old.last_active_ms, client_id));
        }
        self.by_activity.insert((now_ms, client_id));
        assert_eq!(self.clients.len(), self.by_activity.len());
    }

    /// Closes the session if `secret` is its secret.
    pub(crate) fn close(&mut self, client_id: u64, secret: u128) -> bool {
        match self.clients.get(&client_id) {
            Some(session) if session.secret == secret => self.forget(client_id),
            _ => false,
        }
    }

    fn forget(&mut self, client_id: u64) -> bool {
        match self.clients.remove(&client_id) {
            Some(session) => {
                self.by_activity
                    .remove(&(session.last_active_ms, client_id));
                true
            }
            None => false,
        }
    }

    /// Forgets sessions idle for `ttl_ms` or longer.
    pub(crate) fn expire(&mut self, now_ms: u64, ttl_ms: u64) {
        while let Some(&(last_active_ms, client_id)) = self.by_activity.first() {
            if now_ms.saturating_sub(last_active_ms) < ttl_ms {
                break;
            }
            self.forget(client_id);
        }
    }

    pub(crate) fn check(
        &mut self,
        at: SessionSeq,
        now_ms: u64,
        ttl_ms: u64,
    ) -> Result<SessionCheck> {
        let not_found = Error::SessionNotFound {
            client_id: at.client_id,
        };
        let session = self.clients.get(&at.client_id).ok_or(not_found.clone())?;
        // A wrong secret gets the same answer as an unknown id: nothing to tell them apart.
        if session.secret != at.secret {
            return Err(not_found);
        }
        if now_ms.saturating_sub(session.last_active_ms) >= ttl_ms {
            self.forget(at.client_id);
            return Err(not_found);
        }
        if at.seq.saturating_sub(session.last_seq) > SESSION_SEQ_AHEAD_MAX {
            return Err(Error::SessionSeqTooFar {
                client_id: at.client_id,
                seq: at.seq,
                last_seq: session.last_seq,
            });
        }
        if at.seq < session.last_seq {
            return Err(Error::SessionSeqStale {
                client_id: at.client_id,
                seq: at.seq,
                last_seq: session.last_seq,
            });
        }
        if at.seq == session.last_seq
            && let Some(result) = &session.last_result
        {
            return Ok(SessionCheck::Duplicate {
                result: result.clone(),
                revision: session.last_revision,
            });
        }
        Ok(SessionCheck::Fresh)
    }

    /// Remembers `result`, given at store `revision`, as the answer to `at`.
    pub(crate) fn record(
        &mut self,
        at: SessionSeq,
        now_ms: u64,
        result: Result<Response>,
        revision: i64,
    ) {
        let Some(session) = self.clients.get_mut(&at.client_id) else {
            return;
        };
        // `check` refused a foreign secret before the command ran; this is the same guard.
        if session.secret != at.secret {
            return;
        }
        self.by_activity
            .remove(&(session.last_active_ms, at.client_id));
        session.last_seq = at.seq;
        session.last_active_ms = now_ms;
        session.last_result = Some(result);
        session.last_revision = revision;
        self.by_activity.insert((now_ms, at.client_id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: u128 = 0x0123_4567_89ab_cdef_0123_4567_89ab_cdef;

    fn at(client_id: u64, seq: u64) -> SessionSeq {
        SessionSeq {
            client_id,
            seq,
            secret: SECRET,
        }
    }

    #[test]
    fn retries_get_the_first_answer_and_old_seqs_are_refused() {
        let mut sessions = Sessions::default();
        sessions.open(7, SECRET, 0, 10);
        let first = at(7, 1);
        assert!(matches!(
            sessions.check(first, 1, 100),
            Ok(SessionCheck::Fresh)
        ));
        sessions.record(first, 1, Ok(Response::Ticked), 1);
        assert!(matches!(
            sessions.check(first, 2, 100),
            Ok(SessionCheck::Duplicate {
                result: Ok(Response::Ticked),
                ..
            })
        ));
        sessions.record(at(7, 2), 2, Ok(Response::Ticked), 1);
        assert!(matches!(
            sessions.check(first, 3, 100),
            Err(Error::SessionSeqStale { .. })
        ));
        // Idle past the TTL: gone.
        assert!(matches!(
            sessions.check(first, 200, 100),
            Err(Error::SessionNotFound { .. })
        ));
        assert!(sessions.is_empty());
    }

    #[test]
    fn another_secret_reads_nothing_and_moves_nothing() {
        let mut sessions = Sessions::default();
        sessions.open(7, SECRET, 0, 10);
        sessions.record(at(7, 1), 1, Ok(Response::Ticked), 1);
        for secret in [0, 1, SECRET ^ 1] {
            let foreign = SessionSeq {
                client_id: 7,
                seq: 1,
                secret,
            };
            assert!(matches!(
                sessions.check(foreign, 2, 100),
                Err(Error::SessionNotFound { client_id: 7 })
            ));
            let ahead = SessionSeq { seq: 5, ..foreign };
            sessions.record(ahead, 2, Ok(Response::SessionClosed), 1);
            assert!(!sessions.close(7, secret), "closed with a foreign secret");
        }
        assert!(matches!(
            sessions.check(at(7, 1), 3, 100),
            Ok(SessionCheck::Duplicate {
                result: Ok(Response::Ticked),
                ..
            })
        ));
        assert!(sessions.close(7, SECRET));
    }

    #[test]
    fn a_sequence_number_may_not_run_far_ahead() {
        let mut sessions = Sessions::default();
        sessions.open(7, SECRET, 0, 10);
        assert!(matches!(
            sessions.check(at(7, u64::MAX), 1, 100),
            Err(Error::SessionSeqTooFar { .. })
        ));
        assert!(matches!(
            sessions.check(at(7, SESSION_SEQ_AHEAD_MAX + 1), 1, 100),
            Err(Error::SessionSeqTooFar { .. })
        ));
        assert!(matches!(
            sessions.check(at(7, SESSION_SEQ_AHEAD_MAX), 1, 100),
            Ok(SessionCheck::Fresh)
        ));
    }

    #[test]
    fn eviction_drops_the_least_recently_active() {
        let mut sessions = Sessions::default();
        sessions.open(1, SECRET, 0, 2);
        sessions.open(2, SECRET, 5, 2);
        sessions.record(at(1, 1), 10, Ok(Response::Ticked), 1);
        sessions.open(3, SECRET, 11, 2);
        assert_eq!(sessions.len(), 2);
        assert!(sessions.clients.contains_key(&1) && sessions.clients.contains_key(&3));
        sessions.expire(200, 100);
        assert!(sessions.is_empty());
    }
}
