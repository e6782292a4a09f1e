//! A data directory remembers which cluster and which member made it, in a small text file
//! beside the log. A node started over another cluster's directory (or another member's)
//! would otherwise join with a log its peers never wrote, and the damage would show much
//! later, if at all; with the file it stops at once with one sentence.
//!
//! The file holds two lines, `cluster-id=<16 hex digits>` and `member-id=<decimal>`. It is
//! written once, atomically (temporary file, fsync, rename), the first time a node opens the
//! directory; a directory from before the file existed is adopted the same way.

use std::fs;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use crate::error::Error;

/// The identity file's name in a data directory.
pub const IDENTITY_FILE_NAME: &str = "IDENTITY";
/// Anything larger is not an identity file this node wrote.
const IDENTITY_FILE_BYTES_MAX: u64 = 4096;

/// Checks that `data_dir` was made by member `member` of cluster `cluster`, recording it if the
/// directory does not say yet. The caller holds the directory's lock.
pub(crate) fn check_or_record(data_dir: &Path, cluster: u64, member: u64) -> Result<(), Error> {
    let path = data_dir.join(IDENTITY_FILE_NAME);
    let failure = |reason: String| Error::Identity {
        path: path.display().to_string(),
        reason,
    };
    match fs::metadata(&path) {
        Ok(meta) if meta.len() > IDENTITY_FILE_BYTES_MAX => {
            return Err(failure(format!(
                "{} bytes, more than an identity file holds",
                meta.len()
            )));
        }
        Ok(_) => {
            let text = fs::read_to_string(&path).map_err(|e| failure(e.to_string()))?;
            let (found_cluster, found_member) = parse(&text).ok_or_else(|| {
                failure("malformed; expected cluster-id=<hex> and member-id=<n> lines".into())
            })?;
            if (found_cluster, found_member) != (cluster, member) {
                return Err(Error::OtherCluster {
                    data_dir: data_dir.display().to_string(),
                    found_cluster,
                    found_member,
                    cluster,
                    member,
                });
            }
            return Ok(());
        }
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => return Err(failure(error.to_string())),
    }
    let temporary = data_dir.join(format!("{IDENTITY_FILE_NAME}.tmp"));
    let write = || -> std::io::Result<()> {
        // Owner only, like everything else in the data directory.
        let mut file = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&temporary)?;
        file.write_all(render(cluster, member).as_bytes())?;
        file.sync_all()?;
        fs::rename(&temporary, &path)?;
        // The rename is durable once the directory is.
        fs::File::open(data_dir)?.sync_all()
    };
    write().map_err(|e| failure(e.to_string()))
}

fn render(cluster: u64, member: u64) -> String {
    format!("cluster-id={cluster:016x}\nmember-id={member}\n")
}

fn parse(text: &str) -> Option<(u64, u64)> {
    let mut cluster = None;
    let mut member = None;
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let (key, value) = line.split_once('=')?;
        match key.trim() {
            "cluster-id" => cluster = Some(u64::from_str_radix(value.trim(), 16).ok()?),
            "member-id" => member = Some(value.trim().parse().ok()?),
            _ => return None,
        }
    }
    Some((cluster?, member?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> std::path::PathBuf {
        let dir =
            std::env::temp_dir().join(format!("conclave-identity-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("create the test directory");
        dir
    }

    #[test]
    fn first_open_records_and_later_opens_must_match() {
        let dir = temp_dir("match");
        check_or_record(&dir, 0xabc, 2).expect("recorded");
        assert_eq!(
            fs::read_to_string(dir.join(IDENTITY_FILE_NAME)).expect("written"),
            "cluster-id=0000000000000abc\nmember-id=2\n"
        );
        check_or_record(&dir, 0xabc, 2).expect("same identity opens");
        let other_cluster = check_or_record(&dir, 0xdef, 2).expect_err("another cluster");
        assert!(
            matches!(
                other_cluster,
                Error::OtherCluster {
                    found_cluster: 0xabc,
                    cluster: 0xdef,
                    ..
                }
            ),
            "{other_cluster}"
        );
        let sentence = other_cluster.to_string();
        assert!(sentence.contains("belongs to member 2 of cluster 0000000000000abc"));
        let other_member = check_or_record(&dir, 0xabc, 3).expect_err("another member");
        assert!(matches!(
            other_member,
            Error::OtherCluster {
                found_member: 2,
                member: 3,
                ..
            }
        ));
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_damaged_identity_file_is_an_error_not_a_panic() {
        let dir = temp_dir("damaged");
        for text in ["", "cluster-id=zz\nmember-id=1\n", "member-id=1\n", "x=1\n"] {
            fs::write(dir.join(IDENTITY_FILE_NAME), text).expect("write");
            let error = check_or_record(&dir, 1, 1).expect_err("malformed");
            assert!(matches!(error, Error::Identity { .. }), "{text:?}: {error}");
        }
        let _ = fs::remove_dir_all(&dir);
    }
}
