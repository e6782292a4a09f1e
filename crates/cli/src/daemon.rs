//! `conclave daemon start|stop|status`: `serve` in the background, with a pid file and a log
//! file in its data directory.

use std::ffi::OsString;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use clap::{ArgMatches, Args, Subcommand};
use conclave_proto::etcdserverpb::StatusRequest;
use conclave_proto::etcdserverpb::maintenance_client::MaintenanceClient;
use serde_json::json;

use crate::cmd::{CmdResult, Failure, Output};
use crate::{CONFIG_HELP, ServeArgs, ServeCommandArgs};

/// Name of the pid file inside the data directory.
pub const PID_FILE: &str = "conclave.pid";
/// Name of the log file inside the data directory.
pub const LOG_FILE: &str = "conclave.log";
/// How long `start` waits for the client port to answer.
const START_TIMEOUT: Duration = Duration::from_secs(15);
/// How long `stop` waits after SIGTERM (a graceful stop hands leadership over) before SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(15);
const POLL: Duration = Duration::from_millis(50);

// Parsed once per process; the size of the Start variant costs nothing worth boxing for.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
pub enum DaemonCommand {
    /// Start `conclave serve` in the background with these serve flags (every flag `serve`
    /// takes: tests compare the two `--help` texts).
    #[command(after_help = CONFIG_HELP)]
    Start(ServeCommandArgs),
    /// Stop the daemon of a data directory (SIGTERM, SIGKILL after 15 s).
    Stop(DirArgs),
    /// Whether the daemon of a data directory runs.
    Status(DirArgs),
}

#[derive(Args, Debug)]
pub struct DirArgs {
    /// The daemon's data directory (where its pid file is).
    #[arg(long, env = "CONCLAVE_DATA_DIR", default_value = "./conclave-data")]
    pub data_dir: PathBuf,
    /// The daemon's config file, for its `data-dir` (the flag and its environment variable
    /// beat it).
    #[arg(long, env = "CONCLAVE_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
}

impl DirArgs {
    fn resolve(mut self, matches: &ArgMatches) -> Result<DirArgs, Failure> {
        crate::config_file::resolve_data_dir(&mut self.data_dir, self.config.as_deref(), matches)
            .map_err(|e| Failure::invalid(e.to_string()))?;
        Ok(self)
    }
}

impl ServeCommandArgs {
    /// The `serve` command line that reproduces these arguments once `--config` is resolved:
    /// every value goes as a flag, so the child needs no file.
    fn to_args(&self) -> Vec<OsString> {
        let mut args = self.serve.to_args();
        args.extend([
            "--initial-cluster-state".into(),
            self.initial_cluster_state.as_str().into(),
        ]);
        if let Some(id) = self.initial_cluster_id {
            args.extend(["--initial-cluster-id".into(), format!("{id:x}").into()]);
        }
        args
    }
}

impl ServeArgs {
    /// The flags that reproduce these arguments. The destructuring is exhaustive on purpose:
    /// a new serve flag does not compile until it is passed on here too.
    fn to_args(&self) -> Vec<OsString> {
        let ServeArgs {
            name,
            id,
            data_dir,
            listen_client,
            listen_peer,
            initial_cluster,
            initial_cluster_clients,
            snapshot_entries,
            snapshot_log_percent,
            snapshot_bytes_max,
            tick_ms,
            heartbeat_ms,
            election_timeout_ms,
            request_timeout_ms,
            peer_secret_file,
            tls,
            client_limits,
            auth,
            auto_compaction_mode,
            auto_compaction_retention,
            listen_metrics,
            wal_fsync_warn_ms,
            lease_reads,
        } = self;
        let mut args: Vec<OsString> = vec!["serve".into(), "--name".into(), name.into()];
        if let Some(id) = id {
            args.extend(["--id".into(), id.to_string().into()]);
        }
        args.extend(["--data-dir".into(), data_dir.clone().into_os_string()]);
        args.extend(["--listen-client".into(), listen_client.into()]);
        args.extend(["--listen-peer".into(), listen_peer.into()]);
        if let Some(spec) = initial_cluster {
            args.extend(["--initial-cluster".into(), spec.into()]);
        }
        if let Some(spec) = initial_cluster_clients {
            args.extend(["--initial-cluster-clients".into(), spec.into()]);
        }
        if let Some(address) = listen_metrics {
            args.extend(["--listen-metrics".into(), address.into()]);
        }
        if let Some(path) = peer_secret_file {
            args.extend(["--peer-secret-file".into(), path.clone().into_os_string()]);
        }
        args.extend(tls.to_argv());
        if *lease_reads {
            args.push("--lease-reads".into());
        }
        for (flag, value) in [
            ("--snapshot-entries", snapshot_entries),
            ("--snapshot-log-percent", snapshot_log_percent),
            ("--snapshot-bytes-max", snapshot_bytes_max),
            ("--tick-ms", tick_ms),
            ("--heartbeat-ms", heartbeat_ms),
            ("--election-timeout-ms", election_timeout_ms),
            ("--request-timeout-ms", request_timeout_ms),
            ("--wal-fsync-warn-ms", wal_fsync_warn_ms),
        ] {
            args.extend([flag.into(), value.to_string().into()]);
        }
        args.extend(client_limits.to_args());
        args.extend(auth.to_args());
        args.extend([
            "--auto-compaction-mode".into(),
            auto_compaction_mode.as_str().into(),
            "--auto-compaction-retention".into(),
            auto_compaction_retention.into(),
        ]);
        args
    }
}

fn read_pid(dir: &Path) -> Option<i32> {
    std::fs::read_to_string(dir.join(PID_FILE))
        .ok()?
        .trim()
        .parse()
        .ok()
}

fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists and may be signalled.
    unsafe { libc::kill(pid, 0) == 0 }
}

/// Runs a daemon command; `matches` are its subcommand's (which flags the user set).
pub async fn run(json: bool, command: DaemonCommand, matches: &ArgMatches) -> i32 {
    let out = Output::new(json);
    let result = match command {
        DaemonCommand::Start(args) => start(&out, args, matches).await,
        DaemonCommand::Stop(args) => match args.resolve(matches) {
            Ok(args) => stop(&out, args).await,
            Err(failure) => Err(failure),
        },
        DaemonCommand::Status(args) => args.resolve(matches).and_then(|args| status(&out, args)),
    };
    match result {
        Ok(code) => code,
        Err(failure) => {
            out.failure(&failure);
            failure.exit_code()
        }
    }
}

async fn start(out: &Output, mut full: ServeCommandArgs, matches: &ArgMatches) -> CmdResult {
    // Resolve the config file here, so the pid file lands in its data directory, and refuse
    // bad flags with the same sentence serve would print.
    full.apply_config_file(matches)
        .map_err(|e| Failure::invalid(e.to_string()))?;
    let args = &full.serve;
    let member_id = args
        .to_config()
        .map_err(|e| Failure::invalid(e.to_string()))?
        .id;
    let dir = args.data_dir.clone();
    if let Some(pid) = read_pid(&dir).filter(|pid| alive(*pid)) {
        return Err(Failure::new(
            "already_exists",
            format!("a daemon (pid {pid}) already runs over {}", dir.display()),
        ));
    }
    // Owner only, like everything `serve` keeps in its data directory.
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(conclave_storage::disk::DIR_MODE)
        .create(&dir)
        .map_err(|e| Failure::io(format!("cannot create {}: {e}", dir.display())))?;
    let log_path = dir.join(LOG_FILE);
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(conclave_storage::disk::FILE_MODE)
        .open(&log_path)
        .map_err(|e| Failure::io(format!("cannot open {}: {e}", log_path.display())))?;
    let log_err = log
        .try_clone()
        .map_err(|e| Failure::io(format!("cannot open {}: {e}", log_path.display())))?;
    let exe = std::env::current_exe()
        .map_err(|e| Failure::io(format!("cannot find the conclave binary: {e}")))?;
    let mut command = std::process::Command::new(exe);
    command
        .args(full.to_args())
        // Every value is on the command line already; the child must not read the file again.
        .env_remove("CONCLAVE_CONFIG")
        .stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(log_err));
    // Its own session: the daemon outlives this shell and its terminal's signals.
    // SAFETY: setsid is async-signal-safe and affects only the child.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut command, || {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = command
        .spawn()
        .map_err(|e| Failure::io(format!("cannot start conclave serve: {e}")))?;
    let pid = child.id();
    let pid_path = dir.join(PID_FILE);
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(conclave_storage::disk::FILE_MODE)
        .open(&pid_path)
        .and_then(|mut file| std::io::Write::write_all(&mut file, format!("{pid}\n").as_bytes()))
        .map_err(|e| Failure::io(format!("cannot write {}: {e}", pid_path.display())))?;
    let url = format!("http://{}", args.listen_client);
    let started = Instant::now();
    // Ready only when our child is alive, holds the client port itself, and the member that
    // answers there is the one it runs: another server already on the port answers too.
    let mut last_answer: Option<u64> = None;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            let _ = std::fs::remove_file(&pid_path);
            let reason = crate::dev::last_log_line(&log_path)
                .map(|line| format!(": {line}"))
                .unwrap_or_default();
            return Err(Failure::io(format!(
                "conclave serve exited at once ({status}){reason}; see {}",
                log_path.display()
            )));
        }
        let answered = answering_member(&url).await;
        if answered.is_some() {
            last_answer = answered;
        }
        if answered == Some(member_id) && listens_on(pid, &args.listen_client) && alive(pid as i32)
        {
            break;
        }
        if started.elapsed() > START_TIMEOUT {
            let seen = match last_answer {
                Some(other) if other != member_id => {
                    format!("; member {other:x} answers there, not this one ({member_id:x})")
                }
                _ => String::new(),
            };
            return Err(Failure::new(
                "timeout",
                format!(
                    "conclave serve (pid {pid}) did not answer on {} within {START_TIMEOUT:?}{seen}; see {}",
                    args.listen_client,
                    log_path.display()
                ),
            ));
        }
        tokio::time::sleep(POLL).await;
    }
    out.ok(
        json!({
            "pid": pid,
            "data_dir": dir.display().to_string(),
            "log": log_path.display().to_string(),
            "pid_file": pid_path.display().to_string(),
            "listen_client": args.listen_client,
            "initial_cluster_state": full.initial_cluster_state.as_str(),
        }),
        || {
            format!(
                "conclave serve started (pid {pid}), clients on {}, log {}",
                args.listen_client,
                log_path.display()
            )
        },
    );
    Ok(0)
}

/// The member id of whatever Conclave (or etcd) server answers a status call on `url`.
async fn answering_member(url: &str) -> Option<u64> {
    let endpoint = tonic::transport::Endpoint::from_shared(url.to_string()).ok()?;
    let channel = endpoint.connect_timeout(POLL * 4).connect().await.ok()?;
    let answer = MaintenanceClient::new(channel)
        .status(StatusRequest {})
        .await
        .ok()?;
    answer.into_inner().header.map(|h| h.member_id)
}

/// Whether process `pid` itself holds a listening TCP socket on the port of `address`
/// (Linux: its socket inodes against the kernel's table of listeners). Elsewhere the member
/// id check alone has to do, and this answers true.
pub(crate) fn listens_on(pid: u32, address: &str) -> bool {
    if !cfg!(target_os = "linux") {
        return true;
    }
    let Some(port) = address
        .rsplit_once(':')
        .and_then(|(_, port)| port.parse::<u16>().ok())
    else {
        return false;
    };
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    let inodes: std::collections::HashSet<String> = fds
        .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter_map(|target| {
            let target = target.to_string_lossy().into_owned();
            Some(
                target
                    .strip_prefix("socket:[")?
                    .strip_suffix(']')?
                    .to_string(),
            )
        })
        .collect();
    ["tcp", "tcp6"].iter().any(|table| {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")) else {
            return false;
        };
        text.lines().skip(1).any(|line| {
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            let fields: Vec<&str> = line.split_whitespace().collect();
            let listening = fields.get(3) == Some(&"0A");
            let on_port = fields
                .get(1)
                .and_then(|local| local.rsplit_once(':'))
                .and_then(|(_, hex)| u16::from_str_radix(hex, 16).ok())
                == Some(port);
            let ours = fields.get(9).is_some_and(|inode| inodes.contains(*inode));
            listening && on_port && ours
        })
    })
}

async fn stop(out: &Output, args: DirArgs) -> CmdResult {
    let pid_path = args.data_dir.join(PID_FILE);
    let Some(pid) = read_pid(&args.data_dir).filter(|pid| alive(*pid)) else {
        let _ = std::fs::remove_file(&pid_path);
        return Err(Failure::new(
            "not_found",
            format!("no daemon runs over {}", args.data_dir.display()),
        ));
    };
    // SAFETY: kill(2) on the daemon's pid; no memory is shared.
    unsafe {
        libc::kill(pid, libc::SIGTERM);
    }
    let started = Instant::now();
    let mut forced = false;
    while alive(pid) {
        if started.elapsed() > STOP_TIMEOUT && !forced {
            // SAFETY: as above.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
            forced = true;
        }
        tokio::time::sleep(POLL).await;
    }
    let _ = std::fs::remove_file(&pid_path);
    out.ok(
        json!({"pid": pid, "stopped": true, "forced": forced}),
        || format!("conclave serve (pid {pid}) stopped"),
    );
    Ok(0)
}

fn status(out: &Output, args: DirArgs) -> CmdResult {
    match read_pid(&args.data_dir).filter(|pid| alive(*pid)) {
        Some(pid) => {
            out.ok(
                json!({"running": true, "pid": pid, "data_dir": args.data_dir.display().to_string()}),
                || format!("running (pid {pid})"),
            );
            Ok(0)
        }
        None => Err(Failure::new(
            "not_found",
            format!("no daemon runs over {}", args.data_dir.display()),
        )),
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, FromArgMatches};

    use super::*;
    use crate::{Cli, ClusterState, Command};

    fn serve_args(argv: Vec<OsString>) -> ServeCommandArgs {
        let matches = Cli::command()
            .try_get_matches_from(argv)
            .expect("a valid command line");
        match Cli::from_arg_matches(&matches).map(|cli| cli.command) {
            Ok(Command::Serve(args)) => args,
            _ => panic!("not serve"),
        }
    }

    #[test]
    fn the_child_command_line_reproduces_the_resolved_args() {
        let mut resolved = serve_args(vec!["conclave".into(), "serve".into()]);
        resolved.serve.name = "n2".into();
        resolved.serve.id = Some(2);
        resolved.serve.heartbeat_ms = 30;
        resolved.serve.initial_cluster = Some("1=127.0.0.1:1,2=127.0.0.1:3".into());
        resolved.initial_cluster_state = ClusterState::Existing;
        resolved.config = Some("unused.toml".into());
        let mut argv: Vec<OsString> = vec!["conclave".into()];
        argv.extend(resolved.to_args());
        assert!(!argv.iter().any(|a| a == "--config"), "{argv:?}");
        let child = serve_args(argv);
        assert_eq!(
            format!("{:?}", child.serve),
            format!("{:?}", resolved.serve)
        );
        assert_eq!(child.initial_cluster_state, ClusterState::Existing);
        assert_eq!(child.config, None);
    }
}
