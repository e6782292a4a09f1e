//! Snapshot and restore of the whole state, in a versioned, checksummed, streamable format.
//!
//! ```text
//!   "CNCLSTAT"  u32 LE format version
//!   frame*      u32 LE payload length (1..=FRAME_BYTES_MAX), u32 LE crc32c(payload), payload
//!   end frame   u32 LE 0, u32 LE crc32c of all payloads together
//! ```
//!
//! The payloads, concatenated, are the postcard encoding of the state (KV with its retained
//! history, leases, groups, topics, sessions, last applied index and clock, and from format 4
//! the auth state at its end), then, from version 4 on, the work queues as a section of their
//! own, then, from version 5 on, the senders of retained topic messages (topic, seq, sender
//! for each message that names one) and the names of the election groups whose preempt policy
//! is `never`. Frames let a
//! receiver check each chunk as it arrives; the end frame catches lost or reordered frames.

use std::io::{Read, Write};

use crate::config::Config;
use crate::error::{Error, Result};
use crate::machine::{State, StateMachine, StateV1, StateV2, StateV3};
use crate::queue::WorkQueues;
use crate::topic::MessageSender;

/// Magic bytes at the start of every snapshot.
pub const SNAPSHOT_MAGIC: &[u8; 8] = b"CNCLSTAT";
/// The format version this build writes and reads. The body is the postcard encoding of the
/// state types, so any change to them (a field added, a variant moved) must bump this.
pub const SNAPSHOT_FORMAT_VERSION: u32 = 5;
/// The oldest format version this build reads: version 1 lacks session secrets, version 2
/// the revision of each session's cached answer, version 3 the auth state (users, roles) and the
/// work queues (both restored empty), version 4 the senders of topic messages (restored
/// empty) and the `never` preempt policy (no group has it).
pub const SNAPSHOT_FORMAT_VERSION_MIN: u32 = 1;
/// Payload bytes per frame when writing.
const FRAME_BYTES: usize = 64 * 1024;
/// Largest frame a reader accepts.
pub const FRAME_BYTES_MAX: usize = 1024 * 1024;

fn io_error(error: std::io::Error) -> Error {
    Error::SnapshotIo(error.to_string())
}

/// Cuts a byte stream into checksummed frames.
struct FrameWriter<W: Write> {
    inner: W,
    buffer: Vec<u8>,
    body_crc: u32,
}

impl<W: Write> FrameWriter<W> {
    fn emit_frame(&mut self) -> std::io::Result<()> {
        if self.buffer.is_empty() {
            return Ok(());
        }
        assert!(self.buffer.len() <= FRAME_BYTES_MAX);
        let length = u32::try_from(self.buffer.len()).map_err(std::io::Error::other)?;
        self.inner.write_all(&length.to_le_bytes())?;
        self.inner
            .write_all(&crc32c::crc32c(&self.buffer).to_le_bytes())?;
        self.inner.write_all(&self.buffer)?;
        self.body_crc = crc32c::crc32c_append(self.body_crc, &self.buffer);
        self.buffer.clear();
        Ok(())
    }

    fn finish(mut self) -> std::io::Result<W> {
        self.emit_frame()?;
        self.inner.write_all(&0u32.to_le_bytes())?;
        self.inner.write_all(&self.body_crc.to_le_bytes())?;
        self.inner.flush()?;
        Ok(self.inner)
    }
}

impl<W: Write> Write for FrameWriter<W> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        let room = FRAME_BYTES - self.buffer.len();
        let taken = bytes.len().min(room);
        self.buffer.extend_from_slice(&bytes[..taken]);
        if self.buffer.len() == FRAME_BYTES {
            self.emit_frame()?;
        }
        Ok(taken)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl StateMachine {
    /// The groups whose preempt policy is `never`, by name: the snapshot section that carries
    /// what [`crate::GroupPolicy`]'s own encoding leaves out.
    fn never_preempt_groups(&self) -> Vec<&str> {
        self.state
            .groups
            .iter()
            .filter(|(_, group)| group.policy.preempt_never)
            .map(|(name, _)| name.as_str())
            .collect()
    }

    /// Writes a snapshot of the whole state to `writer`. Returns the writer.
    pub fn snapshot<W: Write>(&self, writer: W) -> Result<W> {
        self.check_invariants();
        let mut frames = FrameWriter {
            inner: writer,
            buffer: Vec::with_capacity(FRAME_BYTES),
            body_crc: 0,
        };
        frames.inner.write_all(SNAPSHOT_MAGIC).map_err(io_error)?;
        frames
            .inner
            .write_all(&SNAPSHOT_FORMAT_VERSION.to_le_bytes())
            .map_err(io_error)?;
        let frames = postcard::to_io(&self.state, frames)
            .map_err(|error| Error::SnapshotIo(error.to_string()))?;
        let frames = postcard::to_io(&self.queues, frames)
            .map_err(|error| Error::SnapshotIo(error.to_string()))?;
        let frames = postcard::to_io(&self.state.topics.senders(), frames)
            .map_err(|error| Error::SnapshotIo(error.to_string()))?;
        let frames = postcard::to_io(&self.never_preempt_groups(), frames)
            .map_err(|error| Error::SnapshotIo(error.to_string()))?;
        frames.finish().map_err(io_error)
    }

    /// A snapshot in memory.
    pub fn snapshot_to_vec(&self) -> Vec<u8> {
        // Writing to a Vec cannot fail.
        self.snapshot(Vec::new())
            .expect("snapshot into memory is infallible")
    }

    /// Rebuilds a state machine from a snapshot. Checks framing, every checksum, the version
    /// and the state's invariants; never panics on bad input.
    pub fn restore<R: Read>(config: Config, mut reader: R) -> Result<StateMachine> {
        config.validate()?;
        let mut header = [0u8; 12];
        reader.read_exact(&mut header).map_err(io_error)?;
        if &header[..8] != SNAPSHOT_MAGIC {
            return Err(Error::SnapshotCorrupt("bad magic".into()));
        }
        let version = u32::from_le_bytes([header[8], header[9], header[10], header[11]]);
        if !(SNAPSHOT_FORMAT_VERSION_MIN..=SNAPSHOT_FORMAT_VERSION).contains(&version) {
            return Err(Error::SnapshotVersion {
                found: version,
                supported: SNAPSHOT_FORMAT_VERSION,
            });
        }
        let mut body = Vec::new();
        let mut body_crc = 0u32;
        loop {
            let mut frame_header = [0u8; 8];
            reader.read_exact(&mut frame_header).map_err(io_error)?;
            let length = u32::from_le_bytes([
                frame_header[0],
                frame_header[1],
                frame_header[2],
                frame_header[3],
            ]);
            let crc = u32::from_le_bytes([
                frame_header[4],
                frame_header[5],
                frame_header[6],
                frame_header[7],
            ]);
            let length = usize::try_from(length)
                .map_err(|_| Error::SnapshotCorrupt("frame length".into()))?;
            if length == 0 {
                if crc != body_crc {
                    return Err(Error::SnapshotCorrupt(
                        "whole-body checksum mismatch".into(),
                    ));
                }
                break;
            }
            if length > FRAME_BYTES_MAX {
                return Err(Error::SnapshotCorrupt(format!("frame of {length} bytes")));
            }
            let start = body.len();
            body.resize(start + length, 0);
            reader.read_exact(&mut body[start..]).map_err(io_error)?;
            if crc32c::crc32c(&body[start..]) != crc {
                return Err(Error::SnapshotCorrupt(format!(
                    "frame at body offset {start}: checksum mismatch"
                )));
            }
            body_crc = crc32c::crc32c_append(body_crc, &body[start..]);
        }
        let does_not_decode = |error: postcard::Error| {
            Error::SnapshotCorrupt(format!("state does not decode: {error}"))
        };
        let (state, rest) = if version == 1 {
            let (old, rest) =
                postcard::take_from_bytes::<StateV1>(&body).map_err(does_not_decode)?;
            (State::from(old), rest)
        } else if version == 2 {
            let (old, rest) =
                postcard::take_from_bytes::<StateV2>(&body).map_err(does_not_decode)?;
            (State::from(old), rest)
        } else if version == 3 {
            let (old, rest) =
                postcard::take_from_bytes::<StateV3>(&body).map_err(does_not_decode)?;
            (State::from(old), rest)
        } else {
            postcard::take_from_bytes::<State>(&body).map_err(does_not_decode)?
        };
        let (queues, rest) = if version >= 4 {
            postcard::take_from_bytes::<WorkQueues>(rest).map_err(does_not_decode)?
        } else {
            (WorkQueues::default(), rest)
        };
        let (senders, rest) = if version >= 5 {
            postcard::take_from_bytes::<Vec<MessageSender>>(rest).map_err(does_not_decode)?
        } else {
            (Vec::new(), rest)
        };
        let (never_groups, rest) = if version >= 5 {
            postcard::take_from_bytes::<Vec<String>>(rest).map_err(does_not_decode)?
        } else {
            (Vec::new(), rest)
        };
        let mut state = state;
        state.topics.restore_senders(senders)?;
        for name in never_groups {
            let group = state.groups.get_mut(&name).ok_or_else(|| {
                Error::SnapshotCorrupt(format!("preempt policy for unknown group {name:?}"))
            })?;
            if group.policy.preempt_never || group.policy.preempt {
                return Err(Error::SnapshotCorrupt(format!(
                    "group {name:?} has two preempt policies"
                )));
            }
            group.policy.preempt_never = true;
        }
        if !rest.is_empty() {
            return Err(Error::SnapshotCorrupt("trailing bytes after state".into()));
        }
        let machine = StateMachine {
            config,
            state,
            queues,
        };
        machine.verify().map_err(Error::SnapshotCorrupt)?;
        Ok(machine)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::{Command, Request};
    use crate::txn::PutRequest;

    /// The groups became a persistent map (a freeze no longer copies them); images must not
    /// change: the map encodes exactly as the `BTreeMap` it replaced.
    #[test]
    fn the_group_map_encodes_exactly_as_a_btreemap() {
        let mut machine = StateMachine::new(crate::Config::default());
        let mut index = 0;
        let mut apply = |machine: &mut StateMachine, request: Request| {
            index += 1;
            let output = machine.apply(index, &Command::new(index, request));
            assert!(output.result.is_ok(), "{:?}", output.result);
        };
        for group in 0..200i64 {
            apply(
                &mut machine,
                Request::LeaseGrant {
                    id: group + 1,
                    ttl_ms: 60_000,
                },
            );
            for candidate in 0..2 {
                apply(
                    &mut machine,
                    Request::GroupRegister(crate::GroupRegister {
                        group: format!("group-{group}"),
                        candidate: format!("agent-{candidate}"),
                        priority: candidate,
                        value: bytes::Bytes::from_static(b"10.0.0.1:7000"),
                        lease_id: group + 1,
                        preempt: false,
                    }),
                );
            }
        }
        let as_btree: std::collections::BTreeMap<String, crate::election::Group> = machine
            .state
            .groups
            .iter()
            .map(|(name, group)| (name.clone(), group.clone()))
            .collect();
        assert_eq!(as_btree.len(), 200);
        assert_eq!(
            postcard::to_allocvec(&machine.state.groups).expect("in memory"),
            postcard::to_allocvec(&as_btree).expect("in memory")
        );
    }

    /// A frame writer holding the image's magic and `version`, as every format begins.
    fn image_header(version: u32) -> FrameWriter<Vec<u8>> {
        let mut frames = FrameWriter {
            inner: Vec::new(),
            buffer: Vec::new(),
            body_crc: 0,
        };
        frames.inner.extend_from_slice(SNAPSHOT_MAGIC);
        frames.inner.extend_from_slice(&version.to_le_bytes());
        frames
    }

    /// Writes the image a build of `version` 1 to 3 wrote: the state, and no queue section
    /// (without sessions, formats 1 to 3 encode the state alike).
    fn old_image(machine: &StateMachine, version: u32) -> Vec<u8> {
        let mut frames = image_header(version);
        // Formats 1 to 3 end before the auth state; a default one encodes in 37 bytes.
        let mut state = postcard::to_allocvec(&machine.state).expect("in memory");
        assert!(
            !machine.state.auth.enabled,
            "only a default auth state is trimmed"
        );
        state.truncate(state.len() - 37);
        frames.write_all(&state).expect("in memory");
        frames.finish().expect("in memory")
    }

    #[test]
    fn older_images_load_with_no_queues_and_a_version_4_image_keeps_them() {
        let mut machine = StateMachine::new(Config::default());
        let put = Request::Put(PutRequest::new("k", "v"));
        machine.apply(1, &Command::new(5, put));
        let push = Request::QueuePush(crate::queue::JobPush {
            queue: "jobs".into(),
            ..Default::default()
        });
        machine.apply(2, &Command::new(6, push));
        for version in 1..=3 {
            let image = old_image(&machine, version);
            let old = StateMachine::restore(Config::default(), image.as_slice())
                .unwrap_or_else(|error| panic!("format {version}: {error}"));
            assert_eq!(old.revision(), machine.revision());
            assert!(old.work_queue("jobs").is_none());
        }
        let new = StateMachine::restore(Config::default(), machine.snapshot_to_vec().as_slice())
            .expect("loads");
        assert_eq!(new.work_queue("jobs").map(|q| q.len()), Some(1));
        // A version 3 header on a version 4 body is refused, not misread.
        let mut mislabelled = machine.snapshot_to_vec();
        mislabelled[8..12].copy_from_slice(&3u32.to_le_bytes());
        assert!(StateMachine::restore(Config::default(), mislabelled.as_slice()).is_err());
    }

    /// Writes the image a build of format 4 wrote: the state and the queues, no senders.
    fn format_4_image(machine: &StateMachine) -> Vec<u8> {
        let frames = image_header(4);
        let frames = postcard::to_io(&machine.state, frames).expect("in memory");
        let frames = postcard::to_io(&machine.queues, frames).expect("in memory");
        frames.finish().expect("in memory")
    }

    fn publish_from(topic: &str, data: &'static [u8], from: &str) -> Request {
        Request::PublishFrom {
            topic: topic.into(),
            data: bytes::Bytes::from_static(data),
            from: from.into(),
        }
    }

    fn senders(machine: &StateMachine, topic: &str) -> Vec<String> {
        let read = machine.topic_read(topic, 0, 0);
        read.messages.into_iter().map(|m| m.from).collect()
    }

    #[test]
    fn message_senders_survive_a_snapshot_and_a_format_4_image_loads_without_them() {
        let mut machine = StateMachine::new(Config::default());
        machine.apply(1, &Command::new(5, publish_from("t", b"a", "agent-1")));
        let unnamed = Request::Publish {
            topic: "t".into(),
            data: bytes::Bytes::from_static(b"b"),
        };
        machine.apply(2, &Command::new(6, unnamed));
        machine.apply(3, &Command::new(7, publish_from("u", b"c", "agent-2")));
        assert_eq!(senders(&machine, "t"), ["agent-1", ""]);

        let image = machine.snapshot_to_vec();
        let restored = StateMachine::restore(Config::default(), image.as_slice()).expect("loads");
        assert_eq!(senders(&restored, "t"), ["agent-1", ""]);
        assert_eq!(senders(&restored, "u"), ["agent-2"]);
        assert_eq!(restored.snapshot_to_vec(), image);

        let old = StateMachine::restore(Config::default(), format_4_image(&machine).as_slice())
            .expect("a format 4 image loads");
        assert_eq!(senders(&old, "t"), ["", ""]);
        assert_eq!(old.topic_read("t", 0, 0).messages.len(), 2);
        assert_eq!(old.revision(), machine.revision());

        // A format 5 body under a format 4 header has a trailing section: refused.
        let mut mislabelled = image.clone();
        mislabelled[8..12].copy_from_slice(&4u32.to_le_bytes());
        assert!(StateMachine::restore(Config::default(), mislabelled.as_slice()).is_err());
    }

    #[test]
    fn a_sender_section_naming_a_message_not_retained_is_corruption() {
        let mut machine = StateMachine::new(Config::default());
        machine.apply(1, &Command::new(5, publish_from("t", b"a", "agent-1")));
        let frames = image_header(SNAPSHOT_FORMAT_VERSION);
        let frames = postcard::to_io(&machine.state, frames).expect("in memory");
        let frames = postcard::to_io(&machine.queues, frames).expect("in memory");
        let mut senders = machine.state.topics.senders();
        senders.push(senders[0].clone());
        let frames = postcard::to_io(&senders, frames).expect("in memory");
        let twice = frames.finish().expect("in memory");
        let error = StateMachine::restore(Config::default(), twice.as_slice())
            .expect_err("a sender named twice is refused");
        assert!(matches!(error, Error::SnapshotCorrupt(_)), "{error:?}");
    }

    #[test]
    fn a_format_4_image_keeps_higher_and_always_and_the_never_section_is_checked() {
        use crate::election::{GroupPolicy, PreemptPolicy};
        let mut machine = StateMachine::new(Config::default());
        for (index, (group, preempt)) in [("polite", false), ("eager", true)].iter().enumerate() {
            let policy = GroupPolicy {
                preempt: *preempt,
                ..GroupPolicy::default()
            };
            let configure = Request::GroupConfigure {
                group: (*group).into(),
                policy,
            };
            machine.apply(index as u64 + 1, &Command::new(5, configure));
        }
        let old = StateMachine::restore(Config::default(), format_4_image(&machine).as_slice())
            .expect("a format 4 image loads");
        assert_eq!(
            old.group_policy("polite").preempt_policy(),
            PreemptPolicy::Higher
        );
        assert_eq!(
            old.group_policy("eager").preempt_policy(),
            PreemptPolicy::Always
        );

        // A `never` section naming a group that has no policy, or one already `always`, is
        // corruption.
        for named in ["missing", "eager"] {
            let frames = image_header(SNAPSHOT_FORMAT_VERSION);
            let frames = postcard::to_io(&machine.state, frames).expect("in memory");
            let frames = postcard::to_io(&machine.queues, frames).expect("in memory");
            let frames =
                postcard::to_io(&machine.state.topics.senders(), frames).expect("in memory");
            let frames = postcard::to_io(&vec![named], frames).expect("in memory");
            let image = frames.finish().expect("in memory");
            let error =
                StateMachine::restore(Config::default(), image.as_slice()).expect_err("refused");
            assert!(
                matches!(error, Error::SnapshotCorrupt(_)),
                "{named}: {error:?}"
            );
        }
    }

    /// Snapshots are taken from a clone while the machine goes on applying (the clone is
    /// O(1) for the key-value store, a persistent map): the clone taken at index N must encode
    /// to exactly the image an eager snapshot at N gives, however much is applied after.
    #[test]
    fn a_clone_taken_before_writes_encodes_as_an_eager_snapshot_at_that_point() {
        let mut machine = StateMachine::new(Config::default());
        let mut index = 0;
        let mut put = |machine: &mut StateMachine, key: String, value: &str| {
            index += 1;
            let request = Request::Put(PutRequest::new(key, value.to_owned()));
            machine.apply(index, &Command::new(1_000 + index, request));
        };
        for i in 0..2_000 {
            put(&mut machine, format!("k/{}", i % 700), "before");
        }
        let eager = machine.snapshot_to_vec();
        let frozen = machine.clone();
        for i in 0..2_000 {
            put(&mut machine, format!("k/{}", (i * 13) % 900), "after");
        }
        assert_eq!(frozen.snapshot_to_vec(), eager);
        assert_ne!(machine.snapshot_to_vec(), eager, "the original did move on");
        let restored = StateMachine::restore(Config::default(), eager.as_slice()).expect("loads");
        assert_eq!(restored.snapshot_to_vec(), eager);
    }
}
