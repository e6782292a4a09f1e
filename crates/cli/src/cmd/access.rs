//! `auth enable|disable|status`, `user ...` and `role ...`: etcd's Auth service from the
//! `conclave` CLI, with etcdctl's argument shapes; and the `--user` credentials of every
//! client command.

use std::io::{BufRead, IsTerminal};

use clap::{Args, Subcommand};
use conclave_client::{Credentials, Permission, PermissionKind};
use serde_json::json;

use super::output::text;
use super::{CmdResult, Ctx, Failure};

/// The variable holding the password of `--user NAME` (agents and scripts).
pub const PASSWORD_ENV: &str = "CONCLAVE_PASSWORD";

/// `conclave auth ...`.
#[derive(Subcommand, Debug)]
pub enum AuthCommand {
    /// Turn authentication on (needs a `root` user holding the `root` role).
    Enable,
    /// Turn authentication off.
    Disable,
    /// Whether authentication is on, and the auth revision.
    Status,
}

/// `conclave user ...`.
#[derive(Subcommand, Debug)]
pub enum UserCommand {
    /// Add user NAME (NAME:PASSWORD, --new-user-password, a prompt on a terminal, or one line
    /// of stdin).
    Add(UserAddArgs),
    /// Delete a user.
    Delete { name: String },
    /// A user's roles.
    Get { name: String },
    /// Every user.
    List,
    /// Change a user's password (prompted on a terminal, else one line of stdin).
    Passwd(PasswdArgs),
    /// Grant ROLE to USER.
    GrantRole { user: String, role: String },
    /// Revoke ROLE from USER.
    RevokeRole { user: String, role: String },
}

#[derive(Args, Debug)]
pub struct UserAddArgs {
    /// NAME or NAME:PASSWORD.
    #[arg(value_name = "NAME[:PASSWORD]")]
    pub user: String,
    /// The new user's password (etcdctl's flag).
    #[arg(long, value_name = "PASSWORD")]
    pub new_user_password: Option<String>,
}

#[derive(Args, Debug)]
pub struct PasswdArgs {
    pub name: String,
    /// The new password (otherwise prompted, or one line of stdin).
    #[arg(long, value_name = "PASSWORD")]
    pub new_password: Option<String>,
}

/// `conclave role ...`.
#[derive(Subcommand, Debug)]
pub enum RoleCommand {
    /// Add a role without permissions.
    Add { name: String },
    /// Delete a role.
    Delete { name: String },
    /// A role's key-range permissions.
    Get { name: String },
    /// Every role.
    List,
    /// Grant ROLE read, write or readwrite on KEY, [KEY, END), a prefix or every key from KEY.
    GrantPermission(GrantArgs),
    /// Revoke ROLE's permission on exactly that range.
    RevokePermission(RevokeArgs),
}

#[derive(Args, Debug)]
pub struct GrantArgs {
    pub role: String,
    /// read, write or readwrite.
    #[arg(value_name = "read|write|readwrite")]
    pub kind: String,
    #[command(flatten)]
    pub range: RangeArgs,
}

#[derive(Args, Debug)]
pub struct RevokeArgs {
    pub role: String,
    #[command(flatten)]
    pub range: RangeArgs,
}

/// `KEY [END] [--prefix | --from-key]`, as etcdctl takes a permission's range.
#[derive(Args, Debug)]
pub struct RangeArgs {
    pub key: String,
    /// End of the range [KEY, END).
    pub end: Option<String>,
    /// Every key that starts with KEY.
    #[arg(long)]
    pub prefix: bool,
    /// Every key from KEY on.
    #[arg(long)]
    pub from_key: bool,
}

impl RangeArgs {
    /// The range as the wire carries it: `range_end` empty for one key, `"\0"` for every
    /// key from `key` on.
    fn to_range(&self) -> CmdResult<(Vec<u8>, Vec<u8>)> {
        if self.key.is_empty() {
            return Err(Failure::invalid("the key must not be empty"));
        }
        let key = self.key.as_bytes().to_vec();
        let chosen =
            usize::from(self.prefix) + usize::from(self.from_key) + usize::from(self.end.is_some());
        if chosen > 1 {
            return Err(Failure::invalid(
                "give at most one of END, --prefix and --from-key",
            ));
        }
        let range_end = if self.prefix {
            conclave_client::prefix_end(&key)
        } else if self.from_key {
            vec![0]
        } else {
            self.end
                .as_deref()
                .map(|e| e.as_bytes().to_vec())
                .unwrap_or_default()
        };
        Ok((key, range_end))
    }
}

/// etcdctl's way of naming a range in its messages.
fn describe_range(key: &[u8], range_end: &[u8]) -> String {
    if range_end.is_empty() {
        text(key)
    } else if range_end == [0] {
        format!("[{}, <open ended>", text(key))
    } else {
        format!("[{}, {})", text(key), text(range_end))
    }
}

/// Splits `NAME[:PASSWORD]`.
pub fn split_user(spec: &str) -> (String, Option<String>) {
    match spec.split_once(':') {
        Some((name, password)) => (name.to_string(), Some(password.to_string())),
        None => (spec.to_string(), None),
    }
}

/// A password typed at the terminal (not echoed), or one line of stdin when it is not one.
fn read_password(prompt: &str) -> CmdResult<String> {
    if std::io::stdin().is_terminal() {
        return rpassword::prompt_password(prompt)
            .map_err(|e| Failure::io(format!("cannot read the password: {e}")));
    }
    let mut line = String::new();
    std::io::stdin()
        .lock()
        .read_line(&mut line)
        .map_err(|e| Failure::io(format!("cannot read the password from stdin: {e}")))?;
    Ok(line.trim_end_matches(['\n', '\r']).to_string())
}

/// The credentials of `--user NAME[:PASSWORD]`: the password from the flag, else
/// `CONCLAVE_PASSWORD`, else a prompt on a terminal. Never read from a piped stdin, which
/// belongs to the command (`txn`, `put` from stdin).
pub fn credentials(user: Option<&str>) -> CmdResult<Option<Credentials>> {
    let Some(spec) = user else {
        return Ok(None);
    };
    let (name, password) = split_user(spec);
    if name.is_empty() {
        return Err(Failure::invalid(
            "--user needs a user name (NAME[:PASSWORD])",
        ));
    }
    let password = match password {
        Some(password) => password,
        None => match std::env::var(PASSWORD_ENV) {
            Ok(password) => password,
            Err(_) if std::io::stdin().is_terminal() => read_password("Password: ")?,
            Err(_) => {
                return Err(Failure::invalid(format!(
                    "--user {name} has no password: give --user {name}:PASSWORD or set {PASSWORD_ENV}"
                )));
            }
        },
    };
    Ok(Some(Credentials::password(name, password)))
}

pub async fn auth(ctx: &Ctx, command: AuthCommand) -> CmdResult {
    let client = ctx.connect().await?;
    let auth = client.auth();
    match command {
        AuthCommand::Enable => {
            auth.enable().await?;
            ctx.out
                .ok(json!({"enabled": true}), || "Authentication Enabled".into());
        }
        AuthCommand::Disable => {
            auth.disable().await?;
            ctx.out.ok(json!({"enabled": false}), || {
                "Authentication Disabled".into()
            });
        }
        AuthCommand::Status => {
            let (enabled, revision) = auth.status().await?;
            ctx.out.ok(
                json!({"enabled": enabled, "auth_revision": revision}),
                || format!("Authentication Status: {enabled}\nAuthRevision: {revision}"),
            );
        }
    }
    Ok(0)
}

pub async fn user(ctx: &Ctx, command: UserCommand) -> CmdResult {
    // Passwords are asked for before connecting, so a prompt does not eat the deadline.
    let new_password = match &command {
        UserCommand::Add(args) => {
            let (name, inline) = split_user(&args.user);
            if name.is_empty() {
                return Err(Failure::invalid("the user name must not be empty"));
            }
            match (inline, args.new_user_password.clone()) {
                (Some(_), Some(_)) => {
                    return Err(Failure::invalid(
                        "give the password once: NAME:PASSWORD or --new-user-password",
                    ));
                }
                (Some(password), None) | (None, Some(password)) => Some(password),
                (None, None) => Some(read_new_password(&name)?),
            }
        }
        UserCommand::Passwd(args) => match &args.new_password {
            Some(password) => Some(password.clone()),
            None => Some(read_new_password(&args.name)?),
        },
        _ => None,
    };
    let client = ctx.connect().await?;
    let auth = client.auth();
    let password = new_password.unwrap_or_default();
    match command {
        UserCommand::Add(args) => {
            let (name, _) = split_user(&args.user);
            auth.user_add(&name, &password).await?;
            ctx.out
                .ok(json!({"user": name}), || format!("User {name} created"));
        }
        UserCommand::Delete { name } => {
            auth.user_delete(&name).await?;
            ctx.out
                .ok(json!({"user": name}), || format!("User {name} deleted"));
        }
        UserCommand::Get { name } => {
            let roles = auth.user_get(&name).await?;
            let line = roles.join(" ");
            ctx.out.ok(json!({"user": name, "roles": roles}), || {
                format!("User: {name}\nRoles: {line}")
            });
        }
        UserCommand::List => {
            let users = auth.user_list().await?;
            let lines = users.join("\n");
            ctx.out.ok(json!({"users": users}), || lines);
        }
        UserCommand::Passwd(args) => {
            auth.user_change_password(&args.name, &password).await?;
            ctx.out
                .ok(json!({"user": args.name}), || "Password updated".into());
        }
        UserCommand::GrantRole { user, role } => {
            auth.user_grant_role(&user, &role).await?;
            ctx.out.ok(json!({"user": user, "role": role}), || {
                format!("Role {role} is granted to user {user}")
            });
        }
        UserCommand::RevokeRole { user, role } => {
            auth.user_revoke_role(&user, &role).await?;
            ctx.out.ok(json!({"user": user, "role": role}), || {
                format!("Role {role} is revoked from user {user}")
            });
        }
    }
    Ok(0)
}

/// A new password: typed twice on a terminal, else one line of stdin.
fn read_new_password(name: &str) -> CmdResult<String> {
    let password = read_password(&format!("Password of {name}: "))?;
    if std::io::stdin().is_terminal() && read_password("Type password again: ")? != password {
        return Err(Failure::invalid("the two passwords differ"));
    }
    if password.is_empty() {
        return Err(Failure::invalid("the password must not be empty"));
    }
    Ok(password)
}

pub async fn role(ctx: &Ctx, command: RoleCommand) -> CmdResult {
    // Check the arguments before connecting.
    let range = match &command {
        RoleCommand::GrantPermission(GrantArgs { range, .. })
        | RoleCommand::RevokePermission(RevokeArgs { range, .. }) => Some(range.to_range()?),
        _ => None,
    };
    let kind = match &command {
        RoleCommand::GrantPermission(args) => Some(args.kind.parse::<PermissionKind>()?),
        _ => None,
    };
    let client = ctx.connect().await?;
    let auth = client.auth();
    match command {
        RoleCommand::Add { name } => {
            auth.role_add(&name).await?;
            ctx.out
                .ok(json!({"role": name}), || format!("Role {name} created"));
        }
        RoleCommand::Delete { name } => {
            auth.role_delete(&name).await?;
            ctx.out
                .ok(json!({"role": name}), || format!("Role {name} deleted"));
        }
        RoleCommand::Get { name } => {
            let permissions = auth.role_get(&name).await?;
            let documents: Vec<_> = permissions
                .iter()
                .map(|p| {
                    json!({"kind": p.kind.as_str(), "key": text(&p.key), "range_end": text(&p.range_end)})
                })
                .collect();
            ctx.out
                .ok(json!({"role": name, "permissions": documents}), || {
                    let mut lines = vec![format!("Role {name}")];
                    for (title, kinds) in [
                        (
                            "KV Read:",
                            [PermissionKind::Read, PermissionKind::ReadWrite],
                        ),
                        (
                            "KV Write:",
                            [PermissionKind::Write, PermissionKind::ReadWrite],
                        ),
                    ] {
                        lines.push(title.to_string());
                        for p in permissions.iter().filter(|p| kinds.contains(&p.kind)) {
                            lines.push(format!("\t{}", describe_range(&p.key, &p.range_end)));
                        }
                    }
                    lines.join("\n")
                });
        }
        RoleCommand::List => {
            let roles = auth.role_list().await?;
            let lines = roles.join("\n");
            ctx.out.ok(json!({"roles": roles}), || lines);
        }
        RoleCommand::GrantPermission(args) => {
            let (Some((key, range_end)), Some(kind)) = (range, kind) else {
                return Err(Failure::invalid("no permission to grant"));
            };
            let document = json!({
                "role": args.role,
                "kind": kind.as_str(),
                "key": text(&key),
                "range_end": text(&range_end),
            });
            let permission = Permission {
                kind,
                key,
                range_end,
            };
            auth.role_grant_permission(&args.role, permission).await?;
            let role = args.role;
            ctx.out.ok(document, || format!("Role {role} updated"));
        }
        RoleCommand::RevokePermission(args) => {
            let Some((key, range_end)) = range else {
                return Err(Failure::invalid("no permission to revoke"));
            };
            let role = args.role;
            auth.role_revoke_permission(&role, &key, &range_end).await?;
            let range = describe_range(&key, &range_end);
            ctx.out.ok(
                json!({"role": role, "key": text(&key), "range_end": text(&range_end)}),
                || format!("Permission of range {range} is revoked from role {role}"),
            );
        }
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(
        key: &str,
        end: Option<&str>,
        prefix: bool,
        from_key: bool,
    ) -> CmdResult<(Vec<u8>, Vec<u8>)> {
        RangeArgs {
            key: key.into(),
            end: end.map(str::to_string),
            prefix,
            from_key,
        }
        .to_range()
    }

    #[test]
    fn users_split_at_the_first_colon() {
        assert_eq!(split_user("alice"), ("alice".into(), None));
        assert_eq!(
            split_user("alice:pa:ss"),
            ("alice".into(), Some("pa:ss".into()))
        );
        assert_eq!(split_user("bob:"), ("bob".into(), Some(String::new())));
    }

    #[test]
    fn key_ranges_follow_etcdctl() {
        assert_eq!(
            range("a/x", None, false, false).ok(),
            Some((b"a/x".to_vec(), Vec::new()))
        );
        assert_eq!(
            range("a/", None, true, false).ok(),
            Some((b"a/".to_vec(), b"a0".to_vec()))
        );
        assert_eq!(
            range("a", None, false, true).ok(),
            Some((b"a".to_vec(), vec![0]))
        );
        assert_eq!(
            range("a", Some("c"), false, false).ok(),
            Some((b"a".to_vec(), b"c".to_vec()))
        );
        assert!(range("a", Some("c"), true, false).is_err());
        assert!(range("a", None, true, true).is_err());
        assert!(range("", None, false, false).is_err());
        assert_eq!(describe_range(b"a/", b"a0"), "[a/, a0)");
        assert_eq!(describe_range(b"k", b""), "k");
    }
}
