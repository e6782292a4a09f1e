//! etcd's Lock service (`v3lockpb`): Lock and Unlock, with fencing.
//!
//! ```text
//!  Lock(name, lease) ─► propose Request::Lock ─► key <name>/<lease hex>, fence = create rev
//!     owner? ── yes ─► answer (key; fence in the `conclave-fence` response metadata)
//!            └─ no ──► wait: applied events that touch <name>/ ─► queue_status again
//!                        Owner ─► answer · Lost (lease ran out, key gone) ─► error, never Owner
//!  Unlock(key) ─► propose Request::Unlock (fenced when `conclave-fence` metadata is sent)
//! ```
//!
//! Waiting is driven by the apply path's event broadcast (the one watches use), never by
//! polling. A follower forwards the whole call to the leader, which proposes and waits.
//! Helpers shared with the election services live here too.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use conclave_proto::etcdserverpb::{self as pb, kv_client::KvClient};
use conclave_proto::v3lockpb::lock_server::{Lock, LockServer};
use conclave_proto::v3lockpb::{self as lockpb, lock_client::LockClient};
use conclave_state::{QueueResponse, QueueStatus, Request, Response, StateMachine};
use tokio::time::Instant;
use tonic::metadata::MetadataValue;
use tonic::{Status, async_trait};

use super::limits::Wait;
use super::route::leader_call;
use super::watch_hub::{Delivery, Interest, Subscription};
use super::{Api, CallContext, Served, answer, convert, state_status, to_status, unexpected};
use crate::error::Error;

/// Request and response metadata carrying a lock's fence (its key's create revision). etcd's
/// messages have no field for it; Conclave-aware clients read it from Lock and send it with
/// Unlock, so a stale holder's unlock cannot release a later holder of the same key.
pub const FENCE_METADATA: &str = "conclave-fence";
/// How long a Lock or Campaign waits when the client sets no deadline. etcd waits for ever;
/// a bound keeps a waiter whose cancellation was lost from living for ever.
pub const QUEUE_WAIT_DEFAULT_MS: u64 = 24 * 3600 * 1000;

/// The lock service over the shared [`Api`].
pub struct LockService {
    pub api: Arc<Api>,
}

/// The service, ready for the gRPC router.
pub fn server(api: &Arc<Api>, decode_max: usize) -> LockServer<LockService> {
    LockServer::new(LockService { api: api.clone() }).max_decoding_message_size(decode_max)
}

/// A waiting call's context: the client's deadline, or [`QUEUE_WAIT_DEFAULT_MS`].
pub(crate) fn wait_context<T>(request: &tonic::Request<T>) -> CallContext {
    CallContext::new(request, QUEUE_WAIT_DEFAULT_MS)
}

/// `name` followed by `/`: the prefix of a lock's or an election's queue keys.
pub(crate) fn queue_prefix(name: &[u8]) -> Vec<u8> {
    let mut prefix = name.to_vec();
    prefix.push(b'/');
    prefix
}

/// Resolves once the node's driver has stopped or a graceful shutdown drains the client API,
/// so waits and streams end and the gRPC server's graceful shutdown is not held up by them.
pub(crate) async fn node_stopped(api: &Api) {
    let mut status = api.node.status.clone();
    tokio::select! {
        // An error means the driver's status sender is gone: stopped as well.
        _ = status.wait_for(|s| s.stopped.is_some()) => {}
        _ = api.draining() => {}
    }
}

/// For a stream that reads the state afresh on each change (topic Subscribe, etcd election
/// Observe): waits for the next change. False when the stream must end: its client is gone,
/// or the node stopped (the client is told so).
pub(crate) async fn stream_changed<R>(
    changes: &mut Subscription,
    stopped: std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
    responses: &tokio::sync::mpsc::Sender<Result<R, Status>>,
) -> bool {
    let changed = tokio::select! {
        _ = responses.closed() => return false,
        _ = stopped => false,
        changed = changes.changed() => changed,
    };
    if !changed {
        let _ = responses.send(Err(to_status(Error::Stopped))).await;
    }
    changed
}

/// Runs `check` on the applied state now and again after every applied batch with events
/// `interest` names (the watch hub wakes this call for those only), until it answers `Some`
/// or the deadline passes (`Ok(None)`). Subscribing under the state's read lock means no
/// batch can slip between a check and the wait.
pub(crate) async fn wait_until<T>(
    api: &Api,
    deadline: Instant,
    mut check: impl FnMut(&StateMachine) -> Option<T>,
    interest: Interest,
) -> Result<Option<T>, Status> {
    let (mut changes, first) = api.subscribe_with(interest, Delivery::Signal, &mut check);
    if let Some(done) = first {
        return Ok(Some(done));
    }
    let stopped = node_stopped(api);
    tokio::pin!(stopped);
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        let received = tokio::select! {
            _ = &mut stopped => return Err(to_status(Error::Stopped)),
            received = tokio::time::timeout(remaining, changes.changed()) => received,
        };
        match received {
            Err(_) => return Ok(None),
            // A batch with events it waits on, or a resync: the state itself is authoritative.
            Ok(true) => {}
            Ok(false) => return Err(to_status(Error::Stopped)),
        }
        if let Some(done) = api.node.read_state(&mut check) {
            return Ok(Some(done));
        }
    }
}

/// The answer to a waiter whose key is gone or whose lease ran out: it never owns.
pub(crate) fn lost_status() -> Status {
    state_status(&conclave_state::Error::LeaseNotFound)
}

/// Waits until the queue key `key` (created at `fence`) owns `name`. Answers the revision
/// at which it was seen owning, `Ok(None)` at the deadline, or the "lease not found" status
/// once the key is lost.
pub(crate) async fn wait_for_queue(
    api: &Api,
    deadline: Instant,
    name: &[u8],
    key: &[u8],
    fence: i64,
) -> Result<Option<i64>, Status> {
    let prefix = queue_prefix(name);
    let outcome = wait_until(
        api,
        deadline,
        |state| match state.queue_status(name, key, fence) {
            QueueStatus::Owner { .. } => Some(Ok(state.revision())),
            QueueStatus::Lost => Some(Err(lost_status())),
            QueueStatus::Waiting { .. } => None,
        },
        Interest::prefix(&prefix),
    )
    .await?;
    outcome.transpose()
}

/// After a Lock or an etcd Campaign queued `queued` on `name` at `revision`: the revision at
/// which the key owns `name`, waiting for its turn when it does not yet. On a deadline the key
/// keeps its place (etcd's clients retry with the same lease, which finds the same key, and
/// must not lose their turn); only a dropped call withdraws it. A wait beyond the node's cap
/// for `cap`'s kind is refused, and the key removed, so a refused call leaves nothing behind.
pub(crate) async fn wait_for_turn(
    api: &Arc<Api>,
    ctx: &CallContext,
    cap: (Wait, Option<SocketAddr>),
    name: &[u8],
    queued: &QueueResponse,
    revision: i64,
) -> Result<i64, Status> {
    if queued.owner {
        return Ok(revision);
    }
    // Armed from here on: dropped on a refusal below, it removes the key.
    let mut guard = QueueGuard::new(
        api.clone(),
        Bytes::copy_from_slice(name),
        queued.key.clone(),
        queued.fence,
        ctx,
    );
    let (kind, client) = cap;
    let _slot = api.limits.wait(kind, client)?;
    let waited = wait_for_queue(api, ctx.deadline, name, &queued.key, queued.fence).await;
    guard.disarm();
    waited?.ok_or_else(|| to_status(Error::Timeout))
}

/// How often an abandoned waiter's key is looked at again when the key ahead of it changed
/// before its withdrawal applied (the local state may lag the leader's).
const WITHDRAW_ATTEMPTS_MAX: usize = 5;
/// Pause between those attempts, so a lagging local state can catch up.
const WITHDRAW_RETRY_MS: u64 = 50;

/// Withdraws a queue key whose waiting call was dropped, but only while it is still waiting:
/// the delete is a Txn that also requires the key just ahead to exist unchanged, so it applies
/// only while this key has never owned the queue. Lock and Campaign are idempotent under one
/// lease, so a client that gave up on one call and retried elsewhere shares this key with its
/// retry; once the key owns the queue that retry may have been told so, and deleting the key
/// would hand the lock to the next waiter while the holder's lease is still valid (the fault
/// suite saw this when a member paused with such a call was continued). An owner key is left
/// to its holder or its lease.
pub(crate) async fn withdraw_waiter(
    api: &Api,
    ctx: &CallContext,
    name: &[u8],
    key: Bytes,
    fence: i64,
) -> Result<bool, Status> {
    use pb::compare::{CompareResult, CompareTarget, TargetUnion};
    let create_is = |key: Bytes, revision: i64| pb::Compare {
        result: CompareResult::Equal as i32,
        target: CompareTarget::Create as i32,
        key,
        target_union: Some(TargetUnion::CreateRevision(revision)),
        ..Default::default()
    };
    for attempt in 0..WITHDRAW_ATTEMPTS_MAX {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(WITHDRAW_RETRY_MS)).await;
        }
        let ahead = match api
            .node
            .read_state(|state| state.queue_status(name, &key, fence))
        {
            QueueStatus::Waiting { waiting_for } => waiting_for,
            QueueStatus::Owner { .. } | QueueStatus::Lost => return Ok(false),
        };
        let txn = pb::TxnRequest {
            compare: vec![
                create_is(key.clone(), fence),
                create_is(ahead.key.clone(), ahead.create_revision),
            ],
            success: vec![pb::RequestOp {
                request: Some(pb::request_op::Request::RequestDeleteRange(
                    pb::DeleteRangeRequest {
                        key: key.clone(),
                        ..Default::default()
                    },
                )),
            }],
            failure: vec![],
        };
        let command = Request::Txn(convert::txn_from_pb(txn.clone())?);
        let served =
            api.write_routed(ctx, command, &txn, leader_call!(KvClient::txn), |applied| {
                match answer(&applied)? {
                    Response::Txn(answer) => Ok(answer.succeeded),
                    other => Err(unexpected(other)),
                }
            })
            .await?;
        let withdrawn = match served {
            Served::Here(succeeded) => succeeded,
            Served::Leader(response) => response.into_inner().succeeded,
        };
        if withdrawn {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Withdraws a waiter's queue key if the call is dropped while waiting (the client cancelled
/// or disconnected), as etcd's recipes do, unless the key has come to own the queue meanwhile
/// (see [`withdraw_waiter`]); disarmed on every answer.
pub(crate) struct QueueGuard {
    api: Arc<Api>,
    name: Bytes,
    key: Bytes,
    fence: i64,
    armed: bool,
    /// The caller's credentials: the withdrawal is the caller's write, checked as such.
    token: Option<Arc<str>>,
    cert_user: Option<Arc<str>>,
}

impl QueueGuard {
    pub(crate) fn new(
        api: Arc<Api>,
        name: Bytes,
        key: Bytes,
        fence: i64,
        caller: &CallContext,
    ) -> Self {
        QueueGuard {
            api,
            name,
            key,
            fence,
            armed: true,
            token: caller.token.clone(),
            cert_user: caller.cert_user.clone(),
        }
    }

    pub(crate) fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for QueueGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let api = self.api.clone();
        let name = self.name.clone();
        let key = self.key.clone();
        let fence = self.fence;
        let (token, cert_user) = (self.token.take(), self.cert_user.take());
        runtime.spawn(async move {
            let ctx = CallContext {
                deadline: Instant::now() + Duration::from_millis(api.config.request_timeout_ms),
                forwarded: false,
                forwarded_by: None,
                session: None,
                fence: None,
                token,
                cert_user,
            };
            match withdraw_waiter(&api, &ctx, &name, key, fence).await {
                Ok(true) => {}
                Ok(false) => tracing::debug!(
                    "abandoned queue key owns the queue or is gone; left to its lease"
                ),
                Err(status) => {
                    tracing::debug!(%status, "abandoned queue key not removed; its lease will")
                }
            }
        });
    }
}

/// The fence a request carries in its metadata, if any.
pub(crate) fn request_fence<T>(request: &tonic::Request<T>) -> Result<Option<i64>, Status> {
    let Some(value) = request.metadata().get(FENCE_METADATA) else {
        return Ok(None);
    };
    value
        .to_str()
        .ok()
        .and_then(|text| text.trim().parse::<i64>().ok())
        .filter(|fence| *fence > 0)
        .map(Some)
        .ok_or_else(|| {
            Status::invalid_argument(format!(
                "conclave: invalid argument: {FENCE_METADATA} must be a positive revision"
            ))
        })
}

fn with_fence<T>(message: T, fence: i64) -> tonic::Response<T> {
    let mut response = tonic::Response::new(message);
    if let Ok(value) = MetadataValue::try_from(fence.to_string()) {
        response.metadata_mut().insert(FENCE_METADATA, value);
    }
    response
}

#[async_trait]
impl Lock for LockService {
    async fn lock(
        &self,
        request: tonic::Request<lockpb::LockRequest>,
    ) -> Result<tonic::Response<lockpb::LockResponse>, Status> {
        let ctx = wait_context(&request);
        let client = request.remote_addr();
        let message = request.into_inner();
        if message.name.is_empty() {
            return Err(state_status(&conclave_state::Error::EmptyKey));
        }
        let api = &self.api;
        let command = Request::Lock {
            name: message.name.clone(),
            lease: message.lease,
        };
        let served = api
            .write_routed(
                &ctx,
                command,
                &message,
                leader_call!(LockClient::lock),
                |applied| match answer(&applied)? {
                    Response::Lock(queued) => Ok((queued.clone(), applied.output.revision)),
                    other => Err(unexpected(other)),
                },
            )
            .await?;
        let (queued, revision): (QueueResponse, i64) = match served {
            Served::Leader(response) => return Ok(response),
            Served::Here(local) => local,
        };
        let revision = wait_for_turn(
            api,
            &ctx,
            (Wait::Lock, client),
            &message.name,
            &queued,
            revision,
        )
        .await?;
        Ok(with_fence(
            lockpb::LockResponse {
                header: Some(api.header(revision)),
                key: queued.key,
            },
            queued.fence,
        ))
    }

    async fn unlock(
        &self,
        request: tonic::Request<lockpb::UnlockRequest>,
    ) -> Result<tonic::Response<lockpb::UnlockResponse>, Status> {
        let mut ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        let fence = request_fence(&request)?;
        // Passed on to the leader with the call when this node forwards it.
        ctx.fence = fence;
        let message = request.into_inner();
        if message.key.is_empty() {
            return Err(state_status(&conclave_state::Error::EmptyKey));
        }
        let api = &self.api;
        let command = Request::Unlock {
            key: message.key.clone(),
            fence,
        };
        let served = api
            .write_routed(
                &ctx,
                command,
                &message,
                leader_call!(LockClient::unlock),
                |applied| match answer(&applied)? {
                    Response::Unlocked { released } => Ok((*released, applied.output.revision)),
                    other => Err(unexpected(other)),
                },
            )
            .await?;
        let (released, revision) = match served {
            Served::Leader(response) => return Ok(response),
            Served::Here(local) => local,
        };
        // etcd answers an unlock of a missing key with success; a fenced unlock that released
        // nothing tells its caller it no longer held the lock.
        if let (Some(fence), false) = (fence, released) {
            return Err(Status::failed_precondition(format!(
                "conclave: lock key {:?} is not held at fence {fence}",
                String::from_utf8_lossy(&message.key)
            )));
        }
        Ok(tonic::Response::new(lockpb::UnlockResponse {
            header: Some(api.header(revision)),
        }))
    }
}
