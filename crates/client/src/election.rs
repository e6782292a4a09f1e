//! Priority election groups (`conclave.v1.Election`): campaign, leadership with its fencing
//! token, and a `lost()` future that fires no later than the server could expire the lease.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use conclave_proto::conclave::v1 as cv1;
use conclave_proto::conclave::v1::election_client::ElectionClient;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_stream::StreamExt;

use crate::Client;
use crate::conn::{Retry, Shared, queue_wait_slice, request};
use crate::error::{Error, ErrorContext, Result};
use crate::kv::{Compare, CompareOp};
use crate::lease::{GiveUp, LeaseId, LeaseKeepAlive, LeaseState, keepalive_interval, wait_expired};

/// The read-only key mirroring a group's seat; its `create_revision` is the current fence, so
/// `Compare::create_revision(group_leader_key(g), Equal, fence)` fences a KV write.
pub fn group_leader_key(group: &str) -> String {
    format!("/_conclave/elect/{group}/leader")
}

/// A member of a group.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Candidate {
    pub candidate_id: String,
    pub priority: i64,
    pub value: Vec<u8>,
    pub lease: LeaseId,
    pub joined_revision: i64,
    /// How long ago the Raft leader last accepted a keepalive of the candidate's lease
    /// (in [`Election::candidates`] answers; `None` elsewhere or when it has none).
    pub keepalive_age: Option<Duration>,
}

impl From<cv1::Candidate> for Candidate {
    fn from(c: cv1::Candidate) -> Self {
        Candidate {
            candidate_id: c.candidate_id,
            priority: c.priority,
            value: c.value.into(),
            lease: c.lease,
            joined_revision: c.joined_revision,
            keepalive_age: c.keepalive_age_ms.map(Duration::from_millis),
        }
    }
}

/// Who may take a sitting leader's seat.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PreemptPolicy {
    /// Only a strictly higher-priority candidate that campaigns with `preempt`.
    #[default]
    Higher,
    /// Every strictly higher-priority candidate, with or without `preempt`.
    Always,
    /// No candidate: the leader keeps the seat until it resigns or its lease ends.
    Never,
}

/// A group's policy ([`Election::configure`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GroupPolicy {
    /// Fill an empty seat this long after the first live candidate shows up, from everyone
    /// registered by then.
    pub settle: Option<Duration>,
    pub preempt: PreemptPolicy,
    /// A requested handoff completes after this long even if the leader stays.
    pub handoff_timeout: Option<Duration>,
}

fn millis(duration: Option<Duration>) -> u64 {
    duration.map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl From<cv1::GroupPolicy> for GroupPolicy {
    fn from(p: cv1::GroupPolicy) -> Self {
        GroupPolicy {
            settle: (p.settle_ms > 0).then(|| Duration::from_millis(p.settle_ms)),
            preempt: match cv1::PreemptPolicy::try_from(p.preempt_policy) {
                Ok(cv1::PreemptPolicy::Always) => PreemptPolicy::Always,
                Ok(cv1::PreemptPolicy::Never) => PreemptPolicy::Never,
                _ => PreemptPolicy::Higher,
            },
            handoff_timeout: (p.handoff_timeout_ms > 0)
                .then(|| Duration::from_millis(p.handoff_timeout_ms)),
        }
    }
}

impl From<GroupPolicy> for cv1::GroupPolicy {
    fn from(p: GroupPolicy) -> Self {
        cv1::GroupPolicy {
            settle_ms: millis(p.settle),
            preempt_policy: match p.preempt {
                PreemptPolicy::Higher => cv1::PreemptPolicy::Higher,
                PreemptPolicy::Always => cv1::PreemptPolicy::Always,
                PreemptPolicy::Never => cv1::PreemptPolicy::Never,
            } as i32,
            handoff_timeout_ms: millis(p.handoff_timeout),
        }
    }
}

/// One leadership of a group, as the server reports it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LeaderInfo {
    pub group: String,
    pub leader: Candidate,
    /// Count of leader changes in the group.
    pub term: u64,
    /// Fencing token: strictly increasing over the group's leaderships.
    pub fence: u64,
    pub elected_revision: i64,
    /// A higher-priority candidate that asked for the seat (`preempt`) and waits for this
    /// leader to resign; `None` when no handoff is pending.
    pub handoff_to: Option<Candidate>,
    /// When the leadership began, on the Raft leader's clock, in Unix milliseconds (0 from
    /// servers that do not say).
    pub elected_unix_ms: i64,
}

impl From<cv1::Leadership> for LeaderInfo {
    fn from(l: cv1::Leadership) -> Self {
        LeaderInfo {
            group: l.group,
            leader: l.leader.map(Candidate::from).unwrap_or_default(),
            term: l.term,
            fence: l.fence,
            elected_revision: l.elected_revision,
            handoff_to: l.handoff_to.map(Candidate::from),
            elected_unix_ms: l.elected_unix_ms,
        }
    }
}

/// Options of [`Election::campaign`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CampaignOptions {
    /// TTL of the lease the client grants for the candidacy (ignored with `lease`).
    pub ttl: Duration,
    /// Campaign under an existing lease instead; the client still sends keepalives for it
    /// (it needs acknowledgements to know how long it may lead) but does not revoke it.
    pub lease: Option<LeaseId>,
    /// Ask a lower-priority leader for the seat instead of waiting for it to go: the leader
    /// is told ([`Leadership::handoff_requested`]) and the seat moves when it resigns (or its
    /// lease ends).
    pub preempt: bool,
    /// Give up waiting after this long ([`Error::Timeout`]); `None` waits for ever.
    pub timeout: Option<Duration>,
}

impl Default for CampaignOptions {
    fn default() -> Self {
        CampaignOptions {
            ttl: Duration::from_secs(10),
            lease: None,
            preempt: false,
            timeout: None,
        }
    }
}

/// Why a leadership ended.
#[derive(Debug, Clone, PartialEq, Eq)]
// One value per lost leadership: its size does not matter, boxing would only burden callers.
#[allow(clippy::large_enum_variant)]
pub enum LossReason {
    /// [`Leadership::resign`] was called.
    Resigned,
    /// Another candidate holds the seat now (handoff, preemption), or the seat is vacant.
    Deposed { new_leader: Option<LeaderInfo> },
    /// The lease expired, was revoked, or was not confirmed in time (local deadline).
    LeaseExpired { reason: String },
}

/// Registration without waiting ([`Election::register`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    pub elected: bool,
    pub leadership: Option<LeaderInfo>,
}

/// Kinds of [`ElectionEvent`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ElectionEventKind {
    Elected,
    Proclaimed,
    Resigned,
    Deposed,
    Expired,
    CandidateJoined,
    CandidateLeft,
    /// The first event of every observe stream (and after each reconnect): the state then.
    Current,
    /// A higher-priority candidate (`candidate`) asked the leader for the seat.
    HandoffRequested,
    /// The pending handoff is off (the challenger left or lost its edge).
    HandoffCancelled,
    Unknown,
}

/// One event of a group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElectionEvent {
    pub kind: ElectionEventKind,
    pub group: String,
    /// The leadership after the event; `None` when the seat is vacant.
    pub leadership: Option<LeaderInfo>,
    /// The candidate the event is about.
    pub candidate: Option<Candidate>,
    pub revision: i64,
}

impl From<cv1::ElectionEvent> for ElectionEvent {
    fn from(e: cv1::ElectionEvent) -> Self {
        use cv1::election_event::Kind;
        let kind = match Kind::try_from(e.kind) {
            Ok(Kind::Elected) => ElectionEventKind::Elected,
            Ok(Kind::Proclaimed) => ElectionEventKind::Proclaimed,
            Ok(Kind::Resigned) => ElectionEventKind::Resigned,
            Ok(Kind::Deposed) => ElectionEventKind::Deposed,
            Ok(Kind::Expired) => ElectionEventKind::Expired,
            Ok(Kind::CandidateJoined) => ElectionEventKind::CandidateJoined,
            Ok(Kind::CandidateLeft) => ElectionEventKind::CandidateLeft,
            Ok(Kind::Current) => ElectionEventKind::Current,
            Ok(Kind::HandoffRequested) => ElectionEventKind::HandoffRequested,
            Ok(Kind::HandoffCancelled) => ElectionEventKind::HandoffCancelled,
            Ok(Kind::Unspecified) | Err(_) => ElectionEventKind::Unknown,
        };
        ElectionEvent {
            kind,
            group: e.group,
            leadership: e.leadership.map(LeaderInfo::from),
            candidate: e.candidate.map(Candidate::from),
            revision: e.revision,
        }
    }
}

/// Whether an event ends the leadership with fence `fence`, and why.
pub(crate) fn loss_from_event(fence: u64, event: &ElectionEvent) -> Option<LossReason> {
    match &event.leadership {
        Some(current) if current.fence == fence => None,
        // An event about an older leadership (replayed history) says nothing about ours.
        Some(current) if current.fence < fence => None,
        other => Some(match event.kind {
            ElectionEventKind::Expired => LossReason::LeaseExpired {
                reason: "the server expired the leader's lease".into(),
            },
            _ => LossReason::Deposed {
                new_leader: other.clone(),
            },
        }),
    }
}

/// What an event says about a handoff of the leadership with fence `fence`: `Some(Some(c))`
/// while challenger `c` waits for the seat, `Some(None)` when none is pending, `None` when the
/// event is about another leadership (or says nothing about one).
pub(crate) fn handoff_from_event(fence: u64, event: &ElectionEvent) -> Option<Option<Candidate>> {
    let current = event.leadership.as_ref().filter(|l| l.fence == fence)?;
    Some(current.handoff_to.clone())
}

/// Priority election groups.
#[derive(Clone)]
pub struct Election {
    client: Client,
}

fn election_client(channel: crate::conn::Channel) -> ElectionClient<crate::conn::Channel> {
    ElectionClient::new(channel)
}

impl Election {
    pub(crate) fn new(client: Client) -> Self {
        Election { client }
    }

    fn inner(&self) -> &Shared {
        &self.client.inner
    }

    /// Joins `group` and waits until elected. The returned [`Leadership`] keeps the lease
    /// alive; dropping it stops the keepalives and revokes a lease the client granted (so the
    /// seat passes at once).
    pub async fn campaign(
        &self,
        group: &str,
        candidate_id: &str,
        priority: i64,
        value: impl Into<Vec<u8>>,
        options: CampaignOptions,
    ) -> Result<Leadership> {
        if group.is_empty() || candidate_id.is_empty() {
            return Err(Error::InvalidArgument(
                "a campaign needs a group and a candidate id".into(),
            ));
        }
        let keeper = match options.lease {
            Some(id) => self.client.lease_keep_alive(id),
            None => self.client.lease_grant_kept(options.ttl).await?,
        };
        let give_up = options.timeout.map(|t| Instant::now() + t);
        let message = cv1::CampaignRequest {
            group: group.to_string(),
            candidate_id: candidate_id.to_string(),
            priority,
            value: value.into().into(),
            lease: keeper.id(),
            preempt: options.preempt,
            wait: true,
        };
        let mut expired = Box::pin(keeper.expired());
        let mut first = true;
        let elected = loop {
            // One blocking call at a time; the server answers by its own deadline, and
            // re-registering under the same lease changes nothing, so we simply ask again.
            let Some(slice) = queue_wait_slice(give_up, first) else {
                return Err(Error::Timeout(format!(
                    "not elected in group {group:?} within the campaign timeout"
                )));
            };
            first = false;
            let call = self.inner().call_in_session(
                Retry::Idempotent,
                ErrorContext {
                    lease_id: keeper.id(),
                    revision: 0,
                },
                slice,
                |channel, timeout, at| {
                    let message = message.clone();
                    async move {
                        election_client(channel)
                            .campaign(at.request(message, timeout))
                            .await
                    }
                },
            );
            let answer = tokio::select! {
                answer = call => answer,
                reason = &mut expired => {
                    return Err(Error::LeaseExpired { lease_id: keeper.id(), message: reason });
                }
            };
            match answer {
                Ok(answer) => {
                    let answer = answer.into_inner();
                    if answer.elected
                        && let Some(leadership) = answer.leadership
                    {
                        break LeaderInfo::from(leadership);
                    }
                }
                Err(Error::Timeout(_)) => {}
                Err(error) => return Err(error),
            }
        };
        Ok(Leadership::start(
            self.client.clone(),
            candidate_id.to_string(),
            elected,
            keeper,
        ))
    }

    /// Registers (or updates) a candidacy under an existing lease and answers at once with
    /// who leads; the caller keeps the lease alive (the CLI's `--no-wait`).
    pub async fn register(
        &self,
        group: &str,
        candidate_id: &str,
        priority: i64,
        value: impl Into<Vec<u8>>,
        lease: LeaseId,
        preempt: bool,
    ) -> Result<Registration> {
        let message = cv1::CampaignRequest {
            group: group.to_string(),
            candidate_id: candidate_id.to_string(),
            priority,
            value: value.into().into(),
            lease,
            preempt,
            wait: false,
        };
        let context = ErrorContext {
            lease_id: lease,
            revision: 0,
        };
        let answer = self
            .client
            .call_in_session(Retry::Idempotent, context, |channel, timeout, at| {
                let message = message.clone();
                async move {
                    election_client(channel)
                        .campaign(at.request(message, timeout))
                        .await
                }
            })
            .await?
            .into_inner();
        Ok(Registration {
            elected: answer.elected,
            leadership: answer.leadership.map(LeaderInfo::from),
        })
    }

    /// Withdraws `candidate_id` from `group` (fence 0: whether or not it leads). Answers
    /// whether it was leading.
    pub async fn resign(&self, group: &str, candidate_id: &str, fence: u64) -> Result<bool> {
        resign(&self.client, group, candidate_id, fence).await
    }

    /// The group's current leadership, `None` when the seat is vacant.
    pub async fn leader(&self, group: &str) -> Result<Option<LeaderInfo>> {
        Ok(self.leader_and_policy(group).await?.0)
    }

    /// The group's current leadership (`None` when the seat is vacant) and its policy.
    pub async fn leader_and_policy(
        &self,
        group: &str,
    ) -> Result<(Option<LeaderInfo>, GroupPolicy)> {
        let message = cv1::LeaderRequest {
            group: group.to_string(),
        };
        let answer = self
            .client
            .call(
                Retry::Idempotent,
                ErrorContext::default(),
                |channel, timeout| {
                    let message = message.clone();
                    async move {
                        election_client(channel)
                            .leader(request(message, timeout))
                            .await
                    }
                },
            )
            .await;
        match answer {
            Ok(answer) => {
                let answer = answer.into_inner();
                Ok((
                    answer.leadership.map(LeaderInfo::from),
                    answer.policy.map(GroupPolicy::from).unwrap_or_default(),
                ))
            }
            // etcd-style servers answer "no leader" as NotFound.
            Err(Error::NotFound(_)) => Ok((None, GroupPolicy::default())),
            Err(error) => Err(error),
        }
    }

    /// The group's candidates in election order (leader first).
    pub async fn candidates(&self, group: &str) -> Result<Vec<Candidate>> {
        Ok(self.candidates_and_policy(group).await?.0)
    }

    /// The group's candidates in election order (leader first), with their keepalive ages,
    /// and the group's policy.
    pub async fn candidates_and_policy(
        &self,
        group: &str,
    ) -> Result<(Vec<Candidate>, GroupPolicy)> {
        let message = cv1::CandidatesRequest {
            group: group.to_string(),
        };
        let answer = self
            .client
            .call(
                Retry::Idempotent,
                ErrorContext::default(),
                |channel, timeout| {
                    let message = message.clone();
                    async move {
                        election_client(channel)
                            .candidates(request(message, timeout))
                            .await
                    }
                },
            )
            .await?
            .into_inner();
        Ok((
            answer.candidates.into_iter().map(Candidate::from).collect(),
            answer.policy.map(GroupPolicy::from).unwrap_or_default(),
        ))
    }

    /// Sets the group's policy (creating the group if needed); answers the policy now in
    /// force. Setting the same policy twice is harmless, so it is retried freely.
    pub async fn configure(&self, group: &str, policy: GroupPolicy) -> Result<GroupPolicy> {
        if group.is_empty() {
            return Err(Error::InvalidArgument("a group needs a name".into()));
        }
        let message = cv1::ConfigureRequest {
            group: group.to_string(),
            policy: Some(policy.into()),
        };
        let answer = self
            .client
            .call(
                Retry::Idempotent,
                ErrorContext::default(),
                |channel, timeout| {
                    let message = message.clone();
                    async move {
                        election_client(channel)
                            .configure(request(message, timeout))
                            .await
                    }
                },
            )
            .await?
            .into_inner();
        Ok(answer.policy.map(GroupPolicy::from).unwrap_or_default())
    }

    /// A stream of the group's events, starting with a `Current` event. Survives reconnects:
    /// it resumes after the last delivered revision (preceded by a fresh `Current`).
    pub async fn observe(&self, group: &str) -> Result<ElectionEvents> {
        observe(self.inner().clone(), group.to_string(), 0).await
    }
}

async fn resign(client: &Client, group: &str, candidate_id: &str, fence: u64) -> Result<bool> {
    let message = cv1::ResignRequest {
        group: group.to_string(),
        candidate_id: candidate_id.to_string(),
        fence,
    };
    let answer = client
        .call_in_session(
            Retry::Idempotent,
            ErrorContext::default(),
            |channel, timeout, at| {
                let message = message.clone();
                async move {
                    election_client(channel)
                        .resign(at.request(message, timeout))
                        .await
                }
            },
        )
        .await?;
    Ok(answer.into_inner().was_leader)
}

/// Opens an observe stream, confirming the server accepted it before returning.
async fn open_observe(
    inner: &Shared,
    group: &str,
    start_revision: i64,
) -> Result<tonic::Streaming<cv1::ObserveResponse>> {
    let message = cv1::ObserveRequest {
        group: group.to_string(),
        start_revision,
    };
    let answer = inner
        .call(
            Retry::Idempotent,
            ErrorContext {
                lease_id: 0,
                revision: start_revision,
            },
            inner.options.request_timeout,
            |channel, _| {
                let message = message.clone();
                // No deadline on the stream itself: it lives as long as the observer.
                async move { election_client(channel).observe(message).await }
            },
        )
        .await?;
    Ok(answer.into_inner())
}

async fn observe(inner: Shared, group: String, start_revision: i64) -> Result<ElectionEvents> {
    let first = open_observe(&inner, &group, start_revision).await?;
    let (tx, rx) = mpsc::channel(256);
    let task = tokio::spawn(observe_task(inner, group, first, tx));
    Ok(ElectionEvents { events: rx, task })
}

async fn observe_task(
    inner: Shared,
    group: String,
    first: tonic::Streaming<cv1::ObserveResponse>,
    out: mpsc::Sender<Result<ElectionEvent>>,
) {
    let mut stream = Some(first);
    let mut last_seen = 0i64;
    let mut failures = 0u32;
    loop {
        let mut current = match stream.take() {
            Some(s) => s,
            None => {
                let from = if last_seen > 0 { last_seen + 1 } else { 0 };
                match open_observe(&inner, &group, from).await {
                    Ok(s) => {
                        failures = 0;
                        s
                    }
                    Err(error) if error.is_transient() || error.code() == "timeout" => {
                        tokio::time::sleep(inner.options.backoff.delay(failures)).await;
                        failures = failures.saturating_add(1);
                        continue;
                    }
                    Err(error) => {
                        let _ = out.send(Err(error)).await;
                        return;
                    }
                }
            }
        };
        loop {
            let answer = tokio::select! {
                answer = current.next() => answer,
                () = out.closed() => return,
            };
            match answer {
                Some(Ok(answer)) => {
                    for event in answer.events {
                        let event = ElectionEvent::from(event);
                        last_seen = last_seen.max(event.revision);
                        if out.send(Ok(event)).await.is_err() {
                            return;
                        }
                    }
                }
                Some(Err(status)) => {
                    let error = Error::status(&status);
                    if !error.is_transient() {
                        let _ = out.send(Err(error)).await;
                        return;
                    }
                    break;
                }
                None => break,
            }
        }
        tokio::time::sleep(inner.options.backoff.delay(failures)).await;
        failures = failures.saturating_add(1);
    }
}

/// A stream of election events; see [`Election::observe`]. Dropping it ends the observation.
pub struct ElectionEvents {
    events: mpsc::Receiver<Result<ElectionEvent>>,
    task: JoinHandle<()>,
}

impl ElectionEvents {
    pub async fn next(&mut self) -> Option<Result<ElectionEvent>> {
        self.events.recv().await
    }
}

impl tokio_stream::Stream for ElectionEvents {
    type Item = Result<ElectionEvent>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.events.poll_recv(cx)
    }
}

impl Drop for ElectionEvents {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Holding a group's seat. See [`Leadership::lost`] for when it ends.
pub struct Leadership {
    client: Client,
    candidate_id: String,
    info: LeaderInfo,
    keeper: Option<LeaseKeepAlive>,
    lost_tx: watch::Sender<Option<LossReason>>,
    /// The challenger waiting for the seat, as the group's events last said.
    handoff_tx: watch::Sender<Option<Candidate>>,
    monitor: JoinHandle<()>,
}

impl Leadership {
    fn start(
        client: Client,
        candidate_id: String,
        info: LeaderInfo,
        keeper: LeaseKeepAlive,
    ) -> Self {
        let (lost_tx, _) = watch::channel(None);
        let (handoff_tx, _) = watch::channel(info.handoff_to.clone());
        let monitor = tokio::spawn(monitor(
            client.inner.clone(),
            info.group.clone(),
            info.fence,
            info.elected_revision,
            (keeper.subscribe(), keeper.give_up_handle(), keeper.id()),
            lost_tx.clone(),
            handoff_tx.clone(),
        ));
        Leadership {
            client,
            candidate_id,
            info,
            keeper: Some(keeper),
            lost_tx,
            handoff_tx,
            monitor,
        }
    }

    pub fn group(&self) -> &str {
        &self.info.group
    }

    pub fn candidate_id(&self) -> &str {
        &self.candidate_id
    }

    /// The group's term when this leadership began.
    pub fn term(&self) -> u64 {
        self.info.term
    }

    /// This leadership's fencing token.
    pub fn fence(&self) -> u64 {
        self.info.fence
    }

    /// What the server said when electing us.
    pub fn info(&self) -> &LeaderInfo {
        &self.info
    }

    pub fn lease_id(&self) -> LeaseId {
        self.keeper.as_ref().map_or(0, LeaseKeepAlive::id)
    }

    /// Until when the lease is known alive (local, safety margins applied).
    pub fn lease_deadline(&self) -> Option<Instant> {
        self.keeper.as_ref().and_then(LeaseKeepAlive::deadline)
    }

    /// The compare that makes a KV transaction apply only while this leadership lasts.
    pub fn fence_compare(&self) -> Compare {
        Compare::create_revision(
            group_leader_key(&self.info.group),
            CompareOp::Equal,
            i64::try_from(self.info.fence).unwrap_or(i64::MAX),
        )
    }

    /// `Some(reason)` once the leadership is over.
    pub fn lost_reason(&self) -> Option<LossReason> {
        let recorded = self.lost_tx.borrow().clone();
        recorded.or_else(|| match self.keeper.as_ref().map(LeaseKeepAlive::state) {
            Some(LeaseState::Expired { reason }) => Some(LossReason::LeaseExpired { reason }),
            _ => None,
        })
    }

    /// Resolves when the leadership is gone: resigned, deposed (handoff, preemption), or the
    /// lease expired — by the server's word or because no keepalive sent in the last
    /// TTL minus the safety margin was acknowledged (see `lease` module docs for the clock
    /// assumption). Safe to call many times; does not borrow `self`.
    pub fn lost(&self) -> impl Future<Output = LossReason> + Send + 'static {
        let mut lost = self.lost_tx.subscribe();
        let mut lease = self
            .keeper
            .as_ref()
            .map(|keeper| (keeper.subscribe(), keeper.give_up_handle(), keeper.id()));
        let has_lease = lease.is_some();
        async move {
            let lease_expired = async {
                match lease.as_mut() {
                    Some((state, give_up, id)) => wait_expired(state, give_up, *id).await,
                    None => std::future::pending().await,
                }
            };
            let recorded = async {
                loop {
                    if let Some(reason) = lost.borrow_and_update().clone() {
                        return reason;
                    }
                    if lost.changed().await.is_err() {
                        // The handle went away without a recorded reason (abandoned, as a
                        // crash would): the lease alone decides when leadership is gone.
                        if has_lease {
                            std::future::pending::<()>().await;
                        }
                        return LossReason::Resigned;
                    }
                }
            };
            // Biased: `resign` records its reason before it stops the keepalive task, so when
            // both are ready the recorded reason is the true one.
            tokio::select! {
                biased;
                reason = recorded => reason,
                reason = lease_expired => LossReason::LeaseExpired { reason },
            }
        }
    }

    /// The higher-priority candidate waiting for this seat, if a handoff is pending.
    pub fn handoff(&self) -> Option<Candidate> {
        self.handoff_tx.borrow().clone()
    }

    /// Resolves with the challenger when a higher-priority candidate asks for the seat with
    /// preemption (at once if one already has). The seat stays ours until we resign or the
    /// lease ends, so this is the moment to stop the work guarded by the fence and call
    /// [`Leadership::resign`]; [`Leadership::lost`] fires when the seat is gone. A handoff
    /// that is called off before this resolves (the challenger left) is not reported.
    /// Safe to call many times; does not borrow `self`.
    pub fn handoff_requested(&self) -> impl Future<Output = Candidate> + Send + 'static {
        let mut handoff = self.handoff_tx.subscribe();
        async move {
            loop {
                if let Some(challenger) = handoff.borrow_and_update().clone() {
                    return challenger;
                }
                if handoff.changed().await.is_err() {
                    // The leadership handle is gone: no handoff will ever be reported.
                    return std::future::pending().await;
                }
            }
        }
    }

    /// Publishes a new value for this leadership (refused with `leadership_lost` when the
    /// fence is stale).
    pub async fn proclaim(&self, value: impl Into<Vec<u8>>) -> Result<()> {
        if let Some(reason) = self.lost_reason() {
            return Err(Error::LeadershipLost(format!("{reason:?}")));
        }
        let message = cv1::ProclaimRequest {
            group: self.info.group.clone(),
            candidate_id: self.candidate_id.clone(),
            fence: self.info.fence,
            value: value.into().into(),
        };
        self.client
            .call_in_session(
                Retry::Idempotent,
                ErrorContext::default(),
                |channel, timeout, at| {
                    let message = message.clone();
                    async move {
                        election_client(channel)
                            .proclaim(at.request(message, timeout))
                            .await
                    }
                },
            )
            .await?;
        Ok(())
    }

    /// Resigns this leadership (fenced: a stale fence changes nothing) and leaves the group;
    /// answers whether we were still leading.
    pub async fn resign(mut self) -> Result<bool> {
        // The seat change our resignation causes is not a deposition: stop watching first, so
        // `lost()` says `Resigned` (unless a loss was already recorded before this call).
        self.monitor.abort();
        let was_leader = resign(
            &self.client,
            &self.info.group,
            &self.candidate_id,
            self.info.fence,
        )
        .await;
        // Leave the group even if the fence is stale, so we do not get elected again later.
        let _ = resign(&self.client, &self.info.group, &self.candidate_id, 0).await;
        self.lost_tx.send_if_modified(|slot| {
            if slot.is_none() {
                *slot = Some(LossReason::Resigned);
                true
            } else {
                false
            }
        });
        if let Some(keeper) = self.keeper.take() {
            drop(keeper);
        }
        was_leader
    }

    /// Stops heartbeating without resigning or revoking, as a crashed process would: the seat
    /// moves when the server expires the lease. For demonstrations and failover tests.
    pub fn abandon(mut self) {
        self.monitor.abort();
        if let Some(keeper) = self.keeper.take() {
            keeper.stop();
        }
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        self.monitor.abort();
    }
}

/// Watches the group (falling back to polling the leader) and records the first loss.
async fn monitor(
    inner: Shared,
    group: String,
    fence: u64,
    elected_revision: i64,
    // The lease's state, what gives it up at its local deadline, and its id.
    (mut lease, give_up, lease_id): (watch::Receiver<LeaseState>, Arc<GiveUp>, LeaseId),
    lost: watch::Sender<Option<LossReason>>,
    handoff: watch::Sender<Option<Candidate>>,
) {
    let note_handoff = |pending: Option<Candidate>| {
        handoff.send_if_modified(|slot| {
            let changed = *slot != pending;
            *slot = pending;
            changed
        });
    };
    let lease_view = lease.clone();
    let observing = async {
        let client = Client {
            inner: inner.clone(),
        };
        let mut failures = 0u32;
        loop {
            match observe(inner.clone(), group.clone(), elected_revision).await {
                Ok(mut events) => {
                    while let Some(event) = events.next().await {
                        match event {
                            Ok(event) => {
                                if let Some(reason) = loss_from_event(fence, &event) {
                                    return reason;
                                }
                                if let Some(pending) = handoff_from_event(fence, &event) {
                                    note_handoff(pending);
                                }
                            }
                            Err(_) => break,
                        }
                    }
                }
                Err(error) => {
                    tracing::debug!(%error, %group, "observe failed; polling the leader");
                }
            }
            // Observe unavailable (or ended): ask directly, then try observing again.
            let interval = match &*lease_view.borrow() {
                LeaseState::Alive { ttl, .. } => keepalive_interval(*ttl),
                _ => Duration::from_secs(1),
            };
            match client.election().leader(&group).await {
                Ok(Some(current)) if current.fence == fence => note_handoff(current.handoff_to),
                Ok(current) => {
                    return LossReason::Deposed {
                        new_leader: current,
                    };
                }
                Err(_) => {}
            }
            tokio::time::sleep(interval.min(inner.options.backoff.delay(failures))).await;
            failures = failures.saturating_add(1);
        }
    };
    let reason = tokio::select! {
        reason = observing => reason,
        reason = wait_expired(&mut lease, &give_up, lease_id) => LossReason::LeaseExpired { reason },
    };
    lost.send_if_modified(|slot| {
        if slot.is_none() {
            *slot = Some(reason);
            true
        } else {
            false
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leadership(fence: u64, id: &str) -> LeaderInfo {
        LeaderInfo {
            group: "g".into(),
            leader: Candidate {
                candidate_id: id.into(),
                ..Default::default()
            },
            term: fence,
            fence,
            elected_revision: fence as i64,
            handoff_to: None,
            elected_unix_ms: 0,
        }
    }

    fn event(kind: ElectionEventKind, leadership: Option<LeaderInfo>) -> ElectionEvent {
        ElectionEvent {
            kind,
            group: "g".into(),
            leadership,
            candidate: None,
            revision: 1,
        }
    }

    #[test]
    fn events_decide_loss() {
        use ElectionEventKind::*;
        let mine = 10;
        assert_eq!(
            loss_from_event(mine, &event(Current, Some(leadership(10, "a")))),
            None
        );
        assert_eq!(
            loss_from_event(mine, &event(Proclaimed, Some(leadership(10, "a")))),
            None
        );
        // Replayed history from before our election.
        assert_eq!(
            loss_from_event(mine, &event(Elected, Some(leadership(7, "b")))),
            None
        );
        assert_eq!(
            loss_from_event(mine, &event(Deposed, Some(leadership(12, "b")))),
            Some(LossReason::Deposed {
                new_leader: Some(leadership(12, "b"))
            })
        );
        assert!(matches!(
            loss_from_event(mine, &event(Expired, None)),
            Some(LossReason::LeaseExpired { .. })
        ));
        assert_eq!(
            loss_from_event(mine, &event(Resigned, None)),
            Some(LossReason::Deposed { new_leader: None })
        );
    }

    #[test]
    fn events_decide_handoff() {
        use ElectionEventKind::*;
        let challenger = Candidate {
            candidate_id: "high".into(),
            priority: 9,
            ..Default::default()
        };
        let mut asked = leadership(10, "a");
        asked.handoff_to = Some(challenger.clone());
        assert_eq!(
            handoff_from_event(10, &event(HandoffRequested, Some(asked.clone()))),
            Some(Some(challenger.clone()))
        );
        // Any later event of our leadership repeats it, and a fresh CURRENT carries it.
        assert_eq!(
            handoff_from_event(10, &event(Current, Some(asked.clone()))),
            Some(Some(challenger))
        );
        assert_eq!(
            handoff_from_event(10, &event(HandoffCancelled, Some(leadership(10, "a")))),
            Some(None)
        );
        // Another leadership's handoff is not ours.
        assert_eq!(
            handoff_from_event(10, &event(HandoffRequested, Some(leadership(7, "b")))),
            None
        );
        assert_eq!(handoff_from_event(10, &event(Resigned, None)), None);
        // A handoff request is not a loss: the seat is still ours.
        assert_eq!(
            loss_from_event(10, &event(HandoffRequested, Some(asked))),
            None
        );
        let wire = cv1::ElectionEvent {
            kind: cv1::election_event::Kind::HandoffRequested as i32,
            ..Default::default()
        };
        assert_eq!(ElectionEvent::from(wire).kind, HandoffRequested);
    }

    #[test]
    fn fence_key_and_event_kinds() {
        assert_eq!(
            group_leader_key("workers"),
            "/_conclave/elect/workers/leader"
        );
        let wire = cv1::ElectionEvent {
            kind: cv1::election_event::Kind::CandidateJoined as i32,
            group: "g".into(),
            ..Default::default()
        };
        assert_eq!(
            ElectionEvent::from(wire).kind,
            ElectionEventKind::CandidateJoined
        );
        let unknown = cv1::ElectionEvent {
            kind: 99,
            ..Default::default()
        };
        assert_eq!(
            ElectionEvent::from(unknown).kind,
            ElectionEventKind::Unknown
        );
    }
}
