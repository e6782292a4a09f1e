//! Mutual TLS on the peer port: the reloadable certificates and what the cluster calls each
//! member, so each side can check that the other's certificate names the member it claims to
//! be (see [`crate::tls`] for the naming rule).

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use conclave_raft::NodeId;
use rustls_pki_types::{CertificateDer, ServerName};
use tokio::net::TcpStream;

use crate::error::Error;
use crate::tls::{PeerPortTls, PeerTlsFiles, certificate_names_member, load_peer_port_tls};

/// The peer port's TLS: certificates (reloaded on SIGHUP) and the member names they must carry.
pub struct PeerTls {
    port: Arc<PeerPortTls>,
    names: RwLock<BTreeMap<NodeId, String>>,
}

impl std::fmt::Debug for PeerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerTls").finish_non_exhaustive()
    }
}

/// Two transport configurations are alike only if they share the very same TLS state.
impl PartialEq for PeerTls {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}
impl Eq for PeerTls {}

impl PeerTls {
    /// Loads the files; an error stops the node.
    pub fn load(files: PeerTlsFiles) -> Result<Arc<PeerTls>, Error> {
        Ok(Arc::new(PeerTls {
            port: load_peer_port_tls(files)?,
            names: RwLock::new(BTreeMap::new()),
        }))
    }

    /// Reads the certificate files again (SIGHUP); on an error the previous ones stay.
    pub fn reload(&self) -> Result<(), Error> {
        self.port.reload()
    }

    /// Records the name the cluster knows member `id` by (founding list, member records).
    pub fn note_member_name(&self, id: NodeId, name: &str) {
        if name.is_empty() {
            return;
        }
        let mut names = self.names.write().unwrap_or_else(|p| p.into_inner());
        names.insert(id, name.to_string());
    }

    pub fn member_name(&self, id: NodeId) -> Option<String> {
        let names = self.names.read().unwrap_or_else(|p| p.into_inner());
        names.get(&id).cloned()
    }

    /// The dialer's TLS handshake with member `peer`, whose certificate must name it.
    pub(crate) async fn connect(
        &self,
        peer: NodeId,
        stream: TcpStream,
    ) -> Result<tokio_rustls::client::TlsStream<TcpStream>, Error> {
        let name = self.member_name(peer).ok_or_else(|| Error::PeerTls {
            reason: format!(
                "the name of member {peer} is not known, so its certificate cannot be checked"
            ),
        })?;
        let server_name = ServerName::try_from(name.clone()).map_err(|_| Error::PeerTls {
            reason: format!("member name {name:?} is not a DNS name a certificate can carry"),
        })?;
        let connector = tokio_rustls::TlsConnector::from(self.port.current().dialer);
        let stream = connector
            .connect(server_name, stream)
            .await
            .map_err(|error| Error::PeerTls {
                reason: format!("TLS with member {peer} ({name}) failed: {error}"),
            })?;
        Ok(stream)
    }

    /// The listener's TLS handshake: the dialer must present a certificate the CA signed.
    /// Returns the stream and the dialer's certificate.
    pub(crate) async fn accept(
        &self,
        stream: TcpStream,
    ) -> Result<
        (
            tokio_rustls::server::TlsStream<TcpStream>,
            CertificateDer<'static>,
        ),
        Error,
    > {
        let acceptor = tokio_rustls::TlsAcceptor::from(self.port.current().listener);
        let stream = acceptor
            .accept(stream)
            .await
            .map_err(|error| Error::PeerTls {
                reason: format!("TLS handshake failed: {error}"),
            })?;
        let certificate = stream
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|certs| certs.first())
            .cloned()
            .ok_or_else(|| Error::PeerTls {
                reason: "the peer presented no certificate".into(),
            })?;
        Ok((stream, certificate))
    }

    /// Why the dialer's certificate does not fit the member its Hello claims, if it does not:
    /// it must name `claimed_name`, and that must be the name the cluster records for `from`
    /// (an id the cluster does not know yet is not a member, and the Raft core refuses its
    /// messages anyway).
    pub(crate) fn check_claim(
        &self,
        certificate: &CertificateDer<'_>,
        from: NodeId,
        claimed_name: &str,
    ) -> Option<String> {
        if !certificate_names_member(certificate, claimed_name) {
            return Some(format!(
                "node {from}'s certificate does not name the member {claimed_name:?} its Hello claims"
            ));
        }
        match self.member_name(from) {
            Some(known) if known != claimed_name => Some(format!(
                "node {from} is member {known:?}, but it presented a certificate for {claimed_name:?}"
            )),
            _ => None,
        }
    }
}
