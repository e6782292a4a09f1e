//! The core's read-only view of stable storage, and an in-memory implementation.
//!
//! The core never writes storage: the application persists what [`crate::Ready`] hands it and
//! then calls [`crate::RawNode::advance`]. The core reads back through [`Storage`] whatever it
//! needs of the durable log (entries to replicate, terms to check, the snapshot to send).

use bytes::Bytes;

use crate::error::StorageError;
use crate::types::{ConfState, Entry, HardState, Index, Snapshot, SnapshotMeta, Term};

/// Read access to the durable log, hard state and latest snapshot.
///
/// The log held is the contiguous range `first_index()..=last_index()`; everything before
/// `first_index()` is covered by `snapshot()`, whose index is `first_index() - 1`.
pub trait Storage {
    /// The persisted hard state and the membership as of the latest snapshot. The core replays
    /// committed entries after the snapshot, which brings the membership up to date.
    fn initial_state(&self) -> Result<(HardState, ConfState), StorageError>;

    /// Entries in `[low, high)`, stopping early once their payloads exceed `max_bytes` (but
    /// always at least one entry when the range is non-empty).
    ///
    /// Errors: [`StorageError::Compacted`] if `low < first_index()`,
    /// [`StorageError::Unavailable`] if `high > last_index() + 1`.
    fn entries(&self, low: Index, high: Index, max_bytes: u64) -> Result<Vec<Entry>, StorageError>;

    /// The term of the entry at `index`, for `index` in `[first_index() - 1, last_index()]`
    /// (the term of `first_index() - 1` is the snapshot's term).
    fn term(&self, index: Index) -> Result<Term, StorageError>;

    /// The index of the first entry still in the log (snapshot index + 1).
    fn first_index(&self) -> Result<Index, StorageError>;

    /// The index of the last entry in the log (the snapshot index when the log is empty).
    fn last_index(&self) -> Result<Index, StorageError>;

    /// The most recent snapshot.
    fn snapshot(&self) -> Result<Snapshot, StorageError>;
}

/// The term of the bootstrap snapshot. No node leads in it: the first campaign raises the
/// term past it, so a node still at this term has never heard from a leader.
pub const BOOTSTRAP_TERM: u64 = 1;

/// The snapshot every founding member of a new cluster starts from: index 1, term 1, the
/// initial membership and empty application data.
///
/// Putting the initial membership in a snapshot rather than in log entries means a node that
/// joins later with an empty log cannot match the leader's log at index 1, so the leader sends
/// it a snapshot, which is how it learns the membership it cannot infer.
pub fn bootstrap_snapshot(conf_state: ConfState) -> Snapshot {
    Snapshot {
        meta: SnapshotMeta {
            index: 1,
            term: BOOTSTRAP_TERM,
            conf_state,
        },
        data: Bytes::new(),
    }
}

/// Storage kept in memory: for tests, the simulator and the benchmark.
///
/// Writes go through its own methods, which the application calls while handling a Ready.
#[derive(Debug, Clone, Default)]
pub struct MemStorage {
    hard_state: HardState,
    snapshot: Snapshot,
    /// Entries after the snapshot, contiguous from `snapshot.meta.index + 1`.
    entries: Vec<Entry>,
}

impl MemStorage {
    /// A founding member of a new cluster: the log starts from the bootstrap snapshot
    /// ([`bootstrap_snapshot`]) that carries the initial membership.
    pub fn new_with_conf_state(conf_state: ConfState) -> Self {
        let snapshot = bootstrap_snapshot(conf_state);
        let hard_state = HardState {
            term: snapshot.meta.term,
            vote: None,
            commit: snapshot.meta.index,
        };
        MemStorage {
            hard_state,
            snapshot,
            entries: Vec::new(),
        }
    }

    pub fn hard_state(&self) -> HardState {
        self.hard_state
    }

    pub fn set_hard_state(&mut self, hard_state: HardState) {
        self.hard_state = hard_state;
    }

    /// Appends `entries`, first dropping any stored suffix they overwrite. They must start no
    /// later than `last_index() + 1` and not before the snapshot.
    pub fn append(&mut self, entries: &[Entry]) {
        let Some(first) = entries.first() else { return };
        let snap_index = self.snapshot.meta.index;
        assert!(
            first.index > snap_index,
            "append at {} overwrites snapshot {snap_index}",
            first.index
        );
        let last = self.last();
        assert!(
            first.index <= last + 1,
            "append at {} leaves a gap after {last}",
            first.index
        );
        self.entries
            .truncate((first.index - snap_index - 1) as usize);
        for pair in entries.windows(2) {
            assert_eq!(
                pair[0].index + 1,
                pair[1].index,
                "appended entries are not contiguous"
            );
        }
        self.entries.extend_from_slice(entries);
    }

    /// Replaces the whole log with `snapshot` (a follower installing the leader's snapshot).
    pub fn apply_snapshot(&mut self, snapshot: Snapshot) {
        assert!(
            snapshot.meta.index >= self.snapshot.meta.index,
            "snapshot {} is older than the stored {}",
            snapshot.meta.index,
            self.snapshot.meta.index
        );
        let keep_from = snapshot.meta.index;
        let term_matches = self.term(keep_from).ok() == Some(snapshot.meta.term);
        // Keep entries past the snapshot only if the log agrees with it at its index.
        let kept: Vec<Entry> = if term_matches {
            self.entries
                .iter()
                .filter(|e| e.index > keep_from)
                .cloned()
                .collect()
        } else {
            Vec::new()
        };
        self.entries = kept;
        if self.hard_state.commit < snapshot.meta.index {
            self.hard_state.commit = snapshot.meta.index;
        }
        self.snapshot = snapshot;
    }

    /// Records a snapshot the application took of its state at `index` (which it has
    /// applied) and drops the log up to it.
    pub fn create_snapshot(&mut self, index: Index, conf_state: ConfState, data: Bytes) {
        assert!(
            index <= self.last(),
            "snapshot at {index} is past the log end {}",
            self.last()
        );
        assert!(
            index >= self.snapshot.meta.index,
            "snapshot at {index} goes backwards"
        );
        let term = self
            .term(index)
            .unwrap_or_else(|e| panic!("snapshot at {index}: {e}"));
        self.compact(index);
        self.snapshot = Snapshot {
            meta: SnapshotMeta {
                index,
                term,
                conf_state,
            },
            data,
        };
    }

    /// Drops entries up to and including `index` (which must be covered by the snapshot the
    /// caller is about to record, or already recorded).
    fn compact(&mut self, index: Index) {
        let snap_index = self.snapshot.meta.index;
        if index <= snap_index {
            return;
        }
        let drop_count = ((index - snap_index) as usize).min(self.entries.len());
        self.entries.drain(..drop_count);
    }

    fn last(&self) -> Index {
        self.snapshot.meta.index + self.entries.len() as u64
    }
}

impl Storage for MemStorage {
    fn initial_state(&self) -> Result<(HardState, ConfState), StorageError> {
        Ok((self.hard_state, self.snapshot.meta.conf_state.clone()))
    }

    fn entries(&self, low: Index, high: Index, max_bytes: u64) -> Result<Vec<Entry>, StorageError> {
        let snap_index = self.snapshot.meta.index;
        if low <= snap_index {
            return Err(StorageError::Compacted(low));
        }
        if high > self.last() + 1 {
            return Err(StorageError::Unavailable(high));
        }
        let mut out = Vec::new();
        let mut size = 0u64;
        for entry in
            &self.entries[(low - snap_index - 1) as usize..(high - snap_index - 1) as usize]
        {
            size += entry.payload_size();
            if !out.is_empty() && size > max_bytes {
                break;
            }
            out.push(entry.clone());
        }
        Ok(out)
    }

    fn term(&self, index: Index) -> Result<Term, StorageError> {
        let snap_index = self.snapshot.meta.index;
        if index < snap_index {
            return Err(StorageError::Compacted(index));
        }
        if index == snap_index {
            return Ok(self.snapshot.meta.term);
        }
        match self.entries.get((index - snap_index - 1) as usize) {
            Some(entry) => Ok(entry.term),
            None => Err(StorageError::Unavailable(index)),
        }
    }

    fn first_index(&self) -> Result<Index, StorageError> {
        Ok(self.snapshot.meta.index + 1)
    }

    fn last_index(&self) -> Result<Index, StorageError> {
        Ok(self.last())
    }

    fn snapshot(&self) -> Result<Snapshot, StorageError> {
        Ok(self.snapshot.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::EntryKind;

    fn entry(index: Index, term: Term) -> Entry {
        Entry {
            index,
            term,
            kind: EntryKind::Normal,
            data: Bytes::from(vec![0u8; 10]),
        }
    }

    #[test]
    fn append_truncates_conflicts_and_compaction_keeps_terms() {
        let mut s = MemStorage::default();
        s.append(&[entry(1, 1), entry(2, 1), entry(3, 1)]);
        s.append(&[entry(2, 2)]);
        assert_eq!(s.last_index(), Ok(2));
        assert_eq!(s.term(2), Ok(2));
        s.append(&[entry(3, 2), entry(4, 2)]);
        s.create_snapshot(
            3,
            ConfState::with_voters([1, 2, 3]),
            Bytes::from_static(b"state"),
        );
        assert_eq!(s.first_index(), Ok(4));
        assert_eq!(s.term(3), Ok(2));
        assert_eq!(s.term(2), Err(StorageError::Compacted(2)));
        assert_eq!(s.entries(3, 5, u64::MAX), Err(StorageError::Compacted(3)));
        assert_eq!(s.entries(4, 6, u64::MAX), Err(StorageError::Unavailable(6)));
        assert_eq!(s.entries(4, 5, u64::MAX).map(|e| e.len()), Ok(1));
    }

    #[test]
    fn founding_members_start_from_the_bootstrap_snapshot() {
        let s = MemStorage::new_with_conf_state(ConfState::with_voters([1, 2, 3]));
        assert_eq!(
            (s.first_index(), s.last_index(), s.term(1)),
            (Ok(2), Ok(1), Ok(1))
        );
        let (hard_state, conf) = s.initial_state().expect("state");
        assert_eq!((hard_state.term, hard_state.commit), (1, 1));
        assert_eq!(conf.voters.len(), 3);
    }

    #[test]
    fn entries_respect_byte_limit_but_return_at_least_one() {
        let mut s = MemStorage::default();
        s.append(&[entry(1, 1), entry(2, 1), entry(3, 1)]);
        assert_eq!(s.entries(1, 4, 0).map(|e| e.len()), Ok(1));
        assert_eq!(s.entries(1, 4, 20).map(|e| e.len()), Ok(2));
        assert_eq!(s.entries(1, 4, u64::MAX).map(|e| e.len()), Ok(3));
    }

    #[test]
    fn installing_a_snapshot_keeps_only_a_matching_suffix() {
        let mut s = MemStorage::default();
        s.append(&[entry(1, 1), entry(2, 1), entry(3, 1)]);
        let meta = SnapshotMeta {
            index: 2,
            term: 1,
            conf_state: ConfState::default(),
        };
        s.apply_snapshot(Snapshot {
            meta,
            data: Bytes::new(),
        });
        assert_eq!((s.first_index(), s.last_index()), (Ok(3), Ok(3)));
        let meta = SnapshotMeta {
            index: 5,
            term: 3,
            conf_state: ConfState::default(),
        };
        s.apply_snapshot(Snapshot {
            meta,
            data: Bytes::new(),
        });
        assert_eq!((s.first_index(), s.last_index()), (Ok(6), Ok(5)));
        assert_eq!(s.hard_state().commit, 5);
    }
}
