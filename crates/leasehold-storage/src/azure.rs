//! The one request path to Azure Storage (and Azurite) through the `azure_storage_*` 0.21 crates:
//! [`send`] counts every round trip, bounds it in time and classifies its error, for blobs and
//! queues alike; [`BlobContainer`] is a container as the lock and the retrigger markers use it.
//!
//! The SDK's own retry policy is switched off everywhere: callers retry transient errors with
//! [`crate::RetryOptions`], so every request sent is one counted round trip and retries are visible.

use std::future::Future;
use std::time::Duration;

use azure_core::RetryOptions as AzureRetryOptions;
use azure_core::error::ErrorKind as AzureErrorKind;
use azure_core::request_options::IfMatchCondition;
use azure_storage_blobs::prelude::{BlobClient, ClientBuilder, ContainerClient};

use crate::account::StorageAccount;
use crate::counters::{Op, OpCounters};
use crate::error::{StoreError, StoreErrorKind, StoreResult};

/// Default limit on one round trip before it counts as a transient failure.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The SDK's retry policy for every client: none (see the module docs).
pub fn no_sdk_retries() -> AzureRetryOptions {
    AzureRetryOptions::none()
}

/// Sends one SDK request for any storage service: counts it, bounds it in time and maps its
/// error, so every Azure round trip is counted and classified the same way.
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

/// One blob container: its requests go through [`send`], and one that finds the container
/// missing creates it and is sent once more (the only case where a call costs two round trips).
#[derive(Debug, Clone)]
pub struct BlobContainer {
    client: ContainerClient,
    counters: OpCounters,
    request_timeout: Duration,
}

impl BlobContainer {
    /// The container `name` in `account`, recording round trips into `counters`.
    pub fn new(account: &StorageAccount, name: &str, counters: OpCounters) -> Self {
        let client =
            ClientBuilder::with_location(account.blob_location().clone(), account.credentials().clone())
                .retry(no_sdk_retries())
                .container_client(name);
        Self {
            client,
            counters,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
        }
    }

    /// Sets the per-request time limit.
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    pub fn name(&self) -> &str {
        self.client.container_name()
    }

    pub fn counters(&self) -> &OpCounters {
        &self.counters
    }

    /// The SDK client of a blob in the container, to build a request for [`Self::call`].
    pub fn blob(&self, name: &str) -> BlobClient {
        self.client.blob_client(name)
    }

    /// Sends one request (see [`send`]).
    pub async fn call<T>(&self, op: Op, fut: impl Future<Output = azure_core::Result<T>>) -> StoreResult<T> {
        send(&self.counters, op, self.request_timeout, fut).await
    }

    /// Creates the container; an existing one is success.
    pub async fn create(&self) -> StoreResult<()> {
        match self
            .call(Op::ContainerCreate, self.client.create().into_future())
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Some("ContainerAlreadyExists") => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Runs `attempt`; if it says the container is missing, creates the container and tries
    /// once more.
    pub async fn with_container<T, F, Fut>(&self, attempt: F) -> StoreResult<T>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = StoreResult<T>>,
    {
        match attempt().await {
            Err(e) if e.code() == Some("ContainerNotFound") => {
                self.create().await?;
                attempt().await
            }
            other => other,
        }
    }

    /// Puts an empty blob unless one exists (`If-None-Match: *`), creating the container on
    /// first use: `true` if this call created it, `false` if it was there already.
    pub async fn put_empty_if_absent(&self, name: &str, op: Op) -> StoreResult<bool> {
        let blob = self.blob(name);
        let attempt = || {
            let fut = blob
                .put_block_blob(Vec::<u8>::new())
                .if_match(IfMatchCondition::NotMatch("*".into()))
                .into_future();
            async move {
                match self.call(op, fut).await {
                    Ok(_) => Ok(true),
                    // 409 BlobAlreadyExists, or 412 when the blob is there and leased.
                    Err(e) if e.code() == Some("BlobAlreadyExists") || e.status() == Some(412) => Ok(false),
                    Err(e) => Err(e),
                }
            }
        };
        self.with_container(attempt).await
    }

    /// Deletes a blob: `true` if it existed, `false` if not.
    pub async fn delete_if_present(&self, name: &str, op: Op) -> StoreResult<bool> {
        match self.call(op, self.blob(name).delete().into_future()).await {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == StoreErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Whether a blob exists (one properties request).
    pub async fn exists(&self, name: &str) -> StoreResult<bool> {
        match self
            .call(Op::BlobProperties, self.blob(name).get_properties().into_future())
            .await
        {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == StoreErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
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
            classify(409, Some("LeaseIsBreakingAndCannotBeAcquired")),
            LeaseBreaking
        );
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
        assert_eq!(classify(408, None), Transient);
        assert_eq!(classify(403, Some("AuthenticationFailed")), Rejected);
        assert_eq!(classify(400, Some("InvalidHeaderValue")), Rejected);
        assert_eq!(classify(400, Some("PopReceiptMismatch")), NotFound);
        assert_eq!(classify(409, Some("QueueBeingDeleted")), Transient);
        assert_eq!(classify(409, Some("BlobAlreadyExists")), Rejected);
    }
}
