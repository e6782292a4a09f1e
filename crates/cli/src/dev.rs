//! `conclave dev`: a local cluster of real `conclave serve` processes, with a live status.
//!
//! Node i (from 1) gets client port `base + 2(i-1)` and peer port `base + 2(i-1) + 1`, so the
//! first node is on etcd's ports 2379/2380 and `etcdctl` works without flags. Every node is a
//! child process logging to `<data-dir>/node<i>.log`. About once a second `dev` asks each node
//! for its own status (the probe `conclave status` uses) and shows it: redrawn in place on a
//! terminal when `dev` runs in the foreground, otherwise one plain line whenever the leader or
//! the set of answering nodes changes, so scripts and tests can follow it. A node that exits is shown as down and is not
//! restarted. SIGINT (Ctrl-C) or SIGTERM stops them all: SIGTERM, then SIGKILL after a grace
//! period (or at once on a second Ctrl-C).

use std::io::{IsTerminal, Read, Seek, SeekFrom, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use clap::Args;
use conclave_proto::etcdserverpb::StatusResponse;

use crate::cluster_spec::CliError;
use crate::cmd::Output;
use crate::cmd::cluster::{probe, reported_leader};
use crate::termination_signal;

/// Most nodes `dev` starts: a development cluster, not a deployment.
const DEV_NODES_MAX: u16 = 9;
/// Three nodes: the smallest cluster that survives losing one, so a failover can be watched.
const DEV_NODES_DEFAULT: u16 = 3;
/// How long stopped children get, all together, to hand over leadership and exit before
/// SIGKILL.
const CHILD_STOP_GRACE_MS: u64 = 5_000;
/// How often the nodes are asked for their status (and the screen redrawn).
const STATUS_INTERVAL_MS: u64 = 1_000;
/// How long one status probe may take: below the interval, so a hung node cannot stall the
/// others' rows.
const PROBE_TIMEOUT_MS: u64 = 700;
/// Longest error text in a screen cell, so each node keeps one line.
const SCREEN_ERROR_CHARS_MAX: usize = 40;
/// How long every node gets, from its start, to answer as itself on its client port; a node
/// that exits or stays silent meanwhile fails `dev` (a busy port, a bad data directory).
const DEV_START_TIMEOUT_MS: u64 = 30_000;
/// How often a starting node is checked.
const DEV_START_POLL_MS: u64 = 100;
/// How much of an exited node's log is read to show its last line.
const LOG_TAIL_BYTES: u64 = 4_096;

#[derive(Args, Debug, Clone)]
pub struct DevArgs {
    /// How many nodes (1 to 9).
    #[arg(long, default_value_t = DEV_NODES_DEFAULT)]
    pub nodes: u16,
    /// Client port of node 1; node i uses base + 2(i-1) (client) and base + 2(i-1) + 1 (peer).
    #[arg(long, default_value_t = 2379)]
    pub base_port: u16,
    /// Data directory; node i keeps its data in `<dir>/node<i>` and logs to `<dir>/node<i>.log`.
    #[arg(long, default_value = "./conclave-dev")]
    pub data_dir: PathBuf,
    /// TLS on both ports: a throwaway CA with server, peer and client certificates in
    /// `<dir>/tls` (made once, reused on later runs); clients must present the client
    /// certificate (`--client-cert-auth`), and members use mutual TLS between them.
    #[arg(long)]
    pub tls: bool,
}

/// The certificates of a `dev --tls` cluster.
struct DevTls {
    ca: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
    client_cert: PathBuf,
    client_key: PathBuf,
    /// `<dir>/tls`, where node i's peer certificate is `node<i>-peer.pem`.
    dir: PathBuf,
}

/// The common name of the client certificate `dev --tls` makes.
const DEV_CLIENT_NAME: &str = "dev-client";

impl DevTls {
    /// Makes the CA and certificates the first time, and finds them on later runs.
    fn ensure(data_dir: &Path, nodes: &[DevNode]) -> Result<DevTls, CliError> {
        let dir = data_dir.join("tls");
        let (ca, _) = crate::certs::ca_paths(&dir);
        let tls = DevTls {
            server_cert: dir.join("server-server.pem"),
            server_key: dir.join("server-server-key.pem"),
            client_cert: dir.join(format!("{DEV_CLIENT_NAME}-client.pem")),
            client_key: dir.join(format!("{DEV_CLIENT_NAME}-client-key.pem")),
            ca,
            dir,
        };
        if !tls.ca.exists() {
            crate::certs::init_ca(
                &tls.dir,
                "Conclave dev CA",
                crate::certs::CA_VALID_DAYS_DEFAULT,
            )?;
        }
        let localhost = [std::net::IpAddr::from([127, 0, 0, 1])];
        let localhost_dns = ["localhost".to_string()];
        let days = crate::certs::CERT_VALID_DAYS_DEFAULT;
        use crate::certs::CertKind;
        if !tls.server_cert.exists() {
            crate::certs::issue(
                &tls.dir,
                "server",
                CertKind::Server,
                &localhost,
                &localhost_dns,
                &tls.dir,
                None,
                days,
            )?;
        }
        if !tls.client_cert.exists() {
            crate::certs::issue(
                &tls.dir,
                DEV_CLIENT_NAME,
                CertKind::Client,
                &[],
                &[],
                &tls.dir,
                None,
                days,
            )?;
        }
        for node in nodes {
            if !tls.peer_cert(node).exists() {
                crate::certs::issue(
                    &tls.dir,
                    &node.name,
                    CertKind::Peer,
                    &localhost,
                    &[],
                    &tls.dir,
                    None,
                    days,
                )?;
            }
        }
        Ok(tls)
    }

    fn peer_cert(&self, node: &DevNode) -> PathBuf {
        self.dir.join(format!("{}-peer.pem", node.name))
    }

    fn peer_key(&self, node: &DevNode) -> PathBuf {
        self.dir.join(format!("{}-peer-key.pem", node.name))
    }

    /// The `serve` flags of `node`.
    fn serve_args(&self, node: &DevNode) -> Vec<String> {
        let path = |p: &Path| p.display().to_string();
        vec![
            "--cert-file".into(),
            path(&self.server_cert),
            "--key-file".into(),
            path(&self.server_key),
            "--trusted-ca-file".into(),
            path(&self.ca),
            "--client-cert-auth".into(),
            "--peer-cert-file".into(),
            path(&self.peer_cert(node)),
            "--peer-key-file".into(),
            path(&self.peer_key(node)),
            "--peer-trusted-ca-file".into(),
            path(&self.ca),
        ]
    }

    /// The client flags, as `conclave` and etcdctl both spell them.
    fn client_flags(&self) -> String {
        format!(
            "--cacert {} --cert {} --key {}",
            shell_word(&self.ca.display().to_string()),
            shell_word(&self.client_cert.display().to_string()),
            shell_word(&self.client_key.display().to_string())
        )
    }

    fn client_options(&self) -> Result<conclave_client::TlsOptions, CliError> {
        conclave_client::TlsOptions::from_files(
            Some(&self.ca),
            Some(&self.client_cert),
            Some(&self.client_key),
        )
        .map_err(|e| CliError::Io(e.to_string()))
    }
}

struct DevNode {
    id: u16,
    name: String,
    client: String,
    peer: String,
    data_dir: PathBuf,
    log: PathBuf,
    /// Shared by every node of the layout; see [`ensure_peer_secret`].
    peer_secret_file: PathBuf,
    /// The TLS flags of `serve` (`dev --tls`), empty without TLS.
    tls_args: Vec<String>,
}

/// A started node: its process, and how it ended once it did.
struct Running {
    node: DevNode,
    child: tokio::process::Child,
    pid: u32,
    exit: Option<ExitStatus>,
}

fn layout(args: &DevArgs) -> Result<Vec<DevNode>, CliError> {
    if args.nodes == 0 || args.nodes > DEV_NODES_MAX {
        return Err(CliError::Usage(format!(
            "--nodes must be between 1 and {DEV_NODES_MAX}"
        )));
    }
    if args.base_port == 0 {
        return Err(CliError::Usage(
            "--base-port must be a port number from 1".into(),
        ));
    }
    (1..=args.nodes)
        .map(|id| {
            let (client_port, peer_port) = args
                .base_port
                .checked_add(2 * (id - 1))
                .and_then(|p| p.checked_add(1).map(|peer| (p, peer)))
                .ok_or_else(|| CliError::Usage("--base-port is too high for --nodes".into()))?;
            Ok(DevNode {
                id,
                // The name `serve` gives a member whose --initial-cluster key is its id.
                name: format!("node{id}"),
                client: format!("127.0.0.1:{client_port}"),
                peer: format!("127.0.0.1:{peer_port}"),
                data_dir: args.data_dir.join(format!("node{id}")),
                log: args.data_dir.join(format!("node{id}.log")),
                peer_secret_file: args.data_dir.join(PEER_SECRET_FILE),
                tls_args: Vec::new(),
            })
        })
        .collect()
}

/// The dev cluster's peer secret, in its data directory.
const PEER_SECRET_FILE: &str = "peer-secret";
/// Random bytes in a generated peer secret (written hex-encoded).
const PEER_SECRET_GENERATED_BYTES: usize = 32;

/// Makes sure `dir` holds a peer secret file readable by its owner only, creating one with
/// fresh random bytes the first time, so a dev cluster's peers authenticate with a real
/// secret rather than the weak key derived from the cluster id.
fn ensure_peer_secret(dir: &Path) -> Result<PathBuf, CliError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join(PEER_SECRET_FILE);
    if path.exists() {
        return Ok(path);
    }
    let secret = conclave_server::transport::auth::new_secret_hex(PEER_SECRET_GENERATED_BYTES)
        .map_err(|e| CliError::Io(e.to_string()))?;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(|e| CliError::Io(format!("cannot create {}: {e}", path.display())))?;
    file.write_all(format!("{secret}\n").as_bytes())
        .map_err(|e| CliError::Io(format!("cannot write {}: {e}", path.display())))?;
    Ok(path)
}

/// Records, in the data directory, which cluster its node directories belong to.
const LAYOUT_FILE: &str = "dev-cluster";

/// Refuses a data directory that holds the nodes of another layout (another --nodes or
/// --base-port): its members would bootstrap different clusters and could not work together.
/// Records the layout in a fresh one.
fn claim_data_dir(dir: &Path, nodes: &[DevNode], initial_cluster: &str) -> Result<(), CliError> {
    let marker = dir.join(LAYOUT_FILE);
    let advice = "remove it or pick another --data-dir";
    match std::fs::read_to_string(&marker) {
        Ok(recorded) if recorded.trim() == initial_cluster => return Ok(()),
        Ok(recorded) => {
            return Err(CliError::Usage(format!(
                "{} holds a dev cluster of other members ({}), not {initial_cluster}; \
                 use the --nodes and --base-port it was started with, or {advice}",
                dir.display(),
                recorded.trim()
            )));
        }
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(CliError::Io(format!(
                "cannot read {}: {e}",
                marker.display()
            )));
        }
        Err(_) => {}
    }
    // No record: a directory from before records were kept, or a fresh one. Only the exact
    // set of node directories this layout uses can be resumed.
    let entries = std::fs::read_dir(dir)
        .map_err(|e| CliError::Io(format!("cannot read {}: {e}", dir.display())))?;
    let mut found: Vec<String> = entries
        .filter_map(|entry| entry.ok())
        .filter(|entry| entry.path().is_dir())
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .filter(|name| {
            name.strip_prefix("node")
                .is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()))
        })
        .collect();
    found.sort();
    let mut expected: Vec<String> = nodes.iter().map(|n| n.name.clone()).collect();
    expected.sort();
    if !found.is_empty() && found != expected {
        return Err(CliError::Usage(format!(
            "{} holds the data of nodes {} from an earlier run, not of {}; {advice}",
            dir.display(),
            found.join(","),
            expected.join(",")
        )));
    }
    std::fs::write(&marker, format!("{initial_cluster}\n"))
        .map_err(|e| CliError::Io(format!("cannot write {}: {e}", marker.display())))
}

/// The `serve` arguments of a node (without the program).
fn serve_args(node: &DevNode, initial_cluster: &str) -> Vec<String> {
    let mut args: Vec<String> = vec![
        "serve".into(),
        "--id".into(),
        node.id.to_string(),
        "--data-dir".into(),
        node.data_dir.display().to_string(),
        "--listen-client".into(),
        node.client.clone(),
        "--listen-peer".into(),
        node.peer.clone(),
        "--initial-cluster".into(),
        initial_cluster.to_string(),
        "--peer-secret-file".into(),
        node.peer_secret_file.display().to_string(),
    ];
    args.extend(node.tls_args.iter().cloned());
    args
}

/// `text` as one shell word.
fn shell_word(text: &str) -> String {
    let plain = !text.is_empty()
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-./:=,@%+".contains(c));
    if plain {
        text.to_string()
    } else {
        format!("'{}'", text.replace('\'', r"'\''"))
    }
}

/// The command that starts `node` again by hand, logging where `dev` had it log.
fn restart_command(exe: &Path, node: &DevNode, initial_cluster: &str) -> String {
    let mut words = vec![shell_word(&exe.display().to_string())];
    words.extend(
        serve_args(node, initial_cluster)
            .iter()
            .map(|w| shell_word(w)),
    );
    format!(
        "{} >> {} 2>&1 &",
        words.join(" "),
        shell_word(&node.log.display().to_string())
    )
}

fn spawn(exe: &Path, node: DevNode, initial_cluster: &str) -> Result<Running, CliError> {
    let log = std::fs::File::create(&node.log)
        .map_err(|e| CliError::Io(format!("cannot create {}: {e}", node.log.display())))?;
    let log_err = log
        .try_clone()
        .map_err(|e| CliError::Io(format!("cannot open {}: {e}", node.log.display())))?;
    let mut command = std::process::Command::new(exe);
    command
        .args(serve_args(&node, initial_cluster))
        .stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(log_err))
        // Its own process group: Ctrl-C reaches `dev` alone, which then stops the nodes in
        // order instead of racing them.
        .process_group(0);
    #[cfg(target_os = "linux")]
    {
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: the closure runs between fork and exec and calls only prctl(2) and
        // getppid(2), which are async-signal-safe; it touches no memory of the parent.
        unsafe {
            command.pre_exec(move || {
                // If `dev` dies without stopping its nodes (SIGKILL), they get SIGTERM. The
                // signal follows the thread that forks: this runs on the main thread, which
                // lives as long as the process.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                // `dev` may have died before prctl took effect; then nothing would stop us.
                if libc::getppid() != parent {
                    return Err(std::io::Error::other("conclave dev has exited"));
                }
                Ok(())
            });
        }
    }
    let mut command = tokio::process::Command::from(command);
    // An early return (an error starting a later node) must not leave the first ones running.
    command.kill_on_drop(true);
    let child = command
        .spawn()
        .map_err(|e| CliError::Io(format!("cannot start {}: {e}", node.name)))?;
    let pid = child
        .id()
        .ok_or_else(|| CliError::Io(format!("{} exited as it started", node.name)))?;
    Ok(Running {
        node,
        child,
        pid,
        exit: None,
    })
}

/// Writes to stdout and flushes; a closed stdout is ignored, since the nodes must still be
/// stopped on the signal.
fn say(text: &str) {
    let mut stdout = std::io::stdout().lock();
    let _ = stdout
        .write_all(text.as_bytes())
        .and_then(|_| stdout.flush());
}

fn describe_exit(status: &ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit {code}"),
        (None, Some(signal)) => format!("signal {signal}"),
        (None, None) => "exited".into(),
    }
}

/// How a node ended; when it exited on its own (not by a signal), with the last line of its
/// log, which usually says why (a port in use, a data directory of another cluster).
fn exit_reason(status: &ExitStatus, log: &Path) -> String {
    match (status.code(), last_log_line(log)) {
        (Some(_), Some(line)) => format!("{}: {line}", describe_exit(status)),
        _ => describe_exit(status),
    }
}

/// The last non-empty line of a log, for a node that exited (why it did, usually).
pub(crate) fn last_log_line(path: &Path) -> Option<String> {
    let mut file = std::fs::File::open(path).ok()?;
    let len = file.metadata().ok()?.len();
    file.seek(SeekFrom::Start(len.saturating_sub(LOG_TAIL_BYTES)))
        .ok()?;
    let mut tail = Vec::new();
    file.read_to_end(&mut tail).ok()?;
    let text = String::from_utf8_lossy(&tail);
    text.lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .map(|l| l.trim().to_string())
}

fn format_elapsed(elapsed: Duration) -> String {
    let secs = elapsed.as_secs();
    if secs < 60 {
        format!("{:.1}s", elapsed.as_secs_f64())
    } else if secs < 3_600 {
        format!("{}m{:02}s", secs / 60, secs % 60)
    } else {
        format!("{}h{:02}m", secs / 3_600, (secs / 60) % 60)
    }
}

fn clip(text: &str, chars_max: usize) -> String {
    if text.chars().count() <= chars_max {
        text.to_string()
    } else {
        let mut clipped: String = text.chars().take(chars_max.saturating_sub(1)).collect();
        clipped.push('…');
        clipped
    }
}

/// What one round of probes saw, and what the screen or the change lines are made of.
struct Watch {
    interactive: bool,
    out: Output,
    exe: PathBuf,
    initial_cluster: String,
    endpoints: String,
    /// The client's TLS flags (` --cacert ...`), empty without TLS.
    client_flags: String,
    data_dir: PathBuf,
    /// The leader as last reported (0: none) and since when.
    leader: u64,
    leader_since: Instant,
    /// The last change line printed (plain mode), so only changes print.
    last_change: Option<String>,
    /// Which exits have been announced (plain mode).
    exits_announced: Vec<bool>,
}

impl Watch {
    fn show(&mut self, running: &[Running], answers: &[Result<StatusResponse, String>]) {
        let (leader, term) = reported_leader(answers.iter().filter_map(|a| a.as_ref().ok()));
        if leader != self.leader {
            self.leader = leader;
            self.leader_since = Instant::now();
        }
        if self.interactive {
            let screen = self.screen(running, answers, term);
            // Home, clear, then the frame in one write so it does not flicker.
            say(&format!("\x1b[H\x1b[2J{screen}"));
        } else {
            self.plain_lines(running, answers, term);
        }
    }

    fn name_of(&self, running: &[Running], id: u64) -> String {
        running
            .iter()
            .find(|r| u64::from(r.node.id) == id)
            .map(|r| r.node.name.clone())
            .unwrap_or_else(|| format!("{id:x}"))
    }

    fn plain_lines(
        &mut self,
        running: &[Running],
        answers: &[Result<StatusResponse, String>],
        term: u64,
    ) {
        for (index, r) in running.iter().enumerate() {
            let Some(status) = &r.exit else { continue };
            if self.exits_announced[index] {
                continue;
            }
            self.exits_announced[index] = true;
            say(&format!(
                "exited {} pid={} ({}), not restarted; start it again with: {}\n",
                r.node.name,
                r.pid,
                exit_reason(status, &r.node.log),
                restart_command(&self.exe, &r.node, &self.initial_cluster),
            ));
        }
        let list = |answered: bool| {
            let names: Vec<&str> = running
                .iter()
                .zip(answers)
                .filter(|(_, a)| a.is_ok() == answered)
                .map(|(r, _)| r.node.name.as_str())
                .collect();
            if names.is_empty() {
                "none".to_string()
            } else {
                names.join(",")
            }
        };
        let (leader, pid) = match running.iter().find(|r| u64::from(r.node.id) == self.leader) {
            Some(r) => (r.node.name.clone(), r.pid.to_string()),
            None if self.leader == 0 => ("none".to_string(), "none".to_string()),
            None => (self.name_of(running, self.leader), "none".to_string()),
        };
        let change = format!(
            "leader={leader} pid={pid} up={} down={}",
            list(true),
            list(false)
        );
        if self.last_change.as_deref() != Some(change.as_str()) {
            say(&format!(
                "status leader={leader} pid={pid} term={term} up={} down={}\n",
                list(true),
                list(false)
            ));
            self.last_change = Some(change);
        }
    }

    fn screen(
        &self,
        running: &[Running],
        answers: &[Result<StatusResponse, String>],
        term: u64,
    ) -> String {
        let out = &self.out;
        let mut text = format!(
            "{} {} node(s), data and logs in {}. Ctrl-C stops them all.\n",
            out.bold("Conclave dev cluster:"),
            running.len(),
            self.data_dir.display()
        );
        let since = format_elapsed(self.leader_since.elapsed());
        if self.leader == 0 {
            text.push_str(&out.red(&format!(
                "No leader for {since} (an election is under way, or too few nodes are up)."
            )));
        } else {
            text.push_str(&format!(
                "Leader {} in term {term}, for {since} since the last leader change.",
                out.green(&self.name_of(running, self.leader))
            ));
        }
        text.push_str("\n\n");
        let rows: Vec<Vec<String>> = running
            .iter()
            .zip(answers)
            .map(|(r, answer)| {
                let process = match &r.exit {
                    None => "running".to_string(),
                    Some(status) => out.red(&format!(
                        "exited ({})",
                        clip(&exit_reason(status, &r.node.log), SCREEN_ERROR_CHARS_MAX)
                    )),
                };
                let mut row = vec![
                    r.node.name.clone(),
                    r.node.client.clone(),
                    r.pid.to_string(),
                    process,
                ];
                match answer {
                    Ok(s) => row.extend([
                        if s.leader == u64::from(r.node.id) {
                            out.green("leader")
                        } else if s.leader == 0 {
                            "no leader".into()
                        } else {
                            "follower".into()
                        },
                        s.raft_term.to_string(),
                        s.raft_index.to_string(),
                        s.raft_applied_index.to_string(),
                        if s.errors.is_empty() {
                            out.green("healthy")
                        } else {
                            out.red(&clip(&s.errors.join("; "), SCREEN_ERROR_CHARS_MAX))
                        },
                    ]),
                    Err(error) => row.extend([
                        out.red(if r.exit.is_some() {
                            "down"
                        } else {
                            "unreachable"
                        }),
                        "-".into(),
                        "-".into(),
                        "-".into(),
                        if r.exit.is_some() {
                            "-".into()
                        } else {
                            out.red(&clip(error, SCREEN_ERROR_CHARS_MAX))
                        },
                    ]),
                }
                row
            })
            .collect();
        text.push_str(&out.table(
            &[
                "NAME", "CLIENT", "PID", "PROCESS", "ROLE", "TERM", "COMMIT", "APPLIED", "HEALTH",
            ],
            &rows,
        ));
        text.push_str("\n\n");
        let down: Vec<&Running> = running.iter().filter(|r| r.exit.is_some()).collect();
        if !down.is_empty() {
            text.push_str(
                "A node that exits is not restarted. To start one again, in another terminal \
                 (Ctrl-C here will not stop a node started by hand):\n",
            );
            for r in down {
                text.push_str(&format!(
                    "  {}\n",
                    restart_command(&self.exe, &r.node, &self.initial_cluster)
                ));
            }
            text.push('\n');
        }
        text.push_str(&format!(
            "Try: ETCDCTL_API=3 etcdctl --endpoints={}{} put greeting hello\n\
             \x20    kill -9 <PID of the leader>   (from another terminal, to watch the failover)\n",
            self.endpoints, self.client_flags
        ));
        text
    }
}

/// Whether the screen may be redrawn: stdout is a terminal and `dev` runs in its foreground
/// (`conclave dev &` prints change lines instead of repainting over the shell).
fn stdout_is_foreground_terminal() -> bool {
    if !std::io::stdout().is_terminal() {
        return false;
    }
    // SAFETY: tcgetpgrp(3) and getpgrp(2) read process state only; fd 1 is stdout, open.
    unsafe { libc::tcgetpgrp(libc::STDOUT_FILENO) == libc::getpgrp() }
}

/// Asks every node for its status at once; in node order.
async fn probe_all(
    running: &[Running],
    tls: Option<&conclave_client::TlsOptions>,
) -> Vec<Result<StatusResponse, String>> {
    let timeout = Duration::from_millis(PROBE_TIMEOUT_MS);
    let probes: Vec<_> = running
        .iter()
        .map(|r| {
            let url = r.node.client.clone();
            let tls = tls.cloned();
            tokio::spawn(async move { probe(&url, timeout, tls.as_ref()).await })
        })
        .collect();
    let mut answers = Vec::with_capacity(probes.len());
    for (probe, r) in probes.into_iter().zip(running) {
        let answer = probe
            .await
            .unwrap_or_else(|e| Err(format!("status probe failed: {e}")));
        answers.push(own_answer(r, answer));
    }
    answers
}

/// A node's status answer, if it is its own: a node that exited has none, whatever now
/// answers on its port, and neither does another server that holds the port.
fn own_answer(
    r: &Running,
    answer: Result<StatusResponse, String>,
) -> Result<StatusResponse, String> {
    if r.exit.is_some() {
        return Err("exited".to_string());
    }
    let answer = answer?;
    let member = answer.header.as_ref().map_or(0, |h| h.member_id);
    if member != u64::from(r.node.id) {
        return Err(format!(
            "member {member:x} answers on {}, not {}",
            r.node.client, r.node.name
        ));
    }
    Ok(answer)
}

/// Waits until every node runs, holds its own client port and answers there as itself.
/// A node that exits first, or a silence past [`DEV_START_TIMEOUT_MS`], is an error naming
/// each node that failed and why (its log's last line).
async fn wait_started(
    running: &mut [Running],
    tls: Option<&conclave_client::TlsOptions>,
) -> Result<(), CliError> {
    let deadline = Instant::now() + Duration::from_millis(DEV_START_TIMEOUT_MS);
    let mut signal = std::pin::pin!(termination_signal());
    loop {
        for r in running.iter_mut().filter(|r| r.exit.is_none()) {
            if let Ok(Some(status)) = r.child.try_wait() {
                r.exit = Some(status);
            }
        }
        let exited: Vec<String> = running
            .iter()
            .filter_map(|r| {
                let status = r.exit.as_ref()?;
                Some(format!(
                    "{} exited while starting ({})",
                    r.node.name,
                    exit_reason(status, &r.node.log)
                ))
            })
            .collect();
        if !exited.is_empty() {
            return Err(CliError::Io(exited.join("; ")));
        }
        let answers = probe_all(running, tls).await;
        let pending: Vec<String> = running
            .iter()
            .zip(&answers)
            .filter_map(|(r, answer)| {
                let listening = crate::daemon::listens_on(r.pid, &r.node.client);
                match answer {
                    Ok(_) if listening => None,
                    Ok(_) => Some(format!(
                        "{} answers but does not hold {} itself",
                        r.node.name, r.node.client
                    )),
                    Err(error) => Some(format!("{}: {error}", r.node.name)),
                }
            })
            .collect();
        if pending.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(CliError::Io(format!(
                "the nodes did not all start within {DEV_START_TIMEOUT_MS} ms: {}",
                pending.join("; ")
            )));
        }
        tokio::select! {
            _ = &mut signal => return Err(CliError::Io("interrupted while the nodes started".into())),
            _ = tokio::time::sleep(Duration::from_millis(DEV_START_POLL_MS)) => {}
        }
    }
}

/// Stops every running node: SIGTERM to all, then SIGKILL to any still running after the
/// grace period (or at once on a second SIGINT/SIGTERM). Returns when all are reaped.
async fn stop_all(running: &mut [Running]) {
    for r in running.iter().filter(|r| r.exit.is_none()) {
        // SAFETY: kill(2) on a child we spawned and have not reaped (its pid is still ours);
        // no memory is involved.
        unsafe {
            libc::kill(r.pid as libc::pid_t, libc::SIGTERM);
        }
    }
    let deadline = tokio::time::Instant::now() + Duration::from_millis(CHILD_STOP_GRACE_MS);
    let mut hurry = std::pin::pin!(termination_signal());
    let mut patient = true;
    for r in running.iter_mut().filter(|r| r.exit.is_none()) {
        if patient {
            tokio::select! {
                waited = tokio::time::timeout_at(deadline, r.child.wait()) => {
                    if let Ok(Ok(status)) = waited {
                        r.exit = Some(status);
                        continue;
                    }
                    patient = false;
                }
                _ = &mut hurry => patient = false,
            }
        }
        // Child::kill sends SIGKILL and reaps.
        let _ = r.child.kill().await;
        r.exit = r.child.try_wait().ok().flatten();
    }
}

pub async fn run(args: DevArgs) -> Result<(), CliError> {
    let mut nodes = layout(&args)?;
    if let Some(warning) = crate::cluster_spec::even_cluster_warning(nodes.len()) {
        eprintln!("conclave: warning: {warning}");
    }
    let initial_cluster = nodes
        .iter()
        .map(|n| format!("{}={}", n.id, n.peer))
        .collect::<Vec<_>>()
        .join(",");
    let scheme = if args.tls { "https://" } else { "" };
    let endpoints = nodes
        .iter()
        .map(|n| format!("{scheme}{}", n.client))
        .collect::<Vec<_>>()
        .join(",");
    let exe = std::env::current_exe()
        .map_err(|e| CliError::Io(format!("cannot find the conclave binary: {e}")))?;
    std::fs::create_dir_all(&args.data_dir)
        .map_err(|e| CliError::Io(format!("cannot create {}: {e}", args.data_dir.display())))?;
    claim_data_dir(&args.data_dir, &nodes, &initial_cluster)?;
    ensure_peer_secret(&args.data_dir)?;
    let tls = if args.tls {
        let tls = DevTls::ensure(&args.data_dir, &nodes)?;
        for node in &mut nodes {
            node.tls_args = tls.serve_args(node);
        }
        Some(tls)
    } else {
        None
    };
    let probe_tls = tls.as_ref().map(DevTls::client_options).transpose()?;

    // Started here, on the thread that runs `run` (the main thread), for PR_SET_PDEATHSIG.
    let mut running = Vec::with_capacity(nodes.len());
    for node in nodes {
        running.push(spawn(&exe, node, &initial_cluster)?);
    }

    let mut banner = format!("Conclave dev cluster, {} node(s):\n", running.len());
    for r in &running {
        banner.push_str(&format!(
            "  {}  pid {}  client {}  peer {}  log {}\n",
            r.node.name,
            r.pid,
            r.node.client,
            r.node.peer,
            r.node.log.display()
        ));
    }
    let flags = match &tls {
        Some(tls) => {
            banner.push_str(&format!(
                "TLS on both ports (certificates in {}); clients need: {}\n",
                tls.dir.display(),
                tls.client_flags()
            ));
            format!(" {}", tls.client_flags())
        }
        None => String::new(),
    };
    banner.push_str(&format!(
        "Connect with etcdctl (Debian package etcd-client) or conclave:\n\
         \x20 ETCDCTL_API=3 etcdctl --endpoints={endpoints}{flags} put greeting hello\n\
         \x20 ETCDCTL_API=3 etcdctl --endpoints={endpoints}{flags} endpoint status -w table\n\
         \x20 conclave --endpoints {endpoints}{flags} status\n\
         Ctrl-C stops the cluster.\n"
    ));
    say(&banner);
    if let Err(error) = wait_started(&mut running, probe_tls.as_ref()).await {
        stop_all(&mut running).await;
        return Err(error);
    }
    say("every node answers on its client port\n");

    let mut watch = Watch {
        interactive: stdout_is_foreground_terminal(),
        out: Output::new(false),
        exe,
        initial_cluster,
        endpoints,
        client_flags: flags,
        data_dir: args.data_dir.clone(),
        leader: 0,
        leader_since: Instant::now(),
        last_change: None,
        exits_announced: vec![false; running.len()],
    };
    let mut signal = std::pin::pin!(termination_signal());
    let mut ticker = tokio::time::interval(Duration::from_millis(STATUS_INTERVAL_MS));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = &mut signal => break,
            _ = ticker.tick() => {}
        }
        for r in running.iter_mut().filter(|r| r.exit.is_none()) {
            if let Ok(Some(status)) = r.child.try_wait() {
                r.exit = Some(status);
            }
        }
        let answers = tokio::select! {
            _ = &mut signal => break,
            answers = probe_all(&running, probe_tls.as_ref()) => answers,
        };
        watch.show(&running, &answers);
        if running.iter().all(|r| r.exit.is_some()) {
            break;
        }
    }
    let all_exited = running.iter().all(|r| r.exit.is_some());

    let up = running.iter().filter(|r| r.exit.is_none()).count();
    say(&format!("stopping {up} running node(s)\n"));
    let started = Instant::now();
    stop_all(&mut running).await;
    let summary: Vec<String> = running
        .iter()
        .map(|r| {
            let how = r.exit.as_ref().map_or("unknown".into(), describe_exit);
            format!("{}={how}", r.node.name)
        })
        .collect();
    say(&format!(
        "stopped in {}: {}\n",
        format_elapsed(started.elapsed()),
        summary.join(" ")
    ));
    if all_exited {
        // Nothing is left to serve: say so in the exit code, not only on the screen.
        let reasons: Vec<String> = running
            .iter()
            .filter_map(|r| {
                let status = r.exit.as_ref()?;
                Some(format!(
                    "{} ({})",
                    r.node.name,
                    exit_reason(status, &r.node.log)
                ))
            })
            .collect();
        return Err(CliError::Io(format!(
            "every node has exited: {}",
            reasons.join("; ")
        )));
    }
    Ok(())
}
