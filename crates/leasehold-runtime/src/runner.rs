//! The coalescing record runner: see [`RecordRunner`] for the protocol.

use std::sync::Arc;
use std::time::Duration;

use leasehold_lock::{LeaseGuard, LeaseLock, LockKey, StoreError, StoreErrorKind, StoreResult};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::budget::{Admission, BudgetPermit, Budgets, HeldBy, Lane, Waiting};
use crate::error::{Error, LogicError};
use crate::history::{History, HistoryEntry, HistoryEvent};
use crate::markers::{MarkerStore, RecordStatus, record_status};
use crate::message::{TriggerKind, TriggerMessage, truncate_to};
use crate::observe::{LockStep, OutcomeSink, record_lock, record_outcome};
use crate::outcome::Outcome;
use crate::poison::PoisonMessage;
use crate::queue::TriggerQueue;
use crate::record::{RecordId, Scope};
use crate::slot::ConsumerSlot;
use crate::watchdog::Watchdog;

mod debounce;
mod drive;
mod gate;
mod held;
mod options;
mod run;
mod traced;
mod watched;

use gate::{LogicEnd, MAX_PAUSE_WAIT_WATCHED, MAX_SLOT_WAIT_WATCHED, tell_budget};
use run::{Held, Streak, asks_to_run_later, keep_until_ended};

pub use debounce::Debounce;
use debounce::{Next, Step as DebounceStep, marked};
pub use options::*;
use traced::{CoalescedLinks, DeliveryTrace};

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
        if swept_nothing(delivery, outcome) {
            tracing::info!(outcome = "coalesced", "{SWEPT_NOTHING}");
        } else {
            log(outcome);
        }
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
            Outcome::Paused {
                budget, after, by, ..
            } => {
                entry.budget = Some(budget.clone());
                entry = entry.until_after(*after);
                if *by == crate::HeldBy::Limit {
                    entry = entry.with_reason("no slot of the budget's limit (its runs are all under way) and the waiting room full: back at its turn");
                }
            }
            Outcome::Coalesced if swept_nothing(delivery, outcome) => {
                entry = entry.with_reason(SWEPT_NOTHING)
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

    fn options_retry(&self) -> leasehold_lock::RetryOptions {
        self.lock.options().retry.clone()
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

/// What a sweep that ended without a run did: the sweep put when a trigger was given up, of a
/// chain given up more than once, runs only if the retrigger marker is set; it was not (no
/// trigger came since, or the holder that took it puts its retrigger), so the sweep stood down,
/// as a holder does, and the give-ups end here. Its outcome is `coalesced`, but no run of the
/// record was under way: its log line and history entry say so.
const SWEPT_NOTHING: &str = "a sweep after a give-up found no trigger left to honour (none came since, or the holder that took it puts its retrigger): it stood down without a run; the record stays given up (leasehold poison list)";

/// Whether `outcome` is a sweep's stand-down for want of a trigger owed ([`SWEPT_NOTHING`]).
fn swept_nothing(delivery: &Delivery, outcome: &Outcome) -> bool {
    matches!(outcome, Outcome::Coalesced) && delivery.message.kind == TriggerKind::Sweep
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
        Outcome::Paused {
            budget,
            after,
            by: crate::HeldBy::Pause,
            ..
        } => tracing::info!(
            outcome = "paused",
            budget = %budget,
            run_again_in_s = after.as_secs_f64(),
            "handed back by the downstream budget's pause (after a throttle): the trigger comes back then, not counted as an attempt"
        ),
        Outcome::Paused { budget, after, .. } => tracing::info!(
            outcome = "at_limit",
            budget = %budget,
            run_again_in_s = after.as_secs_f64(),
            "handed back by the downstream budget's limit (no slot, and nowhere to wait without keeping the consumer's): the trigger comes back at its turn, not counted as an attempt"
        ),
        other => tracing::info!(outcome = other.name(), "trigger handled without a run"),
    }
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

fn storage_failed(step: &'static str, error: impl Into<leasehold_lock::Error>) -> Outcome {
    Outcome::Failed {
        error: Error::storage(step, error),
        retriggered: false,
    }
}
