//! The nemesis: one fault at a time, held for a while, then healed, with quiet time between.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::cluster::Cluster;
use crate::history::{Kind, Recorder};
use crate::rng::Rng;

/// Families of faults `--nemesis` can name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Partition,
    Kill,
    Pause,
    Skew,
}

impl Family {
    pub fn parse(name: &str) -> Option<Family> {
        match name {
            "partition" => Some(Family::Partition),
            "kill" => Some(Family::Kill),
            "pause" => Some(Family::Pause),
            "skew" => Some(Family::Skew),
            _ => None,
        }
    }
}

/// How long a fault lasts and how long the cluster is left alone after it.
pub const FAULT_MS: (u64, u64) = (1500, 5000);
pub const QUIET_MS: (u64, u64) = (1000, 3000);

/// Intervals during which a fault was active, for the lease checker.
pub type FaultWindows = Vec<(u64, u64)>;

/// A fault in progress and how to undo it.
enum Undo {
    Heal,
    Restart(usize),
    Resume(usize),
    Unskew(usize),
}

/// Clock rates the skew nemesis gives a member: slow ones well beyond real hardware, fast ones
/// only within the clients' documented drift allowance (`LeaseSafety`, 1%), since a leader
/// whose clock runs faster than that may end leases early by design.
pub const SKEW_RATES: &[f64] = &[0.5, 0.9, 0.999, 1.005, 1.01];

fn between(rng: &mut Rng, (low, high): (u64, u64)) -> Duration {
    Duration::from_millis(low + rng.below(high - low + 1))
}

/// Runs faults until `until`; returns the fault windows. Faults are recorded in `history`
/// (process 0: invoke = start, ok = healed, with what was done).
pub async fn run(
    cluster: &tokio::sync::Mutex<Cluster>,
    families: &[Family],
    seed: u64,
    until: Instant,
    history: Recorder,
) -> FaultWindows {
    let mut rng = Rng::new(seed ^ 0x6e65_6d65);
    let mut windows = Vec::new();
    if families.is_empty() {
        tokio::time::sleep(until.saturating_duration_since(Instant::now())).await;
        return windows;
    }
    tokio::time::sleep(between(&mut rng, QUIET_MS)).await;
    while Instant::now() < until {
        let family = families[rng.below(families.len() as u64) as usize];
        let (what, undo) = {
            let mut cluster = cluster.lock().await;
            start_fault(&mut cluster, family, &mut rng).await
        };
        let Some(undo) = undo else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        let start = history.record(
            0,
            Kind::Invoke,
            "fault",
            &what,
            json!(format!("{family:?}").to_lowercase()),
        );
        tokio::time::sleep(between(&mut rng, FAULT_MS)).await;
        {
            let mut cluster = cluster.lock().await;
            undo_fault(&mut cluster, undo);
        }
        let end = history.record(0, Kind::Ok, "fault", &what, json!("healed"));
        windows.push((start, end));
        tokio::time::sleep(between(&mut rng, QUIET_MS)).await;
    }
    windows
}

async fn start_fault(
    cluster: &mut Cluster,
    family: Family,
    rng: &mut Rng,
) -> (String, Option<Undo>) {
    let n = cluster.members.len();
    let leader = cluster.leader().await;
    let pick = |rng: &mut Rng| -> usize {
        // Half the time the leader, when there is one: that is where it hurts.
        match leader {
            Some(l) if rng.below(2) == 0 => l,
            _ => rng.below(n as u64) as usize,
        }
    };
    match family {
        Family::Kill => {
            let victim = pick(rng);
            cluster.kill(victim);
            (
                format!("kill -9 member {}", victim + 1),
                Some(Undo::Restart(victim)),
            )
        }
        Family::Pause => {
            let victim = pick(rng);
            if cluster.pause(victim) {
                (
                    format!("SIGSTOP member {}", victim + 1),
                    Some(Undo::Resume(victim)),
                )
            } else {
                (String::new(), None)
            }
        }
        Family::Skew => {
            let victim = pick(rng);
            let rate = SKEW_RATES[rng.below(SKEW_RATES.len() as u64) as usize];
            cluster.kill(victim);
            cluster.members[victim].clock_rate = Some(rate);
            if let Err(error) = cluster.spawn(victim) {
                eprintln!("nemesis: restart of member {} failed: {error}", victim + 1);
            }
            (
                format!(
                    "member {} restarted with its clock at rate {rate}",
                    victim + 1
                ),
                Some(Undo::Unskew(victim)),
            )
        }
        Family::Partition => {
            if !cluster.net.can_partition() {
                return (String::new(), None);
            }
            let (what, cuts) = partition_plan(n, leader, rng, cluster.net.mode);
            for (from, to) in &cuts {
                if let Err(error) = cluster.net.drop_link(*from, *to) {
                    eprintln!("nemesis: {error}");
                }
            }
            (what, Some(Undo::Heal))
        }
    }
}

/// Which directed links to cut, and a description. On loopback only one member's inbound
/// peer traffic can be cut.
pub fn partition_plan(
    n: usize,
    leader: Option<usize>,
    rng: &mut Rng,
    mode: crate::net::Mode,
) -> (String, Vec<(usize, usize)>) {
    let members: Vec<usize> = (0..n).collect();
    let isolate = |x: usize| -> Vec<(usize, usize)> {
        members
            .iter()
            .filter(|&&m| m != x)
            .flat_map(|&m| [(m, x), (x, m)])
            .collect()
    };
    if mode == crate::net::Mode::Loopback {
        let x = leader.unwrap_or(rng.below(n as u64) as usize);
        return (format!("member {} hears no peer", x + 1), vec![(0, x)]);
    }
    match rng.below(4) {
        0 => {
            let x = leader.unwrap_or(rng.below(n as u64) as usize);
            (format!("leader {} isolated", x + 1), isolate(x))
        }
        1 => {
            // Majority / minority, the minority chosen at random.
            let mut shuffled = members.clone();
            for i in (1..n).rev() {
                shuffled.swap(i, rng.below(i as u64 + 1) as usize);
            }
            let minority: Vec<usize> = shuffled[..(n - 1) / 2].to_vec();
            let cuts = minority
                .iter()
                .flat_map(|&a| {
                    members
                        .iter()
                        .filter(|m| !minority.contains(m))
                        .flat_map(move |&b| [(a, b), (b, a)])
                })
                .collect();
            (
                format!(
                    "minority {:?} cut off",
                    minority.iter().map(|m| m + 1).collect::<Vec<_>>()
                ),
                cuts,
            )
        }
        2 => {
            // One way: a member hears nobody but can still talk.
            let x = pick_any(leader, rng, n);
            let cuts = members
                .iter()
                .filter(|&&m| m != x)
                .map(|&m| (m, x))
                .collect();
            (format!("member {} hears no one (one-way)", x + 1), cuts)
        }
        _ => {
            // A bridge: one member sees both halves, which do not see each other.
            let bridge = rng.below(n as u64) as usize;
            let rest: Vec<usize> = members.iter().copied().filter(|&m| m != bridge).collect();
            let (left, right) = rest.split_at(rest.len() / 2);
            let cuts = left
                .iter()
                .flat_map(|&a| right.iter().flat_map(move |&b| [(a, b), (b, a)]))
                .collect();
            (
                format!(
                    "bridge member {} between {:?} and {:?}",
                    bridge + 1,
                    left.iter().map(|m| m + 1).collect::<Vec<_>>(),
                    right.iter().map(|m| m + 1).collect::<Vec<_>>()
                ),
                cuts,
            )
        }
    }
}

fn pick_any(leader: Option<usize>, rng: &mut Rng, n: usize) -> usize {
    match leader {
        Some(l) if rng.below(2) == 0 => l,
        _ => rng.below(n as u64) as usize,
    }
}

fn undo_fault(cluster: &mut Cluster, undo: Undo) {
    match undo {
        Undo::Heal => {
            if let Err(error) = cluster.net.heal() {
                eprintln!("nemesis: heal failed: {error}");
            }
        }
        Undo::Restart(index) => {
            if let Err(error) = cluster.spawn(index) {
                eprintln!("nemesis: restart of member {} failed: {error}", index + 1);
            }
        }
        Undo::Resume(index) => cluster.resume(index),
        Undo::Unskew(index) => {
            cluster.kill(index);
            cluster.members[index].clock_rate = None;
            if let Err(error) = cluster.spawn(index) {
                eprintln!("nemesis: restart of member {} failed: {error}", index + 1);
            }
        }
    }
}

/// Ends every fault: heals the network, resumes paused members, restarts killed ones.
pub fn heal_all(cluster: &mut Cluster) {
    let _ = cluster.net.heal();
    for index in 0..cluster.members.len() {
        if cluster.members[index].clock_rate.is_some() {
            cluster.kill(index);
            cluster.members[index].clock_rate = None;
        }
        if cluster.members[index].paused {
            cluster.resume(index);
        }
        if !cluster.is_up(index)
            && let Err(error) = cluster.spawn(index)
        {
            eprintln!("restart of member {} failed: {error}", index + 1);
        }
    }
}
