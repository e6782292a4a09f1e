//! Lease timing. A lease must never end before TTL after the send time of its last
//! acknowledged grant or keepalive (the server measures from when it processed it, which is
//! later), and once keepalives stop it must be gone within TTL + election timeout + slack after
//! the last acknowledgement, plus any time faults were active in between (a cluster without a
//! leader cannot expire anything).
//!
//! History operations, key = lease id:
//! - `grant` (args `{"ttl_ms": t}`) and `keepalive`: ok when acknowledged, fail with
//!   `"gone"` when the server answered that the lease no longer exists;
//! - `probe`: a linearizable read of the lease's key, ok with `true` (present) or `false` (gone);
//! - `stop`: keepalives end here on purpose (ok, no value).

use std::collections::BTreeMap;

use serde_json::Value;

use crate::history::{Kind, Op};

/// Time-outs and bounds of the lease checker.
#[derive(Debug, Clone, Copy)]
pub struct LeaseBounds {
    pub election_timeout_us: u64,
    /// Scheduling and delivery slack on a shared machine.
    pub slack_us: u64,
    /// How much faster than real time a leader's clock may run (parts per million of the
    /// TTL): 0 unless the skew nemesis runs, then the clients' allowance.
    pub clock_drift_ppm: u64,
}

/// `faults`: intervals `[start, end)` in microseconds during which a fault was active.
pub fn check(ops: &[Op], bounds: LeaseBounds, faults: &[(u64, u64)]) -> Vec<String> {
    let mut anomalies = Vec::new();
    let mut by_lease: BTreeMap<&str, Vec<&Op>> = BTreeMap::new();
    for op in ops {
        by_lease.entry(op.key.as_str()).or_default().push(op);
    }
    for (lease, ops) in by_lease {
        let Some(ttl_us) = ops
            .iter()
            .find(|op| op.f == "grant")
            .and_then(|op| op.args.get("ttl_ms"))
            .and_then(Value::as_u64)
            .map(|ms| ms * 1000)
        else {
            continue;
        };
        let renewals: Vec<&&Op> = ops
            .iter()
            .filter(|op| (op.f == "grant" || op.f == "keepalive") && op.outcome == Kind::Ok)
            .collect();
        let gone = |op: &&&Op| match op.f.as_str() {
            "probe" => op.outcome == Kind::Ok && op.result == Value::Bool(false),
            "keepalive" => op.outcome == Kind::Fail && op.result == "gone",
            _ => false,
        };
        // Never before TTL.
        for seen_gone in ops.iter().filter(|op| gone(op)) {
            let last_send = renewals
                .iter()
                .filter(|r| r.invoke_us < seen_gone.complete_us)
                .map(|r| r.invoke_us)
                .max();
            let drift_us = ttl_us * bounds.clock_drift_ppm / 1_000_000;
            if let Some(sent) = last_send
                && seen_gone.complete_us < sent + ttl_us - drift_us
            {
                anomalies.push(format!(
                    "early-expiry: lease {lease} was gone {:.3} s after the send of its last acknowledged keepalive, before its TTL of {:.3} s",
                    (seen_gone.complete_us - sent) as f64 / 1e6,
                    ttl_us as f64 / 1e6
                ));
            }
        }
        // Not long after TTL once keepalives stopped.
        let Some(stop) = ops.iter().find(|op| op.f == "stop") else {
            continue;
        };
        let Some(last_ack) = renewals
            .iter()
            .filter(|r| r.invoke_us <= stop.invoke_us)
            .map(|r| r.complete_us)
            .max()
        else {
            continue;
        };
        let last_present = ops
            .iter()
            .filter(|op| {
                op.f == "probe" && op.outcome == Kind::Ok && op.result == Value::Bool(true)
            })
            .map(|op| op.invoke_us)
            .max();
        if let Some(present_at) = last_present {
            let fault_us: u64 = faults
                .iter()
                .map(|(s, e)| (*e).min(present_at).saturating_sub((*s).max(last_ack)))
                .sum();
            let limit = last_ack + ttl_us + bounds.election_timeout_us + bounds.slack_us + fault_us;
            if present_at > limit {
                anomalies.push(format!(
                    "late-expiry: lease {lease} was still present {:.3} s after its last acknowledged keepalive (TTL {:.3} s, {:.3} s of faults in between)",
                    (present_at - last_ack) as f64 / 1e6,
                    ttl_us as f64 / 1e6,
                    fault_us as f64 / 1e6
                ));
            }
        }
    }
    anomalies
}
