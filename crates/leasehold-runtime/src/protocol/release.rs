//! Release and marker: release the lease, *then* take the marker; if it was set (or may have
//! been: a take that was retried), put one retrigger.
//!
//! Why release first: checking first leaves a window where a trigger sets the marker after the
//! check and before the release, and nobody ever sees it. After the release, a trigger either
//! found the lease held (and set the marker before our check) or finds it free (and runs).
//! Why a retried take still retriggers: a delete whose answer was lost may have removed a set
//! marker, and the retry then sees it gone. An extra run is harmless, a lost trigger is not.

use super::{Answer, End, Fault, Request, RunEnd, Step};

/// The step name of the holder's marker check, in logs and failures.
pub const CHECK_MARKER: &str = "check retrigger marker";

/// The release phase's state.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Release {
    then: Then,
    waits: Waits,
    /// Under [`Fault::CheckMarkerBeforeRelease`]: the marker is taken while the lease is held.
    checks_first: bool,
}

/// What the release is for, and so how it ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Then {
    /// After a run: retrigger for what coalesced onto it ([`End::Ran`]).
    Ran,
    /// A holder that stands down: retrigger, then [`End::Coalesced`].
    StandDown,
    /// The run's follow-up is a message of its own: take the marker into it ([`End::CarriedOn`]).
    CarriedOn,
    /// A request failed before the run: release (whatever its answer), then fail with `step`.
    Quietly(&'static str),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Waits {
    Release,
    TakeMarker,
    /// The retrigger's put; `retried` is not needed past it.
    Retrigger,
    /// Under [`Fault::CheckMarkerBeforeRelease`]: the release after the check, its answer ignored.
    LateRelease {
        retriggered: bool,
    },
}

/// Where the release phase goes next.
pub(super) enum Next {
    Step(Release, Step),
    End(End),
}

impl Release {
    /// The phase after the run's part that is still the runner's.
    pub(super) fn after(end: RunEnd, fault: Fault) -> Next {
        let then = match end {
            RunEnd::Ran => Then::Ran,
            RunEnd::CarriedOn => Then::CarriedOn,
            RunEnd::StoodDown => Then::StandDown,
            RunEnd::StillRunning => return Next::End(End::StillRunning),
            RunEnd::FailedBefore(step) => Then::Quietly(step),
        };
        if then == Then::Ran && fault == Fault::CheckMarkerBeforeRelease {
            // WRONG on purpose: a trigger that sets the marker after this check and before the
            // release is never seen by anyone.
            return Next::Step(
                Self {
                    then,
                    waits: Waits::TakeMarker,
                    checks_first: true,
                },
                take_marker(),
            );
        }
        Next::Step(
            Self {
                then,
                waits: Waits::Release,
                checks_first: false,
            },
            Step::Send(Request::Release),
        )
    }

    /// A holder that stands down before its run: release, then take the marker and retrigger.
    pub(super) fn stand_down(fault: Fault) -> (Self, Step) {
        match Self::after(RunEnd::StoodDown, fault) {
            Next::Step(release, step) => (release, step),
            Next::End(_) => unreachable!("a stand-down releases"),
        }
    }

    /// A holder whose request failed before the run: release, then fail with `step`.
    pub(super) fn quietly(step: &'static str) -> (Self, Step) {
        (
            Self {
                then: Then::Quietly(step),
                waits: Waits::Release,
                checks_first: false,
            },
            Step::Send(Request::Release),
        )
    }

    pub(super) fn on(self, answer: Answer, fault: Fault) -> Next {
        if let (Waits::Release, Then::Quietly(step)) = (self.waits, self.then) {
            return Next::End(End::StorageFailed { step });
        }
        match (self.waits, answer) {
            // The lease stays until it expires; a trigger seeing it in that window relies on us.
            // Not acknowledging makes our own message come back and look again.
            (Waits::Release, Answer::Failed) => Next::End(End::StorageFailed {
                step: "release lease",
            }),
            (Waits::Release, Answer::Done) => {
                if self.then == Then::StandDown && fault == Fault::StandDownSkipsMarkerCheck {
                    return Next::End(End::Coalesced);
                }
                self.wait(Waits::TakeMarker, take_marker())
            }
            (Waits::TakeMarker, Answer::Marker { changed, retried }) => {
                let owed = changed || (retried && fault != Fault::RetriedTakeAtItsWord);
                match self.then {
                    Then::CarriedOn => Next::End(End::CarriedOn {
                        joined: changed || (retried && fault != Fault::CarriedOnRetriedTakeAtItsWord),
                    }),
                    _ if owed => self.wait(Waits::Retrigger, Step::Send(Request::PutRetrigger)),
                    _ => self.retriggered(false),
                }
            }
            (Waits::TakeMarker | Waits::Retrigger, Answer::Failed) => {
                Next::End(End::StorageFailed { step: CHECK_MARKER })
            }
            (Waits::Retrigger, Answer::Done) => self.retriggered(true),
            (Waits::LateRelease { retriggered }, _) => Next::End(End::Ran { retriggered }),
            (waits, answer) => panic!("release: waiting on {waits:?}, told {answer:?}"),
        }
    }

    /// The marker checked (and a retrigger put if it was owed).
    fn retriggered(self, retriggered: bool) -> Next {
        match self.then {
            Then::StandDown => Next::End(End::Coalesced),
            Then::Ran if self.checks_first => {
                self.wait(Waits::LateRelease { retriggered }, Step::Send(Request::Release))
            }
            _ => Next::End(End::Ran { retriggered }),
        }
    }

    fn wait(self, waits: Waits, step: Step) -> Next {
        Next::Step(Self { waits, ..self }, step)
    }
}

fn take_marker() -> Step {
    Step::Send(Request::TakeMarker { why: CHECK_MARKER })
}
