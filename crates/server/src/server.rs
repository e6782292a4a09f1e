//! Wires a node together: listeners, peer transport, the Raft driver and the gRPC services,
//! and takes it apart again on shutdown.
//!
//! ```text
//!  run(config, shutdown)
//!    bind client + peer listeners (fail fast, one sentence)
//!    PeerTransport (dial peers) + serve_peers (accept) ──► driver thread (node::spawn)
//!    tonic: KV, Watch, Maintenance, Cluster ──► Api ──► NodeHandle
//!  shutdown: leader hands over (still serving) ─► gRPC drains (accepted requests finish,
//!            streams end) ─► driver stops ─► peer listener stops
//! ```

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use conclave_proto::etcdserverpb::cluster_server::ClusterServer;
use conclave_proto::etcdserverpb::kv_server::KvServer;
use conclave_proto::etcdserverpb::maintenance_server::MaintenanceServer;
use conclave_proto::etcdserverpb::watch_server::WatchServer;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};

use crate::api::Api;
use crate::api::cluster::ClusterService;
use crate::api::coalesce::CoalescingWriter;
use crate::api::kv::KvService;
use crate::api::limits::{IdleClosing, Limits};
use crate::api::maintenance::MaintenanceService;
use crate::api::watch::WatchService;
use crate::authority::ClientStream;
use crate::config::{GRPC_DECODE_SLACK_BYTES, GRPC_RESPONSE_BYTES_MAX, ServerConfig};
use crate::error::Error;
use crate::node;
use crate::tls::{CLIENT_TLS_HANDSHAKE_TIMEOUT_MS, CLIENT_TLS_HANDSHAKES_MAX, ClientPortTls};
use crate::transport::{
    PeerKey, PeerListenerState, PeerTls, PeerTransport, TransportConfig, bind_peer_listener,
    serve_peers_with,
};

/// A client connection that sends nothing for this long gets an HTTP/2 ping (or after a third
/// of `client_idle_timeout_ms`, if sooner, so that a live client answers before it is idle).
const CLIENT_KEEPALIVE_INTERVAL_MS: u64 = 30_000;
/// A graceful shutdown waits for accepted client requests at most their longest deadline
/// (`request_timeout_ms`) plus this, then stops the driver, which ends whatever is left.
const DRAIN_MARGIN_MS: u64 = 500;

/// Runs one node until `shutdown` resolves (then shuts down gracefully) or a fatal error
/// stops it. Returns that error, if any.
pub async fn run(config: ServerConfig, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
    config.validate()?;
    let client_listener = TcpListener::bind(&config.listen_client)
        .await
        .map_err(|source| Error::ClientListen {
            address: config.listen_client.clone(),
            source,
        })?;
    let peer_listener = bind_peer_listener(&config.listen_peer).await?;
    let metrics_listener = match &config.listen_metrics {
        Some(address) => match TcpListener::bind(address).await {
            Ok(listener) => Some(listener),
            Err(error) if config.listen_metrics_optional => {
                tracing::warn!(
                    address = %address,
                    %error,
                    "metrics listener not started: its default address is taken; give \
                     --listen-metrics ADDR (or none)"
                );
                None
            }
            Err(source) => {
                return Err(Error::MetricsListen {
                    address: address.clone(),
                    source,
                });
            }
        },
        None => None,
    };
    let client_tls = match &config.client_tls {
        Some(files) => Some(crate::tls::load_client_port_tls(files.clone())?),
        None => None,
    };
    // Members forward to the leader's client port: check now that they can.
    crate::tls::member_client_tls(&config)?;

    let transport_config = transport_config(&config)?;
    if let Some(tls) = &transport_config.tls {
        for member in &config.members {
            tls.note_member_name(member.id, &member.name);
        }
    }
    let reload = reload_on_hangup(client_tls.clone(), transport_config.tls.clone());
    let listener_state = PeerListenerState::new();
    let announced = listener_state.announced();
    let mut transport = PeerTransport::new(transport_config.clone())?;
    for member in config.members.iter().filter(|m| m.id != config.id) {
        transport.add_peer(member.id, member.peer_addr.clone())?;
    }
    transport.route_unrecorded_by(listener_state.announced());
    let (inbound_sender, inbound) = mpsc::channel(config.driver_queue_messages_max);
    let (stop_peers, peers_stopped) = oneshot::channel::<()>();

    let (calls_sender, calls_inbound) =
        mpsc::channel(crate::api::peer_calls::PEER_CALLS_QUEUED_MAX);
    listener_state.take_calls_into(calls_sender);
    let peer_calls = transport.calls();

    let (stop_driver, driver_stopped) = oneshot::channel();
    let (handle, driver) = node::spawn(config.clone(), transport, inbound, driver_stopped)?;
    // Before the listener accepts anything, so every plain-TCP peer connection is read on
    // the driver's thread.
    listener_state.receive_on(handle.driver_runtime());
    let peers = tokio::spawn(serve_peers_with(
        peer_listener,
        transport_config,
        inbound_sender,
        listener_state.clone(),
        async move {
            let _ = peers_stopped.await;
        },
    ));
    let mut driver = tokio::task::spawn_blocking(move || {
        driver
            .join()
            .unwrap_or_else(|_| Err(Error::RaftStart("the Raft driver panicked".into())))
    });

    let api = Api::new(handle, config.clone());
    api.use_peer_calls(peer_calls.clone());
    tokio::spawn(crate::api::peer_calls::serve(
        api.clone(),
        peer_calls,
        calls_inbound,
    ));
    let decode_max = config.request_bytes_max + GRPC_DECODE_SLACK_BYTES;
    let kv = KvServer::new(KvService { api: api.clone() })
        .max_decoding_message_size(decode_max)
        .max_encoding_message_size(GRPC_RESPONSE_BYTES_MAX);
    let maintenance = MaintenanceServer::new(MaintenanceService::new(api.clone()))
        .max_decoding_message_size(decode_max)
        .max_encoding_message_size(GRPC_RESPONSE_BYTES_MAX);
    let cluster = ClusterServer::new(ClusterService::new(api.clone()));
    let watch = WatchServer::new(WatchService { api: api.clone() })
        .max_decoding_message_size(decode_max)
        .max_encoding_message_size(GRPC_RESPONSE_BYTES_MAX);
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    tokio::spawn(report_health(api.clone(), health_reporter));
    let (stop_metrics, metrics_stopped) = oneshot::channel::<()>();
    if let Some(listener) = metrics_listener {
        let overview = crate::observe::Overview::new(api.clone());
        let (latest_sender, overview_latest) = tokio::sync::watch::channel(Arc::new(String::new()));
        tokio::spawn(overview.clone().publish(latest_sender));
        let state = Arc::new(crate::http::HttpState {
            api: api.clone(),
            peers: listener_state.clone(),
            overview,
            overview_latest,
        });
        tracing::info!(metrics = %config.listen_metrics.as_deref().unwrap_or_default(), "metrics listener: /metrics /health /readyz /ui");
        tokio::spawn(crate::http::serve(listener, state, async move {
            let _ = metrics_stopped.await;
        }));
    }
    let (stop_grpc, grpc_stopped) = oneshot::channel::<()>();
    let caps = &config.client_limits;
    let keepalive_ms = CLIENT_KEEPALIVE_INTERVAL_MS.min((caps.client_idle_timeout_ms / 3).max(1));
    let router = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_millis(keepalive_ms)))
        .max_concurrent_streams(Some(caps.grpc_streams_per_connection_max))
        .layer(crate::http::GrpcMetricsLayer {
            metrics: api.node.metrics_arc(),
        })
        .add_service(health_service)
        .add_service(kv)
        .add_service(
            crate::api::auth::AuthService::server(api.clone())
                .max_decoding_message_size(decode_max),
        )
        .add_service(maintenance)
        .add_service(cluster)
        .add_service(watch)
        .add_service(crate::api::lease::server(&api, decode_max))
        .add_service(crate::api::lock::server(&api, decode_max))
        .add_service(crate::api::election::server(&api, decode_max))
        .add_service(crate::api::conclave::election_server(&api, decode_max))
        .add_service(crate::api::conclave::topic_server(&api, decode_max))
        .add_service(crate::api::conclave::queue_server(&api, decode_max))
        .add_service(crate::api::conclave::session_server(&api))
        .add_service(crate::api::conclave::status_server(&api))
        .add_service(crate::api::cluster::membership_server(&api));
    let grpc_shutdown = async move {
        let _ = grpc_stopped.await;
    };
    let mut grpc = match client_tls {
        None => tokio::spawn(router.serve_with_incoming_shutdown(
            client_connections(client_listener, api.limits.clone()),
            grpc_shutdown,
        )),
        Some(tls) => tokio::spawn(router.serve_with_incoming_shutdown(
            tls_client_connections(client_listener, api.limits.clone(), tls),
            grpc_shutdown,
        )),
    };
    tokio::spawn(crate::compactor::run(api.clone()));
    tokio::spawn(crate::api::cluster::record_member_attributes(
        api.clone(),
        announced,
    ));
    tracing::info!(
        id = config.id,
        client = %config.listen_client,
        peer = %config.listen_peer,
        lease_read_ms = config.lease_read_ms(),
        "conclave node started"
    );

    tokio::pin!(shutdown);
    let driver_result = tokio::select! {
        _ = &mut shutdown => {
            hand_off(&api, config.shutdown_transfer_timeout_ms).await;
            // Drain: no new connections, a GOAWAY on open ones (clients send new requests
            // elsewhere), and every request already accepted finishes, through the successor
            // if it is a write. The driver runs on as a follower meanwhile. Streams end now.
            api.begin_drain();
            let _ = stop_grpc.send(());
            let drain_ms = config.request_timeout_ms + DRAIN_MARGIN_MS;
            let drained = tokio::time::timeout(Duration::from_millis(drain_ms), &mut grpc).await;
            let _ = stop_driver.send(());
            let result = (&mut driver).await;
            match drained {
                Ok(served) => log_grpc_end(served),
                Err(_) => {
                    tracing::warn!(drain_ms, "client requests outlived the drain; stopped anyway");
                    log_grpc_end((&mut grpc).await);
                }
            }
            result
        }
        result = &mut driver => {
            let _ = stop_grpc.send(());
            log_grpc_end((&mut grpc).await);
            result
        }
    };
    let _ = stop_metrics.send(());
    reload.abort();
    let _ = stop_peers.send(());
    let _ = peers.await;
    match driver_result {
        Ok(result) => result,
        Err(join_error) => Err(Error::RaftStart(format!("driver task: {join_error}"))),
    }
}

/// Keeps `grpc.health.v1.Health` on the client port in step with the node: SERVING (for
/// the whole server, service "") while it knows a leader and its driver runs, NOT_SERVING
/// otherwise.
async fn report_health(api: Arc<Api>, reporter: tonic_health::server::HealthReporter) {
    let mut status = api.node.status.clone();
    let mut serving = None;
    loop {
        let now = {
            let current = status.borrow_and_update();
            current.leader.is_some() && current.stopped.is_none()
        };
        if serving != Some(now) {
            serving = Some(now);
            let state = if now {
                tonic_health::ServingStatus::Serving
            } else {
                tonic_health::ServingStatus::NotServing
            };
            reporter.set_service_status("", state).await;
        }
        if status.changed().await.is_err() {
            reporter
                .set_service_status("", tonic_health::ServingStatus::NotServing)
                .await;
            return;
        }
    }
}

/// The peer transport's settings: the peer key from `--peer-secret-file` (or the weak key,
/// with a warning) and the attributes this node announces in its handshakes.
pub fn transport_config(config: &ServerConfig) -> Result<TransportConfig, Error> {
    let mut transport = TransportConfig::new(config.cluster_id(), config.id);
    match &config.peer_secret_file {
        Some(path) => transport.peer_key = PeerKey::read_secret_file(path)?,
        None => tracing::warn!(
            "no --peer-secret-file: peers authenticate with a key derived from the cluster id, \
             which anyone who can reach a client port can learn; give every member the same \
             secret file (see docs/security.md)"
        ),
    }
    if let Some(files) = &config.peer_tls {
        transport.tls = Some(PeerTls::load(files.clone())?);
    }
    if let Some(me) = config.this_member() {
        transport.own_name = me.name.clone();
        transport.own_client_address = me.client_addr.clone();
        transport.own_peer_address = me.peer_addr.clone();
    }
    transport.vote_withheld_ms = config.vote_withheld_ms();
    transport.lease_read_ms = config.lease_read_ms();
    Ok(transport)
}

fn log_grpc_end(served: Result<Result<(), tonic::transport::Error>, tokio::task::JoinError>) {
    match served {
        Ok(Ok(())) => {}
        Ok(Err(error)) => tracing::warn!(%error, "gRPC server ended with an error"),
        Err(error) => tracing::warn!(%error, "gRPC server task failed"),
    }
}

/// On shutdown a leader hands over to its most up-to-date follower and waits (up to
/// `timeout_ms`) until it no longer leads, still serving: requests that reach it meanwhile are
/// forwarded to the successor or retried there, not refused.
async fn hand_off(api: &Api, timeout_ms: u64) {
    match api.node.hand_off().await {
        Ok(true) => {}
        // Not a leader, nobody to hand over to, or the driver is gone: nothing to wait for.
        Ok(false) | Err(_) => return,
    }
    let mut status = api.node.status.clone();
    let handed_over =
        status.wait_for(|s| s.stopped.is_some() || s.role != Some(conclave_raft::Role::Leader));
    if tokio::time::timeout(Duration::from_millis(timeout_ms), handed_over)
        .await
        .is_err()
    {
        tracing::warn!(
            timeout_ms,
            "leadership not handed over in time; stopping as leader"
        );
    }
}

/// Accepted client connections with `TCP_NODELAY` set: tonic applies its own nodelay default
/// only to listeners it binds itself, and without it a response written in two parts waits
/// for the client's delayed ACK (about 40 ms per small read on Linux).
///
/// Each is wrapped in a [`ClientStream`], which repairs the URL-valued `:authority` etcdctl
/// sends when it dials a member's advertised client URL, in a [`CoalescingWriter`], which
/// writes the frames of many streams in one system call, and in an [`IdleClosing`], which
/// holds one of `client_connections_max` slots and closes a silent connection. A connection
/// beyond the cap is closed as soon as it is accepted.
fn client_connections(
    listener: tokio::net::TcpListener,
    limits: Arc<Limits>,
) -> impl tokio_stream::Stream<Item = std::io::Result<IdleClosing<CoalescingWriter<ClientStream>>>>
{
    use tokio_stream::StreamExt;
    tokio_stream::wrappers::TcpListenerStream::new(listener).filter_map(move |accepted| {
        let stream = match accepted {
            Ok(stream) => stream,
            Err(error) => return Some(Err(error)),
        };
        let peer = stream.peer_addr().ok();
        // Dropping the stream closes it: the client sees its connection end.
        let slot = limits.connection(peer)?;
        if let Err(error) = stream.set_nodelay(true) {
            return Some(Err(error));
        }
        let stream = CoalescingWriter::new(ClientStream::new(stream));
        Some(Ok(IdleClosing::new(stream, limits.clone(), peer, slot)))
    })
}

/// Client connections over TLS: each accepted socket takes its connection slot, then completes
/// its TLS handshake (at most [`CLIENT_TLS_HANDSHAKES_MAX`] at once, each within
/// [`CLIENT_TLS_HANDSHAKE_TIMEOUT_MS`]) off the accept loop, so a slow or silent client delays
/// nobody else. A client that fails the handshake (no certificate, or one the CA did not sign,
/// under `--client-cert-auth`; plaintext HTTP/2) is closed. The handshake uses the certificates
/// of the last (re)load.
fn tls_client_connections(
    listener: tokio::net::TcpListener,
    limits: Arc<Limits>,
    tls: Arc<ClientPortTls>,
) -> impl tokio_stream::Stream<
    Item = std::io::Result<
        IdleClosing<CoalescingWriter<ClientStream<tokio_rustls::server::TlsStream<TcpStream>>>>,
    >,
> {
    let (sender, receiver) = mpsc::channel(CLIENT_TLS_HANDSHAKES_MAX);
    let handshakes = Arc::new(tokio::sync::Semaphore::new(CLIENT_TLS_HANDSHAKES_MAX));
    tokio::spawn(async move {
        loop {
            let (stream, peer) = tokio::select! {
                () = sender.closed() => return,
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        // Usually descriptor exhaustion; pausing lets connections close.
                        tracing::warn!(%error, "accepting a client connection failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let Some(slot) = limits.connection(Some(peer)) else {
                continue;
            };
            let Ok(handshake) = handshakes.clone().try_acquire_owned() else {
                tracing::debug!(%peer, "too many client TLS handshakes at once; closing the new one");
                continue;
            };
            if let Err(error) = stream.set_nodelay(true) {
                tracing::debug!(%peer, %error, "client connection lost before TLS");
                continue;
            }
            let acceptor = tokio_rustls::TlsAcceptor::from(tls.current());
            let sender = sender.clone();
            let limits = limits.clone();
            tokio::spawn(async move {
                let timeout = Duration::from_millis(CLIENT_TLS_HANDSHAKE_TIMEOUT_MS);
                let accepted = tokio::time::timeout(timeout, acceptor.accept(stream)).await;
                drop(handshake);
                let stream = match accepted {
                    Ok(Ok(stream)) => stream,
                    Ok(Err(error)) => {
                        tracing::debug!(%peer, %error, "client TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(%peer, "client TLS handshake timed out");
                        return;
                    }
                };
                let stream = CoalescingWriter::new(ClientStream::new(stream));
                let _ = sender
                    .send(Ok(IdleClosing::new(stream, limits, Some(peer), slot)))
                    .await;
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(receiver)
}

/// Reloads the certificates of both ports on SIGHUP (on Unix). A failed reload keeps the
/// certificates in force and says why.
fn reload_on_hangup(
    client: Option<Arc<ClientPortTls>>,
    peer: Option<Arc<PeerTls>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        if client.is_none() && peer.is_none() {
            return;
        }
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            let mut hangups = match signal(SignalKind::hangup()) {
                Ok(hangups) => hangups,
                Err(error) => {
                    tracing::warn!(%error, "cannot listen for SIGHUP; certificates will not reload");
                    return;
                }
            };
            while hangups.recv().await.is_some() {
                if let Some(client) = &client {
                    match client.reload() {
                        Ok(()) => tracing::info!("client port certificates reloaded"),
                        Err(error) => {
                            tracing::warn!(%error, "client port certificates not reloaded; the previous ones stay in force")
                        }
                    }
                }
                if let Some(peer) = &peer {
                    match peer.reload() {
                        Ok(()) => tracing::info!("peer port certificates reloaded"),
                        Err(error) => {
                            tracing::warn!(%error, "peer port certificates not reloaded; the previous ones stay in force")
                        }
                    }
                }
            }
        }
    })
}
