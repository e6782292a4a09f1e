//! `put`, `get`, `del`, `watch`.

use clap::Args;
use conclave_client::{
    DeleteOptions, EventType, GetOptions, GetResponse, KeyValue, PutOptions, WatchOptions,
};
use serde_json::{Value, json};

use super::output::text;
use super::{CmdResult, Ctx, Failure, lease_hex, parse_lease_id};

#[derive(Args, Debug)]
pub struct PutArgs {
    pub key: String,
    /// The value; read from stdin when omitted (for values too big or binary for argv).
    pub value: Option<String>,
    /// Attach the key to this lease (hex id); the key goes when the lease does.
    #[arg(long, value_name = "ID")]
    pub lease: Option<String>,
    /// Also print the key-value this put replaced (none for a new key).
    #[arg(long)]
    pub prev_kv: bool,
}

#[derive(Args, Debug)]
pub struct GetArgs {
    pub key: String,
    /// Every key starting with KEY.
    #[arg(long)]
    pub prefix: bool,
    /// Read at this past revision.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub rev: i64,
    /// Return at most N keys (0: no limit).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub limit: i64,
    /// Only the keys, without values (the server sends none).
    #[arg(long, conflicts_with = "print_value_only")]
    pub keys_only: bool,
    /// Only the values, one a line (human output; --json keeps whole key-values).
    #[arg(long)]
    pub print_value_only: bool,
}

#[derive(Args, Debug)]
pub struct DelArgs {
    pub key: String,
    /// Every key starting with KEY.
    #[arg(long)]
    pub prefix: bool,
    /// Also print the key-values deleted.
    #[arg(long)]
    pub prev_kv: bool,
}

#[derive(Args, Debug)]
pub struct CompactArgs {
    /// Drop the history below this revision (reads and watches from before it then fail
    /// with `compacted`).
    pub revision: i64,
}

#[derive(Args, Debug)]
pub struct WatchArgs {
    pub key: String,
    /// Every key starting with KEY.
    #[arg(long)]
    pub prefix: bool,
    /// Start from this revision (replaying history); 0 is "from now".
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub rev: i64,
}

/// Longest value `put KEY` reads from stdin; above etcd's 1.5 MiB request limit so that the
/// server's `too_large` answer is what a big value meets, below what is sane to buffer.
pub const PUT_STDIN_BYTES_MAX: u64 = 16 * 1024 * 1024;

/// Reads stdin whole, refusing more than `max` bytes with `too_large`.
pub async fn read_stdin(max: u64) -> CmdResult<Vec<u8>> {
    use std::io::Read;
    let input = tokio::task::spawn_blocking(move || {
        let mut input = Vec::new();
        std::io::stdin()
            .take(max + 1)
            .read_to_end(&mut input)
            .map(|_| input)
    })
    .await
    .map_err(|e| Failure::io(format!("cannot read stdin: {e}")))?
    .map_err(|e| Failure::io(format!("cannot read stdin: {e}")))?;
    if input.len() as u64 > max {
        return Err(Failure::new(
            "too_large",
            format!("the input on stdin is over {max} bytes"),
        ));
    }
    Ok(input)
}

/// A key-value as JSON: text key and value, revisions, lease (hex, absent without one).
/// A keys-only answer has no `value` field.
pub fn kv_json_keys_only(kv: &KeyValue) -> Value {
    let mut value = kv_json(kv);
    if let Some(fields) = value.as_object_mut() {
        fields.remove("value");
    }
    value
}

/// A key-value as JSON: text key and value, revisions, lease (hex, absent without one).
pub fn kv_json(kv: &KeyValue) -> Value {
    let mut value = json!({
        "key": text(&kv.key),
        "value": text(&kv.value),
        "create_revision": kv.create_revision,
        "mod_revision": kv.mod_revision,
        "version": kv.version,
    });
    if kv.lease != 0 {
        value["lease"] = json!(lease_hex(kv.lease));
    }
    value
}

pub fn get_json(answer: &GetResponse) -> Value {
    json!({
        "kvs": answer.kvs.iter().map(kv_json).collect::<Vec<_>>(),
        "count": answer.count,
        "more": answer.more,
        "revision": answer.revision,
    })
}

/// etcdctl's simple format: key line, value line.
pub fn get_human(answer: &GetResponse) -> String {
    let mut out = String::new();
    for kv in &answer.kvs {
        out.push_str(&text(&kv.key));
        out.push('\n');
        out.push_str(&text(&kv.value));
        out.push('\n');
    }
    out
}

fn check_key(key: &str) -> CmdResult<()> {
    if key.is_empty() {
        return Err(Failure::invalid("the key must not be empty"));
    }
    Ok(())
}

fn check_revision(rev: i64, flag: &str) -> CmdResult<()> {
    if rev < 0 {
        return Err(Failure::invalid(format!(
            "{flag} must be 0 or a revision, not {rev}"
        )));
    }
    Ok(())
}

pub async fn put(ctx: &Ctx, args: PutArgs) -> CmdResult {
    check_key(&args.key)?;
    let lease = args.lease.as_deref().map(parse_lease_id).transpose()?;
    let value = match args.value {
        Some(value) => value.into_bytes(),
        None => read_stdin(PUT_STDIN_BYTES_MAX).await?,
    };
    let client = ctx.connect().await?;
    let answer = client
        .put(
            args.key.as_bytes(),
            value,
            PutOptions {
                lease: lease.unwrap_or(0),
                prev_kv: args.prev_kv,
            },
        )
        .await?;
    let mut data = json!({"key": args.key, "revision": answer.revision});
    if args.prev_kv {
        data["prev_kv"] = answer.prev_kv.as_ref().map_or(Value::Null, kv_json);
    }
    ctx.out.ok(data, || {
        // etcdctl's format: OK, then the replaced key and value.
        let mut human = "OK".to_string();
        if let Some(prev) = &answer.prev_kv {
            human.push_str(&format!("\n{}\n{}", text(&prev.key), text(&prev.value)));
        }
        human
    });
    Ok(0)
}

pub async fn get(ctx: &Ctx, args: GetArgs) -> CmdResult {
    check_key(&args.key)?;
    check_revision(args.rev, "--rev")?;
    if args.limit < 0 {
        return Err(Failure::invalid("--limit must be 0 (no limit) or more"));
    }
    let client = ctx.connect().await?;
    let answer = client
        .get(
            args.key.as_bytes(),
            GetOptions {
                prefix: args.prefix,
                revision: args.rev,
                limit: args.limit,
                keys_only: args.keys_only,
                ..GetOptions::default()
            },
        )
        .await?;
    let mut data = get_json(&answer);
    if args.keys_only {
        data["kvs"] = answer.kvs.iter().map(kv_json_keys_only).collect();
    }
    ctx.out.ok(data, || {
        if args.keys_only {
            answer.kvs.iter().map(|kv| text(&kv.key) + "\n").collect()
        } else if args.print_value_only {
            answer.kvs.iter().map(|kv| text(&kv.value) + "\n").collect()
        } else {
            get_human(&answer)
        }
    });
    Ok(0)
}

pub async fn del(ctx: &Ctx, args: DelArgs) -> CmdResult {
    check_key(&args.key)?;
    let client = ctx.connect().await?;
    let answer = client
        .delete(
            args.key.as_bytes(),
            DeleteOptions {
                prefix: args.prefix,
                prev_kv: args.prev_kv,
                ..DeleteOptions::default()
            },
        )
        .await?;
    let mut data = json!({"deleted": answer.deleted, "revision": answer.revision});
    if args.prev_kv {
        data["prev_kvs"] = answer.prev_kvs.iter().map(kv_json).collect();
    }
    ctx.out.ok(data, || {
        // etcdctl's format: the count, then each deleted key and value.
        let mut human = answer.deleted.to_string();
        for kv in &answer.prev_kvs {
            human.push_str(&format!("\n{}\n{}", text(&kv.key), text(&kv.value)));
        }
        human
    });
    Ok(0)
}

pub async fn compact(ctx: &Ctx, args: CompactArgs) -> CmdResult {
    if args.revision < 1 {
        return Err(Failure::invalid(format!(
            "the revision to compact to must be 1 or more, not {}",
            args.revision
        )));
    }
    let client = ctx.connect().await?;
    let revision = client.compact(args.revision).await?;
    ctx.out.ok(
        json!({"compacted": args.revision, "revision": revision}),
        || format!("compacted revision {}", args.revision),
    );
    Ok(0)
}

pub async fn watch(ctx: &Ctx, args: WatchArgs) -> CmdResult {
    check_key(&args.key)?;
    check_revision(args.rev, "--rev")?;
    let client = ctx.connect().await?;
    let mut watcher = client
        .watch(
            args.key.as_bytes(),
            WatchOptions {
                prefix: args.prefix,
                start_revision: args.rev,
                ..WatchOptions::default()
            },
        )
        .await?;
    loop {
        let event = tokio::select! {
            event = watcher.next() => event,
            _ = super::interrupted() => return Ok(0),
        };
        let Some(event) = event else {
            return Err(Failure::new("unavailable", "the watch ended"));
        };
        let event = event?;
        let kind = match event.kind {
            EventType::Put => "PUT",
            EventType::Delete => "DELETE",
        };
        ctx.out.ok(
            json!({"type": kind, "revision": event.revision(), "kv": kv_json(&event.kv)}),
            // etcdctl's watch format: event type, key, value.
            || format!("{kind}\n{}\n{}", text(&event.kv.key), text(&event.kv.value)),
        );
    }
}
