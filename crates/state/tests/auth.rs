//! Auth through the log: permissions checked at apply time, auth state in snapshots.

use bytes::Bytes;
use conclave_state::{
    AuthRequest, Command, Config, Error, GroupRegister, KeyPermission, PermissionKind, PutRequest,
    RangeRequest, Request, Response, StateMachine,
};

struct Log {
    machine: StateMachine,
    index: u64,
}

impl Log {
    fn new() -> Log {
        Log {
            machine: StateMachine::new(Config::default()),
            index: 0,
        }
    }

    fn apply(&mut self, request: Request) -> Result<Response, Error> {
        self.index += 1;
        self.machine
            .apply(self.index, &Command::new(self.index, request))
            .result
    }

    fn as_user(&mut self, user: &str, request: Request) -> Result<Response, Error> {
        self.apply(Request::AsUser {
            user: user.into(),
            request: Box::new(request),
        })
    }

    fn auth(&mut self, change: AuthRequest) {
        let result = self.apply(Request::Auth(change.clone()));
        assert!(result.is_ok(), "{change:?}: {result:?}");
    }
}

fn grant(
    role: &str,
    kind: PermissionKind,
    key: &'static str,
    range_end: &'static str,
) -> AuthRequest {
    AuthRequest::RoleGrantPermission {
        name: role.into(),
        permission: KeyPermission {
            kind,
            key: Bytes::from_static(key.as_bytes()),
            range_end: Bytes::from_static(range_end.as_bytes()),
        },
    }
}

/// root (root role), alice (read on a/), crew (readwrite on crew/), auth enabled.
fn setup() -> Log {
    let mut log = Log::new();
    for (user, role) in [("root", "root"), ("alice", "reader"), ("carol", "crew")] {
        log.auth(AuthRequest::UserAdd {
            name: user.into(),
            password_hash: "$2b$04$notarealhash".into(),
        });
        if role != "root" {
            log.auth(AuthRequest::RoleAdd { name: role.into() });
        }
        log.auth(AuthRequest::UserGrantRole {
            user: user.into(),
            role: role.into(),
        });
    }
    log.auth(grant("reader", PermissionKind::Read, "a/", "a0"));
    log.auth(grant("crew", PermissionKind::ReadWrite, "crew/", "crew0"));
    log.auth(AuthRequest::Enable { token_key: [9; 32] });
    log
}

fn put(key: &str) -> Request {
    Request::Put(PutRequest::new(key.to_string(), "v"))
}

#[test]
fn a_reader_reads_its_prefix_and_writes_nothing() {
    let mut log = setup();
    assert!(log.as_user("root", put("a/x")).is_ok());
    let revision = log.machine.revision();
    assert_eq!(
        log.as_user("alice", put("a/x")),
        Err(Error::PermissionDenied)
    );
    assert_eq!(
        log.machine.revision(),
        revision,
        "a refused write changed the store"
    );
    let read = |key: &str| Request::Range(RangeRequest::key(key.to_string()));
    assert!(matches!(
        log.as_user("alice", read("a/x")),
        Ok(Response::Range(_))
    ));
    assert_eq!(
        log.as_user("alice", read("b/x")),
        Err(Error::PermissionDenied)
    );
    assert_eq!(log.as_user("", read("a/x")), Err(Error::UserEmpty));
    assert_eq!(
        log.as_user("mallory", read("a/x")),
        Err(Error::PermissionDenied)
    );
    // Auth changes and compaction are root's.
    assert_eq!(
        log.as_user("alice", Request::Auth(AuthRequest::Disable)),
        Err(Error::PermissionDenied)
    );
    assert_eq!(
        log.as_user("alice", Request::Compact { revision: 1 }),
        Err(Error::PermissionDenied)
    );
    assert!(
        log.as_user("root", Request::Auth(AuthRequest::Disable))
            .is_ok()
    );
    assert!(
        log.as_user("alice", put("b/x")).is_ok(),
        "disabled auth checks nothing"
    );
}

#[test]
fn a_permission_revoked_earlier_in_the_log_refuses_the_write() {
    let mut log = setup();
    assert!(log.as_user("carol", put("crew/k")).is_ok());
    log.auth(AuthRequest::RoleRevokePermission {
        name: "crew".into(),
        key: Bytes::from_static(b"crew/"),
        range_end: Bytes::from_static(b"crew0"),
    });
    assert_eq!(
        log.as_user("carol", put("crew/k")),
        Err(Error::PermissionDenied)
    );
}

#[test]
fn elections_locks_groups_and_topics_map_to_keys() {
    let mut log = setup();
    let Ok(Response::LeaseGranted { id: lease, .. }) = log.as_user(
        "carol",
        Request::LeaseGrant {
            id: 0,
            ttl_ms: 60_000,
        },
    ) else {
        panic!("anyone may grant a lease");
    };
    let campaign = |name: &'static str| Request::Campaign {
        name: Bytes::from_static(name.as_bytes()),
        lease,
        value: Bytes::from_static(b"me"),
    };
    assert!(matches!(
        log.as_user("carol", campaign("crew/a")),
        Ok(Response::Campaign(_))
    ));
    assert_eq!(
        log.as_user("carol", campaign("ops")),
        Err(Error::PermissionDenied)
    );
    let lock = |name: &'static str| Request::Lock {
        name: Bytes::from_static(name.as_bytes()),
        lease,
    };
    assert!(log.as_user("carol", lock("crew/l")).is_ok());
    assert_eq!(
        log.as_user("carol", lock("db")),
        Err(Error::PermissionDenied)
    );
    let register = |group: &str| {
        Request::GroupRegister(GroupRegister {
            group: group.into(),
            candidate: "c1".into(),
            priority: 1,
            lease_id: lease,
            ..GroupRegister::default()
        })
    };
    assert!(log.as_user("carol", register("crew/g")).is_ok());
    assert_eq!(
        log.as_user("carol", register("other")),
        Err(Error::PermissionDenied)
    );
    let publish = |topic: &str| Request::Publish {
        topic: topic.into(),
        data: Bytes::from_static(b"x"),
    };
    assert!(log.as_user("carol", publish("crew/tasks")).is_ok());
    assert_eq!(
        log.as_user("carol", publish("tasks")),
        Err(Error::PermissionDenied)
    );
    // Revoking the lease deletes crew/ keys only: allowed for carol, not for alice.
    assert_eq!(
        log.as_user("alice", Request::LeaseRevoke { id: lease }),
        Err(Error::PermissionDenied)
    );
    assert!(
        log.as_user("carol", Request::LeaseRevoke { id: lease })
            .is_ok()
    );
}

#[test]
fn nested_identities_are_refused() {
    let mut log = setup();
    let nested = Request::AsUser {
        user: "root".into(),
        request: Box::new(put("b/x")),
    };
    assert!(matches!(
        log.as_user("alice", nested),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn auth_state_survives_a_snapshot() {
    let log = setup();
    let bytes = log.machine.snapshot_to_vec();
    let restored = StateMachine::restore(Config::default(), bytes.as_slice()).expect("restores");
    assert_eq!(restored.auth(), log.machine.auth());
    let mut follower = Log {
        machine: restored,
        index: log.index,
    };
    assert_eq!(
        follower.as_user("alice", put("a/x")),
        Err(Error::PermissionDenied)
    );
    assert!(follower.as_user("carol", put("crew/x")).is_ok());
}

/// Rewrites a one-frame snapshot image with a new body and version.
fn reframe(image: &[u8], version: u32, body: &[u8]) -> Vec<u8> {
    let mut out = image[..8].to_vec();
    out.extend_from_slice(&version.to_le_bytes());
    let length = u32::try_from(body.len()).expect("small");
    out.extend_from_slice(&length.to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(body).to_le_bytes());
    out.extend_from_slice(body);
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(body).to_le_bytes());
    out
}

#[test]
fn a_version_3_image_without_auth_still_loads() {
    let mut log = Log::new();
    log.apply(put("k")).expect("put");
    let image = log.machine.snapshot_to_vec();
    let length = u32::from_le_bytes(image[12..16].try_into().expect("4 bytes"));
    let body = &image[20..20 + usize::try_from(length).expect("fits")];
    // The default auth section: enabled, revision, users, roles, 32 key bytes, generations.
    let auth_section = 1 + 1 + 1 + 1 + 32 + 1;
    // After it, the work queues' section: an empty map and three counters, a byte each.
    let queues_section = 4;
    // Then (format 5) the senders of topic messages and the `never` groups: two empty lists,
    // a byte each.
    let senders_section = 2;
    let v3_body = &body[..body.len() - auth_section - queues_section - senders_section];
    let restored = StateMachine::restore(Config::default(), reframe(&image, 3, v3_body).as_slice())
        .expect("a version 3 image loads");
    assert_eq!(restored.revision(), log.machine.revision());
    assert!(!restored.auth().enabled);
    // The control: the same body labelled version 4 lacks its auth section.
    assert!(
        StateMachine::restore(Config::default(), reframe(&image, 4, v3_body).as_slice()).is_err()
    );
}

#[test]
fn a_txn_needs_every_compare_and_both_branches() {
    use conclave_state::{Compare, CompareResult, CompareTarget, RequestOp, TxnRequest};
    let mut log = setup();
    log.auth(grant("reader", PermissionKind::ReadWrite, "a/w", ""));
    let txn = |compare: &'static str, success: &'static str, failure: &'static str| {
        Request::Txn(TxnRequest {
            compare: vec![Compare::new(
                compare,
                CompareResult::Equal,
                CompareTarget::Version(0),
            )],
            success: vec![RequestOp::Put(PutRequest::new(success, "v"))],
            failure: vec![RequestOp::Range(RangeRequest::key(failure))],
        })
    };
    assert!(log.as_user("alice", txn("a/x", "a/w", "a/y")).is_ok());
    // A compare outside the reader's range.
    assert_eq!(
        log.as_user("alice", txn("b/x", "a/w", "a/y")),
        Err(Error::PermissionDenied)
    );
    // A write it may not make, even in the branch that would not run.
    assert_eq!(
        log.as_user("alice", txn("a/x", "a/x", "a/y")),
        Err(Error::PermissionDenied)
    );
    assert_eq!(
        log.as_user("alice", txn("a/x", "a/w", "b/y")),
        Err(Error::PermissionDenied)
    );
}
