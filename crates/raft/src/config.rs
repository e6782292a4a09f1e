//! How a core is tuned. Every limit the core enforces is here, with its unit in its name.

use crate::types::NodeId;

/// Default of [`Config::max_snapshot_bytes`]: 4 GiB, twice etcd's default 2 GiB backend quota.
pub const DEFAULT_MAX_SNAPSHOT_BYTES: u64 = 4 * 1024 * 1024 * 1024;

/// Configuration of one Raft core.
#[derive(Debug, Clone)]
pub struct Config {
    /// This node's id; never 0.
    pub id: NodeId,
    /// T: a follower that hears nothing for a random number of ticks in `[T, 2T)` campaigns.
    pub election_ticks: u64,
    /// A leader sends heartbeats every this many ticks. Must be below `election_ticks`.
    pub heartbeat_ticks: u64,
    /// Run a PreVote round before raising the term, so a rejoining node cannot disrupt.
    pub pre_vote: bool,
    /// A leader that has not heard from a quorum for `election_ticks` steps down, and followers
    /// that heard from a leader within `election_ticks` ignore vote requests, as do nodes that
    /// started less than `election_ticks` ago past the bootstrap term (before a restart they
    /// may have acknowledged a leader whose lease still runs).
    pub check_quorum: bool,
    /// Upper bound on the payload bytes of entries in one `Append` message (at least one
    /// entry is always sent, so one big entry still moves).
    pub max_append_bytes: u64,
    /// Upper bound on `Append` messages in flight to one follower in replicate mode.
    pub max_inflight_appends: usize,
    /// Upper bound on the payload bytes of proposed but uncommitted entries on a leader.
    pub max_uncommitted_bytes: u64,
    /// Snapshots go out in chunks of at most this many bytes.
    pub snapshot_chunk_bytes: u64,
    /// A follower assembles an incoming snapshot in memory; a transfer that would grow past
    /// this many bytes is refused and discarded. Bounds what a peer can make a node allocate.
    pub max_snapshot_bytes: u64,
    /// The leader lease for reads, in the milliseconds of the clock the application feeds
    /// [`crate::RawNode::set_now_ms`]; 0 (the default) turns lease reads off. When set, a
    /// leader answers a read at once, with no heartbeat round, while a quorum has
    /// acknowledged a heartbeat it sent less than this long ago, and every node withholds its
    /// vote from a candidate for `election_ticks` after it last heard from a leader or after
    /// it started (`check_quorum`, whether or not the node reads from leases itself). Safe
    /// only when this is shorter than the least real time `election_ticks - 1` ticks can take
    /// on any member, less what the members' clocks may drift apart meanwhile. Needs
    /// `check_quorum`.
    pub lease_read_ms: u64,
    /// A commit index that advances while a follower already holds every entry is not sent
    /// to it at once: the next `Append` or heartbeat carries it, or the leader's next tick.
    /// Saves each caught-up follower a message, a wake-up and an acknowledgement per commit;
    /// its serializable reads lag by at most a tick. An awaited follower
    /// ([`crate::RawNode::set_awaited`]) hears of each commit at once. Off by default; the
    /// server turns it on (docs/performance.md, "A quorum first").
    pub defer_commit_notice: bool,
    /// A leader sends a new entry at once only to the followers it needs for a quorum
    /// (awaited ones first, then those with the highest match index; an awaited follower,
    /// [`crate::RawNode::set_awaited`], is never a spare). The others, the spares, get
    /// committed entries in batches: once one lacks [`crate::SPARE_LAG_ENTRIES_MAX`] of them,
    /// at the leader's next tick, before a read it asked for is answered, and everything at
    /// once when an entry has waited a whole tick without committing (the followers counted
    /// on are not answering).
    /// At one request in flight, two disk syncs then run at once instead of three, and the
    /// commit waits for the second of two. Off by default; the server turns it on.
    pub replicate_to_quorum_first: bool,
    /// Seed of the PRNG behind election timeouts. Give each node its own.
    pub seed: u64,
    /// Deliberately broken behaviour for negative-control tests of the simulator's checkers.
    #[cfg(feature = "negative-controls")]
    pub bugs: crate::Bugs,
}

impl Config {
    /// A configuration with Conclave's defaults for node `id`.
    pub fn new(id: NodeId) -> Self {
        Config {
            id,
            election_ticks: 10,
            heartbeat_ticks: 2,
            pre_vote: true,
            check_quorum: true,
            max_append_bytes: 1024 * 1024,
            max_inflight_appends: 256,
            max_uncommitted_bytes: 64 * 1024 * 1024,
            snapshot_chunk_bytes: 1024 * 1024,
            max_snapshot_bytes: DEFAULT_MAX_SNAPSHOT_BYTES,
            lease_read_ms: 0,
            defer_commit_notice: false,
            replicate_to_quorum_first: false,
            seed: id,
            #[cfg(feature = "negative-controls")]
            bugs: crate::Bugs::default(),
        }
    }

    /// Checks the configuration, returning one sentence on what is wrong.
    pub fn validate(&self) -> Result<(), String> {
        if self.id == 0 {
            return Err("node id 0 is reserved".into());
        }
        if self.heartbeat_ticks == 0 {
            return Err("heartbeat_ticks must be at least 1".into());
        }
        if self.election_ticks <= self.heartbeat_ticks {
            return Err("election_ticks must exceed heartbeat_ticks".into());
        }
        if self.max_inflight_appends == 0 {
            return Err("max_inflight_appends must be at least 1".into());
        }
        if self.max_append_bytes == 0 || self.snapshot_chunk_bytes == 0 {
            return Err("max_append_bytes and snapshot_chunk_bytes must be at least 1".into());
        }
        if self.max_snapshot_bytes == 0 {
            return Err("max_snapshot_bytes must be at least 1".into());
        }
        if self.max_uncommitted_bytes == 0 {
            return Err("max_uncommitted_bytes must be at least 1".into());
        }
        if self.lease_read_ms > 0 && !self.check_quorum {
            return Err("lease reads (lease_read_ms) need check_quorum".into());
        }
        Ok(())
    }
}
