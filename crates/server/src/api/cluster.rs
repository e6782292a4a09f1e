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

use conclave_proto::conclave::v1::membership_server::{Membership, MembershipServer};
use conclave_proto::conclave::v1::{self as cv1};
use conclave_proto::etcdserverpb::{
    self as pb, cluster_client::ClusterClient, cluster_server::Cluster,
};
use conclave_raft::{ConfChangeStep, ConfState, NodeId};
use tonic::{Status, async_trait};

use super::route::leader_call;
use super::{Api, CallContext, to_status};
use crate::config::Member;
use crate::error::Error;
use crate::node::{MEMBER_FIELD_BYTES_MAX, NodeStatus, PeerMatch};

/// etcd's Cluster responses carry the member, cluster and term but no revision.
const NO_REVISION: i64 = 0;

/// How often a change refused as "in progress" is retried, and how often we look for its
/// effect on the configuration.
const CHANGE_POLL_MS: u64 = 20;

const ERR_MEMBER_NOT_FOUND: &str = "etcdserver: member not found";
const ERR_PEER_URL_EXISTS: &str = "etcdserver: Peer URLs already exists";
const ERR_NOT_LEARNER: &str = "etcdserver: can only promote a learner member";
const ERR_LEARNER_NOT_READY: &str =
    "etcdserver: can only promote a learner member which is in sync with leader";
/// A learner is promoted only once its log reaches this share of the leader's (etcd's
/// threshold): a voter far behind would slow every commit, or stall the cluster when it is
/// needed for a quorum.
const LEARNER_READY_PERCENT: u64 = 90;
const ERR_BAD_URLS: &str = "etcdserver: given member URLs are invalid";

pub struct ClusterService {
    pub api: Arc<Api>,
    /// Serializes this node's changes, so a check (a peer URL in use, a learner to promote)
    /// sees the effect of the change before it. Ids need no lock: the core picks each one
    /// above every id in the log, applied or not.
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
        let (members, conf) = current_members(&self.api);
        let scheme = client_scheme(&self.api);
        members.iter().map(|m| to_pb(m, &conf, scheme)).collect()
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
        // The leader's core picks the id: above every id the cluster ever used, so a removed
        // member's id (its process may still run) is never given again.
        let record = self.api.node.add_member(peer_addr.clone());
        let id = match tokio::time::timeout(ctx.remaining(), record).await {
            Err(_) => return Err(to_status(Error::Timeout)),
            Ok(Err(Error::Raft(conclave_raft::Error::InvalidConfChange(reason)))) => {
                return Err(Status::failed_precondition(format!(
                    "conclave: invalid membership change: {reason}"
                )));
            }
            Ok(Err(error)) => return Err(to_status(error)),
            Ok(Ok(id)) => id,
        };
        let member = Member {
            id,
            name: String::new(),
            peer_addr,
            client_addr: String::new(),
        };
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
            member: Some(to_pb(&member, &conf, client_scheme(&self.api))),
            members: self.members(),
        })
    }

    async fn remove_local(
        &self,
        ctx: &CallContext,
        id: NodeId,
    ) -> Result<pb::MemberRemoveResponse, Status> {
        let _one_at_a_time = self.changing.lock().await;
        self.existing(id)?;
        self.change(ctx, vec![ConfChangeStep::RemoveNode(id)])
            .await?;
        self.settle(ctx, |conf| !conf.contains(id)).await;
        Ok(pb::MemberRemoveResponse {
            header: Some(self.api.header(NO_REVISION)),
            members: self.members(),
        })
    }

    async fn promote_local(
        &self,
        ctx: &CallContext,
        id: NodeId,
    ) -> Result<pb::MemberPromoteResponse, Status> {
        let _one_at_a_time = self.changing.lock().await;
        let conf = self.existing(id)?;
        if !conf.learners.contains(&id) {
            return Err(Status::failed_precondition(ERR_NOT_LEARNER));
        }
        match self.api.node.peer_match(id).await {
            Ok(Some(progress)) if learner_ready(progress) => {}
            Ok(_) => return Err(Status::failed_precondition(ERR_LEARNER_NOT_READY)),
            Err(error) => return Err(to_status(error)),
        }
        self.change(ctx, vec![ConfChangeStep::AddVoter(id)]).await?;
        self.settle(ctx, |conf| conf.voters.contains(&id) && !conf.is_joint())
            .await;
        Ok(pb::MemberPromoteResponse {
            header: Some(self.api.header(NO_REVISION)),
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

/// Whether a learner's log is close enough to the leader's to make it a voter.
fn learner_ready(progress: PeerMatch) -> bool {
    // In u128, so no index is too large for the product.
    u128::from(progress.matched) * 100
        >= u128::from(progress.leader_last) * u128::from(LEARNER_READY_PERCENT)
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

#[async_trait]
impl Cluster for ClusterService {
    async fn member_add(
        &self,
        request: tonic::Request<pb::MemberAddRequest>,
    ) -> Result<tonic::Response<pb::MemberAddResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        // Membership is root's business once auth is on (etcd's rule).
        self.api.check_admin(&ctx)?;
        let message = request.into_inner();
        self.api
            .serve(
                &ctx,
                &message,
                leader_call!(ClusterClient::member_add),
                || self.add_local(&ctx, message.clone()),
            )
            .await
    }

    async fn member_remove(
        &self,
        request: tonic::Request<pb::MemberRemoveRequest>,
    ) -> Result<tonic::Response<pb::MemberRemoveResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        // Membership is root's business once auth is on (etcd's rule).
        self.api.check_admin(&ctx)?;
        let message = request.into_inner();
        self.api
            .serve(
                &ctx,
                &message,
                leader_call!(ClusterClient::member_remove),
                || self.remove_local(&ctx, message.id),
            )
            .await
    }

    async fn member_list(
        &self,
        request: tonic::Request<pb::MemberListRequest>,
    ) -> Result<tonic::Response<pb::MemberListResponse>, Status> {
        if request.get_ref().linearizable {
            // etcd's `linearizable` flag: the list includes every configuration change
            // committed before the call, not only those this member has heard of.
            let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
            self.api.linearizable_barrier(&ctx).await?;
        }
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
        // Membership is root's business once auth is on (etcd's rule).
        self.api.check_admin(&ctx)?;
        let message = request.into_inner();
        self.api
            .serve(
                &ctx,
                &message,
                leader_call!(ClusterClient::member_promote),
                || self.promote_local(&ctx, message.id),
            )
            .await
    }
}

// ---- Published member attributes -----------------------------------------------------------

/// How long a member waits before publishing its attributes again after a failure, and at
/// most for its own record to show a successful publication.
const PUBLISH_RETRY_MS: u64 = 500;

/// The scheme of the client URLs members advertise: `https` when this node serves clients
/// over TLS (members of one cluster are configured alike), so clients that learn the URLs
/// from `member list` (etcdctl's `--cluster` commands, conclave-client's failover) keep TLS.
fn client_scheme(api: &Api) -> &'static str {
    if api.config.client_tls.is_some() {
        "https"
    } else {
        "http"
    }
}

fn to_pb(member: &Member, conf: &ConfState, client_scheme: &str) -> pb::Member {
    pb::Member {
        id: member.id,
        name: member.name.clone(),
        peer_ur_ls: vec![format!("http://{}", member.peer_addr)],
        client_ur_ls: if member.client_addr.is_empty() {
            Vec::new()
        } else {
            vec![format!("{client_scheme}://{}", member.client_addr)]
        },
        is_learner: conf.learners.contains(&member.id),
    }
}

/// The members of the current configuration from the replicated member records, with the
/// configuration it runs under. A record made by MemberAdd has no name or client address until
/// the member publishes them; this node's own configuration (and the founding list) may
/// already know them.
pub(crate) fn current_members(api: &Api) -> (Vec<Member>, ConfState) {
    let status = api.node.status();
    let conf = status.conf_state;
    let members = status
        .members
        .iter()
        // A joining node that has no configuration yet shows what it was told.
        .filter(|m| conf.contains(m.id) || conf.members().is_empty())
        .map(|member| {
            let known = api
                .config
                .member(member.id)
                .filter(|k| k.peer_addr == member.peer_addr);
            let mut resolved = member.clone();
            if let Some(known) = known {
                if resolved.name.is_empty() {
                    resolved.name = known.name.clone();
                }
                if resolved.client_addr.is_empty() {
                    resolved.client_addr = known.client_addr.clone();
                }
            }
            resolved
        })
        .collect();
    (members, conf)
}

/// `conclave.v1.Membership`, ready for the gRPC router.
pub fn membership_server(api: &Arc<Api>) -> MembershipServer<MembershipService> {
    MembershipServer::new(MembershipService { api: api.clone() })
}

/// `conclave.v1.Membership` on the client port. Publishing attributes moved to the
/// authenticated peer handshake (see [`record_member_attributes`]): a client could otherwise
/// point a member's client address at a listener of its own and receive forwarded writes.
pub struct MembershipService {
    pub api: Arc<Api>,
}

/// The answer to every `PublishAttributes` call on the client port.
pub const ERR_PUBLISH_ATTRIBUTES_PEER_ONLY: &str = "conclave: PublishAttributes is not served on the client port; members announce \
     their name and client address in the authenticated peer handshake";

/// Every refused call is counted (it is either an old member or someone probing).
pub static PUBLISH_ATTRIBUTES_REFUSED: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(0);

/// One sentence for attributes the records cannot take.
fn check_attributes(name: &str, client_address: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MEMBER_FIELD_BYTES_MAX {
        return Err(format!(
            "a member name must be 1 to {MEMBER_FIELD_BYTES_MAX} bytes"
        ));
    }
    let address_ok = client_address.len() <= MEMBER_FIELD_BYTES_MAX
        && parse_peer_url(client_address).as_deref() == Some(client_address);
    if !address_ok {
        return Err(format!(
            "client address {client_address:?} is not host:port"
        ));
    }
    Ok(())
}

#[async_trait]
impl Membership for MembershipService {
    async fn publish_attributes(
        &self,
        request: tonic::Request<cv1::PublishAttributesRequest>,
    ) -> Result<tonic::Response<cv1::PublishAttributesResponse>, Status> {
        let refused = PUBLISH_ATTRIBUTES_REFUSED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // The first refusal and then one in a thousand: a caller in a loop must not flood the log.
        if refused.is_multiple_of(1000) {
            tracing::warn!(
                remote = ?request.remote_addr(),
                member = request.get_ref().id,
                refused = refused + 1,
                "refused PublishAttributes on the client port"
            );
        }
        Err(Status::permission_denied(ERR_PUBLISH_ATTRIBUTES_PEER_ONLY))
    }
}

/// Runs for the node's life: while this node leads, completes the member records that lack a
/// name or client address (a member added by MemberAdd has only its peer address) from what
/// that member announced in its authenticated peer handshake, or, for this node itself, from
/// its own configuration. The others need a member's client address to forward requests to
/// it when it leads. Only a member's own announcement fills its record, and only fields still
/// empty, so not even a member can redirect another's traffic. Ends when the node drains or
/// stops.
pub async fn record_member_attributes(
    api: Arc<Api>,
    mut announced: tokio::sync::watch::Receiver<
        std::collections::BTreeMap<NodeId, crate::transport::PeerAttributes>,
    >,
) {
    let mut status = api.node.status.clone();
    let retry = Duration::from_millis(PUBLISH_RETRY_MS);
    // Evaluated on every status change without copying it: only a leader with an incomplete
    // configuration member's record has anything to do.
    let needed = |s: &NodeStatus| {
        s.stopped.is_some()
            || (s.role == Some(conclave_raft::Role::Leader)
                && s.members
                    .iter()
                    .any(|m| s.conf_state.contains(m.id) && incomplete(m)))
    };
    loop {
        let current = tokio::select! {
            current = status.wait_for(needed) => match current {
                Ok(current) => current.clone(),
                Err(_) => return,
            },
            _ = api.draining() => return,
        };
        if current.stopped.is_some() {
            return;
        }
        let own = api.config.this_member().map(|me| {
            (
                me.id,
                crate::transport::PeerAttributes {
                    name: me.name.clone(),
                    client_address: me.client_addr.clone(),
                    peer_address: me.peer_addr.clone(),
                },
            )
        });
        let peers: Vec<_> = announced
            .borrow_and_update()
            .iter()
            .map(|(id, attributes)| (*id, attributes.clone()))
            .collect();
        for (id, attributes) in own.into_iter().chain(peers) {
            let Some(record) = current
                .members
                .iter()
                .find(|m| m.id == id && current.conf_state.contains(m.id) && incomplete(m))
            else {
                continue;
            };
            if let Err(reason) = check_attributes(&attributes.name, &attributes.client_address) {
                tracing::warn!(member = id, %reason, "ignoring the attributes a member announced");
                continue;
            }
            let member = Member {
                id,
                name: attributes.name.clone(),
                peer_addr: record.peer_addr.clone(),
                client_addr: attributes.client_address.clone(),
            };
            match tokio::time::timeout(retry, api.node.update_member(member)).await {
                Ok(Ok(())) => tracing::info!(
                    member = id,
                    name = %attributes.name,
                    client = %attributes.client_address,
                    "member attributes recorded"
                ),
                Ok(Err(error)) => {
                    tracing::debug!(member = id, %error, "member attributes not recorded yet")
                }
                Err(_) => tracing::debug!(member = id, "member attributes not recorded in time"),
            }
        }
        // A record may stay incomplete until its member connects (a new announcement) or an
        // update commits; look again then, or after the retry interval at the latest.
        tokio::select! {
            // A closed channel (the listener stopped) disables this branch.
            Ok(()) = announced.changed() => {}
            () = tokio::time::sleep(retry) => {}
            _ = api.draining() => return,
        }
    }
}

/// A member record still without the name or client address its member announces.
fn incomplete(member: &Member) -> bool {
    member.name.is_empty() || member.client_addr.is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_learner_is_ready_at_ninety_percent_of_the_leaders_log() {
        let at = |matched, leader_last| {
            learner_ready(PeerMatch {
                matched,
                leader_last,
            })
        };
        assert!(!at(0, 10));
        assert!(!at(89, 100));
        assert!(at(90, 100));
        assert!(at(100, 100));
        assert!(at(u64::MAX, u64::MAX));
        assert!(!at(u64::MAX / 2, u64::MAX));
    }

    #[test]
    fn announced_attributes_must_be_a_name_and_host_port() {
        assert!(check_attributes("node4", "127.0.0.1:2385").is_ok());
        assert!(check_attributes("", "127.0.0.1:2385").is_err());
        assert!(check_attributes("node4", "http://127.0.0.1:2385").is_err());
        assert!(check_attributes("node4", "127.0.0.1").is_err());
        assert!(check_attributes("node4", "127.0.0.1:0").is_err());
        let long = "x".repeat(MEMBER_FIELD_BYTES_MAX + 1);
        assert!(check_attributes(&long, "127.0.0.1:2385").is_err());
    }
}
