//! Topics: ordered event logs with durable consumer cursors.
//!
//! ```text
//!   publish(topic, data) ──► seq = last + 1 (dense from 1), tagged with the store revision
//!   read(topic, from_seq, limit) / inbox(consumer, topics) ◄── retained messages
//!   ack(consumer, topic, seq) ──► cursor = max(cursor, seq)
//!   retention: count and age (leader-clock timestamps), applied on publish and on Tick
//! ```

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Longest sender (`Message::from`) a publish may name, in bytes; longer is refused as an
/// invalid argument.
pub const MESSAGE_FROM_BYTES_MAX: usize = 256;

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
    /// Who sent it, as the publisher named itself (not verified); empty when unnamed. Kept
    /// out of this struct's encoding so that images written before senders existed still
    /// decode: a snapshot carries the senders in a section of their own at its end
    /// ([`Topics::senders`]).
    #[serde(skip)]
    pub from: String,
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
        from: &str,
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
            from: from.to_owned(),
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

    /// The topics `consumer` has a cursor in (it acknowledged there), by name.
    pub fn followed_by(&self, consumer: &str) -> Vec<String> {
        self.cursors
            .get(consumer)
            .map(|topics| topics.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// Number of consumers with cursors.
    pub fn consumer_count(&self) -> usize {
        self.cursors.len()
    }

    /// Every consumer cursor as (consumer, topic, last acknowledged seq), in name order.
    pub fn cursors(&self) -> impl Iterator<Item = (&str, &str, u64)> {
        self.cursors.iter().flat_map(|(consumer, topics)| {
            topics
                .iter()
                .map(move |(topic, seq)| (consumer.as_str(), topic.as_str(), *seq))
        })
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
        let messages = if limit == 0 { usize::MAX } else { limit };
        self.read_within(topic, from_seq, &mut ReadBudget::new(messages, usize::MAX))
    }

    /// Messages with seq >= `from_seq`, as many as `budget` still allows; what they cost is
    /// taken from it. Nothing past the budget is copied.
    pub fn read_within(&self, topic: &str, from_seq: u64, budget: &mut ReadBudget) -> TopicRead {
        let Some(entry) = self.topics.get(topic) else {
            return TopicRead {
                topic: topic.to_owned(),
                first_seq: 1,
                ..TopicRead::default()
            };
        };
        let first_seq = entry.first_seq();
        let skip = usize::try_from(from_seq.saturating_sub(first_seq)).unwrap_or(usize::MAX);
        let messages = entry
            .messages
            .iter()
            .skip(skip)
            .take_while(|message| budget.take(message))
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

    /// What `consumer` has not acknowledged on `topics`, at most `limit` messages in all (0
    /// for all). A topic named twice is read once.
    pub fn inbox(&self, consumer: &str, topics: &[String], limit: usize) -> Vec<TopicRead> {
        let messages = if limit == 0 { usize::MAX } else { limit };
        self.inbox_within(consumer, topics, &mut ReadBudget::new(messages, usize::MAX))
    }

    /// What `consumer` has not acknowledged on `topics`, in the order named, as much as
    /// `budget` allows over all of them. A topic named twice is read once, and once the budget
    /// is spent no further topic is looked at, so a request naming many topics copies no more
    /// than one naming a few.
    pub fn inbox_within(
        &self,
        consumer: &str,
        topics: &[String],
        budget: &mut ReadBudget,
    ) -> Vec<TopicRead> {
        let mut seen = BTreeSet::new();
        let mut reads = Vec::new();
        for topic in topics {
            if budget.spent() {
                break;
            }
            if !seen.insert(topic.as_str()) {
                continue;
            }
            let acked_seq = self.cursor(consumer, topic);
            let read = self.read_within(topic, acked_seq.saturating_add(1), budget);
            reads.push(TopicRead { acked_seq, ..read });
        }
        reads
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

    /// The sender of every retained message that has one, in topic then seq order: the
    /// snapshot section that carries what [`Message`]'s own encoding leaves out.
    pub(crate) fn senders(&self) -> Vec<MessageSender> {
        self.topics
            .iter()
            .flat_map(|(name, topic)| {
                topic
                    .messages
                    .iter()
                    .filter(|message| !message.from.is_empty())
                    .map(|message| MessageSender {
                        topic: name.clone(),
                        seq: message.seq,
                        from: message.from.clone(),
                    })
            })
            .collect()
    }

    /// Puts back the senders [`Topics::senders`] listed. Refuses (as corruption) a sender of a
    /// message that is not retained, an empty or overlong one, and one named twice.
    pub(crate) fn restore_senders(&mut self, senders: Vec<MessageSender>) -> Result<()> {
        for sender in senders {
            if sender.from.is_empty() || sender.from.len() > MESSAGE_FROM_BYTES_MAX {
                return Err(Error::SnapshotCorrupt(format!(
                    "sender of {} bytes for {}#{}",
                    sender.from.len(),
                    sender.topic,
                    sender.seq
                )));
            }
            let message = self.topics.get_mut(&sender.topic).and_then(|topic| {
                let first_seq = topic.first_seq();
                let index = usize::try_from(sender.seq.checked_sub(first_seq)?).ok()?;
                topic.messages.get_mut(index)
            });
            let Some(message) = message else {
                return Err(Error::SnapshotCorrupt(format!(
                    "sender for {}#{}, which is not retained",
                    sender.topic, sender.seq
                )));
            };
            if !message.from.is_empty() {
                return Err(Error::SnapshotCorrupt(format!(
                    "two senders for {}#{}",
                    sender.topic, sender.seq
                )));
            }
            message.from = sender.from;
        }
        Ok(())
    }
}

/// One entry of the snapshot section of message senders.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct MessageSender {
    topic: String,
    seq: u64,
    from: String,
}

/// What one answer may still copy out of the topics: a count of messages and a number of
/// bytes (each message costs its data, its topic name and its sender). The first message is always taken
/// whatever its size, so a reader makes progress past a message bigger than the budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadBudget {
    messages_left: usize,
    bytes_left: usize,
    taken_any: bool,
}

impl ReadBudget {
    /// At most `messages` messages and `bytes` bytes.
    pub fn new(messages: usize, bytes: usize) -> ReadBudget {
        ReadBudget {
            messages_left: messages,
            bytes_left: bytes,
            taken_any: false,
        }
    }

    /// Takes `message`'s cost if it fits.
    fn take(&mut self, message: &Message) -> bool {
        if self.messages_left == 0 {
            return false;
        }
        let cost = message
            .data
            .len()
            .saturating_add(message.topic.len())
            .saturating_add(message.from.len());
        if self.taken_any && cost > self.bytes_left {
            self.messages_left = 0;
            return false;
        }
        self.messages_left -= 1;
        self.bytes_left = self.bytes_left.saturating_sub(cost);
        self.taken_any = true;
        true
    }

    /// Whether nothing more can be taken.
    pub fn spent(&self) -> bool {
        self.messages_left == 0
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
                "",
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

    #[test]
    fn an_inbox_reads_each_topic_once_within_one_budget() {
        let mut topics = Topics::default();
        for (i, topic) in ["a", "a", "a", "b", "b"].into_iter().enumerate() {
            topics.publish(topic, Bytes::from(vec![0u8; 10]), "", i as i64, 0, 1000);
        }
        // The same topic named 30,000 times is one topic.
        let named = vec!["a".to_owned(); 30_000];
        let reads = topics.inbox("me", &named, 0);
        assert_eq!(reads.len(), 1);
        assert_eq!(reads[0].messages.len(), 3);
        // `limit` counts over all topics.
        let both = ["a".to_owned(), "b".to_owned(), "a".to_owned()];
        let total = |reads: &[TopicRead]| reads.iter().map(|r| r.messages.len()).sum::<usize>();
        assert_eq!(total(&topics.inbox("me", &both, 4)), 4);
        assert_eq!(total(&topics.inbox("me", &both, 0)), 5);
        // 11 bytes a message (10 of data, 1 of topic name): 25 bytes hold two.
        let mut budget = ReadBudget::new(usize::MAX, 25);
        assert_eq!(total(&topics.inbox_within("me", &both, &mut budget)), 2);
        assert!(budget.spent());
        // The first message is returned even when it alone is over the budget.
        let mut tiny = ReadBudget::new(usize::MAX, 1);
        assert_eq!(topics.read_within("b", 0, &mut tiny).messages.len(), 1);
    }
}
