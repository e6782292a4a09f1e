//! Work queues against real `conclave serve` processes: workers draining a queue while the Raft
//! leader is killed (-9) twice, a worker that stalls past its visibility timeout and has its
//! late ack refused by fence, dead-lettering, priority and delay — the last three through the
//! `conclave queue` commands.

mod common;

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::Cluster;
use conclave_client::{ClaimOptions, Client, ClientOptions, Error, PushOptions};
use serde_json::Value;
use tokio::sync::Mutex;

const JOBS: u64 = 2_000;
const WORKERS: usize = 8;
const PUSHERS: u64 = 8;
/// Long enough that claims outlive an election now and then, short enough that one that
/// outlived its worker's patience comes back within the test.
const VISIBILITY: Duration = Duration::from_secs(5);
/// The whole drain may take this long on a loaded 2-core machine.
const DRAIN_BOUND: Duration = Duration::from_secs(90);

async fn client(endpoints: &str) -> Client {
    let options = ClientOptions {
        request_timeout: Duration::from_secs(10),
        ..ClientOptions::default()
    };
    let endpoints: Vec<&str> = endpoints.split(',').collect();
    Client::connect_with(&endpoints, options)
        .await
        .expect("connect")
}

/// What one worker saw: acks that succeeded, and acks whose outcome it could not learn.
#[derive(Default)]
struct WorkerLog {
    /// (job id, payload) of each ack heard.
    acked: Vec<(u64, Vec<u8>)>,
    stale: Vec<u64>,
    unknown: Vec<u64>,
}

async fn worker(
    client: Client,
    name: String,
    done: Arc<AtomicBool>,
    acks: Arc<AtomicU64>,
) -> WorkerLog {
    let queues = client.queues();
    let mut log = WorkerLog::default();
    while !done.load(Ordering::SeqCst) {
        let options = ClaimOptions {
            worker: name.clone(),
            visibility_timeout: VISIBILITY,
            wait: Duration::from_millis(500),
        };
        let job = match queues.claim("jobs", options).await {
            Ok(Some(job)) => job,
            Ok(None) => continue,
            // A failover in progress: claim again (a claim whose answer was lost is retried
            // in its session by the client; one that gave up times out and comes back).
            Err(_) => continue,
        };
        let mut outcome_unknown = false;
        loop {
            match queues.ack("jobs", job.id, job.fence).await {
                Ok(()) => {
                    log.acked.push((job.id, job.payload.clone()));
                    acks.fetch_add(1, Ordering::SeqCst);
                    break;
                }
                Err(Error::LeadershipLost(_)) => {
                    if outcome_unknown {
                        log.unknown.push(job.id);
                    } else {
                        log.stale.push(job.id);
                    }
                    break;
                }
                Err(error) if error.is_transient() || matches!(error, Error::Timeout(_)) => {
                    outcome_unknown = true;
                }
                Err(error) => panic!("ack of job {} failed: {error}", job.id),
            }
        }
    }
    log
}

#[tokio::test(flavor = "multi_thread")]
async fn eight_workers_drain_2000_jobs_while_the_leader_is_killed_twice() {
    let mut cluster = Cluster::start(3).await;
    let endpoints = cluster.endpoints();
    let started = Instant::now();
    // Job id -> payload, as the pushes answered.
    let pushed = Arc::new(Mutex::new(BTreeMap::new()));
    let mut pushers = Vec::new();
    for pusher in 0..PUSHERS {
        let client = client(&endpoints).await;
        let pushed = pushed.clone();
        pushers.push(tokio::spawn(async move {
            for n in 0..JOBS / PUSHERS {
                let payload = format!("{pusher}-{n}").into_bytes();
                let answer = client
                    .queues()
                    .push(
                        "jobs",
                        payload.clone(),
                        PushOptions {
                            max_attempts: 1_000,
                            ..PushOptions::default()
                        },
                    )
                    .await
                    .expect("push");
                assert!(!answer.existing);
                let previous = pushed.lock().await.insert(answer.job_id, payload);
                assert!(previous.is_none(), "job id given twice");
            }
        }));
    }
    for pusher in pushers {
        pusher.await.expect("pusher");
    }
    let pushed = pushed.lock().await.clone();
    assert_eq!(pushed.len() as u64, JOBS);
    println!("pushed {JOBS} jobs in {:?}", started.elapsed());
    let done = Arc::new(AtomicBool::new(false));
    let acks = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for n in 0..WORKERS {
        let client = client(&endpoints).await;
        workers.push(tokio::spawn(worker(
            client,
            format!("worker-{n}"),
            done.clone(),
            acks.clone(),
        )));
    }
    let drain_started = Instant::now();
    // Kill the leader at a third and at two thirds of the acks, restarting it in between so
    // the cluster keeps its quorum for the second kill.
    for fraction in [1, 2] {
        while acks.load(Ordering::SeqCst) < JOBS * fraction / 3 {
            assert!(drain_started.elapsed() < DRAIN_BOUND, "the drain stalled");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let leader = cluster.wait_for_leader(Duration::from_secs(15)).await;
        cluster.kill(leader);
        println!(
            "killed leader {leader} at {} acks, {:?} into the drain",
            acks.load(Ordering::SeqCst),
            drain_started.elapsed()
        );
        cluster.wait_for_leader(Duration::from_secs(15)).await;
        cluster.spawn(leader);
    }
    let observer = client(&endpoints).await;
    loop {
        assert!(
            drain_started.elapsed() < DRAIN_BOUND,
            "the drain did not finish within {DRAIN_BOUND:?}"
        );
        if let Ok(stats) = observer.queues().stats("jobs").await
            && stats.first().is_some_and(|s| s.acked >= JOBS)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    done.store(true, Ordering::SeqCst);
    let mut acked_by: BTreeMap<u64, usize> = BTreeMap::new();
    let (mut stale, mut unknown) = (0, 0);
    for worker in workers {
        let log = worker.await.expect("worker");
        for (id, payload) in log.acked {
            assert_eq!(
                pushed.get(&id),
                Some(&payload),
                "job {id} came back with another payload"
            );
            *acked_by.entry(id).or_default() += 1;
        }
        stale += log.stale.len();
        unknown += log.unknown.len();
    }
    println!(
        "drained in {:?}: {} acks heard, {stale} refused as stale, {unknown} of unknown outcome",
        drain_started.elapsed(),
        acked_by.len()
    );
    // No job was acked twice, and every ack a worker heard is of a pushed job.
    assert!(acked_by.values().all(|&n| n == 1), "a job was acked twice");
    // The state machine's record: every job acked once, none left, none dead.
    let stats = observer.queues().stats("jobs").await.expect("stats");
    let stats = &stats[0];
    assert_eq!(stats.pushed, JOBS);
    assert_eq!(stats.acked, JOBS, "{stats:?}");
    assert_eq!(
        (stats.ready, stats.delayed, stats.in_flight),
        (0, 0, 0),
        "{stats:?}"
    );
    assert_eq!(stats.dead_lettered, 0);
    // A job missing from the workers' record is one whose ack applied while its answer was
    // lost; the server's count above says it was acked exactly once.
    assert!(
        acked_by.len() as u64 + unknown as u64 >= JOBS,
        "{} acks heard and {unknown} unknown do not cover {JOBS} jobs",
        acked_by.len()
    );
    let (left, _) = observer.queues().list("jobs", 0, 10).await.expect("list");
    assert!(left.is_empty(), "jobs left: {left:?}");
}

// ---- through the CLI -------------------------------------------------------------------------

fn conclave(endpoints: &str, args: &[&str]) -> (i32, Value) {
    let output = Command::new(env!("CARGO_BIN_EXE_conclave"))
        .args(["--endpoints", endpoints, "--json", "--timeout", "10s"])
        .args(args)
        .output()
        .expect("run conclave");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let document = serde_json::from_str(stdout.trim()).unwrap_or_else(|error| {
        panic!(
            "conclave {args:?}: not one JSON document ({error}): {stdout}; stderr: {}",
            String::from_utf8_lossy(&output.stderr)
        )
    });
    (output.status.code().unwrap_or(-1), document)
}

fn ok(endpoints: &str, args: &[&str]) -> Value {
    let (code, document) = conclave(endpoints, args);
    assert_eq!(code, 0, "conclave {args:?}: {document}");
    document["data"].clone()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_worker_paused_past_its_timeout_has_its_late_ack_refused_by_fence() {
    let cluster = Cluster::start(3).await;
    let endpoints = cluster.endpoints();
    let pushed = ok(
        &endpoints,
        &[
            "queue",
            "push",
            "work",
            "--data",
            r#"{"task":"resize","n":7}"#,
        ],
    );
    let id = pushed["id"].as_u64().expect("job id");
    let first = ok(
        &endpoints,
        &[
            "queue",
            "claim",
            "work",
            "--worker",
            "slow",
            "--visibility",
            "1s",
        ],
    );
    assert_eq!(first["id"].as_u64(), Some(id));
    // JSON stays JSON.
    assert_eq!(first["payload"]["task"], "resize");
    let first_fence = first["fence"].as_u64().expect("fence").to_string();
    // The slow worker stalls past its visibility timeout; the job comes back to someone else.
    let second = ok(
        &endpoints,
        &[
            "queue", "claim", "work", "--worker", "fast", "--wait", "10s",
        ],
    );
    assert_eq!(second["id"].as_u64(), Some(id));
    assert_eq!(second["attempts"].as_u64(), Some(2));
    let second_fence = second["fence"].as_u64().expect("fence");
    assert!(second_fence > first_fence.parse::<u64>().unwrap());
    let id_text = id.to_string();
    let (code, late) = conclave(
        &endpoints,
        &["queue", "ack", "work", &id_text, "--fence", &first_fence],
    );
    assert_eq!(code, 8, "the late ack must be refused: {late}");
    assert_eq!(late["code"], "leadership_lost", "{late}");
    ok(
        &endpoints,
        &[
            "queue",
            "ack",
            "work",
            &id_text,
            "--fence",
            &second_fence.to_string(),
        ],
    );
    let stats = ok(&endpoints, &["queue", "stats", "work"]);
    let stats = &stats["queues"][0];
    assert_eq!(stats["acked"], 1, "{stats}");
    assert_eq!(stats["timed_out"], 1, "{stats}");
    assert_eq!(stats["in_flight"], 0, "{stats}");
}

#[tokio::test(flavor = "multi_thread")]
async fn dead_letters_priority_and_delay_through_the_cli() {
    let cluster = Cluster::start(3).await;
    let endpoints = cluster.endpoints();
    // Dead-lettering: two claims that time out use up max attempts 2.
    let poison = ok(
        &endpoints,
        &[
            "queue",
            "push",
            "mail",
            "--data",
            "poison",
            "--max-attempts",
            "2",
        ],
    )["id"]
        .as_u64()
        .unwrap();
    for attempt in 1..=2u64 {
        let job = ok(
            &endpoints,
            &[
                "queue",
                "claim",
                "mail",
                "--visibility",
                "1s",
                "--wait",
                "10s",
            ],
        );
        assert_eq!(job["id"].as_u64(), Some(poison));
        assert_eq!(job["attempts"].as_u64(), Some(attempt));
    }
    // The second claim runs out; the job moves to mail.dead, where a worker can take it.
    let dead = ok(
        &endpoints,
        &["queue", "claim", "mail.dead", "--wait", "10s"],
    );
    assert_eq!(dead["id"].as_u64(), Some(poison));
    assert_eq!(dead["payload"], "poison");
    let stats = ok(&endpoints, &["queue", "stats", "mail"]);
    assert_eq!(stats["queues"][0]["dead_lettered"], 1);
    let (code, empty) = conclave(&endpoints, &["queue", "claim", "mail"]);
    assert_eq!(
        (code, &empty["code"]),
        (3, &Value::from("not_found")),
        "{empty}"
    );

    // Priority, then age.
    for (data, priority) in [("low", "1"), ("high", "9"), ("high-later", "9")] {
        ok(
            &endpoints,
            &[
                "queue",
                "push",
                "prio",
                "--data",
                data,
                "--priority",
                priority,
            ],
        );
    }
    let order: Vec<Value> = (0..3)
        .map(|_| ok(&endpoints, &["queue", "claim", "prio"])["payload"].clone())
        .collect();
    assert_eq!(order, ["high", "high-later", "low"].map(Value::from));

    // Delay: a delayed high-priority job waits its turn; a waiting claim gets it when due.
    let pushed_at = Instant::now();
    ok(
        &endpoints,
        &[
            "queue",
            "push",
            "later",
            "--data",
            "late",
            "--delay",
            "2s",
            "--priority",
            "5",
        ],
    );
    ok(&endpoints, &["queue", "push", "later", "--data", "now"]);
    assert_eq!(
        ok(&endpoints, &["queue", "claim", "later"])["payload"],
        "now"
    );
    let listed = ok(&endpoints, &["queue", "list", "later"]);
    let states: Vec<&str> = listed["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["state"].as_str().unwrap())
        .collect();
    assert_eq!(states, ["delayed", "claimed"]);
    let late = ok(&endpoints, &["queue", "claim", "later", "--wait", "20s"]);
    assert_eq!(late["payload"], "late");
    assert!(
        pushed_at.elapsed() >= Duration::from_millis(1_900),
        "claimed after {:?}, before its 2 s delay",
        pushed_at.elapsed()
    );
}
