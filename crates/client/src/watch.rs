//! Watches that survive reconnects: after a broken stream the watch is re-created on a working
//! member from the last delivered revision + 1, so no event is lost or repeated.

use std::pin::Pin;
use std::task::{Context, Poll};

use conclave_proto::etcdserverpb as pb;
use conclave_proto::etcdserverpb::kv_client::KvClient;
use conclave_proto::etcdserverpb::watch_client::WatchClient;
use conclave_proto::mvccpb;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;

use crate::Client;
use crate::conn::{Retry, Shared, request};
use crate::error::{Error, ErrorContext, Result};
use crate::kv::{KeyValue, prefix_end};

/// Options of [`Client::watch`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WatchOptions {
    pub prefix: bool,
    pub range_end: Option<Vec<u8>>,
    /// First revision to report (inclusive); 0 means "from now".
    pub start_revision: i64,
    /// Include each key's previous value.
    pub prev_kv: bool,
}

impl WatchOptions {
    pub fn prefix() -> Self {
        WatchOptions {
            prefix: true,
            ..WatchOptions::default()
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    Put,
    Delete,
}

/// One change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchEvent {
    pub kind: EventType,
    /// For a delete, the key and the deleting revision (`mod_revision`).
    pub kv: KeyValue,
    pub prev_kv: Option<KeyValue>,
}

impl WatchEvent {
    /// The revision of the write that caused the event.
    pub fn revision(&self) -> i64 {
        self.kv.mod_revision
    }
}

impl From<mvccpb::Event> for WatchEvent {
    fn from(event: mvccpb::Event) -> Self {
        WatchEvent {
            kind: if event.r#type == mvccpb::event::EventType::Delete as i32 {
                EventType::Delete
            } else {
                EventType::Put
            },
            kv: event.kv.map(KeyValue::from).unwrap_or_default(),
            prev_kv: event.prev_kv.map(KeyValue::from),
        }
    }
}

/// A stream of watch events; ends after an error that retrying cannot fix (compaction, a
/// refused watch). Dropping it cancels the watch.
pub struct Watcher {
    events: mpsc::Receiver<Result<WatchEvent>>,
    task: JoinHandle<()>,
}

impl Watcher {
    /// The next event; `None` after the watch ended (the error, if any, came just before).
    pub async fn next(&mut self) -> Option<Result<WatchEvent>> {
        self.events.recv().await
    }
}

impl tokio_stream::Stream for Watcher {
    type Item = Result<WatchEvent>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.events.poll_recv(cx)
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Client {
    /// Watches a key, prefix or range. The watch follows the client across members.
    pub async fn watch(&self, key: impl Into<Vec<u8>>, options: WatchOptions) -> Result<Watcher> {
        let key = key.into();
        if key.is_empty() {
            return Err(Error::InvalidArgument("a watch needs a key".into()));
        }
        let range_end = match (&options.range_end, options.prefix) {
            (Some(end), _) => end.clone(),
            (None, true) => prefix_end(&key),
            (None, false) => Vec::new(),
        };
        let create = pb::WatchCreateRequest {
            key: key.into(),
            range_end: range_end.into(),
            start_revision: options.start_revision,
            progress_notify: true,
            prev_kv: options.prev_kv,
            ..Default::default()
        };
        let (tx, rx) = mpsc::channel(256);
        // Establish the first stream before returning, so "from now" means now.
        let first = open(&self.inner, create.clone()).await?;
        let task = tokio::spawn(watch_task(self.inner.clone(), create, first, tx));
        Ok(Watcher { events: rx, task })
    }
}

/// How long a stream may stay silent before the watch asks whether its member still keeps up.
/// A member cut off from the leader (partitioned, or removed and still running) keeps the
/// stream open and answers HTTP/2 pings, but applies nothing, so the watch must leave it by
/// itself (docs/faults.md, finding 6); so must it leave a member that names a leader but does
/// not apply what the cluster commits, such as a learner that cannot install the leader's
/// snapshot (finding 7). A check costs one Status call and one linearizable read, and only
/// a stream silent this long is checked.
pub(crate) const SILENCE_CHECK: std::time::Duration = std::time::Duration::from_secs(2);

/// Whether a member whose Status shows `member_revision` keeps up: it must have applied the
/// revision the cluster had at the previous silence check (`cluster_revision_before`, `None`
/// before the first check). A member slightly behind passes, since it had a whole check
/// interval to get there; one that stays behind (a stale learner hearing only heartbeats)
/// does not.
pub(crate) fn keeps_up(cluster_revision_before: Option<i64>, member_revision: i64) -> bool {
    cluster_revision_before.is_none_or(|cluster| member_revision >= cluster)
}

/// The revision the cluster has now, for the next silence check to hold the member to: the
/// header of a linearizable (leader-confirmed) count-only read of the watched key (its first key alone,
/// so the read stays cheap for a prefix), or — when
/// that read fails, as it does through a member that cannot catch up — at least `known`, a
/// revision the watch has seen the cluster reach. `None` when neither says anything.
async fn cluster_revision(
    inner: &Shared,
    watched: &pb::WatchCreateRequest,
    known: i64,
) -> Option<i64> {
    let message = pb::RangeRequest {
        key: watched.key.clone(),
        count_only: true,
        ..Default::default()
    };
    // A short bound: the watch's stream is not read while this runs.
    let read = inner
        .call(
            Retry::Idempotent,
            ErrorContext::default(),
            SILENCE_CHECK,
            |channel, timeout| {
                let message = message.clone();
                async move {
                    KvClient::new(channel)
                        .range(request(message, timeout))
                        .await
                }
            },
        )
        .await;
    let read = read
        .ok()
        .and_then(|answer| answer.into_inner().header)
        .map_or(0, |header| header.revision);
    let revision = read.max(known);
    (revision > 0).then_some(revision)
}

struct Open {
    /// Keeps the request side open; etcd ends a watch stream whose client half closes.
    _requests: mpsc::Sender<pb::WatchRequest>,
    answers: tonic::Streaming<pb::WatchResponse>,
    /// The connection the stream is on, to ask its member for its status.
    channel: crate::conn::Channel,
    generation: u64,
    /// Where the stream starts, once the server confirmed the creation.
    created_revision: Option<i64>,
}

/// Opens a stream and creates the watch on it, waiting for the server's confirmation.
async fn open(inner: &Shared, create: pb::WatchCreateRequest) -> Result<Open> {
    let context = ErrorContext {
        lease_id: 0,
        revision: create.start_revision,
    };
    let timeout = inner.options.request_timeout;
    inner
        .call_active(Retry::Idempotent, context, timeout, |active, _| {
            let create = create.clone();
            let channel = active.channel.clone();
            let generation = active.generation;
            async move {
                let (tx, rx) = mpsc::channel(4);
                let _ = tx
                    .send(pb::WatchRequest {
                        request_union: Some(pb::watch_request::RequestUnion::CreateRequest(create)),
                    })
                    .await;
                let mut answers = WatchClient::new(channel.clone())
                    .watch(ReceiverStream::new(rx))
                    .await?
                    .into_inner();
                match answers.next().await {
                    Some(Ok(first)) if first.compact_revision > 0 => {
                        Err(tonic::Status::out_of_range(format!(
                            "etcdserver: mvcc: required revision has been compacted \
                             (compacted up to {})",
                            first.compact_revision
                        )))
                    }
                    Some(Ok(first)) if first.canceled => Err(tonic::Status::invalid_argument(
                        if first.cancel_reason.is_empty() {
                            "the server canceled the watch".to_string()
                        } else {
                            first.cancel_reason
                        },
                    )),
                    Some(Ok(first)) => Ok(Open {
                        _requests: tx,
                        answers,
                        channel,
                        generation,
                        created_revision: first
                            .created
                            .then(|| first.header.map_or(0, |h| h.revision)),
                    }),
                    Some(Err(status)) => Err(status),
                    None => Err(tonic::Status::unavailable("watch stream closed")),
                }
            }
        })
        .await
}

/// Where a re-created watch must start: after the last delivered event, or — for a watch
/// "from now" that has delivered nothing — after the revision the first stream started at.
pub(crate) fn resume_revision(requested: i64, created_at: Option<i64>, last_seen: i64) -> i64 {
    if last_seen > 0 {
        last_seen + 1
    } else if requested > 0 {
        requested
    } else {
        created_at.map_or(0, |r| r + 1)
    }
}

async fn watch_task(
    inner: Shared,
    mut create: pb::WatchCreateRequest,
    first: Open,
    out: mpsc::Sender<Result<WatchEvent>>,
) {
    let requested = create.start_revision;
    let mut created_at = first.created_revision;
    let mut last_seen = 0i64;
    let mut stream = Some(first);
    let mut failures = 0u32;
    // The cluster's revision at the last silence check: a member must reach it by the next
    // check. A fact about the cluster, so it holds across streams.
    let mut cluster_revision_before: Option<i64> = None;
    loop {
        let mut current = match stream.take() {
            Some(open) => open,
            None => {
                create.start_revision = resume_revision(requested, created_at, last_seen);
                match open(&inner, create.clone()).await {
                    Ok(open) => {
                        failures = 0;
                        if created_at.is_none() {
                            created_at = open.created_revision;
                        }
                        open
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
                answer = current.answers.next() => answer,
                () = out.closed() => return,
                () = tokio::time::sleep(SILENCE_CHECK) => {
                    // Silent for a while: carry on only if the member still knows a leader
                    // and has applied what the cluster had at the previous check; otherwise
                    // resume elsewhere.
                    match inner.member_status(current.channel.clone()).await {
                        Ok(status)
                            if status.leader != 0
                                && keeps_up(cluster_revision_before, status.revision) =>
                        {
                            let known = last_seen.max(created_at.unwrap_or(0));
                            cluster_revision_before =
                                cluster_revision(&inner, &create, known).await;
                            if let Some(revision) = cluster_revision_before {
                                inner.raise_revision_floor(revision);
                            }
                            continue;
                        }
                        Ok(status) => {
                            tracing::debug!(
                                leader = status.leader,
                                revision = status.revision,
                                ?cluster_revision_before,
                                "conclave watch leaves a member that does not keep up"
                            );
                            break;
                        }
                        Err(_) => break,
                    }
                }
            };
            match answer {
                Some(Ok(answer)) => {
                    if answer.compact_revision > 0 {
                        let _ = out
                            .send(Err(Error::Compacted {
                                requested_revision: resume_revision(
                                    requested, created_at, last_seen,
                                ),
                                compact_revision: answer.compact_revision,
                            }))
                            .await;
                        return;
                    }
                    if answer.canceled {
                        let _ = out
                            .send(Err(Error::InvalidArgument(format!(
                                "the server canceled the watch: {}",
                                answer.cancel_reason
                            ))))
                            .await;
                        return;
                    }
                    for event in answer.events {
                        let event = WatchEvent::from(event);
                        // A re-created watch must start after what we delivered; drop any
                        // overlap a server sends anyway rather than repeat it.
                        if last_seen > 0 && event.revision() <= last_seen {
                            continue;
                        }
                        last_seen = event.revision();
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
        inner.forget(current.generation);
        tokio::time::sleep(inner.options.backoff.delay(failures)).await;
        failures = failures.saturating_add(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resume_picks_up_after_the_last_event() {
        // Delivered up to revision 17: the new watch starts at 18, whatever was asked first.
        assert_eq!(resume_revision(0, Some(10), 17), 18);
        assert_eq!(resume_revision(5, Some(10), 17), 18);
        // Nothing delivered yet: keep the requested start...
        assert_eq!(resume_revision(5, Some(10), 0), 5);
        // ...or for "from now", the revision after the one the first stream was created at.
        assert_eq!(resume_revision(0, Some(10), 0), 11);
        assert_eq!(resume_revision(0, None, 0), 0);
    }

    #[test]
    fn a_member_keeps_up_when_it_reaches_what_the_cluster_had_one_check_before() {
        // Nothing to hold it to before the first check.
        assert!(keeps_up(None, 0));
        // At or past the cluster's revision of the previous check: fine, even if the cluster
        // has moved on since (a follower slightly behind under load).
        assert!(keeps_up(Some(500), 500));
        assert!(keeps_up(Some(500), 731));
        // Still short of it a whole check later: a member that does not keep up.
        assert!(!keeps_up(Some(500), 499));
        assert!(!keeps_up(Some(500), 1));
    }

    #[test]
    fn events_convert() {
        let event = mvccpb::Event {
            r#type: mvccpb::event::EventType::Delete as i32,
            kv: Some(mvccpb::KeyValue {
                key: b"k".to_vec().into(),
                mod_revision: 4,
                ..Default::default()
            }),
            prev_kv: None,
        };
        let event = WatchEvent::from(event);
        assert_eq!(event.kind, EventType::Delete);
        assert_eq!(event.revision(), 4);
    }
}
