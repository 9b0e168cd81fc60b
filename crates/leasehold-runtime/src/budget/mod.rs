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

mod pause;
mod permit;
mod store;

pub use permit::BudgetPermit;
pub use store::{AzureBudgets, BudgetStore, MemoryBudgets, SharedPause};

use crate::flow::PerScope;
use crate::protocol::budget::{self as decide, Waits, waits};
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
    /// How long a run of the budget holds its slot here, on average (the last few runs): the
    /// pace at which slots free, for [`Budgets::limit_turn`].
    run_mean: Option<Duration>,
    /// The latest turn given to a trigger handed back for the limit, per lane (high, low).
    turns_until: [Option<Instant>; 2],
    /// When the latest runs of the budget succeeded here (the last [`SUCCESSES_KEPT`]): the
    /// pace its runs get through, pauses and refusals included.
    successes: std::collections::VecDeque<Instant>,
}

impl Budget {
    /// Deliveries waiting here for a slot that go before one of `lane`: its lane's, and for the
    /// low lane the high lane's too.
    fn ahead_of(&self, lane: Lane) -> usize {
        match lane {
            Lane::High => self.high_waiting,
            Lane::Low => self.high_waiting + self.low_waiting,
        }
    }

    /// Whether the budget's runs here are long ([`LONG_RUN`] on average).
    fn long_runs(&self) -> bool {
        self.run_mean.is_some_and(|m| m >= LONG_RUN)
    }
}

/// Runs at least this long, on average, make holders beyond one per slot of the limit wait by
/// being handed back for their turn rather than under their leases
/// ([`Budgets::limit_holds`]).
const LONG_RUN: Duration = Duration::from_secs(5);

/// How many of a budget's latest successes a worker keeps, for the pace of its turns.
const SUCCESSES_KEPT: usize = 64;

/// How far back successes count for the pace of a budget's turns.
const PACE_WINDOW: Duration = Duration::from_secs(60);

/// How many of a budget's latest refusals a worker keeps (their records and times).
const REFUSALS_KEPT: usize = 32;

/// How long before a throttled chain's refusal (beyond the pause it asks for) another record's
/// refusal must have come for the chain's to count as the downstream's.
const OTHERS_REFUSED_WITHIN: Duration = Duration::from_secs(30);

/// The furthest turn a trigger handed back for its budget's limit is given
/// ([`Budgets::limit_turn`]); one beyond it is handed back again then, if its turn has not come.
pub const MAX_LIMIT_TURN: Duration = Duration::from_secs(600);

/// The most triggers a worker remembers handing back for one budget's pause; one handed back
/// beyond them comes back at the pause's end, resumed or not.
pub const MAX_HANDED_BACK: usize = 10_000;

/// How much later than a pause's end a handed-back trigger may be hidden and still count as
/// hidden for that pause: the time between the decision and the update that hid it (a second),
/// and the rounding up to whole seconds ([`crate::protocol::budget::hidden_for`]: under a
/// second).
const RELEASE_SLACK: Duration = Duration::from_secs(2);

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

/// What held a delivery handed back at its budget's gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HeldBy {
    /// The budget's pause after a throttle: the trigger comes back once it ends.
    Pause,
    /// The budget's limit (runs at once): no slot came, and nowhere to wait without keeping a
    /// slot of the consumer. Not a pause: the trigger comes back at its turn
    /// ([`Budgets::limit_turn`]).
    Limit,
}

/// What a delivery may do, by its budget ([`Budgets::admit`]).
#[derive(Debug)]
pub enum Admission {
    /// Run: the slot is held until the permit is dropped (tell it how the run went first).
    Go(BudgetPermit),
    /// The budget is paused for `after` more (`by` the pause), or no slot of its limit came
    /// (`by` the limit: its turn is `after` away): hand the message back, hidden that long.
    Paused {
        budget: String,
        after: Duration,
        by: HeldBy,
    },
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
    /// could not, a pause hands the delivery back at once, and a wait for a slot goes on for at
    /// most [`in_slot`](Self::in_slot).
    pub park: Option<&'a (dyn Fn() -> bool + Send + Sync)>,
    /// The longest wait for a slot when [`park`](Self::park) could not free what the delivery
    /// holds (`None`: as long as it takes); then `Paused` after 1 s, so that what it holds goes
    /// to other work — a dead holder's message above all — while runs of the budget are long.
    pub in_slot: Option<Duration>,
}

impl fmt::Debug for Waiting<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Waiting")
            .field("stand_in", &self.stand_in)
            .field("slot", &self.slot)
            .field("pause", &self.pause)
            .field("park", &self.park.is_some())
            .field("in_slot", &self.in_slot)
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
    /// Told when a run of any budget gives its slot back: a consumer pacing its polls while
    /// every budget is at its limit polls now.
    freed: Notify,
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
                freed: Notify::new(),
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
            run_mean: None,
            turns_until: [None, None],
            successes: Default::default(),
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
        let waiting = Waiting {
            stand_in: !honour_pause,
            slot: max_wait,
            pause: max_wait,
            park: None,
            in_slot: None,
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
        let asker = decide::Asker {
            stand_in: waiting.stand_in,
            low: lane == Lane::Low,
            pause_deadline,
        };
        let mut counted = Counted {
            budgets: self,
            name: &name,
            lane: None,
        };
        // Parked yet (once, just before the first wait), and until when a wait in what it could
        // not free (the consumer's slot) may go on.
        let mut parked = false;
        let mut in_slot_until: Option<Instant> = None;
        let mut waited = false;
        loop {
            let notified = notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let now = Instant::now();
            let gate = self.pass_gate(&name, now, &asker, lane, &mut counted);
            self.refresh_if_stale(&name);
            let held_until = match gate {
                Gate::HandBack(after) => {
                    return Admission::Paused {
                        budget: name.clone(),
                        after,
                        by: HeldBy::Pause,
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
                        started: Instant::now(),
                    });
                }
                Gate::Wait(held_until) => held_until,
            };
            if !parked && let Some(park) = waiting.park {
                parked = true;
                match (waits(held_until.is_some(), Some(park())), held_until) {
                    (Waits::HandBack, Some(until)) => {
                        // Nowhere to wait without keeping others from work: back after the pause.
                        return Admission::Paused {
                            budget: name.clone(),
                            after: until.saturating_duration_since(Instant::now()),
                            by: HeldBy::Pause,
                        };
                    }
                    // A wait for the limit in what others may need: for a while only (and so
                    // is a pause it meets there).
                    (Waits::InSlot, _) => in_slot_until = waiting.in_slot.map(|w| now + w),
                    _ => {}
                }
            }
            waited = true;
            let until = held_until
                .or(slot_deadline)
                .unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
            let until = in_slot_until.map_or(until, |d| until.min(d));
            // Biased, so the same instants give the same choice (the simulation replays).
            tokio::select! {
                biased;
                _ = &mut notified => {}
                _ = tokio::time::sleep_until(until) => {
                    let now = Instant::now();
                    if in_slot_until.is_some_and(|d| now >= d) {
                        // Back when the pause it met ends, or at its turn for the limit.
                        let (after, by) = match held_until {
                            Some(h) => (h.saturating_duration_since(now), HeldBy::Pause),
                            None => (self.limit_turn_of(&name, lane), HeldBy::Limit),
                        };
                        tracing::info!(budget = %name, waited_s = waiting.in_slot.unwrap_or_default().as_secs_f64(),
                            back_in_s = after.as_secs_f64(),
                            "no slot of the budget came while this delivery waited in the consumer's slot (the waiting room is full): handed back, so the slot is free for other work");
                        return Admission::Paused { budget: name.clone(), after, by };
                    }
                    if held_until.is_none() && slot_deadline.is_some() {
                        let after = self.limit_turn_of(&name, lane);
                        tracing::info!(budget = %name, waited_s = waiting.slot.unwrap_or_default().as_secs_f64(),
                            back_in_s = after.as_secs_f64(),
                            "no slot of the budget came in the longest wait allowed: handed back");
                        return Admission::Paused { budget: name.clone(), after, by: HeldBy::Limit };
                    }
                }
            }
        }
    }

    /// Whether every budget the scopes draw on has all its slots taken here (its limit reached)
    /// and, with `waiting_enough`, as many deliveries as it has slots waiting for one: a
    /// consumer whose waiting room is full (or, with `waiting_enough`, any consumer) then takes
    /// no message until a slot frees (but for a paced poll, for a dead holder's message),
    /// instead of taking each only to hand it back.
    pub fn all_at_limit(&self, waiting_enough: bool) -> bool {
        self.inner.options.names.values().all(|name| {
            self.with_budget(name, |b| {
                let limit = self.limit_of(b);
                b.in_flight >= limit && (!waiting_enough || (b.ahead_of(Lane::Low) >= limit && b.long_runs()))
            })
        })
    }

    /// Completes when a run of any budget gives its slot back.
    pub async fn slot_freed(&self) {
        self.inner.freed.notified().await
    }

    /// Whether a delivery of `lane` for `scope` would wait for a slot of its budget's limit now
    /// (not for a pause: [`paused`](Self::paused) says that), and if so whether as many
    /// deliveries as the limit has slots already wait for one ahead of it (its lane's, and for
    /// the low lane the high lane's too).
    ///
    /// Only while the budget's runs are long ([`LONG_RUN`]): a holder waiting for a slot then
    /// holds its lease and its message (renewing both) for a run's time or more; short runs
    /// free a slot sooner than a trigger handed back comes round. Otherwise `(false, false)`.
    pub fn limit_holds(&self, scope: &Scope, lane: Lane) -> (bool, bool) {
        let at_limit = self.at_limit(scope, lane);
        self.with_budget(self.name_of(scope), |b| {
            let long = b.long_runs();
            (
                long && at_limit,
                long && at_limit && b.ahead_of(lane) >= self.limit_of(b),
            )
        })
    }

    /// Whether a delivery of `lane` for `scope` would wait for a slot of its budget's limit now
    /// (not for a pause: [`paused`](Self::paused) says that): every slot of the limit is taken,
    /// or the other lane goes first.
    pub fn at_limit(&self, scope: &Scope, lane: Lane) -> bool {
        let name = self.name_of(scope);
        let now = Instant::now();
        let asker = decide::Asker {
            stand_in: false,
            low: lane == Lane::Low,
            pause_deadline: None,
        };
        self.with_budget(name, |b| {
            let slots = self.slots_of(b);
            matches!(decide::gate(&slots, None, now, &asker), decide::Gate::Wait(None))
        })
    }

    /// A turn for a trigger of `lane` handed back because its budget's limit was reached: how
    /// long from now it stays hidden. Slots free about once per [`run_mean`](Budget) / limit
    /// (the pace); the deliveries waiting for one here go first, then the triggers handed back
    /// before it, one pace apart: so each trigger of a backlog waiting for the limit is handed
    /// back about once, not every few seconds (each time a lease, a fencing token and a
    /// `paused` entry), and they come back at about the rate slots free. At most
    /// [`MAX_LIMIT_TURN`] away (a trigger beyond it is handed back again then).
    pub fn limit_turn(&self, scope: &Scope, lane: Lane) -> (String, Duration) {
        let name = self.name_of(scope).to_string();
        let after = self.limit_turn_of(&name, lane);
        (name, after)
    }

    fn limit_turn_of(&self, name: &str, lane: Lane) -> Duration {
        let now = Instant::now();
        self.with_budget(name, |b| {
            let limit = self.limit_of(b).max(1) as u32;
            // Slots free about once per run's time per slot of the limit; and runs get through
            // no faster than they have lately (throttles, pauses and refusals take their share).
            // Nothing seen yet: no spread (a second).
            let by_length = b.run_mean.unwrap_or(Duration::ZERO) / limit;
            while b
                .successes
                .front()
                .is_some_and(|t| now.saturating_duration_since(*t) > PACE_WINDOW)
            {
                b.successes.pop_front();
            }
            let by_successes = match (b.successes.front(), b.successes.len()) {
                // Half the interval seen: turns lean early, so the pace can grow (a schedule at
                // the pace seen would hold the runs to it).
                (Some(first), n) if n >= 2 => now.saturating_duration_since(*first) / (2 * (n as u32 - 1)),
                _ => Duration::ZERO,
            };
            let pace = by_length.max(by_successes);
            // A slot must free first, and the deliveries waiting here have theirs before.
            let ahead = u32::try_from(b.ahead_of(lane)).unwrap_or(u32::MAX).max(1);
            let earliest = (now + pace * ahead).max(now + Duration::from_secs(1));
            let slot = &mut b.turns_until[usize::from(lane == Lane::Low)];
            let after_last = slot.filter(|t| *t > now).map(|t| t + pace);
            let turn = after_last
                .map_or(earliest, |t| t.max(earliest))
                .min(now + MAX_LIMIT_TURN);
            *slot = Some(turn);
            turn - now
        })
    }

    /// The budget's slots as its gate sees them.
    fn slots_of(&self, b: &Budget) -> decide::Slots {
        decide::Slots {
            in_flight: b.in_flight,
            limit: self.limit_of(b),
            high_waiting: b.high_waiting,
            low_waiting: b.low_waiting,
            high_run: b.high_run,
            low_every: self.inner.options.low_every,
        }
    }

    /// One pass through the budget's gate ([`decide::gate`]): a slot taken, handed back, or a
    /// wait (counted among its lane's waiting the first time).
    fn pass_gate(
        &self,
        name: &str,
        now: Instant,
        asker: &decide::Asker<Instant>,
        lane: Lane,
        counted: &mut Counted<'_>,
    ) -> Gate {
        self.with_budget(name, |b| {
            let mut slots = self.slots_of(b);
            match decide::gate(&slots, b.paused_until, now, asker) {
                decide::Gate::HandBack(until) => Gate::HandBack(until - now),
                decide::Gate::Wait(Some(until)) => Gate::Wait(Some(until)),
                decide::Gate::Go => {
                    if decide::start(&mut slots, asker) {
                        b.notify.notify_waiters();
                    }
                    b.in_flight = slots.in_flight;
                    b.high_run = slots.high_run;
                    Gate::Go(b.in_flight)
                }
                decide::Gate::Wait(None) => {
                    if counted.lane.is_none() {
                        match lane {
                            Lane::High => b.high_waiting += 1,
                            Lane::Low => b.low_waiting += 1,
                        }
                        counted.lane = Some(lane);
                    }
                    Gate::Wait(None)
                }
            }
        })
    }

    /// Runs of a budget allowed at once on this worker now.
    fn limit_of(&self, b: &Budget) -> usize {
        if self.inner.options.adaptive {
            (b.limit as usize).max(1)
        } else {
            self.inner.options.max_concurrency.max(1)
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

#[cfg(test)]
mod tests;
