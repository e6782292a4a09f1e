//! Segment files: naming and the fixed header.
//!
//! ```text
//! <dir>/wal/<first_seq, 20 decimal digits>.wal
//! header (32 bytes): magic "CNCLVWAL" | format version u32 | reserved u32 (0)
//!                    | first_seq u64 | CRC32C of the 24 bytes before, u32 | reserved u32 (0)
//! then frames (see record.rs), then zeros up to the preallocated length.
//! ```

use std::path::{Path, PathBuf};

/// Bytes of a segment header.
pub const SEGMENT_HEADER_BYTES: usize = 32;
/// The WAL format this code writes and reads.
pub const WAL_FORMAT_VERSION: u32 = 1;
const MAGIC: &[u8; 8] = b"CNCLVWAL";
const EXTENSION: &str = ".wal";
/// Suffix of a segment still being created; such files are removed at start-up.
pub const TEMP_SUFFIX: &str = ".tmp";

/// The file name of the segment whose first record has sequence number `first_seq`.
pub fn segment_file_name(first_seq: u64) -> String {
    format!("{first_seq:020}{EXTENSION}")
}

/// The first sequence number a segment file name stands for, if it is one.
pub fn parse_segment_file_name(name: &str) -> Option<u64> {
    let digits = name.strip_suffix(EXTENSION)?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The path of a segment in `wal_dir`.
pub fn segment_path(wal_dir: &Path, first_seq: u64) -> PathBuf {
    wal_dir.join(segment_file_name(first_seq))
}

/// Encodes the header of a segment starting at `first_seq`.
pub fn encode_header(first_seq: u64) -> [u8; SEGMENT_HEADER_BYTES] {
    let mut header = [0u8; SEGMENT_HEADER_BYTES];
    header[..8].copy_from_slice(MAGIC);
    header[8..12].copy_from_slice(&WAL_FORMAT_VERSION.to_le_bytes());
    header[16..24].copy_from_slice(&first_seq.to_le_bytes());
    let crc = crc32c::crc32c(&header[..24]);
    header[24..28].copy_from_slice(&crc.to_le_bytes());
    header
}

/// Checks a segment header and returns its first sequence number.
pub fn decode_header(bytes: &[u8]) -> Result<u64, String> {
    let header = bytes
        .get(..SEGMENT_HEADER_BYTES)
        .ok_or("segment shorter than its header")?;
    if &header[..8] != MAGIC {
        return Err("not a Conclave WAL segment (bad magic)".into());
    }
    let crc = u32::from_le_bytes([header[24], header[25], header[26], header[27]]);
    if crc32c::crc32c(&header[..24]) != crc {
        return Err("segment header checksum mismatch".into());
    }
    // The last four bytes lie outside the checksum: insisting on zeros keeps every header
    // byte verified.
    if header[28..].iter().any(|&b| b != 0) {
        return Err("segment header reserved bytes are not zero".into());
    }
    let version = u32::from_le_bytes([header[8], header[9], header[10], header[11]]);
    if version != WAL_FORMAT_VERSION {
        return Err(format!("unsupported WAL format version {version}"));
    }
    let mut first_seq = [0u8; 8];
    first_seq.copy_from_slice(&header[16..24]);
    Ok(u64::from_le_bytes(first_seq))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_headers_round_trip() {
        assert_eq!(parse_segment_file_name(&segment_file_name(42)), Some(42));
        assert_eq!(parse_segment_file_name("42.wal"), None);
        assert_eq!(parse_segment_file_name("0000000000000000004x.wal"), None);
        assert_eq!(decode_header(&encode_header(7)), Ok(7));
        let mut bad = encode_header(7);
        bad[17] ^= 1;
        assert!(decode_header(&bad).is_err());
        assert!(decode_header(&bad[..10]).is_err());
    }
}
