//! Replicated authentication state: etcd's users, roles and key-range permissions.
//!
//! Every change goes through the log as a [`AuthRequest`], so every member holds the same
//! users and roles and enforces the same permissions. Passwords never enter the log: the
//! member that receives `UserAdd`/`UserChangePassword` hashes them (bcrypt) and proposes the
//! hash. Client writes are proposed as [`crate::Request::AsUser`], and the permission check
//! runs here, at apply time, against the auth state at that point of the log; a permission
//! revoked before a write is applied refuses that write on every member.
//!
//! Semantics follow etcd 3.4's auth store: the `root` user must exist and hold the `root`
//! role before auth can be enabled; the `root` role grants everything (and is the only one
//! allowed to manage auth, compact and run maintenance); while auth is enabled the root user
//! cannot be deleted nor lose the root role, and the root role cannot be deleted. A
//! permission covers one key (`range_end` empty), the interval `[key, range_end)`, or every
//! key from `key` on (`range_end` = `"\0"`); a request is permitted when the union of the
//! user's roles' intervals covers its whole range.

use std::collections::BTreeMap;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The user that must exist (with [`ROOT_ROLE`]) before auth is enabled.
pub const ROOT_USER: &str = "root";
/// The role that grants every permission and auth management.
pub const ROOT_ROLE: &str = "root";
/// Longest user or role name, in bytes.
pub const AUTH_NAME_BYTES_MAX: usize = 1024;
/// Longest stored password hash, in bytes (a bcrypt hash is 60).
pub const PASSWORD_HASH_BYTES_MAX: usize = 256;
/// Most users the store holds.
pub const USERS_MAX: usize = 10_000;
/// Most roles the store holds.
pub const ROLES_MAX: usize = 10_000;
/// Most roles one user holds.
pub const USER_ROLES_MAX: usize = 256;
/// Most key-range permissions one role holds.
pub const ROLE_PERMISSIONS_MAX: usize = 1024;
/// Longest key or range end in a permission, in bytes.
pub const PERMISSION_KEY_BYTES_MAX: usize = 64 * 1024;

/// What a permission allows (etcd's `authpb.Permission.Type`, same numbering).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum PermissionKind {
    /// Range, watch, compare.
    Read,
    /// Put, delete, and the writes of elections, locks and topics.
    Write,
    /// Both.
    ReadWrite,
}

impl PermissionKind {
    /// Whether a permission of this kind allows `wanted`.
    pub fn allows(self, wanted: PermissionKind) -> bool {
        self == PermissionKind::ReadWrite || self == wanted
    }
}

/// One key-range permission of a role.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyPermission {
    /// Read, write or both.
    pub kind: PermissionKind,
    /// The first key.
    pub key: Bytes,
    /// Empty: `key` alone; `"\0"`: every key from `key` on; otherwise the end, exclusive.
    pub range_end: Bytes,
}

/// A user.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct User {
    /// The name.
    pub name: String,
    /// The bcrypt hash of the password; empty for a user added with `no_password`, who can
    /// only be identified by a client certificate.
    pub password_hash: String,
    /// Granted roles, sorted, without duplicates.
    pub roles: Vec<String>,
    /// Bumped on every password change: tokens name the generation they were issued for, so
    /// a new password (or deleting and re-adding the user) ends the old tokens.
    pub generation: u64,
}

/// A role: a name and its key-range permissions.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Role {
    /// The name.
    pub name: String,
    /// Permissions, sorted by (key, range_end), at most one per (key, range_end).
    pub permissions: Vec<KeyPermission>,
}

/// The replicated auth state (a section of the snapshot image).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuthState {
    /// Whether requests are checked.
    pub enabled: bool,
    /// etcd's auth revision: bumped by every successful change.
    pub revision: u64,
    /// Users by name.
    pub users: BTreeMap<String, User>,
    /// Roles by name.
    pub roles: BTreeMap<String, Role>,
    /// The key members sign tokens with, chosen at random by the member that proposed the
    /// last AuthEnable (so re-enabling ends every earlier token).
    pub token_key: [u8; 32],
    /// Counts every user ever added, so a re-added user's tokens differ from the old ones.
    pub generations_issued: u64,
}

/// A change to the auth state, proposed through the log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AuthRequest {
    /// Turn checking on; needs the root user with the root role.
    Enable {
        /// A fresh random token signing key.
        token_key: [u8; 32],
    },
    /// Turn checking off.
    Disable,
    /// Add a user.
    UserAdd {
        /// The name.
        name: String,
        /// bcrypt hash of the password, or empty for a user without a password.
        password_hash: String,
    },
    /// Delete a user.
    UserDelete {
        /// The name.
        name: String,
    },
    /// Replace a user's password hash.
    UserChangePassword {
        /// The name.
        name: String,
        /// The new bcrypt hash.
        password_hash: String,
    },
    /// Grant a role to a user.
    UserGrantRole {
        /// The user.
        user: String,
        /// The role.
        role: String,
    },
    /// Revoke a role from a user.
    UserRevokeRole {
        /// The user.
        user: String,
        /// The role.
        role: String,
    },
    /// Add a role.
    RoleAdd {
        /// The name.
        name: String,
    },
    /// Delete a role (and take it from every user).
    RoleDelete {
        /// The name.
        name: String,
    },
    /// Add a permission to a role, or change the kind of the one on the same range.
    RoleGrantPermission {
        /// The role.
        name: String,
        /// The permission.
        permission: KeyPermission,
    },
    /// Remove the permission on exactly this range from a role.
    RoleRevokePermission {
        /// The role.
        name: String,
        /// The permission's key.
        key: Bytes,
        /// The permission's range end.
        range_end: Bytes,
    },
}

/// A range a request touches, and how.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Access {
    /// Read or write.
    pub kind: PermissionKind,
    /// First key.
    pub key: Bytes,
    /// etcd range end (empty: `key` alone; `"\0"`: everything from `key`).
    pub range_end: Bytes,
}

impl Access {
    /// A read of `[key, range_end)`.
    pub fn read(key: impl Into<Bytes>, range_end: impl Into<Bytes>) -> Access {
        Access {
            kind: PermissionKind::Read,
            key: key.into(),
            range_end: range_end.into(),
        }
    }

    /// A write of `[key, range_end)`.
    pub fn write(key: impl Into<Bytes>, range_end: impl Into<Bytes>) -> Access {
        Access {
            kind: PermissionKind::Write,
            key: key.into(),
            range_end: range_end.into(),
        }
    }
}

/// The half-open interval a key/range_end pair denotes; `None` as the end is "no end".
fn interval(key: &[u8], range_end: &[u8]) -> (Vec<u8>, Option<Vec<u8>>) {
    if range_end.is_empty() {
        // The single key `key` is the interval [key, key + "\0").
        let mut end = key.to_vec();
        end.push(0);
        (key.to_vec(), Some(end))
    } else if range_end == [0] {
        (key.to_vec(), None)
    } else {
        (key.to_vec(), Some(range_end.to_vec()))
    }
}

fn check_name(name: &str, empty: Error) -> Result<()> {
    if name.is_empty() {
        return Err(empty);
    }
    if name.len() > AUTH_NAME_BYTES_MAX {
        return Err(Error::RequestTooLarge);
    }
    Ok(())
}

fn check_hash(hash: &str) -> Result<()> {
    if hash.len() > PASSWORD_HASH_BYTES_MAX {
        return Err(Error::RequestTooLarge);
    }
    Ok(())
}

impl AuthState {
    /// Whether `user` holds the root role.
    pub fn is_root(&self, user: &str) -> bool {
        self.users
            .get(user)
            .is_some_and(|u| u.roles.iter().any(|r| r == ROOT_ROLE))
    }

    /// etcd's check for auth management, compaction and maintenance: with auth enabled,
    /// only a holder of the root role.
    pub fn check_admin(&self, user: &str) -> Result<()> {
        if !self.enabled {
            return Ok(());
        }
        self.check_user(user)?;
        if self.is_root(user) {
            Ok(())
        } else {
            Err(Error::PermissionDenied)
        }
    }

    fn check_user(&self, user: &str) -> Result<()> {
        if user.is_empty() {
            return Err(Error::UserEmpty);
        }
        if !self.users.contains_key(user) {
            return Err(Error::PermissionDenied);
        }
        Ok(())
    }

    /// Whether `user` may make every access in `accesses` (all allowed when auth is off).
    pub fn check_access(&self, user: &str, accesses: &[Access]) -> Result<()> {
        if !self.enabled {
            return Ok(());
        }
        self.check_user(user)?;
        if self.is_root(user) {
            return Ok(());
        }
        for access in accesses {
            if !self.covers(user, access) {
                return Err(Error::PermissionDenied);
            }
        }
        Ok(())
    }

    /// Whether the union of `user`'s permissions of the access's kind covers its range.
    fn covers(&self, user: &str, access: &Access) -> bool {
        let Some(user) = self.users.get(user) else {
            return false;
        };
        let mut granted: Vec<(Vec<u8>, Option<Vec<u8>>)> = user
            .roles
            .iter()
            .filter_map(|name| self.roles.get(name))
            .flat_map(|role| &role.permissions)
            .filter(|permission| permission.kind.allows(access.kind))
            .map(|permission| interval(&permission.key, &permission.range_end))
            .collect();
        granted.sort();
        let (start, end) = interval(&access.key, &access.range_end);
        // Sweep the granted intervals in order of their starts, extending the covered prefix
        // of the wanted interval; a gap before the wanted end means not covered.
        let mut covered_to = start;
        for (from, to) in granted {
            if from > covered_to {
                break;
            }
            match to {
                None => return true,
                Some(to) => {
                    if to > covered_to {
                        covered_to = to;
                    }
                }
            }
            if end.as_ref().is_some_and(|end| covered_to >= *end) {
                return true;
            }
        }
        end.is_some_and(|end| covered_to >= end)
    }

    /// Applies one change. Errors leave the state untouched.
    pub fn apply(&mut self, request: &AuthRequest) -> Result<()> {
        match request {
            AuthRequest::Enable { token_key } => {
                if self.enabled {
                    return Ok(());
                }
                let Some(root) = self.users.get(ROOT_USER) else {
                    return Err(Error::RootUserNotExist);
                };
                if !root.roles.iter().any(|role| role == ROOT_ROLE) {
                    return Err(Error::RootRoleNotExist);
                }
                self.enabled = true;
                self.token_key = *token_key;
            }
            AuthRequest::Disable => {
                if !self.enabled {
                    return Ok(());
                }
                self.enabled = false;
            }
            AuthRequest::UserAdd {
                name,
                password_hash,
            } => {
                check_name(name, Error::UserEmpty)?;
                check_hash(password_hash)?;
                if self.users.contains_key(name) {
                    return Err(Error::UserAlreadyExist);
                }
                if self.users.len() >= USERS_MAX {
                    return Err(limit("users", USERS_MAX));
                }
                self.generations_issued += 1;
                let user = User {
                    name: name.clone(),
                    password_hash: password_hash.clone(),
                    roles: Vec::new(),
                    generation: self.generations_issued,
                };
                self.users.insert(name.clone(), user);
            }
            AuthRequest::UserDelete { name } => {
                if self.enabled && name == ROOT_USER {
                    return Err(Error::InvalidAuthMgmt);
                }
                if self.users.remove(name).is_none() {
                    return Err(Error::UserNotFound);
                }
            }
            AuthRequest::UserChangePassword {
                name,
                password_hash,
            } => {
                check_hash(password_hash)?;
                self.generations_issued += 1;
                let generation = self.generations_issued;
                let Some(user) = self.users.get_mut(name) else {
                    self.generations_issued -= 1;
                    return Err(Error::UserNotFound);
                };
                user.password_hash = password_hash.clone();
                user.generation = generation;
            }
            AuthRequest::UserGrantRole { user, role } => {
                if !self.users.contains_key(user) {
                    return Err(Error::UserNotFound);
                }
                // The root role need not be created to be granted (etcd's rule).
                if role != ROOT_ROLE && !self.roles.contains_key(role) {
                    return Err(Error::RoleNotFound);
                }
                let Some(entry) = self.users.get_mut(user) else {
                    return Err(Error::UserNotFound);
                };
                match entry.roles.binary_search(role) {
                    // etcd ignores a repeated grant.
                    Ok(_) => return Ok(()),
                    Err(at) => {
                        if entry.roles.len() >= USER_ROLES_MAX {
                            return Err(limit("roles per user", USER_ROLES_MAX));
                        }
                        entry.roles.insert(at, role.clone());
                    }
                }
            }
            AuthRequest::UserRevokeRole { user, role } => {
                if self.enabled && user == ROOT_USER && role == ROOT_ROLE {
                    return Err(Error::InvalidAuthMgmt);
                }
                let Some(entry) = self.users.get_mut(user) else {
                    return Err(Error::UserNotFound);
                };
                let Ok(at) = entry.roles.binary_search(role) else {
                    return Err(Error::RoleNotGranted);
                };
                entry.roles.remove(at);
            }
            AuthRequest::RoleAdd { name } => {
                check_name(name, Error::RoleEmpty)?;
                if self.roles.contains_key(name) {
                    return Err(Error::RoleAlreadyExist);
                }
                if self.roles.len() >= ROLES_MAX {
                    return Err(limit("roles", ROLES_MAX));
                }
                let role = Role {
                    name: name.clone(),
                    permissions: Vec::new(),
                };
                self.roles.insert(name.clone(), role);
            }
            AuthRequest::RoleDelete { name } => {
                if self.enabled && name == ROOT_ROLE {
                    return Err(Error::InvalidAuthMgmt);
                }
                if self.roles.remove(name).is_none() {
                    return Err(Error::RoleNotFound);
                }
                for user in self.users.values_mut() {
                    user.roles.retain(|role| role != name);
                }
            }
            AuthRequest::RoleGrantPermission { name, permission } => {
                if permission.key.len() > PERMISSION_KEY_BYTES_MAX
                    || permission.range_end.len() > PERMISSION_KEY_BYTES_MAX
                {
                    return Err(Error::RequestTooLarge);
                }
                let Some(role) = self.roles.get_mut(name) else {
                    return Err(Error::RoleNotFound);
                };
                let position = role.permissions.binary_search_by(|p| {
                    (&p.key, &p.range_end).cmp(&(&permission.key, &permission.range_end))
                });
                match position {
                    Ok(at) => role.permissions[at].kind = permission.kind,
                    Err(at) => {
                        if role.permissions.len() >= ROLE_PERMISSIONS_MAX {
                            return Err(limit("permissions per role", ROLE_PERMISSIONS_MAX));
                        }
                        role.permissions.insert(at, permission.clone());
                    }
                }
            }
            AuthRequest::RoleRevokePermission {
                name,
                key,
                range_end,
            } => {
                let Some(role) = self.roles.get_mut(name) else {
                    return Err(Error::RoleNotFound);
                };
                let Some(at) = role
                    .permissions
                    .iter()
                    .position(|p| p.key == *key && p.range_end == *range_end)
                else {
                    return Err(Error::PermissionNotGranted);
                };
                role.permissions.remove(at);
            }
        }
        self.revision += 1;
        Ok(())
    }

    /// The invariants a snapshot must satisfy: enabled implies root with the root role,
    /// sorted unique roles per user, sorted unique permissions per role, names as keyed.
    pub fn verify(&self) -> std::result::Result<(), String> {
        if self.enabled && !self.is_root(ROOT_USER) {
            return Err("auth is enabled without the root user holding the root role".into());
        }
        for (name, user) in &self.users {
            if *name != user.name {
                return Err(format!("user {name:?} is stored as {:?}", user.name));
            }
            if !user.roles.windows(2).all(|pair| pair[0] < pair[1]) {
                return Err(format!("user {name:?} has unsorted or repeated roles"));
            }
            if user.generation > self.generations_issued {
                return Err(format!("user {name:?} has a generation never issued"));
            }
        }
        for (name, role) in &self.roles {
            if *name != role.name {
                return Err(format!("role {name:?} is stored as {:?}", role.name));
            }
            let sorted = role.permissions.windows(2).all(|pair| {
                (&pair[0].key, &pair[0].range_end) < (&pair[1].key, &pair[1].range_end)
            });
            if !sorted {
                return Err(format!(
                    "role {name:?} has unsorted or repeated permissions"
                ));
            }
        }
        Ok(())
    }
}

fn limit(what: &str, max: usize) -> Error {
    Error::LimitReached {
        what: what.into(),
        limit: u64::try_from(max).unwrap_or(u64::MAX),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user_add(name: &str) -> AuthRequest {
        AuthRequest::UserAdd {
            name: name.into(),
            password_hash: "hash".into(),
        }
    }

    fn grant(role: &str, kind: PermissionKind, key: &str, range_end: &str) -> AuthRequest {
        AuthRequest::RoleGrantPermission {
            name: role.into(),
            permission: KeyPermission {
                kind,
                key: Bytes::copy_from_slice(key.as_bytes()),
                range_end: Bytes::copy_from_slice(range_end.as_bytes()),
            },
        }
    }

    fn enabled_store() -> AuthState {
        let mut auth = AuthState::default();
        for request in [
            user_add("root"),
            AuthRequest::UserGrantRole {
                user: "root".into(),
                role: "root".into(),
            },
            user_add("alice"),
            AuthRequest::RoleAdd {
                name: "reader".into(),
            },
            grant("reader", PermissionKind::Read, "a/", "a0"),
            AuthRequest::UserGrantRole {
                user: "alice".into(),
                role: "reader".into(),
            },
            AuthRequest::Enable { token_key: [7; 32] },
        ] {
            auth.apply(&request).expect("setup applies");
        }
        auth
    }

    #[test]
    fn enable_needs_root_with_root_role() {
        let mut auth = AuthState::default();
        let enable = AuthRequest::Enable { token_key: [1; 32] };
        assert_eq!(auth.apply(&enable), Err(Error::RootUserNotExist));
        auth.apply(&user_add("root")).unwrap();
        assert_eq!(auth.apply(&enable), Err(Error::RootRoleNotExist));
        let grant_root = AuthRequest::UserGrantRole {
            user: "root".into(),
            role: "root".into(),
        };
        auth.apply(&grant_root).unwrap();
        auth.apply(&enable).unwrap();
        assert!(auth.enabled);
        assert_eq!(
            Error::RootUserNotExist.to_string(),
            "etcdserver: root user does not exist"
        );
    }

    #[test]
    fn root_cannot_be_removed_while_enabled() {
        let mut auth = enabled_store();
        let revision = auth.revision;
        for request in [
            AuthRequest::UserDelete {
                name: "root".into(),
            },
            AuthRequest::UserRevokeRole {
                user: "root".into(),
                role: "root".into(),
            },
            AuthRequest::RoleDelete {
                name: "root".into(),
            },
        ] {
            assert_eq!(auth.apply(&request), Err(Error::InvalidAuthMgmt));
        }
        assert_eq!(auth.revision, revision, "a refused change bumps nothing");
        auth.apply(&AuthRequest::Disable).unwrap();
        auth.apply(&AuthRequest::UserDelete {
            name: "root".into(),
        })
        .unwrap();
    }

    #[test]
    fn management_errors_match_etcd() {
        let mut auth = enabled_store();
        assert_eq!(auth.apply(&user_add("alice")), Err(Error::UserAlreadyExist));
        assert_eq!(auth.apply(&user_add("")), Err(Error::UserEmpty));
        assert_eq!(
            auth.apply(&AuthRequest::UserDelete { name: "bob".into() }),
            Err(Error::UserNotFound)
        );
        assert_eq!(
            auth.apply(&AuthRequest::UserGrantRole {
                user: "alice".into(),
                role: "nope".into()
            }),
            Err(Error::RoleNotFound)
        );
        assert_eq!(
            auth.apply(&AuthRequest::UserRevokeRole {
                user: "alice".into(),
                role: "root".into()
            }),
            Err(Error::RoleNotGranted)
        );
        assert_eq!(
            auth.apply(&AuthRequest::RoleRevokePermission {
                name: "reader".into(),
                key: Bytes::from_static(b"b/"),
                range_end: Bytes::from_static(b"b0"),
            }),
            Err(Error::PermissionNotGranted)
        );
        assert_eq!(
            Error::UserNotFound.to_string(),
            "etcdserver: user name not found"
        );
        assert_eq!(
            Error::PermissionDenied.to_string(),
            "etcdserver: permission denied"
        );
        assert_eq!(
            Error::AuthFailed.to_string(),
            "etcdserver: authentication failed, invalid user ID or password"
        );
    }

    #[test]
    fn read_only_prefix_reads_and_nothing_else() {
        let auth = enabled_store();
        let ok = |access: Access| auth.check_access("alice", &[access]);
        assert_eq!(ok(Access::read("a/x", "")), Ok(()));
        assert_eq!(ok(Access::read("a/", "a0")), Ok(()));
        assert_eq!(ok(Access::write("a/x", "")), Err(Error::PermissionDenied));
        assert_eq!(ok(Access::read("b/x", "")), Err(Error::PermissionDenied));
        // A range reaching past the granted one is refused as a whole.
        assert_eq!(ok(Access::read("a/", "b")), Err(Error::PermissionDenied));
        assert_eq!(ok(Access::read("a/", "\0")), Err(Error::PermissionDenied));
        assert_eq!(
            auth.check_access("root", &[Access::write("", "\0")]),
            Ok(())
        );
        assert_eq!(auth.check_access("", &[]), Err(Error::UserEmpty));
        assert_eq!(auth.check_access("eve", &[]), Err(Error::PermissionDenied));
        assert_eq!(auth.check_admin("alice"), Err(Error::PermissionDenied));
        assert_eq!(auth.check_admin("root"), Ok(()));
    }

    #[test]
    fn coverage_is_the_union_of_intervals() {
        let mut auth = enabled_store();
        auth.apply(&grant("reader", PermissionKind::Read, "a0", "c"))
            .unwrap();
        auth.apply(&grant("reader", PermissionKind::ReadWrite, "k", ""))
            .unwrap();
        auth.apply(&grant("reader", PermissionKind::Write, "z", "\0"))
            .unwrap();
        let check = |access: Access| auth.check_access("alice", &[access]).is_ok();
        // [a/, a0) and [a0, c) together cover [a/, c).
        assert!(check(Access::read("a/", "c")));
        assert!(!check(Access::read("a/", "c\0")));
        assert!(check(Access::read("k", "")));
        assert!(check(Access::write("k", "")));
        assert!(!check(Access::write("k", "l")), "a key is not its range");
        assert!(check(Access::write("zzz", "\0")));
        assert!(!check(Access::read("zzz", "")));
        assert!(!check(Access::write("y", "\0")));
    }

    #[test]
    fn grant_replaces_kind_on_the_same_range_and_delete_role_ungrants() {
        let mut auth = enabled_store();
        auth.apply(&grant("reader", PermissionKind::ReadWrite, "a/", "a0"))
            .unwrap();
        assert_eq!(auth.roles["reader"].permissions.len(), 1);
        assert!(
            auth.check_access("alice", &[Access::write("a/x", "")])
                .is_ok()
        );
        auth.apply(&AuthRequest::RoleDelete {
            name: "reader".into(),
        })
        .unwrap();
        assert!(auth.users["alice"].roles.is_empty());
        assert!(
            auth.check_access("alice", &[Access::read("a/x", "")])
                .is_err()
        );
        assert_eq!(auth.verify(), Ok(()));
    }

    #[test]
    fn password_change_and_readd_move_the_generation() {
        let mut auth = enabled_store();
        let first = auth.users["alice"].generation;
        auth.apply(&AuthRequest::UserChangePassword {
            name: "alice".into(),
            password_hash: "other".into(),
        })
        .unwrap();
        let second = auth.users["alice"].generation;
        assert_ne!(first, second);
        auth.apply(&AuthRequest::UserDelete {
            name: "alice".into(),
        })
        .unwrap();
        auth.apply(&user_add("alice")).unwrap();
        assert!(![first, second].contains(&auth.users["alice"].generation));
        assert_eq!(auth.verify(), Ok(()));
    }

    #[test]
    fn verify_catches_broken_invariants() {
        let mut auth = enabled_store();
        if let Some(root) = auth.users.get_mut("root") {
            root.roles.clear();
        }
        assert!(auth.verify().is_err());
        let mut auth = enabled_store();
        if let Some(alice) = auth.users.get_mut("alice") {
            alice.roles.push("reader".into());
        }
        assert!(auth.verify().is_err());
    }
}
