//! What the runtime tells about its deliveries besides logging them: metrics through the
//! [`metrics`] facade (a no-op until the application installs a recorder, so a library user
//! pays nothing) and an [`OutcomeSink`] the application may install on the runner.

use std::sync::Arc;
use std::time::Duration;

use crate::outcome::Outcome;
use crate::record::{RecordId, Scope};

/// Counter of finished deliveries, by `outcome` ([`OutcomeLabel`]).
pub const DELIVERIES_TOTAL: &str = "leasehold_deliveries_total";
/// Histogram of how long the logic ran (every run, successful or not), in seconds.
pub const RUN_DURATION_SECONDS: &str = "leasehold_run_duration_seconds";
/// Histogram of the delays of runs put off because their logic asked to be run later
/// (outcome `deferred`), in seconds.
pub const DEFERRAL_SECONDS: &str = "leasehold_deferral_seconds";
/// Histogram of the lock's overhead, by `step`: `grant` (from asking for the lease to holding
/// it, retries included) and `release`, in seconds.
pub const LOCK_SECONDS: &str = "leasehold_lock_seconds";

/// What became of a delivery, as the `outcome` label of [`DELIVERIES_TOTAL`] names it.
///
/// The mapping from [`Outcome`]:
///
/// | outcome | label |
/// | --- | --- |
/// | `Completed { retriggered: false }` | `completed` |
/// | `Completed { retriggered: true }` (the run succeeded and, triggers having arrived during it, enqueued its one retrigger) | `retriggered` |
/// | `Coalesced` | `coalesced` |
/// | `Rechecking` | `rechecked` |
/// | `Retrying` or `Failed` whose error is a lost lease ([`crate::Error::is_lease_lost`]) | `lease_lost` |
/// | `Retrying` (a failed run whose retry is queued) or `Failed`, any other error | `failed` |
/// | `Poisoned` (given up: in the poison queue), and a message that is no trigger at all, poisoned as it arrives | `poisoned` |
/// | `Deferred` (the logic asked to be run later; its delay goes to [`DEFERRAL_SECONDS`]) | `deferred` |
/// | `Superseded` (a trigger arrived during the run, in a scope that supersedes: it was stopped) | `superseded` |
/// | `Waiting` (a scope that debounces: the record waits for its burst of triggers to end) | `waiting` |
/// | `Debounced` (a scope that debounces: the trigger joined a wait in progress, or a waiter stood down for another's run) | `debounced` |
/// | `Paused` (its downstream budget is paused after a throttle: handed back, not an attempt) | `paused` |
/// | `Paused` by the budget's limit ([`HeldBy::Limit`](crate::HeldBy::Limit): no slot, the waiting room full: handed back for its turn, not an attempt) | `at_limit` |
///
/// So the successful runs are `completed` + `retriggered`, and every failed delivery is
/// `failed` or `lease_lost` in both modes (under Functions a failure is mostly `Retrying`,
/// standalone `Failed`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OutcomeLabel {
    Completed,
    Retriggered,
    Coalesced,
    Rechecked,
    Failed,
    LeaseLost,
    Poisoned,
    Deferred,
    Superseded,
    Waiting,
    Debounced,
    Paused,
    AtLimit,
}

impl OutcomeLabel {
    /// Every label, in display order.
    pub const ALL: [OutcomeLabel; 13] = [
        OutcomeLabel::Completed,
        OutcomeLabel::Retriggered,
        OutcomeLabel::Coalesced,
        OutcomeLabel::Rechecked,
        OutcomeLabel::Failed,
        OutcomeLabel::LeaseLost,
        OutcomeLabel::Poisoned,
        OutcomeLabel::Deferred,
        OutcomeLabel::Superseded,
        OutcomeLabel::Waiting,
        OutcomeLabel::Debounced,
        OutcomeLabel::Paused,
        OutcomeLabel::AtLimit,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            OutcomeLabel::Completed => "completed",
            OutcomeLabel::Retriggered => "retriggered",
            OutcomeLabel::Coalesced => "coalesced",
            OutcomeLabel::Rechecked => "rechecked",
            OutcomeLabel::Failed => "failed",
            OutcomeLabel::LeaseLost => "lease_lost",
            OutcomeLabel::Poisoned => "poisoned",
            OutcomeLabel::Deferred => "deferred",
            OutcomeLabel::Superseded => "superseded",
            OutcomeLabel::Waiting => "waiting",
            OutcomeLabel::Debounced => "debounced",
            OutcomeLabel::Paused => "paused",
            OutcomeLabel::AtLimit => "at_limit",
        }
    }
}

impl std::fmt::Display for OutcomeLabel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Outcome {
    /// Its metric label (see [`OutcomeLabel`] for the mapping).
    pub fn label(&self) -> OutcomeLabel {
        match self {
            Outcome::Completed {
                retriggered: false, ..
            } => OutcomeLabel::Completed,
            Outcome::Completed {
                retriggered: true, ..
            } => OutcomeLabel::Retriggered,
            Outcome::Coalesced => OutcomeLabel::Coalesced,
            Outcome::Rechecking { .. } => OutcomeLabel::Rechecked,
            Outcome::Retrying { error, .. } | Outcome::Failed { error, .. } if error.is_lease_lost() => {
                OutcomeLabel::LeaseLost
            }
            Outcome::Retrying { .. } | Outcome::Failed { .. } => OutcomeLabel::Failed,
            Outcome::Poisoned { .. } => OutcomeLabel::Poisoned,
            Outcome::Deferred { .. } => OutcomeLabel::Deferred,
            Outcome::Superseded { .. } => OutcomeLabel::Superseded,
            Outcome::Waiting { .. } => OutcomeLabel::Waiting,
            Outcome::Debounced { .. } => OutcomeLabel::Debounced,
            Outcome::Paused {
                by: crate::HeldBy::Limit,
                ..
            } => OutcomeLabel::AtLimit,
            Outcome::Paused { .. } => OutcomeLabel::Paused,
        }
    }
}

/// Counts a delivery's outcome in [`DELIVERIES_TOTAL`]. The runner calls it for every delivery
/// it handles; whoever poisons a message without handing it to the runner (one that is no
/// trigger) calls it with [`Outcome::Poisoned`].
pub fn record_outcome(outcome: &Outcome) {
    metrics::counter!(DELIVERIES_TOTAL, "outcome" => outcome.label().as_str()).increment(1);
    if let Outcome::Deferred { after, .. } = outcome {
        metrics::histogram!(DEFERRAL_SECONDS).record(after.as_secs_f64());
    }
}

/// Records one run of the logic in [`RUN_DURATION_SECONDS`].
pub(crate) fn record_run(run_time: Duration) {
    metrics::histogram!(RUN_DURATION_SECONDS).record(run_time.as_secs_f64());
}

/// A step of the lock's overhead, the `step` label of [`LOCK_SECONDS`].
#[derive(Debug, Clone, Copy)]
pub(crate) enum LockStep {
    Grant,
    Release,
}

pub(crate) fn record_lock(step: LockStep, took: Duration) {
    let step = match step {
        LockStep::Grant => "grant",
        LockStep::Release => "release",
    };
    metrics::histogram!(LOCK_SECONDS, "step" => step).record(took.as_secs_f64());
}

/// Told of every delivery's outcome once it is decided, with the record, the outcome and how
/// long the logic ran if it ran (failed runs included). Installed on the runner with
/// [`RecordRunner::with_outcome_sink`](crate::RecordRunner::with_outcome_sink); called on the
/// delivery's task, so it must be quick and must not block.
#[derive(Clone)]
pub struct OutcomeSink(Arc<SinkFn>);

type SinkFn = dyn Fn(&Scope, &RecordId, &Outcome, Option<Duration>) + Send + Sync;

impl OutcomeSink {
    pub fn new(sink: impl Fn(&Scope, &RecordId, &Outcome, Option<Duration>) + Send + Sync + 'static) -> Self {
        Self(Arc::new(sink))
    }

    pub(crate) fn tell(
        &self,
        scope: &Scope,
        record: &RecordId,
        outcome: &Outcome,
        run_time: Option<Duration>,
    ) {
        (self.0)(scope, record, outcome, run_time)
    }
}

impl std::fmt::Debug for OutcomeSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OutcomeSink")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{Error, LogicError};

    #[test]
    fn every_outcome_has_its_label() {
        let failed = |error| Outcome::Failed {
            error,
            retriggered: false,
        };
        let cases = [
            (
                Outcome::Completed {
                    fencing_token: Some(1),
                    retriggered: false,
                    run_time: Duration::ZERO,
                },
                "completed",
            ),
            (
                Outcome::Completed {
                    fencing_token: None,
                    retriggered: true,
                    run_time: Duration::ZERO,
                },
                "retriggered",
            ),
            (Outcome::Coalesced, "coalesced"),
            (
                Outcome::Rechecking {
                    after: Duration::from_secs(15),
                },
                "rechecked",
            ),
            (failed(Error::Logic(LogicError::new("no"))), "failed"),
            (failed(Error::LeaseLost), "lease_lost"),
            (failed(Error::LeaseLostBeforeRun), "lease_lost"),
            (
                Outcome::Retrying {
                    error: Error::LeaseLost,
                    after: Duration::from_secs(5),
                },
                "lease_lost",
            ),
            (
                Outcome::Retrying {
                    error: Error::TimedOut(Duration::from_secs(1)),
                    after: Duration::from_secs(5),
                },
                "failed",
            ),
            (
                Outcome::Poisoned {
                    error: Error::LeaseLost,
                },
                "poisoned",
            ),
            (
                Outcome::Deferred {
                    after: Duration::from_secs(30),
                    total: Duration::from_secs(30),
                    asked: None,
                    why: "429".into(),
                    next: Box::new(crate::TriggerMessage::parse("a", "b").unwrap()),
                },
                "deferred",
            ),
            (
                Outcome::Superseded {
                    fencing_token: Some(4),
                    retriggered: true,
                    run_time: Duration::from_secs(3),
                },
                "superseded",
            ),
            (
                Outcome::Waiting {
                    after: Duration::from_secs(10),
                    next: Box::new(crate::TriggerMessage::parse("a", "b").unwrap()),
                },
                "waiting",
            ),
            (Outcome::Debounced { joined: true }, "debounced"),
            (
                Outcome::Paused {
                    budget: "default".into(),
                    after: Duration::from_secs(10),
                    by: crate::HeldBy::Pause,
                    next: Box::new(crate::TriggerMessage::parse("a", "b").unwrap()),
                },
                "paused",
            ),
            (
                Outcome::Paused {
                    budget: "default".into(),
                    after: Duration::from_secs(10),
                    by: crate::HeldBy::Limit,
                    next: Box::new(crate::TriggerMessage::parse("a", "b").unwrap()),
                },
                "at_limit",
            ),
        ];
        for (outcome, label) in cases {
            assert_eq!(outcome.label().as_str(), label, "{outcome:?}");
        }
        let names: Vec<&str> = OutcomeLabel::ALL.iter().map(|l| l.as_str()).collect();
        assert_eq!(
            names,
            [
                "completed",
                "retriggered",
                "coalesced",
                "rechecked",
                "failed",
                "lease_lost",
                "poisoned",
                "deferred",
                "superseded",
                "waiting",
                "debounced",
                "paused",
                "at_limit"
            ]
        );
    }
}
