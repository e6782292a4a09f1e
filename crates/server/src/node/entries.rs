//! What the driver writes into the log and into snapshots next to the machine's own bytes:
//! member records (the membership table with names and addresses lives beside the machine),
//! and the framing that keeps the two apart.
//!
//! A log entry is one of
//! - empty: a new leader's no-op;
//! - [`MEMBER_ENTRY_MAGIC`] + a member record (MemberAdd creates it);
//! - [`MEMBER_UPDATE_ENTRY_MAGIC`] + a member record that changes an existing one (a member
//!   publishing its name and client address), ignored once its member is gone;
//! - [`MACHINE_ENTRY_ESCAPE`] + machine bytes, for machine bytes that are empty or start with
//!   either magic (the coordination machine's commands never do, so its entries carry no
//!   extra byte);
//! - anything else: machine bytes as they are.
//!
//! A snapshot is [`SNAPSHOT_MEMBER_IDS_MAGIC`], the highest member id the cluster ever used,
//! the member records, then the machine's image. Older snapshots still load: with
//! [`SNAPSHOT_MEMBERS_MAGIC`] they carry the records without the highest id, and without
//! either magic (taken before membership changes existed) they are the image alone.

use conclave_raft::NodeId;

use crate::config::Member;

/// Starts a log entry that carries a member record rather than a state-machine command. A
/// coordination command's encoding cannot start with it (leader time 0, then an invalid option
/// tag).
pub(crate) const MEMBER_ENTRY_MAGIC: &[u8] = b"\x00conclave-member\x01";
/// Starts a log entry that updates an existing member record. Apart from a creating record, so
/// that an update committed after its member's removal cannot bring the record back.
pub(crate) const MEMBER_UPDATE_ENTRY_MAGIC: &[u8] = b"\x00conclave-member\x02";
/// Starts a log entry whose remaining bytes go to the machine unchanged, used only when the
/// machine's bytes could be mistaken for a no-op or another framed entry.
pub(crate) const MACHINE_ENTRY_ESCAPE: &[u8] = b"\x00conclave-machine\x01";
/// Starts a snapshot whose member records precede the state machine's image (written before
/// the highest member id was recorded; still read).
pub(crate) const SNAPSHOT_MEMBERS_MAGIC: &[u8] = b"CNCLMEMB";
/// Starts a snapshot whose highest member id ever used, then member records, precede the state
/// machine's image: a removed member's record is gone, and its id must stay used.
pub(crate) const SNAPSHOT_MEMBER_IDS_MAGIC: &[u8] = b"CNCLMID2";
/// Bounds a member record's strings, so a corrupt length cannot ask for gigabytes.
pub(crate) const MEMBER_FIELD_BYTES_MAX: usize = 4096;

/// What a committed normal entry holds.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum EntryBody<'a> {
    /// A leader's no-op.
    Empty,
    /// A member record to create; `None` when its bytes are malformed.
    Member(Option<Member>),
    /// A member record to update, if its member is still there; `None` when malformed.
    MemberUpdate(Option<Member>),
    /// Bytes for the replicated machine.
    Machine(&'a [u8]),
}

/// The log entry for machine bytes `bytes`.
pub(crate) fn machine_entry(bytes: Vec<u8>) -> Vec<u8> {
    let ambiguous = bytes.is_empty()
        || bytes.starts_with(MEMBER_ENTRY_MAGIC)
        || bytes.starts_with(MEMBER_UPDATE_ENTRY_MAGIC)
        || bytes.starts_with(MACHINE_ENTRY_ESCAPE);
    if !ambiguous {
        return bytes;
    }
    let mut framed = Vec::with_capacity(MACHINE_ENTRY_ESCAPE.len() + bytes.len());
    framed.extend_from_slice(MACHINE_ENTRY_ESCAPE);
    framed.extend_from_slice(&bytes);
    framed
}

/// The log entry for a member record.
pub(crate) fn member_entry(member: &Member) -> Vec<u8> {
    let mut out = MEMBER_ENTRY_MAGIC.to_vec();
    encode_member_into(&mut out, member);
    out
}

/// The log entry that updates an existing member record.
pub(crate) fn member_update_entry(member: &Member) -> Vec<u8> {
    let mut out = MEMBER_UPDATE_ENTRY_MAGIC.to_vec();
    encode_member_into(&mut out, member);
    out
}

/// Tells what a committed normal entry's bytes are.
pub(crate) fn entry_body(data: &[u8]) -> EntryBody<'_> {
    if data.is_empty() {
        return EntryBody::Empty;
    }
    if let Some(mut record) = data.strip_prefix(MEMBER_ENTRY_MAGIC) {
        return EntryBody::Member(decode_member(&mut record));
    }
    if let Some(mut record) = data.strip_prefix(MEMBER_UPDATE_ENTRY_MAGIC) {
        return EntryBody::MemberUpdate(decode_member(&mut record));
    }
    EntryBody::Machine(data.strip_prefix(MACHINE_ENTRY_ESCAPE).unwrap_or(data))
}

fn encode_member_into(out: &mut Vec<u8>, member: &Member) {
    out.extend_from_slice(&member.id.to_be_bytes());
    for field in [&member.name, &member.peer_addr, &member.client_addr] {
        out.extend_from_slice(&(field.len() as u32).to_be_bytes());
        out.extend_from_slice(field.as_bytes());
    }
}

/// Reads what [`encode_member_into`] wrote; `None` on malformed bytes, never a panic.
fn decode_member(bytes: &mut &[u8]) -> Option<Member> {
    fn take<'a>(bytes: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        let (head, rest) = (bytes.get(..n)?, bytes.get(n..)?);
        *bytes = rest;
        Some(head)
    }
    fn string(bytes: &mut &[u8]) -> Option<String> {
        let len = u32::from_be_bytes(take(bytes, 4)?.try_into().ok()?) as usize;
        if len > MEMBER_FIELD_BYTES_MAX {
            return None;
        }
        String::from_utf8(take(bytes, len)?.to_vec()).ok()
    }
    let id = u64::from_be_bytes(take(bytes, 8)?.try_into().ok()?);
    Some(Member {
        id,
        name: string(bytes)?,
        peer_addr: string(bytes)?,
        client_addr: string(bytes)?,
    })
}

/// What a snapshot says about the members.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct SnapshotMembers {
    pub records: Vec<Member>,
    /// The highest member id the cluster used up to the snapshot; `None` in a snapshot written
    /// before it was recorded.
    pub member_id_high: Option<NodeId>,
}

/// A snapshot's bytes: [`write_snapshot_header`]'s, then the machine's image. The node streams
/// both into the snapshot file instead (`SnapshotData::write_to`); tests build snapshots with
/// this.
#[cfg(test)]
pub(crate) fn snapshot_bytes<'a>(
    member_id_high: NodeId,
    members: impl ExactSizeIterator<Item = &'a Member>,
    image: &[u8],
) -> Vec<u8> {
    let mut framed = Vec::new();
    write_snapshot_header(&mut framed, member_id_high, members);
    framed.extend_from_slice(image);
    framed
}

/// Appends a snapshot's header: the highest member id ever used and the member records, so a
/// node that catches up by snapshot (a joining one above all) learns every member's address
/// and which ids are taken. The machine's image follows it.
pub(crate) fn write_snapshot_header<'a>(
    out: &mut Vec<u8>,
    member_id_high: NodeId,
    members: impl ExactSizeIterator<Item = &'a Member>,
) {
    out.extend_from_slice(SNAPSHOT_MEMBER_IDS_MAGIC);
    out.extend_from_slice(&member_id_high.to_be_bytes());
    out.extend_from_slice(&(members.len() as u32).to_be_bytes());
    for member in members {
        encode_member_into(out, member);
    }
}

/// Splits a snapshot into what it says about the members (if anything) and the machine's
/// image; `None` when the member section is malformed.
pub(crate) fn split_snapshot(data: &[u8]) -> Option<(Option<SnapshotMembers>, &[u8])> {
    let (member_id_high, mut rest) =
        if let Some(rest) = data.strip_prefix(SNAPSHOT_MEMBER_IDS_MAGIC) {
            let high = u64::from_be_bytes(rest.get(..8)?.try_into().ok()?);
            (Some(high), rest.get(8..)?)
        } else if let Some(rest) = data.strip_prefix(SNAPSHOT_MEMBERS_MAGIC) {
            (None, rest)
        } else {
            return Some((None, data));
        };
    let count = u32::from_be_bytes(rest.get(..4)?.try_into().ok()?);
    rest = rest.get(4..)?;
    let mut members = Vec::new();
    for _ in 0..count {
        members.push(decode_member(&mut rest)?);
    }
    let found = SnapshotMembers {
        records: members,
        member_id_high,
    };
    Some((Some(found), rest))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(id: u64) -> Member {
        Member {
            id,
            name: format!("n{id}"),
            peer_addr: format!("127.0.0.1:{}", 7000 + id),
            client_addr: String::new(),
        }
    }

    #[test]
    fn machine_bytes_round_trip_even_when_they_look_like_driver_entries() {
        let tricky = [
            Vec::new(),
            member_entry(&member(3)),
            member_update_entry(&member(3)),
            machine_entry(b"x".to_vec()),
            [MACHINE_ENTRY_ESCAPE, b"rest"].concat(),
            b"\x00plain".to_vec(),
        ];
        for bytes in tricky {
            let entry = machine_entry(bytes.clone());
            assert_eq!(entry_body(&entry), EntryBody::Machine(&bytes[..]));
        }
        // Ordinary bytes are not framed at all.
        assert_eq!(machine_entry(b"abc".to_vec()), b"abc".to_vec());
        assert_eq!(entry_body(b""), EntryBody::Empty);
        assert_eq!(
            entry_body(&member_entry(&member(2))),
            EntryBody::Member(Some(member(2)))
        );
        assert_eq!(
            entry_body(&member_entry(&member(2))[..MEMBER_ENTRY_MAGIC.len() + 3]),
            EntryBody::Member(None)
        );
        assert_eq!(
            entry_body(&member_update_entry(&member(2))),
            EntryBody::MemberUpdate(Some(member(2)))
        );
    }

    #[test]
    fn snapshots_carry_the_highest_member_id_and_members_before_the_image() {
        let members = [member(1), member(2)];
        // Id 5 was used and removed: only the highest id remembers it.
        let bytes = snapshot_bytes(5, members.iter(), b"image");
        let (found, image) = split_snapshot(&bytes).expect("well-formed");
        assert_eq!(
            found,
            Some(SnapshotMembers {
                records: members.to_vec(),
                member_id_high: Some(5),
            })
        );
        assert_eq!(image, b"image");
        assert_eq!(split_snapshot(b"legacy"), Some((None, &b"legacy"[..])));
        for cut in [
            SNAPSHOT_MEMBER_IDS_MAGIC.len() + 4,
            SNAPSHOT_MEMBER_IDS_MAGIC.len() + 14,
        ] {
            assert_eq!(split_snapshot(&bytes[..cut]), None, "cut at {cut}");
        }
    }

    #[test]
    fn snapshots_with_member_records_but_no_highest_id_still_load() {
        // The layout written before the highest id was recorded.
        let members = [member(1), member(3)];
        let mut bytes = SNAPSHOT_MEMBERS_MAGIC.to_vec();
        bytes.extend_from_slice(&(members.len() as u32).to_be_bytes());
        for m in &members {
            encode_member_into(&mut bytes, m);
        }
        bytes.extend_from_slice(b"image");
        let (found, image) = split_snapshot(&bytes).expect("well-formed");
        assert_eq!(
            found,
            Some(SnapshotMembers {
                records: members.to_vec(),
                member_id_high: None,
            })
        );
        assert_eq!(image, b"image");
    }
}
