//! One HTTP/2 connection the generated gRPC stubs call through directly.
//!
//! tonic's `Channel` puts a queue and a task of its own in front of every connection (so it
//! can balance and reconnect); each request is handed to that task, which hands it to the
//! connection's task. A load generator needs neither balancing nor reconnection, and on a
//! machine it shares with the members it measures, every hand-off it saves is CPU the members
//! get. [`Conn`] sends each request straight to hyper's HTTP/2 connection.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Uri;
use http::uri::{Authority, Scheme};
use hyper::body::Incoming;
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpStream;
use tonic::body::Body;

/// A gRPC connection to one endpoint; clones share the connection.
#[derive(Clone)]
pub struct Conn {
    send: SendRequest<Body>,
    authority: Authority,
}

impl Conn {
    /// Connects to `endpoint` (`host:port`, plaintext) and starts the connection's task.
    pub async fn connect(endpoint: &str) -> Result<Conn, String> {
        let authority: Authority = endpoint
            .parse()
            .map_err(|e| format!("not a host:port: {e}"))?;
        let stream = TcpStream::connect(endpoint)
            .await
            .map_err(|e| e.to_string())?;
        stream.set_nodelay(true).map_err(|e| e.to_string())?;
        let (send, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
        // The connection ends when every clone of `send` is dropped or the peer closes it;
        // requests on a closed connection fail and are counted as errors.
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(Conn { send, authority })
    }
}

impl tower_service::Service<http::Request<Body>> for Conn {
    type Response = http::Response<Incoming>;
    type Error = hyper::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.send.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<Body>) -> Self::Future {
        // The stubs send only a path; HTTP/2 needs the scheme and authority as well.
        let mut parts = request.uri().clone().into_parts();
        parts.scheme = Some(Scheme::HTTP);
        parts.authority = Some(self.authority.clone());
        if let Ok(uri) = Uri::from_parts(parts) {
            *request.uri_mut() = uri;
        }
        Box::pin(self.send.send_request(request))
    }
}
