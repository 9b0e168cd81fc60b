//! Take: the delivery's first acquire, and the contended path (docs/design.md "The protocol").
//!
//! Acquire. If the lease is held: a delivery that may trust the holder creates the marker
//! (`If-None-Match: *`); if it created it, it tries the lease once more (the holder may have
//! released between the two and already looked at the marker): granted, it holds, and its run
//! covers the marker it set (it clears it first, or stands down if it is gone); refused, it
//! leaves, and the holder will find the marker. If the marker was there already, its creator owes
//! the second attempt. A delivery that may *not* trust the holder (a carrier, or a redelivery,
//! which may be standing in for that very holder, dead) looks again once a dead holder's lease
//! must have expired, instead of leaving a marker nobody may read.

use super::hold::{self, MarkerFirst};
use super::{Answer, End, Facts, Fault, Request, Step};

/// Whether a delivery may set the marker and leave when it finds the lease held: not a carrier
/// (it may stand in for the holder it finds), and standalone not a redelivery either (it may be
/// looking at its own dead holder). Under a watchdog every holder has a carrier of its own, so
/// only carriers must look again.
pub fn trusts_holder(facts: &Facts, fault: Fault) -> bool {
    if fault == Fault::TrustHolderOnRedelivery {
        return true;
    }
    !facts.kind.is_carrier() && (facts.watched || !facts.redelivered)
}

/// The take phase's state: which request it waits on.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Take {
    facts: Facts,
    waits: Waits,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Waits {
    Acquire,
    SetMarker,
    /// The second acquire a marker's creator owes.
    Reacquire,
    /// Standalone: the put of the look again.
    LookAgain,
}

/// Where the take phase goes next.
pub(super) enum Next {
    Step(Take, Step),
    /// Granted: hold, dealing with the marker this way first.
    Hold(MarkerFirst),
    End(End),
}

impl Take {
    pub(super) fn start(facts: Facts) -> (Self, Step) {
        let take = Self {
            facts,
            waits: Waits::Acquire,
        };
        (take, Step::Send(Request::Acquire))
    }

    pub(super) fn on(self, answer: Answer, fault: Fault) -> Next {
        match (self.waits, answer) {
            (Waits::Acquire, Answer::Granted) => Next::Hold(hold::first(&self.facts, fault)),
            (Waits::Acquire, Answer::Held) if !trusts_holder(&self.facts, fault) => {
                if self.facts.watched {
                    // The watchdog, left in place, is the look again.
                    Next::End(End::LookAgain)
                } else {
                    self.wait(Waits::LookAgain, Request::PutLookAgain)
                }
            }
            (Waits::Acquire, Answer::Held) => self.wait(Waits::SetMarker, Request::SetMarker),
            (Waits::Acquire | Waits::Reacquire, Answer::Failed) => {
                if self.waits == Waits::Reacquire && fault == Fault::FailedReacquireCoalesces {
                    return Next::End(End::Coalesced);
                }
                // It may have been granted all the same: a lease nobody renews, which expires.
                // Not acknowledged: the message comes back and runs.
                Next::End(End::StorageFailed { step: "acquire" })
            }
            (Waits::SetMarker, Answer::Marker { changed, retried }) => {
                // After a retry, "already set" may be our own lost first attempt's doing: it
                // counts as created, and we owe the second acquire.
                let created = changed || (retried && fault != Fault::RetriedSetAtItsWord);
                if created {
                    self.wait(Waits::Reacquire, Request::Acquire)
                } else {
                    // Its creator makes the second attempt.
                    Next::End(End::Coalesced)
                }
            }
            (Waits::SetMarker, Answer::Failed) => Next::End(End::StorageFailed {
                step: "set retrigger marker",
            }),
            // The holder released between our two attempts and may already have looked at the
            // marker: we hold now, and our run covers the marker we set.
            (Waits::Reacquire, Answer::Granted) => Next::Hold(if fault == Fault::ReacquireLeavesMarker {
                MarkerFirst::Leave
            } else {
                MarkerFirst::ClearOrStandDown
            }),
            // The holder will find the marker.
            (Waits::Reacquire, Answer::Held) => Next::End(End::Coalesced),
            (Waits::LookAgain, Answer::Done) => Next::End(End::LookAgain),
            (Waits::LookAgain, Answer::Failed) => Next::End(End::StorageFailed {
                step: "enqueue recheck",
            }),
            (waits, answer) => panic!("take: waiting on {waits:?}, told {answer:?}"),
        }
    }

    fn wait(self, waits: Waits, request: Request) -> Next {
        Next::Step(Self { waits, ..self }, Step::Send(request))
    }
}
