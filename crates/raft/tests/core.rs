//! Behaviour of the Raft core driven directly, message by message, with a tiny in-memory
//! network. Each test names the rule it checks; the simulator covers the same rules under
//! random faults.

mod common;

use std::collections::BTreeMap;

use bytes::Bytes;
use common::{Net, config, entry};
use conclave_raft::{
    ConfChangeStep, ConfState, Config, Entry, Error, HardState, MemStorage, Message, MessageBody,
    RawNode, ReadState, Role, SPARE_LAG_ENTRIES_MAX, Snapshot, SnapshotMeta, Storage, apply_steps,
};

#[test]
fn a_leader_is_elected_and_its_empty_entry_commits_everywhere() {
    let mut net = Net::new(3);
    net.tick_all(30);
    let leaders = net.leaders();
    assert_eq!(leaders.len(), 1, "exactly one leader, got {leaders:?}");
    let leader = leaders[0];
    let commit = net.node(leader).commit_index();
    for id in 1..=3 {
        assert_eq!(net.node(id).commit_index(), commit);
        assert_eq!(net.node(id).leader(), Some(leader));
    }
}

/// Raft §9.6 (PreVote): a node cut off from the cluster keeps timing out but does not raise
/// its term, so it does not depose the leader when it returns.
#[test]
fn prevote_keeps_a_rejoining_node_from_raising_the_term() {
    let mut net = Net::new(3);
    net.elect(1);
    let term = net.node(1).term();
    net.isolate(3);
    net.tick_all(100);
    assert_eq!(net.node(3).term(), term, "isolated node raised its term");
    net.heal();
    net.tick_all(30);
    assert_eq!(net.leaders(), vec![1]);
    assert_eq!(net.node(1).term(), term);
}

/// CheckQuorum: a leader that hears from no quorum for an election timeout steps down.
#[test]
fn check_quorum_makes_an_isolated_leader_step_down() {
    let mut net = Net::new(3);
    net.elect(1);
    net.isolate(1);
    for _ in 0..25 {
        net.node(1).tick();
        net.collect();
    }
    assert_eq!(net.node(1).role(), Role::Follower);
}

/// Raft §5.1: a node answers a stale leader's message with its own term, and the leader steps
/// down. Also with neither PreVote nor CheckQuorum, where a node whose term ran ahead would
/// otherwise wait to depose the leader by campaigning, which a node that is a learner in its
/// own configuration never does: it ignored its leader forever.
#[test]
fn a_stale_leader_learns_the_higher_term_from_the_answer_to_its_heartbeat() {
    fn plain(id: u64) -> Config {
        let mut config = config(id);
        config.pre_vote = false;
        config.check_quorum = false;
        config
    }
    let mut net = Net::with_config(3, plain);
    net.elect(1);
    let term = net.node(1).term();
    net.isolate(3);
    net.node(3).campaign().expect("the term can grow");
    net.node(3).campaign().expect("the term can grow");
    net.settle();
    let ahead = net.node(3).term();
    assert!(ahead > term);
    net.heal();
    // Only the leader ticks, so node 3 never campaigns: only its answers can tell node 1.
    for _ in 0..2 {
        net.node(1).tick();
        net.settle();
    }
    assert!(
        net.node(1).term() >= ahead,
        "the leader at term {} never learned term {ahead}",
        net.node(1).term()
    );
    assert_ne!(net.node(1).role(), Role::Leader);
}

/// For nodes started from stores past the bootstrap term, as after a restart: with CheckQuorum
/// they would withhold their votes for an election timeout (`lease_reads.rs` tests that), and
/// the tests that use this are about the log, not about when a vote may be granted.
fn restarted_config(id: u64) -> Config {
    let mut config = config(id);
    config.check_quorum = false;
    config
}

/// Raft §5.4.2 (Figure 8): an entry of an earlier term is not committed by counting replicas;
/// only an entry of the leader's own term commits it.
#[test]
fn entries_of_earlier_terms_commit_only_through_the_current_term() {
    let voters = ConfState::with_voters([1, 2, 3]);
    let mut stores = BTreeMap::new();
    for id in 1..=3 {
        let mut store = MemStorage::new_with_conf_state(voters.clone());
        let log: Vec<Entry> = if id == 3 { vec![] } else { vec![entry(2, 2)] };
        store.append(&log);
        store.set_hard_state(HardState {
            term: 3,
            vote: None,
            commit: 1,
        });
        stores.insert(id, store);
    }
    let mut net = Net::with_stores(stores, restarted_config);
    // Node 1 wins term 4 but its appends are held back.
    net.node(1).campaign().expect("the term can grow");
    net.settle_with(&mut |m| !matches!(m.body, MessageBody::Append { .. }));
    assert_eq!(net.node(1).role(), Role::Leader);
    let term = net.node(1).term();
    // Node 2 reports holding index 2 (term 2): a majority stores it, but it must not commit.
    let ack = Message {
        from: 2,
        to: 1,
        term,
        body: MessageBody::AppendResponse {
            index: 2,
            reject: false,
            hint_index: 0,
            hint_term: 0,
            awaited: false,
        },
    };
    net.node(1).step(ack).expect("ack accepted");
    net.collect();
    assert_eq!(
        net.node(1).commit_index(),
        1,
        "earlier-term entry committed by counting"
    );
    // Once the leader's own empty entry (index 3) reaches a majority, both commit.
    net.tick_all(5);
    assert_eq!(net.node(1).commit_index(), 3);
}

/// Conflict hints let the leader skip a whole term of divergent entries per round trip,
/// instead of backing up one index at a time.
#[test]
fn conflict_hints_repair_fifty_divergent_entries_in_few_round_trips() {
    let voters = ConfState::with_voters([1, 2, 3]);
    let mut stores = BTreeMap::new();
    for id in 1..=3 {
        let mut store = MemStorage::new_with_conf_state(voters.clone());
        let log: Vec<Entry> = match id {
            1 | 2 => (2..=51).map(|i| entry(i, 3)).collect(),
            _ => (2..=51).map(|i| entry(i, 2)).collect(),
        };
        store.append(&log);
        store.set_hard_state(HardState {
            term: 3,
            vote: None,
            commit: 1,
        });
        stores.insert(id, store);
    }
    let mut net = Net::with_stores(stores, restarted_config);
    net.elect(1);
    let rejections = net
        .sent
        .iter()
        .filter(|m| {
            m.from == 3 && matches!(m.body, MessageBody::AppendResponse { reject: true, .. })
        })
        .count();
    assert!(
        rejections <= 2,
        "{rejections} rejections to repair one divergent term"
    );
    let leader_last = net.node(1).last_index();
    assert_eq!(net.node(3).last_index(), leader_last);
    assert_eq!(net.node(3).commit_index(), net.node(1).commit_index());
}

/// In replicate mode the leader pipelines at most `max_inflight_appends` unanswered appends.
#[test]
fn pipelined_appends_stop_at_the_inflight_window() {
    fn small_window(id: u64) -> Config {
        let mut c = config(id);
        c.max_inflight_appends = 4;
        c
    }
    let mut net = Net::with_config(3, small_window);
    net.elect(1);
    net.cut.insert((2, 1));
    net.cut.insert((3, 1));
    let before = net.sent.len();
    for i in 0..20 {
        net.node(1)
            .propose(Bytes::from(format!("p{i}")))
            .expect("leader accepts");
        net.settle();
    }
    let appends_to_2 = net.sent[before..]
        .iter()
        .filter(|m| m.to == 2 && matches!(m.body, MessageBody::Append { .. }))
        .count();
    assert_eq!(appends_to_2, 4, "window of 4 not respected");
}

/// Proposals beyond the uncommitted-bytes budget are refused, not buffered.
#[test]
fn proposals_beyond_the_uncommitted_budget_are_refused() {
    fn small_budget(id: u64) -> Config {
        let mut c = config(id);
        c.max_uncommitted_bytes = 1000;
        c
    }
    let mut net = Net::with_config(3, small_budget);
    net.elect(1);
    net.isolate(1);
    let chunk = Bytes::from(vec![0u8; 300]);
    let mut accepted = 0;
    let refusal = loop {
        match net.node(1).propose(chunk.clone()) {
            Ok(_) => accepted += 1,
            Err(e) => break e,
        }
        assert!(accepted < 10, "budget never enforced");
    };
    assert!(
        matches!(refusal, Error::UncommittedLimit { limit: 1000, .. }),
        "{refusal:?}"
    );
    assert_eq!(accepted, 3);
    let huge = Bytes::from(vec![0u8; 2000]);
    assert!(matches!(
        net.node(1).propose(huge),
        Err(Error::ProposalTooLarge { .. })
    ));
}

/// ReadIndex: a new leader answers reads only after an entry of its term is committed and a
/// heartbeat round confirms it still leads; a follower's read goes through the leader.
#[test]
fn read_index_needs_a_quorum_round_and_works_from_followers() {
    let mut net = Net::new(3);
    net.elect(1);
    let commit = net.node(1).commit_index();
    net.node(1)
        .read_index(Bytes::from_static(b"r1"))
        .expect("leader read");
    net.node(2)
        .read_index(Bytes::from_static(b"r2"))
        .expect("follower read");
    net.settle();
    let on_leader = &net.read_states[&1];
    assert_eq!(
        on_leader,
        &vec![ReadState {
            index: commit,
            context: Bytes::from_static(b"r1")
        }]
    );
    let on_follower = &net.read_states[&2];
    assert_eq!(on_follower.len(), 1);
    assert!(on_follower[0].index >= commit);

    // Cut off from the others, the leader cannot confirm a read.
    net.isolate(1);
    net.node(1)
        .read_index(Bytes::from_static(b"r3"))
        .expect("queued");
    net.settle();
    assert_eq!(
        net.read_states[&1].len(),
        1,
        "an isolated leader served a read"
    );
}

/// A new leader holds reads until its own empty entry commits (its commit index may lag).
#[test]
fn read_index_on_a_new_leader_waits_for_its_first_commit() {
    let mut net = Net::new(3);
    net.node(1).campaign().expect("the term can grow");
    // Win the election but keep the empty entry from being acknowledged.
    net.settle_with(&mut |m| !matches!(m.body, MessageBody::AppendResponse { .. }));
    assert_eq!(net.node(1).role(), Role::Leader);
    net.node(1)
        .read_index(Bytes::from_static(b"early"))
        .expect("queued");
    net.settle_with(&mut |m| !matches!(m.body, MessageBody::AppendResponse { .. }));
    assert!(
        net.read_states.get(&1).is_none_or(|r| r.is_empty()),
        "read served before commit"
    );
    net.settle();
    net.tick_all(3);
    let commit = net.node(1).commit_index();
    let reads = &net.read_states[&1];
    assert_eq!(reads.len(), 1);
    assert_eq!(reads[0].index, commit);
}

/// Leadership transfer: the target is caught up, then campaigns at once and wins.
#[test]
fn leadership_transfer_hands_over_to_the_target() {
    let mut net = Net::new(3);
    net.elect(1);
    net.node(1)
        .propose(Bytes::from_static(b"before"))
        .expect("accepted");
    net.settle();
    net.node(1).transfer_leader(3).expect("transfer starts");
    net.settle();
    assert_eq!(net.leaders(), vec![3]);
    assert_eq!(net.node(1).role(), Role::Follower);
    assert!(matches!(
        net.node(1).transfer_leader(2),
        Err(Error::NotLeader { leader: Some(3) })
    ));
    assert!(matches!(
        net.node(3).transfer_leader(9),
        Err(Error::InvalidTransferTarget(9))
    ));
}

/// Joint consensus: adding a voter enters and then leaves the joint configuration by
/// itself; only one change may be pending; a removed leader steps down.
#[test]
fn membership_changes_run_through_joint_consensus() {
    let mut net = Net::new(3);
    net.nodes.insert(
        4,
        RawNode::new(config(4), MemStorage::default()).expect("valid"),
    );
    net.elect(1);
    net.node(1)
        .propose_conf_change(vec![ConfChangeStep::AddVoter(4)])
        .expect("accepted");
    assert!(matches!(
        net.node(1)
            .propose_conf_change(vec![ConfChangeStep::AddLearner(5)]),
        Err(Error::ConfChangeInProgress)
    ));
    net.tick_all(10);
    let conf = net.node(1).conf_state().clone();
    assert_eq!(conf.voters, [1, 2, 3, 4].into_iter().collect());
    assert!(
        !conf.is_joint(),
        "leader did not leave the joint configuration"
    );
    assert_eq!(
        net.node(4).conf_state(),
        &conf,
        "joining node did not learn the membership"
    );

    net.node(1)
        .propose_conf_change(vec![ConfChangeStep::RemoveNode(1)])
        .expect("accepted");
    net.tick_all(40);
    assert_ne!(
        net.node(1).role(),
        Role::Leader,
        "removed leader kept leading"
    );
    let leaders = net.leaders();
    assert_eq!(leaders.len(), 1);
    assert_ne!(leaders[0], 1);
    assert_eq!(
        net.node(leaders[0]).conf_state().voters,
        [2, 3, 4].into_iter().collect()
    );
}

#[test]
fn invalid_membership_changes_are_refused_with_a_reason() {
    let conf = ConfState::with_voters([1, 2]);
    assert!(apply_steps(&conf, &[]).is_err());
    assert!(apply_steps(&conf, &[ConfChangeStep::AddVoter(0)]).is_err());
    assert!(
        apply_steps(
            &conf,
            &[ConfChangeStep::RemoveNode(1), ConfChangeStep::RemoveNode(2)]
        )
        .is_err()
    );
    assert!(apply_steps(&conf, &[ConfChangeStep::AddLearner(1)]).is_err());
    let joint = apply_steps(&conf, &[ConfChangeStep::AddVoter(3)]).expect("valid");
    assert!(joint.is_joint());
    let learner_only = apply_steps(&conf, &[ConfChangeStep::AddLearner(3)]).expect("valid");
    assert!(
        !learner_only.is_joint(),
        "learner changes need no joint phase"
    );
}

/// A follower behind the leader's compacted log receives the snapshot in chunks.
#[test]
fn lagging_follower_receives_the_snapshot_in_chunks() {
    fn small_chunks(id: u64) -> Config {
        let mut c = config(id);
        c.snapshot_chunk_bytes = 10;
        c
    }
    let mut net = Net::with_config(3, small_chunks);
    net.elect(1);
    net.isolate(3);
    for i in 0..20 {
        net.node(1)
            .propose(Bytes::from(format!("p{i}")))
            .expect("accepted");
        net.settle();
    }
    let applied = net.node(1).applied_index();
    let conf = net.node(1).conf_state().clone();
    let data = Bytes::from(vec![9u8; 45]);
    net.node(1)
        .store_mut()
        .create_snapshot(applied, conf, data.clone());
    net.heal();
    let before = net.sent.len();
    net.tick_all(10);
    let chunks = net.sent[before..]
        .iter()
        .filter(|m| m.to == 3 && matches!(m.body, MessageBody::SnapshotChunk { .. }))
        .count();
    assert_eq!(chunks, 5, "45 bytes in chunks of 10");
    assert_eq!(net.node(3).store().snapshot().map(|s| s.data), Ok(data));
    assert_eq!(net.node(3).applied_index(), net.node(1).applied_index());
}

/// Ready contract: a candidate's vote for itself arrives in the same Ready as its vote
/// requests, marked for fsync, so it is durable before anyone hears of the election.
#[test]
fn a_candidate_persists_its_vote_before_asking_for_votes() {
    fn no_prevote(id: u64) -> Config {
        let mut c = config(id);
        c.pre_vote = false;
        c
    }
    let mut net = Net::with_config(3, no_prevote);
    net.node(1).campaign().expect("the term can grow");
    let ready = net.node(1).ready();
    let hard_state = ready.hard_state.expect("hard state changed");
    assert_eq!(hard_state.vote, Some(1));
    assert!(ready.must_sync);
    assert!(
        ready
            .messages
            .iter()
            .all(|m| matches!(m.body, MessageBody::Vote { pre: false, .. }))
    );
    assert_eq!(ready.messages.len(), 2);
    net.node(1).advance(ready);
}

/// A restarted node comes back with exactly what it persisted.
#[test]
fn a_node_restarted_from_its_storage_resumes_term_vote_and_log() {
    let mut net = Net::new(3);
    net.elect(1);
    for i in 0..5 {
        net.node(1)
            .propose(Bytes::from(format!("p{i}")))
            .expect("accepted");
    }
    net.settle();
    let store = net.node(2).store().clone();
    let hard_state = store.hard_state();
    let restarted = RawNode::new(config(2), store).expect("restart");
    assert_eq!(restarted.term(), hard_state.term);
    assert_eq!(restarted.hard_state().vote, hard_state.vote);
    assert_eq!(restarted.last_index(), net.node(2).last_index());
    let snapshot = Snapshot {
        meta: SnapshotMeta::default(),
        data: Bytes::new(),
    };
    assert!(snapshot.is_empty());
}

/// A node started over another cluster's data can answer about entries the leader never had.
/// The leader refuses that answer with a reason instead of trusting it (and then failing to
/// read its own log past the end), and goes on replicating to everyone else.
#[test]
fn an_append_response_past_the_leaders_log_is_refused_not_trusted() {
    let mut net = Net::new(3);
    net.elect(1);
    let last = net.node(1).last_index();
    let term = net.node(1).term();
    for reject in [false, true] {
        let answer = net.node(1).step(Message {
            from: 2,
            to: 1,
            term,
            body: MessageBody::AppendResponse {
                index: last + 5,
                reject,
                hint_index: last + 5,
                hint_term: 0,
                awaited: false,
            },
        });
        assert_eq!(
            answer,
            Err(Error::AppendResponseBeyondLog {
                from: 2,
                index: last + 5,
                last_index: last,
            })
        );
    }
    let index = net
        .node(1)
        .propose(Bytes::from_static(b"after"))
        .expect("still the leader");
    net.settle();
    for id in 1..=3 {
        assert!(
            net.node(id).commit_index() >= index,
            "node {id} did not commit the entry proposed after the bogus answer"
        );
    }
}

/// A follower whose disk dropped the end of its log (a damaged tail, or `conclave repair`)
/// no longer has entries it acknowledged. The leader must send them again, without waiting
/// for a new leader, rather than probe forever at the index it believes the follower holds.
#[test]
fn a_follower_that_lost_acknowledged_entries_gets_them_again_from_the_same_leader() {
    let mut net = Net::new(3);
    net.elect(1);
    for i in 0..6 {
        net.node(1)
            .propose(Bytes::from(format!("e{i}")))
            .expect("accepted");
        net.settle();
    }
    let last = net.node(1).last_index();
    assert_eq!(net.node(3).last_index(), last);

    // Node 3 restarts with its last three entries gone.
    let kept = last - 3;
    let old = net.node(3).store().clone();
    let mut store = MemStorage::new_with_conf_state(ConfState::with_voters([1, 2, 3]));
    let first = old.first_index().expect("first index");
    store.append(&old.entries(first, kept + 1, u64::MAX).expect("entries"));
    let mut hard_state = old.hard_state();
    hard_state.commit = hard_state.commit.min(kept);
    store.set_hard_state(hard_state);
    net.nodes
        .insert(3, RawNode::new(config(3), store).expect("valid config"));
    assert_eq!(net.node(3).last_index(), kept);

    let term = net.node(1).term();
    net.node(1)
        .propose(Bytes::from_static(b"after"))
        .expect("accepted");
    net.settle();
    net.tick_all(10);
    assert_eq!(net.leaders(), vec![1], "the same leader");
    assert_eq!(net.node(1).term(), term, "no new term was needed");
    assert_eq!(net.node(3).last_index(), net.node(1).last_index());
    assert_eq!(
        net.node(3).store().term(kept + 1),
        net.node(1).store().term(kept + 1)
    );
}

/// The core says why its leader changed, for the shell's log line (it logs nothing itself):
/// the winner of an election names the voters, a transfer and a check-quorum step-down are
/// told apart.
#[test]
fn leader_change_reasons_tell_elections_transfers_and_step_downs_apart() {
    use conclave_raft::LeaderChangeReason;
    let mut net = Net::new(3);
    net.elect(1);
    let (reason, votes) = net.node(1).leader_change();
    assert_eq!(reason, LeaderChangeReason::ElectionTimeout);
    assert!(
        votes.contains(&1) && votes.len() >= 2,
        "a quorum voted: {votes:?}"
    );
    for id in 2..=3 {
        let (reason, _) = net.node(id).leader_change();
        assert!(
            matches!(
                reason,
                LeaderChangeReason::ElectionTimeout | LeaderChangeReason::LeaderHeard
            ),
            "follower {id}: {reason:?}"
        );
    }

    net.node(1).transfer_leader(2).expect("2 is a voter");
    net.settle();
    assert_eq!(net.leaders(), vec![2]);
    let (reason, votes) = net.node(2).leader_change();
    assert_eq!(reason, LeaderChangeReason::Transfer);
    assert!(votes.contains(&2), "{votes:?}");

    net.isolate(2);
    for _ in 0..25 {
        net.node(2).tick();
        net.collect();
    }
    assert_eq!(net.node(2).role(), Role::Follower);
    assert_eq!(
        net.node(2).leader_change().0,
        LeaderChangeReason::CheckQuorum
    );
    assert_eq!(
        LeaderChangeReason::CheckQuorum.as_str(),
        "check-quorum step-down"
    );
}

/// A leader that records newer snapshots faster than it can send one still finishes the
/// transfer it began; the follower then catches up (from the log, or from the newest snapshot
/// once, since this storage compacts right up to each snapshot) instead of restarting forever.
#[test]
fn a_snapshot_transfer_finishes_while_the_leader_keeps_snapshotting() {
    fn small_chunks(id: u64) -> Config {
        let mut c = config(id);
        c.snapshot_chunk_bytes = 10;
        c
    }
    /// Rounds of message delivery the transfer gets; without holding the image it never ends.
    const DELIVERY_ROUNDS_MAX: usize = 400;
    /// The leader records a newer snapshot every this many chunks (a transfer is 5 chunks).
    const CHUNKS_PER_SNAPSHOT: usize = 2;
    let mut net = Net::with_config(3, small_chunks);
    net.elect(1);
    net.isolate(3);
    for i in 0..20 {
        net.node(1)
            .propose(Bytes::from(format!("p{i}")))
            .expect("accepted");
        net.settle();
    }
    let first_index = net.node(1).applied_index();
    let conf = net.node(1).conf_state().clone();
    net.node(1)
        .store_mut()
        .create_snapshot(first_index, conf.clone(), Bytes::from(vec![1u8; 45]));
    net.heal();

    let mut snapshots_taken = 1u8;
    let mut chunks_since_snapshot = 0;
    let mut installed_first = None;
    for round in 0..DELIVERY_ROUNDS_MAX {
        if round % 3 == 0 {
            for node in net.nodes.values_mut() {
                node.tick();
            }
        }
        net.node(1)
            .propose(Bytes::from(format!("r{round}")))
            .expect("accepted");
        for m in net.collect() {
            if m.to == 3 && matches!(m.body, MessageBody::SnapshotChunk { .. }) {
                chunks_since_snapshot += 1;
            }
            if let Some(node) = net.nodes.get_mut(&m.to) {
                let _ = node.step(m);
            }
        }
        let installed = net.node(3).store().snapshot().map(|s| s.meta.index);
        if let Ok(index) = installed
            && index > 1
        {
            installed_first = Some(index);
            break;
        }
        let applied = net.node(1).applied_index();
        let stored = net.node(1).store().first_index().expect("first index") - 1;
        if chunks_since_snapshot >= CHUNKS_PER_SNAPSHOT && applied > stored {
            snapshots_taken = snapshots_taken.wrapping_add(1);
            let data = Bytes::from(vec![snapshots_taken; 45]);
            net.node(1)
                .store_mut()
                .create_snapshot(applied, conf.clone(), data);
            chunks_since_snapshot = 0;
        }
    }
    assert_eq!(
        installed_first,
        Some(first_index),
        "the follower never installed the snapshot whose transfer began, within \
         {DELIVERY_ROUNDS_MAX} rounds ({snapshots_taken} snapshots taken)"
    );
    assert!(
        snapshots_taken >= 3,
        "the leader took {snapshots_taken} snapshots: the transfer was never overtaken"
    );
    net.tick_all(20);
    let leader_applied = net.node(1).applied_index();
    assert_eq!(net.node(3).applied_index(), leader_applied);
    assert_eq!(net.node(3).last_index(), net.node(1).last_index());
}

/// With three voters and nothing in flight, a commit takes eight messages: an append and its
/// acknowledgement per follower, then the commit index and its acknowledgement per follower.
/// The second follower's acknowledgement must not draw one more empty append: the commit
/// broadcast already told it everything (that echo used to cost two messages per commit).
/// Every follower still learns each commit without waiting for a heartbeat.
#[test]
fn a_commit_with_three_voters_takes_eight_messages_and_reaches_every_follower() {
    let mut net = Net::new(3);
    net.elect(1);
    net.settle();
    for round in 0..10 {
        let index = net
            .node(1)
            .propose(Bytes::from(format!("put {round}")))
            .expect("the leader takes proposals");
        let mut messages = 0;
        net.settle_with(&mut |_| {
            messages += 1;
            true
        });
        assert!(
            messages <= 8,
            "round {round}: one commit took {messages} messages"
        );
        for id in 1..=3 {
            assert_eq!(
                net.node(id).commit_index(),
                index,
                "round {round}: node {id} does not know entry {index} is committed"
            );
        }
    }
}

/// The quorum-first settings: new entries to a quorum first, commit notices deferred. Heartbeats
/// every 5 ticks, so that what the tests below see within a tick or two is not a heartbeat.
fn quorum_first_config(id: u64) -> Config {
    let mut config = config(id);
    config.heartbeat_ticks = 5;
    config.replicate_to_quorum_first = true;
    config.defer_commit_notice = true;
    config
}

/// With the quorum-first settings and three voters, a commit takes two messages: the entry to
/// the follower the quorum counts on (the lowest id among equals) and its acknowledgement.
/// The spare gets committed entries in batches of `SPARE_LAG_ENTRIES_MAX`, the first follower
/// the commit index with the next entry; the leader's next tick sends both what they lack.
#[test]
fn with_quorum_first_a_commit_takes_two_messages_and_every_follower_learns_it() {
    let mut net = Net::with_config(3, quorum_first_config);
    net.elect(1);
    net.settle();
    let mut batches_to_spare = Vec::new();
    for round in 0..2 * SPARE_LAG_ENTRIES_MAX + 5 {
        let index = net
            .node(1)
            .propose(Bytes::from(format!("put {round}")))
            .expect("the leader takes proposals");
        let first = net.collect();
        assert!(
            first.len() == 1 && first[0].to == 2,
            "round {round}: a new entry goes to one follower first, not {first:?}"
        );
        for m in first {
            net.node(m.to).step(m).expect("a valid append");
        }
        let mut messages = 1;
        net.settle_with(&mut |m| {
            messages += 1;
            if let (3, MessageBody::Append { entries, .. }) = (m.to, &m.body) {
                batches_to_spare.push(entries.len() as u64);
            }
            true
        });
        assert!(
            messages == 2 || messages == 4,
            "round {round}: one commit took {messages} messages"
        );
        assert_eq!(net.node(1).commit_index(), index, "round {round}");
        if round > 0 {
            // The previous round's commit index came with this round's entry.
            assert_eq!(net.node(2).commit_index(), index - 1, "round {round}");
        }
        assert!(
            index - net.node(3).commit_index() < SPARE_LAG_ENTRIES_MAX + 2,
            "round {round}: the spare lags by more than a batch"
        );
    }
    assert_eq!(batches_to_spare.len(), 2, "{batches_to_spare:?}");
    assert!(batches_to_spare.iter().all(|&n| n >= SPARE_LAG_ENTRIES_MAX));
    let last = net.node(1).commit_index();
    net.node(1).tick();
    net.settle();
    for id in [2, 3] {
        assert_eq!(net.node(id).commit_index(), last, "node {id} after a tick");
    }
}

/// The follower a quorum-first broadcast counts on goes silent: within two ticks of the
/// leader the spare gets the entry too, it commits, and the next entries go to the spare
/// first, so they commit without waiting for a tick.
#[test]
fn when_the_follower_counted_on_is_silent_the_spare_gets_the_entry_within_two_ticks() {
    let mut net = Net::with_config(3, quorum_first_config);
    net.elect(1);
    net.settle();
    // A tick sends the commit index the followers are owed, so that from here on only the
    // stall can send the spare anything.
    net.node(1).tick();
    net.settle();
    net.isolate(2);
    let index = net.node(1).propose(Bytes::from("stalled")).expect("leader");
    net.settle();
    assert!(
        net.node(1).commit_index() < index,
        "only the silent follower had the entry"
    );
    for _ in 0..2 {
        net.node(1).tick();
        net.settle();
    }
    assert_eq!(
        net.node(1).commit_index(),
        index,
        "the spare's copy commits it"
    );
    let next = net.node(1).propose(Bytes::from("next")).expect("leader");
    net.settle();
    assert_eq!(
        net.node(1).commit_index(),
        next,
        "new entries go to the answering follower"
    );
}

/// A write a follower handed to the leader: that follower gets the entry with the quorum's
/// (its sync overlaps theirs) and hears of the commit at once, even when it is the spare
/// and the commit notice would otherwise wait.
#[test]
fn a_follower_waiting_for_a_write_hears_of_its_commit_at_once() {
    let mut net = Net::with_config(3, quorum_first_config);
    net.elect(1);
    net.settle();
    for (waiting, round) in [(3, 0), (2, 1), (3, 2)] {
        let index = net
            .node(1)
            .propose(Bytes::from(format!("through {waiting}")))
            .expect("leader");
        net.node(1).hasten_commit_notice(waiting, index);
        let first = net.collect();
        assert!(
            first.iter().any(|m| m.to == waiting),
            "round {round}: member {waiting}, whose client waits, gets the entry at once: {first:?}"
        );
        for m in first {
            net.node(m.to).step(m).expect("a valid append");
        }
        net.settle();
        assert_eq!(net.node(1).commit_index(), index, "round {round}");
        assert_eq!(
            net.node(waiting).commit_index(),
            index,
            "round {round}: member {waiting}, whose client waits, knows the commit"
        );
    }
}

/// Proposes one entry on leader 1 and delivers the messages that go out at once; returns the
/// entry's index and who they went to.
fn propose_and_deliver_first(net: &mut Net, data: String) -> (u64, Vec<u64>) {
    let index = net
        .node(1)
        .propose(Bytes::from(data))
        .expect("the leader takes proposals");
    let first = net.collect();
    let recipients = first.iter().map(|m| m.to).collect();
    for m in first {
        net.node(m.to).step(m).expect("a valid append");
    }
    (index, recipients)
}

/// A follower whose clients wait for what it applies (it says so in its responses) is never
/// held back: it gets each new entry with the quorum and hears of each commit at once. With
/// both followers awaited nothing is held back at all; once neither is, one is spare again.
#[test]
fn an_awaited_follower_gets_every_entry_and_commit_at_once() {
    let mut net = Net::with_config(3, quorum_first_config);
    net.elect(1);
    net.settle();
    // The followers' flags reach the leader with their answers to its next heartbeat.
    let heartbeat = |net: &mut Net| {
        for _ in 0..5 {
            net.node(1).tick();
            net.settle();
        }
    };
    let cases: [(&[u64], &[u64]); 4] =
        [(&[3], &[3]), (&[2], &[2]), (&[2, 3], &[2, 3]), (&[], &[2])];
    for (awaited, first_to) in cases {
        for id in [2, 3] {
            net.node(id).set_awaited(awaited.contains(&id));
        }
        heartbeat(&mut net);
        for round in 0..SPARE_LAG_ENTRIES_MAX + 3 {
            let (index, recipients) =
                propose_and_deliver_first(&mut net, format!("{awaited:?} {round}"));
            net.settle();
            assert_eq!(net.node(1).commit_index(), index);
            if round == 0 {
                // The first entry after a change may also carry what a new spare was owed.
                continue;
            }
            assert_eq!(
                recipients, first_to,
                "awaited {awaited:?}, round {round}: the entry goes at once to these"
            );
            for &id in awaited {
                assert_eq!(
                    net.node(id).commit_index(),
                    index,
                    "awaited {awaited:?}, round {round}: member {id} hears of the commit at once"
                );
            }
        }
    }
}
