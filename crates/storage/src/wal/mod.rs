//! The write-ahead log: records in a chain of segment files.
//!
//! ```text
//!  append_record ─> encode ─> pending buffer ─flush─> active segment (write) ─sync─> durable
//!                      └──> LogModel::apply (the same function recovery replays)
//!  segments: [seg first_seq=1][seg first_seq=N]...[active]   each starts with a Checkpoint
//! ```
//!
//! Appends only fill a buffer; [`Wal::sync`] writes it and calls `fdatasync` once, which is
//! group commit: however many records were appended since the last sync, one sync makes them
//! all durable. Rotation syncs the old segment before the new one exists, so every segment
//! but the last is complete, which is what lets recovery treat damage anywhere but the end of
//! the last segment as corruption rather than as a torn write.

pub mod model;
pub mod record;
pub mod segment;

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use conclave_raft::{Entry, Index};

use crate::disk::{Disk, DiskFile, read_exact_at, read_to_end};
use crate::error::{Error, FatalError, Result};
use model::{Location, LogModel};
use record::{FRAME_HEADER_BYTES, Frame, RECORD_BYTES_MAX, Record};
use segment::{SEGMENT_HEADER_BYTES, TEMP_SUFFIX};

/// How the log lays out and writes its files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WalOptions {
    /// A segment is rotated once the next record would take it past this size.
    pub segment_size_bytes: u64,
    /// Reserve each segment's full size when creating it, and write zeros ahead of the
    /// records (see [`ZERO_AHEAD_BYTES`]).
    pub preallocate: bool,
    /// Appended records are written to the file (not synced) once this many bytes wait.
    pub write_buffer_bytes: usize,
    /// With preallocation, the smallest write of records that starts a new stretch of zeros
    /// ahead of them (see [`ZERO_AHEAD_WRITE_BYTES_MIN`], the default).
    pub zero_ahead_write_bytes_min: usize,
}

impl Default for WalOptions {
    fn default() -> Self {
        WalOptions {
            segment_size_bytes: 64 << 20,
            preallocate: true,
            write_buffer_bytes: 1 << 20,
            zero_ahead_write_bytes_min: ZERO_AHEAD_WRITE_BYTES_MIN,
        }
    }
}

/// With preallocation, how far past the end of its records the log keeps the file written
/// with zeros once it is under load. A reserved block that was never written is marked
/// unwritten, and the first `fdatasync` after a write into it must also record the block as
/// written: on ext4 that is one more metadata write per sync whenever a sync's records reach a
/// new block (under load, nearly every sync). Zeros written ahead, a stretch at a time, pay
/// that once per stretch; alone on this project's machine, a 4 KiB write and `fdatasync` took
/// 128-134 µs and 46-55 µs of CPU with 256 KiB of zeros ahead against 162-201 µs and 60-83 µs
/// without (docs/storage.md). The sync that carries a stretch writes 256 KiB more.
pub const ZERO_AHEAD_BYTES: u64 = 256 << 10;
/// The smallest write of records that starts a new stretch of zeros by default: one
/// file-system block. A write this large reaches a new block every time, so the stretch pays
/// for itself; a quiet member, whose syncs carry a few hundred bytes and reach a new block
/// once in a dozen, would gain little from a stretch and would put its 256 KiB on one
/// request's latency (a 1-client benchmark's p99.9 went above etcd's when every write could
/// start one: docs/performance.md).
pub const ZERO_AHEAD_WRITE_BYTES_MIN: usize = 4 << 10;
/// Zeros written per call when the log writes ahead.
static ZERO_CHUNK: [u8; 64 << 10] = [0; 64 << 10];

/// The largest segment size the options may ask for.
pub const SEGMENT_SIZE_BYTES_MAX: u64 = 1 << 30;
/// The largest segment file recovery reads into memory: a full segment plus one oversized
/// record and its checkpoint. A longer file was not written by this code; refusing it keeps a
/// damaged or planted file from making recovery allocate without bound.
pub const SEGMENT_FILE_BYTES_MAX: u64 = SEGMENT_SIZE_BYTES_MAX + 2 * (RECORD_BYTES_MAX as u64 + 64);

impl WalOptions {
    pub fn validate(&self) -> Result<()> {
        if !(4096..=SEGMENT_SIZE_BYTES_MAX).contains(&self.segment_size_bytes) {
            return Err(Error::InvalidOptions(format!(
                "segment_size_bytes must be between 4096 and {SEGMENT_SIZE_BYTES_MAX}"
            )));
        }
        if self.write_buffer_bytes == 0 {
            return Err(Error::InvalidOptions(
                "write_buffer_bytes must be positive".into(),
            ));
        }
        Ok(())
    }
}

struct Segment {
    first_seq: u64,
    path: PathBuf,
    file: Box<dyn DiskFile>,
    /// Bytes of header and records written to the file (the rest of the file is zeros).
    written_bytes: u64,
    /// The file holds records or written zeros up to here (see [`ZERO_AHEAD_BYTES`]); never
    /// below `written_bytes`, so zeros never land on a record.
    zeroed_bytes: u64,
    record_count: u64,
    /// The log's last index when this segment's checkpoint was written; `u64::MAX` while the
    /// segment has no checkpoint yet.
    checkpoint_last_index: Index,
}

impl Segment {
    /// Writes zeros from the end of the records to [`ZERO_AHEAD_BYTES`] past it (not past the
    /// segment's size).
    fn write_zeros_ahead(&mut self, segment_size_bytes: u64) -> std::io::Result<()> {
        let mut at = self.written_bytes.max(self.zeroed_bytes);
        let until = (self.written_bytes + ZERO_AHEAD_BYTES).min(segment_size_bytes);
        while at < until {
            let len = (until - at).min(ZERO_CHUNK.len() as u64) as usize;
            self.file.write_at(at, &ZERO_CHUNK[..len])?;
            at += len as u64;
        }
        self.zeroed_bytes = at;
        assert!(
            self.zeroed_bytes >= self.written_bytes,
            "the log's zeros start past its records"
        );
        Ok(())
    }
}

/// What recovery found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WalRecovery {
    pub segment_count: usize,
    pub record_count: u64,
    /// A damaged end of the last segment that recovery cut off (a torn final write, or a last
    /// record that fails its checksum); the node logs it.
    pub dropped_tail: Option<DroppedTail>,
}

/// The end of the log that recovery dropped: what, where and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DroppedTail {
    /// The segment that was cut.
    pub file: PathBuf,
    /// Where the segment now ends: just after the last intact record.
    pub offset_bytes: u64,
    /// Records dropped, counted by their length fields (at least the damaged one).
    pub records: u64,
    /// Bytes dropped: from `offset_bytes` to the last non-zero byte of the segment.
    pub bytes: u64,
    /// Why the first dropped record failed (checksum mismatch, incomplete record, ...).
    pub reason: String,
}

/// The write-ahead log over some [`Disk`].
pub struct Wal {
    disk: Arc<dyn Disk>,
    dir: PathBuf,
    options: WalOptions,
    /// Invariant: non-empty; the last one is the active segment.
    segments: VecDeque<Segment>,
    /// Encoded records after the active segment's `written_bytes`.
    pending: Vec<u8>,
    next_seq: u64,
    /// Every record with a smaller or equal sequence number is durable.
    durable_seq: u64,
    model: LogModel,
    /// Set after a failed write or sync: the file's state is unknown, so nothing more is written.
    failure: Option<String>,
}

impl Wal {
    /// Opens (recovering) or creates the log in `dir`. Corruption that a torn final write
    /// cannot explain is an error naming the file and offset; see [`crate::repair`].
    pub fn open(
        disk: Arc<dyn Disk>,
        dir: &Path,
        options: WalOptions,
    ) -> Result<(Wal, WalRecovery)> {
        options.validate()?;
        disk.create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let seqs = list_segments(disk.as_ref(), dir)?;
        let mut wal = Wal {
            disk,
            dir: dir.to_path_buf(),
            options,
            segments: VecDeque::new(),
            pending: Vec::new(),
            next_seq: 1,
            durable_seq: 0,
            model: LogModel::uninitialised(),
            failure: None,
        };
        let mut recovery = WalRecovery {
            segment_count: seqs.len(),
            ..WalRecovery::default()
        };
        for (position, &first_seq) in seqs.iter().enumerate() {
            let is_last = position + 1 == seqs.len();
            wal.recover_segment(first_seq, is_last, &mut recovery)?;
        }
        if wal.segments.is_empty() {
            wal.model = LogModel::fresh();
            wal.create_segment()?;
        } else if !wal.model.is_initialised() {
            let first = &wal.segments[0];
            if first.first_seq != 1 {
                return Err(Error::corrupt(
                    &first.path,
                    0,
                    "log has no checkpoint: earlier segments are missing",
                ));
            }
            wal.model = LogModel::fresh();
        }
        // A process that died between a write and its sync leaves those bytes in the page
        // cache, where recovery reads them back; the node may acknowledge or vote on them as
        // soon as it runs, so they are made durable first. Earlier segments were synced when
        // the next one was made.
        if let Some(last) = wal.segments.back_mut() {
            last.file
                .sync_data()
                .map_err(|e| Error::io(&last.path, e))?;
        }
        wal.durable_seq = wal.next_seq - 1;
        Ok((wal, recovery))
    }

    fn recover_segment(
        &mut self,
        first_seq: u64,
        is_last: bool,
        recovery: &mut WalRecovery,
    ) -> Result<()> {
        let path = segment::segment_path(&self.dir, first_seq);
        let mut file = self.disk.open(&path).map_err(|e| Error::io(&path, e))?;
        let file_len = file.len_bytes().map_err(|e| Error::io(&path, e))?;
        if file_len > SEGMENT_FILE_BYTES_MAX {
            let reason = format!(
                "segment of {file_len} bytes is longer than any segment this code writes ({SEGMENT_FILE_BYTES_MAX})"
            );
            return Err(Error::corrupt(&path, 0, reason));
        }
        let bytes = read_to_end(file.as_ref()).map_err(|e| Error::io(&path, e))?;
        let header_seq =
            segment::decode_header(&bytes).map_err(|reason| Error::corrupt(&path, 0, reason))?;
        if header_seq != first_seq {
            return Err(Error::corrupt(
                &path,
                0,
                format!("header says first seq {header_seq}"),
            ));
        }
        if !self.segments.is_empty() && first_seq != self.next_seq {
            let reason = format!(
                "segment starts at record {first_seq} but the previous segment ends before record {}: records or a segment are missing",
                self.next_seq
            );
            return Err(Error::corrupt(&path, 0, reason));
        }
        self.next_seq = first_seq;
        let mut offset = SEGMENT_HEADER_BYTES;
        let mut record_count = 0u64;
        let mut checkpoint_last_index = u64::MAX;
        loop {
            let reason = match record::read_frame(&bytes[offset..]) {
                Frame::Valid { body, frame_len } => {
                    let (seq, record) = record::decode_body(body)
                        .map_err(|reason| Error::corrupt(&path, offset as u64, reason))?;
                    if seq != self.next_seq {
                        let reason = format!(
                            "record {seq} where record {} belongs (duplicated or misplaced)",
                            self.next_seq
                        );
                        return Err(Error::corrupt(&path, offset as u64, reason));
                    }
                    let is_checkpoint = matches!(record, Record::Checkpoint { .. });
                    if record_count == 0 && !is_checkpoint {
                        return Err(Error::corrupt(
                            &path,
                            offset as u64,
                            "segment does not start with a checkpoint",
                        ));
                    }
                    let location = Location {
                        term: 0,
                        segment_first_seq: first_seq,
                        offset_bytes: offset as u64,
                        frame_len_bytes: frame_len as u32,
                    };
                    self.model
                        .apply(&record, location)
                        .map_err(|reason| Error::corrupt(&path, offset as u64, reason))?;
                    if record_count == 0 {
                        checkpoint_last_index = self.model.last_index();
                    }
                    record_count += 1;
                    self.next_seq += 1;
                    offset += frame_len;
                    continue;
                }
                Frame::Zero => "unwritten space",
                Frame::Incomplete => "incomplete record",
                Frame::Invalid(reason) => reason,
            };
            if bytes[offset..].iter().all(|&b| b == 0) {
                break; // Clean end: nothing was ever written past here.
            }
            if !is_last {
                return Err(Error::corrupt(
                    &path,
                    offset as u64,
                    format!("{reason} in a completed segment"),
                ));
            }
            if valid_record_after(&bytes, offset + 1) {
                let reason = format!("{reason}, yet valid records follow: not a torn final write");
                return Err(Error::corrupt(&path, offset as u64, reason));
            }
            // A torn final write: cut it off so new records follow the last valid one.
            let valid_len = offset as u64;
            let dropped = dropped_extent(&bytes[offset..]);
            file.set_len(valid_len).map_err(|e| Error::io(&path, e))?;
            if self.options.preallocate {
                file.preallocate(self.options.segment_size_bytes)
                    .map_err(|e| Error::io(&path, e))?;
            }
            file.sync_data().map_err(|e| Error::io(&path, e))?;
            recovery.dropped_tail = Some(DroppedTail {
                file: path.clone(),
                offset_bytes: valid_len,
                records: dropped.0,
                bytes: dropped.1,
                reason: reason.to_string(),
            });
            break;
        }
        recovery.record_count += record_count;
        self.segments.push_back(Segment {
            first_seq,
            path,
            file,
            written_bytes: offset as u64,
            zeroed_bytes: offset as u64,
            record_count,
            checkpoint_last_index,
        });
        Ok(())
    }

    /// What the records say the log holds.
    pub fn model(&self) -> &LogModel {
        &self.model
    }

    /// The sequence number of the last record appended (durable or not).
    pub fn last_seq(&self) -> u64 {
        self.next_seq - 1
    }

    /// Every record up to this sequence number is durable.
    pub fn durable_seq(&self) -> u64 {
        self.durable_seq
    }

    /// Bytes appended but not yet handed to the file system.
    pub fn pending_bytes(&self) -> usize {
        self.pending.len()
    }

    /// The segment files, oldest first.
    pub fn segment_paths(&self) -> Vec<PathBuf> {
        self.segments
            .iter()
            .map(|segment| segment.path.clone())
            .collect()
    }

    fn check_usable(&self) -> Result<()> {
        match &self.failure {
            Some(reason) => Err(Error::Fatal(FatalError::Stopped(reason.clone()))),
            None => Ok(()),
        }
    }

    /// Remembers an I/O failure: after a failed write or fsync the file's contents are unknown
    /// (a retried fsync can report success for lost pages), so the log stops.
    fn fail(&mut self, error: Error) -> Error {
        self.failure = Some(error.to_string());
        error
    }

    fn active(&mut self) -> &mut Segment {
        self.segments
            .back_mut()
            .expect("invariant: the log always has an active segment")
    }

    /// Appends one record to the buffer (rotating first if the segment is full) and returns
    /// its sequence number. Durable only after a later [`Wal::sync`].
    pub fn append_record(&mut self, record: &Record<'_>) -> Result<u64> {
        self.check_usable()?;
        let body_len = record.body_len();
        if body_len > RECORD_BYTES_MAX {
            let limit_bytes = RECORD_BYTES_MAX as u64;
            return Err(Error::RecordTooLarge {
                size_bytes: body_len as u64,
                limit_bytes,
            });
        }
        let frame_len = (FRAME_HEADER_BYTES + body_len) as u64;
        let segment_size = self.options.segment_size_bytes;
        let pending_len = self.pending.len() as u64;
        let active = self.active();
        let end = active.written_bytes + pending_len;
        if active.record_count > 0 && end + frame_len > segment_size {
            self.rotate()?;
        }
        if self.active().record_count == 0 {
            let checkpoint = self.model.checkpoint();
            self.active().checkpoint_last_index = self.model.last_index();
            self.push_record(&checkpoint);
        }
        let seq = self.push_record(record);
        if self.pending.len() >= self.options.write_buffer_bytes {
            self.flush()?;
        }
        Ok(seq)
    }

    fn push_record(&mut self, record: &Record<'_>) -> u64 {
        let seq = self.next_seq;
        let active = self
            .segments
            .back()
            .expect("invariant: the log always has an active segment");
        let offset = active.written_bytes + self.pending.len() as u64;
        let segment_first_seq = active.first_seq;
        let before = self.pending.len();
        record::encode(seq, record, &mut self.pending);
        let frame_len_bytes = (self.pending.len() - before) as u32;
        let location = Location {
            term: 0,
            segment_first_seq,
            offset_bytes: offset,
            frame_len_bytes,
        };
        if let Err(reason) = self.model.apply(record, location) {
            panic!("the log writer produced an invalid record: {reason}");
        }
        self.active().record_count += 1;
        self.next_seq += 1;
        seq
    }

    /// Hands buffered records to the file system (not durable yet).
    pub fn flush(&mut self) -> Result<()> {
        self.check_usable()?;
        if self.pending.is_empty() {
            return Ok(());
        }
        let pending = std::mem::take(&mut self.pending);
        let zero_ahead = self.options.preallocate;
        let write_bytes_min = self.options.zero_ahead_write_bytes_min;
        let segment_size = self.options.segment_size_bytes;
        let active = self.active();
        let mut result = active.file.write_at(active.written_bytes, &pending);
        active.written_bytes += pending.len() as u64;
        active.zeroed_bytes = active.zeroed_bytes.max(active.written_bytes);
        if result.is_ok()
            && zero_ahead
            && pending.len() >= write_bytes_min
            && active.written_bytes + write_bytes_min as u64 >= active.zeroed_bytes
        {
            result = active.write_zeros_ahead(segment_size);
        }
        let path = active.path.clone();
        self.pending = pending;
        self.pending.clear();
        result.map_err(|e| self.fail(Error::io(path, e)))
    }

    /// Makes every appended record durable with one `fdatasync`; returns the durable sequence.
    pub fn sync(&mut self) -> Result<u64> {
        self.flush()?;
        if self.durable_seq == self.last_seq() {
            return Ok(self.durable_seq);
        }
        let active = self.active();
        let path = active.path.clone();
        if let Err(e) = active.file.sync_data() {
            return Err(self.fail(Error::io(path, e)));
        }
        self.durable_seq = self.last_seq();
        Ok(self.durable_seq)
    }

    fn rotate(&mut self) -> Result<()> {
        self.sync()?;
        self.create_segment()
    }

    /// Creates the next segment under a temporary name and renames it into place only once
    /// its header and preallocation are durable, so a segment file is never half made.
    fn create_segment(&mut self) -> Result<()> {
        let first_seq = self.next_seq;
        let path = segment::segment_path(&self.dir, first_seq);
        let temp_path = self.dir.join(format!(
            "{}{TEMP_SUFFIX}",
            segment::segment_file_name(first_seq)
        ));
        let result = (|| -> std::io::Result<Box<dyn DiskFile>> {
            let mut file = self.disk.create(&temp_path)?;
            file.write_at(0, &segment::encode_header(first_seq))?;
            if self.options.preallocate {
                file.preallocate(self.options.segment_size_bytes)?;
            }
            file.sync_data()?;
            self.disk.rename(&temp_path, &path)?;
            self.disk.sync_dir(&self.dir)?;
            Ok(file)
        })();
        let file = result.map_err(|e| self.fail(Error::io(&path, e)))?;
        self.segments.push_back(Segment {
            first_seq,
            path,
            file,
            written_bytes: SEGMENT_HEADER_BYTES as u64,
            zeroed_bytes: SEGMENT_HEADER_BYTES as u64,
            record_count: 0,
            checkpoint_last_index: u64::MAX,
        });
        Ok(())
    }

    /// Deletes whole segments that hold nothing past `snapshot_index`. The caller must have
    /// recorded a snapshot at or past that index; this syncs it first.
    pub fn compact(&mut self, snapshot_index: Index) -> Result<usize> {
        assert!(
            snapshot_index <= self.model.snapshot_index,
            "compacting past the snapshot"
        );
        self.sync()?;
        let mut removed = 0;
        while self.segments.len() > 1 && self.segments[1].checkpoint_last_index <= snapshot_index {
            let segment = self
                .segments
                .pop_front()
                .expect("checked: more than one segment");
            self.disk
                .remove_file(&segment.path)
                .map_err(|e| Error::io(&segment.path, e))?;
            removed += 1;
        }
        if removed > 0 {
            self.disk
                .sync_dir(&self.dir)
                .map_err(|e| Error::io(&self.dir, e))?;
        }
        Ok(removed)
    }

    /// Reads back the entry at `index` from its segment (or from the write buffer), verifying
    /// its checksum and that it is the entry the index says.
    pub fn read_entry(&self, index: Index) -> Result<Entry> {
        let location = self
            .model
            .location(index)
            .ok_or(Error::Unavailable(index))?;
        let position = self
            .segments
            .binary_search_by_key(&location.segment_first_seq, |segment| segment.first_seq)
            .map_err(|_| {
                Error::corrupt(&self.dir, 0, format!("segment of entry {index} is gone"))
            })?;
        let segment = &self.segments[position];
        let len = location.frame_len_bytes as usize;
        let mut frame = vec![0u8; len];
        let is_active = position + 1 == self.segments.len();
        if is_active && location.offset_bytes >= segment.written_bytes {
            let start = (location.offset_bytes - segment.written_bytes) as usize;
            let buffered = self.pending.get(start..start + len);
            frame.copy_from_slice(
                buffered.expect("invariant: buffered entry lies in the write buffer"),
            );
        } else {
            read_exact_at(segment.file.as_ref(), location.offset_bytes, &mut frame)
                .map_err(|e| Error::io(&segment.path, e))?;
        }
        let corrupt =
            |reason: &str| Error::corrupt(&segment.path, location.offset_bytes, reason.to_string());
        let Frame::Valid { body, .. } = record::read_frame(&frame) else {
            return Err(corrupt("entry record fails its checksum on read"));
        };
        let (_, entry) = record::decode_entry(body).map_err(corrupt)?;
        if entry.index != index || entry.term != location.term {
            return Err(corrupt("entry record is not the entry the index points to"));
        }
        Ok(entry)
    }
}

/// Whether any checksummed, decodable record starts at or after `from`: if so, the damage
/// before it is not a torn final write.
fn valid_record_after(bytes: &[u8], from: usize) -> bool {
    (from..bytes.len().saturating_sub(FRAME_HEADER_BYTES)).any(|start| {
        match record::read_frame(&bytes[start..]) {
            Frame::Valid { body, .. } => record::decode_body(body).is_ok(),
            _ => false,
        }
    })
}

/// How many records and bytes a damaged tail holds: bytes up to the last non-zero one (the rest
/// is preallocated or never written), records by walking the length fields through them.
fn dropped_extent(tail: &[u8]) -> (u64, u64) {
    let bytes = tail
        .iter()
        .rposition(|&b| b != 0)
        .map_or(0, |last| last + 1);
    let mut records = 0u64;
    let mut at = 0usize;
    while at < bytes {
        records += 1;
        let Some(header) = tail.get(at..at + FRAME_HEADER_BYTES) else {
            break;
        };
        let body_len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as usize;
        if body_len == 0 || body_len > RECORD_BYTES_MAX {
            break;
        }
        at += FRAME_HEADER_BYTES + body_len;
    }
    (records, bytes as u64)
}

/// The first sequence numbers of the segments in `dir`, ascending; removes leftover temp files.
fn list_segments(disk: &dyn Disk, dir: &Path) -> Result<Vec<u64>> {
    let names = disk.list_files(dir).map_err(|e| Error::io(dir, e))?;
    let mut seqs = Vec::new();
    let mut removed_temp = false;
    for name in names {
        if name.ends_with(TEMP_SUFFIX) {
            let path = dir.join(&name);
            disk.remove_file(&path).map_err(|e| Error::io(&path, e))?;
            removed_temp = true;
        } else if let Some(seq) = segment::parse_segment_file_name(&name) {
            seqs.push(seq);
        }
    }
    if removed_temp {
        disk.sync_dir(dir).map_err(|e| Error::io(dir, e))?;
    }
    seqs.sort_unstable();
    Ok(seqs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{SimDisk, SimDiskOptions};
    use conclave_raft::HardState;

    fn append_hard_state(wal: &mut Wal, term: u64) {
        let record = Record::HardState(HardState {
            term,
            vote: None,
            commit: 0,
        });
        wal.append_record(&record).expect("append");
    }

    fn active_extents(wal: &Wal) -> (u64, u64) {
        let active = wal.segments.back().expect("an active segment");
        (active.written_bytes, active.zeroed_bytes)
    }

    #[test]
    fn only_writes_of_a_block_or_more_start_a_stretch_of_zeros() {
        let disk = Arc::new(SimDisk::new(7, SimDiskOptions::default()));
        let options = WalOptions {
            segment_size_bytes: 4 << 20,
            ..WalOptions::default()
        };
        assert!(options.preallocate);
        let (mut wal, _) = Wal::open(disk, Path::new("/data/wal"), options).expect("open");
        let mut term = 0;
        // A quiet member: one small write per sync never starts a stretch.
        for _ in 0..300 {
            term += 1;
            append_hard_state(&mut wal, term);
            wal.sync().expect("sync");
            let (written, zeroed) = active_extents(&wal);
            assert_eq!(zeroed, written, "a small write started a stretch of zeros");
        }
        // A member under load: a write of a block or more starts one.
        while wal.pending_bytes() < ZERO_AHEAD_WRITE_BYTES_MIN {
            term += 1;
            append_hard_state(&mut wal, term);
        }
        wal.sync().expect("sync");
        let (written, zeroed) = active_extents(&wal);
        assert_eq!(zeroed, written + ZERO_AHEAD_BYTES);
        // Small writes run through the stretch without renewing it.
        let stretch_end = zeroed;
        for _ in 0..100 {
            term += 1;
            append_hard_state(&mut wal, term);
            wal.sync().expect("sync");
            assert_eq!(active_extents(&wal).1, stretch_end);
        }
        // Large writes renew it once the records come within a block of its end.
        let mut renewed = false;
        while !renewed {
            while wal.pending_bytes() < ZERO_AHEAD_WRITE_BYTES_MIN {
                term += 1;
                append_hard_state(&mut wal, term);
            }
            wal.sync().expect("sync");
            let (written, zeroed) = active_extents(&wal);
            assert!(
                zeroed >= written + ZERO_AHEAD_WRITE_BYTES_MIN as u64,
                "{written} {zeroed}"
            );
            renewed = zeroed > stretch_end;
        }
    }
}
