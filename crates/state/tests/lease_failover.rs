//! Lease expiry across Raft leader changes (etcd issue 9888; TEST_PLAN `lease_expiry_bound`).
//!
//! A client keeps a lease alive until it abandons it; leaders die and new ones are promoted
//! after at least an election timeout. The leader side is `LeaseKeeper`, the log is the state
//! machine. Properties, over random schedules:
//! - never early: the lease is never expired before (last acknowledged keepalive + TTL);
//! - never forever: it is expired by (last acknowledged keepalive + TTL + max(checkpoint
//!   interval, election timeout)), or one election timeout after the last promotion if that is
//!   later (a new leader's grace).

use conclave_state::{
    Command, Config, LeaseCheckpoint, LeaseKeeper, Request, Response, StateMachine,
};
use proptest::prelude::*;

const STEP_MS: u64 = 50;
const ELECTION_TIMEOUT_MS: u64 = 1000;
const TTL_MS: u64 = 3000;

struct Log {
    machine: StateMachine,
    index: u64,
}

impl Log {
    fn commit(&mut self, now_ms: u64, request: Request) -> Response {
        self.index += 1;
        let output = self
            .machine
            .apply(self.index, &Command::new(now_ms, request));
        output.result.expect("lease command")
    }

    fn checkpoint(&mut self, now_ms: u64, checkpoints: Vec<LeaseCheckpoint>) {
        if !checkpoints.is_empty() {
            self.commit(now_ms, Request::LeaseCheckpoint { checkpoints });
        }
    }
}

#[derive(Debug, Clone)]
struct Schedule {
    /// (leader lifetime, outage) pairs; the outage is at least an election timeout.
    outages: Vec<(u64, u64)>,
    abandon_at_ms: u64,
    keepalive_every_ms: u64,
    checkpoint_interval_ms: u64,
}

fn schedule() -> impl Strategy<Value = Schedule> {
    (
        proptest::collection::vec(
            (100u64..6000, ELECTION_TIMEOUT_MS..3 * ELECTION_TIMEOUT_MS),
            0..6,
        ),
        0u64..15_000,
        200u64..1000,
        prop_oneof![Just(1000u64), Just(2500), Just(5000)],
    )
        .prop_map(
            |(outages, abandon_at_ms, keepalive_every_ms, checkpoint_interval_ms)| Schedule {
                outages,
                abandon_at_ms,
                keepalive_every_ms,
                checkpoint_interval_ms,
            },
        )
}

/// Runs the schedule; returns (expired at, last acknowledged keepalive, last promotion).
fn run(schedule: &Schedule) -> (u64, u64, u64) {
    run_with(schedule, true)
}

/// `record_renewals: false` is the negative control: the leader acknowledges keepalives
/// without committing the "renewed" record first.
fn run_with(schedule: &Schedule, record_renewals: bool) -> (u64, u64, u64) {
    let config = Config {
        election_timeout_ms: ELECTION_TIMEOUT_MS,
        lease_checkpoint_interval_ms: schedule.checkpoint_interval_ms,
        ..Config::default()
    };
    let mut log = Log {
        machine: StateMachine::new(config.clone()),
        index: 0,
    };
    let Response::LeaseGranted { id, .. } = log.commit(
        0,
        Request::LeaseGrant {
            id: 0,
            ttl_ms: TTL_MS,
        },
    ) else {
        panic!("grant");
    };
    // Leader timeline: alive intervals separated by outages.
    let mut changes = Vec::new();
    let mut at = 0;
    for (lifetime, outage) in &schedule.outages {
        at += lifetime;
        changes.push((at, false));
        at += outage;
        changes.push((at, true));
    }
    let mut keeper = Some(LeaseKeeper::new(&config));
    if let Some(keeper) = keeper.as_mut() {
        keeper.sync(log.machine.leases());
    }
    let (mut last_ack_ms, mut last_promotion_ms, mut next_keepalive_ms) =
        (0, 0, schedule.keepalive_every_ms);
    let mut now_ms = 0;
    loop {
        now_ms += STEP_MS;
        assert!(now_ms < 200_000, "the lease was never expired");
        for (change_ms, up) in &changes {
            if *change_ms > now_ms - STEP_MS && *change_ms <= now_ms {
                if *up {
                    let mut promoted = LeaseKeeper::new(&config);
                    let anchors = promoted.promote(log.machine.leases(), now_ms);
                    log.checkpoint(now_ms, anchors);
                    keeper = Some(promoted);
                    last_promotion_ms = now_ms;
                } else {
                    keeper = None;
                }
            }
        }
        let Some(leader) = keeper.as_mut() else {
            continue;
        };
        if now_ms >= next_keepalive_ms && now_ms < schedule.abandon_at_ms {
            next_keepalive_ms = now_ms + schedule.keepalive_every_ms;
            if let Ok(renewal) = leader.renew(log.machine.leases(), id, now_ms) {
                // Answer only once the renewal record (if any) has committed.
                if record_renewals {
                    let record = renewal.checkpoint_before_reply.into_iter().collect();
                    log.checkpoint(now_ms, record);
                }
                last_ack_ms = now_ms;
            }
        }
        let expired = leader.expired(now_ms, 16);
        if !expired.is_empty() {
            log.commit(now_ms, Request::LeaseExpire { ids: expired });
            assert!(log.machine.lease(id).is_none());
            return (now_ms, last_ack_ms, last_promotion_ms);
        }
        leader.sync(log.machine.leases());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn lease_expiry_is_never_early_and_bounded_across_leader_changes(schedule in schedule()) {
        let (expired_ms, last_ack_ms, last_promotion_ms) = run(&schedule);
        prop_assert!(expired_ms >= last_ack_ms + TTL_MS, "early: expired {expired_ms}, acked {last_ack_ms}");
        let slack_ms = schedule.checkpoint_interval_ms.max(ELECTION_TIMEOUT_MS) + 2 * STEP_MS;
        let bound_ms = (last_ack_ms + TTL_MS + slack_ms).max(last_promotion_ms + ELECTION_TIMEOUT_MS + STEP_MS);
        prop_assert!(expired_ms <= bound_ms, "late: expired {expired_ms}, bound {bound_ms}");
    }
}

#[test]
fn a_stable_leader_expires_at_the_first_step_past_the_ttl() {
    let schedule = Schedule {
        outages: vec![],
        abandon_at_ms: 5000,
        keepalive_every_ms: 500,
        checkpoint_interval_ms: 1000,
    };
    let (expired_ms, last_ack_ms, _) = run(&schedule);
    // The TTL runs from the end of the millisecond the keepalive was read at (the clock's
    // resolution), so the leader ends the lease at its first look after that.
    assert_eq!(expired_ms, last_ack_ms + TTL_MS + STEP_MS);
}

/// Negative control: without the renewal record, a new leader expires the lease before the TTL
/// its holder was promised, and the property above catches it.
#[test]
fn skipping_the_renewal_record_is_caught() {
    let schedule = Schedule {
        outages: vec![(2600, 1000)],
        abandon_at_ms: 2600,
        keepalive_every_ms: 500,
        checkpoint_interval_ms: 1000,
    };
    let (expired_ms, last_ack_ms, _) = run(&schedule);
    assert!(expired_ms >= last_ack_ms + TTL_MS);
    let (expired_ms, last_ack_ms, _) = run_with(&schedule, false);
    assert!(
        expired_ms < last_ack_ms + TTL_MS,
        "expired {expired_ms}, acked {last_ack_ms}"
    );
}
