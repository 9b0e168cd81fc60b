//! [`History`], the writer: entries handed to a task that gathers them and writes them in the
//! background, never holding a run up.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use leasehold_storage::StoreError;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::{
    HISTORY_DROPPED_TOTAL, HISTORY_FAILURES_TOTAL, HISTORY_WRITTEN_TOTAL, HistoryEntry, HistoryStore,
};
use crate::record::{RecordId, Scope};

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::tests::entry;
    use crate::history::{HistoryEvent, MemoryHistory, Recent, RecentQuery};
    use crate::observe::OutcomeLabel;
    use async_trait::async_trait;

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
