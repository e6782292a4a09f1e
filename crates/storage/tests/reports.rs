//! What the storage says it did: the report of a dropped tail, the report of a repair (and
//! that a dry run changes nothing), permissions on a real disk, and snapshots verified before
//! they replace anything.

mod support;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use conclave_raft::{ConfState, SnapshotMeta};
use conclave_storage::{
    Disk, OsDisk, RepairMode, SimDisk, SimDiskOptions, WalStorage, repair_with,
};
use support::*;

#[test]
fn a_flipped_byte_in_the_last_record_is_dropped_and_reported_with_file_offset_and_counts() {
    let (disk, _) = build_log(60, 40);
    let segments = segments(&disk);
    let (path, bytes) = segments.last().cloned().expect("segments");
    let (offset, len) = *frames(&bytes).last().expect("frames");
    let mut damaged = bytes.clone();
    damaged[offset + len - 1] ^= 0x01;
    disk.set_durable_bytes(&path, damaged);
    let storage = open(&disk, small_options()).expect("a damaged last record is a torn tail");
    let tail = storage
        .recovery_report()
        .wal
        .dropped_tail
        .clone()
        .expect("the dropped tail is reported");
    assert_eq!(tail.file, path);
    assert_eq!(tail.offset_bytes, offset as u64);
    assert_eq!(tail.records, 1);
    assert_eq!(tail.bytes, len as u64);
    assert_eq!(tail.reason, "checksum mismatch");
    assert_same(
        &storage,
        &expected_prefix(&segments, segments.len() - 1, offset),
        "prefix",
    );
    // An intact log reports nothing dropped.
    drop(storage);
    let storage = open(&disk, small_options()).expect("reopen");
    assert_eq!(storage.recovery_report().wal.dropped_tail, None);
}

#[test]
fn repair_reports_what_each_cut_loses_and_a_dry_run_changes_nothing() {
    let (disk, _) = build_log(120, 40);
    let segments = segments(&disk);
    let (path, bytes) = &segments[1];
    let frames_of_damaged = frames(bytes);
    let (offset, _) = frames_of_damaged[3];
    let mut damaged = bytes.clone();
    damaged[offset + 12] ^= 0x40;
    disk.set_durable_bytes(path, damaged);
    let before: Vec<_> = self::segments(&disk);
    let dry = repair_with(
        Arc::new(disk.clone()),
        DIR,
        small_options(),
        RepairMode::DryRun,
    )
    .expect("dry run");
    assert_eq!(self::segments(&disk), before, "a dry run changes nothing");
    assert!(open(&disk, small_options()).is_err(), "still refused");
    let applied = repair_with(
        Arc::new(disk.clone()),
        DIR,
        small_options(),
        RepairMode::Apply,
    )
    .expect("repair");
    assert_eq!(dry, applied, "the dry run reports exactly what repair does");
    assert_eq!(applied.cuts.len(), 1);
    let cut = &applied.cuts[0];
    assert_eq!((&cut.file, cut.offset_bytes), (path, offset as u64));
    assert_eq!(cut.reason, "checksum mismatch in a completed segment");
    // Every record from the damaged one to the end of the log.
    let later_records: usize = segments[2..].iter().map(|(_, b)| frames(b).len()).sum();
    let expected_records = frames_of_damaged.len() - 3 + later_records;
    assert_eq!(cut.records_lost, expected_records as u64);
    let later_bytes: usize = segments[2..].iter().map(|(_, b)| b.len()).sum();
    assert_eq!(cut.bytes_lost, (bytes.len() - offset + later_bytes) as u64);
    let storage = open(&disk, small_options()).expect("open after repair");
    let kept = conclave_raft::Storage::last_index(&storage).expect("last");
    assert_eq!(applied.last_index_kept, kept);
    let (first_lost, last_lost) = cut.entries_lost.expect("entries were lost");
    assert!(
        first_lost > kept && first_lost <= kept + 2,
        "{first_lost} after {kept}"
    );
    assert_eq!(last_lost, 120);
    assert!(cut.hard_states_lost > 0);
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path)
        .expect("metadata")
        .permissions()
        .mode()
        & 0o777
}

#[test]
fn a_real_data_directory_is_the_owners_alone_and_older_ones_are_tightened() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().join("data");
    let mut storage = WalStorage::open(Arc::new(OsDisk), &dir, small_options()).expect("open");
    storage
        .bootstrap(ConfState::with_voters([1]))
        .expect("bootstrap");
    storage.append(&[entry(2, 1, 10)]).expect("append");
    storage.sync().expect("sync");
    assert!(storage.recovery_report().tightened_permissions.is_empty());
    drop(storage);
    let mut checked = 0;
    for sub in ["", "wal", "snap"] {
        let sub_dir = dir.join(sub);
        assert_eq!(mode(&sub_dir), 0o700, "{}", sub_dir.display());
        for item in std::fs::read_dir(&sub_dir).expect("list") {
            let path = item.expect("entry").path();
            if path.is_file() {
                assert_eq!(mode(&path), 0o600, "{}", path.display());
                checked += 1;
            }
        }
    }
    assert!(checked >= 3, "LOCK, a segment and a snapshot: {checked}");
    // As an older version (or a careless operator) left it.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let segment = std::fs::read_dir(dir.join("wal"))
        .expect("list")
        .next()
        .expect("a segment")
        .expect("entry")
        .path();
    std::fs::set_permissions(&segment, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let storage = WalStorage::open(Arc::new(OsDisk), &dir, small_options()).expect("reopen");
    let mut tightened = storage.recovery_report().tightened_permissions.clone();
    tightened.sort();
    assert_eq!(tightened, vec![dir.clone(), segment.clone()]);
    assert_eq!(mode(&dir), 0o700);
    assert_eq!(mode(&segment), 0o600);
}

/// A disk whose writes to unfinished snapshot files flip a bit: what a bad cable or a bad
/// controller does between the checksum and the platter.
struct GarblingDisk(SimDisk);

struct GarblingFile(Box<dyn conclave_storage::DiskFile>);

impl conclave_storage::DiskFile for GarblingFile {
    fn len_bytes(&self) -> std::io::Result<u64> {
        self.0.len_bytes()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0.read_at(offset, buf)
    }
    fn write_at(&mut self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        let mut garbled = data.to_vec();
        if let Some(first) = garbled.first_mut() {
            *first ^= 0x08;
        }
        self.0.write_at(offset, &garbled)
    }
    fn sync_data(&mut self) -> std::io::Result<()> {
        self.0.sync_data()
    }
    fn set_len(&mut self, len_bytes: u64) -> std::io::Result<()> {
        self.0.set_len(len_bytes)
    }
    fn preallocate(&mut self, len_bytes: u64) -> std::io::Result<()> {
        self.0.preallocate(len_bytes)
    }
}

impl Disk for GarblingDisk {
    fn create_dir_all(&self, dir: &Path) -> std::io::Result<()> {
        self.0.create_dir_all(dir)
    }
    fn list_files(&self, dir: &Path) -> std::io::Result<Vec<String>> {
        self.0.list_files(dir)
    }
    fn create(&self, path: &Path) -> std::io::Result<Box<dyn conclave_storage::DiskFile>> {
        let file = self.0.create(path)?;
        let is_snapshot = path.to_string_lossy().ends_with(".snap.tmp");
        Ok(if is_snapshot {
            Box::new(GarblingFile(file))
        } else {
            file
        })
    }
    fn open(&self, path: &Path) -> std::io::Result<Box<dyn conclave_storage::DiskFile>> {
        self.0.open(path)
    }
    fn remove_file(&self, path: &Path) -> std::io::Result<()> {
        self.0.remove_file(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> std::io::Result<()> {
        self.0.rename(from, to)
    }
    fn sync_dir(&self, dir: &Path) -> std::io::Result<()> {
        self.0.sync_dir(dir)
    }
    fn lock_dir(&self, dir: &Path) -> std::io::Result<Box<dyn conclave_storage::disk::DirLock>> {
        self.0.lock_dir(dir)
    }
}

#[test]
fn a_snapshot_that_does_not_read_back_is_never_renamed_into_place() {
    let sim = SimDisk::new(3, SimDiskOptions::default());
    let storage =
        WalStorage::open(Arc::new(GarblingDisk(sim.clone())), DIR, small_options()).expect("open");
    let meta = SnapshotMeta {
        index: 5,
        term: 1,
        conf_state: ConfState::with_voters([1]),
    };
    let mut writer = storage.begin_snapshot(meta).expect("begin");
    writer.write_chunk(b"state").expect("chunk");
    let error = writer
        .finish()
        .expect_err("a garbled snapshot fails verification");
    assert!(
        error.to_string().contains("before it was renamed"),
        "{error}"
    );
    let snap_dir = Path::new(DIR).join("snap");
    assert!(
        sim.list_files(&snap_dir).expect("list").is_empty(),
        "neither the snapshot nor its temporary file is left"
    );
}

#[test]
fn a_segment_longer_than_any_the_log_writes_is_refused_before_it_is_read() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().join("data");
    let storage = WalStorage::open(Arc::new(OsDisk), &dir, small_options()).expect("open");
    drop(storage);
    let segment = std::fs::read_dir(dir.join("wal"))
        .expect("list")
        .next()
        .expect("a segment")
        .expect("entry")
        .path();
    // Sparse: no disk space, but reading it whole would take more than a gigabyte of memory.
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&segment)
        .expect("open the segment");
    file.set_len(conclave_storage::wal::SEGMENT_FILE_BYTES_MAX + 1)
        .expect("grow");
    drop(file);
    let error = WalStorage::open(Arc::new(OsDisk), &dir, small_options())
        .expect_err("an impossible segment length is corruption");
    assert!(
        error.to_string().contains("longer than any segment"),
        "{error}"
    );
}
