//! Snapshot files, written and read as streams of chunks.
//!
//! ```text
//! <dir>/snap/<index, 20 digits>-<term, 20 digits>.snap
//! [magic "CNCLSNAP"][format version u32][meta_len u32][meta][CRC32C of all before, u32]
//! [data ...]
//! [data_len u64][CRC32C of every byte before, u32][end magic "SNP."]
//! meta: index u64, term u64, then voters, learners, voters_outgoing as (count u32, ids u64...)
//! ```
//!
//! A writer streams to `<name>.tmp`, fsyncs it, renames it into place and fsyncs the directory,
//! so a snapshot file under its final name is complete. The header has its own checksum so the
//! metadata can be trusted before the data is read; the trailer's covers the whole file.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use conclave_raft::{ConfState, Index, NodeId, SnapshotMeta, Term};

use crate::disk::{Disk, DiskFile, read_exact_at};
use crate::error::{Error, Result};

/// The snapshot format this code writes and reads.
pub const SNAPSHOT_FORMAT_VERSION: u32 = 1;
const MAGIC: &[u8; 8] = b"CNCLSNAP";
const END_MAGIC: &[u8; 4] = b"SNP.";
const TRAILER_BYTES: u64 = 16;
/// Bounds what a corrupt header can make us allocate.
const META_BYTES_MAX: usize = 16 << 20;
const EXTENSION: &str = ".snap";
const TEMP_SUFFIX: &str = ".tmp";
/// Chunk size for verifying and copying snapshot data.
pub const SNAPSHOT_CHUNK_BYTES: usize = 1 << 20;

/// The file name of the snapshot at (`index`, `term`).
pub fn snapshot_file_name(index: Index, term: Term) -> String {
    format!("{index:020}-{term:020}{EXTENSION}")
}

/// The (index, term) a snapshot file name stands for, if it is one.
pub fn parse_snapshot_file_name(name: &str) -> Option<(Index, Term)> {
    let stem = name.strip_suffix(EXTENSION)?;
    let (index, term) = stem.split_once('-')?;
    let all_digits = |s: &str| s.len() == 20 && s.bytes().all(|b| b.is_ascii_digit());
    if !all_digits(index) || !all_digits(term) {
        return None;
    }
    Some((index.parse().ok()?, term.parse().ok()?))
}

/// Whether `name` is a leftover of an unfinished snapshot write.
pub fn is_temp_snapshot_name(name: &str) -> bool {
    name.ends_with(TEMP_SUFFIX)
}

fn encode_meta(meta: &SnapshotMeta) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&meta.index.to_le_bytes());
    out.extend_from_slice(&meta.term.to_le_bytes());
    for set in [
        &meta.conf_state.voters,
        &meta.conf_state.learners,
        &meta.conf_state.voters_outgoing,
    ] {
        out.extend_from_slice(&(set.len() as u32).to_le_bytes());
        for id in set {
            out.extend_from_slice(&id.to_le_bytes());
        }
    }
    out
}

fn decode_meta(bytes: &[u8]) -> Result<SnapshotMeta, &'static str> {
    let mut rest = bytes;
    let u64_field = |rest: &mut &[u8]| -> Result<u64, &'static str> {
        let (head, tail) = rest
            .split_first_chunk::<8>()
            .ok_or("snapshot meta too short")?;
        *rest = tail;
        Ok(u64::from_le_bytes(*head))
    };
    let index = u64_field(&mut rest)?;
    let term = u64_field(&mut rest)?;
    let mut sets: [BTreeSet<NodeId>; 3] = Default::default();
    for set in &mut sets {
        let (count, tail) = rest
            .split_first_chunk::<4>()
            .ok_or("snapshot meta too short")?;
        rest = tail;
        let count = u32::from_le_bytes(*count) as usize;
        if count > rest.len() / 8 {
            return Err("snapshot meta member count too large");
        }
        for _ in 0..count {
            set.insert(u64_field(&mut rest)?);
        }
    }
    if !rest.is_empty() {
        return Err("trailing bytes in snapshot meta");
    }
    let [voters, learners, voters_outgoing] = sets;
    Ok(SnapshotMeta {
        index,
        term,
        conf_state: ConfState {
            voters,
            learners,
            voters_outgoing,
        },
    })
}

/// Streams a new snapshot file. Dropping it unfinished leaves a temp file that start-up removes.
pub struct SnapshotWriter {
    disk: Arc<dyn Disk>,
    dir: PathBuf,
    temp_path: PathBuf,
    file: Box<dyn DiskFile>,
    meta: SnapshotMeta,
    offset_bytes: u64,
    data_len_bytes: u64,
    crc: u32,
}

impl SnapshotWriter {
    pub(crate) fn create(
        disk: Arc<dyn Disk>,
        dir: &Path,
        meta: SnapshotMeta,
    ) -> Result<SnapshotWriter> {
        let name = snapshot_file_name(meta.index, meta.term);
        let temp_path = dir.join(format!("{name}{TEMP_SUFFIX}"));
        let mut file = disk
            .create(&temp_path)
            .map_err(|e| Error::io(&temp_path, e))?;
        let encoded_meta = encode_meta(&meta);
        let mut header = Vec::with_capacity(encoded_meta.len() + 20);
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&SNAPSHOT_FORMAT_VERSION.to_le_bytes());
        header.extend_from_slice(&(encoded_meta.len() as u32).to_le_bytes());
        header.extend_from_slice(&encoded_meta);
        let header_crc = crc32c::crc32c(&header);
        header.extend_from_slice(&header_crc.to_le_bytes());
        file.write_at(0, &header)
            .map_err(|e| Error::io(&temp_path, e))?;
        Ok(SnapshotWriter {
            crc: crc32c::crc32c(&header),
            offset_bytes: header.len() as u64,
            data_len_bytes: 0,
            disk,
            dir: dir.to_path_buf(),
            temp_path,
            file,
            meta,
        })
    }

    /// Appends the next chunk of the application's state.
    pub fn write_chunk(&mut self, chunk: &[u8]) -> Result<()> {
        self.file
            .write_at(self.offset_bytes, chunk)
            .map_err(|e| Error::io(&self.temp_path, e))?;
        self.crc = crc32c::crc32c_append(self.crc, chunk);
        self.offset_bytes += chunk.len() as u64;
        self.data_len_bytes += chunk.len() as u64;
        Ok(())
    }

    /// Makes the bytes written so far durable. A large snapshot synced in pieces never holds
    /// the disk long enough to stall the log's own fsyncs behind it.
    pub fn sync_written(&mut self) -> Result<()> {
        self.file
            .sync_data()
            .map_err(|e| Error::io(&self.temp_path, e))
    }

    /// How many data bytes were written so far (where the next chunk goes).
    pub fn data_len_bytes(&self) -> u64 {
        self.data_len_bytes
    }

    pub fn meta(&self) -> &SnapshotMeta {
        &self.meta
    }

    /// Seals the file and makes it durable under its final name.
    pub fn finish(mut self) -> Result<SnapshotFile> {
        let mut trailer = Vec::with_capacity(TRAILER_BYTES as usize);
        trailer.extend_from_slice(&self.data_len_bytes.to_le_bytes());
        let crc = crc32c::crc32c_append(self.crc, &trailer);
        trailer.extend_from_slice(&crc.to_le_bytes());
        trailer.extend_from_slice(END_MAGIC);
        let temp = self.temp_path.clone();
        self.file
            .write_at(self.offset_bytes, &trailer)
            .map_err(|e| Error::io(&temp, e))?;
        self.file.sync_data().map_err(|e| Error::io(&temp, e))?;
        // Read back before it replaces anything: a file that does not verify now would stop
        // the node at its next start.
        match verify_snapshot_file(self.disk.as_ref(), &temp) {
            Ok(verified) if verified.meta == self.meta => {}
            Ok(_) => return Err(self.discard("snapshot file reads back with other metadata")),
            Err(reason) => return Err(self.discard(&reason)),
        }
        let path = self
            .dir
            .join(snapshot_file_name(self.meta.index, self.meta.term));
        self.disk
            .rename(&temp, &path)
            .map_err(|e| Error::io(&path, e))?;
        self.disk
            .sync_dir(&self.dir)
            .map_err(|e| Error::io(&self.dir, e))?;
        let data_offset_bytes = self.offset_bytes - self.data_len_bytes;
        Ok(SnapshotFile {
            path,
            meta: self.meta,
            data_offset_bytes,
            data_len_bytes: self.data_len_bytes,
        })
    }
}

impl SnapshotWriter {
    /// Removes the unfinished file after a failed verification; the error names it.
    fn discard(&self, reason: &str) -> Error {
        // The file is garbage either way; start-up removes it if this removal fails.
        let _ = self.disk.remove_file(&self.temp_path);
        Error::corrupt(
            &self.temp_path,
            0,
            format!("snapshot failed verification before it was renamed into place: {reason}"),
        )
    }
}

/// A [`SnapshotWriter`] behind [`std::io::Write`], for an encoder that streams its image
/// into the file: the bytes gather into pieces of `piece_bytes`, and each full piece is
/// written and synced before more are taken. No image-sized buffer is ever held, and the
/// log's fsyncs on the same disk queue behind one piece at most.
pub struct SyncedPieceWriter {
    writer: SnapshotWriter,
    piece: Vec<u8>,
    piece_bytes: usize,
    /// The storage error that stopped the stream; [`std::io::Write`] can only pass on its text.
    failed: Option<Error>,
}

impl SyncedPieceWriter {
    /// `piece_bytes` is at least 1.
    pub fn new(writer: SnapshotWriter, piece_bytes: usize) -> SyncedPieceWriter {
        let piece_bytes = piece_bytes.max(1);
        SyncedPieceWriter {
            writer,
            piece: Vec::with_capacity(piece_bytes),
            piece_bytes,
            failed: None,
        }
    }

    /// How many data bytes were taken so far, written or still in the current piece.
    pub fn data_len_bytes(&self) -> u64 {
        self.writer.data_len_bytes() + self.piece.len() as u64
    }

    /// Writes the last piece and seals the file ([`SnapshotWriter::finish`]); or returns the
    /// error that stopped the stream.
    pub fn finish(mut self) -> Result<SnapshotFile> {
        if let Some(error) = self.failed.take() {
            return Err(error);
        }
        self.write_piece()?;
        self.writer.finish()
    }

    /// The error that stopped the stream, if one did: a caller whose encoder failed asks this
    /// first, since the encoder only saw its text.
    pub fn take_error(&mut self) -> Option<Error> {
        self.failed.take()
    }

    fn write_piece(&mut self) -> Result<()> {
        if self.piece.is_empty() {
            return Ok(());
        }
        self.writer.write_chunk(&self.piece)?;
        self.writer.sync_written()?;
        self.piece.clear();
        Ok(())
    }
}

impl std::io::Write for SyncedPieceWriter {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        if let Some(error) = &self.failed {
            return Err(std::io::Error::other(error.to_string()));
        }
        let room = self.piece_bytes - self.piece.len();
        let taken = bytes.len().min(room);
        self.piece.extend_from_slice(&bytes[..taken]);
        if self.piece.len() == self.piece_bytes
            && let Err(error) = self.write_piece()
        {
            let text = error.to_string();
            self.failed = Some(error);
            return Err(std::io::Error::other(text));
        }
        Ok(taken)
    }

    /// Pieces are written whole; `finish` writes the last one.
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A complete, verified snapshot file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotFile {
    pub path: PathBuf,
    pub meta: SnapshotMeta,
    data_offset_bytes: u64,
    pub data_len_bytes: u64,
}

/// Checks a snapshot file end to end, reading it in chunks.
pub(crate) fn verify_snapshot_file(disk: &dyn Disk, path: &Path) -> Result<SnapshotFile, String> {
    let file = disk.open(path).map_err(|e| format!("cannot open: {e}"))?;
    let file_len = file.len_bytes().map_err(|e| e.to_string())?;
    let mut fixed = [0u8; 16];
    read_exact_at(file.as_ref(), 0, &mut fixed).map_err(|_| "file shorter than its header")?;
    if &fixed[..8] != MAGIC {
        return Err("not a Conclave snapshot (bad magic)".into());
    }
    let version = u32::from_le_bytes([fixed[8], fixed[9], fixed[10], fixed[11]]);
    let meta_len = u32::from_le_bytes([fixed[12], fixed[13], fixed[14], fixed[15]]) as usize;
    if meta_len > META_BYTES_MAX || 16 + meta_len as u64 + 4 + TRAILER_BYTES > file_len {
        return Err("impossible snapshot meta length".into());
    }
    let mut header = vec![0u8; 16 + meta_len + 4];
    read_exact_at(file.as_ref(), 0, &mut header).map_err(|e| e.to_string())?;
    let (covered, stored_crc) = header.split_at(16 + meta_len);
    let stored_crc =
        u32::from_le_bytes([stored_crc[0], stored_crc[1], stored_crc[2], stored_crc[3]]);
    if crc32c::crc32c(covered) != stored_crc {
        return Err("snapshot header checksum mismatch".into());
    }
    if version != SNAPSHOT_FORMAT_VERSION {
        return Err(format!("unsupported snapshot format version {version}"));
    }
    let meta = decode_meta(&covered[16..])?;
    let data_offset_bytes = header.len() as u64;
    let data_len_bytes = file_len - data_offset_bytes - TRAILER_BYTES;
    let mut crc = crc32c::crc32c(&header);
    let mut chunk = vec![0u8; SNAPSHOT_CHUNK_BYTES];
    let mut offset = data_offset_bytes;
    while offset < data_offset_bytes + data_len_bytes {
        let take = (data_offset_bytes + data_len_bytes - offset).min(chunk.len() as u64) as usize;
        read_exact_at(file.as_ref(), offset, &mut chunk[..take]).map_err(|e| e.to_string())?;
        crc = crc32c::crc32c_append(crc, &chunk[..take]);
        offset += take as u64;
    }
    let mut trailer = [0u8; TRAILER_BYTES as usize];
    read_exact_at(file.as_ref(), offset, &mut trailer).map_err(|e| e.to_string())?;
    let stored_len = u64::from_le_bytes(trailer[..8].try_into().map_err(|_| "short trailer")?);
    crc = crc32c::crc32c_append(crc, &trailer[..8]);
    let stored_crc = u32::from_le_bytes([trailer[8], trailer[9], trailer[10], trailer[11]]);
    if stored_len != data_len_bytes || &trailer[12..] != END_MAGIC {
        return Err("snapshot trailer does not match the file length".into());
    }
    if crc != stored_crc {
        return Err("snapshot checksum mismatch".into());
    }
    Ok(SnapshotFile {
        path: path.to_path_buf(),
        meta,
        data_offset_bytes,
        data_len_bytes,
    })
}

/// Reads a verified snapshot's data in chunks, e.g. to send it to a follower.
pub struct SnapshotReader {
    file: Box<dyn DiskFile>,
    snapshot: SnapshotFile,
}

impl SnapshotReader {
    pub(crate) fn open(disk: &dyn Disk, snapshot: SnapshotFile) -> Result<SnapshotReader> {
        let file = disk
            .open(&snapshot.path)
            .map_err(|e| Error::io(&snapshot.path, e))?;
        Ok(SnapshotReader { file, snapshot })
    }

    pub fn meta(&self) -> &SnapshotMeta {
        &self.snapshot.meta
    }

    pub fn data_len_bytes(&self) -> u64 {
        self.snapshot.data_len_bytes
    }

    /// Up to `max_len_bytes` of data starting at `offset_bytes`; empty at the end.
    pub fn read_chunk(&self, offset_bytes: u64, max_len_bytes: usize) -> Result<Bytes> {
        let len = self.snapshot.data_len_bytes;
        if offset_bytes >= len {
            return Ok(Bytes::new());
        }
        let take = (len - offset_bytes).min(max_len_bytes as u64) as usize;
        let mut chunk = vec![0u8; take];
        let at = self.snapshot.data_offset_bytes + offset_bytes;
        read_exact_at(self.file.as_ref(), at, &mut chunk)
            .map_err(|e| Error::io(&self.snapshot.path, e))?;
        Ok(Bytes::from(chunk))
    }

    /// All the data at once (for callers that want a whole [`conclave_raft::Snapshot`]).
    pub fn read_all(&self) -> Result<Bytes> {
        let len = usize::try_from(self.snapshot.data_len_bytes)
            .map_err(|_| Error::InvalidOptions("snapshot larger than memory".into()))?;
        self.read_chunk(0, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::FatalError;
    use crate::sim_disk::{SimDisk, SimDiskOptions};

    #[test]
    fn written_snapshots_verify_and_read_back_and_damage_is_caught() {
        let disk = SimDisk::new(1, SimDiskOptions::default());
        let dir = Path::new("/snap");
        disk.create_dir_all(dir).expect("mkdir");
        let shared: Arc<dyn Disk> = Arc::new(disk.clone());
        let meta = SnapshotMeta {
            index: 9,
            term: 3,
            conf_state: ConfState::with_voters([1, 2, 3]),
        };
        let mut writer = SnapshotWriter::create(shared.clone(), dir, meta.clone()).expect("create");
        writer.write_chunk(b"hello ").expect("write");
        // A piece can be synced on its own before the file is finished.
        let syncs_before = disk.sync_count();
        writer.sync_written().expect("sync");
        assert_eq!(
            disk.sync_count(),
            syncs_before + 1,
            "one sync for the piece"
        );
        writer.write_chunk(b"world").expect("write");
        let file = writer.finish().expect("finish");
        assert_eq!(
            parse_snapshot_file_name(&snapshot_file_name(9, 3)),
            Some((9, 3))
        );
        let verified = verify_snapshot_file(shared.as_ref(), &file.path).expect("verify");
        assert_eq!(verified, file);
        let reader = SnapshotReader::open(shared.as_ref(), verified).expect("open");
        assert_eq!(reader.meta(), &meta);
        assert_eq!(reader.read_chunk(6, 100).expect("chunk").as_ref(), b"world");
        assert_eq!(reader.read_all().expect("all").as_ref(), b"hello world");
        let bytes = disk.durable_bytes(&file.path).expect("durable");
        for at in 0..bytes.len() {
            let mut damaged = bytes.clone();
            damaged[at] ^= 0x10;
            disk.set_durable_bytes(&file.path, damaged);
            assert!(
                verify_snapshot_file(shared.as_ref(), &file.path).is_err(),
                "byte {at}"
            );
            disk.set_durable_bytes(&file.path, bytes[..at].to_vec());
            assert!(
                verify_snapshot_file(shared.as_ref(), &file.path).is_err(),
                "cut {at}"
            );
        }
    }

    /// A simulated disk with a snapshot directory, and a piece writer for a snapshot on it.
    fn piece_writer_on_a_fresh_disk(piece_bytes: usize) -> (SimDisk, SyncedPieceWriter) {
        let disk = SimDisk::new(2, SimDiskOptions::default());
        let dir = Path::new("/snap");
        disk.create_dir_all(dir).expect("mkdir");
        let meta = SnapshotMeta {
            index: 12,
            term: 4,
            conf_state: ConfState::with_voters([1]),
        };
        let writer = SnapshotWriter::create(Arc::new(disk.clone()), dir, meta).expect("create");
        (disk, SyncedPieceWriter::new(writer, piece_bytes))
    }

    #[test]
    fn a_streamed_image_is_written_and_synced_a_piece_at_a_time() {
        use std::io::Write as _;
        let (disk, mut pieces) = piece_writer_on_a_fresh_disk(100);
        let image: Vec<u8> = (0..1_050u32).map(|i| (i % 251) as u8).collect();
        let syncs_before = disk.sync_count();
        // Uneven writes, some across a piece's end.
        for part in image.chunks(37) {
            pieces.write_all(part).expect("write");
        }
        assert_eq!(pieces.data_len_bytes(), 1_050);
        assert_eq!(
            disk.sync_count() - syncs_before,
            10,
            "one sync per full piece, none for the unfinished one"
        );
        let file = pieces.finish().expect("finish");
        assert_eq!(file.data_len_bytes, 1_050);
        let reader = SnapshotReader::open(&disk, file).expect("open");
        assert_eq!(reader.read_all().expect("all").as_ref(), image.as_slice());
    }

    #[test]
    fn a_failed_piece_stops_the_stream_and_finish_returns_its_error() {
        use std::io::Write as _;
        let (disk, mut pieces) = piece_writer_on_a_fresh_disk(10);
        disk.fail_next_syncs(1);
        assert!(
            pieces.write_all(&[7; 25]).is_err(),
            "the first piece's sync failed"
        );
        assert!(
            pieces.write_all(&[7; 3]).is_err(),
            "nothing more is taken after a failure"
        );
        assert!(
            matches!(pieces.finish(), Err(Error::Fatal(FatalError::Io { .. }))),
            "finish reports the disk's error"
        );
    }
}
