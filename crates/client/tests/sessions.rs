//! Exactly-once writes across a leader failure: the first answer to a publish is lost (a proxy
//! in front of the leader swallows it), the leader is killed, and the client's retry on the
//! new leader gets the first answer instead of publishing again.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{Cluster, free_port};
use conclave_client::{Client, ClientOptions};
use conclave_proto::etcdserverpb::StatusRequest;
use conclave_proto::etcdserverpb::maintenance_client::MaintenanceClient;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// A TCP proxy in front of one member. Once told to swallow, it still carries requests to the
/// member but drops everything the member sends back, so a write is applied while its answer
/// never arrives, as when a leader dies between applying and answering.
struct Proxy {
    addr: String,
    swallow: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

impl Proxy {
    async fn start(upstream: String) -> Proxy {
        let listener = TcpListener::bind(("127.0.0.1", free_port()))
            .await
            .expect("bind the proxy");
        let addr = listener.local_addr().expect("proxy address").to_string();
        let swallow = Arc::new(AtomicBool::new(false));
        let flag = swallow.clone();
        let task = tokio::spawn(async move {
            while let Ok((downstream, _)) = listener.accept().await {
                tokio::spawn(pipe(downstream, upstream.clone(), flag.clone()));
            }
        });
        Proxy {
            addr,
            swallow,
            task,
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies bytes both ways until either side closes; then both connections close.
async fn pipe(downstream: TcpStream, upstream: String, swallow: Arc<AtomicBool>) {
    let Ok(upstream) = TcpStream::connect(&upstream).await else {
        return;
    };
    let (mut down_read, mut down_write) = downstream.into_split();
    let (mut up_read, mut up_write) = upstream.into_split();
    let requests = tokio::io::copy(&mut down_read, &mut up_write);
    let answers = async {
        let mut buffer = vec![0u8; 16 * 1024];
        loop {
            let n = up_read.read(&mut buffer).await?;
            if n == 0 {
                return Ok::<_, std::io::Error>(());
            }
            if !swallow.load(Ordering::SeqCst) {
                down_write.write_all(&buffer[..n]).await?;
            }
        }
    };
    tokio::select! {
        _ = requests => {}
        _ = answers => {}
    }
}

/// The index of the node that leads, as the nodes say of themselves.
async fn leader_index(cluster: &Cluster) -> usize {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        for (i, node) in cluster.nodes.iter().enumerate() {
            let Ok(channel) =
                tonic::transport::Channel::from_shared(format!("http://{}", node.client_addr))
            else {
                continue;
            };
            let Ok(channel) = channel.connect().await else {
                continue;
            };
            if let Ok(status) = MaintenanceClient::new(channel)
                .status(StatusRequest {})
                .await
            {
                let status = status.into_inner();
                let member = status.header.map_or(0, |h| h.member_id);
                if member != 0 && status.leader == member {
                    return i;
                }
            }
        }
        assert!(Instant::now() < deadline, "no leader within 20 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn messages(client: &Client, topic: &str) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match client.topics().read(topic, 0, 0).await {
            Ok(read) => {
                return read
                    .messages
                    .iter()
                    .map(|m| String::from_utf8_lossy(&m.data).into_owned())
                    .collect();
            }
            Err(error) => assert!(
                Instant::now() < deadline,
                "reading {topic} kept failing: {error}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What happened to a publish whose first answer was lost and whose leader then died.
struct LostAnswer {
    /// Kept alive for the rest of the test.
    _cluster: Cluster,
    _proxy: Proxy,
    observer: Client,
    writer: Client,
    outcome: Result<u64, conclave_client::Error>,
}

/// Publishes "first", then "once" with its answer swallowed; kills the leader once "once" is
/// applied and waits for the writer's verdict.
async fn lose_an_answer(exactly_once: bool) -> LostAnswer {
    let mut cluster = Cluster::start(3);
    let observer = cluster.client().await;
    let leader = leader_index(&cluster).await;
    let proxy = Proxy::start(cluster.nodes[leader].client_addr.clone()).await;
    // The writer reaches the leader through the proxy; the other members are its fallbacks.
    let mut endpoints = vec![proxy.addr.clone()];
    endpoints.extend(
        cluster
            .nodes
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != leader)
            .map(|(_, n)| n.client_addr.clone()),
    );
    let options = ClientOptions {
        request_timeout: Duration::from_secs(20),
        connect_timeout: Duration::from_millis(500),
        exactly_once,
        ..ClientOptions::default()
    };
    let writer = Client::connect_with(&endpoints, options)
        .await
        .expect("connect through the proxy");
    assert!(
        writer
            .current_endpoint()
            .await
            .expect("endpoint")
            .ends_with(&proxy.addr),
        "the writer talks to the leader through the proxy"
    );
    let topics = writer.topics();
    assert_eq!(topics.publish("jobs", "first").await.expect("publish"), 1);

    // From here the leader's answers are lost.
    proxy.swallow.store(true, Ordering::SeqCst);
    let started = Instant::now();
    let pending = tokio::spawn(async move { topics.publish("jobs", "once").await });
    // The publish is applied (the observer, on another connection, sees it) ...
    let deadline = Instant::now() + Duration::from_secs(10);
    while messages(&observer, "jobs").await.len() < 2 {
        assert!(Instant::now() < deadline, "the publish was not applied");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!pending.is_finished(), "its answer was swallowed");
    // ... and then its leader dies before answering.
    let applied = started.elapsed();
    cluster.nodes[leader].kill();
    let outcome = tokio::time::timeout(Duration::from_secs(30), pending)
        .await
        .expect("the publish call ends")
        .expect("task");
    eprintln!(
        "publish with its answer lost (exactly_once: {exactly_once}): applied after \
         {applied:?}, leader killed, call ended after {:?} with {outcome:?}",
        started.elapsed()
    );
    LostAnswer {
        _cluster: cluster,
        _proxy: proxy,
        observer,
        writer,
        outcome,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_retried_after_its_leader_died_is_applied_once() {
    let lost = lose_an_answer(true).await;
    let seq = lost.outcome.expect("the retried publish succeeds");
    assert_eq!(seq, 2, "the retry got the first attempt's answer");
    assert_eq!(
        messages(&lost.observer, "jobs").await,
        ["first", "once"],
        "published once"
    );
    // The session carries on with the next write, on the new leader.
    assert_eq!(
        lost.writer
            .topics()
            .publish("jobs", "after")
            .await
            .expect("publish"),
        3
    );
    assert_eq!(
        messages(&lost.observer, "jobs").await,
        ["first", "once", "after"]
    );
    lost.writer
        .close_sessions()
        .await
        .expect("close the sessions");
}

/// The negative control: without a session the client cannot know whether the publish was
/// applied, says so, and a caller that tries again publishes the message twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_session_the_same_loss_leaves_a_retry_to_the_caller_which_duplicates() {
    let lost = lose_an_answer(false).await;
    let error = lost.outcome.expect_err("ambiguous without a session");
    assert_eq!(error.code(), "unavailable", "{error}");
    lost.writer
        .topics()
        .publish("jobs", "once")
        .await
        .expect("the caller's own retry");
    assert_eq!(
        messages(&lost.observer, "jobs").await,
        ["first", "once", "once"]
    );
}
