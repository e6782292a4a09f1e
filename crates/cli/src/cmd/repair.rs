//! `conclave repair --data-dir DIR [--dry-run]`: cut a write-ahead log that `serve` refused to
//! open because of damage before its end.
//!
//! It says, for each cut, the segment, the offset, why recovery refused it and what the cut
//! loses (records, bytes, the index range of the intact entries after the damage, hard states);
//! with `--dry-run` it only says so. The node must be stopped: the data directory's lock is
//! taken as `serve` takes it.

use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use conclave_storage::{
    Error as StorageError, OsDisk, RepairCut, RepairMode, RepairReport, StorageOptions, repair_with,
};
use serde_json::{Value, json};

use super::{CmdResult, Ctx, Failure};

#[derive(Args, Debug)]
pub struct RepairArgs {
    /// The data directory of the stopped node (as given to `serve --data-dir`).
    #[arg(long, env = "CONCLAVE_DATA_DIR")]
    pub data_dir: PathBuf,
    /// Report what would be cut and change nothing.
    #[arg(long)]
    pub dry_run: bool,
}

pub fn run(ctx: &Ctx, args: RepairArgs) -> CmdResult {
    if !args.data_dir.is_dir() {
        return Err(Failure::new(
            "not_found",
            format!("data directory {} does not exist", args.data_dir.display()),
        ));
    }
    let mode = if args.dry_run {
        RepairMode::DryRun
    } else {
        RepairMode::Apply
    };
    let report = repair_with(
        Arc::new(OsDisk),
        &args.data_dir,
        StorageOptions::default(),
        mode,
    )
    .map_err(|error| failure(&args, error))?;
    ctx.out
        .ok(document(&report, args.dry_run), || human(&report, &args));
    Ok(0)
}

fn failure(args: &RepairArgs, error: StorageError) -> Failure {
    match error {
        StorageError::Locked { .. } => Failure::new(
            "unavailable",
            format!(
                "data directory {} is in use; stop the node before repairing it",
                args.data_dir.display()
            ),
        ),
        StorageError::Fatal(conclave_storage::FatalError::Io { .. }) => {
            Failure::io(format!("repair failed: {error}"))
        }
        other => Failure::new(
            "unavailable",
            format!("the log cannot be repaired by cutting it: {other}"),
        ),
    }
}

fn cut_document(cut: &RepairCut) -> Value {
    json!({
        "file": cut.file.display().to_string(),
        "offset": cut.offset_bytes,
        "reason": cut.reason,
        "records_lost": cut.records_lost,
        "bytes_lost": cut.bytes_lost,
        "entries_lost": cut.entries_lost.map(|(first, last)| json!({"first": first, "last": last})),
        "hard_states_lost": cut.hard_states_lost,
    })
}

fn document(report: &RepairReport, dry_run: bool) -> Value {
    json!({
        "dry_run": dry_run,
        "changed": report.changed_anything() && !dry_run,
        "cuts": report.cuts.iter().map(cut_document).collect::<Vec<_>>(),
        "truncated": report.truncated.iter().map(|(file, len)| json!({"file": file.display().to_string(), "length": len})).collect::<Vec<_>>(),
        "removed": report.removed.iter().map(|file| file.display().to_string()).collect::<Vec<_>>(),
        "last_index_kept": report.last_index_kept,
    })
}

fn human(report: &RepairReport, args: &RepairArgs) -> String {
    let dir = args.data_dir.display();
    if report.cuts.is_empty() {
        return format!(
            "the log in {dir} is intact up to index {}; nothing to repair",
            report.last_index_kept
        );
    }
    let mut text = String::new();
    for cut in &report.cuts {
        let entries = match cut.entries_lost {
            Some((first, last)) => format!("entries {first}..={last}"),
            None => "no intact entries".to_string(),
        };
        text.push_str(&format!(
            "damage in {} at offset {}: {}\n  cutting there loses {} record(s), {} bytes ({entries}, {} hard state(s))\n",
            cut.file.display(),
            cut.offset_bytes,
            cut.reason,
            cut.records_lost,
            cut.bytes_lost,
            cut.hard_states_lost,
        ));
    }
    let verb = if args.dry_run { "would be" } else { "was" };
    for (file, len) in &report.truncated {
        text.push_str(&format!("{} {verb} cut to {len} bytes\n", file.display()));
    }
    for file in &report.removed {
        let verb = if args.dry_run { "would be" } else { "was" };
        text.push_str(&format!("{} {verb} removed\n", file.display()));
    }
    if args.dry_run {
        text.push_str(&format!(
            "dry run: nothing changed; the log would end at index {}. Run without --dry-run to cut it.",
            report.last_index_kept
        ));
    } else {
        text.push_str(&format!(
            "the log now ends at index {}; start the node and it catches up from its peers",
            report.last_index_kept
        ));
    }
    text
}
