//! Functions mode (a delivery under a watchdog, whose host keeps the message hidden for 10
//! minutes whatever happens) and giving a trigger up (the poison entry, then a sweep).

use super::*;
use crate::protocol::carriers;

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
        if carriers::gives_up_at_once(attempts, self.options.max_attempts) {
            let error = Error::GaveUp {
                deliveries: attempts - 1,
                max: self.options.max_attempts,
                last: None,
            };
            return self.poison_delivery(poison, delivery, error).await;
        }
        if let Some(Outcome::Paused {
            budget, after, by, ..
        }) = self.paused(delivery, None, MAX_PAUSE_WAIT_WATCHED)
        {
            // Nothing was done: a copy comes back after the pause, carrying the attempts so far
            // (this delivery does not count), and the host's message is acknowledged.
            let next = msg.follow_up(msg.kind, attempts - 1);
            return match self.enqueue(&next, after).await {
                Ok(()) => Outcome::Paused {
                    budget,
                    after,
                    by,
                    next: Box::new(next),
                },
                Err(e) => storage_failed("put the paused trigger back", e),
            };
        }
        // A delivery that may leave a wait marker behind has carriers that stand in for it.
        let step = self.debounce_step(delivery);
        let marks = step.marks_carrier();
        let standin = msg.follow_up(TriggerKind::Watchdog, attempts);
        let watchdog = match Watchdog::arm(
            self.queue.clone(),
            &self.options_retry(),
            &if marks { marked(standin) } else { standin },
            self.watchdog_visibility(),
        )
        .await
        {
            Ok(w) => Arc::new(w),
            // Nothing happened yet: the host retries its message.
            Err(e) => return storage_failed("put watchdog", e),
        };
        let (outcome, carried) = self
            .watched_protocol(step, delivery, &watchdog, cancel, ended)
            .await;
        // Given up as the message it carried on as (a stand-in that consumed a wait marker has
        // a fresh chain's give-up count).
        let delivery = Delivery {
            message: carried,
            dequeue_count: delivery.dequeue_count,
        };
        self.after_watched(outcome, &delivery, attempts, &watchdog, poison, ended)
            .await
    }

    /// The delivery's debounce step and lock protocol, under its watchdog: its outcome, and the
    /// message its follow-ups (a retry, a recheck) are made of — once it carries on past its
    /// debounce step, the message without `wait`. The host keeps its message hidden for 10
    /// minutes whatever happens: no visibility to watch here (a wait marker left by a late
    /// request is covered by that message, or the watchdog put afresh).
    async fn watched_protocol(
        &self,
        step: DebounceStep,
        delivery: &Delivery,
        watchdog: &Arc<Watchdog>,
        cancel: &CancellationToken,
        ended: &mut Ended,
    ) -> (Outcome, TriggerMessage) {
        let marks = step.marks_carrier();
        match self.debounce(step, delivery, None).await {
            Next::Done(outcome) => {
                if outcome.error().is_some() {
                    // As in `handle_untold`: the retry carries no `afterToken`.
                    *ended = Ended::default();
                }
                let mut retry_of = delivery.message.clone();
                if marks {
                    retry_of = marked(retry_of);
                }
                retry_of.after_token = ended.after_token;
                (outcome, retry_of)
            }
            Next::Carry(carried) => {
                *ended = Ended::carried(delivery, &carried);
                let key = carried.message.key();
                let outcome = self
                    .handle_key(&key, &carried, cancel, Some(watchdog), None, ended)
                    .await;
                (outcome, carried.message)
            }
        }
    }

    /// What becomes of the watchdog once the delivery's protocol came to `outcome`, as the
    /// core decides ([`carriers`]): deleted, or rewritten into what carries the duty on; and
    /// the delivery's outcome for the host.
    async fn after_watched(
        &self,
        outcome: Outcome,
        delivery: &Delivery,
        attempts: u32,
        watchdog: &Watchdog,
        poison: &dyn TriggerQueue,
        ended: &Ended,
    ) -> Outcome {
        let decided = carriers::after(outcome.ended(), attempts, self.options.max_attempts, self.fault());
        let failed = match decided {
            carriers::Watchdog::Disarm | carriers::Watchdog::Dropped => {
                watchdog.disarm().await;
                return outcome;
            }
            carriers::Watchdog::GiveUp => {
                return self
                    .give_up_watched(outcome, delivery, attempts, watchdog, poison)
                    .await;
            }
            carriers::Watchdog::Retry => {
                let Outcome::Failed { error, retriggered } = outcome else {
                    unreachable!("only a failure is retried")
                };
                let mut retry = delivery.message.follow_up(TriggerKind::Watchdog, attempts);
                retry.after_token = ended.after_token;
                let after = self.options.retry_delay;
                return match self.rearm_or_put(watchdog, &retry, after).await {
                    Ok(()) => Outcome::Retrying { error, after },
                    // The host retries its message (and the watchdog may surface too).
                    Err(_) => Outcome::Failed { error, retriggered },
                };
            }
            carriers::Watchdog::LookAgain => {
                let again = delivery
                    .message
                    .looking_again(delivery.continuation_kind(), attempts - 1);
                match outcome {
                    Outcome::Rechecking { after } => self.rearm_or_put(watchdog, &again, after).await,
                    _ => unreachable!("only a look again leaves its watchdog as the look again"),
                }
                .err()
                .map(|e| ("reschedule the watchdog", e))
            }
            carriers::Watchdog::FollowUp | carriers::Watchdog::Deferral => {
                self.rewrite_into_follow_up(&outcome, watchdog).await
            }
        };
        let Some((step, e)) = failed else {
            // The host's message is acknowledged; the watchdog, a message the host never took,
            // carries the duty on, so no deferral or wait counts towards the host's
            // maxDequeueCount.
            return outcome;
        };
        match carriers::if_it_fails(decided) {
            carriers::IfItFails::Acknowledge => {
                tracing::warn!(error = %e, "could not {step}; the watchdog surfaces when its visibility lapses");
                outcome
            }
            carriers::IfItFails::HostRetries => storage_failed(step, e),
            // Not acknowledged: it may be that nobody waits for a marker this delivery
            // created. Its retry, or the host's redelivery, stands in for it.
            carriers::IfItFails::Failed => {
                Box::pin(self.after_watched(
                    storage_failed(step, e),
                    delivery,
                    attempts,
                    watchdog,
                    poison,
                    ended,
                ))
                .await
            }
        }
    }

    /// Rewrites the watchdog into the outcome's follow-up (its waiter, its hand-back, its
    /// deferral): the step and its error, if it failed.
    async fn rewrite_into_follow_up(
        &self,
        outcome: &Outcome,
        watchdog: &Watchdog,
    ) -> Option<(&'static str, StoreError)> {
        let (step, next, after) = match outcome {
            Outcome::Paused { next, after, .. } => ("hand the paused trigger back", next, *after),
            Outcome::Waiting { next, after } => ("persist the waiter", next, *after),
            Outcome::Deferred { next, after, .. } => ("persist the deferral", next, *after),
            _ => unreachable!("only a follow-up is rewritten into"),
        };
        self.rearm_or_put(watchdog, next, after)
            .await
            .err()
            .map(|e| (step, e))
    }

    /// Gives the delivery up (its poison entry, then a sweep), then deletes its watchdog if that
    /// succeeded.
    async fn give_up_watched(
        &self,
        outcome: Outcome,
        delivery: &Delivery,
        attempts: u32,
        watchdog: &Watchdog,
        poison: &dyn TriggerQueue,
    ) -> Outcome {
        let Outcome::Failed { error, .. } = outcome else {
            unreachable!("only a failure is given up")
        };
        let error = if error.gives_up() {
            error
        } else {
            Error::GaveUp {
                deliveries: attempts,
                max: self.options.max_attempts,
                last: Some(Box::new(error)),
            }
        };
        let outcome = self.poison_delivery(poison, delivery, error).await;
        if outcome.acknowledge() {
            watchdog.disarm().await;
        }
        outcome
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
