//! Conclave's own services (`conclave.v1`): priority election groups, topics, cluster status.
//!
//! ```text
//!  Election.Campaign ─► GroupRegister ─► (wait: applied Election events of the group)
//!  Election.Observe  ─► CURRENT, then the group's events from the apply path
//!  Topic.Publish/Ack ─► log          Topic.Read/Inbox ─► linearizable read of the state
//!  Topic.Subscribe   ─► backlog from the topic log, then each publish (apply path events)
//!  Queue.Push/Claim/Ack/Nack/Extend ─► log (Claim may first wait)   Queue.List/Stats ─► read
//!  Session.Open/Close ─► log (positions of later writes travel as metadata, see `api`)
//!  Status.ClusterStatus ─► Maintenance.Status of every member, gathered concurrently
//! ```
//!
//! A preempting challenger puts the seat into handoff; Observe streams tell the leader
//! (HANDOFF_REQUESTED, and `handoff_to` on every leadership) so it can stop and resign.
//!
//! Streams use bounded queues. A stream that falls behind the apply path catches up from the
//! state (topics re-read their retained log, observers get a fresh CURRENT); a topic
//! subscriber that fell behind retention is cancelled, so memory never grows with a slow
//! client.

pub mod election;
pub mod queue;
pub mod session;
pub mod status;
pub mod topic;

use conclave_proto::conclave::v1 as cv1;
use conclave_state::election::Candidate as StateCandidate;
use conclave_state::{ElectionEvent, Event, Message, Seat, StateMachine};
use tonic::Status;

use super::{Api, state_status};
use crate::node::AppliedEvents;

pub use election::{ElectionService, election_server};
pub use queue::{QueueService, queue_server};
pub use session::{SessionService, session_server};
pub use status::{STATUS_PROBE_TIMEOUT_MS, StatusService, status_server};
pub use topic::{
    INBOX_WAIT_MAX_MS, READ_LIMIT_DEFAULT, READ_LIMIT_MAX, SLOW_SUBSCRIBER_REASON,
    SUBSCRIBE_BATCH_MAX, TopicService, topic_server,
};

/// Responses queued for one Observe or Subscribe stream before it waits for the client.
pub const STREAM_RESPONSES_MAX: usize = 64;

pub(super) fn invalid(reason: &str) -> Status {
    state_status(&conclave_state::Error::InvalidArgument(reason.into()))
}

/// Conclave's header: etcd's fields plus the leader this member knows.
pub(super) fn header(api: &Api, revision: i64) -> cv1::ResponseHeader {
    let etcd = api.header(revision);
    cv1::ResponseHeader {
        cluster_id: etcd.cluster_id,
        member_id: etcd.member_id,
        revision: etcd.revision,
        raft_term: etcd.raft_term,
        leader_id: api.node.status.borrow().leader.unwrap_or(0),
    }
}

pub(super) fn candidate_to_pb(candidate: &StateCandidate) -> cv1::Candidate {
    cv1::Candidate {
        candidate_id: candidate.id.clone(),
        priority: candidate.priority,
        value: candidate.value.clone(),
        lease: candidate.lease_id,
        joined_revision: candidate.registered_revision,
        keepalive_age_ms: None,
    }
}

/// A group's leadership as the state shows it now.
pub(super) fn leadership(state: &StateMachine, group: &str) -> Option<cv1::Leadership> {
    let seat = state.group_leader(group)?;
    Some(leadership_of(state, group, seat))
}

pub(super) fn leadership_of(state: &StateMachine, group: &str, seat: &Seat) -> cv1::Leadership {
    let registered = state.group(group);
    let leader = registered
        .and_then(|g| g.candidates.get(&seat.leader))
        .map(candidate_to_pb)
        .unwrap_or_else(|| cv1::Candidate {
            candidate_id: seat.leader.clone(),
            ..Default::default()
        });
    let handoff_to = seat.handoff.as_ref().map(|handoff| {
        registered
            .and_then(|g| g.candidates.get(&handoff.challenger))
            .map(candidate_to_pb)
            .unwrap_or_else(|| cv1::Candidate {
                candidate_id: handoff.challenger.clone(),
                ..Default::default()
            })
    });
    cv1::Leadership {
        group: group.to_string(),
        leader: Some(leader),
        term: registered.map_or(0, |g| g.term),
        fence: u64::try_from(seat.fence).unwrap_or(0),
        elected_revision: seat.fence,
        handoff_to,
        elected_unix_ms: i64::try_from(seat.since_ms).unwrap_or(i64::MAX),
    }
}

/// A state-machine group policy as the API shows it.
pub(super) fn policy_to_pb(policy: &conclave_state::GroupPolicy) -> cv1::GroupPolicy {
    let preempt_policy = match policy.preempt_policy() {
        conclave_state::PreemptPolicy::Always => cv1::PreemptPolicy::Always,
        conclave_state::PreemptPolicy::Higher => cv1::PreemptPolicy::Higher,
        conclave_state::PreemptPolicy::Never => cv1::PreemptPolicy::Never,
    };
    cv1::GroupPolicy {
        settle_ms: policy.settle_ms.unwrap_or(0),
        preempt_policy: preempt_policy as i32,
        handoff_timeout_ms: policy.handoff_timeout_ms.unwrap_or(0),
    }
}

/// A group's policy, defaults when the group does not exist.
pub(super) fn group_policy(state: &StateMachine, group: &str) -> cv1::GroupPolicy {
    policy_to_pb(&state.group(group).map(|g| g.policy).unwrap_or_default())
}

pub(super) fn message_to_pb(message: Message) -> cv1::TopicMessage {
    cv1::TopicMessage {
        topic: message.topic,
        seq: message.seq,
        data: message.data,
        revision: message.revision,
        published_unix_ms: i64::try_from(message.time_ms).unwrap_or(i64::MAX),
        from: message.from,
    }
}

pub(super) fn read_limit(limit: u32) -> usize {
    match usize::try_from(limit) {
        Ok(0) | Err(_) => READ_LIMIT_DEFAULT,
        Ok(limit) => limit.min(READ_LIMIT_MAX),
    }
}

pub(super) fn election_events_of<'a>(
    batch: &'a AppliedEvents,
    group: &'a str,
) -> impl Iterator<Item = &'a ElectionEvent> + 'a {
    batch.events.iter().filter_map(move |event| match event {
        Event::Election(e) if e.group == group => Some(e),
        _ => None,
    })
}
