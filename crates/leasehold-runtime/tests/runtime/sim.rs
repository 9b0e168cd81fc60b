//! Deterministic, seeded simulation of the coalescing protocol.
//!
//! The real runner, consumer, lock and watchdog code runs on paused tokio time against the
//! in-memory lease store and queue, each machine seeing storage through a fault injector. A seed
//! decides the workload and every fault; `LEASEHOLD_SIM_SEED=N` replays one.
//!
//! Fault model (see `FaultCounts` for how often each happens):
//! - storage answers slowly, fails transiently before or after taking effect;
//! - a machine loses storage for 15–60 s (a partition, longer than a lease): every call gets no
//!   answer within the client time-out (10 s), and half of them still take effect up to 4 s after
//!   the client gave up (late landings: acquires, marker deletes, renewals, queue gets...);
//! - a worker process dies at any instant (its logic dies with it, within the supervisor's 1 s);
//!   in Functions mode either the custom handler alone dies, or the whole host instance, whose
//!   in-flight messages stay hidden for 10 minutes;
//! - a worker is shut down gracefully (in-flight runs finish or are handed back) and restarts;
//! - the Functions host lets a message's visibility lapse while its invocation still runs, so the
//!   message is delivered again to another host while its first holder is alive;
//! - an operator breaks a lease under a live run;
//! - storage's clock runs up to 10 % fast against the workers' (leases expire early);
//! - the queue hands out visible messages in a seeded random order, not oldest first (half the
//!   seeds, fault-free ones too: Azure promises no order, so the protocol must need none);
//! - logic fails, panics, runs past its time limit, or is slow to stop (beyond its grace);
//! - a record's logic keeps failing for a while, so triggers reach the poison limit (5);
//! - faults aimed at one step of the protocol ([`Aim`]: the contended path's second acquire, a new
//!   holder's clear of its own marker and a holder's check after its release included): a request
//!   that lands late, after its caller gave up and others looked; a request that took effect and
//!   whose answer is lost (its retry may find its own effect), its retries sometimes failing too, so
//!   a step that took effect answers with an error (a granted acquire); a request seconds slow to
//!   land or to answer.
//! - in faulty seeds whose supersede record's runs fail or ask to run later, faults aimed at the
//!   two steps that decide whether a retry or a deferral may stand down for a later run (issue
//!   35): the note of a run that pends is refused, every retry failing ([`Fault::Refuse`]), or
//!   lands with its answer lost; a deferral's take of the marker lands late, loses its answer
//!   after taking one, or is slow (there the record's runs ask to run later early, and stop
//!   asking just before its stream's last but one trigger).
//!
//! Invariants checked on every seed: (1) no two runs of a record overlap and fencing tokens rise
//! in run order; (2) every accepted trigger is followed by a completed run that started after it,
//! unless it was given up visibly (in the poison queue); (3) in fault-free seeds, triggers that
//! arrived before a run started cause at most one run after it; (4) a record whose holder died
//! runs again within the recovery bound; (5) a run never outlives its time limit plus its stop
//! grace, and a run whose lease was broken is stopped and not acknowledged.
//!
//! Supersede ([`SupersedePlan`], a quarter of the seeds): a record in a scope of its own that
//! supersedes, with a stream of triggers during long runs. A run is superseded when it is told to
//! stop in the instant a watch found its marker set. (S1, fault-free) an unprotected run is told
//! by a marker's creation + the renewal interval + 1 s and stops within its grace; (S2,
//! fault-free) fewer than 3 superseded runs in a row precede a superseded run, costing less than
//! the run time limit; (S3) a superseded run is not completed, and (1) holds for it without the
//! exception for logic that ignores cancellation (its lease is kept until it has ended).
//! In half the supersede seeds (fault-free too) the record's runs in its window fail 30-50 % of
//! the time, and in half of those it is the throttled record as well: retries and deferrals that
//! carry `afterToken` meet supersedes, stand-downs and chains given up (then sweeps).
//!
//! Long pauses ([`LongPausePlan`], 40 % of the budget seeds): the real consumer with 1-3 slots
//! and its waiting room, a budget paused for 60-300 s, debounce waiters or a backlog meeting the
//! pause, and a holder that dies while it holds, whose record must run again within the
//! recovery bound (4) through the pause.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use leasehold_lock::memory::MemoryStore;
use leasehold_lock::{
    LeaseDuration, LeaseLock, LeaseOptions, LeaseStore, LockKey, Op, OpCounters, RetryOptions, StoreError,
    StoreErrorKind, StoreResult,
};
use leasehold_runtime::testing::{Effect, FaultyMarkers, FaultyQueue, FaultyStore, Interceptor};
use leasehold_runtime::{
    BudgetOptions, BudgetStore, Budgets, Consumer, ConsumerOptions, Delivery, Enqueued, Logic, LogicError,
    MarkerSet, MarkerStore, MemoryBudgets, MemoryMarkers, MemoryQueue, Outcome, PerScope, PoisonMessage,
    ProtocolVariant, Received, RecordRunner, RunContext, RunPolicy, RunnerOptions, Scope, TriggerKind,
    TriggerMessage, TriggerQueue, WaitConsumed,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Standalone,
    FunctionsHost,
}

/// A fault at an instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Fault {
    /// The worker process dies (standalone: the daemon; Functions: the custom handler only).
    Crash { machine: usize, restart_after: Duration },
    /// Functions: the whole host instance dies, handler included; its messages stay hidden.
    HostDeath { machine: usize, restart_after: Duration },
    /// The worker is stopped gracefully (SIGTERM) and started again.
    Shutdown { machine: usize, restart_after: Duration },
    /// The machine cannot reach storage for a while.
    Partition { machine: usize, length: Duration },
    /// An operator breaks a record's lease.
    Break { record: usize },
    /// The machine's next request of kind `op` takes effect and its answer is lost: the
    /// caller retries after its late window and may find its own effect ("already exists",
    /// "not found"). Aimed at each retried step, so every retry path is reached.
    LoseAnswer { machine: usize, op: Op },
    /// Every request of kind `op` from the machine fails (503) for `length`: long enough that
    /// a step's retries all fail (a release that fails, a marker that cannot be read...).
    FailOp {
        machine: usize,
        op: Op,
        length: Duration,
    },
    /// The worker (Functions: the handler, or with `host_death` the whole host) dies right
    /// after its next request of kind `op` took effect, before the answer reaches it: a crash
    /// aimed at one await point of the protocol.
    CrashAfter {
        machine: usize,
        op: Op,
        host_death: bool,
        restart_after: Duration,
    },
    /// The machine's next request at `aim` gets no answer within the client's time-out and takes
    /// effect `late` after it was sent (10–14 s: after its caller gave up, before the retry, which
    /// waits the late window): others may have looked in between, and the retry finds its effect.
    LandLate {
        machine: usize,
        aim: Aim,
        late: Duration,
    },
    /// The machine's next request at `aim` that changes something (an acquire granted, a marker
    /// created or removed) takes effect and its answer is lost: the retry may find its own effect. With `failing_for`, requests of that kind from the
    /// machine then fail (503) that long, so every retry fails and a step that took effect answers
    /// with an error (a granted acquire, say).
    LoseChange {
        machine: usize,
        aim: Aim,
        failing_for: Duration,
    },
    /// The machine's next request at `aim` is slow, inside the client's time-out: it takes
    /// `to_land` to take effect, or takes effect at once and its answer takes `to_answer` (one of
    /// them 1–9 s). Others act in the window: a holder releases and looks before a contender's
    /// marker lands, or a trigger finds the lease held while a new holder clears its marker.
    Slow {
        machine: usize,
        aim: Aim,
        to_land: Duration,
        to_answer: Duration,
    },
    /// `after_pause` after the first pause of the budget began (nothing if none began within
    /// [`LONG_PAUSE_WAIT`] of this fault's instant), the worker holding a run of `record` dies
    /// (under Functions: with `host_death`, its whole host), or, when none does, the first that
    /// holds a run of any record but [`LONG_PAUSE_THROTTLED`]; nobody if no run is in progress
    /// ([`LongPausePlan`]).
    CrashHolder {
        record: usize,
        after_pause: Duration,
        host_death: bool,
        restart_after: Duration,
    },
    /// The machine's next request at `aim` is refused (503) without taking effect, and so is
    /// every request of that kind from the machine for `failing_for`: every retry fails (a note
    /// that cannot be written).
    Refuse {
        machine: usize,
        aim: Aim,
        failing_for: Duration,
    },
}

/// A step of the marker protocol, for faults aimed at it: a kind of request, and where one kind
/// plays two parts, which part, told by the worker's previous lock or marker request on the
/// record. (Every retried kind of request, whatever its part, already gets lost answers and
/// outages aimed at it: [`Fault::LoseAnswer`], [`Fault::FailOp`]. These are the parts that decide
/// who reads a marker, several of them rare: aimed at by kind alone, they would seldom be hit.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Aim {
    /// A contender's second acquire: an acquire right after its marker put.
    SecondAcquire,
    /// A marker put (only contenders set markers).
    MarkerPut,
    /// A new holder's clear of its own marker before its run (a contender that won its second
    /// acquire, a sweep): a marker delete right after an acquire.
    OwnMarkerClear,
    /// A holder's check of the marker after its release: a marker delete right after a release.
    HolderCheck,
    /// Debounce: a wait marker's create (a trigger's first step, path A).
    WaitCreate,
    /// Debounce: a waiter's consume of the wait marker, right after its look (path B).
    WaitConsume,
    /// Debounce: a stand-in's consume of the wait marker, not after a look (path C: a
    /// redelivery's, a sweep's, a watchdog's first request on the record).
    StandInConsume,
    /// Supersede: the note of a holder whose run pends (it failed with a retry coming, or asked
    /// to run later): a lock blob metadata write after such a run ended. Its retry or deferral
    /// may carry the run's token (`afterToken`) only if this write lands.
    PendingNote,
    /// Run later: a deferral's take of the marker after its release: a marker delete right after
    /// a release, by a worker whose latest run of the record asked to run later. A take that
    /// lands late may consume a marker set during a later run; a retried one may have taken a
    /// marker whatever its retry answers.
    DeferralTake,
}

/// Every step a fault can be aimed at, in the order of the per-step counts.
const AIMS: [Aim; 9] = [
    Aim::SecondAcquire,
    Aim::MarkerPut,
    Aim::OwnMarkerClear,
    Aim::HolderCheck,
    Aim::WaitCreate,
    Aim::WaitConsume,
    Aim::StandInConsume,
    Aim::PendingNote,
    Aim::DeferralTake,
];

/// The steps of the coalescing protocol, drawn in every faulty seed (the first four [`AIMS`]:
/// the draw of earlier versions, kept so every seed keeps its plan).
const MARKER_AIMS: usize = 4;

/// Debounce's steps, drawn in faulty debounce seeds ([`AIMS`] from [`MARKER_AIMS`] to here).
const DEBOUNCE_AIMS_END: usize = 7;

/// How a worker's latest run of a record ended, for the steps told by it ([`Aim::PendingNote`],
/// [`Aim::DeferralTake`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LastRun {
    /// None yet, or it has not ended.
    Running,
    /// Completed, or told to stop (superseded, its lease lost, its time limit): nothing pends.
    Other,
    /// Failed (or panicked) on its own: its retry comes.
    Failed,
    /// Asked to be run later.
    Deferred,
}

impl Aim {
    /// Whether a request of kind `op`, after the worker's previous request `prev` on the same
    /// record, is this step; `last` says how the worker's latest run of the record ended.
    fn matches(self, op: Op, prev: Option<Op>, last: &dyn Fn() -> LastRun) -> bool {
        match self {
            Aim::SecondAcquire => op == Op::LeaseAcquire && prev == Some(Op::FlagPut),
            Aim::MarkerPut => op == Op::FlagPut,
            Aim::OwnMarkerClear => op == Op::FlagDelete && prev == Some(Op::LeaseAcquire),
            Aim::HolderCheck => op == Op::FlagDelete && prev == Some(Op::LeaseRelease),
            Aim::WaitCreate => op == Op::WaitPut,
            Aim::WaitConsume => op == Op::WaitDelete && prev == Some(Op::WaitHead),
            Aim::StandInConsume => {
                op == Op::WaitDelete && !matches!(prev, Some(Op::WaitHead | Op::WaitDelete))
            }
            Aim::PendingNote => {
                op == Op::BlobSetMetadata && matches!(last(), LastRun::Failed | LastRun::Deferred)
            }
            Aim::DeferralTake => {
                op == Op::FlagDelete && prev == Some(Op::LeaseRelease) && last() == LastRun::Deferred
            }
        }
    }

    fn index(self) -> usize {
        AIMS.iter().position(|a| *a == self).expect("every aim is listed")
    }
}

/// The lock and marker requests that tell which step of the protocol comes next (see [`Aim`]).
/// Debounce's wait marker requests.
const WAIT_OPS: [Op; 4] = [Op::WaitPut, Op::WaitTouch, Op::WaitHead, Op::WaitDelete];

/// And debounce's wait marker requests (see [`Node::step`]).
const STEP_OPS: [Op; 8] = [
    Op::LeaseAcquire,
    Op::LeaseRelease,
    Op::FlagPut,
    Op::FlagDelete,
    Op::WaitPut,
    Op::WaitTouch,
    Op::WaitHead,
    Op::WaitDelete,
];

/// Whether a request's answer says it changed something: an acquire granted, a marker created or
/// removed (any other request that succeeded).
fn changed<T: 'static>(result: &StoreResult<T>) -> bool {
    let Ok(value) = result else { return false };
    let value = value as &dyn std::any::Any;
    if let Some(set) = value.downcast_ref::<MarkerSet>() {
        return *set == MarkerSet::Created;
    }
    if let Some(removed) = value.downcast_ref::<bool>() {
        return *removed;
    }
    // A wait marker created (its ETag), or consumed.
    if let Some(created) = value.downcast_ref::<Option<String>>() {
        return created.is_some();
    }
    if let Some(consumed) = value.downcast_ref::<WaitConsumed>() {
        return *consumed == WaitConsumed::Consumed;
    }
    true
}

/// The requests an aimed crash can follow: every step of the lock, marker, queue and watchdog
/// protocol that changes state.
const CRASH_POINTS: [Op; 10] = [
    Op::LeaseAcquire,
    Op::BlobSequenceIncrement,
    Op::BlobSetMetadata,
    Op::LeaseRelease,
    Op::FlagPut,
    Op::FlagDelete,
    Op::QueuePut,
    Op::QueueDelete,
    Op::QueueUpdate,
    Op::QueueGet,
];

/// The steps that are retried after a lost answer or a failure: the lock's acquire and release,
/// the marker's put and delete, the queue's put and delete.
const RETRIED_STEPS: [Op; 6] = [
    Op::LeaseAcquire,
    Op::LeaseRelease,
    Op::FlagPut,
    Op::FlagDelete,
    Op::QueuePut,
    Op::QueueDelete,
];

/// Everything one seed decides.
#[derive(Debug, Clone)]
pub struct Plan {
    pub seed: u64,
    pub mode: Mode,
    pub faulty: bool,
    pub machines: usize,
    pub triggers: Vec<(Duration, usize)>,
    pub faults: Vec<(Duration, Fault)>,
    pub fencing: bool,
    /// Storage's clock runs fast by this fraction.
    pub skew: f64,
    /// A record whose logic fails throughout a window.
    pub bad_record: Option<(usize, Duration, Duration)>,
    /// Overrides the lease's safety margin (to show the simulation catches a short one).
    pub safety_margin: Option<Duration>,
    /// Share of the bad record's runs in its window that succeed anyway (0: none), so a sweep can
    /// run to success between two failing chains.
    pub bad_record_spares: f64,
    /// The poison queue cannot be written from this instant for this long.
    pub poison_outage: Option<(Duration, Duration)>,
    /// Triggers (by index) put by another tool with a 30,000-character correlation id, far over
    /// what Start accepts: their message is near the queue's 64 KiB limit.
    pub oversized: Vec<usize>,
    /// The queue hands out visible messages in a random order (seeded) rather than oldest
    /// first: Azure promises no order, so the protocol must not need one.
    pub shuffled_delivery: bool,
    /// A record whose logic asks to be run later throughout a window (run later, issue 24).
    pub throttled: Option<Throttle>,
    /// A record whose scope supersedes ([`RunPolicy::Supersede`]), with a stream of triggers
    /// during long runs.
    pub supersede: Option<SupersedePlan>,
    /// Share of the supersede record's runs in its stream's window that fail (0: none), fault-free
    /// seeds too, so retries and deferrals carrying `afterToken` meet supersedes, stand-downs
    /// and given-up chains ([`SupersedePlan`], drawn last of all).
    pub supersede_failures: f64,
    /// How long after the stream's window the supersede record's runs keep failing (ordinary
    /// length, same chance): the last chains, with no later trigger to cover what they drop,
    /// reach the poison limit and their sweeps.
    pub supersede_failing_tail: Duration,
    /// The supersede record's runs that ask to run later do so 0.5-4 s in rather than at the end
    /// of their 20-70 s (a downstream that refuses at once), so they defer before a trigger
    /// supersedes them: set in the seeds that aim faults at a deferral's take of the marker.
    pub supersede_defers_early: bool,
    /// Debounce ([`DebouncePlan`], drawn after everything else): records in a scope of their own
    /// that waits for each burst of triggers to end.
    pub debounce: Option<DebouncePlan>,
    /// Downstream budget ([`BudgetPlan`], drawn from a generator of its own): the throttled
    /// record's runs say "too many", which pauses every record's runs on every machine.
    pub budget: Option<BudgetPlan>,
    /// Priority lanes ([`LanePlan`], drawn from a generator of its own).
    pub lanes: Option<LanePlan>,
    /// A long pause and a dead holder ([`LongPausePlan`], drawn from a generator of its own, in
    /// some budget seeds).
    pub long_pause: Option<LongPausePlan>,
}

/// A long pause and a dead holder (issue 35, item 1), in 40 % of the budget seeds: the consumer
/// has few slots (1-3 on each machine), a record of its own ([`LONG_PAUSE_THROTTLED`]) is
/// throttled once, alone, with a `Retry-After` of 60-300 s (the cap on a pause raised to
/// 300 s), and while that pause holds a holder of another record dies ([`Fault::CrashHolder`]:
/// the victim [`LONG_PAUSE_VICTIM`], whose run started just before the throttle and is long),
/// so its carrier surfaces during the pause, in half the seeds in its last 30 s. Meanwhile
/// debounce waiters conclude and meet the pause under their leases (way one: they skip the
/// first gate), or a backlog of triggers comes faster than one batch per 5 s takes it, spread
/// over more records than there are slots, so that in the pause's last 30 s, when triggers pass
/// the first gate, their holders could fill every slot (way two), or both. The seed's own
/// faults give way to that one death (random faults are off), so the recovery bound (4) is
/// checked on it: the dead holder's record runs again within it, through the pause. Every
/// other run is short ([`LONG_PAUSE_OTHER_RUNS`]), and the seed has no low lane (see
/// [`Plan::from_seed_keeping_lanes`]). Standalone, without the consumer's waiting room and the
/// hand-back of a long pause at the second gate, or without its pace passing a backlog at once,
/// the waiting holders (or the backlog) kept the carrier from a slot.
#[derive(Debug, Clone)]
pub struct LongPausePlan {
    /// The consumer's concurrency on every machine (standalone).
    pub concurrency: usize,
    /// The throttled record's `Retry-After`: the budget's pause.
    pub retry_after: Duration,
    /// When the throttled record's trigger comes (its run is short, and throttles).
    pub at: Duration,
    /// The death was aimed so that the carrier surfaces in the pause's last 30 s.
    pub last_30: bool,
    /// Debounce records whose waits conclude during the pause (way one), if any.
    pub debounce_records: usize,
    /// Triggers of the backlog (way two), over `backlog_records` records from
    /// [`LONG_PAUSE_BACKLOG_FIRST`].
    pub backlog: usize,
    pub backlog_records: usize,
}

impl LongPausePlan {
    /// Records the seed's debounce waiters and its backlog spread over, both (way one, way two).
    pub fn ways(&self) -> (usize, usize) {
        (self.debounce_records, self.backlog_records)
    }
}

/// [`LongPausePlan`]'s throttled record, its victim (whose holder dies), and its backlog's first
/// record (each a record of its own, in the coalescing scope).
pub const LONG_PAUSE_THROTTLED: usize = 19;
pub const LONG_PAUSE_VICTIM: usize = 20;
pub const LONG_PAUSE_BACKLOG_FIRST: usize = 21;
/// How long the victim's run lasts (under the run time limit).
const LONG_PAUSE_VICTIM_RUN: Duration = Duration::from_secs(110);
/// Every other run of a long-pause seed lasts at most this: a slot of the consumer is then held
/// for long only by a holder that waits (the recovery bound cannot hold for a consumer whose
/// few slots run long work: a dead holder's message waits for one like any message).
const LONG_PAUSE_OTHER_RUNS: Duration = Duration::from_secs(5);
/// How long after its instant a [`Fault::CrashHolder`] waits for the pause to begin.
const LONG_PAUSE_WAIT: Duration = Duration::from_secs(60);
/// The cap on a pause in a long-pause seed ([`BudgetOptions::max_pause`]).
const LONG_PAUSE_MAX: Duration = Duration::from_secs(300);

/// Priority lanes (issue 25), in a fifth of the seeds: a low lane of its own queue, served by a
/// second runner on every machine (standalone: the same consumer, its low lane; under Functions
/// a host loop of its own, as `WorkerLow`), and these triggers (by index) put in it. A record's
/// triggers then come by two queues in any order; the lock and the marker are per record,
/// whatever lane a trigger came by.
#[derive(Debug, Clone)]
pub struct LanePlan {
    pub low: Vec<usize>,
}

/// Downstream budgets (issue 25), in half the seeds with a throttled record: every scope draws
/// on one budget; the throttled record's runs are throttles ([`LogicError::throttled`]), which
/// pause it for every record and machine (shared through a budget store), and each machine
/// starts at most `max_concurrency` runs at once, adapting (or not).
#[derive(Debug, Clone, Copy)]
pub struct BudgetPlan {
    pub max_concurrency: usize,
    pub adaptive: bool,
    /// The longest pause ([`BudgetOptions::max_pause`]).
    pub max_pause: Duration,
}

/// Debounce (issue 24): one or two records of their own ([`DEBOUNCE_FIRST_RECORD`] on) in a
/// scope of their own ([`DEBOUNCE_SCOPE`]) whose triggers wait for quiet: Q of 3, 6 or 10 s, the
/// longest wait M of Q, 3Q or 6Q. Each record gets 1-3 bursts of 3-8 triggers (in the plan's
/// triggers) with gaps of 0.3 s to Q - 2 s (Q = 3: to 1 s), bursts at least 2Q + M + 10 s apart;
/// some bursts go on for longer than M. In some seeds the scope also supersedes (debounced
/// supersede), or its first record is the throttled one.
#[derive(Debug, Clone)]
pub struct DebouncePlan {
    pub quiet: Duration,
    pub longest: Duration,
    /// How many records debounce: records `DEBOUNCE_FIRST_RECORD..DEBOUNCE_FIRST_RECORD + records`.
    pub records: usize,
    /// Each burst: its record, its first and its last trigger (from the seed's start).
    pub bursts: Vec<(usize, Duration, Duration)>,
    /// The scope supersedes too (fencing on).
    pub supersede: bool,
}

/// The scope of the debounce records.
pub const DEBOUNCE_SCOPE: &str = "deb";
/// The first debounce record (the others' records are 0-2).
pub const DEBOUNCE_FIRST_RECORD: usize = 3;

impl DebouncePlan {
    /// Whether `record` debounces.
    pub fn has(&self, record: usize) -> bool {
        (DEBOUNCE_FIRST_RECORD..DEBOUNCE_FIRST_RECORD + self.records).contains(&record)
    }

    /// The runner's window.
    pub fn window(&self) -> leasehold_runtime::Debounce {
        leasehold_runtime::Debounce::new(self.quiet, self.longest).expect("Q > 0")
    }
}

/// Supersede (issue 24): one record in a scope of its own ([`SUPERSEDE_SCOPE`]) whose policy is
/// [`RunPolicy::Supersede`] (every other record stays in the coalescing scope `sim`), a stream of
/// triggers for it (one every 3-12 s for 60-120 s, in the plan's triggers) and its runs long
/// (20-70 s) in that window, half of them taking up to 4 s to stop (inside the stop grace), so
/// runs are stopped for triggers that arrive during them. Fencing is on (supersede needs it).
#[derive(Debug, Clone, Copy)]
pub struct SupersedePlan {
    pub record: usize,
    /// The stream's window, from the seed's start: runs that start in it are long.
    pub from: Duration,
    pub to: Duration,
}

/// The scope of the supersede record (every other record's is `sim`).
pub const SUPERSEDE_SCOPE: &str = "sup";
/// Superseded runs in a row after which a run is let finish (the runner's default, set explicitly).
pub const SUPERSEDE_STREAK: u32 = 3;

/// A record whose runs, in a window, end asking to be run later ([`LogicError::run_later`]):
/// 70 % after 5-60 s, 15 % after the default, 15 % after far more than the budget allows.
#[derive(Debug, Clone, Copy)]
pub struct Throttle {
    pub record: usize,
    /// The window, from the seed's start: runs that start in it ask to be run later.
    pub from: Duration,
    pub to: Duration,
    /// The runner's `max_deferral` in this seed: 120-600 s, so some chains spend it.
    pub max_deferral: Duration,
}

impl Plan {
    pub fn from_seed(seed: u64) -> Self {
        Self::draw(seed, false)
    }

    /// [`from_seed`](Self::from_seed), keeping the priority lanes a long-pause seed draws
    /// ([`LongPausePlan`]): a dead holder's message in the low lane behind a backlog during a
    /// pause (the consumer's pace once passed it by).
    pub fn from_seed_keeping_lanes(seed: u64) -> Self {
        Self::draw(seed, true)
    }

    fn draw(seed: u64, keep_lanes: bool) -> Self {
        let mut rng = SmallRng::seed_from_u64(seed ^ 0x5eed);
        let mode = if seed.is_multiple_of(2) {
            Mode::Standalone
        } else {
            Mode::FunctionsHost
        };
        let faulty = seed % 10 < 7;
        let records = rng.random_range(1..=3);
        let machines = rng.random_range(2..=3);
        let n = rng.random_range(3..=14);
        let mut triggers: Vec<_> = (0..n)
            .map(|_| {
                (
                    Duration::from_millis(rng.random_range(0..90_000)),
                    rng.random_range(0..records),
                )
            })
            .collect();
        // Bursts: a third of triggers land within a second of another.
        for i in 0..n / 3 {
            let (t, r) = triggers[i];
            triggers.push((t + Duration::from_millis(rng.random_range(0..1_000)), r));
        }
        triggers.sort();
        let mut faults = Vec::new();
        let mut skew = 0.0;
        let mut bad_record = None;
        if faulty {
            let at = |rng: &mut SmallRng| Duration::from_millis(rng.random_range(0..100_000));
            let pause = |rng: &mut SmallRng| Duration::from_millis(rng.random_range(0..15_000));
            for _ in 0..rng.random_range(0..=2) {
                let machine = rng.random_range(0..machines);
                let restart_after = pause(&mut rng);
                let fault = match (mode, rng.random_range(0..4)) {
                    (Mode::FunctionsHost, 0 | 1) => Fault::HostDeath {
                        machine,
                        restart_after,
                    },
                    (_, 3) => Fault::Shutdown {
                        machine,
                        restart_after,
                    },
                    _ => Fault::Crash {
                        machine,
                        restart_after,
                    },
                };
                faults.push((at(&mut rng), fault));
            }
            if rng.random_bool(0.3) {
                let machine = rng.random_range(0..machines);
                let length = Duration::from_millis(rng.random_range(15_000..60_000));
                faults.push((at(&mut rng), Fault::Partition { machine, length }));
            }
            if rng.random_bool(0.15) {
                let record = rng.random_range(0..records);
                faults.push((at(&mut rng), Fault::Break { record }));
            }
            if rng.random_bool(0.5) {
                skew = rng.random_range(0.0..0.10);
            }
            if rng.random_bool(0.15) {
                let from = at(&mut rng);
                let length = Duration::from_millis(rng.random_range(20_000..90_000));
                bad_record = Some((rng.random_range(0..records), from, from + length));
            }
            // Drawn last, so the faults above stay what they were for every seed.
            if rng.random_bool(0.3) {
                let fault = Fault::CrashAfter {
                    machine: rng.random_range(0..machines),
                    op: CRASH_POINTS[rng.random_range(0..CRASH_POINTS.len())],
                    host_death: mode == Mode::FunctionsHost && rng.random_bool(0.5),
                    restart_after: pause(&mut rng),
                };
                faults.push((at(&mut rng), fault));
            }
        }
        // Drawn after everything above, so the plans of earlier versions stay what they were.
        let (mut poison_outage, mut oversized, mut bad_record_spares) = (None, Vec::new(), 0.0);
        if faulty {
            if mode == Mode::FunctionsHost && rng.random_bool(0.1) {
                // The handler crash-loops (a bad deploy): down for minutes while its host keeps
                // taking messages and failing their invocations.
                let fault = Fault::Crash {
                    machine: rng.random_range(0..machines),
                    restart_after: Duration::from_millis(rng.random_range(60_000..300_000)),
                };
                faults.push((Duration::from_millis(rng.random_range(0..100_000)), fault));
            }
            if rng.random_bool(0.1) {
                let from = Duration::from_millis(rng.random_range(0..100_000));
                let length = Duration::from_millis(rng.random_range(10_000..120_000));
                poison_outage = Some((from, length));
            }
            if rng.random_bool(0.1) {
                let n = triggers.len();
                oversized = (0..n).filter(|_| rng.random_bool(0.3)).collect();
            }
            for _ in 0..rng.random_range(0..=3) {
                let fault = Fault::LoseAnswer {
                    machine: rng.random_range(0..machines),
                    op: RETRIED_STEPS[rng.random_range(0..RETRIED_STEPS.len())],
                };
                faults.push((Duration::from_millis(rng.random_range(0..100_000)), fault));
            }
            if let Some((record, from, _)) = bad_record
                && rng.random_bool(0.5)
            {
                // Flaky rather than broken, for longer: some runs succeed (a sweep can run to
                // success between two failing chains), events keep coming, and queue puts fail
                // for a while on each machine (a holder that consumed the marker cannot hand it
                // on).
                bad_record_spares = 0.3;
                let to = from + Duration::from_millis(rng.random_range(120_000..240_000));
                bad_record = Some((record, from, to));
                // Events in the first half; the outages in the second, where the last failing
                // chains have no later event to mask a trigger they dropped.
                let half = (to - from).as_millis() as u64 / 2;
                for _ in 0..12 {
                    triggers.push((from + Duration::from_millis(rng.random_range(0..half)), record));
                }
                triggers.sort();
                for machine in 0..machines {
                    let fault = Fault::FailOp {
                        machine,
                        op: Op::QueuePut,
                        length: Duration::from_millis(rng.random_range(10_000..40_000)),
                    };
                    let at = from + Duration::from_millis(half + rng.random_range(0..half));
                    faults.push((at, fault));
                }
            }
            if rng.random_bool(0.25) {
                let fault = Fault::FailOp {
                    machine: rng.random_range(0..machines),
                    op: RETRIED_STEPS[rng.random_range(0..RETRIED_STEPS.len())],
                    length: Duration::from_millis(rng.random_range(5_000..30_000)),
                };
                faults.push((Duration::from_millis(rng.random_range(0..100_000)), fault));
            }
        }
        faults.sort();
        // Drawn last of all, for every seed (reordering is no fault: Azure never promised order).
        let shuffled_delivery = rng.random_bool(0.5);
        // Drawn after that, so every seed's plan keeps what it drew before: faults aimed at one
        // step of the protocol, the contended path's own steps included (a second acquire, a clear
        // of one's own marker), where a request that lands late, loses its answer after taking
        // effect or answers slowly decides what the others see.
        if faulty {
            for class in 0..3 {
                for _ in 0..rng.random_range(0..=3) {
                    let machine = rng.random_range(0..machines);
                    let aim = AIMS[rng.random_range(0..MARKER_AIMS)];
                    let fault = match class {
                        0 => Fault::LandLate {
                            machine,
                            aim,
                            late: CLIENT_TIMEOUT + Duration::from_millis(rng.random_range(0..LATE_MAX_MS)),
                        },
                        1 => Fault::LoseChange {
                            machine,
                            aim,
                            failing_for: if rng.random_bool(0.5) {
                                Duration::ZERO
                            } else {
                                Duration::from_millis(rng.random_range(20_000..40_000))
                            },
                        },
                        _ => {
                            let slow = Duration::from_millis(rng.random_range(1_000..9_000));
                            let (to_land, to_answer) = if rng.random_bool(0.5) {
                                (slow, Duration::ZERO)
                            } else {
                                (Duration::ZERO, slow)
                            };
                            Fault::Slow {
                                machine,
                                aim,
                                to_land,
                                to_answer,
                            }
                        }
                    };
                    faults.push((Duration::from_millis(rng.random_range(0..100_000)), fault));
                }
            }
            faults.sort();
        }
        // Drawn after every other draw, for every seed whatever its mode or faults, so each seed
        // keeps the plan it had (one without a throttle runs exactly as before): run later.
        let mut throttled = rng.random_bool(0.3).then(|| {
            // A record that has triggers, so the throttle is met.
            let record = triggers[rng.random_range(0..triggers.len())].1;
            let from = Duration::from_millis(rng.random_range(0..60_000));
            let length = Duration::from_millis(rng.random_range(60_000..400_000));
            Throttle {
                record,
                from,
                to: from + length,
                max_deferral: Duration::from_millis(rng.random_range(120_000..600_000)),
            }
        });
        // Drawn after that, last of all, so a seed without it keeps its plan: supersede.
        let supersede = rng.random_bool(0.25).then(|| {
            let record = triggers[rng.random_range(0..triggers.len())].1;
            let from = Duration::from_millis(rng.random_range(0..40_000));
            let to = from + Duration::from_millis(rng.random_range(60_000..120_000));
            let mut t = from;
            loop {
                t += Duration::from_millis(rng.random_range(3_000..12_000));
                if t >= to {
                    break;
                }
                triggers.push((t, record));
            }
            triggers.sort();
            SupersedePlan { record, from, to }
        });
        // Drawn after that, last of all, so a seed that draws nothing here keeps its plan and its
        // runs: for half the supersede seeds (fault-free ones too), the supersede record's runs
        // in its window fail 30-50 % of the time, early in the run (1-15 s, or their whole
        // length), so its retries — which carry `afterToken` — meet supersedes, stand-downs and
        // chains given up at the poison limit (then sweeps). In half of those the supersede
        // record is the throttled one as well (replacing any throttle drawn above): its runs ask
        // to be run later through its window, so deferrals carrying `afterToken` meet them too,
        // and chains that spend their deferral budget are given up.
        let (mut supersede_failures, mut supersede_failing_tail) = (0.0, Duration::ZERO);
        if let Some(sp) = supersede
            && rng.random_bool(0.5)
        {
            supersede_failures = rng.random_range(0.3..0.5);
            if rng.random_bool(0.5) {
                supersede_failing_tail = Duration::from_millis(rng.random_range(30_000..120_000));
            }
            if rng.random_bool(0.5) {
                throttled = Some(Throttle {
                    record: sp.record,
                    from: sp.from,
                    to: sp.to,
                    max_deferral: Duration::from_millis(rng.random_range(120_000..600_000)),
                });
            }
        }
        // Drawn after every other draw, so a seed without it keeps its plan and its runs:
        // debounce, on records of their own.
        let debounce = rng.random_bool(0.22).then(|| {
            let q = [3u64, 6, 10][rng.random_range(0..3)];
            let quiet = Duration::from_secs(q);
            let longest = quiet * [1u32, 3, 6][rng.random_range(0..3)];
            let records = rng.random_range(1..=2);
            let gap_max = if q == 3 { 1_000 } else { (q - 2) * 1_000 };
            let mut bursts = Vec::new();
            for k in 0..records {
                let record = DEBOUNCE_FIRST_RECORD + k;
                let mut t = Duration::from_millis(rng.random_range(0..60_000));
                for _ in 0..rng.random_range(1..=3) {
                    let first = t;
                    // Some bursts go on for longer than the longest wait.
                    let long = rng.random_bool(0.3);
                    let mut n = if long { 40 } else { rng.random_range(3..=8) };
                    let past = longest + Duration::from_millis(rng.random_range(0..q * 1_000));
                    loop {
                        triggers.push((t, record));
                        n -= 1;
                        if n == 0 || (long && t - first > past) {
                            break;
                        }
                        t += Duration::from_millis(rng.random_range(300..gap_max));
                    }
                    bursts.push((record, first, t));
                    t += quiet * 2 + longest + Duration::from_millis(rng.random_range(10_000..30_000));
                }
            }
            triggers.sort();
            DebouncePlan {
                quiet,
                longest,
                records,
                bursts,
                supersede: rng.random_bool(0.2),
            }
        });
        // In some debounce seeds the first debounce record is the throttled one (its runs ask to
        // run later while its bursts come): deferrals meet waits.
        if let Some(d) = &debounce
            && !d.supersede
            && rng.random_bool(0.2)
        {
            let to = d
                .bursts
                .iter()
                .map(|(_, _, last)| *last)
                .max()
                .unwrap_or_default();
            throttled = Some(Throttle {
                record: DEBOUNCE_FIRST_RECORD,
                from: Duration::ZERO,
                to: to + Duration::from_secs(30),
                max_deferral: Duration::from_millis(rng.random_range(120_000..600_000)),
            });
        }
        // Faults aimed at debounce's own steps (a wait marker's create, a waiter's consume, a
        // stand-in's consume), drawn last and only in faulty debounce seeds, so that they fire
        // often enough and every other seed keeps its plan.
        if faulty && debounce.is_some() {
            for class in 0..3 {
                for _ in 0..rng.random_range(0..=2) {
                    let machine = rng.random_range(0..machines);
                    let aim = AIMS[rng.random_range(MARKER_AIMS..DEBOUNCE_AIMS_END)];
                    let fault = match class {
                        0 => Fault::LandLate {
                            machine,
                            aim,
                            late: CLIENT_TIMEOUT + Duration::from_millis(rng.random_range(0..LATE_MAX_MS)),
                        },
                        1 => Fault::LoseChange {
                            machine,
                            aim,
                            failing_for: if rng.random_bool(0.5) {
                                Duration::ZERO
                            } else {
                                Duration::from_millis(rng.random_range(20_000..40_000))
                            },
                        },
                        _ => {
                            let slow = Duration::from_millis(rng.random_range(1_000..9_000));
                            let (to_land, to_answer) = if rng.random_bool(0.5) {
                                (slow, Duration::ZERO)
                            } else {
                                (Duration::ZERO, slow)
                            };
                            Fault::Slow {
                                machine,
                                aim,
                                to_land,
                                to_answer,
                            }
                        }
                    };
                    faults.push((Duration::from_millis(rng.random_range(0..100_000)), fault));
                }
            }
            faults.sort();
        }
        // From a generator of its own, so every seed keeps the plan it had.
        let mut budget_rng = SmallRng::seed_from_u64(seed ^ 0xb0d6_e725);
        let budget = (throttled.is_some() && budget_rng.random_bool(0.5)).then(|| BudgetPlan {
            max_concurrency: budget_rng.random_range(1..=4),
            adaptive: budget_rng.random_bool(0.7),
            max_pause: SIM_MAX_PAUSE,
        });
        // From a generator of its own too, in some budget seeds only, so every other seed keeps
        // its plan: a long pause and a dead holder ([`LongPausePlan`]).
        let mut pause_rng = SmallRng::seed_from_u64(seed ^ 0x10e6_9a05);
        let (mut faulty, mut debounce, mut budget) = (faulty, debounce, budget);
        let long_pause = budget.is_some_and(|_| pause_rng.random_bool(0.4)).then(|| {
            let rng = &mut pause_rng;
            let concurrency = rng.random_range(1..=3usize);
            let slots = machines * concurrency;
            let last_30 = rng.random_bool(0.5);
            let retry_after = Duration::from_secs(if last_30 {
                rng.random_range(60..=130)
            } else {
                rng.random_range(60..=300)
            });
            let at = Duration::from_millis(rng.random_range(20_000..70_000));
            // The death comes `x` after the pause began (a second or two after `at`: the
            // throttled run is short), so the victim's carrier surfaces 25-35 s later (lease +
            // 5 s from its last push, just before a renewal): with `last_30`, 5-30 s before
            // the pause ends. The victim's run lasts until about `at` + 105 s.
            let p = retry_after.as_millis() as u64;
            let x = if last_30 {
                (p.saturating_sub(60_000) + rng.random_range(0..25_000)).clamp(10_000, 90_000)
            } else {
                rng.random_range(10_000..=p.saturating_sub(50_000).clamp(10_001, 90_000))
            };
            let (with_debounce, with_backlog) = match rng.random_range(0..5) {
                0 | 1 => (true, false),
                2 | 3 => (false, true),
                _ => (true, true),
            };
            // The victim's trigger, before the pause; the throttled record's, which starts it,
            // alone: a refusal while another run of the budget succeeds on its worker is one
            // record's, and pauses nothing.
            triggers.retain(|(t, _)| *t + Duration::from_secs(10) < at || *t > at + Duration::from_secs(5));
            triggers.push((at.saturating_sub(Duration::from_secs(5)), LONG_PAUSE_VICTIM));
            triggers.push((at, LONG_PAUSE_THROTTLED));
            // (Its deferral comes back after the pause, past the window, and completes.)
            throttled = Some(Throttle {
                record: LONG_PAUSE_THROTTLED,
                from: at.saturating_sub(Duration::from_secs(1)),
                to: at + Duration::from_secs(20),
                max_deferral: LONG_PAUSE_MAX * 2,
            });
            // Way one: more debounce records than the consumers have slots (and the
            // restarted worker's), each with a burst that concludes around the death.
            let mut debounce_records = 0;
            if with_debounce {
                debounce_records = slots + concurrency + 2;
                let quiet = Duration::from_secs([3, 6][rng.random_range(0..2)]);
                let d = debounce.get_or_insert_with(|| DebouncePlan {
                    quiet,
                    longest: quiet * 3,
                    records: 0,
                    bursts: Vec::new(),
                    supersede: false,
                });
                d.records = d.records.max(debounce_records);
                let gap_max = d.quiet.as_millis() as u64 - 1_000;
                let from = x.saturating_sub(15_000).max(3_000);
                for k in 0..debounce_records {
                    let record = DEBOUNCE_FIRST_RECORD + k;
                    let first = at + Duration::from_millis(rng.random_range(from..x + 20_000));
                    let mut t = first;
                    for _ in 0..rng.random_range(2..=4) {
                        triggers.push((t, record));
                        t += Duration::from_millis(rng.random_range(300..gap_max));
                    }
                    d.bursts.push((record, first, t));
                }
            }
            // Way two: a backlog that a batch per 5 s falls behind (k = 1.5-3 times what
            // the consumers take at that pace), from before the death until past the
            // carrier's surfacing, over more records than there are slots.
            let (mut backlog, mut backlog_records) = (0, 0);
            if with_backlog {
                backlog_records = slots + concurrency + 2;
                let k = rng.random_range(1.5..3.0);
                let gap = Duration::from_secs_f64(5.0 / (slots as f64 * k)).max(Duration::from_millis(100));
                let end = at + Duration::from_millis((x + 50_000).min(p + 1_000));
                let start = at + Duration::from_millis(x.saturating_sub(25_000).max(3_000));
                let start = start.max(end.saturating_sub(gap * 200));
                let mut t = start;
                while t < end {
                    let record = LONG_PAUSE_BACKLOG_FIRST + rng.random_range(0..backlog_records);
                    triggers.push((t, record));
                    backlog += 1;
                    t += gap;
                }
            }
            triggers.sort();
            // The seed's own faults give way to the death (random faults are off too).
            faulty = true;
            faults = vec![(
                at,
                Fault::CrashHolder {
                    record: LONG_PAUSE_VICTIM,
                    after_pause: Duration::from_millis(x),
                    host_death: mode == Mode::FunctionsHost && rng.random_bool(0.5),
                    restart_after: Duration::from_millis(rng.random_range(1_000..5_000)),
                },
            )];
            if let Some(b) = &mut budget {
                b.max_pause = LONG_PAUSE_MAX;
            }
            LongPausePlan {
                concurrency,
                retry_after,
                at,
                last_30,
                debounce_records,
                backlog,
                backlog_records,
            }
        });
        let mut lane_rng = SmallRng::seed_from_u64(seed ^ 0x1a4e_5eed);
        let mut lanes = lane_rng.random_bool(0.2).then(|| LanePlan {
            low: (0..triggers.len())
                .filter(|_| lane_rng.random_bool(0.5))
                .collect(),
        });
        // Not in a long-pause seed (drawn all the same, so the draws stay the same and the
        // seeds' fingerprints with them): [`Plan::from_seed_keeping_lanes`] keeps them, for
        // `simulation_long_pause_with_lanes` (a dead holder's message in the low lane behind a
        // backlog during a pause).
        if long_pause.is_some() && !keep_lanes {
            lanes = None;
        }
        // Faults aimed at the two steps of the retry-backoff supersede (`afterToken`) that
        // decide whether a retry or a deferral may stand down (issue 35): the note of a run that
        // pends, and a deferral's take of the marker. Drawn from a generator of their own, and
        // only in faulty seeds whose supersede record's runs fail or ask to run later, so every
        // other seed keeps its plan (not in long-pause seeds: their own faults give way to the
        // death).
        let mut pend_rng = SmallRng::seed_from_u64(seed ^ 0x0035_a1ed);
        let mut supersede_defers_early = false;
        if faulty
            && long_pause.is_none()
            && let Some(sp) = supersede
        {
            // Not in budget seeds: there every throttle pauses every run, so no later run starts
            // while a deferral's take is in flight, and throttles as frequent as those below
            // would keep a live holder waiting for its slot past the recovery bound.
            let defers = budget.is_none() && throttled.is_some_and(|t| t.record == sp.record);
            // While the record's runs fail (or ask to run later), and faults last.
            let until = (sp.to + supersede_failing_tail).min(FAULT_PHASE);
            let at = |rng: &mut SmallRng| {
                Duration::from_millis(rng.random_range(sp.from.as_millis() as u64..until.as_millis() as u64))
            };
            if supersede_failures > 0.0 || defers {
                // The note cannot be written (the retry must carry no token, and run); or it
                // was written and its answer lost, every retry failing (the same, one run more).
                // Some anywhere in the record's failing time; and on every machine from shortly
                // before its stream ends, where no later trigger's run covers what a retry that
                // stood down for nothing would drop.
                let end = sp.to.saturating_sub(Duration::from_secs(10));
                let anywhere = (0..pend_rng.random_range(1..=2)).map(|_| None);
                let at_end = (0..machines).filter(|_| end < until).map(Some);
                for aimed in anywhere.chain(at_end).collect::<Vec<_>>() {
                    let (machine, at) = match aimed {
                        None => (pend_rng.random_range(0..machines), at(&mut pend_rng)),
                        Some(machine) => (
                            machine,
                            Duration::from_millis(
                                pend_rng.random_range(end.as_millis() as u64..until.as_millis() as u64),
                            ),
                        ),
                    };
                    let failing_for = Duration::from_millis(pend_rng.random_range(8_000..15_000));
                    let fault = if pend_rng.random_bool(0.75) {
                        Fault::Refuse {
                            machine,
                            aim: Aim::PendingNote,
                            failing_for,
                        }
                    } else {
                        Fault::LoseChange {
                            machine,
                            aim: Aim::PendingNote,
                            failing_for,
                        }
                    };
                    faults.push((at, fault));
                }
            }
            if let Some(t) = throttled.as_mut().filter(|_| defers) {
                // The record's runs ask to run later early in their run, and stop asking 0-4 s
                // before the stream's last but one trigger: a run that one starts completes
                // (unless it fails), and the last trigger may come during it. From 10 s before
                // that, on every machine, a deferral's take lands late — after such a later run
                // started and the last trigger set the marker during it: its retry finds no
                // marker, and the later run completes and removes the note — or its answer is
                // lost (the retry finds none), or it is slow to land.
                let stream: Vec<Duration> = triggers
                    .iter()
                    .filter(|(at, r)| *r == sp.record && *at >= sp.from && *at < sp.to)
                    .map(|(at, _)| *at)
                    .collect();
                let last_but_one = stream.len().checked_sub(2).map_or(sp.to, |i| stream[i]);
                t.to = last_but_one
                    .saturating_sub(Duration::from_millis(pend_rng.random_range(0..4_000)))
                    .max(sp.from + Duration::from_secs(1));
                supersede_defers_early = true;
                let from = t.to.saturating_sub(Duration::from_secs(10)).max(sp.from);
                // Until shortly after: the last deferral's run may end then.
                let until = t.to + Duration::from_secs(2);
                let at = |rng: &mut SmallRng| {
                    Duration::from_millis(rng.random_range(from.as_millis() as u64..until.as_millis() as u64))
                };
                for machine in (0..machines).flat_map(|m| [m, m]) {
                    let fault = match pend_rng.random_range(0..4) {
                        0 | 1 => Fault::LandLate {
                            machine,
                            aim: Aim::DeferralTake,
                            late: CLIENT_TIMEOUT
                                + Duration::from_millis(pend_rng.random_range(0..LATE_MAX_MS)),
                        },
                        2 => Fault::LoseChange {
                            machine,
                            aim: Aim::DeferralTake,
                            failing_for: Duration::ZERO,
                        },
                        _ => Fault::Slow {
                            machine,
                            aim: Aim::DeferralTake,
                            to_land: Duration::from_millis(pend_rng.random_range(1_000..9_000)),
                            to_answer: Duration::ZERO,
                        },
                    };
                    faults.push((at(&mut pend_rng), fault));
                }
            }
            faults.sort();
        }
        Self {
            seed,
            mode,
            faulty,
            machines,
            triggers,
            faults,
            // Supersede needs fencing (its streak is a note on the lease).
            fencing: !seed.is_multiple_of(3)
                || supersede.is_some()
                || debounce.as_ref().is_some_and(|d| d.supersede),
            skew,
            bad_record,
            safety_margin: None,
            poison_outage,
            oversized,
            bad_record_spares,
            shuffled_delivery,
            throttled,
            supersede,
            supersede_failures,
            supersede_failing_tail,
            supersede_defers_early,
            debounce,
            budget,
            lanes,
            long_pause,
        }
    }
}

impl Plan {
    /// Whether the plan aims faults at the retry-backoff supersede's own steps (a pending run's
    /// note, a deferral's marker take): such seeds run differently since they were added.
    pub fn aims_at_pending_steps(&self) -> bool {
        self.faults.iter().any(|(_, f)| {
            matches!(
                f,
                Fault::Refuse { .. }
                    | Fault::LandLate {
                        aim: Aim::PendingNote | Aim::DeferralTake,
                        ..
                    }
                    | Fault::LoseChange {
                        aim: Aim::PendingNote | Aim::DeferralTake,
                        ..
                    }
                    | Fault::Slow {
                        aim: Aim::PendingNote | Aim::DeferralTake,
                        ..
                    }
            )
        })
    }

    /// The scope of `record`'s triggers and lock.
    pub fn scope_of(&self, record: usize) -> &'static str {
        if self.debounce.as_ref().is_some_and(|d| d.has(record)) {
            DEBOUNCE_SCOPE
        } else if self.supersede.is_some_and(|s| s.record == record) {
            SUPERSEDE_SCOPE
        } else {
            "sim"
        }
    }
}

/// Faults stop here so the system can drain; checks look at the state after that.
const FAULT_PHASE: Duration = Duration::from_secs(130);
const DRAIN_LIMIT: Duration = Duration::from_secs(1800);
const LEASE: Duration = Duration::from_secs(30);
const RENEW_EVERY: Duration = Duration::from_secs(10);
/// Standalone visibility: lease duration + the carrier margin (the consumer's default rule; the
/// message is pushed just before each lease renewal).
const VISIBILITY: Duration = Duration::from_secs(35);
/// The Functions host: message visibility, `visibilityTimeout` after a failed invocation,
/// `maxDequeueCount`, polling interval.
const HOST_VISIBILITY: Duration = Duration::from_secs(600);
/// The handler's delay before a failed run's retry (the runner's `retry_delay`).
const RETRY_DELAY: Duration = Duration::from_secs(5);
/// The delay of a run put off without saying for how long (the runner's `default_deferral`):
/// short, so drains stay short.
const SIM_DEFAULT_DEFERRAL: Duration = Duration::from_secs(20);
/// A request to run later for far longer than any seed's budget.
const HUGE_DEFERRAL: Duration = Duration::from_secs(10_000);

/// The queue settings of the project's own `host.json`, which the emulated host obeys:
/// `visibilityTimeout` (delay before a failed invocation's message is visible again) and
/// `maxDequeueCount` (the host poisons a message, with no reason and no sweep, once that many
/// invocations failed).
struct HostQueueSettings {
    retry_visibility: Duration,
    max_dequeue: u32,
}

static HOST_JSON: std::sync::LazyLock<HostQueueSettings> = std::sync::LazyLock::new(|| {
    let host: serde_json::Value =
        serde_json::from_str(include_str!("../../../../host.json")).expect("host.json is JSON");
    let queues = &host["extensions"]["queues"];
    let visibility = queues["visibilityTimeout"].as_str().expect("visibilityTimeout");
    let secs: Vec<u64> = visibility
        .split(':')
        .map(|p| p.parse().expect("hh:mm:ss"))
        .collect();
    HostQueueSettings {
        retry_visibility: Duration::from_secs(secs[0] * 3600 + secs[1] * 60 + secs[2]),
        max_dequeue: queues["maxDequeueCount"].as_u64().expect("maxDequeueCount") as u32,
    }
});
const HOST_POLL: Duration = Duration::from_secs(2);
const MAX_ATTEMPTS: u32 = 5;
const RUN_TIMEOUT: Duration = Duration::from_secs(120);
const STOP_GRACE: Duration = Duration::from_secs(5);
/// A request that got no answer within this is a time-out for the client.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long after the client gave up a request may still take effect (inside the retry's
/// `late_window` of 5 s).
const LATE_MAX_MS: u64 = 4_000;
/// The logic supervisor stops the logic's process tree this long after its worker died.
const SUPERVISOR_KILL: Duration = Duration::from_secs(1);

/// How often each fault class happened in one seed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FaultCounts {
    pub process_crashes: u64,
    pub host_deaths: u64,
    pub shutdowns: u64,
    pub partitions: u64,
    pub timeouts: u64,
    pub late_landings: u64,
    pub transient_errors: u64,
    pub visibility_lapses: u64,
    pub lease_breaks: u64,
    pub skewed_clock: u64,
    pub shuffled_delivery: u64,
    pub logic_failures: u64,
    pub logic_panics: u64,
    pub slow_stops: u64,
    pub time_limits: u64,
    pub poisoned: u64,
    pub storage_failed_outcomes: u64,
    pub lease_lost_outcomes: u64,
    pub rechecks: u64,
    pub watchdog_retries: u64,
    pub aimed_crashes: u64,
    pub crash_loops: u64,
    pub oversized_triggers: u64,
    pub poison_write_failures: u64,
    pub host_poisoned: u64,
    pub detached_logic: u64,
    pub conditional_sweeps: u64,
    /// Per retried step ([`RETRIED_STEPS`]): aimed lost answers that fired.
    pub lost_answers: [u64; 6],
    /// Per retried step: requests failed by an outage of that step.
    pub failed_steps: [u64; 6],
    /// Marker puts that landed after their caller gave up on them and after someone had looked at
    /// the marker since they were sent (their retry answers "already set", though the put is the
    /// caller's own, and the holder relied on has looked already).
    pub puts_after_a_look: u64,
    /// Seeds with a throttled record ([`Throttle`]).
    pub throttled_seeds: u64,
    /// Runs whose logic asked to be run later.
    pub deferrals_asked: u64,
    /// Deferrals persisted (distinct chain and hop seen on a message put or updated).
    pub deferrals_persisted: u64,
    /// Chains deferred more than `MAX_ATTEMPTS` times (never poisoned for it).
    pub long_deferral_chains: u64,
    /// Poison entries of triggers whose deferral budget was spent.
    pub deferral_exhaustions: u64,
    /// Runs of a deferred chain whose start R1 checked against the hop that put them off.
    pub r1_checks: u64,
    /// Triggers never served because the record's logic kept asking to run later through two
    /// budgets: the second, a sweep's chain, was given up and its conditional sweep stood down.
    pub dropped_after_two_budgets: u64,
    /// Seeds with a supersede record ([`SupersedePlan`]).
    pub supersede_seeds: u64,
    /// Runs told to stop because a trigger arrived during them (superseded).
    pub supersedes: u64,
    /// Of those, runs whose logic took longer than its stop grace to stop (abandoned, the lease
    /// kept until it ended).
    pub supersedes_abandoned: u64,
    /// Superseded runs with no marker created on the record after the run's lease was granted (nothing
    /// arrived during them).
    pub spurious_supersedes: u64,
    /// Runs of a supersede record during which a marker was created that were not stopped.
    pub protected_runs: u64,
    /// Of those, in fault-free seeds, runs the streak protected (K superseded in a row before
    /// them, or the streak's run time at the limit).
    pub protected_by_streak: u64,
    /// Markers created during an unprotected run that S1 checked the run's stop against.
    pub s1_checks: u64,
    /// Outcomes `Superseded` (Functions mode), each matched to a run stopped by a watch.
    pub superseded_outcomes: u64,
    /// Seeds whose supersede record's runs fail in its window ([`Plan::supersede_failures`]).
    pub supersede_failure_seeds: u64,
    /// Of those, seeds whose supersede record is the throttled one too.
    pub supersede_throttled_seeds: u64,
    /// Runs of the supersede record failed by that injection.
    pub supersede_failures: u64,
    /// Messages written (put, or updated in place) carrying an `afterToken`: retries.
    pub after_token_retries: u64,
    /// Messages written carrying an `afterToken` and a deferral: deferrals.
    pub after_token_deferrals: u64,
    /// Deliveries carrying an `afterToken` that stood down, a later run having taken their duty
    /// over (the runner's log line, counted on the seed's thread).
    pub after_token_stand_downs: u64,
    /// Poison entries of the supersede record (its chains given up).
    pub supersede_give_ups: u64,
    /// Of those, a sweep's chain given up (`given_up` >= 1).
    pub supersede_sweep_give_ups: u64,
    /// Seeds with debounce records ([`DebouncePlan`]).
    pub debounce_seeds: u64,
    /// Of those, seeds whose debounce scope supersedes too, or whose record is throttled.
    pub debounce_combined_seeds: u64,
    /// Wait markers created (a create that answered with its ETag landed).
    pub waits_created: u64,
    /// Triggers that joined a wait (their create found the marker).
    pub waits_joined: u64,
    /// Waiters written back to wait another period (a message carrying `wait` that has waited
    /// more than one period).
    pub waits_rewaited: u64,
    /// Waiters' consumes (right after their look) that took the marker: the wait concluded.
    pub waits_concluded: u64,
    /// Waiters' looks or consumes that found no marker (they stand down, unless owed).
    pub waits_found_gone: u64,
    /// Consumes not after a look (path C) that took a marker.
    pub standin_consumes: u64,
    /// Bursts B1 checked (fault-free), and worker deaths during a waiter's wake.
    pub b1_checks: u64,
    pub wake_deaths: u64,
    /// Seeds with a downstream budget ([`BudgetPlan`]).
    pub budget_seeds: u64,
    /// Throttles that paused the budget, and deliveries a paused budget handed back.
    pub budget_throttles: u64,
    pub budget_paused: u64,
    /// Seeds with priority lanes ([`LanePlan`]), and triggers put in the low lane.
    pub lane_seeds: u64,
    pub low_triggers: u64,
    /// Seeds with a long pause and a dead holder ([`LongPausePlan`]), and their backlogs'
    /// triggers.
    pub long_pause_seeds: u64,
    pub long_pause_backlog: u64,
    /// Of those seeds: with debounce waiters (way one), with a backlog (way two), and with the
    /// death aimed so that its carrier surfaces in the pause's last 30 s.
    pub long_pause_debounce_seeds: u64,
    pub long_pause_backlog_seeds: u64,
    pub long_pause_last_30_seeds: u64,
    /// Holders that died while the pause held; of those, ones whose carrier surfaced (30 s
    /// after, about) in the pause's last 30 s, and ones the recovery bound (4) checked.
    pub long_pause_deaths: u64,
    pub long_pause_late_carriers: u64,
    pub long_pause_checked: u64,
    /// Deaths aimed at a holder that found no run in progress (no death), or no pause within
    /// [`LONG_PAUSE_WAIT`] (the throttle a record's refusal, or late).
    pub long_pause_no_holder: u64,
    pub long_pause_no_pause: u64,
    /// Per aimed step ([`AIMS`]): requests that landed late ([`Fault::LandLate`]).
    pub landed_late: [u64; 9],
    /// Per aimed step: changes whose answer was lost, retries working ([`Fault::LoseChange`]).
    pub lost_changes: [u64; 9],
    /// Per aimed step: changes answered with an error, every retry failing.
    pub failed_changes: [u64; 9],
    /// Per aimed step: requests that took seconds to land or to answer ([`Fault::Slow`]).
    pub slow: [u64; 9],
    /// Per aimed step: requests refused, every retry failing, nothing taking effect
    /// ([`Fault::Refuse`]).
    pub refused: [u64; 9],
}

impl FaultCounts {
    /// A message written hidden for `delay`, which first carried its deferral hop if `new_hop`:
    /// if it carries an `afterToken`, a deferral (a new hop), or a retry (hidden for the retry
    /// delay). The watchdog's own pushes, which copy the delivery's message, are not counted.
    fn note_after_token(&mut self, message: &TriggerMessage, new_hop: bool, delay: Duration) {
        if message.after_token.is_none() {
            return;
        }
        if new_hop {
            self.after_token_deferrals += 1;
        } else if delay == RETRY_DELAY {
            self.after_token_retries += 1;
        }
    }
}

impl FaultCounts {
    /// A message written: a waiter that has waited more than one quiet period `quiet` is one
    /// written back to wait another (a new waiter has waited one).
    fn note_rewait(&mut self, message: &TriggerMessage, quiet: Option<Duration>) {
        if let (Some(wait), Some(quiet)) = (&message.wait, quiet)
            && message.kind == TriggerKind::Trigger
            && Duration::from_millis(wait.waited_ms) > quiet
        {
            self.waits_rewaited += 1;
        }
    }
}

fn step_index(op: Op) -> usize {
    RETRIED_STEPS
        .iter()
        .position(|o| *o == op)
        .expect("a retried step")
}

impl FaultCounts {
    /// Name and value of each count, for the report.
    pub fn rows(&self) -> Vec<(String, u64)> {
        let mut rows = vec![
            (
                "worker process crashes (logic killed with it)",
                self.process_crashes,
            ),
            (
                "whole Functions host deaths (messages hidden 10 min)",
                self.host_deaths,
            ),
            ("graceful shutdowns with hand-back", self.shutdowns),
            (
                "storage partitions of 15-60 s (longer than a lease)",
                self.partitions,
            ),
            ("requests with no answer (client time-out)", self.timeouts),
            (
                "requests that took effect after the client gave up",
                self.late_landings,
            ),
            (
                "transient storage errors (before or after effect)",
                self.transient_errors,
            ),
            (
                "host visibility lapses (redelivery to a live holder)",
                self.visibility_lapses,
            ),
            ("operator lease breaks", self.lease_breaks),
            ("seeds with storage's clock fast (up to 10 %)", self.skewed_clock),
            ("logic failures", self.logic_failures),
            ("logic panics", self.logic_panics),
            ("logic slow to stop (0-9 s, grace 5 s)", self.slow_stops),
            ("runs past their time limit", self.time_limits),
            ("triggers given up (poison limit 5)", self.poisoned),
            (
                "deliveries failed on storage after all retries",
                self.storage_failed_outcomes,
            ),
            ("deliveries whose run lost its lease", self.lease_lost_outcomes),
            ("rechecks (a held lease not trusted)", self.rechecks),
            ("failed runs retried through the watchdog", self.watchdog_retries),
            (
                "crashes right after a chosen request took effect",
                self.aimed_crashes,
            ),
            (
                "handlers down 60-300 s while their host delivers (crash loop)",
                self.crash_loops,
            ),
            (
                "triggers with a 30,000-character correlation id (near 64 KiB)",
                self.oversized_triggers,
            ),
            (
                "poison writes refused (outage, or an entry over 64 KiB)",
                self.poison_write_failures,
            ),
            (
                "messages the host poisoned itself (no reason, no sweep)",
                self.host_poisoned,
            ),
            (
                "in-process logic whose work ignores cancellation and outlives its future",
                self.detached_logic,
            ),
            (
                "sweeps that ask the marker first (a sweep's chain given up in turn)",
                self.conditional_sweeps,
            ),
            (
                "seeds whose queue hands out messages in random order",
                self.shuffled_delivery,
            ),
            (
                "marker puts that landed late, after someone looked (the retry answers 'already set')",
                self.puts_after_a_look,
            ),
            (
                "seeds with a record whose logic asks to run later for a while",
                self.throttled_seeds,
            ),
            ("runs whose logic asked to run later", self.deferrals_asked),
            ("deferrals persisted (chain hops)", self.deferrals_persisted),
            (
                "chains deferred more than MAX_ATTEMPTS (5) times",
                self.long_deferral_chains,
            ),
            (
                "triggers given up with their deferral budget spent",
                self.deferral_exhaustions,
            ),
            (
                "runs of a deferred chain checked against their hop (R1)",
                self.r1_checks,
            ),
            (
                "triggers dropped after two deferral budgets (a sweep's chain exhausted)",
                self.dropped_after_two_budgets,
            ),
            (
                "seeds with a supersede record (a stream of triggers during long runs)",
                self.supersede_seeds,
            ),
            (
                "runs superseded (stopped for a trigger that arrived during them)",
                self.supersedes,
            ),
            (
                "superseded runs slow to stop past their grace (lease kept until they ended)",
                self.supersedes_abandoned,
            ),
            (
                "superseded runs with no marker created after their lease was granted (spurious)",
                self.spurious_supersedes,
            ),
            (
                "runs of a supersede record not stopped though a marker was created during them",
                self.protected_runs,
            ),
            (
                "of those, fault-free, protected by the streak (3 in a row, or the run time limit)",
                self.protected_by_streak,
            ),
            ("markers during unprotected runs checked by S1", self.s1_checks),
            (
                "outcomes superseded (Functions), each matched to a stopped run",
                self.superseded_outcomes,
            ),
            (
                "seeds whose supersede record's runs fail 30-50 % in its window",
                self.supersede_failure_seeds,
            ),
            (
                "of those, its record throttled too",
                self.supersede_throttled_seeds,
            ),
            ("runs of a supersede record failed so", self.supersede_failures),
            (
                "retries written carrying an afterToken (their run noted itself pending)",
                self.after_token_retries,
            ),
            (
                "deferral hops written carrying an afterToken",
                self.after_token_deferrals,
            ),
            (
                "deliveries with an afterToken that stood down (a later run took their duty over)",
                self.after_token_stand_downs,
            ),
            ("triggers of a supersede record given up", self.supersede_give_ups),
            (
                "of those, a sweep's chain given up",
                self.supersede_sweep_give_ups,
            ),
            ("seeds with debounce records", self.debounce_seeds),
            (
                "of those, its scope superseding too or its record throttled",
                self.debounce_combined_seeds,
            ),
            ("wait markers created (a waiter owed)", self.waits_created),
            ("triggers that joined a wait", self.waits_joined),
            ("waiters written back to wait another period", self.waits_rewaited),
            (
                "waits concluded (a waiter's consume took the marker)",
                self.waits_concluded,
            ),
            (
                "waiters that found no marker (stand down unless owed)",
                self.waits_found_gone,
            ),
            (
                "stand-in consumes that took a wait marker (path C)",
                self.standin_consumes,
            ),
            ("bursts checked by B1", self.b1_checks),
            ("worker deaths during a waiter's wake", self.wake_deaths),
            (
                "seeds with a downstream budget (throttles pause it)",
                self.budget_seeds,
            ),
            ("runs throttled (the budget paused)", self.budget_throttles),
            (
                "deliveries a paused budget handed back (not attempts)",
                self.budget_paused,
            ),
            ("seeds with priority lanes (a low lane's queue)", self.lane_seeds),
            ("triggers put in the low lane", self.low_triggers),
            (
                "seeds with a long pause (60-300 s), few slots and a dead holder",
                self.long_pause_seeds,
            ),
            (
                "... with debounce waiters meeting it (way one)",
                self.long_pause_debounce_seeds,
            ),
            (
                "... with a backlog of triggers (way two)",
                self.long_pause_backlog_seeds,
            ),
            (
                "... with the death aimed at the pause's last 30 s",
                self.long_pause_last_30_seeds,
            ),
            (
                "triggers of a backlog during a long pause",
                self.long_pause_backlog,
            ),
            ("holders that died during a long pause", self.long_pause_deaths),
            (
                "... whose carrier surfaced in the pause's last 30 s",
                self.long_pause_late_carriers,
            ),
            (
                "... whose record the recovery bound checked",
                self.long_pause_checked,
            ),
            (
                "deaths aimed at a holder during a long pause that found none",
                self.long_pause_no_holder,
            ),
            (
                "... that found no pause (one record's refusal, or a throttle too late)",
                self.long_pause_no_pause,
            ),
        ];
        const LOST: [&str; 6] = [
            "lost answers aimed at a lease acquire (retried)",
            "lost answers aimed at a lease release (retried)",
            "lost answers aimed at a marker put (retried)",
            "lost answers aimed at a marker delete (retried)",
            "lost answers aimed at a queue put (retried)",
            "lost answers aimed at a queue delete (retried)",
        ];
        const FAILED: [&str; 6] = [
            "requests failed by an outage of lease acquires (5-30 s)",
            "requests failed by an outage of lease releases (5-30 s)",
            "requests failed by an outage of marker puts (5-30 s)",
            "requests failed by an outage of marker deletes (5-30 s)",
            "requests failed by an outage of queue puts (5-30 s)",
            "requests failed by an outage of queue deletes (5-30 s)",
        ];
        rows.extend(LOST.iter().zip(self.lost_answers).map(|(n, v)| (*n, v)));
        rows.extend(FAILED.iter().zip(self.failed_steps).map(|(n, v)| (*n, v)));
        let mut rows: Vec<(String, u64)> = rows.into_iter().map(|(n, v)| (n.to_string(), v)).collect();
        const STEPS: [&str; 7] = [
            "a contender's second acquire",
            "a marker put",
            "a new holder's clear of its own marker",
            "a holder's marker check after its release",
            "a wait marker's create",
            "a waiter's consume after its look",
            "a stand-in's consume of the wait marker",
        ];
        for (class, counts) in [
            ("requests that landed late (10-14 s) at", self.landed_late),
            ("changes whose answer was lost (retried) at", self.lost_changes),
            (
                "changes answered with an error (every retry failing) at",
                self.failed_changes,
            ),
            ("requests 1-9 s slow to land or to answer at", self.slow),
        ] {
            rows.extend(
                STEPS
                    .iter()
                    .zip(counts)
                    .map(|(step, v)| (format!("{class} {step}"), v)),
            );
        }
        // The retry-backoff supersede's own steps, each with the classes aimed at it.
        let (note, take) = (Aim::PendingNote.index(), Aim::DeferralTake.index());
        rows.extend([
            (
                "note writes refused (every retry failing) after a run that pends, superseding scope"
                    .to_string(),
                self.refused[note],
            ),
            (
                "note writes that landed, their answer lost and every retry failing, after a run that pends"
                    .to_string(),
                self.failed_changes[note],
            ),
            (
                "deferrals' marker takes that landed late (10-14 s; the retry may answer 'not there')"
                    .to_string(),
                self.landed_late[take],
            ),
            (
                "deferrals' marker takes that took a marker, their answer lost (the retry answers 'not there')"
                    .to_string(),
                self.lost_changes[take],
            ),
            (
                "deferrals' marker takes 1-9 s slow to land".to_string(),
                self.slow[take],
            ),
        ]);
        rows
    }

    pub fn add(&mut self, other: &FaultCounts) {
        let mut mine = self.rows();
        for (row, theirs) in mine.iter_mut().zip(other.rows()) {
            row.1 += theirs.1;
        }
        let v: Vec<u64> = mine.into_iter().map(|(_, v)| v).collect();
        *self = FaultCounts {
            process_crashes: v[0],
            host_deaths: v[1],
            shutdowns: v[2],
            partitions: v[3],
            timeouts: v[4],
            late_landings: v[5],
            transient_errors: v[6],
            visibility_lapses: v[7],
            lease_breaks: v[8],
            skewed_clock: v[9],
            logic_failures: v[10],
            logic_panics: v[11],
            slow_stops: v[12],
            time_limits: v[13],
            poisoned: v[14],
            storage_failed_outcomes: v[15],
            lease_lost_outcomes: v[16],
            rechecks: v[17],
            watchdog_retries: v[18],
            aimed_crashes: v[19],
            crash_loops: v[20],
            oversized_triggers: v[21],
            poison_write_failures: v[22],
            host_poisoned: v[23],
            detached_logic: v[24],
            conditional_sweeps: v[25],
            shuffled_delivery: v[26],
            puts_after_a_look: v[27],
            throttled_seeds: v[28],
            deferrals_asked: v[29],
            deferrals_persisted: v[30],
            long_deferral_chains: v[31],
            deferral_exhaustions: v[32],
            r1_checks: v[33],
            dropped_after_two_budgets: v[34],
            supersede_seeds: v[35],
            supersedes: v[36],
            supersedes_abandoned: v[37],
            spurious_supersedes: v[38],
            protected_runs: v[39],
            protected_by_streak: v[40],
            s1_checks: v[41],
            superseded_outcomes: v[42],
            supersede_failure_seeds: v[43],
            supersede_throttled_seeds: v[44],
            supersede_failures: v[45],
            after_token_retries: v[46],
            after_token_deferrals: v[47],
            after_token_stand_downs: v[48],
            supersede_give_ups: v[49],
            supersede_sweep_give_ups: v[50],
            debounce_seeds: v[51],
            debounce_combined_seeds: v[52],
            waits_created: v[53],
            waits_joined: v[54],
            waits_rewaited: v[55],
            waits_concluded: v[56],
            waits_found_gone: v[57],
            standin_consumes: v[58],
            b1_checks: v[59],
            wake_deaths: v[60],
            budget_seeds: v[61],
            budget_throttles: v[62],
            budget_paused: v[63],
            lane_seeds: v[64],
            low_triggers: v[65],
            long_pause_seeds: v[66],
            long_pause_debounce_seeds: v[67],
            long_pause_backlog_seeds: v[68],
            long_pause_last_30_seeds: v[69],
            long_pause_backlog: v[70],
            long_pause_deaths: v[71],
            long_pause_late_carriers: v[72],
            long_pause_checked: v[73],
            long_pause_no_holder: v[74],
            long_pause_no_pause: v[75],
            lost_answers: std::array::from_fn(|i| self.lost_answers[i] + other.lost_answers[i]),
            failed_steps: std::array::from_fn(|i| self.failed_steps[i] + other.failed_steps[i]),
            landed_late: std::array::from_fn(|i| self.landed_late[i] + other.landed_late[i]),
            lost_changes: std::array::from_fn(|i| self.lost_changes[i] + other.lost_changes[i]),
            failed_changes: std::array::from_fn(|i| self.failed_changes[i] + other.failed_changes[i]),
            slow: std::array::from_fn(|i| self.slow[i] + other.slow[i]),
            refused: std::array::from_fn(|i| self.refused[i] + other.refused[i]),
        };
    }
}

#[derive(Debug, Clone)]
struct RunRecord {
    machine: usize,
    record: String,
    token: Option<u64>,
    start: Instant,
    end: Option<Instant>,
    completed: bool,
    /// When the runner told the logic to stop (its cancellation fired), if it did.
    told: Option<Instant>,
    /// How long this logic takes to stop once told (0: at once).
    slow_stop: Duration,
    /// In-process logic whose work ignores cancellation and outlives its future.
    detached: bool,
    /// The logic asked to be run later: when it returned, and the delay it asked for.
    run_later: Option<(Instant, Option<Duration>)>,
    /// The chain's deferral so far, as the run was told (`RunContext::deferred`).
    deferred: Duration,
    /// The delivery number the run was told (`RunContext::attempt`).
    attempt: u32,
    /// The logic failed by injection (a retry of the same trigger may follow).
    failed: bool,
}

#[derive(Debug, Default)]
struct Journal {
    runs: Vec<RunRecord>,
    /// Accepted triggers: correlation id, record, time.
    accepted: Vec<(String, String, Instant)>,
    /// Budget pauses: when a throttle asked, and until when it paused the budget (or would
    /// have: one record's refusal pauses nothing).
    pauses: Vec<(Instant, Instant)>,
    /// A long-pause seed's pause ([`LongPausePlan`]) as its budget store held it when first
    /// seen: from, until.
    long_pause: Option<(Instant, Instant)>,
    /// When each external trigger was first received by a worker (for the coalescing check).
    arrivals: Vec<(String, Instant)>,
    /// Worker deaths: when, machine, the records it was running, restart pause, whole host.
    deaths: Vec<(Instant, usize, Vec<String>, Duration, bool)>,
    partitions: Vec<(Instant, Instant, usize)>,
    /// Requests that got no answer in time (each delays its caller by the time-out and the
    /// retry's late window).
    timeouts: Vec<Instant>,
    /// Lease renewals that got no answer in time: when, machine (a break goes unseen until the
    /// renewal after).
    renew_timeouts: Vec<(Instant, usize)>,
    breaks: Vec<(Instant, String)>,
    /// Gets that took effect but whose answer never came: their messages stay hidden for a
    /// whole visibility period (10 minutes under the Functions host), which no protocol shortens.
    lost_gets: Vec<Instant>,
    /// Poison entries: correlation id, record, time, how often its chain was given up before.
    poisoned: Vec<(Option<String>, String, Instant, u32)>,
    /// Poison entries of triggers whose deferral budget was spent: record, time, the chain's
    /// total deferral, how often its chain was given up before.
    exhausted: Vec<(String, Instant, Duration, u32)>,
    /// Deliveries by the emulated host whose DequeueCount was above 1: record, count, time.
    host_redeliveries: Vec<(String, u32, Instant)>,
    /// Deferrals seen on messages put or updated: the chain's id and the hop.
    deferrals: HashSet<(u64, u32)>,
    /// Messages the host poisoned itself: record, time.
    host_poisoned: Vec<(String, Instant)>,
    /// Outages of one kind of request on one machine ([`Fault::FailOp`]).
    step_outages: Vec<(Instant, Instant)>,
    /// Watchdogs a host took: record, machine, when.
    watchdog_takes: Vec<(String, usize, Instant)>,
    /// Watchdogs a handler put: record, machine, when.
    watchdog_puts: Vec<(String, usize, Instant)>,
    /// Retrigger markers created (a put that created it landed): the marker's key (`scope/record`),
    /// when.
    marker_sets: Vec<(String, Instant)>,
    /// Retrigger markers removed (a delete that removed one landed): the marker's key, when.
    marker_takes: Vec<(String, Instant)>,
    /// Leases granted to a worker: when, machine, the lock's key (`scope/record`).
    grants: Vec<(Instant, usize, String)>,
    /// A supersede watch found the marker set (`MarkerStore::is_set` answered yes to the runner):
    /// when, machine, record. The runner stops the run at that instant (see `check`).
    watch_fired: Vec<(Instant, usize, String)>,
    /// Deaths of a worker during a waiter's wake: when, the record.
    wake_deaths: Vec<(Instant, String)>,
    /// Outcomes `Superseded` the emulated host saw (Functions mode): record, fencing token.
    superseded_outcomes: Vec<(String, Option<u64>)>,
    /// Chains of deliveries, by number; and the chain of each message, by queue name and id
    /// (each emulated queue numbers its messages from 1, so a low lane's `m7` is not the high
    /// lane's; Azure's ids are GUIDs).
    chains: Vec<Chain>,
    message_chain: HashMap<(String, String), u64>,
    violations: Vec<Violation>,
    counts: FaultCounts,
}

/// Shared state of one simulated world.
pub struct World {
    rng: Mutex<SmallRng>,
    faults: AtomicBool,
    blob: Arc<MemoryStore>,
    markers: Arc<MemoryMarkers>,
    queue: Arc<MemoryQueue>,
    /// The low lane's queue ([`LanePlan`]), when the seed has one.
    low_queue: Option<Arc<MemoryQueue>>,
    journal: Mutex<Journal>,
    epoch: Instant,
    logic_rng: Mutex<SmallRng>,
    /// Per machine: storage unreachable until this instant.
    partitioned_until: Mutex<HashMap<usize, Instant>>,
    bad_record: Option<(String, Instant, Instant)>,
    bad_record_spares: f64,
    /// Per machine: the worker was stopped (its logic dies within the supervisor's second).
    dead_at: Mutex<HashMap<usize, Instant>>,
    /// Per machine: an aimed crash waiting for its request (see [`Fault::CrashAfter`]).
    crash_armed: Mutex<HashMap<usize, Fault>>,
    /// Per machine: the kinds of request whose next answer is lost ([`Fault::LoseAnswer`]).
    lose_armed: Mutex<HashMap<usize, Vec<Op>>>,
    /// Per machine: faults aimed at a step of the protocol, waiting for it ([`Fault::LandLate`],
    /// [`Fault::LoseChange`], [`Fault::Slow`]).
    aim_armed: Mutex<HashMap<usize, Vec<Fault>>>,
    /// Per record: when a marker delete last landed (someone looked at the marker).
    marker_looked: Mutex<HashMap<String, Instant>>,
    /// Per machine and kind of request: failing until this instant ([`Fault::FailOp`]).
    failing: Mutex<HashMap<(usize, Op), Instant>>,
    /// Per machine: the generation of its current worker.
    current_worker: Mutex<HashMap<usize, u64>>,
    /// Aimed crashes that fired, for the fault loop to carry out.
    crash_now: tokio::sync::mpsc::UnboundedSender<Fault>,
    /// The poison queue answers every write with a 503 in this window.
    poison_outage: Option<(Instant, Instant)>,
    /// The throttled record and its window ([`Throttle`]).
    throttle: Option<(String, Instant, Instant)>,
    /// The budgets' shared pauses ([`BudgetPlan`]), when the seed has one.
    budgets: Option<(Arc<MemoryBudgets>, BudgetPlan)>,
    /// The supersede record and its stream's window ([`SupersedePlan`]).
    supersede: Option<(String, Instant, Instant)>,
    /// Share of the supersede record's runs in its window that fail ([`Plan::supersede_failures`]).
    supersede_failures: f64,
    /// Until when they fail ([`Plan::supersede_failing_tail`] after the window).
    supersede_failing_until: Option<Instant>,
    /// The supersede record's runs that ask to run later do so early ([`Plan::supersede_defers_early`]).
    supersede_defers_early: bool,
    /// Debounce's quiet period Q ([`DebouncePlan`]).
    debounce_quiet: Option<Duration>,
    /// The longest pause of the budget ([`BudgetPlan::max_pause`]).
    max_pause: Duration,
    /// [`LongPausePlan`]: the throttled record's `Retry-After`, and until when a run of the
    /// victim that starts is long.
    long_pause: Option<(Duration, Instant)>,
    /// Per machine: the records (keys) whose waiter's wake is in progress there, from its look
    /// at the wait marker until the worker's next lock or marker request on the record, a queue
    /// write of the record's message, or a look or consume that found no marker (see
    /// [`Node::step`]): a death meanwhile counts like a holder's for the recovery bound.
    wakes: Mutex<HashMap<usize, HashSet<String>>>,
    /// Each message's body as a worker last received it, by queue name and id; and per machine and message
    /// id, the record (key) of a waiter rewritten in place, its update in flight: the wake ends
    /// when the update lands (the message is then the next waiter, not a dead wake's
    /// redelivery), not when its answer comes back.
    received: Mutex<HashMap<(String, String), String>>,
    wake_writes: Mutex<HashMap<(usize, String), String>>,
}

impl World {
    fn chance(&self, p: f64) -> bool {
        self.faults.load(Ordering::SeqCst) && self.rng.lock().unwrap().random_bool(p)
    }

    fn delay(&self) -> Duration {
        Duration::from_millis(self.rng.lock().unwrap().random_range(0..250))
    }

    fn at(&self, t: Instant) -> f64 {
        (t - self.epoch).as_secs_f64()
    }

    fn count(&self, f: impl FnOnce(&mut FaultCounts)) {
        f(&mut self.journal.lock().unwrap().counts);
    }

    /// Notes that a waiter's wake on `machine` for `key` started (`true`) or ended.
    fn wake(&self, machine: usize, key: &str, started: bool) {
        let mut wakes = self.wakes.lock().unwrap();
        let keys = wakes.entry(machine).or_default();
        if started {
            keys.insert(key.to_string());
        } else {
            keys.remove(key);
        }
    }

    fn partitioned(&self, machine: usize) -> bool {
        self.partitioned_until
            .lock()
            .unwrap()
            .get(&machine)
            .is_some_and(|until| Instant::now() < *until)
    }
}

/// One process's view of storage: delays, transient failures, time-outs with late landings, and
/// silence once the process is dead.
#[derive(Clone)]
struct Node {
    world: Arc<World>,
    machine: usize,
    alive: Arc<AtomicBool>,
    counters: OpCounters,
    /// A worker's requests (not the emulated host's) are where aimed crashes fire: those of
    /// the machine's current worker, `Some(its generation)`, not of one still shutting down.
    aimable: Option<u64>,
    /// Per record: this worker's latest lock or marker request ([`STEP_OPS`]), which tells the
    /// step of the protocol its next one is ([`Aim`]).
    steps: Arc<Mutex<HashMap<String, Op>>>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Node")
    }
}

impl Node {
    async fn pend_if_dead(&self) {
        if !self.alive.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
    }

    /// `late`: whether a request that got no answer may still land afterwards.
    async fn call_with<T: Send + 'static>(
        &self,
        op: Op,
        target: &str,
        effect: Effect<T>,
        late: bool,
    ) -> StoreResult<T> {
        self.pend_if_dead().await;
        self.counters.record(op);
        let world = &self.world;
        let (record, prev) = self.step(op, target);
        let sent = Instant::now();
        let effect = self.landing(op, record, prev, sent, effect);
        let effect = self.wake_write_landing(op, target, effect);
        if world.partitioned(self.machine) || world.chance(0.002) {
            // No answer within the client's time-out; the request may still land afterwards.
            {
                let mut j = world.journal.lock().unwrap();
                j.counts.timeouts += 1;
                j.timeouts.push(Instant::now());
                if op == Op::LeaseRenew {
                    j.renew_timeouts.push((Instant::now(), self.machine));
                }
            }
            if late && world.rng.lock().unwrap().random_bool(0.5) {
                let late = CLIENT_TIMEOUT
                    + Duration::from_millis(world.rng.lock().unwrap().random_range(0..LATE_MAX_MS));
                world.count(|c| c.late_landings += 1);
                tokio::spawn(async move {
                    tokio::time::sleep(late).await;
                    let _ = effect.await;
                });
            }
            tokio::time::sleep(CLIENT_TIMEOUT).await;
            self.pend_if_dead().await;
            return Err(StoreError::timeout(op, CLIENT_TIMEOUT));
        }
        if let Some(Fault::LandLate { aim, late, .. }) = self.take_aimed(op, prev, target, |f| match f {
            Fault::LandLate { aim, .. } => Some(*aim),
            _ => None,
        }) {
            {
                let mut j = world.journal.lock().unwrap();
                j.counts.landed_late[aim.index()] += 1;
                j.timeouts.push(Instant::now());
            }
            tokio::spawn(async move {
                tokio::time::sleep(late).await;
                let _ = effect.await;
            });
            tokio::time::sleep(CLIENT_TIMEOUT).await;
            self.pend_if_dead().await;
            return Err(StoreError::timeout(op, CLIENT_TIMEOUT));
        }
        tokio::time::sleep(world.delay()).await;
        self.pend_if_dead().await;
        if let Some(Fault::Refuse { aim, failing_for, .. }) = self.take_aimed(op, prev, target, |f| match f {
            Fault::Refuse { aim, .. } => Some(*aim),
            _ => None,
        }) {
            // Refused below, with every request of its kind from this machine for a while.
            let now = Instant::now();
            world
                .failing
                .lock()
                .unwrap()
                .insert((self.machine, op), now + failing_for);
            let mut j = world.journal.lock().unwrap();
            j.counts.refused[aim.index()] += 1;
            j.step_outages.push((now, now + failing_for));
        }
        let failing = world
            .failing
            .lock()
            .unwrap()
            .get(&(self.machine, op))
            .is_some_and(|until| Instant::now() < *until);
        if failing && world.faults.load(Ordering::SeqCst) {
            // (An aimed outage of a wait marker's create or delete is counted as its aim.)
            if RETRIED_STEPS.contains(&op) {
                world.count(|c| c.failed_steps[step_index(op)] += 1);
            }
            return Err(
                StoreError::new(StoreErrorKind::Transient, op, "injected outage of one step")
                    .with_status(503, None),
            );
        }
        if world.chance(0.02) {
            world.count(|c| c.transient_errors += 1);
            return Err(
                StoreError::new(StoreErrorKind::Transient, op, "injected before").with_status(503, None)
            );
        }
        let mut slow_answer = Duration::ZERO;
        if let Some(Fault::Slow {
            aim,
            to_land,
            to_answer,
            ..
        }) = self.take_aimed(op, prev, target, |f| match f {
            Fault::Slow { aim, .. } => Some(*aim),
            _ => None,
        }) {
            {
                let mut j = world.journal.lock().unwrap();
                j.counts.slow[aim.index()] += 1;
                j.timeouts.push(Instant::now());
            }
            tokio::time::sleep(to_land).await;
            self.pend_if_dead().await;
            slow_answer = to_answer;
        }
        let result = effect.await;
        let took = self.note_taken(op, &result);
        self.crash_if_aimed_at(op).await;
        if self.lose_if_aimed_at(op) {
            tokio::time::sleep(CLIENT_TIMEOUT).await;
            self.pend_if_dead().await;
            return Err(StoreError::timeout(op, CLIENT_TIMEOUT));
        }
        if changed(&result)
            && let Some(Fault::LoseChange { aim, failing_for, .. }) =
                self.take_aimed(op, prev, target, |f| match f {
                    Fault::LoseChange { aim, .. } => Some(*aim),
                    _ => None,
                })
        {
            let now = Instant::now();
            {
                let mut j = world.journal.lock().unwrap();
                j.timeouts.push(now);
                if failing_for.is_zero() {
                    j.counts.lost_changes[aim.index()] += 1;
                } else {
                    j.counts.failed_changes[aim.index()] += 1;
                    j.step_outages.push((now, now + failing_for));
                }
            }
            if !failing_for.is_zero() {
                world
                    .failing
                    .lock()
                    .unwrap()
                    .insert((self.machine, op), now + failing_for);
            }
            tokio::time::sleep(CLIENT_TIMEOUT).await;
            self.pend_if_dead().await;
            return Err(StoreError::timeout(op, CLIENT_TIMEOUT));
        }
        if !slow_answer.is_zero() {
            tokio::time::sleep(slow_answer).await;
            self.pend_if_dead().await;
        }
        if std::env::var_os("LEASEHOLD_SIM_TRACE").is_some() {
            println!(
                "t={:.3}s machine {} {op}: {:?}",
                world.at(Instant::now()),
                self.machine,
                result.as_ref().err().map(|e| e.to_string())
            );
        }
        tokio::time::sleep(world.delay()).await;
        self.pend_if_dead().await;
        if world.chance(0.01) {
            // Took effect; the answer was lost (the caller retries after its late window).
            world.count(|c| c.transient_errors += 1);
            if took {
                // What the get took stays hidden for a whole visibility period, owned by nobody.
                let now = Instant::now();
                world.journal.lock().unwrap().lost_gets.push(now);
            }
            return Err(StoreError::timeout(op, CLIENT_TIMEOUT));
        }
        result
    }

    /// The record a lock or marker request is about, and this worker's previous such request on
    /// it (which tells the step of the protocol this one is); notes this one as the latest.
    fn step(&self, op: Op, target: &str) -> (Option<String>, Option<Op>) {
        if !STEP_OPS.contains(&op) || self.aimable.is_none() {
            return (None, None);
        }
        let record = target
            .strip_prefix(leasehold_lock::LOCK_PREFIX)
            .unwrap_or(target)
            .to_string();
        // A lock or marker request's step is told by the previous lock or marker request, as it
        // was before debounce (stand-ins consume wait markers in every seed: counted in, they
        // would change which step a request is, and with it every seed's plan); a wait marker
        // request's by the previous request of either kind.
        let mut steps = self.steps.lock().unwrap();
        let any = steps.insert(format!("{record}\u{0}any"), op);
        let prev = if WAIT_OPS.contains(&op) {
            any
        } else {
            steps.insert(record.clone(), op)
        };
        drop(steps);
        // A waiter's wake starts with its look; its consume is part of it; any other request on
        // the record ends it (a carried-on waiter's acquire, or another delivery's).
        if op == Op::WaitHead {
            self.world.wake(self.machine, &record, true);
        } else if op != Op::WaitDelete {
            self.world.wake(self.machine, &record, false);
        }
        (Some(record), prev)
    }

    /// The request's effect, noting when it lands: a lease granted, a marker created (for the
    /// supersede checks); a marker delete is someone looking at the
    /// marker; a marker put that lands after its caller gave up on it and creates the marker
    /// after someone looked since it was sent is counted (the caller's retry hears "already set"
    /// of its own put, and the holder it relied on has looked already).
    fn landing<T: Send + 'static>(
        &self,
        op: Op,
        record: Option<String>,
        prev: Option<Op>,
        sent: Instant,
        effect: Effect<T>,
    ) -> Effect<T> {
        let world = self.world.clone();
        let machine = self.machine;
        if let Some(record) = record
            .clone()
            .filter(|_| matches!(op, Op::WaitPut | Op::WaitHead | Op::WaitDelete))
        {
            // Debounce: counts what each wait marker request did when it landed; a look or a
            // waiter's consume that found no marker ends the wake (it stands down, or, owed,
            // carries on to the lock).
            return Box::pin(async move {
                let result = effect.await;
                let value = result.as_ref().ok().map(|v| v as &dyn std::any::Any);
                let created = value.and_then(|v| v.downcast_ref::<Option<String>>());
                let consumed = value.and_then(|v| v.downcast_ref::<WaitConsumed>());
                let after_look = prev == Some(Op::WaitHead);
                let mut gone = false;
                world.count(|c| match (op, created, consumed) {
                    (Op::WaitPut, Some(Some(_)), _) => c.waits_created += 1,
                    (Op::WaitPut, Some(None), _) => c.waits_joined += 1,
                    (Op::WaitHead, Some(None), _) => {
                        c.waits_found_gone += 1;
                        gone = true;
                    }
                    (Op::WaitDelete, _, Some(WaitConsumed::Consumed)) if after_look => c.waits_concluded += 1,
                    (Op::WaitDelete, _, Some(WaitConsumed::Gone)) if after_look => {
                        c.waits_found_gone += 1;
                        gone = true;
                    }
                    (Op::WaitDelete, _, Some(WaitConsumed::Consumed)) if prev != Some(Op::WaitDelete) => {
                        c.standin_consumes += 1
                    }
                    _ => {}
                });
                if gone {
                    world.wake(machine, &record, false);
                }
                result
            });
        }
        let Some(record) = record.filter(|_| matches!(op, Op::FlagPut | Op::FlagDelete | Op::LeaseAcquire))
        else {
            return effect;
        };
        Box::pin(async move {
            let result = effect.await;
            let now = Instant::now();
            if op == Op::LeaseAcquire {
                if result.is_ok() {
                    world.journal.lock().unwrap().grants.push((now, machine, record));
                }
                return result;
            }
            if op == Op::FlagPut && changed(&result) {
                world
                    .journal
                    .lock()
                    .unwrap()
                    .marker_sets
                    .push((record.clone(), now));
            }
            if op == Op::FlagDelete && changed(&result) {
                world
                    .journal
                    .lock()
                    .unwrap()
                    .marker_takes
                    .push((record.clone(), now));
            }
            let mut looked = world.marker_looked.lock().unwrap();
            if op == Op::FlagDelete {
                looked.insert(record, now);
            } else if now >= sent + CLIENT_TIMEOUT
                && changed(&result)
                && looked.get(&record).is_some_and(|t| *t > sent)
            {
                drop(looked);
                world.count(|c| c.puts_after_a_look += 1);
            }
            result
        })
    }

    /// A waiter rewritten in place ([`World::wake_writes`]): its wake ends when the update lands.
    fn wake_write_landing<T: Send + 'static>(&self, op: Op, target: &str, effect: Effect<T>) -> Effect<T> {
        if op != Op::QueueUpdate {
            return effect;
        }
        let Some(key) = self
            .world
            .wake_writes
            .lock()
            .unwrap()
            .remove(&(self.machine, target.to_string()))
        else {
            return effect;
        };
        let (world, machine) = (self.world.clone(), self.machine);
        Box::pin(async move {
            let result = effect.await;
            if result.is_ok() {
                world.wake(machine, &key, false);
            }
            result
        })
    }

    /// The first fault armed for this machine of the class `class` picks out (by its aim) whose
    /// step this request is: taken, it fires once.
    fn take_aimed(
        &self,
        op: Op,
        prev: Option<Op>,
        target: &str,
        class: impl Fn(&Fault) -> Option<Aim>,
    ) -> Option<Fault> {
        if !self.world.faults.load(Ordering::SeqCst) || self.aimable.is_none() {
            return None;
        }
        let mut armed = self.world.aim_armed.lock().unwrap();
        let faults = armed.get_mut(&self.machine)?;
        let last = || self.last_run(op, target);
        let i = faults
            .iter()
            .position(|f| class(f).is_some_and(|aim| aim.matches(op, prev, &last)))?;
        Some(faults.remove(i))
    }

    /// How this machine's latest run of the record a lock blob metadata write or a marker
    /// delete is about ended ([`LastRun`]; `Running` for any other request).
    fn last_run(&self, op: Op, target: &str) -> LastRun {
        let lock_write = op == Op::BlobSetMetadata && target.starts_with(leasehold_lock::LOCK_PREFIX);
        if !lock_write && op != Op::FlagDelete {
            return LastRun::Running;
        }
        let record = target.rsplit('/').next().unwrap_or(target);
        let j = self.world.journal.lock().unwrap();
        match j
            .runs
            .iter()
            .rev()
            .find(|r| r.machine == self.machine && r.record == record)
        {
            None => LastRun::Running,
            Some(r) if r.end.is_none() => LastRun::Running,
            Some(r) if r.run_later.is_some() => LastRun::Deferred,
            Some(r) if !r.completed && r.told.is_none() => LastRun::Failed,
            Some(_) => LastRun::Other,
        }
    }

    /// A lost answer armed for this machine and `op` fires (the request took effect): says so.
    fn lose_if_aimed_at(&self, op: Op) -> bool {
        if !self.world.faults.load(Ordering::SeqCst) || self.aimable.is_none() {
            return false;
        }
        let mut armed = self.world.lose_armed.lock().unwrap();
        let Some(ops) = armed.get_mut(&self.machine) else {
            return false;
        };
        let Some(i) = ops.iter().position(|o| *o == op) else {
            return false;
        };
        ops.remove(i);
        drop(armed);
        // As late as a time-out: the recovery bound excuses it like one.
        let mut j = self.world.journal.lock().unwrap();
        j.counts.lost_answers[step_index(op)] += 1;
        j.timeouts.push(Instant::now());
        true
    }

    /// An aimed crash armed for this machine and `op` fires: the request has taken effect, and
    /// the process dies before it sees the answer.
    async fn crash_if_aimed_at(&self, op: Op) {
        let fired = {
            let mut armed = self.world.crash_armed.lock().unwrap();
            match armed.get(&self.machine) {
                Some(Fault::CrashAfter { op: o, .. })
                    if *o == op
                        && self.world.faults.load(Ordering::SeqCst)
                        && self.aimable.is_some()
                        && self.aimable
                            == self
                                .world
                                .current_worker
                                .lock()
                                .unwrap()
                                .get(&self.machine)
                                .copied() =>
                {
                    armed.remove(&self.machine)
                }
                _ => None,
            }
        };
        if let Some(fault) = fired {
            self.world.count(|c| c.aimed_crashes += 1);
            let _ = self.world.crash_now.send(fault);
            std::future::pending::<()>().await;
        }
    }

    /// A queue get landed: a trigger arrives when a worker first receives it. Says whether the
    /// get took messages.
    fn note_taken<T: 'static>(&self, op: Op, result: &StoreResult<T>) -> bool {
        if op != Op::QueueGet {
            return false;
        }
        let Some(Ok(taken)) = (result as &dyn std::any::Any).downcast_ref::<StoreResult<Vec<Received>>>()
        else {
            return false;
        };
        let now = Instant::now();
        let mut j = self.world.journal.lock().unwrap();
        for m in taken {
            if let Ok(t) = TriggerMessage::decode(&m.body)
                && t.kind == TriggerKind::Trigger
                && m.dequeue_count == 1
                // A waiter's wake (under the Functions host a first delivery of a trigger) is no
                // trigger arriving.
                && t.wait.is_none()
            {
                j.arrivals.push((t.record_id.to_string(), now));
            }
        }
        !taken.is_empty()
    }

    /// The low lane's queue of this node, when the seed has one: every request through it.
    fn low_queue(&self) -> Option<Arc<dyn TriggerQueue>> {
        let low = self.world.low_queue.clone()?;
        Some(Arc::new(FaultyQueue::new(low, self.clone())))
    }

    /// The lock store, marker store and queue of this node: every request through it.
    fn stores(&self) -> (Arc<dyn LeaseStore>, Arc<dyn MarkerStore>, Arc<dyn TriggerQueue>) {
        let world = &self.world;
        (
            Arc::new(FaultyStore::new(world.blob.clone(), self.clone())),
            Arc::new(FaultyMarkers::new(world.markers.clone(), self.clone())),
            Arc::new(FaultyQueue::new(world.queue.clone(), self.clone())),
        )
    }
}

#[async_trait]
impl Interceptor for Node {
    async fn call<T: Send + 'static>(&self, op: Op, target: &str, effect: Effect<T>) -> StoreResult<T> {
        if matches!(op, Op::QueuePeek | Op::QueueProperties) {
            // Only operators' tools look at the queue's length: no faults, not counted.
            return effect.await;
        }
        // No late landings for gets: a get whose answer is lost already hides what it took for
        // a whole visibility period without an owner (see `note_taken`); late, it is the same.
        let result = self.call_with(op, target, effect, op != Op::QueueGet).await;
        // A supersede watch's read of the marker (its only use of `is_set`) that finds it set:
        // the runner stops the run now.
        if op == Op::BlobProperties
            && self.aimable.is_some()
            && !target.starts_with(leasehold_lock::LOCK_PREFIX)
            && matches!(
                (&result as &dyn std::any::Any).downcast_ref::<StoreResult<bool>>(),
                Some(Ok(true))
            )
        {
            let record = target.rsplit('/').next().unwrap_or(target).to_string();
            self.world
                .journal
                .lock()
                .unwrap()
                .watch_fired
                .push((Instant::now(), self.machine, record));
        }
        result
    }

    fn counters(&self) -> &OpCounters {
        &self.counters
    }
}

/// Poison queue that records what lands in it. Like a real queue it refuses an entry over 64 KiB
/// (413), and during the plan's poison outage it answers every write with a 503.
struct PoisonSink(Arc<World>, OpCounters);

impl std::fmt::Debug for PoisonSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PoisonSink")
    }
}

/// The sim's correlation ids are `t<index>`; an oversized one continues after a `~`.
fn trigger_name(correlation_id: Option<String>) -> Option<String> {
    correlation_id.map(|c| c.split('~').next().unwrap_or_default().to_string())
}

impl PoisonSink {
    /// An entry the handler wrote: the trigger and its reason.
    fn record(world: &World, trigger: Option<TriggerMessage>) {
        let mut j = world.journal.lock().unwrap();
        j.counts.poisoned += 1;
        let (corr, record, given_up) = trigger.map_or((None, String::new(), 0), |t| {
            (
                trigger_name(t.correlation_id),
                t.record_id.to_string(),
                t.given_up,
            )
        });
        j.poisoned.push((corr, record, Instant::now(), given_up));
    }

    /// A message the host poisoned itself (its `maxDequeueCount` invocations failed): no
    /// reason and no sweep, so it excuses nothing — a trigger it carried counts as lost.
    fn record_by_host(world: &World, message: TriggerMessage) {
        let mut j = world.journal.lock().unwrap();
        j.counts.host_poisoned += 1;
        j.host_poisoned
            .push((message.record_id.to_string(), Instant::now()));
    }
}

#[async_trait]
impl TriggerQueue for PoisonSink {
    fn name(&self) -> &str {
        "sim-poison"
    }
    async fn put(&self, body: &str, _delay: Duration) -> StoreResult<Enqueued> {
        let world = &self.0;
        if world
            .poison_outage
            .is_some_and(|(from, to)| (from..to).contains(&Instant::now()))
        {
            world.count(|c| c.poison_write_failures += 1);
            return Err(
                StoreError::new(StoreErrorKind::Transient, Op::QueuePut, "poison queue outage")
                    .with_status(503, None),
            );
        }
        if body.len() > leasehold_runtime::MAX_MESSAGE_BYTES {
            world.count(|c| c.poison_write_failures += 1);
            return Err(
                StoreError::new(StoreErrorKind::Rejected, Op::QueuePut, "entry over 64 KiB")
                    .with_status(413, Some("RequestBodyTooLarge".into())),
            );
        }
        let entry = PoisonMessage::decode(body).expect("poison entries decode");
        // Error::DeferralExhausted's text (the trigger's total is in its message).
        if entry.reason().contains("LEASEHOLD_MAX_DEFERRAL_SECONDS")
            && let Some(trigger) = &entry.trigger
        {
            let mut j = world.journal.lock().unwrap();
            j.counts.deferral_exhaustions += 1;
            let total = trigger.deferral.map_or(Duration::ZERO, |d| d.total());
            j.exhausted.push((
                trigger.record_id.to_string(),
                Instant::now(),
                total,
                trigger.given_up,
            ));
        }
        PoisonSink::record(world, entry.trigger);
        Ok(Enqueued {
            id: String::new(),
            pop_receipt: String::new(),
        })
    }
    async fn get(&self, _max: u32, _v: Duration) -> StoreResult<Vec<Received>> {
        Ok(Vec::new())
    }
    async fn delete(&self, _id: &str, _r: &str) -> StoreResult<()> {
        Ok(())
    }
    async fn set_visibility(&self, _: &str, _: &str, _: &str, _: Duration) -> StoreResult<String> {
        Ok(String::new())
    }
    async fn approximate_len(&self) -> StoreResult<u64> {
        Ok(0)
    }
    fn counters(&self) -> &OpCounters {
        &self.1
    }
}

tokio::task_local! {
    /// Under the emulated Functions host: the chain (see [`Chain`]) of the delivery being
    /// handled, for the messages it puts.
    static DELIVERY_CHAIN: u64;
}

/// A chain of deliveries, as the simulation itself traces it (not as the messages say): a
/// message and what carries on its duty — its watchdog, retries and rechecks — are one chain; a
/// retrigger or a trigger starts a new one; a sweep starts a new *sweep* chain.
#[derive(Debug, Clone, Copy)]
struct Chain {
    /// Whether the chain is a sweep's (`None`: unknown, a message whose put went unseen).
    sweep: Option<bool>,
}

impl Chain {
    /// The chain a message of `kind` starts when no delivery is known to have put it: a sweep's,
    /// fresh events', or (a watchdog or recheck of some unknown chain) unknown.
    fn started_by(kind: TriggerKind) -> Self {
        let sweep = match kind {
            TriggerKind::Sweep => Some(true),
            TriggerKind::Trigger | TriggerKind::Retrigger => Some(false),
            TriggerKind::Watchdog | TriggerKind::Recheck => None,
        };
        Self { sweep }
    }
}

impl Journal {
    /// The chain a message belongs to (made when it is first delivered, if its put was not seen).
    fn chain_of(&mut self, queue: &str, id: &str, message: &TriggerMessage) -> u64 {
        let id = (queue.to_string(), id.to_string());
        if let Some(chain) = self.message_chain.get(&id) {
            return *chain;
        }
        let chain = self.new_chain(Chain::started_by(message.kind));
        self.message_chain.insert(id, chain);
        chain
    }

    fn new_chain(&mut self, chain: Chain) -> u64 {
        self.chains.push(chain);
        self.chains.len() as u64 - 1
    }

    /// A message put by a delivery of chain `parent` (`None`: not known, outside the emulated
    /// host). A sweep that asks the marker first (`given_up` >= 2) may come only from a sweep's
    /// chain that kept failing: from anything else — fresh events — it can drop a trigger.
    fn note_put(&mut self, queue: &str, id: &str, message: &TriggerMessage, parent: Option<u64>) {
        let chain = match (message.kind, parent) {
            (TriggerKind::Watchdog | TriggerKind::Recheck, Some(parent)) => parent,
            (kind, _) => self.new_chain(Chain::started_by(kind)),
        };
        self.message_chain
            .insert((queue.to_string(), id.to_string()), chain);
        if std::env::var_os("LEASEHOLD_SIM_TRACE").is_some() {
            println!(
                "chain: put {queue} {id} {:?} {} given_up={} after_token={:?} deferral={:?} by chain {parent:?} -> chain {chain} (sweep: {:?})",
                message.kind,
                message.record_id,
                message.given_up,
                message.after_token,
                message.deferral.map(|d| (d.id, d.hops)),
                self.chains[chain as usize].sweep
            );
        }
        if message.kind == TriggerKind::Sweep && message.given_up >= 2 {
            self.counts.conditional_sweeps += 1;
        }
        if message.kind == TriggerKind::Sweep
            && message.given_up >= 2
            && let Some(parent) = parent
            && self.chains[parent as usize].sweep == Some(false)
        {
            self.violations.push(Violation::Lost(format!(
                "{}: a sweep that asks the marker first (given up {} times) was queued for a chain of fresh events, not a sweep's: a trigger that coalesced onto that chain can be dropped",
                message.record_id, message.given_up
            )));
        }
    }
}

/// Seed 9153 (with the aims at the retry-backoff supersede's steps): two lanes' queues both
/// number their messages from `m1`; a sweep's chain must stay a sweep's though the other lane's
/// message of the same id belongs to fresh events, and its sweep given up again is no violation.
#[test]
fn chains_are_told_apart_by_queue_as_well_as_id() {
    let mut j = Journal::default();
    let trigger = TriggerMessage::parse("sup", "r0").unwrap();
    let mut sweep = trigger.follow_up(TriggerKind::Sweep, 0);
    sweep.given_up = 1;
    // The high lane's sweep, given up once, and its watchdog m227.
    let sweeps = j.chain_of("sim", "m10", &sweep);
    j.note_put(
        "sim",
        "m227",
        &sweep.follow_up(TriggerKind::Watchdog, 0),
        Some(sweeps),
    );
    // The low lane's own m227, a watchdog of fresh events.
    let fresh = j.chain_of("sim-low", "m9", &trigger);
    j.note_put(
        "sim-low",
        "m227",
        &trigger.follow_up(TriggerKind::Watchdog, 0),
        Some(fresh),
    );
    // The high lane's m227 delivered, given up: its sweep asks the marker first, rightly.
    let delivered = j.chain_of("sim", "m227", &sweep);
    assert_eq!(delivered, sweeps);
    let mut again = sweep.clone();
    again.given_up = 2;
    j.note_put("sim", "m253", &again, Some(delivered));
    assert!(j.violations.is_empty(), "{:?}", j.violations);
}

/// A worker's trigger queue, noting every watchdog it put (for the double fault the recovery
/// check recognises: a host that took a dead holder's watchdog and died before its handler had
/// put one of its own).
struct NotingQueue {
    inner: Arc<dyn TriggerQueue>,
    world: Arc<World>,
    machine: usize,
}

impl std::fmt::Debug for NotingQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NotingQueue")
    }
}

#[async_trait]
impl TriggerQueue for NotingQueue {
    fn name(&self) -> &str {
        self.inner.name()
    }
    async fn put(&self, body: &str, delay: Duration) -> StoreResult<Enqueued> {
        let parent = DELIVERY_CHAIN.try_with(|c| *c).ok();
        let put = self.inner.put(body, delay).await;
        if let Ok(t) = TriggerMessage::decode(body) {
            self.world.wake(self.machine, t.key().as_str(), false);
            let mut j = self.world.journal.lock().unwrap();
            let new_hop = t.deferral.is_some_and(|d| j.deferrals.insert((d.id, d.hops)));
            if put.is_ok() {
                j.counts.note_after_token(&t, new_hop, delay);
                j.counts.note_rewait(&t, self.world.debounce_quiet);
            }
            if t.kind == TriggerKind::Watchdog {
                // Noted even when the answer was lost: the watchdog may be there.
                j.watchdog_puts
                    .push((t.record_id.to_string(), self.machine, Instant::now()));
            }
            if let Ok(enqueued) = &put {
                j.note_put(self.inner.name(), &enqueued.id, &t, parent);
            }
        }
        put
    }
    async fn get(&self, max: u32, visibility: Duration) -> StoreResult<Vec<Received>> {
        let got = self.inner.get(max, visibility).await;
        if std::env::var_os("LEASEHOLD_SIM_TRACE").is_some() {
            println!(
                "t={:.3}s machine {} got {} of {max} from {}",
                self.world.at(Instant::now()),
                self.machine,
                got.as_ref().map_or(0, Vec::len),
                self.inner.name()
            );
        }
        if let Ok(messages) = &got {
            let mut received = self.world.received.lock().unwrap();
            for m in messages {
                received.insert((self.inner.name().to_string(), m.id.clone()), m.body.clone());
            }
        }
        got
    }
    async fn delete(&self, id: &str, receipt: &str) -> StoreResult<()> {
        self.inner.delete(id, receipt).await
    }
    async fn set_visibility(&self, id: &str, receipt: &str, body: &str, v: Duration) -> StoreResult<String> {
        // A waiter written back in place (not a renewal, which keeps the body as received).
        if let Ok(t) = TriggerMessage::decode(body)
            && t.wait.is_some()
            && self
                .world
                .received
                .lock()
                .unwrap()
                .get(&(self.inner.name().to_string(), id.to_string()))
                .is_some_and(|b| b != body)
        {
            self.world
                .wake_writes
                .lock()
                .unwrap()
                .insert((self.machine, id.to_string()), t.key().as_str().to_string());
        }
        let updated = self.inner.set_visibility(id, receipt, body, v).await;
        // A deferral persisted in place (standalone) or into the watchdog (Functions); a retry
        // (standalone: the message itself, made visible after the retry delay).
        if let Ok(t) = TriggerMessage::decode(body) {
            self.world.wake(self.machine, t.key().as_str(), false);
        }
        if updated.is_ok()
            && let Ok(t) = TriggerMessage::decode(body)
        {
            let mut j = self.world.journal.lock().unwrap();
            let new_hop = t.deferral.is_some_and(|d| j.deferrals.insert((d.id, d.hops)));
            j.counts.note_after_token(&t, new_hop, v);
            j.counts.note_rewait(&t, self.world.debounce_quiet);
        }
        updated
    }
    async fn approximate_len(&self) -> StoreResult<u64> {
        self.inner.approximate_len().await
    }
    fn counters(&self) -> &OpCounters {
        self.inner.counters()
    }
}

/// The panic message of injected logic panics (kept out of the test output).
const INJECTED_PANIC: &str = "sim: injected logic panic";

/// Logic that records each run, honours cancellation (sometimes slowly), sometimes fails or
/// panics, sometimes overruns its time limit, and dies with its worker.
struct SimLogic {
    world: Arc<World>,
    killed: CancellationToken,
    machine: usize,
}

/// Ends a run record when the run ends, however it ends (returns, is dropped, panics).
struct ActiveRun {
    world: Arc<World>,
    index: usize,
    done: bool,
    /// The logic returned (or panicked). A run dropped before that was abandoned by the runner:
    /// its command's supervisor sees its stdin close and kills the group within a second.
    returned: bool,
}

impl Drop for ActiveRun {
    fn drop(&mut self) {
        let mut j = self.world.journal.lock().unwrap();
        let run = &mut j.runs[self.index];
        if run.end.is_none() {
            let now = Instant::now();
            let returned = self.returned || std::thread::panicking();
            run.end = Some(if returned { now } else { now + SUPERVISOR_KILL });
            run.completed = self.done;
        }
    }
}

impl SimLogic {
    /// The run's work goes on in a task of its own until `duration` has passed or its worker
    /// died; the logic awaits it and ignores cancellation (noting when it was told). The run
    /// ends when the work does, whatever happens to this future.
    async fn run_detached(
        &self,
        ctx: &RunContext,
        index: usize,
        duration: Duration,
        mut run: ActiveRun,
        later: Option<Option<Duration>>,
    ) -> Result<(), LogicError> {
        let world = self.world.clone();
        world.count(|c| c.detached_logic += 1);
        // The work, not this future, ends the run.
        run.done = true;
        run.returned = true;
        std::mem::forget(run);
        let killed = self.killed.clone();
        let machine = self.machine;
        // A run that asks to be run later is not a completed one.
        let defers = later.is_some();
        let work = tokio::spawn({
            let world = world.clone();
            async move {
                let completed = tokio::select! {
                    biased;
                    _ = killed.cancelled() => false,
                    _ = tokio::time::sleep(duration) => true,
                };
                let mut j = world.journal.lock().unwrap();
                let end = if completed {
                    Instant::now()
                } else {
                    // In-process: it dies with its worker.
                    world
                        .dead_at
                        .lock()
                        .unwrap()
                        .get(&machine)
                        .copied()
                        .unwrap_or_else(Instant::now)
                };
                let r = &mut j.runs[index];
                if r.end.is_none() {
                    r.end = Some(end);
                    r.completed = completed && r.told.is_none() && !defers;
                }
            }
        });
        let mut work = std::pin::pin!(work);
        // Biased: a tie between the work's end and a stop resolves the same way in every
        // process (an unbiased select draws from a per-process random source).
        tokio::select! {
            biased;
            _ = &mut work => {}
            _ = ctx.cancel.cancelled() => {
                {
                    let mut j = world.journal.lock().unwrap();
                    let r = &mut j.runs[index];
                    r.told = Some(Instant::now());
                    // Stops when its work is done: a stop that takes the rest of the work.
                    r.slow_stop = (r.start + duration).saturating_duration_since(Instant::now());
                }
                let _ = (&mut work).await;
            }
        }
        let told = world.journal.lock().unwrap().runs[index].told.is_some();
        if told {
            Err(LogicError::new("cancelled"))
        } else if let Some(asked) = later {
            Err(self.ask_to_run_later(index, asked))
        } else {
            Ok(())
        }
    }

    /// Notes that run `index` asks to be run later, and the request.
    fn ask_to_run_later(&self, index: usize, asked: Option<Duration>) -> LogicError {
        let mut j = self.world.journal.lock().unwrap();
        j.counts.deferrals_asked += 1;
        j.runs[index].run_later = Some((Instant::now(), asked));
        if self.world.budgets.is_some() {
            j.counts.budget_throttles += 1;
            let now = Instant::now();
            let pause = asked.map_or(SIM_DEFAULT_DEFERRAL, |a| a.min(self.world.max_pause));
            j.pauses.push((now, now + pause));
            return LogicError::throttled(asked, "sim: throttled (too many)");
        }
        LogicError::run_later(asked, "sim: throttled")
    }
}

#[async_trait]
impl Logic for SimLogic {
    async fn run(&self, ctx: RunContext) -> Result<(), LogicError> {
        let world = &self.world;
        let faults = world.faults.load(Ordering::SeqCst);
        let (duration, fails, panics, slow_stop, detached) = {
            let mut rng = world.logic_rng.lock().unwrap();
            let d = match rng.random_range(0..100) {
                0..2 if faults => rng.random_range(125_000..160_000),
                2..20 => rng.random_range(20_000..70_000),
                _ => rng.random_range(100..5_000),
            };
            let fails = faults && rng.random_bool(0.05);
            let panics = faults && rng.random_bool(0.01);
            let slow = faults && rng.random_bool(0.1);
            let slow_stop = slow.then(|| Duration::from_millis(rng.random_range(0..9_000)));
            // In-process logic whose work runs elsewhere (a spawned task, `spawn_blocking`) and
            // ignores cancellation: dropping its future would not stop the work.
            let detached = slow && rng.random_bool(0.2);
            // Half of them run past their time limit: told to stop with their lease intact.
            let d = if detached && rng.random_bool(0.5) {
                rng.random_range(125_000..160_000)
            } else {
                d
            };
            (Duration::from_millis(d), fails, panics, slow_stop, detached)
        };
        let now = Instant::now();
        // A long-pause seed ([`LongPausePlan`]): the victim's run that starts before the
        // throttle is long (its holder dies during the pause); the throttled record's are short,
        // so its throttle starts the pause at once. No draw is added.
        let duration = match &world.long_pause {
            Some((_, until)) if ctx.record_id.as_str() == format!("r{LONG_PAUSE_VICTIM}") && now < *until => {
                LONG_PAUSE_VICTIM_RUN
            }
            Some(_) if ctx.record_id.as_str() == format!("r{LONG_PAUSE_THROTTLED}") => {
                Duration::from_millis(300)
            }
            _ => duration,
        };
        // Supersede: a run of the supersede record that starts in its stream's window is long,
        // and half of them take up to 4 s to stop (inside the stop grace: not a fault, not
        // counted as a slow stop); a slow stop drawn above stays. Work that ignores cancellation
        // keeps what it drew.
        // In a seed with supersede failures ([`Plan::supersede_failures`]) such a run fails with
        // that chance, 1-15 s in (or at its end, if shorter): drawn only in those seeds, so the
        // others draw as they did.
        let (duration, slow_stop, stop_counted, sup_fails) = match &world.supersede {
            Some((r, from, to)) if *r == ctx.record_id.as_str() && now >= *from && now < *to && !detached => {
                let mut rng = world.logic_rng.lock().unwrap();
                let d = Duration::from_millis(rng.random_range(20_000..70_000));
                let stop = rng
                    .random_bool(0.5)
                    .then(|| Duration::from_millis(rng.random_range(0..4_000)));
                let (d, sup_fails) =
                    if world.supersede_failures > 0.0 && rng.random_bool(world.supersede_failures) {
                        (
                            d.min(Duration::from_millis(rng.random_range(1_000..15_000))),
                            true,
                        )
                    } else {
                        (d, false)
                    };
                (d, slow_stop.or(stop), slow_stop.is_some(), sup_fails)
            }
            // After the window, for the plan's tail: ordinary runs, failing with the same chance.
            Some((r, _, to))
                if *r == ctx.record_id.as_str()
                    && now >= *to
                    && world.supersede_failing_until.is_some_and(|until| now < until)
                    && world.supersede_failures > 0.0
                    && !detached =>
            {
                let mut rng = world.logic_rng.lock().unwrap();
                if rng.random_bool(world.supersede_failures) {
                    let fail_at = Duration::from_millis(rng.random_range(1_000..15_000));
                    (duration.min(fail_at), slow_stop, true, true)
                } else {
                    (duration, slow_stop, true, false)
                }
            }
            _ => (duration, slow_stop, true, false),
        };
        // A long-pause seed's other runs are short ([`LONG_PAUSE_OTHER_RUNS`]).
        let duration = match &world.long_pause {
            Some(_) if duration != LONG_PAUSE_VICTIM_RUN => duration.min(LONG_PAUSE_OTHER_RUNS),
            _ => duration,
        };
        let bad = world
            .bad_record
            .as_ref()
            .is_some_and(|(r, from, to)| *r == ctx.record_id.as_str() && now >= *from && now < *to)
            && (world.bad_record_spares == 0.0
                || !world
                    .logic_rng
                    .lock()
                    .unwrap()
                    .random_bool(world.bad_record_spares));
        // Run later: a run of the throttled record that starts in its window asks to be run
        // later once its work is done (unless it fails first).
        let later = world
            .throttle
            .as_ref()
            .is_some_and(|(r, from, to)| *r == ctx.record_id.as_str() && now >= *from && now < *to)
            .then(|| {
                // A long-pause seed's throttle asks its Retry-After, undrawn.
                if let Some((retry_after, _)) = &world.long_pause {
                    return Some(*retry_after);
                }
                let mut rng = world.logic_rng.lock().unwrap();
                match rng.random_range(0..100) {
                    0..70 => Some(Duration::from_millis(rng.random_range(5_000..60_000))),
                    70..85 => None,
                    _ => Some(HUGE_DEFERRAL),
                }
            });
        // Drawn only in the seeds that set it, so the others draw as they did.
        let duration = if world.supersede_defers_early && later.is_some() && !detached {
            let early = Duration::from_millis(world.logic_rng.lock().unwrap().random_range(500..4_000));
            duration.min(early)
        } else {
            duration
        };
        let index = {
            let mut j = world.journal.lock().unwrap();
            j.runs.push(RunRecord {
                machine: self.machine,
                record: ctx.record_id.to_string(),
                token: ctx.fencing_token,
                start: now,
                end: None,
                completed: false,
                told: None,
                slow_stop: slow_stop.unwrap_or_default(),
                detached,
                run_later: None,
                deferred: ctx.deferred,
                attempt: ctx.attempt,
                failed: false,
            });
            j.runs.len() - 1
        };
        let mut run = ActiveRun {
            world: world.clone(),
            index,
            done: false,
            returned: false,
        };
        if duration > RUN_TIMEOUT {
            world.count(|c| c.time_limits += 1);
        }
        if detached {
            return self.run_detached(&ctx, index, duration, run, later).await;
        }
        tokio::select! {
            biased;
            _ = self.killed.cancelled() => {
                // The worker died: its supervisor kills the logic within a second.
                let dead_at = world.dead_at.lock().unwrap().get(&self.machine).copied().unwrap_or_else(Instant::now);
                {
                    let mut j = world.journal.lock().unwrap();
                    if j.runs[index].end.is_none() {
                        j.runs[index].end = Some(dead_at + SUPERVISOR_KILL);
                    }
                }
                std::future::pending().await
            }
            _ = ctx.cancel.cancelled() => {
                world.journal.lock().unwrap().runs[index].told = Some(Instant::now());
                if let Some(stop) = slow_stop {
                    if stop_counted {
                        world.count(|c| c.slow_stops += 1);
                    }
                    tokio::time::sleep(stop).await;
                }
                run.returned = true;
                Err(LogicError::new("cancelled"))
            }
            _ = tokio::time::sleep(duration) => {
                if panics {
                    world.count(|c| c.logic_panics += 1);
                    panic!("{INJECTED_PANIC}");
                }
                run.returned = true;
                if fails || bad || sup_fails {
                    world.count(|c| {
                        c.logic_failures += 1;
                        if sup_fails {
                            c.supersede_failures += 1;
                        }
                    });
                    world.journal.lock().unwrap().runs[index].failed = true;
                    Err(LogicError::new("injected logic failure"))
                } else if let Some(asked) = later {
                    Err(self.ask_to_run_later(index, asked))
                } else {
                    run.done = true;
                    Ok(())
                }
            }
        }
    }
}

/// Outcome of one seed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Report {
    pub runs: usize,
    pub accepted: usize,
    /// Per clean death (no other fault near it): what died, how long until the record ran
    /// again, and how long the dead worker took to restart.
    pub recoveries: Vec<(&'static str, Duration, Duration)>,
    pub violations: Vec<Violation>,
    /// Recoveries late only because of the documented double fault (see `check`).
    pub double_faults: usize,
    pub counts: FaultCounts,
    pub fingerprint: u64,
}

/// A broken invariant, by kind (ordered by kind, then text: a seed's report lists them sorted, so
/// two runs of one seed report the same list whatever order the checks met them in).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Violation {
    Overlap(String),
    Fencing(String),
    Lost(String),
    Coalescing(String),
    Recovery(String),
    RunTime(String),
    NotDrained(String),
    /// (R1) A run of a deferred chain started before the delay its logic was granted had passed.
    RunLater(String),
    /// (R2) A deferral counted as a failed attempt or a redelivery, or a trigger given up other
    /// than at its deferral bound.
    Counted(String),
    /// (S1, S2, supersede's own checks) A run not stopped in time after a trigger arrived during
    /// it, stopped when its streak protected it, or an outcome `Superseded` for no stopped run.
    Supersede(String),
    /// (B1, B2) Debounce: a burst not run exactly once, between quiet and the longest wait (plus
    /// latency), or a wait marker left with nobody to consume it.
    Debounce(String),
    /// The seed did not finish within its real-time budget: something spins without letting
    /// simulated time move on (a retry loop with no pause, a task that never yields).
    Stuck(String),
}

impl Violation {
    /// Safety and the recovery bound: must hold on every seed.
    pub fn is_safety(&self) -> bool {
        !matches!(self, Violation::Coalescing(_))
    }
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (kind, text) = match self {
            Violation::Overlap(t) => ("overlap", t),
            Violation::Fencing(t) => ("fencing", t),
            Violation::Lost(t) => ("lost", t),
            Violation::Coalescing(t) => ("coalescing", t),
            Violation::Recovery(t) => ("recovery", t),
            Violation::RunTime(t) => ("run time", t),
            Violation::NotDrained(t) => ("not drained", t),
            Violation::RunLater(t) => ("run later (R1)", t),
            Violation::Counted(t) => ("counted (R2)", t),
            Violation::Supersede(t) => ("supersede (S1/S2)", t),
            Violation::Debounce(t) => ("debounce (B1/B2)", t),
            Violation::Stuck(t) => ("stuck", t),
        };
        write!(f, "{kind}: {text}")
    }
}

/// The runner's `max_deferral` in a seed.
fn max_deferral(plan: &Plan) -> Duration {
    plan.throttled.map_or_else(
        || *RunnerOptions::default().max_deferral.default_value(),
        |t| t.max_deferral,
    )
}

/// The delay the runner grants a run of a chain deferred `so_far` that asked for `asked`, or
/// `None` when the budget is spent: the runner's own rule, restated.
fn granted(plan: &Plan, so_far: Duration, asked: Option<Duration>) -> Option<Duration> {
    let floor = RunnerOptions::default().min_deferral;
    let remaining = max_deferral(plan).saturating_sub(so_far);
    if remaining < floor.max(Duration::from_millis(1)) {
        return None;
    }
    // A throttle's delay is its budget's pause: the asked time, capped (the default when none).
    let asked = match plan.budget {
        Some(b) => Some(asked.map_or(SIM_DEFAULT_DEFERRAL, |a| a.min(b.max_pause))),
        None => asked,
    };
    Some(asked.unwrap_or(SIM_DEFAULT_DEFERRAL).max(floor).min(remaining))
}

/// The longest pause of a budget in the simulation ([`BudgetOptions::max_pause`]).
const SIM_MAX_PAUSE: Duration = Duration::from_secs(90);

/// Per run of `runs` (one record's, in start order): when the chain of deferrals it belongs to
/// started — its first run's start, its own if it was never put off. Each run of a deferred
/// chain is matched to an earlier run whose request to run later put it off (told the total it
/// was told less the delay granted, its delay passed when it started: R1 says one exists), each
/// request to one run where possible (fault-free, a deferral is delivered once), the one whose
/// delay ended first. Chains are told apart by their totals only, so two chains with equal
/// totals (both put off by the default, or both up to the bound) may be swapped; that swaps
/// their starts, but each chain's start is still given to one run.
///
/// A chain given up with its budget spent (`exhausted`: when, in order) queues a sweep, which
/// runs whatever the marker says and starts a chain of its own: the first run not put off that
/// starts after a give-up, one per give-up, counts as started just after it. (Sweeps queued
/// together do not coalesce: each runs in turn.)
fn chain_starts(plan: &Plan, runs: &[&RunRecord], exhausted: &[Instant]) -> Vec<Instant> {
    let mut starts: Vec<Instant> = Vec::with_capacity(runs.len());
    let mut used = vec![false; runs.len()];
    let mut sweeps = exhausted.iter().peekable();
    for (i, run) in runs.iter().enumerate() {
        if run.deferred.is_zero()
            && let Some(given_up) = sweeps.next_if(|p| **p < run.start)
        {
            starts.push(*given_up + Duration::from_millis(1));
            continue;
        }
        let hops: Vec<(usize, Instant)> = (0..i)
            .filter(|_| !run.deferred.is_zero())
            .filter_map(|k| {
                let q = runs[k];
                let (t, asked) = q.run_later?;
                let d = granted(plan, q.deferred, asked)?;
                (q.start < run.start && q.deferred + d == run.deferred && t + d <= run.start)
                    .then_some((k, t + d))
            })
            .collect();
        let pick = hops
            .iter()
            .filter(|(k, _)| !used[*k])
            .min_by_key(|(_, due)| *due)
            .or_else(|| hops.iter().min_by_key(|(_, due)| *due));
        match pick {
            Some((k, _)) => {
                used[*k] = true;
                starts.push(starts[*k]);
            }
            None => starts.push(run.start),
        }
    }
    starts
}

fn lease_options(plan: &Plan, node: u64) -> LeaseOptions {
    LeaseOptions {
        fencing: plan.fencing,
        retry: RetryOptions {
            jitter_seed: Some(plan.seed ^ node),
            ..RetryOptions::default()
        },
        holder: format!("node{node}"),
        safety_margin: plan.safety_margin.unwrap_or(LEASE / 3),
        ..LeaseOptions::with_duration(LeaseDuration::try_from(LEASE).unwrap())
    }
}

/// Keeps injected logic panics out of the test output; other panics print as usual.
fn quiet_injected_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let injected = info
                .payload()
                .downcast_ref::<String>()
                .is_some_and(|s| s == INJECTED_PANIC);
            if !injected {
                default(info);
            }
        }));
    });
}

thread_local! {
    static EPOCH: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
    /// The seed's stand-downs of deliveries carrying an `afterToken` ([`StandDownCounter`]).
    static STAND_DOWNS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Counts, on the seed's thread (its runtime is current-thread), the runner's log line of a
/// delivery carrying an `afterToken` that stands down ("a later run took this retry's duty
/// over"), recognised by its level, target and fields; every other callsite is disabled. Not
/// installed under `LEASEHOLD_SIM_TRACE` (the log goes to the test writer then).
struct StandDownCounter;

impl StandDownCounter {
    fn counts(meta: &tracing::Metadata<'_>) -> bool {
        meta.is_event()
            && *meta.level() == tracing::Level::INFO
            && meta.target() == "leasehold_runtime::runner"
            && meta.fields().field("after_token").is_some()
            && meta.fields().field("pending").is_some()
    }
}

impl tracing::Subscriber for StandDownCounter {
    fn register_callsite(&self, meta: &'static tracing::Metadata<'static>) -> tracing::subscriber::Interest {
        if Self::counts(meta) {
            tracing::subscriber::Interest::always()
        } else {
            tracing::subscriber::Interest::never()
        }
    }
    fn enabled(&self, meta: &tracing::Metadata<'_>) -> bool {
        Self::counts(meta)
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        if Self::counts(event.metadata()) {
            STAND_DOWNS.with(|c| c.set(c.get() + 1));
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// Log timestamps in simulated seconds since the seed's start.
struct SimTime;

impl tracing_subscriber::fmt::time::FormatTime for SimTime {
    fn format_time(&self, w: &mut tracing_subscriber::fmt::format::Writer<'_>) -> std::fmt::Result {
        match EPOCH.with(|e| e.get()) {
            Some(epoch) => write!(w, "t={:.3}s", (Instant::now() - epoch).as_secs_f64()),
            None => write!(w, "t=?"),
        }
    }
}

/// Real time one seed may take before it counts as stuck. A seed normally takes a few
/// milliseconds (none of 10,000 took 0.5 s with the machine loaded); a protocol change that
/// spins (never lets simulated time move on) or storms would otherwise hang the whole test run
/// instead of failing it.
pub const SEED_REAL_TIME_LIMIT: Duration = Duration::from_secs(5);

/// One seed's plan run to completion on its own thread, reported as [`Violation::Stuck`] when it does not finish
/// within `limit` of real time. A stuck seed's thread is left behind (it cannot be stopped
/// from outside); the test that ran it fails, and the process ends with the test run.
pub fn run_seed_bounded(seed: u64, variant: ProtocolVariant, limit: Duration) -> Report {
    run_plan_bounded(Plan::from_seed(seed), variant, limit)
}

/// [`run_plan`] within `limit` of real time, as [`run_seed_bounded`].
pub fn run_plan_bounded(plan: Plan, variant: ProtocolVariant, limit: Duration) -> Report {
    let seed = plan.seed;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name(format!("sim-seed-{seed}"))
        .spawn(move || {
            let _ = tx.send(run_plan(plan, variant));
        })
        .expect("spawn a simulation thread");
    match rx.recv_timeout(limit) {
        Ok(report) => report,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Report {
            violations: vec![Violation::Stuck(format!(
                "seed {seed} did not finish within {limit:?} of real time"
            ))],
            ..Report::default()
        },
        // The seed's thread panicked: a bug in the simulation itself, or an assertion inside it.
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            panic!("seed {seed}: the simulation panicked (replay with LEASEHOLD_SIM_SEED={seed})")
        }
    }
}

/// Runs a plan (a seed's, possibly changed) to completion and checks the invariants.
pub fn run_plan(plan: Plan, variant: ProtocolVariant) -> Report {
    quiet_injected_panics();
    let _counter = if std::env::var_os("LEASEHOLD_SIM_TRACE").is_some() {
        // The protocol's own log lines, on simulated time since the start.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "debug".into()))
            .with_timer(SimTime)
            .with_ansi(false)
            .with_test_writer()
            .try_init();
        None
    } else {
        Some(tracing::subscriber::set_default(StandDownCounter))
    };
    STAND_DOWNS.with(|c| c.set(0));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    let mut report = rt.block_on(simulate(plan, variant));
    report.counts.after_token_stand_downs += STAND_DOWNS.with(|c| c.get());
    report
}

/// What happens next on the timeline.
#[derive(Debug, Clone, Copy)]
enum Step {
    Fault(Fault),
    Restart { machine: usize, host_too: bool },
}

/// A worker process: its liveness, the task that runs it, and its stop signals.
struct Worker {
    alive: Arc<AtomicBool>,
    /// Standalone: the consumer's task.
    task: Option<tokio::task::JoinHandle<()>>,
    killed: CancellationToken,
    shutdown: CancellationToken,
}

/// A custom handler process as the host sees it.
#[derive(Clone)]
struct Handler {
    runner: RecordRunner,
    /// The low lane's runner ([`LanePlan`]).
    low_runner: Option<RecordRunner>,
    poison: Arc<dyn TriggerQueue>,
    killed: CancellationToken,
    shutdown: CancellationToken,
}

type Slot = Arc<Mutex<Option<Handler>>>;

/// A Functions host instance.
struct Host {
    alive: Arc<AtomicBool>,
    killed: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    /// The low lane's loop ([`LanePlan`]).
    low_task: Option<tokio::task::JoinHandle<()>>,
}

impl Host {
    fn abort(&self) {
        self.task.abort();
        if let Some(t) = &self.low_task {
            t.abort();
        }
    }
}

struct Sim {
    plan: Plan,
    world: Arc<World>,
    counters: OpCounters,
    variant: ProtocolVariant,
    slots: Vec<Slot>,
}

impl Sim {
    fn start_worker(&self, machine: usize, generation: u64) -> Worker {
        let alive = Arc::new(AtomicBool::new(true));
        self.world.wakes.lock().unwrap().remove(&machine);
        let killed = CancellationToken::new();
        let shutdown = CancellationToken::new();
        self.world.dead_at.lock().unwrap().remove(&machine);
        self.world
            .current_worker
            .lock()
            .unwrap()
            .insert(machine, generation);
        let node = Node {
            world: self.world.clone(),
            machine,
            alive: alive.clone(),
            counters: self.counters.clone(),
            aimable: Some(generation),
            steps: Arc::default(),
        };
        let (store, markers, queue) = node.stores();
        let queue: Arc<dyn TriggerQueue> = Arc::new(NotingQueue {
            inner: queue,
            world: self.world.clone(),
            machine,
        });
        let lock = LeaseLock::new(
            store,
            lease_options(&self.plan, (machine as u64) << 8 | generation),
        )
        .unwrap();
        let runner_options = RunnerOptions {
            run_timeout: RUN_TIMEOUT,
            stop_grace: STOP_GRACE,
            max_attempts: MAX_ATTEMPTS,
            retry_delay: RETRY_DELAY,
            default_deferral: SIM_DEFAULT_DEFERRAL,
            max_deferral: PerScope::new(max_deferral(&self.plan)),
            run_policy: PerScope::new(RunPolicy::Coalesce)
                .with(
                    Scope::parse(SUPERSEDE_SCOPE).expect("a scope"),
                    if self.plan.supersede.is_some() {
                        RunPolicy::Supersede
                    } else {
                        RunPolicy::Coalesce
                    },
                )
                .with(
                    Scope::parse(DEBOUNCE_SCOPE).expect("a scope"),
                    if self.plan.debounce.as_ref().is_some_and(|d| d.supersede) {
                        RunPolicy::Supersede
                    } else {
                        RunPolicy::Coalesce
                    },
                ),
            supersede_streak: SUPERSEDE_STREAK,
            debounce: PerScope::new(None).with(
                Scope::parse(DEBOUNCE_SCOPE).expect("a scope"),
                self.plan.debounce.as_ref().map(DebouncePlan::window),
            ),
            variant: self.variant,
            ..RunnerOptions::default()
        };
        let logic = Arc::new(SimLogic {
            world: self.world.clone(),
            killed: killed.clone(),
            machine,
        });
        let low_queue: Option<Arc<dyn TriggerQueue>> = node.low_queue().map(|q| {
            Arc::new(NotingQueue {
                inner: q,
                world: self.world.clone(),
                machine,
            }) as Arc<dyn TriggerQueue>
        });
        let mut runner = RecordRunner::new(
            lock.clone(),
            markers.clone(),
            queue,
            logic.clone(),
            runner_options.clone(),
        );
        let mut low_runner = low_queue.map(|q| {
            RecordRunner::new(lock, markers, q, logic, runner_options).with_lane(leasehold_runtime::Lane::Low)
        });
        if let Some((store, plan)) = &self.world.budgets {
            // Each worker its own view (a restarted one starts afresh), one store for all.
            let budgets = Budgets::new(
                store.clone(),
                BudgetOptions {
                    max_concurrency: plan.max_concurrency,
                    adaptive: plan.adaptive,
                    // The default pause is the default deferral (as the checks of run later
                    // expect, [`granted`]).
                    default_pause: SIM_DEFAULT_DEFERRAL,
                    max_pause: plan.max_pause,
                    ..BudgetOptions::default()
                },
            );
            let world = self.world.clone();
            let sink = leasehold_runtime::OutcomeSink::new(move |_, _, outcome, _| {
                if matches!(outcome, Outcome::Paused { .. }) {
                    world.count(|c| c.budget_paused += 1);
                }
            });
            runner = runner
                .with_budgets(budgets.clone())
                .with_outcome_sink(sink.clone());
            low_runner = low_runner.map(|r| r.with_budgets(budgets).with_outcome_sink(sink));
        }
        // The poison queue is reached like any queue: delays, failures, partitions, late landings.
        let poison: Arc<dyn TriggerQueue> = Arc::new(FaultyQueue::new(
            Arc::new(PoisonSink(self.world.clone(), self.counters.clone())),
            node.clone(),
        ));
        let task = match self.plan.mode {
            Mode::Standalone => {
                let options = ConsumerOptions {
                    visibility: VISIBILITY,
                    max_dequeue_count: MAX_ATTEMPTS,
                    poll_max: Duration::from_secs(2),
                    shutdown_grace: Duration::from_secs(10),
                    ..ConsumerOptions::default()
                };
                // A long-pause seed's consumers have few slots.
                let options = ConsumerOptions {
                    concurrency: self
                        .plan
                        .long_pause
                        .as_ref()
                        .map_or(options.concurrency, |l| l.concurrency),
                    ..options
                };
                let mut consumer = Consumer::new(runner, poison.clone(), options);
                if let Some(low) = low_runner {
                    consumer = consumer.with_low_lane(low, poison);
                }
                let s = shutdown.clone();
                Some(tokio::spawn(async move { consumer.run(s).await }))
            }
            Mode::FunctionsHost => {
                *self.slots[machine].lock().unwrap() = Some(Handler {
                    runner,
                    low_runner,
                    poison,
                    killed: killed.clone(),
                    shutdown: shutdown.clone(),
                });
                None
            }
        };
        Worker {
            alive,
            task,
            killed,
            shutdown,
        }
    }

    fn start_host(&self, machine: usize) -> Host {
        let alive = Arc::new(AtomicBool::new(true));
        let killed = CancellationToken::new();
        let node = Node {
            world: self.world.clone(),
            machine,
            alive: alive.clone(),
            counters: self.counters.clone(),
            aimable: None,
            steps: Arc::default(),
        };
        let (_, _, queue) = node.stores();
        let task = tokio::spawn(host(
            self.world.clone(),
            queue,
            self.slots[machine].clone(),
            killed.clone(),
            machine,
            false,
        ));
        // The low lane's function (`WorkerLow`): a queue trigger of its own, on the same host.
        let low_task = node.low_queue().map(|low| {
            tokio::spawn(host(
                self.world.clone(),
                low,
                self.slots[machine].clone(),
                killed.clone(),
                machine,
                true,
            ))
        });
        Host {
            alive,
            killed,
            task,
            low_task,
        }
    }

    /// The worker on `machine` dies now: its storage calls never return, its logic is killed
    /// by its supervisor within a second.
    fn kill_worker(&self, machine: usize, worker: &Worker) {
        let now = Instant::now();
        self.world.dead_at.lock().unwrap().insert(machine, now);
        worker.alive.store(false, Ordering::SeqCst);
        worker.killed.cancel();
        if let Some(task) = &worker.task {
            task.abort();
        }
        *self.slots[machine].lock().unwrap() = None;
    }

    fn running_on(&self, machine: usize) -> Vec<String> {
        let j = self.world.journal.lock().unwrap();
        j.runs
            .iter()
            .filter(|r| r.machine == machine && r.end.is_none_or(|e| e > Instant::now()))
            .map(|r| r.record.clone())
            .collect()
    }
}

async fn simulate(plan: Plan, variant: ProtocolVariant) -> Report {
    let epoch = Instant::now();
    let (crash_now, mut crashes) = tokio::sync::mpsc::unbounded_channel();
    EPOCH.with(|e| e.set(Some(epoch)));
    let world = Arc::new(World {
        rng: Mutex::new(SmallRng::seed_from_u64(plan.seed)),
        // A long-pause seed's one fault is its death: no random ones.
        faults: AtomicBool::new(plan.faulty && plan.long_pause.is_none()),
        // Storage's clock runs fast: its leases end early by the workers' clocks.
        blob: Arc::new(MemoryStore::new().with_clock_rate(1.0 + plan.skew)),
        markers: Arc::new(MemoryMarkers::new()),
        queue: Arc::new({
            let queue = MemoryQueue::new("sim", OpCounters::new());
            if plan.shuffled_delivery {
                queue.with_shuffled_delivery(plan.seed ^ 0x0bad_0bde)
            } else {
                queue
            }
        }),
        low_queue: plan.lanes.as_ref().map(|_| {
            let queue = MemoryQueue::new("sim-low", OpCounters::new());
            Arc::new(if plan.shuffled_delivery {
                queue.with_shuffled_delivery(plan.seed ^ 0x10e5_10e5)
            } else {
                queue
            })
        }),
        journal: Mutex::default(),
        epoch,
        logic_rng: Mutex::new(SmallRng::seed_from_u64(plan.seed.rotate_left(17))),
        partitioned_until: Mutex::default(),
        bad_record_spares: plan.bad_record_spares,
        bad_record: plan
            .bad_record
            .map(|(r, from, to)| (format!("r{r}"), epoch + from, epoch + to)),
        dead_at: Mutex::default(),
        crash_armed: Mutex::default(),
        lose_armed: Mutex::default(),
        aim_armed: Mutex::default(),
        marker_looked: Mutex::default(),
        failing: Mutex::default(),
        current_worker: Mutex::default(),
        crash_now,
        poison_outage: plan
            .poison_outage
            .map(|(from, length)| (epoch + from, epoch + from + length)),
        throttle: plan
            .throttled
            .map(|t| (format!("r{}", t.record), epoch + t.from, epoch + t.to)),
        budgets: plan.budget.map(|b| (Arc::new(MemoryBudgets::new()), b)),
        supersede: plan
            .supersede
            .map(|s| (format!("r{}", s.record), epoch + s.from, epoch + s.to)),
        supersede_failures: plan.supersede_failures,
        supersede_failing_until: plan.supersede.map(|s| epoch + s.to + plan.supersede_failing_tail),
        supersede_defers_early: plan.supersede_defers_early,
        debounce_quiet: plan.debounce.as_ref().map(|d| d.quiet),
        max_pause: plan.budget.map_or(SIM_MAX_PAUSE, |b| b.max_pause),
        long_pause: plan
            .long_pause
            .as_ref()
            .map(|l| (l.retry_after, epoch + l.at + Duration::from_secs(2))),
        wakes: Mutex::default(),
        received: Mutex::default(),
        wake_writes: Mutex::default(),
    });
    if let Some(d) = &plan.debounce {
        world.count(|c| {
            c.debounce_seeds += 1;
            if d.supersede || plan.throttled.is_some_and(|t| d.has(t.record)) {
                c.debounce_combined_seeds += 1;
            }
        });
    }
    if plan.supersede.is_some() {
        world.count(|c| c.supersede_seeds += 1);
    }
    if plan.supersede_failures > 0.0 {
        world.count(|c| {
            c.supersede_failure_seeds += 1;
            if plan.throttled.map(|t| t.record) == plan.supersede.map(|s| s.record) {
                c.supersede_throttled_seeds += 1;
            }
        });
    }
    if plan.throttled.is_some() {
        world.count(|c| c.throttled_seeds += 1);
    }
    if plan.budget.is_some() {
        world.count(|c| c.budget_seeds += 1);
    }
    if let Some(l) = &plan.long_pause {
        world.count(|c| {
            c.long_pause_seeds += 1;
            c.long_pause_backlog += l.backlog as u64;
            let (debounce, backlog) = l.ways();
            c.long_pause_debounce_seeds += u64::from(debounce > 0);
            c.long_pause_backlog_seeds += u64::from(backlog > 0);
            c.long_pause_last_30_seeds += u64::from(l.last_30);
        });
    }
    if let Some(lanes) = &plan.lanes {
        world.count(|c| {
            c.lane_seeds += 1;
            c.low_triggers += lanes.low.len() as u64;
        });
    }
    if plan.skew > 0.0 {
        world.count(|c| c.skewed_clock += 1);
    }
    if plan.shuffled_delivery {
        world.count(|c| c.shuffled_delivery += 1);
    }
    let sim = Sim {
        world: world.clone(),
        counters: OpCounters::new(),
        variant,
        slots: (0..plan.machines).map(|_| Arc::new(Mutex::new(None))).collect(),
        plan: plan.clone(),
    };
    let mut workers: Vec<Worker> = (0..plan.machines).map(|m| sim.start_worker(m, 0)).collect();
    let mut hosts: Vec<Option<Host>> = Vec::new();
    if plan.mode == Mode::FunctionsHost {
        hosts = (0..plan.machines).map(|m| Some(sim.start_host(m))).collect();
    }

    // Start: accept triggers at their times (a put that succeeded is an accepted trigger).
    let injector = {
        let world = world.clone();
        let triggers = plan.triggers.clone();
        let oversized = plan.oversized.clone();
        let low: Vec<usize> = plan.lanes.as_ref().map(|l| l.low.clone()).unwrap_or_default();
        let scopes: Vec<&'static str> = (0..=plan.triggers.iter().map(|(_, r)| *r).max().unwrap_or(0))
            .map(|r| plan.scope_of(r))
            .collect();
        tokio::spawn(async move {
            for (i, (at, record)) in triggers.into_iter().enumerate() {
                tokio::time::sleep_until(world.epoch + at).await;
                let mut msg = TriggerMessage::parse(scopes[record], &format!("r{record}")).unwrap();
                msg.correlation_id = Some(format!("t{i}"));
                if oversized.contains(&i) {
                    // Put by another tool, not Start: a correlation id Start would refuse.
                    msg.correlation_id = Some(format!("t{i}~{}", "x".repeat(30_000)));
                    world.count(|c| c.oversized_triggers += 1);
                }
                match &world.low_queue {
                    Some(q) if low.contains(&i) => q.put(&msg.encode(), Duration::ZERO).await.unwrap(),
                    _ => world.queue.put(&msg.encode(), Duration::ZERO).await.unwrap(),
                };
                world.journal.lock().unwrap().accepted.push((
                    format!("t{i}"),
                    msg.record_id.to_string(),
                    Instant::now(),
                ));
            }
        })
    };

    // Faults at their instants; a stopped worker (or host) starts again after its pause.
    let mut timeline: Vec<(Instant, Step)> = plan
        .faults
        .iter()
        .map(|(at, f)| (epoch + *at, Step::Fault(*f)))
        .collect();
    let mut generation = 1u64;
    // A long-pause seed: when its budget's pause was first seen ([`Fault::CrashHolder`]).
    let mut long_paused: Option<Instant> = None;
    // An aimed crash that fired is carried out at once, like a planned one.
    let aimed = |fault: Fault| {
        let Fault::CrashAfter {
            machine,
            host_death,
            restart_after,
            ..
        } = fault
        else {
            unreachable!("only aimed crashes are sent")
        };
        Step::Fault(if host_death {
            Fault::HostDeath {
                machine,
                restart_after,
            }
        } else {
            Fault::Crash {
                machine,
                restart_after,
            }
        })
    };
    loop {
        timeline.sort_by_key(|(t, _)| *t);
        let next = timeline.first().map(|(t, _)| *t);
        let step = tokio::select! {
            biased;
            Some(fault) = crashes.recv() => aimed(fault),
            _ = tokio::time::sleep_until(next.unwrap_or(epoch + FAULT_PHASE)) => match next {
                Some(_) => timeline.remove(0).1,
                None => {
                    // Faults end here; an aimed crash that fired just now is still carried out.
                    world.faults.store(false, Ordering::SeqCst);
                    match crashes.try_recv() {
                        Ok(fault) => aimed(fault),
                        Err(_) => break,
                    }
                }
            },
        };
        let now = Instant::now();
        // A death aimed at a holder: the worker that runs the record now, else one that runs
        // any record but the throttled one; nobody when no run is in progress.
        let step = match step {
            Step::Fault(
                fault @ Fault::CrashHolder {
                    record,
                    after_pause,
                    host_death,
                    restart_after,
                },
            ) => {
                // When the budget's first pause began (seen in its store), if it did.
                if long_paused.is_none()
                    && let Some((store, _)) = &world.budgets
                {
                    for name in store.names().await.unwrap_or_default() {
                        if let Ok(Some(p)) = store.read(&name).await
                            && !p.left.is_zero()
                        {
                            long_paused = Some(now);
                            world.journal.lock().unwrap().long_pause = Some((now, now + p.left));
                        }
                    }
                }
                match long_paused {
                    None if plan
                        .long_pause
                        .as_ref()
                        .is_some_and(|l| now < epoch + l.at + LONG_PAUSE_WAIT) =>
                    {
                        timeline.push((now + Duration::from_secs(1), Step::Fault(fault)));
                        continue;
                    }
                    None => {
                        world.count(|c| c.long_pause_no_pause += 1);
                        continue;
                    }
                    Some(from) if now < from + after_pause => {
                        timeline.push((from + after_pause, Step::Fault(fault)));
                        continue;
                    }
                    Some(_) => {}
                }
                let running: Vec<Vec<String>> = (0..plan.machines)
                    .map(|m| {
                        if workers[m].alive.load(Ordering::SeqCst) {
                            sim.running_on(m)
                        } else {
                            Vec::new()
                        }
                    })
                    .collect();
                let victim = format!("r{record}");
                let throttled = format!("r{LONG_PAUSE_THROTTLED}");
                let holder = (0..plan.machines)
                    .find(|m| running[*m].contains(&victim))
                    .or_else(|| (0..plan.machines).find(|m| running[*m].iter().any(|r| *r != throttled)));
                let Some(machine) = holder else {
                    world.count(|c| c.long_pause_no_holder += 1);
                    continue;
                };
                Step::Fault(if host_death {
                    Fault::HostDeath {
                        machine,
                        restart_after,
                    }
                } else {
                    Fault::Crash {
                        machine,
                        restart_after,
                    }
                })
            }
            step => step,
        };
        match step {
            Step::Restart { machine, host_too } => {
                generation += 1;
                workers[machine] = sim.start_worker(machine, generation);
                if host_too {
                    hosts[machine] = Some(sim.start_host(machine));
                }
            }
            Step::Fault(
                Fault::Crash {
                    machine,
                    restart_after,
                }
                | Fault::HostDeath {
                    machine,
                    restart_after,
                },
            ) if workers[machine].alive.load(Ordering::SeqCst) => {
                let host_death = matches!(step, Step::Fault(Fault::HostDeath { .. }));
                let mut holding = sim.running_on(machine);
                // Debounce (B3): a waiter's wake in progress counts like a holder: its record
                // must run again within the same bound.
                let waking: Vec<String> = world
                    .wakes
                    .lock()
                    .unwrap()
                    .remove(&machine)
                    .unwrap_or_default()
                    .into_iter()
                    .map(|key| key.rsplit('/').next().unwrap_or_default().to_string())
                    .collect();
                for record in waking {
                    world.count(|c| c.wake_deaths += 1);
                    world
                        .journal
                        .lock()
                        .unwrap()
                        .wake_deaths
                        .push((now, record.clone()));
                    if !holding.contains(&record) {
                        holding.push(record);
                    }
                }
                sim.kill_worker(machine, &workers[machine]);
                if host_death {
                    if let Some(host) = hosts[machine].take() {
                        host.alive.store(false, Ordering::SeqCst);
                        host.killed.cancel();
                        host.abort();
                    }
                    world.count(|c| c.host_deaths += 1);
                } else {
                    world.count(|c| c.process_crashes += 1);
                    if restart_after >= Duration::from_secs(60) {
                        world.count(|c| c.crash_loops += 1);
                    }
                }
                world
                    .journal
                    .lock()
                    .unwrap()
                    .deaths
                    .push((now, machine, holding, restart_after, host_death));
                timeline.push((
                    now + restart_after,
                    Step::Restart {
                        machine,
                        host_too: host_death,
                    },
                ));
            }
            Step::Fault(Fault::Shutdown {
                machine,
                restart_after,
            }) if workers[machine].alive.load(Ordering::SeqCst) => {
                world.count(|c| c.shutdowns += 1);
                let w = &mut workers[machine];
                w.shutdown.cancel();
                // Functions: the host stops invoking a handler that is stopping.
                *sim.slots[machine].lock().unwrap() = None;
                // The process exits once its runs are handed back (the consumer returns; a
                // handler after the host's wait), then is gone like any dead process. A new one
                // starts after the pause, whether or not the old one has gone yet.
                let task = w.task.take();
                let (alive, killed) = (w.alive.clone(), w.killed.clone());
                tokio::spawn(async move {
                    match task {
                        Some(task) => {
                            let _ = task.await;
                        }
                        None => tokio::time::sleep(Duration::from_secs(20)).await,
                    }
                    alive.store(false, Ordering::SeqCst);
                    killed.cancel();
                });
                timeline.push((
                    now + restart_after,
                    Step::Restart {
                        machine,
                        host_too: false,
                    },
                ));
            }
            Step::Fault(Fault::Partition { machine, length }) => {
                world.count(|c| c.partitions += 1);
                world
                    .partitioned_until
                    .lock()
                    .unwrap()
                    .insert(machine, now + length);
                world
                    .journal
                    .lock()
                    .unwrap()
                    .partitions
                    .push((now, now + length, machine));
            }
            Step::Fault(fault @ Fault::CrashAfter { machine, .. }) => {
                world.crash_armed.lock().unwrap().insert(machine, fault);
            }
            Step::Fault(Fault::LoseAnswer { machine, op }) => {
                world
                    .lose_armed
                    .lock()
                    .unwrap()
                    .entry(machine)
                    .or_default()
                    .push(op);
            }
            Step::Fault(
                fault @ (Fault::LandLate { machine, .. }
                | Fault::LoseChange { machine, .. }
                | Fault::Slow { machine, .. }
                | Fault::Refuse { machine, .. }),
            ) => {
                world
                    .aim_armed
                    .lock()
                    .unwrap()
                    .entry(machine)
                    .or_default()
                    .push(fault);
            }
            Step::Fault(Fault::FailOp { machine, op, length }) => {
                world.failing.lock().unwrap().insert((machine, op), now + length);
                world
                    .journal
                    .lock()
                    .unwrap()
                    .step_outages
                    .push((now, now + length));
            }
            Step::Fault(Fault::Break { record }) => {
                let key = LockKey::new(format!("{}/r{record}", plan.scope_of(record))).unwrap();
                // As `leasehold break` does: safe, free only once the time the lease had left passed.
                let _ = world
                    .blob
                    .break_lease(&leasehold_lock::lock_blob_name(&key), LEASE)
                    .await;
                world.count(|c| c.lease_breaks += 1);
                world
                    .journal
                    .lock()
                    .unwrap()
                    .breaks
                    .push((now, format!("r{record}")));
            }
            // A fault on a worker that is not running.
            Step::Fault(_) => {}
        }
    }

    injector.await.unwrap();

    // Drain: wait until no message is left and no run is active.
    let deadline = epoch + FAULT_PHASE + DRAIN_LIMIT;
    loop {
        let idle = world.queue.bodies().is_empty()
            && world.low_queue.as_ref().is_none_or(|q| q.bodies().is_empty())
            && world
                .journal
                .lock()
                .unwrap()
                .runs
                .iter()
                .all(|r| r.end.is_some_and(|e| e <= Instant::now()));
        if idle {
            break;
        }
        if Instant::now() >= deadline {
            let left = world.queue.bodies().len() + world.low_queue.as_ref().map_or(0, |q| q.bodies().len());
            world
                .journal
                .lock()
                .unwrap()
                .violations
                .push(Violation::NotDrained(format!(
                    "{left} messages left after {DRAIN_LIMIT:?}"
                )));
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    for (machine, w) in workers.iter().enumerate() {
        sim.kill_worker(machine, w);
    }
    for host in hosts.into_iter().flatten() {
        host.alive.store(false, Ordering::SeqCst);
        host.abort();
    }
    check(&plan, &world)
}

/// The Functions host, emulated: takes messages hidden for 10 minutes (sometimes letting that
/// lapse early), invokes the handler, deletes on success, makes the message visible again after
/// `visibilityTimeout` when the invocation fails (including when the handler is dead or stopping),
/// and poisons without asking the handler when the `maxDequeueCount`-th invocation fails (or a
/// message arrives past it, after a host crash).
async fn host(
    world: Arc<World>,
    queue: Arc<dyn TriggerQueue>,
    slot: Slot,
    killed: CancellationToken,
    machine: usize,
    low: bool,
) {
    loop {
        let batch = queue.get(16, HOST_VISIBILITY).await.unwrap_or_default();
        if batch.is_empty() {
            tokio::time::sleep(HOST_POLL).await;
            continue;
        }
        for m in batch {
            let handler = slot.lock().unwrap().clone();
            let (queue, world, killed) = (queue.clone(), world.clone(), killed.clone());
            tokio::spawn(async move {
                let Ok(message) = TriggerMessage::decode(&m.body) else {
                    return;
                };
                let chain = world
                    .journal
                    .lock()
                    .unwrap()
                    .chain_of(queue.name(), &m.id, &message);
                if m.dequeue_count > 1 {
                    world.journal.lock().unwrap().host_redeliveries.push((
                        message.record_id.to_string(),
                        m.dequeue_count,
                        Instant::now(),
                    ));
                }
                if message.kind == TriggerKind::Watchdog {
                    world.journal.lock().unwrap().watchdog_takes.push((
                        message.record_id.to_string(),
                        machine,
                        Instant::now(),
                    ));
                }
                if std::env::var_os("LEASEHOLD_SIM_TRACE").is_some() {
                    println!(
                        "host: took {} {} dc={} {:?} {} given_up={} chain {chain} at {:.3}s",
                        queue.name(),
                        m.id,
                        m.dequeue_count,
                        message.kind,
                        message.record_id,
                        message.given_up,
                        world.at(Instant::now())
                    );
                }
                if m.dequeue_count > HOST_JSON.max_dequeue {
                    PoisonSink::record_by_host(&world, message);
                    let _ = queue.delete(&m.id, &m.pop_receipt).await;
                    return;
                }
                let mut receipt = m.pop_receipt.clone();
                // The host's visibility renewal lapses: the message is delivered again while
                // this invocation still runs.
                if world.chance(0.03) {
                    let early = Duration::from_millis(world.rng.lock().unwrap().random_range(5_000..60_000));
                    if let Ok(r) = queue.set_visibility(&m.id, &receipt, &m.body, early).await {
                        receipt = r;
                        world.count(|c| c.visibility_lapses += 1);
                    }
                }
                let delivery = Delivery {
                    message,
                    dequeue_count: m.dequeue_count,
                };
                let outcome = match handler {
                    Some(h) => tokio::select! {
                        biased;
                        _ = killed.cancelled() => return,
                        _ = h.killed.cancelled() => None,
                        outcome = DELIVERY_CHAIN.scope(chain, {
                            let runner = if low { h.low_runner.as_ref().expect("a low lane") } else { &h.runner };
                            runner.handle_watched(&delivery, &*h.poison, &h.shutdown)
                        }) => Some(outcome),
                    },
                    None => None,
                };
                if killed.is_cancelled() {
                    return;
                }
                if let Some(o) = &outcome {
                    count_outcome(&world, o);
                    if let Outcome::Superseded { fencing_token, .. } = o {
                        world
                            .journal
                            .lock()
                            .unwrap()
                            .superseded_outcomes
                            .push((delivery.message.record_id.to_string(), *fencing_token));
                    }
                }
                let acknowledged = outcome.as_ref().is_some_and(Outcome::acknowledge);
                if std::env::var_os("LEASEHOLD_SIM_TRACE").is_some() {
                    println!(
                        "host: {} dc={} {:?} {} -> {:?} at {:.3}s",
                        m.id,
                        m.dequeue_count,
                        delivery.message.kind,
                        delivery.message.record_id,
                        outcome.as_ref().map(Outcome::name),
                        world.at(Instant::now())
                    );
                }
                // The host retries its own storage calls.
                let retry = RetryOptions {
                    jitter_seed: Some(7),
                    ..RetryOptions::default()
                };
                if acknowledged {
                    let _ = retry.run("host delete", || queue.delete(&m.id, &receipt)).await;
                } else if m.dequeue_count >= HOST_JSON.max_dequeue {
                    // Like the real host: the last allowed invocation failed, so the message
                    // goes to the poison queue now, without the handler being asked.
                    PoisonSink::record_by_host(&world, delivery.message.clone());
                    let _ = retry.run("host poison", || queue.delete(&m.id, &receipt)).await;
                } else {
                    let visible =
                        || queue.set_visibility(&m.id, &receipt, &m.body, HOST_JSON.retry_visibility);
                    let _ = retry.run("host retry", visible).await;
                }
            });
        }
    }
}

fn count_outcome(world: &World, outcome: &Outcome) {
    world.count(|c| match outcome {
        Outcome::Failed { error, .. } | Outcome::Retrying { error, .. } => {
            if error.is_storage() {
                c.storage_failed_outcomes += 1;
            }
            if error.is_lease_lost() {
                c.lease_lost_outcomes += 1;
            }
            if matches!(outcome, Outcome::Retrying { .. }) {
                c.watchdog_retries += 1;
            }
        }
        Outcome::Rechecking { .. } => c.rechecks += 1,
        _ => {}
    });
}

fn check(plan: &Plan, world: &World) -> Report {
    let j = world.journal.lock().unwrap();
    let mut violations = j.violations.clone();
    let mut counts = j.counts.clone();
    let at = |t: Instant| world.at(t);
    let mut by_record: HashMap<&str, Vec<&RunRecord>> = HashMap::new();
    for r in &j.runs {
        by_record.entry(&r.record).or_default().push(r);
    }
    for runs in by_record.values_mut() {
        runs.sort_by_key(|r| r.start);
    }

    // (1) Exclusive: runs of a record never overlap (a dead worker's logic counts until its
    // supervisor killed it); fencing tokens rise in run order.
    // The one exception, documented: in-process logic that ignores cancellation keeps running
    // after its lease was lost (its holder cut off from storage, a renewal with no answer, an
    // operator's break) — it was told before its time limit — and nothing can stop it: the
    // runner keeps the lease only while it can renew it. Told at its time limit, its lease was
    // intact and must be kept until it has ended.
    //
    // Supersede: a run told to stop at the very instant a supersede watch found its record's
    // marker set, on its machine (the runner cancels the run in the same instant: `watch_fired`,
    // then the biased `select!`), was stopped because of supersede — told with its lease intact,
    // like a run at its time limit. The runner keeps its lease until its logic has ended, so the
    // exception above does not cover it: only if the lease was then lost (its machine cut off
    // from storage, a renewal with no answer, an operator's break, between the stop and the next
    // run's start) may work that ignores cancellation outlive it.
    let superseded = |r: &RunRecord| {
        r.told.is_some_and(|told| {
            j.watch_fired.iter().any(|(t, m, rec)| {
                *m == r.machine
                    && *rec == r.record
                    && *t >= r.start
                    && *t <= told
                    && told - *t <= Duration::from_millis(1)
            })
        })
    };
    let lease_lost_under = |r: &RunRecord| {
        r.told
            .is_some_and(|told| told + Duration::from_millis(50) < r.start + RUN_TIMEOUT)
            && !superseded(r)
    };
    let lease_lost_after_supersede = |r: &RunRecord, next: Instant| {
        let told = r.told.unwrap_or(r.start);
        superseded(r)
            && (j
                .partitions
                .iter()
                .any(|(from, to, m)| *m == r.machine && *to >= told && *from <= next)
                || j.renew_timeouts
                    .iter()
                    .any(|(t, m)| *m == r.machine && *t + CLIENT_TIMEOUT >= told && *t <= next)
                || j.breaks
                    .iter()
                    .any(|(t, rec)| *rec == r.record && *t <= next && *t >= r.start))
    };
    for (record, runs) in &by_record {
        for w in runs.windows(2) {
            let end = w[0].end.unwrap_or(Instant::now());
            if end > w[1].start
                && w[0].detached
                && (lease_lost_under(w[0]) || lease_lost_after_supersede(w[0], w[1].start))
            {
                continue;
            }
            if end > w[1].start {
                violations.push(Violation::Overlap(format!(
                    "{record}: run from t={:.3}s (machine {}) still running at t={:.3}s when another started (machine {})",
                    at(w[0].start),
                    w[0].machine,
                    at(w[1].start),
                    w[1].machine
                )));
            }
            if let (Some(a), Some(b)) = (w[0].token, w[1].token)
                && b <= a
            {
                violations.push(Violation::Fencing(format!(
                    "{record}: token {b} at t={:.3}s after token {a}",
                    at(w[1].start)
                )));
            }
        }
    }

    // (2) Nothing lost: each accepted trigger is served by a completed run that started after
    // it, or was given up visibly: its own poison entry, or — the one documented exception —
    // it relied on a sweep's chain that kept failing and was given up in turn (its conditional
    // sweep may then stand down). That is: a poison entry of a sweep's chain (P1, `given_up`
    // >= 1) after the trigger, following a give-up of the record (P0) with no completed run of
    // the record in between, so the chain P1 gave up really was a sweep's that never ran to
    // success, not fresh triggers after one (issue 16, item 1).
    let poisoned_ids: HashSet<&str> = j
        .poisoned
        .iter()
        .filter_map(|(c, _, _, _)| c.as_deref())
        .collect();
    // A record whose logic keeps failing for a while: the bad record, and the supersede record
    // whose runs fail in its window ([`Plan::supersede_failures`]), each until its window ends.
    let failing: Vec<(&str, Instant)> = world
        .bad_record
        .iter()
        .map(|(r, _, to)| (r.as_str(), *to))
        .chain(
            world
                .supersede
                .iter()
                .filter(|_| world.supersede_failures > 0.0)
                .map(|(r, _, to)| (r.as_str(), world.supersede_failing_until.unwrap_or(*to))),
        )
        .collect();
    for (corr, record, t) in &j.accepted {
        let served = by_record
            .get(record.as_str())
            .is_some_and(|runs| runs.iter().any(|r| r.start > *t && r.completed));
        let runs = by_record.get(record.as_str()).map(Vec::as_slice).unwrap_or(&[]);
        let failing_sweep_chain = |p1: Instant| {
            j.poisoned.iter().any(|(_, pr, p0, _)| {
                pr == record && *p0 < p1 && !runs.iter().any(|r| r.completed && r.start > *p0 && r.start < p1)
            })
        };
        let given_up = poisoned_ids.contains(corr.as_str())
            || failing.iter().any(|(r, to)| {
                *r == record.as_str()
                    && *to > *t
                    && j.poisoned.iter().any(|(_, pr, p1, chain)| {
                        pr == record && *p1 > *t && *chain >= 1 && failing_sweep_chain(*p1)
                    })
            });
        // Run later, the same exception (docs/flow-control-design.md, 3.5: "a record whose logic
        // always defers stops after two budgets"): a sweep's chain (`given_up` >= 1) whose
        // deferral budget was spent after the trigger, following a give-up of the record with no
        // completed run in between. Only a DeferralExhausted entry excuses here: a sweep's chain
        // given up for failures on a record that is not the bad one stays a loss.
        let dropped_after_two_budgets = !given_up
            && j.exhausted.iter().any(|(er, p1, _, chain)| {
                er == record && *p1 > *t && *chain >= 1 && failing_sweep_chain(*p1)
            });
        if !served && dropped_after_two_budgets {
            counts.dropped_after_two_budgets += 1;
        }
        if !served && !given_up && !dropped_after_two_budgets {
            violations.push(Violation::Lost(format!(
                "trigger {corr} for {record} accepted at t={:.3}s never served",
                at(*t)
            )));
        }
    }

    // (3) Coalescing, fault-free only: for runs R1 < R2 < R3 of a record, some trigger must have
    // arrived (been first received by a worker) after R1 started and before R3 started.
    // Run later: a deferral and the run it puts off are one run (the deferred message is the
    // holder's retrigger, delayed), so runs whose logic asked to run later are left out, and a
    // run of a deferred chain counts as started when its chain's first run did (`chain_start`).
    // The deferred message does not hold the lease: a trigger arriving between two hops runs at
    // once and, throttled too, starts a chain of its own, and each chain ends with a run — the
    // protocol cannot tell that an earlier chain's run already covered it. Counted from their
    // chains' starts, those runs are each owed to their own arrival. In seeds without a throttle
    // no run asks and none is deferred, and the check is what it was.
    // A chain whose deferral budget was spent is given up with a sweep, which runs the record
    // once whatever the marker says (for what coalesced onto the chain) and starts a chain of its
    // own: the give-up counts as a trigger arriving, and the sweep's run as started just after
    // it (`chain_starts`). (Fault-free seeds give nothing else up.)
    // Supersede failures ([`Plan::supersede_failures`], fault-free seeds too): a run whose logic
    // failed is left out, as a run that asked to run later is. It served no trigger: its retry
    // — or the run that took its duty over, the retry standing down — is the run its trigger
    // (and what coalesced onto it) is owed, one run, and the check still holds those to at most
    // one run after them. A chain given up at the poison limit queues a sweep that runs the
    // record once whatever the marker says: as for a spent budget, the give-up counts as a
    // trigger arriving. (Every poison entry, then: in a fault-free seed all others are
    // exhaustions, counted so already.)
    let arrivals: Vec<(&str, Instant)> = j
        .arrivals
        .iter()
        .map(|(record, t)| (record.as_str(), *t))
        .chain(j.poisoned.iter().map(|(_, record, t, _)| (record.as_str(), *t)))
        .collect();
    if !plan.faulty {
        for (record, runs) in &by_record {
            let mut exhausted: Vec<Instant> = j
                .exhausted
                .iter()
                .filter(|(r, _, _, _)| r == record)
                .map(|(_, t, _, _)| *t)
                .collect();
            exhausted.sort();
            let mut runs: Vec<(Instant, &RunRecord)> = chain_starts(plan, runs, &exhausted)
                .into_iter()
                .zip(runs.iter().copied())
                .filter(|(_, r)| r.run_later.is_none() && !r.failed)
                .collect();
            runs.sort_by_key(|(start, _)| *start);
            for w in runs.windows(3) {
                let fresh = arrivals
                    .iter()
                    .any(|(rec, t)| rec == record && *t > w[0].0 && *t < w[2].0);
                if !fresh {
                    violations.push(Violation::Coalescing(format!(
                        "{record} ran at t={:.3}s and twice more (t={:.3}s, t={:.3}s) with no new trigger{}",
                        at(w[0].1.start),
                        at(w[1].1.start),
                        at(w[2].1.start),
                        if w.iter().any(|(start, r)| *start != r.start) {
                            format!(
                                " (their chains of deferrals started at t={:.3}s, t={:.3}s, t={:.3}s)",
                                at(w[0].0),
                                at(w[1].0),
                                at(w[2].0)
                            )
                        } else {
                            String::new()
                        }
                    )));
                }
            }
        }
    }

    // (4) Bounded recovery: a record whose run died with its worker runs again within the bound.
    // Standalone: the message reappears after its visibility (lease + 5 s from its last push, just
    // before the last renewal), when the lease has expired. Functions: the dead holder's watchdog
    // surfaces lease + 5 s after its last push (just before the last renewal) and is taken at the
    // host's next poll; a handler that died alone also leaves its
    // host failing invocations until it is back (the restart pause adds).
    // Slack: storage delays on the way, and one retry's late window (5 s) after a lost answer.
    let slack = Duration::from_secs(10);
    let bound = match plan.mode {
        Mode::Standalone => VISIBILITY + slack,
        Mode::FunctionsHost => LEASE + leasehold_runtime::WATCHDOG_MARGIN + HOST_POLL + slack,
    };
    let other_faults: Vec<(Instant, Instant)> = j
        .partitions
        .iter()
        .map(|(from, to, _)| (*from, *to))
        .chain(j.lost_gets.iter().map(|t| (*t, *t)))
        .chain(j.timeouts.iter().map(|t| (*t, *t + CLIENT_TIMEOUT)))
        .chain(j.breaks.iter().map(|(t, _)| (*t, *t)))
        .chain(j.step_outages.iter().copied())
        .collect();
    // The documented double fault (docs/design.md): a host took the dead holder's watchdog (the
    // record's carrier) and died itself before its handler had put a watchdog of its own, so
    // that watchdog stays hidden for the host's 10 minutes. Recognised exactly: a host death
    // after the holder's, on a machine that took a watchdog of the record after the holder's
    // death and before its own, with no watchdog put for the record by that machine in between.
    let double_fault = |record: &str, holder_died: Instant| {
        j.deaths.iter().any(|(died, m, _, _, whole_host)| {
            *whole_host
                && *died > holder_died
                && j.watchdog_takes.iter().any(|(r, tm, taken)| {
                    r == record
                        && tm == m
                        && *taken > holder_died
                        && *taken <= *died
                        && !j
                            .watchdog_puts
                            .iter()
                            .any(|(pr, pm, put)| pr == record && pm == m && *put >= *taken && *put <= *died)
                })
        })
    };
    let mut double_faults = 0;
    let mut recoveries = Vec::new();
    for (when, machine, records, restart, host_death) in &j.deaths {
        // A long-pause seed's death while the pause held ([`LongPausePlan`]): its carrier
        // surfaces about 30 s later, perhaps in the pause's last 30 s. Nothing about the pause
        // excuses the bound: a carrier is never held by one.
        if let Some((from, until)) = j.long_pause
            && from <= *when
            && *when < until
        {
            counts.long_pause_deaths += 1;
            let surfaces = *when + VISIBILITY - Duration::from_secs(5);
            if surfaces <= until && surfaces + Duration::from_secs(30) >= until {
                counts.long_pause_late_carriers += 1;
            }
        }
        let mut deadline = *when + bound + *restart;
        for (later, _, _, later_restart, _) in &j.deaths {
            if *later > *when && *later <= deadline {
                deadline = deadline.max(*later + bound + *later_restart);
            }
        }
        // The bound holds once faults stop: one that overlaps the window excuses it. So does
        // another machine's crash-looping handler (down a minute or more while its host lives):
        // its host keeps taking messages — the dead holder's watchdog among them — and failing
        // their invocations, each costing a `visibilityTimeout`.
        let crash_loop = j.deaths.iter().any(|(t, m, _, r, host)| {
            m != machine && !host && *r >= Duration::from_secs(60) && *t + *r >= *when && *t <= deadline
        });
        if crash_loop
            || other_faults
                .iter()
                .any(|(from, to)| *to >= *when && *from <= deadline)
        {
            continue;
        }
        for record in records {
            let runs = by_record.get(record.as_str()).map(Vec::as_slice).unwrap_or(&[]);
            // (B3) A death during a waiter's wake: its stand-in consumes and carries on at once,
            // but as a trigger, so a run of the record in progress then (another holder's)
            // takes it over as its retrigger, and the record runs again only after that run.
            let wake = j.wake_deaths.iter().any(|(t, r)| t == when && r == record);
            let taken_over = wake
                && runs
                    .iter()
                    .any(|r| r.start <= deadline && r.end.is_none_or(|e| e > *when));
            // A run on the dead machine told to stop before the death (its lease lost, logic
            // that ignores cancellation still running) while another machine's run of the
            // record was in progress: that run's holder, alive, is the record's; the dead
            // machine held nothing to recover (seed 16192: the live run then ended deferred by
            // a throttle, and the record ran when its deferral said).
            let held_elsewhere = runs
                .iter()
                .any(|r| r.machine == *machine && r.start < *when && r.told.is_some_and(|t| t < *when))
                && runs.iter().any(|r| {
                    r.machine != *machine
                        && r.start < *when
                        && r.end.is_none_or(|e| e > *when)
                        && r.told.is_none_or(|t| t > *when)
                });
            if held_elsewhere {
                continue;
            }
            let recovered = taken_over || runs.iter().any(|r| r.start > *when && r.start <= deadline);
            if plan.long_pause.is_some() {
                counts.long_pause_checked += 1;
            }
            let ran_later = runs.iter().any(|r| r.start > *when);
            let alone = deadline == *when + bound + *restart;
            if let Some(next) = runs.iter().find(|r| r.start > *when).filter(|_| alone) {
                let kind = match (plan.mode, host_death) {
                    (Mode::Standalone, _) => "standalone worker killed",
                    (Mode::FunctionsHost, false) => "Functions handler killed (host alive)",
                    (Mode::FunctionsHost, true) => "whole Functions host died",
                };
                recoveries.push((kind, next.start - *when, *restart));
            }
            if ran_later && !recovered && double_fault(record, *when) {
                double_faults += 1;
            } else if ran_later && !recovered {
                violations.push(Violation::Recovery(format!(
                    "{record}: holder died at t={:.3}s, no run again by t={:.3}s",
                    at(*when),
                    at(deadline)
                )));
            }
        }
    }

    // (5) Bounded run time: a run is told to stop at its time limit, and ends within its stop
    // grace of being told — or, logic slow to stop, when it has stopped (the runner keeps its
    // lease until then, so nothing runs beside it: invariant 1 holds that); a run under a broken
    // lease is told within a renewal interval, ends likewise, and is not acknowledged.
    let stops_by = |r: &RunRecord, told: Instant| told + STOP_GRACE.max(r.slow_stop) + Duration::from_secs(1);
    for r in &j.runs {
        let Some(end) = r.end else { continue };
        if end - r.start <= RUN_TIMEOUT + STOP_GRACE + Duration::from_secs(1) {
            continue;
        }
        let in_time = r.told.is_some_and(|told| {
            told <= r.start + RUN_TIMEOUT + Duration::from_secs(1) && end <= stops_by(r, told)
        });
        if !in_time {
            violations.push(Violation::RunTime(format!(
                "{}: run from t={:.3}s lasted {:.3}s (told to stop at {:?})",
                r.record,
                at(r.start),
                (end - r.start).as_secs_f64(),
                r.told.map(at)
            )));
        }
    }
    for (t, record) in &j.breaks {
        let partitioned = j
            .partitions
            .iter()
            .any(|(from, to, _)| *to >= *t && *from <= *t + RENEW_EVERY);
        if partitioned {
            continue;
        }
        for r in j.runs.iter().filter(|r| &r.record == record && r.start < *t) {
            let Some(end) = r.end else { continue };
            if end <= *t {
                continue;
            }
            // A renewal of the holder's that got no answer around the break (a partition's
            // fault, met alone) delays its seeing the break by the client's time-out: excused as
            // a partition is.
            if j.renew_timeouts
                .iter()
                .any(|(rt, m)| *m == r.machine && *rt + CLIENT_TIMEOUT >= *t && *rt <= *t + RENEW_EVERY)
            {
                continue;
            }
            let told_by = *t + RENEW_EVERY + Duration::from_secs(2);
            let stopped_in_time = end <= told_by + STOP_GRACE
                || r.told
                    .is_some_and(|told| told <= told_by && end <= stops_by(r, told));
            if !stopped_in_time || (r.completed && end > *t + RENEW_EVERY + Duration::from_secs(1)) {
                violations.push(Violation::RunTime(format!(
                    "{record}: lease broken at t={:.3}s, run from t={:.3}s ended at t={:.3}s (completed: {})",
                    at(*t),
                    at(r.start),
                    at(end),
                    r.completed
                )));
            }
        }
    }

    // (R1) Run later, all seeds: a run of a deferred chain (told a total deferral T' > 0) starts
    // no earlier than t + D for an earlier run of the record that asked to run later at t, told
    // T, and was granted D (the runner's rule, restated by `granted`) with T + D = T'. The
    // deferred message is persisted after t, hidden for D; its rechecks, watchdogs and retries
    // come later still; an early redelivery of the message before it carries the earlier total,
    // matched by an earlier hop.
    for (record, runs) in &by_record {
        for r in runs.iter().filter(|r| !r.deferred.is_zero()) {
            counts.r1_checks += 1;
            let hops: Vec<(Instant, Duration)> = runs
                .iter()
                .filter(|q| q.start < r.start)
                .filter_map(|q| {
                    let (t, asked) = q.run_later?;
                    let d = granted(plan, q.deferred, asked)?;
                    (q.deferred + d == r.deferred).then_some((t, d))
                })
                .collect();
            if !hops.iter().any(|(t, d)| *t + *d <= r.start) {
                violations.push(Violation::RunLater(match hops.iter().max_by_key(|(t, _)| *t) {
                    Some((t, d)) => format!(
                        "{record}: run at t={:.3}s deferred {:?} in total started before its hop's delay had passed (asked at t={:.3}s, granted {d:?}: not before t={:.3}s)",
                        at(r.start),
                        r.deferred,
                        at(*t),
                        at(*t + *d)
                    ),
                    None => format!(
                        "{record}: run at t={:.3}s deferred {:?} in total, a total no earlier request to run later was granted",
                        at(r.start),
                        r.deferred
                    ),
                }));
            }
        }
    }
    // Exhaustion only at the bound (every seed): a trigger given up with its deferral budget
    // spent had less than the shortest deferral left of it.
    let floor = RunnerOptions::default().min_deferral;
    for (record, t, total, _) in &j.exhausted {
        if *total + floor <= max_deferral(plan) {
            violations.push(Violation::Counted(format!(
                "{record}: given up at t={:.3}s with its deferral budget spent after only {total:?} of {:?}",
                at(*t),
                max_deferral(plan)
            )));
        }
    }
    // (R2) Fault-free: nothing counts as a failed attempt — every run is told attempt 1, however
    // often its chain was deferred; the emulated host never delivers a message twice (deferrals
    // never raise its DequeueCount); no trigger is given up but for a spent deferral budget.
    // Except, by design, the supersede record whose runs fail ([`Plan::supersede_failures`]): its
    // retries are told their attempt, and its chains are given up at the poison limit.
    if !plan.faulty {
        let failing_record = plan
            .supersede
            .filter(|_| plan.supersede_failures > 0.0)
            .map(|s| format!("r{}", s.record));
        let other_record = |record: &str| failing_record.as_deref() != Some(record);
        for r in j
            .runs
            .iter()
            .filter(|r| r.attempt != 1 && other_record(&r.record))
        {
            violations.push(Violation::Counted(format!(
                "{}: run at t={:.3}s (deferred {:?}) told attempt {} in a fault-free seed",
                r.record,
                at(r.start),
                r.deferred,
                r.attempt
            )));
        }
        for (record, count, t) in &j.host_redeliveries {
            violations.push(Violation::Counted(format!(
                "{record}: the host delivered a message for the {count}th time at t={:.3}s in a fault-free seed",
                at(*t)
            )));
        }
        let other = j
            .poisoned
            .iter()
            .filter(|(_, r, _, _)| other_record(r))
            .count()
            .saturating_sub(j.exhausted.iter().filter(|(r, _, _, _)| other_record(r)).count());
        if other > 0 || !j.host_poisoned.is_empty() {
            violations.push(Violation::Counted(format!(
                "{other} triggers given up but not for a spent deferral budget, {} poisoned by the host, in a fault-free seed",
                j.host_poisoned.len()
            )));
        }
    }
    counts.deferrals_persisted = j.deferrals.len() as u64;
    let mut hops_by_chain: HashMap<u64, u32> = HashMap::new();
    for (id, hops) in &j.deferrals {
        let most = hops_by_chain.entry(*id).or_default();
        *most = (*most).max(*hops);
    }
    counts.long_deferral_chains = hops_by_chain.values().filter(|h| **h > MAX_ATTEMPTS).count() as u64;

    // Supersede ([`SupersedePlan`]). Walks the supersede record's runs in start order, keeping
    // the record's streak as the runner keeps it in its lock note: superseded runs in a row and
    // the run time they cost (a run that ends any other way breaks it).
    // (S3, every supersede seed) A superseded run is never completed (its trigger still needs a
    // completed run after it: (2)); exclusive (1) holds for it without the exception for logic
    // that ignores cancellation, unless its lease was lost after the stop.
    // (S2, fault-free) A run is superseded only while its streak allows: fewer than
    // `SUPERSEDE_STREAK` superseded runs before it in a row, and their run time short of the run
    // time limit; told within what is left of it (plus a second: the watch looks after a
    // renewal). So at most 3 in a row, and the run after them, or after they cost the limit, is
    // never superseded.
    // (S1, fault-free) A run its streak does not protect, during which a marker was created at
    // t (a trigger arrived and found the lease held), is told to stop by t + the renewal interval
    // + 1 s (the watch reads the marker after each renewal) — unless it ended on its own before
    // — and ends within its stop grace, or its slower stop, of being told. Checked when the watch
    // still runs then (its streak's run time left a second to spare).
    if let Some(sp) = plan.supersede {
        let record = format!("r{}", sp.record);
        let key = format!("{SUPERSEDE_SCOPE}/{record}");
        for (_, _, _, given_up) in j.poisoned.iter().filter(|(_, r, _, _)| *r == record) {
            counts.supersede_give_ups += 1;
            if *given_up >= 1 {
                counts.supersede_sweep_give_ups += 1;
            }
        }
        let sets: Vec<Instant> = j
            .marker_sets
            .iter()
            .filter(|(k, _)| *k == key)
            .map(|(_, t)| *t)
            .collect();
        let runs = by_record.get(record.as_str()).cloned().unwrap_or_default();
        let mut streak = (0u32, Duration::ZERO);
        for r in runs {
            let end = r.end.unwrap_or_else(Instant::now);
            let sup = superseded(r);
            // The run's lease was granted (its last grant to the machine before the run): a
            // trigger that finds it held from then on sets the marker, which the run does not
            // cover (under coalesce it would be the holder's retrigger), so the watch stops the
            // run for it though it came before the logic started.
            let granted = j
                .grants
                .iter()
                .filter(|(t, m, k)| *m == r.machine && *k == key && *t <= r.start)
                .map(|(t, _, _)| *t)
                .max()
                .unwrap_or(r.start);
            // Unless it was removed before the run started: a contended holder's clear of its
            // own marker, after its grant, takes a marker set between the two (its run starts
            // after that trigger and covers it: nothing to stop the run for), and a previous
            // holder's take that lands after the grant answers for the marker with a retrigger
            // (seen at 40,000 seeds with the supersede record's runs failing, seed 23528: a
            // retrigger put by the failed run's holder found the contended holder's slow grant
            // held, and that holder's clear took its marker). The watch never sees such a marker.
            let taken_before_start = |set: Instant| {
                j.marker_takes
                    .iter()
                    .any(|(k, t)| *k == key && *t > set && *t <= r.start)
            };
            let first_set = sets
                .iter()
                .copied()
                .filter(|t| *t > granted && *t < end && !taken_before_start(*t))
                .min();
            if sup {
                counts.supersedes += 1;
                let told = r.told.expect("a superseded run was told");
                if end > told + STOP_GRACE + Duration::from_secs(1) {
                    counts.supersedes_abandoned += 1;
                }
                if !sets.iter().any(|t| *t > granted && *t <= told) {
                    counts.spurious_supersedes += 1;
                }
                if r.completed {
                    violations.push(Violation::Lost(format!(
                        "{record}: run from t={:.3}s superseded at t={:.3}s counted as completed",
                        at(r.start),
                        at(told)
                    )));
                }
            } else if first_set.is_some() {
                counts.protected_runs += 1;
            }
            if plan.faulty {
                continue;
            }
            let protected = streak.0 >= SUPERSEDE_STREAK || streak.1 >= RUN_TIMEOUT;
            let watch_until = r.start + RUN_TIMEOUT.saturating_sub(streak.1);
            if !sup && first_set.is_some() && protected {
                counts.protected_by_streak += 1;
            }
            if sup {
                let told = r.told.expect("a superseded run was told");
                if protected || told > watch_until + Duration::from_secs(1) {
                    violations.push(Violation::Supersede(format!(
                        "(S2) {record}: run from t={:.3}s superseded at t={:.3}s after {} superseded in a row costing {:.3}s",
                        at(r.start),
                        at(told),
                        streak.0,
                        streak.1.as_secs_f64()
                    )));
                }
            }
            if let Some(t) = first_set.filter(|_| !protected) {
                let by = t + RENEW_EVERY + Duration::from_secs(1);
                if by + Duration::from_secs(1) <= watch_until {
                    counts.s1_checks += 1;
                    let in_time = match r.told {
                        Some(told) => {
                            sup && told >= t
                                && told <= by
                                && end <= told + STOP_GRACE.max(r.slow_stop) + Duration::from_secs(1)
                        }
                        None => end <= by,
                    };
                    if !in_time {
                        violations.push(Violation::Supersede(format!(
                            "(S1) {record}: run from t={:.3}s, marker created at t={:.3}s, told to stop at {:?} (superseded: {sup}), ended at t={:.3}s",
                            at(r.start),
                            at(t),
                            r.told.map(at),
                            at(end)
                        )));
                    }
                }
            }
            streak = if sup {
                (streak.0 + 1, streak.1 + (end - r.start))
            } else {
                (0, Duration::ZERO)
            };
        }
        // Functions mode: the host sees each delivery's outcome; every `Superseded` is a run the
        // journal says a watch stopped (the same fencing token).
        for (rec, token) in &j.superseded_outcomes {
            counts.superseded_outcomes += 1;
            if !j
                .runs
                .iter()
                .any(|r| r.record == *rec && r.token == *token && superseded(r))
            {
                violations.push(Violation::Supersede(format!(
                    "{rec}: outcome superseded (token {token:?}) for no run a watch stopped"
                )));
            }
        }
    }

    // (B2, every seed) No wait marker is left once the seed has drained: every wait marker has a
    // waiter or a stand-in, which consumes it; one left has neither, and a trigger that joined it
    // (its create found the marker, so it was acknowledged) was relied on for nothing.
    let mut left = world.markers.waiting();
    if !left.is_empty() {
        left.sort();
        violations.push(Violation::Debounce(format!(
            "(B2) wait markers left with nobody to consume them once drained: {}",
            left.iter().map(|k| k.as_str()).collect::<Vec<_>>().join(", ")
        )));
    }
    // (B1, fault-free debounce seeds) Each burst of a debounce record (as drawn; its triggers'
    // acceptance times: Start's put) is run once it has been quiet for Q or has waited M: the
    // first run of the record from its first trigger on starts at or after
    // min(last + Q, first + M). The waiter's wakes are Q apart, an unchanged ETag at a wake means
    // no touch for a whole period, and M is the sum of its own delays since the first trigger's
    // create, which came after the trigger was accepted.
    // And before min(last + 2Q, first + M) plus the latencies the simulation has: the first
    // trigger's delivery (up to the consumer's or host's 2 s poll, plus requests: `DELIVERY`);
    // each wake is delivered up to a poll late too, and those delays add up, since a waiter's
    // next delay starts after its wake (`DELIVERY` per wake: 2 for the quiet end, M / Q for the
    // longest wait); then the consume, the acquire and the logic's start (`START`). (The design's
    // first + M + Q + 3 s does not hold: with Q = 3 s and M = 6Q, six wakes each up to a poll
    // late come to more than Q + 3 s.)
    // A burst no longer than M less a delivery is one wait, so exactly one run starts between its
    // first trigger and the next burst's. A longer one is cut at M (the wake that has waited M
    // consumes), and its later triggers wait anew and run again: its first run is checked.
    // A burst is checked only when no run of the record is in progress at its first trigger (or
    // ended within a retrigger's latency before it, seed 12149): a
    // run then (the previous burst's, runs last up to 70 s) holds the lease, the concluded waiter
    // sets the retrigger marker and its run comes when that one ends; and the previous burst's
    // second wait may then spill its run into this burst's (seen: seed 418).
    // Not checked for a record whose runs ask to run later (a deferred chain's runs are more than
    // one), nor in a scope that supersedes too (a concluded waiter stops the run in progress).
    if let Some(d) = plan.debounce.as_ref().filter(|d| !plan.faulty && !d.supersede) {
        const DELIVERY: Duration = Duration::from_secs(3);
        const START: Duration = Duration::from_secs(2);
        let (q, m) = (d.quiet, d.longest);
        let wakes = (m.as_millis() / q.as_millis()) as u32;
        for k in 0..d.records {
            let record = DEBOUNCE_FIRST_RECORD + k;
            if plan.throttled.is_some_and(|t| t.record == record) {
                continue;
            }
            let name = format!("r{record}");
            let runs = by_record.get(name.as_str()).map(Vec::as_slice).unwrap_or(&[]);
            let bursts: Vec<(Instant, Instant)> = d
                .bursts
                .iter()
                .filter(|(r, _, _)| *r == record)
                .map(|(_, first, last)| (world.epoch + *first, world.epoch + *last))
                .collect();
            for (i, (first, last)) in bursts.iter().copied().enumerate() {
                // (Or ended so shortly before that its holder's retrigger comes after it.)
                let busy = runs
                    .iter()
                    .any(|r| r.start < first && r.end.is_none_or(|e| e + START + DELIVERY > first));
                if busy {
                    continue;
                }
                // A budget paused while the burst waits puts its run off until the pause ends,
                // and a holder waits for a slot of its budget: timing is not checked then. Nor
                // when a pause held the previous burst's run: its trigger, handed back, may wait
                // anew and take this burst in.
                let span = q * 2 + m + DELIVERY * 4;
                let paused = j
                    .pauses
                    .iter()
                    .any(|(from, to)| *to + span >= first && *from <= last + span);
                // Adaptive concurrency cut by an earlier throttle may still be below 3: holders
                // then wait for slots too (seed 18339: cut to 1 at 117 s, a holder of this
                // burst waited 30 s for a slot at 341 s and was handed back).
                let cut = plan.budget.is_some_and(|b| b.adaptive)
                    && j.pauses.iter().any(|(from, _)| *from <= last + span);
                if paused || cut || plan.budget.is_some_and(|b| b.max_concurrency < 3) {
                    continue;
                }
                counts.b1_checks += 1;
                let next = bursts.get(i + 1).map(|(f, _)| *f);
                let ran: Vec<&RunRecord> = runs
                    .iter()
                    .copied()
                    .filter(|r| r.start >= first && next.is_none_or(|n| r.start < n))
                    .collect();
                let one_wait = last - first + DELIVERY <= m;
                let earliest = (last + q).min(first + m);
                let latest = (last + DELIVERY + (q + DELIVERY) * 2)
                    .min(first + DELIVERY + m + DELIVERY * wakes)
                    + START;
                let starts: Vec<String> = ran.iter().map(|r| format!("t={:.3}s", at(r.start))).collect();
                let in_time = ran
                    .first()
                    .is_some_and(|r| r.start >= earliest && r.start < latest);
                if !in_time || (one_wait && ran.len() != 1) {
                    violations.push(Violation::Debounce(format!(
                        "(B1) {name}: burst t={:.3}s..t={:.3}s (Q {q:?}, M {m:?}) ran at [{}], not {} in t={:.3}s..t={:.3}s",
                        at(first),
                        at(last),
                        starts.join(", "),
                        if one_wait { "once" } else { "first" },
                        at(earliest),
                        at(latest)
                    )));
                }
            }
        }
    }

    if std::env::var_os("LEASEHOLD_SIM_TRACE").is_some() {
        println!("{plan:?}");
        for r in &j.runs {
            println!(
                "run {} machine {} token {:?} {:.3}s..{:?} completed={} failed={} told={:?} superseded={} slow_stop={:?} attempt={} deferred={:?} run_later={:?}",
                r.record,
                r.machine,
                r.token,
                at(r.start),
                r.end.map(at),
                r.completed,
                r.failed,
                r.told.map(at),
                superseded(r),
                r.slow_stop,
                r.attempt,
                r.deferred,
                r.run_later.map(|(t, asked)| (at(t), asked))
            );
        }
        for (k, t) in &j.marker_sets {
            println!("marker {k} created at {:.3}s", at(*t));
        }
        for (t, m, rec) in &j.watch_fired {
            println!(
                "watch of {rec} on machine {m} found the marker set at {:.3}s",
                at(*t)
            );
        }
        for (t, m, recs, _, _) in &j.deaths {
            println!("death of machine {m} at {:.3}s holding {recs:?}", at(*t));
        }
        for (c, rec, t) in &j.accepted {
            println!("accepted {c} {rec} at {:.3}s", at(*t));
        }
        for (c, rec, t, chain) in &j.poisoned {
            println!(
                "poisoned {c:?} {rec} (given up before: {chain}) at {:.3}s",
                at(*t)
            );
        }
    }
    // The checks walk hash maps (runs by record): sorted, a seed's violations are the same list
    // on every run of it.
    violations.sort();
    let mut fingerprint = 0xcbf29ce484222325u64;
    for r in &j.runs {
        for v in [
            (r.start - world.epoch).as_nanos() as u64,
            r.end.map_or(0, |e| (e - world.epoch).as_nanos() as u64),
            r.token.unwrap_or(0),
        ] {
            fingerprint = (fingerprint ^ v).wrapping_mul(0x100000001b3);
        }
    }
    Report {
        runs: j.runs.len(),
        accepted: j.accepted.len(),
        recoveries,
        violations,
        double_faults,
        counts,
        fingerprint,
    }
}
