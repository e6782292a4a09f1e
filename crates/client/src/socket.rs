//! The client's TCP connections, each of which can be reset (an RST, with whatever was still
//! queued for sending thrown away) rather than closed.
//!
//! Why: a keepalive written into a connection that a partition cuts stays queued in the
//! kernel, which keeps retransmitting it. When the holder gives its lease up at the local
//! deadline (docs/client.md), an ordinary close would leave that keepalive queued in an
//! orphaned socket; the moment the path works again (the partition heals, or the orphaned
//! socket is no longer caught by a rule that matched its process) the keepalive reaches the
//! leader and renews the lease for one more TTL, so a seat stays held by a holder that has
//! already given it up. A reset discards it: once the lease is reported lost, nothing this
//! client queued can renew it.
//!
//! Each socket is registered at connect time with a second descriptor of it. Resetting sets
//! `SO_LINGER` to zero through that descriptor (so the socket's last close sends an RST and
//! drops the queue) and makes its stream fail, so hyper drops the connection now rather than
//! when the next frame is due; a process that exits at once closes it just as abortively.

use std::future::Future;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tonic::codegen::Service;
use tonic::codegen::http::Uri;

/// The error a reset connection's stream fails with.
const RESET_REASON: &str = "connection reset by the client: a lease was given up";

/// Every live TCP connection a client made, for [`Sockets::reset_all`].
#[derive(Default)]
pub(crate) struct Sockets {
    live: Mutex<Vec<Weak<Resettable>>>,
}

impl Sockets {
    fn register(&self, stream: &TcpStream) -> io::Result<Arc<Resettable>> {
        let resettable = Arc::new(Resettable {
            fd: stream.as_fd().try_clone_to_owned()?,
            reset: AtomicBool::new(false),
            wakers: Mutex::new([None, None]),
        });
        let mut live = self
            .live
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        live.retain(|socket| socket.strong_count() > 0);
        live.push(Arc::downgrade(&resettable));
        Ok(resettable)
    }

    /// Resets every live connection: from now on nothing queued in them is sent. Returns how
    /// many there were. Calls made afterwards connect anew.
    pub(crate) fn reset_all(&self) -> usize {
        let live: Vec<Arc<Resettable>> = {
            let mut live = self
                .live
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            let sockets = live.iter().filter_map(Weak::upgrade).collect();
            live.clear();
            sockets
        };
        for socket in &live {
            socket.reset();
        }
        live.len()
    }
}

/// One registered socket.
struct Resettable {
    /// A second descriptor of the socket: options set through it are the socket's, and the
    /// socket's last close (this one or the stream's, whichever comes later) obeys them.
    fd: OwnedFd,
    reset: AtomicBool,
    /// The tasks waiting to read and to write, woken by a reset.
    wakers: Mutex<[Option<Waker>; 2]>,
}

const READER: usize = 0;
const WRITER: usize = 1;

impl Resettable {
    fn reset(&self) {
        // Linger zero: the last close sends an RST and throws away what is still queued.
        if let Err(error) = socket2::SockRef::from(&self.fd).set_linger(Some(Duration::ZERO)) {
            tracing::warn!(%error, "could not set SO_LINGER to reset a connection");
        }
        self.reset.store(true, Ordering::SeqCst);
        let wakers = std::mem::take(
            &mut *self
                .wakers
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        );
        for waker in wakers.into_iter().flatten() {
            waker.wake();
        }
    }

    /// Fails once reset; otherwise remembers who to wake when it is.
    fn check(&self, cx: &Context<'_>, slot: usize) -> io::Result<()> {
        {
            let mut wakers = self
                .wakers
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            match &mut wakers[slot] {
                Some(waker) if waker.will_wake(cx.waker()) => {}
                other => *other = Some(cx.waker().clone()),
            }
        }
        // Looked at after the waker is stored, so a reset in between is not missed.
        match self.reset.load(Ordering::SeqCst) {
            true => Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                RESET_REASON,
            )),
            false => Ok(()),
        }
    }
}

/// A TCP stream that fails once its socket was reset.
pub(crate) struct ResettableStream {
    stream: TcpStream,
    socket: Arc<Resettable>,
}

impl AsyncRead for ResettableStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.socket.check(cx, READER)?;
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for ResettableStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.socket.check(cx, WRITER)?;
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.socket.check(cx, WRITER)?;
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.socket.check(cx, WRITER)?;
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.socket.check(cx, WRITER)?;
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// Connects tonic's channels over TCP, registering every socket in a [`Sockets`].
#[derive(Clone)]
pub(crate) struct Connector {
    pub(crate) sockets: Arc<Sockets>,
}

impl Service<Uri> for Connector {
    type Response = TokioIo<ResettableStream>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<Self::Response>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let sockets = self.sockets.clone();
        Box::pin(async move {
            let (host, port) = host_and_port(&uri)?;
            // Worded as the transport's own connector words it, so errors read as before.
            let stream = TcpStream::connect((host.as_str(), port))
                .await
                .map_err(|error| {
                    io::Error::new(error.kind(), format!("tcp connect error: {error}"))
                })?;
            stream.set_nodelay(true)?;
            let socket = sockets.register(&stream)?;
            Ok(TokioIo::new(ResettableStream { stream, socket }))
        })
    }
}

/// The host (an IPv6 address without its brackets) and port of an endpoint URL; the port
/// defaults to the scheme's.
fn host_and_port(uri: &Uri) -> io::Result<(String, u16)> {
    let host = uri.host().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("endpoint {uri} has no host"),
        )
    })?;
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    let default_port = match uri.scheme_str() {
        Some("https") => 443,
        _ => 80,
    };
    Ok((host, uri.port_u16().unwrap_or(default_port)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn hosts_and_ports_of_endpoints() {
        let parse = |url: &str| host_and_port(&url.parse::<Uri>().expect("a URL"));
        assert_eq!(
            parse("http://127.0.0.1:2379").ok(),
            Some(("127.0.0.1".into(), 2379))
        );
        assert_eq!(parse("https://[::1]:2379").ok(), Some(("::1".into(), 2379)));
        assert_eq!(
            parse("https://example.test").ok(),
            Some(("example.test".into(), 443))
        );
        assert_eq!(
            parse("http://example.test").ok(),
            Some(("example.test".into(), 80))
        );
    }

    /// A reset connection's peer sees a reset (not an orderly end), and a stream blocked in
    /// a read fails at once.
    #[tokio::test]
    async fn a_reset_socket_fails_its_stream_and_resets_the_peer() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let uri: Uri = format!("http://{}", listener.local_addr().expect("address"))
            .parse()
            .expect("a URL");
        let sockets = Arc::new(Sockets::default());
        let mut connector = Connector {
            sockets: sockets.clone(),
        };
        let (connected, accepted) = tokio::join!(connector.call(uri), listener.accept());
        let mut client = connected.expect("connect").into_inner();
        let (mut server, _) = accepted.expect("accept");
        let reader = tokio::spawn(async move {
            let mut byte = [0u8; 1];
            let read = client.read(&mut byte).await;
            (client, read)
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(sockets.reset_all(), 1);
        let (client, read) = tokio::time::timeout(Duration::from_secs(10), reader)
            .await
            .expect("the blocked read ends at the reset")
            .expect("reader task");
        let error = read.expect_err("a reset stream fails");
        assert_eq!(error.kind(), io::ErrorKind::ConnectionAborted);
        drop(client);
        // The peer learns of it as a reset, not an end of stream.
        let mut rest = Vec::new();
        let seen = tokio::time::timeout(Duration::from_secs(10), server.read_to_end(&mut rest))
            .await
            .expect("the peer learns of the reset");
        let error = seen.expect_err("a reset, not an orderly end");
        assert_eq!(error.kind(), io::ErrorKind::ConnectionReset);
        // Nothing is left to reset, and a socket reset twice is harmless.
        assert_eq!(sockets.reset_all(), 0);
        let _ = server.shutdown().await;
    }
}
