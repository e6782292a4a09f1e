//! What the log holds, as a pure function of its records.
//!
//! Recovery replays every record through [`LogModel::apply`], and the writer applies each
//! record it appends through the same function, so the state after a restart is the state
//! before it by construction. The model holds where each entry lives, not the entries.

use std::collections::VecDeque;

use conclave_raft::{HardState, Index, Term};

use super::record::Record;

/// Where one entry's record is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    pub term: Term,
    /// The segment, named by its first sequence number.
    pub segment_first_seq: u64,
    pub offset_bytes: u64,
    pub frame_len_bytes: u32,
}

/// The log as the records describe it.
#[derive(Debug, Clone)]
pub struct LogModel {
    /// False until the first checkpoint record (the log's starting state) is seen.
    initialised: bool,
    pub hard_state: HardState,
    pub snapshot_index: Index,
    pub snapshot_term: Term,
    /// The index of `locations[0]`. Invariant: `first_index > snapshot_index`. Between a
    /// checkpoint after compaction and the next snapshot record, entries between the two may
    /// be unknown; once open, `first_index == snapshot_index + 1`.
    pub first_index: Index,
    pub locations: VecDeque<Location>,
}

impl LogModel {
    /// The model before any record has been read.
    pub fn uninitialised() -> LogModel {
        LogModel {
            initialised: false,
            hard_state: HardState::default(),
            snapshot_index: 0,
            snapshot_term: 0,
            first_index: 1,
            locations: VecDeque::new(),
        }
    }

    /// The model of a brand-new log.
    pub fn fresh() -> LogModel {
        LogModel {
            initialised: true,
            ..LogModel::uninitialised()
        }
    }

    pub fn is_initialised(&self) -> bool {
        self.initialised
    }

    pub fn last_index(&self) -> Index {
        self.first_index + self.locations.len() as u64 - 1
    }

    /// The term at `index`, if the log knows it (the snapshot's term at its index).
    pub fn term(&self, index: Index) -> Option<Term> {
        if index == self.snapshot_index {
            return Some(self.snapshot_term);
        }
        let offset = index.checked_sub(self.first_index)?;
        self.locations
            .get(usize::try_from(offset).ok()?)
            .map(|location| location.term)
    }

    pub fn location(&self, index: Index) -> Option<Location> {
        let offset = index.checked_sub(self.first_index)?;
        self.locations.get(usize::try_from(offset).ok()?).copied()
    }

    /// The checkpoint record describing the current state.
    pub fn checkpoint(&self) -> Record<'static> {
        Record::Checkpoint {
            hard_state: self.hard_state,
            snapshot_index: self.snapshot_index,
            snapshot_term: self.snapshot_term,
            last_index: self.last_index(),
        }
    }

    /// Applies one record; `location` is where it is stored. Errors describe records that no
    /// correct writer produces, so the caller reports them as corruption.
    pub fn apply(&mut self, record: &Record<'_>, location: Location) -> Result<(), String> {
        match *record {
            Record::Checkpoint {
                hard_state,
                snapshot_index,
                snapshot_term,
                last_index,
            } => {
                if !self.initialised {
                    if last_index < snapshot_index {
                        return Err("checkpoint's last index is below its snapshot".into());
                    }
                    self.initialised = true;
                    self.hard_state = hard_state;
                    self.snapshot_index = snapshot_index;
                    self.snapshot_term = snapshot_term;
                    self.first_index = last_index + 1;
                    return Ok(());
                }
                if *record != self.checkpoint() {
                    return Err(format!(
                        "checkpoint {record:?} disagrees with the records before it ({:?})",
                        self.checkpoint()
                    ));
                }
            }
            _ if !self.initialised => return Err("segment does not start with a checkpoint".into()),
            Record::HardState(hard_state) => self.hard_state = hard_state,
            Record::Entry { term, index, .. } => {
                if index <= self.snapshot_index {
                    return Err(format!(
                        "entry {index} overwrites snapshot {}",
                        self.snapshot_index
                    ));
                }
                if index > self.last_index() + 1 {
                    return Err(format!(
                        "entry {index} leaves a gap after {}",
                        self.last_index()
                    ));
                }
                if index < self.first_index {
                    self.locations.clear();
                    self.first_index = index;
                }
                let keep = (index - self.first_index) as usize;
                self.locations.truncate(keep);
                self.locations.push_back(Location { term, ..location });
            }
            Record::Snapshot {
                index,
                term,
                keep_suffix,
            } => {
                if index < self.snapshot_index {
                    return Err(format!(
                        "snapshot {index} is older than snapshot {}",
                        self.snapshot_index
                    ));
                }
                if keep_suffix {
                    if let Some(known) = self.term(index).filter(|known| *known != term) {
                        return Err(format!(
                            "snapshot ({index}, {term}) keeps a log with term {known}"
                        ));
                    }
                    let drop_count = (index + 1).saturating_sub(self.first_index) as usize;
                    self.locations.drain(..drop_count.min(self.locations.len()));
                    self.first_index = self.first_index.max(index + 1);
                } else {
                    self.locations.clear();
                    self.first_index = index + 1;
                }
                self.snapshot_index = index;
                self.snapshot_term = term;
            }
        }
        Ok(())
    }
}
