//! Conclave's server. For now this is the peer transport only; the runtime that drives the
//! Raft core and the client APIs (etcd v3 and conclave.v1) are to come.

pub mod transport;
