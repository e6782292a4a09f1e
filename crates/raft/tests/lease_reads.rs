//! Lease reads (`Config::lease_read_ms`): a leader answers a read with no heartbeat round
//! while a quorum acknowledged one of its lease rounds recently, and every node withholds its
//! vote long enough that no other leader can be elected meanwhile. The simulator checks the
//! same reads under random faults (`crates/sim`, lease-read seeds and their negative control).

mod common;

use bytes::Bytes;
use common::Net;
use conclave_raft::{
    BOOTSTRAP_TERM, ConfState, Config, Error, HardState, MemStorage, MessageBody, RawNode, Role,
};

/// Milliseconds per tick in these tests.
const TICK_MS: u64 = 10;
/// Election timeout 10 ticks (100 ms); the lease is shorter than the 9 ticks a voter must
/// wait at the least.
const LEASE_MS: u64 = 70;

fn lease_config(id: u64) -> Config {
    let mut config = common::config(id);
    config.lease_read_ms = LEASE_MS;
    config
}

/// A network with a clock: every tick moves every node's clock by [`TICK_MS`].
struct Clocked {
    net: Net,
    now_ms: u64,
}

impl Clocked {
    fn new(size: u64) -> Clocked {
        Clocked {
            net: Net::with_config(size, lease_config),
            now_ms: 1_000,
        }
    }

    fn set_clocks(&mut self) {
        for node in self.net.nodes.values_mut() {
            node.set_now_ms(self.now_ms);
        }
    }

    fn tick(&mut self, ticks: u64) {
        for _ in 0..ticks {
            self.now_ms += TICK_MS;
            self.set_clocks();
            for node in self.net.nodes.values_mut() {
                node.tick();
            }
            self.net.settle();
        }
    }

    /// Ticks until a leader is elected, then a few heartbeat rounds more.
    fn elect_someone(&mut self) -> u64 {
        for _ in 0..100 {
            self.tick(1);
            if let [leader] = self.net.leaders()[..] {
                self.tick(4);
                assert_eq!(self.net.leaders(), vec![leader]);
                return leader;
            }
        }
        panic!("no leader elected");
    }

    /// Asks `node` for a read and hands out its Ready without delivering any message:
    /// whether the read comes back now is whether it was answered from the lease.
    fn read_answered_at_once(&mut self, node: u64, context: &'static [u8]) -> bool {
        self.set_clocks();
        self.net
            .node(node)
            .read_index(Bytes::from_static(context))
            .expect("read accepted");
        self.net.collect();
        self.net
            .read_states
            .get(&node)
            .is_some_and(|reads| reads.iter().any(|r| r.context == context))
    }
}

#[test]
fn a_leader_answers_reads_from_its_lease_and_not_once_it_ran_out() {
    let mut c = Clocked::new(3);
    let leader = c.elect_someone();
    let commit = c.net.node(leader).commit_index();
    // Even cut off from everyone, a leader whose lease holds answers at once.
    c.net.isolate(leader);
    assert!(c.read_answered_at_once(leader, b"in-lease"));
    let read = &c.net.read_states[&leader][0];
    assert_eq!(read.index, commit);
    // Time passes with no acknowledgement (no tick, so check-quorum has not stepped it down
    // yet): the lease runs out and a read waits for a heartbeat round it cannot complete.
    c.now_ms += LEASE_MS;
    assert_eq!(c.net.node(leader).role(), Role::Leader);
    assert!(!c.read_answered_at_once(leader, b"lease-over"));
    c.net.settle();
    assert!(
        !c.net.read_states[&leader]
            .iter()
            .any(|r| r.context == b"lease-over"[..]),
        "an isolated leader past its lease served a read"
    );
}

#[test]
fn heartbeat_rounds_keep_the_lease_alive() {
    let mut c = Clocked::new(3);
    let leader = c.elect_someone();
    for round in 0..20 {
        c.tick(3);
        let context: &'static [u8] = Box::leak(format!("r{round}").into_bytes().into_boxed_slice());
        assert!(
            c.read_answered_at_once(leader, context),
            "read {round} waited although the lease should hold"
        );
    }
    // The same cluster without lease reads: a read always waits for its round.
    let mut net = Net::new(3);
    net.elect(1);
    net.node(1)
        .read_index(Bytes::from_static(b"plain"))
        .expect("read accepted");
    net.collect();
    assert!(net.read_states.get(&1).is_none_or(|r| r.is_empty()));
}

#[test]
fn a_leader_that_began_a_transfer_no_longer_reads_from_its_lease() {
    let mut c = Clocked::new(3);
    let leader = c.elect_someone();
    let target = if leader == 1 { 2 } else { 1 };
    // Keep the transfer from finishing, so this node stays leader.
    c.net.isolate(leader);
    c.net
        .node(leader)
        .transfer_leader(target)
        .expect("transfer starts");
    assert!(!c.read_answered_at_once(leader, b"during-transfer"));
    // Abandoned after an election timeout, the transfer still leaves the lease void for the
    // term: its TimeoutNow may yet arrive, and voters grant a transfer's campaign at once.
    c.net.heal();
    c.tick(12);
    if c.net.node(leader).role() == Role::Leader {
        assert!(!c.read_answered_at_once(leader, b"after-transfer"));
    }
}

#[test]
fn a_node_that_just_started_withholds_its_vote_for_an_election_timeout() {
    let voters = ConfState::with_voters(vec![1, 2, 3]);
    // Stores that were in term 2 before the restart: past the bootstrap term, so the node
    // may have acknowledged a leader.
    let restarted_store = || {
        let mut store = MemStorage::new_with_conf_state(voters.clone());
        store.set_hard_state(HardState {
            term: BOOTSTRAP_TERM + 1,
            vote: None,
            commit: 1,
        });
        store
    };
    let mut candidate = RawNode::new(lease_config(1), restarted_store()).expect("valid config");
    let mut voter = RawNode::new(lease_config(2), restarted_store()).expect("valid config");
    // The candidate's timer is its own business: force its campaign (PreVote first).
    candidate.campaign().expect("the term can grow");
    let requests: Vec<_> = candidate
        .ready()
        .messages
        .into_iter()
        .filter(|m| m.to == 2)
        .collect();
    assert!(
        requests
            .iter()
            .any(|m| matches!(m.body, MessageBody::Vote { pre: true, .. }))
    );
    let answers_to = |voter: &mut RawNode<MemStorage>| {
        for m in &requests {
            voter.step(m.clone()).expect("accepted");
        }
        if !voter.has_ready() {
            return Vec::new();
        }
        let ready = voter.ready();
        let answers: Vec<_> = ready
            .messages
            .iter()
            .filter(|m| matches!(m.body, MessageBody::VoteResponse { .. }))
            .cloned()
            .collect();
        voter.advance(ready);
        answers
    };
    assert!(
        answers_to(&mut voter).is_empty(),
        "a node that just started answered a vote request"
    );
    for _ in 0..lease_config(2).election_ticks - 1 {
        voter.tick();
    }
    assert!(answers_to(&mut voter).is_empty());
    voter.tick();
    let answers = answers_to(&mut voter);
    assert!(
        answers
            .iter()
            .any(|m| matches!(m.body, MessageBody::VoteResponse { granted: true, .. })),
        "an election timeout after starting, the vote is granted: {answers:?}"
    );
    // A node without lease reads of its own withholds its vote just the same: before a
    // restart with other flags it may have acknowledged a leader's lease.
    let mut without_lease =
        RawNode::new(common::config(2), restarted_store()).expect("valid config");
    assert!(answers_to(&mut without_lease).is_empty());
    // Without CheckQuorum there are no leases to respect: it votes at once.
    let mut unchecked = common::config(2);
    unchecked.check_quorum = false;
    let mut unchecked = RawNode::new(unchecked, restarted_store()).expect("valid config");
    assert!(!answers_to(&mut unchecked).is_empty());
    // A node of a new cluster, still in the bootstrap term, never acknowledged anyone: the
    // first election need not wait.
    let mut fresh = RawNode::new(lease_config(2), MemStorage::new_with_conf_state(voters))
        .expect("valid config");
    assert!(!answers_to(&mut fresh).is_empty());
}

#[test]
fn read_contexts_shaped_like_lease_rounds_are_refused() {
    let mut c = Clocked::new(3);
    let leader = c.elect_someone();
    let mut context = vec![0xff, b'L'];
    context.extend_from_slice(&7u64.to_be_bytes());
    assert!(matches!(
        c.net.node(leader).read_index(Bytes::from(context)),
        Err(Error::ReservedReadContext)
    ));
}

#[test]
fn lease_reads_need_check_quorum() {
    let mut config = lease_config(1);
    config.check_quorum = false;
    assert!(config.validate().is_err());
}
