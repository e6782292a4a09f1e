//! Loopback throughput of the peer transport, printed as a table.
//!
//! One sender node pushes a fixed number of messages of one shape to one receiving node over
//! 127.0.0.1 as fast as its queue admits them; the clock runs from the first send to the last
//! message the receiver's channel yields, so encoding, TCP and decoding are all inside.
//! Each scenario runs several times and the fastest run is reported.
//!
//! The reference in the same run is the same traffic over gRPC, as a peer transport built on
//! tonic would carry it: one client-streaming call per peer, each Raft message a protobuf
//! message holding its postcard encoding (the framed protocol's payload, so only the
//! envelope differs). The speedup column is framed over gRPC in messages per second (wall clock); CPU us/msg is
//! the whole process's CPU time per message, which a busy machine disturbs less.

use std::time::{Duration, Instant};

use bytes::Bytes;
use conclave_raft::{Entry, EntryKind, Message, MessageBody};
use conclave_server::Error;
use conclave_server::transport::{PeerTransport, TransportConfig, bind_peer_listener, serve_peers};
use tokio::sync::mpsc;

const CLUSTER_ID: u64 = 0xBE7C;
/// Runs per scenario; the fastest is reported.
const RUNS: usize = 3;

struct Scenario {
    name: &'static str,
    entries_per_message: usize,
    entry_bytes: usize,
    messages: u64,
}

const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "heartbeat",
        entries_per_message: 0,
        entry_bytes: 0,
        messages: 400_000,
    },
    Scenario {
        name: "append 1 x 128 B",
        entries_per_message: 1,
        entry_bytes: 128,
        messages: 400_000,
    },
    Scenario {
        name: "append 16 x 128 B",
        entries_per_message: 16,
        entry_bytes: 128,
        messages: 100_000,
    },
    Scenario {
        name: "append 1 x 64 KiB",
        entries_per_message: 1,
        entry_bytes: 64 * 1024,
        messages: 20_000,
    },
];

fn message(scenario: &Scenario, seq: u64, payload: &Bytes) -> Message {
    let body = if scenario.entries_per_message == 0 {
        MessageBody::Heartbeat {
            commit: seq,
            context: None,
        }
    } else {
        let entries = (0..scenario.entries_per_message as u64)
            .map(|offset| Entry {
                term: 1,
                index: seq + offset,
                kind: EntryKind::Normal,
                data: payload.clone(),
            })
            .collect();
        MessageBody::Append {
            prev_index: seq,
            prev_term: 1,
            entries,
            commit: seq,
        }
    };
    Message {
        from: 1,
        to: 2,
        term: 1,
        body,
    }
}

struct Measured {
    elapsed: Duration,
    wire_bytes: u64,
    /// CPU time of the whole process (both ends) during the run.
    cpu: Duration,
}

/// This process's user + system CPU time, from `/proc/self/stat` (10 ms resolution; runs last
/// far longer). On a shared machine, CPU per message moves less than wall time does.
fn process_cpu() -> Duration {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return Duration::ZERO;
    };
    // Fields after the parenthesised command name; utime and stime are the 12th and 13th.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or(Vec::new(), |(_, rest)| rest.split_whitespace().collect());
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // Linux reports in USER_HZ, 100 per second on every architecture it runs on.
    Duration::from_millis((ticks(11) + ticks(12)) * 10)
}

/// The gRPC reference: a hand-written client-streaming service (no `.proto`: Conclave serves no
/// gRPC peer service, so none is compiled into `conclave-proto`).
mod grpc {
    use std::convert::Infallible;
    use std::task::{Context, Poll};

    use bytes::Bytes;
    use conclave_raft::Message;
    use tokio::sync::mpsc;
    use tonic::codegen::{BoxFuture, StdError, http};
    use tonic::server::{ClientStreamingService, Grpc, NamedService};

    pub const STREAM_PATH: &str = "/conclave.bench.Peer/Stream";

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct PeerMessage {
        /// A Raft message in the framed transport's payload encoding (postcard).
        #[prost(bytes = "bytes", tag = "1")]
        pub encoded: Bytes,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct StreamSummary {
        #[prost(uint64, tag = "1")]
        pub received: u64,
    }

    /// Decodes every streamed message and hands it on, as `serve_peers` does for frames.
    #[derive(Clone)]
    pub struct PeerService {
        pub inbound: mpsc::Sender<Message>,
    }

    impl NamedService for PeerService {
        const NAME: &'static str = "conclave.bench.Peer";
    }

    struct StreamCall(mpsc::Sender<Message>);

    impl ClientStreamingService<PeerMessage> for StreamCall {
        type Response = StreamSummary;
        type Future = BoxFuture<tonic::Response<StreamSummary>, tonic::Status>;

        fn call(&mut self, request: tonic::Request<tonic::Streaming<PeerMessage>>) -> Self::Future {
            let inbound = self.0.clone();
            Box::pin(async move {
                let mut stream = request.into_inner();
                let mut received = 0;
                while let Some(message) = stream.message().await? {
                    let decoded: Message = postcard::from_bytes(&message.encoded)
                        .map_err(|e| tonic::Status::invalid_argument(e.to_string()))?;
                    if inbound.send(decoded).await.is_err() {
                        break;
                    }
                    received += 1;
                }
                Ok(tonic::Response::new(StreamSummary { received }))
            })
        }
    }

    impl<B> tonic::codegen::Service<http::Request<B>> for PeerService
    where
        B: tonic::codegen::Body + Send + 'static,
        B::Error: Into<StdError> + Send + 'static,
    {
        type Response = http::Response<tonic::body::Body>;
        type Error = Infallible;
        type Future = BoxFuture<Self::Response, Self::Error>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, request: http::Request<B>) -> Self::Future {
            let call = StreamCall(self.inbound.clone());
            Box::pin(async move {
                if request.uri().path() != STREAM_PATH {
                    return Ok(tonic::Status::unimplemented("unknown method").into_http());
                }
                let mut grpc = Grpc::new(tonic_prost::ProstCodec::default());
                Ok(grpc.client_streaming(call, request).await)
            })
        }
    }
}

/// HTTP/2 flow-control windows of the gRPC reference. The 64 KiB default stalls a stream of
/// large appends on every window update; a peer transport built on gRPC would raise it.
const GRPC_WINDOW_BYTES: u32 = 8 * 1024 * 1024;

/// The same traffic as [`run`] over one gRPC client stream.
async fn run_grpc(scenario: &Scenario) -> Result<Measured, Box<dyn std::error::Error>> {
    use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    let (inbound_sender, mut inbound) = mpsc::channel(4096);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .initial_stream_window_size(GRPC_WINDOW_BYTES)
            .initial_connection_window_size(GRPC_WINDOW_BYTES)
            .add_service(grpc::PeerService {
                inbound: inbound_sender,
            })
            .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async {
                let _ = stopped.await;
            }),
    );
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}"))?
        .tcp_nodelay(true)
        .initial_stream_window_size(GRPC_WINDOW_BYTES)
        .initial_connection_window_size(GRPC_WINDOW_BYTES)
        .connect()
        .await?;
    let mut client = tonic::client::Grpc::new(channel);
    client.ready().await?;

    // The same bound as the framed transport's per-peer queue.
    let (outbound, queued) = mpsc::channel::<grpc::PeerMessage>(4096);
    let call = tokio::spawn(async move {
        let path = tonic::codegen::http::uri::PathAndQuery::from_static(grpc::STREAM_PATH);
        client
            .client_streaming::<_, grpc::PeerMessage, grpc::StreamSummary, _>(
                tonic::Request::new(ReceiverStream::new(queued)),
                path,
                tonic_prost::ProstCodec::default(),
            )
            .await
    });

    let payload = Bytes::from(vec![0x5A; scenario.entry_bytes]);
    let total = scenario.messages;
    let cpu_before = process_cpu();
    let started = Instant::now();
    let receiver = tokio::spawn(async move {
        let mut received = 0u64;
        let mut batch = Vec::with_capacity(256);
        while received < total {
            let count = inbound.recv_many(&mut batch, 256).await;
            assert!(count > 0, "gRPC listener stopped early");
            received += count as u64;
            batch.clear();
        }
        started.elapsed()
    });
    let mut wire_bytes = 0u64;
    for seq in 0..total {
        let encoded = Bytes::from(postcard::to_allocvec(&message(scenario, seq, &payload))?);
        // Payload plus gRPC's 5-byte message prefix and the protobuf field header; HTTP/2
        // frame headers come on top and are not counted.
        wire_bytes += encoded.len() as u64 + 5 + 1 + 5;
        outbound
            .send(grpc::PeerMessage { encoded })
            .await
            .map_err(|_| "gRPC stream closed early")?;
    }
    let elapsed = receiver.await?;
    let cpu = process_cpu().saturating_sub(cpu_before);
    drop(outbound);
    call.await??;
    let _ = stop.send(());
    server.await??;
    Ok(Measured {
        elapsed,
        wire_bytes,
        cpu,
    })
}

async fn run(scenario: &Scenario) -> Result<Measured, Error> {
    let listener = bind_peer_listener("127.0.0.1:0").await?;
    let address = listener.local_addr()?.to_string();
    let (inbound_sender, mut inbound) = mpsc::channel(4096);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve_peers(
        listener,
        TransportConfig::new(CLUSTER_ID, 2),
        inbound_sender,
        async {
            let _ = stopped.await;
        },
    ));
    let mut transport = PeerTransport::new(TransportConfig::new(CLUSTER_ID, 1))?;
    transport.add_peer(2, address)?;
    while !transport.peer_stats(2).is_some_and(|stats| stats.connected) {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }

    let payload = Bytes::from(vec![0x5A; scenario.entry_bytes]);
    let total = scenario.messages;
    let cpu_before = process_cpu();
    let started = Instant::now();
    let receiver = tokio::spawn(async move {
        let mut received = 0u64;
        let mut batch = Vec::with_capacity(256);
        while received < total {
            let count = inbound.recv_many(&mut batch, 256).await;
            assert!(count > 0, "listener stopped early");
            received += count as u64;
            batch.clear();
        }
        started.elapsed()
    });
    for seq in 0..total {
        let message = message(scenario, seq, &payload);
        loop {
            match transport.send(message.clone()) {
                Ok(()) => break,
                // Backpressure for the benchmark only; the Raft driver never waits. Sleeping
                // rather than spinning leaves the cores to the sender and receiver (a full
                // queue of 4096 messages outlasts the 1 ms timer tick).
                Err(Error::PeerQueueFull { .. }) => {
                    tokio::time::sleep(Duration::from_millis(1)).await
                }
                Err(other) => return Err(other),
            }
        }
    }
    let elapsed = receiver.await.map_err(|error| Error::ProtocolViolation {
        reason: error.to_string(),
    })?;
    let cpu = process_cpu().saturating_sub(cpu_before);
    let stats = transport
        .peer_stats(2)
        .ok_or(Error::UnknownPeer { peer: 2 })?;
    let _ = stop.send(());
    let _ = server.await;
    Ok(Measured {
        elapsed,
        wire_bytes: stats.sent_bytes,
        cpu,
    })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    println!(
        "{:<20} {:<7} {:>9} {:>12} {:>14} {:>12} {:>8} {:>12} {:>8}",
        "scenario",
        "carrier",
        "messages",
        "messages/s",
        "payload MB/s",
        "wire MB/s",
        "seconds",
        "CPU us/msg",
        "speedup"
    );
    for scenario in SCENARIOS {
        // Best of several runs, the two carriers interleaved: the machine is shared, and
        // interference only ever slows a run.
        let mut framed: Option<Measured> = None;
        let mut grpc: Option<Measured> = None;
        for _ in 0..RUNS {
            let run_framed = runtime.block_on(run(scenario))?;
            if framed
                .as_ref()
                .is_none_or(|best| run_framed.elapsed < best.elapsed)
            {
                framed = Some(run_framed);
            }
            let run_grpc = runtime.block_on(run_grpc(scenario))?;
            if grpc
                .as_ref()
                .is_none_or(|best| run_grpc.elapsed < best.elapsed)
            {
                grpc = Some(run_grpc);
            }
        }
        let (Some(framed), Some(grpc)) = (framed, grpc) else {
            return Err("no run measured".into());
        };
        let ratio = grpc.elapsed.as_secs_f64() / framed.elapsed.as_secs_f64();
        for (carrier, measured) in [("framed", &framed), ("gRPC", &grpc)] {
            let seconds = measured.elapsed.as_secs_f64();
            let payload_bytes =
                scenario.messages * (scenario.entries_per_message * scenario.entry_bytes) as u64;
            let ratio_column = if carrier == "framed" {
                format!("{ratio:.2}x")
            } else {
                "1.00x".to_string()
            };
            println!(
                "{:<20} {:<7} {:>9} {:>12.0} {:>14.1} {:>12.1} {:>8.2} {:>12.2} {:>8}",
                scenario.name,
                carrier,
                scenario.messages,
                scenario.messages as f64 / seconds,
                payload_bytes as f64 / seconds / 1e6,
                measured.wire_bytes as f64 / seconds / 1e6,
                seconds,
                measured.cpu.as_secs_f64() * 1e6 / scenario.messages as f64,
                ratio_column,
            );
        }
    }
    Ok(())
}
