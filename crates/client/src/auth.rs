//! Authentication (etcd's Auth service): the credentials a client connects with, the token
//! every call carries as `token` metadata, and the calls that manage users and roles.
//!
//! With a user and password the client calls `Authenticate` before its first request and
//! sends the token on every call (KV, watch, lease, locks, elections, topics, queues). When
//! the server refuses a token (it expired, the password changed, auth was re-enabled), the
//! client authenticates again once and repeats the call; a refused password is final.

use std::fmt;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use conclave_proto::authpb;
use conclave_proto::etcdserverpb as pb;
use conclave_proto::etcdserverpb::auth_client::AuthClient;
use tonic::metadata::AsciiMetadataValue;

use crate::conn::{Channel, Retry, request};
use crate::error::{Error, ErrorContext, Result};
use crate::{Client, kv};

/// The metadata key etcd's servers read the token from.
pub const TOKEN_METADATA_KEY: &str = "token";

/// What a client proves who it is with.
#[derive(Clone, PartialEq, Eq)]
pub enum Credentials {
    /// A user name and password, exchanged for a token (and exchanged again when the token
    /// is refused).
    Password { user: String, password: String },
    /// A token obtained elsewhere; it cannot be renewed, so calls fail with
    /// [`Error::Unauthenticated`] once it expires.
    Token(String),
}

impl fmt::Debug for Credentials {
    // Keeps secrets out of logs and panic messages.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Credentials::Password { user, .. } => f
                .debug_struct("Password")
                .field("user", user)
                .field("password", &"<hidden>")
                .finish(),
            Credentials::Token(_) => f.debug_tuple("Token").field(&"<hidden>").finish(),
        }
    }
}

impl Credentials {
    /// A user name and password.
    pub fn password(user: impl Into<String>, password: impl Into<String>) -> Credentials {
        Credentials::Password {
            user: user.into(),
            password: password.into(),
        }
    }
}

/// Where the client stands with the server's authentication.
#[derive(Clone, Debug)]
enum TokenSlot {
    /// No token yet (or the last one was refused): authenticate before the next call.
    Missing,
    /// The server said authentication is not enabled; calls go without a token (etcd's
    /// clients do the same) until a call is refused for want of one.
    NotNeeded,
    /// The token sent with every call.
    Token(AsciiMetadataValue),
}

/// Adds the current token to every call made through a [`Channel`].
#[derive(Clone)]
pub(crate) struct TokenInterceptor {
    slot: Arc<RwLock<TokenSlot>>,
}

impl tonic::service::Interceptor for TokenInterceptor {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> std::result::Result<tonic::Request<()>, tonic::Status> {
        let slot = self.slot.read().unwrap_or_else(|p| p.into_inner());
        if let TokenSlot::Token(token) = &*slot {
            request
                .metadata_mut()
                .insert(TOKEN_METADATA_KEY, token.clone());
        }
        Ok(request)
    }
}

/// The client's authentication state, shared by its connections.
pub(crate) struct Authenticator {
    credentials: Option<Credentials>,
    slot: Arc<RwLock<TokenSlot>>,
    /// Serialises Authenticate calls, so concurrent requests that find no token ask once.
    authenticating: tokio::sync::Mutex<()>,
}

impl Authenticator {
    pub(crate) fn new(credentials: Option<Credentials>) -> Result<Authenticator> {
        let slot = match &credentials {
            Some(Credentials::Token(token)) => TokenSlot::Token(token_value(token)?),
            Some(Credentials::Password { user, .. }) if user.is_empty() => {
                return Err(Error::InvalidArgument("the user name is empty".into()));
            }
            Some(Credentials::Password { .. }) => TokenSlot::Missing,
            None => TokenSlot::NotNeeded,
        };
        Ok(Authenticator {
            credentials,
            slot: Arc::new(RwLock::new(slot)),
            authenticating: tokio::sync::Mutex::new(()),
        })
    }

    pub(crate) fn interceptor(&self) -> TokenInterceptor {
        TokenInterceptor {
            slot: self.slot.clone(),
        }
    }

    fn needs_token(&self) -> bool {
        matches!(
            *self.slot.read().unwrap_or_else(|p| p.into_inner()),
            TokenSlot::Missing
        )
    }

    /// Authenticates over `channel` when the client has a password and no token.
    pub(crate) async fn ensure(&self, channel: &Channel, timeout: Duration) -> Result<()> {
        if !self.needs_token() {
            return Ok(());
        }
        let Some(Credentials::Password { user, password }) = &self.credentials else {
            return Ok(());
        };
        let _one_at_a_time = self.authenticating.lock().await;
        if !self.needs_token() {
            return Ok(());
        }
        let answer = AuthClient::new(channel.clone())
            .authenticate(request(
                pb::AuthenticateRequest {
                    name: user.clone(),
                    password: password.clone(),
                },
                timeout,
            ))
            .await;
        let next = match answer {
            Ok(answer) => TokenSlot::Token(token_value(&answer.into_inner().token)?),
            Err(status)
                if status.code() == tonic::Code::FailedPrecondition
                    && status.message().contains("authentication is not enabled") =>
            {
                TokenSlot::NotNeeded
            }
            Err(status) => return Err(refused_credentials(&status, user)),
        };
        *self.slot.write().unwrap_or_else(|p| p.into_inner()) = next;
        Ok(())
    }

    /// After a call was refused as unauthenticated: forgets the token so the next attempt
    /// authenticates again. False when that cannot help (no password to authenticate with).
    pub(crate) fn renew(&self) -> bool {
        if !matches!(self.credentials, Some(Credentials::Password { .. })) {
            return false;
        }
        *self.slot.write().unwrap_or_else(|p| p.into_inner()) = TokenSlot::Missing;
        true
    }
}

/// The error of a refused Authenticate: a wrong password or unknown user is
/// [`Error::Unauthenticated`] with one sentence naming the user.
fn refused_credentials(status: &tonic::Status, user: &str) -> Error {
    match Error::status(status) {
        Error::Unauthenticated(message) => Error::Unauthenticated(format!(
            "user {user:?} was refused: wrong password or no such user ({message})"
        )),
        other => other,
    }
}

fn token_value(token: &str) -> Result<AsciiMetadataValue> {
    AsciiMetadataValue::try_from(token).map_err(|_| {
        Error::InvalidArgument("the auth token holds characters metadata cannot carry".into())
    })
}

/// What a role's permission allows on its key range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PermissionKind {
    Read,
    Write,
    ReadWrite,
}

impl PermissionKind {
    /// etcd's name: `read`, `write` or `readwrite`.
    pub fn as_str(self) -> &'static str {
        match self {
            PermissionKind::Read => "read",
            PermissionKind::Write => "write",
            PermissionKind::ReadWrite => "readwrite",
        }
    }

    fn from_wire(kind: i32) -> PermissionKind {
        match authpb::permission::Type::try_from(kind) {
            Ok(authpb::permission::Type::Write) => PermissionKind::Write,
            Ok(authpb::permission::Type::Readwrite) => PermissionKind::ReadWrite,
            _ => PermissionKind::Read,
        }
    }

    fn to_wire(self) -> i32 {
        match self {
            PermissionKind::Read => authpb::permission::Type::Read as i32,
            PermissionKind::Write => authpb::permission::Type::Write as i32,
            PermissionKind::ReadWrite => authpb::permission::Type::Readwrite as i32,
        }
    }
}

impl std::str::FromStr for PermissionKind {
    type Err = Error;

    fn from_str(text: &str) -> Result<PermissionKind> {
        match text.to_ascii_lowercase().as_str() {
            "read" => Ok(PermissionKind::Read),
            "write" => Ok(PermissionKind::Write),
            "readwrite" => Ok(PermissionKind::ReadWrite),
            _ => Err(Error::InvalidArgument(format!(
                "permission {text:?} is not one of read, write, readwrite"
            ))),
        }
    }
}

/// One key-range permission of a role: one key (`range_end` empty), `[key, range_end)`, or
/// every key from `key` on (`range_end` = `"\0"`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Permission {
    pub kind: PermissionKind,
    pub key: Vec<u8>,
    pub range_end: Vec<u8>,
}

impl Permission {
    /// A permission on every key that starts with `prefix`.
    pub fn prefix(kind: PermissionKind, prefix: impl Into<Vec<u8>>) -> Permission {
        let key = prefix.into();
        let range_end = kv::prefix_end(&key);
        Permission {
            kind,
            key,
            range_end,
        }
    }
}

/// User and role management, and turning authentication on and off (`Client::auth`).
/// Every call but `status` needs the root role once auth is enabled.
#[derive(Clone)]
pub struct Auth {
    client: Client,
}

macro_rules! auth_call {
    ($self:ident, $retry:expr, $method:ident, $message:expr) => {{
        let message = $message;
        $self
            .client
            .call($retry, ErrorContext::default(), move |channel, timeout| {
                let message = message.clone();
                async move {
                    AuthClient::new(channel)
                        .$method(request(message, timeout))
                        .await
                }
            })
            .await
            .map(|answer| answer.into_inner())
    }};
}

impl Auth {
    pub(crate) fn new(client: Client) -> Auth {
        Auth { client }
    }

    /// Turns authentication on (needs a `root` user holding the `root` role).
    pub async fn enable(&self) -> Result<()> {
        auth_call!(
            self,
            Retry::Idempotent,
            auth_enable,
            pb::AuthEnableRequest {}
        )?;
        Ok(())
    }

    /// Turns authentication off.
    pub async fn disable(&self) -> Result<()> {
        auth_call!(
            self,
            Retry::Idempotent,
            auth_disable,
            pb::AuthDisableRequest {}
        )?;
        Ok(())
    }

    /// Whether authentication is on, and the auth revision (bumped by every change).
    pub async fn status(&self) -> Result<(bool, u64)> {
        let answer = auth_call!(
            self,
            Retry::Idempotent,
            auth_status,
            pb::AuthStatusRequest {}
        )?;
        Ok((answer.enabled, answer.auth_revision))
    }

    /// Adds a user with a password.
    pub async fn user_add(&self, name: &str, password: &str) -> Result<()> {
        auth_call!(
            self,
            Retry::AtMostOnce,
            user_add,
            pb::AuthUserAddRequest {
                name: name.into(),
                password: password.into(),
                options: None,
            }
        )?;
        Ok(())
    }

    /// Deletes a user.
    pub async fn user_delete(&self, name: &str) -> Result<()> {
        auth_call!(
            self,
            Retry::AtMostOnce,
            user_delete,
            pb::AuthUserDeleteRequest { name: name.into() }
        )?;
        Ok(())
    }

    /// The roles of a user.
    pub async fn user_get(&self, name: &str) -> Result<Vec<String>> {
        let answer = auth_call!(
            self,
            Retry::Idempotent,
            user_get,
            pb::AuthUserGetRequest { name: name.into() }
        )?;
        Ok(answer.roles)
    }

    /// Every user's name.
    pub async fn user_list(&self) -> Result<Vec<String>> {
        let answer = auth_call!(
            self,
            Retry::Idempotent,
            user_list,
            pb::AuthUserListRequest {}
        )?;
        Ok(answer.users)
    }

    /// Sets a user's password (its tokens stop working).
    pub async fn user_change_password(&self, name: &str, password: &str) -> Result<()> {
        auth_call!(
            self,
            Retry::Idempotent,
            user_change_password,
            pb::AuthUserChangePasswordRequest {
                name: name.into(),
                password: password.into(),
            }
        )?;
        Ok(())
    }

    /// Grants a role to a user.
    pub async fn user_grant_role(&self, user: &str, role: &str) -> Result<()> {
        auth_call!(
            self,
            Retry::Idempotent,
            user_grant_role,
            pb::AuthUserGrantRoleRequest {
                user: user.into(),
                role: role.into(),
            }
        )?;
        Ok(())
    }

    /// Takes a role from a user.
    pub async fn user_revoke_role(&self, user: &str, role: &str) -> Result<()> {
        auth_call!(
            self,
            Retry::AtMostOnce,
            user_revoke_role,
            pb::AuthUserRevokeRoleRequest {
                name: user.into(),
                role: role.into(),
            }
        )?;
        Ok(())
    }

    /// Adds a role without permissions.
    pub async fn role_add(&self, name: &str) -> Result<()> {
        auth_call!(
            self,
            Retry::AtMostOnce,
            role_add,
            pb::AuthRoleAddRequest { name: name.into() }
        )?;
        Ok(())
    }

    /// Deletes a role (users holding it lose it).
    pub async fn role_delete(&self, name: &str) -> Result<()> {
        auth_call!(
            self,
            Retry::AtMostOnce,
            role_delete,
            pb::AuthRoleDeleteRequest { role: name.into() }
        )?;
        Ok(())
    }

    /// The permissions of a role.
    pub async fn role_get(&self, name: &str) -> Result<Vec<Permission>> {
        let answer = auth_call!(
            self,
            Retry::Idempotent,
            role_get,
            pb::AuthRoleGetRequest { role: name.into() }
        )?;
        Ok(answer
            .perm
            .into_iter()
            .map(|p| Permission {
                kind: PermissionKind::from_wire(p.perm_type),
                key: p.key.to_vec(),
                range_end: p.range_end.to_vec(),
            })
            .collect())
    }

    /// Every role's name.
    pub async fn role_list(&self) -> Result<Vec<String>> {
        let answer = auth_call!(
            self,
            Retry::Idempotent,
            role_list,
            pb::AuthRoleListRequest {}
        )?;
        Ok(answer.roles)
    }

    /// Grants a key-range permission to a role.
    pub async fn role_grant_permission(&self, role: &str, permission: Permission) -> Result<()> {
        auth_call!(
            self,
            Retry::Idempotent,
            role_grant_permission,
            pb::AuthRoleGrantPermissionRequest {
                name: role.into(),
                perm: Some(authpb::Permission {
                    perm_type: permission.kind.to_wire(),
                    key: permission.key.into(),
                    range_end: permission.range_end.into(),
                }),
            }
        )?;
        Ok(())
    }

    /// Takes the permission on exactly `[key, range_end)` from a role.
    pub async fn role_revoke_permission(
        &self,
        role: &str,
        key: &[u8],
        range_end: &[u8],
    ) -> Result<()> {
        auth_call!(
            self,
            Retry::AtMostOnce,
            role_revoke_permission,
            pb::AuthRoleRevokePermissionRequest {
                role: role.into(),
                key: key.to_vec().into(),
                range_end: range_end.to_vec().into(),
            }
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_never_print_secrets() {
        let text = format!("{:?}", Credentials::password("alice", "s3cret"));
        assert!(text.contains("alice") && !text.contains("s3cret"), "{text}");
        let text = format!("{:?}", Credentials::Token("tok3n".into()));
        assert!(!text.contains("tok3n"), "{text}");
    }

    #[test]
    fn permission_kinds_parse_and_round_trip() {
        for kind in [
            PermissionKind::Read,
            PermissionKind::Write,
            PermissionKind::ReadWrite,
        ] {
            assert_eq!(kind.as_str().parse::<PermissionKind>(), Ok(kind));
            assert_eq!(PermissionKind::from_wire(kind.to_wire()), kind);
        }
        assert_eq!(
            "READWRITE".parse::<PermissionKind>(),
            Ok(PermissionKind::ReadWrite)
        );
        let error = "all".parse::<PermissionKind>().expect_err("not a kind");
        assert_eq!(error.code(), "invalid_argument");
    }

    #[test]
    fn a_token_goes_on_every_call_and_renewal_needs_a_password() {
        use tonic::service::Interceptor;
        let fixed = Authenticator::new(Some(Credentials::Token("abc.1".into()))).expect("ascii");
        let sent = fixed
            .interceptor()
            .call(tonic::Request::new(()))
            .expect("never refuses");
        assert_eq!(
            sent.metadata()
                .get(TOKEN_METADATA_KEY)
                .and_then(|v| v.to_str().ok()),
            Some("abc.1")
        );
        // A fixed token cannot be renewed, a password can.
        assert!(!fixed.renew());
        let with_password =
            Authenticator::new(Some(Credentials::password("alice", "pw"))).expect("valid");
        assert!(with_password.needs_token());
        assert!(with_password.renew());
        let none = Authenticator::new(None).expect("valid");
        let sent = none
            .interceptor()
            .call(tonic::Request::new(()))
            .expect("never refuses");
        assert!(sent.metadata().get(TOKEN_METADATA_KEY).is_none());
        assert!(!none.renew());
        assert!(Authenticator::new(Some(Credentials::password("", "pw"))).is_err());
        assert!(Authenticator::new(Some(Credentials::Token("bad\nline".into()))).is_err());
    }
}
