//! Routes each applied batch of events to the subscriptions it concerns, and to no other:
//! watches (by key range) and the calls that wait for a change (lock and campaign waits, work
//! queue claims, topic inbox waits, by what they wait on).
//!
//! ```text
//!  driver apply ─► broadcast<AppliedEvents> ─► hub task ─┬─ one lookup per event: its key, its
//!                  (one receiver: the hub)               │  election group, topic or queue
//!                                                        ├─ one lookup per watched prefix
//!                                                        │  length: the key's own prefixes
//!                                                        └─ one check per other key range
//!                                          ─► each concerned subscription's own bounded queue
//! ```
//!
//! Each watch and each waiting call used to hold its own receiver of the broadcast, so every
//! applied batch woke every one of them, and most found nothing for them in it. With thousands
//! of agents each watching their own keys, or waiting on their inbox, that was thousands of
//! task wake-ups per put, and it halved the cluster's put rate (docs/performance.md). The hub
//! takes the one wake-up per batch and hands a subscription only the batches it has events in.
//!
//! While a member has no subscription at all its driver publishes no batch (the hub's task
//! would wake for each one, for good, after the first watch); the first subscription after
//! such a spell tells the hub the revision it read, and the hub counts revisions from there.
//!
//! A subscription that sees only some batches can no longer tell on its own that revisions
//! went by without passing through the broadcast (a follower installing a snapshot, or the
//! hub falling behind the broadcast). The hub checks that on the whole stream and sends every
//! subscription a [`HubMessage::Resync`]: a watch then reads the revisions after the last it
//! has seen from the history, a waiting call checks the state again.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use conclave_state::Event;
use tokio::sync::{broadcast, mpsc};

use crate::node::{APPLIED_EVENTS_BUFFER_MAX, AppliedEvents};

/// Batches queued for one watch (or one Conclave election observer) before the hub gives up
/// on it as too slow (a watch is then cancelled with [`super::watch::SLOW_WATCHER_REASON`] and
/// the client watches again from its last revision; an observer starts over from CURRENT).
pub const WATCH_QUEUE_BATCHES_MAX: usize = 4096;
/// Batches queued for all of a member's watches and observers together, the bound the shared
/// broadcast gave them before. Past it, a subscription that already holds
/// [`WATCH_QUEUE_FAIR_SHARE`] batches or more is dropped as too slow when its next batch comes:
/// without the bound, slow watches on different keys could each hold their own
/// [`WATCH_QUEUE_BATCHES_MAX`] batches.
pub const HUB_QUEUED_BATCHES_MAX: usize = APPLIED_EVENTS_BUFFER_MAX;
/// A subscription holding fewer batches than this is never dropped for the member's bound, so
/// slow watches cannot get the ones that keep up cancelled.
pub const WATCH_QUEUE_FAIR_SHARE: usize = 64;

/// How a subscription takes its batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Delivery {
    /// Every batch, in order: watches and observers, which pass the events on.
    Every,
    /// Only that something changed: waits and streams that read the state afresh. At most one
    /// message is queued, later ones fold into it, and the subscription is never dropped.
    Signal,
}

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
        Interest::Keys {
            key: Bytes::copy_from_slice(prefix),
            range_end: conclave_state::mvcc::prefix_end(prefix),
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

    /// The key range of a watch on more than one key: a prefix when the range is exactly the
    /// keys that start with `key` (etcd's `--prefix`), which an event finds by lookup.
    fn span(&self) -> Option<Span> {
        match self {
            Interest::Keys { key, range_end } if !range_end.is_empty() => {
                // Also right for "" and for all-0xff prefixes, whose end is "\0": every key
                // from them on starts with them.
                let is_prefix = conclave_state::mvcc::prefix_end(key) == *range_end;
                Some(if is_prefix {
                    Span::Prefix(key.clone())
                } else {
                    Span::Range(key.clone(), range_end.clone())
                })
            }
            _ => None,
        }
    }
}

/// A watch's range of keys. Every key in [`key`, `prefix_end(key)`) starts with `key`, so a
/// prefix watch concerns an event exactly when the event's key starts with it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Span {
    Prefix(Bytes),
    /// [start, end), `end` = "\0" for every key from `start` on.
    Range(Bytes, Bytes),
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
    delivery: Delivery,
    sender: mpsc::Sender<HubMessage>,
    slow: Arc<AtomicBool>,
}

#[derive(Default)]
struct Registry {
    /// Subscriptions by exact name: a key, an election group, a topic, a queue.
    named: HashMap<Route, Vec<Entry>>,
    /// Watches on a prefix, by prefix. An event looks up its key's own prefixes, at the
    /// lengths in `prefix_lengths`: thousands of agents each watching their own prefix cost
    /// an event a few lookups, not a check per watch.
    prefixes: HashMap<Bytes, Vec<Entry>>,
    /// Prefix length -> how many distinct prefixes of that length `prefixes` holds.
    prefix_lengths: BTreeMap<usize, usize>,
    /// Watches on any other range, by (key, range end); each event checks every one.
    ranges: HashMap<(Bytes, Bytes), Vec<Entry>>,
}

/// Forgets one distinct prefix of `length` in `prefix_lengths`, when its group is removed.
fn forget_prefix_length(prefix_lengths: &mut BTreeMap<usize, usize>, length: usize) {
    if let Some(count) = prefix_lengths.get_mut(&length) {
        *count -= 1;
        if *count == 0 {
            prefix_lengths.remove(&length);
        }
    }
}

impl Registry {
    fn add(&mut self, interest: &Interest, entry: impl Fn() -> Entry) {
        for route in interest.routes() {
            self.named.entry(route).or_default().push(entry());
        }
        match interest.span() {
            Some(Span::Prefix(prefix)) => {
                let length = prefix.len();
                let group = self.prefixes.entry(prefix).or_default();
                if group.is_empty() {
                    *self.prefix_lengths.entry(length).or_default() += 1;
                }
                group.push(entry());
            }
            Some(Span::Range(start, end)) => {
                self.ranges.entry((start, end)).or_default().push(entry());
            }
            None => {}
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
        match interest.span() {
            Some(Span::Prefix(prefix)) => {
                if let Some(group) = self.prefixes.get_mut(&prefix) {
                    group.retain(|entry| entry.id != id);
                    if group.is_empty() {
                        self.prefixes.remove(&prefix);
                        forget_prefix_length(&mut self.prefix_lengths, prefix.len());
                    }
                }
            }
            Some(Span::Range(start, end)) => {
                let range = (start, end);
                if let Some(group) = self.ranges.get_mut(&range) {
                    group.retain(|entry| entry.id != id);
                    if group.is_empty() {
                        self.ranges.remove(&range);
                    }
                }
            }
            None => {}
        }
    }

    fn count(&self) -> usize {
        self.named.values().map(Vec::len).sum::<usize>()
            + self.prefixes.values().map(Vec::len).sum::<usize>()
            + self.ranges.values().map(Vec::len).sum::<usize>()
    }

    /// Drops every group left empty by deliveries.
    fn drop_empty_groups(&mut self) {
        let Registry {
            named,
            prefixes,
            prefix_lengths,
            ranges,
        } = self;
        named.retain(|_, group| !group.is_empty());
        prefixes.retain(|prefix, group| {
            if group.is_empty() {
                forget_prefix_length(prefix_lengths, prefix.len());
            }
            !group.is_empty()
        });
        ranges.retain(|_, group| !group.is_empty());
    }

    fn clear(&mut self) {
        self.named.clear();
        self.prefixes.clear();
        self.prefix_lengths.clear();
        self.ranges.clear();
    }
}

/// Hands `message` to every entry of `group`. An `Every` entry whose queue is full, or which
/// holds its fair share while the member's queued batches are at [`HUB_QUEUED_BATCHES_MAX`], is
/// marked slow and dropped; a full `Signal` entry already has its wake-up; one whose
/// subscriber is gone is dropped.
fn deliver(group: &mut Vec<Entry>, queued: &AtomicUsize, message: impl Fn() -> HubMessage) {
    group.retain(|entry| {
        let every = entry.delivery == Delivery::Every;
        let holds = entry.sender.max_capacity() - entry.sender.capacity();
        if every
            && queued.load(Ordering::Relaxed) >= HUB_QUEUED_BATCHES_MAX
            && holds >= WATCH_QUEUE_FAIR_SHARE
        {
            entry.slow.store(true, Ordering::Relaxed);
            return false;
        }
        match entry.sender.try_send(message()) {
            Ok(()) => {
                if every {
                    queued.fetch_add(1, Ordering::Relaxed);
                }
                true
            }
            Err(mpsc::error::TrySendError::Full(_)) if !every => true,
            Err(mpsc::error::TrySendError::Full(_)) => {
                entry.slow.store(true, Ordering::Relaxed);
                false
            }
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        }
    })
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
        delivery: Delivery,
        read: impl FnOnce(&conclave_state::StateMachine) -> T,
    ) -> (Subscription, T) {
        self.node.read_state(|state| {
            let subscription = self.watch_hub.subscribe(
                interest,
                delivery,
                || self.node.events.subscribe(),
                state.revision(),
            );
            (subscription, read(state))
        })
    }
}

/// One member's subscriptions to its applied events and the task that feeds them.
pub struct WatchHub {
    registry: Mutex<Registry>,
    /// Batches in the queues of `Every` subscriptions, not yet taken.
    queued: AtomicUsize,
    next_id: AtomicU64,
    /// Set once the hub task runs (started by the first subscription).
    started: AtomicBool,
    /// The revision a subscription read when it registered on a member with none, or
    /// [`NO_RESTART`]: the member published no batch meanwhile (the driver skips them while
    /// nobody subscribes), so the hub's last revision is stale, and the revisions between are
    /// in what that subscription read. The hub starts counting from here at its next batch,
    /// rather than taking the revisions it did not see pass for a gap and resyncing.
    restart_at: AtomicI64,
    /// Live subscriptions, shared with the node's driver (see
    /// [`crate::node::NodeHandle::subscriptions`]).
    subscriptions: Arc<AtomicUsize>,
}

/// [`WatchHub::restart_at`] when no subscription restarted the count.
const NO_RESTART: i64 = i64::MIN;

impl Default for WatchHub {
    fn default() -> WatchHub {
        WatchHub {
            registry: Mutex::default(),
            queued: AtomicUsize::new(0),
            next_id: AtomicU64::new(0),
            started: AtomicBool::new(false),
            restart_at: AtomicI64::new(NO_RESTART),
            subscriptions: Arc::default(),
        }
    }
}

/// One subscription's place in the hub: its queue, and its entries, removed when this is
/// dropped.
pub(crate) struct Subscription {
    hub: Arc<WatchHub>,
    id: u64,
    interest: Interest,
    delivery: Delivery,
    receiver: mpsc::Receiver<HubMessage>,
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
        if let Some(message) = self.recv().await {
            return Some(message);
        }
        if !self.fell_behind() {
            return None;
        }
        let fresh = self
            .hub
            .register(self.interest.clone(), self.delivery, None);
        drop(std::mem::replace(self, fresh));
        Some(HubMessage::Resync)
    }

    /// The next message as the hub queued it; `None` once the hub dropped this subscription
    /// ([`Subscription::fell_behind`] says whether for falling behind) or stopped.
    pub async fn recv(&mut self) -> Option<HubMessage> {
        let message = self.receiver.recv().await;
        if message.is_some() {
            self.taken(1);
        }
        message
    }

    fn taken(&self, count: usize) {
        if self.delivery == Delivery::Every {
            self.hub.queued.fetch_sub(count, Ordering::Relaxed);
        }
    }

    /// [`Subscription::next`] for callers that only re-read the state: true on a batch this
    /// subscription is interested in or a resync, false once the hub stopped.
    pub async fn changed(&mut self) -> bool {
        self.next().await.is_some()
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        // Out of the registry first, so the hub queues nothing more here, then give back
        // what is still queued.
        self.hub.registry().remove(&self.interest, self.id);
        self.hub.subscriptions.fetch_sub(1, Ordering::Relaxed);
        let mut left = 0;
        while self.receiver.try_recv().is_ok() {
            left += 1;
        }
        self.taken(left);
    }
}

impl WatchHub {
    /// A hub that keeps its count of live subscriptions in `subscriptions`.
    pub fn counting_into(subscriptions: Arc<AtomicUsize>) -> WatchHub {
        WatchHub {
            subscriptions,
            ..WatchHub::default()
        }
    }

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
        delivery: Delivery,
        subscribe: impl FnOnce() -> broadcast::Receiver<AppliedEvents>,
        revision: i64,
    ) -> Subscription {
        if !self.started.swap(true, Ordering::AcqRel) {
            tokio::spawn(self.clone().run(subscribe(), revision));
        }
        self.register(interest, delivery, Some(revision))
    }

    /// Adds a subscription; `read_at` is the revision its caller read under the state's read
    /// lock, if it holds that lock now.
    fn register(
        self: &Arc<Self>,
        interest: Interest,
        delivery: Delivery,
        read_at: Option<i64>,
    ) -> Subscription {
        let capacity = match delivery {
            Delivery::Every => WATCH_QUEUE_BATCHES_MAX,
            Delivery::Signal => 1,
        };
        let (sender, receiver) = mpsc::channel(capacity);
        let slow = Arc::new(AtomicBool::new(false));
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let first = self.subscriptions.fetch_add(1, Ordering::Relaxed) == 0;
        if first && let Some(revision) = read_at {
            self.restart_at.store(revision, Ordering::Release);
        }
        self.registry().add(&interest, || Entry {
            id,
            delivery,
            sender: sender.clone(),
            slow: slow.clone(),
        });
        Subscription {
            hub: self.clone(),
            id,
            interest,
            delivery,
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
            let received = live.recv().await;
            let restart = self.restart_at.swap(NO_RESTART, Ordering::AcqRel);
            if restart != NO_RESTART {
                seen = Some(restart);
            }
            match received {
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
                    self.registry().clear();
                    return;
                }
            }
        }
    }

    fn resync_all(&self) {
        let mut registry = self.registry();
        let Registry {
            named,
            prefixes,
            ranges,
            ..
        } = &mut *registry;
        for group in named
            .values_mut()
            .chain(prefixes.values_mut())
            .chain(ranges.values_mut())
        {
            deliver(group, &self.queued, || HubMessage::Resync);
        }
        registry.drop_empty_groups();
    }

    /// Hands `batch` to each subscription with an event of it in range, once per route.
    fn route(&self, batch: AppliedEvents) {
        let mut registry = self.registry();
        let Registry {
            named,
            prefixes,
            prefix_lengths,
            ranges,
        } = &mut *registry;
        let mut named_hit: Vec<Route> = Vec::new();
        let mut prefix_hit: Vec<Bytes> = Vec::new();
        let mut range_hit: Vec<(Bytes, Bytes)> = Vec::new();
        for event in batch.events.iter() {
            let route = route_of(event);
            if named.contains_key(&route) && !named_hit.contains(&route) {
                named_hit.push(route);
            }
            let Event::Kv(event) = event else {
                continue;
            };
            let key = &event.kv.key;
            for &length in prefix_lengths.range(..=key.len()).map(|(length, _)| length) {
                let prefix = &key[..length];
                if prefixes.contains_key(prefix) && !prefix_hit.iter().any(|p| p == prefix) {
                    prefix_hit.push(key.slice(..length));
                }
            }
            for (start, end) in ranges.keys() {
                if in_range(key, start, end)
                    && !range_hit.iter().any(|(s, e)| s == start && e == end)
                {
                    range_hit.push((start.clone(), end.clone()));
                }
            }
        }
        // Only the groups delivered to can have emptied: walking every group here would cost
        // each batch a step per watch again.
        for route in named_hit {
            if let Some(group) = named.get_mut(&route) {
                deliver(group, &self.queued, || HubMessage::Batch(batch.clone()));
                if group.is_empty() {
                    named.remove(&route);
                }
            }
        }
        for prefix in prefix_hit {
            if let Some(group) = prefixes.get_mut(&prefix) {
                deliver(group, &self.queued, || HubMessage::Batch(batch.clone()));
                if group.is_empty() {
                    prefixes.remove(&prefix);
                    forget_prefix_length(prefix_lengths, prefix.len());
                }
            }
        }
        for range in range_hit {
            if let Some(group) = ranges.get_mut(&range) {
                deliver(group, &self.queued, || HubMessage::Batch(batch.clone()));
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
            watch.taken(1);
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
        let mut key_a = hub.subscribe(keys("a", ""), Delivery::Every, subscribe, 10);
        let mut key_b = hub.subscribe(keys("b", ""), Delivery::Every, subscribe, 10);
        let mut prefix_t = hub.subscribe(Interest::prefix(b"t/"), Delivery::Every, subscribe, 10);
        let mut from_m = hub.subscribe(keys("m", "\0"), Delivery::Every, subscribe, 10);
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

    fn put_bytes(key: &[u8], mod_revision: i64) -> Event {
        Event::Kv(WatchEvent {
            kind: EventKind::Put,
            kv: KeyValue {
                key: Bytes::copy_from_slice(key),
                mod_revision,
                ..KeyValue::default()
            },
            prev_kv: None,
        })
    }

    /// Keys of 0 to 3 bytes over `a`, `b` and 0xff, so that prefixes nest, ranges straddle
    /// them, and `prefix_end` has to carry past 0xff.
    fn small_key(seed: &mut u64) -> Vec<u8> {
        let mut next = || {
            *seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (*seed >> 33) as usize
        };
        let length = next() % 4;
        (0..length)
            .map(|_| [b'a', b'b', 0xff][next() % 3])
            .collect()
    }

    #[tokio::test]
    async fn prefix_watches_found_by_lookup_match_the_ranges_they_stand_for() {
        let hub = Arc::new(WatchHub::default());
        let (events, _) = broadcast::channel(4096);
        let subscribe = || events.subscribe();
        let mut seed = 7;
        // Watches: single keys, prefixes (etcd's `--prefix`, found by lookup), "from key on"
        // and arbitrary ranges (checked one by one), each with the range it must cover.
        let mut watches = Vec::new();
        for index in 0..120 {
            let key = small_key(&mut seed);
            let interest = match index % 4 {
                0 => Interest::Keys {
                    key: Bytes::from(key.clone()),
                    range_end: Bytes::new(),
                },
                1 | 2 => Interest::prefix(&key),
                _ => Interest::Keys {
                    key: Bytes::from(key.clone()),
                    range_end: Bytes::from(small_key(&mut seed)),
                },
            };
            let Interest::Keys { key, range_end } = interest.clone() else {
                unreachable!("key interests only");
            };
            let watch = hub.subscribe(interest, Delivery::Every, subscribe, 0);
            watches.push((key, range_end, watch));
        }
        let prefixes = hub.registry().prefixes.len();
        assert!(
            prefixes > 10,
            "only {prefixes} prefixes were filed by lookup"
        );
        let mut done = hub.subscribe(
            Interest::Topics(vec!["done".into()]),
            Delivery::Every,
            subscribe,
            0,
        );
        for revision in 1..=200 {
            let key = small_key(&mut seed);
            events
                .send(batch(revision, vec![put_bytes(&key, revision)]))
                .unwrap();
        }
        // The hub routes batches in order: once the marker batch arrived, every put batch
        // before it has reached its watches, however busy the machine is.
        // (At revision 200 again: a batch whose revision has no KV event reads as a skip.)
        events.send(batch(200, vec![message("done", 200)])).unwrap();
        let marker = tokio::time::timeout(Duration::from_secs(30), done.receiver.recv()).await;
        assert!(
            matches!(marker, Ok(Some(HubMessage::Batch(_)))),
            "the hub did not route the marker batch"
        );
        drop(done);
        // Replay the keys sent to know what each watch must have received.
        let mut replay = 7;
        for (index, _) in watches.iter().enumerate() {
            small_key(&mut replay);
            if index % 4 == 3 {
                small_key(&mut replay);
            }
        }
        let keys: Vec<Vec<u8>> = (0..200).map(|_| small_key(&mut replay)).collect();
        for (start, end, watch) in watches.iter_mut() {
            let expected: Vec<i64> = keys
                .iter()
                .zip(1..)
                .filter(|(key, _)| {
                    if end.is_empty() {
                        key.as_slice() == start.as_ref()
                    } else {
                        in_range(key, start, end)
                    }
                })
                .map(|(_, revision)| revision)
                .collect();
            assert_eq!(
                received(watch).await,
                expected,
                "watch [{start:?}, {end:?}) got other batches than its range holds"
            );
        }
        // Dropping every watch empties the index, lengths included.
        watches.clear();
        let registry = hub.registry();
        assert!(registry.prefixes.is_empty() && registry.prefix_lengths.is_empty());
        assert_eq!(registry.count(), 0);
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
        let mut inbox = hub.subscribe(topics, Delivery::Every, subscribe, 10);
        let mut claim = hub.subscribe(
            Interest::Queue("jobs".into()),
            Delivery::Every,
            subscribe,
            10,
        );
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
    async fn a_signal_subscription_holds_one_wake_up_and_is_never_dropped() {
        let hub = Arc::new(WatchHub::default());
        let (events, _) = broadcast::channel(WATCH_QUEUE_BATCHES_MAX + 16);
        let mut wait = hub.subscribe(keys("a", ""), Delivery::Signal, || events.subscribe(), 0);
        for revision in 1..=(WATCH_QUEUE_BATCHES_MAX as i64 + 1) {
            events
                .send(batch(revision, vec![put("a", revision)]))
                .unwrap();
        }
        assert_eq!(
            received(&mut wait).await,
            vec![1],
            "later batches fold into the first"
        );
        assert!(!wait.fell_behind());
        assert_eq!(hub.entry_count(), 1);
        assert_eq!(
            hub.queued.load(Ordering::Relaxed),
            0,
            "signals take no share of the budget"
        );
        let next = WATCH_QUEUE_BATCHES_MAX as i64 + 2;
        events.send(batch(next, vec![put("a", next)])).unwrap();
        assert_eq!(
            received(&mut wait).await,
            vec![next],
            "and it is woken again"
        );
    }

    #[tokio::test]
    async fn the_members_watches_together_queue_at_most_the_hub_budget() {
        let hub = Arc::new(WatchHub::default());
        let batches = WATCH_QUEUE_BATCHES_MAX - 1;
        let (events, _) = broadcast::channel(batches + 16);
        // Enough watches that never read, each under its own cap, to pass the member's budget.
        let count = HUB_QUEUED_BATCHES_MAX / batches + 2;
        let names: Vec<String> = (0..count).map(|i| format!("k{i}")).collect();
        let watches: Vec<Subscription> = names
            .iter()
            .map(|name| hub.subscribe(keys(name, ""), Delivery::Every, || events.subscribe(), 0))
            .collect();
        // A watch on a quiet key holds few batches: the bound never drops it.
        let quiet = hub.subscribe(keys("quiet", ""), Delivery::Every, || events.subscribe(), 0);
        for revision in 1..=batches as i64 {
            let mut puts: Vec<Event> = names.iter().map(|name| put(name, revision)).collect();
            if revision % 1000 == 0 {
                puts.push(put("quiet", revision));
            }
            events.send(batch(revision, puts)).unwrap();
        }
        tokio::time::timeout(Duration::from_secs(10), async {
            while watches.iter().all(|watch| !watch.fell_behind()) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .unwrap_or_else(|_| {
            panic!(
                "the budget drops a watch: {} queued, {} entries",
                hub.queued.load(Ordering::Relaxed),
                hub.entry_count()
            )
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        let most = HUB_QUEUED_BATCHES_MAX + (count + 1) * WATCH_QUEUE_FAIR_SHARE;
        assert!(hub.queued.load(Ordering::Relaxed) <= most);
        assert!(!quiet.fell_behind(), "a watch within its fair share stays");
        drop(watches);
        drop(quiet);
        assert_eq!(
            hub.queued.load(Ordering::Relaxed),
            0,
            "dropped watches give back their share"
        );
    }

    #[tokio::test]
    async fn revisions_that_skip_the_broadcast_resync_every_watch() {
        let hub = Arc::new(WatchHub::default());
        let (events, _) = broadcast::channel(16);
        let mut key_a = hub.subscribe(keys("a", ""), Delivery::Every, || events.subscribe(), 10);
        let mut key_b = hub.subscribe(keys("b", ""), Delivery::Every, || events.subscribe(), 10);
        events.send(batch(11, vec![put("a", 11)])).unwrap();
        // A snapshot installed at revision 20: an empty batch that jumps.
        events.send(batch(20, Vec::new())).unwrap();
        events.send(batch(21, vec![put("b", 21)])).unwrap();
        assert_eq!(received(&mut key_a).await, vec![11, -1]);
        assert_eq!(received(&mut key_b).await, vec![-1, 21]);
    }

    #[tokio::test]
    async fn a_subscription_after_a_spell_without_any_starts_the_count_where_it_read() {
        let hub = Arc::new(WatchHub::default());
        let (events, _) = broadcast::channel(16);
        let first = hub.subscribe(keys("a", ""), Delivery::Every, || events.subscribe(), 10);
        events.send(batch(11, vec![put("a", 11)])).unwrap();
        tokio::time::sleep(Duration::from_millis(30)).await;
        drop(first);
        // Revisions 12 to 15 are applied with nobody subscribed: the driver publishes none.
        // The next subscription read revision 15, so 16 continues what it has.
        let mut next = hub.subscribe(keys("a", ""), Delivery::Every, || events.subscribe(), 15);
        events.send(batch(16, vec![put("a", 16)])).unwrap();
        assert_eq!(
            received(&mut next).await,
            vec![16],
            "no resync for the spell"
        );
        // A snapshot installed later still jumps, and still resyncs.
        events.send(batch(30, Vec::new())).unwrap();
        events.send(batch(31, vec![put("a", 31)])).unwrap();
        assert_eq!(received(&mut next).await, vec![-1, 31]);
    }

    #[tokio::test]
    async fn a_hub_behind_the_broadcast_resyncs_every_watch() {
        let hub = Arc::new(WatchHub::default());
        let (events, _) = broadcast::channel(2);
        let live = events.subscribe();
        let mut key_a = hub.subscribe(keys("a", ""), Delivery::Every, || live, 10);
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
        let watch = hub.subscribe(keys("a", ""), Delivery::Every, || events.subscribe(), 0);
        overflow_until_dropped(&hub, &events, 0).await;
        assert!(watch.fell_behind());
    }

    /// Sends one batch for key "a" more than a queue holds, then waits until the hub has
    /// dropped entries down to `entries_left`.
    async fn overflow_until_dropped(
        hub: &WatchHub,
        events: &broadcast::Sender<AppliedEvents>,
        entries_left: usize,
    ) {
        for revision in 1..=(WATCH_QUEUE_BATCHES_MAX as i64 + 1) {
            events
                .send(batch(revision, vec![put("a", revision)]))
                .unwrap();
        }
        tokio::time::timeout(Duration::from_secs(10), async {
            while hub.entry_count() > entries_left {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the hub drops the watch whose queue is full");
    }

    /// The driver tells the leader this member is awaited while the count is above zero: it
    /// counts each live subscription once, through a resync too, and none once dropped.
    #[tokio::test]
    async fn live_subscriptions_are_counted_for_the_driver() {
        let count = Arc::new(AtomicUsize::new(0));
        let hub = Arc::new(WatchHub::counting_into(count.clone()));
        let (events, _) = broadcast::channel(WATCH_QUEUE_BATCHES_MAX + 16);
        let mut watch = hub.subscribe(keys("a", ""), Delivery::Every, || events.subscribe(), 0);
        let wait = hub.subscribe(keys("b", ""), Delivery::Signal, || events.subscribe(), 0);
        assert_eq!(count.load(Ordering::Relaxed), 2);
        overflow_until_dropped(&hub, &events, 1).await;
        assert_eq!(
            count.load(Ordering::Relaxed),
            2,
            "a dropped-behind subscription still has its client"
        );
        while !matches!(watch.next().await, Some(HubMessage::Resync)) {}
        assert_eq!(count.load(Ordering::Relaxed), 2, "a resync registers anew");
        drop(watch);
        assert_eq!(count.load(Ordering::Relaxed), 1);
        drop(wait);
        assert_eq!(count.load(Ordering::Relaxed), 0);
    }
}
