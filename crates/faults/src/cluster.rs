//! The members: `conclave serve` processes started, killed, paused and restarted by the
//! harness.

use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::Duration;

use conclave_proto::etcdserverpb::StatusRequest;
use conclave_proto::etcdserverpb::maintenance_client::MaintenanceClient;

use crate::Error;
use crate::net::Net;
use crate::tls::{self, RunTls};

/// Peer secret every member of a run shares.
const PEER_SECRET: &str = "conclave-faults-peer-secret-0123456789";
/// How long one status probe may take.
const STATUS_TIMEOUT: Duration = Duration::from_millis(500);

pub struct Member {
    /// Raft member id: the founding id (index + 1) until the member nemesis replaces the
    /// member, then the id MemberAdd gave its replacement.
    pub id: u64,
    /// Started with `--initial-cluster-state existing` (a replacement that joined later).
    pub joined: bool,
    /// A learner not promoted yet.
    pub learner: bool,
    child: Option<Child>,
    pub paused: bool,
    /// Rate of the member's wall clock from its next start (`None`: the real clock).
    pub clock_rate: Option<f64>,
    /// Times the member's process was started.
    starts: u64,
}

/// Which members serve reads from a leader lease (`run --lease-reads`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LeaseReads {
    Off,
    All,
    /// On at a member's first start if its index is even, then the other way at each restart.
    Mixed,
}

impl LeaseReads {
    /// Whether the member at `index` starts with lease reads the `start`-th time (from 0).
    pub fn at_start(self, index: usize, start: u64) -> bool {
        match self {
            LeaseReads::Off => false,
            LeaseReads::All => true,
            LeaseReads::Mixed => (index as u64 + start).is_multiple_of(2),
        }
    }
}

pub struct Cluster {
    pub net: Net,
    pub members: Vec<Member>,
    binary: PathBuf,
    root: PathBuf,
    pub election_timeout_ms: u64,
    /// Client TLS and peer mutual TLS on every member (`run --tls`).
    pub tls: Option<RunTls>,
    /// The cluster id from the first MemberAdd answer, which replacements join with
    /// (`--initial-cluster-id`).
    pub cluster_id: Option<u64>,
    lease_reads: LeaseReads,
}

impl Cluster {
    pub fn start(
        net: Net,
        binary: PathBuf,
        root: PathBuf,
        election_timeout_ms: u64,
        clock_rate: Option<f64>,
        with_tls: bool,
        lease_reads: LeaseReads,
    ) -> Result<Cluster, Error> {
        std::fs::create_dir_all(&root).map_err(|source| Error::Io {
            what: format!("create {}", root.display()),
            source,
        })?;
        std::fs::write(root.join("peer-secret"), PEER_SECRET).map_err(|source| Error::Io {
            what: "write the peer secret".into(),
            source,
        })?;
        let tls = if with_tls {
            let hosts: Vec<String> = net.places.iter().map(|p| p.host.clone()).collect();
            Some(RunTls::create(&binary, root.join("tls"), &hosts)?)
        } else {
            None
        };
        let members = (1..=net.places.len() as u64)
            .map(|id| Member {
                id,
                joined: false,
                learner: false,
                child: None,
                paused: false,
                clock_rate,
                starts: 0,
            })
            .collect();
        let mut cluster = Cluster {
            net,
            members,
            binary,
            root,
            election_timeout_ms,
            tls,
            cluster_id: None,
            lease_reads,
        };
        for index in 0..cluster.members.len() {
            cluster.spawn(index)?;
        }
        Ok(cluster)
    }

    pub fn client_endpoints(&self) -> Vec<String> {
        self.net
            .places
            .iter()
            .map(|p| p.client_addr.clone())
            .collect()
    }

    /// (Re)starts member `index` (0-based) over its data directory.
    pub fn spawn(&mut self, index: usize) -> Result<(), Error> {
        let places = &self.net.places;
        let id = self.members[index].id;
        let joined = self.members[index].joined;
        // Founders get the founding list exactly as they were first started (the cluster id
        // derives from it). A replacement gets the members as they are now, itself included,
        // and the cluster id apart: with the founding list it could not answer a leader that
        // joined after the founders (it would know that address under a founder's id) until a
        // founder sent it a snapshot, so learners waited for a founder to lead.
        let listed_id = |i: usize| {
            if joined {
                self.members[i].id
            } else {
                i as u64 + 1
            }
        };
        let initial = (0..places.len())
            .map(|i| format!("{}={}", listed_id(i), places[i].peer_addr))
            .collect::<Vec<_>>()
            .join(",");
        let clients = (0..places.len())
            .map(|i| format!("{}={}", listed_id(i), places[i].client_addr))
            .collect::<Vec<_>>()
            .join(",");
        let join_args = match (joined, self.cluster_id) {
            (true, Some(cluster_id)) => vec![
                "--initial-cluster-id".to_string(),
                format!("{cluster_id:x}"),
            ],
            _ => Vec::new(),
        };
        let log_path = self.root.join(format!("member{id}.log"));
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|source| Error::Io {
                what: format!("open {}", log_path.display()),
                source,
            })?;
        let log_err = log.try_clone().map_err(|source| Error::Io {
            what: "clone the log handle".into(),
            source,
        })?;
        let tls_args = match &self.tls {
            Some(tls) => tls.serve_args(index, id, &places[index].host)?,
            None => Vec::new(),
        };
        let mut command = self.net.command(index, &self.binary);
        if let Some(rate) = self.members[index].clock_rate {
            command.env("CONCLAVE_FAULTS_CLOCK_RATE", rate.to_string());
        }
        let start = self.members[index].starts;
        self.members[index].starts += 1;
        command.env(
            "CONCLAVE_LEASE_READS",
            self.lease_reads.at_start(index, start).to_string(),
        );
        let child = command
            .arg("serve")
            .args(["--id", &id.to_string()])
            .arg("--data-dir")
            .arg(self.root.join(format!("member{id}")))
            .args(["--listen-client", &places[index].client_addr])
            .args(["--listen-peer", &places[index].peer_addr])
            .args(["--initial-cluster", &initial])
            .args(["--initial-cluster-clients", &clients])
            .args(&join_args)
            // Snapshots every 500 entries whatever the state's size, so that faults meet
            // snapshots being written, sent and installed often.
            .args(["--snapshot-entries", "500"])
            .args(["--snapshot-log-percent", "0"])
            .args([
                "--initial-cluster-state",
                if joined { "existing" } else { "new" },
            ])
            .args([
                "--election-timeout-ms",
                &self.election_timeout_ms.to_string(),
            ])
            .arg("--peer-secret-file")
            .arg(self.root.join("peer-secret"))
            .args(&tls_args)
            .env("CONCLAVE_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log_err))
            .spawn()
            .map_err(|source| Error::Io {
                what: format!("start {}", self.binary.display()),
                source,
            })?;
        self.members[index].child = Some(child);
        self.members[index].paused = false;
        Ok(())
    }

    fn signal(&self, index: usize, signal: i32) -> bool {
        match &self.members[index].child {
            Some(child) => {
                let pid = i32::try_from(child.id()).unwrap_or(0);
                // SAFETY: kill(2) on our own child, which we have not reaped yet.
                pid > 0 && unsafe { libc::kill(pid, signal) } == 0
            }
            None => false,
        }
    }

    /// kill -9; the member stays down until [`Cluster::spawn`].
    pub fn kill(&mut self, index: usize) {
        self.signal(index, libc::SIGKILL);
        if let Some(mut child) = self.members[index].child.take() {
            let _ = child.wait();
        }
        self.members[index].paused = false;
    }

    pub fn pause(&mut self, index: usize) -> bool {
        let done = self.signal(index, libc::SIGSTOP);
        self.members[index].paused |= done;
        done
    }

    pub fn resume(&mut self, index: usize) {
        self.signal(index, libc::SIGCONT);
        self.members[index].paused = false;
    }

    pub fn is_up(&self, index: usize) -> bool {
        self.members[index].child.is_some()
    }

    /// Exited members (a crash the nemesis did not cause), with their exit status.
    pub fn exited(&mut self) -> Vec<(u64, String)> {
        let mut out = Vec::new();
        for member in &mut self.members {
            if let Some(child) = &mut member.child
                && let Ok(Some(status)) = child.try_wait()
            {
                out.push((member.id, status.to_string()));
                member.child = None;
            }
        }
        out
    }

    /// The leader's index as one reachable, unpaused member reports it.
    pub async fn leader(&self) -> Option<usize> {
        for (index, place) in self.net.places.iter().enumerate() {
            if !self.is_up(index) || self.members[index].paused {
                continue;
            }
            let Some(endpoint) = tls::endpoint(&place.client_addr, self.client_tls()) else {
                continue;
            };
            let status = tokio::time::timeout(STATUS_TIMEOUT, async move {
                let channel = endpoint.connect().await.ok()?;
                MaintenanceClient::new(channel)
                    .status(StatusRequest {})
                    .await
                    .ok()
            })
            .await
            .ok()
            .flatten();
            if let Some(status) = status {
                let leader = status.into_inner().leader;
                if let Some(index) = self.members.iter().position(|m| m.id == leader) {
                    return Some(index);
                }
            }
        }
        None
    }

    /// Whether member `index`'s data directory exists already. A replacement's id is new, so
    /// its directory must not: one that does means MemberAdd gave an id twice.
    pub fn has_data_dir(&self, index: usize) -> bool {
        self.root
            .join(format!("member{}", self.members[index].id))
            .exists()
    }

    /// What the harness's clients present and trust, when the run uses TLS.
    pub fn client_tls(&self) -> Option<&conclave_client::TlsOptions> {
        self.tls.as_ref().map(|t| &t.client)
    }

    pub fn log_dir(&self) -> &std::path::Path {
        &self.root
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for index in 0..self.members.len() {
            self.kill(index);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::LeaseReads;

    #[test]
    fn mixed_lease_reads_flip_at_every_restart_and_differ_between_neighbours() {
        let mixed = |index| (0..4).map(move |start| LeaseReads::Mixed.at_start(index, start));
        assert_eq!(mixed(0).collect::<Vec<_>>(), [true, false, true, false]);
        assert_eq!(mixed(1).collect::<Vec<_>>(), [false, true, false, true]);
        assert!((0..4).all(|start| LeaseReads::All.at_start(2, start)));
        assert!((0..4).all(|start| !LeaseReads::Off.at_start(2, start)));
    }
}
