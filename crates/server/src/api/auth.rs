//! etcd's Auth service, auth tokens, and who a call comes from.
//!
//! ```text
//!  Authenticate(name, password) ─► bcrypt check on a blocking thread ─► signed token
//!  any call ─ `token` metadata ─► Api::caller: verify the token against the local auth state
//!     write: proposed as Request::AsUser { user, request }; the state machine checks it
//!     read:  checked here, against the state the read is served from
//! ```
//!
//! Tokens (`--auth-token simple`, the only kind so far) are
//! `<user hex>.<generation>.<expiry ms>.<HMAC-SHA256 hex>`, signed with the random key the
//! last AuthEnable put in the replicated auth state. Any member verifies any member's token,
//! so a follower forwards a call with its token and the leader checks it again; a token ends
//! at its expiry, when its user's password changes or the user is deleted, and when auth is
//! disabled and enabled again. Passwords never enter the log: the member that proposes a
//! UserAdd or UserChangePassword hashes the password with bcrypt first.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use conclave_proto::authpb;
use conclave_proto::etcdserverpb::{
    self as pb,
    auth_client::AuthClient,
    auth_server::{Auth, AuthServer},
};
use conclave_state::{
    Access, AuthRequest, AuthState, Error as StateError, KeyPermission, PermissionKind, Request,
    Response,
};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use tonic::{Status, async_trait};

use super::{Api, CallContext, answer, state_status, unexpected};

/// The metadata key etcd clients send their token in.
pub const TOKEN_METADATA: &str = "token";
/// Longest token accepted in metadata (real ones are about 120 bytes).
pub const TOKEN_BYTES_MAX: usize = 4096;
/// Longest password accepted (bcrypt reads at most 72 bytes; more is refused, not cut).
pub const PASSWORD_BYTES_MAX: usize = 72;

type HmacSha256 = Hmac<Sha256>;

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| {
            u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX)
        })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|at| u8::from_str_radix(text.get(at..at + 2)?, 16).ok())
        .collect()
}

fn token_mac(key: &[u8; 32], user: &str, generation: u64, expires_ms: u64) -> HmacSha256 {
    // A key of any length is valid for HMAC.
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes any key length");
    let user_bytes = user.as_bytes();
    mac.update(&(user_bytes.len() as u64).to_be_bytes());
    mac.update(user_bytes);
    mac.update(&generation.to_be_bytes());
    mac.update(&expires_ms.to_be_bytes());
    mac
}

/// A token for `user` valid until `expires_ms` (Unix ms).
pub fn sign_token(auth: &AuthState, user: &str, expires_ms: u64) -> Option<String> {
    let generation = auth.users.get(user)?.generation;
    let mac = token_mac(&auth.token_key, user, generation, expires_ms);
    Some(format!(
        "{}.{generation}.{expires_ms}.{}",
        hex(user.as_bytes()),
        hex(&mac.finalize().into_bytes())
    ))
}

/// The user a token names, if it is well-formed, signed with the current key, for the user's
/// current generation and not expired at `now_ms`.
pub fn verify_token(auth: &AuthState, token: &str, now_ms: u64) -> Result<String, StateError> {
    let invalid = || StateError::InvalidAuthToken;
    let mut parts = token.split('.');
    let (Some(user), Some(generation), Some(expires), Some(mac), None) = (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) else {
        return Err(invalid());
    };
    let user = String::from_utf8(unhex(user).ok_or_else(invalid)?).map_err(|_| invalid())?;
    let generation: u64 = generation.parse().map_err(|_| invalid())?;
    let expires_ms: u64 = expires.parse().map_err(|_| invalid())?;
    let mac = unhex(mac).ok_or_else(invalid)?;
    let current = auth.users.get(&user).ok_or_else(invalid)?;
    if current.generation != generation || expires_ms <= now_ms {
        return Err(invalid());
    }
    token_mac(&auth.token_key, &user, generation, expires_ms)
        .verify_slice(&mac)
        .map_err(|_| invalid())?;
    Ok(user)
}

/// Who a call is from, given the local auth state: the token's user when it sent one (auth
/// enabled), else the common name of its verified client certificate (`--client-cert-auth`),
/// else nobody (empty). A token is ignored while auth is disabled, as etcd does.
pub fn caller_of(
    auth: &AuthState,
    ctx: &CallContext,
    client_cert_auth: bool,
    now_ms: u64,
) -> Result<String, StateError> {
    if !auth.enabled {
        return Ok(String::new());
    }
    if let Some(token) = &ctx.token {
        return verify_token(auth, token, now_ms);
    }
    if client_cert_auth && let Some(name) = &ctx.cert_user {
        return Ok(name.to_string());
    }
    Ok(String::new())
}

/// The common name in a certificate's subject, for `--client-cert-auth`. The TLS layer
/// hands over the verified chain's leaf; its subject CN becomes [`CallContext::cert_user`].
pub fn common_name_user(common_name: Option<&str>) -> Option<Arc<str>> {
    common_name
        .filter(|name| !name.is_empty() && name.len() <= conclave_state::auth::AUTH_NAME_BYTES_MAX)
        .map(Arc::from)
}

/// The key range an etcd election or lock `name` covers: its `<name>/` prefix.
pub fn name_prefix(name: &[u8]) -> (Vec<u8>, bytes::Bytes) {
    let mut prefix = name.to_vec();
    prefix.push(b'/');
    let end = conclave_state::mvcc::prefix_end(&prefix);
    (prefix, end)
}

impl Api {
    /// The context a call carries when this member forwards it. A caller known here only by
    /// its client certificate (`--client-cert-auth`, no token) gets a token signed for that
    /// user, valid for the configured token lifetime: the member it is forwarded to sees this
    /// member's connection and certificate, not the client's. Every member holds the signing
    /// key, so this grants nothing a member could not already sign.
    pub fn forwarding_context<'a>(&self, ctx: &'a CallContext) -> Cow<'a, CallContext> {
        if ctx.token.is_some() || !self.config.auth.client_cert_auth {
            return Cow::Borrowed(ctx);
        }
        let Some(user) = &ctx.cert_user else {
            return Cow::Borrowed(ctx);
        };
        let expires_ms = now_ms().saturating_add(self.config.auth.token_ttl_ms);
        let token = self.node.read_state(|state| {
            let auth = state.auth();
            if auth.enabled {
                sign_token(auth, user, expires_ms)
            } else {
                None
            }
        });
        match token {
            Some(token) => {
                let mut forwarded = ctx.clone();
                forwarded.token = Some(Arc::from(token));
                Cow::Owned(forwarded)
            }
            None => Cow::Borrowed(ctx),
        }
    }

    /// The verified user of a call (empty: none), against this member's auth state.
    pub fn caller(&self, ctx: &CallContext) -> Result<String, Status> {
        let client_cert_auth = self.config.auth.client_cert_auth;
        self.node
            .read_state(|state| caller_of(state.auth(), ctx, client_cert_auth, now_ms()))
            .map_err(|error| state_status(&error))
    }

    /// Wraps a client's request with its verified identity, for the state machine to check.
    pub fn as_caller(&self, ctx: &CallContext, request: Request) -> Result<Request, Status> {
        Ok(Request::AsUser {
            user: self.caller(ctx)?,
            request: Box::new(request),
        })
    }

    /// Refuses a read the caller's permissions do not cover (nothing while auth is off).
    pub fn check_read(
        &self,
        ctx: &CallContext,
        key: &[u8],
        range_end: &[u8],
    ) -> Result<(), Status> {
        let user = self.caller(ctx)?;
        let access = [Access::read(
            bytes::Bytes::copy_from_slice(key),
            bytes::Bytes::copy_from_slice(range_end),
        )];
        self.node
            .read_state(|state| state.auth().check_access(&user, &access))
            .map_err(|error| state_status(&error))
    }

    /// Refuses a call that needs the root role (maintenance, membership) from anyone else.
    pub fn check_admin(&self, ctx: &CallContext) -> Result<(), Status> {
        let user = self.caller(ctx)?;
        self.node
            .read_state(|state| state.auth().check_admin(&user))
            .map_err(|error| state_status(&error))
    }
}

/// The Auth service over the shared [`Api`].
pub struct AuthService {
    pub api: Arc<Api>,
}

impl AuthService {
    pub fn server(api: Arc<Api>) -> AuthServer<AuthService> {
        AuthServer::new(AuthService { api })
    }

    fn context<T>(&self, request: &tonic::Request<T>) -> CallContext {
        CallContext::new(request, self.api.config.request_timeout_ms)
    }

    /// bcrypt on a blocking thread: at cost 10 a hash takes tens of milliseconds.
    async fn hash(&self, password: String) -> Result<String, Status> {
        if password.len() > PASSWORD_BYTES_MAX {
            return Err(Status::invalid_argument(format!(
                "conclave: a password is at most {PASSWORD_BYTES_MAX} bytes"
            )));
        }
        let cost = self.api.config.auth.bcrypt_cost;
        tokio::task::spawn_blocking(move || bcrypt::hash(password, cost))
            .await
            .map_err(|error| Status::internal(format!("conclave: hashing failed: {error}")))?
            .map_err(|error| Status::internal(format!("conclave: hashing failed: {error}")))
    }

    /// Proposes an auth change (through the leader) and answers with etcd's header.
    async fn change<M: Clone>(
        &self,
        ctx: &CallContext,
        change: AuthRequest,
        message: &M,
        call: super::route::LeaderCall<M, pb::ResponseHeader>,
    ) -> Result<tonic::Response<pb::ResponseHeader>, Status> {
        let api = &self.api;
        let command = Request::Auth(change);
        api.write(ctx, command, message, call, |applied| {
            match answer(&applied)? {
                Response::AuthChanged { .. } => Ok(api.header(applied.output.revision)),
                other => Err(unexpected(other)),
            }
        })
        .await
    }

    /// Reads the auth state after a linearizable barrier.
    async fn read<R>(
        &self,
        ctx: &CallContext,
        read: impl FnOnce(&AuthState) -> Result<R, StateError>,
    ) -> Result<R, Status> {
        self.api.linearizable_barrier(ctx).await?;
        self.api
            .node
            .read_state(|state| read(state.auth()))
            .map_err(|error| state_status(&error))
    }
}

/// A forwarded auth change: the leader answers with the same message; only its header
/// matters to the follower that forwards, so each method maps its response to the header.
macro_rules! forward_header {
    ($method:ident) => {
        |channel, request| {
            Box::pin(async move {
                AuthClient::new(channel)
                    .$method(request)
                    .await
                    .map(|response| response.map(|answer| answer.header.unwrap_or_default()))
            })
        }
    };
}

fn permission_from_pb(permission: authpb::Permission) -> Result<KeyPermission, Status> {
    use authpb::permission::Type;
    let kind = match Type::try_from(permission.perm_type) {
        Ok(Type::Read) => PermissionKind::Read,
        Ok(Type::Write) => PermissionKind::Write,
        Ok(Type::Readwrite) => PermissionKind::ReadWrite,
        Err(_) => {
            return Err(Status::invalid_argument(format!(
                "etcdserver: invalid permission type {}",
                permission.perm_type
            )));
        }
    };
    Ok(KeyPermission {
        kind,
        key: permission.key,
        range_end: permission.range_end,
    })
}

fn permission_to_pb(permission: &KeyPermission) -> authpb::Permission {
    use authpb::permission::Type;
    let kind = match permission.kind {
        PermissionKind::Read => Type::Read,
        PermissionKind::Write => Type::Write,
        PermissionKind::ReadWrite => Type::Readwrite,
    };
    authpb::Permission {
        perm_type: kind as i32,
        key: permission.key.clone(),
        range_end: permission.range_end.clone(),
    }
}

/// Runs an auth change and builds the method's response from the header.
macro_rules! change {
    ($self:ident, $request:ident, $method:ident, $response:ident, |$message:ident| $build:expr) => {{
        let ctx = $self.context(&$request);
        let $message = $request.into_inner();
        let change = $build;
        let header = $self
            .change(&ctx, change, &$message, forward_header!($method))
            .await?
            .into_inner();
        Ok(tonic::Response::new(pb::$response {
            header: Some(header),
        }))
    }};
}

#[async_trait]
impl Auth for AuthService {
    async fn auth_enable(
        &self,
        request: tonic::Request<pb::AuthEnableRequest>,
    ) -> Result<tonic::Response<pb::AuthEnableResponse>, Status> {
        let mut token_key = [0u8; 32];
        getrandom::fill(&mut token_key)
            .map_err(|error| Status::internal(format!("conclave: no randomness: {error}")))?;
        change!(self, request, auth_enable, AuthEnableResponse, |message| {
            AuthRequest::Enable { token_key }
        })
    }

    async fn auth_disable(
        &self,
        request: tonic::Request<pb::AuthDisableRequest>,
    ) -> Result<tonic::Response<pb::AuthDisableResponse>, Status> {
        change!(
            self,
            request,
            auth_disable,
            AuthDisableResponse,
            |message| { AuthRequest::Disable }
        )
    }

    async fn auth_status(
        &self,
        request: tonic::Request<pb::AuthStatusRequest>,
    ) -> Result<tonic::Response<pb::AuthStatusResponse>, Status> {
        let ctx = self.context(&request);
        let (enabled, revision) = self
            .read(&ctx, |auth| Ok((auth.enabled, auth.revision)))
            .await?;
        Ok(tonic::Response::new(pb::AuthStatusResponse {
            header: Some(self.api.read_header()),
            enabled,
            auth_revision: revision,
        }))
    }

    async fn authenticate(
        &self,
        request: tonic::Request<pb::AuthenticateRequest>,
    ) -> Result<tonic::Response<pb::AuthenticateResponse>, Status> {
        let ctx = self.context(&request);
        let message = request.into_inner();
        let name = message.name.clone();
        let hash = self
            .read(&ctx, |auth| {
                if !auth.enabled {
                    return Err(StateError::AuthNotEnabled);
                }
                match auth.users.get(&name) {
                    Some(user) if !user.password_hash.is_empty() => Ok(user.password_hash.clone()),
                    _ => Err(StateError::AuthFailed),
                }
            })
            .await?;
        let password = message.password;
        let matches = tokio::task::spawn_blocking(move || bcrypt::verify(password, &hash))
            .await
            .map_err(|error| Status::internal(format!("conclave: hashing failed: {error}")))?
            .unwrap_or(false);
        if !matches {
            return Err(state_status(&StateError::AuthFailed));
        }
        let expires_ms = now_ms().saturating_add(self.api.config.auth.token_ttl_ms);
        let token = self
            .api
            .node
            .read_state(|state| sign_token(state.auth(), &name, expires_ms))
            .ok_or_else(|| state_status(&StateError::AuthFailed))?;
        Ok(tonic::Response::new(pb::AuthenticateResponse {
            header: Some(self.api.read_header()),
            token,
        }))
    }

    async fn user_add(
        &self,
        request: tonic::Request<pb::AuthUserAddRequest>,
    ) -> Result<tonic::Response<pb::AuthUserAddResponse>, Status> {
        let no_password = request
            .get_ref()
            .options
            .as_ref()
            .is_some_and(|options| options.no_password);
        let password_hash = if no_password {
            String::new()
        } else {
            self.hash(request.get_ref().password.clone()).await?
        };
        change!(self, request, user_add, AuthUserAddResponse, |message| {
            AuthRequest::UserAdd {
                name: message.name.clone(),
                password_hash,
            }
        })
    }

    async fn user_get(
        &self,
        request: tonic::Request<pb::AuthUserGetRequest>,
    ) -> Result<tonic::Response<pb::AuthUserGetResponse>, Status> {
        let ctx = self.context(&request);
        let name = request.into_inner().name;
        let caller = self.api.caller(&ctx)?;
        let roles = self
            .read(&ctx, |auth| {
                // A user may read its own record; everything else is root's.
                if caller != name {
                    auth.check_admin(&caller)?;
                }
                let user = auth.users.get(&name).ok_or(StateError::UserNotFound)?;
                Ok(user.roles.clone())
            })
            .await?;
        Ok(tonic::Response::new(pb::AuthUserGetResponse {
            header: Some(self.api.read_header()),
            roles,
        }))
    }

    async fn user_list(
        &self,
        request: tonic::Request<pb::AuthUserListRequest>,
    ) -> Result<tonic::Response<pb::AuthUserListResponse>, Status> {
        let ctx = self.context(&request);
        let caller = self.api.caller(&ctx)?;
        let users = self
            .read(&ctx, |auth| {
                auth.check_admin(&caller)?;
                Ok(auth.users.keys().cloned().collect())
            })
            .await?;
        Ok(tonic::Response::new(pb::AuthUserListResponse {
            header: Some(self.api.read_header()),
            users,
        }))
    }

    async fn user_delete(
        &self,
        request: tonic::Request<pb::AuthUserDeleteRequest>,
    ) -> Result<tonic::Response<pb::AuthUserDeleteResponse>, Status> {
        change!(
            self,
            request,
            user_delete,
            AuthUserDeleteResponse,
            |message| {
                AuthRequest::UserDelete {
                    name: message.name.clone(),
                }
            }
        )
    }

    async fn user_change_password(
        &self,
        request: tonic::Request<pb::AuthUserChangePasswordRequest>,
    ) -> Result<tonic::Response<pb::AuthUserChangePasswordResponse>, Status> {
        let password_hash = self.hash(request.get_ref().password.clone()).await?;
        change!(
            self,
            request,
            user_change_password,
            AuthUserChangePasswordResponse,
            |message| AuthRequest::UserChangePassword {
                name: message.name.clone(),
                password_hash,
            }
        )
    }

    async fn user_grant_role(
        &self,
        request: tonic::Request<pb::AuthUserGrantRoleRequest>,
    ) -> Result<tonic::Response<pb::AuthUserGrantRoleResponse>, Status> {
        change!(
            self,
            request,
            user_grant_role,
            AuthUserGrantRoleResponse,
            |message| {
                AuthRequest::UserGrantRole {
                    user: message.user.clone(),
                    role: message.role.clone(),
                }
            }
        )
    }

    async fn user_revoke_role(
        &self,
        request: tonic::Request<pb::AuthUserRevokeRoleRequest>,
    ) -> Result<tonic::Response<pb::AuthUserRevokeRoleResponse>, Status> {
        change!(
            self,
            request,
            user_revoke_role,
            AuthUserRevokeRoleResponse,
            |message| {
                AuthRequest::UserRevokeRole {
                    user: message.name.clone(),
                    role: message.role.clone(),
                }
            }
        )
    }

    async fn role_add(
        &self,
        request: tonic::Request<pb::AuthRoleAddRequest>,
    ) -> Result<tonic::Response<pb::AuthRoleAddResponse>, Status> {
        change!(self, request, role_add, AuthRoleAddResponse, |message| {
            AuthRequest::RoleAdd {
                name: message.name.clone(),
            }
        })
    }

    async fn role_get(
        &self,
        request: tonic::Request<pb::AuthRoleGetRequest>,
    ) -> Result<tonic::Response<pb::AuthRoleGetResponse>, Status> {
        let ctx = self.context(&request);
        let name = request.into_inner().role;
        let caller = self.api.caller(&ctx)?;
        let perm = self
            .read(&ctx, |auth| {
                // A user may read the roles it holds; everything else is root's.
                let holds = auth
                    .users
                    .get(&caller)
                    .is_some_and(|user| user.roles.contains(&name));
                if !holds {
                    auth.check_admin(&caller)?;
                }
                let role = auth.roles.get(&name).ok_or(StateError::RoleNotFound)?;
                Ok(role.permissions.iter().map(permission_to_pb).collect())
            })
            .await?;
        Ok(tonic::Response::new(pb::AuthRoleGetResponse {
            header: Some(self.api.read_header()),
            perm,
        }))
    }

    async fn role_list(
        &self,
        request: tonic::Request<pb::AuthRoleListRequest>,
    ) -> Result<tonic::Response<pb::AuthRoleListResponse>, Status> {
        let ctx = self.context(&request);
        let caller = self.api.caller(&ctx)?;
        let roles = self
            .read(&ctx, |auth| {
                auth.check_admin(&caller)?;
                Ok(auth.roles.keys().cloned().collect())
            })
            .await?;
        Ok(tonic::Response::new(pb::AuthRoleListResponse {
            header: Some(self.api.read_header()),
            roles,
        }))
    }

    async fn role_delete(
        &self,
        request: tonic::Request<pb::AuthRoleDeleteRequest>,
    ) -> Result<tonic::Response<pb::AuthRoleDeleteResponse>, Status> {
        change!(
            self,
            request,
            role_delete,
            AuthRoleDeleteResponse,
            |message| {
                AuthRequest::RoleDelete {
                    name: message.role.clone(),
                }
            }
        )
    }

    async fn role_grant_permission(
        &self,
        request: tonic::Request<pb::AuthRoleGrantPermissionRequest>,
    ) -> Result<tonic::Response<pb::AuthRoleGrantPermissionResponse>, Status> {
        let permission =
            permission_from_pb(
                request.get_ref().perm.clone().ok_or_else(|| {
                    Status::invalid_argument("etcdserver: permission is not given")
                })?,
            )?;
        change!(
            self,
            request,
            role_grant_permission,
            AuthRoleGrantPermissionResponse,
            |message| AuthRequest::RoleGrantPermission {
                name: message.name.clone(),
                permission,
            }
        )
    }

    async fn role_revoke_permission(
        &self,
        request: tonic::Request<pb::AuthRoleRevokePermissionRequest>,
    ) -> Result<tonic::Response<pb::AuthRoleRevokePermissionResponse>, Status> {
        change!(
            self,
            request,
            role_revoke_permission,
            AuthRoleRevokePermissionResponse,
            |message| AuthRequest::RoleRevokePermission {
                name: message.role.clone(),
                key: message.key.clone(),
                range_end: message.range_end.clone(),
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enabled() -> AuthState {
        let mut auth = AuthState::default();
        for change in [
            AuthRequest::UserAdd {
                name: "root".into(),
                password_hash: "h".into(),
            },
            AuthRequest::UserGrantRole {
                user: "root".into(),
                role: "root".into(),
            },
            AuthRequest::UserAdd {
                name: "alice".into(),
                password_hash: "h".into(),
            },
            AuthRequest::Enable { token_key: [3; 32] },
        ] {
            auth.apply(&change).expect("setup");
        }
        auth
    }

    fn ctx(token: Option<&str>, cert: Option<&str>) -> CallContext {
        let mut request = tonic::Request::new(());
        if let Some(token) = token {
            request
                .metadata_mut()
                .insert(TOKEN_METADATA, token.parse().expect("ascii"));
        }
        let mut ctx = CallContext::new(&request, 1000);
        ctx.cert_user = common_name_user(cert);
        ctx
    }

    #[test]
    fn tokens_verify_and_expire() {
        let auth = enabled();
        let token = sign_token(&auth, "alice", 2_000).expect("alice exists");
        assert_eq!(verify_token(&auth, &token, 1_000), Ok("alice".into()));
        assert_eq!(
            verify_token(&auth, &token, 2_000),
            Err(StateError::InvalidAuthToken)
        );
        // Tampering with any part breaks the signature.
        let forged = token.replacen(&hex(b"alice"), &hex(b"root"), 1);
        assert_eq!(
            verify_token(&auth, &forged, 1_000),
            Err(StateError::InvalidAuthToken)
        );
        let later = token.replacen(".2000.", ".9000.", 1);
        assert_eq!(
            verify_token(&auth, &later, 1_000),
            Err(StateError::InvalidAuthToken)
        );
        for junk in ["", "a.b.c.d", "....", "zz.1.2.00"] {
            assert!(verify_token(&auth, junk, 0).is_err());
        }
    }

    #[test]
    fn a_new_password_or_key_ends_old_tokens() {
        let mut auth = enabled();
        let token = sign_token(&auth, "alice", 10_000).expect("alice exists");
        auth.apply(&AuthRequest::UserChangePassword {
            name: "alice".into(),
            password_hash: "other".into(),
        })
        .expect("applies");
        assert!(verify_token(&auth, &token, 0).is_err());
        let token = sign_token(&auth, "alice", 10_000).expect("alice exists");
        auth.apply(&AuthRequest::Disable).expect("applies");
        auth.apply(&AuthRequest::Enable { token_key: [4; 32] })
            .expect("applies");
        assert!(verify_token(&auth, &token, 0).is_err());
    }

    #[test]
    fn callers_come_from_tokens_then_certificates() {
        let auth = enabled();
        let token = sign_token(&auth, "alice", 10_000).expect("alice exists");
        assert_eq!(
            caller_of(&auth, &ctx(Some(&token), Some("bob")), true, 0),
            Ok("alice".into())
        );
        assert_eq!(
            caller_of(&auth, &ctx(None, Some("bob")), true, 0),
            Ok("bob".into())
        );
        // Without --client-cert-auth a certificate names nobody.
        assert_eq!(
            caller_of(&auth, &ctx(None, Some("bob")), false, 0),
            Ok(String::new())
        );
        assert_eq!(
            caller_of(&auth, &ctx(None, None), true, 0),
            Ok(String::new())
        );
        assert_eq!(
            caller_of(&auth, &ctx(Some("bad"), Some("bob")), true, 0),
            Err(StateError::InvalidAuthToken)
        );
        // While auth is off nobody is checked, and a stale token is no error.
        let off = AuthState::default();
        assert_eq!(
            caller_of(&off, &ctx(Some("bad"), None), true, 0),
            Ok(String::new())
        );
        assert_eq!(common_name_user(Some("")), None);
    }
}
