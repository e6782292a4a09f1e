//! The peer wire format: how handshakes and Raft messages are framed on a TCP stream.
//!
//! ```text
//! frame  = length:u32 BE | crc32c:u32 BE | body          (length = body bytes)
//! body   = version:u8 | kind:u8 | payload                 (crc32c covers the whole body)
//! kind   = 1 Hello | 2 HelloAccepted | 3 HelloRejected | 4 Message
//!        | 5 HelloChallenge | 6 HelloProof | 7 Keepalive | 8 Call | 9 Answer
//! payload: postcard encoding of the kind's struct (Hello, HelloAccepted, HelloRejected,
//!          conclave_raft::Message, HelloChallenge, HelloProof; Keepalive has none;
//!          Call and Answer are a PeerCall)
//! ```
//!
//! Call and Answer carry client writes a follower hands to the leader and the leader's
//! answers (`api::peer_calls`); the transport sees only an id and opaque bytes.
//!
//! The handshake (Hello, HelloChallenge, HelloProof, HelloAccepted or HelloRejected) proves
//! both ends know the cluster's peer key; see [`super::auth`].
//!
//! The length is checked against [`MAX_PEER_FRAME_BYTES`] before anything is allocated, and
//! the checksum before anything is decoded, so a corrupt or hostile stream costs at most one
//! bounded buffer and ends in an [`Error`], never a panic.
//!
//! Postcard encodes enum variants by position and struct fields in order, so the payload
//! encoding follows the shape of `conclave_raft`'s types. [`WIRE_VERSION`] must be bumped
//! whenever those types change shape; the golden-bytes test below fails when they do.

use bytes::{Buf, BytesMut};
use conclave_raft::{Message, NodeId};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt};

use super::auth::{Nonce, Proof};
use crate::error::Error;

/// The largest frame body a node sends or accepts. Appends are bounded by the Raft core's
/// `max_append_bytes` (1 MiB by default, but one oversized entry still travels alone) and
/// snapshot chunks by `snapshot_chunk_bytes`, so 64 MiB leaves ample room while bounding
/// what a broken peer can make us allocate.
pub const MAX_PEER_FRAME_BYTES: usize = 64 * 1024 * 1024;

/// The version of the body encoding this node speaks. A frame with any other version closes
/// the connection, so a mixed-version cluster fails loudly instead of misreading messages.
/// Version 2 added the authenticated handshake (challenge, proof, keepalive); version 3 the
/// dialer's vote-withholding window in the Hello; version 4 the `awaited` flag of a
/// follower's responses; version 5 the dialer's peer address in the Hello.
pub const WIRE_VERSION: u8 = 5;

/// Bytes before the body: length and checksum.
pub const FRAME_HEADER_BYTES: usize = 8;

/// Version and kind bytes at the start of every body.
const BODY_PREAMBLE_BYTES: usize = 2;

const KIND_HELLO: u8 = 1;
const KIND_HELLO_ACCEPTED: u8 = 2;
const KIND_HELLO_REJECTED: u8 = 3;
const KIND_MESSAGE: u8 = 4;
const KIND_HELLO_CHALLENGE: u8 = 5;
const KIND_HELLO_PROOF: u8 = 6;
const KIND_KEEPALIVE: u8 = 7;
const KIND_CALL: u8 = 8;
const KIND_ANSWER: u8 = 9;

/// The largest handshake frame a listener reads before the dialer has proved itself, so an
/// unauthenticated connection cannot make it reserve a large buffer. A Hello carries three
/// short strings besides fixed-size fields.
pub const HANDSHAKE_FRAME_BYTES_MAX: usize = 4096;

/// The dialer's first frame: who it is, whom it thinks it reached, and its half of the
/// challenge.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    pub cluster_id: u64,
    /// The dialing node; every message on this connection must come from it.
    pub from: NodeId,
    /// The node the dialer meant to reach; a mismatch means a misconfigured address.
    pub to: NodeId,
    /// Fresh for each connection; the listener's proof covers it.
    pub nonce: Nonce,
    /// The dialer's member name and client address (`host:port`), which the leader records
    /// once the dialer has proved itself; empty when it has none to publish.
    pub name: String,
    pub client_address: String,
    /// How long the dialer withholds its vote after it heard from a leader or started, in
    /// milliseconds of its ticks (`(election ticks - 1) * tick`); a listener that reads from
    /// a lease refuses a dialer whose window is shorter than its own (0: not announced).
    pub vote_withheld_ms: u64,
    /// The dialer's own peer address (`host:port`), where the listener can answer a dialer
    /// it holds no member record of (a leader added while the listener was away); empty when
    /// the dialer has none to publish.
    pub peer_address: String,
}

/// The listener's answer to a [`Hello`]: its own nonce and its proof of the peer key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HelloChallenge {
    pub cluster_id: u64,
    pub node_id: NodeId,
    pub nonce: Nonce,
    pub proof: Proof,
}

/// The dialer's proof of the peer key, over both nonces.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HelloProof {
    pub proof: Proof,
}

/// The listener's answer when it accepts a [`Hello`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HelloAccepted {
    pub cluster_id: u64,
    pub node_id: NodeId,
}

/// The listener's answer when it refuses a [`Hello`]; the connection closes after it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HelloRejected {
    /// One sentence for the dialer's log.
    pub reason: String,
}

/// A request one member makes of another over the peer link, or the answer to one: the id
/// pairs them, the payload is the caller's own encoding.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerCall {
    pub id: u64,
    pub payload: Vec<u8>,
}

/// One decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Hello(Hello),
    HelloAccepted(HelloAccepted),
    HelloRejected(HelloRejected),
    Message(Message),
    HelloChallenge(HelloChallenge),
    HelloProof(HelloProof),
    /// Sent by an idle dialer so the listener's idle timeout does not close a healthy link.
    Keepalive,
    /// A request for the receiving member (a client write for the leader).
    Call(PeerCall),
    /// The answer to a [`Frame::Call`] the receiving member made.
    Answer(PeerCall),
}

/// Appends one framed Raft message to `out` and returns the frame's size in bytes.
///
/// On error (`FrameTooLarge`, or an encoding failure) `out` is left as it was.
pub fn encode_message(message: &Message, out: &mut Vec<u8>) -> Result<usize, Error> {
    encode_payload(KIND_MESSAGE, message, out)
}

/// Appends any frame to `out` and returns the frame's size in bytes.
pub fn encode_frame(frame: &Frame, out: &mut Vec<u8>) -> Result<usize, Error> {
    match frame {
        Frame::Hello(hello) => encode_payload(KIND_HELLO, hello, out),
        Frame::HelloAccepted(accepted) => encode_payload(KIND_HELLO_ACCEPTED, accepted, out),
        Frame::HelloRejected(rejected) => encode_payload(KIND_HELLO_REJECTED, rejected, out),
        Frame::Message(message) => encode_payload(KIND_MESSAGE, message, out),
        Frame::HelloChallenge(challenge) => encode_payload(KIND_HELLO_CHALLENGE, challenge, out),
        Frame::HelloProof(proof) => encode_payload(KIND_HELLO_PROOF, proof, out),
        Frame::Keepalive => encode_payload(KIND_KEEPALIVE, &(), out),
        Frame::Call(call) => encode_payload(KIND_CALL, call, out),
        Frame::Answer(answer) => encode_payload(KIND_ANSWER, answer, out),
    }
}

fn encode_payload<T: Serialize>(kind: u8, payload: &T, out: &mut Vec<u8>) -> Result<usize, Error> {
    let start = out.len();
    out.extend_from_slice(&[0; FRAME_HEADER_BYTES]);
    out.push(WIRE_VERSION);
    out.push(kind);
    if let Err(error) = postcard::to_io(payload, &mut *out) {
        out.truncate(start);
        return Err(Error::FrameMalformed {
            reason: format!("cannot encode payload: {error}"),
        });
    }
    let body_start = start + FRAME_HEADER_BYTES;
    let body_bytes = out.len() - body_start;
    if body_bytes > MAX_PEER_FRAME_BYTES {
        out.truncate(start);
        return Err(Error::FrameTooLarge {
            size_bytes: body_bytes as u64,
            max_bytes: MAX_PEER_FRAME_BYTES as u64,
        });
    }
    let checksum = crc32c::crc32c(&out[body_start..]);
    // Fits: checked against MAX_PEER_FRAME_BYTES, which is far below u32::MAX.
    let length = body_bytes as u32;
    out[start..start + 4].copy_from_slice(&length.to_be_bytes());
    out[start + 4..body_start].copy_from_slice(&checksum.to_be_bytes());
    Ok(FRAME_HEADER_BYTES + body_bytes)
}

/// Reads the header fields, refusing lengths that cannot be a valid body.
/// Returns (body length, expected checksum).
pub fn parse_header(header: [u8; FRAME_HEADER_BYTES]) -> Result<(usize, u32), Error> {
    let [l0, l1, l2, l3, c0, c1, c2, c3] = header;
    let body_bytes = u32::from_be_bytes([l0, l1, l2, l3]) as usize;
    let checksum = u32::from_be_bytes([c0, c1, c2, c3]);
    if body_bytes > MAX_PEER_FRAME_BYTES {
        return Err(Error::FrameTooLarge {
            size_bytes: body_bytes as u64,
            max_bytes: MAX_PEER_FRAME_BYTES as u64,
        });
    }
    if body_bytes < BODY_PREAMBLE_BYTES {
        return Err(Error::FrameMalformed {
            reason: format!("body of {body_bytes} bytes is shorter than its preamble"),
        });
    }
    Ok((body_bytes, checksum))
}

/// Checks and decodes a body whose length came from [`parse_header`].
pub fn decode_body(body: &[u8], expected_checksum: u32) -> Result<Frame, Error> {
    let actual = crc32c::crc32c(body);
    if actual != expected_checksum {
        return Err(Error::FrameChecksum {
            expected: expected_checksum,
            actual,
        });
    }
    let [version, kind, payload @ ..] = body else {
        return Err(Error::FrameMalformed {
            reason: "body has no preamble".into(),
        });
    };
    if *version != WIRE_VERSION {
        return Err(Error::FrameVersion {
            version: *version,
            supported: WIRE_VERSION,
        });
    }
    match *kind {
        KIND_HELLO => decode_payload(payload).map(Frame::Hello),
        KIND_HELLO_ACCEPTED => decode_payload(payload).map(Frame::HelloAccepted),
        KIND_HELLO_REJECTED => decode_payload(payload).map(Frame::HelloRejected),
        KIND_MESSAGE => decode_payload(payload).map(Frame::Message),
        KIND_HELLO_CHALLENGE => decode_payload(payload).map(Frame::HelloChallenge),
        KIND_HELLO_PROOF => decode_payload(payload).map(Frame::HelloProof),
        KIND_KEEPALIVE => decode_payload::<()>(payload).map(|()| Frame::Keepalive),
        KIND_CALL => decode_payload(payload).map(Frame::Call),
        KIND_ANSWER => decode_payload(payload).map(Frame::Answer),
        other => Err(Error::FrameMalformed {
            reason: format!("unknown frame kind {other}"),
        }),
    }
}

fn decode_payload<'a, T: Deserialize<'a>>(payload: &'a [u8]) -> Result<T, Error> {
    let (value, rest) =
        postcard::take_from_bytes(payload).map_err(|error| Error::FrameMalformed {
            reason: format!("undecodable body: {error}"),
        })?;
    if !rest.is_empty() {
        return Err(Error::FrameMalformed {
            reason: format!("{} trailing bytes after the payload", rest.len()),
        });
    }
    Ok(value)
}

/// Spare room kept in the read buffer so that a read can take in a whole batch of small
/// frames at once.
const READ_CHUNK_BYTES: usize = 64 * 1024;

/// A read buffer grown past this by a large frame is released once it is empty again.
const READ_BUFFER_RETAINED_BYTES_MAX: usize = 4 * 1024 * 1024;

enum Parsed {
    Frame(Frame),
    /// The buffer holds less than one frame; the frame is this long (0: header incomplete).
    NeedFrameBytes(usize),
}

/// Reads frames from a byte stream through its own buffer: many small frames come out of one
/// read, and a large frame is read straight into room reserved for all of it, so each byte is
/// copied once from the kernel and decoded in place.
///
/// It may read past the frame it returns, so a stream must not be handed elsewhere after use.
pub struct FrameReader<R> {
    stream: R,
    buffer: BytesMut,
    /// Frames with a longer body are refused before their room is reserved.
    frame_bytes_max: usize,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub fn new(stream: R) -> Self {
        FrameReader {
            stream,
            buffer: BytesMut::new(),
            frame_bytes_max: MAX_PEER_FRAME_BYTES,
        }
    }

    /// Lowers (or restores, up to [`MAX_PEER_FRAME_BYTES`]) the largest body accepted from
    /// here on; the handshake reads with [`HANDSHAKE_FRAME_BYTES_MAX`].
    pub fn set_frame_bytes_max(&mut self, frame_bytes_max: usize) {
        self.frame_bytes_max = frame_bytes_max.min(MAX_PEER_FRAME_BYTES);
    }

    /// The next frame, or `None` when the stream ended cleanly between frames.
    ///
    /// Cancel safe: bytes already read stay in the buffer for the next call.
    pub async fn next_frame(&mut self) -> Result<Option<Frame>, Error> {
        loop {
            let frame_bytes = match self.parse_buffered()? {
                Parsed::Frame(frame) => return Ok(Some(frame)),
                Parsed::NeedFrameBytes(frame_bytes) => frame_bytes,
            };
            let read = if frame_bytes > READ_CHUNK_BYTES {
                // Read a large frame's remainder exactly, so the buffer ends on the frame
                // boundary and the next frame starts at the front without being moved.
                let remaining_bytes = (frame_bytes - self.buffer.len()) as u64;
                (&mut self.stream)
                    .take(remaining_bytes)
                    .read_buf(&mut self.buffer)
                    .await?
            } else {
                if self.buffer.capacity() - self.buffer.len() < READ_CHUNK_BYTES / 16 {
                    self.buffer.reserve(READ_CHUNK_BYTES);
                }
                self.stream.read_buf(&mut self.buffer).await?
            };
            if read == 0 {
                return if self.buffer.is_empty() {
                    Ok(None)
                } else {
                    Err(Error::FrameTruncated)
                };
            }
        }
    }

    /// Takes one whole frame off the front of the buffer if there is one; otherwise makes
    /// room for the rest of the frame and says how long the frame is (header only: 0).
    fn parse_buffered(&mut self) -> Result<Parsed, Error> {
        let Some(header) = self.buffer.first_chunk::<FRAME_HEADER_BYTES>() else {
            return Ok(Parsed::NeedFrameBytes(0));
        };
        let (body_bytes, checksum) = parse_header(*header)?;
        if body_bytes > self.frame_bytes_max {
            return Err(Error::FrameTooLarge {
                size_bytes: body_bytes as u64,
                max_bytes: self.frame_bytes_max as u64,
            });
        }
        let frame_bytes = FRAME_HEADER_BYTES + body_bytes;
        if self.buffer.len() < frame_bytes {
            self.buffer.reserve(frame_bytes - self.buffer.len());
            return Ok(Parsed::NeedFrameBytes(frame_bytes));
        }
        let frame = decode_body(&self.buffer[FRAME_HEADER_BYTES..frame_bytes], checksum);
        self.buffer.advance(frame_bytes);
        if self.buffer.is_empty() && self.buffer.capacity() > READ_BUFFER_RETAINED_BYTES_MAX {
            self.buffer = BytesMut::new();
        }
        frame.map(Parsed::Frame)
    }

    /// The underlying stream, for writing answers on the same connection.
    pub fn get_mut(&mut self) -> &mut R {
        &mut self.stream
    }

    /// The reader with `change` applied to its stream, keeping whatever it has buffered: the
    /// bytes it read ahead are still the next ones on the connection.
    pub fn map_stream<S: AsyncRead + Unpin>(self, change: impl FnOnce(R) -> S) -> FrameReader<S> {
        FrameReader {
            stream: change(self.stream),
            buffer: self.buffer,
            frame_bytes_max: self.frame_bytes_max,
        }
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use conclave_raft::{Entry, EntryKind, MessageBody};

    use super::*;

    fn append(entries: usize, payload_bytes: usize) -> Message {
        let entries = (1..=entries as u64)
            .map(|index| Entry {
                term: 3,
                index,
                kind: EntryKind::Normal,
                data: Bytes::from(vec![0xAB; payload_bytes]),
            })
            .collect();
        Message {
            from: 1,
            to: 2,
            term: 3,
            body: MessageBody::Append {
                prev_index: 0,
                prev_term: 0,
                entries,
                commit: 0,
            },
        }
    }

    async fn read_all(bytes: &[u8]) -> Result<Vec<Frame>, Error> {
        let mut reader = FrameReader::new(bytes);
        let mut frames = Vec::new();
        while let Some(frame) = reader.next_frame().await? {
            frames.push(frame);
        }
        Ok(frames)
    }

    fn block_on<F: std::future::Future>(future: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a current-thread runtime builds")
            .block_on(future)
    }

    #[test]
    fn frames_round_trip() {
        let frames = vec![
            Frame::Hello(Hello {
                cluster_id: 7,
                from: 1,
                to: 2,
                nonce: [9; 32],
                name: "a".into(),
                client_address: "127.0.0.1:2379".into(),
                vote_withheld_ms: 140,
                peer_address: "127.0.0.1:2380".into(),
            }),
            Frame::HelloChallenge(HelloChallenge {
                cluster_id: 7,
                node_id: 2,
                nonce: [8; 32],
                proof: [7; 32],
            }),
            Frame::HelloProof(HelloProof { proof: [6; 32] }),
            Frame::Keepalive,
            Frame::Call(PeerCall {
                id: 41,
                payload: vec![1, 2, 3],
            }),
            Frame::Answer(PeerCall {
                id: 41,
                payload: Vec::new(),
            }),
            Frame::HelloAccepted(HelloAccepted {
                cluster_id: 7,
                node_id: 2,
            }),
            Frame::HelloRejected(HelloRejected {
                reason: "wrong cluster".into(),
            }),
            Frame::Message(append(3, 100)),
            Frame::Message(Message {
                from: 2,
                to: 1,
                term: 9,
                body: MessageBody::TimeoutNow,
            }),
        ];
        let mut wire = Vec::new();
        for frame in &frames {
            let size = encode_frame(frame, &mut wire).expect("encodes");
            assert!(size > FRAME_HEADER_BYTES);
        }
        assert_eq!(block_on(read_all(&wire)).expect("decodes"), frames);
    }

    /// Pins the encoding of one message. If this fails, `conclave_raft`'s types or the codec
    /// changed shape: bump WIRE_VERSION and update the bytes.
    #[test]
    fn message_encoding_is_pinned() {
        let message = Message {
            from: 1,
            to: 2,
            term: 5,
            body: MessageBody::Append {
                prev_index: 10,
                prev_term: 4,
                entries: vec![Entry {
                    term: 5,
                    index: 11,
                    kind: EntryKind::Normal,
                    data: Bytes::from_static(b"hi"),
                }],
                commit: 9,
            },
        };
        let mut wire = Vec::new();
        encode_message(&message, &mut wire).expect("encodes");
        let body = [
            WIRE_VERSION,
            KIND_MESSAGE,
            1,
            2,
            5,
            0,
            10,
            4,
            1,
            5,
            11,
            0,
            2,
            b'h',
            b'i',
            9,
        ];
        assert_eq!(&wire[FRAME_HEADER_BYTES..], &body);
        assert_eq!(&wire[..4], &(body.len() as u32).to_be_bytes());
        assert_eq!(&wire[4..8], &crc32c::crc32c(&body).to_be_bytes());

        let response = Message {
            from: 2,
            to: 1,
            term: 5,
            body: MessageBody::AppendResponse {
                index: 11,
                reject: false,
                hint_index: 0,
                hint_term: 0,
                awaited: true,
            },
        };
        let mut wire = Vec::new();
        encode_message(&response, &mut wire).expect("encodes");
        let body = [WIRE_VERSION, KIND_MESSAGE, 2, 1, 5, 1, 11, 0, 0, 0, 1];
        assert_eq!(&wire[FRAME_HEADER_BYTES..], &body);
    }

    #[test]
    fn corruption_is_detected_not_panicked_on() {
        let mut wire = Vec::new();
        encode_message(&append(2, 50), &mut wire).expect("encodes");
        // Any single flipped bit in the body fails the checksum.
        for position in FRAME_HEADER_BYTES..wire.len() {
            let mut bad = wire.clone();
            bad[position] ^= 0x10;
            assert!(matches!(
                block_on(read_all(&bad)),
                Err(Error::FrameChecksum { .. })
            ));
        }
        // Every truncation is reported as such.
        for cut in 1..wire.len() {
            assert!(matches!(
                block_on(read_all(&wire[..cut])),
                Err(Error::FrameTruncated)
            ));
        }
    }

    #[test]
    fn oversize_and_malformed_headers_are_refused() {
        let mut header = [0u8; FRAME_HEADER_BYTES];
        header[..4].copy_from_slice(&(MAX_PEER_FRAME_BYTES as u32 + 1).to_be_bytes());
        assert!(matches!(
            parse_header(header),
            Err(Error::FrameTooLarge { .. })
        ));
        header[..4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(
            parse_header(header),
            Err(Error::FrameTooLarge { .. })
        ));
        header[..4].copy_from_slice(&1u32.to_be_bytes());
        assert!(matches!(
            parse_header(header),
            Err(Error::FrameMalformed { .. })
        ));
    }

    #[test]
    fn wrong_version_kind_and_garbage_bodies_are_refused() {
        let check = |body: &[u8]| decode_body(body, crc32c::crc32c(body));
        assert!(matches!(
            check(&[WIRE_VERSION + 1, KIND_MESSAGE]),
            Err(Error::FrameVersion { .. })
        ));
        assert!(matches!(
            check(&[WIRE_VERSION, 99]),
            Err(Error::FrameMalformed { .. })
        ));
        assert!(matches!(
            check(&[WIRE_VERSION, KIND_MESSAGE]),
            Err(Error::FrameMalformed { .. })
        ));
        // A valid message followed by a stray byte.
        let mut wire = Vec::new();
        encode_message(&append(1, 1), &mut wire).expect("encodes");
        let mut body = wire[FRAME_HEADER_BYTES..].to_vec();
        body.push(0);
        assert!(matches!(check(&body), Err(Error::FrameMalformed { .. })));
        // Pseudo-random bodies with valid checksums never panic the decoder.
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for length in 0..2000usize {
            let mut body = vec![WIRE_VERSION, KIND_MESSAGE];
            for _ in 0..length % 64 {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                body.push(state as u8);
            }
            let _ = check(&body);
        }
    }

    #[test]
    fn oversize_message_is_refused_before_sending() {
        let mut wire = vec![1, 2, 3];
        let huge = append(1, MAX_PEER_FRAME_BYTES);
        assert!(matches!(
            encode_message(&huge, &mut wire),
            Err(Error::FrameTooLarge { .. })
        ));
        assert_eq!(
            wire,
            vec![1, 2, 3],
            "a refused frame leaves the buffer untouched"
        );
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        fn message() -> impl Strategy<Value = Message> {
            let body = prop_oneof![
                (
                    any::<u64>(),
                    any::<u64>(),
                    any::<u64>(),
                    proptest::collection::vec(
                        (
                            any::<u64>(),
                            any::<u64>(),
                            proptest::collection::vec(any::<u8>(), 0..64)
                        ),
                        0..4
                    )
                )
                    .prop_map(|(prev_index, prev_term, commit, entries)| {
                        MessageBody::Append {
                            prev_index,
                            prev_term,
                            commit,
                            entries: entries
                                .into_iter()
                                .map(|(term, index, data)| Entry {
                                    term,
                                    index,
                                    kind: EntryKind::Normal,
                                    data: Bytes::from(data),
                                })
                                .collect(),
                        }
                    }),
                (
                    any::<u64>(),
                    any::<bool>(),
                    any::<u64>(),
                    any::<u64>(),
                    any::<bool>()
                )
                    .prop_map(|(index, reject, hint_index, hint_term, awaited)| {
                        MessageBody::AppendResponse {
                            index,
                            reject,
                            hint_index,
                            hint_term,
                            awaited,
                        }
                    }),
                (
                    any::<u64>(),
                    proptest::option::of(proptest::collection::vec(any::<u8>(), 0..16))
                )
                    .prop_map(|(commit, context)| MessageBody::Heartbeat {
                        commit,
                        context: context.map(Bytes::from),
                    }),
                Just(MessageBody::TimeoutNow),
            ];
            (any::<u64>(), any::<u64>(), any::<u64>(), body).prop_map(|(from, to, term, body)| {
                Message {
                    from,
                    to,
                    term,
                    body,
                }
            })
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]

            #[test]
            fn messages_round_trip(message in message()) {
                let mut wire = Vec::new();
                encode_message(&message, &mut wire).expect("encodes");
                let frames = block_on(read_all(&wire)).expect("decodes");
                prop_assert_eq!(frames, vec![Frame::Message(message)]);
            }

            /// Random bytes on the stream, with or without a plausible header in front: the
            /// reader returns frames or an error, never panics, and never reserves room for a
            /// body longer than its limit.
            #[test]
            fn random_streams_never_panic_or_overreserve(
                length in any::<u32>(),
                bytes in proptest::collection::vec(any::<u8>(), 0..512),
                handshake in any::<bool>(),
            ) {
                let mut wire = length.to_be_bytes().to_vec();
                wire.extend_from_slice(&bytes);
                for stream in [&wire[..], &bytes[..]] {
                    let mut reader = FrameReader::new(stream);
                    let limit = if handshake { HANDSHAKE_FRAME_BYTES_MAX } else { MAX_PEER_FRAME_BYTES };
                    reader.set_frame_bytes_max(limit);
                    let _ = block_on(async {
                        while reader.next_frame().await?.is_some() {}
                        Ok::<_, Error>(())
                    });
                    prop_assert!(
                        reader.buffer.capacity() <= limit + FRAME_HEADER_BYTES + READ_CHUNK_BYTES,
                        "reserved {} bytes for a stream of {}", reader.buffer.capacity(), stream.len()
                    );
                }
            }

            /// Valid frames with bytes of the body changed and the checksum made to match, so
            /// the decoder itself (not the checksum) sees the damage.
            #[test]
            fn mutated_bodies_never_panic(
                message in message(),
                mutations in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
                cut in any::<usize>(),
            ) {
                let mut wire = Vec::new();
                encode_message(&message, &mut wire).expect("encodes");
                let mut body = wire[FRAME_HEADER_BYTES..].to_vec();
                for (position, value) in mutations {
                    let position = position % body.len();
                    body[position] = value;
                }
                let _ = decode_body(&body, crc32c::crc32c(&body));
                body.truncate(cut % (body.len() + 1));
                let _ = decode_body(&body, crc32c::crc32c(&body));
            }
        }

        #[test]
        fn a_handshake_reader_refuses_a_large_frame_before_reserving_it() {
            let mut wire = (MAX_PEER_FRAME_BYTES as u32).to_be_bytes().to_vec();
            wire.extend_from_slice(&[0; 4]);
            let mut reader = FrameReader::new(&wire[..]);
            reader.set_frame_bytes_max(HANDSHAKE_FRAME_BYTES_MAX);
            assert!(matches!(
                block_on(reader.next_frame()),
                Err(Error::FrameTooLarge { .. })
            ));
            assert!(reader.buffer.capacity() < 2 * READ_CHUNK_BYTES);
        }
    }
}
