//! Checkers of recorded histories. Each returns its anomalies as sentences; none means the
//! history passed.

pub mod fence;
pub mod lease;
pub mod linearizable;
pub mod queue;
pub mod topic;
pub mod watch;

use std::collections::BTreeMap;

use crate::history::Op;

/// Linearizability of every key's register history; one sentence per key that fails.
pub fn register(ops: &[Op]) -> Vec<String> {
    let mut by_key: BTreeMap<&str, Vec<Op>> = BTreeMap::new();
    for op in ops {
        by_key.entry(op.key.as_str()).or_default().push(op.clone());
    }
    let mut anomalies = Vec::new();
    for (key, ops) in by_key {
        let entries = match linearizable::entries(&ops) {
            Ok(entries) => entries,
            Err(reason) => {
                anomalies.push(format!("register {key:?}: malformed history: {reason}"));
                continue;
            }
        };
        match linearizable::check(&entries) {
            linearizable::Verdict::Linearizable => {}
            linearizable::Verdict::NotLinearizable { stuck_at, placed } => {
                let op = &ops[stuck_at];
                anomalies.push(format!(
                    "nonlinearizable: key {key:?}: after {placed} operations no order fits process {}'s {} {} -> {} ({}..{} us)",
                    op.process, op.f, op.args, op.result, op.invoke_us, op.complete_us
                ));
            }
            linearizable::Verdict::Unknown { states } => anomalies.push(format!(
                "undecided: key {key:?}: the search gave up after {states} states"
            )),
        }
    }
    anomalies
}
