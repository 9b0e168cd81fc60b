//! The one request path to Azure Storage (and Azurite) through the official `azure_storage_blob`
//! and `azure_storage_queue` 1.x crates:
//! [`send`] counts every round trip, bounds it in time and classifies its error, for blobs and
//! queues alike; [`BlobContainer`] is a container as the lock and the retrigger markers use it.
//!
//! The SDK's own retry policy is switched off everywhere: callers retry transient errors with
//! [`crate::RetryOptions`], so every request sent is one counted round trip and retries are visible.

use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use azure_core::error::ErrorKind as AzureErrorKind;
use azure_core::http::{ClientOptions, RetryOptions as AzureRetryOptions, Transport};
use azure_storage_blob::models::{
    AccountKind, BlobClientUploadOptions, BlobContainerClientGetAccountInfoResultHeaders,
    BlobContainerClientListBlobsOptions, LeaseState as AzureLeaseState, ListBlobsIncludeItem,
};
use azure_storage_blob::{BlobClient, BlobContainerClient, BlobContainerClientOptions};

use crate::account::{Service, StorageAccount};
use crate::counters::{Op, OpCounters};
use crate::error::{StoreError, StoreErrorKind, StoreResult};

/// Default limit on one round trip before it counts as a transient failure.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a pooled connection may sit idle before it is closed: below Azurite's keep-alive
/// (Node's default, 5 s; Azure's own is minutes), so a connection is never reused just as the
/// server closes it.
pub const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(4);

/// Most tokio runtimes whose pools are kept: past this many (only a process that keeps making
/// runtimes, as a test binary does, gets there) the map starts afresh and live runtimes build
/// their pools again on their next request.
const MAX_RUNTIME_POOLS: usize = 64;

/// The HTTP client every storage client sends through: one `reqwest` client, so one connection
/// pool, per tokio runtime. A trigger's 6–10 requests reuse connections instead of opening one
/// each, and every blob and queue client of a runtime shares them.
///
/// Per runtime because a pooled connection is served by a task of the runtime that opened it: a
/// pool shared across runtimes can hand a request a connection whose runtime has just shut down,
/// and the request fails ("runtime dropped the dispatch task"). The application has one runtime;
/// a library user's tests, each `#[tokio::test]` on a runtime of its own, have many.
#[derive(Debug, Default)]
pub struct RuntimePools {
    clients: std::sync::Mutex<std::collections::HashMap<Option<tokio::runtime::Id>, reqwest::Client>>,
}

impl RuntimePools {
    /// The pools of this process.
    pub fn global() -> &'static Arc<RuntimePools> {
        static POOLS: OnceLock<Arc<RuntimePools>> = OnceLock::new();
        POOLS.get_or_init(Arc::default)
    }

    /// The client (and pool) of the runtime this is called on.
    pub fn current(&self) -> reqwest::Client {
        let runtime = tokio::runtime::Handle::try_current().ok().map(|h| h.id());
        let mut clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(client) = clients.get(&runtime) {
            return client.clone();
        }
        if clients.len() >= MAX_RUNTIME_POOLS {
            clients.clear();
        }
        let client = reqwest::Client::builder()
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            // Storage never redirects; a 3xx is an error to surface, not a request to re-send
            // (signed for one URL) somewhere else.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .expect("an HTTP client with default TLS settings builds");
        clients.insert(runtime, client.clone());
        client
    }
}

#[async_trait::async_trait]
impl azure_core::http::HttpClient for RuntimePools {
    async fn execute_request(
        &self,
        request: &azure_core::http::Request,
    ) -> azure_core::Result<azure_core::http::AsyncRawResponse> {
        let client = self.current();
        client.execute_request(request).await
    }
}

/// Client options for every storage client: the runtime's HTTP client, no SDK retries (callers
/// retry transient errors with [`crate::RetryOptions`], so each call is one counted round trip),
/// and the account's authorisation.
pub fn client_options(account: &StorageAccount) -> ClientOptions {
    client_options_for(account, Service::Blob)
}

/// [`client_options`] for requests to `service`: blobs and queues are signed alike, the Table
/// service otherwise (a Shared Key string of its own).
pub fn client_options_for(account: &StorageAccount, service: Service) -> ClientOptions {
    ClientOptions {
        retry: AzureRetryOptions::none(),
        transport: Some(Transport::new(RuntimePools::global().clone())),
        per_try_policies: crate::auth::policy(account.account(), account.credential(), service)
            .into_iter()
            .collect(),
        ..Default::default()
    }
}

/// Counter of storage round trips sent, by `op` ([`Op::label`]).
pub const STORAGE_REQUESTS_TOTAL: &str = "leasehold_storage_requests_total";
/// Counter of failed storage round trips, by `op` and `class` ([`StoreError::class`]: a
/// storage answer's kind, or `timeout`). Some classes are the protocol's expected answers
/// (`lease_already_present` when a record is busy, `not_found` for an absent marker).
pub const STORAGE_ERRORS_TOTAL: &str = "leasehold_storage_errors_total";

/// Sends one SDK request for any storage service: counts it (in `counters` and the
/// [`STORAGE_REQUESTS_TOTAL`] metric), bounds it in time and maps its error (counted in
/// [`STORAGE_ERRORS_TOTAL`]), so every Azure round trip is counted and classified the same way.
pub async fn send<T>(
    counters: &OpCounters,
    op: Op,
    timeout: Duration,
    fut: impl Future<Output = azure_core::Result<T>>,
) -> StoreResult<T> {
    counters.record(op);
    metrics::counter!(STORAGE_REQUESTS_TOTAL, "op" => op.label()).increment(1);
    let error = match tokio::time::timeout(timeout, fut).await {
        Ok(Ok(v)) => return Ok(v),
        Ok(Err(e)) => map_error(op, &e),
        Err(_) => StoreError::timeout(op, timeout),
    };
    metrics::counter!(STORAGE_ERRORS_TOTAL, "op" => op.label(), "class" => error.class()).increment(1);
    Err(error)
}

/// Classifies an SDK error as a definitive or transient storage answer. Only the status, the
/// storage error code and a redacted message are kept.
fn map_error(op: Op, e: &azure_core::Error) -> StoreError {
    match e.kind() {
        AzureErrorKind::HttpResponse {
            status,
            error_code,
            raw_response,
        } => {
            let status = u16::from(*status);
            // Without an `x-ms-error-code` the SDK puts the status number in its place.
            let code = error_code.clone().filter(|c| c.parse::<u16>().is_err());
            let kind = classify(status, code.as_deref());
            let message = raw_response
                .as_ref()
                .and_then(|r| service_message(r.body().as_ref()))
                .unwrap_or_default();
            StoreError::new(kind, op, message).with_status(status, code)
        }
        AzureErrorKind::Io | AzureErrorKind::Connection => {
            StoreError::new(StoreErrorKind::Transient, op, format!("connection: {e}"))
        }
        AzureErrorKind::Credential => {
            StoreError::new(StoreErrorKind::Rejected, op, "credentials were refused")
        }
        _ => StoreError::new(StoreErrorKind::Transient, op, e.to_string()),
    }
}

/// The first line of the service's `<Message>` (what went wrong, in its words: "The API version
/// … is not supported by Azurite", "Server failed to authenticate the request"); later lines hold
/// request ids and, for authentication failures, details that are kept out of logs. The Table
/// service answers in JSON instead: its `odata.error.message.value`, likewise.
fn service_message(body: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(body).ok()?;
    let message = match text.find("<Message>") {
        Some(at) => {
            let start = at + "<Message>".len();
            let end = start + text[start..].find("</Message>")?;
            text[start..end].to_string()
        }
        None => crate::table::odata_error(body)?.1,
    };
    let first = message.lines().next()?.trim();
    (!first.is_empty()).then(|| first.chars().take(300).collect())
}

pub(crate) fn classify(status: u16, code: Option<&str>) -> StoreErrorKind {
    match (status, code.unwrap_or("")) {
        (409, "LeaseAlreadyPresent") => StoreErrorKind::LeaseAlreadyPresent,
        (409, "LeaseIsBreakingAndCannotBeAcquired") => StoreErrorKind::LeaseBreaking,
        (409 | 412, c) if c.starts_with("Lease") => StoreErrorKind::LeaseLost,
        (
            409,
            "ContainerBeingDeleted" | "BlobBeingRehydrated" | "QueueBeingDeleted" | "TableBeingDeleted",
        ) => StoreErrorKind::Transient,
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
#[derive(Clone)]
pub struct BlobContainer {
    client: Arc<BlobContainerClient>,
    counters: OpCounters,
    request_timeout: Duration,
}

impl std::fmt::Debug for BlobContainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlobContainer")
            .field("name", &self.name())
            .finish()
    }
}

impl BlobContainer {
    /// The container `name` in `account`, recording round trips into `counters`.
    pub fn new(account: &StorageAccount, name: &str, counters: OpCounters) -> Self {
        let options = BlobContainerClientOptions {
            client_options: client_options(account),
            ..Default::default()
        };
        let client = BlobContainerClient::new(
            account.url(Service::Blob, name),
            account.token_credential(),
            Some(options),
        )
        .expect("a container URL under a valid endpoint");
        Self {
            client: Arc::new(client),
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
        self.client
            .url()
            .path_segments()
            .and_then(|mut s| s.next_back())
            .unwrap_or_default()
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
        match self.call(Op::ContainerCreate, self.client.create(None)).await {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Some("ContainerAlreadyExists") => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Whether the container exists (one properties request).
    pub async fn container_exists(&self) -> StoreResult<bool> {
        match self
            .call(Op::BlobProperties, self.client.get_properties(None))
            .await
        {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == StoreErrorKind::NotFound => Ok(false),
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
        Ok(self.create_empty(name, op).await?.is_some())
    }

    /// [`put_empty_if_absent`](Self::put_empty_if_absent) that says what it created: the new
    /// blob's ETag if this call created it, `None` if it was there already.
    pub async fn create_empty_tagged(&self, name: &str, op: Op) -> StoreResult<Option<String>> {
        match self.create_empty(name, op).await? {
            None => Ok(None),
            Some(answer) => answer
                .etag
                .map(|tag| Some(tag.to_string()))
                .ok_or_else(|| StoreError::new(StoreErrorKind::Transient, op, "unreadable answer: no ETag")),
        }
    }

    /// The upload of an empty blob with `If-None-Match: *`: its answer if this call created it.
    async fn create_empty(
        &self,
        name: &str,
        op: Op,
    ) -> StoreResult<Option<azure_storage_blob::models::BlobClientUploadResult>> {
        let blob = self.blob(name);
        let attempt = || {
            let fut = blob.upload(
                azure_core::Bytes::new().into(),
                Some(BlobClientUploadOptions::default().if_not_exists()),
            );
            async move {
                match self.call(op, fut).await {
                    Ok(answer) => Ok(Some(answer)),
                    // 409 BlobAlreadyExists, or 412 when the blob is there and leased.
                    Err(e) if e.code() == Some("BlobAlreadyExists") || e.status() == Some(412) => Ok(None),
                    Err(e) => Err(e),
                }
            }
        };
        self.with_container(attempt).await
    }

    /// Replaces a blob's metadata with `metadata`, without a lease, which changes its ETag: the
    /// new ETag, or `None` if the blob (or its container) does not exist. Never creates it.
    pub async fn set_metadata_if_present(
        &self,
        name: &str,
        metadata: &std::collections::HashMap<String, String>,
        op: Op,
    ) -> StoreResult<Option<String>> {
        match self.call(op, self.blob(name).set_metadata(metadata, None)).await {
            Ok(answer) => answer
                .headers()
                .get_optional_str(&azure_core::http::headers::ETAG)
                .map(|tag| Some(tag.to_string()))
                .ok_or_else(|| StoreError::new(StoreErrorKind::Transient, op, "unreadable answer: no ETag")),
            Err(e) if e.kind() == StoreErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// A blob's metadata (one properties request), `None` if it (or its container) does not
    /// exist.
    pub async fn metadata(
        &self,
        name: &str,
        op: Op,
    ) -> StoreResult<Option<std::collections::HashMap<String, String>>> {
        use azure_storage_blob::models::BlobClientGetPropertiesResultHeaders;
        match self.call(op, self.blob(name).get_properties(None)).await {
            Ok(answer) => answer
                .metadata()
                .map(Some)
                .map_err(|_| StoreError::new(StoreErrorKind::Transient, op, "unreadable answer: metadata")),
            Err(e) if e.kind() == StoreErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// A blob's metadata with storage's own clock (one properties request): when the blob was
    /// last written and the time the service answered, both by the service's clock, so a time
    /// written relative to the write can be measured without trusting this machine's clock.
    /// `None` if it (or its container) does not exist.
    pub async fn metadata_with_clock(&self, name: &str, op: Op) -> StoreResult<Option<TimedMetadata>> {
        use azure_storage_blob::models::BlobClientGetPropertiesResultHeaders;
        match self.call(op, self.blob(name).get_properties(None)).await {
            Ok(answer) => {
                let metadata = answer.metadata().map_err(|_| {
                    StoreError::new(StoreErrorKind::Transient, op, "unreadable answer: metadata")
                })?;
                let last_modified = answer
                    .last_modified()
                    .ok()
                    .flatten()
                    .map(std::time::SystemTime::from);
                let answered_at = answer
                    .headers()
                    .get_optional_str(&azure_core::http::headers::HeaderName::from_static("date"))
                    .and_then(|d| azure_core::time::parse_rfc7231(d).ok())
                    .map(std::time::SystemTime::from);
                Ok(Some(TimedMetadata {
                    metadata,
                    last_modified,
                    answered_at,
                }))
            }
            Err(e) if e.kind() == StoreErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// A blob's ETag (one properties request), `None` if it does not exist.
    pub async fn etag(&self, name: &str, op: Op) -> StoreResult<Option<String>> {
        use azure_storage_blob::models::BlobClientGetPropertiesResultHeaders;
        match self.call(op, self.blob(name).get_properties(None)).await {
            Ok(answer) => answer
                .etag()
                .ok()
                .flatten()
                .map(|tag| Some(tag.to_string()))
                .ok_or_else(|| StoreError::new(StoreErrorKind::Transient, op, "unreadable answer: no ETag")),
            Err(e) if e.kind() == StoreErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Deletes a blob, only if its ETag is `if_match` when one is given: one round trip (`op`),
    /// and a second (`look`, a properties request) when a conditional delete fails.
    ///
    /// A write with `If-Match` on a blob that does not exist fails with 412 `ConditionNotMet`,
    /// exactly as one on a blob whose ETag differs (the service's rule for write operations;
    /// Azurite follows it): the status tells "changed" from "gone" only without a condition.
    /// So a 412 is followed by a look: no blob now is [`Deleted::NotFound`] (whether it was
    /// already gone or was deleted since, someone else deleted it), a blob is
    /// [`Deleted::Changed`].
    pub async fn delete_if_match(
        &self,
        name: &str,
        if_match: Option<&str>,
        op: Op,
        look: Op,
    ) -> StoreResult<Deleted> {
        let options = azure_storage_blob::models::BlobClientDeleteOptions {
            if_match: if_match.map(|tag| azure_core::http::Etag::from(tag.to_string())),
            ..Default::default()
        };
        match self.call(op, self.blob(name).delete(Some(options))).await {
            Ok(_) => Ok(Deleted::Deleted),
            Err(e) if e.kind() == StoreErrorKind::NotFound => Ok(Deleted::NotFound),
            Err(e) if e.status() == Some(412) => Ok(match self.etag(name, look).await? {
                Some(_) => Deleted::Changed,
                None => Deleted::NotFound,
            }),
            Err(e) => Err(e),
        }
    }

    /// Deletes a blob: `true` if it existed, `false` if not.
    pub async fn delete_if_present(&self, name: &str, op: Op) -> StoreResult<bool> {
        match self.call(op, self.blob(name).delete(None)).await {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == StoreErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// One page of the blobs whose names start with `prefix`, with their metadata and lease
    /// state: one List Blobs request for up to `max` (1–5,000: the service's page limit)
    /// blobs, starting at `marker` (the previous page's [`BlobPage::next_marker`]). A container
    /// that does not exist yet has no blobs.
    pub async fn list_page(&self, prefix: &str, marker: Option<&str>, max: u32) -> StoreResult<BlobPage> {
        use futures::StreamExt;
        let op = Op::BlobList;
        let options = BlobContainerClientListBlobsOptions {
            include: Some(vec![ListBlobsIncludeItem::Metadata]),
            marker: marker.map(str::to_string),
            maxresults: Some(max.clamp(1, 5000) as i32),
            prefix: Some(prefix.to_string()),
            ..Default::default()
        };
        let answer = self
            .call(op, async {
                let mut pages = self.client.list_blobs(Some(options))?.into_pages();
                match pages.next().await {
                    Some(page) => page?.into_model().map(Some),
                    None => Ok(None),
                }
            })
            .await;
        let page = match answer {
            Ok(Some(page)) => page,
            Ok(None) => return Ok(BlobPage::default()),
            Err(e) if e.code() == Some("ContainerNotFound") => return Ok(BlobPage::default()),
            Err(e) => return Err(e),
        };
        let blobs = page
            .blob_items
            .into_iter()
            .filter_map(|item| {
                let name = item.name?;
                let properties = item.properties;
                Some(ListedBlob {
                    name,
                    lease: match properties.as_ref().and_then(|p| p.lease_state) {
                        Some(AzureLeaseState::Leased) => ListedLease::Leased,
                        Some(AzureLeaseState::Breaking) => ListedLease::Breaking,
                        Some(AzureLeaseState::Broken) => ListedLease::Broken,
                        Some(AzureLeaseState::Expired) => ListedLease::Expired,
                        _ => ListedLease::Available,
                    },
                    sequence: properties
                        .as_ref()
                        .filter(|p| p.blob_type == Some(azure_storage_blob::models::BlobType::PageBlob))
                        .and_then(|p| p.blob_sequence_number)
                        .and_then(|n| u64::try_from(n).ok()),
                    last_modified: properties
                        .and_then(|p| p.last_modified)
                        .map(std::time::SystemTime::from),
                    metadata: item
                        .metadata
                        .and_then(|m| m.values)
                        .unwrap_or_default()
                        .into_iter()
                        .collect(),
                })
            })
            .collect();
        Ok(BlobPage {
            blobs,
            next_marker: page.next_marker.filter(|m| !m.is_empty()),
        })
    }

    /// The kind of storage account the container is in, as Get Account Information answers
    /// (`x-ms-account-kind`: `StorageV2`, `BlockBlobStorage`, ...); `None` if the answer names
    /// none this client knows. One request (counted as a properties read).
    pub async fn account_kind(&self) -> StoreResult<Option<&'static str>> {
        let answer = self
            .call(Op::BlobProperties, self.client.get_account_info(None))
            .await?;
        Ok(answer.account_kind().ok().flatten().map(|kind| match kind {
            AccountKind::BlobStorage => "BlobStorage",
            AccountKind::BlockBlobStorage => "BlockBlobStorage",
            AccountKind::FileStorage => "FileStorage",
            AccountKind::Storage => "Storage",
            AccountKind::StorageV2 => "StorageV2",
        }))
    }

    /// Whether a blob exists (one properties request).
    pub async fn exists(&self, name: &str) -> StoreResult<bool> {
        match self
            .call(Op::BlobProperties, self.blob(name).get_properties(None))
            .await
        {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == StoreErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }
}

/// Whether an account of `kind` (as [`BlobContainer::account_kind`] names it) holds page blobs:
/// premium block-blob accounts, legacy Blob storage accounts and file accounts hold none.
pub fn holds_page_blobs(kind: &str) -> bool {
    !matches!(kind, "BlockBlobStorage" | "BlobStorage" | "FileStorage")
}

/// Answer of [`BlobContainer::delete_if_match`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deleted {
    /// This call deleted the blob.
    Deleted,
    /// There was no such blob.
    NotFound,
    /// The blob's ETag was not the one given (412, and the blob is there): it was left as it is.
    Changed,
}

/// One page of a blob listing ([`BlobContainer::list_page`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlobPage {
    pub blobs: Vec<ListedBlob>,
    /// Where the next page starts; `None` on the last page.
    pub next_marker: Option<String>,
}

/// A blob as a listing shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedBlob {
    pub name: String,
    pub lease: ListedLease,
    /// A page blob's sequence number (`None` for other blobs).
    pub sequence: Option<u64>,
    pub last_modified: Option<std::time::SystemTime>,
    pub metadata: std::collections::BTreeMap<String, String>,
}

/// A listed blob's lease state, as the service reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListedLease {
    Available,
    Leased,
    Expired,
    Breaking,
    Broken,
}

impl ListedLease {
    /// Whether someone holds the lease now (a breaking lease is held until its break period ends).
    pub fn is_held(self) -> bool {
        matches!(self, ListedLease::Leased | ListedLease::Breaking)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ListedLease::Available => "available",
            ListedLease::Leased => "leased",
            ListedLease::Expired => "expired",
            ListedLease::Breaking => "breaking",
            ListedLease::Broken => "broken",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_accounts_that_hold_page_blobs_pass() {
        for kind in ["StorageV2", "Storage"] {
            assert!(holds_page_blobs(kind), "{kind}");
        }
        for kind in ["BlockBlobStorage", "BlobStorage", "FileStorage"] {
            assert!(!holds_page_blobs(kind), "{kind}");
        }
    }

    #[test]
    fn the_services_own_words_are_kept_to_their_first_line() {
        let body = br#"<?xml version="1.0" encoding="utf-8"?><Error><Code>AuthenticationFailed</Code><Message>Server failed to authenticate the request.
RequestId:8c1b
Time:2026-11-22T17:00:00Z</Message><AuthenticationErrorDetail>The MAC signature found in the HTTP request 'c2lnbmF0dXJl' is not the same</AuthenticationErrorDetail></Error>"#;
        assert_eq!(
            service_message(body).as_deref(),
            Some("Server failed to authenticate the request.")
        );
        assert_eq!(service_message(b"not xml"), None);
        assert_eq!(service_message(b"<Message></Message>"), None);
        let table = br#"{"odata.error":{"code":"TableNotFound","message":{"lang":"en-US","value":"The table specified does not exist.\nRequestId:8c1b\nTime:2026-11-22T17:00:00Z"}}}"#;
        assert_eq!(
            service_message(table).as_deref(),
            Some("The table specified does not exist.")
        );
    }

    /// Storage never redirects: a 3xx answer is surfaced as an error with its status, and the
    /// request (signed for one URL) is not re-sent to the `Location`.
    #[tokio::test]
    async fn a_redirect_is_an_error_not_followed() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        use tokio::net::TcpListener;

        // Where the redirect points: counts whoever comes.
        let elsewhere = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let elsewhere_port = elsewhere.local_addr().unwrap().port();
        let followed = Arc::new(AtomicUsize::new(0));
        let count = followed.clone();
        let watcher = tokio::spawn(async move {
            while let Ok((_stream, _)) = elsewhere.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
            }
        });
        // The "storage account": answers every request with a redirect.
        let server = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = server.local_addr().unwrap().port();
        let redirector = tokio::spawn(async move {
            while let Ok((mut stream, _)) = server.accept().await {
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 16 * 1024];
                    let _ = stream.read(&mut buf).await;
                    let answer = format!(
                        "HTTP/1.1 307 Temporary Redirect\r\nLocation: http://127.0.0.1:{elsewhere_port}/devstoreaccount1/c/x\r\nContent-Length: 0\r\n\r\n"
                    );
                    let _ = stream.write_all(answer.as_bytes()).await;
                });
            }
        });
        let account = StorageAccount::emulator("127.0.0.1", port, port, port);
        let container = BlobContainer::new(&account, "c", OpCounters::new());
        let e = container.exists("x").await.unwrap_err();
        assert_eq!(e.status(), Some(307), "{e}");
        assert_eq!(
            followed.load(Ordering::SeqCst),
            0,
            "the redirect was not followed"
        );
        redirector.abort();
        watcher.abort();
    }

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
        assert_eq!(classify(409, Some("TableBeingDeleted")), Transient);
        assert_eq!(classify(409, Some("TableAlreadyExists")), Rejected);
        assert_eq!(classify(409, Some("EntityAlreadyExists")), Rejected);
        assert_eq!(classify(404, Some("TableNotFound")), NotFound);
    }
}

/// A blob's metadata and the service's clock readings that came with it
/// ([`BlobContainer::metadata_with_clock`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TimedMetadata {
    pub metadata: std::collections::HashMap<String, String>,
    /// When the blob (or its metadata) was last written, by the service's clock (to the second).
    pub last_modified: Option<std::time::SystemTime>,
    /// When the service answered (its `Date` header, to the second).
    pub answered_at: Option<std::time::SystemTime>,
}
