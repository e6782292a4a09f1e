//! Recorded histories in Jepsen's convention: every operation is an `invoke` followed by one
//! completion, `ok` (it happened, with this result), `fail` (it certainly did not happen) or
//! `info` (unknown: it may have happened, at any time after its invocation).

use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The four kinds of history events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Invoke,
    Ok,
    Fail,
    Info,
}

/// One line of a history file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// The logical client that issued the operation; one operation at a time per process.
    pub process: u64,
    #[serde(rename = "type")]
    pub kind: Kind,
    /// Operation name (`read`, `write`, `cas`, `acquire`, ...).
    pub f: String,
    /// The key or object the operation is about.
    pub key: String,
    /// Arguments on invoke, the result on completion.
    pub value: Value,
    /// Microseconds since the run's start, on the harness's monotonic clock.
    pub time_us: u64,
}

/// A thread-safe history shared by a workload's clients.
#[derive(Clone)]
pub struct Recorder {
    start: Instant,
    events: Arc<Mutex<Vec<Event>>>,
}

impl Recorder {
    pub fn new(start: Instant) -> Recorder {
        Recorder {
            start,
            events: Arc::new(Mutex::new(Vec::new())),
        }
    }

    /// Microseconds since the run's start.
    pub fn now_us(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// Converts an `Instant` taken during the run into the history's clock.
    pub fn at_us(&self, instant: Instant) -> u64 {
        u64::try_from(instant.saturating_duration_since(self.start).as_micros()).unwrap_or(u64::MAX)
    }

    /// Appends an event stamped now; returns the stamp.
    pub fn record(&self, process: u64, kind: Kind, f: &str, key: &str, value: Value) -> u64 {
        self.push(None, process, kind, f, key, value)
    }

    /// Appends an event stamped `time_us`, an earlier reading of [`Recorder::now_us`]: for a
    /// history with one process (the nemesis's), whose start is known only once it is over.
    /// The stamp never goes below the last event's, so the file stays in time order.
    pub fn record_started(
        &self,
        time_us: u64,
        process: u64,
        kind: Kind,
        f: &str,
        key: &str,
        value: Value,
    ) -> u64 {
        self.push(Some(time_us), process, kind, f, key, value)
    }

    fn push(
        &self,
        started_us: Option<u64>,
        process: u64,
        kind: Kind,
        f: &str,
        key: &str,
        value: Value,
    ) -> u64 {
        let mut events = self
            .events
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        // Stamped under the lock so the file's order is the time order.
        let floor_us = events.last().map_or(0, |last| last.time_us);
        let time_us = started_us.unwrap_or_else(|| self.now_us()).max(floor_us);
        events.push(Event {
            process,
            kind,
            f: f.to_string(),
            key: key.to_string(),
            value,
            time_us,
        });
        time_us
    }

    pub fn events(&self) -> Vec<Event> {
        self.events
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    /// Writes the history as JSON lines.
    pub fn write_to(&self, path: &Path) -> std::io::Result<()> {
        write_events(path, &self.events())
    }
}

pub fn write_events(path: &Path, events: &[Event]) -> std::io::Result<()> {
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    for event in events {
        serde_json::to_writer(&mut out, event)?;
        out.write_all(b"\n")?;
    }
    out.flush()
}

/// Reads a history written by [`write_events`].
pub fn read_events(path: &Path) -> Result<Vec<Event>, crate::Error> {
    let text = std::fs::read_to_string(path).map_err(|source| crate::Error::Io {
        what: format!("read {}", path.display()),
        source,
    })?;
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(n, line)| {
            serde_json::from_str(line).map_err(|e| crate::Error::BadHistory {
                file: path.display().to_string(),
                line: n + 1,
                reason: e.to_string(),
            })
        })
        .collect()
}

/// An operation paired from its invoke and completion events.
#[derive(Debug, Clone, PartialEq)]
pub struct Op {
    pub process: u64,
    pub f: String,
    pub key: String,
    pub args: Value,
    /// `Ok`, `Fail` or `Info` (an invoke with no completion counts as `Info`).
    pub outcome: Kind,
    pub result: Value,
    pub invoke_us: u64,
    /// `u64::MAX` for `Info`: it may take effect at any later time.
    pub complete_us: u64,
}

/// Pairs each process's invoke with its next completion. Events are taken in order.
pub fn pair(events: &[Event]) -> Result<Vec<Op>, String> {
    let mut open: std::collections::BTreeMap<u64, Op> = std::collections::BTreeMap::new();
    let mut ops = Vec::new();
    for event in events {
        match event.kind {
            Kind::Invoke => {
                let op = Op {
                    process: event.process,
                    f: event.f.clone(),
                    key: event.key.clone(),
                    args: event.value.clone(),
                    outcome: Kind::Info,
                    result: Value::Null,
                    invoke_us: event.time_us,
                    complete_us: u64::MAX,
                };
                if let Some(previous) = open.insert(event.process, op) {
                    return Err(format!(
                        "process {} invoked {} while its {} was still open",
                        event.process, event.f, previous.f
                    ));
                }
            }
            kind => {
                let Some(mut op) = open.remove(&event.process) else {
                    return Err(format!(
                        "process {} completed {} without an invoke",
                        event.process, event.f
                    ));
                };
                op.outcome = kind;
                op.result = event.value.clone();
                op.complete_us = if kind == Kind::Info {
                    u64::MAX
                } else {
                    event.time_us
                };
                ops.push(op);
            }
        }
    }
    ops.extend(open.into_values());
    ops.sort_by_key(|op| op.invoke_us);
    Ok(ops)
}
