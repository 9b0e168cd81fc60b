//! The per-delivery lock protocol as a pure state machine (sans-IO): no I/O, no clock, no tokio.
//!
//! A [`Machine`] is one delivery's way through the steps of docs/design.md "The protocol", from
//! its first acquire to the decision that ends it. It is told what happened ([`Answer`]: a
//! storage answer, the run's end) and says what to do next ([`Step`]: send a [`Request`], do the
//! run, or stop with an [`End`]). Whoever drives it does the I/O: the runner
//! ([`RecordRunner`](crate::RecordRunner)) against Azure Storage or the simulation's stores, and
//! the model checker (`tests/model`) against a model of storage in which every interleaving of a
//! small deployment is tried. Both drive this same code, so what the checker proves is a property
//! of the shipped decisions, not of a specification beside them.
//!
//! The phases, each in its own module and named as docs/design.md names the steps:
//! - [`take`]: acquire; on a held lease, trust the holder (set the marker, try once more) or look
//!   again later (a carrier or a redelivery, which may be standing in for that very holder);
//! - [`hold`]: what a holder does with the marker before its run (consume it, or stand down);
//! - [`release`]: release the lease, *then* take the marker, and put one retrigger if it was (or
//!   may have been) set;
//! - [`budget`]: the budget's gate — who is never held (a stand-in), who is handed back before the
//!   lock, and where a holder waits out a pause (a seat of the waiting room, not its slot);
//! - [`debounce`]: before all of these, a trigger waits for its record's burst to end (a wait
//!   marker and its waiter), and a possible stand-in consumes a marker its dead creator left;
//! - [`carriers`]: under Functions, what becomes of a delivery's watchdog when it ends (deleted,
//!   or rewritten into its look again, its retry, its follow-up; a give-up);
//! - [`later`]: run later — the delay of a deferral within its chain's budget, or the give-up
//!   once it is spent;
//! - [`supersede`]: a retry's `afterToken` and the lease's `pending` note — whether a granted
//!   retry stands down, what a run notes before its release, and which token its retry carries.
//!
//! What happens between the grant and the release (the supersede notes, the budget's slot, the
//! run itself, run later) is still the runner's: the machine asks for it with [`Step::Run`] and
//! is told how it ended ([`RunEnd`]).
//!
//! A storage request is one call with the driver's retries (the runner's `RetryOptions`): an
//! answer says whether it was retried, because after a retry a definitive-looking answer ("not
//! there", "already there") may describe our own earlier attempt, whose answer was lost.

pub mod budget;
pub mod carriers;
pub mod debounce;
pub mod hold;
pub mod later;
pub mod release;
pub mod supersede;
pub mod take;

use crate::message::TriggerKind;

/// Known-wrong decisions, kept so the model checker and the simulation can prove they catch
/// them (docs/mutants-2026-11-25.md, F1–F7, and the seed design's marker check before the
/// release). Only [`Fault::None`] is ever shipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Fault {
    #[default]
    None,
    /// F1: a contender takes a retried marker put's "already set" at its word (its own lost
    /// first attempt may have set it): it leaves without the second acquire it owes.
    RetriedSetAtItsWord,
    /// F2: a contender's second acquire that failed (it may have been granted, answer lost) is
    /// acknowledged as coalesced.
    FailedReacquireCoalesces,
    /// F3: a stand-down without the marker check after its release.
    StandDownSkipsMarkerCheck,
    /// F4: a holder's marker check ignores that the delete was retried.
    RetriedTakeAtItsWord,
    /// F5: a contender that won its second acquire leaves the marker it set.
    ReacquireLeavesMarker,
    /// F6: a stand-down after a retried clear of one's own marker.
    StandDownAfterRetriedClear,
    /// F7: a sweep does not clear the marker before its run.
    SweepLeavesMarker,
    /// The seed design's bug: check the marker *before* releasing the lease.
    CheckMarkerBeforeRelease,
    /// A redelivery or a carrier that finds the lease held trusts the holder (sets the marker
    /// and leaves), though it may be standing in for that very holder, dead.
    TrustHolderOnRedelivery,
    /// Supersede (issue 35's first loss): a run hands its token to its retry or deferral although
    /// its `pending` note could not be written; the retry then takes itself for a run whose duty
    /// a later run took over, stands down, and its trigger is lost.
    TokenWithoutNote,
    /// Run later (issue 35's second loss): a deferral whose take of the marker after the release
    /// was retried and answered "not there" takes that at its word and keeps its token, though its
    /// first attempt may have consumed a marker set during a later run.
    CarriedOnRetriedTakeAtItsWord,
    /// Budgets (issue 35's liveness failure): a holder waiting out its budget's pause keeps its
    /// slot of the consumer (the code before the waiting room): holders waiting out a pause fill
    /// the slots, and a dead holder's message waits for the pause to end.
    HolderKeepsItsSlot,
    /// Debounce: a possible stand-in (a redelivery) carries on without consuming the wait marker,
    /// though a marker whose creator died has no waiter but it.
    StandInTrustsWaitMarker,
    /// Debounce: a waiter whose retried consume answers "gone" stands down, though its own first
    /// attempt may have consumed the marker.
    WaiterStandsDownAfterRetriedDelete,
    /// Debounce: a trigger's touch of a marker consumed meanwhile creates one, which nobody waits
    /// for.
    TouchByPut,
    /// Functions: a delivery that has to look again deletes its watchdog instead of leaving it as
    /// the look again.
    LookAgainDropsWatchdog,
    /// Lanes: the budget's gate before the low lane's turn at starts (as one told `low_every` 0):
    /// while holders of both lanes wait for a slot, the high lane always goes first. Applied by
    /// the model checker to the gate's [`budget::Slots`]; the runner's gate is told its option.
    HighLaneAlwaysFirst,
}

/// A storage request the machine asks for. Each is one call with the driver's retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Request {
    /// Try to acquire the record's lease once, with the delivery's one lease id (an acquire that
    /// timed out may land later: with the same id, the next attempt renews it). Answered
    /// [`Answer::Granted`], [`Answer::Held`] or [`Answer::Failed`].
    Acquire,
    /// Create the retrigger marker (`If-None-Match: *`). Answered [`Answer::Marker`] (`changed`:
    /// this call created it) or [`Answer::Failed`].
    SetMarker,
    /// Delete the retrigger marker. Answered [`Answer::Marker`] (`changed`: it was there) or
    /// [`Answer::Failed`]. `why` names the step, for logs.
    TakeMarker { why: &'static str },
    /// Release the lease. Answered [`Answer::Done`] or [`Answer::Failed`].
    Release,
    /// Put one retrigger for the triggers that coalesced onto the run. [`Answer::Done`] or
    /// [`Answer::Failed`].
    PutRetrigger,
    /// Standalone: put the delivery's look again (a recheck, delayed a renewal interval and a
    /// margin). [`Answer::Done`] or [`Answer::Failed`].
    PutLookAgain,
}

/// What the driver tells the machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Answer {
    /// The lease is ours (with its fencing token, if fencing is on: the driver keeps it).
    Granted,
    /// Someone else holds the lease.
    Held,
    /// A marker request's answer: whether it changed the marker (created it, or deleted it), and
    /// whether it was retried (then "unchanged" may be our own earlier attempt's doing).
    Marker { changed: bool, retried: bool },
    /// The request succeeded.
    Done,
    /// The request failed after its retries (it may have taken effect all the same).
    Failed,
    /// The run asked for with [`Step::Run`] ended.
    RunEnded(RunEnd),
}

/// How the part of a hold that is still the runner's (notes, the budget's slot, the run, run
/// later) ended: what the lease and the marker are owed next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RunEnd {
    /// The logic ran (successfully or not, or it asked to be given up): release, then take the
    /// marker and retrigger for what coalesced onto the run.
    Ran,
    /// The run's follow-up is a message of its own (its deferral, or its trigger handed back by
    /// a paused budget), which stands for what coalesced onto the run: release, then take the
    /// marker into that message.
    CarriedOn,
    /// A later run took this retry's duty over (supersede's `pending` note): stand down as a
    /// holder, that is release and then take the marker and retrigger.
    StoodDown,
    /// The logic did not stop: the lease is kept renewed until it has really ended, and released
    /// then. Nothing more to do here.
    StillRunning,
    /// A request before the run failed (nothing ran): release quietly, and fail.
    FailedBefore(&'static str),
}

/// What the machine asks the driver to do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Step {
    /// Send this request and tell the machine its answer.
    Send(Request),
    /// The lease is held and the marker dealt with: do the run and tell the machine how it ended
    /// ([`Answer::RunEnded`]).
    Run,
    /// The delivery's protocol is over.
    Done(End),
}

/// How a delivery's protocol ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum End {
    /// Covered by another holder's run, or stood down as a holder: acknowledge.
    Coalesced,
    /// The lease was held and this delivery may not trust its holder: it looks again later
    /// (standalone: its recheck is put; under Functions: its watchdog is left as the look again).
    LookAgain,
    /// After the run ([`RunEnd::Ran`]): the lease released and the marker checked; `retriggered`:
    /// a retrigger was put for what coalesced onto the run.
    Ran { retriggered: bool },
    /// After [`RunEnd::CarriedOn`]: released, and `joined` says whether fresh triggers joined
    /// the follow-up (the marker was set, or may have been: a retried take).
    CarriedOn { joined: bool },
    /// After [`RunEnd::StillRunning`]: the lease stays with the logic.
    StillRunning,
    /// A storage request failed (`step` names it): do not acknowledge; the message is retried.
    StorageFailed { step: &'static str },
}

/// One delivery's protocol, from its first acquire to its end.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Machine {
    phase: Phase,
    fault: Fault,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Phase {
    Take(take::Take),
    Hold(hold::Hold),
    Running,
    Release(release::Release),
    Over(End),
}

/// What a delivery is, as far as the protocol's decisions go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Facts {
    /// The message's kind: a carrier ([`TriggerKind::is_carrier`]) never trusts a held lease.
    pub kind: TriggerKind,
    /// Delivered before without being deliberately re-hidden since: its earlier delivery may
    /// have died holding the lease.
    pub redelivered: bool,
    /// How many times the trigger's chain was given up (a sweep of a sweep's chain asks the
    /// marker first).
    pub given_up: u32,
    /// Under Functions: every holder has a watchdog of its own, and a look again is the
    /// delivery's watchdog, left in place (nothing to put).
    pub watched: bool,
}

impl Machine {
    /// A delivery's protocol, and its first step (always the acquire).
    pub fn start(facts: Facts, fault: Fault) -> (Self, Step) {
        let (take, step) = take::Take::start(facts);
        let machine = Self {
            phase: Phase::Take(take),
            fault,
        };
        (machine, step)
    }

    /// Tells the machine the answer to its last step; returns the next one.
    pub fn on(&mut self, answer: Answer) -> Step {
        let fault = self.fault;
        let phase = std::mem::replace(&mut self.phase, Phase::Over(End::Coalesced));
        let (phase, step) = match phase {
            Phase::Take(take) => match take.on(answer, fault) {
                take::Next::Step(take, step) => (Phase::Take(take), step),
                take::Next::Hold(first) => Self::hold(first),
                take::Next::End(end) => (Phase::Over(end), Step::Done(end)),
            },
            Phase::Hold(hold) => match hold.on(answer, fault) {
                hold::Next::Step(hold, step) => (Phase::Hold(hold), step),
                hold::Next::Run => (Phase::Running, Step::Run),
                hold::Next::Release(release, step) => (Phase::Release(release), step),
            },
            Phase::Running => match answer {
                Answer::RunEnded(end) => match release::Release::after(end, fault) {
                    release::Next::Step(release, step) => (Phase::Release(release), step),
                    release::Next::End(end) => (Phase::Over(end), Step::Done(end)),
                },
                other => panic!("the machine waits for the run's end, not {other:?}"),
            },
            Phase::Release(release) => match release.on(answer, fault) {
                release::Next::Step(release, step) => (Phase::Release(release), step),
                release::Next::End(end) => (Phase::Over(end), Step::Done(end)),
            },
            Phase::Over(end) => panic!("the delivery's protocol is over ({end:?}); it was told {answer:?}"),
        };
        self.phase = phase;
        step
    }

    fn hold(first: hold::MarkerFirst) -> (Phase, Step) {
        match hold::Hold::start(first) {
            hold::Next::Step(hold, step) => (Phase::Hold(hold), step),
            hold::Next::Run => (Phase::Running, Step::Run),
            hold::Next::Release(release, step) => (Phase::Release(release), step),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trigger() -> Facts {
        Facts {
            kind: TriggerKind::Trigger,
            redelivered: false,
            given_up: 0,
            watched: false,
        }
    }

    fn drive(facts: Facts, answers: &[Answer]) -> Vec<Step> {
        let (mut machine, step) = Machine::start(facts, Fault::None);
        let mut steps = vec![step];
        for answer in answers {
            steps.push(machine.on(*answer));
        }
        steps
    }

    #[test]
    fn the_holder_path_releases_before_it_takes_the_marker() {
        let steps = drive(
            trigger(),
            &[
                Answer::Granted,
                Answer::RunEnded(RunEnd::Ran),
                Answer::Done,
                Answer::Marker {
                    changed: true,
                    retried: false,
                },
                Answer::Done,
            ],
        );
        assert_eq!(
            steps,
            [
                Step::Send(Request::Acquire),
                Step::Run,
                Step::Send(Request::Release),
                Step::Send(Request::TakeMarker {
                    why: release::CHECK_MARKER
                }),
                Step::Send(Request::PutRetrigger),
                Step::Done(End::Ran { retriggered: true }),
            ]
        );
    }

    #[test]
    fn a_contender_that_sets_the_marker_tries_once_more_and_leaves() {
        let steps = drive(
            trigger(),
            &[
                Answer::Held,
                Answer::Marker {
                    changed: true,
                    retried: false,
                },
                Answer::Held,
            ],
        );
        assert_eq!(
            steps,
            [
                Step::Send(Request::Acquire),
                Step::Send(Request::SetMarker),
                Step::Send(Request::Acquire),
                Step::Done(End::Coalesced),
            ]
        );
    }

    #[test]
    fn a_carrier_that_finds_the_lease_held_looks_again() {
        let facts = Facts {
            kind: TriggerKind::Recheck,
            ..trigger()
        };
        let steps = drive(facts, &[Answer::Held, Answer::Done]);
        assert_eq!(steps[1], Step::Send(Request::PutLookAgain));
        assert_eq!(steps[2], Step::Done(End::LookAgain));
        let watched = Facts {
            watched: true,
            ..facts
        };
        assert_eq!(drive(watched, &[Answer::Held])[1], Step::Done(End::LookAgain));
    }
}
