//! Explicit repair of a log that recovery refused to open.
//!
//! Recovery never skips damage before the end of the log: skipping would silently drop
//! acknowledged entries or a vote. When an operator decides the node should rejoin anyway,
//! [`repair`] cuts the log at the first damaged record (deleting the segments after it), so
//! the node starts with the intact prefix and catches up from its peers. [`RepairReport`] says
//! what each cut removed: records, bytes, and the indexes of the intact entries after the
//! damage. A dry run ([`RepairMode::DryRun`]) computes the same report on an in-memory copy of
//! the log and changes nothing.
//!
//! Caution: the cut can also drop the latest hard state, so the node may forget a vote it cast.
//! Repair a node only while the cluster has moved past the terms in question (or after
//! removing and re-adding it as a member).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use conclave_raft::Index;

use crate::disk::{Disk, read_to_end};
use crate::error::{Error, FatalError, Result};
use crate::sim_disk::{SimDisk, SimDiskOptions};
use crate::storage::{StorageOptions, lock_data_dir};
use crate::wal::record::{self, Frame, Record};
use crate::wal::segment::{self, SEGMENT_HEADER_BYTES};
use crate::wal::{SEGMENT_FILE_BYTES_MAX, Wal};

/// Whether [`repair`] changes the log or only says what it would change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RepairMode {
    /// Cut the log and delete the segments after the damage.
    Apply,
    /// Report the same cuts, changing nothing (the log is read into memory).
    DryRun,
}

/// One place where the log was (or would be) cut, and what the cut removes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepairCut {
    /// The segment where the damage starts.
    pub file: PathBuf,
    /// Where in `file` the damage starts; the log keeps everything before it.
    pub offset_bytes: u64,
    /// What recovery found wrong there.
    pub reason: String,
    /// Records removed: the damaged one plus every intact record after it.
    pub records_lost: u64,
    /// Bytes removed (not counting never-written zeros at segment ends).
    pub bytes_lost: u64,
    /// The lowest and highest index of the intact entry records removed, if any. The damaged
    /// record itself may hold one more entry, whose index is unknown.
    pub entries_lost: Option<(Index, Index)>,
    /// Intact hard-state records removed: each one a term or vote the node forgets.
    pub hard_states_lost: u64,
}

/// What [`repair`] changed (or, in a dry run, would change).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RepairReport {
    /// Each cut, in the order it was made.
    pub cuts: Vec<RepairCut>,
    /// Segments cut short: the file and the length it was cut to.
    pub truncated: Vec<(PathBuf, u64)>,
    /// Segments deleted because they followed (or began with) the damage.
    pub removed: Vec<PathBuf>,
    /// The log's last index once repaired.
    pub last_index_kept: Index,
}

impl RepairReport {
    pub fn changed_anything(&self) -> bool {
        !self.truncated.is_empty() || !self.removed.is_empty()
    }
}

/// Passes of open-and-cut before giving up; each pass removes data, so a real log converges
/// in one or two, and the bound only guards against a disk that lies.
const REPAIR_PASSES_MAX: usize = 1000;

/// Cuts the log in data directory `dir` at every point where recovery reports corruption,
/// until it opens. Errors that are not log corruption (a missing snapshot, I/O errors) are
/// returned unchanged: cutting the log cannot fix them.
pub fn repair(
    disk: Arc<dyn Disk>,
    dir: impl AsRef<Path>,
    options: StorageOptions,
) -> Result<RepairReport> {
    repair_with(disk, dir, options, RepairMode::Apply)
}

/// [`repair`], or with [`RepairMode::DryRun`] only the report of what it would do.
pub fn repair_with(
    disk: Arc<dyn Disk>,
    dir: impl AsRef<Path>,
    options: StorageOptions,
    mode: RepairMode,
) -> Result<RepairReport> {
    options.validate()?;
    let dir = dir.as_ref();
    // Held in a dry run too: a running node would change the log under the report.
    let _lock = lock_data_dir(disk.as_ref(), dir)?;
    let wal_dir = dir.join("wal");
    let working: Arc<dyn Disk> = match mode {
        RepairMode::Apply => disk,
        RepairMode::DryRun => Arc::new(copy_to_memory(disk.as_ref(), &wal_dir)?),
    };
    let mut report = RepairReport::default();
    for _ in 0..REPAIR_PASSES_MAX {
        let (file, offset, reason) = match Wal::open(working.clone(), &wal_dir, options.wal) {
            Ok((wal, _)) => {
                report.last_index_kept = wal.model().last_index();
                return Ok(report);
            }
            Err(Error::Fatal(FatalError::Corrupt {
                file,
                offset,
                reason,
            })) if is_segment_in(&file, &wal_dir) => (file, offset, reason),
            Err(other) => return Err(other),
        };
        cut_log_at(
            working.as_ref(),
            &wal_dir,
            &file,
            offset,
            reason,
            &mut report,
        )?;
    }
    Err(Error::corrupt(wal_dir, 0, "repair did not converge"))
}

/// The segments of `wal_dir` copied into a fresh simulated disk at the same paths.
fn copy_to_memory(disk: &dyn Disk, wal_dir: &Path) -> Result<SimDisk> {
    let copy = SimDisk::new(0, SimDiskOptions::default());
    copy.create_dir_all(wal_dir)
        .map_err(|e| Error::io(wal_dir, e))?;
    let names = disk
        .list_files(wal_dir)
        .map_err(|e| Error::io(wal_dir, e))?;
    for name in names {
        if segment::parse_segment_file_name(&name).is_none() {
            continue;
        }
        let path = wal_dir.join(name);
        let bytes = read_segment(disk, &path)?;
        copy.set_durable_bytes(&path, bytes);
    }
    Ok(copy)
}

/// A whole segment file, refusing one longer than any segment this code writes.
fn read_segment(disk: &dyn Disk, path: &Path) -> Result<Vec<u8>> {
    let file = disk.open(path).map_err(|e| Error::io(path, e))?;
    let len = file.len_bytes().map_err(|e| Error::io(path, e))?;
    if len > SEGMENT_FILE_BYTES_MAX {
        let reason = format!("segment of {len} bytes is longer than any segment this code writes");
        return Err(Error::corrupt(path, 0, reason));
    }
    read_to_end(file.as_ref()).map_err(|e| Error::io(path, e))
}

fn segment_seq(file: &Path) -> Option<u64> {
    file.file_name()
        .and_then(|name| name.to_str())
        .and_then(segment::parse_segment_file_name)
}

fn is_segment_in(file: &Path, wal_dir: &Path) -> bool {
    file.parent() == Some(wal_dir) && segment_seq(file).is_some()
}

fn cut_log_at(
    disk: &dyn Disk,
    wal_dir: &Path,
    file: &Path,
    offset: u64,
    reason: String,
    report: &mut RepairReport,
) -> Result<()> {
    let Some(damaged_seq) = segment_seq(file) else {
        return Err(Error::corrupt(file, offset, "not a segment file"));
    };
    let names = disk
        .list_files(wal_dir)
        .map_err(|e| Error::io(wal_dir, e))?;
    let keep_damaged = offset > SEGMENT_HEADER_BYTES as u64;
    let mut later: Vec<(u64, PathBuf)> = names
        .into_iter()
        .filter_map(|name| Some((segment::parse_segment_file_name(&name)?, name)))
        .filter(|&(seq, _)| seq > damaged_seq || (seq == damaged_seq && !keep_damaged))
        .map(|(seq, name)| (seq, wal_dir.join(name)))
        .collect();
    later.sort_unstable();
    let mut lost = LostRecords::default();
    if keep_damaged {
        let bytes = read_segment(disk, file)?;
        let start = usize::try_from(offset)
            .unwrap_or(usize::MAX)
            .min(bytes.len());
        lost.add_damaged_region(&bytes[start..]);
    }
    for (seq, path) in &later {
        let bytes = read_segment(disk, path)?;
        if *seq == damaged_seq {
            // The damage is at this segment's header: none of its records can be trusted.
            lost.add_damaged_region(&bytes);
        } else {
            lost.add_region(bytes.get(SEGMENT_HEADER_BYTES..).unwrap_or_default());
            lost.bytes += SEGMENT_HEADER_BYTES.min(bytes.len()) as u64;
        }
    }
    for (_, path) in later {
        disk.remove_file(&path).map_err(|e| Error::io(&path, e))?;
        report.removed.push(path);
    }
    if keep_damaged {
        let mut handle = disk.open(file).map_err(|e| Error::io(file, e))?;
        handle.set_len(offset).map_err(|e| Error::io(file, e))?;
        handle.sync_data().map_err(|e| Error::io(file, e))?;
        report.truncated.push((file.to_path_buf(), offset));
    }
    disk.sync_dir(wal_dir).map_err(|e| Error::io(wal_dir, e))?;
    report.cuts.push(RepairCut {
        file: file.to_path_buf(),
        offset_bytes: offset,
        reason,
        records_lost: lost.records,
        bytes_lost: lost.bytes,
        entries_lost: lost.entries,
        hard_states_lost: lost.hard_states,
    });
    Ok(())
}

/// Tallies what a cut removes.
#[derive(Debug, Default)]
struct LostRecords {
    records: u64,
    bytes: u64,
    entries: Option<(Index, Index)>,
    hard_states: u64,
}

impl LostRecords {
    /// A region that starts with the damaged record: it counts as one record lost, plus the
    /// intact records found after it.
    fn add_damaged_region(&mut self, region: &[u8]) {
        let written = written_len(region);
        if written == 0 {
            return;
        }
        self.records += 1;
        self.bytes += written as u64;
        self.scan(&region[1..written]);
    }

    /// A region of records that are intact unless they fail their checksum.
    fn add_region(&mut self, region: &[u8]) {
        let written = written_len(region);
        self.bytes += written as u64;
        self.scan(&region[..written]);
    }

    /// Counts the intact records in `region`, resynchronising byte by byte after damage.
    fn scan(&mut self, region: &[u8]) {
        let mut at = 0;
        while at < region.len() {
            let Frame::Valid { body, frame_len } = record::read_frame(&region[at..]) else {
                at += 1;
                continue;
            };
            let Ok((_, decoded)) = record::decode_body(body) else {
                at += 1;
                continue;
            };
            self.records += 1;
            match decoded {
                Record::Entry { index, .. } => {
                    self.entries = Some(match self.entries {
                        Some((low, high)) => (low.min(index), high.max(index)),
                        None => (index, index),
                    });
                }
                Record::HardState(_) => self.hard_states += 1,
                Record::Checkpoint { .. } | Record::Snapshot { .. } => {}
            }
            at += frame_len;
        }
    }
}

/// The length of `region` up to its last non-zero byte (the rest was never written).
fn written_len(region: &[u8]) -> usize {
    region
        .iter()
        .rposition(|&b| b != 0)
        .map_or(0, |last| last + 1)
}
