//! Multi-version key-value store with etcd v3 revision semantics.
//!
//! ```text
//!   write (put/delete) ──► record at (revision+1, sub) ──► pending events
//!                                                              │ finish_write()
//!   range(at rev) ◄── per-key history (sorted by revision) ◄───┘ revision += 1 (if any write)
//!   events_since(rev) ◄── the same history, merged across keys in (revision, sub) order
//! ```
//!
//! Each key keeps a short history of records sorted by `(mod_revision, sub)`. A record with
//! `version == 0` is a tombstone. Compaction at revision C keeps every record at or above C and,
//! for each key, the newest record below C when it is a live value (it is what a read at C sees).
//! So reads and watch replays at any revision >= C are exact.

use std::cmp::Ordering;
use std::ops::Bound;

use bytes::Bytes;
use imbl::OrdMap;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::history::History;

/// One key's value as of some revision, as etcd's `mvccpb.KeyValue`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyValue {
    /// The key.
    pub key: Bytes,
    /// Revision of the write that created this generation of the key.
    pub create_revision: i64,
    /// Revision of the last write to the key.
    pub mod_revision: i64,
    /// 1 on creation, +1 per write; a deleted key has no version.
    pub version: i64,
    /// The value.
    pub value: Bytes,
    /// The lease the key is attached to, 0 for none.
    pub lease: i64,
}

/// Whether an event wrote or deleted its key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum EventKind {
    /// A put: `kv` holds the new value.
    Put,
    /// A delete: `kv` holds only the key and the deleting revision in `mod_revision`.
    Delete,
}

/// A change to one key, for watchers. All events of one revision come out together, in the
/// order the writes happened.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchEvent {
    /// Put or delete.
    pub kind: EventKind,
    /// The key after the change (for a delete: key and `mod_revision` only).
    pub kv: KeyValue,
    /// The key before the change, if it existed. Servers strip it for watchers that did not ask.
    pub prev_kv: Option<KeyValue>,
}

/// Sort order of a range, as etcd's `RangeRequest.SortOrder`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum SortOrder {
    /// No sorting: results are in key order.
    #[default]
    None,
    /// Lowest first.
    Ascend,
    /// Highest first.
    Descend,
}

/// What a range is sorted by, as etcd's `RangeRequest.SortTarget`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum SortTarget {
    /// The key bytes.
    #[default]
    Key,
    /// The key's version.
    Version,
    /// The key's create revision.
    Create,
    /// The key's mod revision.
    Mod,
    /// The value bytes.
    Value,
}

/// A read of one key or a key range, as etcd's `RangeRequest`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RangeRequest {
    /// First key (or the only key when `range_end` is empty).
    pub key: Bytes,
    /// End of the range, exclusive. Empty: just `key`. `"\0"`: every key >= `key`.
    pub range_end: Bytes,
    /// Most keys to return; 0 for no limit.
    pub limit: i64,
    /// Revision to read at; 0 or less for the current revision.
    pub revision: i64,
    /// Sort order.
    pub sort_order: SortOrder,
    /// Sort target.
    pub sort_target: SortTarget,
    /// Return keys without values.
    pub keys_only: bool,
    /// Return only the count.
    pub count_only: bool,
    /// Drop keys whose mod revision is below this (0: no bound).
    pub min_mod_revision: i64,
    /// Drop keys whose mod revision is above this (0: no bound).
    pub max_mod_revision: i64,
    /// Drop keys whose create revision is below this (0: no bound).
    pub min_create_revision: i64,
    /// Drop keys whose create revision is above this (0: no bound).
    pub max_create_revision: i64,
}

impl RangeRequest {
    /// A read of one key at the current revision.
    pub fn key(key: impl Into<Bytes>) -> Self {
        RangeRequest {
            key: key.into(),
            ..RangeRequest::default()
        }
    }

    /// A read of every key starting with `prefix`, at the current revision.
    pub fn prefix(prefix: impl Into<Bytes>) -> Self {
        let key: Bytes = prefix.into();
        let range_end = prefix_end(&key);
        RangeRequest {
            key,
            range_end,
            ..RangeRequest::default()
        }
    }
}

/// The answer to a [`RangeRequest`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RangeResponse {
    /// Matching keys (empty when `count_only`).
    pub kvs: Vec<KeyValue>,
    /// True when `limit` cut off more matching keys.
    pub more: bool,
    /// Number of keys in the range at that revision (before min/max filters and the limit).
    pub count: i64,
}

/// The `range_end` that selects every key with the given prefix, as etcd's `GetPrefixRangeEnd`.
pub fn prefix_end(prefix: &[u8]) -> Bytes {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return Bytes::from(end);
        }
    }
    // Only 0xff bytes (or empty): every key from the prefix on.
    Bytes::from_static(b"\0")
}

/// Start and end bounds of a key range.
pub(crate) type KeyBounds<'a> = (Bound<&'a [u8]>, Bound<&'a [u8]>);

/// Converts etcd's (key, range_end) encoding to map bounds. `None` means an empty range.
pub(crate) fn range_bounds<'a>(key: &'a [u8], range_end: &'a [u8]) -> Option<KeyBounds<'a>> {
    if range_end.is_empty() {
        return Some((Bound::Included(key), Bound::Included(key)));
    }
    if range_end == b"\0" {
        return Some((Bound::Included(key), Bound::Unbounded));
    }
    if range_end <= key {
        return None;
    }
    Some((Bound::Included(key), Bound::Excluded(range_end)))
}

/// True when `candidate` lies in etcd's (key, range_end) range.
pub(crate) fn range_contains(key: &[u8], range_end: &[u8], candidate: &[u8]) -> bool {
    match range_bounds(key, range_end) {
        None => false,
        Some((_, Bound::Included(end))) => candidate == end,
        Some((_, Bound::Unbounded)) => candidate >= key,
        Some((_, Bound::Excluded(end))) => candidate >= key && candidate < end,
    }
}

/// One write to a key. `version == 0` marks a tombstone.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Record {
    mod_revision: i64,
    /// Position of the write within its revision (a Txn writes several keys in one revision).
    sub: u32,
    create_revision: i64,
    version: i64,
    lease: i64,
    value: Bytes,
}

impl Record {
    fn is_live(&self) -> bool {
        self.version > 0
    }

    fn to_kv(&self, key: &Bytes) -> KeyValue {
        KeyValue {
            key: key.clone(),
            create_revision: self.create_revision,
            mod_revision: self.mod_revision,
            version: self.version,
            value: self.value.clone(),
            lease: self.lease,
        }
    }
}

/// The record a read at `at` sees (`None`: the newest, including pending writes).
fn visible(history: &History<Record>, at: Option<i64>) -> Option<&Record> {
    let record = match at {
        None => history.last(),
        Some(revision) => {
            let after = history.partition_point(|record| record.mod_revision <= revision);
            after
                .checked_sub(1)
                .and_then(|position| history.get(position))
        }
    };
    record.filter(|record| record.is_live())
}

/// The MVCC store. Writes go to revision `revision + 1` until [`KvStore::finish_write`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvStore {
    /// Invariant: each history is non-empty and sorted by (mod_revision, sub).
    /// A persistent map: cloning the store is O(1) and the clone stays as it was while the
    /// original moves on, so a snapshot can be encoded on another thread (see `docs/state.md`).
    /// It serializes exactly as a `BTreeMap` would (a length, then the pairs in key order).
    /// A history's clone shares its older records too (see `history.rs`), so the first write
    /// to a map node after a freeze costs the same however long the node's histories are.
    keys: OrdMap<Bytes, History<Record>>,
    /// Invariant: revision >= 1 and revision >= compact_revision.
    revision: i64,
    compact_revision: i64,
    /// Writes made at `revision + 1` since the last `finish_write`. Invariant: 0 between commands.
    pending_writes: u32,
    #[serde(skip)]
    pending_events: Vec<WatchEvent>,
}

impl Default for KvStore {
    fn default() -> Self {
        KvStore::new()
    }
}

impl KvStore {
    /// An empty store at revision 1, as etcd.
    pub fn new() -> Self {
        KvStore {
            keys: OrdMap::new(),
            revision: 1,
            compact_revision: 0,
            pending_writes: 0,
            pending_events: Vec::new(),
        }
    }

    /// The revision of the last committed write (1 on an empty store).
    pub fn revision(&self) -> i64 {
        self.revision
    }

    /// Reads below this revision fail as compacted.
    pub fn compact_revision(&self) -> i64 {
        self.compact_revision
    }

    /// The revision the pending writes will get.
    pub(crate) fn write_revision(&self) -> i64 {
        self.revision + 1
    }

    /// True when the current command has written something.
    pub(crate) fn has_pending_writes(&self) -> bool {
        self.pending_writes > 0
    }

    /// Number of live keys (walks the store; for tests and benchmarks).
    pub fn live_key_count(&self) -> usize {
        self.keys
            .values()
            .filter(|history| visible(history, None).is_some())
            .count()
    }

    /// Resolves a requested read revision: 0 or less means current. Errors outside the history.
    pub fn check_revision(&self, revision: i64) -> Result<i64> {
        if revision <= 0 {
            return Ok(self.revision);
        }
        if revision > self.revision {
            return Err(Error::FutureRevision {
                current_revision: self.revision,
            });
        }
        if revision < self.compact_revision {
            return Err(Error::Compacted {
                compact_revision: self.compact_revision,
            });
        }
        Ok(revision)
    }

    /// The live value of `key` now (including the current command's writes).
    pub fn get(&self, key: &[u8]) -> Option<KeyValue> {
        let (stored_key, history) = self.keys.get_key_value(key)?;
        visible(history, None).map(|record| record.to_kv(stored_key))
    }

    /// Live keys in the range now, in key order.
    pub(crate) fn live_keys(&self, key: &[u8], range_end: &[u8]) -> Vec<Bytes> {
        let Some(bounds) = range_bounds(key, range_end) else {
            return Vec::new();
        };
        self.keys
            .range::<_, [u8]>(bounds)
            .filter(|(_, history)| visible(history, None).is_some())
            .map(|(key, _)| key.clone())
            .collect()
    }

    /// Live key-values in the range now, in key order.
    pub(crate) fn live_kvs(&self, key: &[u8], range_end: &[u8]) -> Vec<KeyValue> {
        let Some(bounds) = range_bounds(key, range_end) else {
            return Vec::new();
        };
        self.keys
            .range::<_, [u8]>(bounds)
            .filter_map(|(key, history)| visible(history, None).map(|record| record.to_kv(key)))
            .collect()
    }

    /// etcd's Range with no byte budget (tests and callers that bound the answer otherwise).
    /// Reads at the current revision include the current command's writes, as an etcd Txn
    /// reads its own writes.
    pub fn range(&self, request: &RangeRequest) -> Result<RangeResponse> {
        self.range_within(request, usize::MAX)
            .map(|(response, _)| response)
    }

    /// etcd's Range, refused with [`Error::RangeTooLarge`] as soon as the key-values it holds
    /// pass `bytes_max` bytes (see [`range_answer_bytes`]), so an over-budget answer is never
    /// built. Filters are applied before a key-value is taken, values are not taken for
    /// `keys_only` (unless the sort needs them), and a sorted read with a `limit` keeps only
    /// its best `limit` candidates as it goes: the budget counts what the answer can hold, not
    /// the size of the range. `count_only` takes nothing. Returns the answer and the most bytes
    /// it held at any point (what was checked against the budget).
    pub fn range_within(
        &self,
        request: &RangeRequest,
        bytes_max: usize,
    ) -> Result<(RangeResponse, usize)> {
        if request.key.is_empty() {
            return Err(Error::EmptyKey);
        }
        let revision = self.check_revision(request.revision)?;
        let at = if revision == self.revision {
            None
        } else {
            Some(revision)
        };
        let sorting =
            request.sort_order != SortOrder::None || request.sort_target != SortTarget::Key;
        let limit = usize::try_from(request.limit)
            .ok()
            .filter(|&limit| limit > 0);
        // In key order, one key past the limit is enough to know `more`.
        let fetch_max = match limit {
            Some(limit) if !sorting => limit.saturating_add(1),
            _ => usize::MAX,
        };
        let take_values = !request.keys_only || request.sort_target == SortTarget::Value;
        let mut kvs = Vec::new();
        let mut held_bytes: usize = 0;
        let mut peak_bytes: usize = 0;
        let mut count: i64 = 0;
        let mut more = false;
        if let Some(bounds) = range_bounds(&request.key, &request.range_end) {
            for (key, history) in self.keys.range::<_, [u8]>(bounds) {
                let Some(record) = visible(history, at) else {
                    continue;
                };
                count += 1;
                if request.count_only || kvs.len() >= fetch_max {
                    continue;
                }
                let mut kv = record.to_kv(key);
                if !passes_filters(request, &kv) {
                    continue;
                }
                if !take_values {
                    kv.value = Bytes::new();
                }
                held_bytes = held_bytes.saturating_add(range_answer_bytes(&kv));
                peak_bytes = peak_bytes.max(held_bytes);
                if held_bytes > bytes_max {
                    return Err(Error::RangeTooLarge {
                        bytes_max: u64::try_from(bytes_max).unwrap_or(u64::MAX),
                    });
                }
                kvs.push(kv);
                if sorting && let Some(limit) = limit {
                    // Keep the best `limit` so far (the sort is stable and keys come in
                    // order, so ties resolve as a full sort would).
                    if kvs.len() > limit.saturating_mul(2).max(64) {
                        sort_kvs(&mut kvs, request.sort_order, request.sort_target);
                        for dropped in kvs.drain(limit..) {
                            held_bytes -= range_answer_bytes(&dropped);
                        }
                        more = true;
                    }
                }
            }
        }
        if request.count_only {
            let response = RangeResponse {
                kvs: Vec::new(),
                more: false,
                count,
            };
            return Ok((response, 0));
        }
        sort_kvs(&mut kvs, request.sort_order, request.sort_target);
        if let Some(limit) = limit
            && kvs.len() > limit
        {
            kvs.truncate(limit);
            more = true;
        }
        if request.keys_only && take_values {
            for kv in &mut kvs {
                kv.value = Bytes::new();
            }
        }
        Ok((RangeResponse { kvs, more, count }, peak_bytes))
    }

    /// Writes `key` at the pending revision. Returns the previous live value and the new one.
    /// Callers have validated the request; this cannot fail.
    pub(crate) fn put(
        &mut self,
        key: Bytes,
        value: Bytes,
        lease: i64,
    ) -> (Option<KeyValue>, KeyValue) {
        let revision = self.write_revision();
        let sub = self.pending_writes;
        self.pending_writes += 1;
        // Store private copies: a request's Bytes may be a slice of a much larger buffer, which
        // the store would otherwise keep alive for as long as the key exists.
        if !self.keys.contains_key(&key[..]) {
            self.keys
                .insert(Bytes::copy_from_slice(&key), History::default());
        }
        let value = Bytes::copy_from_slice(&value);
        let Some(history) = self.keys.get_mut(&key[..]) else {
            unreachable!("inserted above")
        };
        let previous = visible(history, None).map(|record| record.to_kv(&key));
        let (create_revision, version) = match &previous {
            Some(prev) => (prev.create_revision, prev.version + 1),
            None => (revision, 1),
        };
        let record = Record {
            mod_revision: revision,
            sub,
            create_revision,
            version,
            lease,
            value,
        };
        if let Some(last) = history.last() {
            assert!(
                (last.mod_revision, last.sub) < (revision, sub),
                "history out of order"
            );
        }
        let kv = record.to_kv(&key);
        history.push(record);
        self.pending_events.push(WatchEvent {
            kind: EventKind::Put,
            kv: kv.clone(),
            prev_kv: previous.clone(),
        });
        (previous, kv)
    }

    /// Deletes a live `key` at the pending revision and returns its last value (`None` if it was
    /// not live, in which case nothing is written).
    pub(crate) fn delete(&mut self, key: &[u8]) -> Option<KeyValue> {
        let revision = self.write_revision();
        let (stored_key, history) = self.keys.get_key_value(key)?;
        let previous = visible(history, None)?.to_kv(stored_key);
        let stored_key = stored_key.clone();
        let sub = self.pending_writes;
        self.pending_writes += 1;
        let tombstone = Record {
            mod_revision: revision,
            sub,
            create_revision: 0,
            version: 0,
            lease: 0,
            value: Bytes::new(),
        };
        if let Some(history) = self.keys.get_mut(key) {
            history.push(tombstone);
        }
        let kv = KeyValue {
            key: stored_key,
            mod_revision: revision,
            ..KeyValue::default()
        };
        self.pending_events.push(WatchEvent {
            kind: EventKind::Delete,
            kv,
            prev_kv: Some(previous.clone()),
        });
        Some(previous)
    }

    /// Ends the current command's writes: the revision moves on if anything was written.
    /// Returns the command's events in write order.
    pub(crate) fn finish_write(&mut self) -> Vec<WatchEvent> {
        if self.pending_writes > 0 {
            self.revision += 1;
            self.pending_writes = 0;
        }
        assert!(
            self.pending_events
                .iter()
                .all(|event| event.kv.mod_revision == self.revision)
        );
        std::mem::take(&mut self.pending_events)
    }

    /// Drops history below `revision`. etcd's errors for revisions already compacted or not yet
    /// reached.
    pub fn compact(&mut self, revision: i64) -> Result<()> {
        if revision <= self.compact_revision {
            return Err(Error::Compacted {
                compact_revision: self.compact_revision,
            });
        }
        if revision > self.revision {
            return Err(Error::FutureRevision {
                current_revision: self.revision,
            });
        }
        // The persistent map's `retain` cannot change values, so find the histories to trim
        // first, then trim them (each `get_mut` copies only the path to its key if shared).
        let mut trims = Vec::new();
        for (key, history) in &self.keys {
            let below = history.partition_point(|record| record.mod_revision < revision);
            let keep_from = match below.checked_sub(1) {
                Some(newest_below) if history.get(newest_below).is_some_and(Record::is_live) => {
                    newest_below
                }
                _ => below,
            };
            if keep_from > 0 {
                trims.push((key.clone(), keep_from));
            }
        }
        for (key, keep_from) in trims {
            let emptied = match self.keys.get_mut(&key[..]) {
                Some(history) => {
                    history.drop_oldest(keep_from);
                    history.is_empty()
                }
                None => false,
            };
            if emptied {
                self.keys.remove(&key[..]);
            }
        }
        self.compact_revision = revision;
        Ok(())
    }

    /// Every event at revision >= `start_revision` on keys in the range, in revision order, so
    /// a watch can start in the past. `start_revision <= 0` means "from now on": nothing to
    /// replay.
    pub fn events_since(
        &self,
        start_revision: i64,
        key: &[u8],
        range_end: &[u8],
    ) -> Result<Vec<WatchEvent>> {
        if start_revision <= 0 || start_revision > self.revision {
            return Ok(Vec::new());
        }
        if start_revision < self.compact_revision {
            return Err(Error::Compacted {
                compact_revision: self.compact_revision,
            });
        }
        let Some(bounds) = range_bounds(key, range_end) else {
            return Ok(Vec::new());
        };
        let mut found: Vec<(i64, u32, WatchEvent)> = Vec::new();
        for (stored_key, history) in self.keys.range::<_, [u8]>(bounds) {
            let first = history.partition_point(|record| record.mod_revision < start_revision);
            let mut before = first
                .checked_sub(1)
                .and_then(|position| history.get(position));
            for record in history.iter_from(first) {
                if record.mod_revision > self.revision {
                    break; // pending writes of the command being applied
                }
                let prev_kv = before
                    .replace(record)
                    .filter(|before| before.is_live())
                    .map(|before| before.to_kv(stored_key));
                let event = if record.is_live() {
                    WatchEvent {
                        kind: EventKind::Put,
                        kv: record.to_kv(stored_key),
                        prev_kv,
                    }
                } else {
                    let kv = KeyValue {
                        key: stored_key.clone(),
                        mod_revision: record.mod_revision,
                        ..KeyValue::default()
                    };
                    WatchEvent {
                        kind: EventKind::Delete,
                        kv,
                        prev_kv,
                    }
                };
                found.push((record.mod_revision, record.sub, event));
            }
        }
        found.sort_by_key(|(revision, sub, _)| (*revision, *sub));
        Ok(found.into_iter().map(|(_, _, event)| event).collect())
    }

    /// Checks the structural invariants without panicking (a restored snapshot is input).
    pub(crate) fn verify(&self) -> std::result::Result<(), String> {
        if self.revision < 1 || self.revision < self.compact_revision {
            return Err(format!(
                "revision {} vs compaction {}",
                self.revision, self.compact_revision
            ));
        }
        if self.pending_writes != 0 {
            return Err("unfinished writes".into());
        }
        for (key, history) in &self.keys {
            let ordered = history
                .iter()
                .zip(history.iter().skip(1))
                .all(|(older, newer)| {
                    (older.mod_revision, older.sub) < (newer.mod_revision, newer.sub)
                });
            let in_range = history
                .iter()
                .all(|record| record.mod_revision <= self.revision);
            if history.is_empty() || !ordered || !in_range {
                return Err(format!("history of key {key:?} is malformed"));
            }
        }
        Ok(())
    }

    /// Asserts the structural invariants.
    pub fn check_invariants(&self) {
        let verdict = self.verify();
        assert!(verdict.is_ok(), "kv invariant broken: {verdict:?}");
    }

    /// Counts a write that has no key (a topic publish), so the revision moves on.
    pub(crate) fn mark_write(&mut self) {
        self.pending_writes += 1;
    }
}

/// What one key-value costs a range answer's byte budget: its key and the value it carries.
/// The fixed-size fields are left out; they are small next to any answer worth refusing.
pub fn range_answer_bytes(kv: &KeyValue) -> usize {
    kv.key.len().saturating_add(kv.value.len())
}

fn passes_filters(request: &RangeRequest, kv: &KeyValue) -> bool {
    let above = |value: i64, min: i64| min == 0 || value >= min;
    let below = |value: i64, max: i64| max == 0 || value <= max;
    above(kv.mod_revision, request.min_mod_revision)
        && below(kv.mod_revision, request.max_mod_revision)
        && above(kv.create_revision, request.min_create_revision)
        && below(kv.create_revision, request.max_create_revision)
}

/// Sorts as etcd does (a non-key target with no order means ascending). Ties keep key order so
/// the answer is deterministic.
fn sort_kvs(kvs: &mut [KeyValue], order: SortOrder, target: SortTarget) {
    let order = match (order, target) {
        (SortOrder::None, SortTarget::Key) => return,
        (SortOrder::None, _) => SortOrder::Ascend,
        (order, _) => order,
    };
    let compare = |a: &KeyValue, b: &KeyValue| -> Ordering {
        match target {
            SortTarget::Key => a.key.cmp(&b.key),
            SortTarget::Version => a.version.cmp(&b.version),
            SortTarget::Create => a.create_revision.cmp(&b.create_revision),
            SortTarget::Mod => a.mod_revision.cmp(&b.mod_revision),
            SortTarget::Value => a.value.cmp(&b.value),
        }
    };
    match order {
        SortOrder::Descend => kvs.sort_by(|a, b| compare(b, a)),
        _ => kvs.sort_by(compare),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The persistent map must put the same bytes on disk as the `BTreeMap` it replaced, or
    /// images written before the change would no longer load (and vice versa).
    #[test]
    fn the_key_map_encodes_exactly_as_a_btreemap() {
        let mut store = KvStore::new();
        for i in 0..500u32 {
            put(
                &mut store,
                &format!("key/{:04}", (i * 7919) % 500),
                &format!("v{i}"),
            );
        }
        let as_btree: std::collections::BTreeMap<Bytes, Vec<Record>> = store
            .keys
            .iter()
            .map(|(key, history)| (key.clone(), history.iter().cloned().collect()))
            .collect();
        assert_eq!(
            postcard::to_allocvec(&store.keys).expect("in memory"),
            postcard::to_allocvec(&as_btree).expect("in memory")
        );
        let decoded: OrdMap<Bytes, History<Record>> =
            postcard::from_bytes(&postcard::to_allocvec(&as_btree).expect("in memory"))
                .expect("decodes");
        assert_eq!(decoded, store.keys);
    }

    /// A clone is a snapshot: writes to the original after cloning leave it untouched.
    #[test]
    fn a_clone_stays_as_it_was_while_the_original_moves_on() {
        let mut store = KvStore::new();
        for i in 0..300 {
            put(&mut store, &format!("k{i}"), "before");
        }
        let frozen = store.clone();
        let frozen_bytes = postcard::to_allocvec(&frozen).expect("in memory");
        for i in 0..300 {
            put(&mut store, &format!("k{i}"), "after");
        }
        store.compact(store.revision()).expect("compacts");
        assert_eq!(
            frozen.get(b"k7").map(|kv| kv.value),
            Some(Bytes::from("before"))
        );
        assert_eq!(
            store.get(b"k7").map(|kv| kv.value),
            Some(Bytes::from("after"))
        );
        assert_eq!(
            postcard::to_allocvec(&frozen).expect("in memory"),
            frozen_bytes
        );
    }

    fn put(store: &mut KvStore, key: &str, value: &str) -> i64 {
        store.put(
            Bytes::from(key.to_owned()),
            Bytes::from(value.to_owned()),
            0,
        );
        store.finish_write();
        store.revision()
    }

    #[test]
    fn revisions_start_at_one_and_versions_count_writes() {
        let mut store = KvStore::new();
        assert_eq!(store.revision(), 1);
        assert_eq!(put(&mut store, "a", "1"), 2);
        assert_eq!(put(&mut store, "a", "2"), 3);
        let kv = store.get(b"a").expect("live");
        assert_eq!((kv.create_revision, kv.mod_revision, kv.version), (2, 3, 2));
        store.delete(b"a");
        store.finish_write();
        assert_eq!(store.revision(), 4);
        assert!(store.get(b"a").is_none());
        assert_eq!(put(&mut store, "a", "3"), 5);
        let kv = store.get(b"a").expect("live");
        assert_eq!((kv.create_revision, kv.version), (5, 1));
    }

    #[test]
    fn historic_reads_and_compaction() {
        let mut store = KvStore::new();
        put(&mut store, "a", "1"); // 2
        put(&mut store, "a", "2"); // 3
        put(&mut store, "b", "1"); // 4
        let at_two = RangeRequest {
            revision: 2,
            ..RangeRequest::prefix("")
        };
        let at_two = RangeRequest {
            key: Bytes::from_static(b"\0"),
            ..at_two
        };
        let response = store.range(&at_two).expect("read");
        assert_eq!(response.kvs.len(), 1);
        assert_eq!(response.kvs[0].value, Bytes::from_static(b"1"));
        store.compact(3).expect("compact");
        assert_eq!(
            store.range(&at_two),
            Err(Error::Compacted {
                compact_revision: 3
            })
        );
        let at_three = RangeRequest {
            revision: 3,
            ..at_two.clone()
        };
        assert_eq!(store.range(&at_three).expect("read").kvs.len(), 1);
        assert_eq!(
            store.compact(3),
            Err(Error::Compacted {
                compact_revision: 3
            })
        );
        assert_eq!(
            store.compact(9),
            Err(Error::FutureRevision {
                current_revision: 4
            })
        );
        let future = RangeRequest {
            revision: 5,
            ..at_two
        };
        assert_eq!(
            store.range(&future),
            Err(Error::FutureRevision {
                current_revision: 4
            })
        );
        store.check_invariants();
    }

    #[test]
    fn events_replay_with_prev_kv_and_respect_compaction() {
        let mut store = KvStore::new();
        put(&mut store, "a", "1"); // 2
        put(&mut store, "a", "2"); // 3
        store.delete(b"a");
        store.finish_write(); // 4
        let events = store.events_since(3, b"a", b"").expect("replay");
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].kind, EventKind::Put);
        assert_eq!(
            events[0].prev_kv.as_ref().map(|kv| kv.value.clone()),
            Some(Bytes::from_static(b"1"))
        );
        assert_eq!(events[1].kind, EventKind::Delete);
        assert_eq!(events[1].kv.mod_revision, 4);
        store.compact(4).expect("compact");
        assert!(store.events_since(3, b"a", b"").is_err());
        // The delete at exactly the compaction revision is still replayable.
        assert_eq!(store.events_since(4, b"a", b"").expect("replay").len(), 1);
    }

    #[test]
    fn prefix_end_matches_etcd() {
        assert_eq!(prefix_end(b"abc"), Bytes::from_static(b"abd"));
        assert_eq!(prefix_end(b"a\xff"), Bytes::from_static(b"b"));
        assert_eq!(prefix_end(b"\xff\xff"), Bytes::from_static(b"\0"));
        assert!(range_contains(b"a", b"\0", b"zzz"));
        assert!(!range_contains(b"b", b"a", b"b"));
    }
}
