//! The metrics listener (`--listen-metrics`): a small HTTP/1.1 server for operators.
//!
//! | path | answer |
//! |---|---|
//! | `/metrics` | Prometheus metrics ([`crate::metrics::render`]) |
//! | `/health` | etcd's `{"health":"true"}`, or `"false"` with a reason and status 503 |
//! | `/readyz` | 200 `ok` when this member has a leader and has applied close to the leader's commit index; 503 with the reason otherwise |
//! | `/livez` | 200 `ok` while the process answers |
//! | `/ui` | the dashboard (one embedded page, no external assets) |
//! | `/ui/events` | the overview as server-sent events, one per change |
//! | `/api/v1/overview` | the overview as one JSON document (`conclave top --json`) |
//!
//! Only GET (and HEAD) are served; every request is read-only. Connections are capped by
//! [`HTTP_CONNECTIONS_MAX`]; a request's head by hyper's own buffer limit.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use conclave_proto::etcdserverpb::StatusRequest;
use conclave_proto::etcdserverpb::maintenance_client::MaintenanceClient;
use http::{Method, Request, Response, StatusCode, header};
use http_body::{Body, Frame};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tokio_stream::StreamExt;

use crate::api::Api;
use crate::metrics::{GrpcMethodLabels, NodeMetrics};
use crate::observe::{MEMBER_STATUS_TIMEOUT_MS, Overview};
use crate::transport::PeerListenerState;

/// Connections the metrics listener serves at once; more wait in the kernel's backlog.
pub const HTTP_CONNECTIONS_MAX: usize = 256;
/// `/readyz` says "catching up" while this member's applied index is further than this
/// behind the leader's commit index.
pub const READY_APPLY_LAG_MAX: u64 = 1_000;
/// The metrics listener's default port is the client port plus this (documented in
/// docs/operations.md): client 2379 gives metrics on 12379.
pub const METRICS_PORT_OFFSET: u16 = 10_000;

const DASHBOARD_HTML: &str = include_str!("../assets/dashboard.html");

type HttpBody = BoxBody<Bytes, Infallible>;

/// The metrics listener's default address for a client address `host:port`: the same host,
/// the port plus [`METRICS_PORT_OFFSET`]. `None` when the port has no room for it.
pub fn default_metrics_address(listen_client: &str) -> Option<String> {
    let (host, port) = listen_client.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    let port = port.checked_add(METRICS_PORT_OFFSET)?;
    Some(format!("{host}:{port}"))
}

/// What the listener serves from.
pub struct HttpState {
    pub api: Arc<Api>,
    pub peers: Arc<PeerListenerState>,
    pub overview: Arc<Overview>,
    pub overview_latest: watch::Receiver<Arc<String>>,
}

/// Serves the metrics listener until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    state: Arc<HttpState>,
    shutdown: impl Future<Output = ()>,
) {
    let slots = Arc::new(Semaphore::new(HTTP_CONNECTIONS_MAX));
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            _ = &mut shutdown => return,
            permit = slots.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => return,
            },
        };
        let accepted = tokio::select! {
            _ = &mut shutdown => return,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(error) => {
                tracing::warn!(%error, "metrics listener: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let state = state.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let service = service_fn(move |request| {
                let state = state.clone();
                async move { Ok::<_, Infallible>(route(&state, request).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn full(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<HttpBody> {
    let mut response = Response::new(Full::new(body.into()).boxed());
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    response.headers_mut().insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-store"),
    );
    response
}

async fn route(state: &HttpState, request: Request<Incoming>) -> Response<HttpBody> {
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return full(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain; charset=utf-8",
            "only GET and HEAD are served here\n",
        );
    }
    match request.uri().path() {
        "/metrics" => full(
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            crate::metrics::render(&state.api, &state.peers),
        ),
        "/health" => {
            let (healthy, reason) = health(&state.api);
            let body = serde_json::json!({
                "health": if healthy { "true" } else { "false" },
                "reason": reason,
            });
            let status = if healthy {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            full(status, "application/json", format!("{body}\n"))
        }
        "/readyz" => match readiness(state).await {
            Ok(()) => full(StatusCode::OK, "text/plain; charset=utf-8", "ok\n"),
            Err(reason) => full(
                StatusCode::SERVICE_UNAVAILABLE,
                "text/plain; charset=utf-8",
                format!("not ready: {reason}\n"),
            ),
        },
        "/livez" => full(StatusCode::OK, "text/plain; charset=utf-8", "ok\n"),
        "/" | "/ui" | "/ui/" => full(StatusCode::OK, "text/html; charset=utf-8", DASHBOARD_HTML),
        "/api/v1/overview" => {
            let document = state.overview.build().await;
            full(StatusCode::OK, "application/json", format!("{document}\n"))
        }
        "/ui/events" => events(state),
        _ => full(
            StatusCode::NOT_FOUND,
            "text/plain; charset=utf-8",
            "not found: try /metrics, /health, /readyz or /ui\n",
        ),
    }
}

/// etcd's `/health`: healthy while the member's driver runs and it knows a leader.
pub fn health(api: &Api) -> (bool, &'static str) {
    let status = api.node.status();
    if status.stopped.is_some() {
        (false, "RAFT STOPPED")
    } else if status.leader.is_none() {
        (false, "RAFT NO LEADER")
    } else {
        (true, "")
    }
}

/// Ready to serve: a leader is known and this member has applied to within
/// [`READY_APPLY_LAG_MAX`] entries of the leader's commit index (asked of the leader when it
/// is another member).
pub async fn readiness(state: &HttpState) -> Result<(), String> {
    let status = state.api.node.status();
    if let Some(reason) = &status.stopped {
        return Err(format!("the Raft driver stopped: {reason}"));
    }
    let Some(leader) = status.leader else {
        return Err("no leader".into());
    };
    let leader_commit = if leader == status.id {
        status.commit_index
    } else {
        let channel = state
            .overview
            .member_channel(leader)
            .ok_or_else(|| "the leader's client address is unknown".to_owned())?;
        let mut client = MaintenanceClient::new(channel);
        let ask = client.status(StatusRequest {});
        match tokio::time::timeout(Duration::from_millis(MEMBER_STATUS_TIMEOUT_MS), ask).await {
            Ok(Ok(answer)) => answer.into_inner().raft_index,
            Ok(Err(error)) => {
                return Err(format!("the leader did not answer: {}", error.message()));
            }
            Err(_) => return Err("the leader did not answer in time".into()),
        }
    };
    let behind = leader_commit.saturating_sub(status.applied_index);
    if behind > READY_APPLY_LAG_MAX {
        return Err(format!(
            "catching up: applied index {} is {behind} entries behind the leader's commit index {leader_commit}",
            status.applied_index
        ));
    }
    Ok(())
}

fn events(state: &HttpState) -> Response<HttpBody> {
    let updates = tokio_stream::wrappers::WatchStream::new(state.overview_latest.clone());
    let frames = updates.map(|document: Arc<String>| {
        Ok::<_, Infallible>(Frame::data(Bytes::from(format!("data: {document}\n\n"))))
    });
    let mut response = Response::new(BodyExt::boxed(StreamBody::new(frames)));
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-store"),
    );
    response
}

// ---- gRPC call metrics ---------------------------------------------------------------------

/// Counts every gRPC call on the client port into `grpc_server_handled_total` and
/// `grpc_server_handling_seconds` with etcd's (go-grpc-prometheus') labels.
#[derive(Clone)]
pub struct GrpcMetricsLayer {
    pub metrics: Arc<NodeMetrics>,
}

impl<S> tower_layer::Layer<S> for GrpcMetricsLayer {
    type Service = GrpcMetricsService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GrpcMetricsService {
            inner,
            metrics: self.metrics.clone(),
        }
    }
}

#[derive(Clone)]
pub struct GrpcMetricsService<S> {
    inner: S,
    metrics: Arc<NodeMetrics>,
}

/// The method's labels from its path `/package.Service/Method`. Streaming methods are named
/// here; everything else is unary.
fn method_labels(path: &str) -> GrpcMethodLabels {
    let mut parts = path.trim_start_matches('/').splitn(2, '/');
    let service = parts.next().unwrap_or_default();
    let method = parts.next().unwrap_or_default();
    let grpc_type = match method {
        "Watch" | "LeaseKeepAlive" => "bidi_stream",
        "Observe" | "Snapshot" | "Subscribe" | "Events" => "server_stream",
        _ => "unary",
    };
    // Unknown paths would let any client mint label values; they share one.
    let known = service.len() <= 64 && method.len() <= 64 && !method.is_empty();
    GrpcMethodLabels {
        grpc_type,
        grpc_service: if known { service } else { "unknown" }.to_owned(),
        grpc_method: if known { method } else { "unknown" }.to_owned(),
    }
}

fn code_name(code: &[u8]) -> &'static str {
    match code {
        b"0" => "OK",
        b"1" => "Canceled",
        b"2" => "Unknown",
        b"3" => "InvalidArgument",
        b"4" => "DeadlineExceeded",
        b"5" => "NotFound",
        b"6" => "AlreadyExists",
        b"7" => "PermissionDenied",
        b"8" => "ResourceExhausted",
        b"9" => "FailedPrecondition",
        b"10" => "Aborted",
        b"11" => "OutOfRange",
        b"12" => "Unimplemented",
        b"13" => "Internal",
        b"14" => "Unavailable",
        b"15" => "DataLoss",
        b"16" => "Unauthenticated",
        _ => "Unknown",
    }
}

impl<S, B, R> tower_service::Service<Request<B>> for GrpcMetricsService<S>
where
    S: tower_service::Service<Request<B>, Response = Response<R>>,
    S::Future: Send + 'static,
{
    type Response = Response<MeteredBody<R>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let labels = method_labels(request.uri().path());
        let metrics = self.metrics.clone();
        let started = Instant::now();
        let answer = self.inner.call(request);
        Box::pin(async move {
            let response = answer.await?;
            // A call that fails at once answers with the status in the headers alone.
            let code = response
                .headers()
                .get("grpc-status")
                .map(|value| code_name(value.as_bytes()));
            Ok(response.map(|body| MeteredBody {
                inner: Box::pin(body),
                call: Some(Call {
                    metrics,
                    labels,
                    started,
                    code,
                }),
            }))
        })
    }
}

struct Call {
    metrics: Arc<NodeMetrics>,
    labels: GrpcMethodLabels,
    started: Instant,
    code: Option<&'static str>,
}

impl Call {
    fn record(mut self, code: &'static str) {
        let took = self.started.elapsed();
        // Paths no service knows would let any client mint label values; they share one.
        if code == "Unimplemented" {
            self.labels.grpc_service = "unknown".to_owned();
            self.labels.grpc_method = "unknown".to_owned();
        }
        if self.labels.grpc_method == "Put" && self.labels.grpc_service == "etcdserverpb.KV" {
            self.metrics.kv_puts.inc();
            self.metrics.kv_put_micros.inc_by(took.as_micros() as u64);
        }
        self.metrics.grpc_call(self.labels, code, took);
    }
}

/// A response body that records its call once the trailers (with `grpc-status`) pass, the
/// body ends, or the client goes away.
pub struct MeteredBody<R> {
    inner: Pin<Box<R>>,
    call: Option<Call>,
}

impl<R> Drop for MeteredBody<R> {
    fn drop(&mut self) {
        if let Some(call) = self.call.take() {
            let code = call.code.unwrap_or("Canceled");
            call.record(code);
        }
    }
}

impl<R: Body> Body for MeteredBody<R> {
    type Data = R::Data;
    type Error = R::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = self.inner.as_mut().poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(trailers) = frame.trailers_ref()
                    && let Some(call) = self.call.take()
                {
                    let code = trailers
                        .get("grpc-status")
                        .map(|value| code_name(value.as_bytes()))
                        .or(call.code)
                        .unwrap_or("Unknown");
                    call.record(code);
                }
            }
            Poll::Ready(None) => {
                if let Some(call) = self.call.take() {
                    let code = call.code.unwrap_or("OK");
                    call.record(code);
                }
            }
            Poll::Ready(Some(Err(_))) => {
                if let Some(call) = self.call.take() {
                    call.record("Unknown");
                }
            }
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_metrics_address_adds_the_offset() {
        assert_eq!(
            default_metrics_address("127.0.0.1:2379").as_deref(),
            Some("127.0.0.1:12379")
        );
        assert_eq!(
            default_metrics_address("[::1]:2379").as_deref(),
            Some("[::1]:12379")
        );
        assert_eq!(default_metrics_address("0.0.0.0:60000"), None);
        assert_eq!(default_metrics_address("nonsense"), None);
    }

    #[test]
    fn method_labels_follow_grpc_paths_and_bound_unknown_ones() {
        let put = method_labels("/etcdserverpb.KV/Put");
        assert_eq!(
            (
                put.grpc_type,
                put.grpc_service.as_str(),
                put.grpc_method.as_str()
            ),
            ("unary", "etcdserverpb.KV", "Put")
        );
        assert_eq!(
            method_labels("/etcdserverpb.Watch/Watch").grpc_type,
            "bidi_stream"
        );
        let odd = method_labels(&format!("/{}/x", "s".repeat(100)));
        assert_eq!(odd.grpc_service, "unknown");
        assert_eq!(code_name(b"14"), "Unavailable");
        assert_eq!(code_name(b"99"), "Unknown");
    }
}
