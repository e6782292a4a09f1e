//! What the core refuses from a peer. Each test sends one forged message that a node must not
//! trust and checks three things: `step` returns `Error::RefusedMessage` with the reason, the
//! node's state (term, vote, role, log, commit) is as before, and the node goes on working.
//! Each guard was removed once to see its test fail.

mod common;

use std::collections::BTreeMap;

use bytes::Bytes;
use common::{Net, config, entry};
use conclave_raft::{
    ConfState, Config, Entry, Error, HardState, MAX_INDEX, MAX_TERM, MemStorage, Message,
    MessageBody, RawNode, Refusal, Role, SnapshotMeta, Storage,
};

/// Everything a refused message must leave untouched.
#[derive(Debug, PartialEq, Eq)]
struct Observed {
    hard_state: HardState,
    role: Role,
    leader: Option<u64>,
    last_index: u64,
    last_term: u64,
}

fn observe(node: &RawNode<MemStorage>) -> Observed {
    let last_index = node.last_index();
    Observed {
        hard_state: node.hard_state(),
        role: node.role(),
        leader: node.leader(),
        last_index,
        last_term: node.store().term(last_index).unwrap_or(0),
    }
}

/// Steps `message` into node `to`, expects it refused for `reason`, and checks that the node
/// changed nothing and has nothing new to persist.
fn assert_refused(net: &mut Net, message: Message, reason: Refusal) {
    let to = message.to;
    let from = message.from;
    let kind = message.body.name();
    let before = observe(net.node(to));
    let answer = net.node(to).step(message);
    assert_eq!(
        answer,
        Err(Error::RefusedMessage { from, kind, reason }),
        "node {to} did not refuse the {kind} from {from}"
    );
    let node = net.node(to);
    assert_eq!(observe(node), before, "a refused {kind} changed node {to}");
    if node.has_ready() {
        let ready = node.ready();
        assert!(ready.hard_state.is_none() && ready.entries.is_empty());
        assert!(ready.snapshot.is_none() && ready.committed_entries.is_empty());
        node.advance(ready);
    }
}

/// The cluster still commits a proposal everywhere after whatever the test sent.
fn assert_still_commits(net: &mut Net, ids: &[u64]) {
    net.settle();
    let leader = net.leaders()[0];
    let index = net
        .node(leader)
        .propose(Bytes::from_static(b"after"))
        .expect("still a leader");
    net.settle();
    for &id in ids {
        assert!(
            net.node(id).commit_index() >= index,
            "node {id} did not commit the entry proposed after the forged message"
        );
    }
}

fn msg(from: u64, to: u64, term: u64, body: MessageBody) -> Message {
    Message {
        from,
        to,
        term,
        body,
    }
}

fn append(prev_index: u64, prev_term: u64, entries: Vec<Entry>, commit: u64) -> MessageBody {
    MessageBody::Append {
        prev_index,
        prev_term,
        entries,
        commit,
    }
}

fn voters(ids: &[u64]) -> ConfState {
    ConfState::with_voters(ids.iter().copied())
}

/// The issue's first reproduction: in a cluster of one, "node 2" sent an Append at a higher
/// term and its entry was committed and applied.
#[test]
fn a_non_member_append_is_refused_in_a_single_member_cluster() {
    let mut net = Net::new(1);
    net.elect(1);
    let last = net.node(1).last_index();
    let term = net.node(1).term();
    let forged = append(last, term, vec![entry(last + 1, term + 1)], last + 1);
    assert_refused(&mut net, msg(2, 1, term + 1, forged), Refusal::NotAMember);
    assert_eq!(net.node(1).role(), Role::Leader);
    assert_still_commits(&mut net, &[1]);
}

/// Heartbeats, snapshot chunks, answers and read requests from a stranger are refused too.
#[test]
fn every_kind_of_message_from_a_non_member_is_refused() {
    let mut net = Net::new(3);
    net.elect(1);
    let term = net.node(1).term();
    let last = net.node(1).last_index();
    let to_follower = [
        MessageBody::Heartbeat {
            commit: last,
            context: None,
        },
        MessageBody::SnapshotChunk {
            meta: SnapshotMeta {
                index: last + 10,
                term,
                conf_state: voters(&[1, 2, 3, 9]),
            },
            offset: 0,
            data: Bytes::from_static(b"x"),
            done: true,
            image_crc32c: crc32c::crc32c(b"x"),
        },
        MessageBody::TimeoutNow,
        MessageBody::ReadIndexResponse {
            context: Bytes::from_static(b"r"),
            index: last,
        },
    ];
    // A leader's messages at the term the follower is in, where it follows member 1: a
    // second leader of one term cannot be honest. (At a later term a stranger is followed
    // as Raft asks: see `a_voter_whose_configuration_predates_its_leader_follows_it`.)
    let (leaders, others): (Vec<_>, Vec<_>) = to_follower.into_iter().partition(|body| {
        matches!(
            body,
            MessageBody::Heartbeat { .. } | MessageBody::SnapshotChunk { .. }
        )
    });
    let follower_term = net.node(2).term();
    for body in leaders {
        assert_refused(
            &mut net,
            msg(9, 2, follower_term, body),
            Refusal::NotTheLeader,
        );
    }
    for body in others {
        assert_refused(&mut net, msg(9, 2, term + 1, body), Refusal::NotAMember);
    }
    let to_leader = [
        MessageBody::AppendResponse {
            index: last,
            reject: false,
            hint_index: 0,
            hint_term: 0,
            awaited: false,
        },
        MessageBody::HeartbeatResponse {
            context: None,
            awaited: false,
        },
        MessageBody::SnapshotResponse {
            snapshot_index: last,
            next_offset: 0,
            installed: true,
            reject: false,
        },
        MessageBody::ReadIndexRequest {
            context: Bytes::from_static(b"r"),
        },
    ];
    for body in to_leader {
        assert_refused(&mut net, msg(9, 1, term, body), Refusal::NotAMember);
    }
    assert_still_commits(&mut net, &[1, 2, 3]);
}

/// A learner replicates but never elects: its vote requests and its votes are refused, even
/// at a higher term (which would otherwise depose the leader).
#[test]
fn votes_and_vote_requests_from_a_learner_are_refused() {
    let conf = ConfState {
        voters: [1, 2, 3].into_iter().collect(),
        learners: [4].into_iter().collect(),
        voters_outgoing: Default::default(),
    };
    let stores: BTreeMap<u64, MemStorage> = (1..=4)
        .map(|id| (id, MemStorage::new_with_conf_state(conf.clone())))
        .collect();
    let mut net = Net::with_stores(stores, config);
    net.elect(1);
    let term = net.node(1).term();
    let last = net.node(1).last_index();
    for pre in [true, false] {
        let vote = MessageBody::Vote {
            pre,
            last_index: last + 100,
            last_term: term,
            transfer: true,
        };
        assert_refused(&mut net, msg(4, 2, term + 1, vote), Refusal::NotAVoter);
        let granted = MessageBody::VoteResponse { pre, granted: true };
        assert_refused(&mut net, msg(4, 1, term, granted), Refusal::NotAVoter);
    }
    assert_still_commits(&mut net, &[1, 2, 3, 4]);
}

/// A message claiming to come from the receiver itself, from the reserved id 0, or addressed
/// to another node is refused.
#[test]
fn forged_sender_and_recipient_ids_are_refused() {
    let mut net = Net::new(3);
    net.elect(1);
    let term = net.node(1).term();
    let heartbeat = || MessageBody::Heartbeat {
        commit: 0,
        context: None,
    };
    assert_refused(
        &mut net,
        msg(2, 2, term + 1, heartbeat()),
        Refusal::InvalidSender,
    );
    assert_refused(
        &mut net,
        msg(0, 2, term + 1, heartbeat()),
        Refusal::InvalidSender,
    );
    let before = observe(net.node(2));
    assert_eq!(
        net.node(2).step(msg(1, 3, term + 1, heartbeat())),
        Err(Error::RefusedMessage {
            from: 1,
            kind: "Heartbeat",
            reason: Refusal::WrongRecipient { to: 3 },
        })
    );
    assert_eq!(observe(net.node(2)), before);
    assert_still_commits(&mut net, &[1, 2, 3]);
}

/// Only the leader a node follows may order it to campaign or hand it a read index.
#[test]
fn timeout_now_and_read_answers_from_a_member_that_does_not_lead_are_refused() {
    let mut net = Net::new(3);
    net.elect(1);
    let term = net.node(1).term();
    assert_refused(
        &mut net,
        msg(3, 2, term, MessageBody::TimeoutNow),
        Refusal::NotTheLeader,
    );
    let read = MessageBody::ReadIndexResponse {
        context: Bytes::from_static(b"r"),
        index: 1,
    };
    assert_refused(&mut net, msg(3, 2, term, read), Refusal::NotTheLeader);
    assert_still_commits(&mut net, &[1, 2, 3]);
}

/// The issue's forged Heartbeat with term = u64::MAX panicked on `term + 1`, and the term,
/// once persisted, panicked every restart. It is refused now, and so is anything past
/// MAX_TERM, even from a member.
#[test]
fn a_term_past_the_limit_is_refused_even_from_a_member() {
    let mut net = Net::new(3);
    net.elect(1);
    for term in [u64::MAX, u64::MAX - 1, MAX_TERM + 1] {
        let heartbeat = MessageBody::Heartbeat {
            commit: 0,
            context: None,
        };
        assert_refused(
            &mut net,
            msg(2, 3, term, heartbeat),
            Refusal::TermTooLarge { term },
        );
    }
    assert_still_commits(&mut net, &[1, 2, 3]);
}

/// A data directory that already holds a term at or past the limit (written before this
/// guard existed) starts, follows and ticks without panicking; asked to campaign, it says why
/// it cannot instead of overflowing.
#[test]
fn a_persisted_term_at_the_limit_refuses_to_campaign_instead_of_overflowing() {
    for term in [u64::MAX, MAX_TERM] {
        let mut store = MemStorage::new_with_conf_state(voters(&[1, 2, 3]));
        store.set_hard_state(HardState {
            term,
            vote: None,
            commit: 0,
        });
        let mut node = RawNode::new(config(1), store).expect("a high term still starts");
        assert_eq!(node.campaign(), Err(Error::TermExhausted { term }));
        for _ in 0..100 {
            node.tick();
        }
        assert_eq!(node.role(), Role::Follower);
        assert_eq!(node.term(), term);
    }
}

/// The issue's forged Append with prev_index = u64::MAX panicked on `index + 1`; indexes past
/// MAX_INDEX are refused in every field that carries one.
#[test]
fn indexes_past_the_limit_are_refused() {
    let mut net = Net::new(3);
    net.elect(1);
    let term = net.node(1).term();
    let too_far = MAX_INDEX + 1;
    let cases = [
        (append(u64::MAX, term, vec![], 0), "prev_index", u64::MAX),
        (append(0, 0, vec![], too_far), "commit", too_far),
        (
            MessageBody::Heartbeat {
                commit: u64::MAX,
                context: None,
            },
            "commit",
            u64::MAX,
        ),
        (
            MessageBody::ReadIndexResponse {
                context: Bytes::from_static(b"r"),
                index: too_far,
            },
            "read index",
            too_far,
        ),
    ];
    for (body, field, index) in cases {
        let reason = Refusal::IndexBeyondBound {
            field,
            index,
            bound: MAX_INDEX,
        };
        assert_refused(&mut net, msg(1, 2, term, body), reason);
    }
    let vote = MessageBody::Vote {
        pre: true,
        last_index: u64::MAX,
        last_term: term,
        transfer: false,
    };
    let reason = Refusal::IndexBeyondBound {
        field: "last_index",
        index: u64::MAX,
        bound: MAX_INDEX,
    };
    assert_refused(&mut net, msg(3, 2, term + 1, vote), reason);
    // An entry one past MAX_INDEX would be numbered by `prev_index + 1`.
    let at_the_end = append(MAX_INDEX, term, vec![entry(MAX_INDEX + 1, term)], 0);
    let reason = Refusal::IndexBeyondBound {
        field: "entry index",
        index: MAX_INDEX + 1,
        bound: MAX_INDEX,
    };
    assert_refused(&mut net, msg(1, 2, term, at_the_end), reason);
    assert_still_commits(&mut net, &[1, 2, 3]);
}

/// The issue's forged AppendResponse with hint_index = u64::MAX panicked on `hint_index + 1`.
/// A hint past the rejected index, or past the leader's log, is refused.
#[test]
fn an_append_response_hint_past_the_rejected_index_is_refused() {
    let mut net = Net::new(3);
    net.elect(1);
    let term = net.node(1).term();
    let last = net.node(1).last_index();
    for (reject, hint_index, bound) in [(true, u64::MAX, last), (true, last + 1, last)] {
        let body = MessageBody::AppendResponse {
            index: last,
            reject,
            hint_index,
            hint_term: 0,
            awaited: false,
        };
        let before = observe(net.node(1));
        let answer = net.node(1).step(msg(2, 1, term, body));
        let expected_reason = if hint_index > MAX_INDEX {
            Refusal::IndexBeyondBound {
                field: "hint_index",
                index: hint_index,
                bound: MAX_INDEX,
            }
        } else {
            Refusal::IndexBeyondBound {
                field: "hint_index",
                index: hint_index,
                bound,
            }
        };
        assert_eq!(
            answer,
            Err(Error::RefusedMessage {
                from: 2,
                kind: "AppendResponse",
                reason: expected_reason,
            })
        );
        assert_eq!(observe(net.node(1)), before);
    }
    // Within MAX_INDEX but past the rejected index: the leader's own check.
    let body = MessageBody::AppendResponse {
        index: 1,
        reject: true,
        hint_index: MAX_INDEX,
        hint_term: 0,
        awaited: false,
    };
    let answer = net.node(1).step(msg(2, 1, term, body));
    assert_eq!(
        answer,
        Err(Error::RefusedMessage {
            from: 2,
            kind: "AppendResponse",
            reason: Refusal::IndexBeyondBound {
                field: "hint_index",
                index: MAX_INDEX,
                bound: 1,
            },
        })
    );
    let body = MessageBody::AppendResponse {
        index: last,
        reject: true,
        hint_index: 0,
        hint_term: term + 1,
        awaited: false,
    };
    let reason = Refusal::TermAhead {
        field: "hint_term",
        term: term + 1,
        message_term: term,
    };
    assert_refused(&mut net, msg(2, 1, term, body), reason);
    assert_still_commits(&mut net, &[1, 2, 3]);
}

/// The issue's forged Append with a conflicting entry at index 1 (after a matching
/// prev_index) tripped the log's assert. Entries must follow prev_index one by one, with
/// terms that never go back and never pass the message's term.
#[test]
fn entries_that_do_not_follow_prev_index_are_refused() {
    let mut net = Net::new(3);
    net.elect(1);
    let term = net.node(1).term();
    let committed = net.node(2).commit_index();
    assert!(committed >= 1);
    let gap = append(committed, term, vec![entry(1, term + 1)], committed);
    let reason = Refusal::EntriesNotContiguous {
        position: 0,
        index: 1,
    };
    assert_refused(&mut net, msg(1, 2, term + 1, gap), reason);
    let skip = append(
        committed,
        term,
        vec![entry(committed + 1, term), entry(committed + 3, term)],
        committed,
    );
    let reason = Refusal::EntriesNotContiguous {
        position: 1,
        index: committed + 3,
    };
    assert_refused(&mut net, msg(1, 2, term, skip), reason);
    let backwards = append(
        committed,
        term,
        vec![entry(committed + 1, term), entry(committed + 2, term - 1)],
        committed,
    );
    let reason = Refusal::EntriesNotContiguous {
        position: 1,
        index: committed + 2,
    };
    assert_refused(&mut net, msg(1, 2, term, backwards), reason);
    let ahead = append(committed, term, vec![entry(committed + 1, term + 5)], 0);
    let reason = Refusal::TermAhead {
        field: "entry term",
        term: term + 5,
        message_term: term,
    };
    assert_refused(&mut net, msg(1, 2, term, ahead), reason);
    assert_still_commits(&mut net, &[1, 2, 3]);
}

/// An entry at or below the commit index that contradicts the log cannot come from a real
/// leader (it holds every committed entry): the Append is refused, not half applied.
#[test]
fn a_conflict_at_or_below_the_commit_index_is_refused() {
    let mut net = Net::new(3);
    net.elect(1);
    let term = net.node(1).term();
    let committed = net.node(2).commit_index();
    let prev_term = net.node(2).store().term(committed - 1).expect("in the log");
    let conflicting = append(
        committed - 1,
        prev_term,
        vec![entry(committed, term + 1)],
        committed,
    );
    let reason = Refusal::ConflictBelowCommit {
        index: committed,
        committed,
    };
    assert_refused(&mut net, msg(1, 2, term + 1, conflicting), reason);
    assert_still_commits(&mut net, &[1, 2, 3]);
}

/// A follower that is sent a snapshot by its leader: the chunk it is sent, before and after.
struct SnapshotCase {
    net: Net,
    term: u64,
    meta: SnapshotMeta,
}

fn snapshot_case(make: fn(u64) -> Config) -> SnapshotCase {
    let mut net = Net::with_config(3, make);
    net.elect(1);
    let term = net.node(1).term();
    let meta = SnapshotMeta {
        index: net.node(1).last_index() + 10,
        term,
        conf_state: voters(&[1, 2, 3]),
    };
    SnapshotCase { net, term, meta }
}

impl SnapshotCase {
    fn chunk(&self, offset: u64, data: &'static [u8], done: bool, crc: u32) -> Message {
        let body = MessageBody::SnapshotChunk {
            meta: self.meta.clone(),
            offset,
            data: Bytes::from_static(data),
            done,
            image_crc32c: crc,
        };
        msg(1, 2, self.term, body)
    }

    fn send(
        &mut self,
        offset: u64,
        data: &'static [u8],
        done: bool,
        crc: u32,
    ) -> Result<(), Error> {
        let chunk = self.chunk(offset, data, done, crc);
        self.net.node(2).step(chunk)
    }

    /// The node's Ready after a chunk: its answer to the leader and whether a snapshot is in.
    fn answer(&mut self) -> (Option<MessageBody>, bool) {
        let node = self.net.node(2);
        let ready = node.ready();
        let answer = ready
            .messages
            .iter()
            .find(|m| matches!(m.body, MessageBody::SnapshotResponse { .. }))
            .map(|m| m.body.clone());
        let installed = ready.snapshot.is_some();
        node.advance(ready);
        (answer, installed)
    }
}

/// The issue's forged SnapshotChunk with garbage data was persisted as a .snap file and
/// bricked the node. An image whose crc32c does not match never reaches Ready (so nothing is
/// written or restored): the node keeps its log and asks the leader to start over.
#[test]
fn a_snapshot_image_with_a_bad_checksum_is_discarded_and_asked_for_again() {
    let mut case = snapshot_case(config);
    let commit = case.net.node(2).commit_index();
    let image: &[u8] = b"the leader's image";
    let good = crc32c::crc32c(image);
    let answer = case.send(0, image, true, good ^ 1);
    assert_eq!(
        answer,
        Err(Error::RefusedMessage {
            from: 1,
            kind: "SnapshotChunk",
            reason: Refusal::SnapshotChecksumMismatch {
                expected: good ^ 1,
                computed: good,
            },
        })
    );
    let (reply, installed) = case.answer();
    assert!(!installed, "a corrupt image reached the Ready");
    assert_eq!(
        reply,
        Some(MessageBody::SnapshotResponse {
            snapshot_index: case.meta.index,
            next_offset: 0,
            installed: false,
            reject: true,
        }),
        "the leader is not asked to resend"
    );
    assert_eq!(case.net.node(2).commit_index(), commit);
    // Sent again intact, it is installed.
    assert_eq!(case.send(0, image, true, good), Ok(()));
    let (_, installed) = case.answer();
    assert!(installed);
}

/// Between the leader and the follower a chunk is damaged; the follower rejects the image,
/// the leader starts over and the follower ends with the leader's exact image.
#[test]
fn a_snapshot_damaged_in_transit_is_sent_again_and_installed_intact() {
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
    let data = Bytes::from((0..45u8).collect::<Vec<_>>());
    net.node(1)
        .store_mut()
        .create_snapshot(applied, conf, data.clone());
    net.heal();
    let mut damaged = 0;
    let mut refused = 0;
    for _ in 0..200 {
        for id in [1, 2, 3] {
            net.node(id).tick();
        }
        for _ in 0..100 {
            let messages = net.collect();
            if messages.is_empty() {
                break;
            }
            for mut m in messages {
                if let MessageBody::SnapshotChunk {
                    offset: 20, data, ..
                } = &mut m.body
                    && damaged == 0
                {
                    let mut bytes = data.to_vec();
                    bytes[3] ^= 0xff;
                    *data = Bytes::from(bytes);
                    damaged += 1;
                }
                if let Some(node) = net.nodes.get_mut(&m.to)
                    && matches!(node.step(m), Err(Error::RefusedMessage { .. }))
                {
                    refused += 1;
                }
            }
        }
        if net.node(3).store().snapshot().map(|s| s.data) == Ok(data.clone()) {
            break;
        }
    }
    assert_eq!(damaged, 1);
    assert_eq!(refused, 1, "the damaged image was not refused exactly once");
    assert_eq!(net.node(3).store().snapshot().map(|s| s.data), Ok(data));
    assert_eq!(net.node(3).applied_index(), net.node(1).applied_index());
}

/// A chunk past the bytes received so far cannot be placed: refused, and the leader is told
/// where to resume. A chunk whose checksum differs from the transfer's ends the transfer.
#[test]
fn snapshot_chunks_out_of_place_are_refused() {
    let mut case = snapshot_case(config);
    let crc = crc32c::crc32c(b"0123456789");
    assert_eq!(case.send(0, b"01234", false, crc), Ok(()));
    let _ = case.answer();
    let answer = case.send(7, b"789", true, crc);
    assert_eq!(
        answer,
        Err(Error::RefusedMessage {
            from: 1,
            kind: "SnapshotChunk",
            reason: Refusal::SnapshotOffsetBeyondReceived {
                offset: 7,
                received: 5,
            },
        })
    );
    let (reply, installed) = case.answer();
    assert!(!installed);
    assert_eq!(
        reply,
        Some(MessageBody::SnapshotResponse {
            snapshot_index: case.meta.index,
            next_offset: 5,
            installed: false,
            reject: false,
        })
    );
    let answer = case.send(5, b"56789", true, crc ^ 1);
    assert_eq!(
        answer,
        Err(Error::RefusedMessage {
            from: 1,
            kind: "SnapshotChunk",
            reason: Refusal::SnapshotChecksumChanged,
        })
    );
    let (_, installed) = case.answer();
    assert!(!installed);
    // The transfer is gone: even the right chunk now gets "start over".
    assert_eq!(case.send(5, b"56789", true, crc), Ok(()));
    let (reply, installed) = case.answer();
    assert!(!installed);
    assert!(matches!(
        reply,
        Some(MessageBody::SnapshotResponse { reject: true, .. })
    ));
}

/// A transfer that would grow past max_snapshot_bytes is refused before anything is buffered.
#[test]
fn a_snapshot_past_the_size_limit_is_refused() {
    fn tiny_snapshots(id: u64) -> Config {
        let mut c = config(id);
        c.max_snapshot_bytes = 8;
        c
    }
    let mut case = snapshot_case(tiny_snapshots);
    let crc = crc32c::crc32c(b"0123456789");
    let before = observe(case.net.node(2));
    let answer = case.send(0, b"0123456789", true, crc);
    assert_eq!(
        answer,
        Err(Error::RefusedMessage {
            from: 1,
            kind: "SnapshotChunk",
            reason: Refusal::SnapshotTooLarge { size: 10, limit: 8 },
        })
    );
    assert_eq!(observe(case.net.node(2)), before);
    let answer = case.send(u64::MAX, b"0", true, crc);
    assert_eq!(
        answer,
        Err(Error::RefusedMessage {
            from: 1,
            kind: "SnapshotChunk",
            reason: Refusal::SnapshotTooLarge {
                size: u64::MAX,
                limit: 8,
            },
        })
    );
}

/// A snapshot whose configuration has no voter would leave the node unable to ever elect.
#[test]
fn a_snapshot_without_voters_is_refused() {
    let mut case = snapshot_case(config);
    case.meta.conf_state = ConfState::default();
    let crc = crc32c::crc32c(b"x");
    let message = case.chunk(0, b"x", true, crc);
    assert_refused(&mut case.net, message, Refusal::SnapshotWithoutVoters);
}

/// Members 1 to 3, led by 1, add node 4 (started with an empty configuration) as a voter,
/// with member `cut_off` isolated meanwhile if given.
fn three_members_add_a_fourth(cut_off: Option<u64>) -> Net {
    let mut net = Net::new(3);
    net.nodes.insert(
        4,
        RawNode::new(config(4), MemStorage::default()).expect("valid"),
    );
    net.elect(1);
    if let Some(id) = cut_off {
        net.isolate(id);
    }
    net.node(1)
        .propose_conf_change(vec![conclave_raft::ConfChangeStep::AddVoter(4)])
        .expect("accepted");
    net.tick_all(10);
    net
}

/// A node joining with an empty configuration knows no member yet: it must still accept the
/// leader's snapshot and appends, and then, as a voter, refuse a stranger that claims to lead
/// the term its leader leads.
#[test]
fn a_joining_node_accepts_its_leader_and_then_refuses_strangers() {
    let mut net = three_members_add_a_fourth(None);
    assert!(net.node(4).conf_state().is_voter(4), "node 4 did not join");
    let term = net.node(4).term();
    let heartbeat = MessageBody::Heartbeat {
        commit: 0,
        context: None,
    };
    assert_refused(&mut net, msg(9, 4, term, heartbeat), Refusal::NotTheLeader);
    assert_still_commits(&mut net, &[1, 2, 3, 4]);
}

/// A voter that was cut off while a new member joined, and that new member came to lead,
/// holds a configuration without its leader; it learns the change only from that leader.
/// It used to refuse it as a stranger, stayed out for good, and once its vote was needed
/// for a quorum the cluster could commit nothing more.
#[test]
fn a_voter_whose_configuration_predates_its_leader_follows_it() {
    let mut net = three_members_add_a_fourth(Some(3));
    assert!(net.node(1).conf_state().is_voter(4), "node 4 did not join");
    assert!(!net.node(3).conf_state().contains(4), "node 3 was cut off");
    net.node(1)
        .transfer_leader(4)
        .expect("a voter to hand over to");
    net.tick_all(5);
    assert_eq!(net.leaders(), vec![4], "node 4 took over");

    net.heal();
    net.tick_all(10);
    assert!(
        net.node(3).conf_state().is_voter(4),
        "node 3 never learned of its leader's addition: {:?}",
        net.node(3).conf_state()
    );
    assert_eq!(net.node(3).leader(), Some(4));
    // With member 1 gone, members 2, 3 and 4 are the only quorum: it needs node 3.
    net.isolate(1);
    let index = net
        .node(4)
        .propose(Bytes::from_static(b"with 3"))
        .expect("still the leader");
    net.tick_all(3);
    for id in [2, 3, 4] {
        assert!(
            net.node(id).commit_index() >= index,
            "node {id} did not commit the entry that needed node 3"
        );
    }
}

/// A voter that alone is a quorum of its configuration acknowledged every change after it,
/// so a leader it holds no change for cannot exist: it refuses one even at a later term.
#[test]
fn a_voter_that_alone_is_a_quorum_refuses_a_leader_it_does_not_know() {
    // Two voters: neither is a quorum without the other.
    let mut net = Net::new(2);
    net.elect(1);
    let term = net.node(2).term();
    let heartbeat = MessageBody::Heartbeat {
        commit: 0,
        context: None,
    };
    assert_refused(
        &mut net,
        msg(9, 2, term + 1, heartbeat),
        Refusal::NotAMember,
    );
    assert_still_commits(&mut net, &[1, 2]);
}

/// A membership-change entry that does not decode would stop every node that applies it; a
/// real leader never sends one.
#[test]
fn an_undecodable_membership_change_entry_is_refused() {
    let mut net = Net::new(3);
    net.elect(1);
    let term = net.node(1).term();
    let last = net.node(2).last_index();
    let prev_term = net.node(2).store().term(last).expect("in the log");
    let garbage = Entry {
        index: last + 1,
        term,
        kind: conclave_raft::EntryKind::ConfChange,
        data: Bytes::from_static(b"\x01garbage"),
    };
    let body = append(last, prev_term, vec![garbage], last + 1);
    let reason = Refusal::UndecodableConfChange { index: last + 1 };
    assert_refused(&mut net, msg(1, 2, term, body), reason);
    assert_still_commits(&mut net, &[1, 2, 3]);
}
