//! Client connections whose HTTP/2 `:authority` is a URL are repaired before the HTTP/2
//! server reads them.
//!
//! etcdctl 3.4 dials every member's advertised client URL directly for `endpoint status
//! --cluster` (and `endpoint hashkv --cluster`), and its gRPC library then sends that URL,
//! scheme included (`http://127.0.0.1:2379`), as the request's `:authority`. etcd's Go server
//! ignores the value; the `h2` crate under tonic refuses the request as malformed
//! (`RST_STREAM PROTOCOL_ERROR`) before any service sees it, and offers no setting to relax
//! that. [`ClientStream`] sits between the socket and the HTTP/2 server and rewrites such a
//! value's `://` to `---` (`http---127.0.0.1:2379`, a valid host and port), nothing else.
//!
//! ```text
//!  socket ─► preface ─► frame header ─┬─ HEADERS (+ CONTINUATION) ─► walk the HPACK block ─┐
//!                                     └─ any other frame: forwarded as it streams in        ├─► h2
//!                                          unchanged block: original bytes ◄────────────────┤
//!                                          repaired block: re-framed, value as a raw literal ┘
//! ```
//!
//! The replacement keeps the decoded length, so the entry the value adds to the HPACK dynamic
//! table has the same size on both sides and the client's later index references still name
//! the same entries in h2's table. Anything the walker does not understand (a malformed block,
//! a block over [`HEADER_BLOCK_MAX_BYTES`], a connection without the HTTP/2 preface) is passed
//! through unchanged for h2 to judge. Only the server-to-client direction is not touched.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BytesMut};
use fluke_hpack::huffman::HuffmanDecoder;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tonic::transport::server::Connected;

/// The client connection preface every HTTP/2 connection starts with (RFC 9113 §3.4).
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER_BYTES: usize = 9;
const FRAME_HEADERS: u8 = 0x1;
const FRAME_CONTINUATION: u8 = 0x9;
const FLAG_END_STREAM: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_PADDED: u8 = 0x8;
const FLAG_PRIORITY: u8 = 0x20;
const PRIORITY_BYTES: usize = 5;
/// Every HTTP/2 endpoint accepts frames of this size (the protocol's minimum
/// `SETTINGS_MAX_FRAME_SIZE`), so re-framed blocks never need the negotiated value.
const REFRAME_PAYLOAD_MAX_BYTES: usize = 16_384;
/// Header blocks larger than this are forwarded without a look (gRPC request headers are a few
/// hundred bytes); it bounds what one connection buffers.
pub const HEADER_BLOCK_MAX_BYTES: usize = 64 * 1024;
/// How much is read from the socket at once.
const READ_CHUNK_BYTES: usize = 16 * 1024;
/// The static-table index of `:authority` (RFC 7541 Appendix A).
const STATIC_AUTHORITY_INDEX: usize = 1;

enum State {
    /// `matched` bytes of the preface have arrived.
    Preface {
        matched: usize,
    },
    FrameHeader,
    /// Forwarding the rest of a frame's payload as it arrives.
    Forward {
        remaining: usize,
    },
    /// Collecting a header block: the original frames (to forward unchanged when nothing needs
    /// repair) and the fragment bytes.
    HeaderBlock(Box<PendingBlock>),
    /// Not HTTP/2 with prior knowledge, or given up on: every byte goes through as it is.
    Passthrough,
}

struct PendingBlock {
    original: Vec<u8>,
    fragment: Vec<u8>,
    flags: u8,
    stream_id: [u8; 4],
    priority: Option<[u8; PRIORITY_BYTES]>,
}

/// A client TCP connection as the gRPC server reads it; see the module documentation.
///
/// Generic over the connection below it: a plain TCP stream, or a TLS stream (the repair reads
/// the decrypted HTTP/2 bytes).
pub struct ClientStream<S = TcpStream> {
    inner: S,
    state: State,
    input: BytesMut,
    output: BytesMut,
    /// Where socket reads land (kept, so a read does not zero a fresh buffer each time).
    scratch: Box<[u8]>,
    eof: bool,
}

impl<S> ClientStream<S> {
    pub fn new(inner: S) -> ClientStream<S> {
        ClientStream {
            inner,
            state: State::Preface { matched: 0 },
            input: BytesMut::new(),
            output: BytesMut::new(),
            scratch: vec![0; READ_CHUNK_BYTES].into_boxed_slice(),
            eof: false,
        }
    }
}

impl<S: Connected> Connected for ClientStream<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> S::ConnectInfo {
        self.inner.connect_info()
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for ClientStream<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if !this.output.is_empty() {
                let n = this.output.len().min(buf.remaining());
                buf.put_slice(&this.output[..n]);
                this.output.advance(n);
                return Poll::Ready(Ok(()));
            }
            if matches!(this.state, State::Passthrough) && this.input.is_empty() {
                return Pin::new(&mut this.inner).poll_read(cx, buf);
            }
            process(&mut this.state, &mut this.input, &mut this.output);
            if !this.output.is_empty() {
                continue;
            }
            if this.eof {
                // A truncated frame: hand over what there is and let h2 report it.
                let rest = this.input.split();
                this.output.extend_from_slice(&rest);
                this.state = State::Passthrough;
                if this.output.is_empty() {
                    return Poll::Ready(Ok(()));
                }
                continue;
            }
            let mut read = ReadBuf::new(&mut this.scratch);
            match Pin::new(&mut this.inner).poll_read(cx, &mut read) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
                Poll::Ready(Ok(())) => {
                    if read.filled().is_empty() {
                        this.eof = true;
                    }
                    this.input.extend_from_slice(read.filled());
                }
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for ClientStream<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// Moves everything `input` holds that can be judged yet into `output`.
fn process(state: &mut State, input: &mut BytesMut, output: &mut BytesMut) {
    loop {
        match state {
            State::Passthrough => {
                let all = input.split();
                output.extend_from_slice(&all);
                return;
            }
            State::Preface { matched } => {
                let want = PREFACE.len() - *matched;
                let n = want.min(input.len());
                if n == 0 {
                    return;
                }
                if input[..n] != PREFACE[*matched..*matched + n] {
                    *state = State::Passthrough;
                    continue;
                }
                output.extend_from_slice(&input.split_to(n));
                *matched += n;
                if *matched == PREFACE.len() {
                    *state = State::FrameHeader;
                }
            }
            State::Forward { remaining } => {
                let n = (*remaining).min(input.len());
                if n == 0 && *remaining > 0 {
                    return;
                }
                output.extend_from_slice(&input.split_to(n));
                *remaining -= n;
                if *remaining == 0 {
                    *state = State::FrameHeader;
                }
            }
            State::FrameHeader => {
                if input.len() < FRAME_HEADER_BYTES {
                    return;
                }
                let length = frame_length(input);
                if input[3] == FRAME_HEADERS && length <= HEADER_BLOCK_MAX_BYTES {
                    if input.len() < FRAME_HEADER_BYTES + length {
                        return;
                    }
                    let frame = input.split_to(FRAME_HEADER_BYTES + length);
                    match start_block(&frame) {
                        Some(block) if block.flags & FLAG_END_HEADERS != 0 => {
                            finish_block(*block, output);
                        }
                        Some(block) => *state = State::HeaderBlock(block),
                        None => output.extend_from_slice(&frame),
                    }
                } else {
                    output.extend_from_slice(&input.split_to(FRAME_HEADER_BYTES));
                    *state = State::Forward { remaining: length };
                }
            }
            State::HeaderBlock(block) => {
                if input.len() < FRAME_HEADER_BYTES {
                    return;
                }
                let length = frame_length(input);
                let fits =
                    block.original.len() + FRAME_HEADER_BYTES + length <= HEADER_BLOCK_MAX_BYTES;
                if input[3] != FRAME_CONTINUATION || !fits {
                    // Not what a header block may continue with, or too large to look at:
                    // forward what was held back and let h2 judge the rest.
                    output.extend_from_slice(&block.original);
                    *state = State::FrameHeader;
                    continue;
                }
                if input.len() < FRAME_HEADER_BYTES + length {
                    return;
                }
                let frame = input.split_to(FRAME_HEADER_BYTES + length);
                block.original.extend_from_slice(&frame);
                block
                    .fragment
                    .extend_from_slice(&frame[FRAME_HEADER_BYTES..]);
                if frame[4] & FLAG_END_HEADERS != 0 {
                    let State::HeaderBlock(block) = std::mem::replace(state, State::FrameHeader)
                    else {
                        unreachable!("matched HeaderBlock above");
                    };
                    finish_block(*block, output);
                }
            }
        }
    }
}

fn frame_length(header: &[u8]) -> usize {
    (usize::from(header[0]) << 16) | (usize::from(header[1]) << 8) | usize::from(header[2])
}

/// Splits a whole HEADERS frame into its parts; `None` when its padding or priority fields do
/// not fit (h2 will refuse the frame itself).
fn start_block(frame: &[u8]) -> Option<Box<PendingBlock>> {
    let flags = frame[4];
    let mut payload = &frame[FRAME_HEADER_BYTES..];
    if flags & FLAG_PADDED != 0 {
        let (&pad, rest) = payload.split_first()?;
        payload = rest.get(..rest.len().checked_sub(usize::from(pad))?)?;
    }
    let priority = if flags & FLAG_PRIORITY != 0 {
        let bytes: [u8; PRIORITY_BYTES] = payload.get(..PRIORITY_BYTES)?.try_into().ok()?;
        payload = &payload[PRIORITY_BYTES..];
        Some(bytes)
    } else {
        None
    };
    Some(Box::new(PendingBlock {
        original: frame.to_vec(),
        fragment: payload.to_vec(),
        flags,
        stream_id: frame[5..9].try_into().ok()?,
        priority,
    }))
}

/// Writes a complete header block: the original frames, or new ones around a repaired block.
fn finish_block(block: PendingBlock, output: &mut BytesMut) {
    let Some(repaired) = repair_block(&block.fragment) else {
        output.extend_from_slice(&block.original);
        return;
    };
    let mut payload = Vec::with_capacity(PRIORITY_BYTES + repaired.len());
    if let Some(priority) = block.priority {
        payload.extend_from_slice(&priority);
    }
    payload.extend_from_slice(&repaired);
    let mut chunks = payload.chunks(REFRAME_PAYLOAD_MAX_BYTES).peekable();
    let mut frame_type = FRAME_HEADERS;
    let mut flags = block.flags & (FLAG_END_STREAM | FLAG_PRIORITY);
    while let Some(chunk) = chunks.next() {
        if chunks.peek().is_none() {
            flags |= FLAG_END_HEADERS;
        }
        let length = chunk.len();
        output.extend_from_slice(&[(length >> 16) as u8, (length >> 8) as u8, length as u8]);
        output.extend_from_slice(&[frame_type, flags]);
        output.extend_from_slice(&block.stream_id);
        output.extend_from_slice(chunk);
        frame_type = FRAME_CONTINUATION;
        flags = 0;
    }
}

/// The header block with every URL-valued `:authority` literal repaired, or `None` when
/// nothing needed it or the block is not valid HPACK.
pub fn repair_block(block: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    let mut copied = 0;
    let mut pos = 0;
    while pos < block.len() {
        let first = block[pos];
        let prefix_bits = if first & 0x80 != 0 {
            // Indexed field: a reference to a table entry, nothing to inspect.
            read_integer(block, &mut pos, 7)?;
            continue;
        } else if first & 0xc0 == 0x40 {
            6 // literal with incremental indexing
        } else if first & 0xe0 == 0x20 {
            // Dynamic table size update.
            read_integer(block, &mut pos, 5)?;
            continue;
        } else {
            4 // literal without indexing, or never indexed
        };
        let name_index = read_integer(block, &mut pos, prefix_bits)?;
        // A name taken from the dynamic table is not looked at: gRPC's encoders name
        // `:authority` by its static index (or, rarely, literally).
        let is_authority = if name_index == 0 {
            read_string(block, &mut pos)? == b":authority"
        } else {
            name_index == STATIC_AUTHORITY_INDEX
        };
        let value_start = pos;
        if !is_authority {
            // Only `:authority` values are decoded: Huffman decoding every header of every
            // request cost the leader a fifth of its CPU under load.
            skip_string(block, &mut pos)?;
            continue;
        }
        let value = read_string(block, &mut pos)?;
        if let Some(fixed) = repaired_authority(&value) {
            out.extend_from_slice(&block[copied..value_start]);
            write_raw_string(&fixed, &mut out);
            copied = pos;
        }
    }
    if copied == 0 {
        return None;
    }
    out.extend_from_slice(&block[copied..]);
    Some(out)
}

/// `scheme://host:port` as `scheme---host:port`: the same length, and a valid authority.
fn repaired_authority(value: &[u8]) -> Option<Vec<u8>> {
    let at = value.windows(3).position(|w| w == b"://")?;
    let mut fixed = value.to_vec();
    fixed[at..at + 3].copy_from_slice(b"---");
    Some(fixed)
}

/// An HPACK integer with an `n`-bit prefix (RFC 7541 §5.1); `None` if cut off or too large.
fn read_integer(block: &[u8], pos: &mut usize, prefix_bits: u32) -> Option<usize> {
    let mask = (1usize << prefix_bits) - 1;
    let mut value = usize::from(*block.get(*pos)?) & mask;
    *pos += 1;
    if value < mask {
        return Some(value);
    }
    let mut shift = 0u32;
    loop {
        let byte = *block.get(*pos)?;
        *pos += 1;
        if shift > 28 {
            return None;
        }
        value += usize::from(byte & 0x7f) << shift;
        shift += 7;
        if byte & 0x80 == 0 {
            return Some(value);
        }
    }
}

/// An HPACK string literal (RFC 7541 §5.2), Huffman-decoded when it is coded.
fn read_string(block: &[u8], pos: &mut usize) -> Option<Vec<u8>> {
    let huffman = *block.get(*pos)? & 0x80 != 0;
    let length = read_integer(block, pos, 7)?;
    let end = pos.checked_add(length)?;
    let raw = block.get(*pos..end)?;
    *pos = end;
    if huffman {
        // Building a decoder builds its tables; one per thread is kept and reused.
        HUFFMAN.with_borrow_mut(|decoder| decoder.decode(raw).ok())
    } else {
        Some(raw.to_vec())
    }
}

/// Steps over an HPACK string literal without decoding it.
fn skip_string(block: &[u8], pos: &mut usize) -> Option<()> {
    let length = read_integer(block, pos, 7)?;
    let end = pos.checked_add(length)?;
    block.get(*pos..end)?;
    *pos = end;
    Some(())
}

thread_local! {
    static HUFFMAN: std::cell::RefCell<HuffmanDecoder> =
        std::cell::RefCell::new(HuffmanDecoder::new());
}

fn write_raw_string(value: &[u8], out: &mut Vec<u8>) {
    write_integer(value.len(), 7, 0x00, out);
    out.extend_from_slice(value);
}

fn write_integer(value: usize, prefix_bits: u32, first_bits: u8, out: &mut Vec<u8>) {
    let mask = (1usize << prefix_bits) - 1;
    if value < mask {
        out.push(first_bits | value as u8);
        return;
    }
    out.push(first_bits | mask as u8);
    let mut rest = value - mask;
    while rest >= 0x80 {
        out.push((rest & 0x7f) as u8 | 0x80);
        rest >>= 7;
    }
    out.push(rest as u8);
}

#[cfg(test)]
mod tests {
    use super::*;
    use fluke_hpack::{Decoder, Encoder};

    fn frames(headers: &[(&[u8], &[u8])], encoder: &mut Encoder) -> Vec<u8> {
        let block = encoder.encode(headers.iter().copied());
        let mut frame = vec![
            (block.len() >> 16) as u8,
            (block.len() >> 8) as u8,
            block.len() as u8,
            FRAME_HEADERS,
            FLAG_END_HEADERS | FLAG_END_STREAM,
            0,
            0,
            0,
            1,
        ];
        frame.extend_from_slice(&block);
        frame
    }

    /// Runs `bytes` through the rewriter fed in pieces of `step` bytes.
    fn rewrite(bytes: &[u8], step: usize) -> Vec<u8> {
        let mut state = State::Preface { matched: 0 };
        let mut input = BytesMut::new();
        let mut output = BytesMut::new();
        for piece in bytes.chunks(step) {
            input.extend_from_slice(piece);
            process(&mut state, &mut input, &mut output);
        }
        assert!(input.is_empty(), "everything complete was consumed");
        output.to_vec()
    }

    /// Decodes every HEADERS frame (each one a whole block) of a connection's bytes.
    fn decode_all(bytes: &[u8]) -> Vec<Vec<(Vec<u8>, Vec<u8>)>> {
        assert_eq!(&bytes[..PREFACE.len()], PREFACE);
        let mut decoder = Decoder::new();
        let mut pos = PREFACE.len();
        let mut blocks = Vec::new();
        while pos < bytes.len() {
            let length = frame_length(&bytes[pos..]);
            let payload = &bytes[pos + FRAME_HEADER_BYTES..pos + FRAME_HEADER_BYTES + length];
            if bytes[pos + 3] == FRAME_HEADERS {
                blocks.push(decoder.decode(payload).expect("valid HPACK"));
            }
            pos += FRAME_HEADER_BYTES + length;
        }
        blocks
    }

    #[test]
    fn a_url_authority_is_repaired_and_later_references_stay_in_step() {
        let mut encoder = Encoder::new();
        let mut bytes = PREFACE.to_vec();
        let request: &[(&[u8], &[u8])] = &[
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", b"/etcdserverpb.Maintenance/Status"),
            (b":authority", b"http://127.0.0.1:2379"),
            (b"te", b"trailers"),
        ];
        bytes.extend(frames(request, &mut encoder));
        // A DATA frame in between, then the same headers again (now table references).
        bytes.extend_from_slice(&[0, 0, 3, 0x0, 0x1, 0, 0, 0, 1, 7, 8, 9]);
        bytes.extend(frames(request, &mut encoder));
        for step in [1, 7, bytes.len()] {
            let out = rewrite(&bytes, step);
            let blocks = decode_all(&out);
            assert_eq!(blocks.len(), 2);
            for block in &blocks {
                let authority = block
                    .iter()
                    .find(|(name, _)| name == b":authority")
                    .map(|(_, value)| value.clone());
                assert_eq!(authority.as_deref(), Some(&b"http---127.0.0.1:2379"[..]));
                assert_eq!(block.len(), request.len());
            }
            assert!(
                out.windows(12)
                    .any(|w| w == [0, 0, 3, 0x0, 0x1, 0, 0, 0, 1, 7, 8, 9]),
                "the DATA frame passes unchanged"
            );
        }
    }

    #[test]
    fn a_huffman_coded_plain_authority_and_other_frames_pass_unchanged() {
        let mut bytes = PREFACE.to_vec();
        // RFC 7541 C.4.1: GET http://www.example.com/ with a Huffman-coded authority.
        let block: &[u8] = &[
            0x82, 0x86, 0x84, 0x41, 0x8c, 0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab,
            0x90, 0xf4, 0xff,
        ];
        bytes.extend_from_slice(&[0, 0, block.len() as u8, FRAME_HEADERS, FLAG_END_HEADERS]);
        bytes.extend_from_slice(&[0, 0, 0, 1]);
        bytes.extend_from_slice(block);
        bytes.extend_from_slice(&[0, 0, 0, 0x4, 0x0, 0, 0, 0, 0]); // SETTINGS
        assert_eq!(repair_block(block), None);
        assert_eq!(rewrite(&bytes, 3), bytes);
        let blocks = decode_all(&bytes);
        assert!(
            blocks[0].contains(&(b":authority".to_vec(), b"www.example.com".to_vec())),
            "the vector decodes as the RFC says"
        );
    }

    #[test]
    fn a_block_split_over_continuation_frames_is_repaired_as_a_whole() {
        let mut encoder = Encoder::new();
        let headers: &[(&[u8], &[u8])] = &[
            (b":method", b"POST"),
            (b":authority", b"http://10.0.0.1:2379"),
        ];
        let block = encoder.encode(headers.iter().copied());
        let (a, b) = block.split_at(block.len() / 2);
        let mut bytes = PREFACE.to_vec();
        bytes.extend_from_slice(&[0, 0, a.len() as u8, FRAME_HEADERS, 0, 0, 0, 0, 3]);
        bytes.extend_from_slice(a);
        bytes.extend_from_slice(&[0, 0, b.len() as u8, FRAME_CONTINUATION, FLAG_END_HEADERS]);
        bytes.extend_from_slice(&[0, 0, 0, 3]);
        bytes.extend_from_slice(b);
        let out = rewrite(&bytes, 5);
        let blocks = decode_all(&out);
        assert_eq!(
            blocks[0][1],
            (b":authority".to_vec(), b"http---10.0.0.1:2379".to_vec())
        );
        assert_eq!(out[PREFACE.len() + 4], FLAG_END_HEADERS, "one frame now");
    }

    #[test]
    fn not_http2_or_not_hpack_passes_unchanged() {
        let http1 = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec();
        assert_eq!(rewrite(&http1, 4), http1);
        let mut bytes = PREFACE.to_vec();
        // A literal whose value length runs past the block's end.
        bytes.extend_from_slice(&[0, 0, 3, FRAME_HEADERS, FLAG_END_HEADERS, 0, 0, 0, 1]);
        bytes.extend_from_slice(&[0x41, 0x10, b'h']);
        assert_eq!(rewrite(&bytes, 2), bytes);
    }
}
