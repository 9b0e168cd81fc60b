//! Run history: one entry for each thing that happened to a record (a run started or ended, a
//! trigger coalesced onto a run, a wait, a run put off, a trigger held by a pause, a give-up,
//! an operator's action), written off the run's path to a store every instance shares, so
//! "what happened to record X" has an answer after the instance that ran it is gone.
//!
//! [`History`] is the writer: [`History::record`] never waits and never fails — it hands the
//! entry to a task that gathers a record's entries for a moment ([`HistoryOptions::flush_every`])
//! and writes them in one request ([`HistoryStore::append`]). A write that fails or hangs is
//! counted ([`HISTORY_FAILURES_TOTAL`]) and logged at most once a minute; entries beyond the
//! bounded buffer are dropped and counted ([`HISTORY_DROPPED_TOTAL`]). A run never waits for,
//! fails for, or repeats for its history.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use leasehold_storage::StoreError;
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
}

/// How the history writer behaves.
#[derive(Debug, Clone)]
pub struct HistoryOptions {
    /// How long a record's entries are gathered before they are written together: a run's
    /// start and end (and the triggers that coalesced onto it) cost one request when the run is
    /// shorter than this.
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
        let inner = Arc::new(Inner {
            store: store.clone(),
            options: options.clone(),
            sender,
        });
        tokio::spawn(write_loop(store, options, receiver));
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
        if self
            .inner
            .sender
            .try_send(Command::Entry(Box::new(entry)))
            .is_err()
        {
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
                write_all(&store, &options, &writes, &mut tasks, &mut pending, &mut order);
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
                write_all(&store, &options, &writes, &mut tasks, &mut pending, &mut order);
                while tasks.join_next().await.is_some() {}
                let _ = done.send(());
            }
            None => {
                write_all(&store, &options, &writes, &mut tasks, &mut pending, &mut order);
                while tasks.join_next().await.is_some() {}
                return;
            }
        }
    }
}

/// The most entries one write carries (a stored group stays well under the store's limits).
pub const MAX_ENTRIES_PER_WRITE: usize = 100;

fn write_all(
    store: &Arc<dyn HistoryStore>,
    options: &HistoryOptions,
    writes: &Arc<tokio::sync::Semaphore>,
    tasks: &mut tokio::task::JoinSet<()>,
    pending: &mut HashMap<(Scope, RecordId), Vec<HistoryEntry>>,
    order: &mut VecDeque<(Scope, RecordId)>,
) {
    while let Some(key) = order.pop_front() {
        let Some(entries) = pending.remove(&key) else {
            continue;
        };
        for chunk in entries.chunks(MAX_ENTRIES_PER_WRITE) {
            let chunk = chunk.to_vec();
            let (store, writes, timeout) = (store.clone(), writes.clone(), options.write_timeout);
            tasks.spawn(async move {
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

    /// A record's entries within the flush interval go in one write; records apart; `flush`
    /// writes at once.
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
        assert_eq!(store.appends(), 2, "one write per record");
        let all = store.all();
        assert_eq!(all.len(), 3);
        assert!(all.iter().all(|e| e.instance == "host:1"));
        history.record(entry("3", HistoryEvent::Started));
        history.flush().await;
        assert_eq!(store.appends(), 3);
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

    #[derive(Debug)]
    struct Broken {
        hang: bool,
        calls: Mutex<u64>,
    }

    #[async_trait]
    impl HistoryStore for Broken {
        async fn append(&self, _: &[HistoryEntry]) -> Result<(), StoreError> {
            *self.calls.lock().unwrap() += 1;
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
    }

    /// A store that refuses or hangs never holds `record` up, and the writer goes on: a hung
    /// write ends at its timeout.
    #[tokio::test(start_paused = true)]
    async fn a_failing_or_hanging_store_never_holds_a_caller_up() {
        for hang in [false, true] {
            let store = Arc::new(Broken {
                hang,
                calls: Mutex::new(0),
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
            assert!(*store.calls.lock().unwrap() >= 4, "hang {hang}");
        }
    }
}
