//! The seam between the storage and a file system.
//!
//! ```text
//!   Wal / snapshots ──> dyn Disk ──┬─> OsDisk   (std::fs, fdatasync, posix_fallocate, flock)
//!                                  └─> SimDisk  (memory; crash() keeps synced bytes only)
//! ```
//!
//! The trait is small on purpose: it holds only what the log needs, so the simulated disk can
//! model exactly what survives a crash. To ensure correctness an implementation must:
//! - make a file's data and length durable on [`DiskFile::sync_data`], and nothing earlier;
//! - make creations, renames and removals durable only on [`Disk::sync_dir`] of the parent;
//! - let [`Disk::lock_dir`] fail with [`io::ErrorKind::WouldBlock`] while another lock is held.

use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

/// A file system: real or simulated. All paths are absolute or relative to the same root.
pub trait Disk: Send + Sync {
    /// Creates `dir` and its parents. Durable once the parents are synced.
    fn create_dir_all(&self, dir: &Path) -> io::Result<()>;
    /// The names (not paths) of the regular files in `dir`, in no particular order.
    fn list_files(&self, dir: &Path) -> io::Result<Vec<String>>;
    /// Creates `path` empty, replacing any file of that name, opened for reading and writing.
    fn create(&self, path: &Path) -> io::Result<Box<dyn DiskFile>>;
    /// Opens an existing file for reading and writing.
    fn open(&self, path: &Path) -> io::Result<Box<dyn DiskFile>>;
    fn remove_file(&self, path: &Path) -> io::Result<()>;
    /// Atomically replaces `to` with `from` (both in the same directory).
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Makes the directory's entries (creations, renames, removals) durable.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    /// Takes an exclusive lock on `dir` held until the guard is dropped.
    fn lock_dir(&self, dir: &Path) -> io::Result<Box<dyn DirLock>>;
    /// Takes away every permission of the group and of others on `path` (a file or a
    /// directory); returns whether there were any. A disk without permissions has none.
    fn restrict_to_owner(&self, path: &Path) -> io::Result<bool> {
        let _ = path;
        Ok(false)
    }
}

/// An open file.
pub trait DiskFile: Send {
    /// The file's current length in bytes.
    fn len_bytes(&self) -> io::Result<u64>;
    /// Reads up to `buf.len()` bytes at `offset`; returns how many (0 at the end of the file).
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<usize>;
    /// Writes all of `data` at `offset`, growing the file if needed. Not durable until synced.
    fn write_at(&mut self, offset: u64, data: &[u8]) -> io::Result<()>;
    /// Makes the data written so far, and the length, durable (`fdatasync`).
    fn sync_data(&mut self) -> io::Result<()>;
    /// Cuts or extends the file to `len_bytes`. Not durable until synced.
    fn set_len(&mut self, len_bytes: u64) -> io::Result<()>;
    /// Reserves space up to `len_bytes` (zero-filled) so later appends need no allocation.
    fn preallocate(&mut self, len_bytes: u64) -> io::Result<()>;
}

/// Proof that a directory is locked; dropping it releases the lock.
pub trait DirLock: Send {}

/// Reads `buf.len()` bytes at `offset`, or fails with `UnexpectedEof`.
pub fn read_exact_at(file: &dyn DiskFile, mut offset: u64, mut buf: &mut [u8]) -> io::Result<()> {
    while !buf.is_empty() {
        let read = file.read_at(offset, buf)?;
        if read == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "file ends early",
            ));
        }
        offset += read as u64;
        buf = &mut buf[read..];
    }
    Ok(())
}

/// Reads the whole file into memory.
pub fn read_to_end(file: &dyn DiskFile) -> io::Result<Vec<u8>> {
    let len = usize::try_from(file.len_bytes()?)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "file too large for memory"))?;
    let mut bytes = vec![0u8; len];
    read_exact_at(file, 0, &mut bytes)?;
    Ok(bytes)
}

/// Mode of the directories [`OsDisk`] creates: the node's data is its own (etcd does the same).
pub const DIR_MODE: u32 = 0o700;
/// Mode of the files [`OsDisk`] creates.
pub const FILE_MODE: u32 = 0o600;
/// The permission bits of the group and of others.
const GROUP_AND_OTHER_BITS: u32 = 0o077;

/// The real file system. Directories it creates are [`DIR_MODE`] and files [`FILE_MODE`],
/// whatever the umask allows.
#[derive(Debug, Clone, Copy, Default)]
pub struct OsDisk;

impl Disk for OsDisk {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        DirBuilder::new().recursive(true).mode(DIR_MODE).create(dir)
    }

    fn list_files(&self, dir: &Path) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        for item in fs::read_dir(dir)? {
            let item = item?;
            if item.file_type()?.is_file() {
                // Names that are not UTF-8 are not ours; skipping them is safe.
                if let Ok(name) = item.file_name().into_string() {
                    names.push(name);
                }
            }
        }
        Ok(names)
    }

    fn create(&self, path: &Path) -> io::Result<Box<dyn DiskFile>> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .mode(FILE_MODE)
            .open(path)?;
        Ok(Box::new(OsFile { file }))
    }

    fn open(&self, path: &Path) -> io::Result<Box<dyn DiskFile>> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        Ok(Box::new(OsFile { file }))
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        // Held open across the unlink, the file loses only its name here. The release thread
        // frees its blocks a step at a time, so the Raft thread that called this never waits.
        let held = OpenOptions::new().write(true).open(path).ok();
        fs::remove_file(path)?;
        if let Some(file) = held {
            crate::release::release_removed_file(file);
        }
        Ok(())
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        fs::rename(from, to)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }

    fn lock_dir(&self, dir: &Path) -> io::Result<Box<dyn DirLock>> {
        let path = dir.join(LOCK_FILE_NAME);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(FILE_MODE)
            .open(&path)?;
        // flock locks belong to the open file description, so a second open in this very
        // process conflicts too, and the kernel drops the lock when the process dies.
        // SAFETY: flock only reads the descriptor, which `file` keeps open for the call.
        let result = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if result != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Box::new(OsDirLock {
            _file: file,
            _path: path,
        }))
    }

    fn restrict_to_owner(&self, path: &Path) -> io::Result<bool> {
        // symlink_metadata: a link planted in the directory is not followed to its target.
        let metadata = fs::symlink_metadata(path)?;
        if metadata.file_type().is_symlink() {
            return Ok(false);
        }
        let mode = metadata.permissions().mode();
        if mode & GROUP_AND_OTHER_BITS == 0 {
            return Ok(false);
        }
        fs::set_permissions(
            path,
            fs::Permissions::from_mode(mode & !GROUP_AND_OTHER_BITS),
        )?;
        Ok(true)
    }
}

/// The name of the lock file in a data directory.
pub const LOCK_FILE_NAME: &str = "LOCK";

struct OsDirLock {
    /// Holding the descriptor holds the flock; closing it releases the lock.
    _file: File,
    _path: PathBuf,
}

impl DirLock for OsDirLock {}

struct OsFile {
    file: File,
}

impl DiskFile for OsFile {
    fn len_bytes(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        FileExt::read_at(&self.file, buf, offset)
    }

    fn write_at(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        FileExt::write_all_at(&self.file, data, offset)
    }

    fn sync_data(&mut self) -> io::Result<()> {
        // fdatasync on Linux: data and size, without unrelated metadata such as mtime.
        self.file.sync_data()
    }

    fn set_len(&mut self, len_bytes: u64) -> io::Result<()> {
        self.file.set_len(len_bytes)
    }

    fn preallocate(&mut self, len_bytes: u64) -> io::Result<()> {
        let len = libc::off_t::try_from(len_bytes)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "preallocation too large"))?;
        // SAFETY: posix_fallocate only reads the descriptor, which `self.file` keeps open.
        let result = unsafe { libc::posix_fallocate(self.file.as_raw_fd(), 0, len) };
        match result {
            0 => Ok(()),
            // Some file systems cannot preallocate; the log works without it, only slower.
            libc::EOPNOTSUPP | libc::EINVAL => Ok(()),
            errno => Err(io::Error::from_raw_os_error(errno)),
        }
    }
}
