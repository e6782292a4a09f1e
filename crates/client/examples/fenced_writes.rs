//! Why a leader needs a fencing token: a leader that stalls (a long GC pause, a frozen VM)
//! may still believe it leads after its lease expired and a successor was elected. A storage
//! that remembers the highest fence it has seen refuses the stale leader's write.
//!
//! Run a server first (`conclave dev`), then:
//! `cargo run -p conclave-client --example fenced_writes`.

use std::sync::Mutex;
use std::time::Duration;

use conclave_client::{CampaignOptions, Client, Op, PutOptions, Txn};

/// An external resource (a database, an object store) that accepts a write only with a fence
/// at least as high as every fence it has seen.
#[derive(Default)]
struct FencedStorage {
    state: Mutex<(u64, Vec<String>)>,
}

impl FencedStorage {
    fn write(&self, fence: u64, record: &str) -> Result<(), String> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if fence < state.0 {
            return Err(format!("stale fence {fence}: already saw {}", state.0));
        }
        state.0 = fence;
        state.1.push(format!("[fence {fence}] {record}"));
        Ok(())
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let endpoints: Vec<String> = std::env::var("CONCLAVE_ENDPOINTS")
        .unwrap_or_else(|_| "127.0.0.1:2379".into())
        .split(',')
        .map(str::to_string)
        .collect();
    let storage = FencedStorage::default();
    let options = CampaignOptions {
        ttl: Duration::from_secs(2),
        ..Default::default()
    };

    let alice_client = Client::connect(&endpoints).await?;
    let alice = alice_client
        .election()
        .campaign("fenced-demo", "alice", 10, "alice", options.clone())
        .await?;
    let alice_fence = alice.fence();
    let alice_compare = alice.fence_compare();
    println!("alice leads with fence {alice_fence}");
    storage
        .write(alice_fence, "alice: balance = 100")
        .map_err(|e| e.to_string())?;

    // Alice stalls: her keepalives stop, as in a long pause. Her code still holds the fence.
    alice.abandon();
    println!("alice stalls (no keepalives)...");

    let bob_client = Client::connect(&endpoints).await?;
    let bob = bob_client
        .election()
        .campaign("fenced-demo", "bob", 5, "bob", options)
        .await?;
    println!(
        "bob takes over with fence {} after alice's lease expired",
        bob.fence()
    );
    storage
        .write(bob.fence(), "bob: balance = 70")
        .map_err(|e| e.to_string())?;

    // Alice wakes up and, unaware, writes with her old fence.
    match storage.write(alice_fence, "alice: balance = 150") {
        Ok(()) => println!("BUG: the stale write was accepted"),
        Err(reason) => println!("storage refused alice's late write: {reason}"),
    }
    // The same protection inside Conclave's own KV: a transaction conditioned on the fence.
    let stale = Txn::new().when([alice_compare]).and_then([Op::put(
        "fenced-demo/balance",
        "150",
        PutOptions::default(),
    )]);
    let applied = alice_client.txn(stale).await?.succeeded;
    println!("alice's fenced KV write applied: {applied}");
    let fresh = Txn::new().when([bob.fence_compare()]).and_then([Op::put(
        "fenced-demo/balance",
        "70",
        PutOptions::default(),
    )]);
    println!(
        "bob's fenced KV write applied: {}",
        bob_client.txn(fresh).await?.succeeded
    );

    let records = storage
        .state
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .1
        .clone();
    println!("storage holds: {records:?}");
    bob.resign().await?;
    Ok(())
}
