//! Scenario scripts: `testdata/*.txt` drive the state machine and compare a stable text
//! description of every answer and event with the expected output. Regenerate the expected
//! output with `REWRITE=1 cargo test -p conclave-state --test scripts`.
//!
//! A case is a command line, `----`, the expected output, and a blank line. Commands:
//! `time ms=N` · `grant id=N ttl=MS` · `revoke id=N` · `expire ids=N,N` ·
//! `checkpoint id=N [deadline=MS]` · `put key=K value=V [lease=N]` · `delete key=K [end=E]` ·
//! `get key=K` · `register group=G candidate=C priority=P lease=N [preempt] [value=V]` ·
//! `resign group=G candidate=C lease=N` · `proclaim group=G candidate=C fence=F value=V` ·
//! `configure group=G [preempt] [handoff=MS] [settle=MS]` · `leader group=G` · `tick` ·
//! `lock name=L lease=N` · `unlock key=K [fence=F]` · `status name=L key=K fence=F` ·
//! `publish topic=T data=D` · `ack consumer=C topic=T seq=N` · `inbox consumer=C topics=T,T`.

// Lines of a golden file are easier to read than to wrap.
#![allow(clippy::too_many_lines)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use bytes::Bytes;
use conclave_state::{
    ApplyOutput, Command, Config, DeleteRangeRequest, ElectionEventKind, Event, EventKind,
    GroupPolicy, GroupRegister, LeaseCheckpoint, PutRequest, Request, Response, StateMachine,
};

struct Script {
    machine: StateMachine,
    index: u64,
    now_ms: u64,
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn describe_event(event: &Event) -> String {
    match event {
        Event::Kv(watch) => match watch.kind {
            EventKind::Put => format!(
                "watch: put {}={} rev={} create={} ver={} lease={}",
                text(&watch.kv.key),
                text(&watch.kv.value),
                watch.kv.mod_revision,
                watch.kv.create_revision,
                watch.kv.version,
                watch.kv.lease
            ),
            EventKind::Delete => format!(
                "watch: delete {} rev={}",
                text(&watch.kv.key),
                watch.kv.mod_revision
            ),
        },
        Event::Election(election) => {
            let what = match &election.kind {
                ElectionEventKind::Elected {
                    leader,
                    priority,
                    value,
                    fence,
                } => {
                    format!(
                        "elected {leader} priority={priority} value={} fence={fence}",
                        text(value)
                    )
                }
                ElectionEventKind::HandoffRequested {
                    leader,
                    challenger,
                    challenger_priority,
                    deadline_ms,
                } => {
                    format!(
                        "handoff-requested {leader} -> {challenger} (priority {challenger_priority}) deadline={deadline_ms:?}"
                    )
                }
                ElectionEventKind::HandoffCancelled { leader } => {
                    format!("handoff-cancelled {leader} keeps the seat")
                }
                ElectionEventKind::Vacant => "vacant".to_owned(),
                ElectionEventKind::ValueChanged {
                    leader,
                    value,
                    fence,
                } => {
                    format!("value-changed {leader} value={} fence={fence}", text(value))
                }
                ElectionEventKind::CandidatesChanged { candidates } => {
                    let list: Vec<String> = candidates
                        .iter()
                        .map(|c| format!("{}:{}", c.id, c.priority))
                        .collect();
                    format!("candidates [{}]", list.join(" "))
                }
            };
            format!(
                "group {} term={} rev={}: {what}",
                election.group, election.term, election.revision
            )
        }
        Event::Topic(message) => {
            format!(
                "topic {}#{} rev={} data={}",
                message.topic,
                message.seq,
                message.revision,
                text(&message.data)
            )
        }
        Event::Queue(queue) => format!("queue {queue} changed"),
    }
}

fn describe_response(response: &Response) -> String {
    match response {
        Response::Group(status) => match &status.seat {
            Some(seat) => {
                let handoff = seat
                    .handoff
                    .as_ref()
                    .map(|h| format!(" handoff->{}", h.challenger))
                    .unwrap_or_default();
                format!(
                    "group {} term={} leader={} fence={}{handoff}",
                    status.group, status.term, seat.leader, seat.fence
                )
            }
            None => format!("group {} term={} vacant", status.group, status.term),
        },
        Response::Lock(lock) | Response::Campaign(lock) => format!(
            "key={} fence={} owner={} waiting_for={}",
            text(&lock.key),
            lock.fence,
            lock.owner,
            lock.waiting_for
                .as_ref()
                .map(|kv| text(&kv.key))
                .unwrap_or_else(|| "-".into())
        ),
        Response::Put(_) => "put".to_owned(),
        Response::DeleteRange(delete) => format!("deleted={}", delete.deleted),
        other => format!("{other:?}"),
    }
}

impl Script {
    fn apply(&mut self, request: Request) -> String {
        self.index += 1;
        let output: ApplyOutput = self
            .machine
            .apply(self.index, &Command::new(self.now_ms, request));
        let mut out = match &output.result {
            Ok(response) => format!(
                "rev={} ok: {}\n",
                output.revision,
                describe_response(response)
            ),
            Err(error) => format!("rev={} error {}: {error}\n", output.revision, error.code()),
        };
        for event in &output.events {
            let _ = writeln!(out, "  {}", describe_event(event));
        }
        out
    }

    fn run(&mut self, line: &str) -> String {
        let mut words = line.split_whitespace();
        let verb = words.next().unwrap_or_default();
        let mut args: BTreeMap<&str, &str> = BTreeMap::new();
        for word in words {
            let (key, value) = word.split_once('=').unwrap_or((word, ""));
            args.insert(key, value);
        }
        let string = |name: &str| args.get(name).map(|v| v.to_string()).unwrap_or_default();
        let number = |name: &str| {
            args.get(name)
                .and_then(|v| v.parse::<i64>().ok())
                .unwrap_or(0)
        };
        let optional = |name: &str| args.get(name).and_then(|v| v.parse::<u64>().ok());
        let bytes = |name: &str| Bytes::from(string(name));
        match verb {
            "time" => {
                self.now_ms = number("ms") as u64;
                format!("now={}\n", self.now_ms)
            }
            "grant" => self.apply(Request::LeaseGrant {
                id: number("id"),
                ttl_ms: number("ttl") as u64,
            }),
            "revoke" => self.apply(Request::LeaseRevoke { id: number("id") }),
            "expire" => {
                let ids = string("ids")
                    .split(',')
                    .filter_map(|id| id.parse().ok())
                    .collect();
                self.apply(Request::LeaseExpire { ids })
            }
            "checkpoint" => self.apply(Request::LeaseCheckpoint {
                checkpoints: vec![LeaseCheckpoint {
                    id: number("id"),
                    deadline_ms: optional("deadline"),
                }],
            }),
            "put" => self.apply(Request::Put(PutRequest {
                lease: number("lease"),
                ..PutRequest::new(bytes("key"), bytes("value"))
            })),
            "delete" => self.apply(Request::DeleteRange(DeleteRangeRequest {
                key: bytes("key"),
                range_end: bytes("end"),
                prev_kv: false,
            })),
            "get" => match self.machine.kv().get(string("key").as_bytes()) {
                Some(kv) => format!(
                    "{}={} create={} mod={} ver={} lease={}\n",
                    text(&kv.key),
                    text(&kv.value),
                    kv.create_revision,
                    kv.mod_revision,
                    kv.version,
                    kv.lease
                ),
                None => "absent\n".to_owned(),
            },
            "register" => self.apply(Request::GroupRegister(GroupRegister {
                group: string("group"),
                candidate: string("candidate"),
                priority: number("priority"),
                value: bytes("value"),
                lease_id: number("lease"),
                preempt: args.contains_key("preempt"),
            })),
            "resign" => self.apply(Request::GroupResign {
                group: string("group"),
                candidate: string("candidate"),
                lease_id: number("lease"),
            }),
            "proclaim" => self.apply(Request::GroupProclaim {
                group: string("group"),
                candidate: string("candidate"),
                fence: number("fence"),
                value: bytes("value"),
            }),
            "configure" => self.apply(Request::GroupConfigure {
                group: string("group"),
                policy: GroupPolicy {
                    preempt_never: false,
                    preempt: args.contains_key("preempt"),
                    handoff_timeout_ms: optional("handoff"),
                    settle_ms: optional("settle"),
                },
            }),
            "leader" => {
                let group = string("group");
                let succession: Vec<String> = self
                    .machine
                    .group_succession(&group)
                    .iter()
                    .map(|c| format!("{}:{}", c.id, c.priority))
                    .collect();
                match self.machine.group_leader(&group) {
                    Some(seat) => format!(
                        "leader={} fence={} handoff={} succession=[{}]\n",
                        seat.leader,
                        seat.fence,
                        seat.handoff.as_ref().map_or("-", |h| h.challenger.as_str()),
                        succession.join(" ")
                    ),
                    None => format!("vacant succession=[{}]\n", succession.join(" ")),
                }
            }
            "tick" => self.apply(Request::Tick),
            "lock" => self.apply(Request::Lock {
                name: bytes("name"),
                lease: number("lease"),
            }),
            "unlock" => self.apply(Request::Unlock {
                key: bytes("key"),
                fence: optional("fence").map(|f| f as i64),
            }),
            "status" => format!(
                "{:?}\n",
                self.machine.queue_status(
                    string("name").as_bytes(),
                    string("key").as_bytes(),
                    number("fence")
                )
            ),
            "publish" => self.apply(Request::Publish {
                topic: string("topic"),
                data: bytes("data"),
            }),
            "ack" => self.apply(Request::Ack {
                consumer: string("consumer"),
                topic: string("topic"),
                seq: number("seq") as u64,
            }),
            "inbox" => {
                let topics: Vec<String> = string("topics").split(',').map(str::to_owned).collect();
                let mut out = String::new();
                for read in self.machine.inbox(&string("consumer"), &topics, 0) {
                    let seqs: Vec<String> = read
                        .messages
                        .iter()
                        .map(|m| format!("{}:{}", m.seq, text(&m.data)))
                        .collect();
                    let _ = writeln!(
                        out,
                        "{} acked={} unread=[{}]",
                        read.topic,
                        read.acked_seq,
                        seqs.join(" ")
                    );
                }
                out
            }
            other => format!("unknown command {other:?}\n"),
        }
    }
}

fn run_file(path: &Path) {
    let input = std::fs::read_to_string(path).expect("read testdata");
    let mut script = Script {
        machine: StateMachine::new(Config::default()),
        index: 0,
        now_ms: 0,
    };
    let mut rewritten = String::new();
    let mut failures = Vec::new();
    let mut lines = input.lines().peekable();
    while let Some(line) = lines.next() {
        if line.trim().is_empty() || line.starts_with('#') {
            rewritten.push_str(line);
            rewritten.push('\n');
            continue;
        }
        let command = line.to_owned();
        let mut expected = String::new();
        if lines.peek() == Some(&"----") {
            lines.next();
            while let Some(next) = lines.peek() {
                if next.is_empty() {
                    break;
                }
                expected.push_str(next);
                expected.push('\n');
                lines.next();
            }
        }
        let actual = script.run(&command);
        if actual != expected {
            failures.push(format!("{command}\nexpected:\n{expected}actual:\n{actual}"));
        }
        let _ = write!(rewritten, "{command}\n----\n{actual}");
    }
    script.machine.check_invariants();
    if std::env::var_os("REWRITE").is_some() {
        std::fs::write(path, rewritten).expect("rewrite testdata");
        return;
    }
    assert!(
        failures.is_empty(),
        "{}: {} mismatches\n{}",
        path.display(),
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn testdata_scripts() {
    let directory = Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata");
    let mut files: Vec<_> = std::fs::read_dir(&directory)
        .expect("testdata directory")
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "txt"))
        .collect();
    files.sort();
    assert!(!files.is_empty());
    for file in files {
        run_file(&file);
    }
}
