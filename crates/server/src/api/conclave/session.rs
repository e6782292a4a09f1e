//! `conclave.v1.Session`: exactly-once client sessions.

use std::sync::Arc;

use conclave_proto::conclave::v1::session_client::SessionClient;
use conclave_proto::conclave::v1::session_server::{Session as SessionApi, SessionServer};
use conclave_proto::conclave::v1::{self as cv1};
use conclave_state::{Request, Response};
use tonic::{Status, async_trait};

use super::header;
use crate::api::route::leader_call;
use crate::api::{Api, CallContext, answer, unexpected};

// ---- Session ----------------------------------------------------------------------------

/// Exactly-once client sessions over the shared [`Api`]. The positions themselves travel as
/// metadata on each write (see [`crate::api::SESSION_CLIENT_HEADER`]); this service only opens and
/// closes sessions.
pub struct SessionService {
    pub api: Arc<Api>,
}

/// `conclave.v1.Session`, ready for the gRPC router.
pub fn session_server(api: &Arc<Api>) -> SessionServer<SessionService> {
    SessionServer::new(SessionService { api: api.clone() })
}

#[async_trait]
impl SessionApi for SessionService {
    async fn open_session(
        &self,
        request: tonic::Request<cv1::OpenSessionRequest>,
    ) -> Result<tonic::Response<cv1::OpenSessionResponse>, Status> {
        let mut ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        // Opening is not itself part of a session (a repeated open makes a second session,
        // which expires unused).
        ctx.session = None;
        let message = request.into_inner();
        let api = &self.api;
        let session_ttl_ms = api.node.read_state(|state| state.config().session_ttl_ms);
        // Chosen here and carried in the entry, so every replica stores the same secret.
        let secret = crate::api::new_session_secret()?;
        api.write(
            &ctx,
            Request::OpenSessionWithSecret { secret },
            &message,
            leader_call!(SessionClient::open_session),
            |applied| match answer(&applied)? {
                Response::SessionOpened { client_id } => Ok(cv1::OpenSessionResponse {
                    header: Some(header(api, applied.output.revision)),
                    client_id: *client_id,
                    session_ttl_ms,
                    session_secret: secret.to_be_bytes().to_vec().into(),
                }),
                other => Err(unexpected(other)),
            },
        )
        .await
    }

    async fn close_session(
        &self,
        request: tonic::Request<cv1::CloseSessionRequest>,
    ) -> Result<tonic::Response<cv1::CloseSessionResponse>, Status> {
        let mut ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        ctx.session = None;
        let message = request.into_inner();
        let api = &self.api;
        let secret = crate::api::session_secret_from_bytes(&message.session_secret)?;
        // Without a secret, only a session opened before secrets can match; the older
        // variant keeps such entries readable by members that predate secrets.
        let command = if secret == 0 {
            Request::CloseSession {
                client_id: message.client_id,
            }
        } else {
            Request::CloseSessionWithSecret {
                client_id: message.client_id,
                secret,
            }
        };
        api.write(
            &ctx,
            command,
            &message,
            leader_call!(SessionClient::close_session),
            |applied| match answer(&applied)? {
                Response::SessionClosed => Ok(cv1::CloseSessionResponse {
                    header: Some(header(api, applied.output.revision)),
                }),
                other => Err(unexpected(other)),
            },
        )
        .await
    }
}
