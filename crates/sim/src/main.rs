//! `conclave-sim`: runs seeds of the deterministic simulator and reports invariant violations.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use conclave_sim::{Bug, CoreSimulation, Simulation, StorageKind, SwarmParams};

/// Deterministic simulation of Conclave's node core under network and crash faults.
#[derive(Parser, Debug)]
#[command(name = "conclave-sim", version)]
struct Args {
    /// Run seeds 0..N and print one summary line.
    #[arg(long, conflicts_with = "seed")]
    seeds: Option<u64>,
    /// Run one seed; on a violation print its parameters and trace tail.
    #[arg(long)]
    seed: Option<u64>,
    /// First seed of a `--seeds` run (seeds FIRST..FIRST+N).
    #[arg(long, default_value_t = 0)]
    first_seed: u64,
    /// Cluster size (1, 3, 5 or 7); drawn from the seed when absent.
    #[arg(long, value_parser = parse_nodes)]
    nodes: Option<usize>,
    /// Storage under the nodes: `mem`, or `wal` for Conclave's write-ahead log on a simulated
    /// disk that loses unsynced writes and tears the last one on a crash.
    #[arg(long, value_enum, default_value_t = StorageArg::Mem)]
    storage: StorageArg,
    /// With --seed: print `trace_hash=<hex>` of the run.
    #[arg(long, requires = "seed")]
    trace_hash: bool,
    /// With --seed and the coordination machine: print every trace line to stderr.
    #[arg(long, requires = "seed")]
    trace: bool,
    /// What the nodes run: `coordination`, the server's node core with the real state
    /// machine and client checkers; or `hash-chain`, the bare Raft core with a hash chain.
    #[arg(long, value_enum, default_value_t = MachineArg::Coordination)]
    machine: MachineArg,
    /// Negative control: switch on a deliberate bug in the node core, which the checkers
    /// must catch (the run then fails).
    #[arg(long, value_enum)]
    bug: Option<BugArg>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum MachineArg {
    Coordination,
    HashChain,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum BugArg {
    AnswerBeforeApply,
    ApplyBeforePersist,
    SendBeforePersist,
    SkipTick,
    KeepaliveWithoutConfirm,
    LeaseNeverExpires,
}

impl BugArg {
    fn bug(self) -> Bug {
        match self {
            BugArg::AnswerBeforeApply => Bug::AnswerBeforeApply,
            BugArg::ApplyBeforePersist => Bug::ApplyBeforePersist,
            BugArg::SendBeforePersist => Bug::SendBeforePersist,
            BugArg::SkipTick => Bug::SkipTick,
            BugArg::KeepaliveWithoutConfirm => Bug::KeepaliveWithoutConfirm,
            BugArg::LeaseNeverExpires => Bug::LeaseNeverExpires,
        }
    }
}

/// One seed's run, whichever machine.
enum Run {
    Chain(Box<Simulation>),
    Core(Box<CoreSimulation>),
}

impl Run {
    fn run(&mut self) -> bool {
        match self {
            Run::Chain(sim) => sim.run(),
            Run::Core(sim) => sim.run(),
        }
    }
    fn events(&self) -> u64 {
        match self {
            Run::Chain(sim) => sim.stats.events,
            Run::Core(sim) => sim.stats.events,
        }
    }
    fn violations(&self) -> &[conclave_sim::checker::Violation] {
        match self {
            Run::Chain(sim) => sim.violations(),
            Run::Core(sim) => sim.violations(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum StorageArg {
    Mem,
    Wal,
}

fn simulation(seed: u64, args: &Args) -> Run {
    let mut params = SwarmParams::from_seed(seed, args.nodes);
    params.storage = match args.storage {
        StorageArg::Mem => StorageKind::Mem,
        StorageArg::Wal => StorageKind::Wal,
    };
    match args.machine {
        MachineArg::HashChain => {
            Run::Chain(Box::new(Simulation::with_params(seed, params, true, None)))
        }
        MachineArg::Coordination => Run::Core(Box::new(CoreSimulation::new(
            seed,
            params,
            args.bug.map(BugArg::bug),
        ))),
    }
}

fn parse_nodes(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n @ (1 | 3 | 5 | 7)) => Ok(n),
        _ => Err(format!("cluster size must be 1, 3, 5 or 7, not {s:?}")),
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.bug.is_some() && args.machine != MachineArg::Coordination {
        eprintln!("error: --bug needs --machine coordination (the bugs live in the node core)");
        return ExitCode::from(2);
    }
    if let Some(seed) = args.seed {
        return run_one(seed, &args);
    }
    let count = args.seeds.unwrap_or(100);
    let started = Instant::now();
    let on_terminal = std::io::stderr().is_terminal();
    let (mut events, mut violations) = (0u64, 0u64);
    for seed in args.first_seed..args.first_seed + count {
        let mut sim = simulation(seed, &args);
        let ok = sim.run();
        events += sim.events();
        if !ok {
            violations += sim.violations().len() as u64;
            for v in sim.violations() {
                eprintln!("seed {seed}: {}: {}", v.invariant, v.detail);
            }
            eprintln!("  replay with: conclave-sim --seed {seed}");
        }
        let done = seed - args.first_seed + 1;
        if on_terminal {
            eprint!(
                "\r{done}/{count} seeds, {violations} violations, {:.1}s",
                started.elapsed().as_secs_f64()
            );
            let _ = std::io::stderr().flush();
        }
    }
    if on_terminal {
        eprintln!();
    }
    println!("seeds={count} events={events} violations={violations}");
    if violations == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn run_one(seed: u64, args: &Args) -> ExitCode {
    let (ok, trace_hash) = match simulation(seed, args) {
        Run::Chain(mut sim) => {
            let ok = sim.run();
            report_chain(seed, &sim, ok);
            (ok, sim.trace_hash())
        }
        Run::Core(mut sim) => {
            sim.print_trace(args.trace);
            let ok = sim.run();
            report_core(seed, &sim, ok);
            (ok, sim.trace_hash())
        }
    };
    if args.trace_hash {
        println!("trace_hash={trace_hash:016x}");
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn report_core(seed: u64, sim: &CoreSimulation, ok: bool) {
    let s = &sim.stats;
    println!(
        "seed={seed} events={} messages={} crashes={} snapshots={} ops_acked={} ops_open={} \
         reads_by_index={} session_retries={} leases_ended={} seats={} violations={}",
        s.events,
        s.messages_delivered,
        s.crashes,
        s.snapshots,
        s.ops_acked,
        s.ops_open,
        s.reads_by_index,
        s.session_retries,
        s.leases_expired,
        s.seats_seen,
        sim.violations().len()
    );
    if ok {
        return;
    }
    println!("{}", sim.describe());
    for v in sim.violations() {
        println!("VIOLATION {}: {}", v.invariant, v.detail);
    }
    println!("trace tail:");
    for line in sim.trace_tail() {
        println!("  {line}");
    }
}

fn report_chain(seed: u64, sim: &Simulation, ok: bool) {
    let s = &sim.stats;
    println!(
        "seed={seed} events={} messages={} elections={} crashes={} snapshots={} reads={} \
         conf_changes={} committed={} violations={}",
        s.events,
        s.messages_delivered,
        s.elections_won,
        s.crashes,
        s.snapshots_installed,
        s.reads_served,
        s.conf_changes_applied,
        sim.checker.committed_entries(),
        sim.violations().len()
    );
    if ok {
        return;
    }
    println!("{}", sim.describe());
    for v in sim.violations() {
        println!("VIOLATION {}: {}", v.invariant, v.detail);
    }
    println!("trace tail:");
    for line in sim.trace_tail() {
        println!("  {line}");
    }
}
