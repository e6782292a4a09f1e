//! `elect campaign|leader|candidates|observe|resign|configure`: Conclave's priority election
//! groups.

use clap::{Args, Subcommand, ValueEnum};
use conclave_client::{
    CampaignOptions, Candidate, ElectionEvent, ElectionEventKind, GroupPolicy, LeaderInfo,
    LossReason, PreemptPolicy,
};
use serde_json::{Value, json};

use super::output::{rfc3339_utc, text};
use super::{CmdResult, Ctx, Failure, child, lease_hex, parse_duration, parse_lease_id};

#[derive(Subcommand, Debug)]
pub enum ElectCommand {
    /// Join GROUP and block until elected; then run CMD while leading.
    Campaign(CampaignArgs),
    /// Who leads GROUP.
    Leader { group: String },
    /// GROUP's candidates, highest priority first.
    Candidates { group: String },
    /// Stream GROUP's election events.
    Observe { group: String },
    /// Withdraw candidate ID from GROUP (resigning if it leads).
    Resign {
        group: String,
        #[arg(long, value_name = "ID")]
        id: String,
    },
    /// Set GROUP's policy (creating the group if needed); flags not given keep their value.
    Configure(ConfigureArgs),
}

#[derive(Args, Debug)]
pub struct ConfigureArgs {
    pub group: String,
    /// Before an empty seat is filled, collect candidates this long from the first one, then
    /// elect by priority (ties to the smallest id); `off` elects the first at once.
    #[arg(long, value_name = "DURATION")]
    pub settle: Option<String>,
    /// Who may ask a sitting leader for its seat: `higher` (a higher-priority candidate that
    /// campaigns with --preempt), `always` (every higher-priority candidate) or `never` (no
    /// candidate: the seat moves only when the leader resigns or its lease ends).
    #[arg(long, value_enum, value_name = "POLICY")]
    pub preempt_policy: Option<PreemptPolicyArg>,
    /// A requested handoff completes after this long even if the leader has not resigned;
    /// `off` waits for the leader (or its lease).
    #[arg(long, value_name = "DURATION")]
    pub handoff_timeout: Option<String>,
}

/// `--preempt-policy`.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreemptPolicyArg {
    Higher,
    Always,
    Never,
}

fn policy_name(policy: PreemptPolicy) -> &'static str {
    match policy {
        PreemptPolicy::Higher => "higher",
        PreemptPolicy::Always => "always",
        PreemptPolicy::Never => "never",
    }
}

fn millis(duration: Option<std::time::Duration>) -> Option<u64> {
    duration.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn policy_json(policy: &GroupPolicy) -> Value {
    json!({
        "settle_ms": millis(policy.settle),
        "preempt_policy": policy_name(policy.preempt),
        "handoff_timeout_ms": millis(policy.handoff_timeout),
    })
}

fn policy_human(policy: &GroupPolicy) -> String {
    let off = |d: Option<std::time::Duration>| d.map_or("off".to_string(), |d| format!("{d:?}"));
    format!(
        "settle {}, preempt {}, handoff timeout {}",
        off(policy.settle),
        policy_name(policy.preempt),
        off(policy.handoff_timeout)
    )
}

/// A duration flag that may be `off`.
fn optional_duration(text: &str, what: &str) -> CmdResult<Option<std::time::Duration>> {
    match text {
        "off" | "none" => Ok(None),
        _ => parse_duration(text, what).map(Some),
    }
}

#[derive(Args, Debug)]
pub struct CampaignArgs {
    pub group: String,
    /// This candidate's id, unique in the group.
    #[arg(long, value_name = "ID")]
    pub id: String,
    /// Higher priorities lead first.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub priority: i64,
    /// What the leader publishes (an address, say).
    #[arg(long, default_value = "")]
    pub value: String,
    /// TTL of the candidacy's lease: how long a dead leader keeps the seat.
    #[arg(long, default_value = "10s", allow_hyphen_values = true)]
    pub ttl: String,
    /// Ask a lower-priority leader for the seat: it is told, stops its command and resigns
    /// (a leader that ignores the request keeps the seat until its lease ends).
    #[arg(long)]
    pub preempt: bool,
    /// Campaign under this existing lease (hex id) instead of granting one.
    #[arg(long, value_name = "ID")]
    pub lease: Option<String>,
    /// Register and return at once (needs --lease; keep it alive with
    /// `lease keepalive ID --once`).
    #[arg(long, requires = "lease")]
    pub no_wait: bool,
    /// How long CMD may take to exit after SIGTERM before SIGKILL.
    #[arg(long, default_value = child::STOP_GRACE_DEFAULT)]
    pub grace: String,
    /// Run while leading, with CONCLAVE_GROUP, CONCLAVE_TERM and CONCLAVE_FENCE set.
    #[arg(last = true, value_name = "CMD")]
    pub command: Vec<String>,
}

fn candidate_json(c: &Candidate) -> Value {
    json!({
        "id": c.candidate_id,
        "priority": c.priority,
        "value": text(&c.value),
        "lease": lease_hex(c.lease),
        "joined_revision": c.joined_revision,
        "keepalive_age_ms": millis(c.keepalive_age),
    })
}

/// The `elect leader` document: the leader's id, priority, value, term and fence.
fn leader_json(info: &LeaderInfo) -> Value {
    json!({
        "group": info.group,
        "leader": info.leader.candidate_id,
        "priority": info.leader.priority,
        "value": text(&info.leader.value),
        "term": info.term,
        "fence": info.fence,
        "lease": lease_hex(info.leader.lease),
        "elected_revision": info.elected_revision,
        "elected_at": (info.elected_unix_ms > 0).then(|| rfc3339_utc(info.elected_unix_ms)).flatten(),
        "elected_unix_ms": (info.elected_unix_ms > 0).then_some(info.elected_unix_ms),
        "handoff_to": info.handoff_to.as_ref().map(|c| c.candidate_id.clone()),
    })
}

fn leader_human(info: &LeaderInfo) -> String {
    format!(
        "{} leads {} (priority {}, term {}, fence {}){}",
        info.leader.candidate_id,
        info.group,
        info.leader.priority,
        info.term,
        info.fence,
        if info.leader.value.is_empty() {
            String::new()
        } else {
            format!(": {}", text(&info.leader.value))
        }
    )
}

fn event_name(kind: ElectionEventKind) -> &'static str {
    match kind {
        ElectionEventKind::Elected => "elected",
        ElectionEventKind::Proclaimed => "proclaimed",
        ElectionEventKind::Resigned => "resigned",
        ElectionEventKind::Deposed => "deposed",
        ElectionEventKind::Expired => "expired",
        ElectionEventKind::CandidateJoined => "candidate_joined",
        ElectionEventKind::CandidateLeft => "candidate_left",
        ElectionEventKind::Current => "current",
        ElectionEventKind::HandoffRequested => "handoff_requested",
        ElectionEventKind::HandoffCancelled => "handoff_cancelled",
        ElectionEventKind::Unknown => "unknown",
    }
}

fn event_json(event: &ElectionEvent) -> Value {
    json!({
        "event": event_name(event.kind),
        "group": event.group,
        "revision": event.revision,
        "leadership": event.leadership.as_ref().map(leader_json),
        "candidate": event.candidate.as_ref().map(candidate_json),
    })
}

fn event_human(event: &ElectionEvent) -> String {
    let who = event
        .candidate
        .as_ref()
        .map(|c| format!(" {}", c.candidate_id))
        .unwrap_or_default();
    let leads = match &event.leadership {
        Some(info) => leader_human(info),
        None => "no leader".into(),
    };
    format!("{}{who}: {leads}", event_name(event.kind))
}

fn loss_text(reason: &LossReason) -> String {
    match reason {
        LossReason::Resigned => "resigned".into(),
        LossReason::Deposed {
            new_leader: Some(info),
        } => format!(
            "deposed: {} now leads with fence {}",
            info.leader.candidate_id, info.fence
        ),
        LossReason::Deposed { new_leader: None } => "deposed: the seat is vacant".into(),
        LossReason::LeaseExpired { reason } => format!("the lease expired: {reason}"),
    }
}

fn check_group(group: &str) -> CmdResult<()> {
    if group.is_empty() {
        return Err(Failure::invalid("the group name must not be empty"));
    }
    Ok(())
}

pub async fn run(ctx: &Ctx, command: ElectCommand) -> CmdResult {
    match command {
        ElectCommand::Campaign(args) => campaign(ctx, args).await,
        ElectCommand::Configure(args) => configure(ctx, args).await,
        ElectCommand::Leader { group } => {
            check_group(&group)?;
            let client = ctx.connect().await?;
            match client.election().leader_and_policy(&group).await? {
                (Some(info), policy) => {
                    let mut document = leader_json(&info);
                    document["policy"] = policy_json(&policy);
                    ctx.out.ok(document, || {
                        format!("{}\npolicy: {}", leader_human(&info), policy_human(&policy))
                    });
                    Ok(0)
                }
                (None, _) => Err(Failure::new(
                    "not_found",
                    format!("group {group:?} has no leader"),
                )),
            }
        }
        ElectCommand::Candidates { group } => {
            check_group(&group)?;
            let client = ctx.connect().await?;
            let election = client.election();
            let (candidates, policy) = election.candidates_and_policy(&group).await?;
            let leader = election
                .leader(&group)
                .await
                .ok()
                .flatten()
                .map(|info| info.leader.candidate_id);
            let list: Vec<Value> = candidates
                .iter()
                .map(|c| {
                    let mut value = candidate_json(c);
                    value["leader"] = json!(leader.as_deref() == Some(c.candidate_id.as_str()));
                    value
                })
                .collect();
            let document =
                json!({"group": group, "candidates": list, "policy": policy_json(&policy)});
            ctx.out.ok(document, || {
                let rows: Vec<Vec<String>> = candidates
                    .iter()
                    .map(|c| {
                        let leads = leader.as_deref() == Some(c.candidate_id.as_str());
                        vec![
                            if leads {
                                ctx.out.green("*")
                            } else {
                                String::new()
                            },
                            c.candidate_id.clone(),
                            c.priority.to_string(),
                            text(&c.value),
                            lease_hex(c.lease),
                            millis(c.keepalive_age).map_or("-".into(), |ms| format!("{ms} ms")),
                        ]
                    })
                    .collect();
                let table = ctx.out.table(
                    &["", "ID", "PRIORITY", "VALUE", "LEASE", "KEEPALIVE"],
                    &rows,
                );
                format!("{table}\npolicy: {}", policy_human(&policy))
            });
            Ok(0)
        }
        ElectCommand::Observe { group } => {
            check_group(&group)?;
            let client = ctx.connect().await?;
            let mut events = client.election().observe(&group).await?;
            loop {
                let event = tokio::select! {
                    event = events.next() => event,
                    _ = super::interrupted() => return Ok(0),
                };
                let Some(event) = event else {
                    return Err(Failure::new("unavailable", "the observe stream ended"));
                };
                let event = event?;
                ctx.out.ok(event_json(&event), || event_human(&event));
            }
        }
        ElectCommand::Resign { group, id } => {
            check_group(&group)?;
            let client = ctx.connect().await?;
            let was_leader = client.election().resign(&group, &id, 0).await?;
            ctx.out.ok(
                json!({"group": group, "id": id, "was_leader": was_leader}),
                || {
                    if was_leader {
                        format!("{id} resigned the lead of {group}")
                    } else {
                        format!("{id} left {group}")
                    }
                },
            );
            Ok(0)
        }
    }
}

async fn configure(ctx: &Ctx, args: ConfigureArgs) -> CmdResult {
    check_group(&args.group)?;
    let settle = args
        .settle
        .as_deref()
        .map(|t| optional_duration(t, "--settle"))
        .transpose()?;
    let handoff_timeout = args
        .handoff_timeout
        .as_deref()
        .map(|t| optional_duration(t, "--handoff-timeout"))
        .transpose()?;
    let client = ctx.connect().await?;
    let election = client.election();
    let (_, mut policy) = election.leader_and_policy(&args.group).await?;
    if let Some(settle) = settle {
        policy.settle = settle;
    }
    if let Some(handoff_timeout) = handoff_timeout {
        policy.handoff_timeout = handoff_timeout;
    }
    if let Some(preempt) = args.preempt_policy {
        policy.preempt = match preempt {
            PreemptPolicyArg::Higher => PreemptPolicy::Higher,
            PreemptPolicyArg::Always => PreemptPolicy::Always,
            PreemptPolicyArg::Never => PreemptPolicy::Never,
        };
    }
    let policy = election.configure(&args.group, policy).await?;
    let mut document = policy_json(&policy);
    document["group"] = json!(args.group);
    ctx.out.ok(document, || {
        format!("{}: {}", args.group, policy_human(&policy))
    });
    Ok(0)
}

async fn campaign(ctx: &Ctx, args: CampaignArgs) -> CmdResult {
    check_group(&args.group)?;
    if args.id.is_empty() {
        return Err(Failure::invalid("--id must not be empty"));
    }
    let ttl = parse_duration(&args.ttl, "--ttl")?;
    let grace = parse_duration(&args.grace, "--grace")?;
    let lease = args.lease.as_deref().map(parse_lease_id).transpose()?;
    let client = ctx.connect().await?;
    let election = client.election();
    if args.no_wait {
        let lease = lease.ok_or_else(|| Failure::invalid("--no-wait needs --lease ID"))?;
        let registration = election
            .register(
                &args.group,
                &args.id,
                args.priority,
                args.value.as_bytes(),
                lease,
                args.preempt,
            )
            .await?;
        let leader = registration.leadership.as_ref();
        ctx.out.ok(
            json!({
                "group": args.group,
                "id": args.id,
                "elected": registration.elected,
                "leadership": leader.map(leader_json),
            }),
            || match leader {
                Some(info) if registration.elected => {
                    format!("elected: {}", leader_human(info))
                }
                Some(info) => format!("registered; {}", leader_human(info)),
                None => "registered; the seat is vacant".into(),
            },
        );
        return Ok(0);
    }
    let options = CampaignOptions {
        ttl,
        lease,
        preempt: args.preempt,
        timeout: ctx.wait,
    };
    ctx.out.note(&format!(
        "campaigning in {} as {} (priority {})",
        args.group, args.id, args.priority
    ));
    let campaign = election.campaign(
        &args.group,
        &args.id,
        args.priority,
        args.value.as_bytes(),
        options,
    );
    let leadership = tokio::select! {
        leadership = campaign => leadership?,
        _ = super::interrupted() => {
            // Withdraw now rather than leave the candidacy until its lease expires.
            let _ = election.resign(&args.group, &args.id, 0).await;
            return Err(Failure::new(
                "interrupted",
                format!("interrupted before being elected in {}; withdrew {}", args.group, args.id),
            ));
        }
    };
    let info = leadership.info().clone();
    // A lease this command granted is revoked on the way out, so nothing it held lingers
    // until the TTL (the library revokes in the background, which exit would cut short).
    let granted_lease = lease.is_none().then(|| leadership.lease_id());
    let revoke = |client: conclave_client::Client| async move {
        if let Some(id) = granted_lease {
            let _ = client.lease_revoke(id).await;
        }
    };
    let mut elected = leader_json(&info);
    elected["event"] = json!("elected");
    ctx.out
        .ok(elected, || format!("elected: {}", leader_human(&info)));

    let mut running = if args.command.is_empty() {
        None
    } else {
        let env = [
            ("CONCLAVE_GROUP", args.group.clone()),
            ("CONCLAVE_CANDIDATE", args.id.clone()),
            ("CONCLAVE_TERM", leadership.term().to_string()),
            ("CONCLAVE_FENCE", leadership.fence().to_string()),
            ("CONCLAVE_LEASE", lease_hex(leadership.lease_id())),
        ];
        match child::spawn(&args.command, &env) {
            Ok(child) => Some(child),
            Err(failure) => {
                let _ = leadership.resign().await;
                return Err(failure);
            }
        }
    };
    let lost = leadership.lost();
    let handoff = leadership.handoff_requested();
    let exited = async {
        match running.as_mut() {
            Some(child) => child.wait().await.ok(),
            None => std::future::pending().await,
        }
    };
    enum End {
        Lost(LossReason),
        HandedOver(Candidate),
        Exited(Option<std::process::ExitStatus>),
        Interrupted,
    }
    let end = tokio::select! {
        reason = lost => End::Lost(reason),
        challenger = handoff => End::HandedOver(challenger),
        status = exited => End::Exited(status),
        _ = super::interrupted() => End::Interrupted,
    };
    match end {
        End::HandedOver(challenger) => {
            // CMD stops before the seat moves, so the challenger never leads while our
            // command still acts on the old fence; resigning then moves the seat at once.
            if let Some(child) = running.as_mut() {
                child::stop(child, grace).await;
            }
            let _ = leadership.resign().await;
            revoke(client.clone()).await;
            Err(Failure::new(
                "leadership_lost",
                format!(
                    "lost the lead of {} (fence {}): handed over to {} (priority {}), which asked for it with --preempt",
                    args.group, info.fence, challenger.candidate_id, challenger.priority
                ),
            ))
        }
        End::Lost(reason) => {
            if let Some(child) = running.as_mut() {
                child::stop(child, grace).await;
            }
            Err(Failure::new(
                "leadership_lost",
                format!(
                    "lost the lead of {} (fence {}): {}",
                    args.group,
                    info.fence,
                    loss_text(&reason)
                ),
            ))
        }
        End::Exited(status) => {
            // CMD's work is done: hand the seat on at once.
            let _ = leadership.resign().await;
            revoke(client.clone()).await;
            let code = status.map(child::exit_code).unwrap_or(1);
            ctx.out.ok(
                json!({"event": "resigned", "group": args.group, "fence": info.fence, "exit_code": code}),
                || format!("command exited with {code}; resigned {}", args.group),
            );
            Ok(code)
        }
        End::Interrupted => {
            let had_command = running.is_some();
            if let Some(child) = running.as_mut() {
                child::stop(child, grace).await;
            }
            let _ = leadership.resign().await;
            revoke(client.clone()).await;
            if had_command {
                // CMD was cut short: the last document says so, as the exit code (130) does.
                return Err(Failure::new(
                    "interrupted",
                    format!(
                        "interrupted while the command ran; stopped it and resigned {} (fence {})",
                        args.group, info.fence
                    ),
                ));
            }
            ctx.out.ok(
                json!({"event": "resigned", "group": args.group, "fence": info.fence}),
                || format!("resigned {}", args.group),
            );
            Ok(0)
        }
    }
}
