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
//!   ([`Outcome::Paused`](crate::Outcome::Paused)).
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

/// Where budgets' pauses are shared between workers. Each method is one round trip (the first
/// write of a budget in a container: two or three).
#[async_trait]
pub trait BudgetStore: Send + Sync + fmt::Debug + 'static {
    /// How much longer the budget `name` is paused, as last written (`None`: not paused).
    async fn read(&self, name: &str) -> Result<Option<Duration>, StoreError>;

    /// Pauses the budget `name` for `pause` from now (replacing what was written).
    async fn write(&self, name: &str, pause: Duration) -> Result<(), StoreError>;

    /// The round-trip counters this store records into.
    fn counters(&self) -> &OpCounters;
}

/// Budgets as empty blobs `budgets/<name>` whose metadata holds the end of the pause as a wall
/// clock time (workers' clocks differ by a little; a pause is advice, see the module's docs).
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
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

#[async_trait]
impl BudgetStore for AzureBudgets {
    async fn read(&self, name: &str) -> Result<Option<Duration>, StoreError> {
        let metadata = self
            .container
            .metadata(&format!("{BUDGET_PREFIX}{name}"), Op::BudgetRead)
            .await?;
        let until = metadata
            .and_then(|m| m.get(PAUSED_UNTIL).and_then(|v| v.parse::<u64>().ok()))
            .unwrap_or(0);
        let now = unix_ms(SystemTime::now());
        Ok((until > now).then(|| Duration::from_millis(until - now)))
    }

    async fn write(&self, name: &str, pause: Duration) -> Result<(), StoreError> {
        let blob = format!("{BUDGET_PREFIX}{name}");
        let until = unix_ms(SystemTime::now() + pause);
        let metadata = HashMap::from([(PAUSED_UNTIL.to_string(), until.to_string())]);
        if self
            .container
            .set_metadata_if_present(&blob, &metadata, Op::BudgetWrite)
            .await?
            .is_some()
        {
            return Ok(());
        }
        // The budget's first pause: create its blob (and the container, the first time), then
        // write.
        self.container.put_empty_if_absent(&blob, Op::BudgetWrite).await?;
        self.container
            .set_metadata_if_present(&blob, &metadata, Op::BudgetWrite)
            .await?;
        Ok(())
    }

    fn counters(&self) -> &OpCounters {
        self.container.counters()
    }
}

/// Budgets in memory, on the runtime's clock (paused in tests and the simulation), counting
/// round trips as [`AzureBudgets`] would once its blobs exist.
#[derive(Debug, Default)]
pub struct MemoryBudgets {
    paused: Mutex<HashMap<String, Instant>>,
    counters: OpCounters,
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
        self.paused.lock().expect("budget mutex").get(name).copied()
    }
}

#[async_trait]
impl BudgetStore for MemoryBudgets {
    async fn read(&self, name: &str) -> Result<Option<Duration>, StoreError> {
        self.counters.record(Op::BudgetRead);
        let now = Instant::now();
        Ok(self
            .paused
            .lock()
            .expect("budget mutex")
            .get(name)
            .filter(|until| **until > now)
            .map(|until| *until - now))
    }

    async fn write(&self, name: &str, pause: Duration) -> Result<(), StoreError> {
        self.counters.record(Op::BudgetWrite);
        self.paused
            .lock()
            .expect("budget mutex")
            .insert(name.to_string(), Instant::now() + pause);
        Ok(())
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
    /// The longest pause one throttle sets (a longer `Retry-After` is capped, with a warning).
    /// Default 300 s: Dataverse's service-protection window.
    pub max_pause: Duration,
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
        }
    }
}

/// The name of the budget every scope draws on unless told otherwise.
pub const DEFAULT_BUDGET: &str = "default";

/// Checks a budget name: 1–63 letters, digits and `-` (it names a blob).
pub fn check_budget_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > 63 || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
        return Err(format!(
            "{name:?} is not a budget name (1-63 letters, digits and '-')"
        ));
    }
    Ok(())
}

/// One budget's state on this worker.
#[derive(Debug)]
struct Budget {
    /// When the pause this worker knows of ends.
    paused_until: Option<Instant>,
    /// The end of the last pause written or read, so a throttle that does not lengthen it is
    /// not written again.
    shared_until: Option<Instant>,
    /// The adaptive limit (runs at once), in `[1, max_concurrency]`.
    limit: f64,
    in_flight: usize,
    /// Deliveries of the high lane waiting for a slot: the low lane's wait behind them.
    high_waiting: usize,
    /// When the pause was last read, and whether a read is under way.
    read_at: Option<Instant>,
    reading: bool,
    notify: Arc<Notify>,
    throttles: u64,
    /// The concurrency the downstream last answered "too many" at: growth stops below it until
    /// [`PROBE_AFTER`] windows of successes and [`PROBE_EVERY`] have passed since.
    ceiling: Option<usize>,
    /// Successes since the last cut.
    since_cut: u64,
    /// When the limit was last cut.
    cut_at: Option<Instant>,
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
    /// The budget is paused for `after` more: hand the message back, hidden that long.
    Paused { budget: String, after: Duration },
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
}

impl Budgets {
    pub fn new(store: Arc<dyn BudgetStore>, options: BudgetOptions) -> Self {
        Self {
            inner: Arc::new(Inner {
                store,
                options,
                budgets: Mutex::new(HashMap::new()),
            }),
        }
    }

    pub fn options(&self) -> &BudgetOptions {
        &self.inner.options
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
            limit: self.inner.options.max_concurrency.max(1) as f64,
            in_flight: 0,
            high_waiting: 0,
            read_at: None,
            reading: false,
            notify: Arc::new(Notify::new()),
            throttles: 0,
            ceiling: None,
            since_cut: 0,
            cut_at: None,
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
        let name = self.name_of(scope).to_string();
        let deadline = max_wait.map(|w| Instant::now() + w);
        let notify = self.with_budget(&name, |b| b.notify.clone());
        let mut counted = HighWaiting {
            budgets: self,
            name: &name,
            counted: false,
        };
        loop {
            let notified = notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let now = Instant::now();
            // Until when the pause holds this delivery, if it does.
            let mut held_until = None;
            let decided = self.with_budget(&name, |b| {
                let paused = b.paused_until.filter(|u| honour_pause && *u > now);
                if let Some(until) = paused {
                    // Waited out when it ends within the wait allowed; else put off.
                    if deadline.is_some_and(|d| d < until) {
                        return Some(Err(until - now));
                    }
                    held_until = Some(until);
                    return None;
                }
                let limit = if self.inner.options.adaptive {
                    b.limit as usize
                } else {
                    self.inner.options.max_concurrency.max(1)
                };
                let behind_high = lane == Lane::Low && b.high_waiting > 0;
                // A delivery that may stand in for a dead holder is not held (it still counts).
                if !honour_pause || (b.in_flight < limit.max(1) && !behind_high) {
                    b.in_flight += 1;
                    return Some(Ok(b.in_flight));
                }
                if lane == Lane::High && !counted.counted {
                    b.high_waiting += 1;
                    counted.counted = true;
                }
                None
            });
            self.refresh_if_stale(&name);
            match decided {
                Some(Err(after)) => {
                    return Admission::Paused {
                        budget: name.clone(),
                        after,
                    };
                }
                Some(Ok(position)) => {
                    drop(counted);
                    return Admission::Go(BudgetPermit {
                        budgets: self.clone(),
                        name,
                        told: false,
                        position,
                    });
                }
                None => {}
            }
            let until = held_until
                .or(deadline)
                .unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
            // Biased, so the same instants give the same choice (the simulation replays).
            tokio::select! {
                biased;
                _ = &mut notified => {}
                _ = tokio::time::sleep_until(until) => {
                    if held_until.is_none() && deadline.is_some() {
                        return Admission::Paused { budget: name.clone(), after: Duration::from_secs(1) };
                    }
                }
            }
        }
    }

    /// Reads the budget's pause in the background if the last read is stale and none is under
    /// way.
    fn refresh_if_stale(&self, name: &str) {
        let every = self.inner.options.refresh_every;
        let start = self.with_budget(name, |b| {
            let stale = b.read_at.is_none_or(|at| at.elapsed() >= every);
            if stale && !b.reading {
                b.reading = true;
                true
            } else {
                false
            }
        });
        if !start {
            return;
        }
        let this = self.clone();
        let name = name.to_string();
        tokio::spawn(async move {
            let read = this.inner.store.read(&name).await;
            let now = Instant::now();
            this.with_budget(&name, |b| {
                b.reading = false;
                b.read_at = Some(now);
                match read {
                    Ok(Some(left)) => {
                        let until = now + left;
                        if b.paused_until.is_none_or(|u| u < until) {
                            tracing::info!(budget = %name, paused_for_s = left.as_secs_f64(),
                                "another worker paused this downstream budget: no run of it starts before the pause ends");
                            b.paused_until = Some(until);
                            b.notify.notify_waiters();
                        }
                        b.shared_until = b.shared_until.max(Some(until));
                    }
                    Ok(None) => {}
                    Err(e) => tracing::debug!(budget = %name, error = %e,
                        "could not read the budget's pause; reading again later"),
                }
            });
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

/// Counts a high-lane delivery among the waiting while it waits.
struct HighWaiting<'a> {
    budgets: &'a Budgets,
    name: &'a str,
    counted: bool,
}

impl Drop for HighWaiting<'_> {
    fn drop(&mut self) {
        if self.counted {
            self.budgets.with_budget(self.name, |b| {
                b.high_waiting -= 1;
                // A low-lane delivery may have waited behind this one.
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
}

impl BudgetPermit {
    pub fn budget(&self) -> &str {
        &self.name
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

    /// The downstream throttled the run and asked for `pause` (already bounded,
    /// [`Budgets::pause_for`]): pauses the budget here, cuts the limit (once per pause: to the
    /// concurrency that was refused less one, or by half), and
    /// writes the pause for the other workers if it lengthens what they know. Never fails: a
    /// write that fails is logged (they will meet the downstream's 429 themselves).
    pub async fn throttled(&mut self, pause: Duration) {
        self.told = true;
        let now = Instant::now();
        let until = now + pause;
        let write = self.budgets.with_budget(&self.name, |b| {
            b.throttles += 1;
            let was_paused = b.paused_until.is_some_and(|u| u > now);
            // This run was refused with `position` runs in flight here: fewer than that were
            // what the downstream took. Cut to that; if it is no cut (other workers share the
            // downstream), halve — once per pause. A probe's refusal (the limit back at the
            // concurrency refused before) cuts no lower than the level that has worked since:
            // a run that started after this one may have reached the downstream first, so
            // `position` can undercount. A later refusal in the same pause only lowers it to
            // what it shows.
            let shown = self.position.saturating_sub(1).max(1) as f64;
            let before = b.limit;
            if !was_paused {
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
            }
            lengthens
        });
        if write {
            let store = &self.budgets.inner.store;
            if let Err(e) = store.write(&self.name, pause).await {
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
        permits[4].throttled(Duration::from_secs(2)).await;
        assert_eq!(b.views()[0].limit, 4);
        permits[3].throttled(Duration::from_secs(2)).await;
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
        held[3].throttled(Duration::from_secs(1)).await;
        assert_eq!(b.views()[0].limit, 3);
        drop(held);
        for _ in 0..4 {
            tokio::time::sleep(Duration::from_secs(2)).await;
            let mut p = go(&b, Lane::High).await;
            p.throttled(Duration::from_secs(1)).await;
        }
        assert_eq!(b.views()[0].limit, 1);
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
        permits[3].throttled(Duration::from_secs(1)).await;
        assert_eq!(b.views()[0].limit, 3);
        drop(permits);
        tokio::time::sleep(PROBE_EVERY).await;
        for _ in 0..PROBE_AFTER * 4 + 4 {
            go(&b, Lane::High).await.succeeded();
        }
        assert_eq!(b.views()[0].limit, 4, "probing");
        let mut early = go(&b, Lane::High).await;
        let _others: Vec<_> = futures_like(&b, 3).await;
        early.throttled(Duration::from_secs(1)).await;
        assert_eq!(b.views()[0].limit, 3);
        // Refused again at the level that worked (the downstream took less since): a cut as
        // any.
        drop((early, _others));
        tokio::time::sleep(Duration::from_secs(2)).await;
        let mut p = go(&b, Lane::High).await;
        let _q = go(&b, Lane::High).await;
        p.throttled(Duration::from_secs(1)).await;
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
        held[3].throttled(Duration::from_secs(1)).await;
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
        second.throttled(Duration::from_millis(10)).await;
        assert_eq!(b.views()[0].limit, 1);
        first.succeeded();
        drop((first, second));
        let (b, _) = budgets(4);
        let mut held = futures_like(&b, 6).await;
        held[5].throttled(Duration::from_millis(10)).await;
        assert_eq!(b.views()[0].limit, 2, "halved from 4");
        // Refused at exactly one more than the limit: it shows the limit itself, no cut, so
        // halved too.
        let (b, _) = budgets(4);
        let mut held = futures_like(&b, 5).await;
        held[4].throttled(Duration::from_millis(10)).await;
        assert_eq!(b.views()[0].limit, 2, "halved from 4");
    }

    #[tokio::test(start_paused = true)]
    async fn a_paused_budget_turns_deliveries_away_until_the_pause_ends_and_shares_it() {
        let (b, store) = budgets(4);
        let mut p = go(&b, Lane::High).await;
        p.throttled(Duration::from_secs(30)).await;
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
        p.throttled(Duration::from_secs(30)).await;
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
        p1.throttled(Duration::from_secs(10)).await;
        p2.throttled(Duration::from_secs(10)).await;
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
