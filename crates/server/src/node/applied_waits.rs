//! Waiting for this member's applied index to reach a point, one wake-up per waiter.
//!
//! A write a follower hands to the leader, and a forwarded call, answer their client only once
//! this member has applied as far as the leader had, so the client reads its write here at
//! once. Waiting on the status watch for that woke every such task on every turn (and every
//! other task watching the status with them) until its own index came; at 64 clients spread
//! over three members that was dozens of wake-ups per turn, each a thread hand-off. Here the
//! driver hands each waiter its one wake-up when the index is reached, or when the node stops.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::oneshot;

/// Waiters above this many are checked for abandoned entries (their caller gave up) before
/// another is added, so a wait far ahead of the applied index that nobody holds any more
/// cannot pile up.
pub const APPLIED_WAITS_PRUNE_ABOVE: usize = 4096;

#[derive(Default)]
struct Inner {
    applied_index: u64,
    stopped: bool,
    waiting: BTreeMap<u64, Vec<oneshot::Sender<()>>>,
    count: usize,
}

/// The applied index as the driver last published it, and the tasks waiting for it to grow.
#[derive(Default)]
pub struct AppliedWaits {
    inner: Mutex<Inner>,
}

impl AppliedWaits {
    fn inner(&self) -> MutexGuard<'_, Inner> {
        // The lock only guards plain bookkeeping; a panic elsewhere leaves it consistent.
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Resolves once the applied index is at least `index`, or once the node stopped (the
    /// caller then finds out from the status). Cancel-safe: dropping it abandons the wait.
    pub async fn reached(&self, index: u64) {
        let woken = {
            let mut inner = self.inner();
            if inner.stopped || inner.applied_index >= index {
                return;
            }
            if inner.count >= APPLIED_WAITS_PRUNE_ABOVE {
                inner.waiting.retain(|_, senders| {
                    senders.retain(|sender| !sender.is_closed());
                    !senders.is_empty()
                });
                inner.count = inner.waiting.values().map(Vec::len).sum();
            }
            let (sender, woken) = oneshot::channel();
            inner.waiting.entry(index).or_default().push(sender);
            inner.count += 1;
            woken
        };
        // An error means the sender was dropped unsent, which only `stop` does.
        let _ = woken.await;
    }

    /// The driver applied through `applied_index`: wakes every wait it satisfies.
    pub(crate) fn advance(&self, applied_index: u64) {
        let reached = {
            let mut inner = self.inner();
            if applied_index <= inner.applied_index {
                return;
            }
            inner.applied_index = applied_index;
            let later = inner.waiting.split_off(&(applied_index + 1));
            let reached = std::mem::replace(&mut inner.waiting, later);
            inner.count -= reached.values().map(Vec::len).sum::<usize>();
            reached
        };
        for sender in reached.into_values().flatten() {
            let _ = sender.send(());
        }
    }

    /// The node stopped: every wait ends now, and every later one at once.
    pub(crate) fn stop(&self) {
        let waiting = {
            let mut inner = self.inner();
            inner.stopped = true;
            inner.count = 0;
            std::mem::take(&mut inner.waiting)
        };
        drop(waiting);
    }

    #[cfg(test)]
    fn waiting_count(&self) -> usize {
        self.inner().count
    }
}

/// Held by the driver: ends every wait when the driver goes away, however it ends (a clean
/// stop, a fatal error, a panic while applying).
pub(crate) struct StopWaitsOnDrop(pub Arc<AppliedWaits>);

impl Drop for StopWaitsOnDrop {
    fn drop(&mut self) {
        self.0.stop();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    async fn resolves(waits: &Arc<AppliedWaits>, index: u64) -> bool {
        resolves_within(waits, index, Duration::from_millis(50)).await
    }

    /// `Duration::ZERO` polls the wait once (registering it) and then gives up on it.
    async fn resolves_within(waits: &Arc<AppliedWaits>, index: u64, within: Duration) -> bool {
        tokio::time::timeout(within, waits.reached(index))
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn a_wait_ends_exactly_when_its_index_is_applied() {
        let waits = Arc::new(AppliedWaits::default());
        waits.advance(5);
        assert!(
            resolves(&waits, 5).await,
            "an index already applied waits for nothing"
        );

        let later = tokio::spawn({
            let waits = waits.clone();
            async move { waits.reached(8).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        waits.advance(7);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            !later.is_finished(),
            "index 7 applied must not end a wait for 8"
        );
        assert_eq!(waits.waiting_count(), 1);
        waits.advance(9);
        tokio::time::timeout(Duration::from_secs(5), later)
            .await
            .expect("index 9 applied ends the wait for 8")
            .expect("the waiting task");
        assert_eq!(waits.waiting_count(), 0);
        // The applied index never goes back.
        waits.advance(3);
        assert!(resolves(&waits, 9).await);
        assert!(!resolves(&waits, 10).await);
    }

    #[tokio::test]
    async fn stopping_ends_every_wait_and_later_ones() {
        let waits = Arc::new(AppliedWaits::default());
        let waiting = tokio::spawn({
            let waits = waits.clone();
            async move { waits.reached(100).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(StopWaitsOnDrop(waits.clone()));
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("stopping ends the wait")
            .expect("the waiting task");
        assert!(resolves(&waits, 1_000).await, "after a stop nothing waits");
    }

    #[tokio::test]
    async fn abandoned_waits_are_pruned_at_the_bound() {
        let waits = Arc::new(AppliedWaits::default());
        for index in 0..APPLIED_WAITS_PRUNE_ABOVE as u64 {
            // Each wait registers, then its caller gives up.
            assert!(!resolves_within(&waits, 1_000_000 + index, Duration::ZERO).await);
        }
        assert_eq!(waits.waiting_count(), APPLIED_WAITS_PRUNE_ABOVE);
        assert!(!resolves_within(&waits, 5_000_000, Duration::ZERO).await);
        assert_eq!(
            waits.waiting_count(),
            1,
            "the abandoned waits went before the next one was added"
        );
    }
}
