//! Thin wrappers over etcd's election service (`v3electionpb`), for programs that share an
//! election with etcd tooling. Conclave's priority groups ([`crate::Election`]) are richer.

use conclave_proto::v3electionpb as pb;
use conclave_proto::v3electionpb::election_client::ElectionClient;

use crate::Client;
use crate::conn::{Retry, request};
use crate::error::{Error, ErrorContext, Result};
use crate::kv::KeyValue;
use crate::lease::LeaseId;

/// Proof of leadership in an etcd election; its `rev` is the fence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdLeaderKey {
    pub name: Vec<u8>,
    pub key: Vec<u8>,
    pub rev: i64,
    pub lease: LeaseId,
}

impl From<pb::LeaderKey> for EtcdLeaderKey {
    fn from(k: pb::LeaderKey) -> Self {
        EtcdLeaderKey {
            name: k.name.into(),
            key: k.key.into(),
            rev: k.rev,
            lease: k.lease,
        }
    }
}

impl From<&EtcdLeaderKey> for pb::LeaderKey {
    fn from(k: &EtcdLeaderKey) -> Self {
        pb::LeaderKey {
            name: k.name.clone().into(),
            key: k.key.clone().into(),
            rev: k.rev,
            lease: k.lease,
        }
    }
}

/// etcd's election service.
#[derive(Clone)]
pub struct EtcdElection {
    client: Client,
}

fn election_client(channel: crate::conn::Channel) -> ElectionClient<crate::conn::Channel> {
    ElectionClient::new(channel)
}

impl EtcdElection {
    pub(crate) fn new(client: Client) -> Self {
        EtcdElection { client }
    }

    /// Waits (up to the request timeout) until `lease` leads election `name`. Repeating a
    /// campaign under the same lease finds the same key, so it is retried.
    pub async fn campaign(
        &self,
        name: impl Into<Vec<u8>>,
        lease: LeaseId,
        value: impl Into<Vec<u8>>,
    ) -> Result<EtcdLeaderKey> {
        let message = pb::CampaignRequest {
            name: name.into().into(),
            lease,
            value: value.into().into(),
        };
        let context = ErrorContext {
            lease_id: lease,
            revision: 0,
        };
        let answer = self
            .client
            .call(Retry::Idempotent, context, |channel, timeout| {
                let message = message.clone();
                async move {
                    election_client(channel)
                        .campaign(request(message, timeout))
                        .await
                }
            })
            .await?
            .into_inner();
        answer
            .leader
            .map(EtcdLeaderKey::from)
            .ok_or_else(|| Error::Unavailable("campaign answer without a leader key".into()))
    }

    /// Replaces the leader's value (refused with `leadership_lost` if no longer leader).
    pub async fn proclaim(&self, leader: &EtcdLeaderKey, value: impl Into<Vec<u8>>) -> Result<()> {
        let message = pb::ProclaimRequest {
            leader: Some(leader.into()),
            value: value.into().into(),
        };
        self.client
            .call(
                Retry::Idempotent,
                ErrorContext::default(),
                |channel, timeout| {
                    let message = message.clone();
                    async move {
                        election_client(channel)
                            .proclaim(request(message, timeout))
                            .await
                    }
                },
            )
            .await?;
        Ok(())
    }

    /// The current leader's key and value, `None` when there is none.
    pub async fn leader(&self, name: impl Into<Vec<u8>>) -> Result<Option<KeyValue>> {
        let message = pb::LeaderRequest {
            name: name.into().into(),
        };
        let answer = self
            .client
            .call(
                Retry::Idempotent,
                ErrorContext::default(),
                |channel, timeout| {
                    let message = message.clone();
                    async move {
                        election_client(channel)
                            .leader(request(message, timeout))
                            .await
                    }
                },
            )
            .await;
        match answer {
            Ok(answer) => Ok(answer.into_inner().kv.map(KeyValue::from)),
            Err(Error::NotFound(_)) => Ok(None),
            Err(error) => Err(error),
        }
    }

    /// Gives up leadership (a stale key changes nothing).
    pub async fn resign(&self, leader: &EtcdLeaderKey) -> Result<()> {
        let message = pb::ResignRequest {
            leader: Some(leader.into()),
        };
        self.client
            .call(
                Retry::Idempotent,
                ErrorContext::default(),
                |channel, timeout| {
                    let message = message.clone();
                    async move {
                        election_client(channel)
                            .resign(request(message, timeout))
                            .await
                    }
                },
            )
            .await?;
        Ok(())
    }
}
