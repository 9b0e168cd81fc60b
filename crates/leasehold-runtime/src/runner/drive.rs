//! The runner's driver of the protocol core ([`crate::protocol`]): it sends the requests the
//! core's [`Machine`] asks for to storage, tells it their answers, and does the part of a hold
//! that is still the runner's (the supersede notes, the budget's slot, the run, run later)
//! when the machine says [`Step::Run`]. What each step decides is the core's; the order of the
//! requests is the one docs/design.md gives, and the one the simulation has always seen.

use std::sync::Arc;
use std::time::Duration;

use leasehold_lock::{LeaseGuard, LeaseId, LockKey};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{
    Delivery, Ended, Held, HiddenUntil, LogicEnd, RecordRunner, RunContext, keep_until_ended, storage_failed,
    tell_budget,
};
use crate::error::{Error, LogicError};
use crate::history::HistoryEvent;
use crate::markers::MarkerSet;
use crate::message::TriggerMessage;
use crate::observe::{LockStep, record_lock, record_run};
use crate::outcome::Outcome;
use crate::protocol::release::CHECK_MARKER;
use crate::protocol::supersede::{self, RunResult};
use crate::protocol::{Answer, End, Facts, Fault, Machine, Request, RunEnd, Step};
use crate::runner::asks_to_run_later;
use crate::slot::ConsumerSlot;
use crate::trace::Span;
use crate::watchdog::Watchdog;

/// What the runner's part of a hold left for the end of the delivery.
enum Hold {
    /// Not (yet) run.
    None,
    /// A request before the run failed (its error, until the driver takes it).
    FailedBefore(Option<leasehold_lock::Error>),
    /// A later run took this retry's duty over.
    StoodDown,
    /// A paused budget handed the trigger back before its run: `next` comes back after `after`.
    HandedBack {
        budget: String,
        after: Duration,
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
struct Ran {
    token: Option<u64>,
    result: Result<(), Error>,
    run_time: Duration,
    /// Its deferral ([`Outcome::Deferred`]), or the give-up of a chain whose deferral budget is
    /// spent ([`Outcome::Failed`]), if the logic asked to be run later.
    deferral: Option<Outcome>,
    /// The token its retry or deferral carries, if it pends (supersede).
    after_token: Option<u64>,
    /// The run's span, ended at the release.
    run_span: Option<Span>,
}

impl RecordRunner {
    /// The known-wrong decisions a test asked for ([`crate::ProtocolVariant`]), if any.
    pub(super) fn fault(&self) -> Fault {
        #[cfg(feature = "testing")]
        match self.options.variant {
            crate::ProtocolVariant::CheckMarkerBeforeRelease => return Fault::CheckMarkerBeforeRelease,
            crate::ProtocolVariant::TrustHolderOnRedelivery => return Fault::TrustHolderOnRedelivery,
            crate::ProtocolVariant::StandInTrustsWaitMarker => return Fault::StandInTrustsWaitMarker,
            crate::ProtocolVariant::WaiterStandsDownAfterRetriedDelete => {
                return Fault::WaiterStandsDownAfterRetriedDelete;
            }
            crate::ProtocolVariant::TouchByPut => return Fault::TouchByPut,
            crate::ProtocolVariant::Core(fault) => return fault,
            _ => {}
        }
        Fault::None
    }

    /// One delivery's lock protocol for `key`, from its first acquire to its outcome: the
    /// core's [`Machine`], driven against storage.
    pub(super) async fn handle_key(
        &self,
        key: &LockKey,
        delivery: &Delivery,
        cancel: &CancellationToken,
        watchdog: Option<&Arc<Watchdog>>,
        hidden: Option<&HiddenUntil>,
        ended: &mut Ended,
    ) -> Outcome {
        // One lease id for every attempt of this delivery: an acquire that took effect after we
        // gave up on it is then our own lease, which our next attempt renews, not a stranger's.
        let lease = LeaseId::random();
        let facts = Facts {
            kind: delivery.message.kind,
            redelivered: delivery.redelivered(),
            given_up: delivery.message.given_up,
            watched: watchdog.is_some(),
        };
        let (mut machine, mut step) = Machine::start(facts, self.fault());
        let asked = Instant::now();
        let mut acquires = 0u32;
        let mut guard: Option<Held> = None;
        let mut follower = None;
        // The first request that failed, for the outcome (a quiet release after it keeps it).
        let mut failure: Option<leasehold_lock::Error> = None;
        let mut hold = Hold::None;
        let end = loop {
            let answer = match step {
                Step::Done(end) => break end,
                Step::Send(Request::Acquire) => {
                    acquires += 1;
                    let process = ended.trace.as_ref().map(|t| &t.process);
                    let span = if acquires == 1 {
                        Self::lease_span(process, "acquire")
                    } else {
                        None
                    };
                    let acquired = self.lock.try_acquire_as(key, lease).await;
                    drop(span);
                    match acquired {
                        Ok(Some(granted)) => {
                            record_lock(LockStep::Grant, asked.elapsed());
                            follower = self.follow_lease(&granted, watchdog, hidden);
                            guard = Some(Held(Some(granted)));
                            Answer::Granted
                        }
                        Ok(None) => Answer::Held,
                        Err(e) => failed(&mut failure, e),
                    }
                }
                Step::Send(Request::SetMarker) => {
                    let (set, retried) = self
                        .marker_op("set retrigger marker", |markers| markers.set(key))
                        .await;
                    match set {
                        Ok(set) => Answer::Marker {
                            changed: set == MarkerSet::Created,
                            retried,
                        },
                        Err(e) => failed(&mut failure, e),
                    }
                }
                Step::Send(Request::TakeMarker { why }) => {
                    let (taken, retried) = self.marker_op(why, |markers| markers.take(key)).await;
                    match taken {
                        Ok(changed) => Answer::Marker { changed, retried },
                        Err(e) => failed(&mut failure, e),
                    }
                }
                Step::Send(Request::Release) => {
                    let held = guard.take().expect("the machine releases only a held lease");
                    self.release(held, &mut hold, &mut failure).await
                }
                Step::Send(Request::PutRetrigger) => {
                    let mut retrigger = delivery.message.retrigger();
                    retrigger.links = self.coalesced.take(key);
                    match self.enqueue(&retrigger, Duration::ZERO).await {
                        Ok(()) => Answer::Done,
                        Err(e) => failed(&mut failure, e),
                    }
                }
                Step::Send(Request::PutLookAgain) => {
                    // The holder may be the dead one this delivery stands in for: look again
                    // once its lease must have expired.
                    let again = delivery
                        .message
                        .looking_again(delivery.continuation_kind(), delivery.attempts() - 1);
                    match self.enqueue(&again, self.recheck_delay).await {
                        Ok(()) => Answer::Done,
                        Err(e) => failed(&mut failure, e),
                    }
                }
                Step::Run => {
                    let held = guard.as_ref().expect("the machine runs only under a held lease");
                    let slot = hidden.and_then(|h| h.slot.as_deref());
                    let (end, state) = self
                        .run_held(key, delivery, held.get(), cancel, watchdog.is_some(), slot, ended)
                        .await;
                    hold = state;
                    match &mut hold {
                        Hold::FailedBefore(e) => {
                            if let Some(e) = e.take() {
                                failure.get_or_insert(e);
                            }
                        }
                        Hold::Abandoned { task, .. } => {
                            // Releasing would let another holder start beside the logic: the
                            // lease is kept renewed until it has really ended, then released;
                            // the message comes back meanwhile and finds the lease held.
                            let held = guard.take().expect("the run was held");
                            keep_until_ended(held, task.take().expect("abandoned once"));
                        }
                        _ => {}
                    }
                    Answer::RunEnded(end)
                }
            };
            step = machine.on(answer);
        };
        // Let a watchdog push in flight finish, so its receipt is current for what follows.
        if let Some(follower) = follower {
            follower.finish().await;
        }
        self.outcome(key, end, hold, failure, ended)
    }

    /// Sends a release, ending the run's span (if the run has one) with it.
    async fn release(
        &self,
        held: Held,
        hold: &mut Hold,
        failure: &mut Option<leasehold_lock::Error>,
    ) -> Answer {
        let run_span = match hold {
            Hold::Ran(ran) => ran.run_span.take(),
            _ => None,
        };
        let span = Self::lease_span(run_span.as_ref(), "release");
        let released = held.release().await;
        drop(span);
        if let (Some(run_span), Hold::Ran(ran)) = (&run_span, &*hold)
            && let Err(error) = &ran.result
        {
            run_span.fail(error.to_string());
        }
        drop(run_span);
        match released {
            Ok(()) => Answer::Done,
            Err(e) => failed(failure, e),
        }
    }

    /// Standalone: the delivered message is pushed just before each renewal of the lease, so it
    /// surfaces a margin after the lease expires, whenever this process dies. Under Functions the
    /// watchdog is kept a lease ahead of the lease the same way, until the hold ends.
    fn follow_lease(
        &self,
        guard: &LeaseGuard,
        watchdog: Option<&Arc<Watchdog>>,
        hidden: Option<&HiddenUntil>,
    ) -> Option<crate::watchdog::Follower> {
        if let Some(push) = hidden.and_then(|h| h.push.clone()) {
            guard.before_each_renewal(push);
        }
        watchdog.map(|w| {
            let (follower, push) = w.follow(self.watchdog_visibility());
            guard.before_each_renewal(push);
            follower
        })
    }

    /// The part of a hold that is still the runner's, from the lease held and the marker dealt
    /// with to the release: the supersede notes, the budget's slot, the run, run later. Says what
    /// the lease and the marker are owed next ([`RunEnd`]), and what the outcome is made of.
    #[allow(clippy::too_many_arguments)]
    async fn run_held(
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
        let ctx = RunContext {
            scope: delivery.message.scope.clone(),
            record_id: delivery.message.record_id.clone(),
            fencing_token: token,
            cancel: run_cancel.clone(),
            attempt: delivery.attempts(),
            deferred: delivery.message.deferral.map_or(Duration::ZERO, |d| d.total()),
            trace: run_span.as_ref().and_then(|s| s.context().cloned()),
        };
        let streak = match self.supersede_streak(delivery, guard).await {
            Ok(streak) => streak,
            Err(e) => {
                // Nothing ran: the trigger is retried, and the marker (cleared above, set again
                // by whoever found the lease held since) stays for its run.
                return (
                    RunEnd::FailedBefore("read the record's notes"),
                    Hold::FailedBefore(Some(e)),
                );
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
            return (RunEnd::StoodDown, Hold::StoodDown);
        }
        // The downstream budget's slot, waited for under the lease: triggers that come
        // meanwhile find the lease held and coalesce onto this run, as during the run itself.
        // With it, the pause a throttle of the run set, if one did.
        let (end, run_time, throttle_pause) = match self.slot(delivery, cancel, watched, consumer_slot).await
        {
            Err((budget, after)) => {
                // Put off before the run: the trigger is handed back as it is, hidden until the
                // pause ends — as a holder: release, then take the marker, which the trigger
                // handed back now stands for too. The streak and the notes stay as they are
                // (nothing ran).
                let message = &delivery.message;
                let next = message.follow_up(message.kind, delivery.attempts().saturating_sub(1));
                return (RunEnd::CarriedOn, Hold::HandedBack { budget, after, next });
            }
            Ok(slot) => {
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
                        &run_cancel,
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

    /// The delivery's outcome, from how its protocol ended and what its hold left.
    fn outcome(
        &self,
        key: &LockKey,
        end: End,
        hold: Hold,
        failure: Option<leasehold_lock::Error>,
        ended: &mut Ended,
    ) -> Outcome {
        match (end, hold) {
            (End::Coalesced, _) => Outcome::Coalesced,
            (End::LookAgain, _) => Outcome::Rechecking {
                after: self.recheck_delay,
            },
            (End::StillRunning, Hold::Abandoned { error, .. }) => Outcome::Failed {
                error,
                retriggered: false,
            },
            (End::StorageFailed { step }, hold) => {
                if matches!(hold, Hold::StoodDown) && step == CHECK_MARKER {
                    // The take may have consumed a marker nobody else will answer for: the
                    // retry must run.
                    ended.after_token = None;
                }
                storage_failed(step, failure.expect("a failed step has its error"))
            }
            (
                End::CarriedOn { joined },
                Hold::HandedBack {
                    budget,
                    after,
                    mut next,
                },
            ) => {
                if joined {
                    self.joined(key, &mut next);
                }
                Outcome::Paused {
                    budget,
                    after,
                    next: Box::new(next),
                }
            }
            (End::CarriedOn { joined }, Hold::Ran(ran)) => {
                let Some(Outcome::Deferred {
                    after,
                    total,
                    asked,
                    why,
                    mut next,
                }) = ran.deferral
                else {
                    unreachable!("only a deferral carries the run on")
                };
                // The later run covers what coalesced onto this one: its message is the
                // retrigger, delayed. The marker is taken all the same (as any holder takes it
                // after its release), so the triggers it stands for are covered by a run that
                // starts after them, and none is left behind to cost the next holder a run more.
                if joined {
                    self.joined(key, &mut next);
                } else {
                    next.after_token = ran.after_token;
                }
                Outcome::Deferred {
                    after,
                    total,
                    asked,
                    why,
                    next,
                }
            }
            (End::Ran { retriggered }, Hold::Ran(ran)) => match (ran.deferral, ran.result) {
                // The deferral budget is spent and the trigger is given up: as for a failed run
                // given up, triggers that coalesced onto the run got a retrigger of their own.
                (Some(Outcome::Failed { error, .. }), _) => Outcome::Failed { error, retriggered },
                (Some(other), _) => other,
                (None, Ok(())) => Outcome::Completed {
                    fencing_token: ran.token,
                    retriggered,
                    run_time: ran.run_time,
                },
                (None, Err(Error::Superseded)) => Outcome::Superseded {
                    fencing_token: ran.token,
                    retriggered,
                    run_time: ran.run_time,
                },
                (None, Err(error)) => {
                    ended.after_token = ran.after_token;
                    Outcome::Failed { error, retriggered }
                }
            },
            (end, _) => unreachable!("the protocol ended {end:?} after a hold that does not end so"),
        }
    }

    /// Fresh triggers joined `next`, a message that carries this delivery on (its deferral, or
    /// its trigger handed back by a paused budget): the marker was set, or may have been (a
    /// retried take). It then stands for them, and they are owed what any new trigger is: a
    /// chain that is given up once before its sweep asks the marker (no give-ups, as a
    /// retrigger starts), and one that may not stand down for a later run (no `afterToken`):
    /// those triggers may have arrived during that run (the take comes after the release, while
    /// another may hold and run), which then does not cover them.
    fn joined(&self, key: &LockKey, next: &mut TriggerMessage) {
        next.given_up = 0;
        next.after_token = None;
        // Its run covers them: it links to them (the latest, if too many).
        next.links.extend(self.coalesced.take(key));
        let extra = next.links.len().saturating_sub(crate::trace::MAX_LINKS);
        next.links.drain(..extra);
    }
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

/// Keeps the first failure of a delivery's requests (a quiet release after it keeps it).
fn failed(failure: &mut Option<leasehold_lock::Error>, e: impl Into<leasehold_lock::Error>) -> Answer {
    if failure.is_none() {
        *failure = Some(e.into());
    }
    Answer::Failed
}
