//! Fault injection for tests and simulations (feature `testing`): a store that sends every
//! request through an [`Interceptor`], which decides what happens to it — delay it, refuse it,
//! lose its answer, let it land late, or never answer (a dead process). The lock's tests, the
//! runtime's regression tests and its simulation each write an interceptor and share the stores:
//! [`FaultyStore`] here, and the marker store and queue in `leasehold-runtime`'s `testing` module.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use leasehold_storage::{Op, OpCounters, StoreResult};

use crate::store::{BlobProperties, ETag, LeaseDuration, LeaseId, LeaseStore, Metadata};

/// What storage does when a request lands. Awaiting it lands the request; dropping it means the
/// request never landed; spawning it to be awaited later is a request that lands late.
pub type Effect<T> = Pin<Box<dyn Future<Output = StoreResult<T>> + Send + 'static>>;

/// Decides the fate of each request a faulty store sends.
#[async_trait]
pub trait Interceptor: Send + Sync + fmt::Debug + 'static {
    /// One request of kind `op`, on `target` (a blob's name, a message's id; empty where there
    /// is none). Returns what the caller sees.
    async fn call<T: Send + 'static>(&self, op: Op, target: &str, effect: Effect<T>) -> StoreResult<T>;

    /// The counters the faulty stores report (the interceptor decides when a request counts).
    fn counters(&self) -> &OpCounters;
}

#[async_trait]
impl<I: Interceptor> Interceptor for Arc<I> {
    async fn call<T: Send + 'static>(&self, op: Op, target: &str, effect: Effect<T>) -> StoreResult<T> {
        (**self).call(op, target, effect).await
    }

    fn counters(&self) -> &OpCounters {
        (**self).counters()
    }
}

/// A [`LeaseStore`] whose every request goes through an [`Interceptor`] before it reaches `inner`.
#[derive(Debug, Clone)]
pub struct FaultyStore<I> {
    inner: Arc<dyn LeaseStore>,
    interceptor: I,
}

impl<I: Interceptor> FaultyStore<I> {
    pub fn new(inner: Arc<dyn LeaseStore>, interceptor: I) -> Self {
        Self { inner, interceptor }
    }

    async fn send<T, F, Fut>(&self, op: Op, blob: &str, request: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce(Arc<dyn LeaseStore>, String) -> Fut,
        Fut: Future<Output = StoreResult<T>> + Send + 'static,
    {
        let effect = request(self.inner.clone(), blob.to_string());
        self.interceptor.call(op, blob, Box::pin(effect)).await
    }
}

#[async_trait]
impl<I: Interceptor> LeaseStore for FaultyStore<I> {
    async fn create_container(&self) -> StoreResult<()> {
        self.send(Op::ContainerCreate, "", |s, _| async move {
            s.create_container().await
        })
        .await
    }

    async fn create_blob(&self, blob: &str) -> StoreResult<()> {
        self.send(
            Op::BlobCreate,
            blob,
            |s, b| async move { s.create_blob(&b).await },
        )
        .await
    }

    async fn acquire_lease(&self, blob: &str, lease: LeaseId, duration: LeaseDuration) -> StoreResult<()> {
        self.send(Op::LeaseAcquire, blob, move |s, b| async move {
            s.acquire_lease(&b, lease, duration).await
        })
        .await
    }

    async fn renew_lease(&self, blob: &str, lease: LeaseId) -> StoreResult<()> {
        self.send(Op::LeaseRenew, blob, move |s, b| async move {
            s.renew_lease(&b, lease).await
        })
        .await
    }

    async fn release_lease(&self, blob: &str, lease: LeaseId, if_match: Option<&ETag>) -> StoreResult<()> {
        let if_match = if_match.cloned();
        self.send(Op::LeaseRelease, blob, move |s, b| async move {
            s.release_lease(&b, lease, if_match.as_ref()).await
        })
        .await
    }

    async fn break_lease(&self, blob: &str, period: Duration) -> StoreResult<()> {
        self.send(Op::LeaseBreak, blob, move |s, b| async move {
            s.break_lease(&b, period).await
        })
        .await
    }

    async fn properties(&self, blob: &str) -> StoreResult<BlobProperties> {
        self.send(
            Op::BlobProperties,
            blob,
            |s, b| async move { s.properties(&b).await },
        )
        .await
    }

    async fn set_metadata(
        &self,
        blob: &str,
        lease: Option<LeaseId>,
        if_match: Option<&ETag>,
        metadata: &Metadata,
    ) -> StoreResult<ETag> {
        let (if_match, metadata) = (if_match.cloned(), metadata.clone());
        self.send(Op::BlobSetMetadata, blob, move |s, b| async move {
            s.set_metadata(&b, lease, if_match.as_ref(), &metadata).await
        })
        .await
    }

    async fn increment_sequence(
        &self,
        blob: &str,
        lease: LeaseId,
        if_match: Option<&ETag>,
    ) -> StoreResult<Option<(u64, ETag)>> {
        let if_match = if_match.cloned();
        self.send(Op::BlobSequenceIncrement, blob, move |s, b| async move {
            s.increment_sequence(&b, lease, if_match.as_ref()).await
        })
        .await
    }

    async fn replace_with_page_blob(
        &self,
        blob: &str,
        lease: LeaseId,
        if_match: Option<&ETag>,
        sequence: u64,
        metadata: &Metadata,
    ) -> StoreResult<ETag> {
        let (if_match, metadata) = (if_match.cloned(), metadata.clone());
        self.send(Op::BlobCreate, blob, move |s, b| async move {
            s.replace_with_page_blob(&b, lease, if_match.as_ref(), sequence, &metadata)
                .await
        })
        .await
    }

    fn counters(&self) -> &OpCounters {
        self.interceptor.counters()
    }
}
