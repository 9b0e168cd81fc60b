//! [`LeaseStore`] on Azure Blob Storage (and Azurite), on the shared request path of
//! `leasehold-storage` (counted, timed and classified round trips; no SDK retries).

use std::collections::HashMap;
use std::time::Duration;

use async_trait::async_trait;
use azure_core::http::Etag;
use azure_storage_blob::BlobClient;
use azure_storage_blob::models::{
    BlobClientAcquireLeaseOptions, BlobClientBreakLeaseOptions, BlobClientGetPropertiesResultHeaders,
    BlobClientReleaseLeaseOptions, BlobClientSetMetadataOptions, BlobType, LeaseState as AzureLeaseState,
    PageBlobClientCreateOptions, PageBlobClientCreateResultHeaders, PageBlobClientSetSequenceNumberOptions,
    PageBlobClientSetSequenceNumberResultHeaders, SequenceNumberActionType,
};
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

fn lease_state(state: Option<AzureLeaseState>) -> LeaseState {
    match state {
        Some(AzureLeaseState::Leased) => LeaseState::Leased,
        Some(AzureLeaseState::Expired) => LeaseState::Expired,
        Some(AzureLeaseState::Breaking) => LeaseState::Breaking,
        Some(AzureLeaseState::Broken) => LeaseState::Broken,
        Some(AzureLeaseState::Available) | None => LeaseState::Available,
    }
}

/// An answer the service gave that does not read as its documentation says.
fn malformed(op: Op, what: &str) -> leasehold_storage::StoreError {
    leasehold_storage::StoreError::new(
        leasehold_storage::StoreErrorKind::Transient,
        op,
        format!("unreadable answer: {what}"),
    )
}

#[async_trait]
impl LeaseStore for AzureBlobStore {
    async fn create_container(&self) -> StoreResult<()> {
        self.container.create().await
    }

    async fn create_blob(&self, name: &str) -> StoreResult<()> {
        let page_blob = self.blob(name).page_blob_client();
        let attempt = || {
            let options = PageBlobClientCreateOptions::default().if_not_exists();
            let fut = page_blob.create(0, Some(options));
            async move {
                match self.call(Op::BlobCreate, fut).await {
                    Ok(_) => Ok(()),
                    // Created by someone else first (409), or there and leased (412): either
                    // way the blob is there, which is all we wanted.
                    Err(e) if e.code() == Some("BlobAlreadyExists") || e.status() == Some(412) => Ok(()),
                    Err(e) => Err(e),
                }
            }
        };
        self.container.with_container(attempt).await
    }

    async fn acquire_lease(&self, name: &str, lease: LeaseId, duration: LeaseDuration) -> StoreResult<()> {
        let blob = self.blob(name);
        let options = BlobClientAcquireLeaseOptions {
            proposed_lease_id: Some(lease.to_string()),
            ..Default::default()
        };
        let fut = blob.acquire_lease(i32::from(duration.secs()), Some(options));
        self.call(Op::LeaseAcquire, fut).await.map(drop)
    }

    async fn renew_lease(&self, name: &str, lease: LeaseId) -> StoreResult<()> {
        let blob = self.blob(name);
        let fut = blob.renew_lease(lease.to_string(), None);
        self.call(Op::LeaseRenew, fut).await.map(drop)
    }

    async fn release_lease(&self, name: &str, lease: LeaseId, if_match: Option<&ETag>) -> StoreResult<()> {
        let blob = self.blob(name);
        let options = BlobClientReleaseLeaseOptions {
            if_match: if_match.map(|tag| Etag::from(tag.0.clone())),
            ..Default::default()
        };
        let fut = blob.release_lease(lease.to_string(), Some(options));
        self.call(Op::LeaseRelease, fut).await.map(drop)
    }

    async fn break_lease(&self, name: &str, period: Duration) -> StoreResult<()> {
        let blob = self.blob(name);
        let options = BlobClientBreakLeaseOptions {
            break_period: Some(i32::try_from(period.as_secs()).unwrap_or(60).min(60)),
            ..Default::default()
        };
        match self.call(Op::LeaseBreak, blob.break_lease(Some(options))).await {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Some("LeaseNotPresentWithLeaseOperation") => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn properties(&self, name: &str) -> StoreResult<BlobProperties> {
        let blob = self.blob(name);
        let op = Op::BlobProperties;
        let response = self.call(op, blob.get_properties(None)).await?;
        let etag = response
            .etag()
            .ok()
            .flatten()
            .ok_or_else(|| malformed(op, "no ETag"))?;
        let page_blob =
            response.blob_type().map_err(|_| malformed(op, "blob type"))? == Some(BlobType::PageBlob);
        let sequence = if page_blob {
            let number = response
                .blob_sequence_number()
                .map_err(|_| malformed(op, "sequence number"))?
                .ok_or_else(|| malformed(op, "a page blob without a sequence number"))?;
            Some(u64::try_from(number).map_err(|_| malformed(op, "a negative sequence number"))?)
        } else {
            None
        };
        Ok(BlobProperties {
            sequence,
            lease_state: lease_state(response.lease_state().map_err(|_| malformed(op, "lease state"))?),
            metadata: response
                .metadata()
                .map_err(|_| malformed(op, "metadata"))?
                .into_iter()
                .collect(),
            etag: ETag(etag.to_string()),
        })
    }

    async fn set_metadata(
        &self,
        name: &str,
        lease: Option<LeaseId>,
        if_match: Option<&ETag>,
        metadata: &Metadata,
    ) -> StoreResult<ETag> {
        let blob = self.blob(name);
        let op = Op::BlobSetMetadata;
        let metadata: HashMap<String, String> = metadata.clone().into_iter().collect();
        let options = BlobClientSetMetadataOptions {
            lease_id: lease.map(|l| l.to_string()),
            if_match: if_match.map(|tag| Etag::from(tag.0.clone())),
            ..Default::default()
        };
        let response = self.call(op, blob.set_metadata(&metadata, Some(options))).await?;
        let etag = response
            .headers()
            .get_optional_str(&azure_core::http::headers::ETAG)
            .ok_or_else(|| malformed(op, "no ETag"))?;
        Ok(ETag(etag.to_string()))
    }

    async fn increment_sequence(
        &self,
        name: &str,
        lease: LeaseId,
        if_match: Option<&ETag>,
    ) -> StoreResult<Option<(u64, ETag)>> {
        let page_blob = self.blob(name).page_blob_client();
        let op = Op::BlobSequenceIncrement;
        // No content header goes with the action: any one of them would set (and clear) all six.
        let options = PageBlobClientSetSequenceNumberOptions {
            lease_id: Some(lease.to_string()),
            if_match: if_match.map(|tag| Etag::from(tag.0.clone())),
            ..Default::default()
        };
        let fut = page_blob.set_sequence_number(SequenceNumberActionType::Increment, Some(options));
        let response = match self.call(op, fut).await {
            Ok(response) => response,
            // The action on a block blob.
            Err(e) if e.status() == Some(400) && e.code() == Some("InvalidOperation") => return Ok(None),
            Err(e) => return Err(e),
        };
        let number = response
            .blob_sequence_number()
            .map_err(|_| malformed(op, "sequence number"))?
            .ok_or_else(|| malformed(op, "no sequence number"))?;
        let number = u64::try_from(number).map_err(|_| malformed(op, "a negative sequence number"))?;
        let etag = response
            .etag()
            .ok()
            .flatten()
            .ok_or_else(|| malformed(op, "no ETag"))?;
        Ok(Some((number, ETag(etag.to_string()))))
    }

    async fn replace_with_page_blob(
        &self,
        name: &str,
        lease: LeaseId,
        if_match: Option<&ETag>,
        sequence: u64,
        metadata: &Metadata,
    ) -> StoreResult<ETag> {
        let page_blob = self.blob(name).page_blob_client();
        let op = Op::BlobCreate;
        let options = PageBlobClientCreateOptions {
            lease_id: Some(lease.to_string()),
            if_match: if_match.map(|tag| Etag::from(tag.0.clone())),
            blob_sequence_number: Some(
                i64::try_from(sequence).map_err(|_| malformed(op, "a sequence number past 2^63"))?,
            ),
            metadata: Some(metadata.clone().into_iter().collect()),
            ..Default::default()
        };
        let response = self.call(op, page_blob.create(0, Some(options))).await?;
        let etag = response
            .etag()
            .ok()
            .flatten()
            .ok_or_else(|| malformed(op, "no ETag"))?;
        Ok(ETag(etag.to_string()))
    }

    fn counters(&self) -> &OpCounters {
        self.container.counters()
    }
}
