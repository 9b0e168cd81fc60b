//! Fault injection for tests and simulations (feature `testing`): the marker store and queue
//! twins of `leasehold_lock::testing::FaultyStore`. Every request goes through one
//! [`Interceptor`], so a test or simulation that writes one interceptor decides the fate of every
//! request a runner makes — lock, marker and queue alike.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use leasehold_lock::LockKey;
pub use leasehold_lock::testing::{Effect, FaultyStore, Interceptor};
use leasehold_storage::{Op, OpCounters, StoreResult};

use crate::markers::{MarkerSet, MarkerStore, WaitConsumed};
use crate::queue::{Enqueued, Peeked, Received, TriggerQueue};

/// A [`MarkerStore`] whose every request goes through an [`Interceptor`] before it reaches `inner`.
#[derive(Debug, Clone)]
pub struct FaultyMarkers<I> {
    inner: Arc<dyn MarkerStore>,
    interceptor: I,
}

impl<I: Interceptor> FaultyMarkers<I> {
    pub fn new(inner: Arc<dyn MarkerStore>, interceptor: I) -> Self {
        Self { inner, interceptor }
    }

    async fn send<T, F, Fut>(&self, op: Op, key: &LockKey, request: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce(Arc<dyn MarkerStore>, LockKey) -> Fut,
        Fut: Future<Output = StoreResult<T>> + Send + 'static,
    {
        let effect = request(self.inner.clone(), key.clone());
        self.interceptor.call(op, key.as_str(), Box::pin(effect)).await
    }
}

#[async_trait]
impl<I: Interceptor> MarkerStore for FaultyMarkers<I> {
    async fn set(&self, key: &LockKey) -> StoreResult<MarkerSet> {
        self.send(Op::FlagPut, key, |m, k| async move { m.set(&k).await })
            .await
    }

    async fn take(&self, key: &LockKey) -> StoreResult<bool> {
        self.send(Op::FlagDelete, key, |m, k| async move { m.take(&k).await })
            .await
    }

    async fn is_set(&self, key: &LockKey) -> StoreResult<bool> {
        self.send(Op::BlobProperties, key, |m, k| async move { m.is_set(&k).await })
            .await
    }

    async fn wait_create(&self, key: &LockKey) -> StoreResult<Option<String>> {
        self.send(Op::WaitPut, key, |m, k| async move { m.wait_create(&k).await })
            .await
    }

    async fn wait_touch(&self, key: &LockKey) -> StoreResult<bool> {
        self.send(Op::WaitTouch, key, |m, k| async move { m.wait_touch(&k).await })
            .await
    }

    async fn wait_look(&self, key: &LockKey) -> StoreResult<Option<String>> {
        self.send(Op::WaitHead, key, |m, k| async move { m.wait_look(&k).await })
            .await
    }

    async fn wait_consume(&self, key: &LockKey, if_match: Option<&str>) -> StoreResult<WaitConsumed> {
        let if_match = if_match.map(str::to_string);
        self.send(Op::WaitDelete, key, |m, k| async move {
            m.wait_consume(&k, if_match.as_deref()).await
        })
        .await
    }

    fn counters(&self) -> &OpCounters {
        self.interceptor.counters()
    }
}

/// A [`TriggerQueue`] whose every request goes through an [`Interceptor`] before it reaches
/// `inner`.
pub struct FaultyQueue<I> {
    inner: Arc<dyn TriggerQueue>,
    interceptor: I,
}

impl<I: fmt::Debug> fmt::Debug for FaultyQueue<I> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultyQueue")
            .field("inner", &self.inner.name())
            .field("interceptor", &self.interceptor)
            .finish()
    }
}

impl<I: Clone> Clone for FaultyQueue<I> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            interceptor: self.interceptor.clone(),
        }
    }
}

impl<I: Interceptor> FaultyQueue<I> {
    pub fn new(inner: Arc<dyn TriggerQueue>, interceptor: I) -> Self {
        Self { inner, interceptor }
    }

    async fn send<T, F, Fut>(&self, op: Op, target: &str, request: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce(Arc<dyn TriggerQueue>) -> Fut,
        Fut: Future<Output = StoreResult<T>> + Send + 'static,
    {
        let effect = request(self.inner.clone());
        self.interceptor.call(op, target, Box::pin(effect)).await
    }
}

#[async_trait]
impl<I: Interceptor> TriggerQueue for FaultyQueue<I> {
    fn name(&self) -> &str {
        self.inner.name()
    }

    async fn put(&self, body: &str, delay: Duration) -> StoreResult<Enqueued> {
        let body = body.to_string();
        self.send(
            Op::QueuePut,
            "",
            move |q| async move { q.put(&body, delay).await },
        )
        .await
    }

    async fn get(&self, max: u32, visibility: Duration) -> StoreResult<Vec<Received>> {
        self.send(
            Op::QueueGet,
            "",
            move |q| async move { q.get(max, visibility).await },
        )
        .await
    }

    async fn delete(&self, id: &str, pop_receipt: &str) -> StoreResult<()> {
        let (i, r) = (id.to_string(), pop_receipt.to_string());
        self.send(
            Op::QueueDelete,
            id,
            move |q| async move { q.delete(&i, &r).await },
        )
        .await
    }

    async fn set_visibility(
        &self,
        id: &str,
        pop_receipt: &str,
        body: &str,
        visibility: Duration,
    ) -> StoreResult<String> {
        let (i, r, b) = (id.to_string(), pop_receipt.to_string(), body.to_string());
        self.send(Op::QueueUpdate, id, move |q| async move {
            q.set_visibility(&i, &r, &b, visibility).await
        })
        .await
    }

    async fn update_visibility(
        &self,
        id: &str,
        pop_receipt: &str,
        visibility: Duration,
    ) -> StoreResult<String> {
        let (i, r) = (id.to_string(), pop_receipt.to_string());
        self.send(Op::QueueUpdate, id, move |q| async move {
            q.update_visibility(&i, &r, visibility).await
        })
        .await
    }

    async fn approximate_len(&self) -> StoreResult<u64> {
        self.send(
            Op::QueueProperties,
            "",
            |q| async move { q.approximate_len().await },
        )
        .await
    }

    async fn peek(&self, max: u32) -> StoreResult<Vec<Peeked>> {
        self.send(Op::QueuePeek, "", move |q| async move { q.peek(max).await })
            .await
    }

    fn counters(&self) -> &OpCounters {
        self.interceptor.counters()
    }
}
