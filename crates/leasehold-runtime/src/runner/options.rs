//! What the runner is given: the logic and what it is told, the run policies, the runner's
//! options and its known-wrong variants (tests only), and the notes and margins others read.

use std::time::Duration;

use async_trait::async_trait;
use tokio_util::sync::CancellationToken;

use super::Debounce;
use crate::error::LogicError;
use crate::flow::PerScope;
use crate::record::{RecordId, Scope};
use crate::trace::TraceContext;

/// What the logic is told about its run.
#[derive(Debug, Clone)]
pub struct RunContext {
    pub scope: Scope,
    pub record_id: RecordId,
    /// Strictly increasing per record; `None` when fencing is off.
    pub fencing_token: Option<u64>,
    /// Fires when the run must stop: lease lost, time limit, shutdown. Results produced after it
    /// fired are not acknowledged.
    pub cancel: CancellationToken,
    /// Delivery number of this trigger (1 = first). Runs put off by the logic's requests to run
    /// later do not count.
    pub attempt: u32,
    /// How long this trigger has been put off so far by its logic's requests to run later
    /// ([`LogicError::run_later`]); zero for a trigger never put off.
    pub deferred: Duration,
    /// The run's span context ([`crate::trace`]), to hand the downstream (a URL logic sends it
    /// as `traceparent`, a command gets `TRACEPARENT`) so its spans join the trace; `None` when
    /// the trigger has no trace.
    pub trace: Option<TraceContext>,
}

/// A record's logic.
#[async_trait]
pub trait Logic: Send + Sync + 'static {
    async fn run(&self, run: RunContext) -> Result<(), LogicError>;
}

/// Known-wrong protocol variants, kept so the simulation can prove it catches them. Only with
/// the `testing` feature (the crate's own tests turn it on); never use anything but `Correct`.
#[cfg(feature = "testing")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProtocolVariant {
    #[default]
    Correct,
    /// Check the marker *before* releasing the lease (the seed design's class of bug).
    CheckMarkerBeforeRelease,
    /// Let a redelivery or a carrier that finds the lease held set the marker and be
    /// acknowledged (trusting a possibly dead holder).
    TrustHolderOnRedelivery,
    /// Persist a deferral visible at once instead of after its delay (its total still counts
    /// the delay): the record runs again before the time the logic asked for.
    DeferralIgnoresDelay,
    /// Standalone: persist a deferral by deleting the delivered message and then putting the
    /// deferred one, two requests where one Update Message does both: a crash between them
    /// loses the trigger.
    DeferralDeletesThenPuts,
    /// Supersede: release the lease as soon as the stop is decided, before the logic has ended
    /// (then note, release and retrigger as usual): a logic slow to stop still runs when the next
    /// holder starts.
    SupersedeReleasesAtCancel,
    /// Debounce: a stand-in (path C: a redelivery, a sweep, a carrier marked with `wait`) trusts
    /// the wait marker to have a waiter and does not consume it: an orphan (its creator died
    /// before becoming its waiter) is left, with the triggers that joined it.
    StandInTrustsWaitMarker,
    /// Debounce: a waiter ignores that its consume was retried (not `owed`): a retried delete
    /// that answers "gone" (its own lost first attempt took the marker) stands down.
    WaiterStandsDownAfterRetriedDelete,
    /// Debounce: a joining trigger whose touch finds the marker gone creates it again: an
    /// incarnation with no waiter.
    TouchByPut,
    /// A known-wrong decision of the protocol core ([`crate::protocol::Fault`]).
    Core(crate::protocol::Fault),
}

/// What a scope does with a trigger that arrives during a run of its record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RunPolicy {
    /// The run goes on; the triggers that arrived during it cause one more run after it.
    #[default]
    Coalesce,
    /// The run is stopped (as when its lease is lost: the logic is cancelled, a command's process
    /// group gets SIGTERM, then SIGKILL) and the record runs again, on the new data, once it has
    /// ended. Needs fencing: the record's streak of stopped runs is kept with its lease, and
    /// after [`RunnerOptions::supersede_streak`] stopped runs in a row, or once they have cost
    /// the run time limit, a run is let finish (so a steady stream of triggers cannot starve the
    /// record).
    Supersede,
}

impl std::str::FromStr for RunPolicy {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "coalesce" => Ok(RunPolicy::Coalesce),
            "supersede" => Ok(RunPolicy::Supersede),
            other => Err(format!("unknown policy {other:?} (coalesce or supersede)")),
        }
    }
}

impl std::fmt::Display for RunPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RunPolicy::Coalesce => "coalesce",
            RunPolicy::Supersede => "supersede",
        })
    }
}

/// The lock note holding a record's streak of superseded runs: `<runs>:<run time in ms>`.
pub const SUPERSEDED_NOTE: &str = "superseded";

/// Reads a [`SUPERSEDED_NOTE`]: superseded runs in a row, and the run time they cost.
pub fn superseded_streak(note: &str) -> Option<(u32, Duration)> {
    let (runs, ms) = note.split_once(':')?;
    Some((runs.parse().ok()?, Duration::from_millis(ms.parse().ok()?)))
}
/// The lock note naming, by its fencing token, the run whose retry or deferral is pending in a
/// superseding scope: a later run that completes (or is superseded) removes it, and the retry,
/// finding it gone or another's, stands down.
pub const PENDING_NOTE: &str = "pending";

/// How the runner behaves.
#[derive(Debug, Clone)]
pub struct RunnerOptions {
    /// A run longer than this is cancelled, its lease released and its trigger retried.
    /// Default 9 minutes: inside the Functions Consumption plan's 10-minute limit, with a
    /// minute left to release the lease and enqueue a retrigger.
    pub run_timeout: Duration,
    /// How long a cancelled run may take to stop before it is abandoned (and its lease left to
    /// lapse). Default 5 s. Keep it at least 2 s below the lease's safety margin, so logic told
    /// of a lost lease is gone before storage can grant the lease to anyone else.
    pub stop_grace: Duration,
    /// Delay of a recheck (a carrier that found the lease held looks again after it). Default:
    /// the lease's renewal interval + 5 s, set by [`RecordRunner::new`]: short, because a
    /// recheck that comes too early only looks again, while one that comes late delays a dead
    /// holder's recovery.
    pub recheck_delay: Option<Duration>,
    /// Deliveries of a trigger before it is given up (poison queue), when the runner decides
    /// that itself ([`RecordRunner::handle_watched`]). Default 5, as the Functions host.
    pub max_attempts: u32,
    /// Delay before a failed trigger is tried again ([`RecordRunner::handle_watched`]).
    /// Default 5 s.
    pub retry_delay: Duration,
    /// The shortest delay of a run put off by its logic ([`LogicError::run_later`]), so logic
    /// answering "again in 0 s" cannot spin. Default 1 s.
    pub min_deferral: Duration,
    /// The delay of a run put off by its logic without saying for how long. Default 60 s.
    pub default_deferral: Duration,
    /// How long, in total, a trigger may be put off by its logic's requests to run later, per
    /// scope; a request beyond it gives the trigger up ([`Error::DeferralExhausted`]). Default
    /// 24 hours. At most 7 days (the longest a queue message can stay hidden).
    pub max_deferral: PerScope<Duration>,
    /// What each scope does with a trigger that arrives during a run. Default: coalesce.
    pub run_policy: PerScope<RunPolicy>,
    /// Superseded runs of a record in a row after which a run is let finish. Default 3.
    pub supersede_streak: u32,
    /// Each scope's debounce window; `None` (the default): triggers run as they come.
    pub debounce: PerScope<Option<Debounce>>,
    /// The protocol variant (feature `testing` only).
    #[cfg(feature = "testing")]
    pub variant: ProtocolVariant,
}

impl Default for RunnerOptions {
    fn default() -> Self {
        Self {
            run_timeout: Duration::from_secs(540),
            stop_grace: Duration::from_secs(5),
            recheck_delay: None,
            max_attempts: 5,
            retry_delay: Duration::from_secs(5),
            min_deferral: Duration::from_secs(1),
            default_deferral: Duration::from_secs(60),
            max_deferral: PerScope::new(Duration::from_secs(86_400)),
            run_policy: PerScope::new(RunPolicy::Coalesce),
            supersede_streak: 3,
            debounce: PerScope::new(None),
            #[cfg(feature = "testing")]
            variant: ProtocolVariant::Correct,
        }
    }
}

/// How much longer than the lease duration a standalone delivery's message stays hidden after
/// each push ([`crate::ConsumerOptions::visibility`]). It is pushed just before each renewal of
/// the delivery's lease, so a dead holder's message must surface only after the lease renewed
/// last has expired: later than the push by the push's answer and the renewal's flight, and by
/// how much faster the workers' clocks run than storage's over a lease.
pub const CARRIER_MARGIN: Duration = Duration::from_secs(5);

/// How much longer than the lease duration a watchdog stays hidden after each push (just before
/// each renewal of the delivery's lease, as [`CARRIER_MARGIN`] for a standalone message):
/// it must surface only after a dead holder's lease has expired (the renewal lands after the push
/// before it; clock rates and the push's own flight time included).
pub const WATCHDOG_MARGIN: Duration = Duration::from_secs(5);
