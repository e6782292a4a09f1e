//! A simulated disk in memory, deterministic from a seed, with no threads and no clocks.
//!
//! It keeps, for every file, the bytes written so far and the bytes as of its last sync, and for
//! every directory the entries as of its last directory sync. [`SimDisk::crash`] throws away
//! everything unsynced, like a power cut: files not yet made durable in their directory vanish,
//! and a file keeps its synced bytes, plus, when the crash tears, a random prefix of its unsynced
//! bytes whose last few bytes may be garbled (a write cut short in the middle of a sector).
//! Handles opened before a crash fail afterwards, like a dead process's file descriptors.
//!
//! Directories themselves are durable as soon as they are created (the log creates its
//! directories once, and a lost empty directory is not a fault worth modelling).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::disk::{DirLock, Disk, DiskFile};

/// A torn write garbles at most this many bytes at its end. Fewer than the smallest record
/// (17 bytes), so garbling never reaches past the last record of the torn part.
const TORN_GARBLE_BYTES_MAX: usize = 16;

/// How the simulated disk misbehaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimDiskOptions {
    /// Chance, in percent, that a crash keeps a torn part of each file's unsynced bytes.
    pub torn_write_percent: u8,
    /// Chance, in percent, that a torn part has some of its last bytes garbled.
    pub garble_percent: u8,
}

impl Default for SimDiskOptions {
    fn default() -> Self {
        SimDiskOptions {
            torn_write_percent: 50,
            garble_percent: 50,
        }
    }
}

/// A shared handle to one simulated disk; clones see the same disk.
#[derive(Clone)]
pub struct SimDisk {
    state: Arc<Mutex<SimState>>,
}

impl std::fmt::Debug for SimDisk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.lock();
        f.debug_struct("SimDisk")
            .field("crashes", &state.crash_count)
            .finish_non_exhaustive()
    }
}

struct Inode {
    data: Vec<u8>,
    /// The bytes as of the last `sync_data`.
    synced: Vec<u8>,
    /// Invariant: `data[..dirty_from] == synced[..dirty_from]`; syncs copy only the rest.
    dirty_from: usize,
}

impl Inode {
    fn new(bytes: Vec<u8>) -> Inode {
        Inode {
            dirty_from: bytes.len(),
            synced: bytes.clone(),
            data: bytes,
        }
    }

    fn sync(&mut self) {
        let from = self.dirty_from.min(self.data.len()).min(self.synced.len());
        self.synced.truncate(from);
        self.synced.extend_from_slice(&self.data[from..]);
        self.dirty_from = self.data.len();
    }
}

struct SimState {
    options: SimDiskOptions,
    rng_state: u64,
    /// Bumped by every crash; handles from an older boot are dead.
    boot: u64,
    crash_count: u64,
    sync_count: u64,
    /// Syncs still to fail with an I/O error (fault injection).
    failing_syncs: u32,
    next_inode: u64,
    inodes: HashMap<u64, Inode>,
    names: BTreeMap<PathBuf, u64>,
    /// The directory entries as of each directory's last sync.
    durable_names: BTreeMap<PathBuf, u64>,
    dirs: BTreeSet<PathBuf>,
    /// Locked directories and the token of the guard holding each.
    locks: HashMap<PathBuf, u64>,
    next_lock_token: u64,
}

impl SimState {
    /// splitmix64: tiny, good enough for fault choices, and fully determined by the seed.
    fn next_random(&mut self) -> u64 {
        self.rng_state = self.rng_state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng_state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn chance_percent(&mut self, percent: u8) -> bool {
        self.next_random() % 100 < u64::from(percent)
    }

    fn inode_of(&self, path: &Path) -> io::Result<u64> {
        self.names.get(path).copied().ok_or_else(|| not_found(path))
    }

    fn check_parent(&self, path: &Path) -> io::Result<()> {
        match path.parent() {
            Some(parent) if self.dirs.contains(parent) => Ok(()),
            _ => Err(not_found(path)),
        }
    }

    /// What survives a crash of one file: its synced bytes and maybe a torn unsynced part.
    fn surviving_bytes(&mut self, inode: &Inode) -> Vec<u8> {
        let mut survivor = inode.synced.clone();
        let start = inode
            .dirty_from
            .min(inode.data.len())
            .min(inode.synced.len());
        let common = start
            + inode.data[start..]
                .iter()
                .zip(&inode.synced[start..])
                .take_while(|(a, b)| a == b)
                .count();
        let unsynced_len = inode.data.len().saturating_sub(common) as u64;
        if unsynced_len == 0 || !self.chance_percent(self.options.torn_write_percent) {
            return survivor;
        }
        let kept = (self.next_random() % (unsynced_len + 1)) as usize;
        let end = common + kept;
        if survivor.len() < end {
            survivor.resize(end, 0);
        }
        survivor[common..end].copy_from_slice(&inode.data[common..end]);
        if kept > 0 && self.chance_percent(self.options.garble_percent) {
            // Only the end of the torn part is garbled: the sector being written when the
            // power went. Bytes before it either reached the platter or did not.
            let window = kept.min(TORN_GARBLE_BYTES_MAX);
            let garbled = 1 + (self.next_random() % window as u64) as usize;
            for _ in 0..garbled {
                let at = end - 1 - (self.next_random() % window as u64) as usize;
                survivor[at] ^= (self.next_random() % 255 + 1) as u8;
            }
        }
        survivor
    }
}

fn not_found(path: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::NotFound,
        format!("{} not found", path.display()),
    )
}

fn stale_handle() -> io::Error {
    io::Error::other("stale handle: the simulated disk crashed since it was opened")
}

impl SimDisk {
    /// An empty disk whose fault choices follow `seed`.
    pub fn new(seed: u64, options: SimDiskOptions) -> SimDisk {
        let mut dirs = BTreeSet::new();
        dirs.insert(PathBuf::from("/"));
        dirs.insert(PathBuf::new());
        SimDisk {
            state: Arc::new(Mutex::new(SimState {
                options,
                rng_state: seed,
                boot: 0,
                crash_count: 0,
                sync_count: 0,
                failing_syncs: 0,
                next_inode: 1,
                inodes: HashMap::new(),
                names: BTreeMap::new(),
                durable_names: BTreeMap::new(),
                dirs,
                locks: HashMap::new(),
                next_lock_token: 1,
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, SimState> {
        // A panic while holding the lock leaves plain data behind; keep using it.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A power cut: unsynced data and directory entries are lost (maybe torn), locks are
    /// released, and every handle opened before it fails from now on.
    pub fn crash(&self) {
        let mut state = self.lock();
        state.boot += 1;
        state.crash_count += 1;
        state.locks.clear();
        state.names = state.durable_names.clone();
        let live: BTreeSet<u64> = state.names.values().copied().collect();
        let mut inodes = std::mem::take(&mut state.inodes);
        inodes.retain(|id, _| live.contains(id));
        let mut ids: Vec<u64> = inodes.keys().copied().collect();
        ids.sort_unstable(); // HashMap order is random; the fault choices must not be.
        for id in ids {
            if let Some(inode) = inodes.get_mut(&id) {
                *inode = Inode::new(state.surviving_bytes(inode));
            }
        }
        state.inodes = inodes;
    }

    /// Makes the next `count` file syncs fail with an I/O error.
    pub fn fail_next_syncs(&self, count: u32) {
        self.lock().failing_syncs = count;
    }

    /// How many file syncs succeeded so far.
    pub fn sync_count(&self) -> u64 {
        self.lock().sync_count
    }

    /// The durable bytes of `path` (what a crash now would leave, before tearing).
    pub fn durable_bytes(&self, path: &Path) -> Option<Vec<u8>> {
        let state = self.lock();
        let id = state.durable_names.get(path)?;
        state.inodes.get(id).map(|inode| inode.synced.clone())
    }

    /// Replaces the contents of `path` durably, as a fault injector does to a powered-off disk.
    pub fn set_durable_bytes(&self, path: &Path, bytes: Vec<u8>) {
        let mut state = self.lock();
        let id = match state.names.get(path) {
            Some(&id) => id,
            None => {
                let id = state.next_inode;
                state.next_inode += 1;
                state.names.insert(path.to_path_buf(), id);
                id
            }
        };
        state.durable_names.insert(path.to_path_buf(), id);
        state.inodes.insert(id, Inode::new(bytes));
    }

    /// Removes `path` durably (a lost file).
    pub fn remove_durably(&self, path: &Path) {
        let mut state = self.lock();
        state.names.remove(path);
        state.durable_names.remove(path);
    }

    /// The durable file names in `dir`, sorted.
    pub fn durable_files(&self, dir: &Path) -> Vec<String> {
        let state = self.lock();
        state
            .durable_names
            .keys()
            .filter(|path| path.parent() == Some(dir))
            .filter_map(|path| path.file_name()?.to_str().map(str::to_owned))
            .collect()
    }
}

impl Disk for SimDisk {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        let mut state = self.lock();
        for ancestor in dir.ancestors() {
            state.dirs.insert(ancestor.to_path_buf());
        }
        Ok(())
    }

    fn list_files(&self, dir: &Path) -> io::Result<Vec<String>> {
        let state = self.lock();
        if !state.dirs.contains(dir) {
            return Err(not_found(dir));
        }
        Ok(state
            .names
            .keys()
            .filter(|path| path.parent() == Some(dir))
            .filter_map(|path| path.file_name()?.to_str().map(str::to_owned))
            .collect())
    }

    fn create(&self, path: &Path) -> io::Result<Box<dyn DiskFile>> {
        let mut state = self.lock();
        state.check_parent(path)?;
        let id = state.next_inode;
        state.next_inode += 1;
        state.inodes.insert(id, Inode::new(Vec::new()));
        state.names.insert(path.to_path_buf(), id);
        let boot = state.boot;
        Ok(Box::new(SimFile {
            disk: self.clone(),
            inode: id,
            boot,
        }))
    }

    fn open(&self, path: &Path) -> io::Result<Box<dyn DiskFile>> {
        let state = self.lock();
        let id = state.inode_of(path)?;
        Ok(Box::new(SimFile {
            disk: self.clone(),
            inode: id,
            boot: state.boot,
        }))
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        let mut state = self.lock();
        state
            .names
            .remove(path)
            .map(|_| ())
            .ok_or_else(|| not_found(path))
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let mut state = self.lock();
        state.check_parent(to)?;
        let id = state.names.remove(from).ok_or_else(|| not_found(from))?;
        state.names.insert(to.to_path_buf(), id);
        Ok(())
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let mut state = self.lock();
        if !state.dirs.contains(dir) {
            return Err(not_found(dir));
        }
        let in_dir = |path: &PathBuf| path.parent() == Some(dir);
        state.durable_names.retain(|path, _| !in_dir(path));
        let entries: Vec<(PathBuf, u64)> = state
            .names
            .iter()
            .filter(|(path, _)| in_dir(path))
            .map(|(p, id)| (p.clone(), *id))
            .collect();
        state.durable_names.extend(entries);
        Ok(())
    }

    fn lock_dir(&self, dir: &Path) -> io::Result<Box<dyn DirLock>> {
        let mut state = self.lock();
        if state.locks.contains_key(dir) {
            return Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                "directory is locked",
            ));
        }
        let token = state.next_lock_token;
        state.next_lock_token += 1;
        state.locks.insert(dir.to_path_buf(), token);
        Ok(Box::new(SimDirLock {
            disk: self.clone(),
            dir: dir.to_path_buf(),
            token,
        }))
    }
}

struct SimDirLock {
    disk: SimDisk,
    dir: PathBuf,
    token: u64,
}

impl DirLock for SimDirLock {}

impl Drop for SimDirLock {
    fn drop(&mut self) {
        let mut state = self.disk.lock();
        // After a crash someone else may hold a newer lock on the same directory.
        if state.locks.get(&self.dir) == Some(&self.token) {
            state.locks.remove(&self.dir);
        }
    }
}

struct SimFile {
    disk: SimDisk,
    inode: u64,
    boot: u64,
}

impl SimFile {
    fn with_inode<T>(
        &self,
        action: impl FnOnce(&mut SimState, u64) -> io::Result<T>,
    ) -> io::Result<T> {
        let mut state = self.disk.lock();
        if state.boot != self.boot || !state.inodes.contains_key(&self.inode) {
            return Err(stale_handle());
        }
        action(&mut state, self.inode)
    }
}

fn inode_mut(state: &mut SimState, id: u64) -> io::Result<&mut Inode> {
    state.inodes.get_mut(&id).ok_or_else(stale_handle)
}

impl DiskFile for SimFile {
    fn len_bytes(&self) -> io::Result<u64> {
        self.with_inode(|state, id| Ok(inode_mut(state, id)?.data.len() as u64))
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        self.with_inode(|state, id| {
            let data = &inode_mut(state, id)?.data;
            let start = usize::try_from(offset)
                .unwrap_or(usize::MAX)
                .min(data.len());
            let count = buf.len().min(data.len() - start);
            buf[..count].copy_from_slice(&data[start..start + count]);
            Ok(count)
        })
    }

    fn write_at(&mut self, offset: u64, bytes: &[u8]) -> io::Result<()> {
        self.with_inode(|state, id| {
            let inode = inode_mut(state, id)?;
            let start = usize::try_from(offset)
                .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "offset too large"))?;
            let end = start + bytes.len();
            if inode.data.len() < end {
                inode.data.resize(end, 0);
            }
            inode.data[start..end].copy_from_slice(bytes);
            inode.dirty_from = inode.dirty_from.min(start);
            Ok(())
        })
    }

    fn sync_data(&mut self) -> io::Result<()> {
        self.with_inode(|state, id| {
            if state.failing_syncs > 0 {
                state.failing_syncs -= 1;
                return Err(io::Error::other("injected sync failure"));
            }
            state.sync_count += 1;
            inode_mut(state, id)?.sync();
            Ok(())
        })
    }

    fn set_len(&mut self, len_bytes: u64) -> io::Result<()> {
        self.with_inode(|state, id| {
            let len = usize::try_from(len_bytes)
                .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "length too large"))?;
            let inode = inode_mut(state, id)?;
            inode.data.resize(len, 0);
            inode.dirty_from = inode.dirty_from.min(len);
            Ok(())
        })
    }

    fn preallocate(&mut self, len_bytes: u64) -> io::Result<()> {
        self.with_inode(|state, id| {
            let len = usize::try_from(len_bytes)
                .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "length too large"))?;
            let inode = inode_mut(state, id)?;
            if inode.data.len() < len {
                inode.dirty_from = inode.dirty_from.min(inode.data.len());
                inode.data.resize(len, 0);
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_crash_keeps_synced_bytes_and_entries_and_kills_old_handles() {
        let disk = SimDisk::new(
            9,
            SimDiskOptions {
                torn_write_percent: 0,
                garble_percent: 0,
            },
        );
        let dir = Path::new("/d");
        disk.create_dir_all(dir).expect("mkdir");
        let synced_path = dir.join("synced");
        let mut file = disk.create(&synced_path).expect("create");
        file.write_at(0, b"durable").expect("write");
        file.sync_data().expect("sync");
        disk.sync_dir(dir).expect("sync dir");
        file.write_at(7, b" and lost").expect("write");
        let mut unnamed = disk.create(&dir.join("unnamed")).expect("create");
        unnamed.write_at(0, b"x").expect("write");
        unnamed.sync_data().expect("sync"); // data synced, but its directory entry never was
        let _lock = disk.lock_dir(dir).expect("lock");
        assert!(disk.lock_dir(dir).is_err());

        disk.crash();
        assert!(
            file.read_at(0, &mut [0u8; 4]).is_err(),
            "old handles die with the crash"
        );
        assert_eq!(
            disk.list_files(dir).expect("list"),
            vec!["synced".to_string()]
        );
        let reopened = disk.open(&synced_path).expect("open");
        assert_eq!(
            crate::disk::read_to_end(reopened.as_ref()).expect("read"),
            b"durable"
        );
        assert!(disk.lock_dir(dir).is_ok(), "a crash releases locks");
    }

    #[test]
    fn torn_crashes_keep_a_prefix_of_the_unsynced_bytes_with_at_most_a_garbled_end() {
        for seed in 0..200 {
            let disk = SimDisk::new(
                seed,
                SimDiskOptions {
                    torn_write_percent: 100,
                    garble_percent: 50,
                },
            );
            let dir = Path::new("/d");
            disk.create_dir_all(dir).expect("mkdir");
            let path = dir.join("f");
            let mut file = disk.create(&path).expect("create");
            file.write_at(0, &[1u8; 100]).expect("write");
            file.sync_data().expect("sync");
            disk.sync_dir(dir).expect("sync dir");
            file.write_at(100, &[2u8; 100]).expect("write");
            disk.crash();
            let bytes = disk.durable_bytes(&path).expect("file survives");
            assert!(bytes.len() >= 100 && bytes.len() <= 200, "seed {seed}");
            assert!(
                bytes[..100].iter().all(|&b| b == 1),
                "seed {seed}: synced bytes changed"
            );
            let torn = &bytes[100..];
            let intact = torn.len().saturating_sub(TORN_GARBLE_BYTES_MAX);
            assert!(
                torn[..intact].iter().all(|&b| b == 2),
                "seed {seed}: garbled too early"
            );
        }
    }
}
