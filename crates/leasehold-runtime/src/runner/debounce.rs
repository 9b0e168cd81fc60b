//! Debounce: a record's run starts only once its burst of triggers has ended.
//!
//! Per record there is a *wait marker* (`waiting/<scope>/<record>`), whose existence means
//! "triggers are waiting for the record's burst to end", and one queue message, its *waiter*
//! ([`TriggerMessage::wait`]), which wakes every quiet period Q, looks at the marker's ETag and,
//! once it has not changed for a whole period (or the waiter has waited the longest wait M),
//! consumes the marker and carries on as one trigger through the coalescing protocol.
//!
//! The decisions — which path a delivery takes (A, a trigger; B, a waiter's wake; C, a possible
//! stand-in), and what each answer means — are the protocol core's ([`crate::protocol::debounce`],
//! where the paths are described); this module drives them against the marker store: the ETags,
//! the clock (the quiet period Q, the longest wait M), the requests with their retries, and the
//! waiter's next message. The design and its proof: `docs/design.md` (*Debounce*).

use std::time::Duration;

use leasehold_lock::LockKey;

use leasehold_lock::{StoreError, StoreErrorKind};
use leasehold_storage::Op;
use leasehold_storage::azure::DEFAULT_REQUEST_TIMEOUT;
use tokio::time::Instant;

use super::{Delivery, HiddenUntil, Outcome, RecordRunner, storage_failed};
use crate::markers::WaitConsumed;
use crate::message::{TriggerMessage, Wait};
use crate::protocol::debounce::{self, Answer, Consumed, End, Etag, Path, Request, Waited, Waiting};

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

/// What a delivery does about debounce before the coalescing protocol: its path (the core's
/// decision), and its scope's window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Step {
    path: Path,
    window: Option<Debounce>,
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
        self.path.marks_carrier()
    }
}

/// The ETags a debounce step has seen: the driver's part of what the core decides on.
#[derive(Default)]
struct Etags {
    created: Option<String>,
    looked: Option<String>,
}

impl RecordRunner {
    /// The debounce step of `delivery`.
    pub(crate) fn debounce_step(&self, delivery: &Delivery) -> Step {
        let message = &delivery.message;
        let window = *self.options.debounce.get(&message.scope);
        let waited = message.wait.as_ref().map(|wait| Waited {
            owed: wait.owed,
            longest: window.is_some_and(|w| Duration::from_millis(wait.waited_ms) >= w.longest),
        });
        Step {
            path: debounce::path(message.kind, waited, delivery.redelivered(), window.is_some()),
            window,
        }
    }

    /// Takes `step` for `delivery`, in the delivery's span: the core's [`Waiting`], driven
    /// against the marker store. `hidden`: until when the delivered message stays hidden, if the
    /// caller knows.
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
        let (mut waiting, mut next) = Waiting::start(step.path, self.fault());
        let mut etags = Etags::default();
        let mut error = None;
        loop {
            let request = match next {
                debounce::Step::Send(request) => request,
                debounce::Step::Done(end) => return self.debounced(end, &step, delivery, etags, error),
            };
            let answer = match self
                .wait_request(request, &key, delivery, carrier, &mut etags)
                .await
            {
                Ok(answer) => answer,
                Err(e) => {
                    if request == Request::Touch {
                        tracing::debug!(error = %e, "touching the wait marker failed; the waiter may run before the burst ends");
                    }
                    error = Some(e);
                    Answer::Failed
                }
            };
            next = waiting.on(answer);
        }
    }

    /// Sends one of the core's wait-marker requests, with retries.
    async fn wait_request(
        &self,
        request: Request,
        key: &LockKey,
        delivery: &Delivery,
        carrier: Carrier<'_>,
        etags: &mut Etags,
    ) -> Result<Answer, StoreError> {
        Ok(match request {
            Request::Create => {
                let (created, retried) = self
                    .marker_op(debounce::CREATE, |m| {
                        let sent = carrier.may_send(Op::WaitPut);
                        async move {
                            sent?;
                            m.wait_create(key).await
                        }
                    })
                    .await;
                match created? {
                    Some(etag) => {
                        etags.created = Some(etag);
                        Answer::Created
                    }
                    None => Answer::Exists { retried },
                }
            }
            Request::Touch => {
                let found = self.markers.wait_touch(key).await?;
                if !found {
                    tracing::debug!(
                        "the wait marker was consumed before the touch; its consumer's run covers this trigger"
                    );
                }
                Answer::Touched { found }
            }
            Request::Look => {
                let looked = self
                    .lock
                    .options()
                    .retry
                    .run(debounce::LOOK, || self.markers.wait_look(key))
                    .await?;
                let seen = delivery.message.wait.as_ref().and_then(|w| w.etag.as_ref());
                let unchanged = looked.as_ref().map(|tag| seen == Some(tag));
                etags.looked = looked;
                Answer::Looked(unchanged)
            }
            Request::Consume { if_unchanged } => {
                let condition = if if_unchanged {
                    etags.looked.as_deref()
                } else {
                    None
                };
                let (consumed, retried) = self.consume_wait(key, condition, carrier).await;
                let what = match consumed? {
                    WaitConsumed::Consumed => Consumed::Consumed,
                    WaitConsumed::Gone => Consumed::Gone,
                    WaitConsumed::Changed => Consumed::Changed,
                };
                Answer::Consumed { what, retried }
            }
        })
    }

    /// Where the delivery goes once its debounce step has ended with `end`.
    fn debounced(
        &self,
        end: End,
        step: &Step,
        delivery: &Delivery,
        etags: Etags,
        error: Option<StoreError>,
    ) -> Next {
        match end {
            End::Carry { owes } => {
                if step.path == Path::StandIn {
                    tracing::debug!(
                        owes,
                        "a possible stand-in consumed the wait marker, if any; running without waiting"
                    );
                }
                Next::Carry(carried_on(delivery, owes))
            }
            End::Wait { etag, owed } => {
                let etag = match etag {
                    Etag::Created => etags.created,
                    Etag::Looked => etags.looked,
                    Etag::Unknown => None,
                };
                let window = step.window.expect("only a scope that debounces waits");
                let waited_ms = delivery.message.wait.as_ref().map_or(0, |w| w.waited_ms);
                Next::Done(self.rewait(delivery, window, etag, waited_ms, owed))
            }
            End::Joined => Next::Done(Outcome::Debounced { joined: true }),
            End::NotOwed => Next::Done(Outcome::Debounced { joined: false }),
            End::StorageFailed { step } => {
                Next::Done(storage_failed(step, error.expect("a failed step has its error")))
            }
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
        self.marker_op(debounce::CONSUME, |m| {
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
