//! Death detected in well under a TTL, as separate CLI processes against a real 3-node
//! cluster: kill -9 of a leading `elect campaign` hands the seat over within a second (the
//! kernel closes the dead process's connection, and the leader shortens its lease to
//! `LEASE_ORPHAN_GRACE_MS`); a holder cut off by a partition (no FIN) keeps the seat until its
//! TTL; a holder whose member shuts down moves to another member and keeps its seat.
//!
//! The partition runs the holder as another user and drops its packets with an iptables
//! owner rule on loopback, so this file needs root, `iptables` and `setpriv` (as the fault
//! suite needs root for its namespaces).

mod cli_support;
mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use cli_support::{Streaming, run};
use common::Cluster;
use serde_json::Value;

const RETRY: Duration = Duration::from_secs(15);
const LINE_TIMEOUT: Duration = Duration::from_secs(15);

fn campaign(eps: &str, group: &str, id: &str, priority: u32, ttl: &str) -> Streaming {
    Streaming::start(
        eps,
        &[
            "elect",
            "campaign",
            group,
            "--id",
            id,
            "--priority",
            &priority.to_string(),
            "--ttl",
            ttl,
            "--json",
            "--",
            "sleep",
            "600",
        ],
    )
}

/// The `elected` line of a streaming campaign, with its arrival time.
fn elected(process: &Streaming, timeout: Duration) -> (Instant, Value) {
    let (at, line) = process
        .next_json(timeout)
        .expect("an elected line before the timeout");
    assert_eq!(line["status"], "ok", "{line}");
    assert_eq!(line["data"]["event"], "elected", "{line}");
    (at, line["data"].clone())
}

fn wait_candidates(eps: &str, group: &str, n: usize) -> Value {
    wait_candidates_where(eps, group, n, |_| true)
}

/// Lists `group` until it has `n` candidates and `settled` holds for the listing.
fn wait_candidates_where(
    eps: &str,
    group: &str,
    n: usize,
    settled: impl Fn(&Value) -> bool,
) -> Value {
    let start = Instant::now();
    loop {
        let run = run(eps, &["elect", "candidates", group, "--json"]);
        if run.code == 0 {
            let data = run.data();
            if data["candidates"].as_array().map_or(0, Vec::len) >= n && settled(&data) {
                return data;
            }
        }
        assert!(
            start.elapsed() < RETRY,
            "{group}: {n} candidates never registered (or never all showed a keepalive)"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn leader_of(eps: &str, group: &str) -> Option<String> {
    let run = run(eps, &["elect", "leader", group, "--json"]);
    (run.code == 0).then(|| {
        run.data()["leader"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn kill_9_of_a_leading_campaign_hands_the_seat_over_within_a_second() {
    let cluster = Cluster::start(3).await;
    let eps = cluster.endpoints();
    let eps = eps.as_str();
    const ROUNDS: usize = 10;
    let limit = Duration::from_secs(1);
    let mut takeovers = Vec::new();
    for round in 0..ROUNDS {
        let group = format!("death-{round}");
        let mut first = campaign(eps, &group, "first", 20, "10s");
        let (_, leading) = elected(&first, LINE_TIMEOUT);
        assert_eq!(leading["leader"], "first", "{leading}");
        let second = campaign(eps, &group, "second", 10, "10s");
        // Every candidate's keepalive becomes visible, as an age in ms. A candidate can be
        // listed a moment before its first keepalive reaches the leader (its campaign
        // joins and starts keeping its lease alive at once); its age is null until then.
        wait_candidates_where(eps, &group, 2, |listed| {
            listed["candidates"]
                .as_array()
                .expect("candidates")
                .iter()
                .all(|candidate| candidate["keepalive_age_ms"].as_u64().is_some())
        });
        let killed = Instant::now();
        first.kill9();
        let (at, next) = elected(&second, Duration::from_secs(15));
        let takeover = at.duration_since(killed);
        eprintln!("round {round}: takeover {takeover:?} after kill -9 (TTL 10 s)");
        assert_eq!(next["leader"], "second", "{next}");
        assert!(next["fence"].as_u64() > leading["fence"].as_u64(), "{next}");
        takeovers.push(takeover);
    }
    let slow: Vec<&Duration> = takeovers.iter().filter(|t| **t > limit).collect();
    assert!(slow.is_empty(), "takeovers over {limit:?}: {takeovers:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_holder_whose_member_shuts_down_moves_and_keeps_its_seat() {
    let mut cluster = Cluster::start(3).await;
    let leader = cluster.wait_for_leader(RETRY).await;
    let follower = cluster
        .live_ids()
        .into_iter()
        .find(|id| *id != leader)
        .expect("a follower");
    let other = cluster
        .live_ids()
        .into_iter()
        .find(|id| *id != leader && *id != follower)
        .expect("another follower");
    // The holder talks to the follower first, the other follower next.
    let holder_eps = format!(
        "{},{}",
        cluster.endpoint(follower).trim_start_matches("http://"),
        cluster.endpoint(other).trim_start_matches("http://")
    );
    let eps = cluster.endpoint(leader);
    let holder = campaign(&holder_eps, "moving", "holder", 20, "3s");
    let (_, first) = elected(&holder, LINE_TIMEOUT);
    assert_eq!(first["leader"], "holder");
    let _waiting = campaign(&eps, "moving", "waiting", 10, "3s");
    wait_candidates(&eps, "moving", 2);
    assert!(cluster.terminate(follower), "the member shut down cleanly");
    // Longer than two TTLs: the holder renews through the other member all along.
    let watched = Instant::now();
    while watched.elapsed() < Duration::from_secs(8) {
        if let Some(now) = leader_of(&eps, "moving") {
            assert_eq!(now, "holder", "the seat moved while its holder was alive");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The user the partitioned holder runs as: iptables matches its packets by owner.
const PARTITIONED_UID: &str = "65534";

/// `elect campaign` as [`PARTITIONED_UID`] (through `setpriv`), so that a rule on the
/// owner of packets cuts this process alone from every member.
fn campaign_as_partitionable(eps: &str, group: &str, id: &str, ttl: &str) -> Streaming {
    use std::process::Stdio;
    let mut child = Command::new("setpriv")
        .args([
            "--reuid",
            PARTITIONED_UID,
            "--regid",
            PARTITIONED_UID,
            "--clear-groups",
        ])
        .arg(env!("CARGO_BIN_EXE_conclave"))
        .args([
            "elect",
            "campaign",
            group,
            "--id",
            id,
            "--priority",
            "20",
            "--ttl",
            ttl,
            "--json",
            "--",
            "sleep",
            "600",
        ])
        .env("CONCLAVE_ENDPOINTS", eps)
        .env_remove("CONCLAVE_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("this test needs setpriv (util-linux) and root");
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send((Instant::now(), line)).is_err() {
                break;
            }
        }
    });
    Streaming { child, lines }
}

/// An iptables rule that drops every TCP packet [`PARTITIONED_UID`] sends on loopback, until
/// dropped: its connections stay open (no FIN, no reset) and it cannot reach any member.
struct Partition;

impl Partition {
    const RULE: [&str; 11] = [
        "OUTPUT",
        "-o",
        "lo",
        "-p",
        "tcp",
        "-m",
        "owner",
        "--uid-owner",
        PARTITIONED_UID,
        "-j",
        "DROP",
    ];

    fn cut() -> Partition {
        let status = Command::new("iptables")
            .arg("-I")
            .args(Self::RULE)
            .status()
            .expect("this test needs the iptables command (and root)");
        assert!(
            status.success(),
            "iptables -I {:?} failed (root needed)",
            Self::RULE
        );
        Partition
    }
}

impl Drop for Partition {
    fn drop(&mut self) {
        let _ = Command::new("iptables").arg("-D").args(Self::RULE).status();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_partitioned_holder_keeps_its_seat_until_the_ttl() {
    let cluster = Cluster::start(3).await;
    let eps = cluster.endpoints();
    let eps = eps.as_str();
    const TTL_S: u64 = 10;
    let holder = campaign_as_partitionable(eps, "cut", "holder", &format!("{TTL_S}s"));
    let (_, first) = elected(&holder, LINE_TIMEOUT);
    assert_eq!(first["leader"], "holder");
    let waiting = campaign(eps, "cut", "waiting", 10, &format!("{TTL_S}s"));
    wait_candidates(eps, "cut", 2);
    let partition = Partition::cut();
    let cut_at = Instant::now();
    // When the seat moved, as the cluster says (not the waiting process).
    let moved = loop {
        if leader_of(eps, "cut").is_some_and(|leader| leader != "holder") {
            break cut_at.elapsed();
        }
        assert!(
            cut_at.elapsed() < Duration::from_secs(TTL_S + 15),
            "the seat never moved from a partitioned holder"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let (at, next) = elected(&waiting, Duration::from_secs(TTL_S + 15));
    let takeover = at.duration_since(cut_at);
    drop(partition);
    eprintln!(
        "seat moved {moved:?}, waiting campaign elected {takeover:?} after the partition (TTL {TTL_S} s)"
    );
    assert_eq!(next["leader"], "waiting", "{next}");
    // The last keepalive was at most TTL/3 before the cut, so the lease lived at least
    // 2/3 of the TTL after it: far longer than the orphan grace.
    assert!(
        moved >= Duration::from_secs(TTL_S * 2 / 3 - 1),
        "the seat moved {moved:?} after a partition: before the TTL"
    );
    // And not much past it: the TTL counts from the last keepalive the leader read, which
    // was before the cut. The holder gives its lease up at its local deadline by resetting
    // its connections, so a keepalive it queued during the partition is thrown away rather
    // than delivered by the kernel once the socket is orphaned (no longer the partitioned
    // user's, so the rule no longer drops it), which renewed the lease for a second TTL.
    let past_ttl = Duration::from_millis(PAST_TTL_SLACK_MS);
    assert!(
        moved <= Duration::from_secs(TTL_S) + past_ttl,
        "the seat moved {moved:?} after a partition: more than {past_ttl:?} past the {TTL_S} s TTL"
    );
    assert!(
        takeover <= moved + past_ttl,
        "the waiting campaign said elected {takeover:?} after the cut, the seat moved at {moved:?}"
    );
}

/// The harness cluster's election timeout (`serve`'s default `--election-timeout-ms`).
const ELECTION_TIMEOUT_MS: u64 = 150;

/// How long past the TTL a partitioned holder's seat may take to move on a loaded machine:
/// a leader change on the way (two election timeouts), then 2 s for the expiry's commit,
/// the next candidate's election and this test's polling process noticing.
const PAST_TTL_SLACK_MS: u64 = 2 * ELECTION_TIMEOUT_MS + 2_000;
