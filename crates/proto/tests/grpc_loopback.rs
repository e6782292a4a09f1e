//! The generated client and server stubs talk to each other over a real HTTP/2 connection,
//! so the paths the client calls are the paths the server routes.

use conclave_proto::etcdserverpb::kv_client::KvClient;
use conclave_proto::etcdserverpb::kv_server::{Kv, KvServer};
use conclave_proto::etcdserverpb::{
    CompactionRequest, CompactionResponse, DeleteRangeRequest, DeleteRangeResponse, PutRequest,
    PutResponse, RangeRequest, RangeResponse, ResponseHeader, TxnRequest, TxnResponse,
};
use conclave_proto::mvccpb::KeyValue;
use tonic::{Request, Response, Status};

/// Answers Range with one key echoing the request; everything else is unimplemented.
struct EchoKv;

#[tonic::async_trait]
impl Kv for EchoKv {
    async fn range(
        &self,
        request: Request<RangeRequest>,
    ) -> Result<Response<RangeResponse>, Status> {
        let request = request.into_inner();
        Ok(Response::new(RangeResponse {
            header: Some(ResponseHeader {
                cluster_id: 7,
                member_id: 1,
                revision: 42,
                raft_term: 3,
            }),
            kvs: vec![KeyValue {
                key: request.key,
                value: "v".into(),
                mod_revision: 42,
                ..Default::default()
            }],
            more: false,
            count: 1,
        }))
    }

    async fn put(&self, _: Request<PutRequest>) -> Result<Response<PutResponse>, Status> {
        Err(Status::unimplemented("not in this test"))
    }

    async fn delete_range(
        &self,
        _: Request<DeleteRangeRequest>,
    ) -> Result<Response<DeleteRangeResponse>, Status> {
        Err(Status::unimplemented("not in this test"))
    }

    async fn txn(&self, _: Request<TxnRequest>) -> Result<Response<TxnResponse>, Status> {
        Err(Status::unimplemented("not in this test"))
    }

    async fn compact(
        &self,
        _: Request<CompactionRequest>,
    ) -> Result<Response<CompactionResponse>, Status> {
        Err(Status::unimplemented("not in this test"))
    }
}

#[tokio::test]
async fn kv_range_round_trips_through_grpc() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("loopback binds");
    let address = listener.local_addr().expect("bound");
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(KvServer::new(EchoKv))
            .serve_with_incoming(incoming),
    );

    let mut client = KvClient::connect(format!("http://{address}"))
        .await
        .expect("connects");
    let answer = client
        .range(RangeRequest {
            key: "foo".into(),
            ..Default::default()
        })
        .await
        .expect("range answers")
        .into_inner();
    assert_eq!(answer.kvs.len(), 1);
    assert_eq!(&answer.kvs[0].key[..], b"foo");
    assert_eq!(answer.header.map(|header| header.revision), Some(42));

    let status = client
        .put(PutRequest::default())
        .await
        .expect_err("put is not implemented here");
    assert_eq!(status.code(), tonic::Code::Unimplemented);
    server.abort();
}
