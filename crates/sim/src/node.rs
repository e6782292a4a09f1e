//! A simulated Conclave node: a Raft core over in-memory durable storage, plus a tiny state
//! machine (a hash chain over applied entries) that the checkers can compare across nodes.

use bytes::Bytes;
use conclave_raft::{
    Config, Entry, EntryKind, Index, MemStorage, Message, RawNode, ReadState, Ready, Role,
    SoftState, Storage, Term,
};

/// Where a crash may strike while a Ready is handled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrashPoint {
    /// Before anything of the Ready is persisted.
    BeforePersist,
    /// After persisting, before any message goes out.
    AfterPersist,
    /// After sending, before applying.
    AfterSend,
}

/// The simulated application state: how many entries were applied and a hash over them, so
/// that two nodes with the same (index, hash) applied the same sequence.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AppState {
    pub applied: Index,
    pub hash: u64,
}

/// Padding that makes snapshots long enough to travel in several chunks.
const SNAPSHOT_PADDING_BYTES: usize = 100;

impl AppState {
    pub fn apply(&mut self, entry: &Entry) {
        assert_eq!(
            entry.index,
            self.applied + 1,
            "state machine applied out of order"
        );
        self.applied = entry.index;
        self.hash = chain_hash(self.hash, entry);
    }

    pub fn encode(&self) -> Bytes {
        let mut out = Vec::with_capacity(16 + SNAPSHOT_PADDING_BYTES);
        out.extend_from_slice(&self.applied.to_be_bytes());
        out.extend_from_slice(&self.hash.to_be_bytes());
        out.extend((0..SNAPSHOT_PADDING_BYTES).map(|i| (i as u8).wrapping_mul(31)));
        Bytes::from(out)
    }

    pub fn decode(data: &[u8]) -> AppState {
        if data.len() < 16 {
            return AppState::default();
        }
        let applied = u64::from_be_bytes(data[0..8].try_into().expect("8 bytes"));
        let hash = u64::from_be_bytes(data[8..16].try_into().expect("8 bytes"));
        AppState { applied, hash }
    }
}

/// FNV-1a over the entry's index, term and data, chained onto `prev`.
pub fn chain_hash(prev: u64, entry: &Entry) -> u64 {
    let mut h = prev ^ 0xcbf2_9ce4_8422_2325;
    let mut feed = |bytes: &[u8]| {
        for &b in bytes {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    feed(&entry.index.to_be_bytes());
    feed(&entry.term.to_be_bytes());
    feed(&[matches!(entry.kind, EntryKind::ConfChange) as u8]);
    feed(&entry.data);
    h
}

/// What handling one Ready produced, for the simulator to route and check.
#[derive(Debug, Default)]
pub struct ReadyOutcome {
    pub messages: Vec<Message>,
    /// Entries applied, with the state hash after each.
    pub applied: Vec<(Entry, u64)>,
    /// A snapshot installed into the state machine.
    pub installed_snapshot: Option<AppState>,
    pub read_states: Vec<ReadState>,
    /// The role change the Ready reported, if any.
    pub soft_state: Option<SoftState>,
    /// Entries made durable (for the log-matching check).
    pub persisted: Vec<Entry>,
    pub crashed: bool,
}

/// One node of the simulated cluster.
pub struct SimNode {
    pub id: u64,
    /// `None` while the node is down.
    pub raw: Option<RawNode<MemStorage>>,
    /// What survives a crash: everything persisted so far.
    pub disk: MemStorage,
    pub state: AppState,
    pub config: Config,
    /// Take a snapshot once this many entries were applied since the last one (0 = never).
    pub snapshot_every: u64,
    restarts: u64,
}

impl SimNode {
    pub fn new(config: Config, disk: MemStorage, snapshot_every: u64) -> Self {
        let id = config.id;
        let mut node = SimNode {
            id,
            raw: None,
            disk,
            state: AppState::default(),
            config,
            snapshot_every,
            restarts: 0,
        };
        node.start();
        node
    }

    /// Boots the core from the durable disk; the state machine restarts from the snapshot.
    pub fn start(&mut self) {
        assert!(self.raw.is_none(), "node {} started twice", self.id);
        let snapshot = self.disk.snapshot().expect("mem storage snapshot");
        self.state = AppState::decode(&snapshot.data);
        self.state.applied = snapshot.meta.index;
        let mut config = self.config.clone();
        // A restarted node draws fresh timeouts, still determined by the run's seed.
        config.seed = self
            .config
            .seed
            .wrapping_add(self.restarts.wrapping_mul(0x9E37_79B9));
        self.restarts += 1;
        let raw = RawNode::new(config, self.disk.clone()).expect("valid sim config");
        self.raw = Some(raw);
    }

    pub fn crash(&mut self) {
        if let Some(raw) = self.raw.take() {
            // Only what a completed persist step wrote is on the disk.
            self.disk = raw.store().clone();
        }
    }

    pub fn is_up(&self) -> bool {
        self.raw.is_some()
    }

    pub fn role(&self) -> Option<Role> {
        self.raw.as_ref().map(|r| r.role())
    }

    pub fn term(&self) -> Option<Term> {
        self.raw.as_ref().map(|r| r.term())
    }

    /// Handles one Ready, crashing at `crash_at` if given.
    pub fn handle_ready(&mut self, crash_at: Option<CrashPoint>) -> ReadyOutcome {
        let mut out = ReadyOutcome::default();
        let Some(raw) = self.raw.as_mut() else {
            return out;
        };
        if !raw.has_ready() {
            return out;
        }
        let ready: Ready = raw.ready();
        out.soft_state = ready.soft_state;
        if crash_at == Some(CrashPoint::BeforePersist) {
            self.raw = None;
            out.crashed = true;
            return out;
        }
        let store = raw.store_mut();
        if let Some(snapshot) = &ready.snapshot {
            store.apply_snapshot(snapshot.clone());
        }
        store.append(&ready.entries);
        if let Some(hard_state) = ready.hard_state {
            store.set_hard_state(hard_state);
        }
        out.persisted = ready.entries.clone();
        self.disk = store.clone();
        if crash_at == Some(CrashPoint::AfterPersist) {
            self.raw = None;
            out.crashed = true;
            return out;
        }
        out.messages = ready.messages.clone();
        if crash_at == Some(CrashPoint::AfterSend) {
            self.raw = None;
            out.crashed = true;
            return out;
        }
        if let Some(snapshot) = &ready.snapshot {
            let mut state = AppState::decode(&snapshot.data);
            state.applied = snapshot.meta.index;
            self.state = state;
            out.installed_snapshot = Some(state);
        }
        for entry in &ready.committed_entries {
            self.state.apply(entry);
            out.applied.push((entry.clone(), self.state.hash));
        }
        out.read_states = ready.read_states.clone();
        raw.advance(ready);
        self.maybe_snapshot();
        out
    }

    fn maybe_snapshot(&mut self) {
        let Some(raw) = self.raw.as_mut() else { return };
        if self.snapshot_every == 0 {
            return;
        }
        let applied = raw.applied_index();
        let snap_index = raw.store().first_index().expect("mem storage") - 1;
        if applied >= snap_index + self.snapshot_every {
            assert_eq!(
                applied, self.state.applied,
                "core and state machine disagree on applied"
            );
            let conf_state = raw.conf_state().clone();
            let data = self.state.encode();
            raw.store_mut().create_snapshot(applied, conf_state, data);
            self.disk = raw.store().clone();
        }
    }
}
