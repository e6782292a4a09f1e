//! The auth flags of `conclave serve` (etcd's names): token kind and lifetime, bcrypt cost.

use std::ffi::OsString;

use clap::Args;
use conclave_server::config::AuthConfig;

use crate::cluster_spec::CliError;

/// The one token kind served so far (see docs/security.md, Tokens).
pub const AUTH_TOKEN_SIMPLE: &str = "simple";

/// Auth flags of `conclave serve`.
#[derive(Args, Debug, Clone)]
pub struct AuthServeArgs {
    /// Kind of auth token Authenticate hands out: `simple` (signed tokens any member checks,
    /// see docs/security.md).
    #[arg(long, env = "CONCLAVE_AUTH_TOKEN", default_value = AUTH_TOKEN_SIMPLE)]
    pub auth_token: String,
    /// How long an auth token is accepted, in seconds (etcd's --auth-token-ttl).
    #[arg(long, env = "CONCLAVE_AUTH_TOKEN_TTL", default_value_t = 300)]
    pub auth_token_ttl: u64,
    /// bcrypt cost of new password hashes, 4..=31 (etcd's --bcrypt-cost).
    #[arg(long, env = "CONCLAVE_BCRYPT_COST", default_value_t = 10)]
    pub bcrypt_cost: u32,
}

impl AuthServeArgs {
    /// Fills the server's auth configuration (its `validate` checks the ranges).
    pub fn apply(&self, config: &mut AuthConfig) -> Result<(), CliError> {
        if self.auth_token != AUTH_TOKEN_SIMPLE {
            return Err(CliError::Usage(format!(
                "--auth-token {:?} is not supported: Conclave serves `simple` tokens only",
                self.auth_token
            )));
        }
        config.token_ttl_ms = self.auth_token_ttl.saturating_mul(1000);
        config.bcrypt_cost = self.bcrypt_cost;
        Ok(())
    }

    /// The flags that reproduce these arguments (for `daemon start`).
    pub fn to_args(&self) -> Vec<OsString> {
        vec![
            "--auth-token".into(),
            self.auth_token.clone().into(),
            "--auth-token-ttl".into(),
            self.auth_token_ttl.to_string().into(),
            "--bcrypt-cost".into(),
            self.bcrypt_cost.to_string().into(),
        ]
    }
}
