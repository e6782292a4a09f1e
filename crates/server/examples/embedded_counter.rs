//! Three Conclave nodes in one process replicating a counter of this program's own.
//!
//! ```sh
//! cargo run --release -p conclave-server --example embedded_counter
//! ```
//!
//! Each node runs the same Raft runtime as `conclave serve` (write-ahead log, peer transport
//! over loopback TCP, snapshots) with `Counter` as the replicated state machine. The program
//! increments through the leader, stops the leader, watches a survivor take over and goes on
//! counting from where the old leader left off.

use std::net::TcpListener;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use conclave_server::{Error, MachineError, Node, NodeConfig, ReplicatedMachine};

/// The replicated state: one number.
#[derive(Default)]
struct Counter {
    value: i64,
}

/// What the program proposes. Reads need no command: `Node::read` runs a closure on the
/// machine once it is up to date.
enum CounterCommand {
    Add(i64),
}

/// Tags the entry's first byte, so new commands can be added later without confusing old
/// entries.
const ADD_TAG: u8 = 1;

impl ReplicatedMachine for Counter {
    type Command = CounterCommand;
    /// The counter's value after the command.
    type Output = i64;

    fn encode(command: CounterCommand) -> Vec<u8> {
        match command {
            CounterCommand::Add(delta) => {
                let mut entry = vec![ADD_TAG];
                entry.extend_from_slice(&delta.to_be_bytes());
                entry
            }
        }
    }

    fn apply(&mut self, _index: u64, entry: &[u8]) -> Result<i64, MachineError> {
        match entry.split_first() {
            Some((&ADD_TAG, delta)) => {
                self.value = self
                    .value
                    .wrapping_add(i64::from_be_bytes(delta.try_into()?));
                Ok(self.value)
            }
            _ => Err("not a counter command".into()),
        }
    }

    fn snapshot(&self) -> Vec<u8> {
        self.value.to_be_bytes().to_vec()
    }

    fn restore(&mut self, image: &[u8]) -> Result<(), MachineError> {
        self.value = i64::from_be_bytes(image.try_into()?);
        Ok(())
    }
}

/// Proposes through whichever node leads: a follower's answer names the leader, and during an
/// election there is none for a moment. (A real program forwards over its own connections.)
async fn add(nodes: &[Node<Counter>], delta: i64) -> Result<i64, Error> {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut target = 0;
    loop {
        match nodes[target].propose(CounterCommand::Add(delta)).await {
            Err(Error::NotLeader {
                leader: Some(leader),
            }) => {
                target = nodes.iter().position(|n| n.id() == leader).unwrap_or(0);
            }
            Err(Error::NotLeader { leader: None } | Error::NoLeader | Error::LeaderChanged)
                if Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            // Each addition is proposed once; a timeout would leave it unknown whether it
            // applied, so it is reported rather than retried.
            other => return other,
        }
    }
}

/// A loopback address nothing listens on right now.
fn free_address() -> std::io::Result<String> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.to_string())
}

async fn start(
    id: u64,
    root: &std::path::Path,
    members: &[(u64, String)],
) -> Result<Node<Counter>, Error> {
    let config = NodeConfig::new(id, root.join(format!("node-{id}")), members.to_vec());
    Node::builder(config, Counter::default())
        .on_leader(move |term| println!("  [node {id}] became leader (term {term})"))
        .on_follower(move |leader, term| {
            println!("  [node {id}] following node {leader} (term {term})")
        })
        .start()
        .await
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root: PathBuf =
        std::env::temp_dir().join(format!("conclave-counter-{}", std::process::id()));
    let members: Vec<(u64, String)> = (1..=3)
        .map(|id| Ok((id, free_address()?)))
        .collect::<std::io::Result<_>>()?;
    println!("starting 3 nodes, data in {}", root.display());
    for (id, address) in &members {
        println!("  node {id}: peers connect to {address}");
    }
    let mut nodes = Vec::new();
    for (id, _) in &members {
        nodes.push(start(*id, &root, &members).await?);
    }

    let leader = nodes[0].wait_for_leader().await?;
    println!("node {leader} leads");
    for _ in 0..10 {
        add(&nodes, 1).await?;
    }
    let follower = nodes
        .iter()
        .find(|n| n.id() != leader)
        .ok_or("no follower")?;
    match follower.propose(CounterCommand::Add(1)).await {
        Err(Error::NotLeader { leader: hint }) => {
            println!(
                "node {} refuses a proposal: not leader, leader is {hint:?}",
                follower.id()
            )
        }
        other => println!("node {} answered {:?}", follower.id(), other.map(|_| ())),
    }
    for node in &nodes {
        let value = node.read(|counter| counter.value).await?;
        println!("node {} reads {value} (linearizable)", node.id());
    }

    println!("stopping the leader, node {leader}");
    let position = nodes
        .iter()
        .position(|n| n.id() == leader)
        .ok_or("leader gone")?;
    let stopped = nodes.remove(position);
    // A survivor's role changes from here on tell when another node leads.
    let mut roles = nodes[0].roles();
    let stop_began = Instant::now();
    stopped.shutdown().await?;
    let next = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(change) = roles.next().await {
            match change.leader {
                Some(next) if next != leader => return Some(next),
                _ => {}
            }
        }
        None
    })
    .await?
    .ok_or("node stopped")?;
    println!(
        "node {next} leads, {:?} after the stop began",
        stop_began.elapsed()
    );

    for _ in 0..10 {
        add(&nodes, 1).await?;
    }
    for node in &nodes {
        let value = node.read(|counter| counter.value).await?;
        println!(
            "node {} reads {value}: nothing lost across the failover",
            node.id()
        );
        if value != 20 {
            return Err(format!("node {} counted {value}, not 20", node.id()).into());
        }
    }

    for node in nodes {
        node.shutdown().await?;
    }
    std::fs::remove_dir_all(&root)?;
    println!("done");
    Ok(())
}
