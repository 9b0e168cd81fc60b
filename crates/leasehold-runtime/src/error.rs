//! Why a delivery did not end in a completed run: [`Error`], carried by
//! [`Outcome`](crate::Outcome) and written to logs and the poison queue; and [`LogicError`], what a
//! record's logic returns when it fails.

use std::fmt;
use std::time::Duration;

use crate::message::DecodeError;

/// A failed run of a record's logic, or its request to be run again later
/// ([`LogicError::run_later`]). Its text ends up in logs and, if the trigger keeps failing, the
/// poison queue.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct LogicError {
    message: String,
    /// `Some` when the logic asks to be run again later: after this delay, or after the default
    /// (`None`).
    run_later: Option<Option<Duration>>,
    /// Whether the downstream said "too many" ([`LogicError::throttled`]).
    throttled: bool,
}

impl LogicError {
    pub fn new(message: impl fmt::Display) -> Self {
        Self {
            message: message.to_string(),
            run_later: None,
            throttled: false,
        }
    }

    /// From any error: its text, then each of its sources', joined by `: `.
    pub fn from_error(error: &(dyn std::error::Error + 'static)) -> Self {
        let mut text = error.to_string();
        let mut source = error.source();
        while let Some(e) = source {
            text.push_str(": ");
            text.push_str(&e.to_string());
            source = e.source();
        }
        Self::new(text)
    }

    /// The logic asks to be run again after `after` (`None`: the runner's default), for the
    /// reason `why` (say, "the CRM answered 429"). This is not a failure: the run ends, its lease
    /// is released, and the record runs again later without the delivery counting towards the
    /// poison limit. Triggers that arrived during the run are covered by that later run. The
    /// runner bounds the delay and the total a trigger may be put off
    /// ([`RunnerOptions::max_deferral`](crate::RunnerOptions::max_deferral)).
    pub fn run_later(after: Option<Duration>, why: impl fmt::Display) -> Self {
        Self {
            message: why.to_string(),
            run_later: Some(after),
            throttled: false,
        }
    }

    /// The downstream this run writes to said "too many" (HTTP 429, or 503 with `Retry-After`),
    /// asking for `after` (`None`: it did not say, or not readably): a [`run_later`] that also
    /// pauses the run's downstream budget, so no run of that budget starts anywhere before the
    /// time has passed, and makes this worker start fewer of its runs at once
    /// ([`crate::Budgets`]). A delay beyond the budget's longest pause is capped to it.
    ///
    /// [`run_later`]: LogicError::run_later
    pub fn throttled(after: Option<Duration>, why: impl fmt::Display) -> Self {
        Self {
            message: why.to_string(),
            run_later: Some(after),
            throttled: true,
        }
    }

    /// Whether the downstream said "too many" ([`LogicError::throttled`]).
    pub fn is_throttled(&self) -> bool {
        self.throttled
    }

    /// `Some(after)` when this is a request to be run later ([`LogicError::run_later`]).
    pub fn asks_to_run_later(&self) -> Option<Option<Duration>> {
        self.run_later
    }

    pub fn message(&self) -> &str {
        &self.message
    }
}

/// Why a delivery did not end in a completed run.
///
/// Its text names the cause in one line, a storage failure's included (so `source()` is not
/// set: printing the chain would repeat it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The logic returned an error.
    #[error("logic failed: {0}")]
    Logic(LogicError),
    /// The logic panicked; the text is the panic's message.
    #[error("logic panicked: {0}")]
    LogicPanicked(String),
    /// The logic's task was cancelled under it (the async runtime is shutting down).
    #[error("logic task was cancelled")]
    LogicTaskCancelled,
    /// The lease was found lost before the logic was started.
    #[error("lease lost before the run started")]
    LeaseLostBeforeRun,
    /// The lease was lost while the logic ran (renewals failed, or it was broken); the logic was
    /// told to stop.
    #[error("lease lost during the run")]
    LeaseLost,
    /// The run was cancelled from outside (shutdown); the logic was told to stop.
    #[error("run cancelled (shutdown)")]
    Cancelled,
    /// A trigger arrived during the run, whose scope supersedes: the logic was told to stop, to
    /// run again on the new data.
    #[error("superseded: a trigger arrived during the run, which was stopped to run again on the new data")]
    Superseded,
    /// The run passed its time limit; the logic was told to stop.
    #[error("run exceeded its time limit of {0:?}")]
    TimedOut(Duration),
    /// The logic was told to stop (for `stopped`) and did not within its grace: it may still be
    /// running, so its lease was left to lapse instead of released.
    #[error("{stopped}; the logic did not stop within {grace:?} and was abandoned")]
    Abandoned { stopped: Box<Error>, grace: Duration },
    /// A storage step failed (after its retries).
    #[error("storage: {step}: {error}")]
    Storage {
        step: &'static str,
        error: leasehold_lock::Error,
    },
    /// The trigger failed too many deliveries and was given up: it is in the poison queue.
    #[error("gave up after {deliveries} deliveries (max {max}){}", last_failure(.last))]
    GaveUp {
        deliveries: u32,
        max: u32,
        /// The last delivery's failure, when it is known here.
        last: Option<Box<Error>>,
    },
    /// The message is not a trigger: it is in the poison queue.
    #[error("unreadable message: {0}")]
    Unreadable(DecodeError),
    /// The logic asked to be run later once more than the trigger's deferral budget allows: it
    /// is given up at once (a trigger that waited that long should not be retried every few
    /// seconds against a service that asked for patience).
    #[error("{}", deferral_exhausted(*.total, *.max, *.hops, .asked, .why))]
    DeferralExhausted {
        /// Delay granted to this trigger so far, over `hops` requests to run later.
        total: Duration,
        max: Duration,
        hops: u32,
        /// What the logic asked for this time (`None`: no delay given), and why.
        asked: Option<Duration>,
        why: String,
    },
}

fn deferral_exhausted(
    total: Duration,
    max: Duration,
    hops: u32,
    asked: &Option<Duration>,
    why: &str,
) -> String {
    let asked = match asked {
        Some(d) => format!("{} s", d.as_secs()),
        None => "the default delay".into(),
    };
    format!(
        "deferred {} s in total over {hops} requests to run later, the most LEASEHOLD_MAX_DEFERRAL_SECONDS allows ({} s); the logic asked once more, for {asked}: {why}",
        total.as_secs(),
        max.as_secs()
    )
}

fn last_failure(last: &Option<Box<Error>>) -> String {
    match last {
        Some(e) => format!(": {e}"),
        None => "; last failures are in the logs".into(),
    }
}

impl Error {
    pub(crate) fn storage(step: &'static str, error: impl Into<leasehold_lock::Error>) -> Self {
        Error::Storage {
            step,
            error: error.into(),
        }
    }

    /// Whether storage failed (rather than the run or its logic).
    pub fn is_storage(&self) -> bool {
        matches!(self, Error::Storage { .. })
    }

    /// Whether the trigger is given up at once, whatever its attempts: its deferral budget is
    /// spent.
    pub fn gives_up(&self) -> bool {
        matches!(self, Error::DeferralExhausted { .. })
    }

    /// Whether the run stopped because its lease was lost.
    pub fn is_lease_lost(&self) -> bool {
        match self {
            Error::LeaseLost | Error::LeaseLostBeforeRun => true,
            Error::Abandoned { stopped, .. } => stopped.is_lease_lost(),
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("the CRM said no")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn a_logic_error_keeps_the_whole_chain() {
        let e = Outer(std::io::Error::other("connection reset"));
        assert_eq!(
            LogicError::from_error(&e).message(),
            "the CRM said no: connection reset"
        );
        assert_eq!(LogicError::new("plain").to_string(), "plain");
    }

    #[test]
    fn texts_name_the_cause() {
        let abandoned = Error::Abandoned {
            stopped: Box::new(Error::LeaseLost),
            grace: Duration::from_secs(5),
        };
        assert_eq!(
            abandoned.to_string(),
            "lease lost during the run; the logic did not stop within 5s and was abandoned"
        );
        assert!(abandoned.is_lease_lost() && !abandoned.is_storage());
        let gave_up = |last| Error::GaveUp {
            deliveries: 5,
            max: 5,
            last,
        };
        assert_eq!(
            gave_up(Some(Box::new(Error::Logic(LogicError::new("no"))))).to_string(),
            "gave up after 5 deliveries (max 5): logic failed: no"
        );
        assert_eq!(
            gave_up(None).to_string(),
            "gave up after 5 deliveries (max 5); last failures are in the logs"
        );
        let storage = Error::storage(
            "release lease",
            leasehold_lock::Error::LeaseLost { key: "a/b".into() },
        );
        assert_eq!(
            storage.to_string(),
            "storage: release lease: lease on \"a/b\" was lost"
        );
        assert!(storage.is_storage() && !storage.is_lease_lost());
    }
}
