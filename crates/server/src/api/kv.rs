//! etcd's KV service: Range, Put, DeleteRange, Txn, Compact.

use std::sync::Arc;

use conclave_proto::etcdserverpb::{self as pb, kv_client::KvClient, kv_server::Kv};
use conclave_state::{Access, Request, Response};
use prost::Message;
use tonic::{Status, async_trait};

use super::route::leader_call;
use super::{Api, CallContext, answer, convert, state_status, unexpected};

/// The KV service over the shared [`Api`].
pub struct KvService {
    pub api: Arc<Api>,
}

impl KvService {
    fn context<T>(&self, request: &tonic::Request<T>) -> CallContext {
        CallContext::new(request, self.api.config.request_timeout_ms)
    }

    /// etcd refuses requests above `--max-request-bytes` before doing anything with them.
    fn check_size(&self, message: &impl Message) -> Result<(), Status> {
        if message.encoded_len() > self.api.config.request_bytes_max {
            return Err(state_status(&conclave_state::Error::RequestTooLarge));
        }
        Ok(())
    }
}

#[async_trait]
impl Kv for KvService {
    async fn range(
        &self,
        request: tonic::Request<pb::RangeRequest>,
    ) -> Result<tonic::Response<pb::RangeResponse>, Status> {
        let ctx = self.context(&request);
        let client = request.remote_addr();
        let message = request.into_inner();
        self.check_size(&message)?;
        if !message.serializable {
            self.api.linearizable_barrier(&ctx).await?;
        }
        let range = convert::range_from_pb(message)?;
        // Checked while the answer is built under the state lock, not after.
        let bytes_max = self.api.config.client_limits.range_response_bytes_max;
        let user = self.api.caller(&ctx)?;
        let access = [Access::read(range.key.clone(), range.range_end.clone())];
        let (result, revision) = self.api.node.read_state(|state| {
            let answer = state
                .auth()
                .check_access(&user, &access)
                .and_then(|()| state.range_within(&range, bytes_max));
            (answer, state.revision())
        });
        let response = result.map_err(|e| match e {
            conclave_state::Error::RangeTooLarge { .. } => self.api.limits.range_refused(client),
            other => state_status(&other),
        })?;
        Ok(tonic::Response::new(convert::range_to_pb(
            response,
            self.api.header(revision),
        )))
    }

    async fn put(
        &self,
        request: tonic::Request<pb::PutRequest>,
    ) -> Result<tonic::Response<pb::PutResponse>, Status> {
        let ctx = self.context(&request);
        let message = request.into_inner();
        self.check_size(&message)?;
        let api = &self.api;
        let command = Request::Put(convert::put_from_pb(message.clone()));
        api.write_self_contained(
            &ctx,
            command,
            &message,
            leader_call!(KvClient::put),
            |applied| match answer(&applied)? {
                Response::Put(put) => Ok(convert::put_to_pb(
                    put.clone(),
                    api.header(applied.output.revision),
                )),
                other => Err(unexpected(other)),
            },
        )
        .await
    }

    async fn delete_range(
        &self,
        request: tonic::Request<pb::DeleteRangeRequest>,
    ) -> Result<tonic::Response<pb::DeleteRangeResponse>, Status> {
        let ctx = self.context(&request);
        let message = request.into_inner();
        self.check_size(&message)?;
        let api = &self.api;
        let command = Request::DeleteRange(convert::delete_from_pb(message.clone()));
        api.write_self_contained(
            &ctx,
            command,
            &message,
            leader_call!(KvClient::delete_range),
            |applied| match answer(&applied)? {
                Response::DeleteRange(deleted) => Ok(convert::delete_to_pb(
                    deleted.clone(),
                    api.header(applied.output.revision),
                )),
                other => Err(unexpected(other)),
            },
        )
        .await
    }

    async fn txn(
        &self,
        request: tonic::Request<pb::TxnRequest>,
    ) -> Result<tonic::Response<pb::TxnResponse>, Status> {
        let ctx = self.context(&request);
        let message = request.into_inner();
        self.check_size(&message)?;
        let api = &self.api;
        let command = Request::Txn(convert::txn_from_pb(message.clone())?);
        api.write_self_contained(
            &ctx,
            command,
            &message,
            leader_call!(KvClient::txn),
            |applied| match answer(&applied)? {
                Response::Txn(txn) => Ok(convert::txn_to_pb(
                    txn.clone(),
                    api.header(applied.output.revision),
                )),
                other => Err(unexpected(other)),
            },
        )
        .await
    }

    async fn compact(
        &self,
        request: tonic::Request<pb::CompactionRequest>,
    ) -> Result<tonic::Response<pb::CompactionResponse>, Status> {
        let ctx = self.context(&request);
        let message = request.into_inner();
        let api = &self.api;
        let command = Request::Compact {
            revision: message.revision,
        };
        api.write_self_contained(
            &ctx,
            command,
            &message,
            leader_call!(KvClient::compact),
            |applied| match answer(&applied)? {
                Response::Compacted => Ok(pb::CompactionResponse {
                    header: Some(api.header(applied.output.revision)),
                }),
                other => Err(unexpected(other)),
            },
        )
        .await
    }
}
