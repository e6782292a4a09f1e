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

/// A member whose wall clock ran slower than real time (the skew nemesis's rates below 1),
/// from its restart at `start_us` until it was restarted at the real rate at `end_us`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SlowClock {
    pub start_us: u64,
    pub end_us: u64,
    pub rate: f64,
}

/// Time between the spawn of a skewed member and the nemesis's record of the fault, during
/// which its clock may already run slow (the record follows the restart).
const SLOW_CLOCK_START_MARGIN_US: u64 = 200_000;

impl SlowClock {
    /// How far behind real time this clock can be at `at_us` (0 outside its window).
    pub fn lag_us(&self, at_us: u64) -> u64 {
        let start_us = self.start_us.saturating_sub(SLOW_CLOCK_START_MARGIN_US);
        if at_us < start_us {
            return 0;
        }
        let running_us = at_us.min(self.end_us).saturating_sub(start_us);
        (running_us as f64 * (1.0 - self.rate).max(0.0)) as u64
    }

    /// The slow clocks of a run's `faults` history: skew faults whose description ends in
    /// "at rate R" with R below 1 (as `nemesis` records them).
    pub fn from_faults(faults: &[Op]) -> Vec<SlowClock> {
        faults
            .iter()
            .filter(|op| op.args == "skew")
            .filter_map(|op| {
                let rate = op
                    .key
                    .rsplit("at rate ")
                    .next()?
                    .trim()
                    .parse::<f64>()
                    .ok()?;
                (rate < 1.0).then_some(SlowClock {
                    start_us: op.invoke_us,
                    end_us: op.complete_us,
                    rate,
                })
            })
            .collect()
    }
}

/// `faults`: intervals `[start, end)` in microseconds during which a fault was active.
pub fn check(ops: &[Op], bounds: LeaseBounds, faults: &[(u64, u64)]) -> Vec<String> {
    check_with_slow_clocks(ops, bounds, faults, &[])
}

/// [`check`], allowing for members whose clocks ran slow. Leader clocks must agree to within
/// the election timeout (docs/state.md); a slow clock breaks that on purpose: a deadline its
/// member stamped while leading is early in real time by the clock's lag, and a member with a
/// true clock that leads next ends the lease that much early. A lease's expiry may therefore
/// come early by the largest lag a slow clock had while the lease's deadline could have been
/// stamped (from its last acknowledged renewal to when it was seen gone), and by no more.
pub fn check_with_slow_clocks(
    ops: &[Op],
    bounds: LeaseBounds,
    faults: &[(u64, u64)],
    slow_clocks: &[SlowClock],
) -> Vec<String> {
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
            let lag_us = |sent: u64| {
                slow_clocks
                    .iter()
                    .filter(|c| c.end_us >= sent)
                    .map(|c| c.lag_us(seen_gone.complete_us))
                    .max()
                    .unwrap_or(0)
            };
            if let Some(sent) = last_send
                && seen_gone.complete_us < (sent + ttl_us).saturating_sub(drift_us + lag_us(sent))
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
