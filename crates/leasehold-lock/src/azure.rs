//! [`LeaseStore`] on Azure Blob Storage (and Azurite) through `azure_storage_blobs` 0.21.
//!
//! This module and its queue twin in `leasehold-runtime` are the only places that touch the Azure
//! SDK. The SDK's own retry policy is switched off: callers retry transient errors with `backon`,
//! so every request sent is one counted round trip and retries are visible.

use std::future::Future;
use std::time::Duration;

use async_trait::async_trait;
use azure_core::RetryOptions;
use azure_core::error::ErrorKind as AzureErrorKind;
use azure_core::request_options::{IfMatchCondition, Metadata as AzureMetadata};
use azure_storage_blobs::prelude::{BlobClient, ClientBuilder, ContainerClient};

use crate::account::StorageAccount;
use crate::counters::{Op, OpCounters};
use crate::error::{StoreError, StoreErrorKind, StoreResult};
use crate::store::{BlobProperties, ETag, FlagPut, LeaseDuration, LeaseId, LeaseState, LeaseStore, Metadata};

/// Default limit on one round trip before it counts as a transient failure.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// One blob container holding lock and flag blobs.
#[derive(Debug, Clone)]
pub struct AzureBlobStore {
    container: ContainerClient,
    counters: OpCounters,
    request_timeout: Duration,
}

impl AzureBlobStore {
    /// A store on `container` in `account`, recording round trips into `counters`.
    pub fn new(account: &StorageAccount, container: &str, counters: OpCounters) -> Self {
        let container =
            ClientBuilder::with_location(account.blob_location().clone(), account.credentials().clone())
                .retry(RetryOptions::none())
                .container_client(container);
        Self {
            container,
            counters,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
        }
    }

    /// Sets the per-request time limit.
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    pub fn container_name(&self) -> &str {
        self.container.container_name()
    }

    fn blob(&self, name: &str) -> BlobClient {
        self.container.blob_client(name)
    }

    async fn call<T>(&self, op: Op, fut: impl Future<Output = azure_core::Result<T>>) -> StoreResult<T> {
        send(&self.counters, op, self.request_timeout, fut).await
    }

    /// Creates the container; an existing one is success.
    async fn ensure_container(&self) -> StoreResult<()> {
        match self
            .call(Op::ContainerCreate, self.container.create().into_future())
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Some("ContainerAlreadyExists") => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Runs `attempt`; if it says the container is missing, creates the container and tries once more.
    async fn with_container<T, F, Fut>(&self, attempt: F) -> StoreResult<T>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = StoreResult<T>>,
    {
        match attempt().await {
            Err(e) if e.code() == Some("ContainerNotFound") => {
                self.ensure_container().await?;
                attempt().await
            }
            other => other,
        }
    }
}

/// Sends one SDK request for any storage service: counts it, bounds it in time and maps its
/// error. Shared by the blob store here and the queue in `leasehold-runtime`, so every Azure
/// round trip is counted and classified the same way.
pub async fn send<T>(
    counters: &OpCounters,
    op: Op,
    timeout: Duration,
    fut: impl Future<Output = azure_core::Result<T>>,
) -> StoreResult<T> {
    counters.record(op);
    match tokio::time::timeout(timeout, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(map_error(op, &e)),
        Err(_) => Err(StoreError::timeout(op, timeout)),
    }
}

/// Classifies an SDK error as a definitive or transient storage answer. Only the status, the
/// storage error code and a redacted message are kept.
fn map_error(op: Op, e: &azure_core::Error) -> StoreError {
    match e.kind() {
        AzureErrorKind::HttpResponse { status, error_code } => {
            let status = u16::from(*status);
            let code = error_code.clone();
            let kind = classify(status, code.as_deref());
            StoreError::new(kind, op, "").with_status(status, code)
        }
        AzureErrorKind::Io => StoreError::new(StoreErrorKind::Transient, op, format!("connection: {e}")),
        AzureErrorKind::Credential => {
            StoreError::new(StoreErrorKind::Rejected, op, "credentials were refused")
        }
        _ => StoreError::new(StoreErrorKind::Transient, op, e.to_string()),
    }
}

fn classify(status: u16, code: Option<&str>) -> StoreErrorKind {
    match (status, code.unwrap_or("")) {
        (409, "LeaseAlreadyPresent") => StoreErrorKind::LeaseAlreadyPresent,
        (409, "LeaseIsBreakingAndCannotBeAcquired") => StoreErrorKind::LeaseBreaking,
        (409 | 412, c) if c.starts_with("Lease") => StoreErrorKind::LeaseLost,
        (409, "ContainerBeingDeleted" | "BlobBeingRehydrated" | "QueueBeingDeleted") => {
            StoreErrorKind::Transient
        }
        // Queue: a stale pop receipt means someone else took the message since.
        (400, "PopReceiptMismatch") => StoreErrorKind::NotFound,
        (404, _) => StoreErrorKind::NotFound,
        (412, _) => StoreErrorKind::ConditionNotMet,
        (408 | 429 | 500..=599, _) => StoreErrorKind::Transient,
        _ => StoreErrorKind::Rejected,
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
        self.ensure_container().await
    }

    async fn create_blob(&self, name: &str) -> StoreResult<()> {
        let blob = self.blob(name);
        let attempt = || {
            let fut = blob
                .put_block_blob(Vec::<u8>::new())
                .if_match(IfMatchCondition::NotMatch("*".into()))
                .into_future();
            async move {
                match self.call(Op::BlobCreate, fut).await {
                    Ok(_) => Ok(()),
                    // Someone else created it first (409), or it exists and is leased (412): both
                    // mean the blob is there, which is all we wanted.
                    Err(e)
                        if matches!(e.status(), Some(409 | 412)) && e.code() != Some("ContainerNotFound") =>
                    {
                        Ok(())
                    }
                    Err(e) => Err(e),
                }
            }
        };
        self.with_container(attempt).await
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

    async fn put_flag(&self, name: &str) -> StoreResult<FlagPut> {
        let blob = self.blob(name);
        let attempt = || {
            let fut = blob
                .put_block_blob(Vec::<u8>::new())
                .if_match(IfMatchCondition::NotMatch("*".into()))
                .into_future();
            async move {
                match self.call(Op::FlagPut, fut).await {
                    Ok(_) => Ok(FlagPut::Created),
                    Err(e) if e.code() == Some("BlobAlreadyExists") || (e.status() == Some(412)) => {
                        Ok(FlagPut::AlreadySet)
                    }
                    Err(e) => Err(e),
                }
            }
        };
        self.with_container(attempt).await
    }

    async fn delete_flag(&self, name: &str) -> StoreResult<bool> {
        match self
            .call(Op::FlagDelete, self.blob(name).delete().into_future())
            .await
        {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == StoreErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }

    async fn flag_exists(&self, name: &str) -> StoreResult<bool> {
        match self
            .call(Op::BlobProperties, self.blob(name).get_properties().into_future())
            .await
        {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == StoreErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn counters(&self) -> &OpCounters {
        &self.counters
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_answers_are_classified() {
        use StoreErrorKind::*;
        assert_eq!(classify(409, Some("LeaseAlreadyPresent")), LeaseAlreadyPresent);
        assert_eq!(
            classify(409, Some("LeaseIdMismatchWithLeaseOperation")),
            LeaseLost
        );
        assert_eq!(classify(412, Some("LeaseIdMissing")), LeaseLost);
        assert_eq!(classify(412, Some("LeaseNotPresentWithBlobOperation")), LeaseLost);
        assert_eq!(classify(412, Some("ConditionNotMet")), ConditionNotMet);
        assert_eq!(classify(404, Some("BlobNotFound")), NotFound);
        assert_eq!(classify(503, Some("ServerBusy")), Transient);
        assert_eq!(classify(500, None), Transient);
        assert_eq!(classify(429, None), Transient);
        assert_eq!(classify(403, Some("AuthenticationFailed")), Rejected);
        assert_eq!(classify(400, Some("InvalidHeaderValue")), Rejected);
        assert_eq!(classify(400, Some("PopReceiptMismatch")), NotFound);
        assert_eq!(classify(409, Some("QueueBeingDeleted")), Transient);
    }
}
