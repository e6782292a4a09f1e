//! `lease grant|revoke|keepalive|ttl|list`.

use clap::Subcommand;
use serde_json::json;

use super::output::text;
use super::{CmdResult, Ctx, lease_hex, parse_duration, parse_lease_id};

/// Shortest pause between two keepalives of `lease keepalive` (a 1 s lease would otherwise
/// be renewed in a busy loop once rounded down).
const KEEPALIVE_PAUSE_MIN_MS: u64 = 100;

#[derive(Subcommand, Debug)]
pub enum LeaseCommand {
    /// Grant a lease of TTL (seconds, or a duration like 30s, 2m).
    Grant {
        #[arg(allow_hyphen_values = true)]
        ttl: String,
    },
    /// Revoke a lease, deleting its keys and ending its candidacies and locks.
    Revoke { id: String },
    /// Keep a lease alive: every TTL/3 until Ctrl-C, or one keepalive with --once.
    Keepalive {
        id: String,
        /// Send one keepalive and exit (the heartbeat of a shell script).
        #[arg(long)]
        once: bool,
    },
    /// Remaining and granted TTL of a lease.
    Ttl {
        id: String,
        /// Also list the keys attached to it.
        #[arg(long)]
        keys: bool,
    },
    /// Every live lease.
    List,
}

pub async fn run(ctx: &Ctx, command: LeaseCommand) -> CmdResult {
    match command {
        LeaseCommand::Grant { ttl } => {
            let ttl = parse_duration(&ttl, "the lease TTL")?;
            let client = ctx.connect().await?;
            let grant = client.lease_grant(ttl).await?;
            let id = lease_hex(grant.id);
            let seconds = grant.ttl.as_secs();
            ctx.out.ok(json!({"id": id, "ttl": seconds}), || {
                format!("lease {id} granted with TTL({seconds}s)")
            });
        }
        LeaseCommand::Revoke { id } => {
            let id = parse_lease_id(&id)?;
            let client = ctx.connect().await?;
            client.lease_revoke(id).await?;
            let id = lease_hex(id);
            ctx.out.ok(json!({"id": id, "revoked": true}), || {
                format!("lease {id} revoked")
            });
        }
        LeaseCommand::Keepalive { id, once } => {
            let id = parse_lease_id(&id)?;
            let client = ctx.connect().await?;
            let hex = lease_hex(id);
            loop {
                let ttl = client.lease_keep_alive_once(id).await?;
                let seconds = ttl.as_secs();
                ctx.out.ok(json!({"id": hex, "ttl": seconds}), || {
                    format!("lease {hex} keepalived with TTL({seconds})")
                });
                if once {
                    break;
                }
                let pause = (ttl / 3).max(std::time::Duration::from_millis(KEEPALIVE_PAUSE_MIN_MS));
                tokio::select! {
                    _ = tokio::time::sleep(pause) => {}
                    _ = super::interrupted() => break,
                }
            }
        }
        LeaseCommand::Ttl { id, keys } => {
            let id = parse_lease_id(&id)?;
            let client = ctx.connect().await?;
            let answer = client.lease_time_to_live(id, keys).await?;
            let hex = lease_hex(id);
            let key_list: Vec<String> = answer.keys.iter().map(|k| text(k)).collect();
            let remaining = answer.remaining.as_secs();
            let granted = answer.granted_ttl.as_secs();
            let mut data = json!({"id": hex, "granted_ttl": granted, "remaining_ttl": remaining});
            if keys {
                data["keys"] = json!(key_list);
            }
            ctx.out.ok(data, || {
                let mut line =
                    format!("lease {hex} granted with TTL({granted}s), remaining({remaining}s)");
                if keys {
                    line.push_str(&format!(", attached keys({})", key_list.join(", ")));
                }
                line
            });
        }
        LeaseCommand::List => {
            let client = ctx.connect().await?;
            let leases = client.leases().await?;
            let ids: Vec<String> = leases.iter().map(|id| lease_hex(*id)).collect();
            ctx.out.ok(json!({"leases": ids}), || {
                let mut out = format!("found {} leases", ids.len());
                for id in &ids {
                    out.push('\n');
                    out.push_str(id);
                }
                out
            });
        }
    }
    Ok(0)
}
