//! Functions mode (a delivery under a watchdog, whose host keeps the message hidden for 10
//! minutes whatever happens) and giving a trigger up (the poison entry, then a sweep).

use super::*;

impl RecordRunner {
    /// Handles one delivery whose message someone else keeps hidden, for longer than a lease,
    /// whatever happens to this process (the Functions host: 10 minutes). A hidden watchdog
    /// message is put first and carries the delivery's duty if its host dies; a failed run turns
    /// it into the retry, and a trigger that failed `max_attempts` times is given up (poison
    /// queue, with a sweep). Every outcome but `Failed` means: acknowledge.
    /// Costs 2 round trips per delivery (put and delete of the watchdog) plus one per lease
    /// renewal while a run lasts.
    pub async fn handle_watched(
        &self,
        delivery: &Delivery,
        poison: &dyn TriggerQueue,
        cancel: &CancellationToken,
    ) -> Outcome {
        async {
            let traced = self.trace_delivery(delivery);
            let (inner, trace) = match &traced {
                Some((traced, trace)) => (traced, Some(trace.clone())),
                None => (delivery, None),
            };
            let mut ended = Ended {
                trace,
                ..Ended::of(delivery)
            };
            let outcome = self.handle_watched_inner(inner, poison, cancel, &mut ended).await;
            self.finished(delivery, &outcome, &ended);
            outcome
        }
        .instrument(delivery.span())
        .await
    }

    pub(super) async fn handle_watched_inner(
        &self,
        delivery: &Delivery,
        poison: &dyn TriggerQueue,
        cancel: &CancellationToken,
        ended: &mut Ended,
    ) -> Outcome {
        let msg = &delivery.message;
        let attempts = delivery.attempts();
        if attempts > self.options.max_attempts {
            // Only a message the host redelivered after a crash can get here.
            let error = Error::GaveUp {
                deliveries: attempts - 1,
                max: self.options.max_attempts,
                last: None,
            };
            return self.poison_delivery(poison, delivery, error).await;
        }
        if let Some(Outcome::Paused { budget, after, .. }) =
            self.paused(delivery, None, MAX_PAUSE_WAIT_WATCHED)
        {
            // Nothing was done: a copy comes back after the pause, carrying the attempts so far
            // (this delivery does not count), and the host's message is acknowledged.
            let next = msg.follow_up(msg.kind, attempts - 1);
            return match self.enqueue(&next, after).await {
                Ok(()) => Outcome::Paused {
                    budget,
                    after,
                    next: Box::new(next),
                },
                Err(e) => storage_failed("put the paused trigger back", e),
            };
        }
        let key = msg.key();
        // A delivery that may leave a wait marker behind has carriers that stand in for it.
        let step = self.debounce_step(delivery);
        let marks = step.marks_carrier();
        let carrier = |m: TriggerMessage| if marks { marked(m) } else { m };
        let standin = carrier(msg.follow_up(TriggerKind::Watchdog, attempts));
        let watchdog = match Watchdog::arm(
            self.queue.clone(),
            &self.options_retry(),
            &standin,
            self.watchdog_visibility(),
        )
        .await
        {
            Ok(w) => Arc::new(w),
            // Nothing happened yet: the host retries its message.
            Err(e) => return storage_failed("put watchdog", e),
        };
        // What the delivery's follow-ups (a retry, a recheck) are made of: once it carries on
        // past its debounce step, the message without `wait`.
        // The host keeps its message hidden for 10 minutes whatever happens: no visibility to
        // watch here (a wait marker left by a late request is covered by that message, or the
        // watchdog put afresh).
        let (outcome, carried) = match self.debounce(step, delivery, None).await {
            Next::Done(outcome) => {
                if outcome.error().is_some() {
                    // As in `handle_untold`: the retry carries no `afterToken`.
                    *ended = Ended::default();
                }
                let mut retry_of = carrier(msg.clone());
                retry_of.after_token = ended.after_token;
                (outcome, retry_of)
            }
            Next::Carry(carried) => {
                *ended = Ended::carried(delivery, &carried);
                (
                    self.handle_key(&key, &carried, cancel, Some(&watchdog), None, ended)
                        .await,
                    carried.message,
                )
            }
        };
        let msg = &carried;
        // Given up as the message it carried on as (a stand-in that consumed a wait marker has
        // a fresh chain's give-up count).
        let delivery = &Delivery {
            message: carried.clone(),
            dequeue_count: delivery.dequeue_count,
        };
        let outcome = match outcome {
            // Handed back before its run: the watchdog becomes it; the host's message is
            // acknowledged. If that fails, the host retries its message (early, nothing lost).
            Outcome::Paused { budget, after, next } => match self.rearm_or_put(&watchdog, &next, after).await
            {
                Ok(()) => return Outcome::Paused { budget, after, next },
                Err(e) => storage_failed("hand the paused trigger back", e),
            },
            // The watchdog becomes the waiter; the host's message is acknowledged.
            Outcome::Waiting { after, next } => match self.rearm_or_put(&watchdog, &next, after).await {
                Ok(()) => return Outcome::Waiting { after, next },
                // Not acknowledged: it may be that nobody waits for a marker this delivery
                // created. Its retry, or the host's redelivery, stands in for it.
                Err(e) => storage_failed("persist the waiter", e),
            },
            other => other,
        };
        match outcome {
            Outcome::Rechecking { after } => {
                // Leave the watchdog in place as the look again; this delivery did not fail.
                let again = msg.looking_again(delivery.continuation_kind(), attempts - 1);
                if let Err(e) = self.rearm_or_put(&watchdog, &again, after).await {
                    tracing::warn!(error = %e, "could not reschedule the watchdog; it surfaces when its visibility lapses");
                }
                Outcome::Rechecking { after }
            }
            Outcome::Deferred {
                after,
                total,
                asked,
                why,
                next,
            } => match self.rearm_or_put(&watchdog, &next, after).await {
                // The host's message is acknowledged; the watchdog, a message the host never
                // took, carries the later run, so no deferral counts towards the host's
                // maxDequeueCount.
                Ok(()) => Outcome::Deferred {
                    after,
                    total,
                    asked,
                    why,
                    next,
                },
                // The host retries its message (and the watchdog may surface too): early, but
                // nothing lost. The storage failure counts as a failed attempt.
                Err(e) => storage_failed("persist the deferral", e),
            },
            Outcome::Failed { error, .. } if error.gives_up() => {
                let outcome = self.poison_delivery(poison, delivery, error).await;
                if outcome.acknowledge() {
                    watchdog.disarm().await;
                }
                outcome
            }
            Outcome::Failed { error, .. } if attempts >= self.options.max_attempts => {
                let error = Error::GaveUp {
                    deliveries: attempts,
                    max: self.options.max_attempts,
                    last: Some(Box::new(error)),
                };
                let outcome = self.poison_delivery(poison, delivery, error).await;
                if outcome.acknowledge() {
                    watchdog.disarm().await;
                }
                outcome
            }
            Outcome::Failed { error, retriggered } => {
                let mut retry = msg.follow_up(TriggerKind::Watchdog, attempts);
                retry.after_token = ended.after_token;
                let after = self.options.retry_delay;
                match self.rearm_or_put(&watchdog, &retry, after).await {
                    Ok(()) => Outcome::Retrying { error, after },
                    // The host retries its message (and the watchdog may surface too).
                    Err(_) => Outcome::Failed { error, retriggered },
                }
            }
            other => {
                watchdog.disarm().await;
                other
            }
        }
    }

    /// Gives a trigger up: writes its poison entry, then queues a sweep (so triggers that
    /// coalesced onto a holder of it are still honoured). The caller deletes the message only if
    /// this succeeds.
    ///
    /// The entry goes first: if the sweep's put fails after it, the message is given up again
    /// later and its entry is written twice, while a poison write that fails leaves no sweep
    /// behind for the next give-up to double. An entry storage refuses for what it is (413 or
    /// 400: [`PoisonMessage::encode`] always fits the queue, so only a malformed request gets
    /// here) would be refused on every retry: that refusal is final, logged with the record and
    /// the reason, and the give-up goes on without the entry.
    pub async fn give_up(&self, poison: &dyn TriggerQueue, entry: &PoisonMessage) -> Result<(), StoreError> {
        let body = entry.encode();
        let (scope, record) = match &entry.trigger {
            Some(t) => (Some(t.scope.as_str()), Some(t.record_id.as_str())),
            None => (None, None),
        };
        let reason = truncate_to(entry.reason(), 1024);
        match self
            .options_retry()
            .run("write poison", || poison.put(&body, Duration::ZERO))
            .await
        {
            Ok(_) => tracing::error!(
                scope,
                record,
                dequeue_count = entry.dequeue_count,
                reason,
                poison_queue = poison.name(),
                "trigger moved to the poison queue"
            ),
            Err(e) if e.kind() == StoreErrorKind::Rejected && matches!(e.status(), Some(400 | 413)) => {
                tracing::error!(
                    scope,
                    record,
                    dequeue_count = entry.dequeue_count,
                    reason,
                    poison_queue = poison.name(),
                    error = %e,
                    "the poison queue refused the entry for good; the trigger is given up without one (this log line is its only record)"
                )
            }
            Err(e) => return Err(e),
        }
        if let Some(trigger) = &entry.trigger {
            let mut sweep = trigger.follow_up(TriggerKind::Sweep, 0);
            sweep.given_up = trigger.given_up.saturating_add(1);
            // It stands for other triggers than the one given up: a budget of its own, and no
            // run it waits for.
            sweep.deferral = None;
            sweep.after_token = None;
            // A sweep always stands in for a wait marker its trigger may have left.
            sweep.wait = None;
            // Not before a request of the given-up delivery that timed out may still land (a
            // marker take, a wait marker's create or delete): the sweep's run must start after it.
            self.enqueue(&sweep, self.lock.options().retry.late_window)
                .await?;
        }
        Ok(())
    }

    pub(super) async fn poison_delivery(
        &self,
        poison: &dyn TriggerQueue,
        delivery: &Delivery,
        error: Error,
    ) -> Outcome {
        let entry = PoisonMessage::new(
            delivery.message.encode(),
            Some(delivery.message.clone()),
            &error,
            delivery.dequeue_count,
        );
        match self.give_up(poison, &entry).await {
            Ok(()) => Outcome::Poisoned { error },
            Err(e) => storage_failed("give the trigger up", e),
        }
    }

    /// Turns the watchdog into `message`, visible after `after`. If the watchdog is gone — it
    /// surfaced during this delivery (which outlived its visibility without a grant) and was
    /// taken — its taker cannot stand for what this delivery may still leave behind: one of our
    /// acquires that timed out may land after the taker looked, leaving a lease that nobody
    /// renews and onto which a trigger may coalesce. So the message is put afresh. At worst one
    /// run more; without it, a lost trigger.
    pub(super) async fn rearm_or_put(
        &self,
        watchdog: &Watchdog,
        message: &TriggerMessage,
        after: Duration,
    ) -> Result<(), StoreError> {
        match watchdog.rearm(message, after).await {
            Err(e) if e.kind() == StoreErrorKind::NotFound => {
                tracing::debug!("the watchdog was taken during the delivery; its follow-up is put afresh");
                self.enqueue(message, after).await
            }
            other => other,
        }
    }

    /// A watchdog pushed just before a renewal must still be hidden when the lease that renewal
    /// extended expires: lease duration + margin (35 s by default). Its first put, before the
    /// grant, covers the grant's lease the same way.
    pub(super) fn watchdog_visibility(&self) -> Duration {
        let lease = self.lock.options();
        lease.duration.as_duration() + WATCHDOG_MARGIN
    }
}
