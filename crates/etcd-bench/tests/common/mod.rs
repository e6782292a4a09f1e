//! What the tests of this crate share: a `put-floor` cluster of three processes, and its logs.

#![allow(dead_code)] // each test binary uses its own part of this module

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::process::{Child, Command};

/// Child processes, killed when the test ends however it ends.
pub struct Processes(Vec<Child>);

impl Drop for Processes {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

pub fn free_addr() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    listener.local_addr().expect("local address")
}

pub fn floor(dir: &Path, inline: bool) -> (Processes, SocketAddr) {
    let binary = env!("CARGO_BIN_EXE_put-floor");
    let (leader, first, second) = (free_addr(), free_addr(), free_addr());
    let mut children = Vec::new();
    for (name, addr) in [("f1", first), ("f2", second)] {
        children.push(
            Command::new(binary)
                .args(["follower", "--listen", &addr.to_string(), "--log-mib", "1"])
                .arg("--dir")
                .arg(dir.join(name))
                .spawn()
                .expect("start a follower"),
        );
    }
    let mut command = Command::new(binary);
    command
        .args(["leader", "--listen", &leader.to_string(), "--log-mib", "1"])
        .args(["--followers", &format!("{first},{second}")])
        .arg("--dir")
        .arg(dir.join("leader"));
    if inline {
        command.arg("--inline");
    }
    children.push(command.spawn().expect("start the leader"));
    (Processes(children), leader)
}

/// The first `count` records of a log (each a little-endian u32 length and the record), or
/// None while the log holds fewer.
pub fn logged_records(log: &Path, count: usize) -> Option<Vec<Vec<u8>>> {
    let bytes = std::fs::read(log).expect("read a log file");
    let mut records = Vec::new();
    let mut at = 0;
    while records.len() < count {
        let len = u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?) as usize;
        if len == 0 {
            return None; // the pre-written zeros: nothing appended here yet
        }
        records.push(bytes.get(at + 4..at + 4 + len)?.to_vec());
        at += 4 + len;
    }
    Some(records)
}

/// How many records a log holds: they run from the start to the first zero length.
pub fn record_count(log: &Path) -> usize {
    let bytes = std::fs::read(log).expect("read a log file");
    let mut count = 0;
    let mut at = 0;
    while let Some(length) = bytes.get(at..at + 4) {
        let length = u32::from_le_bytes(length.try_into().expect("four bytes")) as usize;
        if length == 0 {
            break;
        }
        count += 1;
        at += 4 + length;
    }
    count
}
