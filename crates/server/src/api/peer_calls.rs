//! Client writes a follower hands to the leader over the authenticated peer link, instead of
//! as a second gRPC call.
//!
//! ```text
//!  client ─ gRPC ─► follower: checks the caller, wraps the request (as_caller)
//!                     │  Call { id, WriteCall }          (the peer link, PeerCalls)
//!                     ▼
//!                   leader: proposes it in the caller's session, waits for it to apply
//!                     │  Answer { id, WriteAnswer }      (the leader's peer link back)
//!                     ▼
//!                   follower: waits until it has applied as far, converts the answer like
//!                             one of its own, answers the client
//! ```
//!
//! At 64 clients spread over three members two writes in three arrive at a follower, and a
//! forwarded gRPC call (HTTP/2 client on the follower, server on the leader, the request and
//! the answer encoded twice more) cost about as much CPU as the rest of the write together
//! (docs/performance.md). A call on the peer link is one small frame each way.
//!
//! The answer is what the leader's own apply produced, so session retries, errors and their
//! codes behave exactly as in a forwarded gRPC call. The one difference: the response header
//! names the member the client called (as etcd does), not the leader.
//!
//! Failures keep gRPC's meaning. A call whose link fails before the answer is a transport
//! failure, retried on whichever member leads by then (the write may have been applied, as
//! with a broken gRPC connection; a client session makes the retry exactly-once). A call
//! queued before its link failed is never sent afterwards ([`PeerCalls::link_failed`]).
//! Only writes whose command is built from the request alone take this path
//! (`Api::write_self_contained`: the KV writes, topic publish, ack and configure, the
//! work-queue writes, lease revokes, etcd's Proclaim and Resign, a group's Proclaim and
//! Configure); calls that carry a lock fence, calls whose caller this member cannot
//! verify (its auth state may lag the leader's), and every other write still go as gRPC
//! calls, since some handlers check state before they build the command and count on the
//! leader checking again.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use conclave_raft::NodeId;
use conclave_state::{ApplyOutput, Request, Response, SessionSeq};
use serde::{Deserialize, Serialize};
use tokio::sync::{Semaphore, mpsc, oneshot};
use tonic::Status;
use tonic::metadata::MetadataValue;

use super::route::{ERROR_CODE_HEADER, ErrorCode};
use super::{Api, CallContext, to_status};
use crate::error::Error;
use crate::node::Applied;
use crate::transport::{InboundCall, PeerCall, PeerCallInput, PeerCalls};

/// Writes from followers the leader works on at once; a call beyond it is refused at once
/// with "too many requests" (the follower's client sees that error).
pub const PEER_CALLS_IN_FLIGHT_MAX: usize = 4096;
/// Calls and answers received and not yet taken by [`serve`]; more are dropped (and counted
/// in the listener's `calls_dropped`), and the caller's deadline ends the call.
pub const PEER_CALLS_QUEUED_MAX: usize = 4096;

/// What a follower sends: the request, already wrapped with its verified caller.
#[derive(Serialize, Deserialize)]
struct WriteCall {
    request: Request,
    session: Option<SessionSeq>,
}

/// What the leader answers.
#[derive(Serialize, Deserialize)]
enum WriteAnswer {
    /// Applied: the machine's answer (without its events, which every member publishes from
    /// its own apply), the term it committed in and the leader's applied index then.
    Applied {
        revision: i64,
        result: Result<Response, conclave_state::Error>,
        duplicate: bool,
        term: u64,
        applied_index: u64,
    },
    /// Failed: the gRPC status the leader would have answered a forwarded gRPC call with.
    Failed {
        grpc_code: i32,
        message: String,
        error_code: Option<String>,
    },
}

/// Calls waiting for their answer, by id: the member called and where its answer goes.
type Waiting = HashMap<u64, (NodeId, oneshot::Sender<Vec<u8>>)>;

/// The follower's side: calls waiting for their answer.
#[derive(Default)]
pub struct PendingCalls {
    next_id: AtomicU64,
    waiting: Mutex<Waiting>,
}

impl PendingCalls {
    fn waiting(&self) -> std::sync::MutexGuard<'_, Waiting> {
        self.waiting
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Hands an answer from `peer` to its call; an answer nobody waits for (the call timed
    /// out), or from another member than the one called, is dropped.
    fn answered(&self, peer: NodeId, answer: PeerCall) {
        let mut waiting = self.waiting();
        if waiting
            .get(&answer.id)
            .is_some_and(|(called, _)| *called == peer)
            && let Some((_, reply)) = waiting.remove(&answer.id)
        {
            let _ = reply.send(answer.payload);
        }
    }
}

/// Removes a call's entry however its wait ends (answer, link failure, deadline).
struct Registered<'a> {
    pending: &'a PendingCalls,
    id: u64,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        self.pending.waiting().remove(&self.id);
    }
}

impl Api {
    /// The handle to send peer calls with, once the server has one.
    pub(crate) fn peer_calls(&self) -> Option<&PeerCalls> {
        self.peer_calls.get()
    }

    /// Sends calls to the leader over `calls` from now on (the server sets it once).
    pub fn use_peer_calls(&self, calls: PeerCalls) {
        let _ = self.peer_calls.set(calls);
    }

    /// Replicates `request` (wrapped with its verified caller) through `leader` over the peer
    /// link and returns what applying it produced, once this member has applied as far.
    pub(crate) async fn write_through_leader(
        &self,
        ctx: &CallContext,
        calls: &PeerCalls,
        leader: NodeId,
        request: Request,
    ) -> Result<Applied, Status> {
        let payload = encode_exact(&WriteCall {
            request,
            session: ctx.session,
        })
        .map_err(|error| internal(format!("cannot encode a write: {error}")))?;
        let pending = &self.pending_calls;
        let id = pending.next_id.fetch_add(1, Ordering::Relaxed);
        let (reply, answer) = oneshot::channel();
        pending.waiting().insert(id, (leader, reply));
        let _registered = Registered { pending, id };
        let ticket = calls
            .call(leader, PeerCall { id, payload })
            .map_err(|error| link_failure(leader, &error.to_string()))?;
        let answer = tokio::select! {
            answer = answer => answer.map_err(|_| to_status(Error::Stopped))?,
            () = calls.link_failed(ticket) => {
                return Err(link_failure(leader, "the connection failed before the answer came"));
            }
        };
        let answer: WriteAnswer = postcard::from_bytes(&answer).map_err(|error| {
            internal(format!(
                "the leader's answer to a write is undecodable: {error}"
            ))
        })?;
        match answer {
            WriteAnswer::Applied {
                revision,
                result,
                duplicate,
                term,
                applied_index,
            } => {
                // Then a client that wrote through this member reads its write here at once.
                let caught_up = self.node.applied_through(applied_index);
                let _ = tokio::time::timeout(ctx.remaining(), caught_up).await;
                Ok(Applied {
                    output: ApplyOutput {
                        revision,
                        result,
                        events: Vec::new(),
                        duplicate,
                    },
                    term,
                })
            }
            WriteAnswer::Failed {
                grpc_code,
                message,
                error_code,
            } => {
                let mut status = Status::new(tonic::Code::from(grpc_code), message);
                if let Some(value) = error_code
                    .and_then(|code| ErrorCode::parse(&code))
                    .map(|code| MetadataValue::from_static(code.as_str()))
                {
                    status.metadata_mut().insert(ERROR_CODE_HEADER, value);
                }
                Err(status)
            }
        }
    }

    /// The leader's side of one call from `peer`: the encoded [`WriteAnswer`].
    async fn answer_call(&self, peer: NodeId, payload: &[u8]) -> Vec<u8> {
        // The same bar as for Raft messages: knowing the peer key is not enough, the caller
        // must be in the configuration (a removed member's writes are refused).
        let is_member = self.node.status.borrow().conf_state.contains(peer);
        let answer = match postcard::from_bytes::<WriteCall>(payload) {
            _ if !is_member => failed(&internal(format!(
                "node {peer:x} is not a member of this cluster; its write is refused"
            ))),
            Err(error) => failed(&internal(format!(
                "member {peer:x} sent an undecodable write: {error}"
            ))),
            Ok(WriteCall { request, session }) => {
                let timeout = Duration::from_millis(self.config.request_timeout_ms);
                let proposed = self.node.propose_handed_over(request, session, Some(peer));
                let applied = tokio::time::timeout(timeout, proposed)
                    .await
                    .unwrap_or(Err(Error::Timeout));
                match applied {
                    Ok(applied) => WriteAnswer::Applied {
                        revision: applied.output.revision,
                        result: applied.output.result,
                        duplicate: applied.output.duplicate,
                        term: applied.term,
                        // The machine's own index: the published status may lag the apply
                        // that produced this answer by a driver turn.
                        applied_index: self.node.read_state(|state| state.last_applied()),
                    },
                    Err(error) => failed(&to_status(error)),
                }
            }
        };
        // Plain data into a Vec: only a bug in a serde derive could fail here.
        encode_exact(&answer).unwrap_or_default()
    }
}

/// `value`'s postcard encoding in a buffer allocated once at its exact length, not grown
/// while it is written: a call and its answer carry every write through a follower.
fn encode_exact<T: serde::Serialize>(value: &T) -> postcard::Result<Vec<u8>> {
    let length = postcard::serialize_with_flavor(value, postcard::ser_flavors::Size::default())?;
    postcard::to_extend(value, Vec::with_capacity(length))
}

/// A peer's bytes that are not what they must be: a bug or a hostile member, never retried.
fn internal(reason: String) -> Status {
    to_status(Error::ProtocolViolation { reason })
}

fn failed(status: &Status) -> WriteAnswer {
    WriteAnswer::Failed {
        grpc_code: status.code() as i32,
        message: status.message().to_owned(),
        error_code: ErrorCode::of(status).map(|code| code.as_str().to_owned()),
    }
}

/// A call lost with its link: like a broken gRPC connection, it carries no error code, so
/// the routing loop retries it on whichever member leads by then.
fn link_failure(leader: NodeId, reason: &str) -> Status {
    Status::unavailable(format!(
        "write to leader {leader:x} over the peer link failed: {reason}"
    ))
}

/// Takes the calls and answers other members send here: answers go to the calls waiting for
/// them, calls are proposed (at most [`PEER_CALLS_IN_FLIGHT_MAX`] at once) and answered.
pub async fn serve(api: Arc<Api>, calls: PeerCalls, mut inbound: mpsc::Receiver<InboundCall>) {
    let slots = Arc::new(Semaphore::new(PEER_CALLS_IN_FLIGHT_MAX));
    while let Some((peer, input)) = inbound.recv().await {
        match input {
            PeerCallInput::Answer(answer) => api.pending_calls.answered(peer, answer),
            PeerCallInput::Call(call) => {
                let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                    let payload =
                        postcard::to_allocvec(&failed(&to_status(Error::TooManyRequests)))
                            .unwrap_or_default();
                    let _ = calls.answer(
                        peer,
                        PeerCall {
                            id: call.id,
                            payload,
                        },
                    );
                    continue;
                };
                let (api, calls) = (Arc::clone(&api), calls.clone());
                tokio::spawn(async move {
                    let payload = api.answer_call(peer, &call.payload).await;
                    if let Err(error) = calls.answer(
                        peer,
                        PeerCall {
                            id: call.id,
                            payload,
                        },
                    ) {
                        tracing::debug!(peer, %error, "answer to a peer call not sent");
                    }
                    drop(slot);
                });
            }
        }
    }
}
