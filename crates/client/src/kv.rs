//! Key-value operations (etcd v3 KV) and a transaction builder.

use conclave_proto::etcdserverpb as pb;
use conclave_proto::etcdserverpb::kv_client::KvClient;
use conclave_proto::mvccpb;

use crate::Client;
use crate::conn::{Retry, request};
use crate::error::{ErrorContext, Result};
use crate::lease::LeaseId;

/// A key at one revision.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct KeyValue {
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    pub create_revision: i64,
    pub mod_revision: i64,
    /// Writes since creation (1 for a new key).
    pub version: i64,
    /// 0 when the key has no lease.
    pub lease: LeaseId,
}

impl KeyValue {
    /// The key as text, lossily.
    pub fn key_str(&self) -> std::borrow::Cow<'_, str> {
        String::from_utf8_lossy(&self.key)
    }

    /// The value as text, lossily.
    pub fn value_str(&self) -> std::borrow::Cow<'_, str> {
        String::from_utf8_lossy(&self.value)
    }
}

impl From<mvccpb::KeyValue> for KeyValue {
    fn from(kv: mvccpb::KeyValue) -> Self {
        KeyValue {
            key: kv.key.into(),
            value: kv.value.into(),
            create_revision: kv.create_revision,
            mod_revision: kv.mod_revision,
            version: kv.version,
            lease: kv.lease,
        }
    }
}

/// The `range_end` that selects every key starting with `prefix`, as etcd computes it: the
/// prefix with its last byte below 0xff incremented; `"\0"` (all keys) when there is none.
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// Sort order of a range read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SortOrder {
    #[default]
    None,
    Ascend,
    Descend,
}

/// What a range read sorts by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SortTarget {
    #[default]
    Key,
    Version,
    Create,
    Mod,
    Value,
}

/// Options of [`Client::get`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GetOptions {
    /// Every key starting with the given key.
    pub prefix: bool,
    /// Explicit end of a half-open range `[key, range_end)`; overrides `prefix`.
    pub range_end: Option<Vec<u8>>,
    /// Read at this past revision (0: latest).
    pub revision: i64,
    /// At most this many keys (0: no limit).
    pub limit: i64,
    pub sort_order: SortOrder,
    pub sort_target: SortTarget,
    pub keys_only: bool,
    pub count_only: bool,
    /// Answer from the member's local state without a linearizable read barrier.
    pub serializable: bool,
}

impl GetOptions {
    pub fn prefix() -> Self {
        GetOptions {
            prefix: true,
            ..GetOptions::default()
        }
    }

    fn to_request(&self, key: Vec<u8>) -> pb::RangeRequest {
        let range_end = match (&self.range_end, self.prefix) {
            (Some(end), _) => end.clone(),
            (None, true) => prefix_end(&key),
            (None, false) => Vec::new(),
        };
        pb::RangeRequest {
            key: key.into(),
            range_end: range_end.into(),
            limit: self.limit,
            revision: self.revision,
            sort_order: match self.sort_order {
                SortOrder::None => pb::range_request::SortOrder::None,
                SortOrder::Ascend => pb::range_request::SortOrder::Ascend,
                SortOrder::Descend => pb::range_request::SortOrder::Descend,
            } as i32,
            sort_target: match self.sort_target {
                SortTarget::Key => pb::range_request::SortTarget::Key,
                SortTarget::Version => pb::range_request::SortTarget::Version,
                SortTarget::Create => pb::range_request::SortTarget::Create,
                SortTarget::Mod => pb::range_request::SortTarget::Mod,
                SortTarget::Value => pb::range_request::SortTarget::Value,
            } as i32,
            serializable: self.serializable,
            keys_only: self.keys_only,
            count_only: self.count_only,
            ..Default::default()
        }
    }
}

/// Answer of a range read.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GetResponse {
    pub kvs: Vec<KeyValue>,
    /// More keys matched than `limit` let through.
    pub more: bool,
    /// Keys in the range (before the limit).
    pub count: i64,
    /// The store revision the answer reflects.
    pub revision: i64,
}

impl From<pb::RangeResponse> for GetResponse {
    fn from(r: pb::RangeResponse) -> Self {
        GetResponse {
            kvs: r.kvs.into_iter().map(KeyValue::from).collect(),
            more: r.more,
            count: r.count,
            revision: r.header.map_or(0, |h| h.revision),
        }
    }
}

/// Options of [`Client::put`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PutOptions {
    /// Attach the key to this lease (0: none).
    pub lease: LeaseId,
    /// Return the previous value.
    pub prev_kv: bool,
}

/// Answer of a put.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PutResponse {
    pub revision: i64,
    pub prev_kv: Option<KeyValue>,
}

impl From<pb::PutResponse> for PutResponse {
    fn from(r: pb::PutResponse) -> Self {
        PutResponse {
            revision: r.header.map_or(0, |h| h.revision),
            prev_kv: r.prev_kv.map(KeyValue::from),
        }
    }
}

/// Options of [`Client::delete`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeleteOptions {
    pub prefix: bool,
    pub range_end: Option<Vec<u8>>,
    pub prev_kv: bool,
}

impl DeleteOptions {
    pub fn prefix() -> Self {
        DeleteOptions {
            prefix: true,
            ..DeleteOptions::default()
        }
    }
}

/// Answer of a delete.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DeleteResponse {
    pub deleted: i64,
    pub prev_kvs: Vec<KeyValue>,
    pub revision: i64,
}

impl From<pb::DeleteRangeResponse> for DeleteResponse {
    fn from(r: pb::DeleteRangeResponse) -> Self {
        DeleteResponse {
            deleted: r.deleted,
            prev_kvs: r.prev_kvs.into_iter().map(KeyValue::from).collect(),
            revision: r.header.map_or(0, |h| h.revision),
        }
    }
}

/// Comparison operator of a txn compare.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompareOp {
    Equal,
    NotEqual,
    Greater,
    Less,
}

impl CompareOp {
    fn wire(self) -> i32 {
        use pb::compare::CompareResult as R;
        (match self {
            CompareOp::Equal => R::Equal,
            CompareOp::NotEqual => R::NotEqual,
            CompareOp::Greater => R::Greater,
            CompareOp::Less => R::Less,
        }) as i32
    }
}

/// One condition of a transaction.
#[derive(Debug, Clone, PartialEq)]
pub struct Compare(pb::Compare);

impl Compare {
    fn new(
        key: impl Into<Vec<u8>>,
        op: CompareOp,
        target: pb::compare::CompareTarget,
        union: pb::compare::TargetUnion,
    ) -> Self {
        Compare(pb::Compare {
            result: op.wire(),
            target: target as i32,
            key: key.into().into(),
            target_union: Some(union),
            range_end: Default::default(),
        })
    }

    /// Compares the key's value.
    pub fn value(key: impl Into<Vec<u8>>, op: CompareOp, value: impl Into<Vec<u8>>) -> Self {
        use pb::compare::{CompareTarget, TargetUnion};
        Compare::new(
            key,
            op,
            CompareTarget::Value,
            TargetUnion::Value(value.into().into()),
        )
    }

    /// Compares the key's version (0 when absent: `version(k, Equal, 0)` means "k is absent").
    pub fn version(key: impl Into<Vec<u8>>, op: CompareOp, version: i64) -> Self {
        use pb::compare::{CompareTarget, TargetUnion};
        Compare::new(
            key,
            op,
            CompareTarget::Version,
            TargetUnion::Version(version),
        )
    }

    /// Compares the key's creation revision; with a fence this is the fenced-write check.
    pub fn create_revision(key: impl Into<Vec<u8>>, op: CompareOp, revision: i64) -> Self {
        use pb::compare::{CompareTarget, TargetUnion};
        Compare::new(
            key,
            op,
            CompareTarget::Create,
            TargetUnion::CreateRevision(revision),
        )
    }

    /// Compares the key's last modification revision.
    pub fn mod_revision(key: impl Into<Vec<u8>>, op: CompareOp, revision: i64) -> Self {
        use pb::compare::{CompareTarget, TargetUnion};
        Compare::new(
            key,
            op,
            CompareTarget::Mod,
            TargetUnion::ModRevision(revision),
        )
    }

    /// Compares the key's lease.
    pub fn lease(key: impl Into<Vec<u8>>, op: CompareOp, lease: LeaseId) -> Self {
        use pb::compare::{CompareTarget, TargetUnion};
        Compare::new(key, op, CompareTarget::Lease, TargetUnion::Lease(lease))
    }

    /// Applies the compare to every key in `[key, range_end)` instead of the key alone.
    pub fn with_range_end(mut self, range_end: impl Into<Vec<u8>>) -> Self {
        self.0.range_end = range_end.into().into();
        self
    }

    /// Applies the compare to every key with the compare's key as prefix.
    pub fn with_prefix(mut self) -> Self {
        self.0.range_end = prefix_end(&self.0.key).into();
        self
    }
}

/// One operation of a transaction branch.
#[derive(Debug, Clone, PartialEq)]
pub struct Op(pb::RequestOp);

impl Op {
    pub fn get(key: impl Into<Vec<u8>>, options: GetOptions) -> Self {
        Op(pb::RequestOp {
            request: Some(pb::request_op::Request::RequestRange(
                options.to_request(key.into()),
            )),
        })
    }

    pub fn put(key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>, options: PutOptions) -> Self {
        Op(pb::RequestOp {
            request: Some(pb::request_op::Request::RequestPut(put_request(
                key.into(),
                value.into(),
                options,
            ))),
        })
    }

    pub fn delete(key: impl Into<Vec<u8>>, options: DeleteOptions) -> Self {
        Op(pb::RequestOp {
            request: Some(pb::request_op::Request::RequestDeleteRange(delete_request(
                key.into(),
                &options,
            ))),
        })
    }

    /// A nested transaction.
    pub fn txn(txn: Txn) -> Self {
        Op(pb::RequestOp {
            request: Some(pb::request_op::Request::RequestTxn(txn.into_request())),
        })
    }
}

/// A transaction: if every compare holds, run `success`, else `failure`, atomically.
///
/// ```
/// use conclave_client::{Compare, CompareOp, Op, Txn};
/// let txn = Txn::new()
///     .when([Compare::version("config", CompareOp::Equal, 0)])
///     .and_then([Op::put("config", "v1", Default::default())])
///     .or_else([Op::get("config", Default::default())]);
/// assert_eq!(txn.compare_count(), 1);
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Txn {
    compare: Vec<pb::Compare>,
    success: Vec<pb::RequestOp>,
    failure: Vec<pb::RequestOp>,
}

impl Txn {
    pub fn new() -> Self {
        Txn::default()
    }

    /// Adds conditions (all must hold).
    pub fn when(mut self, compares: impl IntoIterator<Item = Compare>) -> Self {
        self.compare.extend(compares.into_iter().map(|c| c.0));
        self
    }

    /// Adds operations run when the conditions hold.
    pub fn and_then(mut self, ops: impl IntoIterator<Item = Op>) -> Self {
        self.success.extend(ops.into_iter().map(|o| o.0));
        self
    }

    /// Adds operations run when a condition fails.
    pub fn or_else(mut self, ops: impl IntoIterator<Item = Op>) -> Self {
        self.failure.extend(ops.into_iter().map(|o| o.0));
        self
    }

    pub fn compare_count(&self) -> usize {
        self.compare.len()
    }

    /// The wire request (for inspection and tests).
    pub fn into_request(self) -> pb::TxnRequest {
        pb::TxnRequest {
            compare: self.compare,
            success: self.success,
            failure: self.failure,
        }
    }
}

/// The answer of one operation in a transaction branch.
#[derive(Debug, Clone, PartialEq)]
pub enum OpResponse {
    Get(GetResponse),
    Put(PutResponse),
    Delete(DeleteResponse),
    Txn(TxnResponse),
}

/// Answer of a transaction.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TxnResponse {
    /// Whether the compares held (so `success` ran).
    pub succeeded: bool,
    pub responses: Vec<OpResponse>,
    pub revision: i64,
}

impl From<pb::TxnResponse> for TxnResponse {
    fn from(r: pb::TxnResponse) -> Self {
        use pb::response_op::Response;
        TxnResponse {
            succeeded: r.succeeded,
            revision: r.header.map_or(0, |h| h.revision),
            responses: r
                .responses
                .into_iter()
                .filter_map(|op| {
                    Some(match op.response? {
                        Response::ResponseRange(r) => OpResponse::Get(r.into()),
                        Response::ResponsePut(r) => OpResponse::Put(r.into()),
                        Response::ResponseDeleteRange(r) => OpResponse::Delete(r.into()),
                        Response::ResponseTxn(r) => OpResponse::Txn(r.into()),
                    })
                })
                .collect(),
        }
    }
}

fn put_request(key: Vec<u8>, value: Vec<u8>, options: PutOptions) -> pb::PutRequest {
    pb::PutRequest {
        key: key.into(),
        value: value.into(),
        lease: options.lease,
        prev_kv: options.prev_kv,
        ..Default::default()
    }
}

fn delete_request(key: Vec<u8>, options: &DeleteOptions) -> pb::DeleteRangeRequest {
    let range_end = match (&options.range_end, options.prefix) {
        (Some(end), _) => end.clone(),
        (None, true) => prefix_end(&key),
        (None, false) => Vec::new(),
    };
    pb::DeleteRangeRequest {
        key: key.into(),
        range_end: range_end.into(),
        prev_kv: options.prev_kv,
    }
}

impl Client {
    /// Reads a key, a prefix or a range, now or at a past revision.
    pub async fn get(&self, key: impl Into<Vec<u8>>, options: GetOptions) -> Result<GetResponse> {
        let message = options.to_request(key.into());
        let context = ErrorContext {
            lease_id: 0,
            revision: options.revision,
        };
        let answer = self
            .call(Retry::Idempotent, context, |channel, timeout| {
                let message = message.clone();
                async move {
                    KvClient::new(channel)
                        .range(request(message, timeout))
                        .await
                }
            })
            .await?;
        Ok(answer.into_inner().into())
    }

    /// Writes a key. In an exactly-once session: a retry after an ambiguous failure never
    /// creates a second revision or overwrites a later writer.
    pub async fn put(
        &self,
        key: impl Into<Vec<u8>>,
        value: impl Into<Vec<u8>>,
        options: PutOptions,
    ) -> Result<PutResponse> {
        let message = put_request(key.into(), value.into(), options);
        let context = ErrorContext {
            lease_id: options.lease,
            revision: 0,
        };
        let answer = self
            .call_in_session(Retry::AtMostOnce, context, |channel, timeout, at| {
                let message = message.clone();
                async move {
                    KvClient::new(channel)
                        .put(at.request(message, timeout))
                        .await
                }
            })
            .await?;
        Ok(answer.into_inner().into())
    }

    /// Deletes a key, a prefix or a range (in an exactly-once session).
    pub async fn delete(
        &self,
        key: impl Into<Vec<u8>>,
        options: DeleteOptions,
    ) -> Result<DeleteResponse> {
        let message = delete_request(key.into(), &options);
        let answer = self
            .call_in_session(
                Retry::AtMostOnce,
                ErrorContext::default(),
                |channel, timeout, at| {
                    let message = message.clone();
                    async move {
                        KvClient::new(channel)
                            .delete_range(at.request(message, timeout))
                            .await
                    }
                },
            )
            .await?;
        Ok(answer.into_inner().into())
    }

    /// Runs a transaction (in an exactly-once session: a retry gets the first answer).
    pub async fn txn(&self, txn: Txn) -> Result<TxnResponse> {
        self.txn_with(txn, Retry::AtMostOnce).await
    }

    /// [`Client::txn`], sent with `fallback` when the server has no sessions.
    pub(crate) async fn txn_with(&self, txn: Txn, fallback: Retry) -> Result<TxnResponse> {
        let message = txn.into_request();
        let answer = self
            .call_in_session(fallback, ErrorContext::default(), |channel, timeout, at| {
                let message = message.clone();
                async move {
                    KvClient::new(channel)
                        .txn(at.request(message, timeout))
                        .await
                }
            })
            .await?;
        Ok(answer.into_inner().into())
    }

    /// Compacts history below `revision`.
    pub async fn compact(&self, revision: i64) -> Result<i64> {
        let context = ErrorContext {
            lease_id: 0,
            revision,
        };
        let answer = self
            .call(Retry::Idempotent, context, |channel, timeout| async move {
                KvClient::new(channel)
                    .compact(request(
                        pb::CompactionRequest {
                            revision,
                            physical: false,
                        },
                        timeout,
                    ))
                    .await
            })
            .await?;
        Ok(answer.into_inner().header.map_or(0, |h| h.revision))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pb::compare::{CompareResult, CompareTarget, TargetUnion};

    #[test]
    fn prefix_end_matches_etcd() {
        assert_eq!(prefix_end(b"a"), b"b");
        assert_eq!(prefix_end(b"a/"), b"a0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), b"\0");
        assert_eq!(prefix_end(b""), b"\0");
    }

    #[test]
    fn get_options_build_range_requests() {
        let request = GetOptions {
            prefix: true,
            revision: 5,
            limit: 3,
            sort_order: SortOrder::Descend,
            sort_target: SortTarget::Mod,
            ..Default::default()
        }
        .to_request(b"jobs/".to_vec());
        assert_eq!(&request.range_end[..], b"jobs0");
        assert_eq!((request.revision, request.limit), (5, 3));
        assert_eq!(request.sort_order(), pb::range_request::SortOrder::Descend);
        assert_eq!(request.sort_target(), pb::range_request::SortTarget::Mod);
        let explicit = GetOptions {
            prefix: true,
            range_end: Some(b"z".to_vec()),
            ..Default::default()
        }
        .to_request(b"a".to_vec());
        assert_eq!(&explicit.range_end[..], b"z");
        assert!(
            GetOptions::default()
                .to_request(b"k".to_vec())
                .range_end
                .is_empty()
        );
    }

    #[test]
    fn txn_builder_produces_the_wire_request() {
        let txn = Txn::new()
            .when([
                Compare::create_revision("/_conclave/elect/g/leader", CompareOp::Equal, 42),
                Compare::value("cfg", CompareOp::NotEqual, "old"),
            ])
            .when([Compare::version("jobs/", CompareOp::Greater, 0).with_prefix()])
            .and_then([
                Op::put(
                    "cfg",
                    "new",
                    PutOptions {
                        lease: 7,
                        prev_kv: true,
                    },
                ),
                Op::delete("tmp/", DeleteOptions::prefix()),
            ])
            .or_else([Op::txn(
                Txn::new().and_then([Op::get("cfg", GetOptions::default())]),
            )]);
        let wire = txn.into_request();
        assert_eq!(wire.compare.len(), 3);
        let fence = &wire.compare[0];
        assert_eq!(fence.result(), CompareResult::Equal);
        assert_eq!(fence.target(), CompareTarget::Create);
        assert_eq!(fence.target_union, Some(TargetUnion::CreateRevision(42)));
        assert_eq!(wire.compare[1].result(), CompareResult::NotEqual);
        assert_eq!(
            wire.compare[1].target_union,
            Some(TargetUnion::Value(b"old".to_vec().into()))
        );
        assert_eq!(&wire.compare[2].range_end[..], b"jobs0");
        assert_eq!(wire.compare[2].result(), CompareResult::Greater);
        match &wire.success[0].request {
            Some(pb::request_op::Request::RequestPut(put)) => {
                assert_eq!(
                    (&put.key[..], put.lease, put.prev_kv),
                    (&b"cfg"[..], 7, true)
                );
            }
            other => panic!("expected a put, got {other:?}"),
        }
        match &wire.success[1].request {
            Some(pb::request_op::Request::RequestDeleteRange(delete)) => {
                assert_eq!(&delete.range_end[..], b"tmp0");
            }
            other => panic!("expected a delete, got {other:?}"),
        }
        assert!(matches!(
            &wire.failure[0].request,
            Some(pb::request_op::Request::RequestTxn(nested)) if nested.success.len() == 1
        ));
    }

    #[test]
    fn txn_response_converts_every_op() {
        use pb::response_op::Response;
        let header = Some(pb::ResponseHeader {
            revision: 9,
            ..Default::default()
        });
        let wire = pb::TxnResponse {
            header,
            succeeded: true,
            responses: vec![
                pb::ResponseOp {
                    response: Some(Response::ResponsePut(pb::PutResponse {
                        header,
                        prev_kv: None,
                    })),
                },
                pb::ResponseOp { response: None },
                pb::ResponseOp {
                    response: Some(Response::ResponseDeleteRange(pb::DeleteRangeResponse {
                        deleted: 2,
                        ..Default::default()
                    })),
                },
            ],
        };
        let answer = TxnResponse::from(wire);
        assert!(answer.succeeded);
        assert_eq!(answer.revision, 9);
        assert_eq!(answer.responses.len(), 2);
        assert!(matches!(&answer.responses[1], OpResponse::Delete(d) if d.deleted == 2));
    }
}
