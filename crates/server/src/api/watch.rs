//! etcd's Watch service: one bidirectional stream carries many watches.
//!
//! ```text
//!  driver apply ─► broadcast<AppliedEvents> (bounded) ─► watch hub (one task) ─► the queue of
//!      each watch the batch has events for (bounded) ─► that watch's task: filter by range and
//!      kind ─► stream's response queue (bounded) ─► gRPC
//! ```
//!
//! Backpressure: a client that does not read fills its stream's response queue, its watch
//! tasks stop reading their queues, and once a queue holds [`WATCH_QUEUE_BATCHES_MAX`] batches
//! (or the member's watches together hold their bound) the hub drops the watch, which is
//! cancelled (memory stays bounded; the client re-watches from its last revision). Each watch
//! registers with the hub before it reads history, under the state's read lock, so no revision
//! falls between the replay and the live events. See [`super::watch_hub`] for why one hub
//! routes the batches instead of every watch reading them.
//!
//! [`WATCH_QUEUE_BATCHES_MAX`]: super::watch_hub::WATCH_QUEUE_BATCHES_MAX

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use conclave_proto::etcdserverpb::{self as pb, watch_request::RequestUnion, watch_server::Watch};
use conclave_state::{Event, WatchEvent};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming, async_trait};

use super::convert::event_to_pb;
use super::watch_hub::{Delivery, HubMessage, Interest};
use super::{Api, CallContext};
use crate::node::AppliedEvents;

/// Responses queued for one stream before its watch tasks wait for the client.
pub const WATCH_STREAM_RESPONSES_MAX: usize = 256;
/// Watches one stream may hold at once.
pub const WATCHES_PER_STREAM_MAX: usize = 1024;
/// Why a watch that fell too far behind was cancelled.
pub const SLOW_WATCHER_REASON: &str = "etcdserver: watcher fell too far behind the apply path and was cancelled; watch again from the last received revision";

pub struct WatchService {
    pub api: Arc<Api>,
}

/// What one watch selects.
#[derive(Clone)]
struct Filter {
    key: Bytes,
    range_end: Bytes,
    no_put: bool,
    no_delete: bool,
    prev_kv: bool,
}

impl Filter {
    fn matches(&self, event: &WatchEvent) -> bool {
        let key = &event.kv.key[..];
        let in_range = if self.range_end.is_empty() {
            key == &self.key[..]
        } else if &self.range_end[..] == b"\0" {
            key >= &self.key[..]
        } else {
            key >= &self.key[..] && key < &self.range_end[..]
        };
        let filtered = match event.kind {
            conclave_state::EventKind::Put => self.no_put,
            conclave_state::EventKind::Delete => self.no_delete,
        };
        in_range && !filtered
    }
}

type Responses = mpsc::Sender<Result<pb::WatchResponse, Status>>;

#[async_trait]
impl Watch for WatchService {
    type WatchStream = ReceiverStream<Result<pb::WatchResponse, Status>>;

    async fn watch(
        &self,
        request: tonic::Request<Streaming<pb::WatchRequest>>,
    ) -> Result<tonic::Response<Self::WatchStream>, Status> {
        let client = request.remote_addr();
        // A node with no watch slot left refuses new streams outright; on an open stream a
        // create beyond the cap gets etcd's refusal (created and canceled) with the reason.
        if self.api.limits.watches_available() == 0 {
            return Err(self.api.limits.watch(client).err().unwrap_or_else(|| {
                Status::resource_exhausted(super::limits::watches_exhausted_reason(
                    self.api.limits.caps.watches_max,
                ))
            }));
        }
        // The stream's credentials; each create is checked with them against the auth state
        // of that moment.
        let caller = CallContext::new(&request, 0);
        let mut incoming = request.into_inner();
        let (responses, output) = mpsc::channel(WATCH_STREAM_RESPONSES_MAX);
        let api = self.api.clone();
        tokio::spawn(async move {
            let mut watches: HashMap<i64, JoinHandle<()>> = HashMap::new();
            let mut next_id: i64 = 0;
            // The stream ends when the node stops, so it cannot hold up a graceful shutdown.
            let stopped = super::lock::node_stopped(&api);
            tokio::pin!(stopped);
            loop {
                let message = tokio::select! {
                    _ = &mut stopped => break,
                    message = incoming.next() => match message {
                        Some(Ok(message)) => message,
                        _ => break,
                    },
                };
                watches.retain(|_, task| !task.is_finished());
                match message.request_union {
                    Some(RequestUnion::CreateRequest(create)) => {
                        let id = if create.watch_id != 0 {
                            create.watch_id
                        } else {
                            while watches.contains_key(&next_id) {
                                next_id += 1;
                            }
                            next_id
                        };
                        if watches.contains_key(&id) || watches.len() >= WATCHES_PER_STREAM_MAX {
                            // etcd answers a refused create with created and canceled both set.
                            let refused = pb::WatchResponse {
                                header: Some(api.read_header()),
                                watch_id: id,
                                created: true,
                                canceled: true,
                                cancel_reason: "etcdserver: too many watches or duplicate watch id"
                                    .into(),
                                ..Default::default()
                            };
                            if responses.send(Ok(refused)).await.is_err() {
                                break;
                            }
                            continue;
                        }
                        let permitted = api.caller(&caller).and_then(|user| {
                            let access = [conclave_state::Access::read(
                                create.key.clone(),
                                create.range_end.clone(),
                            )];
                            api.node
                                .read_state(|state| state.auth().check_access(&user, &access))
                                .map_err(|error| super::state_status(&error))
                        });
                        if let Err(status) = permitted {
                            // etcd refuses an unpermitted create as created and canceled.
                            let refused = pb::WatchResponse {
                                header: Some(api.read_header()),
                                watch_id: id,
                                created: true,
                                canceled: true,
                                cancel_reason: status.message().to_owned(),
                                ..Default::default()
                            };
                            if responses.send(Ok(refused)).await.is_err() {
                                break;
                            }
                            continue;
                        }
                        let slot = match api.limits.watch(client) {
                            Ok(slot) => slot,
                            Err(status) => {
                                let refused = pb::WatchResponse {
                                    header: Some(api.read_header()),
                                    watch_id: id,
                                    created: true,
                                    canceled: true,
                                    cancel_reason: status.message().to_owned(),
                                    ..Default::default()
                                };
                                if responses.send(Ok(refused)).await.is_err() {
                                    break;
                                }
                                continue;
                            }
                        };
                        let task = start_watch(&api, id, create, responses.clone(), slot);
                        watches.insert(id, task);
                    }
                    Some(RequestUnion::CancelRequest(cancel)) => {
                        if let Some(task) = watches.remove(&cancel.watch_id) {
                            task.abort();
                            let canceled = pb::WatchResponse {
                                header: Some(api.read_header()),
                                watch_id: cancel.watch_id,
                                canceled: true,
                                ..Default::default()
                            };
                            if responses.send(Ok(canceled)).await.is_err() {
                                break;
                            }
                        }
                    }
                    Some(RequestUnion::ProgressRequest(_)) => {
                        let progress = pb::WatchResponse {
                            header: Some(api.read_header()),
                            watch_id: -1,
                            ..Default::default()
                        };
                        if responses.send(Ok(progress)).await.is_err() {
                            break;
                        }
                    }
                    None => {}
                }
            }
            for (_, task) in watches {
                task.abort();
            }
        });
        Ok(tonic::Response::new(ReceiverStream::new(output)))
    }
}

fn start_watch(
    api: &Arc<Api>,
    id: i64,
    create: pb::WatchCreateRequest,
    responses: Responses,
    slot: tokio::sync::OwnedSemaphorePermit,
) -> JoinHandle<()> {
    use pb::watch_create_request::FilterType;
    let filter = Filter {
        key: create.key,
        range_end: create.range_end,
        no_put: create.filters.contains(&(FilterType::Noput as i32)),
        no_delete: create.filters.contains(&(FilterType::Nodelete as i32)),
        prev_kv: create.prev_kv,
    };
    // Subscribe and read history in one consistent view (see the module documentation).
    let (mut live, history, revision) = api.node.read_state(|state| {
        let live = api.watch_hub.subscribe(
            Interest::Keys {
                key: filter.key.clone(),
                range_end: filter.range_end.clone(),
            },
            Delivery::Every,
            || api.node.events.subscribe(),
            state.revision(),
        );
        let history = state.events_since(create.start_revision, &filter.key, &filter.range_end);
        (live, history, state.revision())
    });
    let start_revision = create.start_revision;
    let api = api.clone();
    tokio::spawn(async move {
        // One of watches_max, released when the watch ends or is cancelled (abort drops it).
        let _slot = slot;
        let header = api.header(revision);
        let created = pb::WatchResponse {
            header: Some(header),
            watch_id: id,
            created: true,
            ..Default::default()
        };
        if responses.send(Ok(created)).await.is_err() {
            return;
        }
        let history = match history {
            Ok(history) => history,
            Err(conclave_state::Error::Compacted { compact_revision }) => {
                let _ = responses
                    .send(Ok(compacted_cancel(&api, id, compact_revision)))
                    .await;
                return;
            }
            Err(error) => {
                let _ = responses.send(Err(super::state_status(&error))).await;
                return;
            }
        };
        let replay: Vec<_> = history
            .into_iter()
            .filter(|e| filter.matches(e))
            .map(|e| event_to_pb(e, filter.prev_kv))
            .collect();
        if !replay.is_empty() {
            let response = pb::WatchResponse {
                header: Some(header),
                watch_id: id,
                events: replay,
                ..Default::default()
            };
            if responses.send(Ok(response)).await.is_err() {
                return;
            }
        }
        // Every revision up to `seen` has been delivered (or filtered out) by this watch.
        let mut seen = revision;
        loop {
            let message = match live.recv().await {
                Some(message) => message,
                None if live.fell_behind() => {
                    let canceled = pb::WatchResponse {
                        header: Some(api.read_header()),
                        watch_id: id,
                        canceled: true,
                        cancel_reason: SLOW_WATCHER_REASON.into(),
                        ..Default::default()
                    };
                    let _ = responses.send(Ok(canceled)).await;
                    return;
                }
                // The hub stopped: the node is gone.
                None => return,
            };
            let (events, header_revision) = if let HubMessage::Resync = message {
                // The member jumped over revisions without applying them one by one (a
                // snapshot from the leader was installed, announced by a batch with no events
                // at its revision, so this does not wait for a later write), or the hub fell
                // behind the broadcast: read them from the history, or cancel as compacted so
                // the client resumes, never skip them silently.
                let from = (seen + 1).max(start_revision);
                let (history, now) = api.node.read_state(|state| {
                    let history = state.events_since(from, &filter.key, &filter.range_end);
                    (history, state.revision())
                });
                let history = match history {
                    Ok(history) => history,
                    Err(conclave_state::Error::Compacted { compact_revision }) => {
                        let _ = responses
                            .send(Ok(compacted_cancel(&api, id, compact_revision)))
                            .await;
                        return;
                    }
                    Err(error) => {
                        let _ = responses.send(Err(super::state_status(&error))).await;
                        return;
                    }
                };
                seen = seen.max(now);
                let events: Vec<_> = history
                    .into_iter()
                    .filter(|e| filter.matches(e))
                    .map(|e| event_to_pb(e, filter.prev_kv))
                    .collect();
                (events, now)
            } else if let HubMessage::Batch(batch) = message {
                let events: Vec<_> = batch
                    .events
                    .iter()
                    .filter_map(|event| match event {
                        // A watch from a future revision (or created while a restarted member
                        // is still replaying its log) must not see anything before its start,
                        // nor anything a history read already delivered.
                        Event::Kv(e)
                            if e.kv.mod_revision > seen
                                && e.kv.mod_revision >= start_revision
                                && filter.matches(e) =>
                        {
                            Some(event_to_pb(e.clone(), filter.prev_kv))
                        }
                        _ => None,
                    })
                    .collect();
                seen = seen.max(batch.revision);
                (events, batch.revision)
            } else {
                continue;
            };
            if events.is_empty() {
                continue;
            }
            let response = pb::WatchResponse {
                header: Some(api.header(header_revision)),
                watch_id: id,
                events,
                ..Default::default()
            };
            if responses.send(Ok(response)).await.is_err() {
                return;
            }
        }
    })
}

/// etcd's cancellation of a watch whose next revision was compacted away; the client watches
/// again from `compact_revision`. It carries no revision in its header, as etcd's does not.
fn compacted_cancel(api: &Api, id: i64, compact_revision: i64) -> pb::WatchResponse {
    pb::WatchResponse {
        header: Some(pb::ResponseHeader {
            revision: 0,
            ..api.read_header()
        }),
        watch_id: id,
        canceled: true,
        compact_revision,
        cancel_reason: "etcdserver: mvcc: required revision has been compacted".into(),
        ..Default::default()
    }
}

/// True when `batch` does not continue, revision by revision, from `seen`: some revision
/// after `seen` reached the state without its events passing through the broadcast, as
/// when a follower installs a snapshot. Every revision carries at least one KV event, so a
/// batch that continues the stream has, above `seen`, events at `seen + 1`, `seen + 2`, ...
/// up to its own revision. Events at or below `seen` were already delivered and are skipped.
pub(super) fn skips_revisions(seen: i64, batch: &AppliedEvents) -> bool {
    let mut covered = seen;
    for event in batch.events.iter() {
        let Event::Kv(event) = event else {
            continue;
        };
        let revision = event.kv.mod_revision;
        if revision <= covered {
            continue;
        }
        if revision != covered + 1 {
            return true;
        }
        covered = revision;
    }
    batch.revision > covered
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use conclave_state::{Event, EventKind, KeyValue, WatchEvent};

    use super::{AppliedEvents, skips_revisions};

    fn put(mod_revision: i64) -> Event {
        Event::Kv(WatchEvent {
            kind: EventKind::Put,
            kv: KeyValue {
                key: b"k".to_vec().into(),
                mod_revision,
                ..KeyValue::default()
            },
            prev_kv: None,
        })
    }

    fn batch(revision: i64, events: Vec<Event>) -> AppliedEvents {
        AppliedEvents {
            revision,
            events: Arc::new(events),
        }
    }

    #[test]
    fn a_batch_that_continues_the_stream_is_no_gap() {
        assert!(!skips_revisions(4, &batch(5, vec![put(5)])));
        // Several events at one revision (a txn), then the next revision.
        assert!(!skips_revisions(4, &batch(6, vec![put(5), put(5), put(6)])));
        // Events a history read already delivered are skipped, not a gap.
        assert!(!skips_revisions(
            9,
            &batch(10, vec![put(8), put(9), put(10)])
        ));
        assert!(!skips_revisions(9, &batch(7, vec![put(7)])));
        // A batch with no KV event that moves no revision (a topic publish, say).
        assert!(!skips_revisions(9, &batch(9, Vec::new())));
    }

    #[test]
    fn revisions_a_snapshot_jumped_over_are_a_gap() {
        // Installed a snapshot at 20, then applied 21: 5..=20 never went through the broadcast.
        assert!(skips_revisions(4, &batch(21, vec![put(21)])));
        // The jump in the middle of a batch.
        assert!(skips_revisions(4, &batch(21, vec![put(5), put(21)])));
        // The jump with no KV event after it: the batch's revision is past what it carries.
        assert!(skips_revisions(4, &batch(20, vec![put(5)])));
        assert!(skips_revisions(4, &batch(20, Vec::new())));
    }
}
