//! Run history: one entry for each thing that happened to a record (a run started or ended, a
//! trigger coalesced onto a run, a wait, a run put off, a trigger held by a pause, a give-up,
//! an operator's action), written off the run's path to a store every instance shares, so
//! "what happened to record X" has an answer after the instance that ran it is gone.
//!
//! [`History`] is the writer: [`History::record`] never waits and never fails — it hands the
//! entry to a task that gathers every record's entries for a moment
//! ([`HistoryOptions::flush_every`]) and hands them to the store in one write
//! ([`HistoryStore::append`]; [`TableHistory`] makes it a request per partition of records). A write that fails or hangs is
//! counted ([`HISTORY_FAILURES_TOTAL`]) and logged at most once a minute; entries beyond the
//! bounded buffer are dropped and counted ([`HISTORY_DROPPED_TOTAL`]). A run never waits for,
//! fails for, or repeats for its history.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use leasehold_storage::table::{Entity, TABLE_NOT_FOUND, TableClient, odata_literal};
use leasehold_storage::{Op, StoreError, StoreErrorKind};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::observe::OutcomeLabel;
use crate::record::{RecordId, Scope};

/// Counter of history entries written.
pub const HISTORY_WRITTEN_TOTAL: &str = "leasehold_history_written_total";
/// Counter of history writes (requests) that failed or timed out; their entries are lost.
pub const HISTORY_FAILURES_TOTAL: &str = "leasehold_history_failures_total";
/// Counter of history entries dropped: the writer's buffer was full, or a write failed.
pub const HISTORY_DROPPED_TOTAL: &str = "leasehold_history_dropped_total";

/// The longest reason an entry keeps, in characters (cut with an ellipsis beyond).
pub const MAX_REASON_CHARS: usize = 500;

/// What happened, as a history entry's `event` names it: `started` (a run began), every
/// delivery outcome's label ([`OutcomeLabel`]: `completed`, `retriggered`, `coalesced`,
/// `failed`, `lease_lost`, `deferred`, `waiting`, `debounced`, `paused`, `poisoned`, …), and an
/// operator's `enqueued`, `requeued`, `purged` or `broken`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HistoryEvent {
    Started,
    Outcome(OutcomeLabel),
    Enqueued,
    Requeued,
    Purged,
    Broken,
}

impl HistoryEvent {
    pub fn as_str(self) -> &'static str {
        match self {
            HistoryEvent::Started => "started",
            HistoryEvent::Outcome(label) => label.as_str(),
            HistoryEvent::Enqueued => "enqueued",
            HistoryEvent::Requeued => "requeued",
            HistoryEvent::Purged => "purged",
            HistoryEvent::Broken => "broken",
        }
    }

    /// The event named `text`, if it is one.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "started" => Some(HistoryEvent::Started),
            "enqueued" => Some(HistoryEvent::Enqueued),
            "requeued" => Some(HistoryEvent::Requeued),
            "purged" => Some(HistoryEvent::Purged),
            "broken" => Some(HistoryEvent::Broken),
            other => OutcomeLabel::ALL
                .into_iter()
                .find(|l| l.as_str() == other)
                .map(HistoryEvent::Outcome),
        }
    }

    /// Whether it ends a run that started (the run's bar ends here).
    pub fn ends_a_run(self) -> bool {
        matches!(
            self,
            HistoryEvent::Outcome(
                OutcomeLabel::Completed
                    | OutcomeLabel::Retriggered
                    | OutcomeLabel::Superseded
                    | OutcomeLabel::Failed
                    | OutcomeLabel::LeaseLost
                    | OutcomeLabel::Deferred
                    | OutcomeLabel::Poisoned
            )
        )
    }
}

impl fmt::Display for HistoryEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for HistoryEvent {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for HistoryEvent {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        HistoryEvent::parse(&text)
            .ok_or_else(|| serde::de::Error::custom(format!("unknown history event {text:?}")))
    }
}

/// One thing that happened to a record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HistoryEntry {
    /// When, in milliseconds since the Unix epoch, by the writer's clock.
    pub time_ms: u64,
    pub scope: Scope,
    pub record: RecordId,
    pub event: HistoryEvent,
    /// The delivery's attempt (1 for a first delivery); 0 for an operator's action.
    #[serde(default)]
    pub attempt: u32,
    /// The run's fencing token, where a run held the lease with fencing on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fencing_token: Option<u64>,
    /// Who did it: the lease holder's name (`host:pid`), or the operator's tool.
    #[serde(default)]
    pub instance: String,
    /// The queue's lane (`high`, `low`), for a delivery.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lane: Option<String>,
    /// The downstream budget, where one was involved (a pause, a run's slot).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<String>,
    /// How long the logic ran, in milliseconds, for an entry that ends a run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_ms: Option<u64>,
    /// Until when (Unix ms): a wait, a run put off, a trigger held by a pause, a retry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correlation_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
    /// Why (a failure's error, what asked for a run later): at most [`MAX_REASON_CHARS`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl HistoryEntry {
    /// An entry for `event` of `scope`/`record`, now, with every other field empty.
    pub fn new(scope: Scope, record: RecordId, event: HistoryEvent) -> Self {
        Self {
            time_ms: unix_ms(SystemTime::now()),
            scope,
            record,
            event,
            attempt: 0,
            fencing_token: None,
            instance: String::new(),
            lane: None,
            budget: None,
            run_ms: None,
            until_ms: None,
            correlation_id: None,
            trace_id: None,
            reason: None,
        }
    }

    /// Its reason, cut to [`MAX_REASON_CHARS`] (control characters replaced by spaces).
    pub fn with_reason(mut self, reason: impl fmt::Display) -> Self {
        self.reason = Some(bounded_reason(&reason.to_string()));
        self
    }

    /// Until `after` from its time.
    pub fn until_after(mut self, after: Duration) -> Self {
        self.until_ms = Some(self.time_ms.saturating_add(after.as_millis() as u64));
        self
    }

    pub fn time(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(self.time_ms)
    }
}

/// `text` with control characters as spaces, at most [`MAX_REASON_CHARS`] characters.
pub fn bounded_reason(text: &str) -> String {
    let mut out: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(MAX_REASON_CHARS + 1)
        .collect();
    if out.chars().count() > MAX_REASON_CHARS {
        out = out.chars().take(MAX_REASON_CHARS - 1).collect();
        out.push('…');
    }
    out
}

pub(crate) fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Where history is kept.
#[async_trait]
pub trait HistoryStore: Send + Sync + fmt::Debug {
    /// Writes `entries` — all of one record, oldest first — in one request.
    async fn append(&self, entries: &[HistoryEntry]) -> Result<(), StoreError>;

    /// The record's entries no older than `keep`, newest first, at most `limit`.
    async fn read(
        &self,
        scope: &Scope,
        record: &RecordId,
        keep: Duration,
        limit: usize,
    ) -> Result<Vec<HistoryEntry>, StoreError>;

    /// Drops whole stretches of history older than `keep` (never an entry at a time); says
    /// how many.
    async fn sweep(&self, keep: Duration) -> Result<usize, StoreError>;

    /// Entries of every record (or of one scope's) in a window of time, newest first, at most
    /// `query.limit`: the deployment's recent runs. A store may bound what one call reads
    /// (see [`TableHistory`]'s); when it stopped at its bound the answer says it is partial.
    async fn recent(&self, query: &RecentQuery) -> Result<Recent, StoreError>;
}

/// What [`HistoryStore::recent`] reads.
#[derive(Debug, Clone, PartialEq)]
pub struct RecentQuery {
    /// The window, in Unix ms, both ends included.
    pub since_ms: u64,
    pub until_ms: u64,
    /// Only this scope's records.
    pub scope: Option<Scope>,
    /// Only these events; every event when empty.
    pub events: Vec<HistoryEvent>,
    /// At most this many entries (the newest).
    pub limit: usize,
}

impl RecentQuery {
    /// Whether `entry` is one the query asks for.
    pub fn wants(&self, entry: &HistoryEntry) -> bool {
        (self.since_ms..=self.until_ms).contains(&entry.time_ms)
            && self.scope.as_ref().is_none_or(|s| &entry.scope == s)
            && (self.events.is_empty() || self.events.contains(&entry.event))
    }
}

/// What [`HistoryStore::recent`] found.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Recent {
    /// Newest first.
    pub entries: Vec<HistoryEntry>,
    /// The store stopped at its bound before it had read the whole window: entries may be
    /// missing, newer ones among them (a store reads in key order, not time order).
    pub partial: bool,
    /// Stored items read (entities, for [`TableHistory`]).
    pub scanned: usize,
}

/// Newest first; of the same millisecond, the later written (the later in `found`) first.
fn newest_first(mut found: Vec<HistoryEntry>, limit: usize) -> Vec<HistoryEntry> {
    found.reverse();
    found.sort_by_key(|e| std::cmp::Reverse(e.time_ms));
    found.truncate(limit);
    found
}

/// History in memory: for tests and the simulation.
#[derive(Debug, Default)]
pub struct MemoryHistory {
    entries: Mutex<Vec<HistoryEntry>>,
    /// Appends (requests) made.
    appends: Mutex<u64>,
}

impl MemoryHistory {
    pub fn new() -> Self {
        Self::default()
    }

    /// Every entry kept, oldest first.
    pub fn all(&self) -> Vec<HistoryEntry> {
        self.entries.lock().unwrap().clone()
    }

    /// How many appends (requests) were made.
    pub fn appends(&self) -> u64 {
        *self.appends.lock().unwrap()
    }
}

#[async_trait]
impl HistoryStore for MemoryHistory {
    async fn append(&self, entries: &[HistoryEntry]) -> Result<(), StoreError> {
        *self.appends.lock().unwrap() += 1;
        self.entries.lock().unwrap().extend_from_slice(entries);
        Ok(())
    }

    async fn read(
        &self,
        scope: &Scope,
        record: &RecordId,
        keep: Duration,
        limit: usize,
    ) -> Result<Vec<HistoryEntry>, StoreError> {
        let since = unix_ms(SystemTime::now()).saturating_sub(keep.as_millis() as u64);
        let mut found: Vec<HistoryEntry> = self
            .entries
            .lock()
            .unwrap()
            .iter()
            .filter(|e| &e.scope == scope && &e.record == record && e.time_ms >= since)
            .cloned()
            .collect();
        // Newest first; of the same millisecond, the later written first.
        found.reverse();
        found.sort_by_key(|e| std::cmp::Reverse(e.time_ms));
        found.truncate(limit);
        Ok(found)
    }

    async fn sweep(&self, keep: Duration) -> Result<usize, StoreError> {
        let since = unix_ms(SystemTime::now()).saturating_sub(keep.as_millis() as u64);
        let mut entries = self.entries.lock().unwrap();
        let before = entries.len();
        entries.retain(|e| e.time_ms >= since);
        Ok(usize::from(entries.len() < before))
    }

    async fn recent(&self, query: &RecentQuery) -> Result<Recent, StoreError> {
        let entries = self.entries.lock().unwrap();
        let found: Vec<HistoryEntry> = entries.iter().filter(|e| query.wants(e)).cloned().collect();
        Ok(Recent {
            entries: newest_first(found, query.limit),
            partial: false,
            scanned: entries.len(),
        })
    }
}

/// How the history writer behaves.
#[derive(Debug, Clone)]
pub struct HistoryOptions {
    /// How long entries are gathered before they are written together (every record's at one
    /// tick): a run's start and end are in one write when no tick falls between them, and the
    /// more runs a tick gathers, the more share each of the store's requests.
    pub flush_every: Duration,
    /// The most entries waiting to be written; beyond it new ones are dropped (and counted).
    pub max_buffered: usize,
    /// The longest one write may take before it counts as failed (its entries are lost).
    pub write_timeout: Duration,
    /// Writes under way at once.
    pub max_writes: usize,
    /// How long history is kept ([`HistoryStore::sweep`]) and read back.
    pub keep: Duration,
    /// The name entries carry as `instance`.
    pub instance: String,
}

impl Default for HistoryOptions {
    fn default() -> Self {
        Self {
            flush_every: Duration::from_secs(2),
            max_buffered: 10_000,
            write_timeout: Duration::from_secs(10),
            max_writes: 8,
            keep: Duration::from_secs(7 * 24 * 3600),
            instance: String::new(),
        }
    }
}

/// The history writer: cheap to clone, and [`record`](Self::record) never waits.
#[derive(Clone)]
pub struct History {
    inner: Arc<Inner>,
}

struct Inner {
    store: Arc<dyn HistoryStore>,
    options: HistoryOptions,
    sender: mpsc::Sender<Command>,
    /// Entries handed to the writer and not yet written or lost: in the channel, gathered, or
    /// in a write under way. At [`HistoryOptions::max_buffered`] new ones are dropped, so a
    /// store that hangs holds at most that many entries in memory.
    outstanding: Arc<std::sync::atomic::AtomicUsize>,
}

enum Command {
    Entry(Box<HistoryEntry>),
    /// Write everything buffered now, then say so.
    Flush(tokio::sync::oneshot::Sender<()>),
}

impl fmt::Debug for History {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("History")
            .field("store", &self.inner.store)
            .field("options", &self.inner.options)
            .finish()
    }
}

impl History {
    /// A writer to `store`, its task spawned on the current runtime. The task ends when every
    /// clone of the writer is dropped (after writing what it holds).
    pub fn new(store: Arc<dyn HistoryStore>, options: HistoryOptions) -> Self {
        let (sender, receiver) = mpsc::channel(options.max_buffered.max(1));
        let outstanding = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let inner = Arc::new(Inner {
            store: store.clone(),
            options: options.clone(),
            sender,
            outstanding: outstanding.clone(),
        });
        tokio::spawn(write_loop(store, options, receiver, outstanding));
        Self { inner }
    }

    pub fn options(&self) -> &HistoryOptions {
        &self.inner.options
    }

    pub fn store(&self) -> &Arc<dyn HistoryStore> {
        &self.inner.store
    }

    /// Hands `entry` to the writer (its `instance` filled in if empty). Never waits: with the
    /// buffer full the entry is dropped and counted.
    pub fn record(&self, mut entry: HistoryEntry) {
        if entry.instance.is_empty() {
            entry.instance = self.inner.options.instance.clone();
        }
        use std::sync::atomic::Ordering::SeqCst;
        let outstanding = &self.inner.outstanding;
        let full = outstanding.fetch_add(1, SeqCst) >= self.inner.options.max_buffered;
        if full
            || self
                .inner
                .sender
                .try_send(Command::Entry(Box::new(entry)))
                .is_err()
        {
            outstanding.fetch_sub(1, SeqCst);
            metrics::counter!(HISTORY_DROPPED_TOTAL).increment(1);
            warn_at_most_once_a_minute("the history writer's buffer is full: an entry was dropped");
        }
    }

    /// Writes what is buffered now and waits for it (at a stop, and in tests).
    pub async fn flush(&self) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.inner.sender.send(Command::Flush(tx)).await.is_ok() {
            let _ = rx.await;
        }
    }

    /// The record's history, newest first, at most `limit` entries.
    pub async fn read(
        &self,
        scope: &Scope,
        record: &RecordId,
        limit: usize,
    ) -> Result<Vec<HistoryEntry>, StoreError> {
        self.inner
            .store
            .read(scope, record, self.inner.options.keep, limit)
            .await
    }
}

/// Logs `what` as a warning unless a warning of the writer was logged less than a minute ago.
fn warn_at_most_once_a_minute(what: &str) {
    static LAST: Mutex<Option<std::time::Instant>> = Mutex::new(None);
    let mut last = LAST.lock().unwrap_or_else(|e| e.into_inner());
    if last.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
        *last = Some(std::time::Instant::now());
        tracing::warn!(
            "{what} (history never delays nor fails a run; see the {HISTORY_FAILURES_TOTAL} and {HISTORY_DROPPED_TOTAL} metrics; logged at most once a minute)"
        );
    }
}

async fn write_loop(
    store: Arc<dyn HistoryStore>,
    options: HistoryOptions,
    mut receiver: mpsc::Receiver<Command>,
    outstanding: Arc<std::sync::atomic::AtomicUsize>,
) {
    // A record's entries, oldest first, in the order records first came.
    let mut pending: HashMap<(Scope, RecordId), Vec<HistoryEntry>> = HashMap::new();
    let mut order: VecDeque<(Scope, RecordId)> = VecDeque::new();
    let writes = Arc::new(tokio::sync::Semaphore::new(options.max_writes.max(1)));
    let mut tasks = tokio::task::JoinSet::new();
    let mut flush_at: Option<Instant> = None;
    loop {
        let command = tokio::select! {
            command = receiver.recv() => command,
            _ = async {
                match flush_at {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            } => {
                flush_at = None;
                write_all(&store, &options, &writes, &outstanding, &mut tasks, &mut pending, &mut order);
                continue;
            }
            Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
        };
        match command {
            Some(Command::Entry(entry)) => {
                let key = (entry.scope.clone(), entry.record.clone());
                let list = pending.entry(key.clone()).or_default();
                if list.is_empty() {
                    order.push_back(key);
                }
                list.push(*entry);
                flush_at.get_or_insert_with(|| Instant::now() + options.flush_every);
            }
            Some(Command::Flush(done)) => {
                flush_at = None;
                write_all(
                    &store,
                    &options,
                    &writes,
                    &outstanding,
                    &mut tasks,
                    &mut pending,
                    &mut order,
                );
                while tasks.join_next().await.is_some() {}
                let _ = done.send(());
            }
            None => {
                write_all(
                    &store,
                    &options,
                    &writes,
                    &outstanding,
                    &mut tasks,
                    &mut pending,
                    &mut order,
                );
                while tasks.join_next().await.is_some() {}
                return;
            }
        }
    }
}

/// Entries of a write, counted out of the writer's outstanding ones when dropped.
struct Outstanding(Arc<std::sync::atomic::AtomicUsize>, usize);

impl Drop for Outstanding {
    fn drop(&mut self) {
        self.0.fetch_sub(self.1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// The most entries one write ([`HistoryStore::append`]) carries: a flush of more is several
/// writes, under way at once up to [`HistoryOptions::max_writes`].
pub const MAX_ENTRIES_PER_WRITE: usize = 1000;

fn write_all(
    store: &Arc<dyn HistoryStore>,
    options: &HistoryOptions,
    writes: &Arc<tokio::sync::Semaphore>,
    outstanding: &Arc<std::sync::atomic::AtomicUsize>,
    tasks: &mut tokio::task::JoinSet<()>,
    pending: &mut HashMap<(Scope, RecordId), Vec<HistoryEntry>>,
    order: &mut VecDeque<(Scope, RecordId)>,
) {
    // Every record's entries, a record's together and in order: the store writes them in as few
    // requests as it can (the Table service: one per partition of records, per 100 records).
    let mut all = Vec::new();
    while let Some(key) = order.pop_front() {
        if let Some(entries) = pending.remove(&key) {
            all.extend(entries);
        }
    }
    {
        for chunk in all.chunks(MAX_ENTRIES_PER_WRITE) {
            let chunk = chunk.to_vec();
            let (store, writes, timeout) = (store.clone(), writes.clone(), options.write_timeout);
            // Counted out when the write ends, however it ends.
            let done = Outstanding(outstanding.clone(), chunk.len());
            tasks.spawn(async move {
                let _done = done;
                let Ok(_permit) = writes.acquire_owned().await else {
                    return;
                };
                let n = chunk.len() as u64;
                match tokio::time::timeout(timeout, store.append(&chunk)).await {
                    Ok(Ok(())) => metrics::counter!(HISTORY_WRITTEN_TOTAL).increment(n),
                    Ok(Err(e)) => {
                        metrics::counter!(HISTORY_FAILURES_TOTAL).increment(1);
                        metrics::counter!(HISTORY_DROPPED_TOTAL).increment(n);
                        warn_at_most_once_a_minute(&format!(
                            "a history write failed ({n} entries lost): {e}"
                        ));
                    }
                    Err(_) => {
                        metrics::counter!(HISTORY_FAILURES_TOTAL).increment(1);
                        metrics::counter!(HISTORY_DROPPED_TOTAL).increment(n);
                        warn_at_most_once_a_minute(&format!(
                            "a history write took longer than {timeout:?} ({n} entries lost)"
                        ));
                    }
                }
            });
        }
    }
}

/// History in the account's Table service: one table per period of [`HistoryOptions::keep`]
/// (whole days), named `<prefix><yyyymmdd>` after the period's first day (UTC), dropped whole
/// once the period ended more than `keep` ago ([`sweep`](HistoryStore::sweep): a request per
/// period, not per entry). A scope's records are spread by a hash of the record over
/// [`BUCKETS`] partitions `<scope>|<bucket>` (the scope holds no `|`), so a write of many
/// records' entries is a few entity group transactions (one per partition per 100 records), and
/// no partition is hot however a bulk import is ordered. Each record's write is one entity whose
/// row key is `<record>|` and the newest entry's time inverted (`9999999999999 − ms`, then a
/// random suffix), so a record's entities are one key range of its partition, newest first,
/// and whose `Entries` property holds the write's entries as JSON (`Newest`, the newest entry's
/// time in 13 digits, lets [`recent`](HistoryStore::recent) filter by time). A record's history
/// within `keep` is in the current period's table and the one before: read in 2 requests.
#[derive(Debug, Clone)]
pub struct TableHistory {
    client: TableClient,
    prefix: String,
    period_days: u64,
    /// The bounds of one [`HistoryStore::recent`] read: requests, entities, time.
    recent_bounds: (usize, usize, Duration),
}

/// The longest `Entries` property written, in bytes (the service takes 64 KiB a property).
const MAX_ENTRIES_BYTES: usize = 30_000;

/// The longest table name prefix: a table name is at most 63 characters, 8 of them the date.
pub const MAX_HISTORY_PREFIX_LEN: usize = 55;

impl TableHistory {
    /// History in `client`'s account, tables named `<prefix><yyyymmdd>`, kept for `keep`
    /// (rounded up to whole days). `prefix`: letters and digits, starting with a letter, at
    /// most [`MAX_HISTORY_PREFIX_LEN`].
    pub fn new(client: TableClient, prefix: &str, keep: Duration) -> Result<Self, String> {
        Self::check_prefix(prefix)?;
        Ok(Self {
            client,
            prefix: prefix.to_string(),
            period_days: keep.as_secs().div_ceil(DAY.as_secs()).max(1),
            recent_bounds: (RECENT_MAX_REQUESTS, RECENT_MAX_ENTITIES, RECENT_MAX_TIME),
        })
    }

    /// The same history, one [`HistoryStore::recent`] read making at most `requests` requests
    /// and reading at most `entities` entities for at most `time` ([`RECENT_MAX_REQUESTS`],
    /// [`RECENT_MAX_ENTITIES`] and [`RECENT_MAX_TIME`] unless set; tests lower them).
    pub fn with_recent_bounds(mut self, requests: usize, entities: usize, time: Duration) -> Self {
        self.recent_bounds = (requests.max(1), entities.max(1), time);
        self
    }

    /// Whether `prefix` makes valid table names, and if not why.
    pub fn check_prefix(prefix: &str) -> Result<(), String> {
        let valid = !prefix.is_empty()
            && prefix.len() <= MAX_HISTORY_PREFIX_LEN
            && prefix.starts_with(|c: char| c.is_ascii_alphabetic())
            && prefix.chars().all(|c| c.is_ascii_alphanumeric());
        if valid {
            return Ok(());
        }
        Err(format!(
            "{prefix:?} is not a valid history table prefix: 1 to {MAX_HISTORY_PREFIX_LEN} letters and digits, starting with a letter"
        ))
    }

    /// The table prefix a deployment whose blob container is `container` uses by default: its
    /// letters and digits, after `history`.
    pub fn default_prefix(container: &str) -> String {
        let mut prefix: String = format!(
            "history{}",
            container
                .chars()
                .filter(char::is_ascii_alphanumeric)
                .collect::<String>()
        );
        prefix.truncate(MAX_HISTORY_PREFIX_LEN);
        prefix
    }

    /// The period (its number since the Unix epoch) `ms` falls in.
    fn period_of(&self, ms: u64) -> u64 {
        ms / DAY.as_millis() as u64 / self.period_days
    }

    /// The table of period `period`.
    fn table(&self, period: u64) -> String {
        let (y, m, d) = civil_from_days((period * self.period_days) as i64);
        format!("{}{y:04}{m:02}{d:02}", self.prefix)
    }

    /// The period a table of this history is of, from its name.
    fn period_of_table(&self, name: &str) -> Option<u64> {
        let date = name.strip_prefix(&self.prefix)?;
        if date.len() != 8 || !date.chars().all(|c| c.is_ascii_digit()) {
            return None;
        }
        let (y, m, d) = (
            date[..4].parse().ok()?,
            date[4..6].parse().ok()?,
            date[6..].parse().ok()?,
        );
        let days = days_from_civil(y, m, d);
        (days >= 0 && (days as u64).is_multiple_of(self.period_days)).then(|| days as u64 / self.period_days)
    }

    /// The partition of `record`'s entities: its scope and its bucket, by FNV-1a (a hash that
    /// is the same on every machine and version: readers find what any writer wrote).
    fn partition(scope: &Scope, record: &RecordId) -> String {
        let mut hash: u32 = 0x811c_9dc5;
        for byte in record.as_str().bytes() {
            hash = (hash ^ u32::from(byte)).wrapping_mul(0x0100_0193);
        }
        format!("{}|{:02x}", scope.as_str(), hash % BUCKETS)
    }

    /// The first row key of `record`'s entities in its partition; `record}` bounds them above
    /// (`}` sorts just after `|`, which no record holds).
    fn row_prefix(record: &RecordId) -> String {
        format!("{}|", record.as_str())
    }

    async fn insert(&self, table: &str, entities: &[Entity]) -> Result<(), StoreError> {
        match self.client.insert_batch(table, entities).await {
            Err(e) if e.code() == Some(TABLE_NOT_FOUND) => {
                self.client.create_table(table).await?;
                self.client.insert_batch(table, entities).await
            }
            other => other,
        }
    }
}

const DAY: Duration = Duration::from_secs(24 * 3600);

/// The partitions a scope's records are spread over in each table ([`TableHistory`]): enough
/// that no partition nears the service's 2,000 entities a second (a burst of 2,000 runs a
/// second is 125 a partition), few enough that a flush of many runs is a few requests.
pub const BUCKETS: u32 = 16;

/// The civil date (proleptic Gregorian, UTC) of `days` since 1970-01-01 (H. Hinnant's).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// Days since 1970-01-01 of the civil date `y-m-d`.
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if m > 2 { m - 3 } else { m + 9 } as i64;
    let doy = (153 * mp + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[async_trait]
impl HistoryStore for TableHistory {
    async fn append(&self, entries: &[HistoryEntry]) -> Result<(), StoreError> {
        // Each record's entries as entities of at most MAX_ENTRIES_BYTES of entries (one,
        // nearly always), by table and partition.
        let mut batches: BTreeMap<(String, String), Vec<Entity>> = BTreeMap::new();
        let mut records: Vec<(&Scope, &RecordId, Vec<&HistoryEntry>)> = Vec::new();
        let mut index: HashMap<(&Scope, &RecordId), usize> = HashMap::new();
        for entry in entries {
            let at = *index.entry((&entry.scope, &entry.record)).or_insert_with(|| {
                records.push((&entry.scope, &entry.record, Vec::new()));
                records.len() - 1
            });
            records[at].2.push(entry);
        }
        for (scope, record, list) in records {
            let mut groups: Vec<Vec<&HistoryEntry>> = vec![Vec::new()];
            let mut size = 0;
            for entry in list {
                let len = serde_json::to_string(entry).map_or(0, |s| s.len()) + 1;
                if size + len > MAX_ENTRIES_BYTES && !groups.last().is_some_and(Vec::is_empty) {
                    groups.push(Vec::new());
                    size = 0;
                }
                size += len;
                groups.last_mut().expect("one group at least").push(entry);
            }
            let partition = Self::partition(scope, record);
            for group in groups {
                let newest = group.iter().map(|e| e.time_ms).max().unwrap_or(0);
                let mut events: Vec<&str> = group.iter().map(|e| e.event.as_str()).collect();
                events.dedup();
                let mut entity = Entity::new();
                entity.insert("PartitionKey".into(), partition.clone().into());
                entity.insert(
                    "RowKey".into(),
                    format!(
                        "{}{:013}-{}",
                        Self::row_prefix(record),
                        9_999_999_999_999u64.saturating_sub(newest),
                        uuid::Uuid::new_v4().simple()
                    )
                    .into(),
                );
                entity.insert("Newest".into(), format!("{newest:013}").into());
                entity.insert("Scope".into(), scope.as_str().into());
                entity.insert("Events".into(), events.join(" ").into());
                entity.insert(
                    "Entries".into(),
                    serde_json::to_string(&group)
                        .map_err(|e| {
                            StoreError::new(StoreErrorKind::Rejected, Op::HistoryWrite, e.to_string())
                        })?
                        .into(),
                );
                batches
                    .entry((self.table(self.period_of(newest)), partition.clone()))
                    .or_default()
                    .push(entity);
            }
        }
        // One entity group transaction per partition and 100 entities, all under way at once.
        let mut writes = tokio::task::JoinSet::new();
        for ((table, _), entities) in batches {
            for chunk in entities.chunks(leasehold_storage::table::MAX_BATCH) {
                let (this, table, chunk) = (self.clone(), table.clone(), chunk.to_vec());
                writes.spawn(async move { this.insert(&table, &chunk).await });
            }
        }
        let mut failed = None;
        while let Some(done) = writes.join_next().await {
            match done {
                Ok(Ok(())) => {}
                Ok(Err(e)) => failed = failed.or(Some(e)),
                Err(e) => {
                    failed = failed.or(Some(StoreError::new(
                        StoreErrorKind::Transient,
                        Op::HistoryWrite,
                        format!("a history write task failed: {e}"),
                    )))
                }
            }
        }
        failed.map_or(Ok(()), Err)
    }

    async fn read(
        &self,
        scope: &Scope,
        record: &RecordId,
        keep: Duration,
        limit: usize,
    ) -> Result<Vec<HistoryEntry>, StoreError> {
        let now = unix_ms(SystemTime::now());
        let since = now.saturating_sub(keep.as_millis() as u64);
        let filter = format!(
            "PartitionKey eq {} and RowKey ge {} and RowKey lt {}",
            odata_literal(&Self::partition(scope, record)),
            odata_literal(&Self::row_prefix(record)),
            odata_literal(&format!("{}}}", record.as_str())),
        );
        let current = self.period_of(now);
        let mut found = Vec::new();
        for period in [current, current.saturating_sub(1)] {
            if found.len() >= limit || (period != current && self.period_of(since) > period) {
                break;
            }
            let table = self.table(period);
            let mut next = None;
            // A partition's page can be short and carry a continuation: read on while needed.
            for _ in 0..8 {
                let top = (limit - found.len().min(limit)).clamp(1, 1000) as u32;
                let (entities, more) = match self
                    .client
                    .query(&table, Some(&filter), Some(top), next.as_ref())
                    .await
                {
                    Ok(page) => page,
                    Err(e) if e.kind() == StoreErrorKind::NotFound => break,
                    Err(e) => return Err(e),
                };
                for entity in entities {
                    let Some(text) = entity.get("Entries").and_then(serde_json::Value::as_str) else {
                        continue;
                    };
                    match serde_json::from_str::<Vec<HistoryEntry>>(text) {
                        Ok(mut entries) => {
                            entries.reverse();
                            found.extend(entries.into_iter().filter(|e| e.time_ms >= since));
                        }
                        Err(e) => {
                            tracing::debug!(table, error = %e, "a history entity that is not this version's: skipped")
                        }
                    }
                }
                next = more;
                if next.is_none() || found.len() >= limit {
                    break;
                }
            }
        }
        found.sort_by_key(|e| std::cmp::Reverse(e.time_ms));
        found.truncate(limit);
        Ok(found)
    }

    /// Reads the period tables covering the window, newest first, with a `$filter` on the row
    /// key (and the scope's partitions): a query across partitions, which the service answers
    /// in key order (scope, then record), not time order, so every page of the window is read
    /// before the newest `limit` are known.
    ///
    /// Bounded, so a big table cannot hold a page up: at most [`RECENT_MAX_REQUESTS`] requests,
    /// [`RECENT_MAX_ENTITIES`] entities and [`RECENT_MAX_TIME`] in all (unless set otherwise,
    /// [`TableHistory::with_recent_bounds`]). Stopped at a bound, the
    /// answer is `partial`: what it read, newest first, with entries of records later in key
    /// order (and of older tables) missing, newer ones among them. A narrower window or a scope
    /// reads less.
    async fn recent(&self, query: &RecentQuery) -> Result<Recent, StoreError> {
        let started = Instant::now();
        let (max_requests, max_entities, max_time) = self.recent_bounds;
        let filter = Self::recent_filter(query);
        let (first, last) = (self.period_of(query.since_ms), self.period_of(query.until_ms));
        let mut found = Vec::new();
        let (mut requests, mut scanned, mut partial) = (0, 0, false);
        'tables: for period in (first..=last).rev() {
            let table = self.table(period);
            let mut next = None;
            loop {
                let left = max_time.saturating_sub(started.elapsed());
                if requests >= max_requests || scanned >= max_entities || left.is_zero() {
                    partial = true;
                    break 'tables;
                }
                requests += 1;
                let top = (max_entities - scanned).min(1000) as u32;
                let page = tokio::time::timeout(
                    left,
                    self.client.query(&table, Some(&filter), Some(top), next.as_ref()),
                )
                .await;
                let (entities, more) = match page {
                    Err(_) => {
                        partial = true;
                        break 'tables;
                    }
                    Ok(Ok(page)) => page,
                    Ok(Err(e)) if e.kind() == StoreErrorKind::NotFound => break,
                    Ok(Err(e)) => return Err(e),
                };
                scanned += entities.len();
                gather(entities, query, &table, &mut found);
                next = more;
                if next.is_none() {
                    break;
                }
            }
        }
        Ok(Recent {
            entries: newest_first(found, query.limit),
            partial,
            scanned,
        })
    }

    async fn sweep(&self, keep: Duration) -> Result<usize, StoreError> {
        let now = unix_ms(SystemTime::now());
        let mut dropped = 0;
        for name in self.client.list_tables(&self.prefix).await? {
            let Some(period) = self.period_of_table(&name) else {
                continue;
            };
            // The period's end, in ms.
            let end = (period + 1) * self.period_days * DAY.as_millis() as u64;
            if end + (keep.as_millis() as u64) < now && self.client.delete_table(&name).await? {
                dropped += 1;
            }
        }
        Ok(dropped)
    }
}

/// The most requests one [`TableHistory::recent`] makes.
pub const RECENT_MAX_REQUESTS: usize = 20;
/// The most entities one [`TableHistory::recent`] reads (each holds one write's entries: a
/// run's start and end, usually).
pub const RECENT_MAX_ENTITIES: usize = 10_000;
/// The longest one [`TableHistory::recent`] reads for, all requests together.
pub const RECENT_MAX_TIME: Duration = Duration::from_secs(10);
/// How much older than its entity's row key (its newest entry) an entry may be: the writer
/// gathers a record's entries for its flush interval (2 s) before one write, and a write may
/// wait for a slot; an entity newer than a window's end by up to this may still hold entries of
/// the window.
const ENTITY_SPAN: Duration = Duration::from_secs(600);

impl TableHistory {
    /// The `$filter` of a [`HistoryStore::recent`] read: entities whose newest entry is in
    /// `[since, until + ENTITY_SPAN]`, of `scope`'s partitions if given.
    ///
    /// By `Newest` (the newest entry's time by the writer's clock, 13 digits, so compared as
    /// text it compares as a number), not by the service's `Timestamp`: the entries' times are
    /// the writer's, so the window is cut by the same clock, whatever the skew between the writer
    /// and the service.
    fn recent_filter(query: &RecentQuery) -> String {
        let until = query.until_ms.saturating_add(ENTITY_SPAN.as_millis() as u64);
        let mut filter = format!("Newest ge '{:013}' and Newest le '{until:013}'", query.since_ms);
        if let Some(scope) = &query.scope {
            // A scope's partitions are `<scope>|<bucket>`; `}` sorts just above `|`.
            filter = format!(
                "PartitionKey ge {} and PartitionKey lt {} and {filter}",
                odata_literal(&format!("{}|", scope.as_str())),
                odata_literal(&format!("{}}}", scope.as_str())),
            );
        }
        filter
    }
}

/// Reads entities' entries into `found` (the ones `query` wants).
fn gather(entities: Vec<Entity>, query: &RecentQuery, table: &str, found: &mut Vec<HistoryEntry>) {
    for entity in entities {
        let Some(text) = entity.get("Entries").and_then(serde_json::Value::as_str) else {
            continue;
        };
        match serde_json::from_str::<Vec<HistoryEntry>>(text) {
            Ok(entries) => found.extend(entries.into_iter().filter(|e| query.wants(e))),
            Err(e) => {
                tracing::debug!(table, error = %e, "a history entity that is not this version's: skipped")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(record: &str, event: HistoryEvent) -> HistoryEntry {
        HistoryEntry::new(
            Scope::parse("account").unwrap(),
            RecordId::parse(record).unwrap(),
            event,
        )
    }

    #[test]
    fn events_are_named_as_outcomes_are_and_read_back() {
        for event in [
            HistoryEvent::Started,
            HistoryEvent::Enqueued,
            HistoryEvent::Requeued,
            HistoryEvent::Purged,
            HistoryEvent::Broken,
        ]
        .into_iter()
        .chain(OutcomeLabel::ALL.into_iter().map(HistoryEvent::Outcome))
        {
            assert_eq!(HistoryEvent::parse(event.as_str()), Some(event));
            let json = serde_json::to_string(&event).unwrap();
            assert_eq!(serde_json::from_str::<HistoryEvent>(&json).unwrap(), event);
        }
        assert_eq!(HistoryEvent::parse("exploded"), None);
    }

    #[test]
    fn a_reason_is_bounded_and_has_no_control_characters() {
        let e = entry("1", HistoryEvent::Outcome(OutcomeLabel::Failed)).with_reason("a\nb\u{1b}[31m");
        assert_eq!(e.reason.as_deref(), Some("a b [31m"));
        let long = entry("1", HistoryEvent::Started).with_reason("é".repeat(2000));
        let reason = long.reason.unwrap();
        assert_eq!(reason.chars().count(), MAX_REASON_CHARS);
        assert!(reason.ends_with('…'));
    }

    /// The entries gathered within the flush interval, of every record, go in one write (the
    /// store makes it in as few requests as it can); `flush` writes at once.
    #[tokio::test(start_paused = true)]
    async fn a_records_entries_are_gathered_into_one_write() {
        let store = Arc::new(MemoryHistory::new());
        let history = History::new(
            store.clone(),
            HistoryOptions {
                instance: "host:1".into(),
                ..HistoryOptions::default()
            },
        );
        history.record(entry("1", HistoryEvent::Started));
        history.record(entry("2", HistoryEvent::Outcome(OutcomeLabel::Coalesced)));
        tokio::time::sleep(Duration::from_millis(500)).await;
        history.record(entry("1", HistoryEvent::Outcome(OutcomeLabel::Completed)));
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(store.appends(), 0, "nothing is written before the interval");
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(store.appends(), 1, "one write for both records' entries");
        let all = store.all();
        assert_eq!(all.len(), 3);
        assert!(all.iter().all(|e| e.instance == "host:1"));
        history.record(entry("3", HistoryEvent::Started));
        history.flush().await;
        assert_eq!(store.appends(), 2);
        let read = history
            .read(
                &Scope::parse("account").unwrap(),
                &RecordId::parse("1").unwrap(),
                10,
            )
            .await
            .unwrap();
        let events: Vec<_> = read.iter().map(|e| e.event.as_str()).collect();
        assert_eq!(events, ["completed", "started"], "newest first");
    }

    /// `recent` reads every record's entries in the window, of the scope and events asked,
    /// newest first, at most `limit`.
    #[tokio::test]
    async fn recent_entries_across_records_are_filtered_and_newest_first() {
        let store = MemoryHistory::new();
        let at = |record: &str, scope: &str, event, ms: u64| {
            let mut e = HistoryEntry::new(
                Scope::parse(scope).unwrap(),
                RecordId::parse(record).unwrap(),
                event,
            );
            e.time_ms = ms;
            e
        };
        let completed = HistoryEvent::Outcome(OutcomeLabel::Completed);
        let failed = HistoryEvent::Outcome(OutcomeLabel::Failed);
        store
            .append(&[
                at("1", "account", HistoryEvent::Started, 1_000),
                at("1", "account", completed, 2_000),
            ])
            .await
            .unwrap();
        store.append(&[at("2", "contact", failed, 3_000)]).await.unwrap();
        store
            .append(&[at("3", "account", completed, 9_000)])
            .await
            .unwrap();
        store.append(&[at("4", "account", completed, 500)]).await.unwrap();
        let query = |scope: Option<&str>, events: Vec<HistoryEvent>, limit| RecentQuery {
            since_ms: 1_000,
            until_ms: 5_000,
            scope: scope.map(|s| Scope::parse(s).unwrap()),
            events,
            limit,
        };
        let ids = |r: Recent| -> Vec<(String, &'static str)> {
            assert!(!r.partial);
            r.entries
                .iter()
                .map(|e| (e.record.as_str().to_string(), e.event.as_str()))
                .collect()
        };
        let all = store.recent(&query(None, vec![], 10)).await.unwrap();
        assert_eq!(
            ids(all),
            [
                ("2".to_string(), "failed"),
                ("1".into(), "completed"),
                ("1".into(), "started")
            ],
            "the window only (not 500 nor 9000), newest first"
        );
        let runs = store
            .recent(&query(Some("account"), vec![completed, failed], 10))
            .await
            .unwrap();
        assert_eq!(ids(runs), [("1".to_string(), "completed")], "the scope's runs");
        let failures = store.recent(&query(None, vec![failed], 10)).await.unwrap();
        assert_eq!(ids(failures), [("2".to_string(), "failed")]);
        let one = store.recent(&query(None, vec![], 1)).await.unwrap();
        assert_eq!(ids(one), [("2".to_string(), "failed")], "the newest of them");
    }

    /// The table filter bounds row keys (inverted times) by the window, with room for an
    /// entity's older entries, and a scope's partitions by `|` and the next character.
    #[test]
    fn the_recent_filter_bounds_the_newest_entry_and_a_scopes_partitions() {
        let query = RecentQuery {
            since_ms: 1_000_000,
            until_ms: 2_000_000,
            scope: Some(Scope::parse("account").unwrap()),
            events: Vec::new(),
            limit: 10,
        };
        let filter = TableHistory::recent_filter(&query);
        assert_eq!(
            filter,
            "PartitionKey ge 'account|' and PartitionKey lt 'account}' and \
             Newest ge '0000001000000' and Newest le '0000002600000'"
        );
    }

    /// A record's partition is its scope and one of [`BUCKETS`], the same on every machine;
    /// records spread over all of them.
    #[test]
    fn records_spread_over_their_scopes_buckets() {
        let scope = Scope::parse("account").unwrap();
        let record = |r: &str| RecordId::parse(r).unwrap();
        assert_eq!(TableHistory::partition(&scope, &record("a")), "account|0c");
        let mut seen = std::collections::BTreeMap::<String, usize>::new();
        for i in 0..1600 {
            *seen
                .entry(TableHistory::partition(&scope, &record(&format!("rec-{i}"))))
                .or_default() += 1;
        }
        assert_eq!(seen.len(), BUCKETS as usize, "{seen:?}");
        assert!(seen.values().all(|&n| (50..=150).contains(&n)), "{seen:?}");
    }

    #[derive(Debug)]
    struct Broken {
        hang: bool,
        /// Entries handed to it, all writes together.
        entries: Mutex<u64>,
    }

    #[async_trait]
    impl HistoryStore for Broken {
        async fn append(&self, entries: &[HistoryEntry]) -> Result<(), StoreError> {
            *self.entries.lock().unwrap() += entries.len() as u64;
            if self.hang {
                std::future::pending::<()>().await;
            }
            Err(StoreError::new(
                leasehold_storage::StoreErrorKind::Transient,
                leasehold_storage::Op::BlobCreate,
                "refused",
            ))
        }
        async fn read(
            &self,
            _: &Scope,
            _: &RecordId,
            _: Duration,
            _: usize,
        ) -> Result<Vec<HistoryEntry>, StoreError> {
            Ok(Vec::new())
        }
        async fn sweep(&self, _: Duration) -> Result<usize, StoreError> {
            Ok(0)
        }
        async fn recent(&self, _: &RecentQuery) -> Result<Recent, StoreError> {
            Ok(Recent::default())
        }
    }

    /// Against a store that hangs, the writer holds at most `max_buffered` entries, whether
    /// they wait in the channel, are gathered, or are in a write under way: more are dropped;
    /// once the hung writes time out, entries are taken again.
    #[tokio::test(start_paused = true)]
    async fn a_hanging_store_holds_at_most_the_buffer_in_memory() {
        let store = Arc::new(Broken {
            hang: true,
            entries: Mutex::new(0),
        });
        let history = History::new(
            store.clone(),
            HistoryOptions {
                max_buffered: 4,
                ..HistoryOptions::default()
            },
        );
        for round in 0..3 {
            for i in 0..100 {
                history.record(entry(&format!("{round}-{i}"), HistoryEvent::Started));
                tokio::task::yield_now().await;
            }
            tokio::time::sleep(Duration::from_secs(3)).await;
        }
        assert_eq!(
            *store.entries.lock().unwrap(),
            4,
            "only the first 4 entries were taken while their write hung"
        );
        tokio::time::sleep(Duration::from_secs(10)).await;
        history.record(entry("later", HistoryEvent::Started));
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(*store.entries.lock().unwrap(), 5, "taken again once it timed out");
    }

    /// A store that refuses or hangs never holds `record` up, and the writer goes on: a hung
    /// write ends at its timeout.
    #[tokio::test(start_paused = true)]
    async fn a_failing_or_hanging_store_never_holds_a_caller_up() {
        for hang in [false, true] {
            let store = Arc::new(Broken {
                hang,
                entries: Mutex::new(0),
            });
            let history = History::new(
                store.clone(),
                HistoryOptions {
                    max_buffered: 4,
                    ..HistoryOptions::default()
                },
            );
            let started = Instant::now();
            for i in 0..100 {
                history.record(entry(&i.to_string(), HistoryEvent::Started));
            }
            assert_eq!(started.elapsed(), Duration::ZERO, "record never waits");
            tokio::time::timeout(Duration::from_secs(60), history.flush())
                .await
                .expect("a hung write ends at its timeout");
            assert!(*store.entries.lock().unwrap() >= 4, "hang {hang}");
        }
    }
}
