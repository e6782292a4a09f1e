//! Topics (`conclave.v1.Topic`): publish, read, subscribe (resuming after reconnects), consumer
//! inboxes and acknowledgements.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use conclave_proto::conclave::v1 as cv1;
use conclave_proto::conclave::v1::topic_client::TopicClient;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::StreamExt;

use crate::Client;
use crate::conn::{Retry, Shared, request};
use crate::error::{Error, ErrorContext, Result};

/// One message of a topic.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TopicMessage {
    pub topic: String,
    /// From 1, gapless and increasing within the topic.
    pub seq: u64,
    pub data: Vec<u8>,
    pub revision: i64,
    /// The leader's clock at commit time.
    pub published_unix_ms: i64,
    /// The sender the publisher named ([`Topics::publish_from`]); empty when none.
    pub from: String,
}

impl From<cv1::TopicMessage> for TopicMessage {
    fn from(m: cv1::TopicMessage) -> Self {
        TopicMessage {
            topic: m.topic,
            seq: m.seq,
            data: m.data.into(),
            revision: m.revision,
            published_unix_ms: m.published_unix_ms,
            from: m.from,
        }
    }
}

/// Answer of [`Topics::read`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ReadResponse {
    pub messages: Vec<TopicMessage>,
    /// Where the next read should start.
    pub next_seq: u64,
    /// The oldest retained sequence number; anything earlier was trimmed.
    pub first_retained_seq: u64,
}

/// Options of [`Topics::inbox`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct InboxOptions {
    /// At most this many messages (0: the server's default).
    pub limit: u32,
    /// Acknowledge what is returned in the same write (at-most-once delivery).
    pub ack: bool,
    /// With nothing pending, wait up to this long for a message.
    pub wait: Duration,
}

/// Topics and consumer inboxes.
#[derive(Clone)]
pub struct Topics {
    client: Client,
}

fn topic_client(channel: crate::conn::Channel) -> TopicClient<crate::conn::Channel> {
    TopicClient::new(channel)
}

impl Topics {
    pub(crate) fn new(client: Client) -> Self {
        Topics { client }
    }

    /// Appends a message and answers its sequence number. In an exactly-once session, so a
    /// retry after a leader change never publishes it twice.
    pub async fn publish(&self, topic: &str, data: impl Into<Vec<u8>>) -> Result<u64> {
        self.publish_from(topic, data, "").await
    }

    /// [`Topics::publish`], naming the sender (an agent id, at most
    /// 256 bytes, else `invalid_argument`; empty: none). Readers see it as
    /// [`TopicMessage::from`]; the server stores it as given, without checking it.
    pub async fn publish_from(
        &self,
        topic: &str,
        data: impl Into<Vec<u8>>,
        from: &str,
    ) -> Result<u64> {
        let message = cv1::PublishRequest {
            topic: topic.to_string(),
            data: data.into().into(),
            from: from.to_string(),
        };
        let answer = self
            .client
            .call_in_session(
                Retry::AtMostOnce,
                ErrorContext::default(),
                |channel, timeout, at| {
                    let message = message.clone();
                    async move {
                        topic_client(channel)
                            .publish(at.request(message, timeout))
                            .await
                    }
                },
            )
            .await?;
        Ok(answer.into_inner().seq)
    }

    /// Sets `topic`'s retention (creating it if needed): keep at most `max_messages` (the
    /// newest) and none older than `max_age`; `None` lifts that limit. Idempotent.
    pub async fn configure(
        &self,
        topic: &str,
        max_messages: Option<u64>,
        max_age: Option<std::time::Duration>,
    ) -> Result<()> {
        let message = cv1::TopicConfigureRequest {
            topic: topic.to_string(),
            max_messages: max_messages.unwrap_or(0),
            max_age_ms: max_age.map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        };
        self.client
            .call(
                Retry::Idempotent,
                ErrorContext::default(),
                |channel, timeout| {
                    let message = message.clone();
                    async move {
                        topic_client(channel)
                            .configure(request(message, timeout))
                            .await
                    }
                },
            )
            .await?;
        Ok(())
    }

    /// Reads retained messages from `from_seq` (0: the oldest retained).
    pub async fn read(&self, topic: &str, from_seq: u64, limit: u32) -> Result<ReadResponse> {
        let message = cv1::ReadRequest {
            topic: topic.to_string(),
            from_seq,
            limit,
        };
        let answer = self
            .client
            .call(
                Retry::Idempotent,
                ErrorContext::default(),
                |channel, timeout| {
                    let message = message.clone();
                    async move { topic_client(channel).read(request(message, timeout)).await }
                },
            )
            .await?
            .into_inner();
        Ok(ReadResponse {
            messages: answer
                .messages
                .into_iter()
                .map(TopicMessage::from)
                .collect(),
            next_seq: answer.next_seq,
            first_retained_seq: answer.first_retained_seq,
        })
    }

    /// Messages `consumer` has not acknowledged on `topics`, oldest first per topic.
    pub async fn inbox(
        &self,
        consumer: &str,
        topics: &[&str],
        options: InboxOptions,
    ) -> Result<Vec<TopicMessage>> {
        let message = cv1::InboxRequest {
            consumer: consumer.to_string(),
            topics: topics.iter().map(|t| t.to_string()).collect(),
            limit: options.limit,
            ack: options.ack,
            wait_ms: u32::try_from(options.wait.as_millis()).unwrap_or(u32::MAX),
        };
        // Reading without acknowledging is a pure read; with `ack` a retry could skip a batch
        // (the read and its acks are several steps, which one session position cannot cover).
        let retry = if options.ack {
            Retry::AtMostOnce
        } else {
            Retry::Idempotent
        };
        let timeout = self.client.inner.options.request_timeout + options.wait;
        let answer = self
            .client
            .inner
            .call(
                retry,
                ErrorContext::default(),
                timeout,
                |channel, timeout| {
                    let message = message.clone();
                    async move { topic_client(channel).inbox(request(message, timeout)).await }
                },
            )
            .await?;
        Ok(answer
            .into_inner()
            .messages
            .into_iter()
            .map(TopicMessage::from)
            .collect())
    }

    /// Acknowledges every message of `topic` up to and including `seq` for `consumer`;
    /// answers the acknowledged position (it never moves back, so retrying is harmless).
    pub async fn ack(&self, consumer: &str, topic: &str, seq: u64) -> Result<u64> {
        let message = cv1::AckRequest {
            consumer: consumer.to_string(),
            topic: topic.to_string(),
            seq,
        };
        let answer = self
            .client
            .call_in_session(
                Retry::Idempotent,
                ErrorContext::default(),
                |channel, timeout, at| {
                    let message = message.clone();
                    async move {
                        topic_client(channel)
                            .ack(at.request(message, timeout))
                            .await
                    }
                },
            )
            .await?;
        Ok(answer.into_inner().acked_seq)
    }

    /// Streams messages from `from_seq` (0: only new ones), then new ones as published. After a
    /// reconnect it resumes at the last delivered seq + 1.
    pub async fn subscribe(&self, topic: &str, from_seq: u64) -> Result<TopicSubscription> {
        let inner = self.client.inner.clone();
        let first = open_subscribe(&inner, topic, from_seq).await?;
        let (tx, rx) = mpsc::channel(256);
        let task = tokio::spawn(subscribe_task(
            inner,
            topic.to_string(),
            from_seq,
            first,
            tx,
        ));
        Ok(TopicSubscription { messages: rx, task })
    }
}

async fn open_subscribe(
    inner: &Shared,
    topic: &str,
    from_seq: u64,
) -> Result<tonic::Streaming<cv1::SubscribeResponse>> {
    let message = cv1::SubscribeRequest {
        topic: topic.to_string(),
        from_seq,
    };
    let answer = inner
        .call(
            Retry::Idempotent,
            ErrorContext::default(),
            inner.options.request_timeout,
            |channel, _| {
                let message = message.clone();
                async move { topic_client(channel).subscribe(message).await }
            },
        )
        .await?;
    Ok(answer.into_inner())
}

/// Where a re-opened subscription starts.
pub(crate) fn resubscribe_from(requested: u64, last_seen: u64) -> u64 {
    if last_seen > 0 {
        last_seen + 1
    } else {
        requested
    }
}

async fn subscribe_task(
    inner: Shared,
    topic: String,
    requested: u64,
    first: tonic::Streaming<cv1::SubscribeResponse>,
    out: mpsc::Sender<Result<TopicMessage>>,
) {
    let mut stream = Some(first);
    let mut last_seen = 0u64;
    let mut failures = 0u32;
    loop {
        let mut current = match stream.take() {
            Some(s) => s,
            None => {
                match open_subscribe(&inner, &topic, resubscribe_from(requested, last_seen)).await {
                    Ok(s) => {
                        failures = 0;
                        s
                    }
                    Err(error) if error.is_transient() || error.code() == "timeout" => {
                        tokio::time::sleep(inner.options.backoff.delay(failures)).await;
                        failures = failures.saturating_add(1);
                        continue;
                    }
                    Err(error) => {
                        let _ = out.send(Err(error)).await;
                        return;
                    }
                }
            }
        };
        loop {
            let answer = tokio::select! {
                answer = current.next() => answer,
                () = out.closed() => return,
            };
            match answer {
                Some(Ok(answer)) => {
                    for message in answer.messages {
                        // A resumed stream may overlap what we delivered; skip repeats.
                        if message.seq <= last_seen {
                            continue;
                        }
                        last_seen = message.seq;
                        if out.send(Ok(message.into())).await.is_err() {
                            return;
                        }
                    }
                }
                Some(Err(status)) => {
                    let error = Error::status(&status);
                    if !error.is_transient() {
                        let _ = out.send(Err(error)).await;
                        return;
                    }
                    break;
                }
                None => break,
            }
        }
        tokio::time::sleep(inner.options.backoff.delay(failures)).await;
        failures = failures.saturating_add(1);
    }
}

/// A stream of a topic's messages; dropping it ends the subscription.
pub struct TopicSubscription {
    messages: mpsc::Receiver<Result<TopicMessage>>,
    task: JoinHandle<()>,
}

impl TopicSubscription {
    pub async fn next(&mut self) -> Option<Result<TopicMessage>> {
        self.messages.recv().await
    }
}

impl tokio_stream::Stream for TopicSubscription {
    type Item = Result<TopicMessage>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.messages.poll_recv(cx)
    }
}

impl Drop for TopicSubscription {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resubscribe_continues_after_the_last_message() {
        assert_eq!(resubscribe_from(0, 0), 0);
        assert_eq!(resubscribe_from(5, 0), 5);
        assert_eq!(resubscribe_from(5, 9), 10);
    }
}
