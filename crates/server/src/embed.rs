//! Running a Raft node inside your own program, replicating your own state machine.
//!
//! The node is the same runtime `conclave serve` uses (write-ahead log with group commit,
//! pipelined peer transport, ReadIndex reads, snapshots and log compaction, leadership
//! transfer on shutdown) with a [`ReplicatedMachine`] of yours in place of Conclave's
//! coordination state machine, and no gRPC API: your program talks to the node directly.
//!
//! ```no_run
//! use conclave_server::{MachineError, Node, NodeConfig, ReplicatedMachine};
//!
//! #[derive(Default)]
//! struct Counter { value: i64 }
//!
//! impl ReplicatedMachine for Counter {
//!     type Command = i64;
//!     type Output = i64;
//!     fn encode(delta: i64) -> Vec<u8> { delta.to_be_bytes().to_vec() }
//!     fn apply(&mut self, _index: u64, entry: &[u8]) -> Result<i64, MachineError> {
//!         self.value += i64::from_be_bytes(entry.try_into()?);
//!         Ok(self.value)
//!     }
//!     fn snapshot(&self) -> Vec<u8> { self.value.to_be_bytes().to_vec() }
//!     fn restore(&mut self, image: &[u8]) -> Result<(), MachineError> {
//!         self.value = i64::from_be_bytes(image.try_into()?);
//!         Ok(())
//!     }
//! }
//!
//! # async fn run() -> Result<(), conclave_server::Error> {
//! let members = [(1, "10.0.0.1:7000"), (2, "10.0.0.2:7000"), (3, "10.0.0.3:7000")];
//! let config = NodeConfig::new(1, "/var/lib/counter", members);
//! let node = Node::builder(config, Counter::default())
//!     .on_leader(|term| println!("leading in term {term}"))
//!     .on_follower(|leader, term| println!("following node {leader} in term {term}"))
//!     .start()
//!     .await?;
//! match node.propose(5).await {
//!     Ok(value) => println!("counter is now {value}"),
//!     // Forwarding is the program's business: send the command to `leader` its own way.
//!     Err(conclave_server::Error::NotLeader { leader }) => println!("ask node {leader:?}"),
//!     Err(other) => return Err(other),
//! }
//! let value = node.read(|counter| counter.value).await?; // linearizable, on any member
//! node.shutdown().await // a leader hands over to a follower first
//! # }
//! ```

use std::convert::Infallible;
use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

pub use conclave_raft::{NodeId, Role};
use tokio::sync::{broadcast, mpsc, oneshot};

use crate::config::{DEFAULT_SNAPSHOT_ENTRIES, Member, ServerConfig};
use crate::error::Error;
use crate::machine::ReplicatedMachine;
use crate::node::NodeStatus;
use crate::node::core::Duties;
use crate::node::driver::{self, Core, Handle, ShellDuties, Waiters};
use crate::transport::{PeerListenerState, PeerTransport, bind_peer_listener, serve_peers_with};

/// The default heartbeat interval (as `conclave serve`'s `--heartbeat-ms`).
pub const DEFAULT_HEARTBEAT_MS: u64 = 50;
/// The default election timeout T; a follower campaigns after [T, 2T) without a leader.
pub const DEFAULT_ELECTION_TIMEOUT_MS: u64 = 150;
/// The default length of one Raft tick; heartbeat and election timeout are whole ticks.
pub const DEFAULT_TICK_MS: u64 = 10;
/// The default bound on how long [`Node::propose`], [`Node::read`] and
/// [`Node::wait_for_leader`] wait.
pub const DEFAULT_REQUEST_TIMEOUT_MS: u64 = 5_000;
/// Role changes a [`RoleEvents`] reader may fall behind before it skips the oldest.
const ROLE_EVENTS_BUFFER_MAX: usize = 1024;

/// How to start an embedded node. Times are in milliseconds.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// This node's id; must be one of `members`. Ids are never 0.
    pub id: NodeId,
    /// Where the write-ahead log and snapshots live; one node per directory.
    pub data_dir: PathBuf,
    /// Where this node accepts its peers' connections. [`NodeConfig::new`] takes this node's
    /// address from `members`; set it to listen elsewhere (`0.0.0.0:7000`, say).
    pub listen_peer: String,
    /// The founding members, this node included: id and the `host:port` peers dial. Every
    /// member must be started with the same list; a fresh data directory is bootstrapped from
    /// it, a used one keeps its own membership.
    pub members: Vec<(NodeId, String)>,
    pub heartbeat_ms: u64,
    pub election_timeout_ms: u64,
    pub tick_ms: u64,
    /// Snapshot the machine and compact the log every this many applied entries.
    pub snapshot_entries: u64,
    /// How long [`Node::propose`], [`Node::read`] and [`Node::wait_for_leader`] wait.
    pub request_timeout_ms: u64,
    /// How long a leader shutting down waits for its successor before it just stops.
    pub shutdown_transfer_timeout_ms: u64,
}

impl NodeConfig {
    /// Node `id` of the cluster `members` (id, peer address; this node included), keeping its
    /// data in `data_dir`, with `conclave serve`'s timing defaults.
    pub fn new<A: Into<String>>(
        id: NodeId,
        data_dir: impl Into<PathBuf>,
        members: impl IntoIterator<Item = (NodeId, A)>,
    ) -> Self {
        let members: Vec<(NodeId, String)> = members
            .into_iter()
            .map(|(id, address)| (id, address.into()))
            .collect();
        let listen_peer = members
            .iter()
            .find(|(member, _)| *member == id)
            .map(|(_, address)| address.clone())
            .unwrap_or_default();
        NodeConfig {
            id,
            data_dir: data_dir.into(),
            listen_peer,
            members,
            heartbeat_ms: DEFAULT_HEARTBEAT_MS,
            election_timeout_ms: DEFAULT_ELECTION_TIMEOUT_MS,
            tick_ms: DEFAULT_TICK_MS,
            snapshot_entries: DEFAULT_SNAPSHOT_ENTRIES,
            request_timeout_ms: DEFAULT_REQUEST_TIMEOUT_MS,
            shutdown_transfer_timeout_ms: 1_000,
        }
    }

    /// The runtime's configuration, checked; one sentence naming the first bad value.
    fn server_config(&self) -> Result<ServerConfig, Error> {
        let invalid = |reason: String| Err(Error::InvalidConfig { reason });
        if self.tick_ms == 0 {
            return invalid("tick_ms must be at least 1".into());
        }
        if self.heartbeat_ms < self.tick_ms {
            return invalid(format!(
                "heartbeat_ms ({}) must be at least one tick ({} ms)",
                self.heartbeat_ms, self.tick_ms
            ));
        }
        if self.listen_peer.is_empty() {
            return invalid(format!(
                "node {} has no peer address: it is not in the initial members",
                self.id
            ));
        }
        let mut config = ServerConfig::single(&self.data_dir, "", &self.listen_peer);
        config.id = self.id;
        config.members = self
            .members
            .iter()
            .map(|(id, address)| Member {
                id: *id,
                name: format!("node-{id}"),
                peer_addr: address.clone(),
                client_addr: String::new(),
            })
            .collect();
        config.tick_ms = self.tick_ms;
        config.heartbeat_ticks = self.heartbeat_ms / self.tick_ms;
        config.election_ticks = self.election_timeout_ms / self.tick_ms;
        config.snapshot_entries = self.snapshot_entries;
        config.request_timeout_ms = self.request_timeout_ms;
        config.shutdown_transfer_timeout_ms = self.shutdown_transfer_timeout_ms;
        config.validate()?;
        Ok(config)
    }
}

/// The node's role changed, or the leader it knows of did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoleChange {
    pub role: Role,
    /// The leader this node knows of (itself when it leads); `None` during an election.
    pub leader: Option<NodeId>,
    pub term: u64,
}

/// Role changes from the moment [`Node::roles`] was called, in order.
pub struct RoleEvents {
    receiver: broadcast::Receiver<RoleChange>,
}

impl RoleEvents {
    /// The next change; `None` once the node has stopped. A reader that falls more than
    /// 1024 changes behind skips the oldest ones.
    pub async fn next(&mut self) -> Option<RoleChange> {
        loop {
            match self.receiver.recv().await {
                Ok(change) => return Some(change),
                Err(broadcast::error::RecvError::Lagged(_)) => continue,
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    }
}

type LeaderCallback = Box<dyn FnMut(u64) + Send>;
type FollowerCallback = Box<dyn FnMut(NodeId, u64) + Send>;

/// Starts a [`Node`] with callbacks: see [`Node::builder`].
pub struct NodeBuilder<M> {
    config: NodeConfig,
    machine: M,
    on_leader: Option<LeaderCallback>,
    on_follower: Option<FollowerCallback>,
}

impl<M: ReplicatedMachine> NodeBuilder<M> {
    /// Called with the term each time this node becomes the leader.
    pub fn on_leader(mut self, callback: impl FnMut(u64) + Send + 'static) -> Self {
        self.on_leader = Some(Box::new(callback));
        self
    }

    /// Called with the leader's id and the term each time this node starts following a
    /// leader (after it led, after an election, or when it first hears of one).
    pub fn on_follower(mut self, callback: impl FnMut(NodeId, u64) + Send + 'static) -> Self {
        self.on_follower = Some(Box::new(callback));
        self
    }

    /// Opens the data directory, restores the machine from the newest snapshot, replays the
    /// log after it, binds the peer listener and starts the node. Must run inside a Tokio
    /// runtime with IO and timers enabled (the peer connections live on it). Fails with one
    /// sentence on a bad configuration, a peer address in use or a data directory that is
    /// already open or damaged.
    pub async fn start(self) -> Result<Node<M>, Error> {
        let NodeBuilder {
            config,
            machine,
            mut on_leader,
            mut on_follower,
        } = self;
        let server_config = config.server_config()?;
        let listener = bind_peer_listener(&server_config.listen_peer).await?;
        let transport_config = crate::server::transport_config(&server_config)?;
        let transport = PeerTransport::new(transport_config.clone())?;
        let (inbound_sender, inbound) = mpsc::channel(server_config.driver_queue_messages_max);
        let (roles, _) = broadcast::channel(ROLE_EVENTS_BUFFER_MAX);
        // Subscribed before the driver starts, so the callbacks see every change.
        let mut callback_events = RoleEvents {
            receiver: roles.subscribe(),
        };
        let duties = RoleDuties {
            roles: roles.clone(),
            last: None,
        };
        let (stop_driver, driver_stopped) = oneshot::channel();
        let (handle, driver) = driver::spawn(
            server_config,
            machine,
            duties,
            transport,
            inbound,
            driver_stopped,
        )?;
        let (stop_peers, peers_stopped) = oneshot::channel::<()>();
        // As `serve` does: plain-TCP peer connections are read on the driver's thread, so a
        // peer's message wakes the driver directly rather than a worker that hands it over.
        let listener_state = PeerListenerState::new();
        listener_state.receive_on(handle.driver_runtime.clone());
        let peers = tokio::spawn(async move {
            let stopped = async move {
                let _ = peers_stopped.await;
            };
            if let Err(error) = serve_peers_with(
                listener,
                transport_config,
                inbound_sender,
                listener_state,
                stopped,
            )
            .await
            {
                tracing::warn!(%error, "peer listener stopped");
            }
        });
        let callbacks = tokio::spawn(async move {
            while let Some(change) = callback_events.next().await {
                match (change.role, change.leader) {
                    (Role::Leader, _) => {
                        if let Some(callback) = on_leader.as_mut() {
                            callback(change.term);
                        }
                    }
                    (Role::Follower, Some(leader)) => {
                        if let Some(callback) = on_follower.as_mut() {
                            callback(leader, change.term);
                        }
                    }
                    _ => {}
                }
            }
        });
        Ok(Node {
            id: config.id,
            handle,
            roles: Some(roles),
            request_timeout: Duration::from_millis(config.request_timeout_ms),
            shutdown_transfer_timeout: Duration::from_millis(config.shutdown_transfer_timeout_ms),
            running: Some(Running {
                stop_driver,
                driver,
                stop_peers,
                peers,
                callbacks,
            }),
        })
    }
}

/// One member of a cluster replicating `M`, running in this process. See the module
/// documentation for an example and `examples/embedded_counter.rs` for a whole cluster.
///
/// Dropping a node stops it at once; [`Node::shutdown`] stops it gracefully.
pub struct Node<M: ReplicatedMachine> {
    id: NodeId,
    handle: Handle<M, Infallible>,
    /// Kept to subscribe new role readers; dropped on shutdown so they see the end.
    roles: Option<broadcast::Sender<RoleChange>>,
    request_timeout: Duration,
    shutdown_transfer_timeout: Duration,
    running: Option<Running>,
}

/// What a running node owns besides its handle.
struct Running {
    stop_driver: oneshot::Sender<()>,
    driver: driver::DriverThread,
    stop_peers: oneshot::Sender<()>,
    peers: tokio::task::JoinHandle<()>,
    callbacks: tokio::task::JoinHandle<()>,
}

impl<M: ReplicatedMachine> Node<M> {
    /// Starts node `config.id` over `machine` (its state before the first entry) without
    /// callbacks; see [`NodeBuilder::start`].
    pub async fn start(config: NodeConfig, machine: M) -> Result<Node<M>, Error> {
        Node::builder(config, machine).start().await
    }

    /// A node to start with [`NodeBuilder::start`] once callbacks are attached. Callbacks run
    /// one at a time, in the order of the changes, on a task of the runtime that started the
    /// node; keep them short (spawn anything long).
    pub fn builder(config: NodeConfig, machine: M) -> NodeBuilder<M> {
        NodeBuilder {
            config,
            machine,
            on_leader: None,
            on_follower: None,
        }
    }

    /// This node's id.
    pub fn id(&self) -> NodeId {
        self.id
    }

    /// Replicates `command` and answers what applying it produced, once it is applied on this
    /// node. Only the leader accepts proposals: elsewhere this fails at once with
    /// [`Error::NotLeader`] naming the leader if one is known, and the program forwards the
    /// command to it. [`Error::LeaderChanged`] means the proposal was lost to a leader change,
    /// [`Error::Raft`] with `TransferInProgress` that the leader is handing over (ask again
    /// shortly), and [`Error::Timeout`] that it was not applied in time (it may still be):
    /// retry only commands that are safe to apply twice, or make them so.
    pub async fn propose(&self, command: M::Command) -> Result<M::Output, Error> {
        let applied = self.bounded(self.handle.propose(command)).await?;
        Ok(applied.output)
    }

    /// Runs `read` against the machine once it reflects every command committed before the
    /// call (a ReadIndex round through the leader, as etcd's linearizable reads). Works on any
    /// member; fails with [`Error::NoLeader`] or [`Error::LeaderChanged`] while there is no
    /// leader to confirm it.
    pub async fn read<T>(&self, read: impl FnOnce(&M) -> T) -> Result<T, Error> {
        self.bounded(self.handle.read_index()).await?;
        Ok(self.handle.read_state(read))
    }

    /// Runs `read` against this node's machine as it is now, without asking the leader: it
    /// may miss the latest commands (a serializable read).
    pub fn read_local<T>(&self, read: impl FnOnce(&M) -> T) -> T {
        self.handle.read_state(read)
    }

    /// Whether this node is the leader now.
    pub fn is_leader(&self) -> bool {
        self.handle.status.borrow().role == Some(Role::Leader)
    }

    /// The leader this node knows of.
    pub fn leader(&self) -> Option<NodeId> {
        self.handle.status.borrow().leader
    }

    /// Role, term, commit and applied index, members, and whether the node stopped.
    pub fn status(&self) -> NodeStatus {
        self.handle.status()
    }

    /// Waits until this node knows a leader and returns its id.
    pub async fn wait_for_leader(&self) -> Result<NodeId, Error> {
        let mut status = self.handle.status.clone();
        let wait = async move {
            loop {
                let (leader, stopped) = {
                    let current = status.borrow_and_update();
                    (current.leader, current.stopped.is_some())
                };
                match leader {
                    Some(leader) => return Ok(leader),
                    None if stopped => return Err(Error::Stopped),
                    None => status.changed().await.map_err(|_| Error::Stopped)?,
                }
            }
        };
        self.bounded(wait).await
    }

    /// Role changes from now on (the current role is [`Node::is_leader`] / [`Node::leader`]).
    pub fn roles(&self) -> RoleEvents {
        let receiver = match &self.roles {
            Some(roles) => roles.subscribe(),
            // Unreachable while the node is usable; a closed stream is the honest answer.
            None => broadcast::channel(1).1,
        };
        RoleEvents { receiver }
    }

    /// Asks the leader to hand leadership to `target` (the leader answers; elsewhere this
    /// fails with [`Error::NotLeader`]).
    pub async fn transfer_leader(&self, target: NodeId) -> Result<(), Error> {
        self.bounded(self.handle.transfer_leader(target)).await
    }

    /// Stops the node. A leader first hands leadership to its most up-to-date follower and
    /// waits for it (up to `shutdown_transfer_timeout_ms`), still running, so the cluster goes
    /// on without an election timeout. Returns the driver's fatal error if it had stopped on
    /// one.
    pub async fn shutdown(mut self) -> Result<(), Error> {
        let Some(running) = self.running.take() else {
            return Ok(());
        };
        // As `conclave serve` does: the driver keeps running (as a follower) until the
        // successor leads, so proposals in flight here still get their answers.
        if let Ok(true) = self.handle.hand_off().await {
            let mut status = self.handle.status.clone();
            let handed_over =
                status.wait_for(|s| s.stopped.is_some() || s.role != Some(Role::Leader));
            if tokio::time::timeout(self.shutdown_transfer_timeout, handed_over)
                .await
                .is_err()
            {
                tracing::warn!("leadership not handed over in time; stopping as leader");
            }
        }
        let _ = running.stop_driver.send(());
        let driver = running.driver;
        let result = tokio::task::spawn_blocking(move || driver.join())
            .await
            .map_err(|e| Error::RaftStart(format!("driver task: {e}")))?
            .unwrap_or_else(|_| Err(Error::RaftStart("the Raft driver panicked".into())));
        let _ = running.stop_peers.send(());
        let _ = running.peers.await;
        // The driver's copy went with it; once ours goes the callbacks see the end.
        self.roles = None;
        let _ = running.callbacks.await;
        result
    }

    async fn bounded<T>(&self, work: impl Future<Output = Result<T, Error>>) -> Result<T, Error> {
        tokio::time::timeout(self.request_timeout, work)
            .await
            .unwrap_or(Err(Error::Timeout))
    }
}

impl<M: ReplicatedMachine> Drop for Node<M> {
    fn drop(&mut self) {
        if let Some(running) = self.running.take() {
            // The driver also stops when its last handle (this one) goes.
            let _ = running.stop_driver.send(());
            let _ = running.stop_peers.send(());
        }
    }
}

/// An embedded node's only duty: report role changes to the callbacks and [`RoleEvents`].
struct RoleDuties {
    roles: broadcast::Sender<RoleChange>,
    last: Option<(Role, Option<NodeId>)>,
}

impl<M: ReplicatedMachine> ShellDuties<M> for RoleDuties {
    type Request = Infallible;

    fn request(
        &mut self,
        _core: &mut Core<M>,
        _waiters: &mut Waiters<M::Output>,
        request: Infallible,
    ) {
        match request {}
    }
}

impl<M: ReplicatedMachine> Duties<M, conclave_storage::WalStorage> for RoleDuties {
    fn role_changed(&mut self, role: Role, leader: Option<NodeId>, term: u64) {
        // A term change alone is not news to the program.
        if self.last == Some((role, leader)) {
            return;
        }
        self.last = Some((role, leader));
        // No reader is fine.
        let _ = self.roles.send(RoleChange { role, leader, term });
    }
}
