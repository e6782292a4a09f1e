//! The crate's one error type. Operating errors are part of normal life (another process holds
//! the directory, an entry is too large, an index is compacted); [`FatalError`]s (I/O failures
//! and corruption) mean the node must stop, and for corruption an operator decides on repair.

use std::io;
use std::path::PathBuf;

use conclave_raft::Index;

/// Everything `conclave-storage` can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Another process (or another handle in this one) has the data directory open.
    #[error("data directory {dir} is locked by another process")]
    Locked { dir: PathBuf },
    /// A record would exceed [`crate::RECORD_BYTES_MAX`].
    #[error("a record of {size_bytes} bytes exceeds the limit of {limit_bytes} bytes")]
    RecordTooLarge { size_bytes: u64, limit_bytes: u64 },
    /// The options make no sense; the message says which one.
    #[error("invalid storage options: {0}")]
    InvalidOptions(String),
    /// The requested index is covered by the snapshot.
    #[error("index {0} is compacted")]
    Compacted(Index),
    /// The requested index is past the end of the log.
    #[error("index {0} is unavailable")]
    Unavailable(Index),
    /// The directory already holds a log, so it cannot be bootstrapped again.
    #[error("the data directory is not fresh and cannot be bootstrapped")]
    AlreadyBootstrapped,
    /// The storage cannot go on; see [`FatalError`].
    #[error(transparent)]
    Fatal(#[from] FatalError),
}

/// Failures after which the node must stop.
#[derive(Debug, thiserror::Error)]
pub enum FatalError {
    /// The disk returned an error. After a failed write or sync the state of the file is
    /// unknown, so the storage refuses all further writes.
    #[error("I/O error on {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    /// Stored bytes fail verification somewhere a torn final write cannot explain.
    /// [`crate::repair`] can truncate the log at `offset` of `file`.
    #[error("corruption in {file} at offset {offset}: {reason}")]
    Corrupt {
        file: PathBuf,
        offset: u64,
        reason: String,
    },
    /// An earlier write or sync failed; nothing more is written until the node restarts.
    #[error("storage stopped after an earlier failure: {0}")]
    Stopped(String),
}

impl Error {
    /// Whether the node must stop (as opposed to retrying or answering the caller).
    pub fn is_fatal(&self) -> bool {
        matches!(self, Error::Fatal(_))
    }

    /// Whether this is damage inside the write-ahead log, which [`crate::repair`] can cut off
    /// (as opposed to a damaged snapshot or an I/O error, which cutting the log cannot fix).
    pub fn is_repairable_log_corruption(&self) -> bool {
        let Error::Fatal(FatalError::Corrupt { file, .. }) = self else {
            return false;
        };
        let in_wal_dir = file
            .parent()
            .and_then(|dir| dir.file_name())
            .is_some_and(|name| name == "wal");
        let is_segment = file
            .file_name()
            .and_then(|name| name.to_str())
            .and_then(crate::wal::segment::parse_segment_file_name)
            .is_some();
        in_wal_dir && is_segment
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: io::Error) -> Error {
        Error::Fatal(FatalError::Io {
            path: path.into(),
            source,
        })
    }

    pub(crate) fn corrupt(
        file: impl Into<PathBuf>,
        offset: u64,
        reason: impl Into<String>,
    ) -> Error {
        Error::Fatal(FatalError::Corrupt {
            file: file.into(),
            offset,
            reason: reason.into(),
        })
    }
}

/// Shorthand for this crate's results.
pub type Result<T, E = Error> = std::result::Result<T, E>;
