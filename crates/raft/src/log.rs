//! The log as the core sees it: the durable part behind [`Storage`] plus an unstable tail of
//! entries (and possibly a snapshot) that the application has not yet reported durable.

use crate::error::StorageError;
use crate::storage::Storage;
use crate::types::{Entry, Index, Snapshot, Term};

/// Entries and a snapshot not yet on stable storage.
#[derive(Debug, Default)]
struct Unstable {
    /// A snapshot received from the leader, to be installed before any unstable entry.
    snapshot: Option<Snapshot>,
    /// Entries from index `offset` on, contiguous.
    entries: Vec<Entry>,
    /// The index of `entries[0]` (or where the next one would go).
    offset: Index,
}

/// The core's log.
///
/// Invariants: `applied <= committed <= last_index()`; `persisted <= last_index()`.
pub struct RaftLog<S> {
    pub store: S,
    unstable: Unstable,
    /// The highest index known committed.
    pub committed: Index,
    /// The highest index the application has applied (reported through `advance`).
    pub applied: Index,
    /// The highest index known durable on this node (what the leader counts for itself).
    pub persisted: Index,
}

/// Storage failures the core cannot recover from. The node must stop.
fn fatal(context: &str, err: StorageError) -> ! {
    panic!("conclave-raft: storage failure while {context}: {err}")
}

impl<S: Storage> RaftLog<S> {
    pub fn new(store: S, committed: Index) -> Self {
        let first = store
            .first_index()
            .unwrap_or_else(|e| fatal("reading first index", e));
        let last = store
            .last_index()
            .unwrap_or_else(|e| fatal("reading last index", e));
        assert!(
            committed <= last,
            "persisted commit index {committed} is past the stored log end {last}"
        );
        let applied = first - 1;
        RaftLog {
            store,
            unstable: Unstable {
                snapshot: None,
                entries: Vec::new(),
                offset: last + 1,
            },
            committed: committed.max(applied),
            applied,
            persisted: last,
        }
    }

    pub fn first_index(&self) -> Index {
        match &self.unstable.snapshot {
            Some(snap) => snap.meta.index + 1,
            None => self
                .store
                .first_index()
                .unwrap_or_else(|e| fatal("reading first index", e)),
        }
    }

    pub fn last_index(&self) -> Index {
        if let Some(last) = self.unstable.entries.last() {
            return last.index;
        }
        match &self.unstable.snapshot {
            Some(snap) => snap.meta.index,
            None => self
                .store
                .last_index()
                .unwrap_or_else(|e| fatal("reading last index", e)),
        }
    }

    /// The term at `index`, or why it is not known.
    pub fn term(&self, index: Index) -> Result<Term, StorageError> {
        let first = self.first_index();
        // Saturating: `index` may come straight from a peer's message.
        if index.saturating_add(1) < first {
            return Err(StorageError::Compacted(index));
        }
        if index > self.last_index() {
            return Err(StorageError::Unavailable(index));
        }
        if let Some(snap) = &self.unstable.snapshot
            && index == snap.meta.index
        {
            return Ok(snap.meta.term);
        }
        if index >= self.unstable.offset {
            let entry = &self.unstable.entries[(index - self.unstable.offset) as usize];
            return Ok(entry.term);
        }
        match self.store.term(index) {
            Ok(term) => Ok(term),
            Err(e @ (StorageError::Compacted(_) | StorageError::Unavailable(_))) => Err(e),
            Err(e) => fatal("reading a term", e),
        }
    }

    /// The term at `index`, or 0 when it is not known (compacted or beyond the end).
    pub fn term_or_zero(&self, index: Index) -> Term {
        self.term(index).unwrap_or(0)
    }

    pub fn last_term(&self) -> Term {
        let last = self.last_index();
        self.term(last)
            .unwrap_or_else(|e| fatal("reading the last term", e))
    }

    pub fn match_term(&self, index: Index, term: Term) -> bool {
        self.term(index).map(|t| t == term).unwrap_or(false)
    }

    /// Whether a candidate whose log ends at (`last_index`, `last_term`) is at least as
    /// up to date as this log (Raft §5.4.1).
    pub fn is_up_to_date(&self, last_index: Index, last_term: Term) -> bool {
        let my_term = self.last_term();
        last_term > my_term || (last_term == my_term && last_index >= self.last_index())
    }

    /// Entries in `[low, high)`, at most `max_bytes` of payload (but at least one).
    pub fn entries(
        &self,
        low: Index,
        high: Index,
        max_bytes: u64,
    ) -> Result<Vec<Entry>, StorageError> {
        if low >= high {
            return Ok(Vec::new());
        }
        let first = self.first_index();
        if low < first {
            return Err(StorageError::Compacted(low));
        }
        assert!(
            high <= self.last_index() + 1,
            "entries [{low}, {high}) past the log end"
        );
        let mut out = Vec::new();
        let offset = self.unstable.offset;
        if low < offset {
            let stored = match self.store.entries(low, high.min(offset), max_bytes) {
                Ok(entries) => entries,
                Err(e @ StorageError::Compacted(_)) => return Err(e),
                Err(e) => fatal("reading entries", e),
            };
            let complete = stored.len() as u64 == high.min(offset) - low;
            out = stored;
            if !complete {
                return Ok(out);
            }
        }
        if high > offset {
            let mut size: u64 = out.iter().map(Entry::payload_size).sum();
            let from = (low.max(offset) - offset) as usize;
            let to = (high - offset) as usize;
            for entry in &self.unstable.entries[from..to] {
                size += entry.payload_size();
                if !out.is_empty() && size > max_bytes {
                    break;
                }
                out.push(entry.clone());
            }
        }
        Ok(out)
    }

    /// The largest index `<= index` whose term is `<= term`: where a follower's log may
    /// match a leader's, used for conflict hints.
    pub fn find_conflict_by_term(&self, index: Index, term: Term) -> Index {
        let mut i = index.min(self.last_index());
        loop {
            match self.term(i) {
                Ok(t) if t > term && i > 0 => i -= 1,
                _ => return i,
            }
        }
    }

    /// Appends entries at the end of the log (the leader's own proposals).
    pub fn append(&mut self, entries: &[Entry]) -> Index {
        if let Some(first) = entries.first() {
            assert_eq!(
                first.index,
                self.last_index() + 1,
                "leader append leaves a gap"
            );
            assert!(
                first.index > self.committed,
                "leader append overwrites committed entries"
            );
            self.truncate_and_append(entries);
        }
        self.last_index()
    }

    /// A follower's append: if the log matches (`prev_index`, `prev_term`), adds `entries`,
    /// replacing any conflicting suffix, and returns the index of the last new entry.
    pub fn maybe_append(
        &mut self,
        prev_index: Index,
        prev_term: Term,
        entries: &[Entry],
    ) -> Option<Index> {
        if !self.match_term(prev_index, prev_term) {
            return None;
        }
        let last_new = prev_index + entries.len() as u64;
        let conflict = entries.iter().find(|e| !self.match_term(e.index, e.term));
        if let Some(conflict) = conflict {
            assert!(
                conflict.index > self.committed,
                "entry {} conflicts with committed index {}",
                conflict.index,
                self.committed
            );
            let start = (conflict.index - prev_index - 1) as usize;
            self.truncate_and_append(&entries[start..]);
        }
        Some(last_new)
    }

    fn truncate_and_append(&mut self, entries: &[Entry]) {
        let after = entries[0].index;
        let u = &mut self.unstable;
        if after == u.offset + u.entries.len() as u64 {
            u.entries.extend_from_slice(entries);
        } else if after <= u.offset {
            // Replaces part of the durable log too; the application overwrites it on persist.
            u.offset = after;
            u.entries = entries.to_vec();
        } else {
            u.entries.truncate((after - u.offset) as usize);
            u.entries.extend_from_slice(entries);
        }
        self.persisted = self.persisted.min(after - 1);
    }

    pub fn commit_to(&mut self, index: Index) {
        if index > self.committed {
            assert!(
                index <= self.last_index(),
                "commit index {index} is past the log end {}",
                self.last_index()
            );
            self.committed = index;
        }
    }

    pub fn applied_to(&mut self, index: Index) {
        if index == 0 || index <= self.applied {
            return;
        }
        assert!(
            index <= self.committed,
            "applied {index} beyond committed {}",
            self.committed
        );
        self.applied = index;
    }

    /// Unstable entries to hand to the application for persisting.
    pub fn unstable_entries(&self) -> &[Entry] {
        &self.unstable.entries
    }

    pub fn unstable_snapshot(&self) -> Option<&Snapshot> {
        self.unstable.snapshot.as_ref()
    }

    /// Whether committed entries are waiting to be applied.
    pub fn has_next_committed(&self) -> bool {
        self.unstable.snapshot.is_none() && self.committed > self.applied
    }

    /// Committed entries not yet applied (none while a snapshot waits to be installed).
    pub fn next_committed_entries(&self, max_bytes: u64) -> Vec<Entry> {
        if !self.has_next_committed() {
            return Vec::new();
        }
        let low = self.applied + 1;
        assert!(
            low >= self.first_index(),
            "applied {} fell behind the log start",
            self.applied
        );
        self.entries(low, self.committed + 1, max_bytes)
            .unwrap_or_else(|e| fatal("reading committed entries", e))
    }

    /// The application made entries up to (`index`, `term`) durable.
    pub fn stable_to(&mut self, index: Index, term: Term) {
        let u = &mut self.unstable;
        if index < u.offset {
            return;
        }
        let pos = (index - u.offset) as usize;
        if u.entries.get(pos).map(|e| e.term) == Some(term) {
            u.entries.drain(..=pos);
            u.offset = index + 1;
            self.persisted = self.persisted.max(index);
        }
    }

    /// The application installed the snapshot at `index`.
    pub fn stable_snapshot_to(&mut self, index: Index) {
        if self.unstable.snapshot.as_ref().map(|s| s.meta.index) == Some(index) {
            self.unstable.snapshot = None;
            self.persisted = self.persisted.max(index);
        }
    }

    /// Replaces the log with a snapshot from the leader.
    pub fn restore(&mut self, snapshot: Snapshot) {
        let index = snapshot.meta.index;
        assert!(
            index > self.committed,
            "restoring snapshot {index} at or below commit"
        );
        self.committed = index;
        self.unstable = Unstable {
            snapshot: Some(snapshot),
            entries: Vec::new(),
            offset: index + 1,
        };
        // Nothing of the new log is durable until the application installs the snapshot.
        self.persisted = 0;
    }

    /// The snapshot a leader sends to a lagging follower.
    pub fn snapshot(&self) -> Result<Snapshot, StorageError> {
        if let Some(snap) = &self.unstable.snapshot {
            return Ok(snap.clone());
        }
        match self.store.snapshot() {
            Ok(snap) => Ok(snap),
            Err(e @ StorageError::SnapshotTemporarilyUnavailable) => Err(e),
            Err(e) => fatal("reading the snapshot", e),
        }
    }
}
