//! Inbound side: accept peer connections and hand their messages to the Raft driver.
//!
//! ```text
//!  peer ──TCP──► accept ──► connection task: Hello? ──► frames ──► inbound channel ──► Raft driver
//!                (bounded     (checks cluster id,    (checksum,     (bounded: a slow driver
//!                 count)       our id, sender id)     size, sender)   slows the socket, not memory)
//! ```

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use conclave_raft::{Message, NodeId};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use super::TransportConfig;
use super::frame::{self, Frame, FrameReader, HelloAccepted, HelloRejected};
use super::outbound::frame_name;
use crate::error::Error;

/// A message received from a peer: the handshaken sender and the message itself.
pub type InboundMessage = (NodeId, Message);

/// Binds the peer listener. A failure here is fatal: the address is in use or not ours.
pub async fn bind_peer_listener(address: &str) -> Result<TcpListener, Error> {
    TcpListener::bind(address)
        .await
        .map_err(|source| Error::PeerListen {
            address: address.to_string(),
            source,
        })
}

/// Accepts peer connections on `listener` and forwards every received message to `inbound`
/// until `shutdown` resolves or the receiving end of `inbound` is dropped. Returning closes
/// every accepted connection.
///
/// Each connection must open with a `Hello` naming this cluster and this node; anything else
/// is answered with `HelloRejected` and closed. A bad frame (checksum, size, version,
/// undecodable, or a message whose `from` is not the handshaken sender) closes its
/// connection; the peer reconnects and Raft re-sends what was lost.
pub async fn serve_peers(
    listener: TcpListener,
    config: TransportConfig,
    inbound: mpsc::Sender<InboundMessage>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), Error> {
    config.validate()?;
    let config = Arc::new(config);
    let slots = Arc::new(Semaphore::new(config.peer_connections_max));
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        // Reap finished connection tasks so the set does not grow with churn.
        while connections.try_join_next().is_some() {}
        let accepted = tokio::select! {
            () = &mut shutdown => break,
            () = inbound.closed() => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, remote) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                // Usually descriptor exhaustion; pausing lets connections close.
                warn!(%error, "accepting a peer connection failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            warn!(%remote, max = config.peer_connections_max, "too many peer connections; refusing");
            continue;
        };
        let config = Arc::clone(&config);
        let inbound = inbound.clone();
        connections.spawn(async move {
            if let Err(error) = handle_connection(stream, &config, &inbound).await {
                warn!(%remote, %error, "closing peer connection");
            }
            drop(slot);
        });
    }
    info!("peer listener stopped");
    connections.shutdown().await;
    Ok(())
}

/// Runs one inbound connection to its end. `Ok` on a clean close by the peer or the driver.
async fn handle_connection(
    stream: TcpStream,
    config: &TransportConfig,
    inbound: &mpsc::Sender<InboundMessage>,
) -> Result<(), Error> {
    stream.set_nodelay(true)?;
    let mut reader = FrameReader::new(stream);
    let handshake_timeout = Duration::from_millis(config.handshake_timeout_ms);
    let first = tokio::time::timeout(handshake_timeout, reader.next_frame())
        .await
        .map_err(|_| Error::HandshakeTimeout {
            timeout_ms: config.handshake_timeout_ms,
        })??;
    let hello = match first {
        Some(Frame::Hello(hello)) => hello,
        Some(other) => {
            let reason = format!("expected Hello, got {}", frame_name(&other));
            return Err(reject(&mut reader, reason).await);
        }
        None => return Ok(()),
    };
    let refusal = if hello.cluster_id != config.cluster_id {
        Some(format!(
            "cluster id mismatch: node {} belongs to cluster {:#x}, node {} to cluster {:#x}",
            hello.from, hello.cluster_id, config.node_id, config.cluster_id
        ))
    } else if hello.to != config.node_id {
        Some(format!(
            "node {} dialed node {} but reached node {}",
            hello.from, hello.to, config.node_id
        ))
    } else if hello.from == 0 || hello.from == config.node_id {
        Some(format!(
            "node id {} cannot be a peer of node {}",
            hello.from, config.node_id
        ))
    } else {
        None
    };
    if let Some(reason) = refusal {
        return Err(reject(&mut reader, reason).await);
    }
    let accepted = HelloAccepted {
        cluster_id: config.cluster_id,
        node_id: config.node_id,
    };
    let mut answer = Vec::new();
    frame::encode_frame(&Frame::HelloAccepted(accepted), &mut answer)?;
    reader.get_mut().write_all(&answer).await?;
    let peer = hello.from;
    debug!(peer, "peer handshake accepted");

    while let Some(frame) = reader.next_frame().await? {
        let Frame::Message(message) = frame else {
            return Err(Error::ProtocolViolation {
                reason: format!("expected Message, got {}", frame_name(&frame)),
            });
        };
        if message.from != peer || message.to != config.node_id {
            return Err(Error::ProtocolViolation {
                reason: format!(
                    "message {} -> {} on the connection from node {peer} to node {}",
                    message.from, message.to, config.node_id
                ),
            });
        }
        if inbound.send((peer, message)).await.is_err() {
            // The driver is gone: the node is shutting down.
            return Ok(());
        }
    }
    Ok(())
}

/// Tells the dialer why, then yields the error to log. The answer is best effort: the
/// connection closes either way.
async fn reject(reader: &mut FrameReader<TcpStream>, reason: String) -> Error {
    let mut answer = Vec::new();
    let rejected = Frame::HelloRejected(HelloRejected {
        reason: reason.clone(),
    });
    if frame::encode_frame(&rejected, &mut answer).is_ok() {
        let _ = reader.get_mut().write_all(&answer).await;
    }
    Error::HandshakeRejected { reason }
}
