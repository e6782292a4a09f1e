//! TLS for both ports: the client gRPC port (`--cert-file --key-file [--trusted-ca-file
//! --client-cert-auth]`) and the peer port (`--peer-cert-file --peer-key-file
//! --peer-trusted-ca-file`, always mutual).
//!
//! Certificates are read from PEM files when the node starts and again on every
//! [`Reloadable::reload`] (the CLI calls it on SIGHUP): a new connection uses the files as they
//! were at the last successful load, and a failed reload keeps the previous certificates and
//! says why. Open connections keep the certificates they started with.
//!
//! Peer naming: a peer certificate must name its member by a DNS subject alternative name equal
//! to the member's name (`--name`, `n1`). The dialer checks that the listener's certificate
//! names the member it dialed; the listener checks that the dialer's certificate names the
//! member its Hello claims, and that this name is the one the cluster records for that id.
//! Both happen before any Raft message is read. The HMAC handshake of the peer secret still
//! runs inside TLS, so a cluster that sets both needs a certificate *and* the secret.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::rustls;

use crate::error::Error;

/// A PEM file larger than this is refused before it is parsed (a certificate chain or key is a
/// few kilobytes).
pub const TLS_PEM_FILE_BYTES_MAX: u64 = 1024 * 1024;
/// Time a client connection has to finish its TLS handshake before it is closed.
pub const CLIENT_TLS_HANDSHAKE_TIMEOUT_MS: u64 = 10_000;
/// TLS handshakes in progress at once on the client port; more connections are closed at once.
pub const CLIENT_TLS_HANDSHAKES_MAX: usize = 256;

/// The files of the client port's TLS (etcd's flag names).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientTlsFiles {
    /// `--cert-file`: this node's server certificate chain (PEM).
    pub cert_file: PathBuf,
    /// `--key-file`: its private key (PEM).
    pub key_file: PathBuf,
    /// `--trusted-ca-file`: the CA client certificates must be signed by.
    pub trusted_ca_file: Option<PathBuf>,
    /// `--client-cert-auth`: refuse clients without a certificate signed by the CA.
    pub client_cert_auth: bool,
}

/// The files of the peer port's mutual TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerTlsFiles {
    /// `--peer-cert-file`: this member's certificate, naming it (DNS SAN = member name).
    pub cert_file: PathBuf,
    /// `--peer-key-file`.
    pub key_file: PathBuf,
    /// `--peer-trusted-ca-file`: the CA every member's certificate must be signed by.
    pub trusted_ca_file: PathBuf,
}

fn invalid(reason: String) -> Error {
    Error::InvalidConfig { reason }
}

fn read_pem_file(path: &Path, what: &str) -> Result<Vec<u8>, Error> {
    let metadata = std::fs::metadata(path)
        .map_err(|e| invalid(format!("cannot read the {what} {}: {e}", path.display())))?;
    if metadata.len() > TLS_PEM_FILE_BYTES_MAX {
        return Err(invalid(format!(
            "the {what} {} is {} bytes; at most {TLS_PEM_FILE_BYTES_MAX} are allowed",
            path.display(),
            metadata.len()
        )));
    }
    std::fs::read(path)
        .map_err(|e| invalid(format!("cannot read the {what} {}: {e}", path.display())))
}

/// The certificates of a PEM file, at least one.
pub fn load_certs(path: &Path, what: &str) -> Result<Vec<CertificateDer<'static>>, Error> {
    let pem = read_pem_file(path, what)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(format!("the {what} {} is not PEM: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(invalid(format!(
            "the {what} {} holds no certificate",
            path.display()
        )));
    }
    Ok(certs)
}

/// The private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn load_key(path: &Path, what: &str) -> Result<PrivateKeyDer<'static>, Error> {
    let pem = read_pem_file(path, what)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| {
        invalid(format!(
            "the {what} {} holds no usable private key: {e}",
            path.display()
        ))
    })
}

fn roots(path: &Path, what: &str) -> Result<Arc<rustls::RootCertStore>, Error> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in load_certs(path, what)? {
        roots.add(cert).map_err(|e| {
            invalid(format!(
                "the {what} {} holds a certificate that cannot be a trust anchor: {e}",
                path.display()
            ))
        })?;
    }
    Ok(Arc::new(roots))
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The client port's rustls configuration from its files (HTTP/2 only, as gRPC needs).
pub fn client_port_config(files: &ClientTlsFiles) -> Result<rustls::ServerConfig, Error> {
    let certs = load_certs(&files.cert_file, "--cert-file")?;
    let key = load_key(&files.key_file, "--key-file")?;
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| invalid(format!("TLS setup: {e}")))?;
    let builder = match &files.trusted_ca_file {
        Some(ca) => {
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                roots(ca, "--trusted-ca-file")?,
                provider(),
            );
            // Without --client-cert-auth a certificate is checked when a client offers one,
            // and a client without one is still served (etcd does the same).
            let verifier = if files.client_cert_auth {
                verifier
            } else {
                verifier.allow_unauthenticated()
            };
            let verifier = verifier
                .build()
                .map_err(|e| invalid(format!("--trusted-ca-file: {e}")))?;
            builder.with_client_cert_verifier(verifier)
        }
        None if files.client_cert_auth => {
            return Err(invalid(
                "--client-cert-auth needs --trusted-ca-file, the CA client certificates are checked against".into(),
            ));
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(certs, key).map_err(|e| {
        invalid(format!(
            "--cert-file and --key-file do not make a usable pair: {e}"
        ))
    })?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

/// The peer port's configurations, one for each direction.
#[derive(Clone)]
pub struct PeerTlsConfigs {
    pub listener: Arc<rustls::ServerConfig>,
    pub dialer: Arc<rustls::ClientConfig>,
}

/// Both sides of the peer port's mutual TLS from its files.
pub fn peer_port_configs(files: &PeerTlsFiles) -> Result<PeerTlsConfigs, Error> {
    let certs = load_certs(&files.cert_file, "--peer-cert-file")?;
    let key = load_key(&files.key_file, "--peer-key-file")?;
    let roots = roots(&files.trusted_ca_file, "--peer-trusted-ca-file")?;
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
            .build()
            .map_err(|e| invalid(format!("--peer-trusted-ca-file: {e}")))?;
    let listener = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| invalid(format!("TLS setup: {e}")))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs.clone(), key.clone_key())
        .map_err(|e| {
            invalid(format!(
                "--peer-cert-file and --peer-key-file do not make a usable pair: {e}"
            ))
        })?;
    let dialer = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| invalid(format!("TLS setup: {e}")))?
        .with_root_certificates(roots)
        .with_client_auth_cert(certs, key)
        .map_err(|e| {
            invalid(format!(
                "--peer-cert-file and --peer-key-file do not make a usable pair: {e}"
            ))
        })?;
    Ok(PeerTlsConfigs {
        listener: Arc::new(listener),
        dialer: Arc::new(dialer),
    })
}

/// A configuration built from files that [`Reloadable::reload`] builds again.
pub struct Reloadable<F, C> {
    files: F,
    build: fn(&F) -> Result<C, Error>,
    current: RwLock<C>,
}

impl<F, C: Clone> Reloadable<F, C> {
    /// Loads the files now; an error here stops the node.
    pub fn load(files: F, build: fn(&F) -> Result<C, Error>) -> Result<Arc<Self>, Error> {
        let current = RwLock::new(build(&files)?);
        Ok(Arc::new(Reloadable {
            files,
            build,
            current,
        }))
    }

    /// What new connections use.
    pub fn current(&self) -> C {
        self.current
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    /// Reads the files again. On an error the previous configuration stays in force.
    pub fn reload(&self) -> Result<(), Error> {
        let fresh = (self.build)(&self.files)?;
        *self
            .current
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = fresh;
        Ok(())
    }
}

/// The client port's TLS, reloadable.
pub type ClientPortTls = Reloadable<ClientTlsFiles, Arc<rustls::ServerConfig>>;
/// The peer port's TLS, reloadable.
pub type PeerPortTls = Reloadable<PeerTlsFiles, PeerTlsConfigs>;

/// Loads the client port's TLS.
pub fn load_client_port_tls(files: ClientTlsFiles) -> Result<Arc<ClientPortTls>, Error> {
    Reloadable::load(files, |files| client_port_config(files).map(Arc::new))
}

/// Loads the peer port's TLS.
pub fn load_peer_port_tls(files: PeerTlsFiles) -> Result<Arc<PeerPortTls>, Error> {
    Reloadable::load(files, peer_port_configs)
}

/// Whether `certificate` names `member` (a DNS subject alternative name equal to it).
pub fn certificate_names_member(certificate: &CertificateDer<'_>, member: &str) -> bool {
    let Ok(name) = ServerName::try_from(member) else {
        return false;
    };
    let Ok(parsed) = rustls::server::ParsedCertificate::try_from(certificate) else {
        return false;
    };
    rustls::client::verify_server_name(&parsed, &name).is_ok()
}

/// The subject common name of a DER certificate, if it has one that is UTF-8.
pub fn common_name(certificate: &CertificateDer<'_>) -> Option<String> {
    let (_, parsed) = x509_parser::parse_x509_certificate(certificate.as_ref()).ok()?;
    let name = parsed
        .subject()
        .iter_common_name()
        .next()?
        .as_str()
        .ok()?
        .to_string();
    Some(name)
}

/// How this node dials another member's client port (a follower forwarding a request to the
/// leader, the cluster status probe): `None` when client TLS is off. The member's server
/// certificate is checked against `--trusted-ca-file` (else `--peer-trusted-ca-file`), and the
/// node presents its peer certificate (else its server certificate) as a client certificate,
/// so a leader with `--client-cert-auth` accepts it when one CA signs both. Read from the files
/// at each call, so a reload applies to new channels.
pub fn member_client_tls(
    config: &crate::ServerConfig,
) -> Result<Option<tonic::transport::ClientTlsConfig>, Error> {
    let Some(client) = &config.client_tls else {
        return Ok(None);
    };
    let peer = config.peer_tls.as_ref();
    let ca = client
        .trusted_ca_file
        .as_ref()
        .or(peer.map(|p| &p.trusted_ca_file))
        .ok_or_else(|| {
            invalid(
                "client TLS needs --trusted-ca-file (or peer TLS's --peer-trusted-ca-file): members check each other's client-port certificate with it when they forward requests to the leader".into(),
            )
        })?;
    let read = |path: &Path, what: &str| read_pem_file(path, what);
    let (cert, key) = match peer {
        Some(peer) => (
            read(&peer.cert_file, "--peer-cert-file")?,
            read(&peer.key_file, "--peer-key-file")?,
        ),
        None => (
            read(&client.cert_file, "--cert-file")?,
            read(&client.key_file, "--key-file")?,
        ),
    };
    let ca = read(ca, "--trusted-ca-file")?;
    Ok(Some(
        tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(ca))
            .identity(tonic::transport::Identity::from_pem(cert, key)),
    ))
}

/// A tonic endpoint for another member's client address, over TLS when client TLS is on.
pub fn member_endpoint(
    config: &crate::ServerConfig,
    client_addr: &str,
) -> Result<tonic::transport::Endpoint, String> {
    let tls = member_client_tls(config).map_err(|e| e.to_string())?;
    let scheme = if tls.is_some() { "https" } else { "http" };
    let endpoint = tonic::transport::Endpoint::from_shared(format!("{scheme}://{client_addr}"))
        .map_err(|e| format!("bad client address {client_addr}: {e}"))?;
    match tls {
        Some(tls) => endpoint
            .tls_config(tls)
            .map_err(|e| format!("TLS to {client_addr}: {e}")),
        None => Ok(endpoint),
    }
}
