//! etcd's Cluster service. Members live in two replicated places: the Raft configuration
//! (who votes, who learns) and the driver's member records (ids and addresses, see
//! `docs/server.md`, Membership). MemberList shows the records of configuration members.
//!
//! A change runs on the leader (followers forward it): MemberAdd first replicates the new
//! member's record, so every node can dial it by the time the configuration names it, then
//! proposes the configuration change. One change at a time per node; the core refuses a
//! second one while the first (or its joint phase) is under way, and we retry until the
//! deadline.

use std::sync::Arc;
use std::time::Duration;

use conclave_proto::etcdserverpb::{
    self as pb, cluster_client::ClusterClient, cluster_server::Cluster,
};
use conclave_raft::{ConfChangeStep, ConfState, NodeId};
use tonic::transport::{Channel, Endpoint};
use tonic::{Status, async_trait};

use super::{Api, CallContext, FORWARDED_HEADER, to_status};
use crate::config::Member;
use crate::error::Error;
use crate::node::NodeStatus;

/// etcd's Cluster responses carry the member, cluster and term but no revision.
const NO_REVISION: i64 = 0;

/// How often a change refused as "in progress" is retried, and how often we look for its
/// effect on the configuration.
const CHANGE_POLL_MS: u64 = 20;

const ERR_MEMBER_NOT_FOUND: &str = "etcdserver: member not found";
const ERR_PEER_URL_EXISTS: &str = "etcdserver: Peer URLs already exists";
const ERR_NOT_LEARNER: &str = "etcdserver: can only promote a learner member";
const ERR_BAD_URLS: &str = "etcdserver: given member URLs are invalid";

pub struct ClusterService {
    pub api: Arc<Api>,
    /// Serializes this node's changes, so two MemberAdds cannot pick the same id.
    changing: tokio::sync::Mutex<()>,
}

impl ClusterService {
    pub fn new(api: Arc<Api>) -> Self {
        ClusterService {
            api,
            changing: tokio::sync::Mutex::new(()),
        }
    }

    fn members(&self) -> Vec<pb::Member> {
        let status = self.api.node.status();
        let conf = &status.conf_state;
        status
            .members
            .iter()
            // A joining node that has no configuration yet shows what it was told.
            .filter(|m| conf.contains(m.id) || conf.members().is_empty())
            .map(|m| self.to_pb(m, conf))
            .collect()
    }

    fn to_pb(&self, member: &Member, conf: &ConfState) -> pb::Member {
        // A record made by MemberAdd has no name or client address; the member's own
        // configuration (and the founding list) may know them.
        let known = self
            .api
            .config
            .member(member.id)
            .filter(|m| m.peer_addr == member.peer_addr);
        let name = match known {
            Some(k) if member.name.is_empty() => k.name.clone(),
            _ => member.name.clone(),
        };
        let client = match known {
            Some(k) if member.client_addr.is_empty() => k.client_addr.clone(),
            _ => member.client_addr.clone(),
        };
        pb::Member {
            id: member.id,
            name,
            peer_ur_ls: vec![format!("http://{}", member.peer_addr)],
            client_ur_ls: if client.is_empty() {
                Vec::new()
            } else {
                vec![format!("http://{client}")]
            },
            is_learner: conf.learners.contains(&member.id),
        }
    }

    /// `None` when this node leads; otherwise a client for the leader. Waits for a leader
    /// until the deadline.
    async fn leader_client(
        &self,
        ctx: &CallContext,
    ) -> Result<Option<ClusterClient<Channel>>, Status> {
        let mut watch = self.api.node.status.clone();
        loop {
            let status = watch.borrow_and_update().clone();
            match status.leader {
                Some(leader) if leader == self.api.config.id => return Ok(None),
                Some(leader) if !ctx.forwarded => {
                    let address = client_address(&status, &self.api, leader)
                        .ok_or_else(|| to_status(Error::NoLeader))?;
                    let channel = Endpoint::from_shared(format!("http://{address}"))
                        .map_err(|_| to_status(Error::NoLeader))?
                        .connect_lazy();
                    return Ok(Some(ClusterClient::new(channel)));
                }
                _ => {}
            }
            if ctx.remaining().is_zero() {
                return Err(to_status(Error::NoLeader));
            }
            let wait = ctx.remaining().min(Duration::from_millis(CHANGE_POLL_MS));
            let _ = tokio::time::timeout(wait, watch.changed()).await;
        }
    }

    /// Proposes `steps` and waits until they are applied, retrying while another change is
    /// under way.
    async fn change(&self, ctx: &CallContext, steps: Vec<ConfChangeStep>) -> Result<(), Status> {
        loop {
            let attempt = self.api.node.change_membership(steps.clone());
            match tokio::time::timeout(ctx.remaining(), attempt).await {
                Err(_) => return Err(to_status(Error::Timeout)),
                Ok(Ok(())) => return Ok(()),
                Ok(Err(Error::Raft(conclave_raft::Error::ConfChangeInProgress)))
                    if !ctx.remaining().is_zero() =>
                {
                    tokio::time::sleep(Duration::from_millis(CHANGE_POLL_MS)).await;
                }
                Ok(Err(Error::Raft(conclave_raft::Error::InvalidConfChange(reason)))) => {
                    return Err(Status::failed_precondition(format!(
                        "conclave: invalid membership change: {reason}"
                    )));
                }
                Ok(Err(error)) => return Err(to_status(error)),
            }
        }
    }

    /// Waits (until the deadline) for the applied configuration to satisfy `done`, so the
    /// answer's member list shows the change.
    async fn settle(&self, ctx: &CallContext, done: impl Fn(&ConfState) -> bool) {
        while !done(&self.api.node.status().conf_state) && !ctx.remaining().is_zero() {
            tokio::time::sleep(Duration::from_millis(CHANGE_POLL_MS)).await;
        }
    }

    async fn add_local(
        &self,
        ctx: &CallContext,
        request: pb::MemberAddRequest,
    ) -> Result<pb::MemberAddResponse, Status> {
        let peer_addr = match request.peer_ur_ls.as_slice() {
            [url] => parse_peer_url(url).ok_or_else(|| Status::invalid_argument(ERR_BAD_URLS))?,
            _ => return Err(Status::invalid_argument(ERR_BAD_URLS)),
        };
        let _one_at_a_time = self.changing.lock().await;
        let status = self.api.node.status();
        let conf = &status.conf_state;
        let taken = status
            .members
            .iter()
            .any(|m| conf.contains(m.id) && m.peer_addr == peer_addr);
        if taken {
            return Err(Status::failed_precondition(ERR_PEER_URL_EXISTS));
        }
        // Above every id ever recorded, so a record left by an interrupted add is not reused.
        let id = status
            .members
            .iter()
            .map(|m| m.id)
            .chain(conf.members())
            .max()
            .unwrap_or(0)
            + 1;
        let member = Member {
            id,
            name: String::new(),
            peer_addr,
            client_addr: String::new(),
        };
        let record = self.api.node.propose_member(member.clone());
        match tokio::time::timeout(ctx.remaining(), record).await {
            Err(_) => return Err(to_status(Error::Timeout)),
            Ok(Err(error)) => return Err(to_status(error)),
            Ok(Ok(())) => {}
        }
        let step = if request.is_learner {
            ConfChangeStep::AddLearner(id)
        } else {
            ConfChangeStep::AddVoter(id)
        };
        self.change(ctx, vec![step]).await?;
        self.settle(ctx, |conf| conf.contains(id)).await;
        let conf = self.api.node.status().conf_state;
        Ok(pb::MemberAddResponse {
            header: Some(self.api.header(NO_REVISION)),
            member: Some(self.to_pb(&member, &conf)),
            members: self.members(),
        })
    }

    /// Checks `id` is a member (etcd's "member not found" otherwise).
    fn existing(&self, id: NodeId) -> Result<ConfState, Status> {
        let conf = self.api.node.status().conf_state;
        if id == 0 || !conf.contains(id) {
            return Err(Status::not_found(ERR_MEMBER_NOT_FOUND));
        }
        Ok(conf)
    }
}

/// `http://host:port` (or bare `host:port`) to `host:port`; `None` when it is not one.
fn parse_peer_url(url: &str) -> Option<String> {
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
        .unwrap_or(url)
        .trim_end_matches('/');
    let (host, port) = rest.rsplit_once(':')?;
    if host.is_empty() || host.contains('/') || port.parse::<u16>().ok()? == 0 {
        return None;
    }
    Some(rest.to_string())
}

/// Where member `id` serves clients: its record, else the founding list.
fn client_address(status: &NodeStatus, api: &Api, id: NodeId) -> Option<String> {
    status
        .members
        .iter()
        .find(|m| m.id == id && !m.client_addr.is_empty())
        .map(|m| m.client_addr.clone())
        .or_else(|| api.config.member(id).map(|m| m.client_addr.clone()))
}

/// Marks a request forwarded and bounds it by what is left of ours.
fn forwarded<T>(ctx: &CallContext, inner: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(inner);
    request.metadata_mut().insert(
        FORWARDED_HEADER,
        tonic::metadata::MetadataValue::from_static("1"),
    );
    request.set_timeout(ctx.remaining());
    request
}

#[async_trait]
impl Cluster for ClusterService {
    async fn member_add(
        &self,
        request: tonic::Request<pb::MemberAddRequest>,
    ) -> Result<tonic::Response<pb::MemberAddResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        let inner = request.into_inner();
        match self.leader_client(&ctx).await? {
            Some(mut leader) => leader.member_add(forwarded(&ctx, inner)).await,
            None => self.add_local(&ctx, inner).await.map(tonic::Response::new),
        }
    }

    async fn member_remove(
        &self,
        request: tonic::Request<pb::MemberRemoveRequest>,
    ) -> Result<tonic::Response<pb::MemberRemoveResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        let inner = request.into_inner();
        if let Some(mut leader) = self.leader_client(&ctx).await? {
            return leader.member_remove(forwarded(&ctx, inner)).await;
        }
        let _one_at_a_time = self.changing.lock().await;
        let id = inner.id;
        self.existing(id)?;
        self.change(&ctx, vec![ConfChangeStep::RemoveNode(id)])
            .await?;
        self.settle(&ctx, |conf| !conf.contains(id)).await;
        Ok(tonic::Response::new(pb::MemberRemoveResponse {
            header: Some(self.api.header(NO_REVISION)),
            members: self.members(),
        }))
    }

    async fn member_list(
        &self,
        _request: tonic::Request<pb::MemberListRequest>,
    ) -> Result<tonic::Response<pb::MemberListResponse>, Status> {
        Ok(tonic::Response::new(pb::MemberListResponse {
            header: Some(self.api.header(NO_REVISION)),
            members: self.members(),
        }))
    }

    async fn member_promote(
        &self,
        request: tonic::Request<pb::MemberPromoteRequest>,
    ) -> Result<tonic::Response<pb::MemberPromoteResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        let inner = request.into_inner();
        if let Some(mut leader) = self.leader_client(&ctx).await? {
            return leader.member_promote(forwarded(&ctx, inner)).await;
        }
        let _one_at_a_time = self.changing.lock().await;
        let id = inner.id;
        let conf = self.existing(id)?;
        if !conf.learners.contains(&id) {
            return Err(Status::failed_precondition(ERR_NOT_LEARNER));
        }
        self.change(&ctx, vec![ConfChangeStep::AddVoter(id)])
            .await?;
        self.settle(&ctx, |conf| conf.voters.contains(&id) && !conf.is_joint())
            .await;
        Ok(tonic::Response::new(pb::MemberPromoteResponse {
            header: Some(self.api.header(NO_REVISION)),
            members: self.members(),
        }))
    }
}
