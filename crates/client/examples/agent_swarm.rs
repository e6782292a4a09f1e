//! Five agents campaign in one priority group; the leader is killed (it stops heartbeating, as
//! a crashed process would) and the timeline shows the next agent by priority taking over with
//! a higher fencing token.
//!
//! Run a server first (`conclave dev`), then:
//! `cargo run -p conclave-client --example agent_swarm` (endpoints from `CONCLAVE_ENDPOINTS`,
//! default `127.0.0.1:2379`).

use std::collections::HashMap;
use std::time::Duration;

use conclave_client::{CampaignOptions, Client, LossReason};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

const GROUP: &str = "swarm-demo";
/// Short, so the demo's failovers take about two seconds each.
const LEASE_TTL: Duration = Duration::from_secs(2);
const AGENTS: [(&str, i64); 5] = [
    ("agent-a", 50),
    ("agent-b", 40),
    ("agent-c", 30),
    ("agent-d", 20),
    ("agent-e", 10),
];
/// How many leaders get killed before the demo ends.
const KILLS: usize = 3;

enum Report {
    Elected {
        agent: String,
        term: u64,
        fence: u64,
    },
    Lost {
        agent: String,
        reason: LossReason,
    },
    Failed {
        agent: String,
        error: conclave_client::Error,
    },
}

async fn agent(
    endpoints: Vec<String>,
    name: &'static str,
    priority: i64,
    reports: mpsc::Sender<Report>,
    mut kill: oneshot::Receiver<()>,
) {
    // One client per agent, as separate processes would have.
    let client = match Client::connect(&endpoints).await {
        Ok(client) => client,
        Err(error) => {
            let _ = reports
                .send(Report::Failed {
                    agent: name.into(),
                    error,
                })
                .await;
            return;
        }
    };
    let options = CampaignOptions {
        ttl: LEASE_TTL,
        ..Default::default()
    };
    let election = client.election();
    let campaign = election.campaign(GROUP, name, priority, name, options);
    let leadership = tokio::select! {
        result = campaign => match result {
            Ok(leadership) => leadership,
            Err(error) => {
                let _ = reports.send(Report::Failed { agent: name.into(), error }).await;
                return;
            }
        },
        _ = &mut kill => return,
    };
    let _ = reports
        .send(Report::Elected {
            agent: name.into(),
            term: leadership.term(),
            fence: leadership.fence(),
        })
        .await;
    let lost = leadership.lost();
    tokio::select! {
        _ = kill => {
            // Crash: no resign, no revoke; the seat moves when the server expires the lease.
            leadership.abandon();
        }
        reason = lost => {
            let _ = reports.send(Report::Lost { agent: name.into(), reason }).await;
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let endpoints: Vec<String> = std::env::var("CONCLAVE_ENDPOINTS")
        .unwrap_or_else(|_| "127.0.0.1:2379".into())
        .split(',')
        .map(str::to_string)
        .collect();
    let start = Instant::now();
    let stamp = move || format!("{:>7.3}s", start.elapsed().as_secs_f64());
    let (tx, mut reports) = mpsc::channel(64);
    let mut kills = HashMap::new();
    let mut tasks = Vec::new();
    for (name, priority) in AGENTS {
        let (kill_tx, kill_rx) = oneshot::channel();
        kills.insert(name.to_string(), kill_tx);
        tasks.push(tokio::spawn(agent(
            endpoints.clone(),
            name,
            priority,
            tx.clone(),
            kill_rx,
        )));
        println!(
            "{} {name} joins {GROUP:?} with priority {priority}",
            stamp()
        );
        // Staggered starts: the first to arrive leads (stability), later ones wait.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(tx);

    let mut killed = 0;
    let mut last_fence = 0;
    let mut killed_at = None::<Instant>;
    while let Some(report) = reports.recv().await {
        match report {
            Report::Elected { agent, term, fence } => {
                let takeover = killed_at
                    .map(|at| format!(" ({:.2}s after the kill)", at.elapsed().as_secs_f64()))
                    .unwrap_or_default();
                println!(
                    "{} {agent} ELECTED  term {term}  fence {fence}{}{takeover}",
                    stamp(),
                    if fence > last_fence && last_fence > 0 {
                        "  (fence rose)"
                    } else {
                        ""
                    }
                );
                last_fence = fence;
                if killed == KILLS {
                    println!(
                        "{} done: {killed} leaders killed, each successor fenced higher",
                        stamp()
                    );
                    break;
                }
                // Let it lead for a moment, then crash it.
                tokio::time::sleep(Duration::from_millis(800)).await;
                if let Some(kill) = kills.remove(&agent) {
                    println!(
                        "{} {agent} KILLED (stops heartbeating; lease TTL {LEASE_TTL:?})",
                        stamp()
                    );
                    let _ = kill.send(());
                    killed += 1;
                    killed_at = Some(Instant::now());
                }
            }
            Report::Lost { agent, reason } => {
                println!("{} {agent} lost leadership: {reason:?}", stamp())
            }
            Report::Failed { agent, error } => {
                eprintln!(
                    "{} {agent} failed: {error} (code {})",
                    stamp(),
                    error.code()
                );
                return Err(error.into());
            }
        }
    }
    for (_, kill) in kills {
        let _ = kill.send(());
    }
    for task in tasks {
        let _ = task.await;
    }
    Ok(())
}
