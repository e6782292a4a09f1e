//! Test helpers: a state machine driven with increasing indexes and an explicit leader clock.

#![allow(dead_code)]

use bytes::Bytes;
use conclave_state::{
    ApplyOutput, Command, Config, Event, GroupPolicy, GroupRegister, GroupStatus, PutRequest,
    QueueResponse, Request, Response, StateMachine,
};

pub const ELECTION_TIMEOUT_MS: u64 = 1000;

pub struct Driver {
    pub machine: StateMachine,
    pub index: u64,
    pub now_ms: u64,
}

impl Driver {
    pub fn new() -> Self {
        let config = Config {
            election_timeout_ms: ELECTION_TIMEOUT_MS,
            ..Config::default()
        };
        Driver::with_config(config)
    }

    pub fn with_config(config: Config) -> Self {
        Driver {
            machine: StateMachine::new(config),
            index: 0,
            now_ms: 0,
        }
    }

    pub fn apply(&mut self, request: Request) -> ApplyOutput {
        self.index += 1;
        self.machine
            .apply(self.index, &Command::new(self.now_ms, request))
    }

    pub fn ok(&mut self, request: Request) -> Response {
        let output = self.apply(request.clone());
        match output.result {
            Ok(response) => response,
            Err(error) => panic!("{request:?} failed: {error}"),
        }
    }

    pub fn grant(&mut self, ttl_ms: u64) -> i64 {
        match self.ok(Request::LeaseGrant { id: 0, ttl_ms }) {
            Response::LeaseGranted { id, .. } => id,
            other => panic!("unexpected {other:?}"),
        }
    }

    pub fn put(&mut self, key: &str, value: &str, lease: i64) -> i64 {
        let request = PutRequest {
            lease,
            ..PutRequest::new(key.to_owned(), value.to_owned())
        };
        self.apply(Request::Put(request)).revision
    }

    pub fn register(
        &mut self,
        group: &str,
        candidate: &str,
        priority: i64,
        lease_id: i64,
    ) -> ApplyOutput {
        self.apply(Request::GroupRegister(GroupRegister {
            group: group.into(),
            candidate: candidate.into(),
            priority,
            value: Bytes::from(format!("addr-of-{candidate}")),
            lease_id,
            preempt: false,
        }))
    }

    pub fn configure(&mut self, group: &str, policy: GroupPolicy) -> GroupStatus {
        match self.ok(Request::GroupConfigure {
            group: group.into(),
            policy,
        }) {
            Response::Group(status) => status,
            other => panic!("unexpected {other:?}"),
        }
    }

    pub fn lock(&mut self, name: &str, lease: i64) -> QueueResponse {
        match self.ok(Request::Lock {
            name: Bytes::from(name.to_owned()),
            lease,
        }) {
            Response::Lock(response) => response,
            other => panic!("unexpected {other:?}"),
        }
    }

    pub fn leader_of(&self, group: &str) -> Option<String> {
        self.machine
            .group_leader(group)
            .map(|seat| seat.leader.clone())
    }

    pub fn expire(&mut self, id: i64) {
        self.ok(Request::LeaseExpire { ids: vec![id] });
    }
}

pub fn election_events(events: &[Event]) -> Vec<&conclave_state::ElectionEventKind> {
    events
        .iter()
        .filter_map(|event| match event {
            Event::Election(election) => Some(&election.kind),
            _ => None,
        })
        .collect()
}
