//! A cluster whose peer links were all cut by a partition that drops packets (no FIN, no
//! reset) takes writes again soon after the partition heals (docs/faults.md, finding 11).
//!
//! Such a partition closes no connection. Before the peer transport bounded how long sent
//! data may stay unacknowledged (`unacked_timeout_ms`, TCP_USER_TIMEOUT), every peer
//! connection survived the cut, the kernel's retransmission timer doubled while it lasted, and
//! the first message after the heal waited for the next retransmission: after an 8 s cut, the
//! first put was acknowledged 5.3 s after the heal (twice in two runs; 0.6-0.7 s with the bound). With the bound the connections are dropped and dialed anew, and a
//! leader is back within about the reconnect interval plus an election.
//!
//! The cut is made with iptables rules on loopback, so this file needs root and `iptables`
//! (as the fault suite does).

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::Cluster;
use conclave_proto::etcdserverpb::PutRequest;

/// How long every peer link stays cut: long enough for the kernel's retransmission backoff
/// to reach seconds (0.2, 0.6, 1.4, 3.0, 6.2, 12.6 s after the cut on loopback).
const CUT: Duration = Duration::from_secs(8);
/// The most a write may take after the heal: the reconnect interval (a 1 s connect timeout
/// plus up to 500 ms of backoff), an election, and slack for a loaded 2-core machine. Without
/// the bound it took 5.3 s.
const WRITES_AGAIN_WITHIN: Duration = Duration::from_millis(3200);

/// iptables rules dropping every TCP packet to or from the given loopback ports until
/// dropped themselves. They drop on input, after the packet was sent: a drop on output is
/// reported to the sending socket, which then retries at once instead of backing off, so it
/// would not behave like a lost packet on a network.
struct PeerCut {
    rules: Vec<Vec<String>>,
}

impl PeerCut {
    fn cut(ports: &[u16]) -> PeerCut {
        let mut cut = PeerCut { rules: Vec::new() };
        for port in ports {
            for direction in ["--dport", "--sport"] {
                let rule: Vec<String> = [
                    "INPUT",
                    "-i",
                    "lo",
                    "-p",
                    "tcp",
                    direction,
                    &port.to_string(),
                    "-j",
                    "DROP",
                ]
                .iter()
                .map(|s| s.to_string())
                .collect();
                let status = Command::new("iptables")
                    .arg("-I")
                    .args(&rule)
                    .status()
                    .expect("this test needs the iptables command (and root)");
                assert!(
                    status.success(),
                    "iptables -I {rule:?} failed (root needed)"
                );
                cut.rules.push(rule);
            }
        }
        cut
    }
}

impl Drop for PeerCut {
    fn drop(&mut self) {
        for rule in &self.rules {
            let _ = Command::new("iptables").arg("-D").args(rule).status();
        }
    }
}

/// Time until any member acknowledges a put, trying them in turn with short deadlines.
async fn until_a_put_is_acknowledged(cluster: &Cluster, limit: Duration) -> Duration {
    let start = Instant::now();
    let ids = cluster.live_ids();
    let mut clients = Vec::new();
    for id in &ids {
        clients.push(cluster.kv(*id).await);
    }
    let mut attempt = 0usize;
    loop {
        let client = &mut clients[attempt % ids.len()];
        attempt += 1;
        let mut request = tonic::Request::new(PutRequest {
            key: b"heal/probe".to_vec().into(),
            value: b"v".to_vec().into(),
            ..Default::default()
        });
        request.set_timeout(Duration::from_millis(250));
        if client.put(request).await.is_ok() {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < limit,
            "no member acknowledged a put within {limit:?} of the heal"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn writes_resume_soon_after_a_partition_of_every_peer_link_heals() {
    let cluster = Cluster::start(3).await;
    cluster.wait_for_leader(Duration::from_secs(10)).await;
    until_a_put_is_acknowledged(&cluster, Duration::from_secs(10)).await;
    let ports: Vec<u16> = cluster
        .nodes
        .iter()
        .map(|node| {
            node.peer
                .rsplit(':')
                .next()
                .and_then(|port| port.parse().ok())
                .expect("a peer address with a port")
        })
        .collect();

    let cut = PeerCut::cut(&ports);
    tokio::time::sleep(CUT).await;
    // The cut must have cost the leader: otherwise the test tests nothing.
    let mut statuses = Vec::new();
    for id in cluster.live_ids() {
        statuses.push(cluster.status(id).await.map(|s| s.leader));
    }
    assert!(
        statuses.iter().all(|leader| *leader == Some(0)),
        "a member still names a leader after {CUT:?} with every peer link cut: {statuses:?}"
    );
    drop(cut);

    let took = until_a_put_is_acknowledged(&cluster, Duration::from_secs(20)).await;
    eprintln!("a put was acknowledged {took:?} after the heal (cut {CUT:?})");
    assert!(
        took <= WRITES_AGAIN_WITHIN,
        "the first put after the heal took {took:?}, more than {WRITES_AGAIN_WITHIN:?}"
    );
}
