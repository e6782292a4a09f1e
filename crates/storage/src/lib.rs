//! Conclave's durable storage: the Raft log and hard state in a segmented write-ahead log,
//! and snapshot files, on a real or simulated disk.
//!
//! # Layout
//! - [`disk`]: the [`Disk`] seam, with [`OsDisk`] (the real file system).
//! - [`sim_disk`]: [`SimDisk`], an in-memory disk whose crashes lose unsynced bytes.
//! - [`wal`]: segments, record framing, the log model replayed at recovery.
//! - [`snapshot`]: snapshot files streamed in chunks.
//! - [`storage`]: [`WalStorage`], which implements [`conclave_raft::Storage`].
//! - [`repair`](mod@repair): cutting a damaged log so the node can rejoin.
//! - [`release`](mod@release): freeing removed files and replaced images off the Raft thread.
//!
//! # Use
//! ```
//! use std::sync::Arc;
//! use conclave_raft::{ConfState, Entry, EntryKind, HardState, Storage};
//! use conclave_storage::{SimDisk, SimDiskOptions, StorageOptions, WalStorage};
//!
//! let disk = SimDisk::new(7, SimDiskOptions::default());
//! let mut storage = WalStorage::open(Arc::new(disk.clone()), "/node1", StorageOptions::for_simulation())?;
//! storage.bootstrap(ConfState::with_voters([1, 2, 3]))?; // snapshot at index 1
//! let entry = Entry { term: 2, index: 2, kind: EntryKind::Normal, data: "put x".into() };
//! let written = storage.append(&[entry])?;
//! storage.set_hard_state(HardState { term: 2, vote: Some(1), commit: 1 })?;
//! let durable = storage.sync()?; // one fdatasync for everything since the last sync
//! assert!(durable >= written && storage.is_durable(written));
//! drop(storage);
//! disk.crash();
//! let storage = WalStorage::open(Arc::new(disk), "/node1", StorageOptions::for_simulation())?;
//! assert_eq!(storage.last_index(), Ok(2));
//! # Ok::<(), conclave_storage::Error>(())
//! ```

pub mod disk;
pub mod error;
pub mod release;
pub mod repair;
pub mod sim_disk;
pub mod snapshot;
pub mod storage;
pub mod wal;

pub use disk::{Disk, DiskFile, OsDisk};
pub use error::{Error, FatalError, Result};
pub use repair::{RepairCut, RepairMode, RepairReport, repair, repair_with};
pub use sim_disk::{SimDisk, SimDiskOptions};
pub use snapshot::{SnapshotFile, SnapshotReader, SnapshotWriter, SyncedPieceWriter};
pub use storage::{RecoveryReport, StorageOptions, Ticket, WalStorage};
pub use wal::record::RECORD_BYTES_MAX;
pub use wal::{DroppedTail, WalOptions, WalRecovery};
