//! Record framing and encoding.
//!
//! ```text
//! frame:  [body_len: u32 LE][crc: u32 LE][body: body_len bytes]
//!         crc = CRC32C(body_len bytes ++ body), so a torn length is caught as well as a torn body
//! body:   [kind: u8][seq: u64 LE][fields, LE]
//!   1 Checkpoint  hard_state, snapshot_index u64, snapshot_term u64, last_index u64
//!   2 HardState   hard_state
//!   3 Entry       term u64, index u64, entry_kind u8 (0 normal, 1 conf change), data (the rest)
//!   4 Snapshot    index u64, term u64, keep_suffix u8
//! hard_state:     term u64, has_vote u8, vote u64, commit u64
//! ```
//!
//! `seq` numbers every record of the log, one more than the record before it, across
//! segments. Replay insists on it, so a duplicated, lost or reordered record is never mistaken
//! for a legitimate one.

use bytes::Bytes;
use conclave_raft::{Entry, EntryKind, HardState, Index, Term};

/// Bytes before a record body: its length and checksum.
pub const FRAME_HEADER_BYTES: usize = 8;
/// The largest body a record may have. Bounds what a corrupt length field can make us read.
pub const RECORD_BYTES_MAX: usize = 64 << 20;

const KIND_CHECKPOINT: u8 = 1;
const KIND_HARD_STATE: u8 = 2;
const KIND_ENTRY: u8 = 3;
const KIND_SNAPSHOT: u8 = 4;
const HARD_STATE_BYTES: usize = 25;
/// kind + seq: the part every body starts with.
const BODY_PREFIX_BYTES: usize = 9;
/// The body of an entry record, without its data.
pub const ENTRY_BODY_FIXED_BYTES: usize = BODY_PREFIX_BYTES + 17;

/// A decoded record. Entry data borrows from the buffer it was read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record<'a> {
    /// First record of every segment: the log's state when the segment was opened.
    Checkpoint {
        hard_state: HardState,
        snapshot_index: Index,
        snapshot_term: Term,
        last_index: Index,
    },
    HardState(HardState),
    Entry {
        term: Term,
        index: Index,
        kind: EntryKind,
        data: &'a [u8],
    },
    /// The log was replaced up to `index` by a durable snapshot file; entries after `index`
    /// survive only if `keep_suffix` (the log agreed with the snapshot at `index`).
    Snapshot {
        index: Index,
        term: Term,
        keep_suffix: bool,
    },
}

impl Record<'_> {
    /// Builds the record of an entry.
    pub fn entry(entry: &Entry) -> Record<'_> {
        Record::Entry {
            term: entry.term,
            index: entry.index,
            kind: entry.kind,
            data: &entry.data,
        }
    }

    /// The body length this record encodes to.
    pub fn body_len(&self) -> usize {
        BODY_PREFIX_BYTES
            + match self {
                Record::Checkpoint { .. } => HARD_STATE_BYTES + 24,
                Record::HardState(_) => HARD_STATE_BYTES,
                Record::Entry { data, .. } => 17 + data.len(),
                Record::Snapshot { .. } => 17,
            }
    }
}

/// Appends the frame of `record` numbered `seq` to `out`.
pub fn encode(seq: u64, record: &Record<'_>, out: &mut Vec<u8>) {
    let body_len = record.body_len();
    assert!(
        body_len <= RECORD_BYTES_MAX,
        "record of {body_len} bytes passed the size check"
    );
    let start = out.len();
    out.extend_from_slice(&(body_len as u32).to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    let body_start = out.len();
    match record {
        Record::Checkpoint {
            hard_state,
            snapshot_index,
            snapshot_term,
            last_index,
        } => {
            put_prefix(out, KIND_CHECKPOINT, seq);
            put_hard_state(out, hard_state);
            out.extend_from_slice(&snapshot_index.to_le_bytes());
            out.extend_from_slice(&snapshot_term.to_le_bytes());
            out.extend_from_slice(&last_index.to_le_bytes());
        }
        Record::HardState(hard_state) => {
            put_prefix(out, KIND_HARD_STATE, seq);
            put_hard_state(out, hard_state);
        }
        Record::Entry {
            term,
            index,
            kind,
            data,
        } => {
            put_prefix(out, KIND_ENTRY, seq);
            out.extend_from_slice(&term.to_le_bytes());
            out.extend_from_slice(&index.to_le_bytes());
            out.push(match kind {
                EntryKind::Normal => 0,
                EntryKind::ConfChange => 1,
            });
            out.extend_from_slice(data);
        }
        Record::Snapshot {
            index,
            term,
            keep_suffix,
        } => {
            put_prefix(out, KIND_SNAPSHOT, seq);
            out.extend_from_slice(&index.to_le_bytes());
            out.extend_from_slice(&term.to_le_bytes());
            out.push(u8::from(*keep_suffix));
        }
    }
    assert_eq!(
        out.len() - body_start,
        body_len,
        "record body length mismatch"
    );
    let crc = crc32c::crc32c_append(crc32c::crc32c(&out[start..start + 4]), &out[body_start..]);
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
}

fn put_prefix(out: &mut Vec<u8>, kind: u8, seq: u64) {
    out.push(kind);
    out.extend_from_slice(&seq.to_le_bytes());
}

fn put_hard_state(out: &mut Vec<u8>, hard_state: &HardState) {
    out.extend_from_slice(&hard_state.term.to_le_bytes());
    out.push(u8::from(hard_state.vote.is_some()));
    out.extend_from_slice(&hard_state.vote.unwrap_or(0).to_le_bytes());
    out.extend_from_slice(&hard_state.commit.to_le_bytes());
}

/// What the bytes at some offset hold.
#[derive(Debug, PartialEq, Eq)]
pub enum Frame<'a> {
    /// A frame whose checksum matches; `frame_len` counts header and body.
    Valid { body: &'a [u8], frame_len: usize },
    /// A zero length: no record was ever written here (preallocated or never-written space).
    Zero,
    /// The frame runs past the end of the bytes.
    Incomplete,
    /// The length is impossible or the checksum does not match.
    Invalid(&'static str),
}

/// Reads the frame at the start of `bytes`.
pub fn read_frame(bytes: &[u8]) -> Frame<'_> {
    let Some(header) = bytes.get(..FRAME_HEADER_BYTES) else {
        return if bytes.iter().all(|&b| b == 0) {
            Frame::Zero
        } else {
            Frame::Incomplete
        };
    };
    let body_len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as usize;
    let crc = u32::from_le_bytes([header[4], header[5], header[6], header[7]]);
    if body_len == 0 {
        return Frame::Zero;
    }
    if !(BODY_PREFIX_BYTES..=RECORD_BYTES_MAX).contains(&body_len) {
        return Frame::Invalid("impossible record length");
    }
    let Some(body) = bytes.get(FRAME_HEADER_BYTES..FRAME_HEADER_BYTES + body_len) else {
        return Frame::Incomplete;
    };
    if crc32c::crc32c_append(crc32c::crc32c(&header[..4]), body) != crc {
        return Frame::Invalid("checksum mismatch");
    }
    Frame::Valid {
        body,
        frame_len: FRAME_HEADER_BYTES + body_len,
    }
}

/// Decodes a checksummed body. Errors mean the writer and reader disagree on the format: the
/// checksum matched, so these bytes are what was written.
pub fn decode_body(body: &[u8]) -> Result<(u64, Record<'_>), &'static str> {
    let mut reader = Reader { bytes: body };
    let kind = reader.u8()?;
    let seq = reader.u64()?;
    let record = match kind {
        KIND_CHECKPOINT => Record::Checkpoint {
            hard_state: reader.hard_state()?,
            snapshot_index: reader.u64()?,
            snapshot_term: reader.u64()?,
            last_index: reader.u64()?,
        },
        KIND_HARD_STATE => Record::HardState(reader.hard_state()?),
        KIND_ENTRY => {
            let term = reader.u64()?;
            let index = reader.u64()?;
            let kind = match reader.u8()? {
                0 => EntryKind::Normal,
                1 => EntryKind::ConfChange,
                _ => return Err("unknown entry kind"),
            };
            return Ok((
                seq,
                Record::Entry {
                    term,
                    index,
                    kind,
                    data: reader.bytes,
                },
            ));
        }
        KIND_SNAPSHOT => Record::Snapshot {
            index: reader.u64()?,
            term: reader.u64()?,
            keep_suffix: match reader.u8()? {
                0 => false,
                1 => true,
                _ => return Err("invalid snapshot flag"),
            },
        },
        _ => return Err("unknown record kind"),
    };
    if !reader.bytes.is_empty() {
        return Err("trailing bytes after record");
    }
    Ok((seq, record))
}

/// Decodes an entry record into an owned entry (copying its data once).
pub fn decode_entry(body: &[u8]) -> Result<(u64, Entry), &'static str> {
    match decode_body(body)? {
        (
            seq,
            Record::Entry {
                term,
                index,
                kind,
                data,
            },
        ) => Ok((
            seq,
            Entry {
                term,
                index,
                kind,
                data: Bytes::copy_from_slice(data),
            },
        )),
        _ => Err("expected an entry record"),
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], &'static str> {
        let (head, rest) = self
            .bytes
            .split_first_chunk::<N>()
            .ok_or("record too short")?;
        self.bytes = rest;
        Ok(*head)
    }

    fn u8(&mut self) -> Result<u8, &'static str> {
        Ok(self.take::<1>()?[0])
    }

    fn u64(&mut self) -> Result<u64, &'static str> {
        Ok(u64::from_le_bytes(self.take::<8>()?))
    }

    fn hard_state(&mut self) -> Result<HardState, &'static str> {
        let term = self.u64()?;
        let has_vote = self.u8()?;
        let vote = self.u64()?;
        let commit = self.u64()?;
        let vote = match has_vote {
            0 => None,
            1 => Some(vote),
            _ => return Err("invalid vote flag"),
        };
        Ok(HardState { term, vote, commit })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_record_kind_round_trips_and_any_flipped_bit_is_caught() {
        let hard_state = HardState {
            term: 7,
            vote: Some(3),
            commit: 5,
        };
        let records = [
            Record::Checkpoint {
                hard_state,
                snapshot_index: 4,
                snapshot_term: 2,
                last_index: 9,
            },
            Record::HardState(HardState {
                term: 1,
                vote: None,
                commit: 0,
            }),
            Record::Entry {
                term: 3,
                index: 8,
                kind: EntryKind::ConfChange,
                data: b"abc",
            },
            Record::Snapshot {
                index: 4,
                term: 2,
                keep_suffix: true,
            },
        ];
        for (seq, record) in records.iter().enumerate() {
            let mut out = Vec::new();
            encode(seq as u64, record, &mut out);
            let Frame::Valid { body, frame_len } = read_frame(&out) else {
                panic!("invalid")
            };
            assert_eq!(frame_len, out.len());
            assert_eq!(decode_body(body), Ok((seq as u64, record.clone())));
            for bit in 0..out.len() * 8 {
                let mut damaged = out.clone();
                damaged[bit / 8] ^= 1 << (bit % 8);
                assert!(
                    !matches!(read_frame(&damaged), Frame::Valid { .. }),
                    "bit {bit}"
                );
            }
            for cut in 0..out.len() {
                assert!(!matches!(read_frame(&out[..cut]), Frame::Valid { .. }));
            }
        }
    }
}
