//! etcd compatibility at the KV level: the client-side concurrency recipes (`etcdctl lock`,
//! `etcdctl elect`) built only from Txn, Range, Watch and Lease, and etcd's Put/Txn details.

mod common;

use bytes::Bytes;
use common::Driver;
use conclave_state::{
    Compare, CompareResult, CompareTarget, DeleteRangeRequest, EventKind, KeyValue, PutRequest,
    RangeRequest, Request, RequestOp, Response, ResponseOp, SortOrder, SortTarget, TxnRequest,
    queue_key,
};

/// clientv3/concurrency `Mutex.TryAcquire`: create my key if absent, else read it; then read
/// the owner (lowest create revision) in the same Txn.
fn try_acquire(driver: &mut Driver, prefix: &str, lease: i64) -> (KeyValue, KeyValue) {
    let key = queue_key(prefix.trim_end_matches('/').as_bytes(), lease);
    let owner_read = RangeRequest {
        sort_order: SortOrder::Ascend,
        sort_target: SortTarget::Create,
        limit: 1,
        ..RangeRequest::prefix(prefix.to_owned())
    };
    let txn = TxnRequest {
        compare: vec![Compare::new(
            key.clone(),
            CompareResult::Equal,
            CompareTarget::Create(0),
        )],
        success: vec![
            RequestOp::Put(PutRequest {
                lease,
                ..PutRequest::new(key.clone(), "")
            }),
            RequestOp::Range(owner_read.clone()),
        ],
        failure: vec![
            RequestOp::Range(RangeRequest::key(key.clone())),
            RequestOp::Range(owner_read),
        ],
    };
    let Response::Txn(response) = driver.ok(Request::Txn(txn)) else {
        panic!("txn")
    };
    let mine = driver.machine.kv().get(&key).expect("my key");
    let Some(ResponseOp::Range(owner)) = response.responses.last() else {
        panic!("owner read")
    };
    (mine, owner.kvs[0].clone())
}

/// clientv3/concurrency `waitDeletes`: the newest key created before mine.
fn last_ahead(driver: &Driver, prefix: &str, my_revision: i64) -> Option<KeyValue> {
    let request = RangeRequest {
        max_create_revision: my_revision - 1,
        sort_order: SortOrder::Descend,
        sort_target: SortTarget::Create,
        limit: 1,
        ..RangeRequest::prefix(prefix.to_owned())
    };
    driver
        .machine
        .range(&request)
        .expect("range")
        .kvs
        .first()
        .cloned()
}

#[test]
fn etcd_mutex_recipe_over_plain_kv() {
    let mut driver = Driver::new();
    let (a, b) = (driver.grant(10_000), driver.grant(10_000));
    let (mine_a, owner) = try_acquire(&mut driver, "/lock/", a);
    assert_eq!(owner.key, mine_a.key, "first comes, first holds");
    let (mine_b, owner) = try_acquire(&mut driver, "/lock/", b);
    assert_eq!(owner.key, mine_a.key);
    let ahead = last_ahead(&driver, "/lock/", mine_b.create_revision).expect("someone ahead");
    assert_eq!(ahead.key, mine_a.key);
    // The waiter watches for the deletion of the key ahead, from the revision it read at.
    let watch_from = driver.machine.revision() + 1;
    driver.ok(Request::DeleteRange(DeleteRangeRequest {
        key: mine_a.key.clone(),
        ..DeleteRangeRequest::default()
    }));
    let events = driver
        .machine
        .events_since(watch_from, &ahead.key, b"")
        .expect("watch");
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].kind, EventKind::Delete);
    assert!(
        last_ahead(&driver, "/lock/", mine_b.create_revision).is_none(),
        "b holds now"
    );
    // Retrying TryAcquire with the same lease does not re-create the key: same fence.
    let (again, _) = try_acquire(&mut driver, "/lock/", b);
    assert_eq!(again.create_revision, mine_b.create_revision);
}

#[test]
fn put_options_follow_etcd() {
    let mut driver = Driver::new();
    let lease = driver.grant(10_000);
    driver.put("k", "v1", lease);
    let keep = PutRequest {
        ignore_value: true,
        prev_kv: true,
        lease,
        ..PutRequest::new("k", "")
    };
    let Response::Put(put) = driver.ok(Request::Put(keep)) else {
        panic!()
    };
    assert_eq!(
        put.prev_kv.map(|kv| kv.value),
        Some(Bytes::from_static(b"v1"))
    );
    let kv = driver.machine.kv().get(b"k").expect("k");
    assert_eq!(
        (kv.value.as_ref(), kv.version, kv.lease),
        (&b"v1"[..], 2, lease)
    );
    let keep_lease = PutRequest {
        ignore_lease: true,
        ..PutRequest::new("k", "v2")
    };
    driver.ok(Request::Put(keep_lease));
    assert_eq!(
        driver.machine.kv().get(b"k").map(|kv| kv.lease),
        Some(lease)
    );
    // A plain put detaches the lease: revoking it no longer deletes the key.
    driver.put("k", "v3", 0);
    driver.ok(Request::LeaseRevoke { id: lease });
    assert_eq!(
        driver.machine.kv().get(b"k").map(|kv| kv.value),
        Some(Bytes::from_static(b"v3"))
    );
}

#[test]
fn nested_txn_and_lease_compare() {
    let mut driver = Driver::new();
    let lease = driver.grant(10_000);
    driver.put("a", "1", lease);
    let inner = TxnRequest {
        compare: vec![Compare::new(
            "a",
            CompareResult::Equal,
            CompareTarget::Lease(lease),
        )],
        success: vec![RequestOp::Put(PutRequest::new("inner", "yes"))],
        failure: vec![],
    };
    let outer = TxnRequest {
        compare: vec![Compare::new(
            "a",
            CompareResult::Greater,
            CompareTarget::Value(Bytes::from_static(b"0")),
        )],
        success: vec![
            RequestOp::Put(PutRequest::new("outer", "yes")),
            RequestOp::Txn(inner),
        ],
        failure: vec![],
    };
    let before = driver.machine.revision();
    let output = driver.apply(Request::Txn(outer));
    let Ok(Response::Txn(response)) = output.result else {
        panic!("{:?}", output.result)
    };
    assert!(response.succeeded);
    assert!(matches!(&response.responses[1], ResponseOp::Txn(inner) if inner.succeeded));
    // One revision for the whole tree, every event tagged with it.
    assert_eq!(output.revision, before + 1);
    assert_eq!(output.events.len(), 2);
    // A range compare holds only if every key in the range satisfies it.
    driver.put("b", "9", 0);
    let range_compare = Compare {
        range_end: Bytes::from_static(b"c"),
        ..Compare::new(
            "a",
            CompareResult::Less,
            CompareTarget::Value(Bytes::from_static(b"5")),
        )
    };
    let txn = TxnRequest {
        compare: vec![range_compare],
        ..TxnRequest::default()
    };
    assert!(matches!(driver.ok(Request::Txn(txn)), Response::Txn(r) if !r.succeeded));
}

#[test]
fn delete_range_reports_and_spares_reserved_keys() {
    let mut driver = Driver::new();
    let lease = driver.grant(10_000);
    driver.register("g", "a", 1, lease);
    driver.put("x", "1", 0);
    driver.put("y", "2", 0);
    let everything = DeleteRangeRequest {
        key: Bytes::from_static(b"\0"),
        range_end: Bytes::from_static(b"\0"),
        prev_kv: true,
    };
    let Response::DeleteRange(response) = driver.ok(Request::DeleteRange(everything)) else {
        panic!()
    };
    assert_eq!(response.deleted, 2);
    assert_eq!(response.prev_kvs.len(), 2);
    assert!(driver.machine.group_leader("g").is_some());
    driver.machine.check_invariants();
}
