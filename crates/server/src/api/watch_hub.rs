//! Routes each applied batch of events to the subscriptions it concerns, and to no other:
//! watches (by key range) and the calls that wait for a change (lock and campaign waits, work
//! queue claims, topic inbox waits, by what they wait on).
//!
//! ```text
//!  driver apply ─► broadcast<AppliedEvents> ─► hub task ─┬─ one lookup per event: its key, its
//!                  (one receiver: the hub)               │  election group, topic or queue
//!                                                        └─ one check per distinct key range
//!                                          ─► each concerned subscription's own bounded queue
//! ```
//!
//! Each watch and each waiting call used to hold its own receiver of the broadcast, so every
//! applied batch woke every one of them, and most found nothing for them in it. With thousands
//! of agents each watching their own keys, or waiting on their inbox, that was thousands of
//! task wake-ups per put, and it halved the cluster's put rate (docs/performance.md). The hub
//! takes the one wake-up per batch and hands a subscription only the batches it has events in.
//!
//! A subscription that sees only some batches can no longer tell on its own that revisions
//! went by without passing through the broadcast (a follower installing a snapshot, or the
//! hub falling behind the broadcast). The hub checks that on the whole stream and sends every
//! subscription a [`HubMessage::Resync`]: a watch then reads the revisions after the last it
//! has seen from the history, a waiting call checks the state again.

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

/// What a subscription is for: the events that concern it.
#[derive(Clone, Debug)]
pub(crate) enum Interest {
    /// KV events on [`key`, `range_end`): an empty `range_end` means `key` alone, "\0" every
    /// key from `key` on (etcd's range conventions).
    Keys { key: Bytes, range_end: Bytes },
    /// Events of one priority election group.
    Election(String),
    /// Messages on any of these topics.
    Topics(Vec<String>),
    /// Changes to one work queue.
    Queue(String),
}

impl Interest {
    /// Every key under `prefix`.
    pub fn prefix(prefix: &[u8]) -> Interest {
        let mut end = prefix.to_vec();
        while let Some(last) = end.pop() {
            if last < 0xff {
                end.push(last + 1);
                break;
            }
        }
        if end.is_empty() {
            end.push(0);
        }
        Interest::Keys {
            key: Bytes::copy_from_slice(prefix),
            range_end: end.into(),
        }
    }

    /// The routes a subscription is filed under (ranges apart).
    fn routes(&self) -> Vec<Route> {
        match self {
            Interest::Keys { key, range_end } if range_end.is_empty() => {
                vec![Route::Key(key.clone())]
            }
            Interest::Keys { .. } => Vec::new(),
            Interest::Election(group) => vec![Route::Election(group.clone())],
            Interest::Topics(topics) => {
                let mut routes: Vec<Route> = Vec::new();
                for topic in topics {
                    let route = Route::Topic(topic.clone());
                    if !routes.contains(&route) {
                        routes.push(route);
                    }
                }
                routes
            }
            Interest::Queue(queue) => vec![Route::Queue(queue.clone())],
        }
    }

    fn range(&self) -> Option<(Bytes, Bytes)> {
        match self {
            Interest::Keys { key, range_end } if !range_end.is_empty() => {
                Some((key.clone(), range_end.clone()))
            }
            _ => None,
        }
    }
}

/// Where an event is looked up: by exact name.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Route {
    Key(Bytes),
    Election(String),
    Topic(String),
    Queue(String),
}

/// What the hub hands one subscription.
pub(crate) enum HubMessage {
    /// A batch with at least one event the subscription is interested in.
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
    /// Subscriptions by exact name: a key, an election group, a topic, a queue.
    named: HashMap<Route, Vec<Entry>>,
    /// Watches on a range or prefix, by (key, range end).
    ranges: HashMap<(Bytes, Bytes), Vec<Entry>>,
}

impl Registry {
    fn add(&mut self, interest: &Interest, entry: impl Fn() -> Entry) {
        for route in interest.routes() {
            self.named.entry(route).or_default().push(entry());
        }
        if let Some(range) = interest.range() {
            self.ranges.entry(range).or_default().push(entry());
        }
    }

    fn remove(&mut self, interest: &Interest, id: u64) {
        for route in interest.routes() {
            if let Some(group) = self.named.get_mut(&route) {
                group.retain(|entry| entry.id != id);
                if group.is_empty() {
                    self.named.remove(&route);
                }
            }
        }
        if let Some(range) = interest.range()
            && let Some(group) = self.ranges.get_mut(&range)
        {
            group.retain(|entry| entry.id != id);
            if group.is_empty() {
                self.ranges.remove(&range);
            }
        }
    }

    fn count(&self) -> usize {
        self.named.values().map(Vec::len).sum::<usize>()
            + self.ranges.values().map(Vec::len).sum::<usize>()
    }
}

/// Hands `message` to every entry of `group`; an entry whose queue is full is marked slow and
/// dropped, one whose subscriber is gone is dropped.
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

/// The route an event is looked up under.
fn route_of(event: &Event) -> Route {
    match event {
        Event::Kv(event) => Route::Key(event.kv.key.clone()),
        Event::Election(event) => Route::Election(event.group.clone()),
        Event::Topic(message) => Route::Topic(message.topic.clone()),
        Event::Queue(queue) => Route::Queue(queue.clone()),
    }
}

impl super::Api {
    /// Subscribes to `interest` and runs `read` on the state under the same read lock, so a
    /// change after what `read` saw cannot be missed.
    pub(crate) fn subscribe_with<T>(
        &self,
        interest: Interest,
        read: impl FnOnce(&conclave_state::StateMachine) -> T,
    ) -> (Subscription, T) {
        self.node.read_state(|state| {
            let subscription = self.watch_hub.subscribe(
                interest,
                || self.node.events.subscribe(),
                state.revision(),
            );
            (subscription, read(state))
        })
    }
}

/// One member's subscriptions to its applied events and the task that feeds them.
#[derive(Default)]
pub struct WatchHub {
    registry: Mutex<Registry>,
    next_id: AtomicU64,
    /// Set once the hub task runs (started by the first subscription).
    started: AtomicBool,
}

/// One subscription's place in the hub: its queue, and its entries, removed when this is
/// dropped.
pub(crate) struct Subscription {
    hub: Arc<WatchHub>,
    id: u64,
    interest: Interest,
    pub receiver: mpsc::Receiver<HubMessage>,
    slow: Arc<AtomicBool>,
}

impl Subscription {
    /// Whether the hub dropped this subscription for falling [`WATCH_QUEUE_BATCHES_MAX`]
    /// behind.
    pub fn fell_behind(&self) -> bool {
        self.slow.load(Ordering::Relaxed)
    }

    /// The next message, for callers that read the state afresh on a resync (waits, topic
    /// and election streams; a watch must instead be cancelled when it falls behind, and reads
    /// its queue itself). One the hub dropped for falling behind registers again and answers
    /// [`HubMessage::Resync`]: registered before the caller's next read of the state, it
    /// misses nothing that read does not already see. `None` once the hub stopped (the node
    /// is gone).
    pub async fn next(&mut self) -> Option<HubMessage> {
        if let Some(message) = self.receiver.recv().await {
            return Some(message);
        }
        if !self.fell_behind() {
            return None;
        }
        let fresh = self.hub.register(self.interest.clone());
        drop(std::mem::replace(self, fresh));
        Some(HubMessage::Resync)
    }

    /// [`Subscription::next`] for callers that only re-read the state: true on a batch this
    /// subscription is interested in or a resync, false once the hub stopped.
    pub async fn changed(&mut self) -> bool {
        self.next().await.is_some()
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.hub.registry().remove(&self.interest, self.id);
    }
}

impl WatchHub {
    fn registry(&self) -> MutexGuard<'_, Registry> {
        // Plain bookkeeping behind the lock; a panic elsewhere leaves it consistent.
        self.registry
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Registers a subscription to the events `interest` names.
    ///
    /// Call it under the state's read lock, with `subscribe` taking a receiver of the applied
    /// events and `revision` the state's revision, both read under that same lock: the first
    /// subscription starts the hub from there, so no batch after what the caller reads under
    /// that lock can miss it. Batches passed on after that may repeat revisions the caller
    /// already read; a watch skips those.
    pub(crate) fn subscribe(
        self: &Arc<Self>,
        interest: Interest,
        subscribe: impl FnOnce() -> broadcast::Receiver<AppliedEvents>,
        revision: i64,
    ) -> Subscription {
        if !self.started.swap(true, Ordering::AcqRel) {
            tokio::spawn(self.clone().run(subscribe(), revision));
        }
        self.register(interest)
    }

    fn register(self: &Arc<Self>, interest: Interest) -> Subscription {
        let (sender, receiver) = mpsc::channel(WATCH_QUEUE_BATCHES_MAX);
        let slow = Arc::new(AtomicBool::new(false));
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.registry().add(&interest, || Entry {
            id,
            sender: sender.clone(),
            slow: slow.clone(),
        });
        Subscription {
            hub: self.clone(),
            id,
            interest,
            receiver,
            slow,
        }
    }

    /// Entries registered now (a subscription to several topics has one per topic).
    pub fn entry_count(&self) -> usize {
        self.registry().count()
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
                // The broadcast dropped batches the hub had not taken yet: every subscription
                // reads what it missed from the state.
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    seen = None;
                    self.resync_all();
                }
                // The node is gone: dropping every queue ends every subscription.
                Err(broadcast::error::RecvError::Closed) => {
                    let mut registry = self.registry();
                    registry.named.clear();
                    registry.ranges.clear();
                    return;
                }
            }
        }
    }

    fn resync_all(&self) {
        let mut registry = self.registry();
        let Registry { named, ranges } = &mut *registry;
        for group in named.values_mut() {
            deliver(group, || HubMessage::Resync);
        }
        for group in ranges.values_mut() {
            deliver(group, || HubMessage::Resync);
        }
        named.retain(|_, group| !group.is_empty());
        ranges.retain(|_, group| !group.is_empty());
    }

    /// Hands `batch` to each subscription with an event of it in range, once per route.
    fn route(&self, batch: AppliedEvents) {
        let mut registry = self.registry();
        let Registry { named, ranges } = &mut *registry;
        let mut named_hit: Vec<Route> = Vec::new();
        let mut range_hit: Vec<(Bytes, Bytes)> = Vec::new();
        for event in batch.events.iter() {
            let route = route_of(event);
            if named.contains_key(&route) && !named_hit.contains(&route) {
                named_hit.push(route);
            }
            let Event::Kv(event) = event else {
                continue;
            };
            for (start, end) in ranges.keys() {
                if in_range(&event.kv.key, start, end)
                    && !range_hit.iter().any(|(s, e)| s == start && e == end)
                {
                    range_hit.push((start.clone(), end.clone()));
                }
            }
        }
        for route in named_hit {
            if let Some(group) = named.get_mut(&route) {
                deliver(group, || HubMessage::Batch(batch.clone()));
                if group.is_empty() {
                    named.remove(&route);
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

    fn keys(key: &str, range_end: &str) -> Interest {
        Interest::Keys {
            key: Bytes::copy_from_slice(key.as_bytes()),
            range_end: Bytes::copy_from_slice(range_end.as_bytes()),
        }
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
        let mut key_a = hub.subscribe(keys("a", ""), subscribe, 10);
        let mut key_b = hub.subscribe(keys("b", ""), subscribe, 10);
        let mut prefix_t = hub.subscribe(Interest::prefix(b"t/"), subscribe, 10);
        let mut from_m = hub.subscribe(keys("m", "\0"), subscribe, 10);
        assert_eq!(hub.entry_count(), 4);

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
        assert_eq!(hub.entry_count(), 3);
    }

    fn message(topic: &str, revision: i64) -> Event {
        Event::Topic(conclave_state::Message {
            topic: topic.into(),
            seq: 1,
            revision,
            time_ms: 0,
            data: Bytes::new(),
            from: String::new(),
        })
    }

    #[tokio::test]
    async fn waits_hear_only_of_their_topics_and_queues() {
        let hub = Arc::new(WatchHub::default());
        let (events, _) = broadcast::channel(16);
        let subscribe = || events.subscribe();
        let topics = Interest::Topics(vec!["x".into(), "y".into(), "x".into()]);
        let mut inbox = hub.subscribe(topics, subscribe, 10);
        let mut claim = hub.subscribe(Interest::Queue("jobs".into()), subscribe, 10);
        assert_eq!(
            hub.entry_count(),
            3,
            "one entry per distinct topic, one for the queue"
        );

        events
            .send(batch(11, vec![put("k", 11), message("z", 11)]))
            .unwrap();
        events
            .send(batch(12, vec![put("k", 12), message("y", 12)]))
            .unwrap();
        events
            .send(batch(13, vec![put("k", 13), Event::Queue("other".into())]))
            .unwrap();
        events
            .send(batch(14, vec![put("k", 14), Event::Queue("jobs".into())]))
            .unwrap();
        assert_eq!(received(&mut inbox).await, vec![12]);
        assert_eq!(received(&mut claim).await, vec![14]);
        drop(inbox);
        assert_eq!(hub.entry_count(), 1);
    }

    #[tokio::test]
    async fn revisions_that_skip_the_broadcast_resync_every_watch() {
        let hub = Arc::new(WatchHub::default());
        let (events, _) = broadcast::channel(16);
        let mut key_a = hub.subscribe(keys("a", ""), || events.subscribe(), 10);
        let mut key_b = hub.subscribe(keys("b", ""), || events.subscribe(), 10);
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
        let mut key_a = hub.subscribe(keys("a", ""), || live, 10);
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
        let watch = hub.subscribe(keys("a", ""), || events.subscribe(), 0);
        for revision in 1..=(WATCH_QUEUE_BATCHES_MAX as i64 + 1) {
            events
                .send(batch(revision, vec![put("a", revision)]))
                .unwrap();
        }
        tokio::time::timeout(Duration::from_secs(10), async {
            while hub.entry_count() > 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the hub drops the watch whose queue is full");
        assert!(watch.fell_behind());
    }
}
