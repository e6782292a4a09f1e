//! Conclave's own services (`conclave.v1`): priority election groups, topics, cluster status.
//!
//! ```text
//!  Election.Campaign ─► GroupRegister ─► (wait: applied Election events of the group)
//!  Election.Observe  ─► CURRENT, then the group's events from the apply path
//!  Topic.Publish/Ack ─► log          Topic.Read/Inbox ─► linearizable read of the state
//!  Topic.Subscribe   ─► backlog from the topic log, then each publish (apply path events)
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

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use conclave_proto::conclave::v1::election_server::{Election, ElectionServer};
use conclave_proto::conclave::v1::session_client::SessionClient;
use conclave_proto::conclave::v1::session_server::{Session as SessionApi, SessionServer};
use conclave_proto::conclave::v1::status_server::{Status as StatusApi, StatusServer};
use conclave_proto::conclave::v1::topic_server::{Topic, TopicServer};
use conclave_proto::conclave::v1::{
    self as cv1, election_client::ElectionClient, topic_client::TopicClient,
};
use conclave_proto::etcdserverpb::{StatusRequest, maintenance_client::MaintenanceClient};
use conclave_state::election::Candidate as StateCandidate;
use conclave_state::{
    ElectionEvent, ElectionEventKind, Event, GroupRegister, Message, ReadBudget, Request, Response,
    Seat, StateMachine,
};
use tokio::sync::{broadcast, mpsc};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Endpoint;
use tonic::{Status, async_trait};

use super::lock::{Outcome, answer, node_stopped, unexpected, wait_context, wait_until};
use super::maintenance::ETCD_VERSION;
use super::{Api, CallContext, state_status, to_status};
use crate::error::Error;
use crate::node::AppliedEvents;

/// Responses queued for one Observe or Subscribe stream before it waits for the client.
pub const STREAM_RESPONSES_MAX: usize = 64;
/// Messages a Read or Inbox returns when the request says 0.
pub const READ_LIMIT_DEFAULT: usize = 100;
/// Messages a Read or Inbox returns at most, whatever the request says.
pub const READ_LIMIT_MAX: usize = 10_000;
/// Messages one Subscribe response carries at most (backlog and catch-up are chunked).
pub const SUBSCRIBE_BATCH_MAX: usize = 256;
/// Longest an Inbox waits for a message (`wait_ms`), besides the call's own deadline.
pub const INBOX_WAIT_MAX_MS: u64 = 60_000;
/// How long ClusterStatus waits for one member's status.
pub const STATUS_PROBE_TIMEOUT_MS: u64 = 1_000;
/// Why a subscriber was cancelled.
pub const SLOW_SUBSCRIBER_REASON: &str = "conclave: subscriber fell behind the topic's retention and was cancelled; subscribe again from the oldest retained message";

/// `conclave.v1.Election`, ready for the gRPC router.
pub fn election_server(api: &Arc<Api>, decode_max: usize) -> ElectionServer<ElectionService> {
    ElectionServer::new(ElectionService { api: api.clone() }).max_decoding_message_size(decode_max)
}

/// `conclave.v1.Topic`, ready for the gRPC router.
pub fn topic_server(api: &Arc<Api>, decode_max: usize) -> TopicServer<TopicService> {
    TopicServer::new(TopicService { api: api.clone() }).max_decoding_message_size(decode_max)
}

/// `conclave.v1.Status`, ready for the gRPC router.
pub fn status_server(api: &Arc<Api>) -> StatusServer<StatusService> {
    StatusServer::new(StatusService { api: api.clone() })
}

fn invalid(reason: &str) -> Status {
    state_status(&conclave_state::Error::InvalidArgument(reason.into()))
}

/// Conclave's header: etcd's fields plus the leader this member knows.
fn header(api: &Api, revision: i64) -> cv1::ResponseHeader {
    let etcd = api.header(revision);
    cv1::ResponseHeader {
        cluster_id: etcd.cluster_id,
        member_id: etcd.member_id,
        revision: etcd.revision,
        raft_term: etcd.raft_term,
        leader_id: api.node.status.borrow().leader.unwrap_or(0),
    }
}

fn candidate_to_pb(candidate: &StateCandidate) -> cv1::Candidate {
    cv1::Candidate {
        candidate_id: candidate.id.clone(),
        priority: candidate.priority,
        value: candidate.value.clone(),
        lease: candidate.lease_id,
        joined_revision: candidate.registered_revision,
    }
}

/// A group's leadership as the state shows it now.
fn leadership(state: &StateMachine, group: &str) -> Option<cv1::Leadership> {
    let seat = state.group_leader(group)?;
    Some(leadership_of(state, group, seat))
}

fn leadership_of(state: &StateMachine, group: &str, seat: &Seat) -> cv1::Leadership {
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
    }
}

fn message_to_pb(message: Message) -> cv1::TopicMessage {
    cv1::TopicMessage {
        topic: message.topic,
        seq: message.seq,
        data: message.data,
        revision: message.revision,
        published_unix_ms: i64::try_from(message.time_ms).unwrap_or(i64::MAX),
    }
}

fn read_limit(limit: u32) -> usize {
    match usize::try_from(limit) {
        Ok(0) | Err(_) => READ_LIMIT_DEFAULT,
        Ok(limit) => limit.min(READ_LIMIT_MAX),
    }
}

fn election_events_of<'a>(
    batch: &'a AppliedEvents,
    group: &'a str,
) -> impl Iterator<Item = &'a ElectionEvent> + 'a {
    batch.events.iter().filter_map(move |event| match event {
        Event::Election(e) if e.group == group => Some(e),
        _ => None,
    })
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
        _ if !registered => Some(Err(super::lock::lost_status())),
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
        let message = request.into_inner();
        if message.lease == 0 {
            return Err(invalid("a campaign needs a lease"));
        }
        let api = &self.api;
        let command = Request::GroupRegister(GroupRegister {
            group: message.group.clone(),
            candidate: message.candidate_id.clone(),
            priority: message.priority,
            value: message.value.clone(),
            lease_id: message.lease,
            preempt: message.preempt,
        });
        let outcome = api
            .write(
                &ctx,
                command,
                |applied| match answer(&applied)? {
                    Response::Group(_) => Ok(Outcome::Local(applied.output.revision)),
                    other => Err(unexpected(other)),
                },
                |channel, ctx| {
                    let message = message.clone();
                    Box::pin(async move {
                        let request = Api::forwarded_request(message, &ctx);
                        Ok(Outcome::Forwarded(
                            ElectionClient::new(channel).campaign(request).await?,
                        ))
                    })
                },
            )
            .await?;
        if let Outcome::Forwarded(response) = outcome {
            return Ok(response);
        }
        let group = message.group.as_str();
        let candidate = message.candidate_id.as_str();
        let decided = if message.wait {
            wait_until(
                api,
                ctx.deadline,
                |state| campaign_state(state, group, candidate, message.lease),
                |batch| election_events_of(batch, group).next().is_some(),
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
        let response = api
            .write(
                &ctx,
                command,
                |applied| match answer(&applied)? {
                    Response::Group(_) => Ok(cv1::ResignResponse {
                        header: Some(header(api, applied.output.revision)),
                        was_leader,
                    }),
                    other => Err(unexpected(other)),
                },
                |channel, ctx| {
                    let message = message.clone();
                    Box::pin(async move {
                        let request = Api::forwarded_request(message, &ctx);
                        Ok(ElectionClient::new(channel)
                            .resign(request)
                            .await?
                            .into_inner())
                    })
                },
            )
            .await?;
        Ok(tonic::Response::new(response))
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
        let response = api
            .write(
                &ctx,
                command,
                |applied| match answer(&applied)? {
                    Response::Group(_) => Ok(cv1::ProclaimResponse {
                        header: Some(header(api, applied.output.revision)),
                    }),
                    other => Err(unexpected(other)),
                },
                |channel, ctx| {
                    let message = message.clone();
                    Box::pin(async move {
                        let request = Api::forwarded_request(message, &ctx);
                        Ok(ElectionClient::new(channel)
                            .proclaim(request)
                            .await?
                            .into_inner())
                    })
                },
            )
            .await?;
        Ok(tonic::Response::new(response))
    }

    async fn leader(
        &self,
        request: tonic::Request<cv1::LeaderRequest>,
    ) -> Result<tonic::Response<cv1::LeaderResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        let group = request.into_inner().group;
        self.api.linearizable_barrier(&ctx).await?;
        let (leadership, revision) = self
            .api
            .node
            .read_state(|state| (leadership(state, &group), state.revision()));
        Ok(tonic::Response::new(cv1::LeaderResponse {
            header: Some(header(&self.api, revision)),
            leadership,
        }))
    }

    async fn candidates(
        &self,
        request: tonic::Request<cv1::CandidatesRequest>,
    ) -> Result<tonic::Response<cv1::CandidatesResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        let group = request.into_inner().group;
        self.api.linearizable_barrier(&ctx).await?;
        let (candidates, revision) = self.api.node.read_state(|state| {
            let leader = state.group_leader(&group).map(|seat| seat.leader.clone());
            let succession = state.group_succession(&group);
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
            (ordered, state.revision())
        });
        Ok(tonic::Response::new(cv1::CandidatesResponse {
            header: Some(header(&self.api, revision)),
            candidates,
        }))
    }

    type ObserveStream = ReceiverStream<Result<cv1::ObserveResponse, Status>>;

    async fn observe(
        &self,
        request: tonic::Request<cv1::ObserveRequest>,
    ) -> Result<tonic::Response<Self::ObserveStream>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        // The group's history is not retained as events; every stream starts with CURRENT,
        // whatever `start_revision` asks (the client resumes from the state it describes).
        let group = request.into_inner().group;
        self.api.linearizable_barrier(&ctx).await?;
        let (responses, output) = mpsc::channel(STREAM_RESPONSES_MAX);
        let api = self.api.clone();
        let (events, first) = api.node.read_state(|state| {
            (
                api.node.events.subscribe(),
                GroupView::current(state, &group),
            )
        });
        tokio::spawn(observe_group(api, group, events, first, responses));
        Ok(tonic::Response::new(ReceiverStream::new(output)))
    }
}

/// What one observer last told its client about a group.
struct GroupView {
    leader: Option<cv1::Leadership>,
    candidates: BTreeSet<String>,
    revision: i64,
}

impl GroupView {
    fn current(state: &StateMachine, group: &str) -> GroupView {
        GroupView {
            leader: leadership(state, group),
            candidates: state
                .group(group)
                .map(|g| g.candidates.keys().cloned().collect())
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
                let now: BTreeSet<String> = candidates.iter().map(|c| c.id.clone()).collect();
                for joined in now.difference(&self.candidates) {
                    let candidate = lookup(joined).unwrap_or_else(|| cv1::Candidate {
                        candidate_id: joined.clone(),
                        ..Default::default()
                    });
                    out.push(make(
                        Kind::CandidateJoined,
                        self.leader.clone(),
                        Some(candidate),
                    ));
                }
                for left in self.candidates.difference(&now) {
                    let candidate = cv1::Candidate {
                        candidate_id: left.clone(),
                        ..Default::default()
                    };
                    out.push(make(
                        Kind::CandidateLeft,
                        self.leader.clone(),
                        Some(candidate),
                    ));
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
    mut events: broadcast::Receiver<AppliedEvents>,
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
        let batch = tokio::select! {
            _ = responses.closed() => return,
            _ = &mut stopped => {
                let _ = responses.send(Err(to_status(Error::Stopped))).await;
                return;
            }
            batch = events.recv() => batch,
        };
        let out = match batch {
            Ok(batch) => {
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
            // Skipped batches cannot be replayed; a fresh CURRENT resynchronises the client.
            Err(broadcast::error::RecvError::Lagged(_)) => {
                view = api
                    .node
                    .read_state(|state| GroupView::current(state, &group));
                cv1::ObserveResponse {
                    header: Some(header(&api, view.revision)),
                    events: vec![view.current_event(&group)],
                }
            }
            Err(broadcast::error::RecvError::Closed) => {
                let _ = responses.send(Err(to_status(Error::Stopped))).await;
                return;
            }
        };
        if responses.send(Ok(out)).await.is_err() {
            return;
        }
    }
}

// ---- Topic ------------------------------------------------------------------------------

/// Topics over the shared [`Api`].
pub struct TopicService {
    pub api: Arc<Api>,
}

fn topic_events_touch(batch: &AppliedEvents, topics: &[String]) -> bool {
    batch
        .events
        .iter()
        .any(|event| matches!(event, Event::Topic(m) if topics.contains(&m.topic)))
}

async fn ack(
    api: &Api,
    ctx: &CallContext,
    message: cv1::AckRequest,
) -> Result<cv1::AckResponse, Status> {
    let command = Request::Ack {
        consumer: message.consumer.clone(),
        topic: message.topic.clone(),
        seq: message.seq,
    };
    api.write(
        ctx,
        command,
        |applied| match answer(&applied)? {
            Response::Acked { cursor } => Ok(cv1::AckResponse {
                header: Some(header(api, applied.output.revision)),
                acked_seq: *cursor,
            }),
            other => Err(unexpected(other)),
        },
        |channel, ctx| {
            let message = message.clone();
            Box::pin(async move {
                let request = Api::forwarded_request(message, &ctx);
                Ok(TopicClient::new(channel).ack(request).await?.into_inner())
            })
        },
    )
    .await
}

#[async_trait]
impl Topic for TopicService {
    async fn publish(
        &self,
        request: tonic::Request<cv1::PublishRequest>,
    ) -> Result<tonic::Response<cv1::PublishResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        let message = request.into_inner();
        if message.topic.is_empty() {
            return Err(invalid("topic name is empty"));
        }
        let api = &self.api;
        let command = Request::Publish {
            topic: message.topic.clone(),
            data: message.data.clone(),
        };
        let response = api
            .write(
                &ctx,
                command,
                |applied| match answer(&applied)? {
                    Response::Published { seq, revision } => Ok(cv1::PublishResponse {
                        header: Some(header(api, *revision)),
                        seq: *seq,
                    }),
                    other => Err(unexpected(other)),
                },
                |channel, ctx| {
                    let message = message.clone();
                    Box::pin(async move {
                        let request = Api::forwarded_request(message, &ctx);
                        Ok(TopicClient::new(channel)
                            .publish(request)
                            .await?
                            .into_inner())
                    })
                },
            )
            .await?;
        Ok(tonic::Response::new(response))
    }

    async fn read(
        &self,
        request: tonic::Request<cv1::ReadRequest>,
    ) -> Result<tonic::Response<cv1::ReadResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        let message = request.into_inner();
        self.api.linearizable_barrier(&ctx).await?;
        let limit = read_limit(message.limit);
        let bytes_max = self.api.config.client_limits.read_response_bytes_max;
        let (read, revision) = self.api.node.read_state(|state| {
            let mut budget = ReadBudget::new(limit, bytes_max);
            (
                state.topic_read_within(&message.topic, message.from_seq, &mut budget),
                state.revision(),
            )
        });
        let next_seq = read
            .messages
            .last()
            .map_or(message.from_seq.max(read.first_seq), |m| m.seq + 1);
        Ok(tonic::Response::new(cv1::ReadResponse {
            header: Some(header(&self.api, revision)),
            next_seq,
            first_retained_seq: read.first_seq,
            messages: read.messages.into_iter().map(message_to_pb).collect(),
        }))
    }

    type SubscribeStream = ReceiverStream<Result<cv1::SubscribeResponse, Status>>;

    async fn subscribe(
        &self,
        request: tonic::Request<cv1::SubscribeRequest>,
    ) -> Result<tonic::Response<Self::SubscribeStream>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        let message = request.into_inner();
        if message.topic.is_empty() {
            return Err(invalid("topic name is empty"));
        }
        // "From now" means after every publish acknowledged before the call.
        self.api.linearizable_barrier(&ctx).await?;
        let api = self.api.clone();
        let (events, next) = api.node.read_state(|state| {
            let next = match message.from_seq {
                0 => state.topic_read(&message.topic, u64::MAX, 1).last_seq + 1,
                from => from,
            };
            (api.node.events.subscribe(), next)
        });
        let (responses, output) = mpsc::channel(STREAM_RESPONSES_MAX);
        tokio::spawn(subscribe_topic(api, message.topic, next, events, responses));
        Ok(tonic::Response::new(ReceiverStream::new(output)))
    }

    async fn inbox(
        &self,
        request: tonic::Request<cv1::InboxRequest>,
    ) -> Result<tonic::Response<cv1::InboxResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        let client = request.remote_addr();
        let mut message = request.into_inner();
        if message.consumer.is_empty() || message.topics.is_empty() {
            return Err(invalid("an inbox needs a consumer and at least one topic"));
        }
        // Each topic once, in the order first named; then the cap on how many.
        let mut seen = std::collections::BTreeSet::new();
        message.topics.retain(|topic| seen.insert(topic.clone()));
        let api = &self.api;
        api.limits.inbox_topics(client, message.topics.len())?;
        api.linearizable_barrier(&ctx).await?;
        let limit = read_limit(message.limit);
        let bytes_max = api.config.client_limits.read_response_bytes_max;
        let read = |state: &StateMachine| {
            let mut budget = ReadBudget::new(limit, bytes_max);
            let pending: Vec<Message> = state
                .inbox_within(&message.consumer, &message.topics, &mut budget)
                .into_iter()
                .flat_map(|read| read.messages)
                .collect();
            (pending, state.revision())
        };
        let (mut pending, mut revision) = api.node.read_state(read);
        if pending.is_empty() && message.wait_ms > 0 {
            let wait = Duration::from_millis(u64::from(message.wait_ms).min(INBOX_WAIT_MAX_MS));
            let deadline = ctx.deadline.min(Instant::now() + wait);
            let found = wait_until(
                api,
                deadline,
                |state| {
                    let (pending, revision) = read(state);
                    (!pending.is_empty()).then_some((pending, revision))
                },
                |batch| topic_events_touch(batch, &message.topics),
            )
            .await?;
            if let Some(found) = found {
                (pending, revision) = found;
            }
        }
        if message.ack {
            // One ack per topic, at the last message returned (cursors never move back). The
            // acks are separate writes, so they cannot share one session position: they go
            // without it (an ack is idempotent anyway).
            let mut ack_ctx = ctx;
            ack_ctx.session = None;
            let mut last: Vec<(String, u64)> = Vec::new();
            for m in &pending {
                match last.iter_mut().find(|(topic, _)| *topic == m.topic) {
                    Some(entry) => entry.1 = entry.1.max(m.seq),
                    None => last.push((m.topic.clone(), m.seq)),
                }
            }
            for (topic, seq) in last {
                let acked = ack(
                    api,
                    &ack_ctx,
                    cv1::AckRequest {
                        consumer: message.consumer.clone(),
                        topic,
                        seq,
                    },
                )
                .await?;
                revision = revision.max(acked.header.map_or(0, |h| h.revision));
            }
        }
        Ok(tonic::Response::new(cv1::InboxResponse {
            header: Some(header(api, revision)),
            messages: pending.into_iter().map(message_to_pb).collect(),
        }))
    }

    async fn ack(
        &self,
        request: tonic::Request<cv1::AckRequest>,
    ) -> Result<tonic::Response<cv1::AckResponse>, Status> {
        let ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        let message = request.into_inner();
        if message.consumer.is_empty() || message.topic.is_empty() {
            return Err(invalid("an ack needs a consumer and a topic"));
        }
        Ok(tonic::Response::new(ack(&self.api, &ctx, message).await?))
    }
}

/// Streams `topic` from `next`: the retained log first, then each publish. Every batch is
/// read from the topic log (events only say "something was published"), so skipped
/// broadcast batches lose nothing unless retention dropped the messages.
async fn subscribe_topic(
    api: Arc<Api>,
    topic: String,
    mut next: u64,
    mut events: broadcast::Receiver<AppliedEvents>,
    responses: mpsc::Sender<Result<cv1::SubscribeResponse, Status>>,
) {
    let topics = [topic.clone()];
    let stopped = node_stopped(&api);
    tokio::pin!(stopped);
    loop {
        // Send everything retained from `next` on, in chunks.
        loop {
            let (read, revision) = api.node.read_state(|state| {
                (
                    state.topic_read(&topic, next, SUBSCRIBE_BATCH_MAX),
                    state.revision(),
                )
            });
            if read.first_seq > next && read.last_seq >= next {
                let _ = responses
                    .send(Err(Status::data_loss(SLOW_SUBSCRIBER_REASON)))
                    .await;
                return;
            }
            let Some(last) = read.messages.last().map(|m| m.seq) else {
                break;
            };
            next = last + 1;
            let full = read.messages.len() >= SUBSCRIBE_BATCH_MAX;
            let response = cv1::SubscribeResponse {
                header: Some(header(&api, revision)),
                messages: read.messages.into_iter().map(message_to_pb).collect(),
            };
            if responses.send(Ok(response)).await.is_err() {
                return;
            }
            if !full {
                break;
            }
        }
        loop {
            let batch = tokio::select! {
                _ = responses.closed() => return,
                _ = &mut stopped => {
                    let _ = responses.send(Err(to_status(Error::Stopped))).await;
                    return;
                }
                batch = events.recv() => batch,
            };
            match batch {
                Ok(batch) if topic_events_touch(&batch, &topics) => break,
                Ok(_) => {}
                Err(broadcast::error::RecvError::Lagged(_)) => break,
                Err(broadcast::error::RecvError::Closed) => {
                    let _ = responses.send(Err(to_status(Error::Stopped))).await;
                    return;
                }
            }
        }
    }
}

// ---- Session ----------------------------------------------------------------------------

/// Exactly-once client sessions over the shared [`Api`]. The positions themselves travel as
/// metadata on each write (see [`super::SESSION_CLIENT_HEADER`]); this service only opens and
/// closes sessions.
pub struct SessionService {
    pub api: Arc<Api>,
}

/// `conclave.v1.Session`, ready for the gRPC router.
pub fn session_server(api: &Arc<Api>) -> SessionServer<SessionService> {
    SessionServer::new(SessionService { api: api.clone() })
}

#[async_trait]
impl SessionApi for SessionService {
    async fn open_session(
        &self,
        request: tonic::Request<cv1::OpenSessionRequest>,
    ) -> Result<tonic::Response<cv1::OpenSessionResponse>, Status> {
        let mut ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        // Opening is not itself part of a session (a repeated open makes a second session,
        // which expires unused).
        ctx.session = None;
        let message = request.into_inner();
        let api = &self.api;
        let session_ttl_ms = api.node.read_state(|state| state.config().session_ttl_ms);
        // Chosen here and carried in the entry, so every replica stores the same secret.
        let secret = super::new_session_secret()?;
        let response = api
            .write(
                &ctx,
                Request::OpenSessionWithSecret { secret },
                |applied| match answer(&applied)? {
                    Response::SessionOpened { client_id } => Ok(cv1::OpenSessionResponse {
                        header: Some(header(api, applied.output.revision)),
                        client_id: *client_id,
                        session_ttl_ms,
                        session_secret: secret.to_be_bytes().to_vec().into(),
                    }),
                    other => Err(unexpected(other)),
                },
                |channel, ctx| {
                    Box::pin(async move {
                        let request = Api::forwarded_request(message, &ctx);
                        Ok(SessionClient::new(channel)
                            .open_session(request)
                            .await?
                            .into_inner())
                    })
                },
            )
            .await?;
        Ok(tonic::Response::new(response))
    }

    async fn close_session(
        &self,
        request: tonic::Request<cv1::CloseSessionRequest>,
    ) -> Result<tonic::Response<cv1::CloseSessionResponse>, Status> {
        let mut ctx = CallContext::new(&request, self.api.config.request_timeout_ms);
        ctx.session = None;
        let message = request.into_inner();
        let api = &self.api;
        let secret = super::session_secret_from_bytes(&message.session_secret)?;
        // Without a secret, only a session opened before secrets can match; the older
        // variant keeps such entries readable by members that predate secrets.
        let command = if secret == 0 {
            Request::CloseSession {
                client_id: message.client_id,
            }
        } else {
            Request::CloseSessionWithSecret {
                client_id: message.client_id,
                secret,
            }
        };
        let response = api
            .write(
                &ctx,
                command,
                |applied| match answer(&applied)? {
                    Response::SessionClosed => Ok(cv1::CloseSessionResponse {
                        header: Some(header(api, applied.output.revision)),
                    }),
                    other => Err(unexpected(other)),
                },
                |channel, ctx| {
                    let message = message.clone();
                    Box::pin(async move {
                        let request = Api::forwarded_request(message, &ctx);
                        Ok(SessionClient::new(channel)
                            .close_session(request)
                            .await?
                            .into_inner())
                    })
                },
            )
            .await?;
        Ok(tonic::Response::new(response))
    }
}

// ---- Status -----------------------------------------------------------------------------

/// Cluster status over the shared [`Api`].
pub struct StatusService {
    pub api: Arc<Api>,
}

/// Asks one member's Maintenance.Status.
async fn probe(
    client_addr: String,
) -> Result<conclave_proto::etcdserverpb::StatusResponse, String> {
    let timeout = Duration::from_millis(STATUS_PROBE_TIMEOUT_MS);
    let endpoint = Endpoint::from_shared(format!("http://{client_addr}"))
        .map_err(|e| format!("bad client address {client_addr}: {e}"))?
        .connect_timeout(timeout)
        .timeout(timeout);
    let call = async move {
        let channel = endpoint.connect().await.map_err(|e| e.to_string())?;
        MaintenanceClient::new(channel)
            .status(StatusRequest {})
            .await
            .map(tonic::Response::into_inner)
            .map_err(|status| status.message().to_string())
    };
    match tokio::time::timeout(timeout, call).await {
        Ok(result) => result,
        Err(_) => Err(format!("no answer within {STATUS_PROBE_TIMEOUT_MS} ms")),
    }
}

#[async_trait]
impl StatusApi for StatusService {
    async fn cluster_status(
        &self,
        _request: tonic::Request<cv1::ClusterStatusRequest>,
    ) -> Result<tonic::Response<cv1::ClusterStatusResponse>, Status> {
        let api = &self.api;
        let status = api.node.status();
        // Every member of the current configuration, members added at run time included.
        let (current, conf) = super::cluster::current_members(api);
        let probes = current.iter().map(|member| {
            let address = member.client_addr.clone();
            async move {
                if address.is_empty() {
                    return Err("its client address is not known yet".to_string());
                }
                probe(address).await
            }
        });
        let answers = futures_join_all(probes.collect()).await;
        let members = current
            .iter()
            .zip(answers)
            .map(|(member, answer)| {
                let mut out = cv1::MemberStatus {
                    id: member.id,
                    name: member.name.clone(),
                    peer_urls: vec![format!("http://{}", member.peer_addr)],
                    client_urls: vec![format!("http://{}", member.client_addr)],
                    learner: conf.learners.contains(&member.id),
                    version: ETCD_VERSION.to_string(),
                    ..Default::default()
                };
                match answer {
                    Ok(remote) => {
                        out.healthy = remote.errors.is_empty();
                        out.raft_term = remote.raft_term;
                        out.raft_index = remote.raft_index;
                        out.commit_index = remote.raft_index;
                        out.applied_index = remote.raft_applied_index;
                        out.db_size_bytes = remote.db_size;
                        out.version = remote.version;
                        out.error = remote.errors.join("; ");
                    }
                    Err(error) => out.error = error,
                }
                out
            })
            .collect();
        let revision = api.node.read_state(|state| state.revision());
        Ok(tonic::Response::new(cv1::ClusterStatusResponse {
            header: Some(header(api, revision)),
            cluster_id: api.cluster_id,
            leader_id: status.leader.unwrap_or(0),
            raft_term: status.term,
            members,
        }))
    }
}

/// Runs the probes concurrently (one task each) and answers in order.
async fn futures_join_all<F>(probes: Vec<F>) -> Vec<F::Output>
where
    F: std::future::Future<Output = Result<conclave_proto::etcdserverpb::StatusResponse, String>>
        + Send
        + 'static,
{
    let tasks: Vec<_> = probes.into_iter().map(tokio::spawn).collect();
    let mut answers = Vec::with_capacity(tasks.len());
    for task in tasks {
        answers.push(match task.await {
            Ok(answer) => answer,
            Err(error) => Err(format!("status probe failed: {error}")),
        });
    }
    answers
}
