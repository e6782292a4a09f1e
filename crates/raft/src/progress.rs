//! The leader's view of each follower: how far its log matches and how replication proceeds.

use std::collections::VecDeque;

use bytes::Bytes;

use crate::types::{Index, SnapshotMeta};

/// How the leader is currently replicating to one follower.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicationMode {
    /// Where the follower's log matches is unknown: one `Append` at a time, then wait.
    Probe,
    /// The follower is in step: `Append`s are pipelined up to the in-flight window.
    Replicate,
    /// The follower needs a snapshot; chunks go one at a time.
    Snapshot {
        meta: SnapshotMeta,
        next_offset: u64,
        /// crc32c of the whole image, computed once when the transfer starts.
        image_crc32c: u32,
        /// The image being sent, held until the transfer ends: storage may record newer
        /// snapshots meanwhile, and restarting with each of them would never finish while the
        /// leader snapshots faster than it can send one. A clone of the storage's `Bytes`, so
        /// it costs memory only once storage has moved on (at most one image per follower).
        image: Bytes,
    },
}

/// Replication state of one follower, kept by the leader.
#[derive(Debug, Clone)]
pub struct Progress {
    /// The highest index known to match the leader's log.
    pub match_index: Index,
    /// The next index to send. Invariant: `match_index < next_index`.
    pub next_index: Index,
    pub mode: ReplicationMode,
    /// In probe mode: an `Append` is out and unanswered, so wait for a reply or a heartbeat.
    pub probe_sent: bool,
    /// Last index of each pipelined `Append` not yet acknowledged, oldest first.
    pub inflight: VecDeque<Index>,
    /// Heard from since the last CheckQuorum round.
    pub recent_active: bool,
    /// The follower installed a snapshot from this leader and has not yet caught up with the
    /// leader's applied index: it still needs the log from `match_index + 1`.
    pub catching_up: bool,
    /// With lease reads on: when (the leader's `now_ms`) the newest lease round this
    /// follower acknowledged was sent.
    pub lease_acked_ms: Option<u64>,
    /// The highest commit index sent to this follower (in an `Append` or a heartbeat).
    pub commit_sent: Index,
    /// A commit index this follower is to hear of as soon as it is reached, held back or not
    /// (a write through it waits for it there); 0 for none.
    pub commit_wanted: Index,
    /// Clients of this follower wait for what it applies (its latest response said so).
    pub awaited: bool,
}

impl Progress {
    pub fn new(next_index: Index) -> Self {
        Progress {
            match_index: 0,
            next_index,
            mode: ReplicationMode::Probe,
            probe_sent: false,
            inflight: VecDeque::new(),
            recent_active: false,
            catching_up: false,
            lease_acked_ms: None,
            commit_sent: 0,
            commit_wanted: 0,
            awaited: false,
        }
    }

    pub fn become_probe(&mut self) {
        if let ReplicationMode::Snapshot { meta, .. } = &self.mode {
            self.next_index = self.match_index.max(meta.index) + 1;
        } else {
            self.next_index = self.match_index + 1;
        }
        self.mode = ReplicationMode::Probe;
        self.probe_sent = false;
        self.inflight.clear();
    }

    pub fn become_replicate(&mut self) {
        self.mode = ReplicationMode::Replicate;
        self.next_index = self.match_index + 1;
        self.probe_sent = false;
        self.inflight.clear();
    }

    pub fn become_snapshot(&mut self, meta: SnapshotMeta, image: Bytes, image_crc32c: u32) {
        self.mode = ReplicationMode::Snapshot {
            meta,
            next_offset: 0,
            image_crc32c,
            image,
        };
        self.catching_up = false;
        self.probe_sent = false;
        self.inflight.clear();
    }

    /// The lowest index this follower still needs from the leader's log to catch up without
    /// another snapshot: the index of the snapshot it is receiving, or, after installing one,
    /// what it has matched so far. `None` for a follower replicating in step.
    pub fn catch_up_floor(&self) -> Option<Index> {
        match &self.mode {
            ReplicationMode::Snapshot { meta, .. } => Some(meta.index),
            _ if self.catching_up => Some(self.match_index),
            _ => None,
        }
    }

    /// Whether the leader should hold back further `Append`s to this follower.
    pub fn is_paused(&self, max_inflight: usize) -> bool {
        match self.mode {
            ReplicationMode::Probe => self.probe_sent,
            ReplicationMode::Replicate => self.inflight.len() >= max_inflight,
            ReplicationMode::Snapshot { .. } => true,
        }
    }

    /// Records an acknowledgement up to `index`; returns whether it taught anything new.
    pub fn maybe_update(&mut self, index: Index) -> bool {
        let updated = index > self.match_index;
        if updated {
            self.match_index = index;
            self.probe_sent = false;
        }
        self.next_index = self.next_index.max(index + 1);
        while self.inflight.front().is_some_and(|&last| last <= index) {
            self.inflight.pop_front();
        }
        updated
    }

    /// Records that an `Append` ending at `last_index` went out.
    pub fn sent_append(&mut self, last_index: Index, entry_count: usize) {
        match self.mode {
            ReplicationMode::Replicate => {
                if entry_count > 0 {
                    self.next_index = last_index + 1;
                    self.inflight.push_back(last_index);
                }
            }
            ReplicationMode::Probe => self.probe_sent = true,
            ReplicationMode::Snapshot { .. } => {
                unreachable!("append sent to a follower that is receiving a snapshot")
            }
        }
    }

    /// Handles a rejection of an `Append` whose `prev_index` was `rejected`. Returns false if
    /// the rejection is stale (refers to a message sent before the state it contradicts).
    pub fn maybe_decrease_to(&mut self, rejected: Index, next_probe: Index) -> bool {
        match self.mode {
            ReplicationMode::Replicate => {
                if rejected <= self.match_index {
                    return false;
                }
                self.become_probe();
                self.next_index = next_probe.min(rejected).max(self.match_index + 1);
                true
            }
            ReplicationMode::Probe => {
                if self.next_index == 0 || rejected != self.next_index - 1 {
                    return false;
                }
                if rejected <= self.match_index {
                    // The follower no longer has an entry it acknowledged: its disk dropped a
                    // damaged tail, or `conclave repair` cut its log. Believe it and send the
                    // entries again; otherwise every probe would stop at `match_index + 1` and
                    // the follower would stay behind until the next leader. Lowering a match
                    // never lowers the commit index, which only grows.
                    self.match_index = next_probe.min(rejected).saturating_sub(1);
                }
                self.next_index = next_probe.min(rejected).max(self.match_index + 1);
                self.probe_sent = false;
                true
            }
            ReplicationMode::Snapshot { .. } => false,
        }
    }
}
