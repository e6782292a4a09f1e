//! etcd's Election service (`v3electionpb`): Campaign, Proclaim, Leader, Observe, Resign.
//!
//! ```text
//!  Campaign(name, lease, value) ─► propose Request::Campaign ─► key <name>/<lease hex>
//!     leads? ── no ─► wait on applied events under <name>/ ─► queue_status ─► LeaderKey
//!  Proclaim / Resign ─► fenced on LeaderKey.rev by the state machine
//!  Leader ─► linearizable read of the lowest create revision under <name>/
//!  Observe ─► current leader, then each new leader key or value (state-driven, coalescing)
//! ```
//!
//! As in etcd, an election is a queue of plain KV keys, so `etcdctl elect` (which uses KV,
//! Watch and Lease directly) and this service see the same leaders.

use std::sync::Arc;

use bytes::Bytes;
use conclave_proto::v3electionpb::election_server::{Election, ElectionServer};
use conclave_proto::v3electionpb::{self as epb, election_client::ElectionClient};
use conclave_state::{LeaderKey, QueueResponse, Request, Response};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, async_trait};

use super::convert::kv_to_pb;
use super::limits::Wait;
use super::lock::{node_stopped, queue_prefix, stream_changed, wait_context, wait_for_turn};
use super::route::leader_call;
use super::watch_hub::{Delivery, Interest};
use super::{Api, CallContext, Served, answer, state_status, unexpected};

/// Leader updates queued for one Observe stream. Observe reports state (the newest leader),
/// so a client slower than this only skips intermediate values, never grows the queue.
pub const OBSERVE_STREAM_RESPONSES_MAX: usize = 16;
/// etcd's message for a Proclaim or Resign without a leader key.
const MISSING_LEADER_KEY: &str = "\"leader\" field must be provided";

/// The etcd election service over the shared [`Api`].
pub struct ElectionService {
    pub api: Arc<Api>,
}

/// The service, ready for the gRPC router.
pub fn server(api: &Arc<Api>, decode_max: usize) -> ElectionServer<ElectionService> {
    ElectionServer::new(ElectionService { api: api.clone() }).max_decoding_message_size(decode_max)
}

fn leader_from_pb(leader: Option<epb::LeaderKey>) -> Result<LeaderKey, Status> {
    let leader = leader.ok_or_else(|| Status::invalid_argument(MISSING_LEADER_KEY))?;
    Ok(LeaderKey {
        name: leader.name,
        key: leader.key,
        rev: leader.rev,
        lease: leader.lease,
    })
}

fn leader_to_pb(name: Bytes, queued: &QueueResponse, lease: i64) -> epb::LeaderKey {
    epb::LeaderKey {
        name,
        key: queued.key.clone(),
        rev: queued.fence,
        lease,
    }
}

#[async_trait]
impl Election for ElectionService {
    async fn campaign(
        &self,
        request: tonic::Request<epb::CampaignRequest>,
    ) -> Result<tonic::Response<epb::CampaignResponse>, Status> {
        let ctx = wait_context(&request);
        let client = request.remote_addr();
        let message = request.into_inner();
        if message.name.is_empty() {
            return Err(state_status(&conclave_state::Error::EmptyKey));
        }
        let api = &self.api;
        let command = Request::Campaign {
            name: message.name.clone(),
            lease: message.lease,
            value: message.value.clone(),
        };
        let served = api
            .write_routed(
                &ctx,
                command,
                &message,
                leader_call!(ElectionClient::campaign),
                |applied| match answer(&applied)? {
                    Response::Campaign(queued) => Ok((queued.clone(), applied.output.revision)),
                    other => Err(unexpected(other)),
                },
            )
            .await?;
        let (queued, revision) = match served {
            Served::Leader(response) => return Ok(response),
            Served::Here(local) => local,
        };
        let revision = wait_for_turn(
            api,
            &ctx,
            (Wait::Campaign, client),
            &message.name,
            &queued,
            revision,
        )
        .await?;
        Ok(tonic::Response::new(epb::CampaignResponse {
            header: Some(api.header(revision)),
            leader: Some(leader_to_pb(message.name, &queued, message.lease)),
        }))
    }

    async fn proclaim(
        &self,
        request: tonic::Request<epb::ProclaimRequest>,
    ) -> Result<tonic::Response<epb::ProclaimResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        let message = request.into_inner();
        let leader = leader_from_pb(message.leader.clone())?;
        let api = &self.api;
        let command = Request::Proclaim {
            leader,
            value: message.value.clone(),
        };
        api.write_self_contained(
            &ctx,
            command,
            &message,
            leader_call!(ElectionClient::proclaim),
            |applied| match answer(&applied)? {
                Response::Proclaimed => Ok(epb::ProclaimResponse {
                    header: Some(api.header(applied.output.revision)),
                }),
                other => Err(unexpected(other)),
            },
        )
        .await
    }

    async fn leader(
        &self,
        request: tonic::Request<epb::LeaderRequest>,
    ) -> Result<tonic::Response<epb::LeaderResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        let message = request.into_inner();
        let (prefix, end) = super::auth::name_prefix(&message.name);
        self.api.check_read(&ctx, &prefix, &end)?;
        self.api.linearizable_barrier(&ctx).await?;
        let (leader, revision) = self
            .api
            .node
            .read_state(|state| (state.election_leader(&message.name), state.revision()));
        let kv = leader.map_err(|e| state_status(&e))?;
        Ok(tonic::Response::new(epb::LeaderResponse {
            header: Some(self.api.header(revision)),
            kv: Some(kv_to_pb(kv)),
        }))
    }

    type ObserveStream = ReceiverStream<Result<epb::LeaderResponse, Status>>;

    async fn observe(
        &self,
        request: tonic::Request<epb::LeaderRequest>,
    ) -> Result<tonic::Response<Self::ObserveStream>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        // Held by the stream's task until the stream ends (election_observers_max).
        let slot = (self.api.limits).wait(Wait::ElectionObserver, request.remote_addr())?;
        let name = request.into_inner().name;
        let (prefix, end) = super::auth::name_prefix(&name);
        self.api.check_read(&ctx, &prefix, &end)?;
        // The first answer reflects every write acknowledged before the call, as etcd's Get.
        self.api.linearizable_barrier(&ctx).await?;
        let (responses, output) = mpsc::channel(OBSERVE_STREAM_RESPONSES_MAX);
        let api = self.api.clone();
        let prefix = queue_prefix(&name);
        let (mut changes, mut current) =
            api.subscribe_with(Interest::prefix(&prefix), Delivery::Signal, |state| {
                (state.election_leader(&name).ok(), state.revision())
            });
        tokio::spawn(async move {
            let _slot = slot;
            // The last leader key and version sent, so an unchanged leader is not repeated.
            let mut sent: Option<(Bytes, i64)> = None;
            let stopped = node_stopped(&api);
            tokio::pin!(stopped);
            loop {
                if let (Some(kv), revision) = &current {
                    let this = (kv.key.clone(), kv.mod_revision);
                    if sent.as_ref() != Some(&this) {
                        sent = Some(this);
                        let response = epb::LeaderResponse {
                            header: Some(api.header(*revision)),
                            kv: Some(kv_to_pb(kv.clone())),
                        };
                        // Blocking here is bounded: while we wait, the hub may drop this
                        // subscription as behind, and the next answer is read from the state
                        // afresh either way.
                        if responses.send(Ok(response)).await.is_err() {
                            return;
                        }
                    }
                }
                if !stream_changed(&mut changes, stopped.as_mut(), &responses).await {
                    return;
                }
                current = api
                    .node
                    .read_state(|state| (state.election_leader(&name).ok(), state.revision()));
            }
        });
        Ok(tonic::Response::new(ReceiverStream::new(output)))
    }

    async fn resign(
        &self,
        request: tonic::Request<epb::ResignRequest>,
    ) -> Result<tonic::Response<epb::ResignResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        let message = request.into_inner();
        let leader = leader_from_pb(message.leader.clone())?;
        let api = &self.api;
        api.write_self_contained(
            &ctx,
            Request::Resign { leader },
            &message,
            leader_call!(ElectionClient::resign),
            |applied| match answer(&applied)? {
                // etcd answers a stale resign with success too: the key is not ours.
                Response::Resigned { .. } => Ok(epb::ResignResponse {
                    header: Some(api.header(applied.output.revision)),
                }),
                other => Err(unexpected(other)),
            },
        )
        .await
    }
}
