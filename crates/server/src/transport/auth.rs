//! Peer authentication: both ends of a peer connection prove they know the cluster's peer key
//! with an HMAC-SHA256 challenge-response inside the Hello exchange (see `docs/transport.md`).
//!
//! ```text
//!  dialer                                              listener
//!    Hello { cluster, from, to, dialer_nonce, attrs } ──►      (attrs: name, client
//!                                                               address, vote window,
//!                                                               peer address)
//!                 ◄── HelloChallenge { listener_nonce, listener_proof }
//!    HelloProof { dialer_proof }                      ──►
//!                 ◄── HelloAccepted | HelloRejected
//!  proof = HMAC(key, label | direction | cluster | dialer id | listener id
//!                    | dialer_nonce | listener_nonce | attrs)
//! ```
//!
//! Each side contributes a fresh random nonce, so a recorded transcript never verifies again
//! (replay), and the direction byte differs between the two proofs, so a listener's proof
//! cannot be sent back as a dialer's (reflection).

use std::path::Path;

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::error::Error;

/// Bytes of each side's handshake nonce.
pub const HANDSHAKE_NONCE_BYTES: usize = 32;
/// Bytes of an HMAC-SHA256 proof.
pub const HANDSHAKE_PROOF_BYTES: usize = 32;
/// A peer secret file shorter than this (after trimming the trailing newline) is refused:
/// too easy to guess.
pub const PEER_SECRET_BYTES_MIN: usize = 16;
/// A peer secret file longer than this is refused (it is not a secret file).
pub const PEER_SECRET_FILE_BYTES_MAX: usize = 4096;

/// Binds every proof to this protocol, so a MAC made for anything else never verifies.
const PROOF_LABEL: &[u8] = b"conclave peer handshake v2";
const DIRECTION_DIALER: u8 = 1;
const DIRECTION_LISTENER: u8 = 2;

pub type Nonce = [u8; HANDSHAKE_NONCE_BYTES];
pub type Proof = [u8; HANDSHAKE_PROOF_BYTES];

/// The key peers prove knowledge of. Debug output never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct PeerKey {
    key: [u8; 32],
    /// Derived from public facts only (`--peer-secret-file` not given).
    weak: bool,
}

impl std::fmt::Debug for PeerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerKey")
            .field("weak", &self.weak)
            .finish_non_exhaustive()
    }
}

impl PeerKey {
    /// The key of a cluster started with a shared secret (the contents of the secret file).
    pub fn from_secret(secret: &[u8]) -> Result<PeerKey, Error> {
        if secret.len() < PEER_SECRET_BYTES_MIN {
            return Err(Error::InvalidConfig {
                reason: format!(
                    "the peer secret is {} bytes; it must be at least {PEER_SECRET_BYTES_MIN}",
                    secret.len()
                ),
            });
        }
        let mut hash = Sha256::new();
        hash.update(b"conclave peer secret v1\0");
        hash.update(secret);
        Ok(PeerKey {
            key: hash.finalize().into(),
            weak: false,
        })
    }

    /// The weak fallback when no secret file is given: a key every member derives from the
    /// cluster id. The cluster id is in every response header, so this only keeps clusters
    /// and misconfigured nodes apart; it does not keep an attacker out.
    pub fn weak_from_cluster_id(cluster_id: u64) -> PeerKey {
        let mut hash = Sha256::new();
        hash.update(b"conclave weak peer key v1\0");
        hash.update(cluster_id.to_be_bytes());
        PeerKey {
            key: hash.finalize().into(),
            weak: true,
        }
    }

    /// Whether anyone who knows the cluster id can derive this key.
    pub fn is_weak(&self) -> bool {
        self.weak
    }

    /// Reads the secret in `path` (trailing whitespace trimmed, so `echo` output works).
    /// A file that others may read works but is warned about: the secret is the cluster's
    /// only proof of membership.
    pub fn read_secret_file(path: &Path) -> Result<PeerKey, Error> {
        let unreadable = |reason: String| Error::InvalidConfig {
            reason: format!("cannot use peer secret file {}: {reason}", path.display()),
        };
        let metadata = std::fs::metadata(path).map_err(|e| unreadable(e.to_string()))?;
        if metadata.len() > PEER_SECRET_FILE_BYTES_MAX as u64 {
            return Err(unreadable(format!(
                "it is {} bytes, more than the {PEER_SECRET_FILE_BYTES_MAX}-byte limit",
                metadata.len()
            )));
        }
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = metadata.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                tracing::warn!(
                    file = %path.display(),
                    mode = format_args!("{mode:o}"),
                    "the peer secret file can be read by other users; make it 0600"
                );
            }
        }
        let contents = std::fs::read(path).map_err(|e| unreadable(e.to_string()))?;
        let trimmed_len = contents
            .iter()
            .rposition(|byte| !byte.is_ascii_whitespace())
            .map_or(0, |last| last + 1);
        PeerKey::from_secret(&contents[..trimmed_len]).map_err(|e| unreadable(e.to_string()))
    }
}

/// What a dialer announces about itself in its Hello; covered by its proof.
#[derive(Debug, Clone, Copy)]
pub struct Transcript<'a> {
    pub cluster_id: u64,
    pub dialer: u64,
    pub listener: u64,
    pub dialer_nonce: &'a Nonce,
    pub listener_nonce: &'a Nonce,
    pub dialer_name: &'a str,
    pub dialer_client_address: &'a str,
    pub dialer_vote_withheld_ms: u64,
    pub dialer_peer_address: &'a str,
}

impl Transcript<'_> {
    fn mac(&self, key: &PeerKey, direction: u8) -> Hmac<Sha256> {
        // A 32-byte key is always accepted by HMAC; the fallback can never run.
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&key.key)
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        mac.update(PROOF_LABEL);
        mac.update(&[direction]);
        mac.update(&self.cluster_id.to_be_bytes());
        mac.update(&self.dialer.to_be_bytes());
        mac.update(&self.listener.to_be_bytes());
        mac.update(self.dialer_nonce);
        mac.update(self.listener_nonce);
        // Length-prefixed, so no two (name, address) pairs hash alike.
        for field in [self.dialer_name, self.dialer_client_address] {
            mac.update(&(field.len() as u64).to_be_bytes());
            mac.update(field.as_bytes());
        }
        mac.update(&self.dialer_vote_withheld_ms.to_be_bytes());
        mac.update(&(self.dialer_peer_address.len() as u64).to_be_bytes());
        mac.update(self.dialer_peer_address.as_bytes());
        mac
    }

    pub fn dialer_proof(&self, key: &PeerKey) -> Proof {
        self.mac(key, DIRECTION_DIALER)
            .finalize()
            .into_bytes()
            .into()
    }

    pub fn listener_proof(&self, key: &PeerKey) -> Proof {
        self.mac(key, DIRECTION_LISTENER)
            .finalize()
            .into_bytes()
            .into()
    }

    /// Constant-time check of a dialer's proof.
    pub fn verify_dialer(&self, key: &PeerKey, proof: &Proof) -> bool {
        self.mac(key, DIRECTION_DIALER).verify_slice(proof).is_ok()
    }

    /// Constant-time check of a listener's proof.
    pub fn verify_listener(&self, key: &PeerKey, proof: &Proof) -> bool {
        self.mac(key, DIRECTION_LISTENER)
            .verify_slice(proof)
            .is_ok()
    }
}

/// A fresh nonce from the operating system's generator.
pub fn new_nonce() -> Result<Nonce, Error> {
    let mut nonce = [0u8; HANDSHAKE_NONCE_BYTES];
    getrandom::fill(&mut nonce).map_err(|error| Error::ProtocolViolation {
        reason: format!("no randomness for a handshake nonce: {error}"),
    })?;
    Ok(nonce)
}

/// `bytes` random bytes, hex-encoded: a new peer secret (used by `conclave dev`).
pub fn new_secret_hex(bytes: usize) -> Result<String, Error> {
    let mut secret = vec![0u8; bytes];
    getrandom::fill(&mut secret).map_err(|error| Error::InvalidConfig {
        reason: format!("no randomness for a peer secret: {error}"),
    })?;
    Ok(secret.iter().map(|byte| format!("{byte:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn transcript<'a>(dialer_nonce: &'a Nonce, listener_nonce: &'a Nonce) -> Transcript<'a> {
        Transcript {
            cluster_id: 7,
            dialer: 1,
            listener: 2,
            dialer_nonce,
            listener_nonce,
            dialer_name: "a",
            dialer_client_address: "127.0.0.1:2379",
            dialer_vote_withheld_ms: 140,
            dialer_peer_address: "127.0.0.1:2380",
        }
    }

    #[test]
    fn proofs_verify_only_with_the_same_key_transcript_and_direction() {
        let key = PeerKey::from_secret(b"0123456789abcdef").expect("long enough");
        let other = PeerKey::from_secret(b"0123456789abcdeF").expect("long enough");
        let (d, l) = ([1; 32], [2; 32]);
        let t = transcript(&d, &l);
        let proof = t.dialer_proof(&key);
        assert!(t.verify_dialer(&key, &proof));
        assert!(!t.verify_dialer(&other, &proof), "another key");
        assert!(
            !t.verify_listener(&key, &proof),
            "reflected as the other direction"
        );
        let fresh = [3; 32];
        assert!(
            !transcript(&d, &fresh).verify_dialer(&key, &proof),
            "replayed against a new listener nonce"
        );
        let mut swapped = t;
        swapped.dialer = 2;
        swapped.listener = 1;
        assert!(!swapped.verify_dialer(&key, &proof), "other node ids");
        let mut moved = t;
        moved.dialer_client_address = "10.0.0.1:2379";
        assert!(!moved.verify_dialer(&key, &proof), "other attributes");
        let mut hastier = t;
        hastier.dialer_vote_withheld_ms = 40;
        assert!(!hastier.verify_dialer(&key, &proof), "another vote window");
        let mut elsewhere = t;
        elsewhere.dialer_peer_address = "10.0.0.1:2380";
        assert!(
            !elsewhere.verify_dialer(&key, &proof),
            "another peer address"
        );
        assert!(t.verify_listener(&key, &t.listener_proof(&key)));
    }

    #[test]
    fn short_secrets_are_refused_and_weak_keys_are_marked() {
        assert!(PeerKey::from_secret(b"short").is_err());
        assert!(PeerKey::weak_from_cluster_id(1).is_weak());
        assert_ne!(
            PeerKey::weak_from_cluster_id(1),
            PeerKey::weak_from_cluster_id(2)
        );
        assert!(
            !format!("{:?}", PeerKey::weak_from_cluster_id(1)).contains("key:"),
            "Debug must not print the key"
        );
    }
}
