//! A slot of a budget ([`BudgetPermit`]), held while a delivery runs.

use super::*;

/// A slot of a budget, held while a delivery runs; freed when dropped.
#[derive(Debug)]
pub struct BudgetPermit {
    pub(super) budgets: Budgets,
    pub(super) name: String,
    pub(super) told: bool,
    /// Runs of the budget in flight on this worker when this one started, itself included.
    pub(super) position: usize,
    /// Whether the delivery had to wait for it.
    pub(super) waited: bool,
    /// When it was taken.
    pub(super) started: Instant,
}

impl BudgetPermit {
    pub fn budget(&self) -> &str {
        &self.name
    }

    /// Whether the delivery waited for this slot (for a pause, or for the limit).
    pub fn waited(&self) -> bool {
        self.waited
    }

    /// The run succeeded: the limit grows by one per `limit` successes, up to just below the
    /// concurrency the downstream last refused, and beyond it only after [`PROBE_AFTER`] windows
    /// of successes and [`PROBE_EVERY`] since the cut.
    pub fn succeeded(&mut self) {
        if std::mem::replace(&mut self.told, true) {
            return;
        }
        let max = self.budgets.inner.options.max_concurrency.max(1) as f64;
        self.budgets.with_budget(&self.name, |b| {
            if b.successes.len() == SUCCESSES_KEPT {
                b.successes.pop_front();
            }
            b.successes.push_back(Instant::now());
            b.since_cut += 1;
            let cap = match b.ceiling {
                Some(c)
                    if b.since_cut < PROBE_AFTER * c as u64
                        || b.cut_at.is_some_and(|at| at.elapsed() < PROBE_EVERY) =>
                {
                    (c.saturating_sub(1).max(1) as f64).min(max)
                }
                _ => max,
            };
            if b.limit < cap {
                b.limit = (b.limit + 1.0 / b.limit).min(cap);
            }
        });
    }

    /// The downstream throttled the run of `record` and asked for `pause` (already bounded,
    /// [`Budgets::pause_for`]): pauses the budget here, cuts the limit (once per pause: to the
    /// concurrency that was refused less one, or by half), and writes the pause for the other
    /// workers if it lengthens what they know. Never fails: a write that fails is logged (they
    /// will meet the downstream's 429 themselves).
    ///
    /// Not every refusal is the downstream's. `again` says the run was itself put off by a
    /// throttle before (a record's chain of deferrals, refused once more). Such a refusal counts
    /// for the budget only when another record was refused too within the pause asked for and
    /// the [`OTHERS_REFUSED_WITHIN`] before it (a throttled downstream refuses many records: a
    /// bulk import's chains are most of its refusals, and what its limit must learn from);
    /// alone, it is one record's refusal (a lock on that record, a validation that answers
    /// 429): counted, but the budget is neither paused nor cut, and the record comes back when
    /// it was asked to. Nor does a refusal with no other run of the budget in flight here cut
    /// the limit: it shows nothing of the concurrency the downstream takes (the pause still
    /// holds).
    pub async fn throttled(&mut self, record: &str, pause: Duration, again: bool) {
        self.told = true;
        let now = Instant::now();
        let until = now + pause;
        let write = self.budgets.with_budget(&self.name, |b| {
            b.throttles += 1;
            let within = pause + OTHERS_REFUSED_WITHIN;
            let others = b
                .refused
                .iter()
                .any(|(r, at)| r != record && now.saturating_duration_since(*at) <= within);
            if b.refused.len() == REFUSALS_KEPT {
                b.refused.pop_front();
            }
            b.refused.push_back((record.to_string(), now));
            if again && !others {
                b.record_refusals += 1;
                tracing::info!(budget = %self.name, record,
                    "a record put off by a throttle was refused again, and no other record was: one record's refusal, the budget is neither paused nor cut (the record runs later)");
                return None;
            }
            let was_paused = b.paused_until.is_some_and(|u| u > now);
            // This run was refused with `position` runs in flight here: fewer than that were
            // what the downstream took. Cut to that; if it is no cut (other workers share the
            // downstream), halve — once per pause. A probe's refusal (the limit back at the
            // concurrency refused before) cuts no lower than the level that has worked since:
            // a run that started after this one may have reached the downstream first, so
            // `position` can undercount. A later refusal in the same pause only lowers it to
            // what it shows. A refusal with nothing else in flight shows nothing.
            let shown = self.position.saturating_sub(1).max(1) as f64;
            let before = b.limit;
            // Nothing else of the budget in flight here now (this run's slot is still held).
            if b.in_flight <= 1 {
                tracing::info!(budget = %self.name, limit = b.limit as u64, pause_s = pause.as_secs_f64(),
                    "the downstream throttled the only run in flight here: budget paused, the limit kept");
            } else if !was_paused {
                let worked = match b.ceiling {
                    Some(c) if b.limit as usize >= c => c.saturating_sub(1).max(1) as f64,
                    _ => 1.0,
                };
                b.limit = if shown < b.limit { shown } else { (b.limit / 2.0).max(1.0) }.max(worked);
                b.since_cut = 0;
                b.cut_at = Some(now);
                b.ceiling = Some(b.limit as usize + 1);
                tracing::info!(budget = %self.name, limit_before = before as u64, limit = b.limit as u64,
                    pause_s = pause.as_secs_f64(), "the downstream throttled a run: budget paused, fewer runs at once");
            } else if shown < b.limit {
                b.limit = shown;
                b.ceiling = Some(b.limit as usize + 1);
            }
            if b.paused_until.is_none_or(|u| u < until) {
                b.paused_until = Some(until);
                b.notify.notify_waiters();
            }
            // Written when it lengthens the shared pause by a second or more.
            let lengthens = b.shared_until.is_none_or(|s| until > s + Duration::from_secs(1));
            if lengthens {
                b.shared_until = Some(until);
                b.writes += 1;
                b.writing += 1;
            } else {
                // Not written (it lengthens the shared pause by under a second): kept here
                // whatever storage says, or the next read would end it at the shared end.
                b.unshared_until = b.unshared_until.max(Some(until));
            }
            lengthens.then_some(b.limit as u32)
        });
        if let Some(limit) = write {
            let store = &self.budgets.inner.store;
            let written = store.write(&self.name, pause, limit).await;
            self.budgets.with_budget(&self.name, |b| {
                b.writing -= 1;
                if written.is_err() {
                    b.unshared_until = b.unshared_until.max(Some(until));
                }
            });
            if let Err(e) = written {
                tracing::warn!(budget = %self.name, error = %e,
                    "could not share the budget's pause; other workers learn of the throttle when they meet it");
            }
        }
    }
}

impl Drop for BudgetPermit {
    fn drop(&mut self) {
        let held = self.started.elapsed();
        self.budgets.with_budget(&self.name, |b| {
            b.in_flight -= 1;
            // The pace at which slots free ([`Budgets::limit_turn`]): the last few runs, the
            // newest an eighth.
            b.run_mean = Some(b.run_mean.map_or(held, |m| (m * 7 + held) / 8));
            b.notify.notify_waiters();
        });
        // One permit kept if the consumer is not waiting at this instant: it polls at once.
        self.budgets.inner.freed.notify_one();
    }
}
