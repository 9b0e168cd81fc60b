//! The runner's driver of the protocol core ([`crate::protocol`]): it sends the requests the
//! core's [`Machine`] asks for to storage, tells it their answers, has the part of a hold that
//! is still the runner's done (`held.rs`: the supersede notes, the budget's slot, the run, run
//! later) when the machine says [`Step::Run`], and makes the delivery's outcome. What each step decides is the core's; the order of the
//! requests is the one docs/design.md gives, and the one the simulation has always seen.

use std::sync::Arc;
use std::time::Duration;

use leasehold_lock::{LeaseGuard, LeaseId, LockKey};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::held::{Hold, Ran};
use super::{Delivery, Ended, Held, HiddenUntil, RecordRunner, keep_until_ended, storage_failed};
use crate::error::Error;
use crate::markers::MarkerSet;
use crate::message::TriggerMessage;
use crate::observe::{LockStep, record_lock};
use crate::outcome::Outcome;
use crate::protocol::release::CHECK_MARKER;
use crate::protocol::{Answer, End, Facts, Fault, Machine, Request, Step};
use crate::watchdog::Watchdog;

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
        let facts = Facts {
            kind: delivery.message.kind,
            redelivered: delivery.redelivered(),
            given_up: delivery.message.given_up,
            watched: watchdog.is_some(),
        };
        let (mut machine, mut step) = Machine::start(facts, self.fault());
        let mut driving = Driving {
            key,
            delivery,
            cancel,
            watchdog,
            hidden,
            // One lease id for every attempt of this delivery: an acquire that took effect after
            // we gave up on it is then our own lease, which our next attempt renews, not a
            // stranger's.
            lease: LeaseId::random(),
            asked: Instant::now(),
            acquires: 0,
            guard: None,
            follower: None,
            failure: None,
            hold: Hold::None,
        };
        let end = loop {
            let answer = match step {
                Step::Done(end) => break end,
                Step::Send(request) => self.send(request, &mut driving, ended).await,
                Step::Run => self.run_step(&mut driving, ended).await,
            };
            step = machine.on(answer);
        };
        // Let a watchdog push in flight finish, so its receipt is current for what follows.
        if let Some(follower) = driving.follower {
            follower.finish().await;
        }
        self.outcome(key, end, driving.hold, driving.failure, ended)
    }

    /// Sends one of the machine's requests; its answer.
    async fn send(&self, request: Request, d: &mut Driving<'_>, ended: &Ended) -> Answer {
        let key = d.key;
        match request {
            Request::Acquire => self.acquire(d, ended).await,
            Request::SetMarker => {
                let (set, retried) = self
                    .marker_op("set retrigger marker", |markers| markers.set(key))
                    .await;
                match set {
                    Ok(set) => Answer::Marker {
                        changed: set == MarkerSet::Created,
                        retried,
                    },
                    Err(e) => failed(&mut d.failure, e),
                }
            }
            Request::TakeMarker { why } => {
                let (taken, retried) = self.marker_op(why, |markers| markers.take(key)).await;
                match taken {
                    Ok(changed) => Answer::Marker { changed, retried },
                    Err(e) => failed(&mut d.failure, e),
                }
            }
            Request::Release => {
                let held = d.guard.take().expect("the machine releases only a held lease");
                self.release(held, &mut d.hold, &mut d.failure).await
            }
            Request::PutRetrigger => {
                let mut retrigger = d.delivery.message.retrigger();
                retrigger.links = self.coalesced.take(key);
                match self.enqueue(&retrigger, Duration::ZERO).await {
                    Ok(()) => Answer::Done,
                    Err(e) => failed(&mut d.failure, e),
                }
            }
            Request::PutLookAgain => {
                // The holder may be the dead one this delivery stands in for: look again once
                // its lease must have expired.
                let delivery = d.delivery;
                let again = delivery
                    .message
                    .looking_again(delivery.continuation_kind(), delivery.attempts() - 1);
                match self.enqueue(&again, self.recheck_delay).await {
                    Ok(()) => Answer::Done,
                    Err(e) => failed(&mut d.failure, e),
                }
            }
        }
    }

    /// One acquire, with the delivery's lease id; on a grant, the lease is followed (the
    /// delivered message or the watchdog pushed before each renewal).
    async fn acquire(&self, d: &mut Driving<'_>, ended: &Ended) -> Answer {
        d.acquires += 1;
        let process = ended.trace.as_ref().map(|t| &t.process);
        let span = if d.acquires == 1 {
            Self::lease_span(process, "acquire")
        } else {
            None
        };
        let acquired = self.lock.try_acquire_as(d.key, d.lease).await;
        drop(span);
        match acquired {
            Ok(Some(granted)) => {
                record_lock(LockStep::Grant, d.asked.elapsed());
                d.follower = self.follow_lease(&granted, d.watchdog, d.hidden);
                d.guard = Some(Held(Some(granted)));
                Answer::Granted
            }
            Ok(None) => Answer::Held,
            Err(e) => failed(&mut d.failure, e),
        }
    }

    /// The machine's [`Step::Run`]: the runner's part of the hold ([`Self::run_held`]), and how
    /// it ended.
    async fn run_step(&self, d: &mut Driving<'_>, ended: &mut Ended) -> Answer {
        let held = d
            .guard
            .as_ref()
            .expect("the machine runs only under a held lease");
        let slot = d.hidden.and_then(|h| h.slot.as_deref());
        let (end, hold) = self
            .run_held(
                d.key,
                d.delivery,
                held.get(),
                d.cancel,
                d.watchdog.is_some(),
                slot,
                ended,
            )
            .await;
        d.hold = hold;
        match &mut d.hold {
            Hold::FailedBefore(e) => {
                if let Some(e) = e.take() {
                    d.failure.get_or_insert(e);
                }
            }
            Hold::Abandoned { task, .. } => {
                // Releasing would let another holder start beside the logic: the lease is kept
                // renewed until it has really ended, then released; the message comes back
                // meanwhile and finds the lease held.
                let held = d.guard.take().expect("the run was held");
                keep_until_ended(held, task.take().expect("abandoned once"));
            }
            _ => {}
        }
        Answer::RunEnded(end)
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
                    by,
                    mut next,
                },
            ) => {
                if joined {
                    self.joined(key, &mut next);
                }
                Outcome::Paused {
                    budget,
                    after,
                    by,
                    next: Box::new(next),
                }
            }
            (end @ (End::CarriedOn { .. } | End::Ran { .. }), Hold::Ran(ran)) => {
                self.ran(key, end, *ran, ended)
            }
            (end, _) => unreachable!("the protocol ended {end:?} after a hold that does not end so"),
        }
    }

    /// The outcome of a delivery whose logic ran (or was put off), once its protocol `end`ed.
    fn ran(&self, key: &LockKey, end: End, ran: Ran, ended: &mut Ended) -> Outcome {
        match end {
            End::CarriedOn { joined } => {
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
            End::Ran { retriggered } => match (ran.deferral, ran.result) {
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
            _ => unreachable!("a run ends its protocol with a release"),
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

/// One delivery's way through the machine, as the driver keeps it.
struct Driving<'a> {
    key: &'a LockKey,
    delivery: &'a Delivery,
    cancel: &'a CancellationToken,
    watchdog: Option<&'a Arc<Watchdog>>,
    hidden: Option<&'a HiddenUntil>,
    lease: LeaseId,
    /// When the first acquire was asked for.
    asked: Instant,
    acquires: u32,
    guard: Option<Held>,
    follower: Option<crate::watchdog::Follower>,
    /// The first request that failed, for the outcome (a quiet release after it keeps it).
    failure: Option<leasehold_lock::Error>,
    hold: Hold,
}

/// Keeps the first failure of a delivery's requests (a quiet release after it keeps it).
fn failed(failure: &mut Option<leasehold_lock::Error>, e: impl Into<leasehold_lock::Error>) -> Answer {
    if failure.is_none() {
        *failure = Some(e.into());
    }
    Answer::Failed
}
