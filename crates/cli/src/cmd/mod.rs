//! The client commands of the `conclave` binary: KV, leases, elections, locks, topics and
//! cluster administration, all through `conclave-client`.
//!
//! Every command ends in one of two ways: success (exit 0, or the exit status of a child
//! command it supervised) or a [`Failure`] carrying a stable code and its exit code.

pub(crate) mod access;
pub(crate) mod auth;
mod bench;
mod bench_scale;
mod child;
pub(crate) mod cluster;
mod elect;
mod kv;
mod lease;
mod lock;
pub mod output;
mod queue;
mod repair;
pub mod top;
mod topic;
mod txn;

use std::time::Duration;

use clap::{Args, Subcommand};
use conclave_client::{Client, ClientOptions, LeaseId};

pub use output::Output;

/// Default client endpoint: a local `conclave serve` or `conclave dev` (etcd's port).
pub const DEFAULT_ENDPOINTS: &str = "127.0.0.1:2379";
/// Default deadline of one request, retries included.
pub const DEFAULT_TIMEOUT: &str = "5s";
/// Longest connection attempt to one endpoint; shorter when `--timeout` is shorter.
const CONNECT_TIMEOUT_MAX: Duration = Duration::from_secs(2);

/// Help text listing the stable error codes and their exit codes.
pub const EXIT_CODES_HELP: &str = "\
Exit codes (with --json, `code` in the error document):
  0   success (or, with `-- CMD`, CMD's own exit status when it ended by itself)
  1   io_error           a local failure (writing a file, reading stdin)
  2   invalid_argument   bad input: flags, TTL, key, revision, txn syntax, a CMD that
                         cannot start
  3   not_found          key, group (no leader), candidate, member or daemon missing
  4   already_exists     lease id or candidate id taken
  5   compacted          the requested revision was compacted
  6   too_large          request, value or TTL over a limit
  7   lease_expired      the lease is gone (expired, revoked, unknown)
  8   leadership_lost    no longer leader or lock holder (stale fence)
  9   timeout            the deadline (--timeout) passed
  10  no_leader          the cluster has no Raft leader
  11  unavailable        a member failed mid-request, or the call is not served
  12  connection_failed  no endpoint could be reached
  13  unauthenticated    no credentials, a wrong password, or an expired token
  14  permission_denied  the user's roles do not allow the call
  15  tls                TLS failed: untrusted or expired certificate, a client
                         certificate refused, or TLS on one side only
  130 interrupted        Ctrl-C / SIGTERM while waiting for a seat or lock, or while CMD
                         ran (after stopping it and resigning or unlocking; a held seat
                         or lock without CMD is released by Ctrl-C with exit 0)";

/// etcdctl's variable for the endpoints, read when neither --endpoints nor
/// CONCLAVE_ENDPOINTS is set.
pub const ETCDCTL_ENDPOINTS_ENV: &str = "ETCDCTL_ENDPOINTS";

/// Flags every client command takes (global: they may appear before or after the command).
#[derive(Args, Debug, Clone)]
pub struct GlobalArgs {
    /// Comma-separated client endpoints, `host:port` or URLs [default: ETCDCTL_ENDPOINTS if
    /// set, else 127.0.0.1:2379].
    #[arg(long, global = true, env = "CONCLAVE_ENDPOINTS")]
    pub endpoints: Option<String>,
    /// Print exactly one JSON document on stdout (one per line for streaming commands).
    #[arg(long, global = true)]
    pub json: bool,
    /// Output format, as etcdctl's flag: `json` is --json; `table` and `simple` are the
    /// human output.
    #[arg(short = 'w', long, global = true, value_enum, value_name = "FORMAT")]
    pub write_out: Option<WriteOut>,
    /// Deadline of each request, retries included (e.g. 500ms, 5s, 1m; default 5s). For
    /// `lock` and `elect campaign` also how long to wait for the lock or the seat.
    #[arg(long, global = true, value_name = "DURATION")]
    pub timeout: Option<String>,
    /// CA certificate (PEM) that signed the servers' certificates; with it a bare host:port
    /// endpoint uses TLS (`https://` endpoints always do, `http://` never).
    #[arg(
        long = "cacert",
        id = "tls_cacert",
        global = true,
        env = "CONCLAVE_CACERT",
        value_name = "FILE"
    )]
    pub cacert: Option<std::path::PathBuf>,
    /// Client certificate (PEM) for servers started with --client-cert-auth; needs --key.
    #[arg(
        long = "cert",
        id = "tls_cert",
        global = true,
        env = "CONCLAVE_CERT",
        value_name = "FILE"
    )]
    pub cert: Option<std::path::PathBuf>,
    /// Private key (PEM) of --cert.
    #[arg(
        long = "key",
        id = "tls_key",
        global = true,
        env = "CONCLAVE_KEY",
        value_name = "FILE"
    )]
    pub key: Option<std::path::PathBuf>,
    /// Authenticate as NAME (when the cluster has auth enabled); the password after a colon,
    /// else from CONCLAVE_PASSWORD, else prompted for on a terminal.
    #[arg(
        long = "user",
        id = "auth_user",
        global = true,
        env = "CONCLAVE_USER",
        value_name = "NAME[:PASSWORD]"
    )]
    pub user: Option<String>,
}

/// `-w/--write-out` values.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteOut {
    Simple,
    Table,
    Json,
}

impl GlobalArgs {
    /// Whether the output is JSON documents (`--json` or `-w json`).
    pub fn wants_json(&self) -> bool {
        self.json || self.write_out == Some(WriteOut::Json)
    }

    /// The endpoint list: --endpoints (or CONCLAVE_ENDPOINTS), else ETCDCTL_ENDPOINTS, else
    /// the default.
    pub fn endpoints_spec(&self) -> String {
        self.endpoints
            .clone()
            .or_else(|| {
                std::env::var(ETCDCTL_ENDPOINTS_ENV)
                    .ok()
                    .filter(|e| !e.trim().is_empty())
            })
            .unwrap_or_else(|| DEFAULT_ENDPOINTS.to_string())
    }
}

/// The client commands.
#[derive(Subcommand, Debug)]
pub enum ClientCommand {
    /// Write KEY=VALUE.
    Put(kv::PutArgs),
    /// Read a key, a prefix or a range.
    Get(kv::GetArgs),
    /// Delete a key or a prefix.
    Del(kv::DelArgs),
    /// Run a transaction read from stdin (etcdctl's format: compares, blank line, success
    /// operations, blank line, failure operations).
    Txn(txn::TxnArgs),
    /// Stream changes of a key or prefix.
    Watch(kv::WatchArgs),
    /// Drop the key-value history below REVISION (etcdctl's `compaction`).
    #[command(alias = "compaction")]
    Compact(kv::CompactArgs),
    /// Leases: grant, revoke, keepalive, ttl, list.
    #[command(subcommand)]
    Lease(lease::LeaseCommand),
    /// Priority election groups: campaign, leader, candidates, observe, resign.
    #[command(subcommand)]
    Elect(elect::ElectCommand),
    /// Hold a fenced lock (while CMD runs, or until Ctrl-C).
    Lock(lock::LockArgs),
    /// Publish DATA to TOPIC.
    Publish(topic::PublishArgs),
    /// Stream a topic's messages.
    Subscribe(topic::SubscribeArgs),
    /// A consumer's unacknowledged messages on one or more topics.
    Inbox(topic::InboxArgs),
    /// Acknowledge a consumer's messages of TOPIC up to SEQ.
    Ack(topic::AckArgs),
    /// Work queues: push, claim, ack, nack, extend, list, stats.
    #[command(subcommand)]
    Queue(queue::QueueCommand),
    /// Topics: configure retention.
    #[command(subcommand)]
    Topic(topic::TopicCommand),
    /// The member this client talks to: node id, cluster id, endpoints, version.
    Info,
    /// Cluster membership.
    #[command(subcommand)]
    Member(cluster::MemberCommand),
    /// One table for the whole cluster: members, leader, term, indexes, db size, health.
    Status,
    /// Hand Raft leadership to member NAME (a name or a hex id).
    TransferLeader(cluster::TransferArgs),
    /// Snapshots of the state machine.
    #[command(subcommand)]
    Snapshot(cluster::SnapshotCommand),
    /// Load generator (etcd v3 put, get, txn, lock) and election failover timer.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Cut a stopped node's write-ahead log at damage `serve` refused to start over, saying
    /// what is lost (--dry-run: only say it).
    Repair(repair::RepairArgs),
    /// Authentication: enable, disable, status.
    #[command(subcommand)]
    Auth(access::AuthCommand),
    /// Users: add, delete, get, list, passwd, grant-role, revoke-role.
    #[command(subcommand)]
    User(access::UserCommand),
    /// Roles and their key-range permissions: add, delete, get, list, grant-permission,
    /// revoke-permission.
    #[command(subcommand)]
    Role(access::RoleCommand),
}

/// Why a command failed: a stable code, one sentence, and the exit code for its class.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub code: &'static str,
    pub message: String,
}

impl Failure {
    pub fn new(code: &'static str, message: impl Into<String>) -> Failure {
        Failure {
            code,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> Failure {
        Failure::new("invalid_argument", message)
    }

    pub fn io(message: impl Into<String>) -> Failure {
        Failure::new("io_error", message)
    }

    /// The documented exit code of this failure's class (see [`EXIT_CODES_HELP`]).
    pub fn exit_code(&self) -> i32 {
        exit_code(self.code)
    }
}

/// Exit code of a stable error code.
pub fn exit_code(code: &str) -> i32 {
    match code {
        "io_error" => 1,
        "invalid_argument" => 2,
        "not_found" => 3,
        "already_exists" => 4,
        "compacted" => 5,
        "too_large" => 6,
        "lease_expired" => 7,
        "leadership_lost" => 8,
        "timeout" => 9,
        "no_leader" => 10,
        "unavailable" => 11,
        "connection_failed" => 12,
        "unauthenticated" => 13,
        "permission_denied" => 14,
        "tls" => 15,
        "interrupted" => 130,
        _ => 1,
    }
}

impl From<conclave_client::Error> for Failure {
    fn from(error: conclave_client::Error) -> Failure {
        Failure::new(error.code(), error.to_string())
    }
}

pub type CmdResult<T = i32> = Result<T, Failure>;

/// Parses `500ms`, `10s`, `2m`, `1h` or a bare number of seconds. Negative, zero or
/// unparsable durations are refused with one sentence naming `what`.
pub fn parse_duration(text: &str, what: &str) -> CmdResult<Duration> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-' || c == '+'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: f64 = number.parse().map_err(|_| {
        Failure::invalid(format!(
            "{what} {text:?} is not a duration (use e.g. 500ms, 10s, 2m)"
        ))
    })?;
    let scale = match unit {
        "ms" => 0.001,
        "" | "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        _ => {
            return Err(Failure::invalid(format!(
                "{what} {text:?} has an unknown unit {unit:?} (use ms, s, m or h)"
            )));
        }
    };
    let seconds = number * scale;
    if !seconds.is_finite() || seconds <= 0.0 {
        return Err(Failure::invalid(format!(
            "{what} must be positive, not {text}"
        )));
    }
    Duration::try_from_secs_f64(seconds)
        .map_err(|_| Failure::invalid(format!("{what} {text:?} is out of range")))
}

/// Lease ids are hexadecimal, as etcdctl prints and reads them; `0x` is optional.
pub fn parse_lease_id(text: &str) -> CmdResult<LeaseId> {
    let digits = text.trim().trim_start_matches("0x");
    let id = u64::from_str_radix(digits, 16).map_err(|_| {
        Failure::invalid(format!(
            "lease id {text:?} is not a hexadecimal number (as `lease grant` prints it)"
        ))
    })?;
    // etcd's ids are int64s printed as unsigned hex; reinterpret the bits.
    let id = id as i64;
    if id == 0 {
        return Err(Failure::invalid("lease id 0 means no lease"));
    }
    Ok(id)
}

/// How lease ids are printed: 16 hex digits, as etcdctl does.
pub fn lease_hex(id: LeaseId) -> String {
    format!("{:016x}", id as u64)
}

/// The shared state of one client command run.
pub struct Ctx {
    pub global: GlobalArgs,
    pub out: Output,
    pub timeout: Duration,
    /// `--timeout` when given explicitly: the wait bound of `lock` and `elect campaign`.
    pub wait: Option<Duration>,
    /// `--cacert --cert --key`, read once.
    pub tls: Option<conclave_client::TlsOptions>,
    /// `--user`, with its password, read once.
    pub credentials: Option<conclave_client::Credentials>,
}

impl Ctx {
    pub fn new(global: GlobalArgs) -> CmdResult<Ctx> {
        let out = Output::new(global.wants_json());
        let wait = global
            .timeout
            .as_deref()
            .map(|t| parse_duration(t, "--timeout"))
            .transpose()?;
        let timeout = match wait {
            Some(wait) => wait,
            None => parse_duration(DEFAULT_TIMEOUT, "--timeout")?,
        };
        let tls = if global.cacert.is_some() || global.cert.is_some() || global.key.is_some() {
            Some(conclave_client::TlsOptions::from_files(
                global.cacert.as_deref(),
                global.cert.as_deref(),
                global.key.as_deref(),
            )?)
        } else {
            None
        };
        let credentials = access::credentials(global.user.as_deref())?;
        Ok(Ctx {
            credentials,
            global,
            out,
            timeout,
            wait,
            tls,
        })
    }

    pub fn endpoints(&self) -> Vec<String> {
        self.global
            .endpoints_spec()
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(str::to_string)
            .collect()
    }

    /// Connects to the cluster, bounded by `--timeout`.
    pub async fn connect(&self) -> CmdResult<Client> {
        let endpoints = self.endpoints();
        if endpoints.is_empty() {
            return Err(Failure::invalid("--endpoints lists no endpoint"));
        }
        let options = ClientOptions {
            tls: self.tls.clone(),
            credentials: self.credentials.clone(),
            request_timeout: self.timeout,
            connect_timeout: self.timeout.min(CONNECT_TIMEOUT_MAX),
            ..ClientOptions::default()
        };
        match tokio::time::timeout(
            self.timeout + CONNECT_TIMEOUT_MAX,
            Client::connect_with(&endpoints, options),
        )
        .await
        {
            Ok(result) => Ok(result?),
            Err(_) => Err(Failure::new(
                "connection_failed",
                format!(
                    "no endpoint of {} answered within {:?}",
                    endpoints.join(","),
                    self.timeout
                ),
            )),
        }
    }
}

/// Runs one client command; answers the process exit code.
pub async fn run(global: GlobalArgs, command: ClientCommand) -> i32 {
    let ctx = match Ctx::new(global.clone()) {
        Ok(ctx) => ctx,
        Err(failure) => {
            Output::new(global.wants_json()).failure(&failure);
            return failure.exit_code();
        }
    };
    let result = match command {
        ClientCommand::Put(args) => kv::put(&ctx, args).await,
        ClientCommand::Get(args) => kv::get(&ctx, args).await,
        ClientCommand::Del(args) => kv::del(&ctx, args).await,
        ClientCommand::Txn(args) => txn::run(&ctx, args).await,
        ClientCommand::Watch(args) => kv::watch(&ctx, args).await,
        ClientCommand::Compact(args) => kv::compact(&ctx, args).await,
        ClientCommand::Lease(command) => lease::run(&ctx, command).await,
        ClientCommand::Elect(command) => elect::run(&ctx, command).await,
        ClientCommand::Lock(args) => lock::run(&ctx, args).await,
        ClientCommand::Publish(args) => topic::publish(&ctx, args).await,
        ClientCommand::Subscribe(args) => topic::subscribe(&ctx, args).await,
        ClientCommand::Inbox(args) => topic::inbox(&ctx, args).await,
        ClientCommand::Ack(args) => topic::ack(&ctx, args).await,
        ClientCommand::Queue(command) => queue::run(&ctx, command).await,
        ClientCommand::Topic(command) => topic::topic(&ctx, command).await,
        ClientCommand::Info => cluster::info(&ctx).await,
        ClientCommand::Member(command) => cluster::member(&ctx, command).await,
        ClientCommand::Status => cluster::status(&ctx).await,
        ClientCommand::TransferLeader(args) => cluster::transfer_leader(&ctx, args).await,
        ClientCommand::Snapshot(command) => cluster::snapshot(&ctx, command).await,
        ClientCommand::Bench(command) => bench::run(&ctx, command).await,
        ClientCommand::Repair(args) => repair::run(&ctx, args),
        ClientCommand::Auth(command) => access::auth(&ctx, command).await,
        ClientCommand::User(command) => access::user(&ctx, command).await,
        ClientCommand::Role(command) => access::role(&ctx, command).await,
    };
    match result {
        Ok(code) => code,
        Err(failure) => {
            ctx.out.failure(&failure);
            failure.exit_code()
        }
    }
}

/// Set once SIGTERM or SIGINT arrived, by the listener the first [`interrupted`] starts.
static INTERRUPTED: std::sync::OnceLock<tokio::sync::watch::Receiver<bool>> =
    std::sync::OnceLock::new();

/// Resolves on SIGTERM or Ctrl-C, at once if one already arrived. The first call starts one
/// listener that stays for the rest of the process: tokio's handler, once installed, stays
/// too, so a listener made per wait would let a signal that comes between two waits (a
/// campaign that was just elected and is starting its command) be swallowed, and the
/// command would run on as if never told to stop. Until the first call the default
/// actions apply, so Ctrl-C still ends a command that never waits for it.
pub async fn interrupted() {
    let mut arrived = INTERRUPTED
        .get_or_init(|| {
            let (tell, arrived) = tokio::sync::watch::channel(false);
            tokio::spawn(async move {
                crate::termination_signal().await;
                let _ = tell.send(true);
                // Kept open so receivers see the flag rather than a closed channel.
                std::future::pending::<()>().await
            });
            arrived
        })
        .clone();
    if arrived.wait_for(|arrived| *arrived).await.is_err() {
        // The listener is gone only with its runtime, when nothing can wait any more.
        std::future::pending::<()>().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A SIGTERM that arrives while no one waits (between two phases of a command) is kept
    /// for the next wait. A listener made per wait lost it: this waited in vain.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_signal_between_two_waits_is_not_lost() {
        // The first wait starts listening; it ends without a signal.
        let first = tokio::time::timeout(Duration::from_millis(200), interrupted()).await;
        assert!(first.is_err(), "no signal was sent yet");
        let status = std::process::Command::new("kill")
            .args(["-TERM", &std::process::id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success());
        // Give the signal time to arrive while nothing waits.
        tokio::time::sleep(Duration::from_millis(300)).await;
        tokio::time::timeout(Duration::from_secs(10), interrupted())
            .await
            .expect("the signal that came between the waits ends the next one");
    }

    #[test]
    fn durations_parse_and_refuse_nonsense() {
        assert_eq!(
            parse_duration("10s", "ttl").ok(),
            Some(Duration::from_secs(10))
        );
        assert_eq!(
            parse_duration("250ms", "ttl").ok(),
            Some(Duration::from_millis(250))
        );
        assert_eq!(
            parse_duration("3", "ttl").ok(),
            Some(Duration::from_secs(3))
        );
        assert_eq!(
            parse_duration("2m", "ttl").ok(),
            Some(Duration::from_secs(120))
        );
        for bad in ["-3", "0", "abc", "5x", "", "-1s"] {
            let failure = parse_duration(bad, "ttl").err();
            assert_eq!(failure.map(|f| f.code), Some("invalid_argument"), "{bad}");
        }
    }

    #[test]
    fn lease_ids_are_hex_and_round_trip() {
        assert_eq!(parse_lease_id("1f").ok(), Some(31));
        assert_eq!(parse_lease_id("0x1f").ok(), Some(31));
        assert_eq!(lease_hex(31), "000000000000001f");
        let big = parse_lease_id("ffffffffffffffff").ok();
        assert_eq!(big, Some(-1));
        assert_eq!(lease_hex(-1), "ffffffffffffffff");
        assert!(parse_lease_id("0").is_err());
        assert!(parse_lease_id("xyz").is_err());
    }

    #[test]
    fn every_client_code_has_its_own_exit_code() {
        let mut seen = std::collections::HashSet::new();
        for code in conclave_client::Error::CODES {
            let exit = exit_code(code);
            assert!(exit > 1, "{code}");
            assert!(seen.insert(exit), "{code} shares exit code {exit}");
            assert!(EXIT_CODES_HELP.contains(code), "{code} undocumented");
        }
    }
}
