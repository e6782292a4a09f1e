//! A simulated Conclave node: a Raft core over in-memory durable storage, plus a tiny state
//! machine (a hash chain over applied entries) that the checkers can compare across nodes.

use std::sync::Arc;

use bytes::Bytes;
use conclave_raft::{
    ConfState, Config, Entry, EntryKind, HardState, Index, MemStorage, Message, MessageBody,
    RawNode, ReadState, Ready, Role, Snapshot, SoftState, Storage, StorageError, Term,
};
use conclave_storage::{SimDisk, SimDiskOptions, StorageOptions, WalStorage};

/// Which storage the simulated nodes persist to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StorageKind {
    /// `MemStorage`: every persist is atomic and durable at once.
    Mem,
    /// Conclave's write-ahead log over a simulated disk that loses unsynced bytes on a crash
    /// and may tear the last write.
    Wal,
}

/// The directory of a node's data on its simulated disk.
const WAL_DIR: &str = "/data";

/// A node's storage, whichever kind the run uses.
pub enum NodeStorage {
    Mem(MemStorage),
    Wal(Box<WalStorage>),
}

/// What outlives a crash.
#[derive(Clone)]
pub enum NodeDisk {
    Mem(MemStorage),
    Wal(SimDisk),
}

impl NodeStorage {
    fn write(&mut self, ready: &Ready) -> Result<(), String> {
        match self {
            NodeStorage::Mem(mem) => {
                if let Some(snapshot) = &ready.snapshot {
                    mem.apply_snapshot(snapshot.clone());
                }
                mem.append(&ready.entries);
                if let Some(hard_state) = ready.hard_state {
                    mem.set_hard_state(hard_state);
                }
                Ok(())
            }
            NodeStorage::Wal(wal) => {
                if let Some(snapshot) = &ready.snapshot {
                    wal.apply_snapshot(snapshot.clone())
                        .map_err(|e| e.to_string())?;
                }
                wal.append(&ready.entries).map_err(|e| e.to_string())?;
                if let Some(hard_state) = ready.hard_state {
                    wal.set_hard_state(hard_state).map_err(|e| e.to_string())?;
                }
                Ok(())
            }
        }
    }

    fn sync(&mut self) -> Result<(), String> {
        match self {
            NodeStorage::Mem(_) => Ok(()),
            NodeStorage::Wal(wal) => wal.sync().map(|_| ()).map_err(|e| e.to_string()),
        }
    }

    fn create_snapshot(
        &mut self,
        index: Index,
        conf_state: ConfState,
        data: Bytes,
    ) -> Result<(), String> {
        match self {
            NodeStorage::Mem(mem) => {
                mem.create_snapshot(index, conf_state, data);
                Ok(())
            }
            NodeStorage::Wal(wal) => wal
                .create_snapshot(index, conf_state, data)
                .map_err(|e| e.to_string()),
        }
    }
}

impl Storage for NodeStorage {
    fn initial_state(&self) -> Result<(HardState, ConfState), StorageError> {
        match self {
            NodeStorage::Mem(s) => s.initial_state(),
            NodeStorage::Wal(s) => s.initial_state(),
        }
    }
    fn entries(&self, low: Index, high: Index, max_bytes: u64) -> Result<Vec<Entry>, StorageError> {
        match self {
            NodeStorage::Mem(s) => s.entries(low, high, max_bytes),
            NodeStorage::Wal(s) => s.entries(low, high, max_bytes),
        }
    }
    fn term(&self, index: Index) -> Result<Term, StorageError> {
        match self {
            NodeStorage::Mem(s) => s.term(index),
            NodeStorage::Wal(s) => s.term(index),
        }
    }
    fn first_index(&self) -> Result<Index, StorageError> {
        match self {
            NodeStorage::Mem(s) => s.first_index(),
            NodeStorage::Wal(s) => s.first_index(),
        }
    }
    fn last_index(&self) -> Result<Index, StorageError> {
        match self {
            NodeStorage::Mem(s) => s.last_index(),
            NodeStorage::Wal(s) => s.last_index(),
        }
    }
    fn snapshot(&self) -> Result<Snapshot, StorageError> {
        match self {
            NodeStorage::Mem(s) => s.snapshot(),
            NodeStorage::Wal(s) => s.snapshot(),
        }
    }
}

impl NodeDisk {
    /// A fresh disk; founding members get the bootstrap membership.
    pub fn new(
        kind: StorageKind,
        seed: u64,
        founding: Option<ConfState>,
    ) -> Result<NodeDisk, String> {
        match kind {
            StorageKind::Mem => Ok(NodeDisk::Mem(match founding {
                Some(conf) => MemStorage::new_with_conf_state(conf),
                None => MemStorage::default(),
            })),
            StorageKind::Wal => {
                let disk = SimDisk::new(seed, SimDiskOptions::default());
                let mut wal = WalStorage::open(
                    Arc::new(disk.clone()),
                    WAL_DIR,
                    StorageOptions::for_simulation(),
                )
                .map_err(|e| e.to_string())?;
                if let Some(conf) = founding {
                    wal.bootstrap(conf).map_err(|e| e.to_string())?;
                }
                wal.sync().map_err(|e| e.to_string())?;
                Ok(NodeDisk::Wal(disk))
            }
        }
    }

    pub(crate) fn open(&self) -> Result<NodeStorage, String> {
        match self {
            NodeDisk::Mem(mem) => Ok(NodeStorage::Mem(mem.clone())),
            NodeDisk::Wal(disk) => WalStorage::open(
                Arc::new(disk.clone()),
                WAL_DIR,
                StorageOptions::for_simulation(),
            )
            .map(|wal| NodeStorage::Wal(Box::new(wal)))
            .map_err(|e| format!("write-ahead log failed to recover: {e}")),
        }
    }
}

/// Where a crash may strike while a Ready is handled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrashPoint {
    /// Before anything of the Ready is persisted.
    BeforePersist,
    /// After persisting, before any message goes out.
    AfterPersist,
    /// After sending, before applying.
    AfterSend,
    /// After writing, before the fsync: the disk keeps an arbitrary, possibly torn, part.
    BeforeSync,
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
    /// The storage failed; the node stopped.
    pub storage_error: Option<String>,
}

/// One node of the simulated cluster.
pub struct SimNode {
    pub id: u64,
    /// `None` while the node is down.
    pub raw: Option<RawNode<NodeStorage>>,
    /// What survives a crash: everything persisted so far.
    pub disk: NodeDisk,
    pub state: AppState,
    pub config: Config,
    /// Take a snapshot once this many entries were applied since the last one (0 = never).
    pub snapshot_every: u64,
    restarts: u64,
}

impl SimNode {
    pub fn new(config: Config, disk: NodeDisk, snapshot_every: u64) -> Result<Self, String> {
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
        node.start()?;
        Ok(node)
    }

    /// Boots the core from the durable disk; the state machine restarts from the snapshot.
    /// Fails (a durability violation) when the disk cannot be recovered.
    pub fn start(&mut self) -> Result<(), String> {
        assert!(self.raw.is_none(), "node {} started twice", self.id);
        let store = self.disk.open()?;
        let snapshot = store.snapshot().map_err(|e| e.to_string())?;
        self.state = AppState::decode(&snapshot.data);
        self.state.applied = snapshot.meta.index;
        let mut config = self.config.clone();
        // A restarted node draws fresh timeouts, still determined by the run's seed.
        config.seed = self
            .config
            .seed
            .wrapping_add(self.restarts.wrapping_mul(0x9E37_79B9));
        self.restarts += 1;
        let raw = RawNode::new(config, store)?;
        self.raw = Some(raw);
        Ok(())
    }

    pub fn crash(&mut self) {
        let Some(raw) = self.raw.take() else { return };
        match (&mut self.disk, raw.store()) {
            // Only what a completed persist step wrote is on the disk.
            (NodeDisk::Mem(disk), NodeStorage::Mem(mem)) => *disk = mem.clone(),
            (NodeDisk::Wal(disk), NodeStorage::Wal(_)) => {
                drop(raw);
                // Unsynced bytes are lost; the last write may be torn.
                disk.crash();
            }
            _ => unreachable!("a node's storage and disk are of one kind"),
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
        // The Ready contract lets a leader send its appends while its own write is in flight;
        // do so, so that a crash before the write completes puts that relaxation to the test.
        let leader_appends: Vec<Message> = if raw.role() == Role::Leader {
            let appends = ready
                .messages
                .iter()
                .filter(|m| matches!(m.body, MessageBody::Append { .. }));
            appends.cloned().collect()
        } else {
            Vec::new()
        };
        out.messages.clone_from(&leader_appends);
        if crash_at == Some(CrashPoint::BeforePersist) {
            self.crash();
            out.crashed = true;
            return out;
        }
        let store = raw.store_mut();
        if let Err(e) = store.write(&ready) {
            out.storage_error = Some(e);
            self.crash();
            out.crashed = true;
            return out;
        }
        if crash_at == Some(CrashPoint::BeforeSync) {
            self.crash();
            out.crashed = true;
            return out;
        }
        if ready.must_sync
            && let Err(e) = raw.store_mut().sync()
        {
            out.storage_error = Some(e);
            self.crash();
            out.crashed = true;
            return out;
        }
        out.persisted = ready.entries.clone();
        let Some(raw) = self.raw.as_mut() else {
            return out;
        };
        if let (NodeDisk::Mem(disk), NodeStorage::Mem(mem)) = (&mut self.disk, raw.store()) {
            *disk = mem.clone();
        }
        if crash_at == Some(CrashPoint::AfterPersist) {
            self.crash();
            out.crashed = true;
            return out;
        }
        let already_sent = leader_appends.len();
        out.messages.extend(
            ready
                .messages
                .iter()
                .filter(|m| !leader_appends.contains(m))
                .cloned(),
        );
        debug_assert_eq!(out.messages.len(), ready.messages.len().max(already_sent));
        if crash_at == Some(CrashPoint::AfterSend) {
            self.crash();
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
        if let Err(e) = self.maybe_snapshot() {
            out.storage_error = Some(e);
            self.crash();
            out.crashed = true;
        }
        out
    }

    fn maybe_snapshot(&mut self) -> Result<(), String> {
        let Some(raw) = self.raw.as_mut() else {
            return Ok(());
        };
        if self.snapshot_every == 0 {
            return Ok(());
        }
        let applied = raw.applied_index();
        let snap_index = raw.store().first_index().map_err(|e| e.to_string())? - 1;
        if applied >= snap_index + self.snapshot_every {
            assert_eq!(
                applied, self.state.applied,
                "core and state machine disagree on applied"
            );
            let conf_state = raw.conf_state().clone();
            let data = self.state.encode();
            raw.store_mut().create_snapshot(applied, conf_state, data)?;
            if let (NodeDisk::Mem(disk), NodeStorage::Mem(mem)) = (&mut self.disk, raw.store()) {
                *disk = mem.clone();
            }
        }
        Ok(())
    }
}
