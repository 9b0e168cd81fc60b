//! [`LeaseStore`] on Azure Blob Storage (and Azurite), on the shared request path of
//! `leasehold-storage` (counted, timed and classified round trips; no SDK retries).

use std::time::Duration;

use async_trait::async_trait;
use azure_core::request_options::{IfMatchCondition, Metadata as AzureMetadata};
use azure_storage_blobs::prelude::BlobClient;
use leasehold_storage::azure::BlobContainer;
use leasehold_storage::{Op, OpCounters, StorageAccount, StoreResult};

use crate::store::{BlobProperties, ETag, LeaseDuration, LeaseId, LeaseState, LeaseStore, Metadata};

pub use leasehold_storage::azure::DEFAULT_REQUEST_TIMEOUT;

/// The lock blobs of one container.
#[derive(Debug, Clone)]
pub struct AzureBlobStore {
    container: BlobContainer,
}

impl AzureBlobStore {
    /// A store on `container` in `account`, recording round trips into `counters`.
    pub fn new(account: &StorageAccount, container: &str, counters: OpCounters) -> Self {
        Self {
            container: BlobContainer::new(account, container, counters),
        }
    }

    /// Sets the per-request time limit.
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.container = self.container.with_request_timeout(timeout);
        self
    }

    pub fn container_name(&self) -> &str {
        self.container.name()
    }

    fn blob(&self, name: &str) -> BlobClient {
        self.container.blob(name)
    }

    async fn call<T>(
        &self,
        op: Op,
        fut: impl std::future::Future<Output = azure_core::Result<T>>,
    ) -> StoreResult<T> {
        self.container.call(op, fut).await
    }
}

fn to_azure_metadata(metadata: &Metadata) -> AzureMetadata {
    let mut m = AzureMetadata::new();
    for (k, v) in metadata {
        m.insert(k.clone(), v.clone());
    }
    m
}

fn lease_state(state: Option<&azure_core::LeaseState>) -> LeaseState {
    match state {
        Some(azure_core::LeaseState::Leased) => LeaseState::Leased,
        Some(azure_core::LeaseState::Expired) => LeaseState::Expired,
        Some(azure_core::LeaseState::Breaking) => LeaseState::Breaking,
        Some(azure_core::LeaseState::Broken) => LeaseState::Broken,
        Some(azure_core::LeaseState::Available) | None => LeaseState::Available,
    }
}

#[async_trait]
impl LeaseStore for AzureBlobStore {
    async fn create_container(&self) -> StoreResult<()> {
        self.container.create().await
    }

    async fn create_blob(&self, name: &str) -> StoreResult<()> {
        // Created now or by someone else first: either way the blob is there, which is all we
        // wanted.
        self.container
            .put_empty_if_absent(name, Op::BlobCreate)
            .await
            .map(drop)
    }

    async fn acquire_lease(&self, name: &str, lease: LeaseId, duration: LeaseDuration) -> StoreResult<()> {
        let fut = self
            .blob(name)
            .acquire_lease(duration.as_duration())
            .proposed_lease_id(azure_core::request_options::LeaseId::from(lease.0))
            .into_future();
        self.call(Op::LeaseAcquire, fut).await.map(|_| ())
    }

    async fn renew_lease(&self, name: &str, lease: LeaseId) -> StoreResult<()> {
        let fut = self
            .blob(name)
            .blob_lease_client(azure_core::request_options::LeaseId::from(lease.0))
            .renew()
            .into_future();
        self.call(Op::LeaseRenew, fut).await.map(|_| ())
    }

    async fn release_lease(&self, name: &str, lease: LeaseId, if_match: Option<&ETag>) -> StoreResult<()> {
        let mut builder = self
            .blob(name)
            .blob_lease_client(azure_core::request_options::LeaseId::from(lease.0))
            .release();
        if let Some(tag) = if_match {
            builder = builder.if_match(IfMatchCondition::Match(tag.0.clone()));
        }
        self.call(Op::LeaseRelease, builder.into_future())
            .await
            .map(|_| ())
    }

    async fn break_lease(&self, name: &str, period: Duration) -> StoreResult<()> {
        let fut = self
            .blob(name)
            .break_lease()
            .lease_break_period(period)
            .into_future();
        match self.call(Op::LeaseBreak, fut).await {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Some("LeaseNotPresentWithLeaseOperation") => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn properties(&self, name: &str) -> StoreResult<BlobProperties> {
        let props = self
            .call(Op::BlobProperties, self.blob(name).get_properties().into_future())
            .await?;
        let blob = props.blob;
        Ok(BlobProperties {
            lease_state: lease_state(blob.properties.lease_state.as_ref()),
            metadata: blob.metadata.unwrap_or_default().into_iter().collect(),
            etag: ETag(blob.properties.etag.to_string()),
        })
    }

    async fn set_metadata(
        &self,
        name: &str,
        lease: Option<LeaseId>,
        if_match: Option<&ETag>,
        metadata: &Metadata,
    ) -> StoreResult<ETag> {
        let mut builder = self
            .blob(name)
            .set_metadata()
            .metadata(to_azure_metadata(metadata));
        if let Some(lease) = lease {
            builder = builder.lease_id(azure_core::request_options::LeaseId::from(lease.0));
        }
        if let Some(tag) = if_match {
            builder = builder.if_match(IfMatchCondition::Match(tag.0.clone()));
        }
        let response = self.call(Op::BlobSetMetadata, builder.into_future()).await?;
        Ok(ETag(response.etag))
    }

    fn counters(&self) -> &OpCounters {
        self.container.counters()
    }
}
