//! `elect campaign`, `lock` and `inbox` as separate CLI processes against a real 3-node
//! cluster: failover by priority after kill -9, exclusive locks, and a consumer that loses
//! nothing across a Raft leader failover.

mod cli_support;
mod common;

use std::time::{Duration, Instant};

use cli_support::{Streaming, run, run_until_ok};
use common::Cluster;
use serde_json::Value;

/// The candidacy TTL the failover test uses: a killed leader's seat moves within it (+1 s).
const TTL_S: u64 = 3;
const LINE_TIMEOUT: Duration = Duration::from_secs(15);

/// Waits for a file a CMD creates once it is ready (its trap installed).
fn wait_for_file(path: &std::path::Path) {
    let began = Instant::now();
    while !path.exists() {
        assert!(
            began.elapsed() < LINE_TIMEOUT,
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits for a streaming campaign's `elected` line; answers when it arrived and its data.
fn elected(process: &Streaming, timeout: Duration) -> (Instant, Value) {
    let (at, line) = process
        .next_json(timeout)
        .expect("an elected line before the timeout");
    assert_eq!(line["status"], "ok", "{line}");
    assert_eq!(line["data"]["event"], "elected", "{line}");
    (at, line["data"].clone())
}

fn campaign(eps: &str, id: &str, priority: u32, log: &str) -> Streaming {
    // `exec` so the long-running part is CMD itself, which dies with its supervisor.
    let script = format!(
        "echo \"$CONCLAVE_GROUP $CONCLAVE_TERM $CONCLAVE_FENCE {id}\" >> {log}; exec sleep 600"
    );
    Streaming::start(
        eps,
        &[
            "elect",
            "campaign",
            "swarm",
            "--id",
            id,
            "--priority",
            &priority.to_string(),
            "--value",
            &format!("http://{id}"),
            "--ttl",
            &format!("{TTL_S}s"),
            "--json",
            "--",
            "sh",
            "-c",
            &script,
        ],
    )
}

/// Waits until the leaders' log has `n` lines (CMD starts just after `elected` is printed).
fn log_lines(log: &std::path::Path, n: usize) -> Vec<String> {
    let start = Instant::now();
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if text.lines().count() >= n || start.elapsed() > LINE_TIMEOUT {
            return text.lines().map(str::to_string).collect();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn candidates(eps: &str) -> usize {
    run(eps, &["elect", "candidates", "swarm", "--json"]).data()["candidates"]
        .as_array()
        .map(Vec::len)
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_leaders_are_replaced_in_priority_order_within_the_ttl() {
    let cluster = Cluster::start(3).await;
    let eps = cluster.endpoints();
    let eps = eps.as_str();
    let log = cluster.root.join("leaders.log");
    let log_arg = log.to_string_lossy().to_string();

    let mut high = campaign(eps, "high", 30, &log_arg);
    let (_, first) = elected(&high, LINE_TIMEOUT);
    assert_eq!(first["leader"], "high");
    log_lines(&log, 1);
    let mut mid = campaign(eps, "mid", 20, &log_arg);
    let mut low = campaign(eps, "low", 10, &log_arg);
    let start = Instant::now();
    while candidates(eps) < 3 {
        assert!(
            start.elapsed() < LINE_TIMEOUT,
            "the candidates did not register"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    let limit = Duration::from_secs(TTL_S + 1);
    let killed = Instant::now();
    high.kill9();
    let (at, second) = elected(&mid, limit + Duration::from_secs(5));
    let takeover = at.duration_since(killed);
    eprintln!("takeover after kill -9 of the leader: {takeover:?} (TTL {TTL_S} s)");
    assert!(takeover <= limit, "mid took over after {takeover:?}");
    assert_eq!(second["leader"], "mid");
    let fence = |v: &Value| v["fence"].as_u64().expect("fence");
    assert!(fence(&second) > fence(&first));
    assert!(second["term"].as_u64() > first["term"].as_u64());
    log_lines(&log, 2);

    let killed = Instant::now();
    mid.kill9();
    let (at, third) = elected(&low, limit + Duration::from_secs(5));
    let takeover = at.duration_since(killed);
    eprintln!("second takeover: {takeover:?}");
    assert!(takeover <= limit, "low took over after {takeover:?}");
    assert_eq!(third["leader"], "low");
    assert!(fence(&third) > fence(&second));

    // Each leader's CMD saw its own group, term and fence.
    let lines = log_lines(&log, 3);
    let expected: Vec<String> = [&first, &second, &third]
        .iter()
        .map(|l| {
            format!(
                "swarm {} {} {}",
                l["term"],
                l["fence"],
                l["leader"].as_str().unwrap_or("")
            )
        })
        .collect();
    assert_eq!(lines, expected);

    // Ctrl-C resigns before exiting: the seat is vacant at once, not after the TTL.
    low.signal("-INT");
    assert_eq!(low.wait_code(LINE_TIMEOUT), Some(130));
    run(eps, &["elect", "leader", "swarm", "--json"]).assert_error("not_found", 3);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_leader_whose_lease_ends_stops_its_command_and_exits_with_leadership_lost() {
    let cluster = Cluster::start(3).await;
    let eps = cluster.endpoints();
    let eps = eps.as_str();
    let marker = cluster.root.join("stopped");
    let trapped = cluster.root.join("trapped");
    let script = format!(
        "trap 'echo stopped > {}; exit 0' TERM; touch {}; while true; do sleep 0.1; done",
        marker.display(),
        trapped.display()
    );
    let mut leader = Streaming::start(
        eps,
        &[
            "elect", "campaign", "g", "--id", "one", "--json", "--", "sh", "-c", &script,
        ],
    );
    let (_, info) = elected(&leader, LINE_TIMEOUT);
    let lease = info["lease"].as_str().expect("lease").to_string();
    // CMD has installed its trap before the loss.
    wait_for_file(&trapped);
    run(eps, &["lease", "revoke", &lease, "--json"]).data();
    assert_eq!(
        leader.wait_code(LINE_TIMEOUT),
        Some(8),
        "leadership_lost's exit code"
    );
    let (_, line) = leader.next_json(LINE_TIMEOUT).expect("the loss document");
    assert_eq!(line["status"], "error");
    assert_eq!(line["code"], "leadership_lost");
    assert_eq!(
        std::fs::read_to_string(&marker).ok().as_deref(),
        Some("stopped\n"),
        "CMD got SIGTERM"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn contending_lock_holders_run_one_after_the_other_with_rising_fences() {
    let cluster = Cluster::start(3).await;
    let eps = cluster.endpoints();
    let eps = eps.as_str();
    let log = cluster.root.join("lock.log");
    let script = format!(
        "echo start $CONCLAVE_LOCK_FENCE >> {0}; sleep 1; echo end $CONCLAVE_LOCK_FENCE >> {0}",
        log.display()
    );
    let args = ["lock", "shared", "--json", "--", "sh", "-c", &script];
    let mut first = Streaming::start(eps, &args);
    let (_, acquired) = first.next_json(LINE_TIMEOUT).expect("acquired");
    assert_eq!(acquired["data"]["event"], "acquired");
    let mut second = Streaming::start(eps, &args);
    assert_eq!(first.wait_code(LINE_TIMEOUT), Some(0));
    assert_eq!(second.wait_code(LINE_TIMEOUT), Some(0));
    let text = std::fs::read_to_string(&log).expect("the lock log");
    let lines: Vec<(&str, u64)> = text
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(what, fence)| (what, fence.parse().unwrap_or(0)))
        .collect();
    assert_eq!(lines.len(), 4, "{text}");
    assert_eq!(lines[0].0, "start");
    assert_eq!(lines[1], ("end", lines[0].1), "{text}");
    assert_eq!(
        lines[2].0, "start",
        "the second ran only after the first: {text}"
    );
    assert_eq!(lines[3], ("end", lines[2].1));
    assert!(lines[2].1 > lines[0].1, "fences rise: {text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn inbox_and_ack_lose_nothing_across_a_leader_failover() {
    let mut cluster = Cluster::start(3).await;
    let eps = cluster.endpoints();
    let settle = Duration::from_secs(20);
    for i in 1..=10 {
        run_until_ok(
            &eps,
            &["publish", "jobs", &format!("m{i}"), "--json"],
            settle,
        )
        .data();
    }
    let mut seen: Vec<(u64, String)> = Vec::new();
    let consume_batch = |seen: &mut Vec<(u64, String)>| -> usize {
        let batch = run_until_ok(
            &eps,
            &[
                "inbox",
                "--consumer",
                "worker",
                "jobs",
                "--limit",
                "3",
                "--json",
            ],
            settle,
        )
        .data();
        let messages = batch["messages"].as_array().cloned().unwrap_or_default();
        for m in &messages {
            seen.push((
                m["seq"].as_u64().expect("seq"),
                m["data"].as_str().unwrap_or("").to_string(),
            ));
        }
        if let Some(last) = messages.last().and_then(|m| m["seq"].as_u64()) {
            run_until_ok(
                &eps,
                &[
                    "ack",
                    "--consumer",
                    "worker",
                    "jobs",
                    &last.to_string(),
                    "--json",
                ],
                settle,
            )
            .data();
        }
        messages.len()
    };
    consume_batch(&mut seen);
    consume_batch(&mut seen);

    let leader = cluster.wait_for_leader(Duration::from_secs(5)).await;
    cluster.kill(leader);
    cluster.wait_for_leader(Duration::from_secs(10)).await;
    for i in 11..=20 {
        run_until_ok(
            &eps,
            &["publish", "jobs", &format!("m{i}"), "--json"],
            settle,
        )
        .data();
    }
    while consume_batch(&mut seen) > 0 {}

    let data: Vec<String> = seen.iter().map(|(_, d)| d.clone()).collect();
    let expected: Vec<String> = (1..=20).map(|i| format!("m{i}")).collect();
    assert_eq!(data, expected, "nothing lost, repeated or reordered");
    assert!(seen.windows(2).all(|w| w[0].0 < w[1].0), "{seen:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn ctrl_c_withdraws_a_waiting_locker_and_releases_a_holder() {
    let cluster = Cluster::start(3).await;
    let eps = cluster.endpoints();
    let eps = eps.as_str();
    let mut holder = Streaming::start(
        eps,
        &["lock", "gate", "--json", "--", "sh", "-c", "exec sleep 600"],
    );
    let (_, acquired) = holder.next_json(LINE_TIMEOUT).expect("acquired");
    let fence = acquired["data"]["fence"].as_u64().expect("fence");
    let mut waiter = Streaming::start(eps, &["lock", "gate", "--json"]);
    // Signal only once it waits (its key is queued behind the holder's): earlier, the
    // default SIGINT action would end it before its handler was installed.
    let queued = Instant::now();
    while run(eps, &["get", "gate/", "--prefix", "--json"]).data()["count"] != 2 {
        assert!(queued.elapsed() < LINE_TIMEOUT, "the waiter never queued");
        std::thread::sleep(Duration::from_millis(20));
    }
    waiter.signal("-INT");
    assert_eq!(waiter.wait_code(LINE_TIMEOUT), Some(130));
    let (_, doc) = waiter
        .next_json(LINE_TIMEOUT)
        .expect("the interrupted document");
    assert_eq!(doc["code"], "interrupted");

    holder.signal("-INT");
    assert_eq!(holder.wait_code(LINE_TIMEOUT), Some(130), "CMD was stopped");
    // CMD was cut short: the last document is the interruption, as the exit code says.
    let (_, last) = holder
        .next_json(LINE_TIMEOUT)
        .expect("the interrupted document");
    assert_eq!(last["code"], "interrupted", "{last}");
    // The lock is free at once: the next holder does not wait for a TTL, and its fence is higher.
    let started = Instant::now();
    let next = run(eps, &["lock", "gate", "--json", "--", "true"]);
    assert_eq!(next.code, 0, "{next:?}");
    // Well below the lock's 10 s TTL, with room for a loaded machine.
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "{:?}",
        started.elapsed()
    );
    let first: Value = next
        .stdout
        .lines()
        .next()
        .and_then(|l| serde_json::from_str(l).ok())
        .expect("acquired line");
    assert!(first["data"]["fence"].as_u64().is_some_and(|f| f > fence));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_preempting_candidate_gets_the_seat_at_once_after_the_incumbent_stops_its_command() {
    // A TTL far longer than the test's bound, so only the handoff can move the seat in time.
    const LONG_TTL: &str = "60s";
    let cluster = Cluster::start(3).await;
    let eps = cluster.endpoints();
    let eps = eps.as_str();
    let stopped = cluster.root.join("low-stopped");
    let seen_by_high = cluster.root.join("high-saw");
    let low_trapped = cluster.root.join("low-trapped");
    let low_script = format!(
        "trap 'echo stopped > {}; exit 0' TERM; touch {}; while true; do sleep 0.1; done",
        stopped.display(),
        low_trapped.display()
    );
    let mut low = Streaming::start(
        eps,
        &[
            "elect",
            "campaign",
            "seat",
            "--id",
            "low",
            "--priority",
            "1",
            "--ttl",
            LONG_TTL,
            "--json",
            "--",
            "sh",
            "-c",
            &low_script,
        ],
    );
    let (_, first) = elected(&low, LINE_TIMEOUT);
    assert_eq!(first["leader"], "low");
    assert!(first["handoff_to"].is_null(), "{first}");
    // CMD has installed its trap.
    wait_for_file(&low_trapped);

    // The challenger's CMD records whether the incumbent's CMD had already stopped when it
    // started: the old leader must be out before the new one acts.
    let high_script = format!(
        "if [ -f {0} ]; then echo after > {1}; else echo before > {1}; fi; exec sleep 600",
        stopped.display(),
        seen_by_high.display()
    );
    let launched = Instant::now();
    let high = Streaming::start(
        eps,
        &[
            "elect",
            "campaign",
            "seat",
            "--id",
            "high",
            "--priority",
            "9",
            "--preempt",
            "--ttl",
            LONG_TTL,
            "--json",
            "--",
            "sh",
            "-c",
            &high_script,
        ],
    );
    let (at, second) = elected(&high, LINE_TIMEOUT);
    let handoff = at.duration_since(launched);
    eprintln!(
        "preemption: challenger launched -> elected in {handoff:?} (incumbent TTL {LONG_TTL})"
    );
    assert!(
        handoff < Duration::from_secs(10),
        "the seat moved only after {handoff:?}"
    );
    assert_eq!(second["leader"], "high");
    let fence = |v: &Value| v["fence"].as_u64().expect("fence");
    assert!(fence(&second) > fence(&first), "{first} then {second}");
    assert!(second["term"].as_u64() > first["term"].as_u64());

    assert_eq!(
        low.wait_code(LINE_TIMEOUT),
        Some(8),
        "the incumbent exits with leadership_lost's code"
    );
    let (_, line) = low.next_json(LINE_TIMEOUT).expect("the loss document");
    assert_eq!(line["status"], "error", "{line}");
    assert_eq!(line["code"], "leadership_lost", "{line}");
    let message = line["message"].as_str().unwrap_or("");
    assert!(message.contains("handed over to high"), "{message}");
    assert_eq!(
        std::fs::read_to_string(&stopped).ok().as_deref(),
        Some("stopped\n"),
        "the incumbent's CMD got SIGTERM"
    );
    let start = Instant::now();
    let saw = loop {
        match std::fs::read_to_string(&seen_by_high) {
            Ok(text) if !text.is_empty() => break text,
            _ if start.elapsed() > LINE_TIMEOUT => panic!("the challenger's CMD did not start"),
            _ => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    assert_eq!(
        saw, "after\n",
        "the incumbent's CMD stopped before the challenger's started"
    );

    let leader = run(eps, &["elect", "leader", "seat", "--json"]).data();
    assert_eq!(leader["leader"], "high");
    assert_eq!(leader["fence"], second["fence"]);
    // The incumbent resigned and left: it is no longer a candidate.
    let candidates = run(eps, &["elect", "candidates", "seat", "--json"]).data();
    let ids: Vec<&str> = candidates["candidates"]
        .as_array()
        .map(|list| list.iter().filter_map(|c| c["id"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(ids, ["high"]);
    drop(high);
}

/// `elect observe` names the candidate that left (its `candidate_left` event once carried an
/// empty candidate: no id, priority 0).
#[tokio::test(flavor = "multi_thread")]
async fn observe_names_the_candidate_that_left() {
    let cluster = Cluster::start(3).await;
    let eps = cluster.endpoints();
    let eps = eps.as_str();
    let observer = Streaming::start(eps, &["elect", "observe", "roster", "--json"]);
    let start = |id: &str, priority: &str| {
        Streaming::start(
            eps,
            &[
                "elect",
                "campaign",
                "roster",
                "--id",
                id,
                "--priority",
                priority,
                "--ttl",
                "10s",
                "--json",
                "--",
                "sh",
                "-c",
                "exec sleep 600",
            ],
        )
    };
    let mut leader = start("alpha", "5");
    let (_, line) = leader.next_json(LINE_TIMEOUT).expect("alpha is elected");
    assert_eq!(line["data"]["event"], "elected", "{line}");
    let mut waiting = start("bravo", "2");
    let began = Instant::now();
    let mut events = Vec::new();
    let mut next_event = |what: &str| -> Value {
        loop {
            let left = LINE_TIMEOUT.saturating_sub(began.elapsed());
            let (_, line) = observer
                .next_json(left)
                .unwrap_or_else(|| panic!("no {what} event; saw {events:?}"));
            assert_eq!(line["status"], "ok", "{line}");
            let event = line["data"].clone();
            events.push(event.clone());
            if event["event"] == what {
                return event;
            }
        }
    };
    let joined = next_event("candidate_joined");
    // The leader may join first; wait for bravo's own.
    let joined = if joined["candidate"]["id"] == "bravo" {
        joined
    } else {
        next_event("candidate_joined")
    };
    assert_eq!(joined["candidate"]["id"], "bravo", "{joined}");

    run(
        eps,
        &["elect", "resign", "roster", "--id", "bravo", "--json"],
    )
    .ok();
    let left = next_event("candidate_left");
    assert_eq!(left["candidate"]["id"], "bravo", "{left}");
    assert_eq!(left["candidate"]["priority"], 2, "{left}");
    assert_eq!(left["leadership"]["leader"], "alpha", "{left}");
    waiting.kill9();
    leader.kill9();
}
