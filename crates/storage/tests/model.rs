//! Property tests: any sequence of appends (with conflicting suffixes), hard states, created
//! and installed snapshots, syncs, clean reopens and crashes of the simulated disk reads back
//! as `MemStorage` says it should. After a crash the log must hold one of the states between
//! the last sync and the crash: never less than what was durable, never something invented.

mod support;

use bytes::Bytes;
use conclave_raft::{ConfState, HardState, MemStorage, Snapshot, SnapshotMeta, Storage};
use conclave_storage::{SimDisk, SimDiskOptions, StorageOptions, WalStorage};
use proptest::prelude::*;
use support::*;

#[derive(Debug, Clone)]
enum Op {
    Append {
        back: u8,
        count: u8,
        new_term: bool,
        size_bytes: u8,
    },
    HardState {
        new_term: bool,
        vote: Option<u8>,
        commit_ahead: u8,
    },
    CreateSnapshot {
        back: u8,
    },
    ApplySnapshot {
        ahead: i8,
        same_term: bool,
    },
    Sync,
    Reopen,
    Crash,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (0u8..4, 1u8..6, any::<bool>(), 0u8..200)
            .prop_map(|(back, count, new_term, size_bytes)| Op::Append { back, count, new_term, size_bytes }),
        2 => (any::<bool>(), proptest::option::of(1u8..4), 0u8..5)
            .prop_map(|(new_term, vote, commit_ahead)| Op::HardState { new_term, vote, commit_ahead }),
        1 => (0u8..6).prop_map(|back| Op::CreateSnapshot { back }),
        1 => (-3i8..6, any::<bool>()).prop_map(|(ahead, same_term)| Op::ApplySnapshot { ahead, same_term }),
        2 => Just(Op::Sync),
        1 => Just(Op::Reopen),
        1 => Just(Op::Crash),
    ]
}

type FullState = ((HardState, u64, Vec<conclave_raft::Entry>), Snapshot);

fn full_state(storage: &dyn Storage) -> FullState {
    (contents(storage), storage.snapshot().expect("snapshot"))
}

struct Harness {
    /// How the log is opened, at the start and at every reopen.
    options: StorageOptions,
    disk: SimDisk,
    storage: Option<WalStorage>,
    model: MemStorage,
    /// The model after each write since the last sync; `history[0]` is durable.
    history: Vec<MemStorage>,
    term: u64,
}

impl Harness {
    fn storage(&mut self) -> &mut WalStorage {
        self.storage.as_mut().expect("open")
    }

    fn record(&mut self) {
        self.history.push(self.model.clone());
    }

    fn set_hard_state(&mut self, hard_state: HardState) {
        self.storage()
            .set_hard_state(hard_state)
            .expect("hard state");
        self.model.set_hard_state(hard_state);
        self.record();
    }

    fn synced(&mut self) {
        self.history = vec![self.model.clone()];
    }

    fn apply(&mut self, op: &Op) {
        let snapshot_index = self.model.first_index().expect("first") - 1;
        let last = self.model.last_index().expect("last");
        match *op {
            Op::Append {
                back,
                count,
                new_term,
                size_bytes,
            } => {
                self.term += u64::from(new_term);
                let first = (last + 1)
                    .saturating_sub(u64::from(back))
                    .max(snapshot_index + 1);
                let entries: Vec<_> = (first..first + u64::from(count))
                    .map(|i| entry(i, self.term, size_bytes.into()))
                    .collect();
                self.storage().append(&entries).expect("append");
                for single in entries.chunks(1) {
                    self.model.append(single);
                    self.record();
                }
            }
            Op::HardState {
                new_term,
                vote,
                commit_ahead,
            } => {
                self.term += u64::from(new_term);
                let commit = (self.model.hard_state().commit + u64::from(commit_ahead)).min(last);
                let commit = commit.max(self.model.hard_state().commit);
                self.set_hard_state(HardState {
                    term: self.term,
                    vote: vote.map(u64::from),
                    commit,
                });
            }
            Op::CreateSnapshot { back } => {
                let index = last.saturating_sub(u64::from(back)).max(snapshot_index);
                let mut hard_state = self.model.hard_state();
                if hard_state.commit < index {
                    hard_state.commit = index;
                    self.set_hard_state(hard_state);
                }
                let conf_state = ConfState::with_voters([1, index % 5 + 2]);
                let data = Bytes::from(format!("state at {index}"));
                self.storage()
                    .create_snapshot(index, conf_state.clone(), data.clone())
                    .expect("create");
                self.model.create_snapshot(index, conf_state, data);
                self.synced();
            }
            Op::ApplySnapshot { ahead, same_term } => {
                let index = last
                    .saturating_add_signed(i64::from(ahead))
                    .max(snapshot_index);
                let term = match self.model.term(index) {
                    Ok(term) if same_term => term,
                    _ => {
                        self.term += 1;
                        self.term
                    }
                };
                let meta = SnapshotMeta {
                    index,
                    term,
                    conf_state: ConfState::with_voters([1, 2, 3]),
                };
                let snapshot = Snapshot {
                    meta,
                    data: Bytes::from(format!("leader state {index}")),
                };
                self.storage()
                    .apply_snapshot(snapshot.clone())
                    .expect("apply");
                self.model.apply_snapshot(snapshot);
                self.synced();
            }
            Op::Sync => {
                self.storage().sync().expect("sync");
                self.synced();
            }
            Op::Reopen => {
                self.storage().sync().expect("sync");
                self.synced();
                self.storage = None;
                self.storage = Some(open(&self.disk, self.options).expect("reopen"));
                assert_eq!(
                    full_state(self.storage()),
                    full_state(&self.model),
                    "after reopen"
                );
            }
            Op::Crash => {
                self.storage = None;
                self.disk.crash();
                let storage = open(&self.disk, self.options).expect("open after crash");
                let recovered = full_state(&storage);
                let matching = self
                    .history
                    .iter()
                    .rposition(|state| full_state(state) == recovered);
                let Some(position) = matching else {
                    panic!(
                        "recovered {recovered:?}\nmatches no state since the last sync: {:?}",
                        self.history
                    )
                };
                self.model = self.history[position].clone();
                self.storage = Some(storage);
                self.synced();
            }
        }
        let (model, storage) = (full_state(&self.model), full_state(self.storage()));
        assert_eq!(storage, model, "after {op:?}");
    }
}

fn reads_back_like_mem_storage(seed: u64, ops: &[Op], options: StorageOptions) {
    let disk = SimDisk::new(seed, SimDiskOptions::default());
    let storage = open(&disk, options).expect("open");
    let mut harness = Harness {
        options,
        disk,
        storage: Some(storage),
        model: MemStorage::default(),
        history: Vec::new(),
        term: 1,
    };
    harness.synced();
    for op in ops {
        harness.apply(op);
    }
    harness.apply(&Op::Reopen);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn the_log_reads_back_like_mem_storage_across_reopens_and_crashes(
        seed in any::<u64>(),
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        reads_back_like_mem_storage(seed, &ops, small_options());
    }

    /// The same with preallocated segments, whose zeros written ahead of the records (torn
    /// or lost in a crash like any unsynced write) must never cover a record.
    #[test]
    fn preallocated_segments_read_back_like_mem_storage_across_reopens_and_crashes(
        seed in any::<u64>(),
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        let mut options = small_options();
        options.wal.preallocate = true;
        reads_back_like_mem_storage(seed, &ops, options);
    }
}
