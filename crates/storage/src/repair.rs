//! Explicit repair of a log that recovery refused to open.
//!
//! Recovery never skips damage before the end of the log: skipping would silently drop
//! acknowledged entries or a vote. When an operator decides the node should rejoin anyway,
//! [`repair`] cuts the log at the first damaged record (deleting the segments after it), so
//! the node starts with the intact prefix and catches up from its peers.
//!
//! Caution: the cut can also drop the latest hard state, so the node may forget a vote it cast.
//! Repair a node only while the cluster has moved past the terms in question (or after
//! removing and re-adding it as a member).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::disk::Disk;
use crate::error::{Error, FatalError, Result};
use crate::storage::{StorageOptions, lock_data_dir};
use crate::wal::Wal;
use crate::wal::segment::{self, SEGMENT_HEADER_BYTES};

/// What [`repair`] changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RepairReport {
    /// Segments cut short: the file and the length it was cut to.
    pub truncated: Vec<(PathBuf, u64)>,
    /// Segments deleted because they followed (or began with) the damage.
    pub removed: Vec<PathBuf>,
}

impl RepairReport {
    pub fn changed_anything(&self) -> bool {
        !self.truncated.is_empty() || !self.removed.is_empty()
    }
}

/// Cuts the log in data directory `dir` at every point where recovery reports corruption,
/// until it opens. Errors that are not log corruption (a missing snapshot, I/O errors) are
/// returned unchanged: cutting the log cannot fix them.
pub fn repair(
    disk: Arc<dyn Disk>,
    dir: impl AsRef<Path>,
    options: StorageOptions,
) -> Result<RepairReport> {
    options.validate()?;
    let dir = dir.as_ref();
    let _lock = lock_data_dir(disk.as_ref(), dir)?;
    let wal_dir = dir.join("wal");
    let mut report = RepairReport::default();
    // Each pass removes data, so the passes end; the bound guards against a disk that lies.
    for _ in 0..1000 {
        let (file, offset) = match Wal::open(disk.clone(), &wal_dir, options.wal) {
            Ok(_) => return Ok(report),
            Err(Error::Fatal(FatalError::Corrupt { file, offset, .. }))
                if is_segment_in(&file, &wal_dir) =>
            {
                (file, offset)
            }
            Err(other) => return Err(other),
        };
        cut_log_at(disk.as_ref(), &wal_dir, &file, offset, &mut report)?;
    }
    Err(Error::corrupt(wal_dir, 0, "repair did not converge"))
}

fn is_segment_in(file: &Path, wal_dir: &Path) -> bool {
    file.parent() == Some(wal_dir)
        && file
            .file_name()
            .and_then(|name| name.to_str())
            .and_then(segment::parse_segment_file_name)
            .is_some()
}

fn cut_log_at(
    disk: &dyn Disk,
    wal_dir: &Path,
    file: &Path,
    offset: u64,
    report: &mut RepairReport,
) -> Result<()> {
    let damaged_seq = file
        .file_name()
        .and_then(|name| name.to_str())
        .and_then(segment::parse_segment_file_name)
        .expect("checked by is_segment_in");
    let names = disk
        .list_files(wal_dir)
        .map_err(|e| Error::io(wal_dir, e))?;
    let keep_damaged = offset > SEGMENT_HEADER_BYTES as u64;
    for name in names {
        let Some(seq) = segment::parse_segment_file_name(&name) else {
            continue;
        };
        if seq > damaged_seq || (seq == damaged_seq && !keep_damaged) {
            let path = wal_dir.join(name);
            disk.remove_file(&path).map_err(|e| Error::io(&path, e))?;
            report.removed.push(path);
        }
    }
    if keep_damaged {
        let mut handle = disk.open(file).map_err(|e| Error::io(file, e))?;
        handle.set_len(offset).map_err(|e| Error::io(file, e))?;
        handle.sync_data().map_err(|e| Error::io(file, e))?;
        report.truncated.push((file.to_path_buf(), offset));
    }
    disk.sync_dir(wal_dir).map_err(|e| Error::io(wal_dir, e))?;
    Ok(())
}
