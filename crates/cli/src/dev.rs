//! `conclave dev`: a local cluster for trying Conclave out.
//!
//! Node i (from 1) gets client port `base + 2(i-1)` and peer port `base + 2(i-1) + 1`, so the
//! first node is on etcd's ports 2379/2380 and `etcdctl` works without flags. One node runs in
//! this process; more run as child `conclave serve` processes, logging to `<data-dir>/node<i>.log`,
//! and are stopped with SIGTERM on Ctrl-C.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use clap::Args;

use crate::cluster_spec::CliError;
use crate::{ServeArgs, termination_signal};

/// Most nodes `dev` starts: a development cluster, not a deployment.
const DEV_NODES_MAX: u16 = 9;
/// How long stopped children get to hand over leadership and exit before SIGKILL.
const CHILD_STOP_GRACE_MS: u64 = 5_000;

#[derive(Args, Debug, Clone)]
pub struct DevArgs {
    /// How many nodes.
    #[arg(long, default_value_t = 1)]
    pub nodes: u16,
    /// Client port of node 1; node i uses base + 2(i-1) (client) and base + 2(i-1) + 1 (peer).
    #[arg(long, default_value_t = 2379)]
    pub base_port: u16,
    /// Data directory; node i keeps its data in `<dir>/node<i>`.
    #[arg(long, default_value = "./conclave-dev")]
    pub data_dir: PathBuf,
}

struct DevNode {
    id: u16,
    client: String,
    peer: String,
    data_dir: PathBuf,
}

fn layout(args: &DevArgs) -> Result<Vec<DevNode>, CliError> {
    if args.nodes == 0 || args.nodes > DEV_NODES_MAX {
        return Err(CliError::Usage(format!(
            "--nodes must be between 1 and {DEV_NODES_MAX}"
        )));
    }
    (1..=args.nodes)
        .map(|id| {
            let client_port = args
                .base_port
                .checked_add(2 * (id - 1))
                .and_then(|p| p.checked_add(1).map(|peer| (p, peer)))
                .ok_or_else(|| CliError::Usage("--base-port is too high for --nodes".into()))?;
            Ok(DevNode {
                id,
                client: format!("127.0.0.1:{}", client_port.0),
                peer: format!("127.0.0.1:{}", client_port.1),
                data_dir: args.data_dir.join(format!("node{id}")),
            })
        })
        .collect()
}

fn serve_args(node: &DevNode, initial_cluster: &str) -> ServeArgs {
    ServeArgs {
        name: format!("node{}", node.id),
        id: Some(node.id as u64),
        data_dir: node.data_dir.clone(),
        listen_client: node.client.clone(),
        listen_peer: node.peer.clone(),
        initial_cluster: Some(initial_cluster.to_string()),
        initial_cluster_clients: None,
        snapshot_entries: conclave_server::config::DEFAULT_SNAPSHOT_ENTRIES,
        tick_ms: 10,
        heartbeat_ms: 50,
        election_timeout_ms: 150,
        request_timeout_ms: 5_000,
    }
}

pub async fn run(args: DevArgs) -> Result<(), CliError> {
    let nodes = layout(&args)?;
    let initial_cluster: Vec<String> = nodes
        .iter()
        .map(|n| format!("{}={}", n.id, n.peer))
        .collect();
    let initial_cluster = initial_cluster.join(",");
    let endpoints: Vec<&str> = nodes.iter().map(|n| n.client.as_str()).collect();
    println!("Conclave dev cluster, {} node(s):", nodes.len());
    for node in &nodes {
        println!(
            "  node{}  client {}  peer {}  data {}",
            node.id,
            node.client,
            node.peer,
            node.data_dir.display()
        );
    }
    let endpoints = endpoints.join(",");
    println!("Connect with etcdctl (Debian package etcd-client):");
    println!("  ETCDCTL_API=3 etcdctl --endpoints={endpoints} put greeting hello");
    println!("  ETCDCTL_API=3 etcdctl --endpoints={endpoints} get greeting");
    println!("  ETCDCTL_API=3 etcdctl --endpoints={endpoints} endpoint status -w table");
    println!("Ctrl-C stops the cluster.");

    if nodes.len() == 1 {
        let config = serve_args(&nodes[0], &initial_cluster).to_config()?;
        conclave_server::server::run(config, termination_signal()).await?;
        return Ok(());
    }

    let exe = std::env::current_exe()
        .map_err(|e| CliError::Io(format!("cannot find the conclave binary: {e}")))?;
    std::fs::create_dir_all(&args.data_dir)
        .map_err(|e| CliError::Io(format!("cannot create {}: {e}", args.data_dir.display())))?;
    let mut children = Vec::new();
    for node in &nodes {
        let log_path = args.data_dir.join(format!("node{}.log", node.id));
        let log = std::fs::File::create(&log_path)
            .map_err(|e| CliError::Io(format!("cannot create {}: {e}", log_path.display())))?;
        let log_err = log
            .try_clone()
            .map_err(|e| CliError::Io(format!("cannot open {}: {e}", log_path.display())))?;
        let child = tokio::process::Command::new(&exe)
            .arg("serve")
            .arg("--id")
            .arg(node.id.to_string())
            .arg("--data-dir")
            .arg(&node.data_dir)
            .arg("--listen-client")
            .arg(&node.client)
            .arg("--listen-peer")
            .arg(&node.peer)
            .arg("--initial-cluster")
            .arg(&initial_cluster)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log_err))
            .spawn()
            .map_err(|e| CliError::Io(format!("cannot start node{}: {e}", node.id)))?;
        children.push(child);
    }
    termination_signal().await;
    for child in &children {
        if let Some(pid) = child.id() {
            // SAFETY: kill(2) on a pid we spawned and have not reaped; no memory is involved.
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGTERM);
            }
        }
    }
    for mut child in children {
        let waited =
            tokio::time::timeout(Duration::from_millis(CHILD_STOP_GRACE_MS), child.wait()).await;
        if waited.is_err() {
            let _ = child.kill().await;
        }
    }
    Ok(())
}
