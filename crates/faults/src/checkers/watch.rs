//! Watches. Each watcher process records the events it was delivered (`event`, ok, with
//! `{"rev", "key", "value"}`) over a range of revisions it covered (`cover`, ok, with
//! `{"from", "to"}`: it watched from `from` and had seen everything up to `to` when it stopped).
//! The writes are the register workload's: `write` and `cas` with `{"rev": r}` in their ok
//! results and unique values.
//!
//! Anomalies: `watch-order` (a revision not above the previous one: out of order or
//! duplicated), `watch-missing` (an acknowledged write in the covered range never delivered),
//! `watch-phantom` (an event no write could have produced: unknown value, or a different key or
//! revision than the acknowledged write of that value).

use std::collections::{BTreeMap, HashMap};

use serde_json::Value;

use crate::history::{Kind, Op};

struct Written {
    key: String,
    rev: Option<i64>,
}

pub fn check(watch_ops: &[Op], register_ops: &[Op]) -> Vec<String> {
    let mut anomalies = Vec::new();
    // Every value ever sent by a write, with the revision it got when acknowledged.
    let mut written: HashMap<i64, Written> = HashMap::new();
    let mut acked: BTreeMap<i64, (String, i64)> = BTreeMap::new();
    for op in register_ops {
        let value = match op.f.as_str() {
            "write" => op.args.as_i64(),
            "cas" => op.args.get(1).and_then(Value::as_i64),
            _ => None,
        };
        let Some(value) = value else { continue };
        if op.outcome == Kind::Fail {
            continue;
        }
        let rev = (op.outcome == Kind::Ok)
            .then(|| op.result.get("rev").and_then(Value::as_i64))
            .flatten();
        let succeeded =
            op.f == "write" || op.result.get("succeeded").and_then(Value::as_bool) != Some(false);
        if !succeeded {
            continue;
        }
        written.insert(
            value,
            Written {
                key: op.key.clone(),
                rev,
            },
        );
        if let Some(rev) = rev {
            acked.insert(rev, (op.key.clone(), value));
        }
    }
    let mut by_process: BTreeMap<u64, Vec<&Op>> = BTreeMap::new();
    for op in watch_ops {
        by_process.entry(op.process).or_default().push(op);
    }
    for (process, ops) in by_process {
        let mut last_rev = 0i64;
        let mut delivered: BTreeMap<i64, i64> = BTreeMap::new();
        for op in ops
            .iter()
            .filter(|op| op.f == "event" && op.outcome == Kind::Ok)
        {
            let rev = op.result.get("rev").and_then(Value::as_i64).unwrap_or(-1);
            let value = op.result.get("value").and_then(Value::as_i64);
            let key = op.result.get("key").and_then(Value::as_str).unwrap_or("");
            if rev <= last_rev {
                anomalies.push(format!(
                    "watch-order: watcher {process} got revision {rev} after {last_rev}"
                ));
            }
            last_rev = last_rev.max(rev);
            match value.and_then(|v| written.get(&v).map(|w| (v, w))) {
                None => anomalies.push(format!(
                    "watch-phantom: watcher {process} got {value:?} at revision {rev}, which no write sent"
                )),
                Some((v, w)) => {
                    if w.key != key || w.rev.is_some_and(|r| r != rev) {
                        anomalies.push(format!(
                            "watch-phantom: watcher {process} got value {v} on {key:?} at revision {rev}; it was written to {:?} at {:?}",
                            w.key, w.rev
                        ));
                    }
                    delivered.insert(rev, v);
                }
            }
        }
        for cover in ops
            .iter()
            .filter(|op| op.f == "cover" && op.outcome == Kind::Ok)
        {
            let from = cover
                .result
                .get("from")
                .and_then(Value::as_i64)
                .unwrap_or(i64::MAX);
            let to = cover.result.get("to").and_then(Value::as_i64).unwrap_or(0);
            for (rev, (key, value)) in acked.range(from..=to) {
                if delivered.get(rev) != Some(value) {
                    anomalies.push(format!(
                        "watch-missing: watcher {process} never got the write of {value} to {key:?} at revision {rev}"
                    ));
                }
            }
        }
    }
    anomalies
}
