//! The coalescing record runner: see [`RecordRunner`] for the protocol.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use leasehold_lock::{LeaseGuard, LeaseLock, LockKey, StoreError, StoreErrorKind, StoreResult};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::budget::{Admission, BudgetPermit, Budgets, Lane, Waiting};
use crate::error::{Error, LogicError};
use crate::flow::PerScope;
use crate::history::{History, HistoryEntry, HistoryEvent};
use crate::markers::{MarkerStore, RecordStatus, record_status};
use crate::message::{TriggerKind, TriggerMessage, truncate_to};
use crate::observe::{LockStep, OutcomeSink, record_lock, record_outcome};
use crate::outcome::Outcome;
use crate::poison::PoisonMessage;
use crate::queue::TriggerQueue;
use crate::record::{RecordId, Scope};
use crate::slot::ConsumerSlot;
use crate::trace::TraceContext;
use crate::watchdog::Watchdog;

mod debounce;
mod drive;
mod traced;

pub use debounce::Debounce;
use debounce::{Next, marked};
use traced::{CoalescedLinks, DeliveryTrace};

/// What the logic is told about its run.
#[derive(Debug, Clone)]
pub struct RunContext {
    pub scope: Scope,
    pub record_id: RecordId,
    /// Strictly increasing per record; `None` when fencing is off.
    pub fencing_token: Option<u64>,
    /// Fires when the run must stop: lease lost, time limit, shutdown. Results produced after it
    /// fired are not acknowledged.
    pub cancel: CancellationToken,
    /// Delivery number of this trigger (1 = first). Runs put off by the logic's requests to run
    /// later do not count.
    pub attempt: u32,
    /// How long this trigger has been put off so far by its logic's requests to run later
    /// ([`LogicError::run_later`]); zero for a trigger never put off.
    pub deferred: Duration,
    /// The run's span context ([`crate::trace`]), to hand the downstream (a URL logic sends it
    /// as `traceparent`, a command gets `TRACEPARENT`) so its spans join the trace; `None` when
    /// the trigger has no trace.
    pub trace: Option<TraceContext>,
}

/// A record's logic.
#[async_trait]
pub trait Logic: Send + Sync + 'static {
    async fn run(&self, run: RunContext) -> Result<(), LogicError>;
}

/// Known-wrong protocol variants, kept so the simulation can prove it catches them. Only with
/// the `testing` feature (the crate's own tests turn it on); never use anything but `Correct`.
#[cfg(feature = "testing")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProtocolVariant {
    #[default]
    Correct,
    /// Check the marker *before* releasing the lease (the seed design's class of bug).
    CheckMarkerBeforeRelease,
    /// Let a redelivery or a carrier that finds the lease held set the marker and be
    /// acknowledged (trusting a possibly dead holder).
    TrustHolderOnRedelivery,
    /// Persist a deferral visible at once instead of after its delay (its total still counts
    /// the delay): the record runs again before the time the logic asked for.
    DeferralIgnoresDelay,
    /// Standalone: persist a deferral by deleting the delivered message and then putting the
    /// deferred one, two requests where one Update Message does both: a crash between them
    /// loses the trigger.
    DeferralDeletesThenPuts,
    /// Supersede: release the lease as soon as the stop is decided, before the logic has ended
    /// (then note, release and retrigger as usual): a logic slow to stop still runs when the next
    /// holder starts.
    SupersedeReleasesAtCancel,
    /// Debounce: a stand-in (path C: a redelivery, a sweep, a carrier marked with `wait`) trusts
    /// the wait marker to have a waiter and does not consume it: an orphan (its creator died
    /// before becoming its waiter) is left, with the triggers that joined it.
    StandInTrustsWaitMarker,
    /// Debounce: a waiter ignores that its consume was retried (not `owed`): a retried delete
    /// that answers "gone" (its own lost first attempt took the marker) stands down.
    WaiterStandsDownAfterRetriedDelete,
    /// Debounce: a joining trigger whose touch finds the marker gone creates it again: an
    /// incarnation with no waiter.
    TouchByPut,
    /// A known-wrong decision of the protocol core ([`crate::protocol::Fault`]).
    Core(crate::protocol::Fault),
}

/// What a scope does with a trigger that arrives during a run of its record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RunPolicy {
    /// The run goes on; the triggers that arrived during it cause one more run after it.
    #[default]
    Coalesce,
    /// The run is stopped (as when its lease is lost: the logic is cancelled, a command's process
    /// group gets SIGTERM, then SIGKILL) and the record runs again, on the new data, once it has
    /// ended. Needs fencing: the record's streak of stopped runs is kept with its lease, and
    /// after [`RunnerOptions::supersede_streak`] stopped runs in a row, or once they have cost
    /// the run time limit, a run is let finish (so a steady stream of triggers cannot starve the
    /// record).
    Supersede,
}

impl std::str::FromStr for RunPolicy {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "coalesce" => Ok(RunPolicy::Coalesce),
            "supersede" => Ok(RunPolicy::Supersede),
            other => Err(format!("unknown policy {other:?} (coalesce or supersede)")),
        }
    }
}

impl std::fmt::Display for RunPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RunPolicy::Coalesce => "coalesce",
            RunPolicy::Supersede => "supersede",
        })
    }
}

/// The lock note holding a record's streak of superseded runs: `<runs>:<run time in ms>`.
pub const SUPERSEDED_NOTE: &str = "superseded";

/// Reads a [`SUPERSEDED_NOTE`]: superseded runs in a row, and the run time they cost.
pub fn superseded_streak(note: &str) -> Option<(u32, Duration)> {
    let (runs, ms) = note.split_once(':')?;
    Some((runs.parse().ok()?, Duration::from_millis(ms.parse().ok()?)))
}
/// The lock note naming, by its fencing token, the run whose retry or deferral is pending in a
/// superseding scope: a later run that completes (or is superseded) removes it, and the retry,
/// finding it gone or another's, stands down.
pub const PENDING_NOTE: &str = "pending";

/// How the runner behaves.
#[derive(Debug, Clone)]
pub struct RunnerOptions {
    /// A run longer than this is cancelled, its lease released and its trigger retried.
    /// Default 9 minutes: inside the Functions Consumption plan's 10-minute limit, with a
    /// minute left to release the lease and enqueue a retrigger.
    pub run_timeout: Duration,
    /// How long a cancelled run may take to stop before it is abandoned (and its lease left to
    /// lapse). Default 5 s. Keep it at least 2 s below the lease's safety margin, so logic told
    /// of a lost lease is gone before storage can grant the lease to anyone else.
    pub stop_grace: Duration,
    /// Delay of a recheck (a carrier that found the lease held looks again after it). Default:
    /// the lease's renewal interval + 5 s, set by [`RecordRunner::new`]: short, because a
    /// recheck that comes too early only looks again, while one that comes late delays a dead
    /// holder's recovery.
    pub recheck_delay: Option<Duration>,
    /// Deliveries of a trigger before it is given up (poison queue), when the runner decides
    /// that itself ([`RecordRunner::handle_watched`]). Default 5, as the Functions host.
    pub max_attempts: u32,
    /// Delay before a failed trigger is tried again ([`RecordRunner::handle_watched`]).
    /// Default 5 s.
    pub retry_delay: Duration,
    /// The shortest delay of a run put off by its logic ([`LogicError::run_later`]), so logic
    /// answering "again in 0 s" cannot spin. Default 1 s.
    pub min_deferral: Duration,
    /// The delay of a run put off by its logic without saying for how long. Default 60 s.
    pub default_deferral: Duration,
    /// How long, in total, a trigger may be put off by its logic's requests to run later, per
    /// scope; a request beyond it gives the trigger up ([`Error::DeferralExhausted`]). Default
    /// 24 hours. At most 7 days (the longest a queue message can stay hidden).
    pub max_deferral: PerScope<Duration>,
    /// What each scope does with a trigger that arrives during a run. Default: coalesce.
    pub run_policy: PerScope<RunPolicy>,
    /// Superseded runs of a record in a row after which a run is let finish. Default 3.
    pub supersede_streak: u32,
    /// Each scope's debounce window; `None` (the default): triggers run as they come.
    pub debounce: PerScope<Option<Debounce>>,
    /// The protocol variant (feature `testing` only).
    #[cfg(feature = "testing")]
    pub variant: ProtocolVariant,
}

impl Default for RunnerOptions {
    fn default() -> Self {
        Self {
            run_timeout: Duration::from_secs(540),
            stop_grace: Duration::from_secs(5),
            recheck_delay: None,
            max_attempts: 5,
            retry_delay: Duration::from_secs(5),
            min_deferral: Duration::from_secs(1),
            default_deferral: Duration::from_secs(60),
            max_deferral: PerScope::new(Duration::from_secs(86_400)),
            run_policy: PerScope::new(RunPolicy::Coalesce),
            supersede_streak: 3,
            debounce: PerScope::new(None),
            #[cfg(feature = "testing")]
            variant: ProtocolVariant::Correct,
        }
    }
}

/// How much longer than the lease duration a standalone delivery's message stays hidden after
/// each push ([`crate::ConsumerOptions::visibility`]). It is pushed just before each renewal of
/// the delivery's lease, so a dead holder's message must surface only after the lease renewed
/// last has expired: later than the push by the push's answer and the renewal's flight, and by
/// how much faster the workers' clocks run than storage's over a lease.
pub const CARRIER_MARGIN: Duration = Duration::from_secs(5);

/// How much longer than the lease duration a watchdog stays hidden after each push (just before
/// each renewal of the delivery's lease, as [`CARRIER_MARGIN`] for a standalone message):
/// it must surface only after a dead holder's lease has expired (the renewal lands after the push
/// before it; clock rates and the push's own flight time included).
pub const WATCHDOG_MARGIN: Duration = Duration::from_secs(5);

/// One delivery of a trigger message.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub message: TriggerMessage,
    /// Dequeue count of this delivery (1 = first).
    pub dequeue_count: u32,
}

impl Delivery {
    /// Deliveries of this trigger so far, including those of messages it was carried over from.
    /// Deliberate re-hides of the message ([`TriggerMessage::rehides`]: its deferrals) are
    /// not attempts.
    pub fn attempts(&self) -> u32 {
        self.message
            .prior_attempts
            .saturating_add(self.dequeue_count.saturating_sub(self.message.rehides).max(1))
    }

    /// Whether this message was delivered before without being deliberately re-hidden since:
    /// its earlier delivery may have died holding the lease.
    pub fn redelivered(&self) -> bool {
        self.dequeue_count > self.message.rehides.saturating_add(1)
    }

    /// Whether this delivery may stand in for a dead holder, whose record must run again within
    /// the recovery bound: a carrier ([`TriggerKind::is_carrier`]) other than a deferral as its
    /// live holder wrote it ([`Deferral::released`](crate::Deferral::released)), or a redelivery.
    /// Such a delivery is neither held by its downstream budget's limit nor put off by its pause.
    pub fn may_stand_in(&self) -> bool {
        let released =
            self.message.kind == TriggerKind::Recheck && self.message.deferral.is_some_and(|d| d.released);
        crate::protocol::budget::may_stand_in(self.message.kind, self.redelivered(), released)
    }

    /// The span every event of this delivery is logged in: scope, record, message kind, attempt,
    /// and (once the lease is granted with fencing on) the fencing token.
    pub fn span(&self) -> tracing::Span {
        let message = &self.message;
        tracing::info_span!(
            "delivery",
            scope = %message.scope,
            record = %message.record_id,
            kind = ?message.kind,
            attempt = self.attempts(),
            fencing_token = tracing::field::Empty,
            trace_id = tracing::field::Empty,
        )
    }

    /// The kind of the message that looks again for this delivery when it may not trust a held
    /// lease: a carrier keeps its kind, a redelivered trigger becomes a recheck.
    fn continuation_kind(&self) -> TriggerKind {
        match self.message.kind {
            // A redelivered sweep may follow one that consumed the marker and failed: it has
            // become a run that is owed, whatever the marker says.
            TriggerKind::Sweep if self.redelivered() => TriggerKind::Recheck,
            kind if kind.is_carrier() => kind,
            _ => TriggerKind::Recheck,
        }
    }
}

/// Runs records' logic under their leases with the coalescing protocol.
///
/// # The protocol
///
/// The coalescing record runner: run a record's logic under its lease, and make sure that
/// triggers arriving during a run cause exactly one more run.
///
/// Per record there is a lock blob (`locks/<scope>/<record>`, leased while a run is in progress,
/// fencing generation in its metadata) and a retrigger marker (`retrigger/<scope>/<record>`, whose
/// existence means "a trigger arrived during a run").
///
/// * Holder path: acquire → run logic while the guard renews → release → *then* delete the marker
///   (202 = it was set) → if it was set, enqueue one retrigger → acknowledge.
/// * Contended path: create the marker with `If-None-Match: *`. If we created it, try the lease
///   once more (with the same lease id): if that succeeds we are the holder (we delete our own
///   marker before running, since our run covers it); if it fails, the holder will find the
///   marker after its release. If the marker already existed, whoever created it is already
///   bound to that same second look.
///
/// **Dead holders.** Leaving a marker is safe only if the holder will read it, or if something
/// else will run the record once the holder's lease has expired. So every holder has a
/// *carrier*: a queue message that comes back if the holder dies, only after its lease must have
/// expired, and then runs the record.
///
/// * Standalone ([`RecordRunner::handle`]): the holder's own trigger message, kept hidden by
///   the consumer while the process lives (lease duration + renewal interval at a time).
/// * Functions mode ([`RecordRunner::handle_watched`]): the host keeps a message hidden for 10
///   minutes whatever happens, so each delivery first puts a hidden *watchdog* message, pushes it
///   a lease duration + renewal interval + 5 s ahead after each lease renewal, and deletes it when
///   it ends. If the whole host dies, the watchdog surfaces at most that long (45 s by default)
///   after the death, once the lease has expired, and stands in for the delivery. A failed run turns the watchdog into its retry (and the host's message is
///   acknowledged), so the retry never waits for the host.
///
/// A carrier ([`TriggerKind::is_carrier`]: recheck, watchdog, sweep), and in standalone mode a
/// redelivered trigger (it may be looking at its own dead holder's lease), never takes a held
/// lease on trust: it looks again later (a recheck after a renewal interval + 5 s, or the
/// watchdog left in place), until the lease is free. Everything else that finds the lease held sets the marker and is
/// acknowledged: the holder reads it, or the holder's carrier runs the record.
///
/// **Giving up.** A trigger given up after too many failed deliveries goes to the poison queue
/// with its reason, and then a sweep message is queued: the poisoned trigger's earlier holder may
/// have died with triggers coalesced onto it (having consumed their marker, even), so the sweep
/// runs the record once more when the lease is free, whatever the marker says. Only a sweep's own
/// chain, given up again, gets a sweep that asks the marker first, so the cycle ends.
///
/// **Stopping.** A run is cancelled when its lease is lost, its time limit passes or `cancel`
/// fires; it has [`RunnerOptions::stop_grace`] to stop. Logic that does not stop by then is
/// abandoned *and its lease is left to lapse* instead of released, so nobody else can start
/// while it may still be running; its message is retried once the lease has expired. A logic
/// that panics fails its run like an error.
///
/// The design, with the reasons for each step's order, is in `docs/design.md`; its proof is the
/// simulation in `tests/runtime/sim.rs` and one deterministic test per bug in
/// `tests/runtime/regressions.rs`.
#[derive(Debug, Clone)]
pub struct RecordRunner {
    lock: LeaseLock,
    markers: Arc<dyn MarkerStore>,
    queue: Arc<dyn TriggerQueue>,
    logic: Arc<dyn Logic>,
    options: RunnerOptions,
    recheck_delay: Duration,
    sink: Option<OutcomeSink>,
    /// Where what happens to each record is written for every instance to read, if anywhere.
    history: Option<History>,
    /// The downstream budgets its runs draw on, if any.
    budgets: Option<Budgets>,
    /// The lane its queue is: its deliveries' priority for a budget's slots.
    lane: Lane,
    /// Told when it puts a message that is visible at once (a retrigger): the consumer of this
    /// process polls then instead of when its idle back-off ends ([`Consumer`](crate::Consumer)
    /// sets it).
    wake: Option<Arc<tokio::sync::Notify>>,
    /// Contexts of triggers that coalesced onto runs here, for the holder's retrigger to name.
    coalesced: CoalescedLinks,
}

impl std::fmt::Debug for dyn Logic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Logic")
    }
}

impl RecordRunner {
    pub fn new(
        lock: LeaseLock,
        markers: Arc<dyn MarkerStore>,
        queue: Arc<dyn TriggerQueue>,
        logic: Arc<dyn Logic>,
        options: RunnerOptions,
    ) -> Self {
        let recheck_delay = options
            .recheck_delay
            .unwrap_or(lock.options().renew_every + Duration::from_secs(5));
        if options.stop_grace + Duration::from_secs(2) > lock.options().safety_margin {
            tracing::warn!(stop_grace = ?options.stop_grace, safety_margin = ?lock.options().safety_margin,
                "the runner's stop grace is not 2 s shorter than the lease's safety margin: logic told of a lost lease may still run when storage hands the lease on");
        }
        let late_window = lock.options().retry.late_window;
        if options.debounce.values().any(Option::is_some) && options.retry_delay < late_window {
            tracing::warn!(retry_delay = ?options.retry_delay, ?late_window,
                "debounce is on and the retry delay is shorter than the storage retry's late window: a wait marker created by a request that landed after its delivery failed may outlive that delivery's retry, which should have consumed it");
        }
        Self {
            lock,
            markers,
            queue,
            logic,
            options,
            recheck_delay,
            sink: None,
            history: None,
            budgets: None,
            lane: Lane::High,
            wake: None,
            coalesced: CoalescedLinks::default(),
        }
    }

    /// This runner, telling `wake` whenever it puts a message that is visible at once (a
    /// retrigger), so a consumer polling its queue takes it at once: a follow-up run then starts
    /// within a poll's round trip of the run before it, wherever the consumer's idle back-off
    /// stood.
    pub fn waking(mut self, wake: Arc<tokio::sync::Notify>) -> Self {
        self.wake = Some(wake);
        self
    }

    /// A runner of `lane` wired exactly as `leasehold serve` and `leasehold handler` wire each
    /// lane's: its runs drawing on the process's downstream `budgets`. What a trigger costs is
    /// counted (tests, the benchmark) on a runner built so, never on a reduced one.
    pub fn shipped(
        lock: LeaseLock,
        markers: Arc<dyn MarkerStore>,
        queue: Arc<dyn TriggerQueue>,
        logic: Arc<dyn Logic>,
        options: RunnerOptions,
        budgets: &Budgets,
        lane: Lane,
    ) -> Self {
        Self::new(lock, markers, queue, logic, options)
            .with_budgets(budgets.clone())
            .with_lane(lane)
    }

    /// This runner, its runs drawing on `budgets` (shared by every runner of the process).
    pub fn with_budgets(mut self, budgets: Budgets) -> Self {
        self.budgets = Some(budgets);
        self
    }

    /// This runner, serving the queue of `lane` (its follow-ups go to that same queue).
    pub fn with_lane(mut self, lane: Lane) -> Self {
        self.lane = lane;
        self
    }

    pub fn lane(&self) -> Lane {
        self.lane
    }

    pub fn budgets(&self) -> Option<&Budgets> {
        self.budgets.as_ref()
    }

    /// This runner, telling `sink` of every delivery's outcome (after it is logged and counted).
    pub fn with_outcome_sink(mut self, sink: OutcomeSink) -> Self {
        self.sink = Some(sink);
        self
    }

    /// This runner, writing what happens to each record to `history` (off the run's path: a
    /// history write never delays nor fails a run).
    pub fn with_history(mut self, history: History) -> Self {
        self.history = Some(history);
        self
    }

    pub fn history(&self) -> Option<&History> {
        self.history.as_ref()
    }

    /// Where a delivery's outcome goes once it is decided, in both modes: its log event, the
    /// [`crate::observe::DELIVERIES_TOTAL`] metric, the outcome sink and the history.
    pub(crate) fn finished(&self, delivery: &Delivery, outcome: &Outcome, ended: &Ended) {
        log(outcome);
        if let Some(trace) = &ended.trace {
            self.trace_outcome(delivery, trace, outcome, ended.token);
        }
        record_outcome(outcome);
        if let Some(sink) = &self.sink {
            sink.tell(
                &delivery.message.scope,
                &delivery.message.record_id,
                outcome,
                ended.ran,
            );
        }
        if let Some(history) = &self.history {
            history.record(self.outcome_entry(delivery, outcome, ended));
        }
    }

    /// A history entry of `delivery` for `event`, with what the delivery knows.
    fn entry(&self, delivery: &Delivery, event: HistoryEvent) -> HistoryEntry {
        let message = &delivery.message;
        let mut entry = HistoryEntry::new(message.scope.clone(), message.record_id.clone(), event);
        entry.attempt = delivery.attempts();
        entry.instance = self.lock.options().holder.clone();
        entry.lane = Some(self.lane.as_str().to_string());
        entry.correlation_id = message.correlation_id.clone();
        entry.trace_id = message.trace().map(|t| t.trace_id_hex());
        entry
    }

    /// The history entry of a delivery's outcome.
    fn outcome_entry(&self, delivery: &Delivery, outcome: &Outcome, ended: &Ended) -> HistoryEntry {
        let mut entry = self.entry(delivery, HistoryEvent::Outcome(outcome.label()));
        if let Some(context) = ended.trace.as_ref().and_then(|t| t.process.context()) {
            entry.trace_id = Some(context.trace_id_hex());
        }
        entry.fencing_token = ended.token;
        entry.run_ms = ended.ran.map(|d| d.as_millis() as u64);
        entry.budget = ended.budget.clone();
        match outcome {
            Outcome::Completed { fencing_token, .. } | Outcome::Superseded { fencing_token, .. } => {
                entry.fencing_token = fencing_token.or(entry.fencing_token);
            }
            Outcome::Rechecking { after } => entry = entry.until_after(*after),
            Outcome::Retrying { error, after } => entry = entry.until_after(*after).with_reason(error),
            Outcome::Poisoned { error } | Outcome::Failed { error, .. } => entry = entry.with_reason(error),
            Outcome::Deferred { after, why, .. } => entry = entry.until_after(*after).with_reason(why),
            Outcome::Waiting { after, .. } => entry = entry.until_after(*after),
            Outcome::Paused { budget, after, .. } => {
                entry.budget = Some(budget.clone());
                entry = entry.until_after(*after);
            }
            Outcome::Coalesced | Outcome::Debounced { .. } => {}
        }
        entry
    }

    pub fn lock(&self) -> &LeaseLock {
        &self.lock
    }

    pub fn queue(&self) -> &Arc<dyn TriggerQueue> {
        &self.queue
    }

    /// What storage says about a record now: its lease and whether a retrigger is pending.
    pub async fn status(&self, scope: &Scope, record_id: &RecordId) -> Result<RecordStatus, Error> {
        record_status(&self.lock, &*self.markers, scope, record_id).await
    }

    pub fn options(&self) -> &RunnerOptions {
        &self.options
    }

    /// Handles one delivery whose message the caller keeps hidden only while this process lives
    /// (the standalone [`crate::Consumer`]): the message itself is the carrier. `cancel` stops a
    /// run from outside (shutdown); the trigger is then not acknowledged.
    ///
    /// In a scope that debounces, prefer [`crate::Consumer`], which also knows until when the
    /// message stays hidden and sends no wait-marker request that could land after it may be
    /// delivered again; a caller of this method must keep its messages hidden, renewed, for at
    /// least 15 s past any delivery in progress (a request's time limit and its late window).
    pub async fn handle(&self, delivery: &Delivery, cancel: &CancellationToken) -> Outcome {
        let span = delivery.span();
        let (outcome, ended) = self
            .handle_untold(delivery, cancel, None)
            .instrument(span.clone())
            .await;
        span.in_scope(|| self.finished(delivery, &outcome, &ended));
        outcome
    }

    /// [`handle`](Self::handle) without telling the outcome ([`finished`](Self::finished)), for
    /// a caller that acts on it first (the consumer gives a trigger up, or writes the retry):
    /// the outcome, and what else the delivery leaves ([`Ended`]). Call it in the delivery's span.
    /// `hidden`, when the caller knows it, says until when the delivered message stays hidden:
    /// a wait marker is then never created or deleted by a request that could land after the
    /// message may have come back (see [`HiddenUntil`]).
    pub(crate) async fn handle_untold(
        &self,
        delivery: &Delivery,
        cancel: &CancellationToken,
        hidden: Option<&HiddenUntil>,
    ) -> (Outcome, Ended) {
        let traced = self.trace_delivery(delivery);
        let (delivery, trace) = match &traced {
            Some((traced, trace)) => (traced, Some(trace.clone())),
            None => (delivery, None),
        };
        if let Some(paused) = self.paused(
            delivery,
            hidden.and_then(|h| h.slot.as_deref()),
            MAX_SLOT_WAIT_WATCHED,
        ) {
            return (
                paused,
                Ended {
                    trace,
                    ..Ended::of(delivery)
                },
            );
        }
        let mut ended = Ended {
            trace: trace.clone(),
            ..Ended::of(delivery)
        };
        let step = self.debounce_step(delivery);
        let outcome = match self.debounce(step, delivery, hidden).await {
            // Only a debounce step ends a delivery here.
            Next::Done(outcome) => {
                if outcome.error().is_some() {
                    // A wait marker delete that failed may have landed: the delivery then owes
                    // a run, which no later run may stand in for (no `afterToken`).
                    ended = Ended {
                        trace: trace.clone(),
                        ..Ended::default()
                    };
                }
                outcome
            }
            Next::Carry(carried) => {
                ended = Ended {
                    trace: trace.clone(),
                    ..Ended::carried(delivery, &carried)
                };
                self.handle_key(&carried.message.key(), &carried, cancel, None, hidden, &mut ended)
                    .await
            }
        };
        (outcome, ended)
    }

    /// The outcome of a delivery its downstream budget's pause turns away before it does
    /// anything ([`Budgets::paused`]): [`Outcome::Paused`] with the message as it is, for a
    /// standalone caller to hide again in place (see [`handle_watched`](Self::handle_watched)
    /// for Functions). `None`: go on.
    ///
    /// Only a pause that outlasts what a holder may wait under its lease (`longest_wait`: 30 s
    /// standalone, [`MAX_PAUSE_WAIT_WATCHED`] under Functions) turns a delivery away; a shorter
    /// one is waited out under the lease. And only a trigger
    /// that would run is turned away: not one that may stand in for a dead holder, whose record
    /// must run again within the recovery bound ([`Delivery::may_stand_in`]: a carrier other
    /// than a deferral as its holder wrote it, or a redelivery, which hidden again in place
    /// would no longer look like one), a debounce waiter or stand-in (its wait has its own
    /// clock, and the lease is where it meets the pause), nor a trigger that is about to wait
    /// for its burst to end (it will not run now anyway). The holder of the lease meets the
    /// pause again before its run ([`slot`](Self::slot)). A shorter pause turns a delivery away
    /// too when the consumer has no room left for deliveries that wait at a gate (`slot`): it
    /// would wait holding a slot of the consumer, which a dead holder's message may need.
    fn paused(
        &self,
        delivery: &Delivery,
        slot: Option<&ConsumerSlot>,
        longest_wait: Duration,
    ) -> Option<Outcome> {
        let budgets = self.budgets.as_ref()?;
        let message = &delivery.message;
        if delivery.may_stand_in() || message.wait.is_some() {
            return None;
        }
        if message.kind == TriggerKind::Trigger && self.options.debounce.get(&message.scope).is_some() {
            return None;
        }
        let (budget, after) = budgets.paused(&message.scope)?;
        // A pause that ends within what a holder may wait is waited out under the lease (where
        // triggers for the record coalesce onto it), not handed back: handing back costs the
        // message a round trip and, with a backlog, a pass over all of it per pause.
        let room_full = slot.is_some_and(ConsumerSlot::room_full);
        if !crate::protocol::budget::handed_back_before_the_lock(
            after > longest_wait,
            room_full,
            self.fault(),
        ) {
            return None;
        }
        Some(Outcome::Paused {
            budget,
            after,
            next: Box::new(message.clone()),
        })
    }

    /// A holder's slot of its downstream budget, taken just before its run ([`Budgets::admit`]):
    /// it waits for one while its lease is renewed, a delivery of the high lane before any of the
    /// low lane but for the low lane's share (under Functions at most [`MAX_SLOT_WAIT_WATCHED`]:
    /// the host's invocation must not be held for minutes). A pause is waited out only if it
    /// ends within 30 s ([`MAX_PAUSE_WAIT_WATCHED`] under Functions), whether or not the
    /// delivery saw it at the first gate. Standalone, a holder about to wait gives its slot of
    /// the consumer back for a seat of the consumer's waiting room (`consumer_slot`,
    /// [`ConsumerSlot`]); with no seat free, a pause hands it back. `Err((budget, after))`: the
    /// budget is paused past that wait (or, under Functions, no slot came in time): the trigger
    /// is handed back, hidden for `after`, without running. A delivery that may stand in for a dead holder
    /// ([`Delivery::may_stand_in`]) is neither put off by a pause nor held by the limit; its run
    /// counts all the same. `Ok(None)`: no budgets.
    async fn slot(
        &self,
        delivery: &Delivery,
        cancel: &CancellationToken,
        watched: bool,
        consumer_slot: Option<&ConsumerSlot>,
    ) -> Result<Option<Slot>, (String, Duration)> {
        let Some(budgets) = &self.budgets else {
            return Ok(None);
        };
        let message = &delivery.message;
        let park = consumer_slot
            .filter(|_| crate::protocol::budget::offers_seat(self.fault()))
            .map(|s| move || s.park());
        let waiting = Waiting {
            stand_in: delivery.may_stand_in(),
            // Under Functions the host's invocation must not be held for minutes.
            slot: watched.then_some(MAX_SLOT_WAIT_WATCHED),
            // In both modes a pause is waited out under the lease only if it ends soon: a
            // holder's wait holds its lease and its message, and standalone, while it waits,
            // its slot of the consumer goes to other work if the consumer has room. Under
            // Functions it holds one of the host's invocations, which a dead holder's watchdog
            // may need: only a pause of a few seconds is waited out there.
            pause: Some(if watched {
                MAX_PAUSE_WAIT_WATCHED
            } else {
                MAX_SLOT_WAIT_WATCHED
            }),
            park: park.as_ref().map(|p| p as &(dyn Fn() -> bool + Send + Sync)),
        };
        let admitted = tokio::select! {
            // Biased, so the same instants give the same choice (the simulation replays).
            biased;
            admitted = budgets.admit_with(&message.scope, self.lane, waiting) => admitted,
            // Stopped while waiting: the caller's cancellation ends the run (`Cancelled`).
            _ = cancel.cancelled() => return Ok(None),
        };
        // Back to a slot of the consumer for the run, if one is free (else the seat it waited
        // in stands for one: never waiting for a slot while holding the budget's).
        if let Some(s) = consumer_slot {
            s.unpark();
        }
        match admitted {
            Admission::Go(permit) => Ok(Some(Slot {
                waited: permit.waited(),
                permit,
            })),
            Admission::Paused { budget, after } => Err((budget, after)),
        }
    }

    /// Handles one delivery whose message someone else keeps hidden, for longer than a lease,
    /// whatever happens to this process (the Functions host: 10 minutes). A hidden watchdog
    /// message is put first and carries the delivery's duty if its host dies; a failed run turns
    /// it into the retry, and a trigger that failed `max_attempts` times is given up (poison
    /// queue, with a sweep). Every outcome but `Failed` means: acknowledge.
    /// Costs 2 round trips per delivery (put and delete of the watchdog) plus one per lease
    /// renewal while a run lasts.
    pub async fn handle_watched(
        &self,
        delivery: &Delivery,
        poison: &dyn TriggerQueue,
        cancel: &CancellationToken,
    ) -> Outcome {
        async {
            let traced = self.trace_delivery(delivery);
            let (inner, trace) = match &traced {
                Some((traced, trace)) => (traced, Some(trace.clone())),
                None => (delivery, None),
            };
            let mut ended = Ended {
                trace,
                ..Ended::of(delivery)
            };
            let outcome = self.handle_watched_inner(inner, poison, cancel, &mut ended).await;
            self.finished(delivery, &outcome, &ended);
            outcome
        }
        .instrument(delivery.span())
        .await
    }

    async fn handle_watched_inner(
        &self,
        delivery: &Delivery,
        poison: &dyn TriggerQueue,
        cancel: &CancellationToken,
        ended: &mut Ended,
    ) -> Outcome {
        let msg = &delivery.message;
        let attempts = delivery.attempts();
        if attempts > self.options.max_attempts {
            // Only a message the host redelivered after a crash can get here.
            let error = Error::GaveUp {
                deliveries: attempts - 1,
                max: self.options.max_attempts,
                last: None,
            };
            return self.poison_delivery(poison, delivery, error).await;
        }
        if let Some(Outcome::Paused { budget, after, .. }) =
            self.paused(delivery, None, MAX_PAUSE_WAIT_WATCHED)
        {
            // Nothing was done: a copy comes back after the pause, carrying the attempts so far
            // (this delivery does not count), and the host's message is acknowledged.
            let next = msg.follow_up(msg.kind, attempts - 1);
            return match self.enqueue(&next, after).await {
                Ok(()) => Outcome::Paused {
                    budget,
                    after,
                    next: Box::new(next),
                },
                Err(e) => storage_failed("put the paused trigger back", e),
            };
        }
        let key = msg.key();
        // A delivery that may leave a wait marker behind has carriers that stand in for it.
        let step = self.debounce_step(delivery);
        let marks = step.marks_carrier();
        let carrier = |m: TriggerMessage| if marks { marked(m) } else { m };
        let standin = carrier(msg.follow_up(TriggerKind::Watchdog, attempts));
        let watchdog = match Watchdog::arm(
            self.queue.clone(),
            &self.options_retry(),
            &standin,
            self.watchdog_visibility(),
        )
        .await
        {
            Ok(w) => Arc::new(w),
            // Nothing happened yet: the host retries its message.
            Err(e) => return storage_failed("put watchdog", e),
        };
        // What the delivery's follow-ups (a retry, a recheck) are made of: once it carries on
        // past its debounce step, the message without `wait`.
        // The host keeps its message hidden for 10 minutes whatever happens: no visibility to
        // watch here (a wait marker left by a late request is covered by that message, or the
        // watchdog put afresh).
        let (outcome, carried) = match self.debounce(step, delivery, None).await {
            Next::Done(outcome) => {
                if outcome.error().is_some() {
                    // As in `handle_untold`: the retry carries no `afterToken`.
                    *ended = Ended::default();
                }
                let mut retry_of = carrier(msg.clone());
                retry_of.after_token = ended.after_token;
                (outcome, retry_of)
            }
            Next::Carry(carried) => {
                *ended = Ended::carried(delivery, &carried);
                (
                    self.handle_key(&key, &carried, cancel, Some(&watchdog), None, ended)
                        .await,
                    carried.message,
                )
            }
        };
        let msg = &carried;
        // Given up as the message it carried on as (a stand-in that consumed a wait marker has
        // a fresh chain's give-up count).
        let delivery = &Delivery {
            message: carried.clone(),
            dequeue_count: delivery.dequeue_count,
        };
        let outcome = match outcome {
            // Handed back before its run: the watchdog becomes it; the host's message is
            // acknowledged. If that fails, the host retries its message (early, nothing lost).
            Outcome::Paused { budget, after, next } => match self.rearm_or_put(&watchdog, &next, after).await
            {
                Ok(()) => return Outcome::Paused { budget, after, next },
                Err(e) => storage_failed("hand the paused trigger back", e),
            },
            // The watchdog becomes the waiter; the host's message is acknowledged.
            Outcome::Waiting { after, next } => match self.rearm_or_put(&watchdog, &next, after).await {
                Ok(()) => return Outcome::Waiting { after, next },
                // Not acknowledged: it may be that nobody waits for a marker this delivery
                // created. Its retry, or the host's redelivery, stands in for it.
                Err(e) => storage_failed("persist the waiter", e),
            },
            other => other,
        };
        match outcome {
            Outcome::Rechecking { after } => {
                // Leave the watchdog in place as the look again; this delivery did not fail.
                let again = msg.looking_again(delivery.continuation_kind(), attempts - 1);
                if let Err(e) = self.rearm_or_put(&watchdog, &again, after).await {
                    tracing::warn!(error = %e, "could not reschedule the watchdog; it surfaces when its visibility lapses");
                }
                Outcome::Rechecking { after }
            }
            Outcome::Deferred {
                after,
                total,
                asked,
                why,
                next,
            } => match self.rearm_or_put(&watchdog, &next, after).await {
                // The host's message is acknowledged; the watchdog, a message the host never
                // took, carries the later run, so no deferral counts towards the host's
                // maxDequeueCount.
                Ok(()) => Outcome::Deferred {
                    after,
                    total,
                    asked,
                    why,
                    next,
                },
                // The host retries its message (and the watchdog may surface too): early, but
                // nothing lost. The storage failure counts as a failed attempt.
                Err(e) => storage_failed("persist the deferral", e),
            },
            Outcome::Failed { error, .. } if error.gives_up() => {
                let outcome = self.poison_delivery(poison, delivery, error).await;
                if outcome.acknowledge() {
                    watchdog.disarm().await;
                }
                outcome
            }
            Outcome::Failed { error, .. } if attempts >= self.options.max_attempts => {
                let error = Error::GaveUp {
                    deliveries: attempts,
                    max: self.options.max_attempts,
                    last: Some(Box::new(error)),
                };
                let outcome = self.poison_delivery(poison, delivery, error).await;
                if outcome.acknowledge() {
                    watchdog.disarm().await;
                }
                outcome
            }
            Outcome::Failed { error, retriggered } => {
                let mut retry = msg.follow_up(TriggerKind::Watchdog, attempts);
                retry.after_token = ended.after_token;
                let after = self.options.retry_delay;
                match self.rearm_or_put(&watchdog, &retry, after).await {
                    Ok(()) => Outcome::Retrying { error, after },
                    // The host retries its message (and the watchdog may surface too).
                    Err(_) => Outcome::Failed { error, retriggered },
                }
            }
            other => {
                watchdog.disarm().await;
                other
            }
        }
    }

    /// Gives a trigger up: writes its poison entry, then queues a sweep (so triggers that
    /// coalesced onto a holder of it are still honoured). The caller deletes the message only if
    /// this succeeds.
    ///
    /// The entry goes first: if the sweep's put fails after it, the message is given up again
    /// later and its entry is written twice, while a poison write that fails leaves no sweep
    /// behind for the next give-up to double. An entry storage refuses for what it is (413 or
    /// 400: [`PoisonMessage::encode`] always fits the queue, so only a malformed request gets
    /// here) would be refused on every retry: that refusal is final, logged with the record and
    /// the reason, and the give-up goes on without the entry.
    pub async fn give_up(&self, poison: &dyn TriggerQueue, entry: &PoisonMessage) -> Result<(), StoreError> {
        let body = entry.encode();
        let (scope, record) = match &entry.trigger {
            Some(t) => (Some(t.scope.as_str()), Some(t.record_id.as_str())),
            None => (None, None),
        };
        let reason = truncate_to(entry.reason(), 1024);
        match self
            .options_retry()
            .run("write poison", || poison.put(&body, Duration::ZERO))
            .await
        {
            Ok(_) => tracing::error!(
                scope,
                record,
                dequeue_count = entry.dequeue_count,
                reason,
                poison_queue = poison.name(),
                "trigger moved to the poison queue"
            ),
            Err(e) if e.kind() == StoreErrorKind::Rejected && matches!(e.status(), Some(400 | 413)) => {
                tracing::error!(
                    scope,
                    record,
                    dequeue_count = entry.dequeue_count,
                    reason,
                    poison_queue = poison.name(),
                    error = %e,
                    "the poison queue refused the entry for good; the trigger is given up without one (this log line is its only record)"
                )
            }
            Err(e) => return Err(e),
        }
        if let Some(trigger) = &entry.trigger {
            let mut sweep = trigger.follow_up(TriggerKind::Sweep, 0);
            sweep.given_up = trigger.given_up.saturating_add(1);
            // It stands for other triggers than the one given up: a budget of its own, and no
            // run it waits for.
            sweep.deferral = None;
            sweep.after_token = None;
            // A sweep always stands in for a wait marker its trigger may have left.
            sweep.wait = None;
            // Not before a request of the given-up delivery that timed out may still land (a
            // marker take, a wait marker's create or delete): the sweep's run must start after it.
            self.enqueue(&sweep, self.lock.options().retry.late_window)
                .await?;
        }
        Ok(())
    }

    async fn poison_delivery(&self, poison: &dyn TriggerQueue, delivery: &Delivery, error: Error) -> Outcome {
        let entry = PoisonMessage::new(
            delivery.message.encode(),
            Some(delivery.message.clone()),
            &error,
            delivery.dequeue_count,
        );
        match self.give_up(poison, &entry).await {
            Ok(()) => Outcome::Poisoned { error },
            Err(e) => storage_failed("give the trigger up", e),
        }
    }

    /// Turns the watchdog into `message`, visible after `after`. If the watchdog is gone — it
    /// surfaced during this delivery (which outlived its visibility without a grant) and was
    /// taken — its taker cannot stand for what this delivery may still leave behind: one of our
    /// acquires that timed out may land after the taker looked, leaving a lease that nobody
    /// renews and onto which a trigger may coalesce. So the message is put afresh. At worst one
    /// run more; without it, a lost trigger.
    async fn rearm_or_put(
        &self,
        watchdog: &Watchdog,
        message: &TriggerMessage,
        after: Duration,
    ) -> Result<(), StoreError> {
        match watchdog.rearm(message, after).await {
            Err(e) if e.kind() == StoreErrorKind::NotFound => {
                tracing::debug!("the watchdog was taken during the delivery; its follow-up is put afresh");
                self.enqueue(message, after).await
            }
            other => other,
        }
    }

    fn options_retry(&self) -> leasehold_lock::RetryOptions {
        self.lock.options().retry.clone()
    }

    /// A watchdog pushed just before a renewal must still be hidden when the lease that renewal
    /// extended expires: lease duration + margin (35 s by default). Its first put, before the
    /// grant, covers the grant's lease the same way.
    fn watchdog_visibility(&self) -> Duration {
        let lease = self.lock.options();
        lease.duration.as_duration() + WATCHDOG_MARGIN
    }

    /// The record's streak of superseded runs, when its scope supersedes (and fencing is on: the
    /// pending note names a run by its token): runs in a row, and the run time they cost. One
    /// read of the lease's notes, only in a superseding scope.
    async fn supersede_streak(
        &self,
        delivery: &Delivery,
        guard: &LeaseGuard,
    ) -> Result<Option<Streak>, leasehold_lock::Error> {
        if *self.options.run_policy.get(&delivery.message.scope) != RunPolicy::Supersede
            || guard.fencing_token().is_none()
        {
            return Ok(None);
        }
        let note = guard.note(SUPERSEDED_NOTE).await?;
        let (runs, lost) = note
            .as_deref()
            .and_then(superseded_streak)
            .unwrap_or((0, Duration::ZERO));
        Ok(Some(Streak {
            runs,
            lost,
            noted: note.is_some(),
            pending: guard.note(PENDING_NOTE).await?.and_then(|p| p.parse().ok()),
        }))
    }

    /// Starts watching for triggers during the run, unless the streak protects it: after each
    /// renewal of the lease, one read of the retrigger marker; once it is set, `fired` fires. It
    /// stops watching when the streak plus this run reach the run time limit.
    fn watch_for_triggers(&self, key: &LockKey, guard: &LeaseGuard, streak: Streak) -> Option<Watch> {
        let budget = self.options.run_timeout.checked_sub(streak.lost)?;
        if streak.runs >= self.options.supersede_streak || budget.is_zero() {
            tracing::debug!(
                superseded_in_a_row = streak.runs,
                lost_s = streak.lost.as_secs(),
                "this run is let finish: its record was superseded enough in a row"
            );
            return None;
        }
        let fired = CancellationToken::new();
        let mut renewals = guard.renewals();
        let (markers, key, fire) = (self.markers.clone(), key.clone(), fired.clone());
        let task = tokio::spawn(
            async move {
                let until = Instant::now() + budget;
                while renewals.changed().await.is_ok() && Instant::now() < until {
                    // Let whoever else follows the renewals go first: the channel wakes its
                    // waiters in no fixed order, and the simulation replays a seed only if the
                    // requests keep theirs. (Carriers no longer follow the channel: they are
                    // pushed before each renewal. The yield stays, so seeds replay as before.)
                    tokio::task::yield_now().await;
                    match markers.is_set(&key).await {
                        Ok(true) => {
                            tracing::info!("a trigger arrived during the run: stopping it, to run again on the new data");
                            fire.cancel();
                            return;
                        }
                        Ok(false) => {}
                        Err(e) => tracing::debug!(error = %e, "could not look at the retrigger marker; looking again at the next renewal"),
                    }
                }
            }
            .instrument(tracing::Span::current()),
        );
        Some(Watch { fired, task })
    }

    /// Records how the run ended in the record's notes, under the lease (before the release), in
    /// one write and only if something changes: the streak (one superseded run more, or — if it
    /// ended any other way and a streak was noted — broken) and `pending` (`Some(Some(token))`:
    /// this run's retry or deferral pends; `Some(None)`: none pends; `None`: as it was). Whether
    /// the notes now say what was asked; a write that fails is logged, and the notes stay as they
    /// were (the guard trips later, a retry runs).
    async fn note_streak(
        &self,
        guard: &LeaseGuard,
        streak: Streak,
        superseded: bool,
        run_time: Duration,
        pending: Option<Option<u64>>,
    ) -> bool {
        if guard.is_lost() {
            // Nothing can be written under a lost lease.
            return false;
        }
        let mut changes = Vec::new();
        if superseded {
            let lost = streak.lost + run_time;
            changes.push((
                SUPERSEDED_NOTE,
                Some(format!("{}:{}", streak.runs + 1, lost.as_millis())),
            ));
        } else if streak.noted {
            changes.push((SUPERSEDED_NOTE, None));
        }
        match pending {
            Some(p) if p != streak.pending => changes.push((PENDING_NOTE, p.map(|t| t.to_string()))),
            _ => {}
        }
        if changes.is_empty() {
            return true;
        }
        match guard.write_notes(&changes).await {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "could not note how the run ended for the record's next runs");
                false
            }
        }
    }

    /// The deferral of a run whose logic asked to be run later: after `asked` (or the default),
    /// no sooner than the shortest deferral and within what is left of the chain's budget; once that is spent,
    /// the trigger is given up ([`Error::DeferralExhausted`], which the caller poisons at once).
    fn defer(&self, delivery: &Delivery, asked: Option<Duration>, why: String) -> Outcome {
        let message = &delivery.message;
        let max = *self.options.max_deferral.get(&message.scope);
        let so_far = message.deferral.unwrap_or(crate::message::Deferral {
            total_ms: 0,
            hops: 0,
            id: 0,
            released: false,
            throttled: false,
        });
        let floor = self.options.min_deferral;
        let remaining = max.saturating_sub(so_far.total());
        if remaining < floor.max(Duration::from_millis(1)) {
            return Outcome::Failed {
                error: Error::DeferralExhausted {
                    total: so_far.total(),
                    max,
                    hops: so_far.hops,
                    asked,
                    why,
                },
                retriggered: false,
            };
        }
        let after = asked
            .unwrap_or(self.options.default_deferral)
            .max(floor)
            .min(remaining);
        let next = message.deferred(
            delivery.attempts().saturating_sub(1),
            after,
            uuid::Uuid::new_v4().as_u64_pair().0 >> 11,
        );
        #[cfg(feature = "testing")]
        if self.options.variant == ProtocolVariant::DeferralIgnoresDelay {
            // WRONG on purpose: the deferred message is visible at once.
            return Outcome::Deferred {
                after: Duration::ZERO,
                total: so_far.total() + after,
                asked,
                why,
                next: Box::new(next),
            };
        }
        Outcome::Deferred {
            after,
            total: so_far.total() + after,
            asked,
            why,
            next: Box::new(next),
        }
    }

    /// Runs the logic (in a task of its own, so a panic is contained) until it ends, the lease is
    /// lost, the time limit passes or `outer` fires; then gives it `stop_grace` to stop.
    async fn run_logic(
        &self,
        ctx: RunContext,
        guard: &LeaseGuard,
        run_cancel: &CancellationToken,
        outer: &CancellationToken,
        superseded: Option<&CancellationToken>,
    ) -> RunEnd {
        let lost = guard.lost();
        if lost.is_cancelled() {
            return RunEnd::stopped(Error::LeaseLostBeforeRun);
        }
        let logic = self.logic.clone();
        // The logic's own events belong to the delivery too.
        let mut task = AbortOnDrop(Some(tokio::spawn(
            async move { logic.run(ctx).await }.instrument(tracing::Span::current()),
        )));
        // Biased: a lost lease or a cancellation wins over a result that is ready at the same
        // moment, so a result produced after the lease was lost is never acknowledged.
        let stopped = tokio::select! {
            biased;
            _ = lost.cancelled() => Error::LeaseLost,
            _ = outer.cancelled() => Error::Cancelled,
            joined = task.handle() => return RunEnd { result: logic_result(joined), still_running: None },
            // After the result: a run that has finished needs no stopping (its marker then gives
            // the usual retrigger).
            _ = fired(superseded) => Error::Superseded,
            _ = tokio::time::sleep(self.options.run_timeout) => Error::TimedOut(self.options.run_timeout),
        };
        run_cancel.cancel();
        #[cfg(feature = "testing")]
        if self.options.variant == ProtocolVariant::SupersedeReleasesAtCancel
            && matches!(stopped, Error::Superseded)
        {
            // WRONG on purpose: the logic is left to stop on its own (its task detached, not
            // aborted), and the caller releases the lease at once.
            drop(task.keep());
            return RunEnd::stopped(stopped);
        }
        if tokio::time::timeout(self.options.stop_grace, task.handle())
            .await
            .is_ok()
        {
            return RunEnd::stopped(stopped);
        }
        tracing::error!(grace = ?self.options.stop_grace,
            "logic did not stop within its grace period; abandoned: its lease is kept until it has ended");
        RunEnd {
            result: Err(Error::Abandoned {
                stopped: Box::new(stopped),
                grace: self.options.stop_grace,
            }),
            still_running: Some(task.keep()),
        }
    }

    /// Runs a marker operation with retries, and says whether it was retried: after a retry a
    /// definitive-looking answer ("not there", "already there") may describe our own earlier
    /// attempt, whose answer was lost.
    async fn marker_op<'a, T, F, Fut>(&'a self, what: &str, mut op: F) -> (StoreResult<T>, bool)
    where
        F: FnMut(&'a dyn MarkerStore) -> Fut,
        Fut: std::future::Future<Output = StoreResult<T>>,
    {
        let mut attempts = 0u32;
        let markers = &*self.markers;
        let result = self
            .lock
            .options()
            .retry
            .run(what, || {
                attempts += 1;
                op(markers)
            })
            .await;
        (result, attempts > 1)
    }

    pub(crate) async fn enqueue(&self, message: &TriggerMessage, delay: Duration) -> Result<(), StoreError> {
        let body = message.encode();
        self.lock
            .options()
            .retry
            .run("enqueue", || self.queue.put(&body, delay))
            .await?;
        if delay.is_zero()
            && let Some(wake) = &self.wake
        {
            wake.notify_one();
        }
        Ok(())
    }
}

/// The one event of a delivery's outcome; which record, attempt and fencing token it was are the
/// fields of the delivery's span ([`Delivery::span`]).
fn log(outcome: &Outcome) {
    match outcome {
        Outcome::Completed {
            retriggered,
            run_time,
            ..
        } => tracing::info!(
            outcome = "completed",
            retriggered,
            run_ms = run_time.as_millis() as u64,
            "record run completed"
        ),
        Outcome::Failed { error, retriggered } => tracing::warn!(
            outcome = "failed",
            retriggered,
            reason = %error,
            "record run failed; trigger will be retried"
        ),
        Outcome::Retrying { error, after } => tracing::warn!(
            outcome = "retrying",
            retry_in = ?after,
            reason = %error,
            "record run failed; retry queued"
        ),
        Outcome::Deferred {
            after,
            total,
            asked,
            why,
            next,
        } => tracing::info!(
            outcome = "deferred",
            run_again_in_s = after.as_secs_f64(),
            deferred_total_s = total.as_secs_f64(),
            asked_s = asked.map(|a| a.as_secs_f64()),
            deferral = next.deferral.map(|d| d.id),
            reason = %why,
            "the logic asked to be run later; the record runs again then"
        ),
        Outcome::Superseded {
            retriggered,
            run_time,
            ..
        } => tracing::info!(
            outcome = "superseded",
            retriggered,
            run_ms = run_time.as_millis() as u64,
            "record run stopped: a trigger arrived during it; the record runs again on the new data"
        ),
        Outcome::Paused { budget, after, .. } => tracing::info!(
            outcome = "paused",
            budget = %budget,
            run_again_in_s = after.as_secs_f64(),
            "the downstream budget is paused (a run was throttled): the trigger comes back when the pause ends, not counted as an attempt"
        ),
        other => tracing::info!(outcome = other.name(), "trigger handled without a run"),
    }
}

/// A record's streak of superseded runs, as its lease's notes say, and the run whose retry or
/// deferral is pending, if one is.
#[derive(Debug, Clone, Copy)]
struct Streak {
    runs: u32,
    lost: Duration,
    /// Whether a streak note was there (a run that ends otherwise removes it).
    noted: bool,
    /// The note [`PENDING_NOTE`]: the fencing token of a run that ended failed with a retry, or
    /// deferred, with no run completed or superseded since.
    pending: Option<u64>,
}

/// Until when a standalone delivery's message is known to stay hidden: its consumer moves it on
/// with each visibility renewal that lands. A request that creates or deletes a wait marker is
/// sent only while the message stays hidden for a request's time limit and its late window
/// more: one that landed after the message came back could create a marker after that
/// redelivery consumed the record's, or delete one created since, with nobody left to run the
/// record for the triggers that joined it (found by the simulation, seeds 10466 and 13190).
#[derive(Clone)]
pub(crate) struct HiddenUntil {
    at: Arc<std::sync::Mutex<Instant>>,
    /// Pushes the message's visibility now (its consumer's renewer does, and this waits for
    /// it): run before each renewal of the delivery's lease, so the message surfaces a margin
    /// after the lease expires, whenever the holder dies.
    push: Option<leasehold_lock::BeforeRenewal>,
    /// The delivery's slot of its consumer, given back while it waits at its budget's gate.
    pub(crate) slot: Option<Arc<ConsumerSlot>>,
}

impl std::fmt::Debug for HiddenUntil {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HiddenUntil")
            .field("at", &self.get())
            .finish_non_exhaustive()
    }
}

impl HiddenUntil {
    pub(crate) fn new(at: Instant) -> Self {
        Self {
            at: Arc::new(std::sync::Mutex::new(at)),
            push: None,
            slot: None,
        }
    }

    /// With the delivery's slot of its consumer, which it gives back while it waits at its
    /// budget's gate.
    pub(crate) fn with_slot(mut self, slot: Arc<ConsumerSlot>) -> Self {
        self.slot = Some(slot);
        self
    }

    /// With `push` run before each renewal of the lease the delivery holds.
    pub(crate) fn with_push(mut self, push: leasehold_lock::BeforeRenewal) -> Self {
        self.push = Some(push);
        self
    }

    pub(crate) fn set(&self, at: Instant) {
        *self.at.lock().expect("hidden-until mutex") = at;
    }

    pub(crate) fn get(&self) -> Instant {
        *self.at.lock().expect("hidden-until mutex")
    }
}

/// What a delivery leaves for whoever acts on its outcome, besides the outcome.
#[derive(Debug, Clone, Default)]
pub(crate) struct Ended {
    /// How long the logic ran, if it ran.
    pub(crate) ran: Option<Duration>,
    /// The `afterToken` the delivery's retry must carry: the message's own until a run changes
    /// it (its run noted itself as pending, or its duty grew beyond the pending run's).
    pub(crate) after_token: Option<u64>,
    /// What the delivery's retry is made of, when it is not the delivered message: the message
    /// it carried on as after a debounce step that owes a run ([`debounce`]).
    pub(crate) carried: Option<TriggerMessage>,
    /// The fencing token of the lease the delivery held, if it held one with fencing on.
    pub(crate) token: Option<u64>,
    /// The downstream budget its run drew on, if it ran with one.
    pub(crate) budget: Option<String>,
    /// The delivery's spans, if it is traced ([`traced`]).
    pub(crate) trace: Option<Arc<DeliveryTrace>>,
}

/// How a run's logic ended, for its downstream budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LogicEnd {
    Succeeded,
    /// The downstream said "too many"; the pause its budget takes (`None`: no budgets).
    Throttled(Option<Duration>),
    Other,
}

/// A holder's slot of its budget ([`RecordRunner::slot`]).
struct Slot {
    permit: BudgetPermit,
    /// Whether the holder had to wait for it (time passed under its lease).
    waited: bool,
}

/// Tells a run's budget slot how its run went (a throttle pauses the budget).
async fn tell_budget(permit: &mut BudgetPermit, record: &str, end: LogicEnd, again: bool) {
    match end {
        LogicEnd::Succeeded => permit.succeeded(),
        LogicEnd::Throttled(Some(pause)) => permit.throttled(record, pause, again).await,
        _ => {}
    }
}

/// The longest a delivery under Functions waits for a slot of its budget before it is put back
/// to come again a second later: the host's invocation must not be held for minutes. A pause
/// longer than this hands a trigger back before the lock, in both modes.
const MAX_SLOT_WAIT_WATCHED: Duration = Duration::from_secs(30);

/// The longest pause a delivery under Functions waits out under its lease (a longer one hands
/// it back): the wait holds one of the host's invocations, and while the host's invocations are
/// all held it takes no message, a dead holder's watchdog included. At most this is added to
/// the recovery bound during a pause.
const MAX_PAUSE_WAIT_WATCHED: Duration = Duration::from_secs(5);

impl Ended {
    pub(crate) fn of(delivery: &Delivery) -> Self {
        Self {
            after_token: delivery.message.after_token,
            ..Self::default()
        }
    }

    /// After a debounce step that carried on as `carried`.
    fn carried(delivery: &Delivery, carried: &Delivery) -> Self {
        Self {
            carried: (carried.message != delivery.message).then(|| carried.message.clone()),
            ..Self::of(carried)
        }
    }
}

/// A run's watch for triggers ([`RecordRunner::watch_for_triggers`]); stops watching when dropped.
struct Watch {
    fired: CancellationToken,
    task: JoinHandle<()>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Fires when `token` does; never without one.
async fn fired(token: Option<&CancellationToken>) {
    match token {
        Some(t) => t.cancelled().await,
        None => std::future::pending().await,
    }
}

/// How a run ended.
struct RunEnd {
    result: Result<(), Error>,
    /// The logic did not stop within its grace: its task, still running.
    still_running: Option<JoinHandle<Result<(), LogicError>>>,
}

impl RunEnd {
    fn stopped(error: Error) -> Self {
        Self {
            result: Err(error),
            still_running: None,
        }
    }
}

/// How often a lease kept for logic that will not stop says so.
const STILL_RUNNING_EVERY: Duration = Duration::from_secs(60);

/// Keeps an abandoned run's lease renewed until its logic's task has really ended, then
/// releases it (or, if the lease was lost meanwhile, lets it go): so nothing else runs the record
/// while the logic may still be acting on it.
///
/// The task is not aborted. Aborting drops the logic's future at its next `.await`, but work it
/// awaits elsewhere — a `spawn_blocking` closure, a spawned task, a thread — goes on after that
/// and nobody can observe it; awaited, it keeps the future alive, so the task ends only when
/// that work has. Logic that never ends keeps its record held for as long as the process lives
/// (said once a minute): exclusivity is the promise; a stuck record is visible, and a restart
/// frees it once the lease lapses, the stuck logic gone with the process.
fn keep_until_ended(guard: Held, mut task: JoinHandle<Result<(), LogicError>>) {
    let span = tracing::Span::current();
    let guard = guard.take();
    tokio::spawn(
        async move {
            let since = Instant::now();
            loop {
                // Biased, so the same instants give the same choice (the simulation replays).
                tokio::select! {
                    biased;
                    _ = &mut task => break,
                    _ = tokio::time::sleep(STILL_RUNNING_EVERY) => tracing::error!(
                        running_for_s = since.elapsed().as_secs(),
                        lease_kept = !guard.lost().is_cancelled(),
                        "abandoned logic is still running; its lease is kept renewed so nothing runs beside it"
                    ),
                }
            }
            if guard.lost().is_cancelled() {
                guard.abandon();
                tracing::warn!("abandoned logic has ended; its lease was lost meanwhile");
            } else if let Err(e) = guard.release().await {
                tracing::warn!(error = %e, "abandoned logic has ended; releasing its lease failed, it lapses");
            } else {
                tracing::info!("abandoned logic has ended; its lease is released");
            }
        }
        .instrument(span),
    );
}

/// The lease of a delivery in progress. If the delivery is dropped before it decides (its
/// invocation went away), the lease is abandoned — left to lapse — not released: the logic may
/// still be stopping, and the message (or its watchdog) comes back after the lease expired.
struct Held(Option<LeaseGuard>);

impl Held {
    fn get(&self) -> &LeaseGuard {
        self.0.as_ref().expect("held until released or abandoned")
    }

    /// Releases the lease, timing it ([`crate::observe::LOCK_SECONDS`], step `release`).
    async fn release(self) -> leasehold_lock::Result<()> {
        let asked = Instant::now();
        let released = self.take().release().await;
        record_lock(LockStep::Release, asked.elapsed());
        released
    }

    /// The guard itself, for whoever ends the hold from here.
    fn take(mut self) -> LeaseGuard {
        self.0.take().expect("held until released or abandoned")
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(guard) = self.0.take() {
            guard.abandon();
        }
    }
}

/// Aborts the logic's task if the run is dropped (its handler went away), unless it was handed
/// on with [`keep`](Self::keep).
struct AbortOnDrop(Option<JoinHandle<Result<(), LogicError>>>);

impl AbortOnDrop {
    fn handle(&mut self) -> &mut JoinHandle<Result<(), LogicError>> {
        self.0.as_mut().expect("kept only once")
    }

    /// The task, no longer aborted on drop.
    fn keep(mut self) -> JoinHandle<Result<(), LogicError>> {
        self.0.take().expect("kept only once")
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(task) = &self.0 {
            task.abort();
        }
    }
}

fn logic_result(joined: Result<Result<(), LogicError>, tokio::task::JoinError>) -> Result<(), Error> {
    match joined {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(Error::Logic(e)),
        // Cancelled only when the runtime itself shuts down under the run.
        Err(e) => match e.try_into_panic() {
            Ok(payload) => {
                let text = payload
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a non-text payload".into());
                Err(Error::LogicPanicked(text))
            }
            Err(_) => Err(Error::LogicTaskCancelled),
        },
    }
}

/// The delay asked for and why, when the logic asked to be run later.
fn asks_to_run_later(result: &Result<(), Error>) -> Option<(Option<Duration>, String)> {
    match result {
        Err(Error::Logic(e)) => e
            .asks_to_run_later()
            .map(|after| (after, e.message().to_string())),
        _ => None,
    }
}

fn storage_failed(step: &'static str, error: impl Into<leasehold_lock::Error>) -> Outcome {
    Outcome::Failed {
        error: Error::storage(step, error),
        retriggered: false,
    }
}
