//! `conclave.v1.Election`: priority election groups (Campaign, Resign, Proclaim, Leader,
//! Candidates, Observe, Configure).

use std::collections::BTreeMap;
use std::sync::Arc;

use conclave_proto::conclave::v1::election_server::{Election, ElectionServer};
use conclave_proto::conclave::v1::{self as cv1, election_client::ElectionClient};
use conclave_state::{
    ElectionEvent, ElectionEventKind, GroupPolicy, GroupRegister, PreemptPolicy, Request, Response,
    StateMachine,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, async_trait};

use super::{
    STREAM_RESPONSES_MAX, candidate_to_pb, election_events_of, group_policy, header, invalid,
    leadership, leadership_of, policy_to_pb,
};
use crate::api::limits::Wait;
use crate::api::lock::{node_stopped, wait_context, wait_until};
use crate::api::route::leader_call;
use crate::api::watch_hub::{Delivery, HubMessage, Interest, Subscription};
use crate::api::{Api, CallContext, Served, answer, state_status, to_status, unexpected};
use crate::error::Error;

/// `conclave.v1.Election`, ready for the gRPC router.
pub fn election_server(api: &Arc<Api>, decode_max: usize) -> ElectionServer<ElectionService> {
    ElectionServer::new(ElectionService { api: api.clone() }).max_decoding_message_size(decode_max)
}

// ---- Election ---------------------------------------------------------------------------

/// Priority election groups over the shared [`Api`].
pub struct ElectionService {
    pub api: Arc<Api>,
}

/// Whether the campaign of `candidate` under `lease` is decided: elected, or no longer
/// registered (its lease ended or it was replaced).
fn campaign_state(
    state: &StateMachine,
    group: &str,
    candidate: &str,
    lease: i64,
) -> Option<Result<cv1::Leadership, Status>> {
    let registered = state
        .group(group)
        .and_then(|g| g.candidates.get(candidate))
        .is_some_and(|c| c.lease_id == lease);
    match state.group_leader(group) {
        Some(seat) if seat.leader == candidate && registered => {
            Some(Ok(leadership_of(state, group, seat)))
        }
        _ if !registered => Some(Err(crate::api::lock::lost_status())),
        _ => None,
    }
}

#[async_trait]
impl Election for ElectionService {
    async fn campaign(
        &self,
        request: tonic::Request<cv1::CampaignRequest>,
    ) -> Result<tonic::Response<cv1::CampaignResponse>, Status> {
        let ctx = wait_context(&request);
        let client = request.remote_addr();
        let message = request.into_inner();
        if message.lease == 0 {
            return Err(invalid("a campaign needs a lease"));
        }
        // Taken before anything is proposed, so a refused campaign leaves no candidacy
        // (campaign_waits_max); held until the answer.
        let _slot = match message.wait {
            true => Some((self.api.limits).wait(Wait::Campaign, client)?),
            false => None,
        };
        let api = &self.api;
        let command = Request::GroupRegister(GroupRegister {
            group: message.group.clone(),
            candidate: message.candidate_id.clone(),
            priority: message.priority,
            value: message.value.clone(),
            lease_id: message.lease,
            preempt: message.preempt,
        });
        let served = api
            .write_routed(
                &ctx,
                command,
                &message,
                leader_call!(ElectionClient::campaign),
                |applied| match answer(&applied)? {
                    Response::Group(_) => Ok(applied.output.revision),
                    other => Err(unexpected(other)),
                },
            )
            .await?;
        if let Served::Leader(response) = served {
            return Ok(response);
        }
        let group = message.group.as_str();
        let candidate = message.candidate_id.as_str();
        let decided = if message.wait {
            wait_until(
                api,
                ctx.deadline,
                |state| campaign_state(state, group, candidate, message.lease),
                Interest::Election(group.to_owned()),
            )
            .await?
        } else {
            api.node
                .read_state(|state| campaign_state(state, group, candidate, message.lease))
        };
        let elected = match decided {
            Some(Ok(elected)) => Some(elected),
            Some(Err(lost)) => return Err(lost),
            // Not elected (yet, or before the deadline): answer with whoever leads.
            None => None,
        };
        let (current, revision) = api
            .node
            .read_state(|state| (leadership(state, group), state.revision()));
        Ok(tonic::Response::new(cv1::CampaignResponse {
            header: Some(header(api, revision)),
            elected: elected.is_some(),
            leadership: elected.or(current),
        }))
    }

    async fn resign(
        &self,
        request: tonic::Request<cv1::ResignRequest>,
    ) -> Result<tonic::Response<cv1::ResignResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        let message = request.into_inner();
        let api = &self.api;
        // The registration's lease and the seat, read where the write will go: a follower
        // forwards the whole call, so these checks run on the leader's applied state.
        let local = api.node.status.borrow().leader == Some(api.config.id) || ctx.forwarded;
        let mut was_leader = false;
        let mut lease_id = 0;
        if local {
            api.linearizable_barrier(&ctx).await?;
            let found = api.node.read_state(|state| {
                let lease = state
                    .group(&message.group)
                    .and_then(|g| g.candidates.get(&message.candidate_id))
                    .map(|c| c.lease_id);
                let seat = state
                    .group_leader(&message.group)
                    .filter(|seat| seat.leader == message.candidate_id)
                    .map(|seat| seat.fence);
                (lease, seat)
            });
            let (Some(lease), seat) = found else {
                return Err(state_status(&conclave_state::Error::CandidateNotFound {
                    group: message.group.clone(),
                    candidate: message.candidate_id.clone(),
                }));
            };
            if message.fence != 0 && seat.and_then(|f| u64::try_from(f).ok()) != Some(message.fence)
            {
                return Err(state_status(&conclave_state::Error::NotGroupLeader {
                    group: message.group.clone(),
                    fence: i64::try_from(message.fence).unwrap_or(i64::MAX),
                }));
            }
            was_leader = seat.is_some();
            lease_id = lease;
        }
        let command = Request::GroupResign {
            group: message.group.clone(),
            candidate: message.candidate_id.clone(),
            lease_id,
        };
        api.write(
            &ctx,
            command,
            &message,
            leader_call!(ElectionClient::resign),
            |applied| match answer(&applied)? {
                Response::Group(_) => Ok(cv1::ResignResponse {
                    header: Some(header(api, applied.output.revision)),
                    was_leader,
                }),
                other => Err(unexpected(other)),
            },
        )
        .await
    }

    async fn proclaim(
        &self,
        request: tonic::Request<cv1::ProclaimRequest>,
    ) -> Result<tonic::Response<cv1::ProclaimResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        let message = request.into_inner();
        let api = &self.api;
        let command = Request::GroupProclaim {
            group: message.group.clone(),
            candidate: message.candidate_id.clone(),
            fence: i64::try_from(message.fence).map_err(|_| invalid("fence is out of range"))?,
            value: message.value.clone(),
        };
        api.write_self_contained(
            &ctx,
            command,
            &message,
            leader_call!(ElectionClient::proclaim),
            |applied| match answer(&applied)? {
                Response::Group(_) => Ok(cv1::ProclaimResponse {
                    header: Some(header(api, applied.output.revision)),
                }),
                other => Err(unexpected(other)),
            },
        )
        .await
    }

    async fn leader(
        &self,
        request: tonic::Request<cv1::LeaderRequest>,
    ) -> Result<tonic::Response<cv1::LeaderResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        let group = request.into_inner().group;
        self.api.check_read(&ctx, group.as_bytes(), &[])?;
        self.api.linearizable_barrier(&ctx).await?;
        let (leadership, policy, revision) = self.api.node.read_state(|state| {
            (
                leadership(state, &group),
                group_policy(state, &group),
                state.revision(),
            )
        });
        Ok(tonic::Response::new(cv1::LeaderResponse {
            header: Some(header(&self.api, revision)),
            leadership,
            policy: Some(policy),
        }))
    }

    async fn candidates(
        &self,
        request: tonic::Request<cv1::CandidatesRequest>,
    ) -> Result<tonic::Response<cv1::CandidatesResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        let message = request.into_inner();
        self.api.check_read(&ctx, message.group.as_bytes(), &[])?;
        let api = &self.api;
        // Served by the Raft leader: the keepalive ages live only in its memory.
        api.serve(
            &ctx,
            &message,
            leader_call!(ElectionClient::candidates),
            || candidates_here(api, &ctx, &message.group),
        )
        .await
    }

    async fn configure(
        &self,
        request: tonic::Request<cv1::ConfigureRequest>,
    ) -> Result<tonic::Response<cv1::ConfigureResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        let message = request.into_inner();
        if message.group.is_empty() {
            return Err(invalid("the group name must not be empty"));
        }
        let wanted = message.policy.unwrap_or_default();
        let preempt_policy = match cv1::PreemptPolicy::try_from(wanted.preempt_policy) {
            Ok(cv1::PreemptPolicy::Always) => PreemptPolicy::Always,
            Ok(cv1::PreemptPolicy::Higher | cv1::PreemptPolicy::Unspecified) => {
                PreemptPolicy::Higher
            }
            Ok(cv1::PreemptPolicy::Never) => PreemptPolicy::Never,
            Err(_) => return Err(invalid("unknown preempt policy")),
        };
        let mut policy = GroupPolicy {
            preempt_never: false,
            preempt: false,
            handoff_timeout_ms: (wanted.handoff_timeout_ms > 0)
                .then_some(wanted.handoff_timeout_ms),
            settle_ms: (wanted.settle_ms > 0).then_some(wanted.settle_ms),
        };
        policy.set_preempt_policy(preempt_policy);
        let api = &self.api;
        // `higher` and `always` as the command older members know, byte for byte.
        let command = match preempt_policy {
            PreemptPolicy::Never => Request::GroupConfigurePreempt {
                group: message.group.clone(),
                policy,
                preempt_policy,
            },
            PreemptPolicy::Higher | PreemptPolicy::Always => Request::GroupConfigure {
                group: message.group.clone(),
                policy,
            },
        };
        api.write_self_contained(
            &ctx,
            command,
            &message,
            leader_call!(ElectionClient::configure),
            |applied| match answer(&applied)? {
                Response::Group(_) => Ok(cv1::ConfigureResponse {
                    header: Some(header(api, applied.output.revision)),
                    policy: Some(policy_to_pb(&policy)),
                }),
                other => Err(unexpected(other)),
            },
        )
        .await
    }

    type ObserveStream = ReceiverStream<Result<cv1::ObserveResponse, Status>>;

    async fn observe(
        &self,
        request: tonic::Request<cv1::ObserveRequest>,
    ) -> Result<tonic::Response<Self::ObserveStream>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        // Held by the stream's task until the stream ends (election_observers_max).
        let slot = (self.api.limits).wait(Wait::ElectionObserver, request.remote_addr())?;
        // The group's history is not retained as events; every stream starts with CURRENT,
        // whatever `start_revision` asks (the client resumes from the state it describes).
        let group = request.into_inner().group;
        self.api.check_read(&ctx, group.as_bytes(), &[])?;
        self.api.linearizable_barrier(&ctx).await?;
        let (responses, output) = mpsc::channel(STREAM_RESPONSES_MAX);
        let api = self.api.clone();
        let interest = Interest::Election(group.clone());
        let (changes, first) = api.subscribe_with(interest, Delivery::Every, |state| {
            GroupView::current(state, &group)
        });
        tokio::spawn(async move {
            let _slot = slot;
            observe_group(api, group, changes, first, responses).await;
        });
        Ok(tonic::Response::new(ReceiverStream::new(output)))
    }
}

/// Candidates answered by this node as the Raft leader, with their keepalive ages.
async fn candidates_here(
    api: &Api,
    ctx: &CallContext,
    group: &str,
) -> Result<cv1::CandidatesResponse, Status> {
    api.linearizable_barrier(ctx).await?;
    let (mut candidates, policy, revision) = api.node.read_state(|state| {
        let leader = state.group_leader(group).map(|seat| seat.leader.clone());
        let succession = state.group_succession(group);
        // The leader first (it may not be first in succession: stability), then the rest.
        let mut ordered: Vec<cv1::Candidate> = succession
            .iter()
            .filter(|c| Some(&c.id) == leader.as_ref())
            .map(|c| candidate_to_pb(c))
            .collect();
        ordered.extend(
            succession
                .iter()
                .filter(|c| Some(&c.id) != leader.as_ref())
                .map(|c| candidate_to_pb(c)),
        );
        (ordered, group_policy(state, group), state.revision())
    });
    let leases: Vec<i64> = candidates.iter().map(|c| c.lease).collect();
    let ages = tokio::time::timeout(ctx.remaining(), api.node.lease_renewal_ages_ms(leases))
        .await
        .map_err(|_| to_status(Error::Timeout))?
        .map_err(to_status)?;
    for (candidate, age) in candidates.iter_mut().zip(ages) {
        candidate.keepalive_age_ms = age;
    }
    Ok(cv1::CandidatesResponse {
        header: Some(header(api, revision)),
        candidates,
        policy: Some(policy),
    })
}

/// What one observer last told its client about a group.
struct GroupView {
    leader: Option<cv1::Leadership>,
    /// The registered candidates as last seen, so one that left is reported in full.
    candidates: BTreeMap<String, cv1::Candidate>,
    revision: i64,
}

impl GroupView {
    fn current(state: &StateMachine, group: &str) -> GroupView {
        GroupView {
            leader: leadership(state, group),
            candidates: state
                .group(group)
                .map(|g| {
                    g.candidates
                        .iter()
                        .map(|(id, c)| (id.clone(), candidate_to_pb(c)))
                        .collect()
                })
                .unwrap_or_default(),
            revision: state.revision(),
        }
    }

    fn current_event(&self, group: &str) -> cv1::ElectionEvent {
        cv1::ElectionEvent {
            kind: cv1::election_event::Kind::Current as i32,
            group: group.to_string(),
            leadership: self.leader.clone(),
            candidate: None,
            revision: self.revision,
        }
    }

    /// Translates one state-machine event into the API's events, reading details (who left
    /// and why) from the state after the batch.
    fn apply(
        &mut self,
        state: &StateMachine,
        group: &str,
        event: &ElectionEvent,
        out: &mut Vec<cv1::ElectionEvent>,
    ) {
        use cv1::election_event::Kind;
        let make =
            |kind: Kind, leadership: Option<cv1::Leadership>, candidate| cv1::ElectionEvent {
                kind: kind as i32,
                group: group.to_string(),
                leadership,
                candidate,
                revision: event.revision,
            };
        let registered = state.group(group);
        let lookup = |id: &str| {
            registered
                .and_then(|g| g.candidates.get(id))
                .map(candidate_to_pb)
        };
        match &event.kind {
            ElectionEventKind::Elected {
                leader,
                priority,
                value,
                fence,
            } => {
                let new = cv1::Leadership {
                    group: group.to_string(),
                    leader: Some(lookup(leader).unwrap_or_else(|| cv1::Candidate {
                        candidate_id: leader.clone(),
                        priority: *priority,
                        value: value.clone(),
                        ..Default::default()
                    })),
                    term: event.term,
                    fence: u64::try_from(*fence).unwrap_or(0),
                    elected_revision: *fence,
                    handoff_to: None,
                    elected_unix_ms: state
                        .group_leader(group)
                        .filter(|seat| seat.fence == *fence)
                        .map_or(0, |seat| i64::try_from(seat.since_ms).unwrap_or(i64::MAX)),
                };
                self.ousted(state, group, Some(new.clone()), event, out);
                out.push(make(Kind::Elected, Some(new.clone()), None));
                self.leader = Some(new);
            }
            ElectionEventKind::Vacant => {
                self.ousted(state, group, None, event, out);
                self.leader = None;
            }
            ElectionEventKind::ValueChanged { value, .. } => {
                if let Some(current) = &mut self.leader {
                    if let Some(leader) = &mut current.leader {
                        leader.value = value.clone();
                    }
                    out.push(make(Kind::Proclaimed, Some(current.clone()), None));
                }
            }
            ElectionEventKind::CandidatesChanged { candidates } => {
                let now: BTreeMap<String, cv1::Candidate> = candidates
                    .iter()
                    .map(|c| {
                        let known = lookup(&c.id).unwrap_or_else(|| cv1::Candidate {
                            candidate_id: c.id.clone(),
                            priority: c.priority,
                            ..Default::default()
                        });
                        (c.id.clone(), known)
                    })
                    .collect();
                for (id, candidate) in &now {
                    if !self.candidates.contains_key(id) {
                        out.push(make(
                            Kind::CandidateJoined,
                            self.leader.clone(),
                            Some(candidate.clone()),
                        ));
                    }
                }
                // A candidate that left is gone from the state: report it as last seen.
                for (id, candidate) in &self.candidates {
                    if !now.contains_key(id) {
                        out.push(make(
                            Kind::CandidateLeft,
                            self.leader.clone(),
                            Some(candidate.clone()),
                        ));
                    }
                }
                self.candidates = now;
            }
            // The incumbent learns from these that it should finish up and resign; the
            // change of leader itself is reported when it happens.
            ElectionEventKind::HandoffRequested {
                challenger,
                challenger_priority,
                ..
            } => {
                let challenger = lookup(challenger).unwrap_or_else(|| cv1::Candidate {
                    candidate_id: challenger.clone(),
                    priority: *challenger_priority,
                    ..Default::default()
                });
                if let Some(current) = &mut self.leader {
                    current.handoff_to = Some(challenger.clone());
                    out.push(make(
                        Kind::HandoffRequested,
                        Some(current.clone()),
                        Some(challenger),
                    ));
                }
            }
            ElectionEventKind::HandoffCancelled { .. } => {
                if let Some(current) = &mut self.leader {
                    let challenger = current.handoff_to.take();
                    out.push(make(
                        Kind::HandoffCancelled,
                        Some(current.clone()),
                        challenger,
                    ));
                }
            }
        }
        self.revision = event.revision;
    }

    /// Reports how the previous leader lost the seat: still registered means deposed
    /// (preemption), its lease still alive means it resigned, else its lease ended.
    fn ousted(
        &self,
        state: &StateMachine,
        group: &str,
        after: Option<cv1::Leadership>,
        event: &ElectionEvent,
        out: &mut Vec<cv1::ElectionEvent>,
    ) {
        use cv1::election_event::Kind;
        let Some(previous) = self.leader.as_ref().and_then(|l| l.leader.clone()) else {
            return;
        };
        let still_registered = state
            .group(group)
            .is_some_and(|g| g.candidates.contains_key(&previous.candidate_id));
        let kind = if still_registered {
            Kind::Deposed
        } else if state.lease(previous.lease).is_some() {
            Kind::Resigned
        } else {
            Kind::Expired
        };
        out.push(cv1::ElectionEvent {
            kind: kind as i32,
            group: group.to_string(),
            leadership: after,
            candidate: Some(previous),
            revision: event.revision,
        });
    }
}

async fn observe_group(
    api: Arc<Api>,
    group: String,
    mut changes: Subscription,
    mut view: GroupView,
    responses: mpsc::Sender<Result<cv1::ObserveResponse, Status>>,
) {
    let first = cv1::ObserveResponse {
        header: Some(header(&api, view.revision)),
        events: vec![view.current_event(&group)],
    };
    if responses.send(Ok(first)).await.is_err() {
        return;
    }
    let stopped = node_stopped(&api);
    tokio::pin!(stopped);
    loop {
        let message = tokio::select! {
            _ = responses.closed() => return,
            _ = &mut stopped => {
                let _ = responses.send(Err(to_status(Error::Stopped))).await;
                return;
            }
            message = changes.next() => message,
        };
        let out = match message {
            Some(HubMessage::Batch(batch)) => {
                let mine: Vec<&ElectionEvent> = election_events_of(&batch, &group).collect();
                if mine.is_empty() {
                    continue;
                }
                let mut out = Vec::new();
                api.node.read_state(|state| {
                    for event in mine {
                        view.apply(state, &group, event, &mut out);
                    }
                });
                if out.is_empty() {
                    continue;
                }
                cv1::ObserveResponse {
                    header: Some(header(&api, batch.revision)),
                    events: out,
                }
            }
            // Revisions that skipped the hub (a snapshot installed here, a hub or stream behind)
            // cannot be replayed; a fresh CURRENT resynchronises the client.
            Some(HubMessage::Resync) => {
                view = api
                    .node
                    .read_state(|state| GroupView::current(state, &group));
                cv1::ObserveResponse {
                    header: Some(header(&api, view.revision)),
                    events: vec![view.current_event(&group)],
                }
            }
            None => {
                let _ = responses.send(Err(to_status(Error::Stopped))).await;
                return;
            }
        };
        if responses.send(Ok(out)).await.is_err() {
            return;
        }
    }
}
