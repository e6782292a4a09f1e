//! `conclave.v1.Status`: the status of every member, gathered concurrently.

use std::sync::Arc;
use std::time::Duration;

use conclave_proto::conclave::v1::status_server::{Status as StatusApi, StatusServer};
use conclave_proto::conclave::v1::{self as cv1};
use conclave_proto::etcdserverpb::{StatusRequest, maintenance_client::MaintenanceClient};
use tonic::{Status, async_trait};

use super::header;
use crate::api::Api;
use crate::api::maintenance::ETCD_VERSION;

/// How long ClusterStatus waits for one member's status.
pub const STATUS_PROBE_TIMEOUT_MS: u64 = 1_000;

/// `conclave.v1.Status`, ready for the gRPC router.
pub fn status_server(api: &Arc<Api>) -> StatusServer<StatusService> {
    StatusServer::new(StatusService { api: api.clone() })
}

// ---- Status -----------------------------------------------------------------------------

/// Cluster status over the shared [`Api`].
pub struct StatusService {
    pub api: Arc<Api>,
}

/// Asks one member's Maintenance.Status.
async fn probe(
    config: &crate::ServerConfig,
    client_addr: String,
) -> Result<conclave_proto::etcdserverpb::StatusResponse, String> {
    let timeout = Duration::from_millis(STATUS_PROBE_TIMEOUT_MS);
    let endpoint = crate::tls::member_endpoint(config, &client_addr)?
        .connect_timeout(timeout)
        .timeout(timeout);
    let call = async move {
        let channel = endpoint.connect().await.map_err(|e| e.to_string())?;
        MaintenanceClient::new(channel)
            .status(StatusRequest {})
            .await
            .map(tonic::Response::into_inner)
            .map_err(|status| status.message().to_string())
    };
    match tokio::time::timeout(timeout, call).await {
        Ok(result) => result,
        Err(_) => Err(format!("no answer within {STATUS_PROBE_TIMEOUT_MS} ms")),
    }
}

#[async_trait]
impl StatusApi for StatusService {
    async fn cluster_status(
        &self,
        _request: tonic::Request<cv1::ClusterStatusRequest>,
    ) -> Result<tonic::Response<cv1::ClusterStatusResponse>, Status> {
        let api = &self.api;
        let status = api.node.status();
        // Every member of the current configuration, members added at run time included.
        let (current, conf) = crate::api::cluster::current_members(api);
        let probes = current.iter().map(|member| {
            let address = member.client_addr.clone();
            let config = api.config.clone();
            async move {
                if address.is_empty() {
                    return Err("its client address is not known yet".to_string());
                }
                probe(&config, address).await
            }
        });
        let answers = futures_join_all(probes.collect()).await;
        let members = current
            .iter()
            .zip(answers)
            .map(|(member, answer)| {
                let mut out = cv1::MemberStatus {
                    id: member.id,
                    name: member.name.clone(),
                    peer_urls: vec![format!("http://{}", member.peer_addr)],
                    client_urls: vec![format!("http://{}", member.client_addr)],
                    learner: conf.learners.contains(&member.id),
                    version: ETCD_VERSION.to_string(),
                    ..Default::default()
                };
                match answer {
                    Ok(remote) => {
                        out.healthy = remote.errors.is_empty();
                        out.raft_term = remote.raft_term;
                        out.raft_index = remote.raft_index;
                        out.commit_index = remote.raft_index;
                        out.applied_index = remote.raft_applied_index;
                        out.db_size_bytes = remote.db_size;
                        out.version = remote.version;
                        out.error = remote.errors.join("; ");
                    }
                    Err(error) => out.error = error,
                }
                out
            })
            .collect();
        let revision = api.node.read_state(|state| state.revision());
        Ok(tonic::Response::new(cv1::ClusterStatusResponse {
            header: Some(header(api, revision)),
            cluster_id: api.cluster_id,
            leader_id: status.leader.unwrap_or(0),
            raft_term: status.term,
            members,
        }))
    }
}

/// Runs the probes concurrently (one task each) and answers in order.
async fn futures_join_all<F>(probes: Vec<F>) -> Vec<F::Output>
where
    F: std::future::Future<Output = Result<conclave_proto::etcdserverpb::StatusResponse, String>>
        + Send
        + 'static,
{
    let tasks: Vec<_> = probes.into_iter().map(tokio::spawn).collect();
    let mut answers = Vec::with_capacity(tasks.len());
    for task in tasks {
        answers.push(match task.await {
            Ok(answer) => answer,
            Err(error) => Err(format!("status probe failed: {error}")),
        });
    }
    answers
}
