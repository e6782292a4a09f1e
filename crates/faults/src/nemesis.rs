//! The nemesis: one fault at a time, held for a while, then healed, with quiet time between.

use std::time::{Duration, Instant};

use conclave_proto::etcdserverpb::cluster_client::ClusterClient;
use conclave_proto::etcdserverpb::{
    MemberAddRequest, MemberListRequest, MemberPromoteRequest, MemberRemoveRequest,
};
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
    Member,
}

impl Family {
    pub fn parse(name: &str) -> Option<Family> {
        match name {
            "partition" => Some(Family::Partition),
            "kill" => Some(Family::Kill),
            "pause" => Some(Family::Pause),
            "skew" => Some(Family::Skew),
            "member" => Some(Family::Member),
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
    /// Re-add (if that failed at first) and promote a replaced member.
    Rejoin(usize),
}

/// Deadline of one membership call, and how long a heal keeps trying to promote a learner
/// that is still catching up.
const MEMBERSHIP_CALL: Duration = Duration::from_secs(3);
const PROMOTE_WITHIN: Duration = Duration::from_secs(10);

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
        // The fault starts when the nemesis starts acting: a member removal or a restart
        // before the record can already hold up the cluster (a removed leader steps down).
        let acting_from_us = history.now_us();
        let (what, undo) = {
            let mut cluster = cluster.lock().await;
            start_fault(&mut cluster, family, &mut rng).await
        };
        let Some(undo) = undo else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        let start = history.record_started(
            acting_from_us,
            0,
            Kind::Invoke,
            "fault",
            &what,
            json!(format!("{family:?}").to_lowercase()),
        );
        tokio::time::sleep(between(&mut rng, FAULT_MS)).await;
        {
            let mut cluster = cluster.lock().await;
            undo_fault(&mut cluster, undo).await;
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
        Family::Member => {
            // Replace a member: remove it from the configuration, stop it, and add a fresh
            // node at its address as a learner under a new id, promoted when the fault ends.
            // Voters never drop below a majority of the founding ones, counted in the
            // configuration itself: a membership call whose answer was lost may have taken
            // effect all the same.
            let Some((listed, _)) = configuration(cluster).await else {
                return (String::new(), None);
            };
            let voters = listed.iter().filter(|m| !m.learner).count();
            let victim = pick(rng);
            let old_id = cluster.members[victim].id;
            let was_voter = listed.iter().any(|m| m.id == old_id && !m.learner);
            if was_voter && voters.saturating_sub(1) < n / 2 + 1 {
                return (String::new(), None);
            }
            if listed.iter().any(|m| m.id == old_id) {
                let answered = membership_call(cluster, |mut c| async move {
                    c.member_remove(MemberRemoveRequest { id: old_id })
                        .await
                        .map(|_| ())
                })
                .await
                .is_some();
                // A removal whose answer was lost, retried on another member, hears "member
                // not found": the configuration says whether it took effect.
                let removed = answered
                    || configuration(cluster)
                        .await
                        .is_some_and(|(listed, _)| listed.iter().all(|m| m.id != old_id));
                if !removed {
                    return (String::new(), None);
                }
            }
            cluster.kill(victim);
            cluster.members[victim].learner = true;
            let readded = add_learner(cluster, victim).await;
            (
                format!(
                    "member {old_id} removed, replaced by learner {}",
                    readded.map_or("(not yet added)".to_string(), |id| id.to_string())
                ),
                Some(Undo::Rejoin(victim)),
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

/// A membership call through the first live member that answers it.
async fn membership_call<T, F, Fut>(cluster: &Cluster, call: F) -> Option<T>
where
    F: Fn(ClusterClient<tonic::transport::Channel>) -> Fut,
    Fut: std::future::Future<Output = Result<T, tonic::Status>>,
{
    for (index, place) in cluster.net.places.iter().enumerate() {
        if !cluster.is_up(index) || cluster.members[index].paused {
            continue;
        }
        let Some(endpoint) = crate::tls::endpoint(&place.client_addr, cluster.client_tls()) else {
            continue;
        };
        let channel = endpoint.connect_timeout(MEMBERSHIP_CALL).connect_lazy();
        match tokio::time::timeout(MEMBERSHIP_CALL, call(ClusterClient::new(channel))).await {
            Ok(Ok(answer)) => return Some(answer),
            Ok(Err(status)) => eprintln!("nemesis: membership call: {}", status.message()),
            Err(_) => {}
        }
    }
    None
}

/// A member of the configuration, as MemberList reports it.
struct Listed {
    id: u64,
    peer_url: String,
    learner: bool,
}

/// The configuration, read linearizably (it includes every change committed before the call),
/// with the cluster id; `None` when no member answered.
async fn configuration(cluster: &Cluster) -> Option<(Vec<Listed>, u64)> {
    membership_call(cluster, |mut c| async move {
        c.member_list(MemberListRequest { linearizable: true })
            .await
            .map(|answer| {
                let answer = answer.into_inner();
                let listed = answer
                    .members
                    .into_iter()
                    .map(|m| Listed {
                        id: m.id,
                        peer_url: m.peer_ur_ls.into_iter().next().unwrap_or_default(),
                        learner: m.is_learner,
                    })
                    .collect();
                (listed, answer.header.map_or(0, |h| h.cluster_id))
            })
    })
    .await
}

/// Adds a fresh learner at member `index`'s address and starts it; its new id, if added.
async fn add_learner(cluster: &mut Cluster, index: usize) -> Option<u64> {
    let peer = format!("http://{}", cluster.net.places[index].peer_addr);
    // The removed record may still be there for a moment (the joint phase needs it).
    let mut added = None;
    for _ in 0..5 {
        let asked = peer.clone();
        added = membership_call(cluster, move |mut c| {
            let peer = asked.clone();
            async move {
                c.member_add(MemberAddRequest {
                    peer_ur_ls: vec![peer],
                    is_learner: true,
                })
                .await
                .map(|answer| {
                    let answer = answer.into_inner();
                    let cluster_id = answer.header.map_or(0, |h| h.cluster_id);
                    answer.member.map(|m| (m.id, cluster_id))
                })
            }
        })
        .await
        .flatten();
        if added.is_some() {
            break;
        }
        // An add whose answer was lost may have taken effect, and a retry would be refused
        // ("Peer URLs already exists"): take the member the configuration lists at this
        // address (not the removed one, whose record may linger for a moment).
        let removed_id = cluster.members[index].id;
        if let Some((listed, cluster_id)) = configuration(cluster).await
            && let Some(member) = listed
                .iter()
                .find(|m| m.peer_url == peer && m.id != removed_id)
        {
            added = Some((member.id, cluster_id));
            break;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let (id, cluster_id) = added?;
    if cluster_id != 0 {
        cluster.cluster_id = Some(cluster_id);
    }
    cluster.members[index].id = id;
    cluster.members[index].joined = true;
    cluster.members[index].learner = true;
    if cluster.has_data_dir(index) {
        // Starting it would resume the removed member's log under the new member's name.
        eprintln!("nemesis: MemberAdd gave id {id} again (its data directory exists); not started");
        return None;
    }
    if let Err(error) = cluster.spawn(index) {
        eprintln!("nemesis: start of learner {id} failed: {error}");
    }
    Some(id)
}

async fn undo_fault(cluster: &mut Cluster, undo: Undo) {
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
        Undo::Rejoin(index) => {
            if !cluster.is_up(index) && add_learner(cluster, index).await.is_none() {
                eprintln!("nemesis: member slot {} could not be re-added", index + 1);
                return;
            }
            let id = cluster.members[index].id;
            let start = Instant::now();
            while start.elapsed() < PROMOTE_WITHIN {
                let promoted = membership_call(cluster, |mut c| async move {
                    c.member_promote(MemberPromoteRequest { id })
                        .await
                        .map(|_| ())
                })
                .await;
                // A promotion whose answer was lost counts if the configuration shows it.
                let promoted = promoted.is_some()
                    || configuration(cluster)
                        .await
                        .is_some_and(|(listed, _)| listed.iter().any(|m| m.id == id && !m.learner));
                if promoted {
                    cluster.members[index].learner = false;
                    return;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            eprintln!("nemesis: learner {id} not promoted within {PROMOTE_WITHIN:?}");
        }
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
