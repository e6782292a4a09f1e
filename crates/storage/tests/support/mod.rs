//! Helpers shared by the storage integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use conclave_raft::{Entry, EntryKind, HardState, MemStorage, Storage};
use conclave_storage::wal::record::{self, FRAME_HEADER_BYTES, Frame, Record};
use conclave_storage::wal::segment::SEGMENT_HEADER_BYTES;
use conclave_storage::{SimDisk, SimDiskOptions, StorageOptions, WalOptions, WalStorage};

pub const DIR: &str = "/data";

pub fn small_options() -> StorageOptions {
    StorageOptions {
        wal: WalOptions {
            segment_size_bytes: 4096,
            preallocate: false,
            write_buffer_bytes: 1024,
            // Every write may start a stretch of zeros, so tests that turn preallocation on
            // exercise it with their small writes.
            zero_ahead_write_bytes_min: 0,
        },
        cache_entries_max: 8,
        cache_bytes_max: 1 << 20,
        snapshots_retained: 2,
        snapshot_read_in_background: false,
    }
}

pub fn entry(index: u64, term: u64, size_bytes: usize) -> Entry {
    let data: Vec<u8> = (0..size_bytes)
        .map(|i| (index as usize * 31 + i) as u8)
        .collect();
    Entry {
        index,
        term,
        kind: EntryKind::Normal,
        data: Bytes::from(data),
    }
}

pub fn open(disk: &SimDisk, options: StorageOptions) -> conclave_storage::Result<WalStorage> {
    WalStorage::open(Arc::new(disk.clone()), DIR, options)
}

pub fn wal_dir() -> PathBuf {
    Path::new(DIR).join("wal")
}

/// Every entry and the hard state, read through the `Storage` trait.
pub fn contents(storage: &dyn Storage) -> (HardState, u64, Vec<Entry>) {
    let first = storage.first_index().expect("first");
    let last = storage.last_index().expect("last");
    let entries = storage.entries(first, last + 1, u64::MAX).expect("entries");
    let (hard_state, _) = storage.initial_state().expect("initial state");
    (hard_state, first, entries)
}

/// A log of `count` entries over several small segments, with hard states between them.
pub fn build_log(count: u64, entry_bytes: usize) -> (SimDisk, MemStorage) {
    let disk = SimDisk::new(
        1,
        SimDiskOptions {
            torn_write_percent: 0,
            garble_percent: 0,
        },
    );
    let mut storage = open(&disk, small_options()).expect("open");
    let mut model = MemStorage::default();
    for index in 1..=count {
        let term = 1 + index / 10;
        storage
            .append(&[entry(index, term, entry_bytes)])
            .expect("append");
        model.append(&[entry(index, term, entry_bytes)]);
        if index % 7 == 0 {
            let hard_state = HardState {
                term,
                vote: Some(index % 3 + 1),
                commit: index - 3,
            };
            storage.set_hard_state(hard_state).expect("hard state");
            model.set_hard_state(hard_state);
        }
    }
    storage.sync().expect("sync");
    (disk, model)
}

/// The durable segment files in order, with their bytes.
pub fn segments(disk: &SimDisk) -> Vec<(PathBuf, Vec<u8>)> {
    let mut names = disk.durable_files(&wal_dir());
    names.sort();
    names
        .into_iter()
        .map(|name| {
            let path = wal_dir().join(name);
            let bytes = disk.durable_bytes(&path).expect("segment bytes");
            (path, bytes)
        })
        .collect()
}

/// The frames of a segment: (offset, length).
pub fn frames(bytes: &[u8]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut offset = SEGMENT_HEADER_BYTES;
    while let Frame::Valid { frame_len, .. } = record::read_frame(&bytes[offset..]) {
        out.push((offset, frame_len));
        offset += frame_len;
    }
    out
}

/// What the log should hold when recovery keeps every record of `segments` up to (not
/// including) byte `cut` of segment `cut_segment`: replays the records independently.
pub fn expected_prefix(
    segments: &[(PathBuf, Vec<u8>)],
    cut_segment: usize,
    cut: usize,
) -> MemStorage {
    let mut model = MemStorage::default();
    for (position, (_, bytes)) in segments.iter().enumerate().take(cut_segment + 1) {
        for (offset, len) in frames(bytes) {
            if position == cut_segment && offset + len > cut {
                return model;
            }
            let Frame::Valid { body, .. } = record::read_frame(&bytes[offset..]) else {
                unreachable!()
            };
            match record::decode_body(body).expect("decodable").1 {
                Record::Entry {
                    term,
                    index,
                    kind,
                    data,
                } => model.append(&[Entry {
                    term,
                    index,
                    kind,
                    data: Bytes::copy_from_slice(data),
                }]),
                Record::HardState(hard_state) => model.set_hard_state(hard_state),
                _ => {}
            }
        }
    }
    model
}

/// Asserts the recovered storage equals `model` exactly.
pub fn assert_same(storage: &WalStorage, model: &MemStorage, context: &str) {
    assert_eq!(contents(storage), contents(model), "{context}");
}

pub const _FRAME_HEADER: usize = FRAME_HEADER_BYTES;
