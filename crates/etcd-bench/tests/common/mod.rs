//! What the tests of this crate share: a `put-floor` cluster of three processes, and its logs.

#![allow(dead_code)] // each test binary uses its own part of this module

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::{Mutex, MutexGuard};

/// One floor at a time per test binary. Each member is handed a port that was free when the
/// test looked, and a leader binds its port only once its followers answer (seconds on a busy
/// disk): meanwhile a second floor starting beside it could be handed the same port, and the
/// first test would then talk to the other floor's follower.
static ONE_FLOOR_AT_A_TIME: Mutex<()> = Mutex::new(());

/// A floor's processes, killed when the test ends however it ends; the next floor may start
/// after that.
pub struct Processes {
    children: Vec<Child>,
    _turn: MutexGuard<'static, ()>,
}

impl Drop for Processes {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A port free when asked, taken between floors so that it is none of a floor's ports.
pub fn free_addr() -> SocketAddr {
    let _turn = ONE_FLOOR_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    listener.local_addr().expect("local address")
}

pub fn floor(dir: &Path, inline: bool) -> (Processes, SocketAddr) {
    // A test that failed while holding its turn leaves nothing behind that matters here.
    let turn = ONE_FLOOR_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let binary = env!("CARGO_BIN_EXE_put-floor");
    // Held together until all three are known, so the three ports differ.
    let listeners: Vec<TcpListener> = (0..3)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port"))
        .collect();
    let addrs: Vec<SocketAddr> = listeners
        .iter()
        .map(|listener| listener.local_addr().expect("local address"))
        .collect();
    drop(listeners);
    let (leader, first, second) = (addrs[0], addrs[1], addrs[2]);
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
    (
        Processes {
            children,
            _turn: turn,
        },
        leader,
    )
}

/// The records of a log (each a little-endian u32 length and the record), from the start to
/// the first zero length (the pre-written zeros: nothing appended there yet).
pub fn logged_records(log: &Path) -> Vec<Vec<u8>> {
    let bytes = std::fs::read(log).expect("read a log file");
    let mut records = Vec::new();
    let mut at = 0;
    while let Some(length) = bytes.get(at..at + 4) {
        let length = u32::from_le_bytes(length.try_into().expect("four bytes")) as usize;
        let Some(record) = bytes.get(at + 4..at + 4 + length).filter(|_| length > 0) else {
            break;
        };
        records.push(record.to_vec());
        at += 4 + length;
    }
    records
}

/// A fresh scratch directory for one test of this process.
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("etcd-bench-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}
