//! The queue seam: [`TriggerQueue`] with an Azure Storage Queue implementation and an in-memory
//! one (tokio time) for the simulation. Bodies are opaque text here; [`crate::TriggerMessage`]
//! does the encoding.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use azure_core::http::headers::HeaderName;
use azure_core::http::{RequestContent, XmlFormat};
use azure_storage_queue::models::{
    QueueClientGetPropertiesResultHeaders, QueueClientPeekMessagesOptions, QueueClientReceiveMessagesOptions,
    QueueClientSendMessageOptions, QueueClientUpdateMessageOptions, QueueMessage,
};
use azure_storage_queue::{QueueClient, QueueClientOptions};
use leasehold_storage::azure::{DEFAULT_REQUEST_TIMEOUT, client_options, send};
use leasehold_storage::{Op, OpCounters, Service, StorageAccount, StoreError, StoreErrorKind, StoreResult};
use tokio::time::Instant;

/// A message taken from the queue (invisible to others until its visibility timeout passes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    pub id: String,
    pub pop_receipt: String,
    /// How many times the message has been taken, this time included (1 = first delivery).
    pub dequeue_count: u32,
    pub body: String,
    /// When the message was put on the queue, as the service reports it.
    pub inserted_at: Option<SystemTime>,
}

/// A message looked at without taking it ([`TriggerQueue::peek`]): no pop receipt, nothing
/// hidden, its dequeue count unchanged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peeked {
    pub id: String,
    /// How many times the message has been taken so far.
    pub dequeue_count: u32,
    pub body: String,
    /// When the message was put on the queue, as the service reports it.
    pub inserted_at: Option<SystemTime>,
    /// When the service will drop the message unread; `None`: never. Every message Leasehold
    /// puts is kept until it is taken and deleted: Azure's default would drop a trigger or a
    /// poison entry, silently, 7 days after it was put.
    pub expires_at: Option<SystemTime>,
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

    /// Hides a taken message for `visibility` from now (zero: visible at once) and keeps its
    /// body: an update that sends no body. Returns the new pop receipt. For operators' scans,
    /// which hold many messages and should not keep each one's body to change when it shows.
    /// A queue that cannot do this answers `Rejected`.
    async fn update_visibility(
        &self,
        id: &str,
        pop_receipt: &str,
        visibility: Duration,
    ) -> StoreResult<String> {
        let _ = (id, pop_receipt, visibility);
        Err(StoreError::new(
            StoreErrorKind::Rejected,
            Op::QueueUpdate,
            format!("queue {} cannot change a message's visibility alone", self.name()),
        ))
    }

    /// Approximate number of messages (visible or not).
    async fn approximate_len(&self) -> StoreResult<u64>;

    /// Looks at up to `max` (1–32: the service's limit) visible messages from the front of the
    /// queue without taking them. For operators' tools; the protocol never peeks. A queue that
    /// does not exist yet has nothing to show.
    async fn peek(&self, max: u32) -> StoreResult<Vec<Peeked>> {
        let _ = max;
        Err(StoreError::new(
            StoreErrorKind::Rejected,
            Op::QueuePeek,
            format!("queue {} cannot be peeked", self.name()),
        ))
    }

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
    delivery: Delivery,
}

/// The order in which a [`MemoryQueue`] hands out visible messages. Azure promises none, so
/// tests choose the one that tries the code hardest.
#[derive(Debug, Default)]
enum Delivery {
    /// By when each became visible, then put order: as Azurite does, and as Azure mostly does.
    #[default]
    ByVisibility,
    /// Put order, whenever each became visible: a message hidden again and back comes round
    /// ahead of those put after it.
    ByPut,
    /// A seeded random order (the state of the generator).
    Shuffled(u64),
}

impl MemoryState {
    /// The next number of a SplitMix64 sequence (small, seedable, and enough to pick an order).
    fn next_random(state: &mut u64) -> u64 {
        *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Indices of the messages visible at `now`, front first: by when each became visible
    /// (stable: equal times keep put order), or in put order under [`Delivery::ByPut`]. What a
    /// peek shows.
    fn front(&self, now: Instant) -> Vec<usize> {
        let mut visible: Vec<usize> = (0..self.messages.len())
            .filter(|&i| self.messages[i].visible_at <= now)
            .collect();
        if !matches!(self.delivery, Delivery::ByPut) {
            visible.sort_by_key(|&i| self.messages[i].visible_at);
        }
        visible
    }

    /// Indices of the messages visible at `now`, in the order a get hands them out: the
    /// [`front`](Self::front), shuffled under [`Delivery::Shuffled`].
    fn visible(&mut self, now: Instant) -> Vec<usize> {
        let mut visible = self.front(now);
        if let Delivery::Shuffled(state) = &mut self.delivery {
            // Fisher–Yates.
            for i in (1..visible.len()).rev() {
                let j = (Self::next_random(state) % (i as u64 + 1)) as usize;
                visible.swap(i, j);
            }
        }
        visible
    }
}

#[derive(Debug, Clone)]
struct MemoryMessage {
    id: String,
    body: String,
    visible_at: Instant,
    dequeue_count: u32,
    pop_receipt: String,
    inserted_at: SystemTime,
}

impl MemoryQueue {
    pub fn new(name: &str, counters: OpCounters) -> Self {
        Self {
            name: name.into(),
            state: Mutex::default(),
            counters,
        }
    }

    /// Hands out visible messages in a seeded random order rather than oldest first. Azure
    /// promises no order (it mostly hands out by the time a message became visible), so a
    /// protocol must not rely on one; the simulation uses this to show it does not.
    pub fn with_shuffled_delivery(self, seed: u64) -> Self {
        self.state.lock().expect("poisoned").delivery = Delivery::Shuffled(seed);
        self
    }

    /// Hands out visible messages in the order they were put, whenever each became visible: a
    /// message hidden again comes round ahead of those put after it (which Azure, promising no
    /// order, may do). For tests of code that must get past such messages.
    pub fn with_put_order_delivery(self) -> Self {
        self.state.lock().expect("poisoned").delivery = Delivery::ByPut;
        self
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

    /// How many messages are visible now (for tests).
    pub fn visible_len(&self) -> usize {
        let now = Instant::now();
        let state = self.state.lock().expect("poisoned");
        state.messages.iter().filter(|m| m.visible_at <= now).count()
    }

    /// When every message is visible (the end of the longest hiding; now or before when none is
    /// hidden), if there are any (for tests).
    pub fn all_visible_at(&self) -> Option<Instant> {
        self.state
            .lock()
            .expect("poisoned")
            .messages
            .iter()
            .map(|m| m.visible_at)
            .max()
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

    /// An update of a taken message (its receipt must match): hidden for `visibility` from now,
    /// a new receipt, and its body replaced when one is given.
    fn rehide(
        &self,
        id: &str,
        pop_receipt: &str,
        visibility: Duration,
        body: Option<&str>,
    ) -> StoreResult<String> {
        self.with(Op::QueueUpdate, |s, now| {
            if let Some(body) = body
                && body.len() > MAX_MESSAGE_BYTES
            {
                return Err(too_large(Op::QueueUpdate, body.len()));
            }
            s.next_id += 1;
            let fresh = format!("u{}", s.next_id);
            let m = s
                .messages
                .iter_mut()
                .find(|m| m.id == id && m.pop_receipt == pop_receipt)
                .ok_or_else(|| receipt_mismatch(Op::QueueUpdate))?;
            m.visible_at = now + visibility;
            m.pop_receipt = fresh.clone();
            if let Some(body) = body {
                m.body = body.to_string();
            }
            Ok(fresh)
        })
    }
}

/// Largest message text a queue accepts, in bytes (Azure Storage's limit, which Azurite
/// enforces too; the text here is the base64 wire form).
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024;

/// What Azure answers a message over [`MAX_MESSAGE_BYTES`].
fn too_large(op: Op, len: usize) -> StoreError {
    StoreError::new(
        StoreErrorKind::Rejected,
        op,
        format!("message of {len} bytes is over the queue's limit of {MAX_MESSAGE_BYTES}"),
    )
    .with_status(413, Some("RequestBodyTooLarge".into()))
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
            if body.len() > MAX_MESSAGE_BYTES {
                return Err(too_large(Op::QueuePut, body.len()));
            }
            s.next_id += 1;
            let id = format!("m{}", s.next_id);
            let pop_receipt = format!("p{}", s.next_id);
            s.messages.push_back(MemoryMessage {
                id: id.clone(),
                body: body.into(),
                visible_at: now + delay,
                dequeue_count: 0,
                pop_receipt: pop_receipt.clone(),
                inserted_at: SystemTime::now(),
            });
            Ok(Enqueued { id, pop_receipt })
        })
    }

    async fn get(&self, max: u32, visibility: Duration) -> StoreResult<Vec<Received>> {
        self.with(Op::QueueGet, |s, now| {
            let mut out = Vec::new();
            s.next_id += 1;
            let receipt_base = s.next_id;
            for i in s.visible(now).into_iter().take(max as usize) {
                let m = &mut s.messages[i];
                m.dequeue_count += 1;
                m.visible_at = now + visibility;
                m.pop_receipt = format!("r{receipt_base}.{i}");
                out.push(Received {
                    id: m.id.clone(),
                    pop_receipt: m.pop_receipt.clone(),
                    dequeue_count: m.dequeue_count,
                    body: m.body.clone(),
                    inserted_at: Some(m.inserted_at),
                });
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
        self.rehide(id, pop_receipt, visibility, Some(body))
    }

    async fn update_visibility(
        &self,
        id: &str,
        pop_receipt: &str,
        visibility: Duration,
    ) -> StoreResult<String> {
        self.rehide(id, pop_receipt, visibility, None)
    }

    async fn approximate_len(&self) -> StoreResult<u64> {
        self.with(Op::QueueProperties, |s, _| Ok(s.messages.len() as u64))
    }

    async fn peek(&self, max: u32) -> StoreResult<Vec<Peeked>> {
        self.with(Op::QueuePeek, |s, now| {
            // A peek never shuffles.
            Ok(s.front(now)
                .into_iter()
                .take(max.clamp(1, 32) as usize)
                .map(|i| &s.messages[i])
                .map(|m| Peeked {
                    id: m.id.clone(),
                    dequeue_count: m.dequeue_count,
                    body: m.body.clone(),
                    inserted_at: Some(m.inserted_at),
                    expires_at: None,
                })
                .collect())
        })
    }

    fn counters(&self) -> &OpCounters {
        &self.counters
    }
}

/// An Azure Storage queue (or Azurite's) through `azure_storage_queue` 1.x, on the shared
/// request path (counted, timed, classified; no SDK retries: callers retry transient errors).
#[derive(Clone)]
pub struct AzureQueue {
    client: Arc<QueueClient>,
    name: String,
    counters: OpCounters,
    request_timeout: Duration,
}

impl fmt::Debug for AzureQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AzureQueue").field("name", &self.name).finish()
    }
}

/// The header an update answers with the message's new pop receipt in.
const POP_RECEIPT: HeaderName = HeaderName::from_static("x-ms-popreceipt");

fn message(body: &str) -> azure_core::Result<RequestContent<QueueMessage, XmlFormat>> {
    QueueMessage {
        message_text: Some(body.to_string()),
    }
    .try_into()
}

/// Whole seconds for a visibility timeout (the service's unit), rounded **up**: a message is
/// never visible before the time asked (rounded down, a hand-back with under a second to wait
/// was visible at once). Zero stays zero where `at_least_one` is false (visible at once).
fn seconds(d: Duration, at_least_one: bool) -> i32 {
    let whole = d.as_secs().saturating_add(u64::from(d.subsec_nanos() > 0));
    let secs = i32::try_from(whole).unwrap_or(i32::MAX);
    if at_least_one { secs.max(1) } else { secs }
}

fn malformed(op: Op, what: &str) -> StoreError {
    StoreError::new(
        StoreErrorKind::Transient,
        op,
        format!("unreadable answer: {what}"),
    )
}

impl AzureQueue {
    pub fn new(account: &StorageAccount, queue: &str, counters: OpCounters) -> Self {
        let options = QueueClientOptions {
            client_options: client_options(account),
            ..Default::default()
        };
        let client = QueueClient::new(
            account.url(Service::Queue, queue),
            account.token_credential(),
            Some(options),
        )
        .expect("a queue URL under a valid endpoint");
        Self {
            client: Arc::new(client),
            name: queue.to_string(),
            counters,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
        }
    }

    async fn call<T>(&self, op: Op, fut: impl Future<Output = azure_core::Result<T>>) -> StoreResult<T> {
        send(&self.counters, op, self.request_timeout, fut).await
    }

    /// Whether the queue exists (one properties request).
    pub async fn exists(&self) -> StoreResult<bool> {
        match self
            .call(Op::QueueProperties, self.client.get_properties(None))
            .await
        {
            Ok(_) => Ok(true),
            Err(e) if e.code() == Some("QueueNotFound") => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Creates the queue; an existing one is success.
    pub async fn create(&self) -> StoreResult<()> {
        match self.call(Op::QueueCreate, self.client.create(None)).await {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Some("QueueAlreadyExists") => Ok(()),
            Err(e) => Err(e),
        }
    }
}

#[async_trait]
impl TriggerQueue for AzureQueue {
    fn name(&self) -> &str {
        &self.name
    }

    async fn put(&self, body: &str, delay: Duration) -> StoreResult<Enqueued> {
        let op = Op::QueuePut;
        let attempt = || async {
            let options = QueueClientSendMessageOptions {
                visibility_timeout: (!delay.is_zero()).then(|| seconds(delay, true)),
                // Kept until taken: without it Azure drops a message 7 days after it was put,
                // a trigger waiting behind a backlog or a poison entry nobody looked at yet.
                message_time_to_live: Some(-1),
                ..Default::default()
            };
            let content =
                message(body).map_err(|e| StoreError::new(StoreErrorKind::Rejected, op, e.to_string()))?;
            self.call(op, async {
                self.client
                    .send_message(content, Some(options))
                    .await?
                    .into_model()
            })
            .await
        };
        let sent = match attempt().await {
            Err(e) if e.code() == Some("QueueNotFound") => {
                self.create().await?;
                attempt().await?
            }
            other => other?,
        };
        let sent = sent
            .items
            .and_then(|items| items.into_iter().next())
            .ok_or_else(|| malformed(op, "no message"))?;
        Ok(Enqueued {
            id: sent.message_id.ok_or_else(|| malformed(op, "no message id"))?,
            pop_receipt: sent.pop_receipt.ok_or_else(|| malformed(op, "no pop receipt"))?,
        })
    }

    async fn get(&self, max: u32, visibility: Duration) -> StoreResult<Vec<Received>> {
        let op = Op::QueueGet;
        let options = QueueClientReceiveMessagesOptions {
            number_of_messages: Some(max.clamp(1, 32) as i32),
            visibility_timeout: Some(seconds(visibility, true)),
            ..Default::default()
        };
        let answer = self
            .call(op, async {
                self.client.receive_messages(Some(options)).await?.into_model()
            })
            .await;
        match answer {
            Ok(received) => received
                .items
                .unwrap_or_default()
                .into_iter()
                .map(|m| {
                    Ok(Received {
                        id: m.message_id.ok_or_else(|| malformed(op, "no message id"))?,
                        pop_receipt: m.pop_receipt.ok_or_else(|| malformed(op, "no pop receipt"))?,
                        dequeue_count: u32::try_from(m.dequeue_count.unwrap_or(1)).unwrap_or(u32::MAX),
                        body: m.message_text.unwrap_or_default(),
                        inserted_at: m.insertion_time.map(SystemTime::from),
                    })
                })
                .collect(),
            // No queue yet means no messages yet.
            Err(e) if e.code() == Some("QueueNotFound") => Ok(Vec::new()),
            Err(e) => Err(e),
        }
    }

    async fn delete(&self, id: &str, pop_receipt: &str) -> StoreResult<()> {
        let fut = self.client.delete_message(id, pop_receipt, None);
        self.call(Op::QueueDelete, fut).await.map(drop)
    }

    async fn set_visibility(
        &self,
        id: &str,
        pop_receipt: &str,
        body: &str,
        visibility: Duration,
    ) -> StoreResult<String> {
        let op = Op::QueueUpdate;
        let options = QueueClientUpdateMessageOptions {
            queue_message: Some(
                message(body).map_err(|e| StoreError::new(StoreErrorKind::Rejected, op, e.to_string()))?,
            ),
            ..Default::default()
        };
        let fut = self
            .client
            .update_message(id, pop_receipt, seconds(visibility, false), Some(options));
        let response = self.call(op, fut).await?;
        response
            .headers()
            .get_optional_str(&POP_RECEIPT)
            .map(str::to_string)
            .ok_or_else(|| malformed(op, "no pop receipt"))
    }

    async fn update_visibility(
        &self,
        id: &str,
        pop_receipt: &str,
        visibility: Duration,
    ) -> StoreResult<String> {
        let op = Op::QueueUpdate;
        // No message in the request: the service keeps the body.
        let fut = self
            .client
            .update_message(id, pop_receipt, seconds(visibility, false), None);
        let response = self.call(op, fut).await?;
        response
            .headers()
            .get_optional_str(&POP_RECEIPT)
            .map(str::to_string)
            .ok_or_else(|| malformed(op, "no pop receipt"))
    }

    async fn approximate_len(&self) -> StoreResult<u64> {
        let op = Op::QueueProperties;
        match self.call(op, self.client.get_properties(None)).await {
            Ok(r) => Ok(r
                .approximate_messages_count()
                .map_err(|_| malformed(op, "message count"))?
                .unwrap_or(0)
                .max(0) as u64),
            Err(e) if e.code() == Some("QueueNotFound") => Ok(0),
            Err(e) => Err(e),
        }
    }

    async fn peek(&self, max: u32) -> StoreResult<Vec<Peeked>> {
        let op = Op::QueuePeek;
        let options = QueueClientPeekMessagesOptions {
            number_of_messages: Some(max.clamp(1, 32) as i32),
            ..Default::default()
        };
        let answer = self
            .call(op, async {
                self.client.peek_messages(Some(options)).await?.into_model()
            })
            .await;
        match answer {
            Ok(peeked) => peeked
                .items
                .unwrap_or_default()
                .into_iter()
                .map(|m| {
                    Ok(Peeked {
                        id: m.message_id.ok_or_else(|| malformed(op, "no message id"))?,
                        dequeue_count: u32::try_from(m.dequeue_count.unwrap_or(0)).unwrap_or(u32::MAX),
                        body: m.message_text.unwrap_or_default(),
                        inserted_at: m.insertion_time.map(SystemTime::from),
                        // "Never" is reported as the last second of the year 9999.
                        expires_at: m
                            .expiration_time
                            .filter(|t| t.year() < 9999)
                            .map(SystemTime::from),
                    })
                })
                .collect(),
            Err(e) if e.code() == Some("QueueNotFound") => Ok(Vec::new()),
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

    /// A visibility timeout in the service's whole seconds is rounded up, never down: a message
    /// hidden for under a second was visible at once (a hand-back for a pause with under a
    /// second left came straight back, again and again).
    #[test]
    fn a_visibility_timeout_is_rounded_up_to_whole_seconds() {
        let ms = Duration::from_millis;
        assert_eq!(seconds(ms(300), false), 1);
        assert_eq!(seconds(ms(999), false), 1);
        assert_eq!(seconds(ms(1000), false), 1);
        assert_eq!(seconds(ms(1001), false), 2);
        assert_eq!(seconds(Duration::ZERO, false), 0);
        assert_eq!(seconds(Duration::ZERO, true), 1);
        assert_eq!(seconds(Duration::from_secs(35), true), 35);
        assert_eq!(seconds(Duration::MAX, false), i32::MAX);
    }

    /// The memory queue refuses what Azure refuses: a message over 64 KiB, put or updated,
    /// answered 413 `RequestBodyTooLarge` (the simulation relies on it to model oversized
    /// poison entries).
    #[tokio::test]
    async fn a_message_over_64_kib_is_refused_as_azure_refuses_it() {
        let queue = MemoryQueue::new("q", OpCounters::new());
        let at_limit = "a".repeat(MAX_MESSAGE_BYTES);
        let put = queue.put(&at_limit, Duration::ZERO).await.unwrap();
        let over = "a".repeat(MAX_MESSAGE_BYTES + 1);
        let refused = queue.put(&over, Duration::ZERO).await.unwrap_err();
        assert_eq!(
            (refused.kind(), refused.status(), refused.code()),
            (StoreErrorKind::Rejected, Some(413), Some("RequestBodyTooLarge"))
        );
        let refused = queue
            .set_visibility(&put.id, &put.pop_receipt, &over, Duration::ZERO)
            .await
            .unwrap_err();
        assert_eq!(refused.status(), Some(413));
        assert_eq!(queue.bodies(), [at_limit]);
    }

    /// Messages come out by when they became visible, as Azurite hands them out (and Azure
    /// mostly does): one put with a delay comes after those put later without one, and one
    /// hidden again goes behind those that stayed visible. A peek shows the same front.
    #[tokio::test(start_paused = true)]
    async fn messages_come_out_by_when_they_became_visible() {
        let queue = MemoryQueue::new("q", OpCounters::new());
        queue.put("delayed", Duration::from_secs(10)).await.unwrap();
        queue.put("first", Duration::ZERO).await.unwrap();
        let second = queue.put("second", Duration::ZERO).await.unwrap();
        tokio::time::advance(Duration::from_secs(1)).await;
        queue
            .set_visibility(&second.id, &second.pop_receipt, "second", Duration::from_secs(5))
            .await
            .unwrap();
        tokio::time::advance(Duration::from_secs(20)).await;
        let peeked = peek_bodies(&queue).await;
        assert_eq!(peeked, ["first", "second", "delayed"]);
        assert_eq!(take_all(&queue, 32).await, ["first", "second", "delayed"]);

        // In put order instead, whenever each became visible.
        let queue = MemoryQueue::new("q", OpCounters::new()).with_put_order_delivery();
        queue.put("delayed", Duration::from_secs(10)).await.unwrap();
        queue.put("first", Duration::ZERO).await.unwrap();
        tokio::time::advance(Duration::from_secs(20)).await;
        let peeked = peek_bodies(&queue).await;
        assert_eq!(peeked, ["delayed", "first"]);
        assert_eq!(take_all(&queue, 32).await, ["delayed", "first"]);
    }

    async fn peek_bodies(queue: &MemoryQueue) -> Vec<String> {
        queue
            .peek(32)
            .await
            .unwrap()
            .into_iter()
            .map(|m| m.body)
            .collect()
    }

    async fn take_all(queue: &MemoryQueue, per_get: u32) -> Vec<String> {
        let mut taken = Vec::new();
        loop {
            let got = queue.get(per_get, Duration::from_secs(60)).await.unwrap();
            if got.is_empty() {
                return taken;
            }
            taken.extend(got.into_iter().map(|m| m.body));
        }
    }

    /// Oldest first by default; under shuffled delivery each message still once, in an order
    /// the seed decides (the same for the same seed), not the order they were put in.
    #[tokio::test]
    async fn shuffled_delivery_hands_out_each_visible_message_once_in_a_seeded_order() {
        let put: Vec<String> = (0..20).map(|i| format!("m{i}")).collect();
        let fill = |queue: MemoryQueue| {
            let put = put.clone();
            async move {
                for body in &put {
                    queue.put(body, Duration::ZERO).await.unwrap();
                }
                // Hidden ones are not handed out, whatever the order.
                queue.put("later", Duration::from_secs(3600)).await.unwrap();
                queue
            }
        };
        let fifo = fill(MemoryQueue::new("q", OpCounters::new())).await;
        assert_eq!(take_all(&fifo, 3).await, put);

        let mut orders = Vec::new();
        for seed in [1, 1, 2] {
            let queue = fill(MemoryQueue::new("q", OpCounters::new()).with_shuffled_delivery(seed)).await;
            let taken = take_all(&queue, 3).await;
            let mut sorted = taken.clone();
            sorted.sort_by_key(|b| b[1..].parse::<u32>().unwrap());
            assert_eq!(sorted, put, "each visible message once, the hidden one not");
            assert_ne!(taken, put, "seed {seed}: not the order they were put in");
            orders.push(taken);
        }
        assert_eq!(orders[0], orders[1], "the same seed, the same order");
        assert_ne!(orders[0], orders[2], "another seed, another order");
    }
}
