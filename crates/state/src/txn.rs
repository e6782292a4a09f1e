//! etcd v3 KV requests (Put, DeleteRange, Txn) and the Txn checks that run before any write.
//!
//! A Txn is atomic: its compares are all evaluated against the state before the Txn (nested
//! Txns included, as etcd does), every check that could fail runs on the chosen path first, and
//! only then are the writes made, all in one revision.

use std::collections::BTreeSet;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::mvcc::{KeyValue, KvStore, RangeRequest, RangeResponse, range_contains};

/// etcd's `PutRequest`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutRequest {
    /// The key.
    pub key: Bytes,
    /// The value.
    pub value: Bytes,
    /// Lease to attach the key to; 0 for none (detaches a previous lease).
    pub lease: i64,
    /// Return the previous value.
    pub prev_kv: bool,
    /// Keep the current value (the key must exist and `value` must be empty).
    pub ignore_value: bool,
    /// Keep the current lease (the key must exist and `lease` must be 0).
    pub ignore_lease: bool,
}

impl PutRequest {
    /// A plain put.
    pub fn new(key: impl Into<Bytes>, value: impl Into<Bytes>) -> Self {
        PutRequest {
            key: key.into(),
            value: value.into(),
            ..PutRequest::default()
        }
    }
}

/// etcd's `PutResponse`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutResponse {
    /// The previous value, when asked for and present.
    pub prev_kv: Option<KeyValue>,
}

/// etcd's `DeleteRangeRequest`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeleteRangeRequest {
    /// First key (or the only key).
    pub key: Bytes,
    /// End of the range, in etcd's encoding (see [`RangeRequest::range_end`]).
    pub range_end: Bytes,
    /// Return the deleted values.
    pub prev_kv: bool,
}

/// etcd's `DeleteRangeResponse`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeleteRangeResponse {
    /// How many keys were deleted.
    pub deleted: i64,
    /// The deleted values, when asked for.
    pub prev_kvs: Vec<KeyValue>,
}

/// What a compare looks at, with the operand.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum CompareTarget {
    /// The key's version (0 when absent).
    Version(i64),
    /// The key's create revision (0 when absent).
    Create(i64),
    /// The key's mod revision (0 when absent).
    Mod(i64),
    /// The value bytes (an absent key fails every value compare).
    Value(Bytes),
    /// The key's lease (0 when absent or unleased).
    Lease(i64),
}

/// The comparison operator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum CompareResult {
    /// `=`
    Equal,
    /// `!=`
    NotEqual,
    /// `<` (the key's field is less than the operand)
    Less,
    /// `>`
    Greater,
}

/// etcd's `Compare`: true when every key in the range satisfies it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Compare {
    /// The key.
    pub key: Bytes,
    /// Optional range end (etcd encoding); empty compares just `key`.
    pub range_end: Bytes,
    /// Field and operand.
    pub target: CompareTarget,
    /// Operator.
    pub result: CompareResult,
}

impl Compare {
    /// A compare on a single key.
    pub fn new(key: impl Into<Bytes>, result: CompareResult, target: CompareTarget) -> Self {
        Compare {
            key: key.into(),
            range_end: Bytes::new(),
            target,
            result,
        }
    }
}

/// One operation of a Txn branch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RequestOp {
    /// A read; it sees the Txn's earlier writes.
    Range(RangeRequest),
    /// A write.
    Put(PutRequest),
    /// A delete.
    DeleteRange(DeleteRangeRequest),
    /// A nested Txn.
    Txn(TxnRequest),
}

/// The answer to one [`RequestOp`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ResponseOp {
    /// Answer to a range.
    Range(RangeResponse),
    /// Answer to a put.
    Put(PutResponse),
    /// Answer to a delete.
    DeleteRange(DeleteRangeResponse),
    /// Answer to a nested Txn.
    Txn(TxnResponse),
}

/// etcd's `TxnRequest`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TxnRequest {
    /// All must hold for `success` to run; otherwise `failure` runs.
    pub compare: Vec<Compare>,
    /// Operations run when every compare holds.
    pub success: Vec<RequestOp>,
    /// Operations run otherwise.
    pub failure: Vec<RequestOp>,
}

/// etcd's `TxnResponse`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TxnResponse {
    /// Whether the compares held.
    pub succeeded: bool,
    /// One answer per operation of the branch that ran.
    pub responses: Vec<ResponseOp>,
}

/// Which branch each Txn (outer first, then nested ones in order) takes, decided up front.
#[derive(Debug)]
pub(crate) struct TxnPath {
    pub(crate) succeeded: bool,
    pub(crate) nested: Vec<TxnPath>,
}

/// Evaluates one compare against the current state.
pub(crate) fn compare_holds(store: &KvStore, compare: &Compare) -> bool {
    let kvs = if compare.range_end.is_empty() {
        store.get(&compare.key).into_iter().collect()
    } else {
        store.live_kvs(&compare.key, &compare.range_end)
    };
    if kvs.is_empty() {
        // An absent key compares as all-zero fields, except that no value compare holds.
        if matches!(compare.target, CompareTarget::Value(_)) {
            return false;
        }
        return compare_kv(compare, &KeyValue::default());
    }
    kvs.iter().all(|kv| compare_kv(compare, kv))
}

fn compare_kv(compare: &Compare, kv: &KeyValue) -> bool {
    let ordering = match &compare.target {
        CompareTarget::Version(operand) => kv.version.cmp(operand),
        CompareTarget::Create(operand) => kv.create_revision.cmp(operand),
        CompareTarget::Mod(operand) => kv.mod_revision.cmp(operand),
        CompareTarget::Lease(operand) => kv.lease.cmp(operand),
        CompareTarget::Value(operand) => kv.value.as_ref().cmp(operand.as_ref()),
    };
    match compare.result {
        CompareResult::Equal => ordering.is_eq(),
        CompareResult::NotEqual => ordering.is_ne(),
        CompareResult::Less => ordering.is_lt(),
        CompareResult::Greater => ordering.is_gt(),
    }
}

/// Decides every branch of the Txn tree against the state before the Txn.
pub(crate) fn decide_path(store: &KvStore, txn: &TxnRequest) -> TxnPath {
    let succeeded = txn
        .compare
        .iter()
        .all(|compare| compare_holds(store, compare));
    let branch = if succeeded {
        &txn.success
    } else {
        &txn.failure
    };
    let nested = branch
        .iter()
        .filter_map(|op| match op {
            RequestOp::Txn(inner) => Some(decide_path(store, inner)),
            _ => None,
        })
        .collect();
    TxnPath { succeeded, nested }
}

/// etcd's static checks: operation counts per list and keys present, recursively.
pub(crate) fn check_shape(txn: &TxnRequest, txn_ops_max: usize) -> Result<()> {
    if txn.compare.len() > txn_ops_max
        || txn.success.len() > txn_ops_max
        || txn.failure.len() > txn_ops_max
    {
        return Err(Error::TooManyOps);
    }
    for compare in &txn.compare {
        if compare.key.is_empty() {
            return Err(Error::EmptyKey);
        }
    }
    for op in txn.success.iter().chain(&txn.failure) {
        match op {
            RequestOp::Range(range) if range.key.is_empty() => return Err(Error::EmptyKey),
            RequestOp::Put(put) if put.key.is_empty() => return Err(Error::EmptyKey),
            RequestOp::DeleteRange(delete) if delete.key.is_empty() => return Err(Error::EmptyKey),
            RequestOp::Txn(inner) => check_shape(inner, txn_ops_max)?,
            _ => {}
        }
    }
    Ok(())
}

/// The keys a list of operations puts and the ranges it deletes.
#[derive(Default)]
struct Writes {
    puts: BTreeSet<Bytes>,
    deletes: Vec<(Bytes, Bytes)>,
}

/// etcd's rule: one Txn may not put the same key twice, nor put a key that one of its deletes
/// covers. The two branches of a nested Txn are alternatives, so they are checked against the
/// enclosing operations but not against each other.
pub(crate) fn check_no_duplicate_writes(txn: &TxnRequest) -> Result<()> {
    collect_writes(&txn.success)?;
    collect_writes(&txn.failure)?;
    Ok(())
}

fn collect_writes(ops: &[RequestOp]) -> Result<Writes> {
    let mut writes = Writes::default();
    for op in ops {
        match op {
            RequestOp::Put(put) => {
                if !writes.puts.insert(put.key.clone()) {
                    return Err(Error::DuplicateKey);
                }
            }
            RequestOp::DeleteRange(delete) => {
                writes
                    .deletes
                    .push((delete.key.clone(), delete.range_end.clone()));
            }
            RequestOp::Range(_) => {}
            RequestOp::Txn(inner) => {
                let success = collect_writes(&inner.success)?;
                let failure = collect_writes(&inner.failure)?;
                let mut nested_puts = success.puts;
                for key in failure.puts {
                    nested_puts.insert(key);
                }
                if nested_puts.iter().any(|key| writes.puts.contains(key)) {
                    return Err(Error::DuplicateKey);
                }
                writes.puts.extend(nested_puts);
                writes.deletes.extend(success.deletes);
                writes.deletes.extend(failure.deletes);
            }
        }
    }
    for key in &writes.puts {
        if writes
            .deletes
            .iter()
            .any(|(start, end)| range_contains(start, end, key))
        {
            return Err(Error::DuplicateKey);
        }
    }
    Ok(writes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(key: &str) -> RequestOp {
        RequestOp::Put(PutRequest::new(key.to_owned(), "v"))
    }

    fn delete(key: &str, range_end: &str) -> RequestOp {
        RequestOp::DeleteRange(DeleteRangeRequest {
            key: Bytes::from(key.to_owned()),
            range_end: Bytes::from(range_end.to_owned()),
            prev_kv: false,
        })
    }

    #[test]
    fn duplicate_puts_and_put_under_delete_are_rejected() {
        let twice = TxnRequest {
            success: vec![put("a"), put("a")],
            ..TxnRequest::default()
        };
        assert_eq!(check_no_duplicate_writes(&twice), Err(Error::DuplicateKey));
        let covered = TxnRequest {
            success: vec![delete("a", "c"), put("b")],
            ..TxnRequest::default()
        };
        assert_eq!(
            check_no_duplicate_writes(&covered),
            Err(Error::DuplicateKey)
        );
        let branches = TxnRequest {
            success: vec![put("a")],
            failure: vec![put("a")],
            ..TxnRequest::default()
        };
        assert_eq!(check_no_duplicate_writes(&branches), Ok(()));
        let two_deletes = TxnRequest {
            success: vec![delete("a", "c"), delete("b", "")],
            ..TxnRequest::default()
        };
        assert_eq!(check_no_duplicate_writes(&two_deletes), Ok(()));
        let nested = TxnRequest {
            success: vec![
                put("a"),
                RequestOp::Txn(TxnRequest {
                    failure: vec![put("a")],
                    ..TxnRequest::default()
                }),
            ],
            ..TxnRequest::default()
        };
        assert_eq!(check_no_duplicate_writes(&nested), Err(Error::DuplicateKey));
    }

    #[test]
    fn too_many_ops() {
        let ops = (0..3).map(|i| put(&format!("k{i}"))).collect();
        let txn = TxnRequest {
            success: ops,
            ..TxnRequest::default()
        };
        assert_eq!(check_shape(&txn, 2), Err(Error::TooManyOps));
        assert_eq!(check_shape(&txn, 3), Ok(()));
    }

    #[test]
    fn absent_key_compares_as_zero() {
        let store = KvStore::new();
        let created = Compare::new("x", CompareResult::Equal, CompareTarget::Create(0));
        assert!(compare_holds(&store, &created));
        let value = Compare::new(
            "x",
            CompareResult::NotEqual,
            CompareTarget::Value(Bytes::new()),
        );
        assert!(!compare_holds(&store, &value));
    }
}
