//! The `conclave` binary.
//!
//! - `conclave serve`: run one node of a cluster (etcd v3 API on `--listen-client`).
//! - `conclave dev`: run a local cluster of child `serve` processes with a live status.
//! - everything else: client commands (KV, leases, elections, locks, topics, cluster), see
//!   `cmd` and docs/cli.md.
//!
//! Errors end the process with one sentence on stderr and a non-zero exit code.

/// jemalloc instead of the system allocator: 6.6% less of the members' CPU per put and 4.7%
/// more puts per second at 64 clients, in alternating runs
/// (docs/performance.md, "One program, optimised whole").
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

mod certs;
mod client_limits;
mod cluster_spec;
mod cmd;
mod config_file;
mod daemon;
mod dev;
mod tls_args;

use std::io::IsTerminal;
use std::path::PathBuf;

use clap::{ArgMatches, Args, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use conclave_server::ServerConfig;

use cluster_spec::{CliError, parse_members};

#[derive(Parser)]
#[command(
    name = "conclave",
    version,
    about = "Conclave: a Raft-replicated coordination service speaking the etcd v3 API",
    after_help = cmd::EXIT_CODES_HELP
)]
struct Cli {
    #[command(flatten)]
    global: cmd::GlobalArgs,
    #[command(flatten)]
    log: LogArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run one node of a Conclave cluster.
    #[command(after_help = CONFIG_HELP)]
    Serve(ServeCommandArgs),
    /// Run a local cluster of child `serve` processes (3 by default) with a live status.
    Dev(dev::DevArgs),
    /// Run `serve` in the background (pid and log file in its data directory).
    #[command(subcommand)]
    Daemon(daemon::DaemonCommand),
    /// The cluster at a glance in the terminal (members, election groups, locks, topics,
    /// puts/s), from a member's metrics listener; `--json` prints one snapshot.
    Top(cmd::top::TopArgs),
    /// Certificates for TLS: `certs init DIR` (a CA), `certs issue --ca DIR --name N --kind K`.
    #[command(subcommand)]
    Certs(certs::CertsCommand),
    #[command(flatten)]
    Client(cmd::ClientCommand),
}

/// How the process logs (to stderr).
#[derive(Args, Debug, Clone)]
struct LogArgs {
    /// Log level or filter (`info`, `debug`, `warn,conclave_server=debug`). Without it,
    /// CONCLAVE_LOG is read, then `info` for serve and dev, `error` for client commands.
    #[arg(long, global = true, value_name = "LEVEL")]
    log_level: Option<String>,
    /// `text` (one line per event) or `json` (one object per line, fields as values).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "CONCLAVE_LOG_FORMAT")]
    log_format: LogFormat,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
enum LogFormat {
    Text,
    Json,
}

/// The `after_help` of `serve` and `daemon start`.
pub const CONFIG_HELP: &str = "\
Configuration file: --config FILE (or CONCLAVE_CONFIG) reads TOML whose keys are the long flag
names, e.g.
  name = \"node1\"
  data-dir = \"/var/lib/conclave\"
  heartbeat-ms = 50
A flag on the command line beats its CONCLAVE_<FLAG> environment variable, which beats the
file, which beats the built-in default.";

/// `--initial-cluster-state`.
#[derive(ValueEnum, serde::Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ClusterState {
    /// Found a new cluster (or resume one from the data directory).
    New,
    /// Join a running cluster after `member add`.
    Existing,
}

impl ClusterState {
    /// The flag value (`new`, `existing`).
    pub fn as_str(self) -> &'static str {
        match self {
            ClusterState::New => "new",
            ClusterState::Existing => "existing",
        }
    }
}

/// A cluster id as etcd and `member add` print it: hex, with or without `0x`.
pub fn parse_cluster_id(text: &str) -> Result<u64, String> {
    let digits = text.trim().trim_start_matches("0x");
    match u64::from_str_radix(digits, 16) {
        Ok(0) => Err("a cluster id is never 0".into()),
        Ok(id) => Ok(id),
        Err(_) => Err(format!(
            "{text:?} is not a cluster id in hex (like 3f2a9c0d11b7e845)"
        )),
    }
}

/// Everything `conclave serve` and `conclave daemon start` take: the node's flags
/// (`ServeArgs`), plus how the node joins (`--initial-cluster-state`) and where a
/// configuration file supplies the flags not given (`--config`).
#[derive(Args, Debug, Clone)]
pub struct ServeCommandArgs {
    #[command(flatten)]
    pub serve: ServeArgs,
    /// `new` founds a cluster; `existing` joins a running one after `member add`: the data
    /// directory starts empty and --initial-cluster lists the founding members plus this one,
    /// under the id `member add` returned.
    #[arg(
        long,
        env = "CONCLAVE_INITIAL_CLUSTER_STATE",
        value_enum,
        default_value_t = ClusterState::New
    )]
    pub initial_cluster_state: ClusterState,
    /// With `existing`: the id of the cluster to join, in hex, as `member add` prints it. With
    /// it, --initial-cluster may list the current members (as `member add` prints them); without
    /// it, the id is derived from --initial-cluster, which must then be the founding list.
    #[arg(
        long,
        env = "CONCLAVE_INITIAL_CLUSTER_ID",
        value_name = "HEX",
        value_parser = parse_cluster_id
    )]
    pub initial_cluster_id: Option<u64>,
    /// TOML file of serve flags by their long names (`heartbeat-ms = 50`); a flag or its
    /// environment variable beats the file.
    #[arg(long, env = "CONCLAVE_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
}

/// Flags of `conclave serve`; each also reads `CONCLAVE_<FLAG>` from the environment.
#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// This member's name in --initial-cluster.
    #[arg(long, env = "CONCLAVE_NAME", default_value = cluster_spec::DEFAULT_MEMBER_NAME)]
    pub name: String,
    /// This member's numeric id (instead of --name).
    #[arg(long, env = "CONCLAVE_ID")]
    pub id: Option<u64>,
    /// Where the write-ahead log and snapshots live.
    #[arg(long, env = "CONCLAVE_DATA_DIR", default_value = "./conclave-data")]
    pub data_dir: PathBuf,
    /// gRPC address for clients (etcd's port, so etcdctl works without flags).
    #[arg(long, env = "CONCLAVE_LISTEN_CLIENT", default_value = "127.0.0.1:2379")]
    pub listen_client: String,
    /// Address for Raft traffic from the other members.
    #[arg(long, env = "CONCLAVE_LISTEN_PEER", default_value = "127.0.0.1:2380")]
    pub listen_peer: String,
    /// Founding members, `KEY=PEER_HOST:PORT,...`; KEY is a numeric id or a name (names get
    /// ids 1, 2, ... in list order). Default: this node alone.
    #[arg(long, env = "CONCLAVE_INITIAL_CLUSTER")]
    pub initial_cluster: Option<String>,
    /// Client addresses of the members, `KEY=HOST:PORT,...`, used to forward writes to the
    /// leader and for `member list`. Default: this node's --listen-client, and for the others
    /// their peer port minus one (the `conclave dev` layout).
    #[arg(long, env = "CONCLAVE_INITIAL_CLUSTER_CLIENTS")]
    pub initial_cluster_clients: Option<String>,
    /// Take a snapshot and compact the log every this many applied entries...
    #[arg(long, env = "CONCLAVE_SNAPSHOT_ENTRIES", default_value_t = conclave_server::config::DEFAULT_SNAPSHOT_ENTRIES)]
    pub snapshot_entries: u64,
    /// ...and once the log applied since the last snapshot is this percentage of its size
    /// (0: entries alone decide). Snapshot work then stays in proportion to the log however
    /// large the state grows; a large state keeps up to about twice its size in log on disk.
    #[arg(long, env = "CONCLAVE_SNAPSHOT_LOG_PERCENT", default_value_t = conclave_server::config::DEFAULT_SNAPSHOT_LOG_PERCENT)]
    pub snapshot_log_percent: u64,
    /// Largest snapshot accepted from a leader, in bytes (held in memory while it arrives);
    /// a larger transfer is refused. Set it alike on every member, above the state's size.
    #[arg(long, env = "CONCLAVE_SNAPSHOT_BYTES_MAX", default_value_t = conclave_server::config::DEFAULT_SNAPSHOT_BYTES_MAX)]
    pub snapshot_bytes_max: u64,
    /// Length of one Raft tick.
    #[arg(long, env = "CONCLAVE_TICK_MS", default_value_t = 10)]
    pub tick_ms: u64,
    /// Heartbeat interval (rounded to ticks).
    #[arg(long, env = "CONCLAVE_HEARTBEAT_MS", default_value_t = 50)]
    pub heartbeat_ms: u64,
    /// Election timeout T; a follower campaigns after [T, 2T) without a leader.
    #[arg(long, env = "CONCLAVE_ELECTION_TIMEOUT_MS", default_value_t = 150)]
    pub election_timeout_ms: u64,
    /// Longest a request waits for a leader or a commit when the client set no deadline.
    #[arg(long, env = "CONCLAVE_REQUEST_TIMEOUT_MS", default_value_t = 5_000)]
    pub request_timeout_ms: u64,
    /// File holding the cluster's peer secret (at least 16 bytes, the same on every member,
    /// mode 0600); peers prove they know it before any Raft message is read. Without it the
    /// key is derived from the cluster id, which anyone who can reach a client port can learn.
    #[arg(long, env = "CONCLAVE_PEER_SECRET_FILE", value_name = "FILE")]
    pub peer_secret_file: Option<PathBuf>,
    #[command(flatten)]
    pub tls: tls_args::ServeTlsArgs,
    #[command(flatten)]
    pub client_limits: client_limits::ClientLimitArgs,
    #[command(flatten)]
    pub auth: cmd::auth::AuthServeArgs,
    /// How --auto-compaction-retention is read: `periodic` keeps a span of time of history,
    /// `revision` a number of revisions.
    #[arg(long, env = "CONCLAVE_AUTO_COMPACTION_MODE", value_enum, default_value_t = CompactionMode::Periodic)]
    pub auto_compaction_mode: CompactionMode,
    /// History the leader keeps when it compacts on its own: periodic, a duration (`30m`,
    /// `1h`, `10s`) or a bare number of hours (etcd's reading); revision, a count. `0` (the
    /// default) leaves compaction to `conclave compact`.
    #[arg(
        long,
        env = "CONCLAVE_AUTO_COMPACTION_RETENTION",
        default_value = "0",
        value_name = "RETENTION"
    )]
    pub auto_compaction_retention: String,
    /// Address of the HTTP listener for /metrics (Prometheus), /health, /readyz and the /ui
    /// dashboard; `none` turns it off. Default: the client host, client port + 10000 (it is
    /// skipped with a WARN if that port is taken).
    #[arg(long, env = "CONCLAVE_LISTEN_METRICS", value_name = "ADDR|none")]
    pub listen_metrics: Option<String>,
    /// A WAL fsync slower than this is logged at WARN and counted.
    #[arg(long, env = "CONCLAVE_WAL_FSYNC_WARN_MS", default_value_t = conclave_server::config::DEFAULT_WAL_FSYNC_WARN_MS)]
    pub wal_fsync_warn_ms: u64,
    /// Answer linearizable reads and lease keepalives on the leader from a leader lease, with
    /// no heartbeat round: faster, but safe only while the members' clocks run at about the
    /// same rate (docs/server.md). Members may differ in it (a rolling change), not in
    /// --tick-ms and --election-timeout-ms.
    #[arg(long, env = "CONCLAVE_LEASE_READS")]
    pub lease_reads: bool,
}

/// `--auto-compaction-mode`.
#[derive(ValueEnum, serde::Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum CompactionMode {
    Periodic,
    Revision,
}

impl CompactionMode {
    pub fn as_str(self) -> &'static str {
        match self {
            CompactionMode::Periodic => "periodic",
            CompactionMode::Revision => "revision",
        }
    }
}

impl ServeArgs {
    /// `--auto-compaction-mode` and `--auto-compaction-retention` as the server's setting.
    fn auto_compaction(&self) -> Result<conclave_server::compactor::AutoCompaction, CliError> {
        use conclave_server::compactor::{AutoCompaction, PERIODIC_RETENTION_MS_MAX};
        let text = self.auto_compaction_retention.trim();
        if text == "0" {
            return Ok(AutoCompaction::Off);
        }
        let bad = |why: &str| {
            CliError::Usage(format!(
                "--auto-compaction-retention {text:?} {why} for --auto-compaction-mode {}",
                self.auto_compaction_mode.as_str()
            ))
        };
        match self.auto_compaction_mode {
            CompactionMode::Revision => {
                let retained: i64 = text
                    .parse()
                    .map_err(|_| bad("is not a number of revisions"))?;
                if retained < 0 {
                    return Err(bad("must not be negative"));
                }
                Ok(AutoCompaction::Revision { retained })
            }
            CompactionMode::Periodic => {
                // etcd reads a bare number as hours.
                let hours = text.parse::<f64>().ok();
                let duration = match hours {
                    Some(hours) if hours.is_finite() && hours > 0.0 => {
                        std::time::Duration::try_from_secs_f64(hours * 3600.0)
                            .map_err(|_| bad("is out of range"))?
                    }
                    Some(_) => return Err(bad("must be positive")),
                    None => cmd::parse_duration(text, "--auto-compaction-retention")
                        .map_err(|f| CliError::Usage(f.message))?,
                };
                let retention_ms = u64::try_from(duration.as_millis()).unwrap_or(u64::MAX);
                if retention_ms == 0 || retention_ms > PERIODIC_RETENTION_MS_MAX {
                    return Err(bad(&format!(
                        "must be between 1 ms and {PERIODIC_RETENTION_MS_MAX} ms"
                    )));
                }
                Ok(AutoCompaction::Periodic { retention_ms })
            }
        }
    }
}

impl ServeArgs {
    /// Turns the flags into a validated server configuration.
    pub fn to_config(&self) -> Result<ServerConfig, CliError> {
        self.check_ranges()?;
        let spec = self
            .initial_cluster
            .clone()
            .unwrap_or_else(|| format!("{}={}", self.name, self.listen_peer));
        let members = parse_members(
            &spec,
            self.initial_cluster_clients.as_deref(),
            self.id,
            &self.name,
            &self.listen_client,
        )?;
        let id = match self.id {
            Some(id) => id,
            None => members
                .iter()
                .find(|m| m.name == self.name)
                .map(|m| m.id)
                .ok_or_else(|| {
                    CliError::Usage(format!(
                        "--name {:?} is not a member of --initial-cluster {spec:?}",
                        self.name
                    ))
                })?,
        };
        let mut config =
            ServerConfig::single(&self.data_dir, &self.listen_client, &self.listen_peer);
        config.id = id;
        config.members = members;
        config.tick_ms = self.tick_ms;
        config.election_ticks = (self.election_timeout_ms / self.tick_ms).max(1);
        config.heartbeat_ticks = (self.heartbeat_ms / self.tick_ms).max(1);
        config.lease_reads = self.lease_reads;
        if config.election_ticks <= config.heartbeat_ticks {
            return Err(CliError::Usage(format!(
                "--election-timeout-ms ({}) must exceed --heartbeat-ms ({}) by at least one tick of --tick-ms ({})",
                self.election_timeout_ms, self.heartbeat_ms, self.tick_ms
            )));
        }
        config.snapshot_entries = self.snapshot_entries;
        config.snapshot_log_percent = self.snapshot_log_percent;
        config.snapshot_bytes_max = self.snapshot_bytes_max;
        config.request_timeout_ms = self.request_timeout_ms;
        config.peer_secret_file = self.peer_secret_file.clone();
        (config.client_tls, config.peer_tls) = self.tls.to_files()?;
        // etcd's common-name authentication rides on the client TLS flag of the same name.
        config.auth.client_cert_auth = self.tls.client_cert_auth;
        config.client_limits = self.client_limits.to_limits();
        self.auth.apply(&mut config.auth)?;
        config.auto_compaction = self.auto_compaction()?;
        config.wal_fsync_warn_ms = self.wal_fsync_warn_ms;
        match self.listen_metrics.as_deref() {
            Some("none") => config.listen_metrics = None,
            Some(address) => config.listen_metrics = Some(address.to_owned()),
            None => {
                config.listen_metrics =
                    conclave_server::http::default_metrics_address(&self.listen_client);
                config.listen_metrics_optional = true;
            }
        }
        config
            .validate()
            .map_err(|e| CliError::Usage(e.to_string()))?;
        Ok(config)
    }
}

impl ServeArgs {
    /// Every numeric flag against its documented range, so a wild value is one sentence naming
    /// the flag rather than an overflow later (the same values come from `--config` keys).
    fn check_ranges(&self) -> Result<(), CliError> {
        use conclave_server::config::{
            ELECTION_TIMEOUT_MS_MAX, HEARTBEAT_MS_MAX, REQUEST_TIMEOUT_MS_MAX,
            SNAPSHOT_BYTES_MAX_LIMIT, SNAPSHOT_BYTES_MAX_MIN, SNAPSHOT_ENTRIES_MAX, TICK_MS_MAX,
        };
        let ranges = [
            ("--tick-ms", self.tick_ms, TICK_MS_MAX),
            ("--heartbeat-ms", self.heartbeat_ms, HEARTBEAT_MS_MAX),
            (
                "--election-timeout-ms",
                self.election_timeout_ms,
                ELECTION_TIMEOUT_MS_MAX,
            ),
            (
                "--request-timeout-ms",
                self.request_timeout_ms,
                REQUEST_TIMEOUT_MS_MAX,
            ),
            (
                "--snapshot-entries",
                self.snapshot_entries,
                SNAPSHOT_ENTRIES_MAX,
            ),
        ];
        for (flag, value, max) in ranges {
            if !(1..=max).contains(&value) {
                return Err(CliError::Usage(format!(
                    "{flag} must be between 1 and {max}, not {value}"
                )));
            }
        }
        let max = conclave_server::config::SNAPSHOT_LOG_PERCENT_MAX;
        if self.snapshot_log_percent > max {
            return Err(CliError::Usage(format!(
                "--snapshot-log-percent must be between 0 and {max}, not {}",
                self.snapshot_log_percent
            )));
        }
        let (min, max) = (SNAPSHOT_BYTES_MAX_MIN, SNAPSHOT_BYTES_MAX_LIMIT);
        if !(min..=max).contains(&self.snapshot_bytes_max) {
            return Err(CliError::Usage(format!(
                "--snapshot-bytes-max must be between {min} and {max}, not {}",
                self.snapshot_bytes_max
            )));
        }
        let range_max = conclave_server::config::GRPC_RESPONSE_BYTES_MAX;
        if let Some(value) = self.client_limits.range_response_bytes_max
            && !(1..=range_max).contains(&value)
        {
            return Err(CliError::Usage(format!(
                "--range-response-bytes-max must be between 1 and {range_max}, not {value}"
            )));
        }
        if self.id == Some(0) {
            return Err(CliError::Usage(
                "--id must be at least 1 (0 is reserved)".into(),
            ));
        }
        Ok(())
    }
}

/// Resolves on SIGTERM or SIGINT (Ctrl-C).
pub async fn termination_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = terminate => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

async fn serve(mut args: ServeCommandArgs, matches: &ArgMatches) -> Result<(), CliError> {
    args.apply_config_file(matches)?;
    let mut config = args.serve.to_config()?;
    config.join = args.initial_cluster_state == ClusterState::Existing;
    config.cluster_id_given = args.initial_cluster_id;
    if !config.join
        && let Some(warning) = cluster_spec::even_cluster_warning(config.members.len())
    {
        tracing::warn!("{warning}");
    }
    conclave_server::server::run(config, termination_signal()).await?;
    Ok(())
}

/// Tokio's own setting for its worker count; when it is set, `serve` leaves the count to it.
const TOKIO_WORKER_THREADS_VAR: &str = "TOKIO_WORKER_THREADS";

/// How many async worker threads `serve` runs on a machine with `cpus` CPUs: one fewer than
/// the CPUs, at least one, because the member's Raft driver has a thread of its own that is
/// busy whenever the workers are (it takes every request and peer message they hand it).
/// With a worker per CPU on top of the driver, the threads outnumber the CPUs and hand work
/// across CPUs more often; on the project's 2-core machine, in an A/B of two rounds, one
/// worker gave 9-16% more puts per second at 64 clients and 7-14% at 1 client than two, on
/// less CPU per put (docs/performance.md). `None`
/// when `TOKIO_WORKER_THREADS` is set: the operator's count wins.
fn serve_worker_threads(cpus: usize, operator_set_count: bool) -> Option<usize> {
    (!operator_set_count).then(|| cpus.saturating_sub(1).max(1))
}

/// The matches of the innermost subcommand (`serve`, or `start` under `daemon`): where the
/// value source of each of its flags is recorded.
fn leaf_matches(matches: &ArgMatches) -> &ArgMatches {
    let mut leaf = matches;
    while let Some((_, sub)) = leaf.subcommand() {
        leaf = sub;
    }
    leaf
}

/// Parses the command line, keeping clap's matches (they say which flags the user set, for
/// `--config`); a bad one ends the process with exit code 2, and with `--json` as an
/// `invalid_argument` document on stdout.
fn parse_cli() -> (Cli, ArgMatches) {
    let parsed = Cli::command().try_get_matches().and_then(|matches| {
        Cli::from_arg_matches(&matches)
            .map(|cli| (cli, matches))
            .map_err(|error| error.format(&mut Cli::command()))
    });
    match parsed {
        Ok(parsed) => parsed,
        Err(error) => {
            use clap::error::ErrorKind;
            let informational = matches!(
                error.kind(),
                ErrorKind::DisplayHelp
                    | ErrorKind::DisplayVersion
                    | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            );
            let args: Vec<String> = std::env::args().collect();
            if !informational && asks_for_json(&args) {
                let sentence = clap_error_sentence(&error.render().to_string());
                cmd::output::emit(
                    &cmd::output::error_document("invalid_argument", &sentence).to_string(),
                );
                std::process::exit(cmd::exit_code("invalid_argument"));
            }
            error.exit()
        }
    }
}

/// Whether a command line clap refused asked for JSON output (`--json`, `-w json`,
/// `--write-out=json`, ...), so the refusal is a JSON document too.
fn asks_for_json(args: &[String]) -> bool {
    args.iter().enumerate().any(|(i, arg)| {
        let next_is_json = || args.get(i + 1).is_some_and(|n| n == "json");
        match arg.as_str() {
            "--json" | "-wjson" | "-w=json" | "--write-out=json" => true,
            "-w" | "--write-out" => next_is_json(),
            _ => false,
        }
    })
}

/// Clap's whole message on one line: the reason with what it lists (the missing arguments,
/// the valid values), without the usage and help hints that follow it.
fn clap_error_sentence(rendered: &str) -> String {
    let mut words = Vec::new();
    for line in rendered.lines() {
        let line = line.trim();
        if line.starts_with("Usage:") || line.starts_with("For more information") {
            break;
        }
        if !line.is_empty() {
            words.push(line.trim_start_matches("error: "));
        }
    }
    let sentence = words.join(" ");
    if sentence.is_empty() {
        "the command line is not valid".to_string()
    } else {
        sentence
    }
}

fn main() {
    let (cli, matches) = parse_cli();
    let matches = leaf_matches(&matches);
    // Client commands are quiet unless asked: their output is the answer, not the logs.
    let default_log = if matches!(cli.command, Command::Client(_) | Command::Daemon(_)) {
        "error"
    } else {
        "info"
    };
    let filter = match &cli.log.log_level {
        Some(level) => match tracing_subscriber::EnvFilter::try_new(level) {
            Ok(filter) => filter,
            Err(error) => {
                eprintln!(
                    "conclave: error: --log-level {level:?} is not a level or filter: {error}"
                );
                std::process::exit(cmd::exit_code("invalid_argument"));
            }
        },
        None => tracing_subscriber::EnvFilter::try_from_env("CONCLAVE_LOG")
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_log)),
    };
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match cli.log.log_format {
        LogFormat::Text => logs.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => logs.json().with_current_span(false).init(),
    }
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    runtime.enable_all();
    if matches!(cli.command, Command::Serve(_)) {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let asked = std::env::var_os(TOKIO_WORKER_THREADS_VAR);
        if let Some(workers) = serve_worker_threads(cpus, asked.is_some()) {
            runtime.worker_threads(workers);
        }
    }
    let runtime = match runtime.build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("conclave: error: cannot start the async runtime: {error}");
            std::process::exit(1);
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Serve(args) => serve(args, matches).await,
            Command::Dev(args) => dev::run(args).await,
            Command::Top(args) => {
                let code =
                    cmd::top::run(cli.global.wants_json(), &cli.global.endpoints_spec(), args)
                        .await;
                std::process::exit(code);
            }
            Command::Certs(command) => certs::run(command),
            Command::Daemon(command) => {
                let code = daemon::run(cli.global.wants_json(), command, matches).await;
                std::process::exit(code);
            }
            Command::Client(command) => {
                let code = cmd::run(cli.global, command).await;
                // Leave at once: background tasks (keepalives, streams) end with the process.
                std::process::exit(code);
            }
        }
    });
    if let Err(error) = result {
        eprintln!("conclave: error: {error}");
        std::process::exit(error.exit_code());
    }
}

#[cfg(test)]
mod tests {
    use super::serve_worker_threads;

    #[test]
    fn serve_leaves_a_cpu_to_the_raft_driver() {
        assert_eq!(serve_worker_threads(1, false), Some(1));
        assert_eq!(serve_worker_threads(2, false), Some(1));
        assert_eq!(serve_worker_threads(8, false), Some(7));
        assert_eq!(serve_worker_threads(8, true), None);
    }
}
