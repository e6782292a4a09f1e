//! The TLS flags of `conclave serve` (etcd's names; the same keys in `--config`).

use std::ffi::OsString;
use std::path::PathBuf;

use clap::Args;
use conclave_server::tls::{ClientTlsFiles, PeerTlsFiles};

use crate::cluster_spec::CliError;

#[derive(Args, Debug, Clone, Default)]
pub struct ServeTlsArgs {
    /// Serve clients over TLS with this certificate chain (PEM); needs --key-file.
    #[arg(long, env = "CONCLAVE_CERT_FILE", value_name = "FILE")]
    pub cert_file: Option<PathBuf>,
    /// The private key of --cert-file (PEM).
    #[arg(long, env = "CONCLAVE_KEY_FILE", value_name = "FILE")]
    pub key_file: Option<PathBuf>,
    /// CA (PEM) that client certificates are checked against.
    #[arg(long, env = "CONCLAVE_TRUSTED_CA_FILE", value_name = "FILE")]
    pub trusted_ca_file: Option<PathBuf>,
    /// Refuse clients without a certificate signed by --trusted-ca-file.
    #[arg(long, env = "CONCLAVE_CLIENT_CERT_AUTH")]
    pub client_cert_auth: bool,
    /// Mutual TLS between members: this member's certificate (PEM), which must carry the
    /// member's name as a DNS subject alternative name; needs the two flags below.
    #[arg(long, env = "CONCLAVE_PEER_CERT_FILE", value_name = "FILE")]
    pub peer_cert_file: Option<PathBuf>,
    /// The private key of --peer-cert-file (PEM).
    #[arg(long, env = "CONCLAVE_PEER_KEY_FILE", value_name = "FILE")]
    pub peer_key_file: Option<PathBuf>,
    /// CA (PEM) every member's peer certificate must be signed by.
    #[arg(long, env = "CONCLAVE_PEER_TRUSTED_CA_FILE", value_name = "FILE")]
    pub peer_trusted_ca_file: Option<PathBuf>,
}

impl ServeTlsArgs {
    /// The client port's and the peer port's TLS files, each `None` when off.
    pub fn to_files(&self) -> Result<(Option<ClientTlsFiles>, Option<PeerTlsFiles>), CliError> {
        let client = match (&self.cert_file, &self.key_file) {
            (Some(cert_file), Some(key_file)) => Some(ClientTlsFiles {
                cert_file: cert_file.clone(),
                key_file: key_file.clone(),
                trusted_ca_file: self.trusted_ca_file.clone(),
                client_cert_auth: self.client_cert_auth,
            }),
            (None, None) => {
                if self.trusted_ca_file.is_some() || self.client_cert_auth {
                    return Err(CliError::Usage(
                        "--trusted-ca-file and --client-cert-auth need --cert-file and --key-file (client TLS)".into(),
                    ));
                }
                None
            }
            _ => {
                return Err(CliError::Usage(
                    "--cert-file and --key-file go together".into(),
                ));
            }
        };
        let peer = match (
            &self.peer_cert_file,
            &self.peer_key_file,
            &self.peer_trusted_ca_file,
        ) {
            (Some(cert_file), Some(key_file), Some(ca)) => Some(PeerTlsFiles {
                cert_file: cert_file.clone(),
                key_file: key_file.clone(),
                trusted_ca_file: ca.clone(),
            }),
            (None, None, None) => None,
            _ => {
                return Err(CliError::Usage(
                    "--peer-cert-file, --peer-key-file and --peer-trusted-ca-file go together (peer TLS is always mutual)".into(),
                ));
            }
        };
        Ok((client, peer))
    }

    /// The flags again, for a child `serve` (`daemon start`).
    pub fn to_argv(&self) -> Vec<OsString> {
        let mut argv: Vec<OsString> = Vec::new();
        for (flag, value) in [
            ("--cert-file", &self.cert_file),
            ("--key-file", &self.key_file),
            ("--trusted-ca-file", &self.trusted_ca_file),
            ("--peer-cert-file", &self.peer_cert_file),
            ("--peer-key-file", &self.peer_key_file),
            ("--peer-trusted-ca-file", &self.peer_trusted_ca_file),
        ] {
            if let Some(path) = value {
                argv.extend([flag.into(), path.clone().into_os_string()]);
            }
        }
        if self.client_cert_auth {
            argv.push("--client-cert-auth".into());
        }
        argv
    }
}
