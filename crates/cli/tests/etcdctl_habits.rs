//! What an etcdctl user types works with `conclave` too: ETCDCTL_ENDPOINTS, `-w json|table`,
//! `get --keys-only/--print-value-only`, `--prev-kv`, `compact`, and the server's automatic
//! compaction (`--auto-compaction-mode/--auto-compaction-retention`).

mod cli_support;
mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use cli_support::{run, run_until_ok};
use common::{Cluster, free_port};

const GENEROUS: Duration = Duration::from_secs(60);

fn conclave() -> Command {
    Command::new(env!("CARGO_BIN_EXE_conclave"))
}

#[tokio::test(flavor = "multi_thread")]
async fn etcdctl_flags_and_variables_are_understood() {
    let cluster = Cluster::start(1).await;
    let eps = cluster.endpoints();
    let plain = eps.replace("http://", "");
    run_until_ok(&eps, &["put", "/p/a", "1", "--json"], GENEROUS).data();
    run(&eps, &["put", "/p/b", "2", "--json"]).data();

    // ETCDCTL_ENDPOINTS when neither --endpoints nor CONCLAVE_ENDPOINTS is set...
    let out = conclave()
        .args(["get", "/p/a", "-w", "json"])
        .env_remove("CONCLAVE_ENDPOINTS")
        .env("ETCDCTL_ENDPOINTS", &plain)
        .output()
        .expect("run");
    assert!(out.status.success(), "{out:?}");
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).expect("-w json is JSON");
    assert_eq!(doc["data"]["kvs"][0]["value"], "1", "{doc}");
    // ...and the flag beats it.
    let out = conclave()
        .args(["get", "/p/a", "--endpoints", &plain, "--json"])
        .env_remove("CONCLAVE_ENDPOINTS")
        .env("ETCDCTL_ENDPOINTS", format!("127.0.0.1:{}", free_port()))
        .output()
        .expect("run");
    assert!(out.status.success(), "{out:?}");

    // -w table is the human output.
    let table = run(&eps, &["member", "list", "-w", "table"]);
    assert!(table.ok().contains("PEER URLS"), "{table:?}");

    let keys = run(&eps, &["get", "/p/", "--prefix", "--keys-only"]);
    assert_eq!(keys.ok().lines().collect::<Vec<_>>(), ["/p/a", "/p/b"]);
    let keys = run(&eps, &["get", "/p/", "--prefix", "--keys-only", "--json"]).data();
    assert!(keys["kvs"][0].get("value").is_none(), "{keys}");
    assert_eq!(keys["kvs"][1]["key"], "/p/b", "{keys}");
    let values = run(&eps, &["get", "/p/", "--prefix", "--print-value-only"]);
    assert_eq!(values.ok().lines().collect::<Vec<_>>(), ["1", "2"]);

    let put = run(&eps, &["put", "/p/a", "3", "--prev-kv", "--json"]).data();
    assert_eq!(put["prev_kv"]["value"], "1", "{put}");
    let put = run(&eps, &["put", "/p/a", "4", "--prev-kv"]);
    assert_eq!(put.ok().lines().collect::<Vec<_>>(), ["OK", "/p/a", "3"]);
    let del = run(&eps, &["del", "/p/", "--prefix", "--prev-kv", "--json"]).data();
    assert_eq!(del["deleted"], 2, "{del}");
    let deleted: Vec<&str> = del["prev_kvs"]
        .as_array()
        .map(|kvs| kvs.iter().filter_map(|kv| kv["value"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(deleted, ["4", "2"], "{del}");

    // compact REV (and etcdctl's name for it): reads below it are refused after.
    let revision = run(&eps, &["put", "/p/c", "5", "--json"]).data()["revision"]
        .as_i64()
        .expect("revision");
    let compacted = run(&eps, &["compaction", &revision.to_string(), "--json"]).data();
    assert_eq!(compacted["compacted"], revision, "{compacted}");
    run(&eps, &["get", "/p/a", "--rev", "2", "--json"]).assert_error("compacted", 5);
    run(&eps, &["compact", "0", "--json"]).assert_error("invalid_argument", 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_leader_compacts_history_older_than_the_retention() {
    let cluster = Cluster::start_with_args(3, &["--auto-compaction-retention", "2s"]).await;
    let eps = cluster.endpoints();
    let first = run_until_ok(&eps, &["put", "k", "0", "--json"], GENEROUS).data()["revision"]
        .as_i64()
        .expect("revision");
    // History at `first` stays readable for the retention, then goes.
    let early = run(&eps, &["get", "k", "--rev", &first.to_string(), "--json"]);
    assert_eq!(early.data()["kvs"][0]["value"], "0", "{early:?}");
    let began = Instant::now();
    let mut writes = 0;
    loop {
        writes += 1;
        run(&eps, &["put", "k", &writes.to_string(), "--json"]).data();
        let old = run(&eps, &["get", "k", "--rev", &first.to_string(), "--json"]);
        if old.code == 5 {
            old.assert_error("compacted", 5);
            break;
        }
        assert!(
            began.elapsed() < GENEROUS,
            "history at revision {first} was never compacted: {old:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // Not before the retention had passed.
    assert!(
        began.elapsed() >= Duration::from_secs(1),
        "{:?}",
        began.elapsed()
    );
    // The newest history is kept.
    let newest = run(&eps, &["get", "k", "--json"]).data();
    let rev = newest["kvs"][0]["mod_revision"].as_i64().expect("rev");
    let kept = run(&eps, &["get", "k", "--rev", &rev.to_string(), "--json"]);
    assert_eq!(kept.code, 0, "{kept:?}");

    let refused = conclave()
        .args([
            "serve",
            "--auto-compaction-mode",
            "revision",
            "--auto-compaction-retention",
            "1h",
        ])
        .output()
        .expect("run");
    assert_eq!(refused.status.code(), Some(2), "{refused:?}");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("--auto-compaction-retention"), "{stderr}");
}
