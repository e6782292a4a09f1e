//! Client sessions for exactly-once commands (Raft dissertation §6.3).
//!
//! A client opens a session (its id is the log index of the `OpenSession` entry) and numbers
//! its requests. The state machine remembers, per client, the last sequence number applied and
//! its answer. A retry of that number gets the remembered answer and changes nothing; an older
//! number is refused (its answer is gone). One request in flight per client is the contract.
//! Sessions idle for `session_ttl_ms` (leader clock) are forgotten, as is the least recently
//! active one when there are more than `sessions_max`.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::command::{Response, SessionSeq};
use crate::error::{Error, Result};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct ClientSession {
    last_seq: u64,
    last_active_ms: u64,
    /// The answer to `last_seq`; `None` before the first request.
    last_result: Option<Result<Response>>,
}

/// What to do with a sessioned command.
#[derive(Debug)]
pub(crate) enum SessionCheck {
    /// A new request: apply it, then [`Sessions::record`] the answer.
    Fresh,
    /// A retry: answer with this and change nothing.
    Duplicate(Result<Response>),
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

    pub(crate) fn open(&mut self, client_id: u64, now_ms: u64, sessions_max: usize) {
        while self.clients.len() >= sessions_max {
            let Some(&(_, oldest)) = self.by_activity.first() else {
                break;
            };
            self.close(oldest);
        }
        let session = ClientSession {
            last_seq: 0,
            last_active_ms: now_ms,
            last_result: None,
        };
        if let Some(old) = self.clients.insert(client_id, session) {
            self.by_activity.remove(&(old.last_active_ms, client_id));
        }
        self.by_activity.insert((now_ms, client_id));
        assert_eq!(self.clients.len(), self.by_activity.len());
    }

    pub(crate) fn close(&mut self, client_id: u64) -> bool {
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
            self.close(client_id);
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
        if now_ms.saturating_sub(session.last_active_ms) >= ttl_ms {
            self.close(at.client_id);
            return Err(not_found);
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
            return Ok(SessionCheck::Duplicate(result.clone()));
        }
        Ok(SessionCheck::Fresh)
    }

    pub(crate) fn record(&mut self, at: SessionSeq, now_ms: u64, result: Result<Response>) {
        let Some(session) = self.clients.get_mut(&at.client_id) else {
            return;
        };
        self.by_activity
            .remove(&(session.last_active_ms, at.client_id));
        session.last_seq = at.seq;
        session.last_active_ms = now_ms;
        session.last_result = Some(result);
        self.by_activity.insert((now_ms, at.client_id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_get_the_first_answer_and_old_seqs_are_refused() {
        let mut sessions = Sessions::default();
        sessions.open(7, 0, 10);
        let first = SessionSeq {
            client_id: 7,
            seq: 1,
        };
        assert!(matches!(
            sessions.check(first, 1, 100),
            Ok(SessionCheck::Fresh)
        ));
        sessions.record(first, 1, Ok(Response::Ticked));
        assert!(matches!(
            sessions.check(first, 2, 100),
            Ok(SessionCheck::Duplicate(Ok(Response::Ticked)))
        ));
        sessions.record(
            SessionSeq {
                client_id: 7,
                seq: 2,
            },
            2,
            Ok(Response::Ticked),
        );
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
    fn eviction_drops_the_least_recently_active() {
        let mut sessions = Sessions::default();
        sessions.open(1, 0, 2);
        sessions.open(2, 5, 2);
        sessions.record(
            SessionSeq {
                client_id: 1,
                seq: 1,
            },
            10,
            Ok(Response::Ticked),
        );
        sessions.open(3, 11, 2);
        assert_eq!(sessions.len(), 2);
        assert!(sessions.clients.contains_key(&1) && sessions.clients.contains_key(&3));
        sessions.expire(200, 100);
        assert!(sessions.is_empty());
    }
}
