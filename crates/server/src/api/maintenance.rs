//! etcd's Maintenance service: Status (what `etcdctl endpoint status` shows), Alarm (always
//! an empty list: Conclave raises no space or corruption alarms), Snapshot, MoveLeader.

use std::sync::Arc;

use conclave_proto::etcdserverpb::{self as pb, maintenance_server::Maintenance};
use conclave_raft::Role;
use tonic::{Status, async_trait};

use super::{Api, CallContext, to_status};
use crate::error::Error;
use crate::node::dir_size_bytes;

/// The etcd version Conclave reports: clients (etcdctl 3.4) gate features on it.
pub const ETCD_VERSION: &str = "3.4.0";
/// Snapshot stream blobs are at most this big (etcd sends 32 KiB pieces).
const SNAPSHOT_BLOB_BYTES_MAX: usize = 32 * 1024;

pub struct MaintenanceService {
    pub api: Arc<Api>,
}

#[async_trait]
impl Maintenance for MaintenanceService {
    async fn alarm(
        &self,
        _request: tonic::Request<pb::AlarmRequest>,
    ) -> Result<tonic::Response<pb::AlarmResponse>, Status> {
        Ok(tonic::Response::new(pb::AlarmResponse {
            header: Some(self.api.read_header()),
            alarms: Vec::new(),
        }))
    }

    async fn status(
        &self,
        _request: tonic::Request<pb::StatusRequest>,
    ) -> Result<tonic::Response<pb::StatusResponse>, Status> {
        let status = self.api.node.status();
        let db_size = dir_size_bytes(&self.api.config.data_dir) as i64;
        let mut errors = Vec::new();
        if status.leader.is_none() {
            errors.push(Error::NoLeader.to_string());
        }
        Ok(tonic::Response::new(pb::StatusResponse {
            header: Some(self.api.read_header()),
            version: ETCD_VERSION.to_string(),
            db_size,
            leader: status.leader.unwrap_or(0),
            raft_index: status.commit_index,
            raft_term: status.term,
            raft_applied_index: status.applied_index,
            errors,
            db_size_in_use: db_size,
            is_learner: status.conf_state.learners.contains(&self.api.config.id),
            storage_version: String::new(),
            db_size_quota: 0,
            downgrade_info: None,
        }))
    }

    type SnapshotStream =
        tokio_stream::Iter<std::vec::IntoIter<Result<pb::SnapshotResponse, Status>>>;

    async fn snapshot(
        &self,
        request: tonic::Request<pb::SnapshotRequest>,
    ) -> Result<tonic::Response<Self::SnapshotStream>, Status> {
        // The image holds password hashes and the token key: root only once auth is on.
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        self.api.check_admin(&ctx)?;
        // Only a clone is taken under the state lock (O(1) for the key-value store, a
        // persistent map), so the driver is not held up while the image is encoded.
        let frozen = self.api.node.read_state(|state| state.clone());
        let image = tokio::task::spawn_blocking(move || frozen.snapshot_to_vec())
            .await
            .map_err(|e| Status::internal(format!("snapshot encoding stopped: {e}")))?;
        let header = self.api.read_header();
        let total = image.len();
        let blobs: Vec<_> = image
            .chunks(SNAPSHOT_BLOB_BYTES_MAX)
            .scan(total, |remaining, chunk| {
                *remaining -= chunk.len();
                Some(Ok(pb::SnapshotResponse {
                    header: Some(header),
                    remaining_bytes: *remaining as u64,
                    blob: bytes::Bytes::copy_from_slice(chunk),
                    version: ETCD_VERSION.to_string(),
                }))
            })
            .collect();
        Ok(tonic::Response::new(tokio_stream::iter(blobs)))
    }

    async fn move_leader(
        &self,
        request: tonic::Request<pb::MoveLeaderRequest>,
    ) -> Result<tonic::Response<pb::MoveLeaderResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        self.api.check_admin(&ctx)?;
        let target = request.into_inner().target_id;
        let status = self.api.node.status();
        if status.role != Some(Role::Leader) {
            return Err(Status::failed_precondition("etcdserver: not leader"));
        }
        self.api
            .node
            .transfer_leader(target)
            .await
            .map_err(|e| match e {
                Error::Raft(conclave_raft::Error::InvalidTransferTarget(_)) => {
                    Status::failed_precondition("etcdserver: bad leader transferee")
                }
                other => to_status(other),
            })?;
        // etcd answers once the target leads.
        let mut watch = self.api.node.status.clone();
        loop {
            if watch.borrow_and_update().leader == Some(target) {
                break;
            }
            if ctx.remaining().is_zero()
                || tokio::time::timeout(ctx.remaining(), watch.changed())
                    .await
                    .is_err()
            {
                return Err(Status::unavailable(
                    "etcdserver: leadership transfer timed out",
                ));
            }
        }
        Ok(tonic::Response::new(pb::MoveLeaderResponse {
            header: Some(self.api.read_header()),
        }))
    }
}
