//! The one routing path of the client API: leader wait, forwarding, retries and the metadata
//! a forwarded call carries. Handlers state only their conversion (a state-machine request
//! and how its answer becomes a response, or what this node does when it leads) and which
//! client method of their own service reaches the leader.
//!
//! ```text
//!  Api::route(ctx, serve, attempt)
//!    ┌─► wait for a known leader (status watch; "no leader" at the deadline, "stopped")
//!    │     leader is this node (or serve = ThisMember) ─► attempt(Here)
//!    │     leader elsewhere, call not forwarded        ─► attempt(Leader(id)): the same gRPC
//!    │                                                    method on the leader, marked forwarded,
//!    │                                                    with the deadline, session and fence
//!    │     leader elsewhere, call already forwarded    ─► "not leader" (the sender re-routes)
//!    └── retriable failure (typed code below, or a transport failure) and time left
//! ```
//!
//! Whether a failure may be retried is decided by a typed code, never by message text. Every
//! status made from a runtime error carries its code in the `conclave-error-code` metadata
//! key, so a follower reads the leader's reason from the forwarded call's answer. Clients see
//! etcd's gRPC codes and messages unchanged (the key is one more trailer).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use std::time::Duration;

use conclave_raft::NodeId;
use conclave_state::Response;
use tonic::Status;
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;

use super::lock::FENCE_METADATA;
use super::{
    Api, CallContext, FORWARDED_BY_HEADER, FORWARDED_HEADER, SESSION_CLIENT_HEADER,
    SESSION_SECRET_HEADER, SESSION_SEQ_HEADER, session_secret_hex, state_status,
};
use crate::error::Error;
use crate::node::Applied;

/// Metadata key of a status's [`ErrorCode`], between members and for clients that want it.
pub const ERROR_CODE_HEADER: &str = "conclave-error-code";
/// Metadata key on a leader's answer to a forwarded call: the leader's applied Raft index
/// when it answered (see [`Api::caught_up_with`]).
pub const APPLIED_INDEX_HEADER: &str = "conclave-applied-index";
/// While no leader is known, or before a retry, wait at most this long (the status watch
/// usually wakes the request much sooner).
pub const LEADER_POLL_MS: u64 = 20;

/// Why a runtime error failed a call: a stable name that travels in [`ERROR_CODE_HEADER`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    NoLeader,
    NotLeader,
    LeaderChanged,
    /// The leader refuses proposals while it hands over (graceful shutdown, MoveLeader).
    LeadershipTransfer,
    Timeout,
    Stopped,
    TooManyRequests,
    RequestTooLarge,
    /// The Raft core refused the proposal for another reason (uncommitted limit, ...).
    RaftRefused,
    Internal,
}

impl ErrorCode {
    const ALL: [ErrorCode; 10] = [
        ErrorCode::NoLeader,
        ErrorCode::NotLeader,
        ErrorCode::LeaderChanged,
        ErrorCode::LeadershipTransfer,
        ErrorCode::Timeout,
        ErrorCode::Stopped,
        ErrorCode::TooManyRequests,
        ErrorCode::RequestTooLarge,
        ErrorCode::RaftRefused,
        ErrorCode::Internal,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::NoLeader => "no-leader",
            ErrorCode::NotLeader => "not-leader",
            ErrorCode::LeaderChanged => "leader-changed",
            ErrorCode::LeadershipTransfer => "leadership-transfer",
            ErrorCode::Timeout => "timeout",
            ErrorCode::Stopped => "stopped",
            ErrorCode::TooManyRequests => "too-many-requests",
            ErrorCode::RequestTooLarge => "request-too-large",
            ErrorCode::RaftRefused => "raft-refused",
            ErrorCode::Internal => "internal",
        }
    }

    pub fn parse(text: &str) -> Option<ErrorCode> {
        ErrorCode::ALL
            .into_iter()
            .find(|code| code.as_str() == text)
    }

    /// The code a status carries, if it carries a known one.
    pub fn of(status: &Status) -> Option<ErrorCode> {
        let value = status.metadata().get(ERROR_CODE_HEADER)?;
        ErrorCode::parse(value.to_str().ok()?)
    }

    /// Failures that another attempt, on whichever member leads by then, may cure.
    fn leadership_moved(self) -> bool {
        matches!(
            self,
            ErrorCode::NoLeader
                | ErrorCode::NotLeader
                | ErrorCode::LeaderChanged
                | ErrorCode::LeadershipTransfer
        )
    }
}

/// The gRPC status etcd returns for each runtime error, tagged with its [`ErrorCode`].
pub fn to_status(error: Error) -> Status {
    let message = error.to_string();
    let (mut status, code) = match error {
        Error::NoLeader | Error::Raft(conclave_raft::Error::NoLeader) => {
            (Status::unavailable(message), ErrorCode::NoLeader)
        }
        Error::NotLeader { .. } | Error::Raft(conclave_raft::Error::NotLeader { .. }) => {
            (Status::unavailable(message), ErrorCode::NotLeader)
        }
        Error::LeaderChanged => (Status::unavailable(message), ErrorCode::LeaderChanged),
        Error::Timeout => (Status::unavailable(message), ErrorCode::Timeout),
        Error::Stopped => (Status::unavailable(message), ErrorCode::Stopped),
        Error::TooManyRequests => (
            Status::resource_exhausted(message),
            ErrorCode::TooManyRequests,
        ),
        Error::Raft(conclave_raft::Error::ProposalTooLarge { .. }) => (
            state_status(&conclave_state::Error::RequestTooLarge),
            ErrorCode::RequestTooLarge,
        ),
        Error::Raft(conclave_raft::Error::TransferInProgress { .. }) => {
            (Status::unavailable(message), ErrorCode::LeadershipTransfer)
        }
        Error::Raft(_) => (Status::unavailable(message), ErrorCode::RaftRefused),
        _ => (Status::internal(message), ErrorCode::Internal),
    };
    status
        .metadata_mut()
        .insert(ERROR_CODE_HEADER, MetadataValue::from_static(code.as_str()));
    status
}

/// Whether a failed attempt may be retried (on another leader) within the deadline: a
/// leadership failure by its code, or a transport failure reaching a leader that just died
/// (unavailable, and no code: no member made it).
pub fn is_retriable(status: &Status) -> bool {
    match ErrorCode::of(status) {
        Some(code) => code.leadership_moved(),
        None => status.code() == tonic::Code::Unavailable,
    }
}

/// A forwarded call that failed on this member's side of the connection is a transport
/// failure, like a peer-link call whose link failed: `Unavailable`, so the route retries it
/// on whichever member leads by then. (When the leader dies or the connection breaks
/// mid-call, tonic reports "transport error" as Unknown or "operation was canceled" as
/// Cancelled, with the local cause attached; a status the leader sent never carries one.)
/// The call may have been applied, as with any broken connection; a client session makes
/// the retry exactly-once. What the leader answered, and the call's own deadline, pass
/// unchanged.
fn forwarding_failure(leader: NodeId, status: Status) -> Status {
    let passes = status.code() == tonic::Code::DeadlineExceeded || ErrorCode::of(&status).is_some();
    match std::error::Error::source(&status) {
        Some(cause) if !passes => Status::unavailable(format!(
            "forwarding to leader {leader:x} failed: {}: {cause}",
            status.message()
        )),
        _ => status,
    }
}

/// Where one attempt of a call runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// On this node (its leader, or any member for [`Serve::ThisMember`]).
    Here,
    /// On the leader `NodeId`, by forwarding the call to its client API.
    Leader(NodeId),
}

/// Which member may serve a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Serve {
    /// Only the leader; followers forward.
    Leader,
    /// This member, once some leader is known (a ReadIndex asks it from here).
    ThisMember,
}

/// What a routed call answered: served here, or the leader's answer to the forwarded call.
pub enum Served<H, L> {
    Here(H),
    Leader(L),
}

/// A boxed call on the leader.
pub type ForwardFuture<R> = Pin<Box<dyn Future<Output = Result<R, Status>> + Send>>;

/// The same gRPC method on the leader: `leader_call!(KvClient::put)`.
pub type LeaderCall<M, R> = fn(Channel, tonic::Request<M>) -> ForwardFuture<tonic::Response<R>>;

/// A [`LeaderCall`] from a generated client's method.
macro_rules! leader_call {
    ($client:ident :: $method:ident) => {
        |channel, request| Box::pin(async move { $client::new(channel).$method(request).await })
    };
}
pub(crate) use leader_call;

/// The state machine's answer, or its error as etcd's status.
pub fn answer(applied: &Applied) -> Result<&Response, Status> {
    applied.output.result.as_ref().map_err(state_status)
}

/// A state-machine answer of the wrong kind for its request (a bug, never input).
pub fn unexpected(response: &Response) -> Status {
    Status::internal(format!("unexpected state machine answer {response:?}"))
}

/// Lazily connected channels to members' client addresses, by member id. A channel is made
/// again when the member's address changes (a published record replaces a guessed one).
#[derive(Default)]
pub struct MemberChannels {
    channels: Mutex<HashMap<NodeId, (String, Channel)>>,
}

impl MemberChannels {
    fn get(&self, api: &Api, id: NodeId) -> Result<Channel, Status> {
        // Without an address the leader cannot be reached: as good as no leader.
        let address = api
            .client_address(id)
            .ok_or_else(|| to_status(Error::NoLeader))?;
        let mut channels = self
            .channels
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some((known, channel)) = channels.get(&id)
            && *known == address
        {
            return Ok(channel.clone());
        }
        let endpoint = crate::tls::member_endpoint(&api.config, &address)
            .map_err(|e| Status::unavailable(format!("cannot reach member {id}: {e}")))?
            .connect_timeout(Duration::from_millis(api.config.request_timeout_ms));
        let channel = endpoint.connect_lazy();
        channels.insert(id, (address, channel.clone()));
        Ok(channel)
    }
}

/// Marks `request` forwarded and copies the call's session position and fence onto it, so
/// the leader applies it exactly as it would have here.
pub fn mark_forwarded<T>(request: &mut tonic::Request<T>, ctx: &CallContext) {
    let metadata = request.metadata_mut();
    metadata.insert(FORWARDED_HEADER, MetadataValue::from_static("1"));
    if let Some(session) = ctx.session {
        metadata.insert(SESSION_CLIENT_HEADER, session.client_id.into());
        metadata.insert(SESSION_SEQ_HEADER, session.seq.into());
        if session.secret != 0
            && let Ok(value) = session_secret_hex(session.secret).parse()
        {
            metadata.insert(SESSION_SECRET_HEADER, value);
        }
    }
    if let Some(fence) = ctx.fence {
        metadata.insert(FENCE_METADATA, fence.into());
    }
    if let Some(token) = &ctx.token
        && let Ok(value) = token.parse()
    {
        metadata.insert(super::auth::TOKEN_METADATA, value);
    }
}

impl Api {
    /// A channel to member `id`'s client API, for forwarding.
    pub fn channel(&self, id: NodeId) -> Result<Channel, Status> {
        self.channels.get(self, id)
    }

    /// A request for the leader: marked forwarded, bounded by what is left of the call.
    pub fn forwarded_request<T>(message: T, ctx: &CallContext) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request.set_timeout(ctx.remaining());
        mark_forwarded(&mut request, ctx);
        request
    }

    /// The call, as a gRPC call on the leader's client API: marked forwarded, within what is
    /// left of the deadline; a connection lost on the way is a retriable transport failure
    /// ([`forwarding_failure`]).
    async fn forward<M: Clone, R>(
        &self,
        ctx: &CallContext,
        leader: NodeId,
        message: &M,
        call: LeaderCall<M, R>,
    ) -> Result<tonic::Response<R>, Status> {
        let mut request = Api::forwarded_request(message.clone(), &self.forwarding_context(ctx));
        request
            .metadata_mut()
            .insert(FORWARDED_BY_HEADER, self.config.id.into());
        call(self.channel(leader)?, request)
            .await
            .map_err(|status| forwarding_failure(leader, status))
    }

    /// Waits until a leader is known (or the deadline, or the node stops).
    async fn known_leader(&self, ctx: &CallContext) -> Result<NodeId, Status> {
        let mut status = self.node.status.clone();
        loop {
            // Two fields, not a clone of the whole status (its member records are strings):
            // every routed call passes here.
            let (stopped, leader) = {
                let current = status.borrow_and_update();
                (current.stopped.is_some(), current.leader)
            };
            if stopped {
                return Err(to_status(Error::Stopped));
            }
            if let Some(leader) = leader {
                return Ok(leader);
            }
            let remaining = ctx.remaining();
            if remaining.is_zero() {
                return Err(to_status(Error::NoLeader));
            }
            let wait = remaining.min(Duration::from_millis(LEADER_POLL_MS));
            let _ = tokio::time::timeout(wait, status.changed()).await;
        }
    }

    /// The routing loop every call goes through: finds where `serve` lets the call run,
    /// runs `attempt` there within the deadline, and tries again while the failure is a
    /// retriable one (the leader moved or died under us) and time is left.
    pub async fn route<T, F>(
        &self,
        ctx: &CallContext,
        serve: Serve,
        mut attempt: impl FnMut(Target) -> F,
    ) -> Result<T, Status>
    where
        F: Future<Output = Result<T, Status>>,
    {
        loop {
            let leader = self.known_leader(ctx).await?;
            let target = match serve {
                _ if leader == self.config.id => Target::Here,
                Serve::ThisMember => Target::Here,
                // A forwarded call that reached a member which knows another leader (this one
                // just handed over): the member that forwarded it routes it again at once.
                Serve::Leader if ctx.forwarded => {
                    return Err(to_status(Error::NotLeader {
                        leader: Some(leader),
                    }));
                }
                Serve::Leader => Target::Leader(leader),
            };
            let outcome = tokio::time::timeout(ctx.remaining(), attempt(target))
                .await
                .unwrap_or_else(|_| Err(to_status(Error::Timeout)));
            match outcome {
                Ok(answer) => return Ok(answer),
                // A call that waited out its deadline while the cluster lost its leader (a
                // leader cut off from its quorum steps down with the proposal pending) failed
                // for want of a leader, and says so: clients tell the two apart.
                Err(status)
                    if ErrorCode::of(&status) == Some(ErrorCode::Timeout)
                        && self.node.status.borrow().leader.is_none() =>
                {
                    return Err(to_status(Error::NoLeader));
                }
                Err(status) if is_retriable(&status) && !ctx.remaining().is_zero() => {
                    tokio::time::sleep(ctx.remaining().min(Duration::from_millis(LEADER_POLL_MS)))
                        .await;
                }
                Err(status) => return Err(status),
            }
        }
    }

    /// A call only the leader serves: `here` when this node leads, else the same call on the
    /// leader through `call`. Says which of the two answered.
    pub async fn serve_routed<M, H, R, F>(
        &self,
        ctx: &CallContext,
        message: &M,
        call: LeaderCall<M, R>,
        mut here: impl FnMut() -> F,
    ) -> Result<Served<H, tonic::Response<R>>, Status>
    where
        M: Clone,
        F: Future<Output = Result<H, Status>>,
    {
        self.route(ctx, Serve::Leader, |target| {
            let local = (target == Target::Here).then(&mut here);
            async move {
                match (local, target) {
                    (Some(local), _) => local.await.map(Served::Here),
                    (None, Target::Leader(leader)) => self
                        .forward(ctx, leader, message, call)
                        .await
                        .map(Served::Leader),
                    (None, Target::Here) => Err(to_status(Error::LeaderChanged)),
                }
            }
        })
        .await
    }

    /// [`Api::serve_routed`] for calls whose local answer is the response itself.
    pub async fn serve<M, R, F>(
        &self,
        ctx: &CallContext,
        message: &M,
        call: LeaderCall<M, R>,
        here: impl FnMut() -> F,
    ) -> Result<tonic::Response<R>, Status>
    where
        M: Clone,
        F: Future<Output = Result<R, Status>>,
    {
        Ok(match self.serve_routed(ctx, message, call, here).await? {
            Served::Here(response) => self.answer_here(ctx, response),
            Served::Leader(response) => self.caught_up_with(ctx, response).await,
        })
    }

    /// An answer served here; to a forwarded call it carries this node's applied index, so
    /// the member that forwarded it can catch up before answering its client.
    fn answer_here<R>(&self, ctx: &CallContext, response: R) -> tonic::Response<R> {
        let mut response = tonic::Response::new(response);
        if ctx.forwarded {
            // The state machine's own index: the published status may lag the apply that
            // produced this answer by a driver turn.
            let applied = self.node.read_state(|state| state.last_applied());
            response
                .metadata_mut()
                .insert(APPLIED_INDEX_HEADER, applied.into());
        }
        response
    }

    /// The leader's answer to a forwarded call, returned once this member has applied as far
    /// as the leader had when it answered. A client that wrote through this member then sees
    /// its write here at once: in a read, and in a watch here, whose event reaches watchers
    /// before the writer's acknowledgement (as in etcd, whose members answer a write only
    /// once they applied it themselves). Without the index (an older leader) or once the
    /// call's deadline passes, the answer goes as it is: the write did happen.
    async fn caught_up_with<R>(
        &self,
        ctx: &CallContext,
        response: tonic::Response<R>,
    ) -> tonic::Response<R> {
        let Some(target) = response
            .metadata()
            .get(APPLIED_INDEX_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
        else {
            return response;
        };
        let caught_up = self.node.applied_through(target);
        let _ = tokio::time::timeout(ctx.remaining(), caught_up).await;
        response
    }

    /// A write: on the leader, replicates `command` in the call's session and converts what
    /// applying it produced with `convert` (`Served::Here`); elsewhere, the leader's answer to
    /// `call` (`Served::Leader`). Callers that act differently when this member leads (lock
    /// and campaign waits) rely on that distinction.
    pub async fn write_routed<M, H, R>(
        &self,
        ctx: &CallContext,
        command: conclave_state::Request,
        message: &M,
        call: LeaderCall<M, R>,
        convert: impl Fn(Applied) -> Result<H, Status>,
    ) -> Result<Served<H, tonic::Response<R>>, Status>
    where
        M: Clone,
    {
        self.write_via(ctx, command, message, call, convert, false)
            .await
    }

    /// [`Api::write_routed`]; with `peer_calls_allowed`, a follower hands the write to the
    /// leader over the peer link when it can ([`super::peer_calls`]) and converts the
    /// leader's answer itself, answering `Served::Here` although it does not lead. Otherwise
    /// (a call with a lock fence, a caller this member cannot verify yet) it forwards the
    /// gRPC call.
    async fn write_via<M, H, R>(
        &self,
        ctx: &CallContext,
        command: conclave_state::Request,
        message: &M,
        call: LeaderCall<M, R>,
        convert: impl Fn(Applied) -> Result<H, Status>,
        peer_calls_allowed: bool,
    ) -> Result<Served<H, tonic::Response<R>>, Status>
    where
        M: Clone,
    {
        let (command, convert) = (&command, &convert);
        let peer_calls = self
            .peer_calls()
            .filter(|_| peer_calls_allowed && ctx.fence.is_none());
        self.route(ctx, Serve::Leader, |target| async move {
            // The member that proposes verifies the caller; the state machine checks the
            // caller's permissions when it applies the command (docs/security.md).
            let as_caller = self.as_caller(ctx, command.clone());
            match (target, peer_calls, as_caller) {
                (Target::Here, _, as_caller) => {
                    // A retry reuses the session position, so the leader that applied the
                    // first attempt answers the second from its cache.
                    let applied = self
                        .node
                        .propose_handed_over(as_caller?, ctx.session, ctx.forwarded_by)
                        .await
                        .map_err(to_status)?;
                    convert(applied).map(Served::Here)
                }
                (Target::Leader(leader), Some(calls), Ok(command)) => {
                    let applied = self
                        .write_through_leader(ctx, calls, leader, command)
                        .await?;
                    convert(applied).map(Served::Here)
                }
                (Target::Leader(leader), _, _) => self
                    .forward(ctx, leader, message, call)
                    .await
                    .map(Served::Leader),
            }
        })
        .await
    }

    /// [`Api::write_routed`] for writes whose local answer is the response itself.
    pub async fn write<M, R>(
        &self,
        ctx: &CallContext,
        command: conclave_state::Request,
        message: &M,
        call: LeaderCall<M, R>,
        convert: impl Fn(Applied) -> Result<R, Status>,
    ) -> Result<tonic::Response<R>, Status>
    where
        M: Clone,
    {
        self.write_answered(ctx, command, message, call, convert, false)
            .await
    }

    /// [`Api::write`] for a write whose command is complete as the member that received it
    /// built it (the KV, topic and work-queue writes, lease revokes, some election writes): a
    /// follower may hand it to the leader over the peer link ([`super::peer_calls`]). A
    /// handler that checks state before it builds the command, and counts on a follower
    /// forwarding the whole call so the leader checks again (a group's Resign), must use
    /// [`Api::write`].
    pub async fn write_self_contained<M, R>(
        &self,
        ctx: &CallContext,
        command: conclave_state::Request,
        message: &M,
        call: LeaderCall<M, R>,
        convert: impl Fn(Applied) -> Result<R, Status>,
    ) -> Result<tonic::Response<R>, Status>
    where
        M: Clone,
    {
        self.write_answered(ctx, command, message, call, convert, true)
            .await
    }

    /// [`Api::write_via`] answered as a response: one served here carries this member's
    /// applied index when forwarded, the leader's is returned once this member caught up.
    async fn write_answered<M, R>(
        &self,
        ctx: &CallContext,
        command: conclave_state::Request,
        message: &M,
        call: LeaderCall<M, R>,
        convert: impl Fn(Applied) -> Result<R, Status>,
        peer_calls_allowed: bool,
    ) -> Result<tonic::Response<R>, Status>
    where
        M: Clone,
    {
        let served = self
            .write_via(ctx, command, message, call, convert, peer_calls_allowed)
            .await?;
        Ok(match served {
            Served::Here(response) => self.answer_here(ctx, response),
            Served::Leader(response) => self.caught_up_with(ctx, response).await,
        })
    }

    /// Waits until this node's state is at least as new as the leader's commit index when the
    /// call arrived (etcd's linearizable read), retrying across leader changes.
    pub async fn linearizable_barrier(&self, ctx: &CallContext) -> Result<(), Status> {
        self.route(ctx, Serve::ThisMember, |_| async {
            self.node.read_index().await.map_err(to_status)
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_lost_while_forwarding_is_retried_and_the_leaders_answers_pass() {
        // What tonic reports when the connection to the leader breaks mid-call: Unknown or
        // Cancelled, with the local cause attached.
        let broken = Status::from_error(Box::new(std::io::Error::other("connection reset")));
        assert_eq!(broken.code(), tonic::Code::Unknown);
        let mut canceled = Status::cancelled("operation was canceled");
        canceled.set_source(std::sync::Arc::new(std::io::Error::other("canceled")));
        for lost in [broken, canceled] {
            assert!(
                !is_retriable(&lost),
                "the raw status would reach the client"
            );
            let mapped = forwarding_failure(3, lost);
            assert_eq!(mapped.code(), tonic::Code::Unavailable);
            assert!(
                mapped.message().contains("leader 3"),
                "{}",
                mapped.message()
            );
            assert!(is_retriable(&mapped));
        }
        let mut late = Status::deadline_exceeded("timeout expired");
        late.set_source(std::sync::Arc::new(std::io::Error::other("deadline")));
        assert_eq!(
            forwarding_failure(3, late).code(),
            tonic::Code::DeadlineExceeded
        );
        // The leader's own answers, including an Unknown one from the wire, pass unchanged.
        let from_leader = Status::unknown("transport error");
        assert_eq!(
            forwarding_failure(3, from_leader.clone()).code(),
            from_leader.code()
        );
        let refused = to_status(Error::TooManyRequests);
        let passed = forwarding_failure(3, refused.clone());
        assert_eq!(passed.code(), refused.code());
        assert_eq!(passed.message(), refused.message());
    }

    #[test]
    fn codes_round_trip_and_only_leadership_failures_retry() {
        for code in ErrorCode::ALL {
            assert_eq!(ErrorCode::parse(code.as_str()), Some(code));
        }
        assert_eq!(ErrorCode::parse("leader changed"), None);
        assert!(is_retriable(&to_status(Error::LeaderChanged)));
        assert!(is_retriable(&to_status(Error::NoLeader)));
        assert!(is_retriable(&to_status(Error::NotLeader {
            leader: Some(2)
        })));
        // A leader handing over refuses proposals; its successor takes them moments later.
        assert!(is_retriable(&to_status(Error::Raft(
            conclave_raft::Error::TransferInProgress { target: 2 }
        ))));
        // A transport failure carries no code.
        assert!(is_retriable(&Status::unavailable("tcp connect error")));
        assert!(!is_retriable(&to_status(Error::Stopped)));
        assert!(!is_retriable(&to_status(Error::Timeout)));
        assert!(!is_retriable(&to_status(Error::TooManyRequests)));
        assert!(!is_retriable(&state_status(
            &conclave_state::Error::EmptyKey
        )));
        assert!(!is_retriable(&state_status(
            &conclave_state::Error::LeaseNotFound
        )));
        // The decision reads the code, not the text: an etcd-looking message without a code
        // from a member is a transport failure, and the same text with a fatal code is not
        // retried.
        let mut stopped_but_worded = Status::unavailable("etcdserver: leader changed");
        stopped_but_worded.metadata_mut().insert(
            ERROR_CODE_HEADER,
            MetadataValue::from_static(ErrorCode::Stopped.as_str()),
        );
        assert!(!is_retriable(&stopped_but_worded));
    }

    #[test]
    fn client_visible_codes_and_messages_are_etcds() {
        let status = to_status(Error::NoLeader);
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert_eq!(status.message(), "etcdserver: no leader");
        assert_eq!(ErrorCode::of(&status), Some(ErrorCode::NoLeader));
        let status = to_status(Error::LeaderChanged);
        assert_eq!(status.message(), "etcdserver: leader changed");
        let status = to_status(Error::Raft(conclave_raft::Error::TransferInProgress {
            target: 3,
        }));
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert_eq!(
            status.message(),
            "etcdserver: leadership transfer to node 3 in progress"
        );
        let status = to_status(Error::TooManyRequests);
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert_eq!(ErrorCode::of(&status), Some(ErrorCode::TooManyRequests));
    }
}
