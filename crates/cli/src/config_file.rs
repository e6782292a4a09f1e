//! `--config FILE`: the flags of `conclave serve` read from a TOML file.
//!
//! The keys are the long flag names (`heartbeat-ms = 50`). A value in the file fills a flag
//! only when neither the command line nor its `CONCLAVE_<FLAG>` environment variable set it,
//! which clap tells apart through each argument's value source; so the order is flag >
//! environment > file > built-in default.

use std::path::{Path, PathBuf};

use clap::ArgMatches;
use clap::parser::ValueSource;
use serde::Deserialize;

use crate::cluster_spec::CliError;
use crate::{ClusterState, ServeCommandArgs};

/// The contents of a config file. Every field is a serve flag under its long name; a key that
/// is none of them is an error rather than silently ignored, so a typo cannot go unnoticed.
/// `initial-cluster-id`: a cluster id in hex, checked as the flag checks it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub struct ClusterIdHex(pub u64);

impl TryFrom<String> for ClusterIdHex {
    type Error = String;
    fn try_from(text: String) -> Result<Self, String> {
        crate::parse_cluster_id(&text).map(ClusterIdHex)
    }
}

impl From<ClusterIdHex> for Option<u64> {
    fn from(id: ClusterIdHex) -> Option<u64> {
        Some(id.0)
    }
}

#[derive(Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ConfigFile {
    pub name: Option<String>,
    pub id: Option<u64>,
    pub data_dir: Option<PathBuf>,
    pub listen_client: Option<String>,
    pub listen_peer: Option<String>,
    pub initial_cluster: Option<String>,
    pub initial_cluster_clients: Option<String>,
    pub initial_cluster_state: Option<ClusterState>,
    pub initial_cluster_id: Option<ClusterIdHex>,
    pub snapshot_entries: Option<u64>,
    pub snapshot_log_percent: Option<u64>,
    pub snapshot_bytes_max: Option<u64>,
    pub tick_ms: Option<u64>,
    pub heartbeat_ms: Option<u64>,
    pub election_timeout_ms: Option<u64>,
    pub request_timeout_ms: Option<u64>,
    pub peer_secret_file: Option<PathBuf>,
    pub listen_metrics: Option<String>,
    pub wal_fsync_warn_ms: Option<u64>,
    pub lease_reads: Option<bool>,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    pub trusted_ca_file: Option<PathBuf>,
    pub client_cert_auth: Option<bool>,
    pub peer_cert_file: Option<PathBuf>,
    pub peer_key_file: Option<PathBuf>,
    pub peer_trusted_ca_file: Option<PathBuf>,
    pub client_connections_max: Option<usize>,
    pub client_idle_timeout_ms: Option<u64>,
    pub grpc_streams_per_connection_max: Option<u32>,
    pub watches_max: Option<usize>,
    pub lease_keepalive_streams_max: Option<usize>,
    pub topics_per_request_max: Option<usize>,
    pub read_response_bytes_max: Option<usize>,
    pub topic_subscriptions_max: Option<usize>,
    pub election_observers_max: Option<usize>,
    pub lock_waits_max: Option<usize>,
    pub campaign_waits_max: Option<usize>,
    pub queue_claim_waits_max: Option<usize>,
    pub range_response_bytes_max: Option<usize>,
    pub auto_compaction_mode: Option<crate::CompactionMode>,
    /// A string, as the flag takes it (`"1h"`, `"24"`, `"1000"`).
    pub auto_compaction_retention: Option<String>,
    pub auth_token: Option<String>,
    pub auth_token_ttl: Option<u64>,
    pub bcrypt_cost: Option<u32>,
}

impl ConfigFile {
    /// Reads and parses `path`; every failure is one sentence naming the file.
    pub fn load(path: &Path) -> Result<ConfigFile, CliError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            CliError::Usage(format!("cannot read config file {}: {e}", path.display()))
        })?;
        ConfigFile::parse(&text)
            .map_err(|e| CliError::Usage(format!("config file {}, {e}", path.display())))
    }

    /// Parses a file's text; the error starts with the line it concerns when TOML knows it.
    fn parse(text: &str) -> Result<ConfigFile, String> {
        toml::from_str(text).map_err(|error| {
            // toml's messages may span lines (what was found, what was expected): one line.
            let message = error
                .message()
                .lines()
                .map(str::trim)
                .filter(|line| !line.is_empty())
                .collect::<Vec<_>>()
                .join("; ");
            match error.span() {
                Some(span) => format!("line {}: {message}", line_of(text, span.start)),
                None => message,
            }
        })
    }
}

/// The 1-based line of byte offset `offset` in `text`.
fn line_of(text: &str, offset: usize) -> usize {
    let end = offset.min(text.len());
    text.as_bytes()[..end]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

/// Whether the user set argument `id` on the command line or in the environment, where it
/// beats the file. Any other source (the built-in default, or none for flags without one)
/// leaves the argument to the file.
fn set_by_user(matches: &ArgMatches, id: &str) -> bool {
    matches!(
        matches.value_source(id),
        Some(ValueSource::CommandLine | ValueSource::EnvVariable)
    )
}

impl ServeCommandArgs {
    /// Reads the file named by `--config` (or `CONCLAVE_CONFIG`), if any, into every argument
    /// the user did not set. `matches` are the matches of the subcommand these args came from.
    pub fn apply_config_file(&mut self, matches: &ArgMatches) -> Result<(), CliError> {
        let Some(path) = self.config.clone() else {
            return Ok(());
        };
        let file = ConfigFile::load(&path)?;
        self.merge(file, matches);
        Ok(())
    }

    fn merge(&mut self, file: ConfigFile, matches: &ArgMatches) {
        // Exhaustive on purpose: a new key does not compile until it is merged too. Each field
        // is named like its clap argument id, which `value_source` takes.
        let ConfigFile {
            name,
            id,
            data_dir,
            listen_client,
            listen_peer,
            initial_cluster,
            initial_cluster_clients,
            initial_cluster_state,
            initial_cluster_id,
            snapshot_entries,
            snapshot_log_percent,
            snapshot_bytes_max,
            tick_ms,
            heartbeat_ms,
            election_timeout_ms,
            request_timeout_ms,
            peer_secret_file,
            listen_metrics,
            wal_fsync_warn_ms,
            lease_reads,
            cert_file,
            key_file,
            trusted_ca_file,
            client_cert_auth,
            peer_cert_file,
            peer_key_file,
            peer_trusted_ca_file,
            client_connections_max,
            client_idle_timeout_ms,
            grpc_streams_per_connection_max,
            watches_max,
            lease_keepalive_streams_max,
            topics_per_request_max,
            read_response_bytes_max,
            topic_subscriptions_max,
            election_observers_max,
            lock_waits_max,
            campaign_waits_max,
            queue_claim_waits_max,
            range_response_bytes_max,
            auto_compaction_mode,
            auto_compaction_retention,
            auth_token,
            auth_token_ttl,
            bcrypt_cost,
        } = file;
        macro_rules! fill {
            ($key:ident => $target:expr) => {
                if let Some(value) = $key
                    && !set_by_user(matches, stringify!($key))
                {
                    $target = value.into();
                }
            };
        }
        let serve = &mut self.serve;
        fill!(name => serve.name);
        fill!(id => serve.id);
        fill!(data_dir => serve.data_dir);
        fill!(listen_client => serve.listen_client);
        fill!(listen_peer => serve.listen_peer);
        fill!(listen_metrics => serve.listen_metrics);
        fill!(wal_fsync_warn_ms => serve.wal_fsync_warn_ms);
        fill!(lease_reads => serve.lease_reads);
        fill!(initial_cluster => serve.initial_cluster);
        fill!(initial_cluster_clients => serve.initial_cluster_clients);
        fill!(snapshot_entries => serve.snapshot_entries);
        fill!(snapshot_log_percent => serve.snapshot_log_percent);
        fill!(snapshot_bytes_max => serve.snapshot_bytes_max);
        fill!(tick_ms => serve.tick_ms);
        fill!(heartbeat_ms => serve.heartbeat_ms);
        fill!(election_timeout_ms => serve.election_timeout_ms);
        fill!(request_timeout_ms => serve.request_timeout_ms);
        fill!(peer_secret_file => serve.peer_secret_file);
        fill!(initial_cluster_state => self.initial_cluster_state);
        fill!(initial_cluster_id => self.initial_cluster_id);
        fill!(auto_compaction_mode => serve.auto_compaction_mode);
        fill!(auto_compaction_retention => serve.auto_compaction_retention);
        fill!(auth_token => serve.auth.auth_token);
        fill!(auth_token_ttl => serve.auth.auth_token_ttl);
        fill!(bcrypt_cost => serve.auth.bcrypt_cost);
        let tls = &mut self.serve.tls;
        fill!(cert_file => tls.cert_file);
        fill!(key_file => tls.key_file);
        fill!(trusted_ca_file => tls.trusted_ca_file);
        fill!(client_cert_auth => tls.client_cert_auth);
        fill!(peer_cert_file => tls.peer_cert_file);
        fill!(peer_key_file => tls.peer_key_file);
        fill!(peer_trusted_ca_file => tls.peer_trusted_ca_file);
        let limits = &mut self.serve.client_limits;
        fill!(client_connections_max => limits.client_connections_max);
        fill!(client_idle_timeout_ms => limits.client_idle_timeout_ms);
        fill!(grpc_streams_per_connection_max => limits.grpc_streams_per_connection_max);
        fill!(watches_max => limits.watches_max);
        fill!(lease_keepalive_streams_max => limits.lease_keepalive_streams_max);
        fill!(topics_per_request_max => limits.topics_per_request_max);
        fill!(read_response_bytes_max => limits.read_response_bytes_max);
        fill!(topic_subscriptions_max => limits.topic_subscriptions_max);
        fill!(election_observers_max => limits.election_observers_max);
        fill!(lock_waits_max => limits.lock_waits_max);
        fill!(campaign_waits_max => limits.campaign_waits_max);
        fill!(queue_claim_waits_max => limits.queue_claim_waits_max);
        fill!(range_response_bytes_max => limits.range_response_bytes_max);
    }
}

/// `--data-dir` of `daemon stop|status` from the file named by `--config`, unless the user set
/// it: the same rule as for serve, so the same file finds the daemon it started.
pub fn resolve_data_dir(
    data_dir: &mut PathBuf,
    config: Option<&Path>,
    matches: &ArgMatches,
) -> Result<(), CliError> {
    let Some(path) = config else {
        return Ok(());
    };
    if let Some(dir) = ConfigFile::load(path)?.data_dir
        && !set_by_user(matches, "data_dir")
    {
        *data_dir = dir;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, FromArgMatches};

    use super::*;
    use crate::{Cli, Command};

    /// The serve args and the `serve` matches of a command line.
    fn serve(argv: &[&str]) -> (ServeCommandArgs, ArgMatches) {
        let matches = Cli::command()
            .try_get_matches_from(argv)
            .expect("a valid command line");
        let cli = Cli::from_arg_matches(&matches).expect("matches fit the parser");
        let Command::Serve(args) = cli.command else {
            panic!("not serve: {argv:?}");
        };
        let sub = matches
            .subcommand_matches("serve")
            .expect("serve matches")
            .clone();
        (args, sub)
    }

    const FULL: &str = r#"
name = "alpha"
id = 7
data-dir = "/var/lib/conclave"
listen-client = "10.0.0.1:2379"
listen-peer = "10.0.0.1:2380"
initial-cluster = "7=10.0.0.1:2380"
initial-cluster-clients = "7=10.0.0.1:2379"
initial-cluster-state = "existing"
initial-cluster-id = "3f2a9c0d11b7e845"
snapshot-entries = 500
snapshot-log-percent = 250
snapshot-bytes-max = 1073741824
tick-ms = 5
heartbeat-ms = 25
election-timeout-ms = 300
lease-reads = true
request-timeout-ms = 900
peer-secret-file = "/etc/conclave/peer-secret"
cert-file = "/etc/conclave/server.pem"
key-file = "/etc/conclave/server-key.pem"
trusted-ca-file = "/etc/conclave/ca.pem"
client-cert-auth = true
peer-cert-file = "/etc/conclave/alpha-peer.pem"
peer-key-file = "/etc/conclave/alpha-peer-key.pem"
peer-trusted-ca-file = "/etc/conclave/ca.pem"
client-connections-max = 100
client-idle-timeout-ms = 60000
grpc-streams-per-connection-max = 64
watches-max = 1000
lease-keepalive-streams-max = 100
topics-per-request-max = 16
read-response-bytes-max = 65536
topic-subscriptions-max = 10
election-observers-max = 11
lock-waits-max = 12
campaign-waits-max = 13
range-response-bytes-max = 1048576
listen-metrics = "10.0.0.1:12379"
wal-fsync-warn-ms = 500
queue-claim-waits-max = 14
auto-compaction-mode = "periodic"
auto-compaction-retention = "1h"
auth-token = "simple"
auth-token-ttl = 600
bcrypt-cost = 12
"#;

    #[test]
    fn every_serve_flag_is_a_key_and_every_key_a_serve_flag() {
        let mut command = Cli::command();
        let serve = command
            .find_subcommand_mut("serve")
            .expect("a serve subcommand");
        let mut flags: Vec<String> = serve
            .get_arguments()
            .filter_map(|arg| arg.get_long().map(str::to_string))
            .filter(|long| long != "config" && long != "help")
            .filter(|long| !arg_is_global(long))
            .collect();
        flags.sort();
        let parsed: toml::Table = toml::from_str(FULL).expect("valid TOML");
        let mut keys: Vec<String> = parsed.keys().cloned().collect();
        keys.sort();
        assert_eq!(flags, keys);
        // And the typed parse accepts all of them.
        let file = ConfigFile::parse(FULL).expect("a valid file");
        assert_eq!(file.heartbeat_ms, Some(25));
        assert_eq!(file.initial_cluster_state, Some(ClusterState::Existing));
        assert_eq!(file.lease_reads, Some(true));
    }

    #[test]
    fn the_example_in_the_docs_parses_and_names_every_key() {
        let doc = include_str!("../../../docs/server.md");
        let start = doc
            .find("```toml\n")
            .expect("a TOML example in docs/server.md")
            + 8;
        let len = doc[start..].find("```").expect("the example ends");
        let example = &doc[start..start + len];
        let parsed: toml::Table = toml::from_str(example).expect("valid TOML");
        let full: toml::Table = toml::from_str(FULL).expect("valid TOML");
        let mut keys: Vec<&String> = parsed.keys().collect();
        // `id` and `name` are alternatives; the example shows `name`.
        let mut all: Vec<&String> = full.keys().filter(|key| *key != "id").collect();
        keys.sort();
        all.sort();
        assert_eq!(keys, all, "the docs' example shows every key but `id`");
        ConfigFile::parse(example).expect("the docs' example is a valid config file");
    }

    /// Global client flags (`--endpoints`, `--json`, ...) show up under every subcommand.
    fn arg_is_global(long: &str) -> bool {
        Cli::command()
            .get_arguments()
            .any(|arg| arg.get_long() == Some(long))
    }

    #[test]
    fn the_file_fills_defaults_and_every_key_lands_in_its_field() {
        let (mut args, matches) = serve(&["conclave", "serve"]);
        args.merge(ConfigFile::parse(FULL).expect("valid"), &matches);
        let s = &args.serve;
        assert_eq!(s.name, "alpha");
        assert_eq!(s.id, Some(7));
        assert_eq!(s.data_dir, PathBuf::from("/var/lib/conclave"));
        assert_eq!(s.listen_client, "10.0.0.1:2379");
        assert_eq!(s.listen_peer, "10.0.0.1:2380");
        assert_eq!(s.initial_cluster.as_deref(), Some("7=10.0.0.1:2380"));
        assert_eq!(
            s.initial_cluster_clients.as_deref(),
            Some("7=10.0.0.1:2379")
        );
        assert_eq!(s.snapshot_entries, 500);
        assert_eq!(s.snapshot_log_percent, 250);
        assert_eq!(s.snapshot_bytes_max, 1 << 30);
        assert_eq!(s.client_limits.range_response_bytes_max, Some(1 << 20));
        assert_eq!(s.tick_ms, 5);
        assert_eq!(s.heartbeat_ms, 25);
        assert_eq!(s.election_timeout_ms, 300);
        assert_eq!(s.request_timeout_ms, 900);
        assert_eq!(
            s.peer_secret_file.as_deref(),
            Some(std::path::Path::new("/etc/conclave/peer-secret"))
        );
        assert_eq!(args.initial_cluster_state, ClusterState::Existing);
        assert_eq!(args.initial_cluster_id, Some(0x3f2a_9c0d_11b7_e845));
        assert!(s.tls.client_cert_auth);
        assert_eq!(
            s.tls.peer_cert_file.as_deref(),
            Some(std::path::Path::new("/etc/conclave/alpha-peer.pem"))
        );
        assert_eq!(
            s.tls.trusted_ca_file.as_deref(),
            Some(std::path::Path::new("/etc/conclave/ca.pem"))
        );
    }

    #[test]
    fn a_flag_beats_the_file_and_keys_the_file_omits_keep_their_defaults() {
        let (mut args, matches) = serve(&[
            "conclave",
            "serve",
            "--heartbeat-ms",
            "70",
            "--id",
            "3",
            "--initial-cluster-state",
            "new",
        ]);
        let file = ConfigFile::parse(
            "heartbeat-ms = 20\nid = 9\ninitial-cluster-state = \"existing\"\ntick-ms = 4\n",
        )
        .expect("valid");
        args.merge(file, &matches);
        assert_eq!(args.serve.heartbeat_ms, 70);
        assert_eq!(args.serve.id, Some(3));
        assert_eq!(args.initial_cluster_state, ClusterState::New);
        assert_eq!(args.serve.tick_ms, 4);
        assert_eq!(args.serve.election_timeout_ms, 150);
        assert_eq!(args.serve.listen_client, "127.0.0.1:2379");
    }

    #[test]
    fn bad_files_give_one_line_naming_the_problem_and_its_line() {
        let cases = [
            ("name = \"a\"\nheartbeat = 50\n", "line 2", "heartbeat"),
            (
                "name = \"a\"\n\nlisten-client = \"127.0.0.1:1\n",
                "line 3",
                "",
            ),
            ("heartbeat-ms = \"fast\"\n", "line 1", "fast"),
            ("heartbeat-ms = -5\n", "line 1", "-5"),
            ("initial-cluster-state = \"old\"\n", "line 1", "old"),
            ("[server]\nname = \"a\"\n", "line 1", "server"),
        ];
        for (text, line, word) in cases {
            let message = ConfigFile::parse(text).expect_err(text);
            assert!(!message.contains('\n'), "{message:?}");
            assert!(message.starts_with(line), "{text:?}: {message}");
            assert!(message.contains(word), "{text:?}: {message}");
        }
    }

    #[test]
    fn every_numeric_value_out_of_range_is_one_sentence_naming_its_flag() {
        let huge = u64::MAX.to_string();
        let cases = [
            ("tick-ms", "0"),
            ("tick-ms", huge.as_str()),
            ("heartbeat-ms", "0"),
            ("heartbeat-ms", huge.as_str()),
            ("election-timeout-ms", huge.as_str()),
            ("election-timeout-ms", "0"),
            ("request-timeout-ms", huge.as_str()),
            ("request-timeout-ms", "0"),
            ("snapshot-entries", "0"),
            ("snapshot-entries", huge.as_str()),
            ("snapshot-log-percent", "1001"),
            ("id", "0"),
        ];
        for (key, value) in cases {
            // The same value as a flag and as a key of the file: both reach the same check.
            let flag = format!("--{key}");
            let mut argv = vec!["conclave", "serve", &flag, value];
            if key != "tick-ms" {
                // The issue's case: a 1 ms tick makes the election timeout overflow in ticks.
                argv.extend(["--tick-ms", "1"]);
            }
            let (args, _) = serve(&argv);
            let error = args.serve.to_config().expect_err(&flag);
            assert_eq!(error.exit_code(), 2, "{flag} {value}");
            let text = error.to_string();
            assert!(text.starts_with(&flag), "{flag} {value}: {text}");
            assert!(!text.contains('\n'), "{text}");
            let (mut args, matches) = serve(&["conclave", "serve"]);
            let file = ConfigFile::parse(&format!("{key} = {value}\n")).expect("valid TOML");
            args.merge(file, &matches);
            let text = args.serve.to_config().expect_err(key).to_string();
            assert!(text.starts_with(&flag), "file {key} = {value}: {text}");
        }
        let (args, _) = serve(&["conclave", "serve", "--heartbeat-ms", "150"]);
        let text = args.serve.to_config().expect_err("heartbeat").to_string();
        assert!(text.contains("--election-timeout-ms"), "{text}");
    }

    #[test]
    fn a_missing_file_is_one_sentence_naming_it() {
        let path =
            std::env::temp_dir().join(format!("conclave-no-such-{}.toml", std::process::id()));
        let error = ConfigFile::load(&path).expect_err("missing");
        assert_eq!(error.exit_code(), 2);
        let text = error.to_string();
        assert!(text.contains(&path.display().to_string()), "{text}");
        assert!(!text.contains('\n'), "{text}");
    }

    #[test]
    fn line_numbers_count_from_one() {
        assert_eq!(line_of("a\nb\nc", 0), 1);
        assert_eq!(line_of("a\nb\nc", 2), 2);
        assert_eq!(line_of("a\nb\nc", 4), 3);
        assert_eq!(line_of("a", 99), 1);
    }
}
