//! The runner's part of a hold, between the grant and the release — what the protocol core
//! asks for with [`Step::Run`](crate::protocol::Step::Run): the supersede notes (and a retry's
//! stand-down), the downstream budget's slot, the run itself, and after it run later and the
//! `pending` note. It says what the lease and the marker are owed next ([`RunEnd`]) and what
//! the delivery's outcome is made of ([`Hold`]).

use std::time::Duration;

use leasehold_lock::{LeaseGuard, LockKey};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::gate::Slot;
use super::run::RunEnd as LogicRun;
use super::{Delivery, Ended, LogicEnd, RecordRunner, RunContext, tell_budget};
use crate::error::{Error, LogicError};
use crate::history::HistoryEvent;
use crate::message::TriggerMessage;
use crate::observe::record_run;
use crate::outcome::Outcome;
use crate::protocol::RunEnd;
use crate::protocol::supersede::{self, RunResult};
use crate::runner::asks_to_run_later;
use crate::slot::ConsumerSlot;
use crate::trace::Span;

/// What the runner's part of a hold left for the end of the delivery.
pub(super) enum Hold {
    /// Not (yet) run.
    None,
    /// A request before the run failed (its error, until the driver takes it).
    FailedBefore(Option<leasehold_lock::Error>),
    /// A later run took this retry's duty over.
    StoodDown,
    /// A paused budget (or its limit) handed the trigger back before its run: `next` comes back
    /// after `after`.
    HandedBack {
        budget: String,
        after: Duration,
        by: crate::HeldBy,
        next: TriggerMessage,
    },
    /// The logic did not stop within its grace; its lease is kept until it has ended.
    Abandoned {
        error: Error,
        task: Option<JoinHandle<Result<(), LogicError>>>,
    },
    /// The logic ran.
    Ran(Box<Ran>),
}

/// How a run went, for its outcome after the release.
pub(super) struct Ran {
    pub(super) token: Option<u64>,
    pub(super) result: Result<(), Error>,
    pub(super) run_time: Duration,
    /// Its deferral ([`Outcome::Deferred`]), or the give-up of a chain whose deferral budget is
    /// spent ([`Outcome::Failed`]), if the logic asked to be run later.
    pub(super) deferral: Option<Outcome>,
    /// The token its retry or deferral carries, if it pends (supersede).
    pub(super) after_token: Option<u64>,
    /// The run's span, ended at the release.
    pub(super) run_span: Option<Span>,
}

impl RecordRunner {
    /// The part of a hold that is still the runner's, from the lease held and the marker dealt
    /// with to the release: the supersede notes, the budget's slot, the run, run later. Says what
    /// the lease and the marker are owed next ([`RunEnd`]), and what the outcome is made of.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn run_held(
        &self,
        key: &LockKey,
        delivery: &Delivery,
        guard: &LeaseGuard,
        cancel: &CancellationToken,
        watched: bool,
        consumer_slot: Option<&ConsumerSlot>,
        ended: &mut Ended,
    ) -> (RunEnd, Hold) {
        let token = guard.fencing_token();
        ended.token = token;
        if let Some(token) = token {
            tracing::Span::current().record("fencing_token", token);
        }
        let run_cancel = cancel.child_token();
        // The run's span: from here (the lease held, the token known) to the release.
        let run_span = ended.trace.as_ref().map(|t| self.run_span(delivery, t, token));
        let ctx = run_context(delivery, token, &run_cancel, run_span.as_ref());
        let streak = match self.notes(delivery, guard).await {
            Ok(streak) => streak,
            Err(stop) => return stop,
        };
        // The downstream budget's slot, waited for under the lease: triggers that come
        // meanwhile find the lease held and coalesce onto this run, as during the run itself.
        // With it, the pause a throttle of the run set, if one did.
        let (end, run_time, throttle_pause) = match self.slot(delivery, cancel, watched, consumer_slot).await
        {
            Err((budget, after, by)) => {
                // Put off before the run: the trigger is handed back as it is, hidden until the
                // pause ends — as a holder: release, then take the marker, which the trigger
                // handed back now stands for too. The streak and the notes stay as they are
                // (nothing ran).
                let message = &delivery.message;
                let next = message.follow_up(message.kind, delivery.attempts().saturating_sub(1));
                return (
                    RunEnd::CarriedOn,
                    Hold::HandedBack {
                        budget,
                        after,
                        by,
                        next,
                    },
                );
            }
            Ok(slot) => {
                let started = Started {
                    ctx,
                    run_cancel: &run_cancel,
                    streak,
                    token,
                };
                self.run_in_slot(key, delivery, guard, cancel, slot, started, ended)
                    .await
            }
        };
        if let Some(task) = end.still_running {
            // The logic is still running: releasing would let another holder start beside it.
            // Keep the lease renewed until the task has really ended, then release it; the
            // message comes back meanwhile and finds the lease held.
            let error = end.result.expect_err("an abandoned run failed");
            return (
                RunEnd::StillRunning,
                Hold::Abandoned {
                    error,
                    task: Some(task),
                },
            );
        }
        let after = After {
            result: end.result,
            run_time,
            throttle_pause,
            streak,
            token,
            run_span,
        };
        self.after_run(delivery, guard, after, ended).await
    }

    /// Supersede: the record's notes, read at the grant (`None` if the scope does not
    /// supersede), or how the hold ends here: the read failed, or a later run took this retry's
    /// duty over and it stands down.
    async fn notes(
        &self,
        delivery: &Delivery,
        guard: &LeaseGuard,
    ) -> Result<Option<super::Streak>, (RunEnd, Hold)> {
        let streak = match self.supersede_streak(delivery, guard).await {
            Ok(streak) => streak,
            Err(e) => {
                // Nothing ran: the trigger is retried, and the marker (cleared above, set again
                // by whoever found the lease held since) stays for its run.
                return Err((
                    RunEnd::FailedBefore("read the record's notes"),
                    Hold::FailedBefore(Some(e)),
                ));
            }
        };
        if let Some(streak) = streak
            && supersede::stands_down(delivery.message.after_token, streak.pending)
        {
            // The retry (or deferral) of run `after`, whose duty a later run has taken over: that
            // run started after this trigger and ended completed or superseded (or pends itself,
            // and its own retry carries on). Stand down — as a holder: release, then take the
            // marker, for triggers that found *this* grant's lease held.
            tracing::info!(after_token = delivery.message.after_token, pending = ?streak.pending,
                "a later run took this retry's duty over: standing down");
            return Err((RunEnd::StoodDown, Hold::StoodDown));
        }
        Ok(streak)
    }

    /// The run in the budget's `slot` (if the scope has a budget): the marker cleared if it
    /// waited for the slot, the supersede watch, the logic, and the budget told how it ended.
    /// How the logic ended, how long it ran, and the pause a throttle of it set, if one did.
    #[allow(clippy::too_many_arguments)]
    async fn run_in_slot(
        &self,
        key: &LockKey,
        delivery: &Delivery,
        guard: &LeaseGuard,
        cancel: &CancellationToken,
        slot: Option<Slot>,
        started: Started<'_>,
        ended: &mut Ended,
    ) -> (LogicRun, Duration, Option<Duration>) {
        let Started {
            ctx,
            run_cancel,
            streak,
            token,
        } = started;
        let waited = slot.as_ref().is_some_and(|s| s.waited);
        let mut permit = slot.map(|s| s.permit);
        if waited {
            // Triggers that found the lease held while this holder waited for its slot
            // set the marker: the run, starting after them, covers them. Taken now, so
            // they cost no run more (nor stop this one, in a superseding scope). A take
            // that fails leaves the marker for the usual retrigger.
            let (taken, _) = self
                .marker_op("clear the marker before the run", |markers| markers.take(key))
                .await;
            if let Err(e) = taken {
                tracing::debug!(error = %e, "could not clear the marker before the run; it gives a retrigger after it");
            }
        }
        let superseded = streak.and_then(|s| self.watch_for_triggers(key, guard, s));
        ended.budget = permit.as_ref().map(|p| p.budget().to_string());
        if let Some(history) = &self.history {
            let mut entry = self.entry(delivery, HistoryEvent::Started);
            entry.fencing_token = token;
            entry.budget = ended.budget.clone();
            history.record(entry);
        }
        let started = Instant::now();
        let end = self
            .run_logic(
                ctx,
                guard,
                run_cancel,
                cancel,
                superseded.as_ref().map(|w| &w.fired),
            )
            .await;
        drop(superseded);
        let run_time = started.elapsed();
        record_run(run_time);
        ended.ran = Some(run_time);
        let logic_end = match &end.result {
            Ok(()) => LogicEnd::Succeeded,
            Err(Error::Logic(e)) if e.is_throttled() => LogicEnd::Throttled(
                self.budgets
                    .as_ref()
                    .map(|b| b.pause_for(e.asks_to_run_later().flatten())),
            ),
            Err(_) => LogicEnd::Other,
        };
        // The slot is free once the logic has ended (or been abandoned); a throttle
        // pauses the budget before this holder's follow-ups are written.
        if let Some(permit) = &mut permit {
            // A record put off by a throttle and refused again, when no other record
            // was, is one record's refusal: it neither pauses nor cuts its budget.
            let again = delivery.message.deferral.as_ref().is_some_and(|d| d.throttled);
            tell_budget(permit, key.as_str(), logic_end, again).await;
        }
        drop(permit);
        let pause = match logic_end {
            LogicEnd::Throttled(pause) => pause,
            _ => None,
        };
        (end, run_time, pause)
    }

    /// After the logic has ended: its deferral, whether its trigger pends (supersede), and the
    /// record's notes, written under the lease before the release.
    async fn after_run(
        &self,
        delivery: &Delivery,
        guard: &LeaseGuard,
        after: After,
        ended: &mut Ended,
    ) -> (RunEnd, Hold) {
        let After {
            result,
            run_time,
            throttle_pause,
            streak,
            token,
            run_span,
        } = after;

        let was_superseded = matches!(result, Err(Error::Superseded));
        let deferral = asks_to_run_later(&result).map(|(asked, why)| {
            // A throttle's run comes back once its budget's pause is over (the pause is bounded).
            let asked = throttle_pause.or(asked);
            let mut deferred = self.defer(delivery, asked, why);
            if let Outcome::Deferred { next, .. } = &mut deferred
                && let Some(d) = &mut next.deferral
            {
                // So its next refusal is known as the same record's, not a new throttle.
                d.throttled = throttle_pause.is_some();
            }
            deferred
        });
        let run_result = match (&result, &deferral) {
            (_, Some(Outcome::Deferred { .. })) => RunResult::Deferred,
            (_, Some(_)) => RunResult::GivenUp,
            (Err(Error::Superseded), None) => RunResult::Superseded,
            (Err(e), None) => RunResult::Failed {
                retried: !e.gives_up() && delivery.attempts() < self.options.max_attempts,
            },
            (Ok(()), None) => RunResult::Completed,
        };
        let mut after_token = None;
        if let Some(streak) = streak {
            let message = &delivery.message;
            let pending = supersede::after_run(
                run_result,
                message.after_token,
                message.given_up,
                streak.pending,
                token,
            );
            let written = self
                .note_streak(guard, streak, was_superseded, run_time, pending.note)
                .await;
            after_token = pending.after_token(written, self.fault());
        }
        // From the release on, a storage failure leaves this delivery answering for triggers
        // that may have come during a later run (a marker it may have consumed, a lease held
        // past its run): its retry carries no token, and must run. Only the run's own failure,
        // at the end, hands the token on.
        ended.after_token = None;
        let end = match &deferral {
            Some(Outcome::Deferred { .. }) => RunEnd::CarriedOn,
            _ => RunEnd::Ran,
        };
        let ran = Ran {
            token,
            result,
            run_time,
            deferral,
            after_token,
            run_span,
        };
        (end, Hold::Ran(Box::new(ran)))
    }
}

/// What a run starts with, once its lease is held and it did not stand down.
struct Started<'a> {
    ctx: RunContext,
    run_cancel: &'a CancellationToken,
    streak: Option<super::Streak>,
    token: Option<u64>,
}

/// What [`RecordRunner::after_run`] is given.
struct After {
    result: Result<(), Error>,
    run_time: Duration,
    throttle_pause: Option<Duration>,
    streak: Option<super::Streak>,
    token: Option<u64>,
    run_span: Option<Span>,
}

/// What the logic is given for its run.
fn run_context(
    delivery: &Delivery,
    token: Option<u64>,
    run_cancel: &CancellationToken,
    run_span: Option<&Span>,
) -> RunContext {
    RunContext {
        scope: delivery.message.scope.clone(),
        record_id: delivery.message.record_id.clone(),
        fencing_token: token,
        cancel: run_cancel.clone(),
        attempt: delivery.attempts(),
        deferred: delivery.message.deferral.map_or(Duration::ZERO, |d| d.total()),
        trace: run_span.and_then(|s| s.context().cloned()),
    }
}
