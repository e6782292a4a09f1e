//! etcd's Cluster service. MemberList reports the founding members still in the Raft
//! configuration; membership changes are not served yet.

use std::sync::Arc;

use conclave_proto::etcdserverpb::{self as pb, cluster_server::Cluster};
use tonic::{Status, async_trait};

use super::Api;

pub struct ClusterService {
    pub api: Arc<Api>,
}

const MEMBERSHIP_UNSUPPORTED: &str = "conclave: membership changes are not supported yet";

impl ClusterService {
    fn members(&self) -> Vec<pb::Member> {
        let conf = self.api.node.status().conf_state;
        self.api
            .config
            .members
            .iter()
            .filter(|m| conf.contains(m.id) || conf.members().is_empty())
            .map(|m| pb::Member {
                id: m.id,
                name: m.name.clone(),
                peer_ur_ls: vec![format!("http://{}", m.peer_addr)],
                client_ur_ls: vec![format!("http://{}", m.client_addr)],
                is_learner: conf.learners.contains(&m.id),
            })
            .collect()
    }
}

#[async_trait]
impl Cluster for ClusterService {
    async fn member_add(
        &self,
        _request: tonic::Request<pb::MemberAddRequest>,
    ) -> Result<tonic::Response<pb::MemberAddResponse>, Status> {
        Err(Status::unimplemented(MEMBERSHIP_UNSUPPORTED))
    }

    async fn member_remove(
        &self,
        _request: tonic::Request<pb::MemberRemoveRequest>,
    ) -> Result<tonic::Response<pb::MemberRemoveResponse>, Status> {
        Err(Status::unimplemented(MEMBERSHIP_UNSUPPORTED))
    }

    async fn member_list(
        &self,
        _request: tonic::Request<pb::MemberListRequest>,
    ) -> Result<tonic::Response<pb::MemberListResponse>, Status> {
        Ok(tonic::Response::new(pb::MemberListResponse {
            header: Some(self.api.read_header()),
            members: self.members(),
        }))
    }

    async fn member_promote(
        &self,
        _request: tonic::Request<pb::MemberPromoteRequest>,
    ) -> Result<tonic::Response<pb::MemberPromoteResponse>, Status> {
        Err(Status::unimplemented(MEMBERSHIP_UNSUPPORTED))
    }
}
