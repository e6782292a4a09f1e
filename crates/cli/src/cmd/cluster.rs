//! `member list`, `status`, `transfer-leader`, `snapshot save`.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Subcommand};
use conclave_client::{Error, ErrorContext, TlsOptions};
use conclave_proto::etcdserverpb::cluster_client::ClusterClient;
use conclave_proto::etcdserverpb::maintenance_client::MaintenanceClient;
use conclave_proto::etcdserverpb::{
    Member, MemberAddRequest, MemberPromoteRequest, MemberRemoveRequest, MoveLeaderRequest,
    SnapshotRequest, StatusRequest, StatusResponse,
};
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tonic::transport::Channel;

use super::{CmdResult, Ctx, Failure};

/// Largest snapshot `snapshot save` accepts before giving up (the state machine is in memory,
/// so anything near this is a runaway stream).
pub const SNAPSHOT_BYTES_MAX: u64 = 8 * 1024 * 1024 * 1024;

#[derive(Subcommand, Debug)]
pub enum MemberCommand {
    /// Every member with its URLs.
    List,
    /// Add a member (voter, or learner with --learner); prints how to start it.
    Add {
        /// The new member's name (used in the printed serve flags).
        name: String,
        /// Its peer address, `http://host:port`.
        #[arg(long, value_name = "URL")]
        peer_url: String,
        /// Join as a non-voting learner (promote it once it caught up).
        #[arg(long)]
        learner: bool,
    },
    /// Remove a member (its name or hex id).
    Remove { name: String },
    /// Make a caught-up learner a voter (its name or hex id).
    Promote { name: String },
}

#[derive(Subcommand, Debug)]
pub enum SnapshotCommand {
    /// Save the leader's state machine snapshot to FILE.
    Save { file: PathBuf },
}

#[derive(Args, Debug)]
pub struct TransferArgs {
    /// The member to hand leadership to: its name or hex id.
    pub name: String,
}

fn id_hex(id: u64) -> String {
    format!("{id:x}")
}

fn member_json(m: &Member) -> Value {
    json!({
        "id": id_hex(m.id),
        "name": m.name,
        "peer_urls": m.peer_ur_ls,
        "client_urls": m.client_ur_ls,
        "learner": m.is_learner,
    })
}

fn status_failure(status: &tonic::Status) -> Failure {
    Error::from_status(status, ErrorContext::default()).into()
}

fn channel(url: &str, timeout: Duration, tls: Option<&TlsOptions>) -> CmdResult<Channel> {
    Ok(conclave_client::endpoint(url, tls)?
        .connect_timeout(timeout)
        .timeout(timeout)
        .connect_lazy())
}

/// One member's own status, asked of that member (the client library would follow the
/// leader).
pub(crate) async fn probe(
    url: &str,
    timeout: Duration,
    tls: Option<&TlsOptions>,
) -> Result<StatusResponse, String> {
    let channel = channel(url, timeout, tls).map_err(|f| f.message)?;
    let mut maintenance = MaintenanceClient::new(channel);
    let call = maintenance.status(StatusRequest {});
    match tokio::time::timeout(timeout, call).await {
        Ok(Ok(answer)) => Ok(answer.into_inner()),
        Ok(Err(status)) => Err(status.message().to_string()),
        Err(_) => Err(format!("no answer within {timeout:?}")),
    }
}

/// The leader and the term as the answering members report them: `(leader id, highest
/// term)`, leader 0 when none is known. A claim of the highest term wins; among those, one
/// naming a leader beats a member that has just moved to that term and not heard from it yet.
pub(crate) fn reported_leader<'a>(answers: impl Iterator<Item = &'a StatusResponse>) -> (u64, u64) {
    answers.fold((0, 0), |(leader, term), s| {
        if s.raft_term > term || (s.raft_term == term && leader == 0) {
            (s.leader, s.raft_term)
        } else {
            (leader, term)
        }
    })
}

/// The member called `name` (or whose hex id it is).
fn find_member<'a>(members: &'a [Member], name: &str) -> CmdResult<&'a Member> {
    members
        .iter()
        .find(|m| m.name == name || id_hex(m.id) == name.trim_start_matches("0x"))
        .ok_or_else(|| {
            Failure::new(
                "not_found",
                format!("no member is named or has the id {name:?}"),
            )
        })
}

/// `4 (n4)`, or `4` for a member that has not started yet (no name).
fn label(m: &Member) -> String {
    if m.name.is_empty() {
        id_hex(m.id)
    } else {
        format!("{} ({})", id_hex(m.id), m.name)
    }
}

fn host_port(url: &str) -> String {
    url.trim_start_matches("http://")
        .trim_start_matches("https://")
        .trim_end_matches('/')
        .to_string()
}

pub async fn member(ctx: &Ctx, command: MemberCommand) -> CmdResult {
    match command {
        MemberCommand::Add {
            name,
            peer_url,
            learner,
        } => {
            if name.is_empty() {
                return Err(Failure::invalid("the member name must not be empty"));
            }
            if !host_port(&peer_url).contains(':') {
                return Err(Failure::invalid(format!(
                    "--peer-url {peer_url:?} needs a host and a port"
                )));
            }
            let client = ctx.connect().await?;
            let url = client.current_endpoint().await?;
            let peer_url = if peer_url.contains("://") {
                peer_url
            } else {
                format!("http://{peer_url}")
            };
            let answer = ClusterClient::new(channel(&url, ctx.timeout, ctx.tls.as_ref())?)
                .member_add(MemberAddRequest {
                    peer_ur_ls: vec![peer_url.clone()],
                    is_learner: learner,
                })
                .await
                .map_err(|s| status_failure(&s))?
                .into_inner();
            let added = answer.member.ok_or_else(|| {
                Failure::new("unavailable", "the server did not say who it added")
            })?;
            // How to start it: numeric keys, since names would be numbered in list order. The
            // list is the current members, so the new one can reach whoever leads; the cluster
            // id comes separately, as it is derived from the founding list, which may be gone.
            let cluster_id = answer.header.as_ref().map_or(0, |h| h.cluster_id);
            if cluster_id == 0 {
                return Err(Failure::new(
                    "unavailable",
                    "the server did not say which cluster it is (no cluster id in its answer)",
                ));
            }
            let initial_cluster = answer
                .members
                .iter()
                .filter_map(|m| {
                    m.peer_ur_ls
                        .first()
                        .map(|p| format!("{}={}", m.id, host_port(p)))
                })
                .collect::<Vec<_>>()
                .join(",");
            let flags = vec![
                "--name".to_string(),
                name.clone(),
                "--id".into(),
                added.id.to_string(),
                "--listen-peer".into(),
                host_port(&peer_url),
                "--initial-cluster".into(),
                initial_cluster,
                "--initial-cluster-state".into(),
                "existing".into(),
                "--initial-cluster-id".into(),
                format!("{cluster_id:x}"),
            ];
            ctx.out.ok(
                json!({
                    "member": member_json(&added),
                    "members": answer.members.iter().map(member_json).collect::<Vec<_>>(),
                    "serve_flags": flags,
                }),
                || {
                    format!(
                        "member {} added{}; start it with an empty data directory:\n  conclave serve {} --listen-client HOST:PORT --initial-cluster-clients ... --peer-secret-file FILE\n(FILE: the cluster's peer secret, the one its other members were given)",
                        id_hex(added.id),
                        if learner { " as a learner" } else { "" },
                        flags.join(" ")
                    )
                },
            );
            Ok(0)
        }
        MemberCommand::Remove { name } => {
            let client = ctx.connect().await?;
            let members = client.member_list().await?;
            let target = find_member(&members, &name)?.clone();
            let url = client.current_endpoint().await?;
            ClusterClient::new(channel(&url, ctx.timeout, ctx.tls.as_ref())?)
                .member_remove(MemberRemoveRequest { id: target.id })
                .await
                .map_err(|s| status_failure(&s))?;
            ctx.out.ok(json!({"removed": member_json(&target)}), || {
                format!("member {} removed", label(&target))
            });
            Ok(0)
        }
        MemberCommand::Promote { name } => {
            let client = ctx.connect().await?;
            let members = client.member_list().await?;
            let target = find_member(&members, &name)?.clone();
            let url = client.current_endpoint().await?;
            ClusterClient::new(channel(&url, ctx.timeout, ctx.tls.as_ref())?)
                .member_promote(MemberPromoteRequest { id: target.id })
                .await
                .map_err(|s| status_failure(&s))?;
            ctx.out.ok(json!({"promoted": member_json(&target)}), || {
                format!("member {} promoted to voter", label(&target))
            });
            Ok(0)
        }
        MemberCommand::List => {
            let client = ctx.connect().await?;
            let members = client.member_list().await?;
            ctx.out.ok(
                json!({"members": members.iter().map(member_json).collect::<Vec<_>>()}),
                || {
                    let rows: Vec<Vec<String>> = members
                        .iter()
                        .map(|m| {
                            vec![
                                id_hex(m.id),
                                m.name.clone(),
                                m.peer_ur_ls.join(","),
                                m.client_ur_ls.join(","),
                                if m.is_learner { "learner" } else { "voter" }.to_string(),
                            ]
                        })
                        .collect();
                    ctx.out
                        .table(&["ID", "NAME", "PEER URLS", "CLIENT URLS", "ROLE"], &rows)
                },
            );
            Ok(0)
        }
    }
}

/// Every member with its own status answer (or why it gave none).
async fn probe_all(ctx: &Ctx) -> CmdResult<Vec<(Member, Result<StatusResponse, String>)>> {
    let client = ctx.connect().await?;
    let members = client.member_list().await?;
    let probes = members.into_iter().map(|member| {
        let timeout = ctx.timeout;
        let tls = ctx.tls.clone();
        tokio::spawn(async move {
            let answer = match member.client_ur_ls.first() {
                Some(url) => probe(url, timeout, tls.as_ref()).await,
                None => Err("no client URL".to_string()),
            };
            (member, answer)
        })
    });
    let mut out = Vec::new();
    for probe in probes.collect::<Vec<_>>() {
        out.push(
            probe
                .await
                .map_err(|e| Failure::io(format!("status probe failed: {e}")))?,
        );
    }
    Ok(out)
}

pub async fn status(ctx: &Ctx) -> CmdResult {
    let answers = probe_all(ctx).await?;
    let (leader, term) = reported_leader(answers.iter().filter_map(|(_, a)| a.as_ref().ok()));
    let members: Vec<Value> = answers
        .iter()
        .map(|(m, answer)| {
            let mut value = member_json(m);
            value["is_leader"] = json!(m.id == leader && leader != 0);
            match answer {
                Ok(s) => {
                    value["healthy"] = json!(s.errors.is_empty());
                    value["raft_term"] = json!(s.raft_term);
                    value["raft_index"] = json!(s.raft_index);
                    value["applied_index"] = json!(s.raft_applied_index);
                    value["db_size"] = json!(s.db_size);
                    value["version"] = json!(s.version);
                    value["errors"] = json!(s.errors);
                }
                Err(error) => {
                    value["healthy"] = json!(false);
                    value["errors"] = json!([error]);
                }
            }
            value
        })
        .collect();
    let healthy = answers.iter().filter(|(_, a)| a.is_ok()).count();
    ctx.out.ok(
        json!({
            "leader": if leader == 0 { Value::Null } else { json!(id_hex(leader)) },
            "raft_term": term,
            "healthy_members": healthy,
            "members": members,
        }),
        || {
            let rows: Vec<Vec<String>> = answers
                .iter()
                .map(|(m, answer)| {
                    let url = m.client_ur_ls.first().cloned().unwrap_or_default();
                    let leads = m.id == leader && leader != 0;
                    match answer {
                        Ok(s) => vec![
                            id_hex(m.id),
                            m.name.clone(),
                            url,
                            if leads {
                                ctx.out.green("leader")
                            } else {
                                "follower".into()
                            },
                            s.raft_term.to_string(),
                            s.raft_index.to_string(),
                            s.raft_applied_index.to_string(),
                            s.db_size.to_string(),
                            if s.errors.is_empty() {
                                ctx.out.green("healthy")
                            } else {
                                ctx.out.red(&s.errors.join("; "))
                            },
                        ],
                        Err(error) => vec![
                            id_hex(m.id),
                            m.name.clone(),
                            url,
                            "-".into(),
                            "-".into(),
                            "-".into(),
                            "-".into(),
                            "-".into(),
                            ctx.out.red(&format!("unreachable: {error}")),
                        ],
                    }
                })
                .collect();
            ctx.out.table(
                &[
                    "ID",
                    "NAME",
                    "ENDPOINT",
                    "ROLE",
                    "TERM",
                    "RAFT INDEX",
                    "APPLIED",
                    "DB SIZE",
                    "HEALTH",
                ],
                &rows,
            )
        },
    );
    Ok(0)
}

pub async fn transfer_leader(ctx: &Ctx, args: TransferArgs) -> CmdResult {
    let answers = probe_all(ctx).await?;
    let members: Vec<Member> = answers.iter().map(|(m, _)| m.clone()).collect();
    let target = find_member(&members, &args.name)?.clone();
    let leader = answers
        .iter()
        .filter_map(|(m, a)| a.as_ref().ok().map(|s| (m, s)))
        .find(|(m, s)| s.leader == m.id)
        .map(|(m, _)| m.clone())
        .ok_or_else(|| Failure::new("no_leader", "no member reports itself leader"))?;
    if leader.id != target.id {
        let url = leader
            .client_ur_ls
            .first()
            .ok_or_else(|| Failure::new("unavailable", "the leader has no client URL"))?;
        // MoveLeader must go to the current leader, which answers once the target leads.
        MaintenanceClient::new(channel(url, ctx.timeout, ctx.tls.as_ref())?)
            .move_leader(MoveLeaderRequest {
                target_id: target.id,
            })
            .await
            .map_err(|s| status_failure(&s))?;
    }
    ctx.out.ok(
        json!({"leader": id_hex(target.id), "name": target.name, "previous_leader": id_hex(leader.id)}),
        || {
            format!(
                "leadership moved from {} to {} ({})",
                id_hex(leader.id),
                id_hex(target.id),
                target.name
            )
        },
    );
    Ok(0)
}

pub async fn snapshot(ctx: &Ctx, command: SnapshotCommand) -> CmdResult {
    let SnapshotCommand::Save { file } = command;
    let client = ctx.connect().await?;
    let url = client.current_endpoint().await?;
    // A snapshot may take longer than one request; allow ten deadlines for the stream.
    let mut stream = MaintenanceClient::new(channel(&url, ctx.timeout * 10, ctx.tls.as_ref())?)
        .snapshot(SnapshotRequest {})
        .await
        .map_err(|s| status_failure(&s))?
        .into_inner();
    // Write to a temporary name and rename, so FILE is never a partial snapshot.
    let partial = file.with_extension("part");
    let mut out = tokio::fs::File::create(&partial)
        .await
        .map_err(|e| Failure::io(format!("cannot create {}: {e}", partial.display())))?;
    let mut total: u64 = 0;
    // The last blob says nothing follows it; a stream that ends before that lost its end.
    let mut complete = false;
    while let Some(chunk) = stream.message().await.map_err(|s| status_failure(&s))? {
        total += chunk.blob.len() as u64;
        complete = chunk.remaining_bytes == 0;
        if total > SNAPSHOT_BYTES_MAX {
            let _ = tokio::fs::remove_file(&partial).await;
            return Err(Failure::new(
                "too_large",
                format!("the snapshot is over {SNAPSHOT_BYTES_MAX} bytes"),
            ));
        }
        out.write_all(&chunk.blob)
            .await
            .map_err(|e| Failure::io(format!("cannot write {}: {e}", partial.display())))?;
    }
    if !complete {
        let _ = tokio::fs::remove_file(&partial).await;
        return Err(Failure::new(
            "unavailable",
            format!(
                "the snapshot stream ended before the image did ({total} bytes received); nothing was saved"
            ),
        ));
    }
    out.sync_all()
        .await
        .map_err(|e| Failure::io(format!("cannot sync {}: {e}", partial.display())))?;
    tokio::fs::rename(&partial, &file)
        .await
        .map_err(|e| Failure::io(format!("cannot rename to {}: {e}", file.display())))?;
    let path = file.display().to_string();
    ctx.out.ok(
        json!({"file": path, "bytes": total, "endpoint": url}),
        || format!("snapshot saved to {path} ({total} bytes)"),
    );
    Ok(0)
}

/// `info`: who this client talks to, as the seed's `pilotctl info` tells an agent its id.
pub async fn info(ctx: &Ctx) -> CmdResult {
    let client = ctx.connect().await?;
    let status = client.status().await?;
    let endpoint = client.current_endpoint().await?;
    let members = client.member_list().await?;
    let header = status.header.unwrap_or_default();
    let name = members
        .iter()
        .find(|m| m.id == header.member_id)
        .map(|m| m.name.clone())
        .unwrap_or_default();
    let endpoints: Vec<String> = members
        .iter()
        .flat_map(|m| m.client_ur_ls.iter().cloned())
        .collect();
    let leader = (status.leader != 0).then(|| id_hex(status.leader));
    ctx.out.ok(
        json!({
            "node_id": id_hex(header.member_id),
            "name": name,
            "cluster_id": id_hex(header.cluster_id),
            "endpoint": endpoint,
            "endpoints": endpoints,
            "version": status.version,
            "leader_id": leader,
            "raft_term": status.raft_term,
        }),
        || {
            format!(
                "node {} ({name}) of cluster {} at {endpoint}, version {}; members at {}",
                id_hex(header.member_id),
                id_hex(header.cluster_id),
                status.version,
                endpoints.join(",")
            )
        },
    );
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(leader: u64, term: u64) -> StatusResponse {
        StatusResponse {
            leader,
            raft_term: term,
            ..Default::default()
        }
    }

    #[test]
    fn the_highest_term_names_the_leader_and_a_named_leader_beats_none() {
        let stale_then_new = [answer(1, 3), answer(2, 4), answer(1, 3)];
        assert_eq!(reported_leader(stale_then_new.iter()), (2, 4));
        // A member that has just moved to term 4 knows no leader yet; its peer does.
        for order in [[answer(0, 4), answer(2, 4)], [answer(2, 4), answer(0, 4)]] {
            assert_eq!(reported_leader(order.iter()), (2, 4));
        }
        assert_eq!(reported_leader([answer(0, 5), answer(2, 4)].iter()), (0, 5));
        assert_eq!(reported_leader(std::iter::empty()), (0, 0));
    }
}
