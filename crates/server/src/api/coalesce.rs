//! Client connections gather what the HTTP/2 server writes during one scheduler turn into one
//! system call.
//!
//! The HTTP/2 server writes a connection's frames as soon as one stream hands it data. A put
//! fanned out to many watches on one connection, or many clients' answers settled by one
//! commit, reach it stream by stream: each stream's task wakes the connection's task, which
//! tokio runs next, so the connection wrote and flushed one small frame per stream (at 10,000
//! watchers, one `writev` per delivered event). [`CoalescingWriter`] takes the written bytes
//! into a buffer and answers the first flush of them by yielding once (tokio puts a task that
//! wakes itself at the back of the run queue): the other streams' tasks that are ready run in
//! between and add their frames, and the next flush writes them all. h2 still hands over a
//! frame of 1 KiB or more with a flush of its own, which goes out with whatever is gathered by
//! then. Only when bytes reach the socket changes, never which bytes or their order.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::server::Connected;

/// Bytes a connection gathers before it writes them without waiting for a flush.
pub const COALESCE_BUFFER_BYTES_MAX: usize = 64 * 1024;
/// The buffer's capacity a connection keeps once its bytes are written; a larger one is freed,
/// so thousands of idle connections do not each hold a burst's worth of memory.
pub const COALESCE_BUFFER_KEPT_BYTES: usize = 4 * 1024;

/// A client connection whose writes are gathered until a flush (see the module's comment).
pub struct CoalescingWriter<S> {
    inner: S,
    /// Bytes accepted from the HTTP/2 server; `buffer[written..]` is not yet on the socket.
    buffer: Vec<u8>,
    written: usize,
    /// The pending bytes' first flush already yielded; the next one writes.
    yielded: bool,
}

impl<S> CoalescingWriter<S> {
    pub fn new(inner: S) -> Self {
        CoalescingWriter {
            inner,
            buffer: Vec::new(),
            written: 0,
            yielded: false,
        }
    }

    fn pending_bytes(&self) -> usize {
        self.buffer.len() - self.written
    }
}

impl<S: AsyncWrite + Unpin> CoalescingWriter<S> {
    /// Writes the whole buffer to the socket.
    fn poll_write_out(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.written < self.buffer.len() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.buffer[self.written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
        }
        if self.buffer.capacity() > COALESCE_BUFFER_KEPT_BYTES {
            self.buffer = Vec::new();
        } else {
            self.buffer.clear();
        }
        self.written = 0;
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for CoalescingWriter<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for CoalescingWriter<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bytes: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.pending_bytes() + bytes.len() > COALESCE_BUFFER_BYTES_MAX {
            ready!(this.poll_write_out(cx))?;
            if bytes.len() >= COALESCE_BUFFER_BYTES_MAX {
                return Pin::new(&mut this.inner).poll_write(cx, bytes);
            }
        }
        this.buffer.extend_from_slice(bytes);
        Poll::Ready(Ok(bytes.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.pending_bytes() > 0 {
            if !this.yielded {
                this.yielded = true;
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            ready!(this.poll_write_out(cx))?;
        }
        this.yielded = false;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_write_out(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }

    /// `false`: the HTTP/2 layer then copies frames shorter than 1 KiB into its own buffer
    /// instead of handing each one over (and flushing) on its own.
    fn is_write_vectored(&self) -> bool {
        false
    }
}

impl<S: Connected> Connected for CoalescingWriter<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::{Wake, Waker};

    use super::*;

    /// A socket that records each write it is given, taking at most `take_max` bytes a call.
    #[derive(Default)]
    struct Socket {
        writes: Vec<Vec<u8>>,
        take_max: Option<usize>,
        flushes: usize,
        shut_down: bool,
    }

    impl Socket {
        fn bytes(&self) -> Vec<u8> {
            self.writes.concat()
        }
    }

    impl AsyncWrite for Socket {
        fn poll_write(
            self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
            bytes: &[u8],
        ) -> Poll<io::Result<usize>> {
            let this = self.get_mut();
            let n = this
                .take_max
                .map_or(bytes.len(), |max| bytes.len().min(max));
            this.writes.push(bytes[..n].to_vec());
            Poll::Ready(Ok(n))
        }

        fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            self.get_mut().flushes += 1;
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            self.get_mut().shut_down = true;
            Poll::Ready(Ok(()))
        }
    }

    #[derive(Default)]
    struct Wakes(AtomicUsize);

    impl Wake for Wakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn write(writer: &mut CoalescingWriter<Socket>, cx: &mut Context<'_>, bytes: &[u8]) {
        match Pin::new(writer).poll_write(cx, bytes) {
            Poll::Ready(Ok(n)) => assert_eq!(n, bytes.len(), "a short write was reported"),
            other => panic!("the write did not complete: {other:?}"),
        }
    }

    fn frame(stream: u8, len: usize) -> Vec<u8> {
        (0..len).map(|i| stream.wrapping_add(i as u8)).collect()
    }

    #[test]
    fn frames_written_before_a_flush_reach_the_socket_in_one_write_after_one_yield() {
        let wakes = Arc::new(Wakes::default());
        let waker = Waker::from(wakes.clone());
        let mut cx = Context::from_waker(&waker);
        let mut writer = CoalescingWriter::new(Socket::default());
        let frames: Vec<Vec<u8>> = (0..40).map(|s| frame(s, 300)).collect();
        for f in &frames[..10] {
            write(&mut writer, &mut cx, f);
        }
        // The first flush yields (and asks to be polled again), writing nothing.
        assert!(Pin::new(&mut writer).poll_flush(&mut cx).is_pending());
        assert_eq!(
            wakes.0.load(Ordering::SeqCst),
            1,
            "the yield did not wake the task"
        );
        assert!(writer.inner.writes.is_empty(), "written before the yield");
        // What other streams add meanwhile goes out with it.
        for f in &frames[10..] {
            write(&mut writer, &mut cx, f);
        }
        assert!(Pin::new(&mut writer).poll_flush(&mut cx).is_ready());
        assert_eq!(writer.inner.writes.len(), 1, "the frames were not gathered");
        assert_eq!(writer.inner.bytes(), frames.concat());
        assert_eq!(writer.inner.flushes, 1);
        // A flush with nothing pending does not yield.
        assert!(Pin::new(&mut writer).poll_flush(&mut cx).is_ready());
        assert_eq!(wakes.0.load(Ordering::SeqCst), 1);
        // The next bytes yield once again before they are written.
        write(&mut writer, &mut cx, b"next");
        assert!(Pin::new(&mut writer).poll_flush(&mut cx).is_pending());
        assert!(Pin::new(&mut writer).poll_flush(&mut cx).is_ready());
        assert_eq!(writer.inner.writes.len(), 2);
        assert_eq!(writer.inner.writes[1], b"next");
    }

    #[test]
    fn a_full_buffer_is_written_out_and_a_large_write_passes_straight_through() {
        let waker = Waker::from(Arc::new(Wakes::default()));
        let mut cx = Context::from_waker(&waker);
        let mut writer = CoalescingWriter::new(Socket::default());
        let small = frame(1, COALESCE_BUFFER_BYTES_MAX - 10);
        write(&mut writer, &mut cx, &small);
        assert!(writer.inner.writes.is_empty());
        // 20 more bytes do not fit: the buffer goes out first, in order.
        let more = frame(2, 20);
        write(&mut writer, &mut cx, &more);
        assert_eq!(writer.inner.writes, vec![small.clone()]);
        let large = frame(3, COALESCE_BUFFER_BYTES_MAX + 1);
        write(&mut writer, &mut cx, &large);
        assert_eq!(
            writer.inner.writes,
            vec![small.clone(), more.clone(), large.clone()]
        );
        assert_eq!(writer.pending_bytes(), 0);
        assert!(
            writer.buffer.capacity() <= COALESCE_BUFFER_KEPT_BYTES,
            "a burst's buffer was kept"
        );
        assert_eq!(writer.inner.bytes(), [small, more, large].concat());
    }

    #[test]
    fn short_socket_writes_and_shutdown_lose_no_byte() {
        let waker = Waker::from(Arc::new(Wakes::default()));
        let mut cx = Context::from_waker(&waker);
        let mut writer = CoalescingWriter::new(Socket {
            take_max: Some(7),
            ..Socket::default()
        });
        let frames: Vec<Vec<u8>> = (0..5).map(|s| frame(s, 33)).collect();
        for f in &frames {
            write(&mut writer, &mut cx, f);
        }
        assert!(Pin::new(&mut writer).poll_shutdown(&mut cx).is_ready());
        assert!(writer.inner.shut_down);
        assert_eq!(writer.inner.bytes(), frames.concat());
        assert!(writer.inner.writes.iter().all(|w| w.len() <= 7));
    }

    #[test]
    fn the_http2_layer_is_told_to_gather_small_frames_itself() {
        assert!(!CoalescingWriter::new(Socket::default()).is_write_vectored());
    }
}
