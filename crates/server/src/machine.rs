//! The seam between the Raft runtime and what it replicates.
//!
//! The driver ([`crate::node`]) owns everything about agreeing on a log: the Raft core, the
//! write-ahead log, the peer transport, ReadIndex, proposal waiters, membership and snapshot
//! compaction. What the log *means* is a [`ReplicatedMachine`]: the driver hands it every
//! committed entry's bytes in log order, asks it for a snapshot every `snapshot_entries`
//! entries, and gives a snapshot back to a node that restarts or falls behind. Conclave's
//! coordination state machine (`conclave_state::StateMachine`) is one implementation; an
//! embedding program supplies its own (see [`crate::embed`] and `examples/embedded_counter.rs`).

use std::io::{self, Write};

/// Why a machine refused an entry or a snapshot image. Any error type converts into it, so
/// `?` works inside [`ReplicatedMachine::apply`] and [`ReplicatedMachine::restore`].
pub type MachineError = Box<dyn std::error::Error + Send + Sync>;

/// A deterministic state machine the cluster replicates.
///
/// Every member applies the same entries in the same order, so every method that changes the
/// state must depend on its arguments and the current state only: no clock, no randomness, no
/// iteration over hash-ordered maps. Whatever only the leader knows (its clock, say) goes into
/// the entry in [`ReplicatedMachine::encode`], which runs on the leader when it proposes.
///
/// ```
/// use conclave_server::{MachineError, ReplicatedMachine};
///
/// /// A replicated counter: commands add to it, the output is the new value.
/// #[derive(Default)]
/// struct Counter { value: i64 }
///
/// impl ReplicatedMachine for Counter {
///     type Command = i64;
///     type Output = i64;
///
///     fn encode(delta: i64) -> Vec<u8> {
///         delta.to_be_bytes().to_vec()
///     }
///     fn apply(&mut self, _index: u64, entry: &[u8]) -> Result<i64, MachineError> {
///         let delta = i64::from_be_bytes(entry.try_into()?);
///         self.value = self.value.wrapping_add(delta);
///         Ok(self.value)
///     }
///     fn snapshot(&self) -> Vec<u8> {
///         self.value.to_be_bytes().to_vec()
///     }
///     fn restore(&mut self, image: &[u8]) -> Result<(), MachineError> {
///         self.value = i64::from_be_bytes(image.try_into()?);
///         Ok(())
///     }
/// }
/// ```
pub trait ReplicatedMachine: Send + Sync + 'static {
    /// What a caller proposes.
    type Command: Send + 'static;
    /// What applying one command answers to its proposer.
    type Output: Send + 'static;

    /// Turns a command into the bytes of its log entry. Runs on the leader at the moment it
    /// proposes; any bytes are allowed (the driver frames them so they cannot be mistaken for
    /// its own entries).
    fn encode(command: Self::Command) -> Vec<u8>;

    /// [`ReplicatedMachine::encode`] with the proposing leader's clock, `now_ms` milliseconds
    /// since the Unix epoch (virtual time in the simulator). The node core calls this one; a
    /// machine that stamps time overrides it rather than reading a clock of its own.
    fn encode_at(command: Self::Command, _now_ms: u64) -> Vec<u8> {
        Self::encode(command)
    }

    /// Applies the committed entry at `index`. Called exactly once per entry and index on
    /// every member, in log order (after a restart, from the last snapshot on). An `Err` means
    /// the bytes are not a command (every member decides that alike, so the entry is skipped
    /// everywhere); its proposer gets [`crate::Error::EntryRejected`]. Errors of the command
    /// itself (a failed compare-and-swap, say) belong in `Output`.
    fn apply(&mut self, index: u64, entry: &[u8]) -> Result<Self::Output, MachineError>;

    /// An image of the whole state, from which [`ReplicatedMachine::restore`] rebuilds it.
    /// The log below it is dropped once it is written.
    fn snapshot(&self) -> Vec<u8>;

    /// The state as it is now, to be encoded into exactly the image
    /// [`ReplicatedMachine::snapshot`] would give now, but later, on the snapshot writer's
    /// thread, while the driver goes on applying entries. Called on the driver thread every
    /// `snapshot_entries` applied entries. The default encodes at once (so the driver waits
    /// for it); a machine whose state clones cheaply (persistent maps) returns a clone.
    fn snapshot_frozen(&self) -> FrozenImage {
        FrozenImage::ready(self.snapshot())
    }

    /// Replaces the state with the one `image` describes: at start from the newest snapshot
    /// on disk, or when the leader sends one to a member that fell behind its log. A machine
    /// that was never snapshotted starts as the value given to the node.
    fn restore(&mut self, image: &[u8]) -> Result<(), MachineError>;
}

/// A machine's state frozen at one applied index, not yet encoded: see
/// [`ReplicatedMachine::snapshot_frozen`].
pub struct FrozenImage(Box<dyn ImageWriter>);

/// Writes a frozen image's bytes, once, on whichever thread the node picks.
trait ImageWriter: FnOnce(&mut dyn Write) -> io::Result<()> + Send {}

impl<F: FnOnce(&mut dyn Write) -> io::Result<()> + Send> ImageWriter for F {}

impl FrozenImage {
    /// An image already encoded.
    pub fn ready(image: Vec<u8>) -> FrozenImage {
        FrozenImage(Box::new(move |out| out.write_all(&image)))
    }

    /// An image `encode` produces when called, on whichever thread calls it; it must give the
    /// bytes [`ReplicatedMachine::snapshot`] gave when this was made.
    pub fn deferred(encode: impl FnOnce() -> Vec<u8> + Send + 'static) -> FrozenImage {
        FrozenImage(Box::new(move |out| out.write_all(&encode())))
    }

    /// Like [`FrozenImage::deferred`], for a machine that can stream its image: `write_to`
    /// writes exactly the bytes [`ReplicatedMachine::snapshot`] gave into the writer it is
    /// given. The node hands it the snapshot file itself, so a large image is never held in
    /// memory whole.
    pub fn deferred_to(
        write_to: impl FnOnce(&mut dyn Write) -> io::Result<()> + Send + 'static,
    ) -> FrozenImage {
        FrozenImage(Box::new(write_to))
    }

    /// The image's bytes, in memory.
    pub fn encode(self) -> Vec<u8> {
        let mut out = Vec::new();
        // Only the encoder can fail here, and a machine's encoder into memory does not.
        self.write_to(&mut out)
            .expect("a frozen image encodes into memory");
        out
    }

    /// Writes the image's bytes to `out`.
    pub fn write_to(self, out: &mut dyn Write) -> io::Result<()> {
        (self.0)(out)
    }
}

impl std::fmt::Debug for FrozenImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FrozenImage")
    }
}
