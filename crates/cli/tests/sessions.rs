//! Exactly-once client sessions over gRPC against a real 3-node cluster: a write carrying a
//! session position is applied once however many members it is sent to, and the same write
//! without a position is applied every time (the negative control).

mod common;

use std::time::Duration;

use common::Cluster;
use conclave_proto::conclave::v1::session_client::SessionClient;
use conclave_proto::conclave::v1::topic_client::TopicClient;
use conclave_proto::conclave::v1::{
    CloseSessionRequest, OpenSessionRequest, PublishRequest, ReadRequest,
};
use conclave_proto::etcdserverpb::{PutRequest, RangeRequest};
use tonic::transport::Channel;

const SESSION_CLIENT: &str = "conclave-session-client";
const SESSION_SEQ: &str = "conclave-session-seq";
const SESSION_SECRET: &str = "conclave-session-secret";

/// A session as OpenSession answered it.
#[derive(Clone, Copy, Debug)]
struct Session {
    client_id: u64,
    secret: u128,
}

fn channel(cluster: &Cluster, id: u64) -> Channel {
    Channel::from_shared(cluster.endpoint(id))
        .expect("valid endpoint")
        .connect_lazy()
}

/// `message` with a session position in its metadata (when given) and a deadline.
fn at<T>(message: T, position: Option<(Session, u64)>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(Duration::from_secs(5));
    if let Some((session, seq)) = position {
        let metadata = request.metadata_mut();
        metadata.insert(SESSION_CLIENT, session.client_id.into());
        metadata.insert(SESSION_SEQ, seq.into());
        let secret = format!("{:032x}", session.secret);
        metadata.insert(SESSION_SECRET, secret.parse().expect("hex is ASCII"));
    }
    request
}

async fn publish(
    channel: Channel,
    topic: &str,
    data: &str,
    position: Option<(Session, u64)>,
) -> u64 {
    TopicClient::new(channel)
        .publish(at(
            PublishRequest {
                topic: topic.into(),
                data: data.to_string().into(),
                from: String::new(),
            },
            position,
        ))
        .await
        .expect("publish")
        .into_inner()
        .seq
}

async fn messages(channel: Channel, topic: &str) -> Vec<String> {
    TopicClient::new(channel)
        .read(at(
            ReadRequest {
                topic: topic.into(),
                from_seq: 0,
                limit: 0,
            },
            None,
        ))
        .await
        .expect("read")
        .into_inner()
        .messages
        .iter()
        .map(|m| String::from_utf8_lossy(&m.data).into_owned())
        .collect()
}

async fn version(cluster: &Cluster, id: u64, key: &str) -> i64 {
    let found = cluster
        .kv(id)
        .await
        .range(at(
            RangeRequest {
                key: key.to_string().into(),
                ..Default::default()
            },
            None,
        ))
        .await
        .expect("range")
        .into_inner()
        .kvs;
    found.first().map_or(0, |kv| kv.version)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_write_sent_twice_with_one_session_position_is_applied_once() {
    let cluster = Cluster::start(3).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(10)).await;
    let follower = cluster
        .live_ids()
        .into_iter()
        .find(|id| *id != leader)
        .expect("a follower");
    let opened = SessionClient::new(channel(&cluster, follower))
        .open_session(at(OpenSessionRequest {}, None))
        .await
        .expect("open a session")
        .into_inner();
    let secret_bytes: [u8; 16] = opened.session_secret[..]
        .try_into()
        .expect("a 16-byte secret");
    let client = Session {
        client_id: opened.client_id,
        secret: u128::from_be_bytes(secret_bytes),
    };
    assert!(client.client_id > 0 && client.secret != 0, "{opened:?}");
    assert!(opened.session_ttl_ms > 0, "{opened:?}");

    // The same publish, same position, to two members (the follower forwards to the leader
    // with the position): one message, and both callers get its sequence number.
    let first = publish(
        channel(&cluster, follower),
        "once",
        "job",
        Some((client, 1)),
    )
    .await;
    let again = publish(channel(&cluster, leader), "once", "job", Some((client, 1))).await;
    assert_eq!((first, again), (1, 1), "both get the first answer");
    assert_eq!(messages(channel(&cluster, leader), "once").await, ["job"]);

    // The next position is a new request.
    let next = publish(
        channel(&cluster, leader),
        "once",
        "job-2",
        Some((client, 2)),
    )
    .await;
    assert_eq!(next, 2);
    assert_eq!(
        messages(channel(&cluster, follower), "once").await,
        ["job", "job-2"]
    );

    // KV: a put repeated at one position leaves the key at version 1.
    for target in [follower, leader] {
        cluster
            .kv(target)
            .await
            .put(at(
                PutRequest {
                    key: "counter".into(),
                    value: "1".into(),
                    ..Default::default()
                },
                Some((client, 3)),
            ))
            .await
            .expect("put");
    }
    assert_eq!(
        version(&cluster, leader, "counter").await,
        1,
        "the repeated put applied once"
    );

    // An older position's answer is gone: it is refused, not applied.
    let stale = TopicClient::new(channel(&cluster, leader))
        .publish(at(
            PublishRequest {
                topic: "once".into(),
                data: "late".into(),
                from: String::new(),
            },
            Some((client, 1)),
        ))
        .await
        .expect_err("an older sequence number");
    assert!(stale.message().contains("older than"), "{stale:?}");
    assert_eq!(messages(channel(&cluster, leader), "once").await.len(), 2);

    // A closed session is gone for good.
    SessionClient::new(channel(&cluster, leader))
        .close_session(at(
            CloseSessionRequest {
                client_id: client.client_id,
                session_secret: opened.session_secret.clone(),
            },
            None,
        ))
        .await
        .expect("close");
    let closed = TopicClient::new(channel(&cluster, follower))
        .publish(at(
            PublishRequest {
                topic: "once".into(),
                data: "after-close".into(),
                from: String::new(),
            },
            Some((client, 4)),
        ))
        .await
        .expect_err("a closed session");
    assert_eq!(closed.code(), tonic::Code::NotFound, "{closed:?}");
    assert_eq!(messages(channel(&cluster, leader), "once").await.len(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn without_a_session_position_the_same_write_sent_twice_is_applied_twice() {
    let cluster = Cluster::start(3).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(10)).await;
    let follower = cluster
        .live_ids()
        .into_iter()
        .find(|id| *id != leader)
        .expect("a follower");
    let first = publish(channel(&cluster, follower), "twice", "job", None).await;
    let again = publish(channel(&cluster, leader), "twice", "job", None).await;
    assert_eq!((first, again), (1, 2));
    assert_eq!(
        messages(channel(&cluster, leader), "twice").await,
        ["job", "job"]
    );
    for target in [follower, leader] {
        cluster
            .kv(target)
            .await
            .put(at(
                PutRequest {
                    key: "counter".into(),
                    value: "1".into(),
                    ..Default::default()
                },
                None,
            ))
            .await
            .expect("put");
    }
    assert_eq!(version(&cluster, leader, "counter").await, 2);
}
