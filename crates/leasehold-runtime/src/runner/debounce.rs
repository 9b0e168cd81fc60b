//! Debounce: a record's run starts only once its burst of triggers has ended.
//!
//! Per record there is a *wait marker* (`waiting/<scope>/<record>`), whose existence means
//! "triggers are waiting for the record's burst to end", and one queue message, its *waiter*
//! ([`TriggerMessage::wait`]), which wakes every quiet period Q, looks at the marker's ETag and,
//! once it has not changed for a whole period (or the waiter has waited the longest wait M),
//! consumes the marker and carries on as one trigger through the coalescing protocol.
//!
//! * **A, a trigger** (a first delivery, in a scope that debounces): create the marker
//!   (`If-None-Match: *`). Created: become its waiter (the delivered message, re-hidden for Q).
//!   There already: touch it (a metadata write changes its ETag; never a create) and
//!   acknowledge: the waiter consumes it later and runs after that, which covers this trigger.
//! * **B, a waiter's wake**: look; unchanged since the last look → delete `If-Match` that ETag,
//!   then run; changed → wait another Q; waited M → delete unconditionally, then run; gone →
//!   someone else consumed it and owes the run: stand down (unless `owed`).
//! * **C, a possible stand-in** (a redelivered trigger, a sweep, a watchdog or retry of an A or
//!   B delivery, a waiter whose scope no longer debounces): delete whatever marker exists, then
//!   carry on as today. It may be the carrier of a delivery that created a marker and died
//!   before becoming its waiter; consuming it and running covers every trigger that joined it.
//!
//! So every wait marker has a waiter or a stand-in, and whoever consumes one owes a run that
//! starts after. The design and its proof: `docs/design.md` (*Debounce*).

use std::time::Duration;

use leasehold_lock::LockKey;

use leasehold_lock::{StoreError, StoreErrorKind};
use leasehold_storage::Op;
use leasehold_storage::azure::DEFAULT_REQUEST_TIMEOUT;
use tokio::time::Instant;

use super::{Delivery, HiddenUntil, Outcome, RecordRunner, storage_failed};
use crate::markers::WaitConsumed;
use crate::message::{TriggerKind, TriggerMessage, Wait};

/// A scope's debounce window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Debounce {
    /// The quiet period Q: a run starts once no trigger arrived for this long (between Q and 2Q
    /// after the last one, as waiters look every Q).
    pub quiet: Duration,
    /// The longest wait M (at least Q): a steady stream of triggers still runs this long after
    /// the first trigger that waits.
    pub longest: Duration,
}

impl Debounce {
    /// A window; `None` (debounce off) if `quiet` is zero. `longest` is raised to `quiet`.
    pub fn new(quiet: Duration, longest: Duration) -> Option<Self> {
        (!quiet.is_zero()).then_some(Self {
            quiet,
            longest: longest.max(quiet),
        })
    }
}

/// What a delivery does about debounce before the coalescing protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Step {
    /// Nothing.
    Skip,
    /// Path A: a trigger's first delivery in a scope that debounces.
    Trigger(Debounce),
    /// Path B: a waiter's wake.
    Wake(Debounce, Wait),
    /// Path C: consume whatever wait marker there is, then carry on.
    StandIn,
}

/// Where a delivery goes after its debounce step.
pub(crate) enum Next {
    /// It has its outcome ([`Outcome::Waiting`], [`Outcome::Debounced`] or a failure).
    Done(Outcome),
    /// It carries on through the coalescing protocol as this delivery (its message without
    /// `wait`).
    Carry(Delivery),
}

impl Step {
    /// Whether this delivery's carrier (a Functions watchdog, or its retry) must stand in for a
    /// wait marker it may leave: marked with `wait`, it takes path C if it surfaces.
    pub(crate) fn marks_carrier(&self) -> bool {
        !matches!(self, Step::Skip)
    }
}

impl RecordRunner {
    /// The debounce step of `delivery`.
    pub(crate) fn debounce_step(&self, delivery: &Delivery) -> Step {
        let message = &delivery.message;
        let window = *self.options.debounce.get(&message.scope);
        let first = !delivery.redelivered();
        match (&message.wait, message.kind, window) {
            (Some(wait), TriggerKind::Trigger, Some(window)) if first => Step::Wake(window, wait.clone()),
            (Some(_), _, _) => Step::StandIn,
            // A redelivered trigger may be its own orphan's stand-in (standalone, it died after
            // creating a marker; under Functions, its handler died): in any scope, because
            // debounce may have been on when it was first delivered.
            (None, TriggerKind::Trigger, _) if !first => Step::StandIn,
            (None, TriggerKind::Trigger, Some(window)) => Step::Trigger(window),
            // A sweep stands for a trigger given up, which may have been such a delivery.
            (None, TriggerKind::Sweep, _) => Step::StandIn,
            _ => Step::Skip,
        }
    }

    /// Takes `step` for `delivery`, in the delivery's span.
    /// `hidden`: until when the delivered message stays hidden, if the caller knows.
    pub(crate) async fn debounce(
        &self,
        step: Step,
        delivery: &Delivery,
        hidden: Option<&HiddenUntil>,
    ) -> Next {
        let key = delivery.message.key();
        let carrier = Carrier {
            hidden,
            margin: DEFAULT_REQUEST_TIMEOUT + self.lock.options().retry.late_window,
        };
        match step {
            Step::Skip => Next::Carry(delivery.clone()),
            Step::Trigger(window) => self.join_or_wait(&key, delivery, window, carrier).await,
            Step::Wake(window, wait) => self.wake(&key, delivery, window, wait, carrier).await,
            Step::StandIn => {
                #[cfg(feature = "testing")]
                if self.options.variant == crate::ProtocolVariant::StandInTrustsWaitMarker {
                    // WRONG on purpose: a marker whose creator died has no waiter but this.
                    return Next::Carry(carried_on(delivery, false));
                }
                let (consumed, retried) = self.consume_wait(&key, None, carrier).await;
                match consumed {
                    Ok(consumed) => {
                        tracing::debug!(
                            ?consumed,
                            retried,
                            "a possible stand-in consumed the wait marker, if any; running without waiting"
                        );
                        // A delete that found a marker (or may have: retried) owes a run.
                        let owes = consumed == WaitConsumed::Consumed || retried;
                        Next::Carry(carried_on(delivery, owes))
                    }
                    Err(e) => Next::Done(storage_failed("consume wait marker", e)),
                }
            }
        }
    }

    /// Path A.
    async fn join_or_wait(
        &self,
        key: &LockKey,
        delivery: &Delivery,
        window: Debounce,
        carrier: Carrier<'_>,
    ) -> Next {
        let (created, retried) = self
            .marker_op("create wait marker", |m| {
                let sent = carrier.may_send(Op::WaitPut);
                async move {
                    sent?;
                    m.wait_create(key).await
                }
            })
            .await;
        match created {
            Ok(Some(etag)) => Next::Done(self.rewait(delivery, window, Some(etag), 0, false)),
            // Our own create may have landed with its answer lost: counted as created (at worst
            // a second waiter), its ETag unknown.
            Ok(None) if retried => Next::Done(self.rewait(delivery, window, None, 0, false)),
            Ok(None) => {
                // Covered by whoever consumes the marker: it runs after this trigger was
                // accepted. The touch only makes the waiter wait for quiet, so any answer will
                // do, a failure included.
                match self.markers.wait_touch(key).await {
                    Ok(true) => {}
                    Ok(false) => {
                        #[cfg(feature = "testing")]
                        if self.options.variant == crate::ProtocolVariant::TouchByPut {
                            // WRONG on purpose: nobody waits for the marker this creates.
                            let _ = self.markers.wait_create(key).await;
                        }
                        tracing::debug!(
                            "the wait marker was consumed before the touch; its consumer's run covers this trigger"
                        )
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "touching the wait marker failed; the waiter may run before the burst ends")
                    }
                }
                Next::Done(Outcome::Debounced { joined: true })
            }
            Err(e) => Next::Done(storage_failed("create wait marker", e)),
        }
    }

    /// Path B.
    async fn wake(
        &self,
        key: &LockKey,
        delivery: &Delivery,
        window: Debounce,
        wait: Wait,
        carrier: Carrier<'_>,
    ) -> Next {
        let looked = self
            .lock
            .options()
            .retry
            .run("look at wait marker", || self.markers.wait_look(key))
            .await;
        let now = match looked {
            Ok(now) => now,
            Err(e) => return Next::Done(storage_failed("look at wait marker", e)),
        };
        let waited = Duration::from_millis(wait.waited_ms);
        let condition = match &now {
            None if wait.owed => return Next::Carry(carried_on(delivery, true)),
            // Someone else consumed it (a stand-in), and owes the run.
            None => return Next::Done(Outcome::Debounced { joined: false }),
            Some(_) if waited >= window.longest => None,
            Some(tag) if wait.etag.as_ref() == Some(tag) => Some(tag.clone()),
            Some(tag) => {
                return Next::Done(self.rewait(
                    delivery,
                    window,
                    Some(tag.clone()),
                    wait.waited_ms,
                    wait.owed,
                ));
            }
        };
        let (consumed, retried) = self.consume_wait(key, condition.as_deref(), carrier).await;
        let owed = wait.owed || retried;
        #[cfg(feature = "testing")]
        // WRONG on purpose: the first attempt may have consumed the marker.
        let owed = if self.options.variant == crate::ProtocolVariant::WaiterStandsDownAfterRetriedDelete {
            wait.owed
        } else {
            owed
        };
        match consumed {
            Ok(WaitConsumed::Consumed) => Next::Carry(carried_on(delivery, true)),
            // A trigger joined between the look and the delete: wait for quiet again. If the
            // delete was retried, its first attempt may have consumed an earlier marker.
            Ok(WaitConsumed::Changed) => {
                Next::Done(self.rewait(delivery, window, None, wait.waited_ms, owed))
            }
            Ok(WaitConsumed::Gone) if owed => Next::Carry(carried_on(delivery, true)),
            Ok(WaitConsumed::Gone) => Next::Done(Outcome::Debounced { joined: false }),
            Err(e) => Next::Done(storage_failed("consume wait marker", e)),
        }
    }

    /// Deletes the wait marker (only if its ETag is `condition`, when given), with retries and
    /// only while `carrier` allows: its answer, and whether it was retried.
    async fn consume_wait(
        &self,
        key: &LockKey,
        condition: Option<&str>,
        carrier: Carrier<'_>,
    ) -> (Result<WaitConsumed, StoreError>, bool) {
        self.marker_op("consume wait marker", |m| {
            let sent = carrier.may_send(Op::WaitDelete);
            async move {
                sent?;
                m.wait_consume(key, condition).await
            }
        })
        .await
    }

    /// The waiter's next wake: the delivered message with its wait, visible after one more
    /// quiet period (or what is left of the longest wait).
    fn rewait(
        &self,
        delivery: &Delivery,
        window: Debounce,
        etag: Option<String>,
        waited_ms: u64,
        owed: bool,
    ) -> Outcome {
        let left = window.longest.saturating_sub(Duration::from_millis(waited_ms));
        let after = window.quiet.min(left).max(Duration::from_millis(1));
        let mut next = delivery.message.clone();
        // A new queue message under Functions (the standalone consumer sets its own).
        next.rehides = 0;
        next.wait = Some(Wait {
            etag,
            waited_ms: waited_ms.saturating_add(after.as_millis() as u64),
            owed,
        });
        Outcome::Waiting {
            after,
            next: Box::new(next),
        }
    }
}

/// A delivery's carrier, as far as its debounce step can see it.
#[derive(Clone, Copy)]
struct Carrier<'a> {
    /// Until when the delivered message stays hidden (standalone), if known.
    hidden: Option<&'a HiddenUntil>,
    /// How long after it is sent a request may still land: its time limit and the late window.
    margin: Duration,
}

impl Carrier<'_> {
    /// Whether a request that creates or deletes a wait marker may be sent now: only if it
    /// lands while the delivered message is still hidden, before any redelivery of it can
    /// stand in ([`HiddenUntil`]). Otherwise the delivery fails without sending it, and its
    /// message, when it comes back, stands in.
    fn may_send(&self, op: Op) -> Result<(), StoreError> {
        match self.hidden {
            Some(until) if Instant::now() + self.margin > until.get() => Err(StoreError::new(
                StoreErrorKind::Rejected,
                op,
                "not sent: the delivered message may be visible again before it could land (its visibility could not be renewed)",
            )),
            _ => Ok(()),
        }
    }
}

/// The delivery as it carries on through the coalescing protocol: its message without `wait`
/// (its continuations never consume again). One that consumed a wait marker (`owes`) owes a run
/// that starts after: it must not stand down for a run that may have ended before the triggers
/// that joined the marker came — neither as a retry whose duty a later run took over
/// (`afterToken`), nor as a sweep that runs only if the retrigger marker is set; and its chain,
/// if given up, gets a sweep that runs whatever the marker says.
fn carried_on(delivery: &Delivery, owes: bool) -> Delivery {
    let mut delivery = delivery.clone();
    delivery.message.wait = None;
    if owes {
        // It stands for fresh triggers now, owed what any new trigger is (as a deferral that
        // took a set marker): a chain never given up, whose sweep, if it is, runs regardless.
        delivery.message.after_token = None;
        delivery.message.given_up = 0;
    }
    delivery
}

/// `message` marked as the carrier of a delivery that may leave a wait marker behind.
pub(crate) fn marked(mut message: TriggerMessage) -> TriggerMessage {
    if message.wait.is_none() {
        message.wait = Some(Wait::default());
    }
    message
}
