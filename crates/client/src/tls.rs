//! TLS to the cluster: the CA that signed the members' server certificates and, for servers
//! started with `--client-cert-auth`, this client's own certificate and key.
//!
//! An `https://` endpoint uses TLS and an `http://` endpoint plaintext; a bare `host:port` uses
//! TLS when [`TlsOptions`] are given (as etcdctl does with `--cacert`) and plaintext otherwise.

use std::path::Path;

use tonic::transport::{Certificate, ClientTlsConfig, Identity};

use crate::error::{Error, Result};

/// A PEM file larger than this is refused before it is read whole (certificates and keys are a
/// few kilobytes).
pub const TLS_PEM_FILE_BYTES_MAX: u64 = 1024 * 1024;

/// What the client presents and trusts over TLS (PEM bytes).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsOptions {
    /// The CA the servers' certificates must be signed by (`--cacert`).
    pub ca_certificate_pem: Option<Vec<u8>>,
    /// This client's certificate (`--cert`), for servers that check clients.
    pub client_certificate_pem: Option<Vec<u8>>,
    /// Its private key (`--key`).
    pub client_key_pem: Option<Vec<u8>>,
}

fn read_pem(path: &Path, flag: &str) -> Result<Vec<u8>> {
    let too_large = std::fs::metadata(path)
        .map(|m| m.len() > TLS_PEM_FILE_BYTES_MAX)
        .unwrap_or(false);
    if too_large {
        return Err(Error::InvalidArgument(format!(
            "{flag} {} is larger than {TLS_PEM_FILE_BYTES_MAX} bytes; it is not a PEM certificate or key",
            path.display()
        )));
    }
    std::fs::read(path)
        .map_err(|e| Error::InvalidArgument(format!("cannot read {flag} {}: {e}", path.display())))
}

impl TlsOptions {
    /// Reads the files of `--cacert`, `--cert` and `--key`; the last two go together.
    pub fn from_files(
        ca_certificate: Option<&Path>,
        client_certificate: Option<&Path>,
        client_key: Option<&Path>,
    ) -> Result<TlsOptions> {
        if client_certificate.is_some() != client_key.is_some() {
            return Err(Error::InvalidArgument(
                "--cert and --key go together (the client certificate and its private key)".into(),
            ));
        }
        Ok(TlsOptions {
            ca_certificate_pem: ca_certificate
                .map(|p| read_pem(p, "--cacert"))
                .transpose()?,
            client_certificate_pem: client_certificate
                .map(|p| read_pem(p, "--cert"))
                .transpose()?,
            client_key_pem: client_key.map(|p| read_pem(p, "--key")).transpose()?,
        })
    }

    /// tonic's configuration for one connection.
    pub(crate) fn config(&self) -> Result<ClientTlsConfig> {
        let Some(ca) = &self.ca_certificate_pem else {
            return Err(Error::Tls(
                "an https:// endpoint needs the CA that signed the server's certificate (--cacert)"
                    .into(),
            ));
        };
        let mut config = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca));
        if let (Some(cert), Some(key)) = (&self.client_certificate_pem, &self.client_key_pem) {
            config = config.identity(Identity::from_pem(cert, key));
        }
        Ok(config)
    }
}

/// A tonic endpoint for `url` (a bare `host:port` gets `https://` when `tls` is given), with
/// TLS set up for an `https://` URL; for programs that dial one member themselves.
pub fn endpoint(url: &str, tls: Option<&TlsOptions>) -> Result<tonic::transport::Endpoint> {
    let url = crate::conn::normalize_endpoint(url, tls.is_some());
    let endpoint = tonic::transport::Endpoint::from_shared(url.clone())
        .map_err(|e| Error::InvalidArgument(format!("endpoint {url:?} is not a valid URL: {e}")))?;
    if !url.starts_with("https://") {
        return Ok(endpoint);
    }
    let config = tls.cloned().unwrap_or_default().config()?;
    endpoint
        .tls_config(config)
        .map_err(|e| Error::Tls(format!("endpoint {url:?}: {e}")))
}

/// One sentence for a connection failure that TLS explains, or `None`. `reason` is the chain of
/// causes of the failure, `tls` whether the client spoke TLS and `client_certificate` whether
/// it offered one.
pub(crate) fn explain_failure(reason: &str, tls: bool, client_certificate: bool) -> Option<String> {
    let has = |needle: &str| reason.contains(needle);
    if has("Expired") {
        return Some(if has("invalid peer certificate") {
            "the server's certificate has expired (or is not valid yet)".into()
        } else {
            "the server refused this client's certificate (--cert): it has expired (or is not valid yet)".into()
        });
    }
    if has("invalid peer certificate") {
        let why = if has("UnknownIssuer") || has("BadSignature") {
            "it is not signed by the CA in --cacert"
        } else if has("NotValidForName") {
            "it does not name the host of the endpoint"
        } else {
            "it cannot be verified"
        };
        return Some(format!("the server's certificate is not trusted: {why}"));
    }
    if has("CertificateRequired") {
        return Some(
            "the server requires a client certificate signed by its CA (--cert and --key)".into(),
        );
    }
    if has("alert") && (has("UnknownCA") || has("BadCertificate") || has("DecryptError")) {
        return Some(
            "the server refused this client's certificate (--cert): it is not signed by the server's CA".into(),
        );
    }
    // Under TLS 1.3 a server's refusal of a missing client certificate may reach the client
    // only as the connection closing right after the handshake, without the alert.
    if tls && !client_certificate && has("connection closed") {
        return Some(
            "the server closed the connection after the TLS handshake: it requires a client certificate signed by its CA (--cert and --key)".into(),
        );
    }
    if tls && (has("InvalidContentType") || has("corrupt message") || has("InvalidMessage")) {
        return Some(
            "the server does not speak TLS; use an http:// endpoint without --cacert".into(),
        );
    }
    if !tls && (has("frame with invalid size") || has("FRAME_SIZE_ERROR")) {
        return Some(SPEAKS_TLS.into());
    }
    None
}

/// What a plaintext client is told when the server speaks TLS.
pub(crate) const SPEAKS_TLS: &str = "the server speaks TLS; use an https:// endpoint with --cacert (and --cert and --key if it checks clients)";

/// Whether the server at the plaintext `endpoint` speaks TLS: it answers the HTTP/2 preface
/// with a TLS alert record (content type 21, version 3.x). Asked only after a plaintext
/// connection failed in a way that does not say why (the server closed it at once), so the
/// client can name the cause instead of "broken pipe".
pub(crate) async fn speaks_tls(endpoint: &str, timeout: std::time::Duration) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Some(address) = endpoint.strip_prefix("http://") else {
        return false;
    };
    let attempt = async {
        let mut stream = tokio::net::TcpStream::connect(address).await.ok()?;
        stream
            .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            .await
            .ok()?;
        let mut first = [0u8; 2];
        stream.read_exact(&mut first).await.ok()?;
        Some(first == [21, 3])
    };
    tokio::time::timeout(timeout, attempt)
        .await
        .ok()
        .flatten()
        .unwrap_or(false)
}

/// Why the TLS server at `endpoint` refuses this client, in rustls's words ("received fatal
/// alert: BadCertificate", "invalid peer certificate: UnknownIssuer", ...) for
/// [`explain_failure`], or `None` when it accepts the handshake or cannot be asked.
///
/// Asked after a TLS connection failed without saying why. Under TLS 1.3 a server checks the
/// client's certificate after the client considers the handshake done, and HTTP/2 has sent its
/// preface by then: the server's alert and a TCP reset for that unread preface race, and the
/// reset often wins, leaving only "connection reset" (which read as `connection_failed`).
/// This handshake sends nothing after it, so the server closes cleanly and its alert arrives.
pub(crate) async fn refusal_reason(
    endpoint: &str,
    options: &TlsOptions,
    timeout: std::time::Duration,
) -> Option<String> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    use tokio::io::AsyncReadExt;
    use tokio_rustls::rustls;

    let authority = endpoint.strip_prefix("https://")?.split('/').next()?;
    let host = match authority.rsplit_once(':') {
        Some((host, _port)) => host.trim_start_matches('[').trim_end_matches(']'),
        None => authority,
    };
    let name = ServerName::try_from(host.to_string()).ok()?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(options.ca_certificate_pem.as_deref()?) {
        roots.add(cert.ok()?).ok()?;
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .ok()?
        .with_root_certificates(roots);
    let mut config = match (&options.client_certificate_pem, &options.client_key_pem) {
        (Some(cert), Some(key)) => {
            let chain = CertificateDer::pem_slice_iter(cert)
                .collect::<std::result::Result<Vec<_>, _>>()
                .ok()?;
            let key = PrivateKeyDer::from_pem_slice(key).ok()?;
            builder.with_client_auth_cert(chain, key).ok()?
        }
        _ => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let attempt = async {
        let tcp = tokio::net::TcpStream::connect(authority).await.ok()?;
        let mut stream = match connector.connect(name, tcp).await {
            Ok(stream) => stream,
            Err(error) => return Some(error_chain(&error)),
        };
        // An accepted client hears the server's HTTP/2 settings; a refused one the alert.
        let mut first = [0u8; 1];
        match stream.read(&mut first).await {
            Ok(0) => Some("connection closed after the TLS handshake".to_string()),
            Ok(_) => None,
            Err(error) => Some(error_chain(&error)),
        }
    };
    tokio::time::timeout(timeout, attempt).await.ok().flatten()
}

fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let said = cause.to_string();
        if !text.contains(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_failures_get_one_sentence_and_others_none() {
        let expired = "transport error: invalid peer certificate: Expired";
        assert!(
            explain_failure(expired, true, false)
                .unwrap()
                .contains("expired")
        );
        let foreign = "invalid peer certificate: UnknownIssuer";
        assert!(
            explain_failure(foreign, true, false)
                .unwrap()
                .contains("--cacert")
        );
        assert!(explain_failure("connection refused", true, false).is_none());
        assert!(explain_failure("connection refused", false, false).is_none());
        let closed = "operation was canceled: connection closed";
        assert!(
            explain_failure(closed, true, false)
                .unwrap()
                .contains("--cert")
        );
        assert!(explain_failure(closed, true, true).is_none());
        assert!(explain_failure(closed, false, false).is_none());
        let plaintext = "h2 protocol error: frame with invalid size";
        assert!(
            explain_failure(plaintext, false, false)
                .unwrap()
                .contains("https://")
        );
    }

    #[test]
    fn cert_without_key_is_refused() {
        let error = TlsOptions::from_files(None, Some(Path::new("/nonexistent")), None)
            .expect_err("a certificate needs its key");
        assert_eq!(error.code(), "invalid_argument");
    }
}
