//! Debounce (docs/design.md "Debounce"): a record's run starts only once its burst of triggers
//! has ended. Per record there is a *wait marker*, whose existence means "triggers wait for the
//! record's burst to end", and one queue message, its *waiter*, which wakes every quiet period,
//! looks at the marker's ETag and, once it has not changed for a whole period (or the waiter has
//! waited the longest wait), consumes the marker and carries on as one trigger.
//!
//! The three paths, and the rule that makes them safe — every wait marker has a waiter or a
//! stand-in, and whoever consumes one owes a run that starts after:
//! * **A, a trigger** (a first delivery, in a scope that debounces): create the marker. Created:
//!   become its waiter. There already: touch it and acknowledge — the waiter runs later.
//! * **B, a waiter's wake**: look; unchanged since the last look, or waited the longest →
//!   consume it, then run; changed → wait another period; gone → whoever consumed it owes the
//!   run: stand down (unless this waiter already owes one).
//! * **C, a possible stand-in** (a redelivered trigger, a sweep, a carrier of an A or B
//!   delivery, a waiter whose scope no longer debounces): consume whatever marker exists, then
//!   carry on. It may be the carrier of a delivery that created a marker and died before
//!   becoming its waiter.
//!
//! A [`Waiting`] is one delivery's debounce step; the driver holds the ETags (the machine is told
//! only whether the one it looked at is the one its waiter saw) and the clock (it says whether the
//! waiter has waited the longest wait).

use crate::message::TriggerKind;

use super::Fault;

/// Which debounce path a delivery takes, before the coalescing protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Path {
    /// None: it goes straight to the coalescing protocol.
    Skip,
    /// A: a trigger's first delivery in a scope that debounces.
    Trigger,
    /// B: a waiter's wake (`owed`: an earlier wake may have consumed the marker; `longest`: it
    /// has waited the longest wait, and consumes whatever marker there is).
    Wake { owed: bool, longest: bool },
    /// C: consume whatever wait marker there is, then carry on.
    StandIn,
}

/// A waiter's message, as far as its wake's decisions go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Waited {
    /// An earlier wake's consume may have consumed the marker: it owes a run whatever it finds.
    pub owed: bool,
    /// It has waited the longest wait.
    pub longest: bool,
}

/// The path of a delivery: its message's `kind`, its wait if it is a waiter or a carrier marked
/// as one, whether it was `redelivered`, and whether its scope debounces now.
pub fn path(kind: TriggerKind, wait: Option<Waited>, redelivered: bool, debounces: bool) -> Path {
    match (wait, kind, debounces) {
        (Some(Waited { owed, longest }), TriggerKind::Trigger, true) if !redelivered => {
            Path::Wake { owed, longest }
        }
        (Some(_), _, _) => Path::StandIn,
        // A redelivered trigger may be its own orphan's stand-in (standalone, it died after
        // creating a marker; under Functions, its handler died): in any scope, because debounce
        // may have been on when it was first delivered.
        (None, TriggerKind::Trigger, _) if redelivered => Path::StandIn,
        (None, TriggerKind::Trigger, true) => Path::Trigger,
        // A sweep stands for a trigger given up, which may have been such a delivery.
        (None, TriggerKind::Sweep, _) => Path::StandIn,
        _ => Path::Skip,
    }
}

impl Path {
    /// Whether this delivery's carriers (a Functions watchdog, or its retry) must stand in for a
    /// wait marker it may leave.
    pub fn marks_carrier(self) -> bool {
        self != Path::Skip
    }
}

/// A wait-marker request. Each is one call with the driver's retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Request {
    /// Create the wait marker (`If-None-Match: *`): [`Answer::Created`], [`Answer::Exists`] or
    /// [`Answer::Failed`].
    Create,
    /// Touch it (a metadata write that changes its ETag, never a create):
    /// [`Answer::Touched`] or [`Answer::Failed`].
    Touch,
    /// Read its ETag: [`Answer::Looked`] or [`Answer::Failed`].
    Look,
    /// Delete it; `if_unchanged`: only if its ETag is still the one just looked at.
    /// [`Answer::Consumed`] or [`Answer::Failed`].
    Consume { if_unchanged: bool },
}

/// What became of a consume.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Consumed {
    /// This call deleted the marker.
    Consumed,
    /// There was none.
    Gone,
    /// Its ETag had changed: a trigger joined since; left as it is.
    Changed,
}

/// What the driver tells a [`Waiting`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Answer {
    /// This call created the marker (the driver keeps its ETag).
    Created,
    /// It was there already; `retried`: our own earlier attempt, answer lost, may have created it.
    Exists { retried: bool },
    /// The touch's answer: whether it found the marker.
    Touched { found: bool },
    /// The look's answer: `None` if there is no marker, else whether its ETag is the one the
    /// waiter saw last.
    Looked(Option<bool>),
    /// The consume's answer, and whether it was retried (then "gone" may be our own doing).
    Consumed { what: Consumed, retried: bool },
    /// The request failed after its retries (it may have taken effect all the same).
    Failed,
}

/// Which ETag a waiter carries to its next wake.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Etag {
    /// The one its create returned.
    Created,
    /// The one its look found.
    Looked,
    /// None known: its next look counts as a change.
    Unknown,
}

/// How a delivery's debounce step ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum End {
    /// On through the coalescing protocol (its message without its wait). `owes`: it consumed a
    /// marker (or may have), and owes a run that starts after — it must not stand down for a
    /// run that may have ended before the triggers that joined the marker came.
    Carry { owes: bool },
    /// Wait another quiet period, as the marker's waiter, with this ETag and `owed`.
    Wait { etag: Etag, owed: bool },
    /// Joined a burst that waits: acknowledge (its waiter's run covers this trigger).
    Joined,
    /// Someone else consumed the marker and owes the run: acknowledge.
    NotOwed,
    /// A request failed (`step` names it): the message is retried, and as a redelivery stands in.
    StorageFailed { step: &'static str },
}

/// What a [`Waiting`] asks for next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Step {
    Send(Request),
    Done(End),
}

/// One delivery's debounce step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Waiting {
    phase: Phase,
    fault: Fault,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Phase {
    Create,
    Touch,
    /// [`Fault::TouchByPut`]'s create after a touch that found nothing.
    TouchPut,
    Look {
        owed: bool,
        longest: bool,
    },
    Consume {
        owed: bool,
    },
    StandIn,
    Over,
}

pub const CREATE: &str = "create wait marker";
pub const LOOK: &str = "look at wait marker";
pub const CONSUME: &str = "consume wait marker";

impl Waiting {
    /// The step of a delivery on `path`, and its first request (or its end, when it has none).
    pub fn start(path: Path, fault: Fault) -> (Self, Step) {
        let (phase, step) = match path {
            Path::Skip => (Phase::Over, Step::Done(End::Carry { owes: false })),
            Path::Trigger => (Phase::Create, Step::Send(Request::Create)),
            Path::Wake { owed, longest } => (Phase::Look { owed, longest }, Step::Send(Request::Look)),
            // WRONG on purpose: a marker whose creator died has no waiter but this.
            Path::StandIn if fault == Fault::StandInTrustsWaitMarker => {
                (Phase::Over, Step::Done(End::Carry { owes: false }))
            }
            Path::StandIn => (
                Phase::StandIn,
                Step::Send(Request::Consume { if_unchanged: false }),
            ),
        };
        (Self { phase, fault }, step)
    }

    /// Tells it the answer to its last request; returns the next step.
    pub fn on(&mut self, answer: Answer) -> Step {
        let (phase, step) = match (self.phase, answer) {
            (Phase::Create, Answer::Created) => wait(Etag::Created, false),
            // Our own create may have landed with its answer lost: counted as created (at worst
            // a second waiter), its ETag unknown.
            (Phase::Create, Answer::Exists { retried: true }) => wait(Etag::Unknown, false),
            (Phase::Create, Answer::Exists { retried: false }) => (Phase::Touch, Step::Send(Request::Touch)),
            (Phase::Create, _) => failed(CREATE),
            // WRONG on purpose: nobody waits for the marker this creates.
            (Phase::Touch, Answer::Touched { found: false }) if self.fault == Fault::TouchByPut => {
                (Phase::TouchPut, Step::Send(Request::Create))
            }
            // Covered by whoever consumes the marker: it runs after this trigger was accepted.
            // The touch only makes the waiter wait for quiet, so any answer will do.
            (Phase::Touch | Phase::TouchPut, _) => done(End::Joined),
            (Phase::Look { owed, .. }, Answer::Looked(None)) => {
                if owed {
                    done(End::Carry { owes: true })
                } else {
                    // Someone else consumed it (a stand-in), and owes the run.
                    done(End::NotOwed)
                }
            }
            (Phase::Look { owed, longest }, Answer::Looked(Some(unchanged))) => {
                if longest || unchanged {
                    (
                        Phase::Consume { owed },
                        Step::Send(Request::Consume {
                            if_unchanged: !longest,
                        }),
                    )
                } else {
                    wait(Etag::Looked, owed)
                }
            }
            (Phase::Look { .. }, _) => failed(LOOK),
            (Phase::Consume { owed }, Answer::Consumed { what, retried }) => {
                // A retried consume's first attempt may have consumed the marker.
                let owed = owed || (retried && self.fault != Fault::WaiterStandsDownAfterRetriedDelete);
                match what {
                    Consumed::Consumed => done(End::Carry { owes: true }),
                    // A trigger joined between the look and the delete: wait for quiet again.
                    Consumed::Changed => wait(Etag::Unknown, owed),
                    Consumed::Gone if owed => done(End::Carry { owes: true }),
                    Consumed::Gone => done(End::NotOwed),
                }
            }
            (Phase::Consume { .. } | Phase::StandIn, Answer::Failed) => failed(CONSUME),
            // A delete that found a marker (or may have: retried) owes a run.
            (Phase::StandIn, Answer::Consumed { what, retried }) => done(End::Carry {
                owes: what == Consumed::Consumed || retried,
            }),
            (phase, answer) => panic!("a debounce step in {phase:?} was told {answer:?}"),
        };
        self.phase = phase;
        step
    }
}

fn wait(etag: Etag, owed: bool) -> (Phase, Step) {
    done(End::Wait { etag, owed })
}

fn failed(step: &'static str) -> (Phase, Step) {
    done(End::StorageFailed { step })
}

fn done(end: End) -> (Phase, Step) {
    (Phase::Over, Step::Done(end))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drive(path: Path, answers: &[Answer]) -> Vec<Step> {
        let (mut waiting, step) = Waiting::start(path, Fault::None);
        let mut steps = vec![step];
        for answer in answers {
            steps.push(waiting.on(*answer));
        }
        steps
    }

    #[test]
    fn a_trigger_that_finds_a_marker_touches_it_and_joins() {
        let steps = drive(
            Path::Trigger,
            &[Answer::Exists { retried: false }, Answer::Failed],
        );
        assert_eq!(
            steps,
            [
                Step::Send(Request::Create),
                Step::Send(Request::Touch),
                Step::Done(End::Joined),
            ]
        );
    }

    #[test]
    fn a_waiter_whose_retried_consume_finds_nothing_still_owes_its_run() {
        let wake = Path::Wake {
            owed: false,
            longest: false,
        };
        let steps = drive(
            wake,
            &[
                Answer::Looked(Some(true)),
                Answer::Consumed {
                    what: Consumed::Gone,
                    retried: true,
                },
            ],
        );
        assert_eq!(steps[1], Step::Send(Request::Consume { if_unchanged: true }));
        assert_eq!(steps[2], Step::Done(End::Carry { owes: true }));
        let not_retried = drive(
            wake,
            &[
                Answer::Looked(Some(true)),
                Answer::Consumed {
                    what: Consumed::Gone,
                    retried: false,
                },
            ],
        );
        assert_eq!(not_retried[2], Step::Done(End::NotOwed));
    }

    #[test]
    fn a_stand_in_owes_a_run_if_it_consumed_a_marker_or_may_have() {
        let consumed = |what, retried| drive(Path::StandIn, &[Answer::Consumed { what, retried }])[1];
        assert_eq!(
            consumed(Consumed::Consumed, false),
            Step::Done(End::Carry { owes: true })
        );
        assert_eq!(
            consumed(Consumed::Gone, true),
            Step::Done(End::Carry { owes: true })
        );
        assert_eq!(
            consumed(Consumed::Gone, false),
            Step::Done(End::Carry { owes: false })
        );
    }

    #[test]
    fn a_waiter_that_waited_the_longest_consumes_whatever_marker_there_is() {
        let steps = drive(
            Path::Wake {
                owed: false,
                longest: true,
            },
            &[Answer::Looked(Some(false))],
        );
        assert_eq!(steps[1], Step::Send(Request::Consume { if_unchanged: false }));
    }

    #[test]
    fn paths() {
        use TriggerKind::*;
        let waits = Some(Waited {
            owed: true,
            longest: false,
        });
        assert_eq!(path(Trigger, None, false, true), Path::Trigger);
        assert_eq!(path(Trigger, None, false, false), Path::Skip);
        assert_eq!(path(Trigger, None, true, false), Path::StandIn);
        assert_eq!(path(Sweep, None, false, false), Path::StandIn);
        assert_eq!(
            path(Trigger, waits, false, true),
            Path::Wake {
                owed: true,
                longest: false
            }
        );
        assert_eq!(path(Trigger, waits, true, true), Path::StandIn);
        assert_eq!(path(Trigger, waits, false, false), Path::StandIn);
        assert_eq!(path(Watchdog, waits, false, true), Path::StandIn);
        assert_eq!(path(Retrigger, None, true, true), Path::Skip);
        assert!(!Path::Skip.marks_carrier());
        assert!(Path::Trigger.marks_carrier() && Path::StandIn.marks_carrier());
    }
}
