//! [`WalStorage`]: the Raft log, hard state and snapshots on a [`Disk`], behind the core's
//! read-only [`conclave_raft::Storage`] trait.
//!
//! ```text
//! <dir>/LOCK                 flock held while open
//! <dir>/wal/<seq>.wal        log segments (wal/segment.rs, wal/record.rs)
//! <dir>/snap/<i>-<t>.snap    snapshot files (snapshot.rs)
//! ```
//!
//! Writes mirror `MemStorage`'s (`set_hard_state`, `append`, `apply_snapshot`,
//! `create_snapshot`) and return a [`Ticket`]; [`WalStorage::sync`] makes everything written
//! so far durable with one `fdatasync` and returns the ticket it covers. Reads see writes at
//! once, durable or not, as the core expects; only durability waits for the sync.

use std::collections::VecDeque;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};

use bytes::Bytes;
use conclave_raft::{
    ConfState, Entry, HardState, Index, Snapshot, SnapshotMeta, Storage, StorageError, Term,
};

use crate::disk::{DirLock, Disk};
use crate::error::{Error, Result};
use crate::snapshot::{self, SnapshotFile, SnapshotReader, SnapshotWriter};
use crate::wal::record::Record;
use crate::wal::{Wal, WalOptions, WalRecovery};

/// Everything [`WalStorage`] can be tuned by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StorageOptions {
    pub wal: WalOptions,
    /// The recent-entry cache keeps at most this many entries...
    pub cache_entries_max: usize,
    /// ...and at most this many payload bytes.
    pub cache_bytes_max: u64,
    /// Snapshot files kept after a new one is recorded (at least 1: the current one).
    pub snapshots_retained: usize,
    /// Whether [`Storage::snapshot`] reads an image that is not in memory on a helper thread,
    /// answering [`StorageError::SnapshotTemporarilyUnavailable`] until it is read, rather
    /// than on the caller's. A large image takes a quarter of a second to read here, longer
    /// than a leader may go without heartbeats; the server turns this on. Off by default (and
    /// in the simulator, which has no threads); [`WalStorage::load_snapshot`] always reads at
    /// once.
    pub snapshot_read_in_background: bool,
}

impl Default for StorageOptions {
    fn default() -> Self {
        StorageOptions {
            wal: WalOptions::default(),
            cache_entries_max: 4096,
            cache_bytes_max: 16 << 20,
            snapshots_retained: 2,
            snapshot_read_in_background: false,
        }
    }
}

impl StorageOptions {
    /// Small segments, no preallocation: for the simulator and tests on [`crate::SimDisk`].
    pub fn for_simulation() -> StorageOptions {
        StorageOptions {
            wal: WalOptions {
                segment_size_bytes: 64 << 10,
                preallocate: false,
                write_buffer_bytes: 16 << 10,
                zero_ahead_write_bytes_min: crate::wal::ZERO_AHEAD_WRITE_BYTES_MIN,
            },
            cache_entries_max: 256,
            cache_bytes_max: 1 << 20,
            snapshots_retained: 2,
            snapshot_read_in_background: false,
        }
    }

    pub fn validate(&self) -> Result<()> {
        self.wal.validate()?;
        if self.snapshots_retained == 0 {
            return Err(Error::InvalidOptions(
                "snapshots_retained must be at least 1".into(),
            ));
        }
        Ok(())
    }
}

/// Names a point in the write order: the sequence number of the last record of a write.
/// It is durable once [`WalStorage::durable`] has reached it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ticket(pub u64);

/// What [`WalStorage::open`] found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    pub wal: WalRecovery,
    /// Snapshot files that failed verification and were passed over, with the reason.
    pub invalid_snapshots: Vec<(PathBuf, String)>,
    /// A snapshot file newer than the log's record of it was adopted (a crash came between
    /// writing the file and logging it).
    pub adopted_snapshot: Option<Index>,
    /// Directories and files that group or others could access (made by an older version or
    /// by hand), now restricted to the owner.
    pub tightened_permissions: Vec<PathBuf>,
}

/// The most recent entries, contiguous and ending at the log's last index.
#[derive(Debug, Default)]
struct EntryCache {
    entries: VecDeque<Entry>,
    payload_bytes: u64,
}

impl EntryCache {
    fn get(&self, index: Index) -> Option<&Entry> {
        let first = self.entries.front()?.index;
        self.entries
            .get(usize::try_from(index.checked_sub(first)?).ok()?)
    }

    fn truncate_from(&mut self, index: Index) {
        while self
            .entries
            .back()
            .is_some_and(|entry| entry.index >= index)
        {
            let entry = self.entries.pop_back().expect("checked: not empty");
            self.payload_bytes -= entry.payload_size();
        }
    }

    fn drop_through(&mut self, index: Index) {
        while self
            .entries
            .front()
            .is_some_and(|entry| entry.index <= index)
        {
            let entry = self.entries.pop_front().expect("checked: not empty");
            self.payload_bytes -= entry.payload_size();
        }
    }

    fn push(&mut self, entry: Entry, options: &StorageOptions) {
        if let Some(back) = self.entries.back() {
            assert_eq!(back.index + 1, entry.index, "cache must stay contiguous");
        }
        self.payload_bytes += entry.payload_size();
        self.entries.push_back(entry);
        while self.entries.len() > options.cache_entries_max
            || self.payload_bytes > options.cache_bytes_max
        {
            let Some(evicted) = self.entries.pop_front() else {
                break;
            };
            self.payload_bytes -= evicted.payload_size();
        }
    }
}

/// Where the current snapshot's image is: a follower that falls behind the log needs it whole.
///
/// An image (hundreds of MB for a large state) stays in memory only while a copy handed out is
/// alive: a transfer to a follower under way, or the Ready that installs it. Held for good, it
/// would sit beside the state it encodes on every member that started from it, received it or
/// sent it, until the next snapshot; snapshots are sent rarely, and the file has it.
enum HeldImage {
    /// Only in its file (read when a follower first needs it).
    Absent,
    /// In memory while someone holds a copy of it: handed out again from here, and gone
    /// (freed on the release thread) with the last copy.
    Lent(Weak<ImageBuffer>),
    /// Being read from its file on a helper thread.
    Loading(std::sync::mpsc::Receiver<Result<Bytes>>),
}

/// An image handed out as [`Bytes`] that the storage can find again while any copy is alive.
struct ImageBuffer {
    image: Option<Bytes>,
}

impl Drop for ImageBuffer {
    fn drop(&mut self) {
        // The last copy is usually dropped on the Raft thread (a transfer finished, a snapshot
        // installed), which must not spend milliseconds freeing a large image.
        if let Some(image) = self.image.take() {
            crate::release::release(image);
        }
    }
}

/// What a lent [`Bytes`] owns: one strong reference to the buffer.
struct LentImage(Arc<ImageBuffer>);

impl AsRef<[u8]> for LentImage {
    fn as_ref(&self) -> &[u8] {
        self.0.image.as_deref().unwrap_or_default()
    }
}

/// Hands `image` out, keeping only a weak reference to it for the next asker.
fn lend(image: Bytes) -> (Bytes, HeldImage) {
    let buffer = Arc::new(ImageBuffer { image: Some(image) });
    let held = HeldImage::Lent(Arc::downgrade(&buffer));
    (Bytes::from_owner(LentImage(buffer)), held)
}

/// Another copy of a lent image, if any copy is still alive.
fn borrow(buffer: &Weak<ImageBuffer>) -> Option<Bytes> {
    buffer
        .upgrade()
        .map(|buffer| Bytes::from_owner(LentImage(buffer)))
}

/// Durable Raft storage: a write-ahead log plus snapshot files, in one locked directory.
pub struct WalStorage {
    disk: Arc<dyn Disk>,
    snap_dir: PathBuf,
    options: StorageOptions,
    wal: Wal,
    /// The current snapshot's file; `None` only for a log never bootstrapped nor snapshotted.
    snapshot_file: Option<SnapshotFile>,
    /// The current snapshot's image, when it is in memory or being read.
    snapshot_data: Mutex<HeldImage>,
    cache: EntryCache,
    recovery: RecoveryReport,
    _lock: Box<dyn DirLock>,
}

impl std::fmt::Debug for WalStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let model = self.wal.model();
        f.debug_struct("WalStorage")
            .field("snapshot_index", &model.snapshot_index)
            .field("last_index", &model.last_index())
            .field("hard_state", &model.hard_state)
            .finish_non_exhaustive()
    }
}

/// Takes the directory lock, mapping "held elsewhere" to [`Error::Locked`].
pub(crate) fn lock_data_dir(disk: &dyn Disk, dir: &Path) -> Result<Box<dyn DirLock>> {
    disk.create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    disk.lock_dir(dir).map_err(|e| match e.kind() {
        io::ErrorKind::WouldBlock => Error::Locked {
            dir: dir.to_path_buf(),
        },
        _ => Error::io(dir, e),
    })
}

impl WalStorage {
    /// Opens the data directory `dir` on `disk`, creating it if needed and recovering what is
    /// there. Fails with [`Error::Locked`] if another handle has it open, and with a
    /// [`crate::FatalError::Corrupt`] naming file and offset if the stored data is damaged
    /// anywhere but a torn final write.
    pub fn open(
        disk: Arc<dyn Disk>,
        dir: impl AsRef<Path>,
        options: StorageOptions,
    ) -> Result<WalStorage> {
        options.validate()?;
        let dir = dir.as_ref();
        let lock = lock_data_dir(disk.as_ref(), dir)?;
        let snap_dir = dir.join("snap");
        disk.create_dir_all(&snap_dir)
            .map_err(|e| Error::io(&snap_dir, e))?;
        let wal_dir = dir.join("wal");
        disk.create_dir_all(&wal_dir)
            .map_err(|e| Error::io(&wal_dir, e))?;
        let tightened = restrict_to_owner(disk.as_ref(), &[dir, &wal_dir, &snap_dir])?;
        let (candidates, mut recovery) = find_snapshots(disk.as_ref(), &snap_dir)?;
        recovery.tightened_permissions = tightened;
        let (wal, wal_recovery) = Wal::open(disk.clone(), &wal_dir, options.wal)?;
        recovery.wal = wal_recovery;
        let mut storage = WalStorage {
            disk,
            snap_dir,
            options,
            wal,
            snapshot_file: None,
            snapshot_data: Mutex::new(HeldImage::Absent),
            cache: EntryCache::default(),
            recovery,
            _lock: lock,
        };
        storage.reconcile_snapshot(candidates)?;
        storage.fill_cache()?;
        Ok(storage)
    }

    /// Matches the log's idea of its snapshot with the snapshot files on disk.
    fn reconcile_snapshot(&mut self, candidates: Vec<SnapshotFile>) -> Result<()> {
        let model = self.wal.model();
        let (base_index, base_term) = (model.snapshot_index, model.snapshot_term);
        let newest = candidates.first().cloned();
        match newest {
            Some(file) if file.meta.index > base_index => {
                // The file became durable but the crash came before the log recorded it.
                self.recovery.adopted_snapshot = Some(file.meta.index);
                self.record_snapshot(file, true)?;
                self.wal.sync()?;
            }
            _ => {
                let matching = candidates
                    .into_iter()
                    .find(|f| f.meta.index == base_index && f.meta.term == base_term);
                match matching {
                    Some(file) => self.snapshot_file = Some(file),
                    None if base_index == 0 && base_term == 0 => {}
                    None => {
                        let expected = self
                            .snap_dir
                            .join(snapshot::snapshot_file_name(base_index, base_term));
                        let found = self
                            .recovery
                            .invalid_snapshots
                            .iter()
                            .find(|(path, _)| path == &expected)
                            .map_or("the file is missing", |(_, reason)| reason.as_str());
                        // Older snapshots cannot stand in: the log after them was compacted.
                        let reason = format!(
                            "{found}; the log is compacted up to this snapshot, so no older one can \
                             replace it: remove the data directory and let the node rejoin from its peers"
                        );
                        return Err(Error::corrupt(expected, 0, reason));
                    }
                }
            }
        }
        let model = self.wal.model();
        if model.first_index != model.snapshot_index + 1 {
            let first_segment = self
                .wal
                .segment_paths()
                .first()
                .cloned()
                .unwrap_or_default();
            let reason = format!(
                "the log resumes at index {} but the snapshot ends at {}: entries are missing",
                model.first_index, model.snapshot_index
            );
            return Err(Error::corrupt(first_segment, 0, reason));
        }
        Ok(())
    }

    fn fill_cache(&mut self) -> Result<()> {
        let model = self.wal.model();
        let last = model.last_index();
        let mut index = last;
        let mut loaded = Vec::new();
        let mut bytes = 0u64;
        while index >= model.first_index && loaded.len() < self.options.cache_entries_max {
            let entry = self.wal.read_entry(index)?;
            bytes += entry.payload_size();
            if bytes > self.options.cache_bytes_max {
                break;
            }
            loaded.push(entry);
            index -= 1;
        }
        for entry in loaded.into_iter().rev() {
            self.cache.push(entry, &self.options);
        }
        Ok(())
    }

    /// What recovery found when this storage was opened.
    pub fn recovery_report(&self) -> &RecoveryReport {
        &self.recovery
    }

    /// Whether nothing was ever stored here (no snapshot, no entries).
    pub fn is_fresh(&self) -> bool {
        let model = self.wal.model();
        self.snapshot_file.is_none() && model.last_index() == 0 && model.snapshot_index == 0
    }

    /// Gives a fresh directory of a founding member its initial membership: the durable
    /// bootstrap snapshot (index 1, term 1; see [`conclave_raft::bootstrap_snapshot`]) and a
    /// hard state at its term. A node joining an existing cluster skips this and receives a
    /// snapshot from the leader instead.
    pub fn bootstrap(&mut self, conf_state: ConfState) -> Result<()> {
        if !self.is_fresh() {
            return Err(Error::AlreadyBootstrapped);
        }
        let meta = conclave_raft::bootstrap_snapshot(conf_state).meta;
        let hard_state = HardState {
            term: meta.term,
            vote: None,
            commit: meta.index,
        };
        let writer = self.begin_snapshot(meta)?;
        let file = writer.finish()?;
        self.record_snapshot(file, false)?;
        self.set_hard_state(hard_state)?;
        self.wal.sync()?;
        Ok(())
    }

    pub fn hard_state(&self) -> HardState {
        self.wal.model().hard_state
    }

    /// Records the hard state. Durable after the next [`WalStorage::sync`].
    pub fn set_hard_state(&mut self, hard_state: HardState) -> Result<Ticket> {
        self.wal
            .append_record(&Record::HardState(hard_state))
            .map(Ticket)
    }

    /// Appends `entries`, first dropping any stored suffix they overwrite (a new leader's
    /// entries replacing uncommitted ones). They must start no later than `last_index() + 1`
    /// and after the snapshot. Durable after the next [`WalStorage::sync`].
    pub fn append(&mut self, entries: &[Entry]) -> Result<Ticket> {
        let Some(first) = entries.first() else {
            return Ok(self.written());
        };
        let model = self.wal.model();
        let (snapshot_index, last) = (model.snapshot_index, model.last_index());
        assert!(
            first.index > snapshot_index,
            "append at {} overwrites snapshot {snapshot_index}",
            first.index
        );
        assert!(
            first.index <= last + 1,
            "append at {} leaves a gap after {last}",
            first.index
        );
        for pair in entries.windows(2) {
            assert_eq!(
                pair[0].index + 1,
                pair[1].index,
                "appended entries are not contiguous"
            );
        }
        self.cache.truncate_from(first.index);
        for entry in entries {
            let seq = self.wal.append_record(&Record::entry(entry))?;
            assert!(seq > 0);
            self.cache.push(entry.clone(), &self.options);
        }
        Ok(self.written())
    }

    /// Makes everything written so far durable (one `fdatasync` for all of it: group commit)
    /// and returns the ticket it covers.
    pub fn sync(&mut self) -> Result<Ticket> {
        self.wal.sync().map(Ticket)
    }

    /// Hands buffered writes to the operating system without waiting for the disk.
    pub fn flush(&mut self) -> Result<()> {
        self.wal.flush()
    }

    /// The ticket of the last write, durable or not.
    pub fn written(&self) -> Ticket {
        Ticket(self.wal.last_seq())
    }

    /// Everything up to this ticket is durable.
    pub fn durable(&self) -> Ticket {
        Ticket(self.wal.durable_seq())
    }

    pub fn is_durable(&self, ticket: Ticket) -> bool {
        ticket <= self.durable()
    }

    /// Whether some write is waiting for a sync.
    pub fn needs_sync(&self) -> bool {
        self.written() > self.durable()
    }

    /// Starts streaming a snapshot (one the application takes, or one arriving from the
    /// leader in chunks). Finish it with [`SnapshotWriter::finish`] and hand the file to
    /// [`WalStorage::install_snapshot`] or [`WalStorage::record_created_snapshot`].
    pub fn begin_snapshot(&self, meta: SnapshotMeta) -> Result<SnapshotWriter> {
        SnapshotWriter::create(self.disk.clone(), &self.snap_dir, meta)
    }

    /// Replaces the log with a snapshot from the leader (like `MemStorage::apply_snapshot`):
    /// entries after it survive only if the log agrees at its index; the commit index rises to
    /// it. Durable on return; whole segments below it are deleted.
    pub fn install_snapshot(&mut self, file: SnapshotFile) -> Result<()> {
        let index = file.meta.index;
        let mut hard_state = self.hard_state();
        if hard_state.commit < index {
            hard_state.commit = index;
            self.set_hard_state(hard_state)?;
        }
        self.record_snapshot(file, true)?;
        self.finish_snapshot(index)
    }

    /// Records a snapshot the application took at an index it has applied (like
    /// `MemStorage::create_snapshot`) and drops the log up to it. Its writer from
    /// [`WalStorage::begin_snapshot`] may have run on another thread while the log moved on.
    /// The image is not kept in memory: the first follower that needs it has it read back
    /// from the file. Durable on return.
    pub fn record_created_snapshot(&mut self, file: SnapshotFile) -> Result<()> {
        let index = file.meta.index;
        let last = self.wal.model().last_index();
        assert!(
            index <= last,
            "snapshot at {index} is past the log end {last}"
        );
        let term = self.wal.model().term(index);
        assert_eq!(
            term,
            Some(file.meta.term),
            "snapshot at {index} has the wrong term"
        );
        self.record_snapshot(file, false)?;
        self.finish_snapshot(index)
    }

    /// Writes `data` as a snapshot at `index` and drops the log up to it.
    pub fn create_snapshot(
        &mut self,
        index: Index,
        conf_state: ConfState,
        data: Bytes,
    ) -> Result<()> {
        let term = self.wal.model().term(index);
        let term = term.unwrap_or_else(|| panic!("snapshot at {index} is outside the log"));
        let mut writer = self.begin_snapshot(SnapshotMeta {
            index,
            term,
            conf_state,
        })?;
        writer.write_chunk(&data)?;
        let file = writer.finish()?;
        self.record_created_snapshot(file)?;
        Ok(())
    }

    /// Writes a whole snapshot from the leader and installs it.
    pub fn apply_snapshot(&mut self, snapshot: Snapshot) -> Result<()> {
        let mut writer = self.begin_snapshot(snapshot.meta)?;
        writer.write_chunk(&snapshot.data)?;
        let file = writer.finish()?;
        self.install_snapshot(file)?;
        Ok(())
    }

    /// Logs that `file` now covers the log up to its index.
    fn record_snapshot(&mut self, file: SnapshotFile, raise_commit: bool) -> Result<()> {
        let SnapshotMeta { index, term, .. } = file.meta;
        let model = self.wal.model();
        assert!(
            index >= model.snapshot_index,
            "snapshot {index} is older than the stored {}",
            model.snapshot_index
        );
        let keep_suffix = model.term(index) == Some(term);
        if raise_commit && model.hard_state.commit < index {
            let hard_state = HardState {
                commit: index,
                ..model.hard_state
            };
            self.wal.append_record(&Record::HardState(hard_state))?;
        }
        self.wal.append_record(&Record::Snapshot {
            index,
            term,
            keep_suffix,
        })?;
        if keep_suffix {
            self.cache.drop_through(index);
        } else {
            self.cache = EntryCache::default();
        }
        self.snapshot_file = Some(file);
        self.forget_snapshot_data();
        Ok(())
    }

    /// Syncs the snapshot record, then deletes what it made unnecessary.
    fn finish_snapshot(&mut self, index: Index) -> Result<()> {
        self.wal.sync()?;
        self.wal.compact(index)?;
        self.prune_snapshots()
    }

    /// Deletes all but the newest `snapshots_retained` snapshot files.
    fn prune_snapshots(&mut self) -> Result<()> {
        let names = self
            .disk
            .list_files(&self.snap_dir)
            .map_err(|e| Error::io(&self.snap_dir, e))?;
        let mut snapshots: Vec<((Index, Term), String)> = names
            .into_iter()
            .filter_map(|name| Some((snapshot::parse_snapshot_file_name(&name)?, name)))
            .collect();
        snapshots.sort_unstable_by_key(|entry| std::cmp::Reverse(entry.0));
        let current = self.snapshot_file.as_ref().map(|file| file.path.clone());
        let mut removed = false;
        for (_, name) in snapshots.into_iter().skip(self.options.snapshots_retained) {
            let path = self.snap_dir.join(name);
            if Some(&path) != current.as_ref() {
                self.disk
                    .remove_file(&path)
                    .map_err(|e| Error::io(&path, e))?;
                removed = true;
            }
        }
        if removed {
            self.disk
                .sync_dir(&self.snap_dir)
                .map_err(|e| Error::io(&self.snap_dir, e))?;
        }
        Ok(())
    }

    /// The current snapshot, its image read from the file now if it is not in memory (or
    /// waited for, if a helper thread is reading it): for start-up, before the node serves.
    pub fn load_snapshot(&self) -> std::result::Result<Snapshot, StorageError> {
        self.held_snapshot(ImageRead::Now)
    }

    /// The current snapshot with its image, read as `read` says if it is not in memory yet.
    fn held_snapshot(&self, read: ImageRead) -> std::result::Result<Snapshot, StorageError> {
        let Some(file) = &self.snapshot_file else {
            return Ok(Snapshot::default());
        };
        let mut held = self.lock_snapshot_data();
        if let HeldImage::Lent(buffer) = &*held {
            match borrow(buffer) {
                Some(data) => {
                    return Ok(Snapshot {
                        meta: file.meta.clone(),
                        data,
                    });
                }
                None => *held = HeldImage::Absent,
            }
        }
        if let HeldImage::Loading(reading) = &*held {
            let answer = match read {
                ImageRead::Now => reading.recv().ok(),
                ImageRead::InBackground => match reading.try_recv() {
                    Ok(answer) => Some(answer),
                    Err(std::sync::mpsc::TryRecvError::Empty) => {
                        return Err(StorageError::SnapshotTemporarilyUnavailable);
                    }
                    Err(std::sync::mpsc::TryRecvError::Disconnected) => None,
                },
            };
            match answer {
                Some(Ok(data)) => {
                    let (data, lent) = lend(data);
                    *held = lent;
                    return Ok(Snapshot {
                        meta: file.meta.clone(),
                        data,
                    });
                }
                Some(Err(error)) => {
                    *held = HeldImage::Absent;
                    return Err(to_storage_error(error));
                }
                // A reader that stopped without an answer: read again below.
                None => *held = HeldImage::Absent,
            }
        }
        if read == ImageRead::InBackground {
            let disk = self.disk.clone();
            let reading_file = file.clone();
            let (answer, reading) = std::sync::mpsc::channel();
            let spawned = std::thread::Builder::new()
                .name("conclave-snapread".into())
                .spawn(move || {
                    let _ = answer.send(read_image(disk.as_ref(), reading_file));
                });
            // Without a thread, the caller reads it itself.
            if spawned.is_ok() {
                *held = HeldImage::Loading(reading);
                return Err(StorageError::SnapshotTemporarilyUnavailable);
            }
        }
        let data = read_image(self.disk.as_ref(), file.clone()).map_err(to_storage_error)?;
        let (data, lent) = lend(data);
        *held = lent;
        Ok(Snapshot {
            meta: file.meta.clone(),
            data,
        })
    }

    /// Opens the current snapshot for reading in chunks (e.g. to send it to a follower).
    pub fn snapshot_reader(&self) -> Result<Option<SnapshotReader>> {
        match &self.snapshot_file {
            Some(file) => SnapshotReader::open(self.disk.as_ref(), file.clone()).map(Some),
            None => Ok(None),
        }
    }

    /// Forgets the image lent for followers: a new snapshot replaced it. A copy still held
    /// elsewhere lives on with its holder; a read still under way is abandoned (its thread
    /// frees what it read). The new image is read from its file when a follower needs it.
    fn forget_snapshot_data(&self) {
        let replaced = std::mem::replace(&mut *self.lock_snapshot_data(), HeldImage::Absent);
        if let HeldImage::Loading(reading) = replaced {
            // A read that finished but was never asked for holds an image too.
            if let Ok(Ok(image)) = reading.try_recv() {
                crate::release::release(image);
            }
        }
    }

    fn lock_snapshot_data(&self) -> std::sync::MutexGuard<'_, HeldImage> {
        self.snapshot_data
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The segment files, oldest first (for tests and tools).
    pub fn segment_paths(&self) -> Vec<PathBuf> {
        self.wal.segment_paths()
    }

    fn entry(&self, index: Index) -> Result<Entry> {
        match self.cache.get(index) {
            Some(entry) => Ok(entry.clone()),
            None => self.wal.read_entry(index),
        }
    }
}

/// A snapshot file's image, read whole.
fn read_image(disk: &dyn Disk, file: SnapshotFile) -> Result<Bytes> {
    SnapshotReader::open(disk, file)?.read_all()
}

/// How an image that is not in memory is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ImageRead {
    /// On the caller's thread.
    Now,
    /// On a helper thread; the caller hears "temporarily unavailable" until it is read.
    InBackground,
}

fn to_storage_error(error: Error) -> StorageError {
    match error {
        Error::Compacted(index) => StorageError::Compacted(index),
        Error::Unavailable(index) => StorageError::Unavailable(index),
        other => StorageError::Fatal(other.to_string()),
    }
}

impl Storage for WalStorage {
    fn initial_state(&self) -> Result<(HardState, ConfState), StorageError> {
        let conf_state = self
            .snapshot_file
            .as_ref()
            .map(|file| file.meta.conf_state.clone())
            .unwrap_or_default();
        Ok((self.hard_state(), conf_state))
    }

    fn entries(&self, low: Index, high: Index, max_bytes: u64) -> Result<Vec<Entry>, StorageError> {
        let model = self.wal.model();
        if low <= model.snapshot_index {
            return Err(StorageError::Compacted(low));
        }
        if high > model.last_index() + 1 {
            return Err(StorageError::Unavailable(high));
        }
        let mut out = Vec::new();
        let mut size = 0u64;
        for index in low..high {
            let entry = self.entry(index).map_err(to_storage_error)?;
            size += entry.payload_size();
            if !out.is_empty() && size > max_bytes {
                break;
            }
            out.push(entry);
        }
        Ok(out)
    }

    fn term(&self, index: Index) -> Result<Term, StorageError> {
        let model = self.wal.model();
        if index < model.snapshot_index {
            return Err(StorageError::Compacted(index));
        }
        model.term(index).ok_or(StorageError::Unavailable(index))
    }

    fn first_index(&self) -> Result<Index, StorageError> {
        Ok(self.wal.model().snapshot_index + 1)
    }

    fn last_index(&self) -> Result<Index, StorageError> {
        Ok(self.wal.model().last_index())
    }

    fn snapshot(&self) -> Result<Snapshot, StorageError> {
        if self.options.snapshot_read_in_background {
            self.held_snapshot(ImageRead::InBackground)
        } else {
            self.held_snapshot(ImageRead::Now)
        }
    }
}

/// Restricts `dirs` and the files in them to the owner; returns what had to change.
fn restrict_to_owner(disk: &dyn Disk, dirs: &[&Path]) -> Result<Vec<PathBuf>> {
    let mut tightened = Vec::new();
    for dir in dirs {
        let names = disk.list_files(dir).map_err(|e| Error::io(*dir, e))?;
        let files = names.into_iter().map(|name| dir.join(name));
        for path in std::iter::once(dir.to_path_buf()).chain(files) {
            if disk
                .restrict_to_owner(&path)
                .map_err(|e| Error::io(&path, e))?
            {
                tightened.push(path);
            }
        }
    }
    Ok(tightened)
}

/// The verified snapshot files in `dir`, newest first, stopping at the first valid one (older
/// files are only read if the log needs a specific one). Removes leftover temp files.
fn find_snapshots(disk: &dyn Disk, dir: &Path) -> Result<(Vec<SnapshotFile>, RecoveryReport)> {
    let names = disk.list_files(dir).map_err(|e| Error::io(dir, e))?;
    let mut report = RecoveryReport::default();
    let mut named = Vec::new();
    let mut removed_temp = false;
    for name in names {
        if snapshot::is_temp_snapshot_name(&name) {
            let path = dir.join(&name);
            disk.remove_file(&path).map_err(|e| Error::io(&path, e))?;
            removed_temp = true;
        } else if let Some(key) = snapshot::parse_snapshot_file_name(&name) {
            named.push((key, name));
        }
    }
    if removed_temp {
        disk.sync_dir(dir).map_err(|e| Error::io(dir, e))?;
    }
    named.sort_unstable_by_key(|entry| std::cmp::Reverse(entry.0));
    let mut valid = Vec::new();
    for ((index, term), name) in named {
        let path = dir.join(name);
        match snapshot::verify_snapshot_file(disk, &path) {
            Ok(file) if file.meta.index == index && file.meta.term == term => valid.push(file),
            Ok(_) => report
                .invalid_snapshots
                .push((path, "file name disagrees with its contents".into())),
            Err(reason) => report.invalid_snapshots.push((path, reason)),
        }
    }
    Ok((valid, report))
}
