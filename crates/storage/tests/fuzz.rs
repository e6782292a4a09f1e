//! Decoder fuzzing: random and mutated bytes into every decoder of what the storage reads back
//! from the disk (record frames and bodies, hard states, segment headers, whole segments and
//! the recovery over them, snapshot files). None may panic, and none may allocate from a length
//! field it has not checked against a cap; what was encoded must decode to itself.
//!
//! CI runs a bounded number of cases (about a minute in release); set `CONCLAVE_FUZZ_CASES` to
//! multiply them for a longer run, e.g. `CONCLAVE_FUZZ_CASES=20 cargo test --release -p
//! conclave-storage --test fuzz`.

mod support;

use std::path::Path;

use conclave_raft::{ConfState, EntryKind, HardState, SnapshotMeta};
use conclave_storage::wal::record::{self, Frame, RECORD_BYTES_MAX, Record};
use conclave_storage::wal::segment::{self, SEGMENT_HEADER_BYTES};
use conclave_storage::{Disk, SimDisk, SimDiskOptions};
use proptest::prelude::*;
use support::*;

/// Cases of a target scaled by `CONCLAVE_FUZZ_CASES` (a multiplier; 1 when unset).
fn cases(base: u32) -> ProptestConfig {
    let factor = std::env::var("CONCLAVE_FUZZ_CASES")
        .ok()
        .and_then(|text| text.parse::<u32>().ok())
        .unwrap_or(1)
        .max(1);
    ProptestConfig {
        cases: base.saturating_mul(factor),
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Values that break careless arithmetic, mixed with ordinary ones.
fn extreme_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1u64),
        Just(u64::MAX),
        Just(u64::MAX - 1),
        Just(u64::from(u32::MAX)),
        Just(1u64 << 63),
        any::<u64>(),
        0u64..1000,
    ]
}

fn hard_state() -> impl Strategy<Value = HardState> {
    (
        extreme_u64(),
        proptest::option::of(extreme_u64()),
        extreme_u64(),
    )
        .prop_map(|(term, vote, commit)| HardState { term, vote, commit })
}

#[derive(Debug, Clone)]
enum OwnedRecord {
    Checkpoint(HardState, u64, u64, u64),
    HardState(HardState),
    Entry(u64, u64, bool, Vec<u8>),
    Snapshot(u64, u64, bool),
}

impl OwnedRecord {
    fn as_record(&self) -> Record<'_> {
        match self {
            OwnedRecord::Checkpoint(hard_state, snapshot_index, snapshot_term, last_index) => {
                Record::Checkpoint {
                    hard_state: *hard_state,
                    snapshot_index: *snapshot_index,
                    snapshot_term: *snapshot_term,
                    last_index: *last_index,
                }
            }
            OwnedRecord::HardState(hard_state) => Record::HardState(*hard_state),
            OwnedRecord::Entry(term, index, conf_change, data) => Record::Entry {
                term: *term,
                index: *index,
                kind: if *conf_change {
                    EntryKind::ConfChange
                } else {
                    EntryKind::Normal
                },
                data,
            },
            OwnedRecord::Snapshot(index, term, keep_suffix) => Record::Snapshot {
                index: *index,
                term: *term,
                keep_suffix: *keep_suffix,
            },
        }
    }
}

fn owned_record() -> impl Strategy<Value = OwnedRecord> {
    prop_oneof![
        (hard_state(), extreme_u64(), extreme_u64(), extreme_u64())
            .prop_map(|(h, i, t, l)| OwnedRecord::Checkpoint(h, i, t, l)),
        hard_state().prop_map(OwnedRecord::HardState),
        (
            extreme_u64(),
            extreme_u64(),
            any::<bool>(),
            proptest::collection::vec(any::<u8>(), 0..64)
        )
            .prop_map(|(t, i, c, d)| OwnedRecord::Entry(t, i, c, d)),
        (extreme_u64(), extreme_u64(), any::<bool>())
            .prop_map(|(i, t, k)| OwnedRecord::Snapshot(i, t, k)),
    ]
}

/// One way to damage bytes: what a bad disk, a bad cable or a hand editor does.
#[derive(Debug, Clone)]
enum Mutation {
    FlipBit {
        at: usize,
        bit: u8,
    },
    SetByte {
        at: usize,
        value: u8,
    },
    /// Overwrite four bytes with a length-like value.
    SetU32 {
        at: usize,
        value: u32,
    },
    Truncate {
        at: usize,
    },
    Insert {
        at: usize,
        bytes: Vec<u8>,
    },
    Remove {
        at: usize,
        len: usize,
    },
    Append {
        bytes: Vec<u8>,
    },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let length = prop_oneof![
        Just(0u32),
        Just(u32::MAX),
        Just(RECORD_BYTES_MAX as u32),
        Just(RECORD_BYTES_MAX as u32 + 1),
        Just(16u32 << 20),
        any::<u32>(),
        0u32..256,
    ];
    prop_oneof![
        (any::<usize>(), 0u8..8).prop_map(|(at, bit)| Mutation::FlipBit { at, bit }),
        (any::<usize>(), any::<u8>()).prop_map(|(at, value)| Mutation::SetByte { at, value }),
        (any::<usize>(), length).prop_map(|(at, value)| Mutation::SetU32 { at, value }),
        any::<usize>().prop_map(|at| Mutation::Truncate { at }),
        (
            any::<usize>(),
            proptest::collection::vec(any::<u8>(), 1..32)
        )
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        (any::<usize>(), 1usize..64).prop_map(|(at, len)| Mutation::Remove { at, len }),
        proptest::collection::vec(any::<u8>(), 1..64).prop_map(|bytes| Mutation::Append { bytes }),
    ]
}

fn apply(bytes: &mut Vec<u8>, mutation: &Mutation) {
    let len = bytes.len();
    let pick = |at: usize| if len == 0 { 0 } else { at % len };
    match mutation {
        Mutation::FlipBit { at, bit } if len > 0 => bytes[pick(*at)] ^= 1 << bit,
        Mutation::SetByte { at, value } if len > 0 => bytes[pick(*at)] = *value,
        Mutation::SetU32 { at, value } if len >= 4 => {
            let at = pick(*at).min(len - 4);
            bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
        }
        Mutation::Truncate { at } => bytes.truncate(pick(*at)),
        Mutation::Insert {
            at,
            bytes: inserted,
        } => {
            let at = if len == 0 { 0 } else { at % (len + 1) };
            bytes.splice(at..at, inserted.iter().copied());
        }
        Mutation::Remove { at, len: removed } if len > 0 => {
            let at = pick(*at);
            let end = (at + removed).min(len);
            bytes.drain(at..end);
        }
        Mutation::Append { bytes: appended } => bytes.extend_from_slice(appended),
        _ => {}
    }
}

/// Everything the frame decoders make of `bytes`: must return, never panic.
fn decode_all(bytes: &[u8]) {
    if let Frame::Valid { body, frame_len } = record::read_frame(bytes) {
        assert!(frame_len <= bytes.len());
        let _ = record::decode_body(body);
        let _ = record::decode_entry(body);
    }
    let _ = segment::decode_header(bytes);
}

/// A small log over two segments, written once: the seed of the segment mutations.
fn seed_log() -> (SimDisk, Vec<(std::path::PathBuf, Vec<u8>)>) {
    let (disk, _) = build_log(40, 30);
    let segments = segments(&disk);
    (disk, segments)
}

/// A data directory with a snapshot the log is compacted to, plus its snapshot file's bytes.
fn seed_snapshot() -> (SimDisk, std::path::PathBuf, Vec<u8>) {
    let disk = SimDisk::new(
        9,
        SimDiskOptions {
            torn_write_percent: 0,
            garble_percent: 0,
        },
    );
    let mut storage = open(&disk, small_options()).expect("open");
    for index in 1..=30 {
        storage.append(&[entry(index, 1, 20)]).expect("append");
    }
    storage
        .create_snapshot(20, ConfState::with_voters([1, 2, 3]), "state image".into())
        .expect("snapshot");
    storage.sync().expect("sync");
    drop(storage);
    let snap_dir = Path::new(DIR).join("snap");
    let name = disk
        .durable_files(&snap_dir)
        .into_iter()
        .find(|name| name.ends_with(".snap"))
        .expect("a snapshot file");
    let path = snap_dir.join(name);
    let bytes = disk.durable_bytes(&path).expect("bytes");
    (disk, path, bytes)
}

proptest! {
    #![proptest_config(cases(300_000))]

    #[test]
    fn random_bytes_never_panic_a_frame_or_header_decoder(
        bytes in proptest::collection::vec(any::<u8>(), 0..256)
    ) {
        decode_all(&bytes);
        for start in 0..bytes.len().min(16) {
            decode_all(&bytes[start..]);
        }
    }

    #[test]
    fn every_record_round_trips_and_mutations_never_panic(
        seq in extreme_u64(),
        owned in owned_record(),
        mutations in proptest::collection::vec(mutation(), 1..4),
    ) {
        let record = owned.as_record();
        let mut encoded = Vec::new();
        record::encode(seq, &record, &mut encoded);
        let Frame::Valid { body, frame_len } = record::read_frame(&encoded) else {
            panic!("a fresh encoding must be a valid frame");
        };
        prop_assert_eq!(frame_len, encoded.len());
        prop_assert_eq!(record::decode_body(body), Ok((seq, record.clone())));
        let mut damaged = encoded.clone();
        for mutation in &mutations {
            apply(&mut damaged, mutation);
        }
        decode_all(&damaged);
        // A checksum guards every frame: a damaged one that still reads as valid must be the
        // very same record (a mutation can undo itself, e.g. truncating past the end).
        if let Frame::Valid { body, .. } = record::read_frame(&damaged)
            && damaged != encoded
        {
            prop_assert_eq!(record::decode_body(body), Ok((seq, record)));
        }
    }

    #[test]
    fn segment_headers_round_trip_and_reject_damage(
        first_seq in extreme_u64(),
        mutation in mutation(),
    ) {
        let header = segment::encode_header(first_seq);
        prop_assert_eq!(segment::decode_header(&header), Ok(first_seq));
        let mut damaged = header.to_vec();
        apply(&mut damaged, &mutation);
        if damaged.get(..SEGMENT_HEADER_BYTES) != Some(&header[..]) {
            prop_assert!(segment::decode_header(&damaged).is_err());
        }
    }
}

proptest! {
    #![proptest_config(cases(40_000))]

    #[test]
    fn recovery_over_mutated_segments_returns_a_log_or_an_error_never_panics(
        which in any::<usize>(),
        mutations in proptest::collection::vec(mutation(), 1..4),
    ) {
        let (disk, segments) = seed_log();
        let (path, bytes) = &segments[which % segments.len()];
        let mut damaged = bytes.clone();
        for mutation in &mutations {
            apply(&mut damaged, mutation);
        }
        disk.set_durable_bytes(path, damaged);
        if let Ok(storage) = open(&disk, small_options()) {
            // Whatever opened reads back in full.
            let _ = contents(&storage);
        }
    }

    #[test]
    fn recovery_over_random_segment_files_never_panics(
        body in proptest::collection::vec(any::<u8>(), 0..512),
        with_header in any::<bool>(),
    ) {
        let disk = SimDisk::new(5, SimDiskOptions::default());
        let path = wal_dir().join(segment::segment_file_name(1));
        let mut bytes = if with_header {
            segment::encode_header(1).to_vec()
        } else {
            Vec::new()
        };
        bytes.extend_from_slice(&body);
        disk.create_dir_all(&wal_dir()).expect("mkdir");
        disk.set_durable_bytes(&path, bytes);
        if let Ok(storage) = open(&disk, small_options()) {
            let _ = contents(&storage);
        }
    }

    #[test]
    fn mutated_snapshot_files_are_refused_or_read_never_panic(
        mutations in proptest::collection::vec(mutation(), 1..4),
    ) {
        let (disk, path, bytes) = seed_snapshot();
        let mut damaged = bytes.clone();
        for mutation in &mutations {
            apply(&mut damaged, mutation);
        }
        let changed = damaged != bytes;
        disk.set_durable_bytes(&path, damaged);
        match open(&disk, small_options()) {
            Ok(storage) => {
                // Only an unchanged file may be taken (the checksum covers the whole file).
                prop_assert!(!changed, "a damaged snapshot file was accepted");
                let snapshot = conclave_raft::Storage::snapshot(&storage).expect("snapshot");
                prop_assert_eq!(snapshot.data.as_ref(), b"state image");
            }
            Err(error) => prop_assert!(error.is_fatal()),
        }
    }

    #[test]
    fn random_snapshot_files_are_refused_never_panic(
        bytes in proptest::collection::vec(any::<u8>(), 0..256),
        magic in any::<bool>(),
    ) {
        let disk = SimDisk::new(6, SimDiskOptions::default());
        let storage = open(&disk, small_options()).expect("open");
        drop(storage);
        let snap_dir = Path::new(DIR).join("snap");
        let path = snap_dir.join(conclave_storage::snapshot::snapshot_file_name(5, 1));
        let mut file = if magic { b"CNCLSNAP".to_vec() } else { Vec::new() };
        file.extend_from_slice(&bytes);
        disk.set_durable_bytes(&path, file);
        // A fresh log needs no snapshot: the garbage is passed over and reported.
        let storage = open(&disk, small_options()).expect("a bad file is passed over");
        prop_assert_eq!(storage.recovery_report().invalid_snapshots.len(), 1);
    }
}

#[test]
fn a_snapshot_meta_with_huge_counts_is_refused_without_allocating() {
    // The header's meta length and the member counts inside it are length fields: set them
    // to their maximum and the file must be refused, not trusted.
    let (disk, path, bytes) = seed_snapshot();
    for (at, value) in [(12usize, u32::MAX), (16 + 16, u32::MAX), (16 + 16, 1 << 28)] {
        let mut damaged = bytes.clone();
        damaged[at..at + 4].copy_from_slice(&value.to_le_bytes());
        disk.set_durable_bytes(&path, damaged);
        assert!(
            open(&disk, small_options()).is_err(),
            "field at {at} = {value}"
        );
    }
    disk.set_durable_bytes(&path, bytes);
    let storage = open(&disk, small_options()).expect("restored");
    let meta: SnapshotMeta = conclave_raft::Storage::snapshot(&storage)
        .expect("snapshot")
        .meta;
    assert_eq!(meta.index, 20);
}
