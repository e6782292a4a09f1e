//! TLS for a run (`run --tls`): a throwaway CA made with `conclave certs`, a server
//! certificate per member slot naming the slot's address, a peer certificate per member id
//! (issued when a member first starts under that id, so replacements the member nemesis adds
//! get theirs too) and one client certificate every workload and probe of the harness
//! presents. Members run with client TLS and `--client-cert-auth` and with peer mutual TLS.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use conclave_client::TlsOptions;
use conclave_proto::etcdserverpb::StatusRequest;
use conclave_proto::etcdserverpb::maintenance_client::MaintenanceClient;

use crate::Error;

/// Common name of the harness's client certificate.
const CLIENT_NAME: &str = "conclave-faults";

/// The run's certificates, under `<members root>/tls`.
pub struct RunTls {
    dir: PathBuf,
    binary: PathBuf,
    /// What every client of the harness trusts and presents.
    pub client: TlsOptions,
}

impl RunTls {
    /// Creates the CA, the client certificate and one server certificate per slot, valid for
    /// the slot's host (an IP address: namespaces give each slot its own).
    pub fn create(binary: &Path, dir: PathBuf, hosts: &[String]) -> Result<RunTls, Error> {
        std::fs::create_dir_all(&dir).map_err(|source| Error::Io {
            what: format!("create {}", dir.display()),
            source,
        })?;
        let mut tls = RunTls {
            dir,
            binary: binary.to_path_buf(),
            client: TlsOptions::default(),
        };
        let ca_dir = tls.dir.clone().into_os_string();
        tls.certs(&["init".into(), ca_dir.clone()])?;
        tls.issue(CLIENT_NAME, "client", None, &tls.dir.clone())?;
        for (slot, host) in hosts.iter().enumerate() {
            tls.issue(&slot_name(slot), "server", Some(host), &tls.slot_dir(slot))?;
        }
        let read = |path: PathBuf| {
            std::fs::read(&path).map_err(|source| Error::Io {
                what: format!("read {}", path.display()),
                source,
            })
        };
        tls.client = TlsOptions {
            ca_certificate_pem: Some(read(tls.ca())?),
            client_certificate_pem: Some(read(tls.dir.join(format!("{CLIENT_NAME}-client.pem")))?),
            client_key_pem: Some(read(tls.dir.join(format!("{CLIENT_NAME}-client-key.pem")))?),
        };
        Ok(tls)
    }

    fn ca(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    fn slot_dir(&self, slot: usize) -> PathBuf {
        self.dir.join(slot_name(slot))
    }

    fn certs(&self, args: &[OsString]) -> Result<(), Error> {
        let output = Command::new(&self.binary)
            .arg("certs")
            .args(args)
            .output()
            .map_err(|source| Error::Io {
                what: format!("run {} certs", self.binary.display()),
                source,
            })?;
        if output.status.success() {
            Ok(())
        } else {
            Err(Error::Command {
                command: format!("conclave certs {}", join(args)),
                stderr: String::from_utf8_lossy(&output.stderr).trim().to_string(),
            })
        }
    }

    fn issue(&self, name: &str, kind: &str, ip: Option<&str>, out: &Path) -> Result<(), Error> {
        std::fs::create_dir_all(out).map_err(|source| Error::Io {
            what: format!("create {}", out.display()),
            source,
        })?;
        let mut args: Vec<OsString> = vec![
            "issue".into(),
            "--ca".into(),
            self.dir.clone().into(),
            "--name".into(),
            name.into(),
            "--kind".into(),
            kind.into(),
            "--out".into(),
            out.into(),
        ];
        if let Some(ip) = ip {
            args.extend(["--ip".into(), ip.into()]);
        }
        self.certs(&args)
    }

    /// The TLS flags of `serve` for the member in `slot` under raft id `id`, issuing its peer
    /// certificate first if this id has none yet. A member started with `--id N` and no
    /// `--name` is named `nodeN`, the name its peer certificate must carry.
    pub fn serve_args(&self, slot: usize, id: u64, host: &str) -> Result<Vec<OsString>, Error> {
        let slot_dir = self.slot_dir(slot);
        let member = format!("node{id}");
        let peer_cert = slot_dir.join(format!("{member}-peer.pem"));
        if !peer_cert.exists() {
            self.issue(&member, "peer", Some(host), &slot_dir)?;
        }
        let server = slot_name(slot);
        Ok(vec![
            "--cert-file".into(),
            slot_dir.join(format!("{server}-server.pem")).into(),
            "--key-file".into(),
            slot_dir.join(format!("{server}-server-key.pem")).into(),
            "--trusted-ca-file".into(),
            self.ca().into(),
            "--client-cert-auth".into(),
            "--peer-cert-file".into(),
            peer_cert.into(),
            "--peer-key-file".into(),
            slot_dir.join(format!("{member}-peer-key.pem")).into(),
            "--peer-trusted-ca-file".into(),
            self.ca().into(),
        ])
    }
}

fn slot_name(slot: usize) -> String {
    format!("slot{}", slot + 1)
}

fn join(args: &[OsString]) -> String {
    args.iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// A tonic endpoint for a member's client address (`host:port`): plaintext without `tls`,
/// TLS with the harness's client certificate with it.
pub fn endpoint(client_addr: &str, tls: Option<&TlsOptions>) -> Option<tonic::transport::Endpoint> {
    let url = match tls {
        Some(_) => format!("https://{client_addr}"),
        None => format!("http://{client_addr}"),
    };
    conclave_client::endpoint(&url, tls).ok()
}

/// How long one refusal probe may take.
const PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// Proves the member at `client_addr` enforces what `--tls` promises before the run counts on
/// it: a plaintext Status call and a TLS one without a client certificate are both refused,
/// and one with the harness's certificate is answered. An error names the check that failed.
pub async fn verify_enforced(client_addr: &str, tls: &TlsOptions) -> Result<(), Error> {
    async fn status(endpoint: Option<tonic::transport::Endpoint>) -> bool {
        let Some(endpoint) = endpoint else {
            return false;
        };
        let call = async {
            let channel = endpoint.connect().await.ok()?;
            MaintenanceClient::new(channel)
                .status(StatusRequest {})
                .await
                .ok()
        };
        tokio::time::timeout(PROBE_TIMEOUT, call)
            .await
            .ok()
            .flatten()
            .is_some()
    }
    let without_certificate = TlsOptions {
        client_certificate_pem: None,
        client_key_pem: None,
        ..tls.clone()
    };
    let checks = [
        ("a plaintext client", endpoint(client_addr, None), false),
        (
            "a TLS client without a client certificate",
            endpoint(client_addr, Some(&without_certificate)),
            false,
        ),
        (
            "the harness's TLS client with its certificate",
            endpoint(client_addr, Some(tls)),
            true,
        ),
    ];
    for (who, endpoint, should_answer) in checks {
        if status(endpoint).await != should_answer {
            return Err(Error::Cluster(format!(
                "TLS is not enforced as promised: member at {client_addr} {} {who}",
                if should_answer { "refused" } else { "answered" }
            )));
        }
    }
    Ok(())
}
