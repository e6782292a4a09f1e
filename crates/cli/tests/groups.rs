//! Election groups and topics configured through the CLI, taking effect in a running 3-node
//! cluster: the settle window elects by priority then the smallest id whatever the arrival
//! order, a handoff timeout moves the seat from a leader that stays, and age retention drops
//! old messages. Each depends on the leader's timer `Tick`.

mod cli_support;
mod common;

use std::time::{Duration, Instant, SystemTime};

use cli_support::{Streaming, run, run_until_ok};
use common::Cluster;
use serde_json::Value;

const RETRY: Duration = Duration::from_secs(15);

/// A small PRNG for start orders; the seed is printed so a failing order can be replayed.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn leader_of(eps: &str, group: &str) -> Option<Value> {
    let run = run(eps, &["elect", "leader", group, "--json"]);
    (run.code == 0).then(|| run.data())
}

fn wait_leader(eps: &str, group: &str, timeout: Duration) -> Value {
    let start = Instant::now();
    loop {
        if let Some(leader) = leader_of(eps, group) {
            return leader;
        }
        assert!(
            start.elapsed() < timeout,
            "{group} got no leader in {timeout:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `elect configure GROUP --preempt-policy POLICY`, checked to echo the policy.
fn configure_preempt_policy(eps: &str, group: &str, policy: &str) {
    let configured = run_until_ok(
        eps,
        &[
            "elect",
            "configure",
            group,
            "--preempt-policy",
            policy,
            "--json",
        ],
        RETRY,
    )
    .data();
    assert_eq!(configured["preempt_policy"], policy, "{configured}");
}

/// Registers candidate `id` in `group` under a fresh 120 s lease without waiting
/// (`--no-wait`, so the candidacy outlives the command), with `--preempt` if asked; answers
/// the campaign's JSON data.
fn register_candidate(eps: &str, group: &str, id: &str, priority: &str, preempt: bool) -> Value {
    let lease = run_until_ok(eps, &["lease", "grant", "120", "--json"], RETRY).data()["id"]
        .as_str()
        .expect("lease id")
        .to_string();
    let mut args = vec![
        "elect",
        "campaign",
        group,
        "--id",
        id,
        "--priority",
        priority,
        "--lease",
        &lease,
        "--no-wait",
        "--json",
    ];
    if preempt {
        args.push("--preempt");
    }
    run(eps, &args).data()
}

#[tokio::test(flavor = "multi_thread")]
async fn settled_groups_elect_the_smallest_id_whatever_the_start_order() {
    let cluster = Cluster::start(3).await;
    let eps = cluster.endpoints();
    let eps = eps.as_str();
    let seed = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
        | 1;
    eprintln!("start-order seed {seed}");
    let mut rng = XorShift(seed);
    const RUNS: usize = 20;
    const PER_BATCH: usize = 5;
    let mut elected_smallest = 0;
    for batch in 0..RUNS / PER_BATCH {
        let mut campaigns = Vec::new();
        let mut groups = Vec::new();
        for i in 0..PER_BATCH {
            let group = format!("settle-{batch}-{i}");
            let configured = run_until_ok(
                eps,
                &["elect", "configure", &group, "--settle", "2s", "--json"],
                RETRY,
            );
            assert_eq!(configured.data()["settle_ms"], 2000, "{configured:?}");
            groups.push(group);
        }
        for group in &groups {
            let mut ids = ["alpha", "bravo", "charlie"];
            // Fisher-Yates with the seeded generator.
            for k in (1..ids.len()).rev() {
                ids.swap(k, (rng.next() % (k as u64 + 1)) as usize);
            }
            eprintln!("{group}: start order {ids:?}");
            for id in ids {
                campaigns.push(Streaming::start(
                    eps,
                    &[
                        "elect",
                        "campaign",
                        group,
                        "--id",
                        id,
                        "--priority",
                        "5",
                        "--ttl",
                        "10s",
                        "--json",
                        "--",
                        "sleep",
                        "600",
                    ],
                ));
                std::thread::sleep(Duration::from_millis(rng.next() % 200));
            }
        }
        for group in &groups {
            let leader = wait_leader(eps, group, RETRY);
            eprintln!("{group}: {} leads", leader["leader"]);
            if leader["leader"] == "alpha" {
                elected_smallest += 1;
            }
            let candidates = run(eps, &["elect", "candidates", group, "--json"]).data();
            assert_eq!(candidates["policy"]["settle_ms"], 2000, "{candidates}");
        }
        drop(campaigns);
    }
    assert_eq!(elected_smallest, RUNS, "seed {seed}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_handoff_timeout_moves_the_seat_from_a_leader_that_stays() {
    let cluster = Cluster::start(3).await;
    let eps = cluster.endpoints();
    let eps = eps.as_str();
    let grant = |ttl: &str| {
        run_until_ok(eps, &["lease", "grant", ttl, "--json"], RETRY).data()["id"]
            .as_str()
            .expect("lease id")
            .to_string()
    };
    // Two groups alike but for the timeout; the leaders never resign (`--no-wait` leaves
    // nobody to act on the handoff request), and their leases outlive the test.
    for (group, timeout) in [("timed", Some("2s")), ("untimed", None)] {
        let mut args = vec![
            "elect",
            "configure",
            group,
            "--preempt-policy",
            "always",
            "--json",
        ];
        if let Some(timeout) = timeout {
            args.extend(["--handoff-timeout", timeout]);
        }
        let configured = run_until_ok(eps, &args, RETRY).data();
        assert_eq!(configured["preempt_policy"], "always", "{configured}");
        let low = grant("120");
        let elected = run(
            eps,
            &[
                "elect",
                "campaign",
                group,
                "--id",
                "low",
                "--priority",
                "1",
                "--lease",
                &low,
                "--no-wait",
                "--json",
            ],
        )
        .data();
        assert_eq!(elected["elected"], true, "{elected}");
    }
    let started = Instant::now();
    for group in ["timed", "untimed"] {
        let high = grant("120");
        let waiting = run(
            eps,
            &[
                "elect",
                "campaign",
                group,
                "--id",
                "high",
                "--priority",
                "9",
                "--lease",
                &high,
                "--no-wait",
                "--json",
            ],
        )
        .data();
        assert_eq!(waiting["elected"], false, "{waiting}");
        let leader = leader_of(eps, group).expect("a leader");
        assert_eq!(leader["leader"], "low", "{leader}");
        assert_eq!(leader["handoff_to"], "high", "{leader}");
    }
    let moved = loop {
        let leader = leader_of(eps, "timed").expect("a leader");
        if leader["leader"] == "high" {
            break started.elapsed();
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the handoff timeout never moved the seat: {leader}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    eprintln!("seat moved {moved:?} after the handoff request (timeout 2 s)");
    assert!(
        moved >= Duration::from_millis(1500),
        "moved too soon: {moved:?}"
    );
    // Without a timeout the leader keeps the seat as long as it stays.
    std::thread::sleep(Duration::from_secs(4).saturating_sub(started.elapsed()));
    let untimed = leader_of(eps, "untimed").expect("a leader");
    assert_eq!(untimed["leader"], "low", "{untimed}");
    let timed = leader_of(eps, "timed").expect("a leader");
    assert!(
        timed["elected_at"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z')),
        "{timed}"
    );
    assert_eq!(timed["policy"]["handoff_timeout_ms"], 2000, "{timed}");
}

#[tokio::test(flavor = "multi_thread")]
async fn age_retention_drops_old_messages_in_a_running_cluster() {
    let cluster = Cluster::start(3).await;
    let eps = cluster.endpoints();
    let eps = eps.as_str();
    run_until_ok(
        eps,
        &["topic", "configure", "aging", "--max-age", "2s", "--json"],
        RETRY,
    )
    .data();
    for topic in ["aging", "kept"] {
        run_until_ok(
            eps,
            &["publish", topic, "--data", r#"{"n":1}"#, "--json"],
            RETRY,
        )
        .data();
        run(eps, &["ack", "--consumer", "reader", topic, "0", "--json"]).data();
    }
    let inbox = |topic: &str| -> Vec<Value> {
        run(eps, &["inbox", "--consumer", "reader", topic, "--json"]).data()["messages"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    };
    assert_eq!(inbox("aging").len(), 1);
    let start = Instant::now();
    while !inbox("aging").is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "the message outlived its 2 s retention"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("aged out {:?} after the check began", start.elapsed());
    // A topic without retention keeps its message; the inbox without topics reads both.
    let kept = inbox("kept");
    assert_eq!(kept.len(), 1);
    assert_eq!(kept[0]["data"]["n"], 1, "JSON data comes back as JSON");
    let all = run(eps, &["inbox", "--consumer", "reader", "--json"]).data();
    let topics: Vec<&str> = all["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter_map(|m| m["topic"].as_str())
        .collect();
    assert_eq!(topics, ["kept"], "{all}");
}

/// The `higher` policy (the default) through the server: a higher-priority candidate that
/// campaigns without `--preempt` waits behind the sitting leader and asks nothing; one that
/// campaigns with `--preempt` asks for the seat (`handoff_to` names it) while the leader
/// keeps it. `always` is the handoff test above: there the challenger asks without the flag.
#[tokio::test(flavor = "multi_thread")]
async fn the_higher_policy_hands_off_only_to_a_challenger_that_asks() {
    let cluster = Cluster::start(3).await;
    let eps = cluster.endpoints();
    let eps = eps.as_str();
    let group = "polite";
    configure_preempt_policy(eps, group, "higher");
    let register = |id: &str, priority: &str, preempt: bool| {
        register_candidate(eps, group, id, priority, preempt)
    };
    let low = register("low", "1", false);
    assert_eq!(low["elected"], true, "{low}");

    let quiet = register("quiet", "5", false);
    assert_eq!(quiet["elected"], false, "{quiet}");
    let leader = leader_of(eps, group).expect("a leader");
    assert_eq!(leader["leader"], "low", "{leader}");
    assert_eq!(
        leader["handoff_to"],
        Value::Null,
        "a challenger without --preempt asks nothing under `higher`: {leader}"
    );
    assert_eq!(leader["policy"]["preempt_policy"], "higher", "{leader}");

    // The best candidate is the one that may ask: eager outranks quiet.
    let eager = register("eager", "9", true);
    assert_eq!(eager["elected"], false, "{eager}");
    let leader = leader_of(eps, group).expect("a leader");
    assert_eq!(
        leader["leader"], "low",
        "the leader keeps the seat: {leader}"
    );
    assert_eq!(leader["handoff_to"], "eager", "{leader}");
}

/// The `never` policy through the server: a higher-priority candidate campaigning with
/// `--preempt` neither displaces the sitting leader nor asks for its seat; it takes the seat
/// when the leader resigns.
#[tokio::test(flavor = "multi_thread")]
async fn the_never_policy_keeps_the_leader_until_it_resigns() {
    let cluster = Cluster::start(3).await;
    let eps = cluster.endpoints();
    let eps = eps.as_str();
    let group = "steadfast";
    configure_preempt_policy(eps, group, "never");
    // Every candidate asks for the seat; under `never` none may have it.
    let register = |id: &str, priority: &str| register_candidate(eps, group, id, priority, true);
    let low = register("low", "1");
    assert_eq!(low["elected"], true, "{low}");
    let first = leader_of(eps, group).expect("a leader");
    let eager = register("eager", "9");
    assert_eq!(eager["elected"], false, "{eager}");
    // Give a (wrongly) requested handoff every chance to show: the leader's timer and a
    // few applied entries.
    std::thread::sleep(Duration::from_millis(500));
    let leader = leader_of(eps, group).expect("a leader");
    assert_eq!(leader["leader"], "low", "never: the leader stays: {leader}");
    assert_eq!(
        leader["handoff_to"],
        Value::Null,
        "no handoff asked: {leader}"
    );
    assert_eq!(leader["policy"]["preempt_policy"], "never", "{leader}");
    assert_eq!(
        leader["fence"], first["fence"],
        "the same leadership: {leader}"
    );

    let resigned = run(eps, &["elect", "resign", group, "--id", "low", "--json"]);
    assert_eq!(resigned.code, 0, "{resigned:?}");
    let start = Instant::now();
    let next = loop {
        let leader = wait_leader(eps, group, RETRY);
        if leader["leader"] == "eager" {
            break leader;
        }
        assert!(
            start.elapsed() < RETRY,
            "eager never took the seat: {leader}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        next["fence"].as_i64() > first["fence"].as_i64(),
        "a higher fence: {next} after {first}"
    );
}
