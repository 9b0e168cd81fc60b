//! A budget's pause, shared: read in the background from its blob, written by a throttle,
//! resumed by an operator; and the triggers this worker handed back for it, made visible again
//! when it ends early.

use super::*;

impl Budgets {
    /// Ends the budget `name`'s pause, in storage (every worker stops honouring it at its next
    /// read, within [`BudgetOptions::refresh_every`] of its next look) and on this worker at
    /// once: the triggers it handed back for the pause are made visible again. Says whether
    /// storage held a pause.
    pub async fn resume(&self, name: &str) -> Result<bool, StoreError> {
        let was = self.inner.store.resume(name).await?;
        let handed_back = self.with_budget(name, |b| {
            b.paused_until = None;
            b.shared_until = None;
            b.unshared_until = None;
            b.notify.notify_waiters();
            std::mem::take(&mut b.handed_back)
        });
        tracing::info!(budget = %name, was_paused = was, "budget resumed: runs of it start again");
        self.release(name, handed_back);
        Ok(was)
    }

    /// Completes when a pause ends early on this worker (a resume, or a shorter pause read from
    /// storage), once the triggers handed back for it are visible again. A consumer that paces
    /// its polls while every budget is paused waits on it too.
    pub async fn pause_ended_early(&self) {
        self.inner.ended_early.notified().await
    }

    /// Notes a trigger handed back for the budget `name`'s pause: its message `id` on `queue`,
    /// hidden for `hidden` by the update that returned `receipt`. When this worker learns that
    /// the pause ended early (a resume here, or a resumed or shorter pause read from storage),
    /// the message is made visible again at once (one request) instead of at the pause's
    /// original end; if the message was taken since, the stale receipt changes nothing. While
    /// it holds such triggers the worker reads the pause every
    /// [`BudgetOptions::refresh_every`], whether or not it starts runs of the budget. A trigger
    /// hidden for no longer than that is not noted (it is back by the next read anyway), nor
    /// one beyond [`MAX_HANDED_BACK`].
    pub fn handed_back(
        &self,
        name: &str,
        queue: Arc<dyn TriggerQueue>,
        id: &str,
        receipt: String,
        hidden: Duration,
    ) {
        if hidden <= self.inner.options.refresh_every {
            return;
        }
        enum Then {
            Noted,
            Watch,
            Release(HandedBack),
        }
        let now = Instant::now();
        let entry = HandedBack {
            queue,
            id: id.to_string(),
            receipt,
            until: now + hidden,
        };
        let then = self.with_budget(name, move |b| {
            // The pause ended, or was shortened, while the trigger was being handed back: no
            // later release would see it.
            if b.paused_until.is_none_or(|u| entry.until > u + RELEASE_SLACK) {
                return Then::Release(entry);
            }
            if b.handed_back.len() >= MAX_HANDED_BACK {
                return Then::Noted;
            }
            b.handed_back.push(entry);
            if b.watching {
                Then::Noted
            } else {
                b.watching = true;
                Then::Watch
            }
        });
        match then {
            Then::Noted => {}
            Then::Watch => self.watch(name),
            Then::Release(entry) => self.release(name, vec![entry]),
        }
    }

    /// While this worker holds triggers handed back for `name`'s pause, reads the pause every
    /// refresh interval (a read it would make anyway when it starts runs is not repeated): the
    /// read that finds the pause ended early releases them.
    pub(super) fn watch(&self, name: &str) {
        let this = self.clone();
        let name = name.to_string();
        // Never a busy loop, whatever the options say.
        let every = self.inner.options.refresh_every.max(Duration::from_millis(100));
        tokio::spawn(async move {
            let mut next = Instant::now();
            loop {
                // When the last read goes stale (a run start may have read since).
                tokio::time::sleep_until(next).await;
                let now = Instant::now();
                let holding = this.with_budget(&name, |b| {
                    // Those whose hiding lapsed are back on the queue by themselves.
                    b.handed_back.retain(|e| e.until > now);
                    b.watching = !b.handed_back.is_empty();
                    b.watching.then_some(b.read_at)
                });
                let Some(read_at) = holding else {
                    return;
                };
                this.refresh_if_stale(&name);
                next = match read_at {
                    Some(at) if at + every > now => at + every,
                    // Read now (or a read is under way): look again an interval on.
                    _ => now + every,
                };
            }
        });
    }

    /// Makes `entries`, handed back for `name`'s pause, visible again now (a few updates at
    /// once), then tells [`pause_ended_early`](Self::pause_ended_early).
    pub(super) fn release(&self, name: &str, entries: Vec<HandedBack>) {
        if entries.is_empty() {
            self.inner.ended_early.notify_one();
            return;
        }
        let name = name.to_string();
        let this = self.clone();
        tokio::spawn(async move {
            let count = entries.len();
            let per_task = count.div_ceil(RELEASES_AT_ONCE);
            let mut tasks = tokio::task::JoinSet::new();
            let mut entries = entries.into_iter();
            loop {
                let chunk: Vec<HandedBack> = entries.by_ref().take(per_task).collect();
                if chunk.is_empty() {
                    break;
                }
                tasks.spawn(async move {
                    let mut visible = 0usize;
                    for e in chunk {
                        match e.queue.update_visibility(&e.id, &e.receipt, Duration::ZERO).await {
                            Ok(_) => visible += 1,
                            // Taken since (its hiding lapsed), or gone: it is not hidden by us.
                            Err(err) => tracing::debug!(id = %e.id, error = %err,
                                "a trigger handed back for the pause could not be made visible again; it comes back when its hiding lapses"),
                        }
                    }
                    visible
                });
            }
            let mut visible = 0;
            while let Some(done) = tasks.join_next().await {
                visible += done.unwrap_or(0);
            }
            tracing::info!(budget = %name, handed_back = count, visible,
                "the budget's pause ended early: the triggers handed back for it are visible again");
            this.inner.ended_early.notify_one();
        });
    }

    /// Reads the budget's pause in the background if the last read is stale and none is under
    /// way. What storage holds replaces what this worker knew (so a pause shortened or resumed
    /// there ends here too), capped at [`BudgetOptions::max_pause`], except that a read that
    /// overlapped one of this worker's writes only lengthens it, and a pause of its own that it
    /// could not write stays.
    pub(super) fn refresh_if_stale(&self, name: &str) {
        let every = self.inner.options.refresh_every;
        let start = self.with_budget(name, |b| {
            let stale = b.read_at.is_none_or(|at| at.elapsed() >= every);
            if stale && !b.reading {
                b.reading = true;
                Some(b.writes)
            } else {
                None
            }
        });
        let Some(writes_before) = start else {
            return;
        };
        let this = self.clone();
        let name = name.to_string();
        tokio::spawn(async move {
            let read = this.inner.store.read(&name).await;
            let now = Instant::now();
            let max = this.inner.options.max_pause;
            let released = this.with_budget(&name, |b| {
                b.reading = false;
                b.read_at = Some(now);
                let shared = match read {
                    Ok(shared) => shared,
                    Err(e) => {
                        tracing::debug!(budget = %name, error = %e, "could not read the budget's pause; reading again later");
                        return None;
                    }
                };
                let left = shared.as_ref().map_or(Duration::ZERO, |s| s.left);
                if left > max {
                    if !b.warned_cap {
                        tracing::warn!(budget = %name, stored_s = left.as_secs_f64(), honoured_s = max.as_secs_f64(),
                            "the budget's stored pause is longer than LEASEHOLD_MAX_THROTTLE_PAUSE_SECONDS (a writer whose clock runs ahead, or a deployment with a larger cap): capped");
                        b.warned_cap = true;
                    }
                } else {
                    b.warned_cap = false;
                }
                let read_until = (!left.is_zero()).then(|| now + left.min(max));
                let mine = b.unshared_until.filter(|u| *u > now);
                let until = read_until.max(mine);
                let overlapped = b.writes != writes_before || b.writing > 0;
                let before = b.paused_until.filter(|u| *u > now);
                if overlapped {
                    if until > before {
                        b.paused_until = until;
                    }
                } else {
                    b.paused_until = until;
                    b.shared_until = read_until;
                }
                let after = b.paused_until.filter(|u| *u > now);
                let mut released = None;
                if after > before {
                    tracing::info!(budget = %name, paused_for_s = left.min(max).as_secs_f64(),
                        "another worker paused this downstream budget: no run of it starts before the pause ends");
                } else if after < before {
                    let resumed = shared.as_ref().is_some_and(|s| s.resumed);
                    tracing::info!(budget = %name, paused_for_s = after.map_or(0.0, |u| (u - now).as_secs_f64()), resumed,
                        "the budget's pause was shortened or ended in storage: runs of it start sooner");
                    // Triggers hidden past the pause's new end come back now (those still
                    // within a pause meet it and are handed back for its rest).
                    let end = after.unwrap_or(now) + RELEASE_SLACK;
                    let (late, kept) = std::mem::take(&mut b.handed_back)
                        .into_iter()
                        .partition(|e| e.until > end);
                    b.handed_back = kept;
                    released = Some(late);
                }
                if after != before {
                    b.notify.notify_waiters();
                }
                released
            });
            if let Some(released) = released {
                this.release(&name, released);
            }
        });
    }

    /// The pause a throttle that asked for `asked` sets: the default when it gave none, capped
    /// to the longest (with a warning naming the record: the delivery's span).
    pub fn pause_for(&self, asked: Option<Duration>) -> Duration {
        let options = &self.inner.options;
        match asked {
            None => {
                tracing::warn!(
                    pause_s = options.default_pause.as_secs_f64(),
                    "the downstream throttled without a usable Retry-After: pausing its budget for the default"
                );
                options.default_pause
            }
            Some(a) if a > options.max_pause => {
                tracing::warn!(
                    asked_s = a.as_secs_f64(),
                    pause_s = options.max_pause.as_secs_f64(),
                    "the downstream asked for a longer pause than the longest allowed: capped"
                );
                options.max_pause
            }
            Some(a) => a,
        }
    }
}
