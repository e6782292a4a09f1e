//! Storage benchmark: group commit against the disk's own limits, and recovery time.
//!
//! `cargo run --release -p conclave-storage --bin storage-bench -- [--dir DIR] [--quick]`
//!
//! It measures, on the disk holding DIR (default: the system temp dir), in one run:
//! - the raw `fdatasync` rate (small write + fdatasync, repeated) and raw sequential write
//!   bandwidth (large writes, one fdatasync at the end);
//! - the raw write-and-fdatasync bandwidth of exactly one batch's bytes, the physical limit
//!   for each batch size, so the WAL's own overhead is visible;
//! - WAL appends per second and MB/s with a sync per entry (batch 1) and group commit at
//!   batches of 8, 64 and 512 entries, for 256-byte entries and for 64 KiB entries;
//! - the time to open (recover) a log of 1,000,000 entries of 256 bytes.

use std::fs::{self, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use conclave_raft::{Entry, EntryKind, HardState, Storage};
use conclave_storage::{OsDisk, StorageOptions, WalStorage};

const MEASURE_TIME: Duration = Duration::from_millis(1500);

struct Args {
    dir: PathBuf,
    quick: bool,
}

fn parse_args() -> Args {
    let mut args = Args {
        dir: std::env::temp_dir(),
        quick: false,
    };
    let mut iter = std::env::args().skip(1);
    while let Some(arg) = iter.next() {
        match arg.as_str() {
            "--dir" => args.dir = PathBuf::from(iter.next().unwrap_or_else(|| usage())),
            "--quick" => args.quick = true,
            _ => usage(),
        }
    }
    args
}

fn usage() -> ! {
    eprintln!("usage: storage-bench [--dir DIR] [--quick]");
    std::process::exit(2)
}

fn mb_per_s(bytes: u64, elapsed: Duration) -> f64 {
    bytes as f64 / 1e6 / elapsed.as_secs_f64()
}

/// Small write + fdatasync, as often as possible for a while: the disk's sync rate.
fn raw_fdatasync_rate(dir: &Path) -> std::io::Result<f64> {
    let path = dir.join("raw-sync");
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)?;
    // Written out in full first, so the timed syncs flush data only, never block allocation.
    let region_bytes: u64 = 64 << 20;
    let fill = vec![1u8; 1 << 20];
    for offset in (0..region_bytes).step_by(fill.len()) {
        file.write_all_at(&fill, offset)?;
    }
    file.sync_all()?;
    let block = vec![7u8; 512];
    let start = Instant::now();
    let mut syncs = 0u64;
    while start.elapsed() < MEASURE_TIME {
        file.write_all_at(&block, syncs * block.len() as u64 % region_bytes)?;
        file.sync_data()?;
        syncs += 1;
    }
    let rate = syncs as f64 / start.elapsed().as_secs_f64();
    fs::remove_file(path)?;
    Ok(rate)
}

/// 1 MiB writes of a fresh file, one fdatasync at the end: the disk's sequential bandwidth.
fn raw_sequential_mb_per_s(dir: &Path, total_bytes: u64) -> std::io::Result<f64> {
    let path = dir.join("raw-seq");
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)?;
    let chunk = vec![9u8; 1 << 20];
    let start = Instant::now();
    let mut offset = 0;
    while offset < total_bytes {
        file.write_all_at(&chunk, offset)?;
        offset += chunk.len() as u64;
    }
    file.sync_data()?;
    let rate = mb_per_s(total_bytes, start.elapsed());
    fs::remove_file(path)?;
    Ok(rate)
}

/// Writes of `bytes_per_sync` at growing offsets, each followed by fdatasync, for a while: the
/// disk's own limit for exactly the write-and-sync pattern a WAL batch makes, with none of
/// the WAL's framing, checksums or bookkeeping.
fn raw_batched_mb_per_s(dir: &Path, bytes_per_sync: usize) -> std::io::Result<f64> {
    let path = dir.join("raw-batched");
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)?;
    // Preallocated like a WAL segment, so each fdatasync flushes data, not a growing size.
    preallocate(&file, RAW_BATCHED_PREALLOCATE_BYTES)?;
    let chunk = vec![7u8; bytes_per_sync];
    let start = Instant::now();
    let mut offset = 0u64;
    while start.elapsed() < MEASURE_TIME {
        file.write_all_at(&chunk, offset)?;
        file.sync_data()?;
        offset += chunk.len() as u64;
    }
    let rate = mb_per_s(offset, start.elapsed());
    fs::remove_file(path)?;
    Ok(rate)
}

/// What the raw batched run preallocates; more than 1.5 s of writes at a fast disk's speed.
const RAW_BATCHED_PREALLOCATE_BYTES: i64 = 2 << 30;

fn preallocate(file: &std::fs::File, len_bytes: i64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: the descriptor is open for writing for the duration of the call.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len_bytes) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::from_raw_os_error(rc))
    }
}

fn entry(index: u64, data: &Bytes) -> Entry {
    Entry {
        term: 1,
        index,
        kind: EntryKind::Normal,
        data: data.clone(),
    }
}

struct AppendResult {
    appends_per_s: f64,
    payload_mb_per_s: f64,
    syncs_per_s: f64,
}

/// Appends batches of `batch` entries, one sync per batch, for a while.
fn wal_appends(
    dir: &Path,
    entry_bytes: usize,
    batch: u64,
) -> conclave_storage::Result<AppendResult> {
    let data_dir = dir.join(format!("wal-{entry_bytes}-{batch}"));
    let _ = fs::remove_dir_all(&data_dir);
    let mut storage = WalStorage::open(Arc::new(OsDisk), &data_dir, StorageOptions::default())?;
    let data = Bytes::from(vec![5u8; entry_bytes]);
    let mut next_index = 1;
    let mut syncs = 0u64;
    let start = Instant::now();
    while start.elapsed() < MEASURE_TIME {
        let entries: Vec<Entry> = (next_index..next_index + batch)
            .map(|i| entry(i, &data))
            .collect();
        storage.append(&entries)?;
        storage.sync()?;
        next_index += batch;
        syncs += 1;
    }
    let elapsed = start.elapsed();
    let appended = next_index - 1;
    drop(storage);
    let _ = fs::remove_dir_all(&data_dir);
    Ok(AppendResult {
        appends_per_s: appended as f64 / elapsed.as_secs_f64(),
        payload_mb_per_s: mb_per_s(appended * entry_bytes as u64, elapsed),
        syncs_per_s: syncs as f64 / elapsed.as_secs_f64(),
    })
}

/// Writes `count` entries of 256 bytes, then times reopening the log.
fn recovery_time(dir: &Path, count: u64) -> conclave_storage::Result<(Duration, u64)> {
    let data_dir = dir.join("wal-recovery");
    let _ = fs::remove_dir_all(&data_dir);
    let options = StorageOptions::default();
    let mut storage = WalStorage::open(Arc::new(OsDisk), &data_dir, options)?;
    let data = Bytes::from(vec![3u8; 256]);
    let mut index = 1;
    while index <= count {
        let end = (index + 1024).min(count + 1);
        let entries: Vec<Entry> = (index..end).map(|i| entry(i, &data)).collect();
        storage.append(&entries)?;
        index = end;
    }
    storage.set_hard_state(HardState {
        term: 1,
        vote: Some(1),
        commit: count,
    })?;
    storage.sync()?;
    drop(storage);
    let start = Instant::now();
    let storage = WalStorage::open(Arc::new(OsDisk), &data_dir, options)?;
    let elapsed = start.elapsed();
    let last = storage
        .last_index()
        .map_err(|e| conclave_storage::Error::InvalidOptions(e.to_string()))?;
    assert_eq!(last, count, "recovered log has the wrong length");
    drop(storage);
    let _ = fs::remove_dir_all(&data_dir);
    Ok((elapsed, last))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse_args();
    let dir = args
        .dir
        .join(format!("conclave-storage-bench-{}", std::process::id()));
    fs::create_dir_all(&dir)?;
    println!("# conclave-storage benchmark in {}", dir.display());

    let sequential_bytes = if args.quick { 64 << 20 } else { 512 << 20 };
    // The disk is shared and its speed drifts, so the raw limits are taken before and after
    // the WAL runs; the ratios use the better of the two (the stricter comparison).
    let sync_rate_before = raw_fdatasync_rate(&dir)?;
    let sequential_before = raw_sequential_mb_per_s(&dir, sequential_bytes)?;
    let mut tables = String::new();
    let mut rows = Vec::new();
    for entry_bytes in [256usize, 64 << 10] {
        for batch in [1u64, 8, 64, 512] {
            // The disk's speed drifts, so each row is compared with a raw run right before it.
            let adjacent_sequential = raw_sequential_mb_per_s(&dir, sequential_bytes / 2)?;
            let same_pattern = raw_batched_mb_per_s(&dir, entry_bytes * batch as usize)?;
            rows.push((
                entry_bytes,
                batch,
                adjacent_sequential,
                same_pattern,
                wal_appends(&dir, entry_bytes, batch)?,
            ));
        }
    }
    let sync_rate_after = raw_fdatasync_rate(&dir)?;
    let sequential_after = raw_sequential_mb_per_s(&dir, sequential_bytes)?;
    let sync_rate = sync_rate_before.max(sync_rate_after);
    let sequential = sequential_before.max(sequential_after);
    println!(
        "\nraw fdatasync rate:   {sync_rate_before:>8.0} syncs/s before, {sync_rate_after:>8.0} after"
    );
    println!(
        "raw sequential write: {sequential_before:>8.1} MB/s before, {sequential_after:>8.1} after \
         (1 MiB writes, one fdatasync)"
    );
    for (entry_bytes, batch, adjacent_sequential, same_pattern, result) in rows {
        if batch == 1 {
            tables.push_str(&format!(
                "\nWAL appends, {entry_bytes}-byte entries, one fdatasync per batch \
                 (batch 1 = fsync per entry):\n\
                 | batch | appends/s | payload MB/s | syncs/s | syncs / raw rate | MB/s / raw bandwidth | raw MB/s just before | MB/s / that | raw write+sync of one batch, MB/s | MB/s / that |\n\
                 |------:|----------:|-------------:|--------:|-----------------:|---------------------:|---------------------:|------------:|----------------------------------:|------------:|\n"
            ));
        }
        tables.push_str(&format!(
            "| {batch:>5} | {:>9.0} | {:>12.1} | {:>7.0} | {:>15.0}% | {:>19.0}% | {:>20.1} | {:>10.0}% | {:>33.1} | {:>10.0}% |\n",
            result.appends_per_s,
            result.payload_mb_per_s,
            result.syncs_per_s,
            100.0 * result.syncs_per_s / sync_rate,
            100.0 * result.payload_mb_per_s / sequential,
            adjacent_sequential,
            100.0 * result.payload_mb_per_s / adjacent_sequential,
            same_pattern,
            100.0 * result.payload_mb_per_s / same_pattern,
        ));
    }
    print!("{tables}");

    let count = if args.quick { 100_000 } else { 1_000_000 };
    let (elapsed, entries) = recovery_time(&dir, count)?;
    println!(
        "\nrecovery of {entries} entries of 256 bytes: {:.3} s (page cache warm)",
        elapsed.as_secs_f64()
    );
    fs::remove_dir_all(&dir)?;
    Ok(())
}
