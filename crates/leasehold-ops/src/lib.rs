#![doc = include_str!("../README.md")]

mod budgets;
pub mod cli;
pub mod clock;
mod history;
mod overview;
mod poison;
pub mod text;
pub mod wiring;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::Result;
use leasehold_lock::RetryOptions;
use leasehold_runtime::{
    Lane, MarkerStore, RecordId, Scope, TriggerMessage, TriggerQueue, record_key, record_status,
};
use leasehold_storage::OpCounters;
use leasehold_storage::azure::BlobContainer;
use serde::Serialize;

pub use budgets::BudgetStatus;
pub use history::{
    DEFAULT_RUNS_LIMIT, HistoryView, MAX_HISTORY_LIMIT, MAX_RUNS_LIMIT, RecordState, RunList, RunQuery,
    RunView, parse_window, run_outcomes,
};
pub use overview::{HeldRecord, Overview, OverviewQuery, QueueView, RecordRef};
pub use poison::{
    PoisonEntry, PoisonList, PoisonQuery, PoisonRecord, PoisonSelection, Progress, PurgeReport,
    RequeueReport, Requeued, SCAN_HIDE, SCAN_HOLD_MAX, Skipped,
};

use crate::wiring::{StorageSettings, wire};

/// Why an operation could not be done. [`status`](Self::status) is the HTTP status the admin API
/// answers with; the text names the problem (and never a secret).
#[derive(Debug, thiserror::Error)]
pub enum OpsError {
    /// The request names something that is not there (a poison entry id, say).
    #[error("{0}")]
    NotFound(String),
    /// The request itself is wrong (a selection that selects nothing, a bad filter).
    #[error("{0}")]
    BadRequest(String),
    /// Storage refused or did not answer (after retries).
    #[error("storage: {0}")]
    Storage(String),
    /// The operator was told to stop (Ctrl-C) and did, putting back what it held.
    #[error("{0}")]
    Interrupted(String),
}

impl OpsError {
    /// The HTTP status for this error: 404, 400 or 503 (an interruption, which only the
    /// command line asks for, is 503 too).
    pub fn status(&self) -> u16 {
        match self {
            OpsError::NotFound(_) => 404,
            OpsError::BadRequest(_) => 400,
            OpsError::Storage(_) | OpsError::Interrupted(_) => 503,
        }
    }

    fn storage(what: &str, e: impl std::fmt::Display) -> Self {
        OpsError::Storage(format!("{what}: {e}"))
    }
}

/// A lane's trigger queue and poison queue.
type LaneQueues = (Arc<dyn TriggerQueue>, Arc<dyn TriggerQueue>);
type LaneRefs<'a> = (&'a Arc<dyn TriggerQueue>, &'a Arc<dyn TriggerQueue>);

/// Operations on one deployment's storage: its trigger queue, poison queue and container.
/// Cheap to clone.
#[derive(Clone)]
pub struct Operator {
    inner: Arc<Inner>,
}

#[derive(Clone)]
struct Inner {
    queue: Arc<dyn TriggerQueue>,
    poison: Arc<dyn TriggerQueue>,
    /// The other lane's queue and poison queue: the low lane's for an operator of the high
    /// lane (the default), the high lane's for one of the low lane ([`Operator::lane`]).
    other: Option<LaneQueues>,
    /// Which lane `queue` and `poison` are.
    lane: Lane,
    lock: leasehold_lock::LeaseLock,
    markers: Arc<dyn MarkerStore>,
    container: BlobContainer,
    counters: OpCounters,
    lease_seconds: u64,
    /// How long a poison scan hides an entry it holds at a time (it hides it again before that
    /// ends; the entries come back on their own within this if the scan dies).
    scan_hide: Duration,
    /// Most entries a poison scan holds at once.
    scan_hold_max: usize,
    /// Told to stop: a poison scan puts back what it holds and ends (the command line's Ctrl-C).
    interrupt: Option<tokio_util::sync::CancellationToken>,
    retry: RetryOptions,
    /// Held by a poison scan while it runs (shared by clones: scans take turns).
    scans: Arc<tokio::sync::Mutex<()>>,
    /// The deployment's run history and how long it is kept (`None`: history is off).
    history: Option<(Arc<dyn leasehold_runtime::HistoryStore>, Duration)>,
}

impl std::fmt::Debug for Operator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Operator")
            .field("queue", &self.inner.queue.name())
            .field("poison", &self.inner.poison.name())
            .field("container", &self.inner.container.name())
            .finish_non_exhaustive()
    }
}

/// The record a command names.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RecordView {
    pub scope: Scope,
    pub record_id: RecordId,
    pub held: bool,
    /// The lease state as storage reports it (`None`: the record never ran).
    pub lease_state: Option<String>,
    /// Who was granted the lease last (the fenced grant's holder).
    pub holder: Option<String>,
    /// When the last fenced grant was made.
    #[serde(serialize_with = "clock::serialize_opt")]
    pub since: Option<SystemTime>,
    pub since_age_seconds: Option<f64>,
    /// The last fencing token granted (0: none yet).
    pub generation: u64,
    pub retrigger_pending: bool,
    /// Whether triggers wait for the record's burst to end (`LEASEHOLD_DEBOUNCE_SECONDS`).
    pub waiting: bool,
    pub sharers: Vec<String>,
    /// Runs of the record stopped in a row by newer triggers (`LEASEHOLD_RUN_POLICY=supersede`),
    /// and the run time they cost, in seconds; `None` when the last run was not stopped.
    pub superseded_in_a_row: Option<(u32, f64)>,
    #[serde(serialize_with = "clock::serialize")]
    pub at: SystemTime,
}

impl Operator {
    /// Operations on the storage `settings` name.
    pub fn new(settings: &StorageSettings) -> Result<Self> {
        let wiring = wire(settings)?;
        let low = (wiring.low_queue.clone(), wiring.low_poison.clone());
        Ok(Self::from_parts(
            wiring.queue,
            wiring.poison,
            wiring.lock,
            wiring.markers,
            BlobContainer::new(&settings.account, &settings.container, wiring.counters.clone()),
            wiring.counters,
        )
        .with(|inner| inner.other = Some(low))
        .with_history(wiring.history.map(|store| {
            let keep = settings.history.as_ref().map_or(Duration::ZERO, |h| h.keep);
            (store, keep)
        })))
    }

    /// The same operator, reading and writing run history in `history` (a store and how long
    /// history is kept), or with history off (`None`).
    pub fn with_history(self, history: Option<(Arc<dyn leasehold_runtime::HistoryStore>, Duration)>) -> Self {
        self.with(|inner| inner.history = history)
    }

    /// The same operator, for `lane`'s queue and poison queue (its poison tools, its
    /// enqueue): the low lane's, or back to the high lane's. The overview shows both either way.
    pub fn lane(self, lane: Lane) -> Self {
        if lane == self.inner.lane {
            return self;
        }
        self.with(|inner| {
            if let Some((queue, poison)) = inner.other.take() {
                let here = (
                    std::mem::replace(&mut inner.queue, queue),
                    std::mem::replace(&mut inner.poison, poison),
                );
                inner.other = Some(here);
                inner.lane = lane;
            }
        })
    }

    /// The lane this operator's queue and poison queue are.
    pub fn lane_of(&self) -> Lane {
        self.inner.lane
    }

    /// The low lane's queue and poison queue, when the operator knows them.
    fn low_lane(&self) -> Option<LaneRefs<'_>> {
        match self.inner.lane {
            Lane::Low => Some((&self.inner.queue, &self.inner.poison)),
            Lane::High => self.inner.other.as_ref().map(|(q, p)| (q, p)),
        }
    }

    /// The high lane's queue and poison queue.
    fn high_lane(&self) -> LaneRefs<'_> {
        match (self.inner.lane, &self.inner.other) {
            (Lane::Low, Some((q, p))) => (q, p),
            _ => (&self.inner.queue, &self.inner.poison),
        }
    }

    /// Operations over these parts (tests wrap the queues to make steps fail).
    pub fn from_parts(
        queue: Arc<dyn TriggerQueue>,
        poison: Arc<dyn TriggerQueue>,
        lock: leasehold_lock::LeaseLock,
        markers: Arc<dyn MarkerStore>,
        container: BlobContainer,
        counters: OpCounters,
    ) -> Self {
        let lease_seconds = u64::from(lock.options().duration.secs());
        Self {
            inner: Arc::new(Inner {
                queue,
                poison,
                other: None,
                lane: Lane::High,
                lock,
                markers,
                container,
                counters,
                lease_seconds,
                scan_hide: poison::SCAN_HIDE,
                scan_hold_max: poison::SCAN_HOLD_MAX,
                interrupt: None,
                retry: RetryOptions::default(),
                scans: Arc::default(),
                history: None,
            }),
        }
    }

    /// The same operator, hiding each poison entry a scan holds for `hide` at a time (30 s
    /// unless set; tests shorten it).
    pub fn with_scan_hide(self, hide: Duration) -> Self {
        self.with(|inner| inner.scan_hide = hide)
    }

    /// The same operator, its poison scans holding at most `most` entries at once
    /// ([`SCAN_HOLD_MAX`] unless set; tests lower it).
    pub fn with_scan_hold_max(self, most: usize) -> Self {
        self.with(|inner| inner.scan_hold_max = most.max(1))
    }

    /// The same operator, its poison scans stopping when `interrupt` is cancelled: a scan then
    /// stops taking entries, puts back what it holds and ends (a requeue or purge reports what it
    /// did, `interrupted`; a listing or `show` answers [`OpsError::Interrupted`]). A requeue
    /// stops between entries, never between putting an entry's trigger and removing it.
    pub fn with_interrupt(self, interrupt: tokio_util::sync::CancellationToken) -> Self {
        self.with(|inner| inner.interrupt = Some(interrupt))
    }

    fn with(self, change: impl FnOnce(&mut Inner)) -> Self {
        let mut inner = (*self.inner).clone();
        change(&mut inner);
        Self {
            inner: Arc::new(inner),
        }
    }

    /// Storage round trips this operator has made so far (all kinds).
    pub fn requests(&self) -> u64 {
        self.inner.counters.snapshot().total()
    }

    /// The trigger queue's name.
    pub fn queue_name(&self) -> &str {
        self.inner.queue.name()
    }

    /// The poison queue's name.
    pub fn poison_name(&self) -> &str {
        self.inner.poison.name()
    }

    /// The trigger queue's (or with `poison`, the poison queue's) depth and oldest message.
    pub async fn queue_view_of(&self, poison: bool) -> Result<QueueView, OpsError> {
        let queue = if poison {
            &self.inner.poison
        } else {
            &self.inner.queue
        };
        self.queue_view(&**queue).await
    }

    /// Puts a trigger for a record on the queue, as Start would.
    pub async fn enqueue(&self, scope: &Scope, record_id: &RecordId) -> Result<TriggerMessage, OpsError> {
        let mut message = TriggerMessage::new(scope.clone(), record_id.clone());
        // A trace of its own, under the caller's when it names one (`TRACEPARENT`, as W3C's
        // environment carrier does), as Start makes for each trigger.
        let parent = std::env::var("TRACEPARENT").ok().and_then(|t| {
            leasehold_runtime::trace::TraceContext::parse(&t, std::env::var("TRACESTATE").ok().as_deref())
        });
        let span = leasehold_runtime::trace::send(self.queue_name(), &mut message, parent.as_ref());
        let body = message.encode();
        let put = self
            .inner
            .retry
            .run("enqueue", || self.inner.queue.put(&body, Duration::ZERO))
            .await;
        if put.is_err() {
            span.fail("not enqueued");
        }
        drop(span);
        put.map_err(|e| OpsError::storage("enqueue", e))?;
        let trace_id = message.trace().map(|t| t.trace_id_hex()).unwrap_or_default();
        tracing::info!(%scope, record = %record_id, queue = self.queue_name(), %trace_id, "enqueued a trigger");
        let mut entry = leasehold_runtime::HistoryEntry::new(
            scope.clone(),
            record_id.clone(),
            leasehold_runtime::HistoryEvent::Enqueued,
        )
        .with_reason(format!("on {}", self.queue_name()));
        entry.instance = "leasehold enqueue".into();
        // Its lane, so the record's state names the queue it waits in.
        entry.lane = Some(self.lane_of().as_str().to_string());
        self.note_entry(entry).await;
        Ok(message)
    }

    /// A record's lease (held, holder, since, fencing generation) and whether a retrigger is
    /// pending: two round trips.
    pub async fn record(&self, scope: &Scope, record_id: &RecordId) -> Result<RecordView, OpsError> {
        let status = record_status(&self.inner.lock, &*self.inner.markers, scope, record_id)
            .await
            .map_err(|e| OpsError::storage("record status", e))?;
        let now = SystemTime::now();
        let info = status.lock;
        Ok(RecordView {
            scope: scope.clone(),
            record_id: record_id.clone(),
            held: info.held,
            lease_state: info.state.map(|s| format!("{s:?}").to_lowercase()),
            holder: info.holder,
            since: info.since,
            since_age_seconds: info.since.map(|s| clock::age_seconds(s, now)),
            generation: info.generation,
            retrigger_pending: status.retrigger_pending,
            waiting: status.waiting,
            sharers: info.sharers,
            superseded_in_a_row: info
                .notes
                .get(leasehold_runtime::SUPERSEDED_NOTE)
                .map(String::as_str)
                .and_then(leasehold_runtime::superseded_streak)
                .map(|(runs, lost)| (runs, lost.as_secs_f64())),
            at: now,
        })
    }

    /// Breaks a record's lease: its run is told at its next renewal and stops; the record is
    /// free once that run released it or its lease would have expired, or at once with `now`
    /// (only for a holder known to be dead). Returns what was done, in words.
    pub async fn break_lease(
        &self,
        scope: &Scope,
        record_id: &RecordId,
        reason: &str,
        now: bool,
    ) -> Result<String, OpsError> {
        let key = record_key(scope, record_id);
        let lock = &self.inner.lock;
        let said = if now {
            lock.break_lock_after(&key, reason, Duration::ZERO)
                .await
                .map_err(|e| OpsError::storage("break lease", e))?;
            format!("broke the lease on {key} ({reason}); the record is free now")
        } else {
            lock.break_lock(&key, reason)
                .await
                .map_err(|e| OpsError::storage("break lease", e))?;
            format!(
                "broke the lease on {key} ({reason}); its run is told at its next renewal, and the record is free \
                 once that run released it or the lease would have expired (at most {} s)",
                self.inner.lease_seconds
            )
        };
        self.note(
            scope,
            record_id,
            leasehold_runtime::HistoryEvent::Broken,
            "leasehold break",
            Some(reason),
        )
        .await;
        Ok(said)
    }
}
