//! What became of a delivery ([`Outcome`]), and so what to do with its message.

use std::time::Duration;

use crate::error::Error;
use crate::message::TriggerMessage;
use crate::protocol::carriers;

/// What became of a delivery, and so what to do with its message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// A trigger arrived during the run, in a scope whose policy is
    /// [`RunPolicy::Supersede`](crate::RunPolicy::Supersede): the run was stopped, has ended, and its lease is released; the
    /// retrigger (when `retriggered`) runs the record again. Acknowledge.
    Superseded {
        fencing_token: Option<u64>,
        retriggered: bool,
        run_time: Duration,
    },
    /// The logic ran and succeeded under the lease. Acknowledge.
    Completed {
        fencing_token: Option<u64>,
        retriggered: bool,
        run_time: Duration,
    },
    /// A run was in progress; the marker is set and that run's holder will run once more.
    /// Acknowledge.
    Coalesced,
    /// The lease was held and this delivery may not trust the holder: it looks again after
    /// `after` (a recheck is enqueued, or the watchdog left in place). Acknowledge.
    Rechecking { after: Duration },
    /// The run failed and its retry is already queued (the watchdog became it). Acknowledge.
    Retrying { error: Error, after: Duration },
    /// Given up after too many failed deliveries ([`Error::GaveUp`]) or with its deferral budget
    /// spent ([`Error::DeferralExhausted`]): the trigger is in the poison queue with its reason
    /// and a sweep is queued. Acknowledge.
    Poisoned { error: Error },
    /// The logic asked to be run later ([`LogicError::run_later`]): the run ended, the lease is
    /// released and the retrigger marker taken; `next` (a recheck carrying the chain's deferral)
    /// must become visible after `after`, and it covers this trigger and every trigger that
    /// coalesced onto the run. Under Functions it is already queued (the watchdog became it).
    /// Standalone the consumer turns the delivered message into it in place, which is also the
    /// acknowledgement.
    Deferred {
        after: Duration,
        /// The chain's deferral so far, `after` included.
        total: Duration,
        /// The delay the logic asked for (`None`: it gave none), and why.
        asked: Option<Duration>,
        why: String,
        next: Box<TriggerMessage>,
    },
    /// In a scope that debounces: the record waits for its burst of triggers to end, and
    /// `next` (the delivered message, as its waiter) must become visible after `after` to look
    /// again. Under Functions it is already queued (the watchdog became it). Standalone the
    /// consumer turns the delivered message into it in place, which is also the
    /// acknowledgement; if that fails, the message comes back as a redelivery, which runs.
    Waiting {
        after: Duration,
        next: Box<TriggerMessage>,
    },
    /// In a scope that debounces: the trigger joined a wait in progress (`joined`), whose waiter
    /// runs the record once the burst has ended; or a waiter found its wait consumed by another
    /// delivery, which runs it. Acknowledge.
    Debounced { joined: bool },
    /// The record's downstream budget is paused ([`crate::Budgets`]): nothing was done, and
    /// `next` (the delivered message, unchanged) must become visible after `after`, without the
    /// delivery counting as an attempt. Under Functions it is already queued (a copy);
    /// standalone the consumer turns the delivered message into it in place, which is also the
    /// acknowledgement. Acknowledge.
    ///
    /// Or, `by` [`HeldBy::Limit`](crate::HeldBy::Limit): no slot of the budget's limit was to be
    /// had and nowhere to wait for one without keeping a slot of the consumer: the same
    /// hand-back, at the trigger's turn. Not a pause.
    Paused {
        budget: String,
        after: Duration,
        by: crate::HeldBy,
        next: Box<TriggerMessage>,
    },
    /// The run failed, timed out, lost its lease, was cancelled, or storage failed. Do not
    /// acknowledge: the message is delivered again (and poisoned after too many deliveries).
    Failed { error: Error, retriggered: bool },
}

impl Outcome {
    /// Why the delivery did not complete a run, if it failed.
    pub fn error(&self) -> Option<&Error> {
        match self {
            Outcome::Retrying { error, .. } | Outcome::Poisoned { error } | Outcome::Failed { error, .. } => {
                Some(error)
            }
            Outcome::Completed { .. }
            | Outcome::Coalesced
            | Outcome::Rechecking { .. }
            | Outcome::Deferred { .. }
            | Outcome::Waiting { .. }
            | Outcome::Debounced { .. }
            | Outcome::Paused { .. }
            | Outcome::Superseded { .. } => None,
        }
    }

    /// Whether the trigger message may be deleted.
    pub fn acknowledge(&self) -> bool {
        matches!(
            self,
            Outcome::Completed { .. }
                | Outcome::Coalesced
                | Outcome::Rechecking { .. }
                | Outcome::Retrying { .. }
                | Outcome::Poisoned { .. }
                | Outcome::Deferred { .. }
                | Outcome::Waiting { .. }
                | Outcome::Debounced { .. }
                | Outcome::Paused { .. }
                | Outcome::Superseded { .. }
        )
    }

    /// What the delivery came to, as the core's carriers see it ([`carriers::Ended`]).
    pub(crate) fn ended(&self) -> carriers::Ended {
        match self {
            Outcome::Paused { .. } | Outcome::Waiting { .. } => carriers::Ended::FollowUp,
            Outcome::Deferred { .. } => carriers::Ended::Deferred,
            Outcome::Rechecking { .. } => carriers::Ended::LookAgain,
            Outcome::Failed { error, .. } => carriers::Ended::Failed {
                gives_up: error.gives_up(),
            },
            Outcome::Completed { .. }
            | Outcome::Coalesced
            | Outcome::Retrying { .. }
            | Outcome::Poisoned { .. }
            | Outcome::Debounced { .. }
            | Outcome::Superseded { .. } => carriers::Ended::Acknowledged,
        }
    }

    /// A short name for logs.
    pub fn name(&self) -> &'static str {
        match self {
            Outcome::Completed { .. } => "completed",
            Outcome::Coalesced => "coalesced",
            Outcome::Rechecking { .. } => "rechecking",
            Outcome::Retrying { .. } => "retrying",
            Outcome::Poisoned { .. } => "poisoned",
            Outcome::Deferred { .. } => "deferred",
            Outcome::Superseded { .. } => "superseded",
            Outcome::Waiting { .. } => "waiting",
            Outcome::Debounced { .. } => "debounced",
            Outcome::Paused {
                by: crate::HeldBy::Limit,
                ..
            } => "at_limit",
            Outcome::Paused { .. } => "paused",
            Outcome::Failed { .. } => "failed",
        }
    }
}
