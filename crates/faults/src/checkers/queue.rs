//! Checks of the queue workload: producers push unique jobs to one work queue, workers claim
//! them, record what they were given and acknowledge them with the claim's fence.
//!
//! History operations:
//! - `push`: invoked with the job's payload; ok with `{"id": n}`;
//! - `claim`: ok with `{"id": n, "payload": p, "fence": f}`, or null when no job was ready;
//! - `ack`: invoked with `{"id": n, "fence": f}`; ok when it was accepted, fail when the fence
//!   was refused;
//! - `drained`: ok once a worker found the queue empty for longer than a claim lasts, after
//!   the run.
//!
//! Anomalies:
//! - `queue-phantom`: a claim handed out a payload nobody pushed, or a job id that an
//!   acknowledged push gave another payload;
//! - `queue-id`: one acknowledged push's job id answered for two payloads;
//! - `queue-fence`: a claim whose fence is not above that of a claim of the same job that had
//!   completed before it was invoked (fences never go back);
//! - `queue-double-ack`: two accepted acks of one job (only the current claim's fence may ack);
//! - `queue-resurrected`: a job claimed by a claim invoked after an ack of it was accepted;
//! - `queue-lost`: an acknowledged push whose job no claim ever delivered, although a worker
//!   drained the queue;
//! - `queue-undrained`: no worker drained the queue in time (so loss cannot be judged:
//!   reported, never a silent pass).

use std::collections::BTreeMap;

use serde_json::Value;

use crate::history::{Kind, Op};

/// One delivered claim.
struct Claim<'a> {
    op: &'a Op,
    id: u64,
    fence: u64,
}

/// Returns one sentence per anomaly.
pub fn check(ops: &[Op]) -> Vec<String> {
    let mut anomalies = Vec::new();
    let mut invoked_payloads: BTreeMap<&str, &Op> = BTreeMap::new();
    // Acknowledged pushes: job id -> payload.
    let mut pushed: BTreeMap<u64, &str> = BTreeMap::new();
    for op in ops.iter().filter(|op| op.f == "push") {
        let Some(payload) = op.args.as_str() else {
            anomalies.push(format!("malformed push {:?}", op.args));
            continue;
        };
        invoked_payloads.insert(payload, op);
        if op.outcome != Kind::Ok {
            continue;
        }
        let Some(id) = op.result.get("id").and_then(Value::as_u64) else {
            anomalies.push(format!("malformed push answer {:?}", op.result));
            continue;
        };
        if let Some(other) = pushed.insert(id, payload) {
            anomalies.push(format!(
                "queue-id: job {id} acknowledged for both {other:?} and {payload:?}"
            ));
        }
    }

    let mut claims: Vec<Claim> = Vec::new();
    for op in ops
        .iter()
        .filter(|op| op.f == "claim" && op.outcome == Kind::Ok)
    {
        if op.result.is_null() {
            continue;
        }
        let (Some(id), Some(payload), Some(fence)) = (
            op.result.get("id").and_then(Value::as_u64),
            op.result.get("payload").and_then(Value::as_str),
            op.result.get("fence").and_then(Value::as_u64),
        ) else {
            anomalies.push(format!("malformed claim answer {:?}", op.result));
            continue;
        };
        if !invoked_payloads.contains_key(payload) {
            anomalies.push(format!(
                "queue-phantom: process {} was given job {id} with {payload:?}, which nobody pushed",
                op.process
            ));
        }
        if let Some(expected) = pushed.get(&id).filter(|expected| **expected != payload) {
            anomalies.push(format!(
                "queue-phantom: process {} was given job {id} with {payload:?}; its push was {expected:?}",
                op.process
            ));
        }
        claims.push(Claim { op, id, fence });
    }

    let mut by_job: BTreeMap<u64, Vec<&Claim>> = BTreeMap::new();
    for claim in &claims {
        by_job.entry(claim.id).or_default().push(claim);
    }
    for (id, job_claims) in &by_job {
        for later in job_claims {
            for earlier in job_claims {
                if earlier.op.complete_us < later.op.invoke_us && later.fence <= earlier.fence {
                    anomalies.push(format!(
                        "queue-fence: job {id}: process {}'s claim got fence {} after process {}'s claim had completed with fence {}",
                        later.op.process, later.fence, earlier.op.process, earlier.fence
                    ));
                }
            }
        }
    }

    // Accepted acks: job id -> the acks.
    let mut acks: BTreeMap<u64, Vec<&Op>> = BTreeMap::new();
    for op in ops
        .iter()
        .filter(|op| op.f == "ack" && op.outcome == Kind::Ok)
    {
        let Some(id) = op.args.get("id").and_then(Value::as_u64) else {
            anomalies.push(format!("malformed ack {:?}", op.args));
            continue;
        };
        acks.entry(id).or_default().push(op);
    }
    for (id, job_acks) in &acks {
        if job_acks.len() > 1 {
            let fences: Vec<String> = job_acks
                .iter()
                .map(|op| op.args["fence"].to_string())
                .collect();
            anomalies.push(format!(
                "queue-double-ack: job {id} was acknowledged {} times (fences {})",
                job_acks.len(),
                fences.join(", ")
            ));
        }
        let first_done = job_acks
            .iter()
            .map(|op| op.complete_us)
            .min()
            .unwrap_or(u64::MAX);
        for claim in by_job.get(id).into_iter().flatten() {
            if claim.op.invoke_us > first_done {
                anomalies.push(format!(
                    "queue-resurrected: process {} claimed job {id} (fence {}) after an ack of it had been accepted",
                    claim.op.process, claim.fence
                ));
            }
        }
    }

    let drained = ops
        .iter()
        .any(|op| op.f == "drained" && op.outcome == Kind::Ok);
    if !drained {
        anomalies.push(
            "queue-undrained: no worker drained the queue after the run, so lost jobs cannot be judged"
                .to_string(),
        );
    } else {
        for (id, payload) in &pushed {
            if !by_job.contains_key(id) {
                anomalies.push(format!(
                    "queue-lost: job {id} ({payload:?}) was pushed and acknowledged, and no claim ever delivered it"
                ));
            }
        }
    }
    anomalies
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::check;
    use crate::history::{Kind, Op};

    fn op(process: u64, f: &str, args: Value, outcome: Kind, result: Value, at: (u64, u64)) -> Op {
        Op {
            process,
            f: f.to_string(),
            key: crate::workloads::QUEUE.to_string(),
            args,
            outcome,
            result,
            invoke_us: at.0,
            complete_us: at.1,
        }
    }

    fn push(id: u64, payload: &str, at: u64) -> Op {
        op(
            1,
            "push",
            json!(payload),
            Kind::Ok,
            json!({"id": id}),
            (at, at + 1),
        )
    }

    fn claim(process: u64, id: u64, payload: &str, fence: u64, at: u64) -> Op {
        let result = json!({"id": id, "payload": payload, "fence": fence});
        op(
            process,
            "claim",
            Value::Null,
            Kind::Ok,
            result,
            (at, at + 1),
        )
    }

    fn ack(process: u64, id: u64, fence: u64, outcome: Kind, at: u64) -> Op {
        let args = json!({"id": id, "fence": fence});
        op(process, "ack", args, outcome, Value::Null, (at, at + 1))
    }

    fn drained(at: u64) -> Op {
        op(
            2,
            "drained",
            Value::Null,
            Kind::Ok,
            Value::Null,
            (at, at + 1),
        )
    }

    #[test]
    fn a_clean_history_with_a_refused_late_ack_passes() {
        let ops = vec![
            push(1, "p1-1", 0),
            push(2, "p1-2", 10),
            claim(2, 1, "p1-1", 1, 20),
            // Process 2 dawdled; process 3 claimed the job again and acked it.
            claim(3, 1, "p1-1", 2, 40),
            ack(3, 1, 2, Kind::Ok, 50),
            ack(2, 1, 1, Kind::Fail, 60),
            claim(3, 2, "p1-2", 3, 70),
            ack(3, 2, 3, Kind::Ok, 80),
            drained(100),
        ];
        assert_eq!(check(&ops), Vec::<String>::new());
    }

    #[test]
    fn each_anomaly_is_named() {
        let cases: Vec<(&str, Vec<crate::history::Op>)> = vec![
            ("queue-lost", vec![push(1, "p1-1", 0), drained(10)]),
            (
                "queue-undrained",
                vec![push(1, "p1-1", 0), claim(2, 1, "p1-1", 1, 5)],
            ),
            (
                "queue-phantom",
                vec![claim(2, 9, "nobody", 1, 5), drained(10)],
            ),
            (
                "queue-double-ack",
                vec![
                    push(1, "p1-1", 0),
                    claim(2, 1, "p1-1", 1, 5),
                    ack(2, 1, 1, Kind::Ok, 10),
                    ack(3, 1, 1, Kind::Ok, 20),
                    drained(30),
                ],
            ),
            (
                "queue-resurrected",
                vec![
                    push(1, "p1-1", 0),
                    claim(2, 1, "p1-1", 1, 5),
                    ack(2, 1, 1, Kind::Ok, 10),
                    claim(3, 1, "p1-1", 2, 20),
                    drained(30),
                ],
            ),
            (
                "queue-fence",
                vec![
                    push(1, "p1-1", 0),
                    claim(2, 1, "p1-1", 5, 5),
                    claim(3, 1, "p1-1", 4, 20),
                    drained(30),
                ],
            ),
        ];
        for (name, ops) in cases {
            let found = check(&ops);
            assert!(
                found.iter().any(|a| a.starts_with(name)),
                "{name} not reported: {found:?}"
            );
        }
    }
}
