//! Checks of the topic workload: publishers append unique messages to topics, consumers read
//! their inboxes and acknowledge what they read.
//!
//! History operations:
//! - `publish` (key: topic): invoked with the message's data; ok with `{"seq": n}`;
//! - `inbox` (consumer process): ok with `[[topic, seq, data], ...]`;
//! - `ack` (key: topic): invoked with `{"seq": n}`;
//! - `drained`: ok once the consumer read an empty inbox twice after the run.
//!
//! Anomalies:
//! - `topic-seq`: two messages at one position of a topic, or one message at two positions
//!   (a publish applied twice);
//! - `topic-order`: a publish that began after another on the same topic had been acknowledged
//!   got a lower sequence number, or an inbox answer out of order within a topic;
//! - `topic-phantom`: a delivered message nobody published;
//! - `topic-duplicate`: a message delivered again after its acknowledgement had completed;
//! - `topic-lost`: an acknowledged publish that a drained consumer never received;
//! - `topic-undrained`: a consumer that did not drain its inbox in time (so loss cannot be
//!   judged: reported, never a silent pass).

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use crate::history::{Kind, Op};

/// Returns one sentence per anomaly.
pub fn check(ops: &[Op]) -> Vec<String> {
    let mut anomalies = Vec::new();
    // Every data ever published (acknowledged or not), by topic.
    let mut invoked: BTreeMap<(&str, &str), &Op> = BTreeMap::new();
    // Acknowledged publishes: topic -> seq -> data.
    let mut acked: BTreeMap<&str, BTreeMap<u64, &str>> = BTreeMap::new();
    let mut acked_ops: Vec<(&Op, u64)> = Vec::new();
    for op in ops.iter().filter(|op| op.f == "publish") {
        let Some(data) = op.args.as_str() else {
            anomalies.push(format!("malformed publish {:?}", op.args));
            continue;
        };
        invoked.insert((op.key.as_str(), data), op);
        if op.outcome != Kind::Ok {
            continue;
        }
        let Some(seq) = op.result.get("seq").and_then(Value::as_u64) else {
            anomalies.push(format!("malformed publish answer {:?}", op.result));
            continue;
        };
        if let Some(other) = acked.entry(&op.key).or_default().insert(seq, data) {
            anomalies.push(format!(
                "topic-seq: {:?} seq {seq} acknowledged for both {other:?} and {data:?}",
                op.key
            ));
        }
        acked_ops.push((op, seq));
    }
    for (topic, by_seq) in &acked {
        let mut seen: BTreeMap<&str, u64> = BTreeMap::new();
        for (seq, data) in by_seq {
            if let Some(first) = seen.insert(data, *seq) {
                anomalies.push(format!(
                    "topic-seq: {topic:?} message {data:?} published at seq {first} and {seq}"
                ));
            }
        }
    }
    // Real-time order of acknowledged publishes per topic (sorted by completion, so the scan
    // is linear: the highest seq completed before each invocation).
    let mut by_completion: Vec<&(&Op, u64)> = acked_ops.iter().collect();
    by_completion.sort_by_key(|(op, _)| op.complete_us);
    let mut by_invocation: Vec<&(&Op, u64)> = acked_ops.iter().collect();
    by_invocation.sort_by_key(|(op, _)| op.invoke_us);
    let mut highest: BTreeMap<&str, (u64, &Op)> = BTreeMap::new();
    let mut next = 0;
    for (op, seq) in by_invocation {
        while next < by_completion.len() && by_completion[next].0.complete_us < op.invoke_us {
            let (done, done_seq) = by_completion[next];
            let entry = highest.entry(&done.key).or_insert((*done_seq, done));
            if *done_seq > entry.0 {
                *entry = (*done_seq, done);
            }
            next += 1;
        }
        if let Some((before, other)) = highest.get(op.key.as_str())
            && seq <= before
        {
            anomalies.push(format!(
                "topic-order: {:?} publish of {} (invoked {} us) got seq {seq}, after process {}'s publish had seq {before}",
                op.key, op.args, op.invoke_us, other.process
            ));
        }
    }
    // Consumers.
    let mut consumers: BTreeSet<u64> = BTreeSet::new();
    let mut drained: BTreeSet<u64> = BTreeSet::new();
    let mut delivered: BTreeMap<(u64, &str), BTreeSet<u64>> = BTreeMap::new();
    // Completed acknowledgements per (consumer, topic): (completion time, position).
    let mut acks: BTreeMap<(u64, &str), Vec<(u64, u64)>> = BTreeMap::new();
    for op in ops {
        if op.f == "ack"
            && op.outcome == Kind::Ok
            && let Some(position) = op.args.get("seq").and_then(Value::as_u64)
        {
            acks.entry((op.process, op.key.as_str()))
                .or_default()
                .push((op.complete_us, position));
        }
        if op.f == "drained" && op.outcome == Kind::Ok {
            drained.insert(op.process);
        }
    }
    for list in acks.values_mut() {
        list.sort();
    }
    let acked_before = |process: u64, topic: &str, at_us: u64| -> u64 {
        acks.get(&(process, topic)).map_or(0, |list| {
            list.iter()
                .take_while(|(done, _)| *done < at_us)
                .map(|(_, position)| *position)
                .max()
                .unwrap_or(0)
        })
    };
    for op in ops.iter().filter(|op| op.f == "inbox") {
        consumers.insert(op.process);
        if op.outcome != Kind::Ok {
            continue;
        }
        let Some(messages) = op.result.as_array() else {
            anomalies.push(format!("malformed inbox answer {:?}", op.result));
            continue;
        };
        let mut last_in_answer: BTreeMap<&str, u64> = BTreeMap::new();
        for message in messages {
            let (Some(topic), Some(seq), Some(data)) = (
                message.get(0).and_then(Value::as_str),
                message.get(1).and_then(Value::as_u64),
                message.get(2).and_then(Value::as_str),
            ) else {
                anomalies.push(format!("malformed inbox message {message:?}"));
                continue;
            };
            if let Some(previous) = last_in_answer.insert(topic, seq)
                && seq <= previous
            {
                anomalies.push(format!(
                    "topic-order: process {} got {topic:?} seq {seq} after seq {previous} in one inbox answer ({} us)",
                    op.process, op.invoke_us
                ));
            }
            if !invoked.contains_key(&(topic, data)) {
                anomalies.push(format!(
                    "topic-phantom: process {} got {data:?} at {topic:?} seq {seq}, which nobody published",
                    op.process
                ));
            }
            if let Some(expected) = acked.get(topic).and_then(|m| m.get(&seq))
                && *expected != data
            {
                anomalies.push(format!(
                    "topic-seq: process {} got {data:?} at {topic:?} seq {seq}, acknowledged for {expected:?}",
                    op.process
                ));
            }
            let position = acked_before(op.process, topic, op.invoke_us);
            if seq <= position {
                anomalies.push(format!(
                    "topic-duplicate: process {} got {topic:?} seq {seq} at {} us after acknowledging up to {position}",
                    op.process, op.invoke_us
                ));
            }
            delivered
                .entry((op.process, topic))
                .or_default()
                .insert(seq);
        }
    }
    for consumer in &consumers {
        if !drained.contains(consumer) {
            anomalies.push(format!(
                "topic-undrained: consumer {consumer} did not drain its inbox after the run"
            ));
            continue;
        }
        for (topic, by_seq) in &acked {
            let got = delivered.get(&(*consumer, *topic));
            for (seq, data) in by_seq {
                if !got.is_some_and(|got| got.contains(seq)) {
                    anomalies.push(format!(
                        "topic-lost: consumer {consumer} never got {data:?}, acknowledged at {topic:?} seq {seq}"
                    ));
                }
            }
        }
    }
    anomalies
}
