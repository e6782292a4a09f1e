//! What a request's TLS connection says about its client, for the auth layer.

/// The subject common name of the certificate the client presented on this request's TLS
/// connection, or `None` (plaintext, no certificate, or a certificate without a UTF-8 CN).
///
/// With `--trusted-ca-file` the certificate was verified against the CA during the handshake
/// (a client whose certificate the CA did not sign never gets this far); with
/// `--client-cert-auth` every TLS client has one. etcd's common-name authentication makes this
/// name the request's user.
pub fn client_common_name<T>(request: &tonic::Request<T>) -> Option<String> {
    let certificates = request.peer_certs()?;
    crate::tls::common_name(certificates.first()?)
}
