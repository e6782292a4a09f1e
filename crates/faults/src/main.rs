//! `conclave-faults`: runs Conclave under faults and checks what clients saw.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use conclave_client::{Client, ClientOptions, GetOptions};
use conclave_faults::Error;
use conclave_faults::checkers::{
    self,
    lease::{LeaseBounds, SlowClock},
};
use conclave_faults::cluster::{Cluster, LeaseReads};
use conclave_faults::history::{self, Event, Kind, Recorder};
use conclave_faults::nemesis::{self, Family};
use conclave_faults::net::{self, Net};
use conclave_faults::workloads::{self, Ctx, PinnedReads, Resource};

/// How long the cluster may take to elect its first leader, and to recover after the run.
const LEADER_WAIT: Duration = Duration::from_secs(30);
/// How long watchers may take to catch up with the final revision.
const WATCH_CATCH_UP: Duration = Duration::from_secs(20);
/// Slack of the lease checker's upper bound (scheduling on a shared machine, probe spacing).
const LEASE_SLACK: Duration = Duration::from_secs(2);
/// How much longer than granted the lease negative control claims its leases are: a lease
/// that ended this much early must be caught.
const LEASE_SHORT_BY: Duration = Duration::from_millis(20);
/// Under the skew nemesis a leader's clock may run this much fast (parts per million), the
/// clients' documented allowance (`LeaseSafety`); the lease checker allows for it.
const SKEW_DRIFT_PPM: u64 = 10_000;
/// First port on loopback (below Linux's ephemeral range).
const LOOPBACK_FIRST_PORT: u16 = 23_000;

const WORKLOADS: &[&str] = &[
    "register", "watch", "lock", "election", "lease", "topic", "queue",
];
const NEGATIVE_CONTROLS: &[(&str, &str)] = &[
    ("register-serializable", "register"),
    ("watch-drop", "watch"),
    ("lock-unfenced", "lock"),
    ("election-unfenced", "election"),
    ("lease-short-ttl", "lease"),
    ("lease-fast-clock", "lease"),
    ("topic-ack-unread", "topic"),
    ("queue-ack-unrecorded", "queue"),
];
/// Clock rate of every member in the `lease-fast-clock` control: far beyond the clients'
/// drift allowance, so leases end early in real time and the lease checker must say so.
const FAST_CLOCK_RATE: f64 = 1.5;

#[derive(Parser)]
#[command(
    name = "conclave-faults",
    about = "Runs a Conclave cluster under faults and checks the clients' histories"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start a cluster, run workloads under a nemesis, check the histories.
    Run(RunArgs),
    /// Check the histories a run wrote to a directory.
    Check {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long, default_value_t = 150)]
        election_timeout_ms: u64,
    },
}

#[derive(clap::Args, Clone)]
struct RunArgs {
    /// Length of the faulty phase, in minutes (fractions allowed).
    #[arg(long, default_value_t = 1.0)]
    minutes: f64,
    /// Members of the cluster (3 or 5).
    #[arg(long, default_value_t = 3)]
    members: usize,
    /// Faults: partition, kill, pause, skew, member (comma-separated; empty for none).
    #[arg(
        long,
        default_value = "partition,kill,pause,skew,member",
        value_delimiter = ','
    )]
    nemesis: Vec<String>,
    /// Workloads: register, watch, lock, election, lease, topic, queue.
    #[arg(
        long,
        default_value = "register,watch,lock,election,lease,topic,queue",
        value_delimiter = ','
    )]
    workload: Vec<String>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Where histories and member logs go (default: a fresh directory under /tmp).
    #[arg(long)]
    out: Option<PathBuf>,
    /// The conclave binary (default: next to this one).
    #[arg(long)]
    binary: Option<PathBuf>,
    /// Run members on loopback even where network namespaces work.
    #[arg(long)]
    loopback: bool,
    /// Raft election timeout of the members.
    #[arg(long, default_value_t = 150)]
    election_timeout_ms: u64,
    /// Run a negative control instead: the named bug is planted and the run succeeds only if
    /// its checker catches it. One of register-serializable, watch-drop, lock-unfenced,
    /// election-unfenced, lease-short-ttl, lease-fast-clock, topic-ack-unread,
    /// queue-ack-unrecorded.
    #[arg(long)]
    negative_control: Option<String>,
    /// Turn TLS on everywhere: members serve clients over TLS and require a client certificate
    /// (`--client-cert-auth`), members talk to each other over mutual TLS, and every client of
    /// the harness (workloads, probes, the nemesis's membership calls) connects over TLS. The
    /// certificates come from a throwaway CA made with `conclave certs` in the members'
    /// directory.
    #[arg(long)]
    tls: bool,
    /// Lease reads on the members (`--lease-reads`): `off`, `all`, or `mixed`, where each
    /// start of a member turns them on or off in turn (members with and without the flag side
    /// by side, as in a rolling change of it; the kill and member nemeses restart members).
    #[arg(long, value_enum, default_value_t = LeaseReads::Off)]
    lease_reads: LeaseReads,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => run(args),
        Command::Check {
            dir,
            election_timeout_ms,
        } => check_dir(&dir, election_timeout_ms)
            .map(|report| if report.total() == 0 { 0 } else { 1 }),
    };
    match result {
        Ok(0) => ExitCode::SUCCESS,
        Ok(_) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("error [{}]: {error}", error.code());
            ExitCode::from(2)
        }
    }
}

fn run(args: RunArgs) -> Result<u8, Error> {
    let families: Vec<Family> = args
        .nemesis
        .iter()
        .filter(|n| !n.is_empty())
        .map(|n| {
            Family::parse(n).ok_or_else(|| {
                Error::Usage(format!(
                    "unknown nemesis {n:?} (partition, kill, pause, skew, member)"
                ))
            })
        })
        .collect::<Result<_, _>>()?;
    for w in &args.workload {
        if !WORKLOADS.contains(&w.as_str()) {
            return Err(Error::Usage(format!(
                "unknown workload {w:?} ({})",
                WORKLOADS.join(", ")
            )));
        }
    }
    if !(3..=9).contains(&args.members) {
        return Err(Error::Usage("--members must be between 3 and 9".into()));
    }
    if !(args.minutes > 0.0 && args.minutes <= 24.0 * 60.0) {
        return Err(Error::Usage(
            "--minutes must be above 0 and at most a day".into(),
        ));
    }
    let negative = match &args.negative_control {
        None => None,
        Some(name) => Some(
            NEGATIVE_CONTROLS
                .iter()
                .find(|(n, _)| n == name)
                .copied()
                .ok_or_else(|| Error::Usage(format!("unknown negative control {name:?}")))?,
        ),
    };
    let binary = match &args.binary {
        Some(path) => path.clone(),
        None => std::env::current_exe()
            .ok()
            .and_then(|exe| exe.parent().map(|dir| dir.join("conclave")))
            .ok_or_else(|| Error::Usage("say where conclave is with --binary".into()))?,
    };
    if !binary.exists() {
        return Err(Error::Usage(format!(
            "{} does not exist (build it, or --binary)",
            binary.display()
        )));
    }
    let out = args.out.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!(
            "conclave-faults-{}-{}",
            std::process::id(),
            args.seed
        ))
    });
    std::fs::create_dir_all(&out).map_err(|source| Error::Io {
        what: format!("create {}", out.display()),
        source,
    })?;
    // A fresh cluster every run: the checkers assume every register starts empty.
    let members_dir = out.join("members");
    if members_dir.exists() {
        std::fs::remove_dir_all(&members_dir).map_err(|source| Error::Io {
            what: format!("clear {}", members_dir.display()),
            source,
        })?;
    }
    net::clean_stale();
    // Before the runtime starts: the harness may move itself into the client namespace.
    let net = Net::new(args.members, args.loopback, LOOPBACK_FIRST_PORT)?;
    println!(
        "members in {:?} mode; histories and logs in {}",
        net.mode,
        out.display()
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|source| Error::Io {
            what: "start the runtime".into(),
            source,
        })?;
    let clock_rate =
        (args.negative_control.as_deref() == Some("lease-fast-clock")).then_some(FAST_CLOCK_RATE);
    let cluster = Cluster::start(
        net,
        binary,
        out.join("members"),
        args.election_timeout_ms,
        clock_rate,
        args.tls,
        args.lease_reads,
    )?;
    if args.lease_reads != LeaseReads::Off {
        println!(
            "lease reads: {} (the members' start-up lines give lease_read_ms)",
            match args.lease_reads {
                LeaseReads::All => "on every member",
                _ => "on every other start of each member",
            }
        );
    }
    if args.tls {
        println!(
            "TLS on: client TLS with client certificates required, peer mutual TLS (certificates in {})",
            out.join("members").join("tls").display()
        );
    }
    // Returning (also on a signal or a panic, which unwinds) drops the cluster and the
    // network: members are killed and the run's namespaces deleted.
    runtime.block_on(async move {
        let mut terminate = tokio::signal::unix::signal(
            tokio::signal::unix::SignalKind::terminate(),
        )
        .map_err(|source| Error::Io {
            what: "listen for SIGTERM".into(),
            source,
        })?;
        tokio::select! {
            result = run_async(args, families, negative, cluster, out) => result,
            _ = tokio::signal::ctrl_c() => {
                eprintln!("interrupted; cleaning up");
                Ok(130)
            }
            _ = terminate.recv() => {
                eprintln!("terminated; cleaning up");
                Ok(143)
            }
        }
    })
}

async fn wait_for_leader(cluster: &tokio::sync::Mutex<Cluster>) -> Result<(), Error> {
    let start = Instant::now();
    while start.elapsed() < LEADER_WAIT {
        if cluster.lock().await.leader().await.is_some() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(Error::Cluster(format!("no leader within {LEADER_WAIT:?}")))
}

/// One client per member, each staying on its member ([`ClientOptions::prefer_leader`] off):
/// given the endpoints with that member first, it uses the member while it answers and knows
/// a leader, and moves on to the next one only when it does not.
async fn member_clients(
    endpoints: &[String],
    options: &ClientOptions,
) -> Result<Vec<Client>, Error> {
    let options = ClientOptions {
        prefer_leader: false,
        ..options.clone()
    };
    let mut clients = Vec::with_capacity(endpoints.len());
    for first in 0..endpoints.len() {
        let mut order = endpoints.to_vec();
        order.rotate_left(first);
        let client = Client::connect_with(&order, options.clone())
            .await
            .map_err(|e| Error::Cluster(e.to_string()))?;
        let on = client
            .current_endpoint()
            .await
            .map_err(|e| Error::Cluster(e.to_string()))?;
        println!("client staying on one member: starts on {on}");
        clients.push(client);
    }
    Ok(clients)
}

async fn run_async(
    args: RunArgs,
    families: Vec<Family>,
    negative: Option<(&'static str, &'static str)>,
    cluster: Cluster,
    out: PathBuf,
) -> Result<u8, Error> {
    let cluster = std::sync::Arc::new(tokio::sync::Mutex::new(cluster));
    wait_for_leader(&cluster).await?;
    let (endpoints, tls) = {
        let cluster = cluster.lock().await;
        (cluster.client_endpoints(), cluster.client_tls().cloned())
    };
    if let Some(tls) = &tls {
        // Every member, so a member started without the flags cannot hide behind the others.
        for endpoint in &endpoints {
            conclave_faults::tls::verify_enforced(endpoint, tls).await?;
        }
        println!("TLS checked on every member: plaintext and certificate-less clients refused");
    }
    let options = ClientOptions {
        request_timeout: workloads::REQUEST_TIMEOUT,
        connect_timeout: Duration::from_millis(500),
        tls: tls.clone(),
        ..Default::default()
    };
    let client = Client::connect_with(&endpoints, options.clone())
        .await
        .map_err(|e| Error::Cluster(e.to_string()))?;
    let member_clients = member_clients(&endpoints, &options).await?;
    let start = Instant::now();
    let until = start + Duration::from_secs_f64(args.minutes * 60.0);
    let ctx = Ctx {
        client: client.clone(),
        endpoints: endpoints.clone(),
        tls: tls.clone(),
        until,
        seed: args.seed,
    };
    // Odd processes write through the leader; even ones each stay on one member, so their
    // writes take a follower's forwarding path under the same faults.
    let ctx_for = |process: u64| -> Ctx {
        if process % 2 == 1 {
            return ctx.clone();
        }
        let member = (process / 2) as usize % member_clients.len();
        Ctx {
            client: member_clients[member].clone(),
            ..ctx.clone()
        }
    };
    let negative_name = negative.map(|(n, _)| n);
    let has = |w: &str| args.workload.iter().any(|x| x == w);
    let histories: BTreeMap<&str, Recorder> = [
        "register", "watch", "lock", "election", "lease", "topic", "queue", "faults",
    ]
    .into_iter()
    .map(|w| (w, Recorder::new(start)))
    .collect();
    let mut tasks = Vec::new();
    if has("register") || has("watch") {
        let pinned = (negative_name == Some("register-serializable"))
            .then(|| PinnedReads::new(&endpoints, tls.as_ref()));
        for process in 1..=5 {
            tasks.push(tokio::spawn(workloads::register(
                ctx_for(process),
                process,
                histories["register"].clone(),
                pinned.clone(),
            )));
        }
    }
    let (finished_tx, finished_rx) = tokio::sync::watch::channel((0i64, false));
    let mut watchers = Vec::new();
    if has("watch") {
        let from = client
            .get(workloads::REGISTER_PREFIX, GetOptions::prefix())
            .await
            .map_err(|e| Error::Cluster(e.to_string()))?
            .revision
            + 1;
        let drop_one = negative_name == Some("watch-drop");
        watchers.push(tokio::spawn(workloads::watch(
            ctx.clone(),
            101,
            histories["watch"].clone(),
            from,
            None,
            drop_one,
            finished_rx.clone(),
        )));
        watchers.push(tokio::spawn(workloads::watch(
            ctx.clone(),
            102,
            histories["watch"].clone(),
            from,
            Some(Duration::from_secs(3)),
            false,
            finished_rx.clone(),
        )));
    }
    if has("lock") {
        let unfenced = negative_name == Some("lock-unfenced");
        let resource = Resource::new(!unfenced);
        let pause = if unfenced { 500 } else { 200 };
        for process in 201..=203 {
            tasks.push(tokio::spawn(workloads::lock(
                ctx_for(process),
                process,
                histories["lock"].clone(),
                resource.clone(),
                pause,
            )));
        }
    }
    if has("election") {
        let unfenced = negative_name == Some("election-unfenced");
        let resource = Resource::new(!unfenced);
        let pause = if unfenced { 500 } else { 200 };
        for process in 301..=303 {
            tasks.push(tokio::spawn(workloads::election(
                ctx_for(process),
                process,
                histories["election"].clone(),
                resource.clone(),
                pause,
            )));
        }
    }
    if has("lease") {
        let extra = if negative_name == Some("lease-short-ttl") {
            LEASE_SHORT_BY
        } else {
            Duration::ZERO
        };
        for process in 401..=402 {
            tasks.push(tokio::spawn(workloads::lease(
                ctx_for(process),
                process,
                histories["lease"].clone(),
                extra,
            )));
        }
    }
    if has("topic") {
        for process in 501..=502 {
            tasks.push(tokio::spawn(workloads::publisher(
                ctx_for(process),
                process,
                histories["topic"].clone(),
            )));
        }
        let ack_unread = negative_name == Some("topic-ack-unread");
        for process in 511..=512 {
            tasks.push(tokio::spawn(workloads::consumer(
                ctx_for(process),
                process,
                histories["topic"].clone(),
                ack_unread && process == 511,
            )));
        }
    }
    if has("queue") {
        for process in 601..=602 {
            tasks.push(tokio::spawn(workloads::producer(
                ctx_for(process),
                process,
                histories["queue"].clone(),
            )));
        }
        let ack_unrecorded = negative_name == Some("queue-ack-unrecorded");
        for process in 611..=612 {
            tasks.push(tokio::spawn(workloads::queue_worker(
                ctx_for(process),
                process,
                histories["queue"].clone(),
                ack_unrecorded && process == 611,
            )));
        }
    }
    let fault_windows = nemesis::run(
        &cluster,
        &families,
        args.seed,
        until,
        histories["faults"].clone(),
    )
    .await;
    {
        let mut cluster = cluster.lock().await;
        nemesis::heal_all(&mut cluster);
    }
    println!(
        "faulty phase over after {:.0} s; waiting for the clients",
        start.elapsed().as_secs_f64()
    );
    // Clients finish their current operation (a paused holder sleeps past its TTL first).
    for task in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(60), task).await;
    }
    wait_for_leader(&cluster).await?;
    if !watchers.is_empty() {
        let final_revision = client
            .get(workloads::REGISTER_PREFIX, GetOptions::prefix())
            .await
            .map_err(|e| Error::Cluster(e.to_string()))?
            .revision;
        let _ = finished_tx.send((final_revision, false));
        let give_up = tokio::time::sleep(WATCH_CATCH_UP);
        tokio::pin!(give_up);
        for watcher in watchers {
            tokio::select! {
                _ = watcher => {}
                _ = &mut give_up => { let _ = finished_tx.send((final_revision, true)); }
            }
        }
    }
    let crashed = cluster.lock().await.exited();
    for (name, recorder) in &histories {
        let path = out.join(format!("{name}.jsonl"));
        recorder.write_to(&path).map_err(|source| Error::Io {
            what: format!("write {}", path.display()),
            source,
        })?;
    }
    let mut report = check_events(
        &histories
            .iter()
            .map(|(k, r)| (k.to_string(), r.events()))
            .collect(),
        args.election_timeout_ms,
        &fault_windows,
    );
    for (id, status) in &crashed {
        report
            .anomalies
            .entry("crash".into())
            .or_default()
            .push(format!("member {id} exited by itself: {status}"));
    }
    report.print();
    println!(
        "TLS: {}",
        if args.tls {
            "on (every client and probe over TLS with a client certificate; members over mutual TLS)"
        } else {
            "off"
        }
    );
    println!("histories in {}", out.display());
    Ok(match negative {
        None => u8::from(report.total() > 0),
        Some((name, checker)) => {
            let caught = report.anomalies.get(checker).map_or(0, Vec::len);
            if caught > 0 {
                println!(
                    "negative control {name}: caught by the {checker} checker ({caught} anomalies), as it must be"
                );
                0
            } else {
                println!("negative control {name}: NOT caught by the {checker} checker");
                1
            }
        }
    })
}

struct Report {
    ops: BTreeMap<String, BTreeMap<&'static str, usize>>,
    faults: BTreeMap<String, usize>,
    anomalies: BTreeMap<String, Vec<String>>,
}

impl Report {
    fn total(&self) -> usize {
        self.anomalies.values().map(Vec::len).sum()
    }

    fn print(&self) {
        println!("operations by outcome:");
        for (workload, outcomes) in &self.ops {
            let line: Vec<String> = outcomes.iter().map(|(k, n)| format!("{k}={n}")).collect();
            println!("  {workload:<9} {}", line.join(" "));
        }
        let faults: Vec<String> = self
            .faults
            .iter()
            .map(|(k, n)| format!("{k}={n}"))
            .collect();
        println!(
            "faults injected: {}",
            if faults.is_empty() {
                "none".into()
            } else {
                faults.join(" ")
            }
        );
        println!("anomalies per checker:");
        for (checker, found) in &self.anomalies {
            println!("  {checker:<9} {}", found.len());
            for sentence in found.iter().take(5) {
                println!("    {sentence}");
            }
            if found.len() > 5 {
                println!("    ... and {} more", found.len() - 5);
            }
        }
        println!("total anomalies: {}", self.total());
    }
}

fn paired(name: &str, events: &[Event], report: &mut Report) -> Vec<history::Op> {
    match history::pair(events) {
        Ok(ops) => ops,
        Err(reason) => {
            report
                .anomalies
                .entry(name.into())
                .or_default()
                .push(format!("malformed history: {reason}"));
            Vec::new()
        }
    }
}

fn check_events(
    histories: &BTreeMap<String, Vec<Event>>,
    election_timeout_ms: u64,
    windows: &[(u64, u64)],
) -> Report {
    let mut report = Report {
        ops: BTreeMap::new(),
        faults: BTreeMap::new(),
        anomalies: BTreeMap::new(),
    };
    let empty = Vec::new();
    let get = |name: &str| histories.get(name).unwrap_or(&empty);
    for (name, events) in histories {
        if name == "faults" {
            for e in events.iter().filter(|e| e.kind == Kind::Invoke) {
                *report
                    .faults
                    .entry(e.value.as_str().unwrap_or("?").to_string())
                    .or_default() += 1;
            }
            continue;
        }
        if events.is_empty() {
            continue;
        }
        let counts = report.ops.entry(name.clone()).or_default();
        for e in events {
            let k = match e.kind {
                Kind::Invoke => continue,
                Kind::Ok => "ok",
                Kind::Fail => "fail",
                Kind::Info => "info",
            };
            *counts.entry(k).or_default() += 1;
        }
        report.anomalies.entry(name.clone()).or_default();
    }
    let skewed = get("faults").iter().any(|e| e.value == "skew");
    let register = paired("register", get("register"), &mut report);
    if !get("register").is_empty() {
        let found = checkers::register(&register);
        report
            .anomalies
            .entry("register".into())
            .or_default()
            .extend(found);
    }
    if !get("watch").is_empty() {
        let watch = paired("watch", get("watch"), &mut report);
        let found = checkers::watch::check(&watch, &register);
        report
            .anomalies
            .entry("watch".into())
            .or_default()
            .extend(found);
    }
    let slow_clocks = SlowClock::from_faults(&history::pair(get("faults")).unwrap_or_default());
    for name in ["lock", "election"] {
        if !get(name).is_empty() {
            let ops = paired(name, get(name), &mut report);
            let hold_ttl_us = workloads::HOLD_TTL.as_micros() as u64;
            let found = checkers::fence::check_with_slow_clocks(&ops, &slow_clocks, hold_ttl_us);
            report
                .anomalies
                .entry(name.into())
                .or_default()
                .extend(found);
        }
    }
    if !get("topic").is_empty() {
        let ops = paired("topic", get("topic"), &mut report);
        let found = checkers::topic::check(&ops);
        report
            .anomalies
            .entry("topic".into())
            .or_default()
            .extend(found);
    }
    if !get("queue").is_empty() {
        let ops = paired("queue", get("queue"), &mut report);
        let found = checkers::queue::check(&ops);
        report
            .anomalies
            .entry("queue".into())
            .or_default()
            .extend(found);
    }
    if !get("lease").is_empty() {
        let ops = paired("lease", get("lease"), &mut report);
        let bounds = LeaseBounds {
            election_timeout_us: election_timeout_ms * 2 * 1000,
            slack_us: LEASE_SLACK.as_micros() as u64,
            clock_drift_ppm: if skewed { SKEW_DRIFT_PPM } else { 0 },
        };
        let found = checkers::lease::check_with_slow_clocks(&ops, bounds, windows, &slow_clocks);
        report
            .anomalies
            .entry("lease".into())
            .or_default()
            .extend(found);
    }
    report
}

fn check_dir(dir: &Path, election_timeout_ms: u64) -> Result<Report, Error> {
    let mut histories = BTreeMap::new();
    for name in [
        "register", "watch", "lock", "election", "lease", "topic", "queue", "faults",
    ] {
        let path = dir.join(format!("{name}.jsonl"));
        if path.exists() {
            histories.insert(name.to_string(), history::read_events(&path)?);
        }
    }
    let windows = history::pair(histories.get("faults").map_or(&[][..], |v| &v[..]))
        .map_err(Error::Usage)?
        .iter()
        .map(|op| (op.invoke_us, op.complete_us))
        .collect::<Vec<_>>();
    let report = check_events(&histories, election_timeout_ms, &windows);
    report.print();
    Ok(report)
}
