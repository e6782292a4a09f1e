//! Conclave's fault suite: real `conclave serve` processes in network namespaces, a nemesis
//! (partitions, kill -9, SIGSTOP, clock skew, member replacement), client workloads with
//! recorded histories, and checkers of our own (linearizability, fencing, leases, watches,
//! topics, work queues). See `docs/faults.md`.

pub mod checkers;
pub mod cluster;
pub mod history;
pub mod nemesis;
pub mod net;
pub mod rng;
pub mod tls;
pub mod workloads;

/// Errors of the harness itself (not anomalies: those are results).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error("`{command}` failed: {stderr}")]
    Command { command: String, stderr: String },
    #[error("{file} line {line}: {reason}")]
    BadHistory {
        file: String,
        line: usize,
        reason: String,
    },
    #[error("{0}")]
    Usage(String),
    #[error("the cluster did not come up: {0}")]
    Cluster(String),
}

impl Error {
    /// Stable code of the error, for scripts.
    pub fn code(&self) -> &'static str {
        match self {
            Error::Io { .. } => "io",
            Error::Command { .. } => "command_failed",
            Error::BadHistory { .. } => "bad_history",
            Error::Usage(_) => "usage",
            Error::Cluster(_) => "cluster",
        }
    }
}
