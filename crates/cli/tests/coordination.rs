//! The `conclave` lease, election, lock and topic commands against a real 3-node cluster, in
//! human and `--json` modes.

mod cli_support;
mod common;

use std::time::Duration;

use cli_support::{Streaming, run};
use common::Cluster;

/// How long a streaming command may take to print its next line.
const LINE_TIMEOUT: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread")]
async fn lease_commands_in_both_output_modes() {
    let cluster = Cluster::start(3).await;
    let eps = cluster.endpoints();
    let eps = eps.as_str();

    let human = run(eps, &["lease", "grant", "30"]);
    assert!(
        human.ok().starts_with("lease ") && human.stdout.contains("granted with TTL(30s)"),
        "{human:?}"
    );
    let granted = run(eps, &["lease", "grant", "30s", "--json"]).data();
    let id = granted["id"].as_str().expect("hex id").to_string();
    assert_eq!(granted["ttl"], 30);

    run(eps, &["put", "session/x", "up", "--lease", &id]).ok();
    let ttl = run(eps, &["lease", "ttl", &id, "--keys", "--json"]).data();
    assert_eq!(ttl["granted_ttl"], 30);
    assert!(ttl["remaining_ttl"].as_u64().is_some_and(|r| r <= 30));
    assert_eq!(ttl["keys"][0], "session/x");
    let human = run(eps, &["lease", "ttl", &id, "--keys"]);
    assert!(human.ok().contains("attached keys(session/x)"), "{human:?}");

    let once = run(eps, &["lease", "keepalive", &id, "--once", "--json"]).data();
    assert_eq!(once["id"], id.as_str());
    assert_eq!(once["ttl"], 30);
    let kept = Streaming::start(eps, &["lease", "keepalive", &id, "--json"]);
    let (_, line) = kept.next_json(LINE_TIMEOUT).expect("a keepalive line");
    assert_eq!(line["data"]["ttl"], 30);
    drop(kept);

    let list = run(eps, &["lease", "list", "--json"]).data();
    assert!(
        list["leases"]
            .as_array()
            .is_some_and(|l| l.iter().any(|x| x == id.as_str())),
        "{list}"
    );
    assert!(run(eps, &["lease", "list"]).ok().contains(&id));

    let revoked = run(eps, &["lease", "revoke", &id, "--json"]).data();
    assert_eq!(revoked["revoked"], true);
    let gone = run(eps, &["get", "session/x", "--json"]).data();
    assert_eq!(gone["count"], 0, "revoking deletes the lease's keys");
    run(eps, &["lease", "ttl", &id, "--json"]).assert_error("lease_expired", 7);
    run(eps, &["lease", "keepalive", &id, "--once", "--json"]).assert_error("lease_expired", 7);
}

#[tokio::test(flavor = "multi_thread")]
async fn election_lock_and_topic_commands_in_both_output_modes() {
    let cluster = Cluster::start(3).await;
    let eps = cluster.endpoints();
    let eps = eps.as_str();

    // The seed document's style: register under a lease, heartbeat with keepalive --once.
    let lease = run(eps, &["lease", "grant", "20", "--json"]).data()["id"]
        .as_str()
        .expect("id")
        .to_string();
    let registered = run(
        eps,
        &[
            "elect",
            "campaign",
            "crew",
            "--id",
            "a1",
            "--priority",
            "7",
            "--value",
            "http://a1",
            "--lease",
            &lease,
            "--no-wait",
            "--json",
        ],
    )
    .data();
    assert_eq!(registered["elected"], true);
    assert_eq!(registered["leadership"]["leader"], "a1");
    let second = run(
        eps,
        &[
            "elect",
            "campaign",
            "crew",
            "--id",
            "a2",
            "--priority",
            "3",
            "--lease",
            &lease,
            "--no-wait",
            "--json",
        ],
    )
    .data();
    assert_eq!(second["elected"], false);
    assert_eq!(second["leadership"]["leader"], "a1");

    let leader = run(eps, &["elect", "leader", "crew", "--json"]).data();
    assert_eq!(leader["leader"], "a1");
    assert_eq!(leader["priority"], 7);
    assert_eq!(leader["value"], "http://a1");
    assert!(leader["term"].as_u64().is_some_and(|t| t >= 1));
    let fence = leader["fence"].as_u64().expect("fence");
    assert!(
        run(eps, &["elect", "leader", "crew"])
            .ok()
            .starts_with("a1 leads crew")
    );
    let candidates = run(eps, &["elect", "candidates", "crew", "--json"]).data();
    assert_eq!(candidates["candidates"][0]["id"], "a1");
    assert_eq!(candidates["candidates"][0]["leader"], true);
    assert_eq!(candidates["candidates"][1]["id"], "a2");
    let table = run(eps, &["elect", "candidates", "crew"]);
    assert!(table.ok().contains("ID  PRIORITY"), "{table:?}");
    assert!(
        table.stdout.contains("*  a1  7"),
        "the leader is starred: {table:?}"
    );

    let observe = Streaming::start(eps, &["elect", "observe", "crew", "--json"]);
    let (_, current) = observe.next_json(LINE_TIMEOUT).expect("the current state");
    assert_eq!(current["data"]["event"], "current");
    assert_eq!(current["data"]["leadership"]["leader"], "a1");
    let resigned = run(eps, &["elect", "resign", "crew", "--id", "a1", "--json"]).data();
    assert_eq!(resigned["was_leader"], true);
    let mut next_leader = None;
    for _ in 0..5 {
        let Some((_, event)) = observe.next_json(LINE_TIMEOUT) else {
            break;
        };
        if event["data"]["event"] == "elected" {
            next_leader = Some(event["data"]["leadership"].clone());
            break;
        }
    }
    let next_leader = next_leader.expect("an elected event");
    assert_eq!(next_leader["leader"], "a2");
    assert!(next_leader["fence"].as_u64().is_some_and(|f| f > fence));
    drop(observe);

    // A lock around a command: acquired and released lines, the fence in CMD's environment.
    let lock = run(
        eps,
        &[
            "lock",
            "door",
            "--json",
            "--",
            "sh",
            "-c",
            "echo \"{\\\"fence\\\":$CONCLAVE_LOCK_FENCE}\"",
        ],
    );
    assert_eq!(lock.code, 0, "{lock:?}");
    let lines: Vec<serde_json::Value> = lock
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON lines"))
        .collect();
    assert_eq!(lines.len(), 3, "{lock:?}");
    assert_eq!(lines[0]["data"]["event"], "acquired");
    assert_eq!(lines[1]["fence"], lines[0]["data"]["fence"]);
    assert_eq!(lines[2]["data"]["event"], "released");
    let failing = run(eps, &["lock", "door", "--", "sh", "-c", "exit 5"]);
    assert_eq!(failing.code, 5, "lock exits with CMD's status: {failing:?}");

    // Topics.
    let published = run(eps, &["publish", "news", "first", "--json"]).data();
    assert_eq!(published["seq"], 1);
    assert_eq!(published["from"], "", "no sender unless one is named");
    assert_eq!(
        run(eps, &["publish", "news", "second", "--from", "agent-b"]).ok(),
        "published news #2\n"
    );
    // Every reader sees the sender the publisher named.
    let subscribe = Streaming::start(eps, &["subscribe", "news", "--from", "1", "--json"]);
    for (seq, data, from) in [(1, "first", ""), (2, "second", "agent-b")] {
        let (_, message) = subscribe.next_json(LINE_TIMEOUT).expect("a message");
        assert_eq!(message["data"]["seq"], seq);
        assert_eq!(message["data"]["data"], data);
        assert_eq!(message["data"]["from"], from, "{message}");
    }
    drop(subscribe);
    let inbox = run(eps, &["inbox", "--consumer", "c1", "news", "--json"]).data();
    assert_eq!(inbox["messages"].as_array().map(Vec::len), Some(2));
    assert_eq!(inbox["messages"][0]["from"], "", "{inbox}");
    assert_eq!(inbox["messages"][1]["from"], "agent-b", "{inbox}");
    // A sender over the bound is refused before anything is published.
    let long = "x".repeat(257);
    run(
        eps,
        &["publish", "news", "third", "--from", &long, "--json"],
    )
    .assert_error("invalid_argument", 2);
    let table = run(eps, &["inbox", "--consumer", "c1", "news", "--limit", "1"]);
    assert_eq!(table.ok(), "TOPIC  SEQ  DATA\nnews   1    first\n");
    let acked = run(eps, &["ack", "--consumer", "c1", "news", "1", "--json"]).data();
    assert_eq!(acked["acked_seq"], 1);
    let taken = run(
        eps,
        &["inbox", "--consumer", "c1", "news", "--ack", "--json"],
    )
    .data();
    assert_eq!(taken["messages"][0]["seq"], 2);
    let empty = run(eps, &["inbox", "--consumer", "c1", "news", "--json"]).data();
    assert_eq!(empty["messages"].as_array().map(Vec::len), Some(0));
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unknown_group_is_not_found() {
    let cluster = Cluster::start(3).await;
    let eps = cluster.endpoints();
    let eps = eps.as_str();
    // An unknown group.
    run(eps, &["elect", "leader", "no-such-group", "--json"]).assert_error("not_found", 3);
    let human = run(eps, &["elect", "leader", "no-such-group"]);
    assert_eq!(human.code, 3, "{human:?}");
    assert!(human.stderr.contains("no-such-group"), "{human:?}");
}
