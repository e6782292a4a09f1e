//! Locks, elections, topics and queues over real servers (in-process nodes on loopback ports), through
//! the tonic clients: etcd's v3lock and v3election, Conclave's own Election/Topic/Status, and
//! `etcdctl lock` / `etcdctl elect` when etcdctl is installed.

mod common;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use conclave_proto::conclave::v1 as cv1;
use conclave_proto::conclave::v1::election_client::ElectionClient as GroupClient;
use conclave_proto::conclave::v1::queue_client::QueueClient;
use conclave_proto::conclave::v1::status_client::StatusClient;
use conclave_proto::conclave::v1::topic_client::TopicClient;
use conclave_proto::etcdserverpb::kv_client::KvClient;
use conclave_proto::etcdserverpb::lease_client::LeaseClient;
use conclave_proto::etcdserverpb::maintenance_client::MaintenanceClient;
use conclave_proto::etcdserverpb::{LeaseGrantRequest, RangeRequest, StatusRequest};
use conclave_proto::v3electionpb as epb;
use conclave_proto::v3electionpb::election_client::ElectionClient;
use conclave_proto::v3lockpb::lock_client::LockClient;
use conclave_proto::v3lockpb::{LockRequest, UnlockRequest};
use conclave_server::{Member, ServerConfig};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_stream::StreamExt;
use tonic::Code;
use tonic::transport::Channel;

/// How long a cluster may take to elect its first leader.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(15);
/// How many times a cluster start may begin again on fresh ports.
const START_ATTEMPTS: u32 = 3;
/// Long enough to be sure a waiter is still waiting (the apply path answers in milliseconds).
const STILL_WAITING: Duration = Duration::from_millis(400);
/// The fence metadata key (see `api::lock::FENCE_METADATA`).
const FENCE: &str = "conclave-fence";

static NEXT_DIR: AtomicU32 = AtomicU32::new(0);
struct Cluster {
    root: PathBuf,
    clients: Vec<String>,
    stops: Vec<oneshot::Sender<()>>,
    tasks: Vec<JoinHandle<()>>,
}

impl Cluster {
    /// Starts `size` in-process nodes and waits until each knows a leader. A node that stops
    /// during start-up (its port was taken between choosing and binding it) makes the whole
    /// cluster start over on fresh ports, a few times at most.
    async fn start(size: u64) -> Cluster {
        for attempt in 1..=START_ATTEMPTS {
            let cluster = Cluster::start_once(size);
            if cluster.wait_for_leader().await {
                return cluster;
            }
            eprintln!("cluster start attempt {attempt} lost a node; starting over on new ports");
            cluster.stop().await;
        }
        panic!("no cluster of {size} started in {START_ATTEMPTS} attempts");
    }

    fn start_once(size: u64) -> Cluster {
        let root = std::env::temp_dir().join(format!(
            "conclave-locks-test-{}-{}",
            std::process::id(),
            NEXT_DIR.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&root);
        let members: Vec<Member> = (1..=size)
            .map(|id| Member {
                id,
                name: format!("node{id}"),
                peer_addr: format!("127.0.0.1:{}", common::free_port()),
                client_addr: format!("127.0.0.1:{}", common::free_port()),
            })
            .collect();
        let mut cluster = Cluster {
            root: root.clone(),
            clients: members.iter().map(|m| m.client_addr.clone()).collect(),
            stops: Vec::new(),
            tasks: Vec::new(),
        };
        for member in &members {
            let mut config = ServerConfig::single(
                root.join(&member.name),
                &member.client_addr,
                &member.peer_addr,
            );
            config.id = member.id;
            config.members = members.clone();
            let (stop, stopped) = oneshot::channel::<()>();
            cluster.stops.push(stop);
            cluster.tasks.push(tokio::spawn(async move {
                let result = conclave_server::server::run(config, async move {
                    let _ = stopped.await;
                })
                .await;
                if let Err(error) = result {
                    eprintln!("node stopped: {error}");
                }
            }));
        }
        cluster
    }

    async fn channel(&self, index: usize) -> Channel {
        Channel::from_shared(format!("http://{}", self.clients[index]))
            .expect("valid address")
            .connect()
            .await
            .expect("connect to the node")
    }

    /// True once every member reports a leader; false as soon as a node has stopped.
    async fn wait_for_leader(&self) -> bool {
        let deadline = tokio::time::Instant::now() + STARTUP_TIMEOUT;
        loop {
            if self.tasks.iter().any(|task| task.is_finished()) {
                return false;
            }
            let mut all = true;
            for index in 0..self.clients.len() {
                let ok = match Channel::from_shared(format!("http://{}", self.clients[index]))
                    .expect("valid address")
                    .connect()
                    .await
                {
                    Ok(channel) => MaintenanceClient::new(channel)
                        .status(StatusRequest {})
                        .await
                        .is_ok_and(|s| s.into_inner().leader != 0),
                    Err(_) => false,
                };
                all &= ok;
            }
            if all {
                return true;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no leader within the startup timeout"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The index of a member that does not lead (the first one in a single-node cluster).
    async fn follower(&self) -> usize {
        for index in 0..self.clients.len() {
            let status = MaintenanceClient::new(self.channel(index).await)
                .status(StatusRequest {})
                .await
                .expect("status")
                .into_inner();
            let me = status.header.map_or(0, |h| h.member_id);
            if status.leader != me {
                return index;
            }
        }
        0
    }

    async fn stop(mut self) {
        for stop in self.stops.drain(..) {
            let _ = stop.send(());
        }
        for task in self.tasks.drain(..) {
            let _ = task.await;
        }
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

async fn grant(channel: &Channel, ttl_s: i64) -> i64 {
    LeaseClient::new(channel.clone())
        .lease_grant(LeaseGrantRequest { ttl: ttl_s, id: 0 })
        .await
        .expect("lease grant")
        .into_inner()
        .id
}

fn fence_of<T>(response: &tonic::Response<T>) -> i64 {
    response
        .metadata()
        .get(FENCE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .expect("the lock answer carries its fence")
}

fn fenced<T>(message: T, fence: i64) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request
        .metadata_mut()
        .insert(FENCE, fence.to_string().parse().expect("ascii"));
    request
}

async fn create_revision(channel: &Channel, key: &[u8]) -> Option<i64> {
    KvClient::new(channel.clone())
        .range(RangeRequest {
            key: key.to_vec().into(),
            ..Default::default()
        })
        .await
        .expect("range")
        .into_inner()
        .kvs
        .first()
        .map(|kv| kv.create_revision)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lock_waits_fifo_fences_rise_expired_waiter_never_granted_stale_unlock_fails() {
    let cluster = Cluster::start(1).await;
    let channel = cluster.channel(0).await;
    let mut locks = LockClient::new(channel.clone());
    let first_lease = grant(&channel, 60).await;
    let second_lease = grant(&channel, 60).await;

    // First holder; the key is <name>/<lease hex> and its create revision is the fence.
    let first = locks
        .lock(LockRequest {
            name: "mylock".into(),
            lease: first_lease,
        })
        .await
        .expect("first lock");
    let first_fence = fence_of(&first);
    let first_key = first.into_inner().key;
    assert_eq!(first_key, format!("mylock/{first_lease:x}").into_bytes());
    assert_eq!(
        create_revision(&channel, &first_key).await,
        Some(first_fence)
    );

    // The second waits until the first unlocks.
    let mut waiter_client = locks.clone();
    let second = tokio::spawn(async move {
        waiter_client
            .lock(LockRequest {
                name: "mylock".into(),
                lease: second_lease,
            })
            .await
    });
    tokio::time::sleep(STILL_WAITING).await;
    assert!(!second.is_finished(), "the second locker must wait");
    locks
        .unlock(fenced(
            UnlockRequest {
                key: first_key.clone(),
            },
            first_fence,
        ))
        .await
        .expect("the holder unlocks");
    let second = tokio::time::timeout(Duration::from_secs(5), second)
        .await
        .expect("the waiter is granted promptly")
        .expect("task")
        .expect("second lock");
    let second_fence = fence_of(&second);
    let second_key = second.into_inner().key;
    assert!(second_fence > first_fence, "fences rise");

    // A stale unlock (the first holder's fence on a key re-created since) fails and releases
    // nothing: re-lock the first lease's key to get the same name with a new fence.
    let relock = locks
        .lock(tonic::Request::new(LockRequest {
            name: "other".into(),
            lease: first_lease,
        }))
        .await
        .expect("lock other");
    let other_fence = fence_of(&relock);
    let other_key = relock.into_inner().key;
    locks
        .unlock(fenced(
            UnlockRequest {
                key: other_key.clone(),
            },
            other_fence,
        ))
        .await
        .expect("unlock other");
    let again = locks
        .lock(LockRequest {
            name: "other".into(),
            lease: first_lease,
        })
        .await
        .expect("lock other again");
    let again_fence = fence_of(&again);
    assert_eq!(
        again.into_inner().key,
        other_key,
        "same key name, new holder"
    );
    let stale = locks
        .unlock(fenced(
            UnlockRequest {
                key: other_key.clone(),
            },
            other_fence,
        ))
        .await
        .expect_err("a stale unlock is refused");
    assert_eq!(stale.code(), Code::FailedPrecondition);
    assert_eq!(
        create_revision(&channel, &other_key).await,
        Some(again_fence)
    );
    // The holder of the second lock still holds it, and an etcd-style unlock (no fence) works.
    assert_eq!(
        create_revision(&channel, &second_key).await,
        Some(second_fence)
    );
    locks
        .unlock(UnlockRequest {
            key: second_key.clone(),
        })
        .await
        .expect("unfenced unlock");
    assert_eq!(create_revision(&channel, &second_key).await, None);

    // A waiter whose lease runs out is never told it holds the lock.
    let holder_lease = grant(&channel, 60).await;
    let short_lease = grant(&channel, 1).await;
    let holder = locks
        .lock(LockRequest {
            name: "expiring".into(),
            lease: holder_lease,
        })
        .await
        .expect("holder");
    let holder_fence = fence_of(&holder);
    let holder_key = holder.into_inner().key;
    let mut waiter_client = locks.clone();
    let waiter = tokio::spawn(async move {
        let mut request = tonic::Request::new(LockRequest {
            name: "expiring".into(),
            lease: short_lease,
        });
        request.set_timeout(Duration::from_secs(20));
        waiter_client.lock(request).await
    });
    // No keepalive: past TTL + the checkpoint interval the lease is dead in the log's eyes.
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    locks
        .unlock(fenced(UnlockRequest { key: holder_key }, holder_fence))
        .await
        .expect("holder unlocks");
    let answer = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the waiter is answered")
        .expect("task");
    let refused = answer.expect_err("an expired waiter is never granted");
    assert_eq!(refused.code(), Code::NotFound, "{refused:?}");
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_election_campaign_leader_proclaim_resign_observe_through_a_follower() {
    let cluster = Cluster::start(3).await;
    let follower = cluster.follower().await;
    let (follower_id, _) = member_and_leader(&cluster, follower).await;
    let channel = cluster.channel(follower).await;
    let mut election = ElectionClient::new(channel.clone());
    let alice_lease = grant(&channel, 60).await;
    let bob_lease = grant(&channel, 60).await;

    let alice = election
        .campaign(epb::CampaignRequest {
            name: "service".into(),
            lease: alice_lease,
            value: "alice".into(),
        })
        .await
        .expect("alice campaigns")
        .into_inner()
        .leader
        .expect("leader key");
    assert_eq!(alice.key, format!("service/{alice_lease:x}").into_bytes());

    let mut observer = election
        .observe(epb::LeaderRequest {
            name: "service".into(),
        })
        .await
        .expect("observe")
        .into_inner();
    let first = observer.next().await.expect("first").expect("ok");
    assert_eq!(first.kv.expect("kv").value, b"alice"[..]);

    let mut bob_client = election.clone();
    let bob = tokio::spawn(async move {
        bob_client
            .campaign(epb::CampaignRequest {
                name: "service".into(),
                lease: bob_lease,
                value: "bob".into(),
            })
            .await
    });
    tokio::time::sleep(STILL_WAITING).await;
    assert!(!bob.is_finished(), "bob waits while alice leads");

    let proclaimed = election
        .proclaim(epb::ProclaimRequest {
            leader: Some(alice.clone()),
            value: "alice-2".into(),
        })
        .await
        .expect("proclaim")
        .into_inner();
    // Proclaim and Resign take the peer link to the leader; the follower answers them.
    assert_eq!(proclaimed.header.map(|h| h.member_id), Some(follower_id));
    let proclaimed = observer.next().await.expect("second").expect("ok");
    assert_eq!(proclaimed.kv.expect("kv").value, b"alice-2"[..]);
    let leader = election
        .leader(epb::LeaderRequest {
            name: "service".into(),
        })
        .await
        .expect("leader")
        .into_inner();
    assert_eq!(leader.kv.expect("kv").value, b"alice-2"[..]);

    let resigned = election
        .resign(epb::ResignRequest {
            leader: Some(alice.clone()),
        })
        .await
        .expect("resign")
        .into_inner();
    assert_eq!(resigned.header.map(|h| h.member_id), Some(follower_id));
    let bob = tokio::time::timeout(Duration::from_secs(5), bob)
        .await
        .expect("bob is elected promptly")
        .expect("task")
        .expect("bob campaign")
        .into_inner()
        .leader
        .expect("leader key");
    assert!(bob.rev > alice.rev);
    let next = observer.next().await.expect("third").expect("ok");
    assert_eq!(next.kv.expect("kv").value, b"bob"[..]);

    // Alice's leadership is over: her proclaim is refused with etcd's error.
    let stale = election
        .proclaim(epb::ProclaimRequest {
            leader: Some(alice),
            value: "stale".into(),
        })
        .await
        .expect_err("stale proclaim");
    assert_eq!(stale.message(), "election: not leader");
    // With no candidate left, Leader answers etcd's "no leader".
    election
        .resign(epb::ResignRequest { leader: Some(bob) })
        .await
        .expect("bob resigns");
    let none = election
        .leader(epb::LeaderRequest {
            name: "service".into(),
        })
        .await
        .expect_err("no leader");
    assert_eq!(none.message(), "election: no leader");
    cluster.stop().await;
}

fn campaign(group: &str, id: &str, priority: i64, lease: i64) -> cv1::CampaignRequest {
    cv1::CampaignRequest {
        group: group.into(),
        candidate_id: id.into(),
        priority,
        value: format!("{id}-addr").into_bytes().into(),
        lease,
        preempt: false,
        wait: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn priority_campaign_stability_preemption_wait_proclaim_and_observe_on_three_nodes() {
    let cluster = Cluster::start(3).await;
    let follower = cluster.follower().await;
    let (follower_id, _) = member_and_leader(&cluster, follower).await;
    let channel = cluster.channel(follower).await;
    let mut groups = GroupClient::new(channel.clone());
    let low_lease = grant(&channel, 60).await;
    let high_lease = grant(&channel, 60).await;
    let mid_lease = grant(&channel, 60).await;

    let mut observer = groups
        .observe(cv1::ObserveRequest {
            group: "workers".into(),
            start_revision: 0,
        })
        .await
        .expect("observe")
        .into_inner();
    let current = observer.next().await.expect("current").expect("ok");
    assert_eq!(
        current.events[0].kind,
        cv1::election_event::Kind::Current as i32
    );

    let low = groups
        .campaign(campaign("workers", "low", 1, low_lease))
        .await
        .expect("low")
        .into_inner();
    assert!(low.elected, "the first candidate of a fresh group leads");
    let low_fence = low.leadership.expect("leadership").fence;

    // Stability: a higher priority without preemption does not depose the leader.
    let high = groups
        .campaign(campaign("workers", "high", 10, high_lease))
        .await
        .expect("high")
        .into_inner();
    assert!(!high.elected);
    let leader = high.leadership.expect("current leadership");
    assert_eq!(leader.leader.expect("leader").candidate_id, "low");
    let candidates = groups
        .candidates(cv1::CandidatesRequest {
            group: "workers".into(),
        })
        .await
        .expect("candidates")
        .into_inner()
        .candidates;
    let ids: Vec<&str> = candidates.iter().map(|c| c.candidate_id.as_str()).collect();
    assert_eq!(ids, ["low", "high"], "leader first, then by priority");

    // A waiting candidate of middle priority blocks.
    let mut mid_client = groups.clone();
    let mid = tokio::spawn(async move {
        let mut request = campaign("workers", "mid", 5, mid_lease);
        request.wait = true;
        let mut request = tonic::Request::new(request);
        request.set_timeout(Duration::from_secs(20));
        mid_client.campaign(request).await
    });

    // Preemption: high asks for the seat; the incumbent keeps it until it resigns.
    let mut preempting = campaign("workers", "high", 10, high_lease);
    preempting.preempt = true;
    let asked = groups
        .campaign(preempting)
        .await
        .expect("preempt")
        .into_inner();
    assert!(
        !asked.elected,
        "handoff: the incumbent stays until it resigns"
    );
    let pending = asked.leadership.expect("the incumbent's leadership");
    assert_eq!(pending.leader.expect("leader").candidate_id, "low");
    assert_eq!(
        pending.handoff_to.map(|c| c.candidate_id).as_deref(),
        Some("high"),
        "the leadership says who waits for the seat"
    );
    let resigned = groups
        .resign(cv1::ResignRequest {
            group: "workers".into(),
            candidate_id: "low".into(),
            fence: low_fence,
        })
        .await
        .expect("low resigns")
        .into_inner();
    assert!(resigned.was_leader);
    let leader = groups
        .leader(cv1::LeaderRequest {
            group: "workers".into(),
        })
        .await
        .expect("leader")
        .into_inner()
        .leadership
        .expect("a leader");
    assert_eq!(
        leader.leader.as_ref().expect("leader").candidate_id,
        "high",
        "succession by priority"
    );
    assert!(leader.fence > low_fence, "fences rise");
    assert!(!mid.is_finished(), "mid still waits behind high");

    // Fenced proclaim: the leader's fence works, a stale one is refused. It takes the peer
    // link to the leader; the follower answers it.
    let proclaimed = groups
        .proclaim(cv1::ProclaimRequest {
            group: "workers".into(),
            candidate_id: "high".into(),
            fence: leader.fence,
            value: "high-2".into(),
        })
        .await
        .expect("proclaim")
        .into_inner();
    assert_eq!(proclaimed.header.map(|h| h.member_id), Some(follower_id));
    let stale = groups
        .proclaim(cv1::ProclaimRequest {
            group: "workers".into(),
            candidate_id: "high".into(),
            fence: low_fence,
            value: "stale".into(),
        })
        .await
        .expect_err("stale fence");
    assert_eq!(stale.code(), Code::FailedPrecondition);

    groups
        .resign(cv1::ResignRequest {
            group: "workers".into(),
            candidate_id: "high".into(),
            fence: 0,
        })
        .await
        .expect("high resigns");
    let mid = tokio::time::timeout(Duration::from_secs(5), mid)
        .await
        .expect("mid is elected promptly")
        .expect("task")
        .expect("mid campaign")
        .into_inner();
    assert!(mid.elected);
    assert_eq!(
        mid.leadership
            .expect("leadership")
            .leader
            .expect("leader")
            .candidate_id,
        "mid"
    );

    // The observer saw the story in order.
    use cv1::election_event::Kind;
    let mut seen = Vec::new();
    let mut handoffs = Vec::new();
    while !seen.contains(&(Kind::Elected as i32, "mid".to_string())) {
        let response = tokio::time::timeout(Duration::from_secs(5), observer.next())
            .await
            .expect("events keep coming")
            .expect("stream open")
            .expect("ok");
        for event in response.events {
            if event.kind == Kind::HandoffRequested as i32 {
                handoffs.push((
                    event.candidate.as_ref().map(|c| c.candidate_id.clone()),
                    event
                        .leadership
                        .as_ref()
                        .and_then(|l| l.handoff_to.as_ref())
                        .map(|c| c.candidate_id.clone()),
                ));
            }
            let who = event
                .leadership
                .and_then(|l| l.leader)
                .map(|c| c.candidate_id)
                .unwrap_or_default();
            seen.push((event.kind, who));
        }
    }
    let elected: Vec<&str> = seen
        .iter()
        .filter(|(kind, _)| *kind == Kind::Elected as i32)
        .map(|(_, who)| who.as_str())
        .collect();
    assert_eq!(elected, ["low", "high", "mid"], "{seen:?}");
    assert!(seen.contains(&(Kind::Proclaimed as i32, "high".to_string())));
    assert!(seen.iter().any(|(kind, _)| *kind == Kind::Resigned as i32));
    // The incumbent's observers were told who asked for the seat, before it moved.
    let asked_at = seen
        .iter()
        .position(|(kind, who)| *kind == Kind::HandoffRequested as i32 && who == "low");
    let high_at = seen
        .iter()
        .position(|e| *e == (Kind::Elected as i32, "high".to_string()));
    assert!(asked_at.is_some() && asked_at < high_at, "{seen:?}");
    assert_eq!(
        handoffs,
        [(Some("high".to_string()), Some("high".to_string()))],
        "{seen:?}"
    );

    let status = StatusClient::new(channel.clone())
        .cluster_status(cv1::ClusterStatusRequest {})
        .await
        .expect("cluster status")
        .into_inner();
    assert_eq!(status.members.len(), 3);
    assert!(status.members.iter().all(|m| m.healthy), "{status:?}");
    assert_ne!(status.leader_id, 0);
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn topics_publish_read_subscribe_inbox_ack_through_a_follower() {
    let cluster = Cluster::start(3).await;
    let channel = cluster.channel(cluster.follower().await).await;
    let mut topics = TopicClient::new(channel.clone());
    for (i, data) in ["a", "b", "c"].into_iter().enumerate() {
        let published = topics
            .publish(cv1::PublishRequest {
                topic: "jobs".into(),
                data: data.into(),
                from: String::new(),
            })
            .await
            .expect("publish")
            .into_inner();
        assert_eq!(published.seq, i as u64 + 1, "dense sequence numbers");
    }
    let read = topics
        .read(cv1::ReadRequest {
            topic: "jobs".into(),
            from_seq: 2,
            limit: 0,
        })
        .await
        .expect("read")
        .into_inner();
    let data: Vec<&[u8]> = read.messages.iter().map(|m| &m.data[..]).collect();
    assert_eq!(data, [&b"b"[..], b"c"]);
    assert_eq!(read.next_seq, 4);
    assert_eq!(read.first_retained_seq, 1);

    let mut subscription = topics
        .subscribe(cv1::SubscribeRequest {
            topic: "jobs".into(),
            from_seq: 1,
        })
        .await
        .expect("subscribe")
        .into_inner();
    let backlog = subscription.next().await.expect("backlog").expect("ok");
    assert_eq!(backlog.messages.len(), 3);
    topics
        .publish(cv1::PublishRequest {
            topic: "jobs".into(),
            data: "d".into(),
            from: String::new(),
        })
        .await
        .expect("publish d");
    let live = tokio::time::timeout(Duration::from_secs(5), subscription.next())
        .await
        .expect("live message")
        .expect("open")
        .expect("ok");
    assert_eq!(live.messages[0].seq, 4);
    assert_eq!(live.messages[0].data, b"d"[..]);

    let inbox = topics
        .inbox(cv1::InboxRequest {
            consumer: "worker".into(),
            topics: vec!["jobs".into()],
            ..Default::default()
        })
        .await
        .expect("inbox")
        .into_inner();
    assert_eq!(inbox.messages.len(), 4);
    let acked = topics
        .ack(cv1::AckRequest {
            consumer: "worker".into(),
            topic: "jobs".into(),
            seq: 2,
        })
        .await
        .expect("ack")
        .into_inner();
    assert_eq!(acked.acked_seq, 2);
    let inbox = topics
        .inbox(cv1::InboxRequest {
            consumer: "worker".into(),
            topics: vec!["jobs".into()],
            ack: true,
            ..Default::default()
        })
        .await
        .expect("inbox and ack")
        .into_inner();
    let seqs: Vec<u64> = inbox.messages.iter().map(|m| m.seq).collect();
    assert_eq!(seqs, [3, 4]);

    // Everything is acknowledged; a waiting inbox is woken by the next publish.
    let mut waiting_client = topics.clone();
    let waiting = tokio::spawn(async move {
        waiting_client
            .inbox(cv1::InboxRequest {
                consumer: "worker".into(),
                topics: vec!["jobs".into()],
                wait_ms: 5_000,
                ..Default::default()
            })
            .await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    topics
        .publish(cv1::PublishRequest {
            topic: "jobs".into(),
            data: "e".into(),
            from: String::new(),
        })
        .await
        .expect("publish e");
    let woken = tokio::time::timeout(Duration::from_secs(3), waiting)
        .await
        .expect("the waiting inbox is answered before its wait ends")
        .expect("task")
        .expect("inbox")
        .into_inner();
    assert_eq!(woken.messages.len(), 1);
    assert_eq!(woken.messages[0].seq, 5);
    cluster.stop().await;
}

fn etcdctl_available() -> bool {
    Command::new("etcdctl")
        .arg("version")
        .env("ETCDCTL_API", "3")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcdctl_lock_serialises_two_processes_and_elect_reports_the_leader() {
    if !etcdctl_available() {
        eprintln!("etcdctl not installed (apt-get install -y etcd-client); skipped");
        return;
    }
    let cluster = Cluster::start(1).await;
    let endpoint = cluster.clients[0].clone();
    let log = cluster.root.join("lock.log");
    let run_locked = |n: u32| {
        let script = format!(
            "echo start-{n} >> {log}; sleep 1; echo end-{n} >> {log}",
            log = log.display()
        );
        Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args([
                "--endpoints",
                &endpoint,
                "lock",
                "mylock",
                "--",
                "sh",
                "-c",
                &script,
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start etcdctl lock")
    };
    let first = run_locked(1);
    let second = run_locked(2);
    let outputs = tokio::task::spawn_blocking(move || {
        (
            first.wait_with_output().expect("etcdctl 1"),
            second.wait_with_output().expect("etcdctl 2"),
        )
    })
    .await
    .expect("join");
    for output in [&outputs.0, &outputs.1] {
        assert!(
            output.status.success(),
            "etcdctl lock failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let lines = std::fs::read_to_string(&log).expect("the lock log");
    let lines: Vec<&str> = lines.lines().collect();
    assert_eq!(lines.len(), 4, "{lines:?}");
    let a = &lines[0][6..];
    assert_eq!(
        lines[1],
        format!("end-{a}"),
        "one holder at a time: {lines:?}"
    );
    assert!(
        lines[2].starts_with("start-") && lines[3].starts_with("end-"),
        "{lines:?}"
    );

    // etcdctl elect: a campaigner and a listener.
    let mut campaigner = Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .args(["--endpoints", &endpoint, "elect", "myelection", "alice"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start etcdctl elect");
    let listener = Command::new("timeout")
        .args([
            "3",
            "etcdctl",
            "--endpoints",
            &endpoint,
            "elect",
            "-l",
            "myelection",
        ])
        .env("ETCDCTL_API", "3")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start etcdctl elect -l");
    let listened = tokio::task::spawn_blocking(move || listener.wait_with_output())
        .await
        .expect("join")
        .expect("listener output");
    let _ = campaigner.kill();
    let _ = campaigner.wait();
    let text = String::from_utf8_lossy(&listened.stdout).to_string();
    assert!(
        text.lines().any(|l| l.starts_with("myelection/")) && text.contains("alice"),
        "etcdctl elect -l output: {text:?}"
    );
    // Our own Election service sees the same leader etcdctl elected.
    let leader = ElectionClient::new(cluster.channel(0).await)
        .leader(epb::LeaderRequest {
            name: "myelection".into(),
        })
        .await;
    // The campaigner was killed without resigning: its key lives until its lease expires.
    if let Ok(leader) = leader {
        assert_eq!(leader.into_inner().kv.expect("kv").value, b"alice"[..]);
    }
    cluster.stop().await;
}

/// The member id and the leader's index, as a member's Status reports them.
async fn member_and_leader(cluster: &Cluster, index: usize) -> (u64, u64) {
    let status = MaintenanceClient::new(cluster.channel(index).await)
        .status(StatusRequest {})
        .await
        .expect("status")
        .into_inner();
    (status.header.map_or(0, |h| h.member_id), status.leader)
}

/// Topic and queue writes that reach a follower go to the leader over the peer link, as KV
/// writes do, and the follower answers them itself: its own member id in the header (a
/// forwarded gRPC call would carry the leader's). Their answers and their errors are the ones
/// the leader gives when called directly.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn topic_and_queue_writes_through_a_follower_take_the_peer_link_and_keep_their_answers() {
    let cluster = Cluster::start(3).await;
    let follower = cluster.follower().await;
    let (follower_id, leader_id) = member_and_leader(&cluster, follower).await;
    assert_ne!(follower_id, leader_id, "a 3-member cluster has a follower");
    let answered_by = |header: Option<cv1::ResponseHeader>| header.map_or(0, |h| h.member_id);

    let mut topics = TopicClient::new(cluster.channel(follower).await);
    let configured = topics
        .configure(cv1::TopicConfigureRequest {
            topic: "through".into(),
            max_messages: 100,
            max_age_ms: 0,
        })
        .await
        .expect("configure through the follower")
        .into_inner();
    assert_eq!(answered_by(configured.header), follower_id, "configure");
    for expected_seq in 1..=3 {
        let published = topics
            .publish(cv1::PublishRequest {
                topic: "through".into(),
                data: format!("m{expected_seq}").into_bytes().into(),
                from: "agent-7".into(),
            })
            .await
            .expect("publish through the follower")
            .into_inner();
        assert_eq!(published.seq, expected_seq, "dense sequence numbers");
        assert_eq!(answered_by(published.header), follower_id, "publish");
    }
    let acked = topics
        .ack(cv1::AckRequest {
            consumer: "reader".into(),
            topic: "through".into(),
            seq: 2,
        })
        .await
        .expect("ack through the follower")
        .into_inner();
    assert_eq!(acked.acked_seq, 2);
    assert_eq!(answered_by(acked.header), follower_id, "topic ack");
    // The sender named in each publish reached the log.
    let read = topics
        .read(cv1::ReadRequest {
            topic: "through".into(),
            from_seq: 1,
            limit: 0,
        })
        .await
        .expect("read")
        .into_inner();
    let senders: Vec<&str> = read.messages.iter().map(|m| m.from.as_str()).collect();
    assert_eq!(senders, ["agent-7"; 3]);

    let mut queues = QueueClient::new(cluster.channel(follower).await);
    let pushed = queues
        .push(cv1::QueuePushRequest {
            queue: "work".into(),
            payload: b"job".to_vec().into(),
            ..Default::default()
        })
        .await
        .expect("push through the follower")
        .into_inner();
    assert!(pushed.job_id > 0);
    assert_eq!(answered_by(pushed.header), follower_id, "push");
    let claimed = queues
        .claim(cv1::QueueClaimRequest {
            queue: "work".into(),
            worker: "w1".into(),
            visibility_timeout_ms: 30_000,
            wait_ms: 0,
        })
        .await
        .expect("claim through the follower")
        .into_inner();
    assert_eq!(answered_by(claimed.header), follower_id, "claim");
    let job = claimed.job.expect("the pushed job is claimed");
    assert_eq!(job.id, pushed.job_id);
    let extended = queues
        .extend(cv1::QueueExtendRequest {
            queue: "work".into(),
            job_id: job.id,
            fence: job.fence,
            visibility_timeout_ms: 60_000,
        })
        .await
        .expect("extend through the follower")
        .into_inner();
    assert_eq!(answered_by(extended.header), follower_id, "extend");
    let nacked = queues
        .nack(cv1::QueueNackRequest {
            queue: "work".into(),
            job_id: job.id,
            fence: job.fence,
            delay_ms: 0,
        })
        .await
        .expect("nack through the follower")
        .into_inner();
    assert_eq!(answered_by(nacked.header), follower_id, "nack");
    assert!(!nacked.dead_lettered);
    let again = queues
        .claim(cv1::QueueClaimRequest {
            queue: "work".into(),
            worker: "w2".into(),
            visibility_timeout_ms: 30_000,
            wait_ms: 0,
        })
        .await
        .expect("claim again")
        .into_inner()
        .job
        .expect("the nacked job is claimable again");
    assert_ne!(again.fence, job.fence, "a new claim, a new fence");

    // An ack with the first claim's fence is refused the same way through the follower as
    // on the leader.
    let stale = cv1::QueueAckRequest {
        queue: "work".into(),
        job_id: job.id,
        fence: job.fence,
    };
    let through_follower = queues
        .ack(stale.clone())
        .await
        .expect_err("a stale fence is refused through the follower");
    let mut leader = None;
    for index in 0..3 {
        if member_and_leader(&cluster, index).await.0 == leader_id {
            leader = Some(index);
        }
    }
    let leader = leader.expect("the leader is one of the three members");
    let on_leader = QueueClient::new(cluster.channel(leader).await)
        .ack(stale)
        .await
        .expect_err("a stale fence is refused on the leader");
    assert_eq!(through_follower.code(), on_leader.code());
    assert_eq!(through_follower.message(), on_leader.message());
    let acked = queues
        .ack(cv1::QueueAckRequest {
            queue: "work".into(),
            job_id: again.id,
            fence: again.fence,
        })
        .await
        .expect("ack with the current fence")
        .into_inner();
    assert_eq!(answered_by(acked.header), follower_id, "queue ack");
    cluster.stop().await;
}
