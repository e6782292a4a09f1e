//! `conclave dev` over real processes: three child nodes elect a leader; SIGKILL the leader's
//! process and `dev` reports another leader and the dead node as down; SIGINT stops `dev`
//! with exit code 0 and leaves no node running.

mod common;

use std::io::BufRead;
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

/// Generous bounds: the CI machine is a noisy 2-core VM.
const FIRST_LEADER_TIMEOUT: Duration = Duration::from_secs(30);
const FAILOVER_TIMEOUT: Duration = Duration::from_secs(30);
const EXIT_TIMEOUT: Duration = Duration::from_secs(30);
const NODES: u16 = 3;

/// A running `conclave dev` with its stdout lines; kills it and any node left on drop.
struct Dev {
    child: Child,
    lines: Receiver<String>,
    seen: Vec<String>,
    pids: Vec<u32>,
    dir: PathBuf,
}

impl Dev {
    fn start(base_port: u16) -> Dev {
        let dir = std::env::temp_dir().join(format!("conclave-dev-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the test directory");
        let stderr = std::fs::File::create(dir.join("dev.stderr")).expect("create dev.stderr");
        let mut child = Command::new(env!("CARGO_BIN_EXE_conclave"))
            .arg("dev")
            .args(["--nodes", &NODES.to_string()])
            .args(["--base-port", &base_port.to_string()])
            .arg("--data-dir")
            .arg(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr))
            .spawn()
            .expect("start conclave dev");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Dev {
            child,
            lines,
            seen: Vec::new(),
            pids: Vec::new(),
            dir,
        }
    }

    /// The next line `accept` takes, within `timeout`; every line read is kept in `seen`.
    fn line_where(&mut self, timeout: Duration, accept: impl Fn(&str) -> bool) -> Option<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.checked_duration_since(Instant::now())?;
            let line = self.lines.recv_timeout(left).ok()?;
            println!("dev: {line}");
            self.seen.push(line.clone());
            if accept(&line) {
                return Some(line);
            }
        }
    }

    fn output(&self) -> String {
        self.seen.join("\n")
    }
}

/// Whether `pid` is a `conclave serve` process still (a pid may be reused once it is gone).
fn is_conclave_serve(pid: u32) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|cmdline| {
            let words: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
            words.iter().any(|w| w.ends_with(b"conclave")) && words.contains(&&b"serve"[..])
        })
        .unwrap_or(false)
}

fn kill(signal: &str, pid: u32) {
    let _ = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status();
}

impl Drop for Dev {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for &pid in &self.pids {
            if is_conclave_serve(pid) {
                kill("-KILL", pid);
            }
        }
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        } else {
            eprintln!("node logs kept in {}", self.dir.display());
        }
    }
}

/// `value` of `key=value` in a status line.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|word| word.strip_prefix(key)?.strip_prefix('='))
}

#[test]
fn dev_reports_the_failover_and_stops_every_node_on_sigint() {
    let base_port = common::free_port_run(2 * NODES);
    let mut dev = Dev::start(base_port);

    // The banner: one line per node with its pid.
    let mut names = Vec::new();
    while dev.pids.len() < usize::from(NODES) {
        let line = dev
            .line_where(Duration::from_secs(10), |l| l.contains(" pid "))
            .unwrap_or_else(|| panic!("no node line in the banner:\n{}", dev.output()));
        let words: Vec<&str> = line.split_whitespace().collect();
        let pid = words
            .iter()
            .position(|w| *w == "pid")
            .and_then(|i| words.get(i + 1))
            .and_then(|p| p.parse::<u32>().ok())
            .unwrap_or_else(|| panic!("no pid in {line:?}"));
        names.push(words[0].to_string());
        dev.pids.push(pid);
    }
    assert_eq!(names, ["node1", "node2", "node3"]);

    // The nodes authenticate to each other with a secret generated for this cluster, kept
    // private, not with the weak key derived from the cluster id.
    let secret = dev.dir.join("peer-secret");
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&secret)
            .unwrap_or_else(|e| panic!("{}: {e}", secret.display()))
            .permissions(),
    );
    assert_eq!(mode & 0o777, 0o600, "{}", secret.display());
    let text = std::fs::read_to_string(&secret).expect("read the secret");
    assert_eq!(text.trim().len(), 64, "32 random bytes, hex-encoded");

    let started = Instant::now();
    let first = dev
        .line_where(FIRST_LEADER_TIMEOUT, |l| {
            l.starts_with("status ") && field(l, "leader") != Some("none")
        })
        .unwrap_or_else(|| {
            panic!(
                "no leader within {FIRST_LEADER_TIMEOUT:?}:\n{}",
                dev.output()
            )
        });
    println!("first leader reported after {:?}", started.elapsed());
    let old_leader = field(&first, "leader").expect("leader field").to_string();
    let old_pid: u32 = field(&first, "pid")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no leader pid in {first:?}"));
    let index = names
        .iter()
        .position(|n| *n == old_leader)
        .unwrap_or_else(|| panic!("unknown leader in {first:?}"));
    assert_eq!(old_pid, dev.pids[index], "the leader's pid is its node's");

    let killed = Instant::now();
    kill("-KILL", old_pid);
    let next = dev
        .line_where(FAILOVER_TIMEOUT, |l| {
            l.starts_with("status ")
                && !matches!(field(l, "leader"), Some("none") | None)
                && field(l, "leader") != Some(old_leader.as_str())
        })
        .unwrap_or_else(|| {
            panic!(
                "no other leader within {FAILOVER_TIMEOUT:?} of killing {old_leader}:\n{}",
                dev.output()
            )
        });
    println!(
        "new leader reported {:?} after killing {old_leader}",
        killed.elapsed()
    );
    let down = field(&next, "down").expect("down field");
    assert!(
        down.split(',').any(|n| n == old_leader),
        "{old_leader} should be down in {next:?}"
    );
    assert!(
        dev.seen
            .iter()
            .any(|l| l.starts_with(&format!("exited {old_leader} pid={old_pid} (signal 9)"))),
        "dev should say {old_leader} exited:\n{}",
        dev.output()
    );

    let interrupted = Instant::now();
    kill("-INT", dev.child.id());
    let deadline = Instant::now() + EXIT_TIMEOUT;
    let code = loop {
        if let Ok(Some(status)) = dev.child.try_wait() {
            break status.code();
        }
        assert!(
            Instant::now() < deadline,
            "dev did not exit within {EXIT_TIMEOUT:?} of SIGINT:\n{}",
            dev.output()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    println!("dev exited {:?} after SIGINT", interrupted.elapsed());
    assert_eq!(code, Some(0), "dev exit code:\n{}", dev.output());
    // The rest of its output, up to the end of the pipe.
    while dev.line_where(Duration::from_secs(5), |_| false).is_some() {}
    assert!(
        dev.seen.iter().any(|l| l.starts_with("stopped ")),
        "dev should report the nodes stopped:\n{}",
        dev.output()
    );

    for (name, &pid) in names.iter().zip(&dev.pids) {
        assert!(!is_conclave_serve(pid), "{name} (pid {pid}) still runs");
    }
    for i in 0..NODES {
        let addr = SocketAddr::from(([127, 0, 0, 1], base_port + 2 * i));
        assert!(
            TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_err(),
            "something still listens on {addr}"
        );
    }
}

#[test]
fn dev_refuses_a_data_directory_of_another_layout() {
    let dir = std::env::temp_dir().join(format!("conclave-dev-test-layout-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // What a one-node run leaves behind; three nodes over it would found two clusters.
    std::fs::create_dir_all(dir.join("node1")).expect("create the test directory");
    let base_port = common::free_port_run(2 * NODES);
    let stderr_path = std::env::temp_dir().join(format!(
        "conclave-dev-test-layout-{}.stderr",
        std::process::id()
    ));
    let stderr_file = std::fs::File::create(&stderr_path).expect("create the stderr file");
    let child = Command::new(env!("CARGO_BIN_EXE_conclave"))
        .args(["dev", "--nodes", "3", "--base-port", &base_port.to_string()])
        .arg("--data-dir")
        .arg(&dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(stderr_file))
        .spawn()
        .expect("run conclave dev");
    // A `dev` that wrongly starts runs until stopped: give it a bound, and kill it on drop.
    let mut dev = Dev {
        child,
        lines: std::sync::mpsc::channel().1,
        seen: Vec::new(),
        pids: Vec::new(),
        dir: dir.clone(),
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let code = loop {
        if let Ok(Some(status)) = dev.child.try_wait() {
            break status.code();
        }
        if Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stderr = std::fs::read_to_string(&stderr_path).unwrap_or_default();
    let _ = std::fs::remove_file(&stderr_path);
    println!("{stderr}");
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("holds the data of nodes node1 from an earlier run"),
        "{stderr}"
    );
    assert!(!dir.join("node2").exists(), "no node may start");
}
