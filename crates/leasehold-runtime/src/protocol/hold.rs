//! Hold: what a holder does with the retrigger marker before its run.
//!
//! A delivery that created the marker and then won the lease (or the sweep of a chain given up
//! twice) consumes it first: its run covers it. If it is gone, the previous holder's check after
//! its release consumed it and owes a retrigger that covers this trigger: running too would be
//! one run more, so it stands down — as a holder (release, then take the marker), because others
//! may have found *its* lease held since. A sweep consumes the marker and runs whatever it said:
//! the trigger given up may have consumed it without handing its duty on.

use super::release::Release;
use super::{Answer, Facts, Fault, Request, Step};
use crate::message::TriggerKind;

/// What a holder does with the marker before its run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MarkerFirst {
    /// Nothing: the marker is checked after the release.
    Leave,
    /// Consume it (the run covers it) and run whatever it said: a sweep, which owes a run.
    Clear,
    /// Consume it, and run only if it was set: a contender that created it (if it is gone, the
    /// previous holder consumed it and owes a retrigger) or a sweep of a chain given up twice.
    ClearOrStandDown,
}

/// What a delivery granted the lease at its first acquire does with the marker. A sweep runs once
/// the lease is free, whatever the marker says; only the sweep of a trigger given up more than
/// once (a sweep's own chain, whose logic keeps failing) runs just if the marker is set, so the
/// give-up → sweep cycle ends — on its first delivery; a redelivered one runs regardless (it may
/// follow one that consumed the marker and failed).
pub fn first(facts: &Facts, fault: Fault) -> MarkerFirst {
    match facts.kind {
        TriggerKind::Sweep if facts.given_up >= 2 && !facts.redelivered => MarkerFirst::ClearOrStandDown,
        TriggerKind::Sweep if fault == Fault::SweepLeavesMarker => MarkerFirst::Leave,
        TriggerKind::Sweep => MarkerFirst::Clear,
        _ => MarkerFirst::Leave,
    }
}

/// The hold phase's state: the clear of one's own marker in flight.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Hold {
    first: MarkerFirst,
}

/// Where the hold phase goes next.
pub(super) enum Next {
    Step(Hold, Step),
    /// On to the run.
    Run,
    /// Released without a run (stood down, or failed): on through the release phase.
    Release(Release, Step),
}

/// The step name of the clear, in logs and failures.
pub const CLEAR_OWN_MARKER: &str = "clear own marker";

impl Hold {
    pub(super) fn start(first: MarkerFirst) -> Next {
        match first {
            MarkerFirst::Leave => Next::Run,
            first => Next::Step(
                Self { first },
                Step::Send(Request::TakeMarker {
                    why: CLEAR_OWN_MARKER,
                }),
            ),
        }
    }

    pub(super) fn on(self, answer: Answer, fault: Fault) -> Next {
        match answer {
            // Gone, and not by a lost attempt of ours: the previous holder consumed it and owes
            // the retrigger. Stand down, as a holder.
            Answer::Marker {
                changed: false,
                retried,
            } if (!retried || fault == Fault::StandDownAfterRetriedClear)
                && self.first == MarkerFirst::ClearOrStandDown =>
            {
                let (release, step) = Release::stand_down(fault);
                Next::Release(release, step)
            }
            Answer::Marker { .. } => Next::Run,
            Answer::Failed => {
                let (release, step) = Release::quietly(CLEAR_OWN_MARKER);
                Next::Release(release, step)
            }
            other => panic!("hold: waiting on the clear of the marker, told {other:?}"),
        }
    }
}
