//! Conclave's server: a Raft node that serves the etcd v3 gRPC API, and a library that runs
//! a node replicating a state machine of your own inside your program ([`embed`]).
//!
//! # Layout
//! - [`config`]: [`ServerConfig`], members and limits.
//! - [`machine`]: [`ReplicatedMachine`], what the runtime replicates.
//! - [`node`]: the Raft driver (one thread: WAL, transport, machine, waiters), generic over the
//!   machine, and the [`node::NodeHandle`] of the coordination machine the API talks to.
//! - [`embed`]: [`Node`], a node of your own machine with a small config, role callbacks and
//!   linearizable reads; `examples/embedded_counter.rs` runs three of them.
//! - [`api`]: etcd's KV, Maintenance and Cluster services; forwarding to the leader.
//! - [`server`]: [`server::run`], which wires listeners, transport, driver and services.
//! - [`transport`]: the peer transport (framed TCP).
//! - [`authority`]: repairs a URL-valued HTTP/2 `:authority` on client connections.
//! - [`metrics`], [`http`], [`observe`]: Prometheus metrics, `/health` and `/readyz`, the
//!   `/ui` dashboard and the overview `conclave top` shows (docs/operations.md).
//! - [`error`]: the crate's [`Error`].
//!
//! See `docs/server.md` for running a cluster.

pub mod api;
pub mod authority;
pub mod compactor;
pub mod config;
pub mod embed;
pub mod error;
pub mod http;
pub mod machine;
pub mod metrics;
pub mod node;
pub mod observe;
pub mod server;
pub mod tls;
pub mod transport;

pub use config::{Member, ServerConfig};
pub use embed::{Node, NodeBuilder, NodeConfig, Role, RoleChange, RoleEvents};
pub use error::Error;
pub use machine::{FrozenImage, MachineError, ReplicatedMachine};
