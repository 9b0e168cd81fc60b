//! A holder's run: supersede's notes and watch, run later's deferral, and the logic itself under
//! the lease (stopping it, and keeping the lease of logic that does not stop).

use super::*;
use crate::protocol::later;

impl RecordRunner {
    /// The record's streak of superseded runs, when its scope supersedes (and fencing is on: the
    /// pending note names a run by its token): runs in a row, and the run time they cost. One
    /// read of the lease's notes, only in a superseding scope.
    pub(super) async fn supersede_streak(
        &self,
        delivery: &Delivery,
        guard: &LeaseGuard,
    ) -> Result<Option<Streak>, leasehold_lock::Error> {
        if *self.options.run_policy.get(&delivery.message.scope) != RunPolicy::Supersede
            || guard.fencing_token().is_none()
        {
            return Ok(None);
        }
        let note = guard.note(SUPERSEDED_NOTE).await?;
        let (runs, lost) = note
            .as_deref()
            .and_then(superseded_streak)
            .unwrap_or((0, Duration::ZERO));
        Ok(Some(Streak {
            runs,
            lost,
            noted: note.is_some(),
            pending: guard.note(PENDING_NOTE).await?.and_then(|p| p.parse().ok()),
        }))
    }

    /// Starts watching for triggers during the run, unless the streak protects it: after each
    /// renewal of the lease, one read of the retrigger marker; once it is set, `fired` fires. It
    /// stops watching when the streak plus this run reach the run time limit.
    pub(super) fn watch_for_triggers(
        &self,
        key: &LockKey,
        guard: &LeaseGuard,
        streak: Streak,
    ) -> Option<Watch> {
        let budget = self.options.run_timeout.checked_sub(streak.lost)?;
        if streak.runs >= self.options.supersede_streak || budget.is_zero() {
            tracing::debug!(
                superseded_in_a_row = streak.runs,
                lost_s = streak.lost.as_secs(),
                "this run is let finish: its record was superseded enough in a row"
            );
            return None;
        }
        let fired = CancellationToken::new();
        let mut renewals = guard.renewals();
        let (markers, key, fire) = (self.markers.clone(), key.clone(), fired.clone());
        let task = tokio::spawn(
            async move {
                let until = Instant::now() + budget;
                while renewals.changed().await.is_ok() && Instant::now() < until {
                    // Let whoever else follows the renewals go first: the channel wakes its
                    // waiters in no fixed order, and the simulation replays a seed only if the
                    // requests keep theirs. (Carriers no longer follow the channel: they are
                    // pushed before each renewal. The yield stays, so seeds replay as before.)
                    tokio::task::yield_now().await;
                    match markers.is_set(&key).await {
                        Ok(true) => {
                            tracing::info!("a trigger arrived during the run: stopping it, to run again on the new data");
                            fire.cancel();
                            return;
                        }
                        Ok(false) => {}
                        Err(e) => tracing::debug!(error = %e, "could not look at the retrigger marker; looking again at the next renewal"),
                    }
                }
            }
            .instrument(tracing::Span::current()),
        );
        Some(Watch { fired, task })
    }

    /// Records how the run ended in the record's notes, under the lease (before the release), in
    /// one write and only if something changes: the streak (one superseded run more, or — if it
    /// ended any other way and a streak was noted — broken) and `pending` (`Some(Some(token))`:
    /// this run's retry or deferral pends; `Some(None)`: none pends; `None`: as it was). Whether
    /// the notes now say what was asked; a write that fails is logged, and the notes stay as they
    /// were (the guard trips later, a retry runs).
    pub(super) async fn note_streak(
        &self,
        guard: &LeaseGuard,
        streak: Streak,
        superseded: bool,
        run_time: Duration,
        pending: Option<Option<u64>>,
    ) -> bool {
        if guard.is_lost() {
            // Nothing can be written under a lost lease.
            return false;
        }
        let mut changes = Vec::new();
        if superseded {
            let lost = streak.lost + run_time;
            changes.push((
                SUPERSEDED_NOTE,
                Some(format!("{}:{}", streak.runs + 1, lost.as_millis())),
            ));
        } else if streak.noted {
            changes.push((SUPERSEDED_NOTE, None));
        }
        match pending {
            Some(p) if p != streak.pending => changes.push((PENDING_NOTE, p.map(|t| t.to_string()))),
            _ => {}
        }
        if changes.is_empty() {
            return true;
        }
        match guard.write_notes(&changes).await {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "could not note how the run ended for the record's next runs");
                false
            }
        }
    }

    /// The deferral of a run whose logic asked to be run later: after `asked` (or the default),
    /// no sooner than the shortest deferral and within what is left of the chain's budget; once that is spent,
    /// the trigger is given up ([`Error::DeferralExhausted`], which the caller poisons at once).
    pub(super) fn defer(&self, delivery: &Delivery, asked: Option<Duration>, why: String) -> Outcome {
        let message = &delivery.message;
        let max = *self.options.max_deferral.get(&message.scope);
        let so_far = message.deferral.unwrap_or(crate::message::Deferral {
            total_ms: 0,
            hops: 0,
            id: 0,
            released: false,
            throttled: false,
        });
        let budget = later::Budget {
            max,
            floor: self.options.min_deferral,
            default: self.options.default_deferral,
        };
        let after = match later::later(asked, so_far.total(), budget) {
            later::Later::Defer(after) => after,
            later::Later::Exhausted => {
                return Outcome::Failed {
                    error: Error::DeferralExhausted {
                        total: so_far.total(),
                        max,
                        hops: so_far.hops,
                        asked,
                        why,
                    },
                    retriggered: false,
                };
            }
        };
        let next = message.deferred(
            delivery.attempts().saturating_sub(1),
            after,
            uuid::Uuid::new_v4().as_u64_pair().0 >> 11,
        );
        #[cfg(feature = "testing")]
        if self.options.variant == ProtocolVariant::DeferralIgnoresDelay {
            // WRONG on purpose: the deferred message is visible at once.
            return Outcome::Deferred {
                after: Duration::ZERO,
                total: so_far.total() + after,
                asked,
                why,
                next: Box::new(next),
            };
        }
        Outcome::Deferred {
            after,
            total: so_far.total() + after,
            asked,
            why,
            next: Box::new(next),
        }
    }

    /// Runs the logic (in a task of its own, so a panic is contained) until it ends, the lease is
    /// lost, the time limit passes or `outer` fires; then gives it `stop_grace` to stop.
    pub(super) async fn run_logic(
        &self,
        ctx: RunContext,
        guard: &LeaseGuard,
        run_cancel: &CancellationToken,
        outer: &CancellationToken,
        superseded: Option<&CancellationToken>,
    ) -> RunEnd {
        let lost = guard.lost();
        if lost.is_cancelled() {
            return RunEnd::stopped(Error::LeaseLostBeforeRun);
        }
        let logic = self.logic.clone();
        // The logic's own events belong to the delivery too.
        let mut task = AbortOnDrop(Some(tokio::spawn(
            async move { logic.run(ctx).await }.instrument(tracing::Span::current()),
        )));
        // Biased: a lost lease or a cancellation wins over a result that is ready at the same
        // moment, so a result produced after the lease was lost is never acknowledged.
        let stopped = tokio::select! {
            biased;
            _ = lost.cancelled() => Error::LeaseLost,
            _ = outer.cancelled() => Error::Cancelled,
            joined = task.handle() => return RunEnd { result: logic_result(joined), still_running: None },
            // After the result: a run that has finished needs no stopping (its marker then gives
            // the usual retrigger).
            _ = fired(superseded) => Error::Superseded,
            _ = tokio::time::sleep(self.options.run_timeout) => Error::TimedOut(self.options.run_timeout),
        };
        run_cancel.cancel();
        #[cfg(feature = "testing")]
        if self.options.variant == ProtocolVariant::SupersedeReleasesAtCancel
            && matches!(stopped, Error::Superseded)
        {
            // WRONG on purpose: the logic is left to stop on its own (its task detached, not
            // aborted), and the caller releases the lease at once.
            drop(task.keep());
            return RunEnd::stopped(stopped);
        }
        if tokio::time::timeout(self.options.stop_grace, task.handle())
            .await
            .is_ok()
        {
            return RunEnd::stopped(stopped);
        }
        tracing::error!(grace = ?self.options.stop_grace,
            "logic did not stop within its grace period; abandoned: its lease is kept until it has ended");
        RunEnd {
            result: Err(Error::Abandoned {
                stopped: Box::new(stopped),
                grace: self.options.stop_grace,
            }),
            still_running: Some(task.keep()),
        }
    }
}

/// A record's streak of superseded runs, as its lease's notes say, and the run whose retry or
/// deferral is pending, if one is.
#[derive(Debug, Clone, Copy)]
pub(super) struct Streak {
    pub(super) runs: u32,
    pub(super) lost: Duration,
    /// Whether a streak note was there (a run that ends otherwise removes it).
    pub(super) noted: bool,
    /// The note [`PENDING_NOTE`]: the fencing token of a run that ended failed with a retry, or
    /// deferred, with no run completed or superseded since.
    pub(super) pending: Option<u64>,
}

/// A run's watch for triggers ([`RecordRunner::watch_for_triggers`]); stops watching when dropped.
pub(super) struct Watch {
    pub(super) fired: CancellationToken,
    pub(super) task: JoinHandle<()>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Fires when `token` does; never without one.
pub(super) async fn fired(token: Option<&CancellationToken>) {
    match token {
        Some(t) => t.cancelled().await,
        None => std::future::pending().await,
    }
}

/// How a run ended.
pub(super) struct RunEnd {
    pub(super) result: Result<(), Error>,
    /// The logic did not stop within its grace: its task, still running.
    pub(super) still_running: Option<JoinHandle<Result<(), LogicError>>>,
}

impl RunEnd {
    pub(super) fn stopped(error: Error) -> Self {
        Self {
            result: Err(error),
            still_running: None,
        }
    }
}

/// How often a lease kept for logic that will not stop says so.
pub(super) const STILL_RUNNING_EVERY: Duration = Duration::from_secs(60);

/// Keeps an abandoned run's lease renewed until its logic's task has really ended, then
/// releases it (or, if the lease was lost meanwhile, lets it go): so nothing else runs the record
/// while the logic may still be acting on it.
///
/// The task is not aborted. Aborting drops the logic's future at its next `.await`, but work it
/// awaits elsewhere — a `spawn_blocking` closure, a spawned task, a thread — goes on after that
/// and nobody can observe it; awaited, it keeps the future alive, so the task ends only when
/// that work has. Logic that never ends keeps its record held for as long as the process lives
/// (said once a minute): exclusivity is the promise; a stuck record is visible, and a restart
/// frees it once the lease lapses, the stuck logic gone with the process.
pub(super) fn keep_until_ended(guard: Held, mut task: JoinHandle<Result<(), LogicError>>) {
    let span = tracing::Span::current();
    let guard = guard.take();
    tokio::spawn(
        async move {
            let since = Instant::now();
            loop {
                // Biased, so the same instants give the same choice (the simulation replays).
                tokio::select! {
                    biased;
                    _ = &mut task => break,
                    _ = tokio::time::sleep(STILL_RUNNING_EVERY) => tracing::error!(
                        running_for_s = since.elapsed().as_secs(),
                        lease_kept = !guard.lost().is_cancelled(),
                        "abandoned logic is still running; its lease is kept renewed so nothing runs beside it"
                    ),
                }
            }
            if guard.lost().is_cancelled() {
                guard.abandon();
                tracing::warn!("abandoned logic has ended; its lease was lost meanwhile");
            } else if let Err(e) = guard.release().await {
                tracing::warn!(error = %e, "abandoned logic has ended; releasing its lease failed, it lapses");
            } else {
                tracing::info!("abandoned logic has ended; its lease is released");
            }
        }
        .instrument(span),
    );
}

/// The lease of a delivery in progress. If the delivery is dropped before it decides (its
/// invocation went away), the lease is abandoned — left to lapse — not released: the logic may
/// still be stopping, and the message (or its watchdog) comes back after the lease expired.
pub(super) struct Held(pub(super) Option<LeaseGuard>);

impl Held {
    pub(super) fn get(&self) -> &LeaseGuard {
        self.0.as_ref().expect("held until released or abandoned")
    }

    /// Releases the lease, timing it ([`crate::observe::LOCK_SECONDS`], step `release`).
    pub(super) async fn release(self) -> leasehold_lock::Result<()> {
        let asked = Instant::now();
        let released = self.take().release().await;
        record_lock(LockStep::Release, asked.elapsed());
        released
    }

    /// The guard itself, for whoever ends the hold from here.
    pub(super) fn take(mut self) -> LeaseGuard {
        self.0.take().expect("held until released or abandoned")
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(guard) = self.0.take() {
            guard.abandon();
        }
    }
}

/// Aborts the logic's task if the run is dropped (its handler went away), unless it was handed
/// on with [`keep`](Self::keep).
pub(super) struct AbortOnDrop(Option<JoinHandle<Result<(), LogicError>>>);

impl AbortOnDrop {
    pub(super) fn handle(&mut self) -> &mut JoinHandle<Result<(), LogicError>> {
        self.0.as_mut().expect("kept only once")
    }

    /// The task, no longer aborted on drop.
    pub(super) fn keep(mut self) -> JoinHandle<Result<(), LogicError>> {
        self.0.take().expect("kept only once")
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(task) = &self.0 {
            task.abort();
        }
    }
}

pub(super) fn logic_result(
    joined: Result<Result<(), LogicError>, tokio::task::JoinError>,
) -> Result<(), Error> {
    match joined {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(Error::Logic(e)),
        // Cancelled only when the runtime itself shuts down under the run.
        Err(e) => match e.try_into_panic() {
            Ok(payload) => {
                let text = payload
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a non-text payload".into());
                Err(Error::LogicPanicked(text))
            }
            Err(_) => Err(Error::LogicTaskCancelled),
        },
    }
}

/// The delay asked for and why, when the logic asked to be run later.
pub(super) fn asks_to_run_later(result: &Result<(), Error>) -> Option<(Option<Duration>, String)> {
    match result {
        Err(Error::Logic(e)) => e
            .asks_to_run_later()
            .map(|after| (after, e.message().to_string())),
        _ => None,
    }
}
