//! `lock NAME [-- CMD]`: hold a fenced lock while CMD runs (or until Ctrl-C).

use clap::Args;
use conclave_client::LockOptions;
use serde_json::json;

use super::output::text;
use super::{CmdResult, Ctx, Failure, child, lease_hex, parse_duration};

#[derive(Args, Debug)]
pub struct LockArgs {
    pub name: String,
    /// TTL of the lock's lease: how long a crashed holder keeps the lock.
    #[arg(long, default_value = "10s", allow_hyphen_values = true)]
    pub ttl: String,
    /// How long CMD may take to exit after SIGTERM before SIGKILL, when the lock is lost.
    #[arg(long, default_value = child::STOP_GRACE_DEFAULT)]
    pub grace: String,
    /// Run while holding the lock, with CONCLAVE_LOCK_FENCE set.
    #[arg(last = true, value_name = "CMD")]
    pub command: Vec<String>,
}

pub async fn run(ctx: &Ctx, args: LockArgs) -> CmdResult {
    if args.name.is_empty() {
        return Err(Failure::invalid("the lock name must not be empty"));
    }
    let ttl = parse_duration(&args.ttl, "--ttl")?;
    let grace = parse_duration(&args.grace, "--grace")?;
    let client = ctx.connect().await?;
    let options = LockOptions {
        ttl,
        lease: None,
        timeout: ctx.wait,
    };
    let mutex = client.mutex();
    let guard = tokio::select! {
        guard = mutex.lock(&args.name, options) => guard?,
        _ = super::interrupted() => {
            return Err(Failure::new(
                "interrupted",
                format!("interrupted while waiting for the lock {}", args.name),
            ));
        }
    };
    let fence = guard.fence();
    let key = text(guard.key());
    ctx.out.ok(
        json!({"event": "acquired", "name": args.name, "key": key, "fence": fence, "lease": lease_hex(guard.lease_id())}),
        // etcdctl prints the lock key.
        || key.clone(),
    );
    let mut running = if args.command.is_empty() {
        None
    } else {
        let env = [
            ("CONCLAVE_LOCK_NAME", args.name.clone()),
            ("CONCLAVE_LOCK_FENCE", fence.to_string()),
            ("CONCLAVE_LOCK_KEY", key.clone()),
        ];
        match child::spawn(&args.command, &env) {
            Ok(child) => Some(child),
            Err(failure) => {
                let _ = guard.unlock().await;
                return Err(failure);
            }
        }
    };
    let lost = guard.lost();
    let exited = async {
        match running.as_mut() {
            Some(child) => child.wait().await.ok(),
            None => std::future::pending().await,
        }
    };
    enum End {
        Lost(String),
        Exited(Option<std::process::ExitStatus>),
        Interrupted,
    }
    let end = tokio::select! {
        reason = lost => End::Lost(reason),
        status = exited => End::Exited(status),
        _ = super::interrupted() => End::Interrupted,
    };
    // With CMD running, an interruption cuts it short: a failure, not a release.
    let cut_short = matches!(end, End::Interrupted) && running.is_some();
    let code = match end {
        End::Lost(reason) => {
            if let Some(child) = running.as_mut() {
                child::stop(child, grace).await;
            }
            return Err(Failure::new(
                "leadership_lost",
                format!("lost the lock {} (fence {fence}): {reason}", args.name),
            ));
        }
        End::Exited(status) => status.map(child::exit_code).unwrap_or(1),
        End::Interrupted => match running.as_mut() {
            Some(child) => {
                child::stop(child, grace).await;
                super::exit_code("interrupted")
            }
            None => 0,
        },
    };
    let lease = guard.lease_id();
    guard.unlock().await?;
    // The lease was granted for this lock alone; revoke it now rather than leave it to expire
    // (the library's background revoke would be cut short by exit).
    let _ = client.lease_revoke(lease).await;
    if cut_short {
        // CMD was cut short: the last document says so, as the exit code (130) does.
        return Err(Failure::new(
            "interrupted",
            format!(
                "interrupted while the command ran; stopped it and released the lock {} (fence {fence})",
                args.name
            ),
        ));
    }
    ctx.out.ok(
        json!({"event": "released", "name": args.name, "fence": fence, "exit_code": code}),
        String::new,
    );
    Ok(code)
}
