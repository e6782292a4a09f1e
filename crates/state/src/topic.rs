//! Topics: ordered event logs with durable consumer cursors.
//!
//! ```text
//!   publish(topic, data) ──► seq = last + 1 (dense from 1), tagged with the store revision
//!   read(topic, from_seq, limit) / inbox(consumer, topics) ◄── retained messages
//!   ack(consumer, topic, seq) ──► cursor = max(cursor, seq)
//!   retention: count and age (leader-clock timestamps), applied on publish and on Tick
//! ```

use std::collections::{BTreeMap, VecDeque};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// A published message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// The topic.
    pub topic: String,
    /// Per-topic sequence number, dense from 1.
    pub seq: u64,
    /// The store revision of the publish.
    pub revision: i64,
    /// Leader-clock time of the publish.
    pub time_ms: u64,
    /// The payload.
    pub data: Bytes,
}

/// How much of a topic is kept. `None` means unbounded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Retention {
    /// Keep at most this many messages (the newest).
    pub max_messages: Option<u64>,
    /// Drop messages older than this (by leader-clock publish time).
    pub max_age_ms: Option<u64>,
}

/// A read of a topic.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopicRead {
    /// The topic.
    pub topic: String,
    /// Messages in sequence order.
    pub messages: Vec<Message>,
    /// Oldest retained seq (`last_seq + 1` when none is retained). A reader that asked for
    /// less than this missed messages to retention.
    pub first_seq: u64,
    /// Newest published seq (0 before the first publish).
    pub last_seq: u64,
    /// The cursor of the consumer, for inbox reads (0 otherwise).
    pub acked_seq: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Topic {
    last_seq: u64,
    retention: Retention,
    /// Invariant: seqs are consecutive and end at `last_seq`.
    messages: VecDeque<Message>,
}

impl Topic {
    fn first_seq(&self) -> u64 {
        self.messages
            .front()
            .map_or(self.last_seq + 1, |message| message.seq)
    }

    fn enforce_retention(&mut self, now_ms: u64, messages_max: u64) {
        let max_messages = self
            .retention
            .max_messages
            .unwrap_or(u64::MAX)
            .min(messages_max);
        let max_messages = usize::try_from(max_messages).unwrap_or(usize::MAX);
        while self.messages.len() > max_messages {
            self.messages.pop_front();
        }
        if let Some(max_age_ms) = self.retention.max_age_ms {
            while self
                .messages
                .front()
                .is_some_and(|message| message.time_ms.saturating_add(max_age_ms) <= now_ms)
            {
                self.messages.pop_front();
            }
        }
    }
}

/// All topics and consumer cursors.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Topics {
    topics: BTreeMap<String, Topic>,
    /// consumer -> topic -> last acknowledged seq.
    cursors: BTreeMap<String, BTreeMap<String, u64>>,
}

impl Topics {
    pub(crate) fn publish(
        &mut self,
        topic: &str,
        data: Bytes,
        revision: i64,
        now_ms: u64,
        messages_max: u64,
    ) -> Message {
        let entry = self.topics.entry(topic.to_owned()).or_default();
        entry.last_seq += 1;
        let message = Message {
            topic: topic.to_owned(),
            seq: entry.last_seq,
            revision,
            time_ms: now_ms,
            data,
        };
        entry.messages.push_back(message.clone());
        entry.enforce_retention(now_ms, messages_max);
        message
    }

    pub(crate) fn configure(
        &mut self,
        topic: &str,
        retention: Retention,
        now_ms: u64,
        messages_max: u64,
    ) {
        let entry = self.topics.entry(topic.to_owned()).or_default();
        entry.retention = retention;
        entry.enforce_retention(now_ms, messages_max);
    }

    pub(crate) fn enforce_all(&mut self, now_ms: u64, messages_max: u64) {
        for topic in self.topics.values_mut() {
            topic.enforce_retention(now_ms, messages_max);
        }
    }

    /// True when the topic exists (it was published to or configured).
    pub fn contains(&self, topic: &str) -> bool {
        self.topics.contains_key(topic)
    }

    /// Number of topics.
    pub fn len(&self) -> usize {
        self.topics.len()
    }

    /// True when there is no topic.
    pub fn is_empty(&self) -> bool {
        self.topics.is_empty()
    }

    /// True when the consumer has acknowledged something.
    pub fn has_consumer(&self, consumer: &str) -> bool {
        self.cursors.contains_key(consumer)
    }

    /// Number of consumers with cursors.
    pub fn consumer_count(&self) -> usize {
        self.cursors.len()
    }

    /// Moves the consumer's cursor forward (never back). Returns the cursor.
    pub(crate) fn ack(&mut self, consumer: &str, topic: &str, seq: u64) -> Result<u64> {
        let last_seq = self.topics.get(topic).map_or(0, |entry| entry.last_seq);
        if seq > last_seq {
            return Err(Error::AckBeyondEnd {
                topic: topic.to_owned(),
                seq,
                last_seq,
            });
        }
        let cursor = self
            .cursors
            .entry(consumer.to_owned())
            .or_default()
            .entry(topic.to_owned())
            .or_insert(0);
        *cursor = (*cursor).max(seq);
        Ok(*cursor)
    }

    /// Messages with seq >= `from_seq` (at most `limit`, 0 for all).
    pub fn read(&self, topic: &str, from_seq: u64, limit: usize) -> TopicRead {
        let Some(entry) = self.topics.get(topic) else {
            return TopicRead {
                topic: topic.to_owned(),
                first_seq: 1,
                ..TopicRead::default()
            };
        };
        let first_seq = entry.first_seq();
        let skip = usize::try_from(from_seq.saturating_sub(first_seq)).unwrap_or(usize::MAX);
        let take = if limit == 0 { usize::MAX } else { limit };
        let messages = entry
            .messages
            .iter()
            .skip(skip)
            .take(take)
            .cloned()
            .collect();
        TopicRead {
            topic: topic.to_owned(),
            messages,
            first_seq,
            last_seq: entry.last_seq,
            acked_seq: 0,
        }
    }

    /// The consumer's cursor on a topic (0 if it never acked).
    pub fn cursor(&self, consumer: &str, topic: &str) -> u64 {
        self.cursors
            .get(consumer)
            .and_then(|topics| topics.get(topic))
            .copied()
            .unwrap_or(0)
    }

    /// What `consumer` has not acknowledged on each of `topics`, at most `limit` per topic.
    pub fn inbox(&self, consumer: &str, topics: &[String], limit: usize) -> Vec<TopicRead> {
        topics
            .iter()
            .map(|topic| {
                let acked_seq = self.cursor(consumer, topic);
                TopicRead {
                    acked_seq,
                    ..self.read(topic, acked_seq + 1, limit)
                }
            })
            .collect()
    }

    /// The earliest time age retention will drop a message, for the server's timer.
    pub fn next_expiry_ms(&self) -> Option<u64> {
        self.topics
            .values()
            .filter_map(|topic| {
                let max_age_ms = topic.retention.max_age_ms?;
                Some(topic.messages.front()?.time_ms.saturating_add(max_age_ms))
            })
            .min()
    }

    /// Topic names.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.topics.keys().map(String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_sequences_retention_and_cursors() {
        let mut topics = Topics::default();
        for i in 0..5u64 {
            let message = topics.publish(
                "t",
                Bytes::from(vec![i as u8]),
                10 + i as i64,
                i * 100,
                1000,
            );
            assert_eq!(message.seq, i + 1);
        }
        topics.configure(
            "t",
            Retention {
                max_messages: Some(3),
                max_age_ms: None,
            },
            500,
            1000,
        );
        let read = topics.read("t", 1, 0);
        assert_eq!(
            (read.first_seq, read.last_seq, read.messages.len()),
            (3, 5, 3)
        );
        assert_eq!(topics.ack("me", "t", 4), Ok(4));
        assert_eq!(topics.ack("me", "t", 2), Ok(4));
        assert!(topics.ack("me", "t", 6).is_err());
        let inbox = topics.inbox("me", &["t".to_owned()], 0);
        assert_eq!(
            inbox[0].messages.iter().map(|m| m.seq).collect::<Vec<_>>(),
            vec![5]
        );
        topics.configure(
            "t",
            Retention {
                max_messages: None,
                max_age_ms: Some(100),
            },
            500,
            1000,
        );
        assert!(topics.read("t", 0, 0).messages.is_empty());
        assert_eq!(topics.read("t", 0, 0).first_seq, 6);
    }
}
