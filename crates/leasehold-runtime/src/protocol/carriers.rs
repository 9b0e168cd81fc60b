//! Carriers under Functions (docs/design.md "Two hosting modes" and "Carriers and recheck"): the
//! host keeps its message hidden for 10 minutes whatever happens, so each delivery puts a hidden
//! **watchdog** message before it touches the lease, which carries the delivery's duty if its
//! host dies; when the delivery ends, the watchdog is deleted, or rewritten into what carries the
//! duty on (its look again, its retry, its deferral or waiter), and the host's message is
//! acknowledged — so retries and attempt counting are the handler's, with reasons.
//!
//! Standalone, the delivered message is its own carrier: the consumer deletes it, writes the
//! follow-up over it in one update, or leaves it hidden for the retry ([`standalone`]).
//!
//! These are the decisions; the runner (`runner/watched.rs`) and the consumer do the requests.

use super::Fault;

/// What a delivery's protocol came to, as far as its watchdog is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Ended {
    /// Nothing more is owed (a run completed, a trigger coalesced, a holder stood down, a
    /// trigger joined a burst that waits, a superseded run).
    Acknowledged,
    /// The lease was held and the delivery may not trust its holder: it looks again later.
    LookAgain,
    /// Its duty goes on in a message of its own, written by the runner: a waiter, or a trigger
    /// a paused budget handed back.
    FollowUp,
    /// Its duty goes on in its deferral (run later).
    Deferred,
    /// It failed; `gives_up`: it asked to be given up at once (a deferral budget spent).
    Failed { gives_up: bool },
}

/// What becomes of the watchdog (and the host's message).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Watchdog {
    /// Delete it and acknowledge: nothing is owed.
    Disarm,
    /// Rewrite it into the look again (a recheck, after a renewal interval and a margin), and
    /// acknowledge whatever the rewrite's answer: if it fails, the watchdog still surfaces, with
    /// its stand-in's body, when its visibility lapses.
    LookAgain,
    /// Rewrite it into the follow-up (a waiter, a handed-back trigger); if that fails, the
    /// delivery has failed (it may have created a wait marker that nobody waits for): its retry
    /// or its give-up, as for any failure.
    FollowUp,
    /// Rewrite it into the deferral; if that fails, the host retries its message (early, nothing
    /// lost; a failed attempt).
    Deferral,
    /// Rewrite it into the retry (a carrier with the attempts so far, after the retry delay); if
    /// that fails, the host retries its message (and the watchdog may surface too).
    Retry,
    /// Give the trigger up (its poison entry, then a sweep), then delete the watchdog if that
    /// succeeded; if it did not, the host retries its message.
    GiveUp,
    /// Delete it and acknowledge although it is owed (a known-wrong decision).
    Dropped,
}

/// Whether a delivery is given up before it does anything: only a message the host redelivered
/// after its handler died (or failed without an answer) gets past the handler's limit.
pub fn gives_up_at_once(attempts: u32, max_attempts: u32) -> bool {
    attempts > max_attempts
}

/// What becomes of the watchdog of a delivery that `ended` so, on its `attempts`-th attempt.
pub fn after(ended: Ended, attempts: u32, max_attempts: u32, fault: Fault) -> Watchdog {
    match ended {
        Ended::Acknowledged => Watchdog::Disarm,
        // WRONG on purpose: the look again is nobody's.
        Ended::LookAgain if fault == Fault::LookAgainDropsWatchdog => Watchdog::Dropped,
        // This delivery did not fail: the watchdog is its look again.
        Ended::LookAgain => Watchdog::LookAgain,
        Ended::FollowUp => Watchdog::FollowUp,
        Ended::Deferred => Watchdog::Deferral,
        Ended::Failed { gives_up: true } => Watchdog::GiveUp,
        Ended::Failed { .. } if attempts >= max_attempts => Watchdog::GiveUp,
        Ended::Failed { .. } => Watchdog::Retry,
    }
}

/// What a failed rewrite of the watchdog (or a failed give-up) leads to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IfItFails {
    /// Acknowledge all the same: the watchdog surfaces as it is, a carrier, when its visibility
    /// lapses.
    Acknowledge,
    /// Do not acknowledge: the host retries its message (and the watchdog may surface too).
    HostRetries,
    /// The delivery has failed: decide again with [`Ended::Failed`].
    Failed,
}

/// What happens if the rewrite (or give-up) `watchdog` asks for fails.
pub fn if_it_fails(watchdog: Watchdog) -> IfItFails {
    match watchdog {
        Watchdog::LookAgain | Watchdog::Disarm | Watchdog::Dropped => IfItFails::Acknowledge,
        Watchdog::FollowUp => IfItFails::Failed,
        Watchdog::Deferral | Watchdog::Retry | Watchdog::GiveUp => IfItFails::HostRetries,
    }
}

/// Standalone: what the consumer does with the delivered message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Message {
    /// Delete it: nothing more is owed, or what is owed is already put (a look again, a
    /// retrigger).
    Delete,
    /// Write the follow-up over it in one update (a deferral, a waiter, a handed-back trigger):
    /// the follow-up and the acknowledgement land together or not at all. If the update fails,
    /// the message comes back when its visibility lapses, early: nothing is lost.
    PersistInPlace,
    /// Leave it for a retry after the retry delay (with the token its retry carries); it is
    /// given up, with a sweep, when a delivery finds it past the limit.
    Retry,
    /// Give the trigger up at once (its poison entry and a sweep), whatever its attempts.
    GiveUp,
}

/// What the standalone consumer does with a message whose delivery `ended` so.
pub fn standalone(ended: Ended) -> Message {
    match ended {
        Ended::Acknowledged | Ended::LookAgain => Message::Delete,
        Ended::FollowUp | Ended::Deferred => Message::PersistInPlace,
        Ended::Failed { gives_up: true } => Message::GiveUp,
        Ended::Failed { gives_up: false } => Message::Retry,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_delivery_is_retried_by_its_watchdog_until_the_handlers_limit() {
        let failed = Ended::Failed { gives_up: false };
        assert_eq!(after(failed, 1, 5, Fault::None), Watchdog::Retry);
        assert_eq!(after(failed, 5, 5, Fault::None), Watchdog::GiveUp);
        assert_eq!(
            after(Ended::Failed { gives_up: true }, 1, 5, Fault::None),
            Watchdog::GiveUp
        );
        assert!(gives_up_at_once(6, 5) && !gives_up_at_once(5, 5));
    }

    #[test]
    fn a_look_again_is_the_watchdog_left_in_place() {
        assert_eq!(after(Ended::LookAgain, 9, 5, Fault::None), Watchdog::LookAgain);
        assert_eq!(if_it_fails(Watchdog::LookAgain), IfItFails::Acknowledge);
        assert_eq!(if_it_fails(Watchdog::Retry), IfItFails::HostRetries);
        assert_eq!(if_it_fails(Watchdog::FollowUp), IfItFails::Failed);
    }
}
