//! Work queues through the state machine: fenced claims, timeouts driven by `Tick`, dead
//! letters, delays, exactly-once claims under session replay, snapshots, and a model check.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use bytes::Bytes;
use common::Driver;
use conclave_state::queue::DEAD_LETTER_SUFFIX;
use conclave_state::{
    Command, Config, Error, Job, JobPush, Request, Response, SessionSeq, StateMachine,
};
use proptest::prelude::*;

fn push_request(queue: &str, payload: &str) -> Request {
    Request::QueuePush(JobPush {
        queue: queue.into(),
        payload: Bytes::from(payload.to_owned()),
        ..JobPush::default()
    })
}

fn pushed(driver: &mut Driver, request: Request) -> (u64, bool) {
    match driver.ok(request) {
        Response::JobPushed { id, existing } => (id, existing),
        other => panic!("unexpected {other:?}"),
    }
}

fn claim(driver: &mut Driver, queue: &str, timeout_ms: u64) -> Option<Job> {
    match driver.ok(Request::QueueClaim {
        queue: queue.into(),
        worker: "w".into(),
        visibility_timeout_ms: timeout_ms,
    }) {
        Response::JobClaimed(job) => job,
        other => panic!("unexpected {other:?}"),
    }
}

fn fence(job: &Job) -> u64 {
    job.claim.as_ref().expect("claimed").fence
}

fn ack(driver: &mut Driver, queue: &str, job: &Job) -> Result<Response, Error> {
    driver
        .apply(Request::QueueAck {
            queue: queue.into(),
            job_id: job.id,
            fence: fence(job),
        })
        .result
}

/// Lets the leader's timer run: a `Tick` at `now_ms` (what the server proposes once
/// `next_timer_ms` is due).
fn tick_at(driver: &mut Driver, now_ms: u64) {
    driver.now_ms = now_ms;
    driver.ok(Request::Tick);
}

#[test]
fn a_timed_out_claim_is_refused_and_the_job_goes_to_the_next_worker() {
    let mut driver = Driver::new();
    let (id, _) = pushed(&mut driver, push_request("jobs", "{\"n\":1}"));
    let first = claim(&mut driver, "jobs", 1000).expect("a job");
    assert_eq!(first.id, id);
    assert_eq!(first.attempts, 1);
    assert_eq!(driver.machine.next_timer_ms(), Some(1000));
    // Nobody else gets it while the claim holds.
    driver.now_ms = 999;
    assert!(claim(&mut driver, "jobs", 1000).is_none());
    tick_at(&mut driver, 1000);
    let stats = driver.machine.work_queue("jobs").unwrap().stats();
    assert_eq!((stats.ready, stats.in_flight), (1, 0));
    assert_eq!(stats.counters.timed_out, 1);
    let second = claim(&mut driver, "jobs", 1000).expect("visible again");
    assert_eq!(second.id, id);
    assert_eq!(second.attempts, 2);
    assert!(fence(&second) > fence(&first));
    // The first worker wakes up and reports: refused by its fence.
    let late = ack(&mut driver, "jobs", &first);
    assert!(
        matches!(late, Err(Error::QueueClaimStale { .. })),
        "{late:?}"
    );
    assert_eq!(late.unwrap_err().code(), 1801);
    assert_eq!(ack(&mut driver, "jobs", &second), Ok(Response::JobAcked));
    // A second ack of the same claim is refused too: the job is done.
    assert!(ack(&mut driver, "jobs", &second).is_err());
    let stats = driver.machine.work_queue("jobs").unwrap().stats();
    assert_eq!(stats.counters.acked, 1);
    assert!(driver.machine.work_queue("jobs").unwrap().is_empty());
    assert_eq!(driver.machine.next_timer_ms(), None);
}

#[test]
fn an_expired_claim_is_settled_before_a_late_ack_even_without_a_tick() {
    let mut driver = Driver::new();
    pushed(&mut driver, push_request("jobs", "a"));
    let job = claim(&mut driver, "jobs", 500).unwrap();
    driver.now_ms = 500;
    assert!(matches!(
        ack(&mut driver, "jobs", &job),
        Err(Error::QueueClaimStale { .. })
    ));
}

#[test]
fn extend_keeps_the_claim_and_nack_releases_it() {
    let mut driver = Driver::new();
    pushed(&mut driver, push_request("jobs", "a"));
    let job = claim(&mut driver, "jobs", 500).unwrap();
    driver.now_ms = 400;
    let extended = driver.ok(Request::QueueExtend {
        queue: "jobs".into(),
        job_id: job.id,
        fence: fence(&job),
        visibility_timeout_ms: 500,
    });
    assert_eq!(extended, Response::JobExtended { deadline_ms: 900 });
    tick_at(&mut driver, 800);
    assert!(claim(&mut driver, "jobs", 500).is_none(), "still claimed");
    let nacked = driver.ok(Request::QueueNack {
        queue: "jobs".into(),
        job_id: job.id,
        fence: fence(&job),
        delay_ms: 100,
    });
    assert_eq!(
        nacked,
        Response::JobNacked {
            dead_lettered: false
        }
    );
    assert!(
        claim(&mut driver, "jobs", 500).is_none(),
        "delayed by the nack"
    );
    driver.now_ms = 900;
    assert_eq!(claim(&mut driver, "jobs", 500).unwrap().id, job.id);
}

#[test]
fn after_max_attempts_a_job_is_dead_lettered_and_claimable_there() {
    let mut driver = Driver::new();
    let (id, _) = pushed(
        &mut driver,
        Request::QueuePush(JobPush {
            queue: "jobs".into(),
            payload: Bytes::from_static(b"poison"),
            max_attempts: 3,
            dedup_key: Some("k".into()),
            ..JobPush::default()
        }),
    );
    for attempt in 1..=3u64 {
        let job = claim(&mut driver, "jobs", 100).expect("claimable");
        assert_eq!(u64::from(job.attempts), attempt);
        let later_ms = driver.now_ms + 100;
        tick_at(&mut driver, later_ms);
    }
    assert!(claim(&mut driver, "jobs", 100).is_none());
    let dead_queue = format!("jobs{DEAD_LETTER_SUFFIX}");
    let dead = driver.machine.work_queue(&dead_queue).expect("created");
    let job = dead.job(id).expect("moved with its id");
    assert_eq!(job.attempts, 3);
    assert_eq!(job.payload, Bytes::from_static(b"poison"));
    assert_eq!(
        driver
            .machine
            .work_queue("jobs")
            .unwrap()
            .stats()
            .counters
            .dead_lettered,
        1
    );
    // The dedup key was released with the job: a new push makes a new job.
    let (again, existing) = pushed(
        &mut driver,
        Request::QueuePush(JobPush {
            queue: "jobs".into(),
            dedup_key: Some("k".into()),
            ..JobPush::default()
        }),
    );
    assert!(!existing && again != id);
    // Dead letters are worked like any job, and never dead-lettered again.
    for _ in 0..5 {
        let job = claim(&mut driver, &dead_queue, 100).expect("dead letter");
        assert_eq!(job.id, id);
        let later_ms = driver.now_ms + 100;
        tick_at(&mut driver, later_ms);
    }
    let job = claim(&mut driver, &dead_queue, 100).unwrap();
    assert_eq!(ack(&mut driver, &dead_queue, &job), Ok(Response::JobAcked));
    // Nobody pushes to a dead-letter queue.
    let refused = driver.apply(push_request(&dead_queue, "x")).result;
    assert!(matches!(refused, Err(Error::InvalidArgument(_))));
}

#[test]
fn dedup_answers_the_queued_or_in_flight_job() {
    let mut driver = Driver::new();
    let keyed = |key: &str| {
        Request::QueuePush(JobPush {
            queue: "jobs".into(),
            dedup_key: Some(key.into()),
            ..JobPush::default()
        })
    };
    let (id, existing) = pushed(&mut driver, keyed("a"));
    assert!(!existing);
    assert_eq!(pushed(&mut driver, keyed("a")), (id, true));
    let job = claim(&mut driver, "jobs", 1000).unwrap();
    assert_eq!(pushed(&mut driver, keyed("a")), (id, true), "in flight");
    ack(&mut driver, "jobs", &job).unwrap();
    let (fresh, existing) = pushed(&mut driver, keyed("a"));
    assert!(!existing && fresh != id, "done: a new job");
    let counters = driver.machine.work_queue("jobs").unwrap().stats().counters;
    assert_eq!((counters.pushed, counters.deduplicated), (2, 2));
}

#[test]
fn delay_holds_a_job_until_its_time_and_the_timer_names_that_time() {
    let mut driver = Driver::new();
    pushed(
        &mut driver,
        Request::QueuePush(JobPush {
            queue: "jobs".into(),
            delay_ms: 2000,
            priority: 9,
            ..JobPush::default()
        }),
    );
    let (now, _) = pushed(&mut driver, push_request("jobs", "now"));
    assert_eq!(driver.machine.next_timer_ms(), Some(2000));
    assert_eq!(claim(&mut driver, "jobs", 10_000).unwrap().id, now);
    driver.now_ms = 1999;
    assert!(claim(&mut driver, "jobs", 10_000).is_none());
    // The Tick at the delay's end makes it ready and announces the queue.
    driver.now_ms = 2000;
    let output = driver.apply(Request::Tick);
    assert!(
        output
            .events
            .iter()
            .any(|event| matches!(event, conclave_state::Event::Queue(q) if q == "jobs"))
    );
    assert_eq!(driver.machine.work_queue("jobs").unwrap().stats().ready, 1);
}

#[test]
fn a_retried_claim_in_a_session_answers_the_same_job_and_claims_nothing_more() {
    let mut machine = StateMachine::new(Config::default());
    let mut index = 0;
    let mut apply = |machine: &mut StateMachine, session: Option<SessionSeq>, request: Request| {
        index += 1;
        let command = Command {
            leader_time_ms: 10,
            session,
            request,
        };
        machine.apply(index, &command)
    };
    let opened = apply(
        &mut machine,
        None,
        Request::OpenSessionWithSecret { secret: 7 },
    );
    let Ok(Response::SessionOpened { client_id }) = opened.result else {
        panic!("{opened:?}")
    };
    for n in 0..2 {
        apply(&mut machine, None, push_request("jobs", &format!("{n}")));
    }
    let at = SessionSeq {
        client_id,
        seq: 1,
        secret: 7,
    };
    let claim = Request::QueueClaim {
        queue: "jobs".into(),
        worker: "w".into(),
        visibility_timeout_ms: 1000,
    };
    let first = apply(&mut machine, Some(at), claim.clone());
    // The answer was lost; the client sends the same position again (the log holds both).
    let retry = apply(&mut machine, Some(at), claim.clone());
    assert!(retry.duplicate);
    assert_eq!(retry.result, first.result);
    let stats = machine.work_queue("jobs").unwrap().stats();
    assert_eq!(
        (stats.in_flight, stats.ready, stats.counters.claimed),
        (1, 1, 1)
    );
    // Negative control: without the session the same two entries claim two jobs.
    let plain = apply(&mut machine, None, claim);
    assert!(matches!(plain.result, Ok(Response::JobClaimed(Some(_)))));
    assert_eq!(machine.work_queue("jobs").unwrap().stats().in_flight, 2);
}

#[test]
fn limits_come_from_the_config() {
    let config = Config {
        queues_max: 1,
        queue_jobs_max: 2,
        job_payload_bytes_max: 4,
        ..Config::default()
    };
    let mut driver = Driver::with_config(config);
    pushed(&mut driver, push_request("a", "1"));
    pushed(&mut driver, push_request("a", "2"));
    let full = driver.apply(push_request("a", "3")).result.unwrap_err();
    assert!(full.to_string().contains("at most 2 jobs"), "{full}");
    let queues = driver.apply(push_request("b", "1")).result.unwrap_err();
    assert!(queues.to_string().contains("at most 1 queues"), "{queues}");
    let large = driver.apply(push_request("a", "12345")).result.unwrap_err();
    assert!(matches!(large, Error::InvalidArgument(_)), "{large}");
    let empty = driver.apply(push_request("", "1")).result.unwrap_err();
    assert!(matches!(empty, Error::InvalidArgument(_)), "{empty}");
}

#[test]
fn a_snapshot_carries_the_queues() {
    let mut driver = Driver::new();
    for n in 0..5 {
        pushed(&mut driver, push_request("jobs", &format!("{n}")));
    }
    let job = claim(&mut driver, "jobs", 1000).unwrap();
    let bytes = driver.machine.snapshot_to_vec();
    let mut restored =
        StateMachine::restore(driver.machine.config().clone(), bytes.as_slice()).expect("restores");
    assert_eq!(restored.snapshot_to_vec(), bytes);
    assert_eq!(restored.work_queue("jobs").unwrap().stats().in_flight, 1);
    assert_eq!(restored.next_timer_ms(), Some(1000));
    // The fence counter came along: a late ack is refused on the restored replica too.
    let tick = Command::new(1000, Request::Tick);
    restored.apply(driver.index + 1, &tick);
    let late = Command::new(
        1000,
        Request::QueueAck {
            queue: "jobs".into(),
            job_id: job.id,
            fence: fence(&job),
        },
    );
    assert!(restored.apply(driver.index + 2, &late).result.is_err());
    let again = Command::new(
        1000,
        Request::QueueClaim {
            queue: "jobs".into(),
            worker: "w".into(),
            visibility_timeout_ms: 0,
        },
    );
    let output = restored.apply(driver.index + 3, &again);
    let Ok(Response::JobClaimed(Some(next))) = output.result else {
        panic!("{output:?}")
    };
    assert!(fence(&next) > fence(&job));
}

// ---- model check ---------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Op {
    Push {
        queue: u8,
        priority: i8,
        delay_ms: u16,
        key: Option<u8>,
    },
    Claim {
        queue: u8,
        timeout_ms: u16,
    },
    /// Acts on the `pick`-th claim handed out so far (stale or not).
    Ack {
        pick: u16,
    },
    Nack {
        pick: u16,
        delay_ms: u16,
    },
    Extend {
        pick: u16,
        timeout_ms: u16,
    },
    Tick,
    Advance {
        ms: u16,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..2u8, -2..3i8, prop_oneof![Just(0u16), 1..500u16], proptest::option::of(0..4u8))
            .prop_map(|(queue, priority, delay_ms, key)| Op::Push { queue, priority, delay_ms, key }),
        3 => (0..3u8, 1..800u16).prop_map(|(queue, timeout_ms)| Op::Claim { queue, timeout_ms }),
        2 => any::<u16>().prop_map(|pick| Op::Ack { pick }),
        1 => (any::<u16>(), 0..300u16).prop_map(|(pick, delay_ms)| Op::Nack { pick, delay_ms }),
        1 => (any::<u16>(), 1..800u16).prop_map(|(pick, timeout_ms)| Op::Extend { pick, timeout_ms }),
        1 => Just(Op::Tick),
        2 => (1..400u16).prop_map(|ms| Op::Advance { ms }),
    ]
}

fn queue_name(queue: u8) -> String {
    // Queue 2 is queue 0's dead-letter queue, so claims and acks reach dead letters too.
    match queue {
        0 => "a".into(),
        1 => "b".into(),
        _ => format!("a{DEAD_LETTER_SUFFIX}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Against any interleaving of pushes, claims, acks (current or stale), nacks, extensions,
    /// ticks and time: a job is held by at most one live claim, fences only grow, only the
    /// current claim's fence is accepted, every job pushed is acked at most once and is
    /// otherwise still somewhere (queued, in flight or dead-lettered), and replaying the log on
    /// a second replica, or from a snapshot, gives the same state.
    #[test]
    fn claims_are_exclusive_and_no_job_is_lost(ops in proptest::collection::vec(op(), 1..120)) {
        let config = Config { queue_jobs_max: 1000, ..Config::default() };
        let mut machine = StateMachine::new(config.clone());
        let mut log: Vec<Command> = Vec::new();
        let mut now_ms = 0u64;
        let mut claims: Vec<(String, Job)> = Vec::new();
        let mut last_fence = 0u64;
        let mut live: BTreeMap<u64, u64> = BTreeMap::new(); // job id -> fence of its live claim
        let mut created = BTreeSet::new();
        let mut acked = BTreeSet::new();
        let mut snapshot_at: Option<(usize, Vec<u8>)> = None;
        for (step, op) in ops.iter().enumerate() {
            let request = match op {
                Op::Push { queue, priority, delay_ms, key } => Request::QueuePush(JobPush {
                    queue: queue_name(*queue % 2),
                    payload: Bytes::from(format!("{step}")),
                    priority: i64::from(*priority),
                    delay_ms: u64::from(*delay_ms),
                    dedup_key: key.map(|k| format!("k{k}")),
                    max_attempts: 2,
                }),
                Op::Claim { queue, timeout_ms } => Request::QueueClaim {
                    queue: queue_name(*queue),
                    worker: format!("w{step}"),
                    visibility_timeout_ms: u64::from(*timeout_ms),
                },
                Op::Ack { pick } | Op::Nack { pick, .. } | Op::Extend { pick, .. } => {
                    if claims.is_empty() { continue; }
                    let (queue, job) = &claims[usize::from(*pick) % claims.len()];
                    let (queue, job_id, fence) = (queue.clone(), job.id, fence(job));
                    match op {
                        Op::Ack { .. } => Request::QueueAck { queue, job_id, fence },
                        Op::Nack { delay_ms, .. } => Request::QueueNack {
                            queue, job_id, fence, delay_ms: u64::from(*delay_ms),
                        },
                        Op::Extend { timeout_ms, .. } => Request::QueueExtend {
                            queue, job_id, fence, visibility_timeout_ms: u64::from(*timeout_ms),
                        },
                        _ => unreachable!(),
                    }
                }
                Op::Tick => Request::Tick,
                Op::Advance { ms } => { now_ms += u64::from(*ms); continue; }
            };
            // What the model says about an ack, nack or extend before it applies.
            let presented = match &request {
                Request::QueueAck { job_id, fence, .. }
                | Request::QueueNack { job_id, fence, .. }
                | Request::QueueExtend { job_id, fence, .. } => Some((*job_id, *fence)),
                _ => None,
            };
            let command = Command::new(now_ms, request.clone());
            log.push(command.clone());
            let output = machine.apply(log.len() as u64, &command);
            // Claims that ran out are settled before the command; refresh the model from the
            // state (which the invariant check below holds to itself).
            live.retain(|id, fence| {
                ["a", "b", "a.dead", "b.dead"].iter().any(|q| {
                    machine.work_queue(q).and_then(|wq| wq.job(*id))
                        .and_then(|j| j.claim.as_ref()).is_some_and(|c| c.fence == *fence)
                })
            });
            match (&request, &output.result) {
                (Request::QueuePush(_), Ok(Response::JobPushed { id, existing })) => {
                    prop_assert!(*existing || created.insert(*id), "job id {} reused", id);
                }
                (Request::QueueClaim { queue, .. }, Ok(Response::JobClaimed(Some(job)))) => {
                    let claim = job.claim.as_ref().expect("a claimed job has a claim");
                    prop_assert!(claim.fence > last_fence, "fence went back");
                    last_fence = claim.fence;
                    prop_assert!(!live.contains_key(&job.id), "job {} claimed twice", job.id);
                    prop_assert!(!acked.contains(&job.id), "acked job {} claimed", job.id);
                    live.insert(job.id, claim.fence);
                    claims.push((queue.clone(), job.clone()));
                }
                (Request::QueueAck { .. }, result) => {
                    let (job_id, _) = presented.expect("ack presents a fence");
                    if result.is_ok() {
                        prop_assert!(acked.insert(job_id), "job {} acked twice", job_id);
                    }
                }
                _ => {}
            }
            if let (Some((job_id, fence)), Ok(_)) = (presented, &output.result) {
                // Accepted only from the claim that was current.
                let current = claims.iter().filter(|(_, j)| j.id == job_id)
                    .filter_map(|(_, j)| j.claim.as_ref()).map(|c| c.fence).max();
                prop_assert_eq!(Some(fence), current);
            }
            machine.check_invariants();
            if step == ops.len() / 2 {
                snapshot_at = Some((log.len(), machine.snapshot_to_vec()));
            }
        }
        // Nothing lost: every job created is acked or still held somewhere.
        let names: Vec<String> = machine.work_queue_names_from("").map(String::from).collect();
        let held: BTreeSet<u64> = names.iter()
            .filter_map(|q| machine.work_queue(q))
            .flat_map(|q| q.jobs_from(0, usize::MAX).map(|j| j.id).collect::<Vec<_>>())
            .collect();
        let accounted: BTreeSet<u64> = held.union(&acked).copied().collect();
        let dropped: u64 = names.iter().filter_map(|q| machine.work_queue(q))
            .map(|q| q.stats().counters.dropped).sum();
        prop_assert_eq!(accounted.len() as u64 + dropped, created.len() as u64);
        prop_assert!(held.is_disjoint(&acked));
        // Replicas agree: the same log from scratch, and from the mid-way snapshot.
        let mut replica = StateMachine::new(config.clone());
        for (i, command) in log.iter().enumerate() {
            replica.apply(i as u64 + 1, command);
        }
        prop_assert_eq!(replica.snapshot_to_vec(), machine.snapshot_to_vec());
        if let Some((applied, bytes)) = snapshot_at {
            let mut resumed = StateMachine::restore(config, bytes.as_slice()).expect("restores");
            for (i, command) in log.iter().enumerate().skip(applied) {
                resumed.apply(i as u64 + 1, command);
            }
            prop_assert_eq!(resumed.snapshot_to_vec(), machine.snapshot_to_vec());
        }
    }
}
