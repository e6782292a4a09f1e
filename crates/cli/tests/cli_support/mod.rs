//! Running the `conclave` client commands as processes, for the black-box CLI tests.

#![allow(dead_code)]

use std::io::Write;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// One finished CLI run.
#[derive(Debug)]
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    fn from(output: Output) -> Run {
        Run {
            code: output.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        }
    }

    /// The one JSON document a `--json` run printed.
    pub fn json(&self) -> Value {
        let lines: Vec<&str> = self.stdout.lines().collect();
        assert_eq!(lines.len(), 1, "one JSON document expected, got {self:?}");
        serde_json::from_str(lines[0]).unwrap_or_else(|e| panic!("not JSON ({e}): {self:?}"))
    }

    /// `data` of a successful `--json` run.
    pub fn data(&self) -> Value {
        let doc = self.json();
        assert_eq!(doc["status"], "ok", "{self:?}");
        assert_eq!(self.code, 0, "{self:?}");
        doc["data"].clone()
    }

    /// Asserts a failed `--json` run with `code` and exit code `exit`.
    pub fn assert_error(&self, code: &str, exit: i32) {
        let doc = self.json();
        assert_eq!(doc["status"], "error", "{self:?}");
        assert_eq!(doc["code"], code, "{self:?}");
        assert!(
            doc["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{self:?}"
        );
        assert_eq!(self.code, exit, "{self:?}");
        assert!(!self.stderr.contains("panicked"), "{self:?}");
    }

    /// Asserts a successful human run.
    pub fn ok(&self) -> &str {
        assert_eq!(self.code, 0, "{self:?}");
        &self.stdout
    }
}

pub fn command(endpoints: &str, args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_conclave"));
    command
        .args(args)
        .env("CONCLAVE_ENDPOINTS", endpoints)
        .env_remove("CONCLAVE_LOG")
        .stdin(Stdio::null());
    command
}

/// Runs `conclave ARGS` to completion.
pub fn run(endpoints: &str, args: &[&str]) -> Run {
    Run::from(
        command(endpoints, args)
            .output()
            .expect("run the conclave binary"),
    )
}

/// Runs `conclave ARGS` with `input` on stdin.
pub fn run_with_stdin(endpoints: &str, args: &[&str], input: &[u8]) -> Run {
    let mut child = command(endpoints, args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the conclave binary");
    if let Some(mut stdin) = child.stdin.take() {
        // The command may refuse the input before reading it all; that is its answer.
        let _ = stdin.write_all(input);
    }
    Run::from(child.wait_with_output().expect("wait for conclave"))
}

/// Runs `conclave ARGS` until it succeeds or `timeout` passes (the cluster may be between
/// leaders); answers the last run.
pub fn run_until_ok(endpoints: &str, args: &[&str], timeout: Duration) -> Run {
    let start = Instant::now();
    loop {
        let run = run(endpoints, args);
        if run.code == 0 || start.elapsed() > timeout {
            return run;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A long-running CLI process whose stdout lines arrive on a channel with their arrival time.
pub struct Streaming {
    pub child: Child,
    pub lines: std::sync::mpsc::Receiver<(Instant, String)>,
}

impl Streaming {
    pub fn start(endpoints: &str, args: &[&str]) -> Streaming {
        let mut child = command(endpoints, args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the conclave binary");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send((Instant::now(), line)).is_err() {
                    break;
                }
            }
        });
        Streaming { child, lines }
    }

    /// The next line as JSON, within `timeout`.
    pub fn next_json(&self, timeout: Duration) -> Option<(Instant, Value)> {
        let (at, line) = self.lines.recv_timeout(timeout).ok()?;
        let value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
        Some((at, value))
    }

    /// SIGKILL, as a crash.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn signal(&self, signal: &str) {
        let _ = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status();
    }

    pub fn wait_code(&mut self, timeout: Duration) -> Option<i32> {
        let start = Instant::now();
        while start.elapsed() < timeout {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Streaming {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `conclave member add NAME --peer-url http://PEER --learner --json` through `eps`: the
/// answer's `data` and the `serve_flags` it prints for starting the new member.
pub fn member_add_learner(eps: &str, name: &str, peer: &str) -> (Value, Vec<String>) {
    let added = run(
        eps,
        &[
            "member",
            "add",
            name,
            "--peer-url",
            &format!("http://{peer}"),
            "--learner",
            "--json",
        ],
    )
    .data();
    assert_eq!(added["member"]["learner"], true, "{added}");
    let flags = added["serve_flags"]
        .as_array()
        .map(|f| {
            f.iter()
                .filter_map(|x| x.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    (added, flags)
}
