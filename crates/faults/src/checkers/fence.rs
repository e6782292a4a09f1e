//! Checks of the fenced-resource workloads (locks and priority elections).
//!
//! History operations, per holder process:
//! - `acquire`: ok with `{"fence": f}` once the lock or seat is held;
//! - `resource`: a write at the resource with `{"fence": f, "within_deadline": b}`; ok when the
//!   resource accepted it, fail when it refused a stale fence.
//!
//! Anomalies:
//! - `fence-reused`: two acquisitions got the same fence;
//! - `fence-order`: an acquisition that began after another had completed got a lower fence;
//! - `exclusion`: the resource refused a holder whose lease was still valid by the client's
//!   conservative local deadline, so someone else held the lock while it did. Under the skew
//!   nemesis a member whose clock ran slow may have stamped the lease's deadline early by its
//!   lag (the lease checker's finding 8): a refusal that came no earlier than that lag before
//!   the holder's deadline (`deadline_left_us`), with the slow clock running within a TTL
//!   before it, is allowed; any other is not;
//! - `interleaved`: the resource accepted a write of an older tenure after one of a newer
//!   tenure — two holders acting at once. A fenced resource cannot let this happen; an unfenced
//!   one (the negative control) does when a paused holder wakes up.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::checkers::lease::SlowClock;
use crate::history::{Kind, Op};

fn fence_of(value: &Value) -> Option<u64> {
    value.get("fence").and_then(Value::as_u64)
}

/// Returns one sentence per anomaly.
pub fn check(ops: &[Op]) -> Vec<String> {
    check_with_slow_clocks(ops, &[], 0)
}

/// [`check`], allowing a refusal within the holder's deadline by no more than the lag of a
/// member's slow clock that ran within `ttl_us` before it (see the module's `exclusion`).
pub fn check_with_slow_clocks(ops: &[Op], slow_clocks: &[SlowClock], ttl_us: u64) -> Vec<String> {
    let mut anomalies = Vec::new();
    let acquires: Vec<(&Op, u64)> = ops
        .iter()
        .filter(|op| op.f == "acquire" && op.outcome == Kind::Ok)
        .filter_map(|op| fence_of(&op.result).map(|f| (op, f)))
        .collect();
    let mut by_fence: BTreeMap<u64, &Op> = BTreeMap::new();
    for (op, fence) in &acquires {
        if let Some(other) = by_fence.insert(*fence, op) {
            anomalies.push(format!(
                "fence-reused: fence {fence} given to process {} at {} us and to process {} at {} us",
                other.process, other.complete_us, op.process, op.complete_us
            ));
        }
    }
    for (a, fa) in &acquires {
        for (b, fb) in &acquires {
            if a.complete_us < b.invoke_us && fb <= fa {
                anomalies.push(format!(
                    "fence-order: process {} acquired fence {fb} (invoked {} us) after process {} had fence {fa} (acquired {} us)",
                    b.process, b.invoke_us, a.process, a.complete_us
                ));
            }
        }
    }
    let mut writes: Vec<&Op> = ops.iter().filter(|op| op.f == "resource").collect();
    writes.sort_by_key(|op| op.complete_us);
    let mut highest: Option<(u64, u64)> = None;
    for op in writes {
        let Some(fence) = fence_of(&op.args) else {
            anomalies.push(format!("malformed resource write {:?}", op.args));
            continue;
        };
        let within = op
            .args
            .get("within_deadline")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let slow_clock_lag_us = slow_clocks
            .iter()
            .filter(|clock| clock.end_us.saturating_add(ttl_us) >= op.invoke_us)
            .map(|clock| clock.lag_us(op.complete_us))
            .max()
            .unwrap_or(0);
        let stamped_early = op
            .args
            .get("deadline_left_us")
            .and_then(Value::as_u64)
            .is_some_and(|left_us| left_us <= slow_clock_lag_us);
        match op.outcome {
            Kind::Fail if within && !stamped_early => anomalies.push(format!(
                "exclusion: the resource refused process {}'s fence {fence} at {} us while its lease was still valid",
                op.process, op.complete_us
            )),
            Kind::Ok => {
                if let Some((newest, process)) = highest
                    && fence < newest
                {
                    anomalies.push(format!(
                        "interleaved: the resource accepted process {}'s fence {fence} at {} us after process {process}'s newer fence {newest}",
                        op.process, op.complete_us
                    ));
                }
                if highest.is_none_or(|(newest, _)| fence > newest) {
                    highest = Some((fence, op.process));
                }
            }
            _ => {}
        }
    }
    anomalies
}
