//! Model-based property test: the KV (through `StateMachine::apply`) against a reference model
//! that keeps a full copy of the key space at every revision.
//!
//! Random sequences of puts, range deletes, Txns, compactions and ranges (current and historic,
//! with limits, sorting and filters) must give the same answers as the model, and watch replay
//! from any revision must equal the differences between the model's copies.

use std::collections::BTreeMap;

use bytes::Bytes;
use conclave_state::{
    Command, Compare, CompareResult, CompareTarget, Config, DeleteRangeRequest, Error, EventKind,
    KeyValue, PutRequest, RangeRequest, Request, RequestOp, Response, ResponseOp, SortOrder,
    SortTarget, StateMachine, TxnRequest,
};
use proptest::prelude::*;

const KEYS: &[&str] = &["a", "ab", "b", "c", "d"];

#[derive(Clone, Debug)]
enum Op {
    Put {
        key: usize,
        value: u8,
    },
    Delete {
        key: usize,
        end: Option<usize>,
    },
    Txn {
        compare_key: usize,
        version: i64,
        then_put: usize,
        then_delete: usize,
        else_key: usize,
    },
    Compact {
        back: i64,
    },
    Range {
        key: usize,
        end: Option<usize>,
        back: i64,
        limit: i64,
        sort: u8,
        min_mod: i64,
    },
    Watch {
        back: i64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let key = 0..KEYS.len();
    let end = proptest::option::of(0..KEYS.len() + 1);
    prop_oneof![
        4 => (key.clone(), any::<u8>()).prop_map(|(key, value)| Op::Put { key, value }),
        1 => (key.clone(), end.clone()).prop_map(|(key, end)| Op::Delete { key, end }),
        2 => (key.clone(), 0i64..3, key.clone(), key.clone(), key.clone()).prop_map(
            |(compare_key, version, then_put, then_delete, else_key)| Op::Txn {
                compare_key, version, then_put, then_delete, else_key
            }
        ),
        1 => (0i64..6).prop_map(|back| Op::Compact { back }),
        3 => (key, end, 0i64..8, 0i64..4, 0u8..6, 0i64..6).prop_map(
            |(key, end, back, limit, sort, min_mod)| Op::Range { key, end, back, limit, sort, min_mod }
        ),
        1 => (0i64..8).prop_map(|back| Op::Watch { back }),
    ]
}

fn key_bytes(index: usize) -> Bytes {
    Bytes::from(KEYS[index])
}

/// `None` end: a single key. `Some(KEYS.len())`: everything from the key on ("\0").
fn end_bytes(end: Option<usize>) -> Bytes {
    match end {
        None => Bytes::new(),
        Some(index) if index == KEYS.len() => Bytes::from_static(b"\0"),
        Some(index) => key_bytes(index),
    }
}

fn in_range(key: &[u8], start: &[u8], end: &[u8]) -> bool {
    if end.is_empty() {
        key == start
    } else if end == b"\0" {
        key >= start
    } else {
        key >= start && key < end
    }
}

/// The reference: the whole key space at every revision.
struct Model {
    /// `states[r]` is the key space at revision r (index 0 unused).
    states: Vec<BTreeMap<Bytes, KeyValue>>,
    compacted: i64,
}

impl Model {
    fn new() -> Self {
        Model {
            states: vec![BTreeMap::new(), BTreeMap::new()],
            compacted: 0,
        }
    }

    fn revision(&self) -> i64 {
        self.states.len() as i64 - 1
    }

    fn current(&self) -> &BTreeMap<Bytes, KeyValue> {
        &self.states[self.states.len() - 1]
    }

    /// Applies a list of writes as one revision (if any changes anything).
    fn write(&mut self, writes: &[(Bytes, Option<Bytes>)]) {
        let revision = self.revision() + 1;
        let mut next = self.current().clone();
        let mut changed = false;
        for (key, value) in writes {
            match value {
                Some(value) => {
                    let kv = match next.get(key) {
                        Some(prev) => KeyValue {
                            mod_revision: revision,
                            version: prev.version + 1,
                            value: value.clone(),
                            ..prev.clone()
                        },
                        None => KeyValue {
                            key: key.clone(),
                            create_revision: revision,
                            mod_revision: revision,
                            version: 1,
                            value: value.clone(),
                            lease: 0,
                        },
                    };
                    next.insert(key.clone(), kv);
                    changed = true;
                }
                None => changed |= next.remove(key).is_some(),
            }
        }
        if changed {
            self.states.push(next);
        }
    }

    fn keys_in(&self, start: &[u8], end: &[u8]) -> Vec<Bytes> {
        self.current()
            .keys()
            .filter(|key| in_range(key, start, end))
            .cloned()
            .collect()
    }

    fn check_revision(&self, revision: i64) -> Result<i64, Error> {
        if revision <= 0 {
            return Ok(self.revision());
        }
        if revision > self.revision() {
            return Err(Error::FutureRevision {
                current_revision: self.revision(),
            });
        }
        if revision < self.compacted {
            return Err(Error::Compacted {
                compact_revision: self.compacted,
            });
        }
        Ok(revision)
    }
}

struct Harness {
    machine: StateMachine,
    model: Model,
    index: u64,
}

impl Harness {
    fn apply(&mut self, request: Request) -> (i64, Result<Response, Error>) {
        self.index += 1;
        let output = self
            .machine
            .apply(self.index, &Command::new(self.index, request));
        (output.revision, output.result)
    }

    fn step(&mut self, op: &Op) {
        match op {
            Op::Put { key, value } => {
                let value = Bytes::from(vec![*value]);
                let request = PutRequest {
                    prev_kv: true,
                    ..PutRequest::new(key_bytes(*key), value.clone())
                };
                let expected_prev = self.model.current().get(&key_bytes(*key)).cloned();
                let (revision, result) = self.apply(Request::Put(request));
                self.model.write(&[(key_bytes(*key), Some(value))]);
                let Ok(Response::Put(response)) = result else {
                    panic!("put failed: {result:?}")
                };
                assert_eq!(response.prev_kv, expected_prev);
                assert_eq!(revision, self.model.revision());
            }
            Op::Delete { key, end } => {
                let (start, end) = (key_bytes(*key), end_bytes(*end));
                let doomed = self.model.keys_in(&start, &end);
                let request = DeleteRangeRequest {
                    key: start,
                    range_end: end,
                    prev_kv: false,
                };
                let (revision, result) = self.apply(Request::DeleteRange(request));
                let writes: Vec<_> = doomed.iter().map(|key| (key.clone(), None)).collect();
                self.model.write(&writes);
                let Ok(Response::DeleteRange(response)) = result else {
                    panic!("delete failed")
                };
                assert_eq!(response.deleted, doomed.len() as i64);
                assert_eq!(revision, self.model.revision());
            }
            Op::Txn {
                compare_key,
                version,
                then_put,
                then_delete,
                else_key,
            } => self.txn(*compare_key, *version, *then_put, *then_delete, *else_key),
            Op::Compact { back } => {
                let target = self.model.revision() - back;
                let expected = if target <= self.model.compacted {
                    Err(Error::Compacted {
                        compact_revision: self.model.compacted,
                    })
                } else {
                    Ok(Response::Compacted)
                };
                let (_, result) = self.apply(Request::Compact { revision: target });
                if expected.is_ok() {
                    self.model.compacted = target;
                }
                assert_eq!(result, expected);
            }
            Op::Range {
                key,
                end,
                back,
                limit,
                sort,
                min_mod,
            } => {
                let revision = if *back == 0 {
                    0
                } else {
                    self.model.revision() - back + 1
                };
                let (sort_order, sort_target) = match sort {
                    0 => (SortOrder::None, SortTarget::Key),
                    1 => (SortOrder::Descend, SortTarget::Key),
                    2 => (SortOrder::Ascend, SortTarget::Mod),
                    3 => (SortOrder::Descend, SortTarget::Create),
                    4 => (SortOrder::None, SortTarget::Version),
                    _ => (SortOrder::Descend, SortTarget::Value),
                };
                let request = RangeRequest {
                    key: key_bytes(*key),
                    range_end: end_bytes(*end),
                    revision,
                    limit: *limit,
                    sort_order,
                    sort_target,
                    min_mod_revision: *min_mod,
                    ..RangeRequest::default()
                };
                let expected = self.model_range(&request);
                assert_eq!(self.machine.range(&request), expected, "query {request:?}");
            }
            Op::Watch { back } => {
                let start = (self.model.revision() - back).max(1);
                let result = self.machine.events_since(start, b"\0", b"\0");
                if start < self.model.compacted {
                    assert_eq!(
                        result,
                        Err(Error::Compacted {
                            compact_revision: self.model.compacted
                        })
                    );
                    return;
                }
                let Ok(events) = result else {
                    panic!("replay failed: {result:?}")
                };
                let mut got: Vec<(i64, Bytes, EventKind, Option<KeyValue>)> = events
                    .into_iter()
                    .map(|event| {
                        (
                            event.kv.mod_revision,
                            event.kv.key.clone(),
                            event.kind,
                            event.prev_kv,
                        )
                    })
                    .collect();
                got.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
                assert_eq!(got, self.model_events(start));
            }
        }
    }

    fn txn(
        &mut self,
        compare_key: usize,
        version: i64,
        then_put: usize,
        then_delete: usize,
        else_key: usize,
    ) {
        let compare = Compare::new(
            key_bytes(compare_key),
            CompareResult::Equal,
            CompareTarget::Version(version),
        );
        let put = RequestOp::Put(PutRequest::new(
            key_bytes(then_put),
            Bytes::from_static(b"t"),
        ));
        let delete = RequestOp::DeleteRange(DeleteRangeRequest {
            key: key_bytes(then_delete),
            ..DeleteRangeRequest::default()
        });
        let read = RequestOp::Range(RangeRequest::key(key_bytes(else_key)));
        let request = TxnRequest {
            compare: vec![compare],
            success: vec![delete, put, read.clone()],
            failure: vec![read],
        };
        let holds = self
            .model
            .current()
            .get(&key_bytes(compare_key))
            .map_or(0, |kv| kv.version)
            == version;
        let (revision, result) = self.apply(Request::Txn(request));
        if then_put == then_delete {
            // etcd checks this statically, whatever the compares say.
            assert_eq!(result, Err(Error::DuplicateKey));
            return;
        }
        let Ok(Response::Txn(response)) = result else {
            panic!("txn failed: {result:?}")
        };
        assert_eq!(response.succeeded, holds);
        if holds {
            self.model.write(&[
                (key_bytes(then_delete), None),
                (key_bytes(then_put), Some(Bytes::from_static(b"t"))),
            ]);
        }
        // The read sees the Txn's own writes.
        let expected_read = self.model.current().get(&key_bytes(else_key)).cloned();
        let Some(ResponseOp::Range(read)) = response.responses.last() else {
            panic!("no read")
        };
        assert_eq!(read.kvs.first().cloned(), expected_read);
        assert_eq!(revision, self.model.revision());
    }

    fn model_range(&self, request: &RangeRequest) -> Result<conclave_state::RangeResponse, Error> {
        let revision = self.model.check_revision(request.revision)?;
        let state = &self.model.states[revision as usize];
        let all: Vec<KeyValue> = state
            .values()
            .filter(|kv| in_range(&kv.key, &request.key, &request.range_end))
            .cloned()
            .collect();
        let count = all.len() as i64;
        let mut kvs: Vec<KeyValue> = all
            .into_iter()
            .filter(|kv| {
                request.min_mod_revision == 0 || kv.mod_revision >= request.min_mod_revision
            })
            .collect();
        let key_of = |kv: &KeyValue| -> (i64, Bytes) {
            match request.sort_target {
                SortTarget::Key => (0, kv.key.clone()),
                SortTarget::Mod => (kv.mod_revision, Bytes::new()),
                SortTarget::Create => (kv.create_revision, Bytes::new()),
                SortTarget::Version => (kv.version, Bytes::new()),
                SortTarget::Value => (0, kv.value.clone()),
            }
        };
        match request.sort_order {
            SortOrder::Descend => kvs.sort_by_key(|kv| std::cmp::Reverse(key_of(kv))),
            _ => kvs.sort_by_key(key_of),
        }
        let mut more = false;
        if request.limit > 0 && kvs.len() > request.limit as usize {
            kvs.truncate(request.limit as usize);
            more = true;
        }
        Ok(conclave_state::RangeResponse { kvs, more, count })
    }

    fn model_events(&self, start: i64) -> Vec<(i64, Bytes, EventKind, Option<KeyValue>)> {
        let mut events = Vec::new();
        for revision in start..=self.model.revision() {
            let before = &self.model.states[revision as usize - 1];
            let after = &self.model.states[revision as usize];
            let keys: std::collections::BTreeSet<&Bytes> =
                before.keys().chain(after.keys()).collect();
            for key in keys {
                match (before.get(key), after.get(key)) {
                    (prev, Some(now)) if now.mod_revision == revision => {
                        events.push((revision, key.clone(), EventKind::Put, prev.cloned()));
                    }
                    (Some(prev), None) => {
                        events.push((revision, key.clone(), EventKind::Delete, Some(prev.clone())));
                    }
                    _ => {}
                }
            }
        }
        events
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn kv_matches_the_reference_model(ops in proptest::collection::vec(op(), 1..80)) {
        let mut harness = Harness { machine: StateMachine::new(Config::default()), model: Model::new(), index: 0 };
        for op in &ops {
            harness.step(op);
        }
        harness.machine.check_invariants();
    }
}
