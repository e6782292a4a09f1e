//! Linearizability of one register (read / write / compare-and-set), checked with the
//! Wing–Gong–Lowe search: repeatedly pick an operation that may go next in real time (no other
//! pending operation completed before it was invoked), apply it to the model, and backtrack when
//! the model refuses; states already seen (the set of linearized operations plus the register's
//! value) are remembered so each is explored once.
//!
//! `ok` operations must all be placed; `info` writes and CASes may be placed anywhere after their
//! invocation or left out; `fail` operations and `info` reads are dropped.

use std::collections::HashSet;

use serde_json::Value;

use crate::history::{Kind, Op};

/// The register's model: `None` is a key that was never written.
pub type Register = Option<i64>;

/// One register operation, decoded from the history.
#[derive(Debug, Clone, PartialEq)]
pub enum RegOp {
    /// A read that returned this value.
    Read(Register),
    Write(i64),
    /// Compare-and-set `from` → `to`; `Some(succeeded)` when known.
    Cas {
        from: i64,
        to: i64,
        succeeded: Option<bool>,
    },
}

/// An operation in the search: its effect and its real-time interval.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub op: RegOp,
    pub invoke_us: u64,
    /// `u64::MAX` when the outcome is unknown.
    pub complete_us: u64,
    pub required: bool,
    /// Index of the history operation, for reports.
    pub index: usize,
}

/// Applies `op` to `value`; `None` when the model cannot produce the recorded result.
pub fn step(value: Register, op: &RegOp) -> Option<Register> {
    match *op {
        RegOp::Read(seen) => (seen == value).then_some(value),
        RegOp::Write(v) => Some(Some(v)),
        RegOp::Cas {
            from,
            to,
            succeeded,
        } => {
            let matches = value == Some(from);
            match succeeded {
                Some(true) => matches.then_some(Some(to)),
                Some(false) => (!matches).then_some(value),
                // Unknown outcome: placing it means it took effect, which needs a match.
                None => matches.then_some(Some(to)),
            }
        }
    }
}

fn as_register(value: &Value) -> Result<Register, String> {
    match value {
        Value::Null => Ok(None),
        other => other
            .as_i64()
            .map(Some)
            .ok_or_else(|| format!("register value {other} is not an integer")),
    }
}

/// Turns a key's paired operations into search entries.
pub fn entries(ops: &[Op]) -> Result<Vec<Entry>, String> {
    let mut out = Vec::new();
    for (index, op) in ops.iter().enumerate() {
        if op.outcome == Kind::Fail || op.outcome == Kind::Invoke {
            continue;
        }
        let known = op.outcome == Kind::Ok;
        let reg_op = match op.f.as_str() {
            "read" => {
                if !known {
                    continue;
                }
                RegOp::Read(as_register(&op.result)?)
            }
            "write" => RegOp::Write(
                as_register(&op.args)?.ok_or_else(|| "a write needs a value".to_string())?,
            ),
            "cas" => {
                let pair = op
                    .args
                    .as_array()
                    .filter(|a| a.len() == 2)
                    .ok_or_else(|| format!("cas arguments {} are not [from, to]", op.args))?;
                let from = as_register(&pair[0])?.ok_or("cas needs a from value")?;
                let to = as_register(&pair[1])?.ok_or("cas needs a to value")?;
                let succeeded = if known {
                    Some(
                        op.result
                            .get("succeeded")
                            .and_then(Value::as_bool)
                            .ok_or_else(|| format!("cas result {} has no succeeded", op.result))?,
                    )
                } else {
                    None
                };
                RegOp::Cas {
                    from,
                    to,
                    succeeded,
                }
            }
            other => return Err(format!("unknown register operation {other:?}")),
        };
        out.push(Entry {
            op: reg_op,
            invoke_us: op.invoke_us,
            complete_us: if known { op.complete_us } else { u64::MAX },
            required: known,
            index,
        });
    }
    out.sort_by_key(|e| e.invoke_us);
    Ok(out)
}

/// What the search concluded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Linearizable,
    /// No order exists; the index (into the history operations) of an operation that could not
    /// be placed after the longest linearizable prefix found.
    NotLinearizable {
        stuck_at: usize,
        placed: usize,
    },
    /// The search gave up after `states` states.
    Unknown {
        states: usize,
    },
}

/// States explored before the search gives up (and says so rather than guessing).
pub const SEARCH_STATES_MAX: usize = 2_000_000;

struct Frame {
    linearized: Vec<u64>,
    first_open: usize,
    placed: usize,
    value: Register,
    candidates: Vec<usize>,
    next: usize,
}

fn is_set(bits: &[u64], i: usize) -> bool {
    bits[i / 64] & (1 << (i % 64)) != 0
}

fn candidates(entries: &[Entry], linearized: &[u64], first_open: usize) -> Vec<usize> {
    // Entries are sorted by invocation: once one is invoked after the earliest completion
    // among the open ones seen so far, no later one can go next (and none of them can
    // complete earlier than it was invoked), so the scan stops there.
    let mut min_complete = u64::MAX;
    let mut out = Vec::new();
    for (i, e) in entries.iter().enumerate().skip(first_open) {
        if e.invoke_us > min_complete {
            break;
        }
        if !is_set(linearized, i) {
            min_complete = min_complete.min(e.complete_us);
        }
    }
    for (i, e) in entries.iter().enumerate().skip(first_open) {
        if e.invoke_us > min_complete {
            break;
        }
        if !is_set(linearized, i) {
            out.push(i);
        }
    }
    out
}

fn first_open(linearized: &[u64], from: usize, len: usize) -> usize {
    (from..len).find(|&i| !is_set(linearized, i)).unwrap_or(len)
}

/// The Wing–Gong–Lowe search with memoization over (linearized set, value).
pub fn check(entries: &[Entry]) -> Verdict {
    let words = entries.len().div_ceil(64).max(1);
    let required_total = entries.iter().filter(|e| e.required).count();
    let mut seen: HashSet<(Vec<u64>, Register)> = HashSet::new();
    let root = vec![0u64; words];
    let mut stack = vec![Frame {
        candidates: candidates(entries, &root, 0),
        linearized: root,
        first_open: 0,
        placed: 0,
        value: None,
        next: 0,
    }];
    let mut best_placed = 0usize;
    let mut best_bits = vec![0u64; words];
    while let Some(frame) = stack.last_mut() {
        if frame.next >= frame.candidates.len() {
            stack.pop();
            continue;
        }
        let i = frame.candidates[frame.next];
        frame.next += 1;
        let Some(value) = step(frame.value, &entries[i].op) else {
            continue;
        };
        let mut linearized = frame.linearized.clone();
        linearized[i / 64] |= 1 << (i % 64);
        if !seen.insert((linearized.clone(), value)) {
            continue;
        }
        if seen.len() > SEARCH_STATES_MAX {
            return Verdict::Unknown { states: seen.len() };
        }
        let placed = frame.placed + usize::from(entries[i].required);
        let open = first_open(&linearized, frame.first_open, entries.len());
        if placed == required_total {
            return Verdict::Linearizable;
        }
        if placed > best_placed {
            best_placed = placed;
            best_bits = linearized.clone();
        }
        stack.push(Frame {
            candidates: candidates(entries, &linearized, open),
            linearized,
            first_open: open,
            placed,
            value,
            next: 0,
        });
    }
    if required_total == 0 {
        return Verdict::Linearizable;
    }
    // Report the required operation the best prefix could not get past: the unplaced one that
    // completed first.
    let stuck = entries
        .iter()
        .enumerate()
        .filter(|(j, e)| e.required && !is_set(&best_bits, *j))
        .min_by_key(|(_, e)| e.complete_us)
        .map(|(_, e)| e.index)
        .unwrap_or(0);
    Verdict::NotLinearizable {
        stuck_at: stuck,
        placed: best_placed,
    }
}

/// Exhaustive check for small histories: tries every subset of the optional operations in
/// every order that respects real time. Used to validate [`check`].
pub fn brute_force(entries: &[Entry]) -> bool {
    fn go(entries: &[Entry], used: &mut Vec<bool>, value: Register) -> bool {
        let all_required = entries
            .iter()
            .zip(used.iter())
            .all(|(e, u)| !e.required || *u);
        if all_required {
            return true;
        }
        for i in 0..entries.len() {
            if used[i] {
                continue;
            }
            // `i` may go next only if no pending operation finished before `i` began.
            let blocked = entries
                .iter()
                .enumerate()
                .any(|(j, other)| j != i && !used[j] && other.complete_us < entries[i].invoke_us);
            if blocked {
                continue;
            }
            if let Some(next) = step(value, &entries[i].op) {
                used[i] = true;
                if go(entries, used, next) {
                    return true;
                }
                used[i] = false;
            }
        }
        false
    }
    go(entries, &mut vec![false; entries.len()], None)
}
