//! Leases over real `conclave serve` processes: grant/revoke/time-to-live through followers,
//! keepalives that keep keys alive, expiry timing (never before the TTL, soon after it), the
//! same across a SIGKILL of the leader, many keepalives in flight on one stream, and etcdctl
//! 3.4's lease commands.

mod common;

use std::collections::BTreeMap;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Cluster, Paused};
use conclave_proto::etcdserverpb::lease_client::LeaseClient;
use conclave_proto::etcdserverpb::{
    LeaseGrantRequest, LeaseKeepAliveRequest, LeaseKeepAliveResponse, LeaseLeasesRequest,
    LeaseRevokeRequest, LeaseTimeToLiveRequest, PutRequest, RangeRequest,
};
use tokio::sync::mpsc;
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Code, Streaming};

const ETCDCTL: &str = "/usr/bin/etcdctl";
/// The harness runs nodes with the default election timeout.
const ELECTION_TIMEOUT: Duration = Duration::from_millis(150);
/// How often the tests look for an expired key.
const POLL_INTERVAL: Duration = Duration::from_millis(20);

fn lease_client(cluster: &Cluster, id: u64) -> LeaseClient<Channel> {
    let channel = Channel::from_shared(cluster.endpoint(id))
        .expect("valid endpoint")
        .connect_lazy();
    LeaseClient::new(channel)
}

async fn grant(cluster: &Cluster, via: u64, ttl_seconds: i64) -> i64 {
    let granted = lease_client(cluster, via)
        .lease_grant(LeaseGrantRequest {
            ttl: ttl_seconds,
            id: 0,
        })
        .await
        .expect("grant")
        .into_inner();
    assert_eq!(granted.ttl, ttl_seconds);
    granted.id
}

async fn put_with_lease(cluster: &Cluster, via: u64, key: &str, lease: i64) {
    cluster
        .kv(via)
        .await
        .put(PutRequest {
            key: key.to_string().into(),
            value: "held".into(),
            lease,
            ..Default::default()
        })
        .await
        .expect("put with lease");
}

/// Whether `key` exists, read linearizably through `via`; `None` when the read failed (no
/// leader during a failover), which says nothing either way.
async fn exists(cluster: &Cluster, via: u64, key: &str) -> Option<bool> {
    let mut request = tonic::Request::new(RangeRequest {
        key: key.to_string().into(),
        ..Default::default()
    });
    request.set_timeout(Duration::from_secs(1));
    let mut kv = cluster.kv(via).await;
    kv.range(request)
        .await
        .ok()
        .map(|r| r.into_inner().count > 0)
}

/// When an acknowledged keepalive was sent, and when its answer arrived.
#[derive(Clone, Copy, Debug)]
struct Sent {
    sent: Instant,
    acked: Instant,
}

/// A client's keepalive stream, re-opened (as etcd's clients do) when it fails.
struct KeepAlive {
    client: LeaseClient<Channel>,
    open: Option<(
        mpsc::Sender<LeaseKeepAliveRequest>,
        Streaming<LeaseKeepAliveResponse>,
    )>,
}

impl KeepAlive {
    fn new(cluster: &Cluster, via: u64) -> Self {
        KeepAlive {
            client: lease_client(cluster, via),
            open: None,
        }
    }

    async fn once(&mut self, id: i64) -> Result<LeaseKeepAliveResponse, String> {
        if self.open.is_none() {
            let (sender, receiver) = mpsc::channel(4);
            let stream = self
                .client
                .lease_keep_alive(ReceiverStream::new(receiver))
                .await
                .map_err(|s| s.to_string())?
                .into_inner();
            self.open = Some((sender, stream));
        }
        let Some((sender, stream)) = self.open.as_mut() else {
            return Err("no stream".into());
        };
        let result = async {
            sender
                .send(LeaseKeepAliveRequest { id })
                .await
                .map_err(|_| "stream closed".to_string())?;
            match tokio::time::timeout(Duration::from_secs(2), stream.message()).await {
                Ok(Ok(Some(response))) => Ok(response),
                Ok(Ok(None)) => Err("stream ended".to_string()),
                Ok(Err(status)) => Err(status.to_string()),
                Err(_) => Err("no answer within 2 s".to_string()),
            }
        }
        .await;
        if result.is_err() {
            self.open = None;
        }
        result
    }

    /// Keeps retrying until a keepalive is acknowledged; returns when it was sent and
    /// acknowledged (the leader renewed it in between), and the answer.
    async fn until_acked(&mut self, id: i64, timeout: Duration) -> (Sent, LeaseKeepAliveResponse) {
        let start = Instant::now();
        loop {
            let sent = Instant::now();
            match self.once(id).await {
                Ok(response) => {
                    let acked = Instant::now();
                    return (Sent { sent, acked }, response);
                }
                Err(error) if start.elapsed() < timeout => {
                    let _ = error;
                    tokio::time::sleep(POLL_INTERVAL).await;
                }
                Err(error) => {
                    panic!("keepalive of {id:x} not acknowledged in {timeout:?}: {error}")
                }
            }
        }
    }
}

/// Keeps `key` alive through `via` for `duration`, checking it stays; returns the last
/// acknowledged keepalive.
async fn keep_alive_for(
    cluster: &Cluster,
    via: u64,
    lease: i64,
    key: &str,
    duration: Duration,
    every: Duration,
) -> Sent {
    let mut keepalive = KeepAlive::new(cluster, via);
    let start = Instant::now();
    let mut last_sent = None;
    while start.elapsed() < duration {
        let (sent, response) = keepalive.until_acked(lease, Duration::from_secs(5)).await;
        assert!(response.ttl > 0, "lease {lease:x} lost while kept alive");
        last_sent = Some(sent);
        assert_ne!(
            exists(cluster, via, key).await,
            Some(false),
            "{key} vanished while its lease was kept alive"
        );
        tokio::time::sleep(every).await;
    }
    last_sent.expect("at least one keepalive")
}

/// Polls `key` through `via` until it is gone. Asserts that no read returned "gone" before the
/// last keepalive was sent + `ttl` (never early) and that it is gone within
/// `limit` of that keepalive's answer (the leader renewed it before answering). Returns how
/// long after the answer it was first seen gone.
async fn wait_for_expiry(
    cluster: &Cluster,
    via: u64,
    key: &str,
    last: Sent,
    ttl: Duration,
    limit: Duration,
) -> Duration {
    loop {
        let seen = exists(cluster, via, key).await;
        // A linearizable read that finds the key gone proves the expiry happened before the
        // read *returned*, not before it was sent: on a busy machine a read sent just before
        // `sent + ttl` can return just after an expiry that was on time. So the evidence of an
        // early expiry is a "gone" that arrived before `sent + ttl` (the keepalive was handled,
        // and its TTL started, after `sent`).
        let returned = Instant::now();
        if seen == Some(false) {
            assert!(
                returned >= last.sent + ttl,
                "{key} expired {:?} after the last keepalive was sent, before its TTL of {ttl:?}",
                returned - last.sent
            );
            return returned - last.acked;
        }
        assert!(
            last.acked.elapsed() < limit,
            "{key} still alive {limit:?} after the last keepalive (TTL {ttl:?})"
        );
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn grant_time_to_live_leases_revoke_through_a_follower_with_etcd_errors() {
    let cluster = Cluster::start(3).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(5)).await;
    let follower = (1..=3).find(|&id| id != leader).expect("a follower");
    let mut leases = lease_client(&cluster, follower);

    let granted = leases
        .lease_grant(LeaseGrantRequest { ttl: 5, id: 0 })
        .await
        .expect("grant")
        .into_inner();
    assert_eq!(granted.ttl, 5);
    assert!(granted.id > 0);
    let header = granted.header.expect("header");
    assert_eq!(
        header.member_id, leader,
        "the leader answered the forwarded grant"
    );
    let chosen = leases
        .lease_grant(LeaseGrantRequest { ttl: 1, id: 0x77 })
        .await
        .expect("grant with an id")
        .into_inner();
    assert_eq!(chosen.id, 0x77);
    assert!(chosen.ttl >= 1);
    let duplicate = leases
        .lease_grant(LeaseGrantRequest { ttl: 5, id: 0x77 })
        .await
        .expect_err("duplicate id");
    assert_eq!(duplicate.code(), Code::FailedPrecondition);
    assert_eq!(duplicate.message(), "etcdserver: lease already exists");
    let too_long = leases
        .lease_grant(LeaseGrantRequest {
            ttl: 9_000_000_001,
            id: 0,
        })
        .await
        .expect_err("too large TTL");
    assert_eq!(too_long.code(), Code::OutOfRange);
    assert_eq!(too_long.message(), "etcdserver: too large lease TTL");

    put_with_lease(&cluster, follower, "leased/a", granted.id).await;
    put_with_lease(&cluster, follower, "leased/b", granted.id).await;
    let ttl = leases
        .lease_time_to_live(LeaseTimeToLiveRequest {
            id: granted.id,
            keys: true,
        })
        .await
        .expect("time to live")
        .into_inner();
    assert_eq!(ttl.granted_ttl, 5);
    assert!((3..=5).contains(&ttl.ttl), "remaining {}", ttl.ttl);
    assert_eq!(ttl.keys, vec!["leased/a".as_bytes(), "leased/b".as_bytes()]);

    let listed = leases
        .lease_leases(LeaseLeasesRequest {})
        .await
        .expect("leases")
        .into_inner();
    let mut ids: Vec<i64> = listed.leases.iter().map(|l| l.id).collect();
    ids.sort();
    assert_eq!(ids, {
        let mut expected = vec![granted.id, 0x77];
        expected.sort();
        expected
    });

    let before = cluster
        .kv(follower)
        .await
        .range(RangeRequest {
            key: "leased/a".into(),
            ..Default::default()
        })
        .await
        .expect("range")
        .into_inner()
        .header
        .expect("header")
        .revision;
    let revoked = leases
        .lease_revoke(LeaseRevokeRequest { id: granted.id })
        .await
        .expect("revoke")
        .into_inner();
    let header = revoked.header.expect("header");
    assert_eq!(header.revision, before + 1, "both keys go in one revision");
    assert_eq!(
        header.member_id, follower,
        "the follower handed the revoke to the leader over the peer link and answered it"
    );
    assert_eq!(exists(&cluster, follower, "leased/a").await, Some(false));
    assert_eq!(exists(&cluster, follower, "leased/b").await, Some(false));
    let gone = leases
        .lease_time_to_live(LeaseTimeToLiveRequest {
            id: granted.id,
            keys: true,
        })
        .await
        .expect("time to live of a revoked lease")
        .into_inner();
    assert_eq!(gone.ttl, -1);
    let again = leases
        .lease_revoke(LeaseRevokeRequest { id: granted.id })
        .await
        .expect_err("revoke twice");
    assert_eq!(again.code(), Code::NotFound);
    assert_eq!(again.message(), "etcdserver: requested lease not found");
    let mut keepalive = KeepAlive::new(&cluster, follower);
    let answer = keepalive.once(granted.id).await.expect("keepalive answer");
    assert_eq!(
        answer.ttl, 0,
        "a keepalive of a missing lease answers TTL 0"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn keepalives_keep_keys_alive_and_abandoned_leases_expire_after_their_ttl() {
    let cluster = Cluster::start(3).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(5)).await;
    let follower = (1..=3).find(|&id| id != leader).expect("a follower");
    let ttl = Duration::from_secs(2);
    let lease = grant(&cluster, follower, 2).await;
    put_with_lease(&cluster, follower, "alive", lease).await;

    // Kept alive through a follower (which forwards to the leader) for twice the TTL.
    let last = keep_alive_for(
        &cluster,
        follower,
        lease,
        "alive",
        ttl * 2,
        Duration::from_millis(500),
    )
    .await;
    let limit = ttl + ELECTION_TIMEOUT + Duration::from_secs(1);
    let expired_after = wait_for_expiry(&cluster, follower, "alive", last, ttl, limit).await;
    println!(
        "lease expiry: key gone {} ms after the last keepalive was acknowledged (TTL {} ms)",
        expired_after.as_millis(),
        ttl.as_millis()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn leases_survive_and_still_expire_across_a_leader_kill() {
    let mut cluster = Cluster::start(3).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(5)).await;
    let survivor = (1..=3).find(|&id| id != leader).expect("a follower");
    let ttl = Duration::from_secs(3);
    let kept = grant(&cluster, survivor, 3).await;
    let abandoned = grant(&cluster, survivor, 3).await;
    put_with_lease(&cluster, survivor, "kept", kept).await;
    put_with_lease(&cluster, survivor, "abandoned", abandoned).await;
    // The abandoned lease's holder goes quiet after one keepalive; the leader then dies.
    let (abandoned_at, _) = KeepAlive::new(&cluster, survivor)
        .until_acked(abandoned, Duration::from_secs(5))
        .await;

    // Keepalives for the other lease continue across the kill: a leader change alone must not
    // expire it.
    let keeper = {
        let endpoint = cluster.endpoint(survivor);
        tokio::spawn(async move {
            let channel = Channel::from_shared(endpoint)
                .expect("valid endpoint")
                .connect_lazy();
            let mut keepalive = KeepAlive {
                client: LeaseClient::new(channel),
                open: None,
            };
            let start = Instant::now();
            let mut last = None;
            while start.elapsed() < Duration::from_secs(6) {
                let (sent, response) = keepalive.until_acked(kept, Duration::from_secs(5)).await;
                assert!(response.ttl > 0, "kept lease lost across the failover");
                last = Some(sent);
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            last.expect("at least one keepalive")
        })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    cluster.kill(leader);
    let limit = ttl + ELECTION_TIMEOUT + Duration::from_secs(1);
    let abandoned_after =
        wait_for_expiry(&cluster, survivor, "abandoned", abandoned_at, ttl, limit).await;
    assert_ne!(
        exists(&cluster, survivor, "kept").await,
        Some(false),
        "the kept-alive key vanished across the failover"
    );
    let kept_last = keeper.await.expect("keepalive task");
    assert_ne!(exists(&cluster, survivor, "kept").await, Some(false));
    let kept_after = wait_for_expiry(&cluster, survivor, "kept", kept_last, ttl, limit).await;
    println!(
        "lease expiry across a leader kill: abandoned {} ms after its last acknowledged keepalive (leader killed ~1 s after it), kept-then-abandoned {} ms after its last acknowledged keepalive (TTL {} ms)",
        abandoned_after.as_millis(),
        kept_after.as_millis(),
        ttl.as_millis()
    );
}

fn etcdctl(endpoints: &str, args: &[&str]) -> String {
    assert!(
        std::path::Path::new(ETCDCTL).exists(),
        "{ETCDCTL} is missing: install it with `apt-get update && apt-get install -y etcd-client` (.ci/run does)"
    );
    let output = Command::new(ETCDCTL)
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={endpoints}"))
        .args(["--command-timeout=5s"])
        .args(args)
        .output()
        .expect("run etcdctl");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "etcdctl {args:?} failed: {}{}",
        stdout,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

#[tokio::test(flavor = "multi_thread")]
async fn etcdctl_lease_grant_put_keep_alive_time_to_live_revoke() {
    let cluster = Cluster::start(3).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(5)).await;
    let follower = (1..=3).find(|&id| id != leader).expect("a follower");
    let via = cluster.nodes[(follower - 1) as usize].client.clone();

    // "lease 694d77aa9e38260f granted with TTL(5s)"
    let granted = etcdctl(&via, &["lease", "grant", "5"]);
    let words: Vec<&str> = granted.split_whitespace().collect();
    assert_eq!(words.first(), Some(&"lease"), "{granted}");
    assert!(
        granted.trim_end().ends_with("granted with TTL(5s)"),
        "{granted}"
    );
    let id = words[1].to_string();

    assert_eq!(
        etcdctl(&via, &["put", "k", "v", &format!("--lease={id}")]).trim(),
        "OK"
    );
    let kept = etcdctl(&via, &["lease", "keep-alive", "--once", &id]);
    assert_eq!(kept.trim(), format!("lease {id} keepalived with TTL(5)"));
    let ttl = etcdctl(&via, &["lease", "timetolive", &id, "--keys"]);
    assert!(
        ttl.starts_with(&format!("lease {id} granted with TTL(5s), remaining(")),
        "{ttl}"
    );
    assert!(ttl.trim_end().ends_with("attached keys([k])"), "{ttl}");
    let list = etcdctl(&via, &["lease", "list"]);
    assert!(list.contains(&id), "{list}");
    assert_eq!(
        etcdctl(&via, &["lease", "revoke", &id]).trim(),
        format!("lease {id} revoked")
    );
    assert_eq!(etcdctl(&via, &["get", "k"]), "");
    assert_eq!(
        etcdctl(&via, &["lease", "timetolive", &id]).trim(),
        format!("lease {id} already expired")
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn etcdctl_lock_of_a_killed_holder_frees_when_its_session_lease_expires() {
    let cluster = Cluster::start(3).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(5)).await;
    let follower = (1..=3).find(|&id| id != leader).expect("a follower");
    let via = cluster.nodes[(follower - 1) as usize].client.clone();
    let etcdctl_lock = |extra: &[&str]| {
        Command::new(ETCDCTL)
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={via}"))
            .args(["lock", "--ttl=2", "shared-lock"])
            .args(extra)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start etcdctl lock")
    };
    // Without a command, `etcdctl lock` prints its key and holds the lock until signalled.
    let mut holder = etcdctl_lock(&[]);
    let held_key = async {
        loop {
            let listed = etcdctl(&via, &["get", "--prefix", "shared-lock/", "--keys-only"]);
            if !listed.trim().is_empty() {
                return listed;
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), held_key)
        .await
        .expect("the first etcdctl took the lock");
    let mut waiter = etcdctl_lock(&["echo", "second-holder"]);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        waiter.try_wait().expect("poll etcdctl").is_none(),
        "the second etcdctl got the lock while the first held it"
    );

    // SIGKILL: the holder cannot unlock or revoke; only its 2 s session lease frees the lock.
    let _ = holder.kill();
    let _ = holder.wait();
    let killed = Instant::now();
    let output = tokio::task::spawn_blocking(move || waiter.wait_with_output())
        .await
        .expect("join")
        .expect("second etcdctl");
    let waited = killed.elapsed();
    assert!(output.status.success());
    assert_eq!(
        String::from_utf8_lossy(&output.stdout).trim(),
        "second-holder"
    );
    println!(
        "etcdctl lock: granted {} ms after the holder was killed (session TTL 2 s)",
        waited.as_millis()
    );
    // Its last keepalive was at most TTL/3 before the kill; allow the expiry bound on top.
    assert!(
        waited < Duration::from_secs(2) + ELECTION_TIMEOUT + Duration::from_secs(1),
        "lock freed {waited:?} after the holder died"
    );
}

/// A leader paused by SIGSTOP still believes it leads when it is continued, until it hears
/// the higher term. A keepalive that waited in its socket meanwhile must not be answered by
/// it with a TTL: the new leader never saw the keepalive, and the holder would act on a lease
/// the cluster may have ended (the fault suite saw two lock holders at once this way). An
/// answer, if any, comes from the new leader (the deposed member retries there).
#[tokio::test(flavor = "multi_thread")]
async fn a_continued_deposed_leader_does_not_answer_keepalives_itself() {
    let cluster = Cluster::start(3).await;
    let old = cluster.wait_for_leader(Duration::from_secs(10)).await;
    let lease = grant(&cluster, old, 5).await;
    let mut keepalive = KeepAlive::new(&cluster, old);
    // Opens the stream on the leader and leaves a fresh "renewed" record, so the continued
    // leader could answer the next keepalive from its memory alone, without a log entry.
    let (_, first) = keepalive.until_acked(lease, Duration::from_secs(5)).await;
    assert!(first.ttl > 0, "first keepalive: {first:?}");
    let pid = cluster.nodes[(old - 1) as usize]
        .child
        .as_ref()
        .expect("leader running")
        .id();
    let paused = Paused::new(pid);
    let (sender, stream) = keepalive.open.as_mut().expect("stream open");
    sender
        .send(LeaseKeepAliveRequest { id: lease })
        .await
        .expect("keepalive queued");
    let others: Vec<u64> = cluster
        .live_ids()
        .into_iter()
        .filter(|&id| id != old)
        .collect();
    let start = Instant::now();
    let new = loop {
        let mut leader = None;
        for &id in &others {
            if let Some(status) = cluster.status(id).await
                && status.header.map(|h| h.member_id) == Some(status.leader)
            {
                leader = Some(id);
            }
        }
        if let Some(leader) = leader {
            break leader;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no new leader while {old} was paused"
        );
        tokio::time::sleep(POLL_INTERVAL).await;
    };
    drop(paused);
    let answer = tokio::time::timeout(Duration::from_secs(5), stream.message()).await;
    println!("paused leader {old}, new leader {new}: {answer:?}");
    if let Ok(Ok(Some(response))) = answer
        && response.ttl > 0
    {
        let from = response.header.map(|h| h.member_id);
        assert_ne!(
            from,
            Some(old),
            "deposed member {old} answered a keepalive with TTL {} after {new} took over",
            response.ttl
        );
    }
    // The lease is still there and kept alive by the new leader.
    let mut fresh = KeepAlive::new(&cluster, new);
    let (_, kept) = fresh.until_acked(lease, Duration::from_secs(5)).await;
    assert!(kept.ttl > 0, "lease lost across the pause: {kept:?}");
}

/// A leader whose followers are both stopped cannot have its term confirmed, so it must not
/// answer a keepalive, not even one it renews from memory alone (within the checkpoint
/// interval of the lease's last record), where the driver starts the confirming round in the
/// same turn as the renewal and answers once that round is in; nor a TimeToLive, whose
/// remaining TTL the driver reads from memory and confirms the same way.
#[tokio::test(flavor = "multi_thread")]
async fn a_leader_that_cannot_reach_a_quorum_answers_neither_a_keepalive_nor_a_time_to_live() {
    let cluster = Cluster::start(3).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(10)).await;
    let lease = grant(&cluster, leader, 5).await;
    let mut keepalive = KeepAlive::new(&cluster, leader);
    // The first keepalive on this leader commits a "renewed" record; the next one, well
    // within the checkpoint interval after it, is renewed from the keeper's memory.
    let (_, first) = keepalive.until_acked(lease, Duration::from_secs(5)).await;
    assert!(first.ttl > 0, "first keepalive: {first:?}");
    let paused = cluster.pause_all_but(leader);
    // Both asked at once, right after the stop: a leader that hears no quorum steps down
    // after an election timeout, and must not answer either before that.
    let (sender, stream) = keepalive.open.as_mut().expect("stream open");
    sender
        .send(LeaseKeepAliveRequest { id: lease })
        .await
        .expect("keepalive queued");
    let mut asked = lease_client(&cluster, leader);
    let (answer, time_to_live) = tokio::join!(
        tokio::time::timeout(Duration::from_millis(1500), stream.message()),
        tokio::time::timeout(
            Duration::from_millis(1500),
            asked.lease_time_to_live(LeaseTimeToLiveRequest {
                id: lease,
                keys: false,
            }),
        ),
    );
    drop(paused);
    println!("leader {leader} with both followers stopped: {answer:?}");
    if let Ok(Ok(Some(response))) = &answer {
        assert!(
            response.ttl <= 0,
            "leader {leader} answered a keepalive with TTL {} while no follower could confirm its term",
            response.ttl
        );
    }
    println!("TimeToLive on leader {leader} with both followers stopped: {time_to_live:?}");
    if let Ok(Ok(response)) = &time_to_live {
        assert!(
            response.get_ref().ttl <= 0,
            "leader {leader} answered TimeToLive with TTL {} while no follower could confirm its term",
            response.get_ref().ttl
        );
    }
    // With the followers back, the lease is kept alive again.
    let now_leader = cluster.wait_for_leader(Duration::from_secs(10)).await;
    let mut fresh = KeepAlive::new(&cluster, now_leader);
    let (_, kept) = fresh.until_acked(lease, Duration::from_secs(5)).await;
    assert!(kept.ttl > 0, "lease lost across the stop: {kept:?}");
}

/// Distinct leases one stream renews back to back in the pipelining test.
const BURST_LEASES: usize = 200;

/// How many WAL fsyncs member `id` has made (the count of its fsync histogram).
async fn wal_fsyncs(cluster: &Cluster, id: u64) -> u64 {
    const SAMPLE: &str = "etcd_disk_wal_fsync_duration_seconds_count ";
    let url = format!("{}/metrics", cluster.metrics_url(id));
    let (_, scrape) = common::http_get(&url).await.expect("metrics scrape");
    scrape
        .lines()
        .find_map(|line| line.strip_prefix(SAMPLE)?.trim().parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no {SAMPLE}in member {id}'s metrics")) as u64
}

/// Sends a keepalive for each of `ids` (repeats allowed) back to back on one new stream
/// through `via`, then half-closes it; returns the TTLs answered per lease id once the server
/// has ended the stream.
async fn keep_alive_burst(cluster: &Cluster, via: u64, ids: &[i64]) -> BTreeMap<i64, Vec<i64>> {
    let (sender, receiver) = mpsc::channel(ids.len());
    for &id in ids {
        sender
            .try_send(LeaseKeepAliveRequest { id })
            .expect("room for every request");
    }
    let mut stream = lease_client(cluster, via)
        .lease_keep_alive(ReceiverStream::new(receiver))
        .await
        .expect("keepalive stream")
        .into_inner();
    let mut answers: BTreeMap<i64, Vec<i64>> = BTreeMap::new();
    let mut count = 0;
    while count < ids.len() {
        let answer = tokio::time::timeout(Duration::from_secs(30), stream.message())
            .await
            .unwrap_or_else(|_| panic!("{count} of {} keepalives answered in 30 s", ids.len()))
            .unwrap_or_else(|status| panic!("after {count} answers: {status}"))
            .unwrap_or_else(|| panic!("stream ended after {count} of {} answers", ids.len()));
        answers.entry(answer.id).or_default().push(answer.ttl);
        count += 1;
    }
    // The half-close ends the stream once nothing is in flight: no answer may follow.
    drop(sender);
    let rest = tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await
        .expect("the stream ends after the half-close");
    assert!(
        matches!(rest, Ok(None)),
        "more than one answer per keepalive: {rest:?}"
    );
    answers
}

/// One LeaseKeepAlive stream carries many keepalives at once, on the leader and through a
/// follower. Every keepalive here needs a checkpoint record before its answer (the leases'
/// records are older than the 500 ms checkpoint interval), so a member that handles a stream's
/// keepalives one at a time waits for a commit per keepalive: at least one leader fsync each.
/// Pipelined, the checkpoints of the keepalives in flight share appends, and the burst costs
/// far fewer fsyncs than keepalives. Each keepalive still gets exactly one true answer.
#[tokio::test(flavor = "multi_thread")]
async fn one_stream_keeps_many_keepalives_in_flight_on_the_leader_and_through_a_follower() {
    let cluster = Cluster::start(3).await;
    let leader = cluster.wait_for_leader(Duration::from_secs(10)).await;
    let follower = cluster
        .live_ids()
        .into_iter()
        .find(|&id| id != leader)
        .expect("a follower");
    let mut leases = Vec::with_capacity(2 * BURST_LEASES);
    for _ in 0..2 * BURST_LEASES {
        leases.push(grant(&cluster, leader, 60).await);
    }
    // Past the checkpoint interval: every keepalive below needs a checkpoint first.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (on_leader, via_follower) = leases.split_at(BURST_LEASES);
    for (via, part) in [(leader, on_leader), (follower, via_follower)] {
        // The first lease three times: keepalives of one lease in flight together are each
        // answered too.
        let mut ids = part.to_vec();
        ids.extend([part[0], part[0]]);
        let fsyncs_before = wal_fsyncs(&cluster, leader).await;
        let started = Instant::now();
        let answers = keep_alive_burst(&cluster, via, &ids).await;
        let took = started.elapsed();
        let fsyncs = wal_fsyncs(&cluster, leader).await - fsyncs_before;
        println!(
            "{} keepalives on one stream through member {via} (leader {leader}): \
             answered in {took:?}, {fsyncs} leader fsyncs",
            ids.len()
        );
        assert_eq!(answers.len(), part.len(), "every lease answered");
        for &id in part {
            let expected = if id == part[0] { 3 } else { 1 };
            let ttls = answers.get(&id).map(Vec::as_slice).unwrap_or_default();
            assert_eq!(ttls.len(), expected, "answers of lease {id:x}: {ttls:?}");
            assert!(
                ttls.iter().all(|&ttl| ttl > 0),
                "lease {id:x} answered {ttls:?}"
            );
        }
        assert!(
            (fsyncs as usize) < ids.len() / 2,
            "{} keepalives cost {fsyncs} leader fsyncs: they were not in flight together",
            ids.len()
        );
    }
}
