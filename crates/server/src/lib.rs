//! Conclave's server.
//!
//! So far this crate holds the peer transport ([`transport`]) and the crate's error type
//! ([`Error`]). The runtime that drives the Raft core, persists, applies and answers, and the
//! client APIs (etcd v3 and conclave.v1 over gRPC) are to come.

pub mod error;
pub mod transport;

pub use error::Error;
