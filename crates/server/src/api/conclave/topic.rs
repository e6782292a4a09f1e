//! `conclave.v1.Topic`: Publish, Read, Subscribe, Inbox, Ack, Configure.

use std::sync::Arc;
use std::time::Duration;

use conclave_proto::conclave::v1::topic_server::{Topic, TopicServer};
use conclave_proto::conclave::v1::{self as cv1, topic_client::TopicClient};
use conclave_state::{
    MESSAGE_FROM_BYTES_MAX, Message, ReadBudget, Request, Response, StateMachine,
};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, async_trait};

use super::{STREAM_RESPONSES_MAX, header, invalid, message_to_pb, read_limit};
use crate::api::limits::Wait;
use crate::api::lock::{node_stopped, stream_changed, wait_until};
use crate::api::route::leader_call;
use crate::api::watch_hub::{Delivery, Interest, Subscription};
use crate::api::{Api, CallContext, answer, unexpected};

/// Messages a Read or Inbox returns when the request says 0.
pub const READ_LIMIT_DEFAULT: usize = 100;
/// Messages a Read or Inbox returns at most, whatever the request says.
pub const READ_LIMIT_MAX: usize = 10_000;
/// Messages one Subscribe response carries at most (backlog and catch-up are chunked).
pub const SUBSCRIBE_BATCH_MAX: usize = 256;
/// Longest an Inbox waits for a message (`wait_ms`), besides the call's own deadline.
pub const INBOX_WAIT_MAX_MS: u64 = 60_000;
/// Why a subscriber was cancelled.
pub const SLOW_SUBSCRIBER_REASON: &str = "conclave: subscriber fell behind the topic's retention and was cancelled; subscribe again from the oldest retained message";

/// `conclave.v1.Topic`, ready for the gRPC router.
pub fn topic_server(api: &Arc<Api>, decode_max: usize) -> TopicServer<TopicService> {
    TopicServer::new(TopicService { api: api.clone() }).max_decoding_message_size(decode_max)
}

// ---- Topic ------------------------------------------------------------------------------

/// Topics over the shared [`Api`].
pub struct TopicService {
    pub api: Arc<Api>,
}

async fn ack(
    api: &Api,
    ctx: &CallContext,
    message: cv1::AckRequest,
) -> Result<cv1::AckResponse, Status> {
    let command = Request::Ack {
        consumer: message.consumer.clone(),
        topic: message.topic.clone(),
        seq: message.seq,
    };
    api.write_self_contained(
        ctx,
        command,
        &message,
        leader_call!(TopicClient::ack),
        |applied| match answer(&applied)? {
            Response::Acked { cursor } => Ok(cv1::AckResponse {
                header: Some(header(api, applied.output.revision)),
                acked_seq: *cursor,
            }),
            other => Err(unexpected(other)),
        },
    )
    .await
    .map(tonic::Response::into_inner)
}

#[async_trait]
impl Topic for TopicService {
    async fn publish(
        &self,
        request: tonic::Request<cv1::PublishRequest>,
    ) -> Result<tonic::Response<cv1::PublishResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        let message = request.into_inner();
        if message.topic.is_empty() {
            return Err(invalid("topic name is empty"));
        }
        if message.from.len() > MESSAGE_FROM_BYTES_MAX {
            return Err(invalid(&format!(
                "the sender is {} bytes; at most {MESSAGE_FROM_BYTES_MAX} are allowed",
                message.from.len()
            )));
        }
        let api = &self.api;
        // Without a sender, the command older members know, byte for byte.
        let command = if message.from.is_empty() {
            Request::Publish {
                topic: message.topic.clone(),
                data: message.data.clone(),
            }
        } else {
            Request::PublishFrom {
                topic: message.topic.clone(),
                data: message.data.clone(),
                from: message.from.clone(),
            }
        };
        api.write_self_contained(
            &ctx,
            command,
            &message,
            leader_call!(TopicClient::publish),
            |applied| match answer(&applied)? {
                Response::Published { seq, revision } => Ok(cv1::PublishResponse {
                    header: Some(header(api, *revision)),
                    seq: *seq,
                }),
                other => Err(unexpected(other)),
            },
        )
        .await
    }

    async fn configure(
        &self,
        request: tonic::Request<cv1::TopicConfigureRequest>,
    ) -> Result<tonic::Response<cv1::TopicConfigureResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        let message = request.into_inner();
        if message.topic.is_empty() {
            return Err(invalid("topic name is empty"));
        }
        let api = &self.api;
        let command = Request::TopicConfigure {
            topic: message.topic.clone(),
            retention: conclave_state::Retention {
                max_messages: (message.max_messages > 0).then_some(message.max_messages),
                max_age_ms: (message.max_age_ms > 0).then_some(message.max_age_ms),
            },
        };
        api.write_self_contained(
            &ctx,
            command,
            &message,
            leader_call!(TopicClient::configure),
            |applied| match answer(&applied)? {
                Response::TopicConfigured => Ok(cv1::TopicConfigureResponse {
                    header: Some(header(api, applied.output.revision)),
                }),
                other => Err(unexpected(other)),
            },
        )
        .await
    }

    async fn read(
        &self,
        request: tonic::Request<cv1::ReadRequest>,
    ) -> Result<tonic::Response<cv1::ReadResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        let message = request.into_inner();
        self.api.check_read(&ctx, message.topic.as_bytes(), &[])?;
        self.api.linearizable_barrier(&ctx).await?;
        let limit = read_limit(message.limit);
        let bytes_max = self.api.config.client_limits.read_response_bytes_max;
        let (read, revision) = self.api.node.read_state(|state| {
            let mut budget = ReadBudget::new(limit, bytes_max);
            (
                state.topic_read_within(&message.topic, message.from_seq, &mut budget),
                state.revision(),
            )
        });
        let next_seq = read
            .messages
            .last()
            .map_or(message.from_seq.max(read.first_seq), |m| m.seq + 1);
        Ok(tonic::Response::new(cv1::ReadResponse {
            header: Some(header(&self.api, revision)),
            next_seq,
            first_retained_seq: read.first_seq,
            messages: read.messages.into_iter().map(message_to_pb).collect(),
        }))
    }

    type SubscribeStream = ReceiverStream<Result<cv1::SubscribeResponse, Status>>;

    async fn subscribe(
        &self,
        request: tonic::Request<cv1::SubscribeRequest>,
    ) -> Result<tonic::Response<Self::SubscribeStream>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        // Held by the stream's task until the stream ends (topic_subscriptions_max).
        let slot = (self.api.limits).wait(Wait::TopicSubscription, request.remote_addr())?;
        let message = request.into_inner();
        self.api.check_read(&ctx, message.topic.as_bytes(), &[])?;
        if message.topic.is_empty() {
            return Err(invalid("topic name is empty"));
        }
        // "From now" means after every publish acknowledged before the call.
        self.api.linearizable_barrier(&ctx).await?;
        let api = self.api.clone();
        let interest = Interest::Topics(vec![message.topic.clone()]);
        let (changes, next) =
            api.subscribe_with(interest, Delivery::Signal, |state| match message.from_seq {
                0 => state.topic_read(&message.topic, u64::MAX, 1).last_seq + 1,
                from => from,
            });
        let (responses, output) = mpsc::channel(STREAM_RESPONSES_MAX);
        tokio::spawn(async move {
            let _slot = slot;
            subscribe_topic(api, message.topic, next, changes, responses).await;
        });
        Ok(tonic::Response::new(ReceiverStream::new(output)))
    }

    async fn inbox(
        &self,
        request: tonic::Request<cv1::InboxRequest>,
    ) -> Result<tonic::Response<cv1::InboxResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        let client = request.remote_addr();
        let mut message = request.into_inner();
        if message.consumer.is_empty() {
            return Err(invalid("an inbox needs a consumer"));
        }
        // Each topic once, in the order first named; then the cap on how many.
        let mut seen = std::collections::BTreeSet::new();
        message.topics.retain(|topic| seen.insert(topic.clone()));
        for topic in &message.topics {
            self.api.check_read(&ctx, topic.as_bytes(), &[])?;
        }
        let api = &self.api;
        api.limits.inbox_topics(client, message.topics.len())?;
        api.linearizable_barrier(&ctx).await?;
        if message.topics.is_empty() {
            // No topic named: every topic the consumer follows (has a cursor in).
            message.topics = api
                .node
                .read_state(|state| state.topics().followed_by(&message.consumer));
            api.limits.inbox_topics(client, message.topics.len())?;
        }
        let limit = read_limit(message.limit);
        let bytes_max = api.config.client_limits.read_response_bytes_max;
        let read = |state: &StateMachine| {
            let mut budget = ReadBudget::new(limit, bytes_max);
            let pending: Vec<Message> = state
                .inbox_within(&message.consumer, &message.topics, &mut budget)
                .into_iter()
                .flat_map(|read| read.messages)
                .collect();
            (pending, state.revision())
        };
        let (mut pending, mut revision) = api.node.read_state(read);
        if pending.is_empty() && message.wait_ms > 0 {
            let wait = Duration::from_millis(u64::from(message.wait_ms).min(INBOX_WAIT_MAX_MS));
            let deadline = ctx.deadline.min(Instant::now() + wait);
            let found = wait_until(
                api,
                deadline,
                |state| {
                    let (pending, revision) = read(state);
                    (!pending.is_empty()).then_some((pending, revision))
                },
                Interest::Topics(message.topics.clone()),
            )
            .await?;
            if let Some(found) = found {
                (pending, revision) = found;
            }
        }
        if message.ack {
            // One ack per topic, at the last message returned (cursors never move back). The
            // acks are separate writes, so they cannot share one session position: they go
            // without it (an ack is idempotent anyway).
            let mut ack_ctx = ctx;
            ack_ctx.session = None;
            let mut last: Vec<(String, u64)> = Vec::new();
            for m in &pending {
                match last.iter_mut().find(|(topic, _)| *topic == m.topic) {
                    Some(entry) => entry.1 = entry.1.max(m.seq),
                    None => last.push((m.topic.clone(), m.seq)),
                }
            }
            for (topic, seq) in last {
                let acked = ack(
                    api,
                    &ack_ctx,
                    cv1::AckRequest {
                        consumer: message.consumer.clone(),
                        topic,
                        seq,
                    },
                )
                .await?;
                revision = revision.max(acked.header.map_or(0, |h| h.revision));
            }
        }
        Ok(tonic::Response::new(cv1::InboxResponse {
            header: Some(header(api, revision)),
            messages: pending.into_iter().map(message_to_pb).collect(),
        }))
    }

    async fn ack(
        &self,
        request: tonic::Request<cv1::AckRequest>,
    ) -> Result<tonic::Response<cv1::AckResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        let message = request.into_inner();
        if message.consumer.is_empty() || message.topic.is_empty() {
            return Err(invalid("an ack needs a consumer and a topic"));
        }
        Ok(tonic::Response::new(ack(&self.api, &ctx, message).await?))
    }
}

/// Streams `topic` from `next`: the retained log first, then each publish. Every batch is
/// read from the topic log (events only say "something was published"), so a resync or a
/// subscription the hub dropped as behind loses nothing unless retention dropped the messages.
async fn subscribe_topic(
    api: Arc<Api>,
    topic: String,
    mut next: u64,
    mut changes: Subscription,
    responses: mpsc::Sender<Result<cv1::SubscribeResponse, Status>>,
) {
    let stopped = node_stopped(&api);
    tokio::pin!(stopped);
    loop {
        // Send everything retained from `next` on, in chunks.
        loop {
            let (read, revision) = api.node.read_state(|state| {
                (
                    state.topic_read(&topic, next, SUBSCRIBE_BATCH_MAX),
                    state.revision(),
                )
            });
            if read.first_seq > next && read.last_seq >= next {
                let _ = responses
                    .send(Err(Status::data_loss(SLOW_SUBSCRIBER_REASON)))
                    .await;
                return;
            }
            let Some(last) = read.messages.last().map(|m| m.seq) else {
                break;
            };
            next = last + 1;
            let full = read.messages.len() >= SUBSCRIBE_BATCH_MAX;
            let response = cv1::SubscribeResponse {
                header: Some(header(&api, revision)),
                messages: read.messages.into_iter().map(message_to_pb).collect(),
            };
            if responses.send(Ok(response)).await.is_err() {
                return;
            }
            if !full {
                break;
            }
        }
        if !stream_changed(&mut changes, stopped.as_mut(), &responses).await {
            return;
        }
    }
}
