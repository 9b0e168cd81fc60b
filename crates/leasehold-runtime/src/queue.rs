//! The queue seam: [`TriggerQueue`] with an Azure Storage Queue implementation and an in-memory
//! one (tokio time) for the simulation. Bodies are opaque text here; [`crate::TriggerMessage`]
//! does the encoding.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use azure_storage_queues::{QueueClient, QueueServiceClientBuilder};
use leasehold_storage::azure::{DEFAULT_REQUEST_TIMEOUT, no_sdk_retries, send};
use leasehold_storage::{Op, OpCounters, StorageAccount, StoreError, StoreErrorKind, StoreResult};
use tokio::time::Instant;

/// A message taken from the queue (invisible to others until its visibility timeout passes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    pub id: String,
    pub pop_receipt: String,
    /// How many times the message has been taken, this time included (1 = first delivery).
    pub dequeue_count: u32,
    pub body: String,
}

/// A message just put on the queue: what [`TriggerQueue::set_visibility`] and
/// [`TriggerQueue::delete`] need to change or remove it before anyone has taken it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Enqueued {
    pub id: String,
    pub pop_receipt: String,
}

/// Queue operations, one round trip each (creating the queue on first use aside).
#[async_trait]
pub trait TriggerQueue: Send + Sync + fmt::Debug + 'static {
    fn name(&self) -> &str;

    /// Adds a message that becomes visible after `delay`. Creates the queue on first use.
    async fn put(&self, body: &str, delay: Duration) -> StoreResult<Enqueued>;

    /// Takes up to `max` (1–32) visible messages, hiding them for `visibility`.
    async fn get(&self, max: u32, visibility: Duration) -> StoreResult<Vec<Received>>;

    /// Deletes a taken message; `NotFound` if the receipt is stale (someone else took it since).
    async fn delete(&self, id: &str, pop_receipt: &str) -> StoreResult<()>;

    /// Hides a taken (or just put) message for `visibility` from now and replaces its body;
    /// returns the new pop receipt.
    async fn set_visibility(
        &self,
        id: &str,
        pop_receipt: &str,
        body: &str,
        visibility: Duration,
    ) -> StoreResult<String>;

    /// Approximate number of messages (visible or not).
    async fn approximate_len(&self) -> StoreResult<u64>;

    fn counters(&self) -> &OpCounters;
}

/// In-memory queue with Azure's visibility and pop-receipt rules, on tokio time.
#[derive(Debug)]
pub struct MemoryQueue {
    name: String,
    state: Mutex<MemoryState>,
    counters: OpCounters,
}

#[derive(Debug, Default)]
struct MemoryState {
    messages: VecDeque<MemoryMessage>,
    next_id: u64,
}

#[derive(Debug, Clone)]
struct MemoryMessage {
    id: String,
    body: String,
    visible_at: Instant,
    dequeue_count: u32,
    pop_receipt: String,
}

impl MemoryQueue {
    pub fn new(name: &str, counters: OpCounters) -> Self {
        Self {
            name: name.into(),
            state: Mutex::default(),
            counters,
        }
    }

    /// Bodies of every message, visible or not (for tests).
    pub fn bodies(&self) -> Vec<String> {
        self.state
            .lock()
            .expect("poisoned")
            .messages
            .iter()
            .map(|m| m.body.clone())
            .collect()
    }

    /// Time at which the next hidden message becomes visible, if any.
    pub fn next_visible_at(&self) -> Option<Instant> {
        self.state
            .lock()
            .expect("poisoned")
            .messages
            .iter()
            .map(|m| m.visible_at)
            .min()
    }

    fn with<T>(&self, op: Op, f: impl FnOnce(&mut MemoryState, Instant) -> StoreResult<T>) -> StoreResult<T> {
        self.counters.record(op);
        let mut state = self.state.lock().expect("memory queue mutex poisoned");
        f(&mut state, Instant::now())
    }
}

fn receipt_mismatch(op: Op) -> StoreError {
    StoreError::new(StoreErrorKind::NotFound, op, "").with_status(404, Some("MessageNotFound".into()))
}

#[async_trait]
impl TriggerQueue for MemoryQueue {
    fn name(&self) -> &str {
        &self.name
    }

    async fn put(&self, body: &str, delay: Duration) -> StoreResult<Enqueued> {
        self.with(Op::QueuePut, |s, now| {
            s.next_id += 1;
            let id = format!("m{}", s.next_id);
            let pop_receipt = format!("p{}", s.next_id);
            s.messages.push_back(MemoryMessage {
                id: id.clone(),
                body: body.into(),
                visible_at: now + delay,
                dequeue_count: 0,
                pop_receipt: pop_receipt.clone(),
            });
            Ok(Enqueued { id, pop_receipt })
        })
    }

    async fn get(&self, max: u32, visibility: Duration) -> StoreResult<Vec<Received>> {
        self.with(Op::QueueGet, |s, now| {
            let mut out = Vec::new();
            s.next_id += 1;
            let receipt_base = s.next_id;
            for (i, m) in s.messages.iter_mut().enumerate() {
                if out.len() as u32 >= max {
                    break;
                }
                if m.visible_at <= now {
                    m.dequeue_count += 1;
                    m.visible_at = now + visibility;
                    m.pop_receipt = format!("r{receipt_base}.{i}");
                    out.push(Received {
                        id: m.id.clone(),
                        pop_receipt: m.pop_receipt.clone(),
                        dequeue_count: m.dequeue_count,
                        body: m.body.clone(),
                    });
                }
            }
            Ok(out)
        })
    }

    async fn delete(&self, id: &str, pop_receipt: &str) -> StoreResult<()> {
        self.with(Op::QueueDelete, |s, _| {
            match s
                .messages
                .iter()
                .position(|m| m.id == id && m.pop_receipt == pop_receipt)
            {
                Some(i) => {
                    s.messages.remove(i);
                    Ok(())
                }
                None => Err(receipt_mismatch(Op::QueueDelete)),
            }
        })
    }

    async fn set_visibility(
        &self,
        id: &str,
        pop_receipt: &str,
        body: &str,
        visibility: Duration,
    ) -> StoreResult<String> {
        self.with(Op::QueueUpdate, |s, now| {
            s.next_id += 1;
            let fresh = format!("u{}", s.next_id);
            match s
                .messages
                .iter_mut()
                .find(|m| m.id == id && m.pop_receipt == pop_receipt)
            {
                Some(m) => {
                    m.visible_at = now + visibility;
                    m.pop_receipt = fresh.clone();
                    m.body = body.to_string();
                    Ok(fresh)
                }
                None => Err(receipt_mismatch(Op::QueueUpdate)),
            }
        })
    }

    async fn approximate_len(&self) -> StoreResult<u64> {
        self.with(Op::QueuePeek, |s, _| Ok(s.messages.len() as u64))
    }

    fn counters(&self) -> &OpCounters {
        &self.counters
    }
}

/// An Azure Storage queue (or Azurite's) through `azure_storage_queues` 0.21. The SDK's retries
/// are off; callers retry transient errors.
#[derive(Debug, Clone)]
pub struct AzureQueue {
    client: QueueClient,
    counters: OpCounters,
    request_timeout: Duration,
}

impl AzureQueue {
    pub fn new(account: &StorageAccount, queue: &str, counters: OpCounters) -> Self {
        let client = QueueServiceClientBuilder::with_location(
            account.queue_location().clone(),
            account.credentials().clone(),
        )
        .retry(no_sdk_retries())
        .build()
        .queue_client(queue);
        Self {
            client,
            counters,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
        }
    }

    async fn call<T>(&self, op: Op, fut: impl Future<Output = azure_core::Result<T>>) -> StoreResult<T> {
        send(&self.counters, op, self.request_timeout, fut).await
    }

    /// Creates the queue; an existing one is success.
    pub async fn create(&self) -> StoreResult<()> {
        match self
            .call(Op::QueueCreate, self.client.create().into_future())
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Some("QueueAlreadyExists") => Ok(()),
            Err(e) => Err(e),
        }
    }
}

#[async_trait]
impl TriggerQueue for AzureQueue {
    fn name(&self) -> &str {
        self.client.queue_name()
    }

    async fn put(&self, body: &str, delay: Duration) -> StoreResult<Enqueued> {
        let attempt = || {
            let mut builder = self.client.put_message(body.to_string());
            if !delay.is_zero() {
                builder = builder.visibility_timeout(delay.max(Duration::from_secs(1)));
            }
            self.call(Op::QueuePut, builder.into_future())
        };
        let response = match attempt().await {
            Err(e) if e.code() == Some("QueueNotFound") => {
                self.create().await?;
                attempt().await?
            }
            other => other?,
        };
        Ok(Enqueued {
            id: response.queue_message.message_id,
            pop_receipt: response.queue_message.pop_receipt,
        })
    }

    async fn get(&self, max: u32, visibility: Duration) -> StoreResult<Vec<Received>> {
        let builder = self
            .client
            .get_messages()
            .number_of_messages(max.clamp(1, 32) as u8)
            .visibility_timeout(visibility.max(Duration::from_secs(1)));
        match self.call(Op::QueueGet, builder.into_future()).await {
            Ok(response) => Ok(response
                .messages
                .into_iter()
                .map(|m| Received {
                    id: m.message_id,
                    pop_receipt: m.pop_receipt,
                    dequeue_count: u32::try_from(m.dequeue_count).unwrap_or(u32::MAX),
                    body: m.message_text,
                })
                .collect()),
            // No queue yet means no messages yet.
            Err(e) if e.code() == Some("QueueNotFound") => Ok(Vec::new()),
            Err(e) => Err(e),
        }
    }

    async fn delete(&self, id: &str, pop_receipt: &str) -> StoreResult<()> {
        let receipt = azure_storage_queues::PopReceipt::new(id, pop_receipt);
        let fut = self.client.pop_receipt_client(receipt).delete().into_future();
        self.call(Op::QueueDelete, fut).await.map(|_| ())
    }

    async fn set_visibility(
        &self,
        id: &str,
        pop_receipt: &str,
        body: &str,
        visibility: Duration,
    ) -> StoreResult<String> {
        let receipt = azure_storage_queues::PopReceipt::new(id, pop_receipt);
        let fut = self
            .client
            .pop_receipt_client(receipt)
            .update(body.to_string(), visibility)
            .into_future();
        self.call(Op::QueueUpdate, fut).await.map(|r| r.pop_receipt)
    }

    async fn approximate_len(&self) -> StoreResult<u64> {
        match self
            .call(Op::QueuePeek, self.client.get_metadata().into_future())
            .await
        {
            Ok(r) => Ok(r.approximate_messages_count as u64),
            Err(e) if e.code() == Some("QueueNotFound") => Ok(0),
            Err(e) => Err(e),
        }
    }

    fn counters(&self) -> &OpCounters {
        &self.counters
    }
}
