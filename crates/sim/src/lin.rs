//! A linearizability check for one register (one key): a Wing & Gong style search over the
//! operations' real-time order, with the explored (linearized set, value) pairs remembered.
//! Histories are per key and kept small by the workload, so the search stays cheap.

use std::collections::HashSet;

/// Operations a single history holds at most (the linearized set is a bit mask).
pub const HISTORY_OPS_MAX: usize = 64;

/// What an operation did. Values are the workload's unique ids; 0 is "no value".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegisterOp {
    /// Wrote a value.
    Put(u64),
    /// Read a value (0: the key was absent).
    Get(u64),
}

/// One operation with its invocation and response times. `returned_ms == None`: no answer
/// came (a timeout, a crash, an ambiguous error), so it may have taken effect at any time
/// after its call, or never.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timed {
    pub op: RegisterOp,
    pub called_ms: u64,
    pub returned_ms: Option<u64>,
}

/// Whether `history` (in any order) is linearizable for a register that starts absent.
/// Reads without an answer are ignored (they have no effect).
pub fn linearizable(history: &[Timed]) -> bool {
    let ops: Vec<Timed> = history
        .iter()
        .copied()
        .filter(|t| t.returned_ms.is_some() || matches!(t.op, RegisterOp::Put(_)))
        .collect();
    assert!(
        ops.len() <= HISTORY_OPS_MAX,
        "a register history of {} operations is beyond the checker's {HISTORY_OPS_MAX}",
        ops.len()
    );
    let must: u64 = ops
        .iter()
        .enumerate()
        .filter(|(_, t)| t.returned_ms.is_some())
        .fold(0, |mask, (i, _)| mask | (1 << i));
    let mut seen = HashSet::new();
    search(&ops, must, 0, 0, &mut seen)
}

fn search(ops: &[Timed], must: u64, done: u64, value: u64, seen: &mut HashSet<(u64, u64)>) -> bool {
    if done & must == must {
        return true;
    }
    if !seen.insert((done, value)) {
        return false;
    }
    // An operation may go next only if no pending operation returned before it was called.
    let earliest_return = ops
        .iter()
        .enumerate()
        .filter(|(i, _)| done & (1 << i) == 0)
        .filter_map(|(_, t)| t.returned_ms)
        .min()
        .unwrap_or(u64::MAX);
    for (i, t) in ops.iter().enumerate() {
        if done & (1 << i) != 0 || t.called_ms > earliest_return {
            continue;
        }
        let next = match t.op {
            RegisterOp::Put(v) => v,
            RegisterOp::Get(v) if v == value => value,
            RegisterOp::Get(_) => continue,
        };
        if search(ops, must, done | (1 << i), next, seen) {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(op: RegisterOp, called_ms: u64, returned_ms: Option<u64>) -> Timed {
        Timed {
            op,
            called_ms,
            returned_ms,
        }
    }

    #[test]
    fn sequential_and_overlapping_histories_pass() {
        use RegisterOp::*;
        assert!(linearizable(&[
            op(Put(1), 0, Some(10)),
            op(Get(1), 11, Some(20)),
            op(Put(2), 21, Some(30)),
            op(Get(2), 31, Some(40)),
        ]));
        // A read overlapping a write may see either value.
        assert!(linearizable(&[
            op(Put(1), 0, Some(10)),
            op(Put(2), 11, Some(30)),
            op(Get(1), 12, Some(20)),
        ]));
        // A write without an answer may have happened, or not.
        assert!(linearizable(&[
            op(Put(1), 0, None),
            op(Get(0), 5, Some(6)),
            op(Get(1), 7, Some(8)),
        ]));
    }

    #[test]
    fn a_stale_read_or_a_lost_acknowledged_write_fails() {
        use RegisterOp::*;
        // Read the old value after the new one was acknowledged.
        assert!(!linearizable(&[
            op(Put(1), 0, Some(10)),
            op(Put(2), 11, Some(20)),
            op(Get(1), 21, Some(30)),
        ]));
        // An acknowledged write that no later read sees.
        assert!(!linearizable(&[
            op(Put(1), 0, Some(10)),
            op(Get(0), 11, Some(20)),
        ]));
        // A value no one wrote.
        assert!(!linearizable(&[op(Get(7), 0, Some(1))]));
        // Values cannot flip back and forth.
        assert!(!linearizable(&[
            op(Put(1), 0, None),
            op(Put(2), 0, None),
            op(Get(1), 10, Some(11)),
            op(Get(2), 12, Some(13)),
            op(Get(1), 14, Some(15)),
        ]));
    }
}
