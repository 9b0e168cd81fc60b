//! Downstream budgets: the runs that write to the same downstream (usually one CRM application
//! user, whose service-protection limits are small) share a budget.
//!
//! * **A pause everyone honours.** A run whose downstream said "too many"
//!   ([`LogicError::throttled`](crate::LogicError::throttled)) pauses its budget for the time the
//!   downstream asked (`Retry-After`, capped): no run of the budget starts on this worker until
//!   then, and the pause is written to a blob (`budgets/<name>`, one write per throttle that
//!   lengthens the pause) that every other worker reads, at most once per
//!   [`BudgetOptions::refresh_every`] and only while it starts runs of the budget, in the
//!   background: a run start costs no storage request. A delivery that meets a paused budget
//!   hands its message back, hidden until the pause ends, without counting as an attempt
//!   ([`Outcome::Paused`](crate::Outcome::Paused)); standalone, a worker that learns the pause
//!   ended early (a resume) makes the messages it handed back visible again at once
//!   ([`Budgets::handed_back`]).
//! * **Concurrency that finds the downstream's limit.** Each worker starts at most `limit` runs
//!   of a budget at once: additive increase (one more after `limit` successes in a row),
//!   multiplicative decrease (halved by the first throttle of a pause), between 1 and
//!   [`BudgetOptions::max_concurrency`]. A delivery of the high lane takes a free slot before
//!   any of the low lane waiting for one.
//!
//! A pause only delays deliveries: a message handed back is the same trigger, delivered later,
//! which the protocol already allows (queues promise no order and no time). So a budget cannot
//! break an invariant of the lock; it is advice, and a worker that misses a pause (its read
//! failed, its clock is off) only meets the downstream's 429 itself, and pauses then.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use leasehold_storage::azure::BlobContainer;
use leasehold_storage::{Op, OpCounters, StorageAccount, StoreError};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::flow::PerScope;
use crate::protocol::budget::{Waits, waits};
use crate::queue::TriggerQueue;
use crate::record::Scope;

/// Prefix of budget blobs in the container.
pub const BUDGET_PREFIX: &str = "budgets/";

/// The metadata key of a budget blob holding the end of its pause, in Unix milliseconds.
const PAUSED_UNTIL: &str = "pauseduntilms";

/// Which queue a trigger came by: a person's save (`High`, the default) or bulk traffic (`Low`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum Lane {
    #[default]
    High,
    Low,
}

impl Lane {
    pub fn as_str(self) -> &'static str {
        match self {
            Lane::High => "high",
            Lane::Low => "low",
        }
    }
}

impl fmt::Display for Lane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Lane {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "high" => Ok(Lane::High),
            "low" => Ok(Lane::Low),
            other => Err(format!("unknown priority {other:?} (high or low)")),
        }
    }
}

/// A budget's pause as storage holds it ([`BudgetStore::read`]).
#[derive(Debug, Clone, PartialEq)]
pub struct SharedPause {
    /// How much longer it lasts, measured on storage's clock when the blob says when it was
    /// written (zero: over, or resumed).
    pub left: Duration,
    /// When it was set, by storage's clock where known.
    pub set_at: Option<SystemTime>,
    /// The adaptive limit the worker that set it had cut to (runs at once on that worker).
    pub limit: Option<u32>,
    /// Whether an operator ended it (`leasehold budget resume`).
    pub resumed: bool,
}

/// Where budgets' pauses are shared between workers. Each method is one round trip (the first
/// write of a budget in a container: two or three; listing: one per 5,000 budgets).
#[async_trait]
pub trait BudgetStore: Send + Sync + fmt::Debug + 'static {
    /// The budget `name`'s pause as last written (`None`: never written).
    async fn read(&self, name: &str) -> Result<Option<SharedPause>, StoreError>;

    /// Pauses the budget `name` for `pause` from now (replacing what was written), noting the
    /// limit the writer cut to.
    async fn write(&self, name: &str, pause: Duration, limit: u32) -> Result<(), StoreError>;

    /// Ends the budget `name`'s pause now (every worker stops honouring it at its next read).
    /// Says whether it was paused.
    async fn resume(&self, name: &str) -> Result<bool, StoreError>;

    /// The names of every budget ever paused in this store.
    async fn names(&self) -> Result<Vec<String>, StoreError>;

    /// The round-trip counters this store records into.
    fn counters(&self) -> &OpCounters;
}

/// Budgets as empty blobs `budgets/<name>` whose metadata holds the pause's length
/// (`pausems`), measured from the blob's `Last-Modified` and read against the `Date` of the
/// answer: both storage's clock, so no worker's clock (one running ahead, say) lengthens
/// anyone's pause. For workers of earlier versions, the end by the writer's clock
/// (`pauseduntilms`) too, which this version reads only from a blob without `pausems`.
#[derive(Debug, Clone)]
pub struct AzureBudgets {
    container: BlobContainer,
}

impl AzureBudgets {
    /// Budgets in `container` of `account`, recording round trips into `counters`.
    pub fn new(account: &StorageAccount, container: &str, counters: OpCounters) -> Self {
        Self {
            container: BlobContainer::new(account, container, counters),
        }
    }

    /// Budgets in the blob container `container` (its round trips counted as it counts them).
    pub fn in_container(container: BlobContainer) -> Self {
        Self { container }
    }

    async fn put_metadata(&self, name: &str, metadata: &HashMap<String, String>) -> Result<bool, StoreError> {
        let blob = format!("{BUDGET_PREFIX}{name}");
        Ok(self
            .container
            .set_metadata_if_present(&blob, metadata, Op::BudgetWrite)
            .await?
            .is_some())
    }
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// The metadata key of a budget blob holding the pause's length in milliseconds, from the
/// blob's last write.
const PAUSE_MS: &str = "pausems";
/// The limit its writer cut to.
const LIMIT: &str = "limit";
/// Set (to the time, Unix ms by the operator's clock) when an operator resumed the budget.
const RESUMED: &str = "resumedms";

/// What a budget blob's metadata says, read at storage's clock where it can be.
fn shared_pause(timed: &leasehold_storage::azure::TimedMetadata) -> SharedPause {
    let m = &timed.metadata;
    let number = |key: &str| m.get(key).and_then(|v| v.parse::<u64>().ok());
    let left = match (number(PAUSE_MS), timed.last_modified, timed.answered_at) {
        // Resumed (or a pause of nothing).
        (Some(0), _, _) => Duration::ZERO,
        // Storage's clock both ends. `Last-Modified` is to the second, rounded down: a second
        // is added, so a pause read never ends before the one written (the writer's own would
        // otherwise be cut short by its next read). `Date` is rounded down too, so a read in
        // the second of the write would say a second more than the pause's length: never more.
        (Some(ms), Some(written), Some(now)) => {
            (written + Duration::from_secs(1) + Duration::from_millis(ms))
                .duration_since(now)
                .unwrap_or(Duration::ZERO)
                .min(Duration::from_millis(ms))
        }
        // Written by an earlier version: the writer's clock against ours.
        _ => {
            let until = number(PAUSED_UNTIL).unwrap_or(0);
            let now = unix_ms(SystemTime::now());
            Duration::from_millis(until.saturating_sub(now))
        }
    };
    SharedPause {
        left,
        set_at: timed.last_modified,
        limit: number(LIMIT).map(|l| l.min(u32::MAX as u64) as u32),
        resumed: m.contains_key(RESUMED),
    }
}

#[async_trait]
impl BudgetStore for AzureBudgets {
    async fn read(&self, name: &str) -> Result<Option<SharedPause>, StoreError> {
        let timed = self
            .container
            .metadata_with_clock(&format!("{BUDGET_PREFIX}{name}"), Op::BudgetRead)
            .await?;
        Ok(timed.as_ref().map(shared_pause))
    }

    async fn write(&self, name: &str, pause: Duration, limit: u32) -> Result<(), StoreError> {
        let blob = format!("{BUDGET_PREFIX}{name}");
        let metadata = HashMap::from([
            (PAUSE_MS.to_string(), pause.as_millis().to_string()),
            (
                PAUSED_UNTIL.to_string(),
                unix_ms(SystemTime::now() + pause).to_string(),
            ),
            (LIMIT.to_string(), limit.to_string()),
        ]);
        if self.put_metadata(name, &metadata).await? {
            return Ok(());
        }
        // The budget's first pause: create its blob (and the container, the first time), then
        // write.
        self.container.put_empty_if_absent(&blob, Op::BudgetWrite).await?;
        self.put_metadata(name, &metadata).await?;
        Ok(())
    }

    async fn resume(&self, name: &str) -> Result<bool, StoreError> {
        let was = self.read(name).await?;
        let Some(was) = was else {
            return Ok(false);
        };
        let mut metadata = HashMap::from([
            (PAUSE_MS.to_string(), "0".to_string()),
            (PAUSED_UNTIL.to_string(), "0".to_string()),
            (RESUMED.to_string(), unix_ms(SystemTime::now()).to_string()),
        ]);
        if let Some(limit) = was.limit {
            metadata.insert(LIMIT.to_string(), limit.to_string());
        }
        self.put_metadata(name, &metadata).await?;
        Ok(!was.left.is_zero())
    }

    async fn names(&self) -> Result<Vec<String>, StoreError> {
        let mut names = Vec::new();
        let mut marker: Option<String> = None;
        loop {
            let page = match self
                .container
                .list_page(BUDGET_PREFIX, marker.as_deref(), 5000)
                .await
            {
                Ok(page) => page,
                Err(e) if e.kind() == leasehold_storage::StoreErrorKind::NotFound => return Ok(names),
                Err(e) => return Err(e),
            };
            names.extend(
                page.blobs
                    .into_iter()
                    .filter_map(|b| b.name.strip_prefix(BUDGET_PREFIX).map(str::to_string)),
            );
            match page.next_marker {
                Some(next) => marker = Some(next),
                None => return Ok(names),
            }
        }
    }

    fn counters(&self) -> &OpCounters {
        self.container.counters()
    }
}

/// Budgets in memory, on the runtime's clock (paused in tests and the simulation), counting
/// round trips as [`AzureBudgets`] would once its blobs exist.
#[derive(Debug, Default)]
pub struct MemoryBudgets {
    paused: Mutex<HashMap<String, MemoryPause>>,
    counters: OpCounters,
}

#[derive(Debug, Clone, Copy)]
struct MemoryPause {
    until: Instant,
    limit: u32,
    resumed: bool,
}

impl MemoryBudgets {
    pub fn new() -> Self {
        Self::default()
    }

    /// A store that records into the given counters.
    pub fn with_counters(counters: OpCounters) -> Self {
        Self {
            paused: Mutex::default(),
            counters,
        }
    }

    /// When the budget's pause ends, as written (for tests).
    pub fn paused_until(&self, name: &str) -> Option<Instant> {
        self.paused
            .lock()
            .expect("budget mutex")
            .get(name)
            .map(|p| p.until)
    }

    /// Writes a pause ending at `until` as another worker, or a clock running ahead, would
    /// (for tests): no cap, no limit.
    pub fn set_paused_until(&self, name: &str, until: Instant) {
        self.paused.lock().expect("budget mutex").insert(
            name.to_string(),
            MemoryPause {
                until,
                limit: 0,
                resumed: false,
            },
        );
    }
}

#[async_trait]
impl BudgetStore for MemoryBudgets {
    async fn read(&self, name: &str) -> Result<Option<SharedPause>, StoreError> {
        self.counters.record(Op::BudgetRead);
        let now = Instant::now();
        Ok(self
            .paused
            .lock()
            .expect("budget mutex")
            .get(name)
            .map(|p| SharedPause {
                left: p.until.saturating_duration_since(now),
                set_at: None,
                limit: (p.limit > 0).then_some(p.limit),
                resumed: p.resumed,
            }))
    }

    async fn write(&self, name: &str, pause: Duration, limit: u32) -> Result<(), StoreError> {
        self.counters.record(Op::BudgetWrite);
        self.paused.lock().expect("budget mutex").insert(
            name.to_string(),
            MemoryPause {
                until: Instant::now() + pause,
                limit,
                resumed: false,
            },
        );
        Ok(())
    }

    async fn resume(&self, name: &str) -> Result<bool, StoreError> {
        self.counters.record(Op::BudgetRead);
        let now = Instant::now();
        let mut paused = self.paused.lock().expect("budget mutex");
        let Some(p) = paused.get_mut(name) else {
            return Ok(false);
        };
        self.counters.record(Op::BudgetWrite);
        let was = p.until > now;
        p.until = now;
        p.resumed = true;
        Ok(was)
    }

    async fn names(&self) -> Result<Vec<String>, StoreError> {
        let mut names: Vec<String> = self
            .paused
            .lock()
            .expect("budget mutex")
            .keys()
            .cloned()
            .collect();
        names.sort();
        Ok(names)
    }

    fn counters(&self) -> &OpCounters {
        &self.counters
    }
}

/// How budgets behave.
#[derive(Debug, Clone)]
pub struct BudgetOptions {
    /// The budget each scope's runs draw on (letters, digits and `-`). Default: every scope on
    /// `default`, as a deployment's runs usually write as one application user.
    pub names: PerScope<String>,
    /// The most runs of one budget a worker starts at once, and where the adaptive limit starts.
    /// Default 8 (`LEASEHOLD_CONCURRENCY`'s default).
    pub max_concurrency: usize,
    /// Whether the limit adapts (AIMD); `false`: always `max_concurrency`. Default `true`.
    pub adaptive: bool,
    /// How often a worker starting runs of a budget reads its pause. Default 3 s.
    pub refresh_every: Duration,
    /// The pause after a throttle that gave no usable `Retry-After`. Default 10 s.
    pub default_pause: Duration,
    /// The longest pause one throttle sets, and the longest a pause read from storage is
    /// honoured (a longer one is capped, with a warning). Default 300 s: Dataverse's
    /// service-protection window.
    pub max_pause: Duration,
    /// While deliveries of both lanes wait for a slot, at least one start in this many goes to
    /// the low lane. Default 4 (as the consumer's takes, `ConsumerOptions::low_every`).
    pub low_every: u32,
}

impl Default for BudgetOptions {
    fn default() -> Self {
        Self {
            names: PerScope::new(DEFAULT_BUDGET.to_string()),
            max_concurrency: 8,
            adaptive: true,
            refresh_every: Duration::from_secs(3),
            default_pause: Duration::from_secs(10),
            max_pause: Duration::from_secs(300),
            low_every: 4,
        }
    }
}

/// The name of the budget every scope draws on unless told otherwise.
pub const DEFAULT_BUDGET: &str = "default";

/// A budget name that is not one ([`check_budget_name`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a budget name (1-63 letters, digits and '-')")]
pub struct BadBudgetName(pub String);

/// Checks a budget name: 1–63 letters, digits and `-` (it names a blob).
pub fn check_budget_name(name: &str) -> Result<(), BadBudgetName> {
    if name.is_empty() || name.len() > 63 || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
        return Err(BadBudgetName(name.to_string()));
    }
    Ok(())
}

/// One budget's state on this worker.
#[derive(Debug)]
struct Budget {
    /// When the pause this worker honours ends.
    paused_until: Option<Instant>,
    /// The end of the pause as storage last held it (written by this worker or read), so a
    /// throttle that does not lengthen it is not written again.
    shared_until: Option<Instant>,
    /// A pause of this worker's own throttle that it could not write: kept whatever storage
    /// says, as storage never heard of it.
    unshared_until: Option<Instant>,
    /// Writes of the pause started, and under way: a read that overlapped one may hold the
    /// blob from before it, and only lengthens the pause.
    writes: u64,
    writing: usize,
    /// The adaptive limit (runs at once), in `[1, max_concurrency]`.
    limit: f64,
    in_flight: usize,
    /// Deliveries of each lane waiting for a slot.
    high_waiting: usize,
    low_waiting: usize,
    /// High-lane starts since the last low-lane start, counted while the low lane waits.
    high_run: u32,
    /// When the pause was last read, and whether a read is under way.
    read_at: Option<Instant>,
    reading: bool,
    notify: Arc<Notify>,
    throttles: u64,
    /// Throttles taken as one record's refusals, not the downstream's: neither paused nor cut.
    record_refusals: u64,
    /// The latest refusals here (the record, when), the last [`REFUSALS_KEPT`] of them: a
    /// throttled chain's next refusal counts for the budget only beside another record's.
    refused: std::collections::VecDeque<(String, Instant)>,
    /// The concurrency the downstream last answered "too many" at: growth stops below it until
    /// [`PROBE_AFTER`] windows of successes and [`PROBE_EVERY`] have passed since.
    ceiling: Option<usize>,
    /// Successes since the last cut.
    since_cut: u64,
    /// When the limit was last cut.
    cut_at: Option<Instant>,
    /// Whether a pause read beyond `max_pause` was warned of (once per such pause).
    warned_cap: bool,
    /// Triggers this worker handed back for the pause, hidden until its end: made visible again
    /// when the pause ends early here ([`Budgets::handed_back`]).
    handed_back: Vec<HandedBack>,
    /// Whether a task reads the pause while triggers are handed back (no run may start to).
    watching: bool,
}

/// How many of a budget's latest refusals a worker keeps (their records and times).
const REFUSALS_KEPT: usize = 32;

/// How long before a throttled chain's refusal (beyond the pause it asks for) another record's
/// refusal must have come for the chain's to count as the downstream's.
const OTHERS_REFUSED_WITHIN: Duration = Duration::from_secs(30);

/// The most triggers a worker remembers handing back for one budget's pause; one handed back
/// beyond them comes back at the pause's end, resumed or not.
pub const MAX_HANDED_BACK: usize = 10_000;

/// How much later than a pause's end a handed-back trigger may be hidden and still count as
/// hidden for that pause (the time between the decision and the update that hid it).
const RELEASE_SLACK: Duration = Duration::from_secs(1);

/// Updates that make handed-back triggers visible again, at once.
const RELEASES_AT_ONCE: usize = 16;

/// A trigger this worker handed back for a budget's pause: its message on `queue`, hidden until
/// `until` by the update that returned `receipt`.
#[derive(Debug)]
struct HandedBack {
    queue: Arc<dyn TriggerQueue>,
    id: String,
    receipt: String,
    until: Instant,
}

/// After a cut, the limit grows back to just below the concurrency that was too many, and
/// probes beyond it only after this many windows of successes (a window: as many successes as
/// the ceiling): a probe costs a throttle and its pause, so it is rare.
const PROBE_AFTER: u64 = 30;

/// And no sooner than this after the cut: a probe costs a pause of every run of the budget (the
/// downstream's `Retry-After`), so with fast runs, probing every [`PROBE_AFTER`] windows would
/// pause the budget every few seconds.
const PROBE_EVERY: Duration = Duration::from_secs(60);

/// What a delivery may do, by its budget ([`Budgets::admit`]).
#[derive(Debug)]
pub enum Admission {
    /// Run: the slot is held until the permit is dropped (tell it how the run went first).
    Go(BudgetPermit),
    /// The budget is paused for `after` more (or, for want of a slot, try again after `after`):
    /// hand the message back, hidden that long.
    Paused { budget: String, after: Duration },
}

/// How long a delivery may wait at a budget's gate ([`Budgets::admit_with`]).
pub struct Waiting<'a> {
    /// A delivery that may stand in for a dead holder: a slot at once, beyond the limit and
    /// through any pause (its record must run again within the recovery bound).
    pub stand_in: bool,
    /// The longest wait for a slot (`None`: as long as it takes); then `Paused` after 1 s.
    pub slot: Option<Duration>,
    /// A pause that ends later than this from now hands the delivery back at once (`None`:
    /// every pause is waited out).
    pub pause: Option<Duration>,
    /// Called once, just before the delivery starts to wait: frees what the delivery holds
    /// that others need while it waits (the consumer's slot), and says whether it could. If it
    /// could not, a pause hands the delivery back at once (a wait for a slot goes on).
    pub park: Option<&'a (dyn Fn() -> bool + Send + Sync)>,
}

impl fmt::Debug for Waiting<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Waiting")
            .field("stand_in", &self.stand_in)
            .field("slot", &self.slot)
            .field("pause", &self.pause)
            .field("park", &self.park.is_some())
            .finish()
    }
}

/// This worker's view of every downstream budget, shared by its deliveries (cheap to clone).
#[derive(Clone)]
pub struct Budgets {
    inner: Arc<Inner>,
}

struct Inner {
    store: Arc<dyn BudgetStore>,
    options: BudgetOptions,
    budgets: Mutex<HashMap<String, Budget>>,
    /// Told when a pause ended early here (and the triggers handed back for it are visible
    /// again): a consumer pacing its polls through the pause polls now.
    ended_early: Notify,
}

impl fmt::Debug for Budgets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Budgets")
            .field("options", &self.inner.options)
            .finish_non_exhaustive()
    }
}

/// What a budget looks like now on this worker (for status and the metrics event).
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetView {
    pub name: String,
    /// How much longer it is paused (zero: not paused).
    pub paused_for: Duration,
    /// The adaptive limit, rounded down.
    pub limit: usize,
    pub in_flight: usize,
    /// Throttles this worker has seen.
    pub throttles: u64,
    /// Of those, the ones taken as one record's refusals (neither paused nor cut the budget).
    pub record_refusals: u64,
    /// Deliveries waiting for a slot, high lane and low lane.
    pub waiting: (usize, usize),
}

/// What the gate decided, under the budget's lock.
enum Gate {
    Go(usize),
    HandBack(Duration),
    /// Wait, until the pause ends (`Some`) or a slot frees (`None`).
    Wait(Option<Instant>),
}

impl Budgets {
    pub fn new(store: Arc<dyn BudgetStore>, options: BudgetOptions) -> Self {
        Self {
            inner: Arc::new(Inner {
                store,
                options,
                budgets: Mutex::new(HashMap::new()),
                ended_early: Notify::new(),
            }),
        }
    }

    pub fn options(&self) -> &BudgetOptions {
        &self.inner.options
    }

    /// The store the budgets' pauses are shared through.
    pub fn store(&self) -> &Arc<dyn BudgetStore> {
        &self.inner.store
    }

    /// The budget `scope`'s runs draw on.
    pub fn name_of(&self, scope: &Scope) -> &str {
        self.inner.options.names.get(scope)
    }

    /// Every budget this worker has met, as it stands now.
    pub fn views(&self) -> Vec<BudgetView> {
        let now = Instant::now();
        let budgets = self.inner.budgets.lock().expect("budgets mutex");
        let mut views: Vec<BudgetView> = budgets
            .iter()
            .map(|(name, b)| BudgetView {
                name: name.clone(),
                paused_for: b
                    .paused_until
                    .map_or(Duration::ZERO, |u| u.saturating_duration_since(now)),
                limit: b.limit as usize,
                in_flight: b.in_flight,
                throttles: b.throttles,
                record_refusals: b.record_refusals,
                waiting: (b.high_waiting, b.low_waiting),
            })
            .collect();
        views.sort_by(|a, b| a.name.cmp(&b.name));
        views
    }

    fn with_budget<T>(&self, name: &str, f: impl FnOnce(&mut Budget) -> T) -> T {
        let mut budgets = self.inner.budgets.lock().expect("budgets mutex");
        let budget = budgets.entry(name.to_string()).or_insert_with(|| Budget {
            paused_until: None,
            shared_until: None,
            unshared_until: None,
            writes: 0,
            writing: 0,
            limit: self.inner.options.max_concurrency.max(1) as f64,
            in_flight: 0,
            high_waiting: 0,
            low_waiting: 0,
            high_run: 0,
            read_at: None,
            reading: false,
            notify: Arc::new(Notify::new()),
            throttles: 0,
            record_refusals: 0,
            refused: Default::default(),
            ceiling: None,
            since_cut: 0,
            cut_at: None,
            warned_cap: false,
            handed_back: Vec::new(),
            watching: false,
        });
        f(budget)
    }

    /// The pause of `scope`'s budget, if it is paused now: its name and how much longer. Starts
    /// a background read of the pause when the last one is older than
    /// [`BudgetOptions::refresh_every`] (no request on the caller's path).
    pub fn paused(&self, scope: &Scope) -> Option<(String, Duration)> {
        let name = self.name_of(scope);
        let now = Instant::now();
        let left = self.with_budget(name, |b| b.paused_until.filter(|u| *u > now).map(|u| u - now));
        self.refresh_if_stale(name);
        left.map(|after| (name.to_string(), after))
    }

    /// How long every budget the scopes draw on stays paused, if all of them are (the shortest
    /// of their pauses): a consumer then takes no message until it ends, instead of taking each
    /// only to hand it back.
    pub fn all_paused(&self) -> Option<Duration> {
        let now = Instant::now();
        let mut left: Option<Duration> = None;
        for name in self.inner.options.names.values() {
            let this = self.with_budget(name, |b| b.paused_until.filter(|u| *u > now).map(|u| u - now))?;
            left = Some(left.map_or(this, |l| l.min(this)));
        }
        left
    }

    /// Ends the budget `name`'s pause, in storage (every worker stops honouring it at its next
    /// read, within [`BudgetOptions::refresh_every`] of its next look) and on this worker at
    /// once: the triggers it handed back for the pause are made visible again. Says whether
    /// storage held a pause.
    pub async fn resume(&self, name: &str) -> Result<bool, StoreError> {
        let was = self.inner.store.resume(name).await?;
        let handed_back = self.with_budget(name, |b| {
            b.paused_until = None;
            b.shared_until = None;
            b.unshared_until = None;
            b.notify.notify_waiters();
            std::mem::take(&mut b.handed_back)
        });
        tracing::info!(budget = %name, was_paused = was, "budget resumed: runs of it start again");
        self.release(name, handed_back);
        Ok(was)
    }

    /// Completes when a pause ends early on this worker (a resume, or a shorter pause read from
    /// storage), once the triggers handed back for it are visible again. A consumer that paces
    /// its polls while every budget is paused waits on it too.
    pub async fn pause_ended_early(&self) {
        self.inner.ended_early.notified().await
    }

    /// Notes a trigger handed back for the budget `name`'s pause: its message `id` on `queue`,
    /// hidden for `hidden` by the update that returned `receipt`. When this worker learns that
    /// the pause ended early (a resume here, or a resumed or shorter pause read from storage),
    /// the message is made visible again at once (one request) instead of at the pause's
    /// original end; if the message was taken since, the stale receipt changes nothing. While
    /// it holds such triggers the worker reads the pause every
    /// [`BudgetOptions::refresh_every`], whether or not it starts runs of the budget. A trigger
    /// hidden for no longer than that is not noted (it is back by the next read anyway), nor
    /// one beyond [`MAX_HANDED_BACK`].
    pub fn handed_back(
        &self,
        name: &str,
        queue: Arc<dyn TriggerQueue>,
        id: &str,
        receipt: String,
        hidden: Duration,
    ) {
        if hidden <= self.inner.options.refresh_every {
            return;
        }
        enum Then {
            Noted,
            Watch,
            Release(HandedBack),
        }
        let now = Instant::now();
        let entry = HandedBack {
            queue,
            id: id.to_string(),
            receipt,
            until: now + hidden,
        };
        let then = self.with_budget(name, move |b| {
            // The pause ended, or was shortened, while the trigger was being handed back: no
            // later release would see it.
            if b.paused_until.is_none_or(|u| entry.until > u + RELEASE_SLACK) {
                return Then::Release(entry);
            }
            if b.handed_back.len() >= MAX_HANDED_BACK {
                return Then::Noted;
            }
            b.handed_back.push(entry);
            if b.watching {
                Then::Noted
            } else {
                b.watching = true;
                Then::Watch
            }
        });
        match then {
            Then::Noted => {}
            Then::Watch => self.watch(name),
            Then::Release(entry) => self.release(name, vec![entry]),
        }
    }

    /// While this worker holds triggers handed back for `name`'s pause, reads the pause every
    /// refresh interval (a read it would make anyway when it starts runs is not repeated): the
    /// read that finds the pause ended early releases them.
    fn watch(&self, name: &str) {
        let this = self.clone();
        let name = name.to_string();
        // Never a busy loop, whatever the options say.
        let every = self.inner.options.refresh_every.max(Duration::from_millis(100));
        tokio::spawn(async move {
            let mut next = Instant::now();
            loop {
                // When the last read goes stale (a run start may have read since).
                tokio::time::sleep_until(next).await;
                let now = Instant::now();
                let holding = this.with_budget(&name, |b| {
                    // Those whose hiding lapsed are back on the queue by themselves.
                    b.handed_back.retain(|e| e.until > now);
                    b.watching = !b.handed_back.is_empty();
                    b.watching.then_some(b.read_at)
                });
                let Some(read_at) = holding else {
                    return;
                };
                this.refresh_if_stale(&name);
                next = match read_at {
                    Some(at) if at + every > now => at + every,
                    // Read now (or a read is under way): look again an interval on.
                    _ => now + every,
                };
            }
        });
    }

    /// Makes `entries`, handed back for `name`'s pause, visible again now (a few updates at
    /// once), then tells [`pause_ended_early`](Self::pause_ended_early).
    fn release(&self, name: &str, entries: Vec<HandedBack>) {
        if entries.is_empty() {
            self.inner.ended_early.notify_one();
            return;
        }
        let name = name.to_string();
        let this = self.clone();
        tokio::spawn(async move {
            let count = entries.len();
            let per_task = count.div_ceil(RELEASES_AT_ONCE);
            let mut tasks = tokio::task::JoinSet::new();
            let mut entries = entries.into_iter();
            loop {
                let chunk: Vec<HandedBack> = entries.by_ref().take(per_task).collect();
                if chunk.is_empty() {
                    break;
                }
                tasks.spawn(async move {
                    let mut visible = 0usize;
                    for e in chunk {
                        match e.queue.update_visibility(&e.id, &e.receipt, Duration::ZERO).await {
                            Ok(_) => visible += 1,
                            // Taken since (its hiding lapsed), or gone: it is not hidden by us.
                            Err(err) => tracing::debug!(id = %e.id, error = %err,
                                "a trigger handed back for the pause could not be made visible again; it comes back when its hiding lapses"),
                        }
                    }
                    visible
                });
            }
            let mut visible = 0;
            while let Some(done) = tasks.join_next().await {
                visible += done.unwrap_or(0);
            }
            tracing::info!(budget = %name, handed_back = count, visible,
                "the budget's pause ended early: the triggers handed back for it are visible again");
            this.inner.ended_early.notify_one();
        });
    }

    /// Whether a delivery of `lane` for `scope` may run now: a slot of its budget, waiting for
    /// one and for the budget's pause to end as long as it takes, or at most `max_wait`: then
    /// (or at once, for a pause that ends later than that) it is told to come back later
    /// (`Paused`: after the pause, or 1 s for want of a slot). With `honour_pause` false (a
    /// delivery that may stand in for a dead holder, whose record must run again within the
    /// recovery bound) it takes a slot at once, beyond the limit if need be. Starts a
    /// background read of the budget's pause when the last one is older than
    /// [`BudgetOptions::refresh_every`].
    pub async fn admit(
        &self,
        scope: &Scope,
        lane: Lane,
        max_wait: Option<Duration>,
        honour_pause: bool,
    ) -> Admission {
        let waiting = Waiting {
            stand_in: !honour_pause,
            slot: max_wait,
            pause: max_wait,
            park: None,
        };
        self.admit_with(scope, lane, waiting).await
    }

    /// [`admit`](Self::admit), with the waits bounded separately ([`Waiting`]).
    ///
    /// While both lanes wait for a slot, a low-lane delivery takes every
    /// [`BudgetOptions::low_every`]-th start; otherwise the high lane goes first.
    pub async fn admit_with(&self, scope: &Scope, lane: Lane, waiting: Waiting<'_>) -> Admission {
        let name = self.name_of(scope).to_string();
        let started = Instant::now();
        let slot_deadline = waiting.slot.map(|w| started + w);
        let pause_deadline = waiting.pause.map(|w| started + w);
        let notify = self.with_budget(&name, |b| b.notify.clone());
        let limit_of = |b: &Budget| {
            if self.inner.options.adaptive {
                (b.limit as usize).max(1)
            } else {
                self.inner.options.max_concurrency.max(1)
            }
        };
        let low_every = self.inner.options.low_every;
        let mut counted = Counted {
            budgets: self,
            name: &name,
            lane: None,
        };
        let mut parked = false;
        let mut waited = false;
        loop {
            let notified = notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let now = Instant::now();
            let gate = self.with_budget(&name, |b| {
                if let Some(until) = b.paused_until.filter(|u| !waiting.stand_in && *u > now) {
                    // Waited out when it ends within the wait allowed; else handed back.
                    if pause_deadline.is_some_and(|d| d < until) {
                        return Gate::HandBack(until - now);
                    }
                    return Gate::Wait(Some(until));
                }
                // While both lanes wait, every `low_every`-th start is the low lane's.
                let low_due = low_every > 0 && b.high_run + 1 >= low_every;
                let behind_high = lane == Lane::Low && b.high_waiting > 0 && !low_due;
                let yields_to_low = lane == Lane::High && b.low_waiting > 0 && low_due;
                // A delivery that may stand in for a dead holder is not held (it still counts).
                if waiting.stand_in || (b.in_flight < limit_of(b) && !behind_high && !yields_to_low) {
                    b.in_flight += 1;
                    if !waiting.stand_in {
                        match lane {
                            Lane::Low => {
                                b.high_run = 0;
                                // A high-lane delivery may have yielded to this one.
                                b.notify.notify_waiters();
                            }
                            Lane::High if b.low_waiting > 0 => b.high_run = b.high_run.saturating_add(1),
                            Lane::High => b.high_run = 0,
                        }
                    }
                    return Gate::Go(b.in_flight);
                }
                if counted.lane.is_none() {
                    match lane {
                        Lane::High => b.high_waiting += 1,
                        Lane::Low => b.low_waiting += 1,
                    }
                    counted.lane = Some(lane);
                }
                Gate::Wait(None)
            });
            self.refresh_if_stale(&name);
            let held_until = match gate {
                Gate::HandBack(after) => {
                    return Admission::Paused {
                        budget: name.clone(),
                        after,
                    };
                }
                Gate::Go(position) => {
                    drop(counted);
                    return Admission::Go(BudgetPermit {
                        budgets: self.clone(),
                        name,
                        told: false,
                        position,
                        waited,
                    });
                }
                Gate::Wait(held_until) => held_until,
            };
            if !parked && let Some(park) = waiting.park {
                parked = true;
                if let (Waits::HandBack, Some(until)) =
                    (waits(held_until.is_some(), Some(park())), held_until)
                {
                    // Nowhere to wait without keeping others from work: back after the pause.
                    return Admission::Paused {
                        budget: name.clone(),
                        after: until.saturating_duration_since(Instant::now()),
                    };
                }
            }
            waited = true;
            let until = held_until
                .or(slot_deadline)
                .unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
            // Biased, so the same instants give the same choice (the simulation replays).
            tokio::select! {
                biased;
                _ = &mut notified => {}
                _ = tokio::time::sleep_until(until) => {
                    if held_until.is_none() && slot_deadline.is_some() {
                        return Admission::Paused { budget: name.clone(), after: Duration::from_secs(1) };
                    }
                }
            }
        }
    }

    /// Reads the budget's pause in the background if the last read is stale and none is under
    /// way. What storage holds replaces what this worker knew (so a pause shortened or resumed
    /// there ends here too), capped at [`BudgetOptions::max_pause`], except that a read that
    /// overlapped one of this worker's writes only lengthens it, and a pause of its own that it
    /// could not write stays.
    fn refresh_if_stale(&self, name: &str) {
        let every = self.inner.options.refresh_every;
        let start = self.with_budget(name, |b| {
            let stale = b.read_at.is_none_or(|at| at.elapsed() >= every);
            if stale && !b.reading {
                b.reading = true;
                Some(b.writes)
            } else {
                None
            }
        });
        let Some(writes_before) = start else {
            return;
        };
        let this = self.clone();
        let name = name.to_string();
        tokio::spawn(async move {
            let read = this.inner.store.read(&name).await;
            let now = Instant::now();
            let max = this.inner.options.max_pause;
            let released = this.with_budget(&name, |b| {
                b.reading = false;
                b.read_at = Some(now);
                let shared = match read {
                    Ok(shared) => shared,
                    Err(e) => {
                        tracing::debug!(budget = %name, error = %e, "could not read the budget's pause; reading again later");
                        return None;
                    }
                };
                let left = shared.as_ref().map_or(Duration::ZERO, |s| s.left);
                if left > max {
                    if !b.warned_cap {
                        tracing::warn!(budget = %name, stored_s = left.as_secs_f64(), honoured_s = max.as_secs_f64(),
                            "the budget's stored pause is longer than LEASEHOLD_MAX_THROTTLE_PAUSE_SECONDS (a writer whose clock runs ahead, or a deployment with a larger cap): capped");
                        b.warned_cap = true;
                    }
                } else {
                    b.warned_cap = false;
                }
                let read_until = (!left.is_zero()).then(|| now + left.min(max));
                let mine = b.unshared_until.filter(|u| *u > now);
                let until = read_until.max(mine);
                let overlapped = b.writes != writes_before || b.writing > 0;
                let before = b.paused_until.filter(|u| *u > now);
                if overlapped {
                    if until > before {
                        b.paused_until = until;
                    }
                } else {
                    b.paused_until = until;
                    b.shared_until = read_until;
                }
                let after = b.paused_until.filter(|u| *u > now);
                let mut released = None;
                if after > before {
                    tracing::info!(budget = %name, paused_for_s = left.min(max).as_secs_f64(),
                        "another worker paused this downstream budget: no run of it starts before the pause ends");
                } else if after < before {
                    let resumed = shared.as_ref().is_some_and(|s| s.resumed);
                    tracing::info!(budget = %name, paused_for_s = after.map_or(0.0, |u| (u - now).as_secs_f64()), resumed,
                        "the budget's pause was shortened or ended in storage: runs of it start sooner");
                    // Triggers hidden past the pause's new end come back now (those still
                    // within a pause meet it and are handed back for its rest).
                    let end = after.unwrap_or(now) + RELEASE_SLACK;
                    let (late, kept) = std::mem::take(&mut b.handed_back)
                        .into_iter()
                        .partition(|e| e.until > end);
                    b.handed_back = kept;
                    released = Some(late);
                }
                if after != before {
                    b.notify.notify_waiters();
                }
                released
            });
            if let Some(released) = released {
                this.release(&name, released);
            }
        });
    }

    /// The pause a throttle that asked for `asked` sets: the default when it gave none, capped
    /// to the longest (with a warning naming the record: the delivery's span).
    pub fn pause_for(&self, asked: Option<Duration>) -> Duration {
        let options = &self.inner.options;
        match asked {
            None => {
                tracing::warn!(
                    pause_s = options.default_pause.as_secs_f64(),
                    "the downstream throttled without a usable Retry-After: pausing its budget for the default"
                );
                options.default_pause
            }
            Some(a) if a > options.max_pause => {
                tracing::warn!(
                    asked_s = a.as_secs_f64(),
                    pause_s = options.max_pause.as_secs_f64(),
                    "the downstream asked for a longer pause than the longest allowed: capped"
                );
                options.max_pause
            }
            Some(a) => a,
        }
    }
}

/// Counts a delivery among its lane's waiting while it waits.
struct Counted<'a> {
    budgets: &'a Budgets,
    name: &'a str,
    lane: Option<Lane>,
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        if let Some(lane) = self.lane {
            self.budgets.with_budget(self.name, |b| {
                match lane {
                    Lane::High => b.high_waiting -= 1,
                    Lane::Low => b.low_waiting -= 1,
                }
                // A delivery of the other lane may have waited behind this one.
                b.notify.notify_waiters();
            });
        }
    }
}

/// A slot of a budget, held while a delivery runs; freed when dropped.
#[derive(Debug)]
pub struct BudgetPermit {
    budgets: Budgets,
    name: String,
    told: bool,
    /// Runs of the budget in flight on this worker when this one started, itself included.
    position: usize,
    /// Whether the delivery had to wait for it.
    waited: bool,
}

impl BudgetPermit {
    pub fn budget(&self) -> &str {
        &self.name
    }

    /// Whether the delivery waited for this slot (for a pause, or for the limit).
    pub fn waited(&self) -> bool {
        self.waited
    }

    /// The run succeeded: the limit grows by one per `limit` successes, up to just below the
    /// concurrency the downstream last refused, and beyond it only after [`PROBE_AFTER`] windows
    /// of successes and [`PROBE_EVERY`] since the cut.
    pub fn succeeded(&mut self) {
        if std::mem::replace(&mut self.told, true) {
            return;
        }
        let max = self.budgets.inner.options.max_concurrency.max(1) as f64;
        self.budgets.with_budget(&self.name, |b| {
            b.since_cut += 1;
            let cap = match b.ceiling {
                Some(c)
                    if b.since_cut < PROBE_AFTER * c as u64
                        || b.cut_at.is_some_and(|at| at.elapsed() < PROBE_EVERY) =>
                {
                    (c.saturating_sub(1).max(1) as f64).min(max)
                }
                _ => max,
            };
            if b.limit < cap {
                b.limit = (b.limit + 1.0 / b.limit).min(cap);
            }
        });
    }

    /// The downstream throttled the run of `record` and asked for `pause` (already bounded,
    /// [`Budgets::pause_for`]): pauses the budget here, cuts the limit (once per pause: to the
    /// concurrency that was refused less one, or by half), and writes the pause for the other
    /// workers if it lengthens what they know. Never fails: a write that fails is logged (they
    /// will meet the downstream's 429 themselves).
    ///
    /// Not every refusal is the downstream's. `again` says the run was itself put off by a
    /// throttle before (a record's chain of deferrals, refused once more). Such a refusal counts
    /// for the budget only when another record was refused too within the pause asked for and
    /// the [`OTHERS_REFUSED_WITHIN`] before it (a throttled downstream refuses many records: a
    /// bulk import's chains are most of its refusals, and what its limit must learn from);
    /// alone, it is one record's refusal (a lock on that record, a validation that answers
    /// 429): counted, but the budget is neither paused nor cut, and the record comes back when
    /// it was asked to. Nor does a refusal with no other run of the budget in flight here cut
    /// the limit: it shows nothing of the concurrency the downstream takes (the pause still
    /// holds).
    pub async fn throttled(&mut self, record: &str, pause: Duration, again: bool) {
        self.told = true;
        let now = Instant::now();
        let until = now + pause;
        let write = self.budgets.with_budget(&self.name, |b| {
            b.throttles += 1;
            let within = pause + OTHERS_REFUSED_WITHIN;
            let others = b
                .refused
                .iter()
                .any(|(r, at)| r != record && now.saturating_duration_since(*at) <= within);
            if b.refused.len() == REFUSALS_KEPT {
                b.refused.pop_front();
            }
            b.refused.push_back((record.to_string(), now));
            if again && !others {
                b.record_refusals += 1;
                tracing::info!(budget = %self.name, record,
                    "a record put off by a throttle was refused again, and no other record was: one record's refusal, the budget is neither paused nor cut (the record runs later)");
                return None;
            }
            let was_paused = b.paused_until.is_some_and(|u| u > now);
            // This run was refused with `position` runs in flight here: fewer than that were
            // what the downstream took. Cut to that; if it is no cut (other workers share the
            // downstream), halve — once per pause. A probe's refusal (the limit back at the
            // concurrency refused before) cuts no lower than the level that has worked since:
            // a run that started after this one may have reached the downstream first, so
            // `position` can undercount. A later refusal in the same pause only lowers it to
            // what it shows. A refusal with nothing else in flight shows nothing.
            let shown = self.position.saturating_sub(1).max(1) as f64;
            let before = b.limit;
            // Nothing else of the budget in flight here now (this run's slot is still held).
            if b.in_flight <= 1 {
                tracing::info!(budget = %self.name, limit = b.limit as u64, pause_s = pause.as_secs_f64(),
                    "the downstream throttled the only run in flight here: budget paused, the limit kept");
            } else if !was_paused {
                let worked = match b.ceiling {
                    Some(c) if b.limit as usize >= c => c.saturating_sub(1).max(1) as f64,
                    _ => 1.0,
                };
                b.limit = if shown < b.limit { shown } else { (b.limit / 2.0).max(1.0) }.max(worked);
                b.since_cut = 0;
                b.cut_at = Some(now);
                b.ceiling = Some(b.limit as usize + 1);
                tracing::info!(budget = %self.name, limit_before = before as u64, limit = b.limit as u64,
                    pause_s = pause.as_secs_f64(), "the downstream throttled a run: budget paused, fewer runs at once");
            } else if shown < b.limit {
                b.limit = shown;
                b.ceiling = Some(b.limit as usize + 1);
            }
            if b.paused_until.is_none_or(|u| u < until) {
                b.paused_until = Some(until);
                b.notify.notify_waiters();
            }
            // Written when it lengthens the shared pause by a second or more.
            let lengthens = b.shared_until.is_none_or(|s| until > s + Duration::from_secs(1));
            if lengthens {
                b.shared_until = Some(until);
                b.writes += 1;
                b.writing += 1;
            }
            lengthens.then_some(b.limit as u32)
        });
        if let Some(limit) = write {
            let store = &self.budgets.inner.store;
            let written = store.write(&self.name, pause, limit).await;
            self.budgets.with_budget(&self.name, |b| {
                b.writing -= 1;
                if written.is_err() {
                    b.unshared_until = b.unshared_until.max(Some(until));
                }
            });
            if let Err(e) = written {
                tracing::warn!(budget = %self.name, error = %e,
                    "could not share the budget's pause; other workers learn of the throttle when they meet it");
            }
        }
    }
}

impl Drop for BudgetPermit {
    fn drop(&mut self) {
        self.budgets.with_budget(&self.name, |b| {
            b.in_flight -= 1;
            b.notify.notify_waiters();
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scope(s: &str) -> Scope {
        Scope::parse(s).unwrap()
    }

    /// A pause read in the second it was written (both `Last-Modified` and `Date` to the
    /// second) never says more than its length; a second later it says what is left of it,
    /// never less than the writer's own clock would.
    #[test]
    fn a_pause_read_says_no_more_than_its_length_nor_less_than_is_left() {
        let at = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let timed = |answered: u64| leasehold_storage::azure::TimedMetadata {
            metadata: HashMap::from([(PAUSE_MS.to_string(), "300000".to_string())]),
            last_modified: Some(at),
            answered_at: Some(at + Duration::from_secs(answered)),
        };
        assert_eq!(shared_pause(&timed(0)).left, Duration::from_secs(300));
        assert_eq!(shared_pause(&timed(1)).left, Duration::from_secs(300));
        assert_eq!(shared_pause(&timed(2)).left, Duration::from_secs(299));
        assert_eq!(shared_pause(&timed(400)).left, Duration::ZERO);
    }

    fn budgets(max: usize) -> (Budgets, Arc<MemoryBudgets>) {
        let store = Arc::new(MemoryBudgets::new());
        let options = BudgetOptions {
            max_concurrency: max,
            ..BudgetOptions::default()
        };
        (Budgets::new(store.clone(), options), store)
    }

    async fn go(b: &Budgets, lane: Lane) -> BudgetPermit {
        match b.admit(&scope("account"), lane, None, true).await {
            Admission::Go(p) => p,
            other => panic!("expected a slot, got {other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_throttle_cuts_to_the_concurrency_the_downstream_took_and_growth_stops_below_it() {
        let (b, _) = budgets(8);
        let mut permits = Vec::new();
        for _ in 0..8 {
            permits.push(go(&b, Lane::High).await);
        }
        // The downstream takes 3 at once: the 5th and then the 4th come back refused, in one
        // pause. The first cuts to 4, the second shows 3 was the most.
        permits[4].throttled("r", Duration::from_secs(2), false).await;
        assert_eq!(b.views()[0].limit, 4);
        permits[3].throttled("r", Duration::from_secs(2), false).await;
        assert_eq!(b.views()[0].limit, 3);
        drop(permits);
        tokio::time::sleep(Duration::from_secs(3)).await;
        // Successes do not take it back over the concurrency that was refused…
        for _ in 0..PROBE_AFTER * 4 - 1 {
            go(&b, Lane::High).await.succeeded();
        }
        assert_eq!(b.views()[0].limit, 3);
        // …until enough windows and enough time have passed: then it probes beyond.
        for _ in 0..5 {
            go(&b, Lane::High).await.succeeded();
        }
        assert_eq!(b.views()[0].limit, 3, "windows enough, but 3 s since the cut");
        tokio::time::sleep(PROBE_EVERY).await;
        for _ in 0..5 {
            go(&b, Lane::High).await.succeeded();
        }
        assert_eq!(b.views()[0].limit, 4);
        // A refusal at 4 in flight shows 3 was the most; refusals go on lowering it, never
        // below 1.
        let mut held = Vec::new();
        for _ in 0..4 {
            held.push(go(&b, Lane::High).await);
        }
        held[3].throttled("r", Duration::from_secs(1), false).await;
        assert_eq!(b.views()[0].limit, 3);
        drop(held);
        for _ in 0..4 {
            tokio::time::sleep(Duration::from_secs(2)).await;
            let _first = go(&b, Lane::High).await;
            let mut p = futures_like(&b, 1).await.remove(0);
            p.throttled("r", Duration::from_secs(1), false).await;
        }
        assert_eq!(b.views()[0].limit, 1);
        // A refusal with nothing else in flight shows nothing of the downstream's concurrency:
        // it pauses, but does not cut.
        let (b, _) = budgets(4);
        let mut p = go(&b, Lane::High).await;
        p.throttled("r", Duration::from_secs(1), false).await;
        assert_eq!(
            (b.views()[0].limit, b.views()[0].paused_for),
            (4, Duration::from_secs(1))
        );
    }

    /// A probe beyond the level that worked, refused, goes back to that level even when the run
    /// refused started early (a later one reached the downstream first, so its position shows
    /// less than the downstream took). Without the floor it would cut to 1 here, and stay below
    /// what works until the next probe.
    #[tokio::test(start_paused = true)]
    async fn a_refused_probe_goes_back_to_the_level_that_worked() {
        let (b, _) = budgets(8);
        let mut permits = Vec::new();
        for _ in 0..4 {
            permits.push(go(&b, Lane::High).await);
        }
        permits[3].throttled("r", Duration::from_secs(1), false).await;
        assert_eq!(b.views()[0].limit, 3);
        drop(permits);
        tokio::time::sleep(PROBE_EVERY).await;
        for _ in 0..PROBE_AFTER * 4 + 4 {
            go(&b, Lane::High).await.succeeded();
        }
        assert_eq!(b.views()[0].limit, 4, "probing");
        let mut early = go(&b, Lane::High).await;
        let _others: Vec<_> = futures_like(&b, 3).await;
        early.throttled("r", Duration::from_secs(1), false).await;
        assert_eq!(b.views()[0].limit, 3);
        // Refused again at the level that worked (the downstream took less since): a cut as
        // any.
        drop((early, _others));
        tokio::time::sleep(Duration::from_secs(2)).await;
        let _p = go(&b, Lane::High).await;
        let mut q = go(&b, Lane::High).await;
        q.throttled("r", Duration::from_secs(1), false).await;
        assert_eq!(b.views()[0].limit, 1);
    }

    /// The probe begins at the success that completes its windows, not one later (the limit is
    /// read unrounded: growth is by a fraction per success).
    #[tokio::test(start_paused = true)]
    async fn growth_beyond_the_refused_level_begins_when_its_windows_are_complete() {
        let (b, _) = budgets(8);
        let mut held = Vec::new();
        for _ in 0..4 {
            held.push(go(&b, Lane::High).await);
        }
        held[3].throttled("r", Duration::from_secs(1), false).await;
        drop(held);
        tokio::time::sleep(PROBE_EVERY).await;
        let limit = |b: &Budgets| b.with_budget(DEFAULT_BUDGET, |x| x.limit);
        for _ in 0..PROBE_AFTER * 4 - 1 {
            go(&b, Lane::High).await.succeeded();
        }
        assert_eq!(limit(&b), 3.0);
        go(&b, Lane::High).await.succeeded();
        assert!(limit(&b) > 3.0, "{}", limit(&b));
    }

    /// `n` slots taken as carriers take them (beyond the limit).
    async fn futures_like(b: &Budgets, n: usize) -> Vec<BudgetPermit> {
        let mut v = Vec::new();
        for _ in 0..n {
            match b.admit(&scope("account"), Lane::High, None, false).await {
                Admission::Go(p) => v.push(p),
                other => panic!("{other:?}"),
            }
        }
        v
    }

    #[tokio::test(start_paused = true)]
    async fn a_refusal_that_shows_no_lower_concurrency_halves_the_limit() {
        let (b, _) = budgets(8);
        // Another worker fills the downstream: this one's second run is refused, at 2 in flight,
        // with its limit at 8: cut to 1 (what it shows). With the limit at 4 and the refusal at
        // 6 (carriers beyond the limit): halved.
        let mut first = go(&b, Lane::High).await;
        let mut second = go(&b, Lane::High).await;
        second.throttled("r", Duration::from_millis(10), false).await;
        assert_eq!(b.views()[0].limit, 1);
        first.succeeded();
        drop((first, second));
        let (b, _) = budgets(4);
        let mut held = futures_like(&b, 6).await;
        held[5].throttled("r", Duration::from_millis(10), false).await;
        assert_eq!(b.views()[0].limit, 2, "halved from 4");
        // Refused at exactly one more than the limit: it shows the limit itself, no cut, so
        // halved too.
        let (b, _) = budgets(4);
        let mut held = futures_like(&b, 5).await;
        held[4].throttled("r", Duration::from_millis(10), false).await;
        assert_eq!(b.views()[0].limit, 2, "halved from 4");
    }

    #[tokio::test(start_paused = true)]
    async fn a_paused_budget_turns_deliveries_away_until_the_pause_ends_and_shares_it() {
        let (b, store) = budgets(4);
        let mut p = go(&b, Lane::High).await;
        p.throttled("r", Duration::from_secs(30), false).await;
        drop(p);
        // Before the lock: turned away for the rest of the pause, whatever the scope.
        assert_eq!(
            b.paused(&scope("contact")),
            Some((DEFAULT_BUDGET.to_string(), Duration::from_secs(30)))
        );
        // A holder with a bounded wait (Functions) is put off by a pause that outlasts it…
        match b
            .admit(&scope("contact"), Lane::Low, Some(Duration::from_secs(20)), true)
            .await
        {
            Admission::Paused { budget, after } => {
                assert_eq!(budget, DEFAULT_BUDGET);
                assert_eq!(after, Duration::from_secs(30));
            }
            other => panic!("{other:?}"),
        }
        // …a carrier is not (nor by the limit: it takes a slot beyond it)…
        let mut held = Vec::new();
        for _ in 0..5 {
            match b
                .admit(
                    &scope("contact"),
                    Lane::High,
                    Some(Duration::from_secs(20)),
                    false,
                )
                .await
            {
                Admission::Go(p) => held.push(p),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(b.views()[0].in_flight, 5);
        drop(held);
        // …and one without a bound (standalone) waits it out, under its lease.
        let started = Instant::now();
        assert!(matches!(
            b.admit(&scope("contact"), Lane::High, None, true).await,
            Admission::Go(_)
        ));
        assert_eq!(started.elapsed(), Duration::from_secs(30));
        assert!(store.paused_until(DEFAULT_BUDGET).is_some());

        // Another worker on the same store learns of a pause at its first look's read.
        let mut p = go(&b, Lane::High).await;
        p.throttled("r", Duration::from_secs(30), false).await;
        drop(p);
        let other = Budgets::new(store.clone(), BudgetOptions::default());
        assert_eq!(
            other.paused(&scope("account")),
            None,
            "the first look does not wait for the read"
        );
        tokio::task::yield_now().await;
        let (_, after) = other.paused(&scope("account")).expect("paused once read");
        assert!(after > Duration::from_secs(25), "{after:?}");
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert_eq!(other.paused(&scope("account")), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_throttle_that_does_not_lengthen_the_pause_is_not_written_again() {
        let (b, store) = budgets(4);
        let mut p1 = go(&b, Lane::High).await;
        let mut p2 = go(&b, Lane::High).await;
        p1.throttled("r", Duration::from_secs(10), false).await;
        p2.throttled("r", Duration::from_secs(10), false).await;
        assert_eq!(store.counters().snapshot().get(Op::BudgetWrite), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn the_high_lane_takes_a_free_slot_before_the_low_lane() {
        let (b, _) = budgets(1);
        let held = go(&b, Lane::Low).await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let low = {
            let (b, order) = (b.clone(), order.clone());
            tokio::spawn(async move {
                let _p = go(&b, Lane::Low).await;
                order.lock().unwrap().push("low");
                tokio::time::sleep(Duration::from_secs(1)).await;
            })
        };
        tokio::time::sleep(Duration::from_millis(10)).await;
        let high = {
            let (b, order) = (b.clone(), order.clone());
            tokio::spawn(async move {
                let _p = go(&b, Lane::High).await;
                order.lock().unwrap().push("high");
                tokio::time::sleep(Duration::from_secs(1)).await;
            })
        };
        tokio::time::sleep(Duration::from_millis(10)).await;
        drop(held);
        high.await.unwrap();
        low.await.unwrap();
        assert_eq!(*order.lock().unwrap(), ["high", "low"]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_bounded_wait_for_a_slot_comes_back_soon() {
        let (b, _) = budgets(1);
        let _held = go(&b, Lane::High).await;
        match b
            .admit(&scope("a"), Lane::High, Some(Duration::from_secs(5)), true)
            .await
        {
            Admission::Paused { after, .. } => assert_eq!(after, Duration::from_secs(1)),
            other => panic!("{other:?}"),
        }
    }

    /// A record put off by a throttle and refused again (its chain's next hop) is one record's
    /// refusal: counted, but neither pause nor cut, so its chain of `Retry-After: 1` hops does
    /// not hold the budget's limit down while it lasts (issue 35, item 2).
    #[tokio::test(start_paused = true)]
    async fn a_throttled_records_chain_is_one_throttle_for_its_budget() {
        let (b, store) = budgets(4);
        let other = go(&b, Lane::High).await;
        let mut first = go(&b, Lane::High).await;
        first.throttled("chain", Duration::from_secs(1), false).await;
        drop((first, other));
        assert_eq!(b.views()[0].limit, 1, "the first refusal, at 2 in flight, cuts");
        let writes = store.counters().snapshot().get(Op::BudgetWrite);
        tokio::time::sleep(Duration::from_secs(2)).await;
        for _ in 0..20 {
            let mut hop = go(&b, Lane::High).await;
            hop.throttled("chain", Duration::from_secs(1), true).await;
            drop(hop);
            let view = &b.views()[0];
            assert_eq!(view.paused_for, Duration::ZERO, "a hop does not pause the budget");
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        assert_eq!(
            store.counters().snapshot().get(Op::BudgetWrite),
            writes,
            "nor writes a pause"
        );
        assert_eq!(b.views()[0].record_refusals, 20);
        // So the limit grows back with the budget's successes, as if the chain were not there.
        tokio::time::sleep(PROBE_EVERY).await;
        for _ in 0..PROBE_AFTER * 2 + 10 {
            go(&b, Lane::High).await.succeeded();
        }
        assert!(b.views()[0].limit >= 2, "{:?}", b.views());
    }

    /// A throttled chain's refusal beside another record's (a throttled downstream refuses
    /// many: a bulk import's chains) counts for the budget: it pauses it and, with others in
    /// flight, cuts. Another record's refusal counts while within the pause asked and 30 s.
    #[tokio::test(start_paused = true)]
    async fn a_chains_refusal_beside_another_records_is_the_downstreams() {
        let (b, _) = budgets(8);
        let mut a = go(&b, Lane::High).await;
        a.throttled("a", Duration::from_secs(2), true).await;
        drop(a);
        assert_eq!(b.views()[0].record_refusals, 1, "alone: a record's refusal");
        tokio::time::sleep(Duration::from_secs(10)).await;
        let held = futures_like(&b, 3).await;
        let mut c = go(&b, Lane::High).await;
        c.throttled("c", Duration::from_secs(2), true).await;
        let view = b.views()[0].clone();
        assert_eq!(
            view.record_refusals, 1,
            "beside a's refusal 10 s before: {view:?}"
        );
        assert!(view.paused_for > Duration::ZERO, "{view:?}");
        assert_eq!(view.limit, 3, "cut to what was in flight before it: {view:?}");
        drop((c, held));
        // The same record again, 40 s on: others' refusals are too old to count beside it.
        tokio::time::sleep(Duration::from_secs(40)).await;
        let mut c = go(&b, Lane::High).await;
        c.throttled("c", Duration::from_secs(2), true).await;
        assert_eq!(b.views()[0].record_refusals, 2, "{:?}", b.views());
    }

    /// A pause read from storage is capped at the longest allowed, and what storage holds
    /// replaces what the worker knew: a shorter pause there shortens it, none ends it (issue
    /// 35, item 3).
    #[tokio::test(start_paused = true)]
    async fn a_pause_read_is_capped_and_follows_storage_down() {
        let store = Arc::new(MemoryBudgets::new());
        let options = BudgetOptions {
            refresh_every: Duration::from_secs(1),
            ..BudgetOptions::default()
        };
        let b = Budgets::new(store.clone(), options);
        let s = scope("account");
        // Two days ahead, as a writer whose clock runs ahead would leave it.
        store.set_paused_until(DEFAULT_BUDGET, Instant::now() + Duration::from_secs(2 * 86_400));
        assert_eq!(b.paused(&s), None, "the first look does not wait for the read");
        tokio::task::yield_now().await;
        let (_, left) = b.paused(&s).expect("paused once read");
        assert_eq!(left, Duration::from_secs(300), "capped at max_pause");
        // Shortened in storage: shorter here at the next read.
        store.set_paused_until(DEFAULT_BUDGET, Instant::now() + Duration::from_secs(20));
        tokio::time::sleep(Duration::from_secs(1)).await;
        b.paused(&s);
        tokio::task::yield_now().await;
        let (_, left) = b.paused(&s).expect("still paused");
        assert!(left <= Duration::from_secs(20), "{left:?}");
        // Resumed by an operator (another process): over here at the next read, and a waiting
        // delivery goes at once.
        let waiter = {
            let b = b.clone();
            tokio::spawn(async move { b.admit(&scope("account"), Lane::High, None, true).await })
        };
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(!waiter.is_finished());
        assert!(store.resume(DEFAULT_BUDGET).await.unwrap());
        tokio::time::sleep(Duration::from_secs(1)).await;
        b.paused(&s);
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(waiter.is_finished(), "resumed: the waiting delivery is admitted");
        assert_eq!(b.paused(&s), None);
    }

    /// A pause of this worker's own whose write failed is kept whatever storage says; one that
    /// was written follows storage (a resume ends it).
    #[tokio::test(start_paused = true)]
    async fn an_own_pause_storage_never_heard_of_stays() {
        #[derive(Debug, Default)]
        struct Refusing(OpCounters);
        #[async_trait]
        impl BudgetStore for Refusing {
            async fn read(&self, _: &str) -> Result<Option<SharedPause>, StoreError> {
                Ok(None)
            }
            async fn write(&self, _: &str, _: Duration, _: u32) -> Result<(), StoreError> {
                Err(StoreError::new(
                    leasehold_storage::StoreErrorKind::Transient,
                    Op::BudgetWrite,
                    "refused",
                ))
            }
            async fn resume(&self, _: &str) -> Result<bool, StoreError> {
                Ok(false)
            }
            async fn names(&self) -> Result<Vec<String>, StoreError> {
                Ok(Vec::new())
            }
            fn counters(&self) -> &OpCounters {
                &self.0
            }
        }
        let options = BudgetOptions {
            refresh_every: Duration::from_secs(1),
            ..BudgetOptions::default()
        };
        let b = Budgets::new(Arc::new(Refusing::default()), options);
        let mut p = go(&b, Lane::High).await;
        p.throttled("r", Duration::from_secs(30), false).await;
        drop(p);
        tokio::time::sleep(Duration::from_secs(2)).await;
        b.paused(&scope("account"));
        tokio::task::yield_now().await;
        let (_, left) = b.paused(&scope("account")).expect("kept");
        assert_eq!(left, Duration::from_secs(28));
        // Resumed here: over, whatever it was.
        b.resume(DEFAULT_BUDGET).await.unwrap();
        assert_eq!(b.paused(&scope("account")), None);
    }

    /// A slot taken at once was not waited for; one taken after a wait was (the runner takes
    /// the marker once more only then: issue 35, item 4).
    #[tokio::test(start_paused = true)]
    async fn a_permit_says_whether_its_delivery_waited() {
        let (b, _) = budgets(1);
        let first = go(&b, Lane::High).await;
        assert!(!first.waited());
        tokio::time::sleep(Duration::from_secs(1)).await;
        let second = {
            let b = b.clone();
            tokio::spawn(async move { go(&b, Lane::High).await })
        };
        tokio::time::sleep(Duration::from_millis(10)).await;
        drop(first);
        assert!(second.await.unwrap().waited());
    }

    /// While both lanes wait for a budget's slots, every `low_every`-th start is the low lane's
    /// (issue 35, item 5): with the limit at 1, a long high-lane backlog cannot hold the low
    /// lane's holders (on their records' leases) for its whole length.
    #[tokio::test(start_paused = true)]
    async fn while_both_lanes_wait_every_fourth_start_is_the_low_lanes() {
        let (b, _) = budgets(1);
        let held = go(&b, Lane::High).await;
        let order = Arc::new(Mutex::new(String::new()));
        let mut tasks = Vec::new();
        for (i, lane) in std::iter::repeat_n(Lane::Low, 3)
            .chain(std::iter::repeat_n(Lane::High, 12))
            .enumerate()
        {
            let (b, order) = (b.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(i as u64)).await;
                let _p = go(&b, lane).await;
                order
                    .lock()
                    .unwrap()
                    .push(if lane == Lane::High { 'H' } else { 'L' });
                tokio::time::sleep(Duration::from_secs(1)).await;
            }));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(held);
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), "HHHLHHHLHHHLHHH");
    }

    /// A delivery about to wait at the gate is asked to park (give its consumer slot back);
    /// when it cannot, a pause hands it back at once, while a wait for the limit goes on.
    #[tokio::test(start_paused = true)]
    async fn a_delivery_parks_before_it_waits_and_one_that_cannot_is_handed_back_from_a_pause() {
        let (b, _) = budgets(1);
        let parks = std::sync::atomic::AtomicUsize::new(0);
        let mut p = go(&b, Lane::High).await;
        p.throttled("r", Duration::from_secs(20), false).await;
        drop(p);
        // No seat: handed back for the rest of the pause.
        let no_seat = || {
            parks.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            false
        };
        let waiting = Waiting {
            stand_in: false,
            slot: None,
            pause: Some(Duration::from_secs(30)),
            park: Some(&no_seat),
        };
        match b.admit_with(&scope("a"), Lane::High, waiting).await {
            Admission::Paused { after, .. } => assert_eq!(after, Duration::from_secs(20)),
            other => panic!("{other:?}"),
        }
        assert_eq!(parks.load(std::sync::atomic::Ordering::SeqCst), 1);
        // A seat: waits the pause out, parked, and its permit says it waited.
        let seat = || {
            parks.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            true
        };
        let waiting = Waiting {
            stand_in: false,
            slot: None,
            pause: Some(Duration::from_secs(30)),
            park: Some(&seat),
        };
        let started = Instant::now();
        match b.admit_with(&scope("a"), Lane::High, waiting).await {
            Admission::Go(p) => assert!(p.waited()),
            other => panic!("{other:?}"),
        }
        assert_eq!(started.elapsed(), Duration::from_secs(20));
        assert_eq!(parks.load(std::sync::atomic::Ordering::SeqCst), 2);
        // A pause longer than the wait allowed: handed back without parking.
        let mut p = go(&b, Lane::High).await;
        p.throttled("r", Duration::from_secs(120), false).await;
        drop(p);
        let waiting = Waiting {
            stand_in: false,
            slot: None,
            pause: Some(Duration::from_secs(30)),
            park: Some(&seat),
        };
        assert!(matches!(
            b.admit_with(&scope("a"), Lane::High, waiting).await,
            Admission::Paused { .. }
        ));
        assert_eq!(parks.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    #[test]
    fn pauses_are_bounded() {
        let (b, _) = budgets(1);
        assert_eq!(b.pause_for(None), Duration::from_secs(10));
        assert_eq!(
            b.pause_for(Some(Duration::from_secs(10 * 365 * 86_400))),
            Duration::from_secs(300)
        );
        assert_eq!(b.pause_for(Some(Duration::from_secs(7))), Duration::from_secs(7));
    }
}
