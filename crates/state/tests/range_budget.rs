//! The byte budget of Range answers: a read over budget is refused while it is being built,
//! never after; `limit`, `count_only`, `keys_only` and filters keep big ranges readable; and a
//! Txn whose Ranges pass `TXN_RANGE_BYTES_MAX` is refused before any of its writes.

mod common;

use bytes::Bytes;
use common::Driver;
use conclave_state::{
    DeleteRangeRequest, Error, PutRequest, RangeRequest, Request, RequestOp, Response, ResponseOp,
    SortOrder, SortTarget, TXN_RANGE_BYTES_MAX, TxnRequest,
};

const MIB: usize = 1024 * 1024;

/// `count` keys `/big/NNN`, each with a value of `value_bytes` bytes.
fn fill(driver: &mut Driver, count: usize, value_bytes: usize) {
    for i in 0..count {
        let put = PutRequest::new(format!("/big/{i:03}"), Bytes::from(vec![b'v'; value_bytes]));
        driver.ok(Request::Put(put));
    }
}

fn too_large(bytes_max: usize) -> Error {
    Error::RangeTooLarge {
        bytes_max: bytes_max as u64,
    }
}

#[test]
fn a_range_over_its_budget_is_refused_and_narrower_reads_still_work() {
    let mut driver = Driver::new();
    fill(&mut driver, 20, 1000);
    let budget = 10_000;
    let all = RangeRequest::prefix("/big/");
    assert_eq!(
        driver.machine.range_within(&all, budget),
        Err(too_large(budget)),
        "20 values of 1000 bytes pass a 10,000-byte budget"
    );
    // The message names the cap and says what to do instead.
    let message = too_large(budget).to_string();
    assert!(
        message.contains("10000 bytes") && message.contains("limit"),
        "{message}"
    );

    let limited = RangeRequest {
        limit: 5,
        ..all.clone()
    };
    let answer = driver
        .machine
        .range_within(&limited, budget)
        .expect("limit");
    assert_eq!((answer.kvs.len(), answer.more, answer.count), (5, true, 20));

    let counted = RangeRequest {
        count_only: true,
        ..all.clone()
    };
    let answer = driver
        .machine
        .range_within(&counted, 1)
        .expect("count_only");
    assert_eq!((answer.kvs.len(), answer.count), (0, 20));

    let keys = RangeRequest {
        keys_only: true,
        ..all.clone()
    };
    let answer = driver
        .machine
        .range_within(&keys, budget)
        .expect("keys_only");
    assert_eq!(answer.kvs.len(), 20);
    assert!(answer.kvs.iter().all(|kv| kv.value.is_empty()));

    // Filters apply before a key-value is taken: keys 15..19 are the newest five.
    let newest = driver.machine.revision() - 4;
    let filtered = RangeRequest {
        min_mod_revision: newest,
        ..all.clone()
    };
    let answer = driver
        .machine
        .range_within(&filtered, budget)
        .expect("filtered");
    assert_eq!(answer.kvs.len(), 5);
    assert_eq!(answer.kvs[0].key, Bytes::from("/big/015"));

    // At the exact size the budget allows it.
    let exact: usize = 20 * (1000 + "/big/000".len());
    let answer = driver
        .machine
        .range_within(&all, exact)
        .expect("exact budget");
    assert_eq!(answer.kvs.len(), 20);
    assert_eq!(
        driver.machine.range_within(&all, exact - 1),
        Err(too_large(exact - 1))
    );
}

#[test]
fn a_sorted_limited_range_keeps_only_its_best_candidates() {
    let mut driver = Driver::new();
    fill(&mut driver, 300, 1000);
    // The etcd lock and election recipes read a prefix's oldest or newest key this way.
    for (order, expected) in [
        (SortOrder::Ascend, "/big/000"),
        (SortOrder::Descend, "/big/299"),
    ] {
        let first = RangeRequest {
            sort_order: order,
            sort_target: SortTarget::Create,
            limit: 1,
            ..RangeRequest::prefix("/big/")
        };
        // 300 KB in the range; the answer and its candidates fit in 100 KB.
        let answer = driver
            .machine
            .range_within(&first, 100_000)
            .expect("sorted");
        assert_eq!(answer.kvs.len(), 1);
        assert_eq!(answer.kvs[0].key, Bytes::from(expected));
        assert!(answer.more);
        assert_eq!(answer.count, 300);
        // The same answer as without a budget, for several limits and orders.
        for limit in [1, 7, 64, 100] {
            let request = RangeRequest {
                sort_order: order,
                sort_target: SortTarget::Value,
                limit,
                ..RangeRequest::prefix("/big/")
            };
            assert_eq!(
                driver.machine.range_within(&request, usize::MAX / 2),
                driver.machine.range(&request)
            );
        }
    }
}

fn txn(success: Vec<RequestOp>) -> Request {
    Request::Txn(TxnRequest {
        compare: Vec::new(),
        success,
        failure: Vec::new(),
    })
}

#[test]
fn a_txn_whose_ranges_pass_the_constant_is_refused_before_its_writes() {
    let mut driver = Driver::new();
    let values = TXN_RANGE_BYTES_MAX / MIB + 1;
    fill(&mut driver, values, MIB);
    let revision = driver.machine.revision();
    let refused = txn(vec![
        RequestOp::Put(PutRequest::new("/marker", "x")),
        RequestOp::Range(RangeRequest::prefix("/big/")),
    ]);
    let output = driver.apply(refused);
    assert_eq!(output.result, Err(too_large(TXN_RANGE_BYTES_MAX)));
    assert_eq!(driver.machine.revision(), revision, "nothing written");
    assert!(driver.machine.kv().get(b"/marker").is_none());

    // Two Ranges that each fit but not together.
    let half = RangeRequest {
        range_end: Bytes::from(format!("/big/{:03}", values / 2 + 1)),
        ..RangeRequest::key("/big/000")
    };
    let rest = RangeRequest {
        key: Bytes::from(format!("/big/{:03}", values / 2)),
        ..RangeRequest::prefix("/big/")
    };
    let output = driver.apply(txn(vec![
        RequestOp::Range(half.clone()),
        RequestOp::Range(rest.clone()),
    ]));
    assert_eq!(output.result, Err(too_large(TXN_RANGE_BYTES_MAX)));
    let output = driver.apply(txn(vec![RequestOp::Range(half)]));
    assert!(output.result.is_ok(), "{:?}", output.result.err());

    // A limited read, keys only, or a count: all fine in a Txn on the same range.
    let output = driver.apply(txn(vec![
        RequestOp::Range(RangeRequest {
            limit: 3,
            ..RangeRequest::prefix("/big/")
        }),
        RequestOp::Range(RangeRequest {
            keys_only: true,
            ..RangeRequest::prefix("/big/")
        }),
        RequestOp::Range(RangeRequest {
            count_only: true,
            ..RangeRequest::prefix("/big/")
        }),
    ]));
    let Ok(Response::Txn(answer)) = output.result else {
        panic!("narrow reads in a txn: {:?}", output.result)
    };
    let Some(ResponseOp::Range(limited)) = answer.responses.first() else {
        panic!("range answer")
    };
    assert_eq!((limited.kvs.len(), limited.count), (3, values as i64));
}

#[test]
fn a_limited_range_after_a_write_in_the_txn_is_charged_for_the_whole_range() {
    let mut driver = Driver::new();
    let values = TXN_RANGE_BYTES_MAX / MIB + 1;
    fill(&mut driver, values, MIB);
    let first = RangeRequest {
        limit: 1,
        ..RangeRequest::prefix("/big/")
    };
    // Deleting the first key lets the next one in: a limited Range after a write may see keys
    // that were past its limit, so the check measures it without the limit.
    let output = driver.apply(txn(vec![
        RequestOp::DeleteRange(DeleteRangeRequest {
            key: Bytes::from("/big/000"),
            ..DeleteRangeRequest::default()
        }),
        RequestOp::Range(first.clone()),
    ]));
    assert_eq!(output.result, Err(too_large(TXN_RANGE_BYTES_MAX)));
    assert!(
        driver.machine.kv().get(b"/big/000").is_some(),
        "nothing deleted"
    );
    // Before any write, the limit counts.
    let output = driver.apply(txn(vec![
        RequestOp::Range(first),
        RequestOp::DeleteRange(DeleteRangeRequest {
            key: Bytes::from("/big/000"),
            ..DeleteRangeRequest::default()
        }),
    ]));
    assert!(output.result.is_ok(), "{:?}", output.result.err());
    assert!(driver.machine.kv().get(b"/big/000").is_none());
}

#[test]
fn a_range_applied_through_the_log_has_the_constant_budget() {
    let mut driver = Driver::new();
    fill(&mut driver, TXN_RANGE_BYTES_MAX / MIB + 1, MIB);
    let output = driver.apply(Request::Range(RangeRequest::prefix("/big/")));
    assert_eq!(output.result, Err(too_large(TXN_RANGE_BYTES_MAX)));
}
