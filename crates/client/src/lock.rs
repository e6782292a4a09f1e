//! Locks with fencing tokens over etcd's Lock service (`v3lockpb`).
//!
//! The lock key is `<name>/<lease hex>`, bound to the holder's lease; its `create_revision`
//! is the fencing token (docs/state.md, "Locks with fencing"). Release is a KV transaction
//! that deletes the key only if it was created at our fence, so a late or repeated unlock can
//! never release a later holder.

use std::time::Duration;

use conclave_proto::v3lockpb::LockRequest;
use conclave_proto::v3lockpb::lock_client::LockClient;
use tokio::time::Instant;

use crate::Client;
use crate::conn::{Retry, queue_wait_slice, request};
use crate::error::{Error, ErrorContext, Result};
use crate::kv::{Compare, CompareOp, DeleteOptions, GetOptions, Op, Txn};
use crate::lease::{LeaseId, LeaseKeepAlive};

/// Options of [`Mutex::lock`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockOptions {
    /// TTL of the lease the client grants for the lock (ignored with `lease`).
    pub ttl: Duration,
    /// Hold the lock under an existing lease (kept alive by the client, not revoked).
    pub lease: Option<LeaseId>,
    /// Give up waiting after this long; `None` waits for ever.
    pub timeout: Option<Duration>,
}

impl Default for LockOptions {
    fn default() -> Self {
        LockOptions {
            ttl: Duration::from_secs(10),
            lease: None,
            timeout: None,
        }
    }
}

/// Locks.
#[derive(Clone)]
pub struct Mutex {
    client: Client,
}

impl Mutex {
    pub(crate) fn new(client: Client) -> Self {
        Mutex { client }
    }

    /// Waits until the caller holds `name`.
    pub async fn lock(&self, name: &str, options: LockOptions) -> Result<LockGuard> {
        if name.is_empty() {
            return Err(Error::InvalidArgument("a lock needs a name".into()));
        }
        let keeper = match options.lease {
            Some(id) => self.client.lease_keep_alive(id),
            None => self.client.lease_grant_kept(options.ttl).await?,
        };
        let lease = keeper.id();
        let context = ErrorContext {
            lease_id: lease,
            revision: 0,
        };
        let give_up = options.timeout.map(|t| Instant::now() + t);
        let message = LockRequest {
            name: name.as_bytes().to_vec().into(),
            lease,
        };
        let mut expired = Box::pin(keeper.expired());
        let mut first = true;
        let key = loop {
            let Some(slice) = queue_wait_slice(give_up, first) else {
                return Err(Error::Timeout(format!(
                    "lock {name:?} not acquired within the lock timeout"
                )));
            };
            first = false;
            // Locking again with the same lease is idempotent (same key, same fence). Not in a
            // session: the server removes the queue key of a Lock call dropped while waiting,
            // and a retry must put it back, not replay the first answer.
            let call =
                self.client
                    .inner
                    .call(Retry::Idempotent, context, slice, |channel, timeout| {
                        let message = message.clone();
                        async move {
                            LockClient::new(channel)
                                .lock(request(message, timeout))
                                .await
                        }
                    });
            let answer = tokio::select! {
                answer = call => answer,
                reason = &mut expired => {
                    return Err(Error::LeaseExpired { lease_id: lease, message: reason });
                }
            };
            match answer {
                Ok(answer) => break Vec::from(answer.into_inner().key),
                Err(Error::Timeout(_)) => {}
                Err(error) => return Err(error),
            }
        };
        // The Lock answer carries the key, not its revision; the key is ours (bound to our
        // lease), so its create_revision cannot change while we hold it.
        let held = self.client.get(key.clone(), GetOptions::default()).await?;
        let fence = match held.kvs.first() {
            Some(kv) if kv.lease == lease => kv.create_revision,
            _ => {
                return Err(Error::LeaseExpired {
                    lease_id: lease,
                    message: format!("lock {name:?} was lost before it could be fenced"),
                });
            }
        };
        Ok(LockGuard {
            client: self.client.clone(),
            name: name.to_string(),
            key,
            fence,
            keeper: Some(keeper),
        })
    }
}

/// Holding a lock. [`LockGuard::unlock`] or dropping it releases the lock (fenced).
pub struct LockGuard {
    client: Client,
    name: String,
    key: Vec<u8>,
    fence: i64,
    keeper: Option<LeaseKeepAlive>,
}

/// Deletes `key` only if it was created at `fence`; answers whether it did.
async fn release(client: &Client, key: Vec<u8>, fence: i64) -> Result<bool> {
    let txn = Txn::new()
        .when([Compare::create_revision(
            key.clone(),
            CompareOp::Equal,
            fence,
        )])
        .and_then([Op::delete(key, DeleteOptions::default())]);
    // Fenced, so repeating it is harmless; in a session a retry also reports the first
    // attempt's release instead of "not held".
    Ok(client.txn_with(txn, Retry::Idempotent).await?.succeeded)
}

impl LockGuard {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The key representing ownership.
    pub fn key(&self) -> &[u8] {
        &self.key
    }

    /// The fencing token: greater than every earlier holder's.
    pub fn fence(&self) -> u64 {
        u64::try_from(self.fence).unwrap_or(0)
    }

    pub fn lease_id(&self) -> LeaseId {
        self.keeper.as_ref().map_or(0, LeaseKeepAlive::id)
    }

    /// The compare that makes a KV transaction apply only while this lock is held.
    pub fn fence_compare(&self) -> Compare {
        Compare::create_revision(self.key.clone(), CompareOp::Equal, self.fence)
    }

    /// Resolves when the lock's lease must be considered gone (see [`LeaseKeepAlive`]).
    pub fn lost(&self) -> impl Future<Output = String> + Send + 'static {
        let expired = self.keeper.as_ref().map(LeaseKeepAlive::expired);
        async move {
            match expired {
                Some(expired) => expired.await,
                None => "the lock was released".to_string(),
            }
        }
    }

    /// Releases the lock; answers whether we still held it.
    pub async fn unlock(mut self) -> Result<bool> {
        let released = release(&self.client, std::mem::take(&mut self.key), self.fence).await;
        if let Some(keeper) = self.keeper.take() {
            drop(keeper);
        }
        released
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        let keeper = self.keeper.take();
        if self.key.is_empty() {
            return;
        }
        let key = std::mem::take(&mut self.key);
        let client = self.client.clone();
        let fence = self.fence;
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                // Best effort: if it fails, revoking (or expiry of) the lease releases it.
                let _ = release(&client, key, fence).await;
                drop(keeper);
            });
        }
    }
}
