//! Recovery against every way a disk can damage the log: cuts at every byte, bit flips,
//! zeroed tails, duplicated records and lost segments. Recovery must return exactly the
//! records before the damage, or a clean corruption error naming the file; never panic and
//! never silently drop records from the middle.

mod support;

use std::sync::Arc;

use conclave_raft::{ConfState, HardState, Storage};
use conclave_storage::wal::segment::SEGMENT_HEADER_BYTES;
use conclave_storage::{Error, FatalError, SimDisk, SimDiskOptions, WalStorage, repair};
use support::*;

fn corrupt_file(result: conclave_storage::Result<WalStorage>) -> (std::path::PathBuf, u64) {
    match result {
        Err(Error::Fatal(FatalError::Corrupt { file, offset, .. })) => (file, offset),
        Err(other) => panic!("expected a corruption error, got {other}"),
        Ok(storage) => panic!("expected a corruption error, opened {storage:?}"),
    }
}

#[test]
fn cutting_the_last_segment_at_every_byte_keeps_exactly_the_whole_records() {
    let (disk, model) = build_log(120, 40);
    let segments = segments(&disk);
    assert!(
        segments.len() >= 3,
        "want several segments, got {}",
        segments.len()
    );
    let (last_path, last_bytes) = segments.last().cloned().expect("segments");
    assert_same(
        &open(&disk, small_options()).expect("open"),
        &model,
        "intact log",
    );
    for cut in SEGMENT_HEADER_BYTES..=last_bytes.len() {
        disk.set_durable_bytes(&last_path, last_bytes[..cut].to_vec());
        let storage = open(&disk, small_options()).unwrap_or_else(|e| panic!("cut at {cut}: {e}"));
        let expected = expected_prefix(&segments, segments.len() - 1, cut);
        assert_same(&storage, &expected, &format!("cut at {cut}"));
        drop(storage);
        // Reopening after recovery cut the tail finds the same log.
        assert_same(
            &open(&disk, small_options()).expect("reopen"),
            &expected,
            &format!("reopen {cut}"),
        );
    }
}

#[test]
fn a_cut_header_of_the_last_segment_is_corruption_not_a_silent_loss() {
    let (disk, _) = build_log(60, 40);
    let segments = segments(&disk);
    let (path, bytes) = segments.last().cloned().expect("segments");
    for cut in 0..SEGMENT_HEADER_BYTES {
        disk.set_durable_bytes(&path, bytes[..cut].to_vec());
        assert_eq!(
            corrupt_file(open(&disk, small_options())).0,
            path,
            "cut at {cut}"
        );
    }
}

#[test]
fn flipped_bits_give_the_prefix_before_a_torn_tail_or_a_corruption_error() {
    let (disk, _) = build_log(120, 40);
    let segments = segments(&disk);
    let mut rng = 0x5EED_u64;
    for trial in 0..400 {
        rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let segment = (rng >> 33) as usize % segments.len();
        let (path, bytes) = &segments[segment];
        let at = (rng >> 7) as usize % bytes.len();
        let mut damaged = bytes.clone();
        damaged[at] ^= 1 << (rng % 8);
        disk.set_durable_bytes(path, damaged);
        let frames = frames(bytes);
        let in_last_frame = frames.last().is_some_and(|&(offset, _)| at >= offset);
        let is_last_segment = segment + 1 == segments.len();
        if is_last_segment && in_last_frame {
            let storage =
                open(&disk, small_options()).unwrap_or_else(|e| panic!("trial {trial}: {e}"));
            assert_same(
                &storage,
                &expected_prefix(&segments, segment, at),
                &format!("trial {trial}"),
            );
        } else {
            let (file, offset) = corrupt_file(open(&disk, small_options()));
            assert_eq!(&file, path, "trial {trial}: flip at {at}");
            assert!(
                offset <= at as u64,
                "trial {trial}: error offset {offset} after the flip at {at}"
            );
        }
        disk.set_durable_bytes(path, bytes.clone());
    }
}

#[test]
fn a_zeroed_tail_of_the_last_segment_is_cut_but_of_an_earlier_one_is_corruption() {
    let (disk, _) = build_log(120, 40);
    let segments = segments(&disk);
    for zeroed in [1, 7, 8, 9, 40, 100, 512, 4096] {
        for (position, (path, bytes)) in segments.iter().enumerate() {
            let start = bytes.len().saturating_sub(zeroed).max(SEGMENT_HEADER_BYTES);
            let mut damaged = bytes.clone();
            damaged[start..].fill(0);
            disk.set_durable_bytes(path, damaged);
            if position + 1 == segments.len() {
                let storage =
                    open(&disk, small_options()).expect("zeroed tail of the last segment");
                assert_same(
                    &storage,
                    &expected_prefix(&segments, position, start),
                    &format!("zeroed {zeroed}"),
                );
            } else {
                let (file, _) = corrupt_file(open(&disk, small_options()));
                // A partly zeroed record is caught in place; whole zeroed records show where
                // the next segment does not continue the sequence.
                let next = &segments[position + 1].0;
                assert!(
                    &file == path || &file == next,
                    "zeroed {zeroed} of segment {position}: {file:?}"
                );
            }
            disk.set_durable_bytes(path, bytes.clone());
        }
    }
}

#[test]
fn a_duplicated_record_anywhere_is_corruption() {
    let (disk, _) = build_log(120, 40);
    let segments = segments(&disk);
    for (path, bytes) in &segments {
        for (offset, len) in frames(bytes) {
            let mut damaged = bytes[..offset + len].to_vec();
            damaged.extend_from_slice(&bytes[offset..]);
            disk.set_durable_bytes(path, damaged);
            let (file, at) = corrupt_file(open(&disk, small_options()));
            assert_eq!(
                (&file, at),
                (path, (offset + len) as u64),
                "duplicate of the record at {offset}"
            );
        }
        disk.set_durable_bytes(path, bytes.clone());
    }
}

#[test]
fn a_missing_segment_is_corruption_wherever_it_was() {
    let (disk, _) = build_log(120, 40);
    let segments = segments(&disk);
    for dropped in 0..segments.len() - 1 {
        disk.remove_durably(&segments[dropped].0);
        let (file, offset) = corrupt_file(open(&disk, small_options()));
        assert_eq!(
            (file, offset),
            (segments[dropped + 1].0.clone(), 0),
            "dropped segment {dropped}"
        );
        disk.set_durable_bytes(&segments[dropped].0, segments[dropped].1.clone());
    }
}

#[test]
fn repair_cuts_at_the_damage_and_the_node_opens_with_the_prefix() {
    let (disk, _) = build_log(120, 40);
    let segments = segments(&disk);
    let (path, bytes) = &segments[1];
    let (offset, _) = frames(bytes)[3];
    let mut damaged = bytes.clone();
    damaged[offset + 12] ^= 0x40;
    disk.set_durable_bytes(path, damaged);
    let (file, at) = corrupt_file(open(&disk, small_options()));
    assert_eq!((&file, at), (path, offset as u64));
    let report = repair(Arc::new(disk.clone()), DIR, small_options()).expect("repair");
    assert_eq!(report.truncated, vec![(path.clone(), offset as u64)]);
    assert_eq!(report.removed.len(), segments.len() - 2);
    let storage = open(&disk, small_options()).expect("open after repair");
    assert_same(
        &storage,
        &expected_prefix(&segments, 1, offset),
        "after repair",
    );
    // A healthy log needs no repair.
    drop(storage);
    assert!(
        !repair(Arc::new(disk.clone()), DIR, small_options())
            .expect("repair")
            .changed_anything()
    );
}

#[test]
fn the_directory_lock_keeps_a_second_opener_out_until_the_first_closes() {
    let disk = SimDisk::new(3, SimDiskOptions::default());
    let first = open(&disk, small_options()).expect("open");
    assert!(matches!(
        open(&disk, small_options()),
        Err(Error::Locked { .. })
    ));
    drop(first);
    open(&disk, small_options()).expect("reopen after close");

    let dir = tempfile::tempdir().expect("tempdir");
    let os = Arc::new(conclave_storage::OsDisk);
    let held = WalStorage::open(os.clone(), dir.path(), small_options()).expect("open");
    assert!(matches!(
        WalStorage::open(os.clone(), dir.path(), small_options()),
        Err(Error::Locked { .. })
    ));
    drop(held);
    WalStorage::open(os, dir.path(), small_options()).expect("reopen after close");
}

#[test]
fn a_failed_sync_stops_all_further_writes() {
    let disk = SimDisk::new(4, SimDiskOptions::default());
    let mut storage = open(&disk, small_options()).expect("open");
    storage.append(&[entry(1, 1, 10)]).expect("append");
    disk.fail_next_syncs(1);
    assert!(storage.sync().expect_err("sync fails").is_fatal());
    let error = storage.append(&[entry(2, 1, 10)]).expect_err("stopped");
    assert!(
        matches!(error, Error::Fatal(FatalError::Stopped(_))),
        "{error}"
    );
}

#[test]
fn snapshots_compact_whole_segments_and_survive_reopen() {
    let disk = SimDisk::new(5, SimDiskOptions::default());
    let mut storage = open(&disk, small_options()).expect("open");
    storage
        .bootstrap(ConfState::with_voters([1, 2, 3]))
        .expect("bootstrap");
    // The bootstrap snapshot covers index 1; the log proper starts after it.
    for index in 2..=200 {
        storage.append(&[entry(index, 2, 50)]).expect("append");
    }
    storage
        .set_hard_state(HardState {
            term: 2,
            vote: Some(1),
            commit: 150,
        })
        .expect("hard state");
    let segments_before = storage.segment_paths().len();
    storage
        .create_snapshot(150, ConfState::with_voters([1, 2]), "state@150".into())
        .expect("snapshot");
    let segments_after = storage.segment_paths().len();
    assert!(
        segments_after < segments_before,
        "{segments_after} >= {segments_before}"
    );
    assert_eq!(storage.first_index(), Ok(151));
    assert_eq!(storage.term(150), Ok(2));
    assert_eq!(
        storage.entries(150, 152, u64::MAX),
        Err(conclave_raft::StorageError::Compacted(150))
    );
    let expected = contents(&storage);
    drop(storage);
    disk.crash();
    let storage = open(&disk, small_options()).expect("reopen");
    assert_eq!(contents(&storage), expected);
    let snapshot = storage.snapshot().expect("snapshot");
    assert_eq!(
        (snapshot.meta.index, snapshot.data.as_ref()),
        (150, b"state@150".as_ref())
    );
    assert_eq!(
        storage.initial_state().expect("state").1,
        ConfState::with_voters([1, 2])
    );
    let reader = storage
        .snapshot_reader()
        .expect("reader")
        .expect("a snapshot");
    assert_eq!(reader.read_chunk(6, 3).expect("chunk").as_ref(), b"150");
}

/// The server writes its snapshot file on a helper thread while the log keeps growing, then
/// records it: the log past the snapshot stays, and a reopen finds both.
#[test]
fn a_snapshot_written_on_another_thread_while_the_log_grows_is_recorded() {
    let disk = SimDisk::new(6, SimDiskOptions::default());
    let mut storage = open(&disk, small_options()).expect("open");
    storage
        .bootstrap(ConfState::with_voters([1, 2, 3]))
        .expect("bootstrap");
    for index in 2..=100 {
        storage.append(&[entry(index, 2, 50)]).expect("append");
    }
    storage
        .set_hard_state(HardState {
            term: 2,
            vote: Some(1),
            commit: 100,
        })
        .expect("hard state");
    storage.sync().expect("sync");
    let mut writer = storage
        .begin_snapshot(conclave_raft::SnapshotMeta {
            index: 100,
            term: 2,
            conf_state: ConfState::with_voters([1, 2, 3]),
        })
        .expect("begin");
    let writing = std::thread::spawn(move || {
        writer.write_chunk(b"state@100").expect("chunk");
        writer.finish().expect("finish")
    });
    for index in 101..=140 {
        storage
            .append(&[entry(index, 2, 50)])
            .expect("append meanwhile");
    }
    storage.sync().expect("sync");
    let file = writing.join().expect("writer thread");
    storage.record_created_snapshot(file).expect("record");
    assert_eq!(storage.first_index(), Ok(101));
    assert_eq!(storage.last_index(), Ok(140));
    assert_eq!(
        storage.snapshot().expect("snapshot").data.as_ref(),
        b"state@100"
    );
    let expected = contents(&storage);
    drop(storage);
    disk.crash();
    let storage = open(&disk, small_options()).expect("reopen");
    assert_eq!(contents(&storage), expected);
    assert_eq!(storage.snapshot().expect("snapshot").meta.index, 100);
}

/// A storage on a fresh simulated disk that reads snapshot images on a helper thread, as the
/// server's does, with entries 1 to 100 in its log.
fn reading_in_the_background(seed: u64) -> WalStorage {
    let disk = SimDisk::new(seed, SimDiskOptions::default());
    let options = conclave_storage::StorageOptions {
        snapshot_read_in_background: true,
        ..small_options()
    };
    let mut storage = open(&disk, options).expect("open");
    for index in 1..=100 {
        storage.append(&[entry(index, 1, 50)]).expect("append");
    }
    storage
}

/// Writes `image` as the snapshot at `index` and records it.
fn record_image(storage: &mut WalStorage, index: u64, image: &[u8]) {
    let mut writer = storage
        .begin_snapshot(conclave_raft::SnapshotMeta {
            index,
            term: 1,
            conf_state: ConfState::with_voters([1]),
        })
        .expect("begin");
    writer.write_chunk(image).expect("chunk");
    let file = writer.finish().expect("finish");
    storage.record_created_snapshot(file).expect("record");
}

/// Asks for the snapshot until its image has been read.
fn snapshot_once_read(storage: &WalStorage) -> conclave_raft::Snapshot {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match storage.snapshot() {
            Ok(snapshot) => return snapshot,
            Err(conclave_raft::StorageError::SnapshotTemporarilyUnavailable) => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the image was never read"
                );
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            Err(other) => panic!("reading the image failed: {other}"),
        }
    }
}

const STILL_READING: Result<u64, conclave_raft::StorageError> =
    Err(conclave_raft::StorageError::SnapshotTemporarilyUnavailable);

/// With `snapshot_read_in_background`, an image that is only in its file is read on a helper
/// thread: the caller hears "temporarily unavailable" until it is read, never waits for it;
/// `load_snapshot` reads at once; a newer snapshot abandons a read under way.
#[test]
fn an_image_only_on_disk_is_read_in_the_background_when_asked() {
    let mut storage = reading_in_the_background(7);
    record_image(&mut storage, 60, b"state@60");
    assert_eq!(
        storage.snapshot().map(|s| s.meta.index),
        STILL_READING,
        "the first ask starts the read and does not wait for it"
    );
    // A newer snapshot abandons that read; asking again reads the newer one.
    record_image(&mut storage, 80, b"state@80");
    let snapshot = snapshot_once_read(&storage);
    assert_eq!(
        (snapshot.meta.index, snapshot.data.as_ref()),
        (80, &b"state@80"[..])
    );
    // Once read, it is held while a copy is: the next ask answers at once.
    assert_eq!(storage.snapshot().expect("held").data.as_ref(), b"state@80");
    // load_snapshot never answers "temporarily unavailable".
    record_image(&mut storage, 90, b"state@90");
    assert_eq!(
        storage.load_snapshot().expect("loaded").data.as_ref(),
        b"state@90"
    );
}

/// An image read from its file, or received from a leader, stays in memory only while a copy
/// of it is held (a transfer under way): the storage hands out the same copy while one is
/// alive, and reads the file again once none is, instead of keeping hundreds of MB beside
/// the state until the next snapshot.
#[test]
fn an_image_stays_in_memory_only_while_a_copy_is_held() {
    let mut storage = reading_in_the_background(8);
    record_image(&mut storage, 60, b"state@60");

    // Read at start-up: while that copy is held, a follower's ask gets the same bytes at once.
    let loaded = storage.load_snapshot().expect("loaded");
    let lent = storage.snapshot().expect("held while a copy is alive");
    assert_eq!(lent.data.as_ref(), b"state@60");
    assert_eq!(
        lent.data.as_ptr(),
        loaded.data.as_ptr(),
        "a second copy of one image, not a second read"
    );
    // With every copy gone the image is no longer in memory: the next ask reads the file.
    drop((loaded, lent));
    assert_eq!(
        storage.snapshot().map(|s| s.meta.index),
        STILL_READING,
        "the image was kept after its last copy was dropped"
    );

    // A snapshot installed from a leader is not kept either.
    let installed = conclave_raft::Snapshot {
        meta: conclave_raft::SnapshotMeta {
            index: 150,
            term: 2,
            conf_state: ConfState::with_voters([1]),
        },
        data: bytes::Bytes::from_static(b"state@150"),
    };
    storage.apply_snapshot(installed).expect("install");
    assert_eq!(
        storage.snapshot().map(|s| s.meta.index),
        STILL_READING,
        "the installed image was kept"
    );
    let read = snapshot_once_read(&storage);
    assert_eq!(
        (read.meta.index, read.data.as_ref()),
        (150, &b"state@150"[..])
    );
}

#[test]
fn a_damaged_snapshot_the_log_depends_on_is_a_clean_error() {
    let disk = SimDisk::new(6, SimDiskOptions::default());
    let mut storage = open(&disk, small_options()).expect("open");
    for index in 1..=100 {
        storage.append(&[entry(index, 1, 50)]).expect("append");
    }
    storage
        .create_snapshot(90, ConfState::with_voters([1]), "s".into())
        .expect("snapshot");
    drop(storage);
    let snap_dir = std::path::Path::new(DIR).join("snap");
    let name = disk
        .durable_files(&snap_dir)
        .into_iter()
        .next()
        .expect("a snapshot file");
    let path = snap_dir.join(name);
    let mut bytes = disk.durable_bytes(&path).expect("bytes");
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    disk.set_durable_bytes(&path, bytes);
    let (file, _) = corrupt_file(open(&disk, small_options()));
    assert_eq!(file, path);
}

#[test]
fn a_real_disk_round_trips_across_reopen_with_preallocated_segments() {
    let dir = tempfile::tempdir().expect("tempdir");
    let os = Arc::new(conclave_storage::OsDisk);
    let mut options = small_options();
    options.wal.preallocate = true;
    let mut storage = WalStorage::open(os.clone(), dir.path(), options).expect("open");
    for index in 1..=300 {
        storage.append(&[entry(index, 1, 30)]).expect("append");
    }
    storage
        .set_hard_state(HardState {
            term: 1,
            vote: Some(2),
            commit: 200,
        })
        .expect("hard state");
    storage.sync().expect("sync");
    let expected = contents(&storage);
    drop(storage);
    let storage = WalStorage::open(os, dir.path(), options).expect("reopen");
    assert_eq!(contents(&storage), expected);
}

#[test]
fn a_snapshot_file_the_crash_kept_from_being_logged_is_adopted_at_open() {
    let disk = SimDisk::new(8, SimDiskOptions::default());
    let mut storage = open(&disk, small_options()).expect("open");
    for index in 1..=50 {
        storage.append(&[entry(index, 3, 20)]).expect("append");
    }
    storage.sync().expect("sync");
    let meta = conclave_raft::SnapshotMeta {
        index: 60,
        term: 4,
        conf_state: ConfState::with_voters([1, 2]),
    };
    let mut writer = storage.begin_snapshot(meta).expect("begin");
    writer.write_chunk(b"from the leader").expect("chunk");
    writer.finish().expect("durable file, never logged");
    drop(storage);
    disk.crash();
    let storage = open(&disk, small_options()).expect("open");
    assert_eq!(storage.recovery_report().adopted_snapshot, Some(60));
    assert_eq!(
        (storage.first_index(), storage.last_index()),
        (Ok(61), Ok(60))
    );
    assert_eq!(storage.hard_state().commit, 60);
    assert_eq!(
        storage.snapshot().expect("snapshot").data.as_ref(),
        b"from the leader"
    );
    drop(storage);
    disk.crash();
    let storage = open(&disk, small_options()).expect("reopen");
    assert_eq!(
        storage.recovery_report().adopted_snapshot,
        None,
        "adoption was made durable"
    );
    assert_eq!(storage.last_index(), Ok(60));
}

#[test]
fn records_a_dead_process_left_unsynced_are_durable_once_recovery_read_them() {
    let disk = SimDisk::new(9, SimDiskOptions::default());
    let mut storage = open(&disk, small_options()).expect("open");
    for index in 1..=20 {
        storage.append(&[entry(index, 2, 30)]).expect("append");
    }
    storage.sync().expect("sync");
    for index in 21..=30 {
        storage.append(&[entry(index, 2, 30)]).expect("append");
    }
    // Written to the file system and never synced: the process dies here, the page cache
    // keeps the bytes, and the restarted node reads all 30 entries back.
    storage.flush().expect("flush");
    drop(storage);
    let storage = open(&disk, small_options()).expect("reopen after the process died");
    assert_eq!(storage.last_index(), Ok(30));
    drop(storage);
    // What the node read back it may already have acknowledged or voted on; a power cut now
    // must not take it away.
    disk.crash();
    let storage = open(&disk, small_options()).expect("reopen after a power cut");
    assert_eq!(
        storage.last_index(),
        Ok(30),
        "entries recovery read back were lost to a later power cut"
    );
}
