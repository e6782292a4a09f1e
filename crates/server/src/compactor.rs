//! Automatic history compaction, as etcd's `--auto-compaction-mode` and
//! `--auto-compaction-retention`: without it the key-value history only grows until someone
//! runs `compact`.
//!
//! - `periodic`: keep about `retention` of history. The revision is sampled every tenth of
//!   the compaction interval (the retention, at most an hour); at each interval the history
//!   below the revision sampled `retention` ago is dropped.
//! - `revision`: keep the last `retention` revisions, checked every
//!   [`REVISION_CHECK_INTERVAL_MS`].
//!
//! [`CompactionPlan`] decides (pure, fed the time); [`run`] is the shell's task, which samples
//! on every member and proposes the compaction only where this member leads, so a new leader
//! already holds samples.

use std::collections::VecDeque;
use std::time::Duration;

use conclave_state::Request;

use crate::api::Api;

/// How often `revision` mode compares the revision with the retained count.
pub const REVISION_CHECK_INTERVAL_MS: u64 = 5_000;
/// The longest interval between two periodic compactions (etcd's: an hour), however long the
/// retention.
pub const PERIODIC_INTERVAL_MAX_MS: u64 = 3_600_000;
/// Revision samples per compaction interval in `periodic` mode.
pub const PERIODIC_SAMPLES_PER_INTERVAL: u64 = 10;
/// The longest periodic retention accepted: a year.
pub const PERIODIC_RETENTION_MS_MAX: u64 = 365 * 24 * 3_600_000;

/// What automatic compaction keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AutoCompaction {
    /// No automatic compaction (retention 0, the default).
    #[default]
    Off,
    /// About this much recent history, in milliseconds.
    Periodic { retention_ms: u64 },
    /// This many most recent revisions.
    Revision { retained: i64 },
}

impl AutoCompaction {
    /// How often [`CompactionPlan::tick`] wants to run.
    pub fn tick_ms(self) -> Option<u64> {
        match self {
            AutoCompaction::Off => None,
            AutoCompaction::Periodic { retention_ms } => Some(
                (retention_ms.min(PERIODIC_INTERVAL_MAX_MS) / PERIODIC_SAMPLES_PER_INTERVAL).max(1),
            ),
            AutoCompaction::Revision { .. } => Some(REVISION_CHECK_INTERVAL_MS),
        }
    }
}

/// The decisions of automatic compaction, from the samples it was fed.
#[derive(Debug)]
pub struct CompactionPlan {
    mode: AutoCompaction,
    /// `(time_ms, revision)`, oldest first; periodic mode only.
    samples: VecDeque<(u64, i64)>,
    /// When the last periodic compaction was due.
    last_run_ms: Option<u64>,
}

impl CompactionPlan {
    pub fn new(mode: AutoCompaction) -> CompactionPlan {
        CompactionPlan {
            mode,
            samples: VecDeque::new(),
            last_run_ms: None,
        }
    }

    /// Records the revision at `now_ms` and answers the revision to compact to, if a
    /// compaction is due and would drop anything beyond `compacted` (the current compact
    /// revision).
    pub fn tick(&mut self, now_ms: u64, revision: i64, compacted: i64) -> Option<i64> {
        let target = match self.mode {
            AutoCompaction::Off => return None,
            AutoCompaction::Revision { retained } => revision.saturating_sub(retained),
            AutoCompaction::Periodic { retention_ms } => {
                self.samples.push_back((now_ms, revision));
                // Keep the newest sample that is at least `retention` old, and all after it.
                while self.samples.len() > 1
                    && self.samples[1].0 <= now_ms.saturating_sub(retention_ms)
                {
                    self.samples.pop_front();
                }
                let interval_ms = retention_ms.min(PERIODIC_INTERVAL_MAX_MS);
                let started = *self.last_run_ms.get_or_insert(now_ms);
                if now_ms.saturating_sub(started) < interval_ms {
                    return None;
                }
                let (sampled_ms, sampled) = *self.samples.front()?;
                if now_ms.saturating_sub(sampled_ms) < retention_ms {
                    // No sample is old enough yet (the member started recently).
                    return None;
                }
                self.last_run_ms = Some(now_ms);
                sampled
            }
        };
        (target > compacted && target >= 1).then_some(target)
    }
}

/// The shell's task: ticks the plan and, on the leader, proposes the compactions it asks
/// for. Ends with the node.
pub async fn run(api: std::sync::Arc<Api>) {
    let mode = api.config.auto_compaction;
    let Some(tick_ms) = mode.tick_ms() else {
        return;
    };
    let mut plan = CompactionPlan::new(mode);
    let started = tokio::time::Instant::now();
    let mut ticker = tokio::time::interval(Duration::from_millis(tick_ms));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let status = api.node.status.borrow().clone();
        if status.stopped.is_some() {
            return;
        }
        let (revision, compacted) = api
            .node
            .read_state(|state| (state.revision(), state.compact_revision()));
        let now_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        let Some(target) = plan.tick(now_ms, revision, compacted) else {
            continue;
        };
        if status.leader != Some(api.config.id) {
            continue;
        }
        match api
            .node
            .propose(Request::Compact { revision: target })
            .await
        {
            Ok(_) => tracing::info!(revision = target, "auto-compaction: history compacted"),
            Err(error) => {
                tracing::warn!(revision = target, %error, "auto-compaction did not apply")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_never_compacts() {
        let mut plan = CompactionPlan::new(AutoCompaction::Off);
        assert_eq!(plan.tick(1_000_000, 500, 0), None);
        assert_eq!(AutoCompaction::Off.tick_ms(), None);
    }

    #[test]
    fn revision_mode_keeps_the_last_n() {
        let mut plan = CompactionPlan::new(AutoCompaction::Revision { retained: 10 });
        assert_eq!(plan.tick(0, 5, 0), None, "fewer revisions than retained");
        assert_eq!(plan.tick(5_000, 25, 0), Some(15));
        assert_eq!(plan.tick(10_000, 25, 15), None, "already compacted there");
        assert_eq!(plan.tick(15_000, 40, 15), Some(30));
    }

    #[test]
    fn periodic_mode_drops_what_is_older_than_the_retention() {
        let retention_ms = 1_000;
        let mode = AutoCompaction::Periodic { retention_ms };
        assert_eq!(mode.tick_ms(), Some(100));
        let mut plan = CompactionPlan::new(mode);
        // One revision every 100 ms: revision r at time 100 r.
        let mut compacted = 0;
        let mut done = Vec::new();
        for step in 0..=40u64 {
            let now_ms = step * 100;
            if let Some(target) = plan.tick(now_ms, step as i64 + 1, compacted) {
                // Never history younger than the retention.
                let target_time_ms = (target as u64 - 1) * 100;
                assert!(
                    now_ms - target_time_ms >= retention_ms,
                    "{now_ms}: {target}"
                );
                compacted = target;
                done.push((now_ms, target));
            }
        }
        // Once per retention interval, each time to the revision of a retention ago.
        assert_eq!(done, [(1_000, 1), (2_000, 11), (3_000, 21), (4_000, 31)]);
    }

    #[test]
    fn a_long_retention_compacts_hourly() {
        let day_ms = 24 * 3_600_000;
        let mode = AutoCompaction::Periodic {
            retention_ms: day_ms,
        };
        assert_eq!(mode.tick_ms(), Some(PERIODIC_INTERVAL_MAX_MS / 10));
        let mut plan = CompactionPlan::new(mode);
        let step_ms = PERIODIC_INTERVAL_MAX_MS / 10;
        let mut first = None;
        for step in 0..=(2 * day_ms / step_ms) {
            let now_ms = step * step_ms;
            if let Some(target) = plan.tick(now_ms, step as i64 + 1, 0) {
                first.get_or_insert((now_ms, target));
            }
        }
        // Nothing before a day's history exists; then the revision of a day ago.
        assert_eq!(first, Some((day_ms, 1)));
    }
}
