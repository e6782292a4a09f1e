//! `publish`, `subscribe`, `inbox`, `ack`.

use std::time::Duration;

use clap::Args;
use conclave_client::{InboxOptions, TopicMessage};
use serde_json::{Value, json};

use super::output::text;
use super::{CmdResult, Ctx, Failure, parse_duration};

#[derive(Args, Debug)]
pub struct PublishArgs {
    pub topic: String,
    pub data: String,
}

#[derive(Args, Debug)]
pub struct SubscribeArgs {
    pub topic: String,
    /// First sequence number to deliver (retained history); 0: only new messages.
    #[arg(long, value_name = "SEQ", default_value_t = 0)]
    pub from: u64,
}

#[derive(Args, Debug)]
pub struct InboxArgs {
    /// The consumer whose unacknowledged messages to read.
    #[arg(long, value_name = "NAME")]
    pub consumer: String,
    #[arg(required = true, value_name = "TOPIC")]
    pub topics: Vec<String>,
    /// Acknowledge what is returned in the same write (at-most-once); without it, ack with
    /// `conclave ack` after processing (at-least-once).
    #[arg(long)]
    pub ack: bool,
    /// At most N messages (0: the server's default).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub limit: u32,
    /// With nothing pending, wait this long for a message.
    #[arg(long, value_name = "DURATION")]
    pub wait: Option<String>,
}

#[derive(Args, Debug)]
pub struct AckArgs {
    /// The consumer acknowledging.
    #[arg(long, value_name = "NAME")]
    pub consumer: String,
    pub topic: String,
    /// Acknowledge every message up to and including SEQ.
    pub seq: u64,
}

fn message_json(m: &TopicMessage) -> Value {
    json!({
        "topic": m.topic,
        "seq": m.seq,
        "data": text(&m.data),
        "revision": m.revision,
        "published_unix_ms": m.published_unix_ms,
    })
}

fn check_topic(topic: &str) -> CmdResult<()> {
    if topic.is_empty() {
        return Err(Failure::invalid("the topic name must not be empty"));
    }
    Ok(())
}

pub async fn publish(ctx: &Ctx, args: PublishArgs) -> CmdResult {
    check_topic(&args.topic)?;
    let client = ctx.connect().await?;
    let seq = client
        .topics()
        .publish(&args.topic, args.data.as_bytes())
        .await?;
    ctx.out.ok(json!({"topic": args.topic, "seq": seq}), || {
        format!("published {} #{seq}", args.topic)
    });
    Ok(0)
}

pub async fn subscribe(ctx: &Ctx, args: SubscribeArgs) -> CmdResult {
    check_topic(&args.topic)?;
    let client = ctx.connect().await?;
    let mut messages = client.topics().subscribe(&args.topic, args.from).await?;
    loop {
        let message = tokio::select! {
            message = messages.next() => message,
            _ = super::interrupted() => return Ok(0),
        };
        let Some(message) = message else {
            return Err(Failure::new("unavailable", "the subscription ended"));
        };
        let message = message?;
        ctx.out.ok(message_json(&message), || {
            format!(
                "{} #{}: {}",
                message.topic,
                message.seq,
                text(&message.data)
            )
        });
    }
}

pub async fn inbox(ctx: &Ctx, args: InboxArgs) -> CmdResult {
    if args.consumer.is_empty() {
        return Err(Failure::invalid("--consumer must not be empty"));
    }
    for topic in &args.topics {
        check_topic(topic)?;
    }
    let wait = args
        .wait
        .as_deref()
        .map(|w| parse_duration(w, "--wait"))
        .transpose()?
        .unwrap_or(Duration::ZERO);
    let client = ctx.connect().await?;
    let topics: Vec<&str> = args.topics.iter().map(String::as_str).collect();
    let messages = client
        .topics()
        .inbox(
            &args.consumer,
            &topics,
            InboxOptions {
                limit: args.limit,
                ack: args.ack,
                wait,
            },
        )
        .await?;
    ctx.out.ok(
        json!({
            "consumer": args.consumer,
            "acked": args.ack,
            "messages": messages.iter().map(message_json).collect::<Vec<_>>(),
        }),
        || {
            let rows: Vec<Vec<String>> = messages
                .iter()
                .map(|m| vec![m.topic.clone(), m.seq.to_string(), text(&m.data)])
                .collect();
            ctx.out.table(&["TOPIC", "SEQ", "DATA"], &rows)
        },
    );
    Ok(0)
}

pub async fn ack(ctx: &Ctx, args: AckArgs) -> CmdResult {
    if args.consumer.is_empty() {
        return Err(Failure::invalid("--consumer must not be empty"));
    }
    check_topic(&args.topic)?;
    let client = ctx.connect().await?;
    let acked = client
        .topics()
        .ack(&args.consumer, &args.topic, args.seq)
        .await?;
    ctx.out.ok(
        json!({"consumer": args.consumer, "topic": args.topic, "acked_seq": acked}),
        || {
            format!(
                "{} acknowledged {} up to #{acked}",
                args.consumer, args.topic
            )
        },
    );
    Ok(0)
}
