//! `publish`, `subscribe`, `inbox`, `ack`, `topic configure`.

use std::time::Duration;

use clap::{Args, Subcommand};
use conclave_client::{InboxOptions, TopicMessage};
use conclave_state::MESSAGE_FROM_BYTES_MAX;
use serde_json::{Value, json};

use super::output::{data_json, text};
use super::{CmdResult, Ctx, Failure, parse_duration};

/// Largest message `publish` reads from stdin; the server's request limit applies too.
pub const PUBLISH_STDIN_BYTES_MAX: u64 = 16 * 1024 * 1024;

#[derive(Args, Debug)]
pub struct PublishArgs {
    pub topic: String,
    /// The message (any bytes; JSON comes back as JSON in `--json` output). Without it and
    /// without --data, or as `-`, the message is read from stdin.
    #[arg(conflicts_with = "data_flag")]
    pub data: Option<String>,
    /// The message, as the flag form of DATA (`--data '{"type":"heartbeat"}'`).
    #[arg(long = "data", id = "data_flag", value_name = "DATA")]
    pub data_flag: Option<String>,
    /// The sender readers see as the message's `from` (an agent id; at most 256 bytes);
    /// not verified by the server. Default: none.
    #[arg(long, env = "CONCLAVE_FROM", value_name = "ID")]
    pub from: Option<String>,
}

#[derive(Subcommand, Debug)]
pub enum TopicCommand {
    /// Set TOPIC's retention (creating it if needed); the limits not given are lifted.
    Configure {
        topic: String,
        /// Keep only the newest N messages.
        #[arg(long, value_name = "N")]
        max_messages: Option<u64>,
        /// Drop messages older than this (e.g. 10m), on the Raft leader's clock.
        #[arg(long, value_name = "DURATION")]
        max_age: Option<String>,
    },
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
    /// Topics to read; none: every topic the consumer follows (has acknowledged in; `ack
    /// --consumer NAME TOPIC 0` follows a topic from its start).
    #[arg(value_name = "TOPIC")]
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
        "data": data_json(&m.data),
        "revision": m.revision,
        "published_unix_ms": m.published_unix_ms,
        "from": m.from,
    })
}

fn check_topic(topic: &str) -> CmdResult<()> {
    if topic.is_empty() {
        return Err(Failure::invalid("the topic name must not be empty"));
    }
    Ok(())
}

/// The message of `publish`: DATA, --data, or stdin.
async fn publish_data(args: &PublishArgs) -> CmdResult<Vec<u8>> {
    match args.data.as_deref().or(args.data_flag.as_deref()) {
        Some(data) if data != "-" => Ok(data.as_bytes().to_vec()),
        _ => {
            use tokio::io::AsyncReadExt;
            let mut data = Vec::new();
            tokio::io::stdin()
                .take(PUBLISH_STDIN_BYTES_MAX + 1)
                .read_to_end(&mut data)
                .await
                .map_err(|e| Failure::io(format!("reading the message from stdin: {e}")))?;
            if data.len() as u64 > PUBLISH_STDIN_BYTES_MAX {
                return Err(Failure::invalid(format!(
                    "the message on stdin is larger than {PUBLISH_STDIN_BYTES_MAX} bytes"
                )));
            }
            // `echo` ends its line; the line end is not part of the message.
            if data.last() == Some(&b'\n') {
                data.pop();
            }
            Ok(data)
        }
    }
}

pub async fn publish(ctx: &Ctx, args: PublishArgs) -> CmdResult {
    check_topic(&args.topic)?;
    let from = args.from.clone().unwrap_or_default();
    if from.len() > MESSAGE_FROM_BYTES_MAX {
        return Err(Failure::invalid(format!(
            "--from is {} bytes; at most {MESSAGE_FROM_BYTES_MAX} are allowed",
            from.len()
        )));
    }
    let data = publish_data(&args).await?;
    let client = ctx.connect().await?;
    let seq = client
        .topics()
        .publish_from(&args.topic, data, &from)
        .await?;
    ctx.out.ok(
        json!({"topic": args.topic, "seq": seq, "from": from}),
        || format!("published {} #{seq}", args.topic),
    );
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
    let all_followed = args.topics.is_empty();
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
            "topics": if all_followed { json!("followed") } else { json!(args.topics) },
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

pub async fn topic(ctx: &Ctx, command: TopicCommand) -> CmdResult {
    match command {
        TopicCommand::Configure {
            topic,
            max_messages,
            max_age,
        } => {
            check_topic(&topic)?;
            if max_messages == Some(0) {
                return Err(Failure::invalid("--max-messages must be at least 1"));
            }
            let max_age = max_age
                .as_deref()
                .map(|age| parse_duration(age, "--max-age"))
                .transpose()?;
            let client = ctx.connect().await?;
            client
                .topics()
                .configure(&topic, max_messages, max_age)
                .await?;
            let max_age_ms = max_age.map(|age| u64::try_from(age.as_millis()).unwrap_or(u64::MAX));
            ctx.out.ok(
                json!({"topic": topic, "max_messages": max_messages, "max_age_ms": max_age_ms}),
                || format!("{topic} configured"),
            );
            Ok(0)
        }
    }
}
