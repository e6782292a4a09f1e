//! Conversions between etcd's protobuf messages and the state machine's types. Unknown enum
//! values are refused with an InvalidArgument status instead of being guessed.

use conclave_proto::etcdserverpb as pb;
use conclave_proto::mvccpb;
use conclave_state as state;
use tonic::Status;

pub fn kv_to_pb(kv: state::KeyValue) -> mvccpb::KeyValue {
    mvccpb::KeyValue {
        key: kv.key,
        create_revision: kv.create_revision,
        mod_revision: kv.mod_revision,
        version: kv.version,
        value: kv.value,
        lease: kv.lease,
    }
}

pub fn event_to_pb(event: state::WatchEvent, with_prev_kv: bool) -> mvccpb::Event {
    let kind = match event.kind {
        state::EventKind::Put => mvccpb::event::EventType::Put,
        state::EventKind::Delete => mvccpb::event::EventType::Delete,
    };
    mvccpb::Event {
        r#type: kind as i32,
        kv: Some(kv_to_pb(event.kv)),
        prev_kv: if with_prev_kv {
            event.prev_kv.map(kv_to_pb)
        } else {
            None
        },
    }
}

fn invalid(what: &str, value: i32) -> Status {
    Status::invalid_argument(format!("etcdserver: invalid {what} {value}"))
}

pub fn range_from_pb(r: pb::RangeRequest) -> Result<state::RangeRequest, Status> {
    use pb::range_request::{SortOrder as O, SortTarget as T};
    let sort_order =
        match O::try_from(r.sort_order).map_err(|_| invalid("sort order", r.sort_order))? {
            O::None => state::SortOrder::None,
            O::Ascend => state::SortOrder::Ascend,
            O::Descend => state::SortOrder::Descend,
        };
    let sort_target =
        match T::try_from(r.sort_target).map_err(|_| invalid("sort target", r.sort_target))? {
            T::Key => state::SortTarget::Key,
            T::Version => state::SortTarget::Version,
            T::Create => state::SortTarget::Create,
            T::Mod => state::SortTarget::Mod,
            T::Value => state::SortTarget::Value,
        };
    Ok(state::RangeRequest {
        key: r.key,
        range_end: r.range_end,
        limit: r.limit,
        revision: r.revision,
        sort_order,
        sort_target,
        keys_only: r.keys_only,
        count_only: r.count_only,
        min_mod_revision: r.min_mod_revision,
        max_mod_revision: r.max_mod_revision,
        min_create_revision: r.min_create_revision,
        max_create_revision: r.max_create_revision,
    })
}

pub fn range_to_pb(r: state::RangeResponse, header: pb::ResponseHeader) -> pb::RangeResponse {
    pb::RangeResponse {
        header: Some(header),
        kvs: r.kvs.into_iter().map(kv_to_pb).collect(),
        more: r.more,
        count: r.count,
    }
}

pub fn put_from_pb(r: pb::PutRequest) -> state::PutRequest {
    state::PutRequest {
        key: r.key,
        value: r.value,
        lease: r.lease,
        prev_kv: r.prev_kv,
        ignore_value: r.ignore_value,
        ignore_lease: r.ignore_lease,
    }
}

pub fn put_to_pb(r: state::PutResponse, header: pb::ResponseHeader) -> pb::PutResponse {
    pb::PutResponse {
        header: Some(header),
        prev_kv: r.prev_kv.map(kv_to_pb),
    }
}

pub fn delete_from_pb(r: pb::DeleteRangeRequest) -> state::DeleteRangeRequest {
    state::DeleteRangeRequest {
        key: r.key,
        range_end: r.range_end,
        prev_kv: r.prev_kv,
    }
}

pub fn delete_to_pb(
    r: state::DeleteRangeResponse,
    header: pb::ResponseHeader,
) -> pb::DeleteRangeResponse {
    pb::DeleteRangeResponse {
        header: Some(header),
        deleted: r.deleted,
        prev_kvs: r.prev_kvs.into_iter().map(kv_to_pb).collect(),
    }
}

fn compare_from_pb(c: pb::Compare) -> Result<state::Compare, Status> {
    use pb::compare::{CompareResult as R, CompareTarget as T, TargetUnion as U};
    let result = match R::try_from(c.result).map_err(|_| invalid("compare result", c.result))? {
        R::Equal => state::CompareResult::Equal,
        R::Greater => state::CompareResult::Greater,
        R::Less => state::CompareResult::Less,
        R::NotEqual => state::CompareResult::NotEqual,
    };
    let target_kind = T::try_from(c.target).map_err(|_| invalid("compare target", c.target))?;
    // etcd reads the operand matching `target`; an absent operand is the zero value.
    let target = match (target_kind, c.target_union) {
        (T::Version, Some(U::Version(v))) => state::CompareTarget::Version(v),
        (T::Version, _) => state::CompareTarget::Version(0),
        (T::Create, Some(U::CreateRevision(v))) => state::CompareTarget::Create(v),
        (T::Create, _) => state::CompareTarget::Create(0),
        (T::Mod, Some(U::ModRevision(v))) => state::CompareTarget::Mod(v),
        (T::Mod, _) => state::CompareTarget::Mod(0),
        (T::Value, Some(U::Value(v))) => state::CompareTarget::Value(v),
        (T::Value, _) => state::CompareTarget::Value(Default::default()),
        (T::Lease, Some(U::Lease(v))) => state::CompareTarget::Lease(v),
        (T::Lease, _) => state::CompareTarget::Lease(0),
    };
    Ok(state::Compare {
        key: c.key,
        range_end: c.range_end,
        target,
        result,
    })
}

fn op_from_pb(op: pb::RequestOp) -> Result<state::RequestOp, Status> {
    use pb::request_op::Request as R;
    match op.request {
        Some(R::RequestRange(r)) => Ok(state::RequestOp::Range(range_from_pb(r)?)),
        Some(R::RequestPut(r)) => Ok(state::RequestOp::Put(put_from_pb(r))),
        Some(R::RequestDeleteRange(r)) => Ok(state::RequestOp::DeleteRange(delete_from_pb(r))),
        Some(R::RequestTxn(r)) => Ok(state::RequestOp::Txn(txn_from_pb(r)?)),
        None => Err(Status::invalid_argument(
            "etcdserver: empty request op in txn",
        )),
    }
}

pub fn txn_from_pb(r: pb::TxnRequest) -> Result<state::TxnRequest, Status> {
    Ok(state::TxnRequest {
        compare: r
            .compare
            .into_iter()
            .map(compare_from_pb)
            .collect::<Result<_, _>>()?,
        success: r
            .success
            .into_iter()
            .map(op_from_pb)
            .collect::<Result<_, _>>()?,
        failure: r
            .failure
            .into_iter()
            .map(op_from_pb)
            .collect::<Result<_, _>>()?,
    })
}

pub fn txn_to_pb(r: state::TxnResponse, header: pb::ResponseHeader) -> pb::TxnResponse {
    use pb::response_op::Response as R;
    // etcd puts a header in every nested response too, but one with only the revision set:
    // the member, cluster and term are the outer header's.
    let nested = pb::ResponseHeader {
        revision: header.revision,
        ..Default::default()
    };
    let responses = r
        .responses
        .into_iter()
        .map(|op| pb::ResponseOp {
            response: Some(match op {
                state::ResponseOp::Range(x) => R::ResponseRange(range_to_pb(x, nested)),
                state::ResponseOp::Put(x) => R::ResponsePut(put_to_pb(x, nested)),
                state::ResponseOp::DeleteRange(x) => {
                    R::ResponseDeleteRange(delete_to_pb(x, nested))
                }
                state::ResponseOp::Txn(x) => R::ResponseTxn(txn_to_pb(x, nested)),
            }),
        })
        .collect();
    pb::TxnResponse {
        header: Some(header),
        succeeded: r.succeeded,
        responses,
    }
}
