//! Routes each applied batch of events to the watches whose key range it touches, and to no
//! other.
//!
//! ```text
//!  driver apply ─► broadcast<AppliedEvents> ─► hub task ─┬─ exact-key watches: one lookup per event
//!                  (one receiver: the hub)               └─ range watches: one check per distinct range
//!                                          ─► each concerned watch's own bounded queue ─► its task
//! ```
//!
//! Each watch used to hold its own receiver of the broadcast, so every applied batch woke
//! every watch task, which then found nothing for it in most batches. With thousands of
//! agents each watching their own keys that was thousands of task wake-ups per put, and it
//! halved the cluster's put rate (docs/performance.md). The hub takes the one wake-up per batch
//! and hands a watch only the batches it has events in.
//!
//! A watch that sees only some batches can no longer tell on its own that revisions went by
//! without passing through the broadcast (a follower installing a snapshot, or the hub falling
//! behind the broadcast). The hub checks that on the whole stream and sends every watch a
//! [`HubMessage::Resync`]; the watch then reads the revisions after the last it has seen from
//! the history, as before.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use conclave_state::Event;
use tokio::sync::{broadcast, mpsc};

use crate::node::{APPLIED_EVENTS_BUFFER_MAX, AppliedEvents};

/// Batches queued for one watch before the hub gives up on it as too slow (the watch is then
/// cancelled with [`super::watch::SLOW_WATCHER_REASON`] and the client watches again from its
/// last revision). The same bound the shared broadcast gave every watch before, now counted
/// in batches that concern the watch.
pub const WATCH_QUEUE_BATCHES_MAX: usize = APPLIED_EVENTS_BUFFER_MAX;

/// What the hub hands one watch.
pub(crate) enum HubMessage {
    /// A batch with at least one event in the watch's key range.
    Batch(AppliedEvents),
    /// Revisions reached the state without passing through the hub: read them from history.
    Resync,
}

struct Entry {
    id: u64,
    sender: mpsc::Sender<HubMessage>,
    slow: Arc<AtomicBool>,
}

#[derive(Default)]
struct Registry {
    /// Watches on one key (empty range end), by key.
    exact: HashMap<Bytes, Vec<Entry>>,
    /// Watches on a range or prefix, by (key, range end).
    ranges: HashMap<(Bytes, Bytes), Vec<Entry>>,
}

impl Registry {
    fn group(&mut self, key: &Bytes, range_end: &Bytes) -> &mut Vec<Entry> {
        if range_end.is_empty() {
            self.exact.entry(key.clone()).or_default()
        } else {
            self.ranges
                .entry((key.clone(), range_end.clone()))
                .or_default()
        }
    }

    fn remove(&mut self, key: &Bytes, range_end: &Bytes, id: u64) {
        let emptied = {
            let group = if range_end.is_empty() {
                self.exact.get_mut(key)
            } else {
                self.ranges.get_mut(&(key.clone(), range_end.clone()))
            };
            let Some(group) = group else {
                return;
            };
            group.retain(|entry| entry.id != id);
            group.is_empty()
        };
        if emptied {
            if range_end.is_empty() {
                self.exact.remove(key);
            } else {
                self.ranges.remove(&(key.clone(), range_end.clone()));
            }
        }
    }
}

/// Hands `message` to every entry of `group`; an entry whose queue is full is marked slow and
/// dropped, one whose watch is gone is dropped.
fn deliver(group: &mut Vec<Entry>, message: impl Fn() -> HubMessage) {
    group.retain(|entry| match entry.sender.try_send(message()) {
        Ok(()) => true,
        Err(mpsc::error::TrySendError::Full(_)) => {
            entry.slow.store(true, Ordering::Relaxed);
            false
        }
        Err(mpsc::error::TrySendError::Closed(_)) => false,
    });
}

/// True when `key` lies in the range [`start`, `end`) in etcd's terms (`end` = "\0": every
/// key from `start` on).
fn in_range(key: &[u8], start: &[u8], end: &[u8]) -> bool {
    key >= start && (end == b"\0" || key < end)
}

/// The watches of one member's Watch service and the task that feeds them.
#[derive(Default)]
pub struct WatchHub {
    registry: Mutex<Registry>,
    next_id: AtomicU64,
    /// Set once the hub task runs (started by the first watch).
    started: AtomicBool,
}

/// One watch's place in the hub: its queue, and its entry, removed when this is dropped.
pub(crate) struct Subscription {
    hub: Arc<WatchHub>,
    id: u64,
    key: Bytes,
    range_end: Bytes,
    pub receiver: mpsc::Receiver<HubMessage>,
    slow: Arc<AtomicBool>,
}

impl Subscription {
    /// Whether the hub dropped this watch for falling [`WATCH_QUEUE_BATCHES_MAX`] behind.
    pub fn fell_behind(&self) -> bool {
        self.slow.load(Ordering::Relaxed)
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.hub
            .registry()
            .remove(&self.key, &self.range_end, self.id);
    }
}

impl WatchHub {
    fn registry(&self) -> MutexGuard<'_, Registry> {
        // Plain bookkeeping behind the lock; a panic elsewhere leaves it consistent.
        self.registry
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Registers a watch on [`key`, `range_end`) (an empty `range_end`: `key` alone).
    ///
    /// Call it under the state's read lock, with `subscribe` taking a receiver of the applied
    /// events and `revision` the state's revision, both read under that same lock: the first
    /// watch starts the hub from there, so no batch after the watch's history read can miss
    /// it. Batches the hub passes on after that may repeat revisions the watch already read
    /// from history; the watch skips those.
    pub(crate) fn subscribe(
        self: &Arc<Self>,
        key: Bytes,
        range_end: Bytes,
        subscribe: impl FnOnce() -> broadcast::Receiver<AppliedEvents>,
        revision: i64,
    ) -> Subscription {
        if !self.started.swap(true, Ordering::AcqRel) {
            tokio::spawn(self.clone().run(subscribe(), revision));
        }
        let (sender, receiver) = mpsc::channel(WATCH_QUEUE_BATCHES_MAX);
        let slow = Arc::new(AtomicBool::new(false));
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.registry().group(&key, &range_end).push(Entry {
            id,
            sender,
            slow: slow.clone(),
        });
        Subscription {
            hub: self.clone(),
            id,
            key,
            range_end,
            receiver,
            slow,
        }
    }

    /// Watches registered now (for tests and the metrics).
    pub fn watch_count(&self) -> usize {
        let registry = self.registry();
        registry.exact.values().map(Vec::len).sum::<usize>()
            + registry.ranges.values().map(Vec::len).sum::<usize>()
    }

    async fn run(self: Arc<Self>, mut live: broadcast::Receiver<AppliedEvents>, revision: i64) {
        // The last revision this hub has seen pass; `None` after it fell behind the broadcast.
        let mut seen = Some(revision);
        loop {
            match live.recv().await {
                Ok(batch) => {
                    let skipped =
                        seen.is_some_and(|seen| super::watch::skips_revisions(seen, &batch));
                    seen = Some(seen.unwrap_or(batch.revision).max(batch.revision));
                    if skipped {
                        self.resync_all();
                    } else {
                        self.route(batch);
                    }
                }
                // The broadcast dropped batches the hub had not taken yet: every watch reads
                // what it missed from history (or is cancelled as compacted, and re-watches).
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    seen = None;
                    self.resync_all();
                }
                // The node is gone: dropping every queue ends every watch.
                Err(broadcast::error::RecvError::Closed) => {
                    let mut registry = self.registry();
                    registry.exact.clear();
                    registry.ranges.clear();
                    return;
                }
            }
        }
    }

    fn resync_all(&self) {
        let mut registry = self.registry();
        let Registry { exact, ranges } = &mut *registry;
        for group in exact.values_mut().chain(ranges.values_mut()) {
            deliver(group, || HubMessage::Resync);
        }
        exact.retain(|_, group| !group.is_empty());
        ranges.retain(|_, group| !group.is_empty());
    }

    /// Hands `batch` to each watch with an event of it in range, once.
    fn route(&self, batch: AppliedEvents) {
        let mut registry = self.registry();
        let Registry { exact, ranges } = &mut *registry;
        let mut exact_hit: Vec<Bytes> = Vec::new();
        let mut range_hit: Vec<(Bytes, Bytes)> = Vec::new();
        for event in batch.events.iter() {
            let Event::Kv(event) = event else {
                continue;
            };
            let key = &event.kv.key;
            if exact.contains_key(&key[..]) && !exact_hit.iter().any(|hit| hit == key) {
                exact_hit.push(key.clone());
            }
            for (start, end) in ranges.keys() {
                if in_range(key, start, end)
                    && !range_hit.iter().any(|(s, e)| s == start && e == end)
                {
                    range_hit.push((start.clone(), end.clone()));
                }
            }
        }
        for key in exact_hit {
            if let Some(group) = exact.get_mut(&key) {
                deliver(group, || HubMessage::Batch(batch.clone()));
                if group.is_empty() {
                    exact.remove(&key);
                }
            }
        }
        for range in range_hit {
            if let Some(group) = ranges.get_mut(&range) {
                deliver(group, || HubMessage::Batch(batch.clone()));
                if group.is_empty() {
                    ranges.remove(&range);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use conclave_state::{EventKind, KeyValue, WatchEvent};

    use super::*;

    fn put(key: &str, mod_revision: i64) -> Event {
        Event::Kv(WatchEvent {
            kind: EventKind::Put,
            kv: KeyValue {
                key: key.as_bytes().to_vec().into(),
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

    /// What reached `watch` by now: the batches' revisions, and `-1` for a resync.
    async fn received(watch: &mut Subscription) -> Vec<i64> {
        tokio::time::sleep(Duration::from_millis(30)).await;
        let mut got = Vec::new();
        while let Ok(message) = watch.receiver.try_recv() {
            got.push(match message {
                HubMessage::Batch(batch) => batch.revision,
                HubMessage::Resync => -1,
            });
        }
        got
    }

    #[tokio::test]
    async fn each_batch_reaches_only_the_watches_it_has_events_for() {
        let hub = Arc::new(WatchHub::default());
        let (events, _) = broadcast::channel(16);
        let subscribe = || events.subscribe();
        let mut key_a = hub.subscribe("a".into(), Bytes::new(), subscribe, 10);
        let mut key_b = hub.subscribe("b".into(), Bytes::new(), subscribe, 10);
        let mut prefix_t = hub.subscribe("t/".into(), "t0".into(), subscribe, 10);
        let mut from_m = hub.subscribe("m".into(), "\0".into(), subscribe, 10);
        assert_eq!(hub.watch_count(), 4);

        events.send(batch(11, vec![put("a", 11)])).unwrap();
        // One batch with two events for one watch reaches it once.
        events
            .send(batch(13, vec![put("t/1", 12), put("t/2", 13)]))
            .unwrap();
        events
            .send(batch(14, vec![put("a", 14), put("x", 14)]))
            .unwrap();
        assert_eq!(received(&mut key_a).await, vec![11, 14]);
        assert_eq!(received(&mut key_b).await, Vec::<i64>::new());
        assert_eq!(received(&mut prefix_t).await, vec![13]);
        assert_eq!(received(&mut from_m).await, vec![13, 14]);

        // A dropped watch leaves the hub.
        drop(key_b);
        assert_eq!(hub.watch_count(), 3);
    }

    #[tokio::test]
    async fn revisions_that_skip_the_broadcast_resync_every_watch() {
        let hub = Arc::new(WatchHub::default());
        let (events, _) = broadcast::channel(16);
        let mut key_a = hub.subscribe("a".into(), Bytes::new(), || events.subscribe(), 10);
        let mut key_b = hub.subscribe("b".into(), Bytes::new(), || events.subscribe(), 10);
        events.send(batch(11, vec![put("a", 11)])).unwrap();
        // A snapshot installed at revision 20: an empty batch that jumps.
        events.send(batch(20, Vec::new())).unwrap();
        events.send(batch(21, vec![put("b", 21)])).unwrap();
        assert_eq!(received(&mut key_a).await, vec![11, -1]);
        assert_eq!(received(&mut key_b).await, vec![-1, 21]);
    }

    #[tokio::test]
    async fn a_hub_behind_the_broadcast_resyncs_every_watch() {
        let hub = Arc::new(WatchHub::default());
        let (events, _) = broadcast::channel(2);
        let live = events.subscribe();
        let mut key_a = hub.subscribe("a".into(), Bytes::new(), || live, 10);
        // Sent before the hub task first runs, so it misses the first two of these.
        for revision in 11..=14 {
            events
                .send(batch(revision, vec![put("a", revision)]))
                .unwrap();
        }
        assert_eq!(received(&mut key_a).await, vec![-1, 13, 14]);
    }

    #[tokio::test]
    async fn a_watch_that_does_not_keep_up_is_dropped_and_told() {
        let hub = Arc::new(WatchHub::default());
        let (events, _) = broadcast::channel(WATCH_QUEUE_BATCHES_MAX + 16);
        let watch = hub.subscribe("a".into(), Bytes::new(), || events.subscribe(), 0);
        for revision in 1..=(WATCH_QUEUE_BATCHES_MAX as i64 + 1) {
            events
                .send(batch(revision, vec![put("a", revision)]))
                .unwrap();
        }
        tokio::time::timeout(Duration::from_secs(10), async {
            while hub.watch_count() > 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the hub drops the watch whose queue is full");
        assert!(watch.fell_behind());
    }
}
