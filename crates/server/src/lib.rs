//! Conclave's server: a Raft node that serves the etcd v3 gRPC API.
//!
//! # Layout
//! - [`config`]: [`ServerConfig`], members and limits.
//! - [`node`]: the Raft driver (one thread: WAL, transport, state machine, waiters) and the
//!   [`node::NodeHandle`] the API talks to.
//! - [`api`]: etcd's KV, Maintenance and Cluster services; forwarding to the leader.
//! - [`server`]: [`server::run`], which wires listeners, transport, driver and services.
//! - [`transport`]: the peer transport (framed TCP).
//! - [`authority`]: repairs a URL-valued HTTP/2 `:authority` on client connections.
//! - [`error`]: the crate's [`Error`].
//!
//! See `docs/server.md` for running a cluster.

pub mod api;
pub mod authority;
pub mod config;
pub mod error;
pub mod node;
pub mod server;
pub mod transport;

pub use config::{Member, ServerConfig};
pub use error::Error;
