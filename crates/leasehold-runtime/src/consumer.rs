//! The standalone queue consumer (`leasehold serve`): polls the trigger queue, runs deliveries
//! through the [`RecordRunner`] with a concurrency limit, keeps each message invisible while its
//! run lasts, acknowledges what the runner says to, and moves messages that keep failing to the
//! poison queue with their reason.
//!
//! Visibility is the consumer's half of the dead-holder mechanism: a message stays hidden only
//! while its worker lives and renews it, so a dead worker's message comes back within one
//! visibility period. A run whose message could not be kept hidden goes on: the lease keeps it
//! exclusive, and the message's next delivery finds the lease held and looks again later.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::error::Error;
use crate::message::TriggerMessage;
use crate::observe::record_outcome;
use crate::outcome::Outcome;
use crate::poison::PoisonMessage;
use crate::protocol::carriers;
use crate::queue::{Received, TriggerQueue};
use crate::runner::{Delivery, Ended, HiddenUntil, RecordRunner};
use crate::slot::ConsumerSlot;
use crate::watchdog::{PushRequests, push_before_renewal};

/// The poison queue of a trigger queue, as the Functions host names it.
pub fn poison_queue_name(queue: &str) -> String {
    format!("{queue}-poison")
}

/// The low lane's queue of a trigger queue (its poison queue is [`poison_queue_name`] of it).
pub fn low_queue_name(queue: &str) -> String {
    format!("{queue}-low")
}

/// While every downstream budget is paused, the consumer takes at most one batch this often.
const PAUSED_POLL: Duration = Duration::from_secs(5);

/// How the consumer behaves.
#[derive(Debug, Clone)]
pub struct ConsumerOptions {
    /// Runs in progress at once. Default 8.
    pub concurrency: usize,
    /// Messages taken per request (at most 32). Default 16.
    pub batch_size: u32,
    /// How long a taken message stays hidden after each push; pushed every
    /// `visibility_renew_every`, and just before each renewal of the lease its run holds. A dead
    /// worker's message reappears within this. Default 35 s = the default lease duration (30 s)
    /// plus [`crate::CARRIER_MARGIN`] (5 s): then a dead worker's message reappears only once its
    /// lease has expired, so it runs at once instead of waiting for a recheck, and recovery takes
    /// at most this long. Keep it at least lease duration + [`crate::CARRIER_MARGIN`], and
    /// longer than the lease's renewal interval and a half.
    pub visibility: Duration,
    /// How often visibility is renewed. Default 10 s.
    pub visibility_renew_every: Duration,
    /// A delivery beyond this count goes to the poison queue. Default 5 (as the Functions host).
    pub max_dequeue_count: u32,
    /// Delay before a failed trigger is tried again. Default 5 s.
    pub retry_delay: Duration,
    /// Shortest and longest pause between polls of an empty queue (the pause doubles while
    /// the queue stays empty). Defaults 100 ms and 2 s.
    pub poll_min: Duration,
    pub poll_max: Duration,
    /// On shutdown, how long in-flight runs may take to finish before they are cancelled and
    /// handed back. Default 30 s.
    pub shutdown_grace: Duration,
    /// With a low lane ([`Consumer::with_low_lane`]): at least one start in this many comes from
    /// the low lane while it has messages, however busy the high lane is. Default 4.
    pub low_every: u32,
}

impl Default for ConsumerOptions {
    fn default() -> Self {
        Self {
            concurrency: 8,
            batch_size: 16,
            visibility: Duration::from_secs(35),
            visibility_renew_every: Duration::from_secs(10),
            max_dequeue_count: 5,
            retry_delay: Duration::from_secs(5),
            poll_min: Duration::from_millis(100),
            poll_max: Duration::from_secs(2),
            shutdown_grace: Duration::from_secs(30),
            low_every: 4,
        }
    }
}

/// Polls a queue and runs its triggers.
#[derive(Debug, Clone)]
pub struct Consumer {
    runner: RecordRunner,
    poison: Arc<dyn TriggerQueue>,
    options: ConsumerOptions,
    wake: Arc<Notify>,
    /// The low lane's own consumer (its runner, whose queue is the low lane's, and its poison
    /// queue), polled after this one's queue ([`ConsumerOptions::low_every`]).
    low: Option<Arc<Consumer>>,
}

impl Consumer {
    /// A consumer of `runner`'s queue. The runner's retriggers wake it, as Start's
    /// [`waker`](Self::waker) does.
    pub fn new(runner: RecordRunner, poison: Arc<dyn TriggerQueue>, options: ConsumerOptions) -> Self {
        let wake = Arc::new(Notify::new());
        Self {
            runner: runner.waking(wake.clone()),
            poison,
            options,
            wake,
            low: None,
        }
    }

    /// This consumer, also taking from a low lane: `runner`'s queue, whose triggers give up to
    /// `poison`. The high lane (this consumer's own queue) is polled first; at least one start
    /// in [`ConsumerOptions::low_every`] comes from the low lane while it has messages. Both
    /// lanes share the concurrency.
    pub fn with_low_lane(mut self, runner: RecordRunner, poison: Arc<dyn TriggerQueue>) -> Self {
        let mut low = Consumer::new(runner, poison, self.options.clone());
        // One loop polls both lanes: the low lane's retriggers wake it too.
        low.runner = low.runner.waking(self.wake.clone());
        low.wake = self.wake.clone();
        self.low = Some(Arc::new(low));
        self
    }

    /// Completes when a budget's pause ended early (never without budgets).
    async fn pause_ended_early(&self) {
        match self.runner.budgets() {
            Some(budgets) => budgets.pause_ended_early().await,
            None => std::future::pending().await,
        }
    }

    /// A handle that makes the consumer poll at once (Start in the same process calls it after
    /// enqueueing).
    pub fn waker(&self) -> Arc<Notify> {
        self.wake.clone()
    }

    fn queue(&self) -> &Arc<dyn TriggerQueue> {
        self.runner.queue()
    }

    /// Runs until `shutdown` fires; then stops taking work, lets in-flight runs finish within the
    /// grace period, cancels the rest (their leases are released and their messages handed back).
    pub async fn run(&self, shutdown: CancellationToken) {
        let tracker = TaskTracker::new();
        let runs_cancel = CancellationToken::new();
        let slots = Arc::new(tokio::sync::Semaphore::new(self.options.concurrency));
        // Where deliveries wait at a budget's gate without a slot: as many as there are slots.
        let seats = Arc::new(tokio::sync::Semaphore::new(self.options.concurrency));
        let mut idle_pause = self.options.poll_min;
        // High-lane starts since the last low-lane one.
        let mut since_low = 0u32;
        // While every budget is paused: when the next poll may be.
        let mut paused_poll_at: Option<Instant> = None;
        // While every budget is at its limit and the waiting room full: when the next poll may be.
        let mut full_poll_at: Option<Instant> = None;
        loop {
            // Wait for a free slot before taking messages, so none sit hidden without a worker.
            let free = tokio::select! {
               biased;
                _ = shutdown.cancelled() => break,
                permit = slots.clone().acquire_many_owned(1) => {
                    drop(permit);
                    slots.available_permits()
                }
            };
            // Every budget paused: once the queue has no full batch to give, take one batch per
            // PAUSED_POLL at most until the pause ends. A message taken now would only wait, or
            // be handed back; but a dead holder's message, which runs through a pause, must
            // still be taken within the recovery bound, so a backlog in front of it is passed
            // over at once (each of its messages handed back until the pause ends: one update
            // per message per pause), not a batch per PAUSED_POLL.
            let paused = self.runner.budgets().and_then(|b| b.all_paused());
            let now = Instant::now();
            // Every budget at its limit and no seat left to wait in: a message taken now would
            // only be handed back (for its turn). Take one batch per PAUSED_POLL at most — a dead
            // holder's message, which runs beyond the limit, must still be taken within the
            // recovery bound — or as soon as a run gives its slot back.
            let room_full = seats.available_permits() == 0;
            let full = paused.is_none() && self.runner.budgets().is_some_and(|b| b.all_at_limit(!room_full));
            match (full, full_poll_at) {
                (true, Some(at)) if at > now => {
                    let budgets = self.runner.budgets().expect("full only with budgets");
                    tokio::select! {
                       biased;
                        _ = shutdown.cancelled() => break,
                        _ = tokio::time::sleep_until(at) => {}
                        _ = budgets.slot_freed() => {}
                        // A trigger just put (a person's save in this process): a seat may
                        // take it.
                        _ = self.wake.notified() => full_poll_at = None,
                    }
                    continue;
                }
                (true, _) => full_poll_at = Some(now + PAUSED_POLL),
                (false, _) => full_poll_at = None,
            }
            if let (Some(left), Some(at)) = (paused, paused_poll_at)
                && at > now
            {
                tokio::select! {
                   biased;
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep_until(at.min(now + left)) => {}
                    // Resumed: the triggers handed back for the pause are visible again.
                    _ = self.pause_ended_early() => paused_poll_at = None,
                }
                continue;
            }
            paused_poll_at = paused.map(|_| now + PAUSED_POLL);
            let want = (free as u32).clamp(1, self.options.batch_size.min(32));
            // The messages are hidden for `visibility` from when the service took them, which
            // is after this.
            let asked = Instant::now();
            // The high lane first, unless the low lane is due a start: then one from it first.
            let low_due = self.low.is_some() && since_low + 1 >= self.options.low_every.max(1);
            let mut lanes: Vec<(&Consumer, u32)> = vec![(self, want)];
            if let Some(low) = &self.low {
                if low_due {
                    lanes.insert(0, (low, 1));
                } else {
                    lanes.push((low, want));
                }
            }
            // Each lane is asked for what is still wanted, in turn. Normally the first that gives
            // anything is the round's. While every budget is paused, the next lane is asked too
            // and the pace is set only once every lane was asked and came back short: a backlog
            // in either lane is passed over at once.
            let mut taken: Vec<(&Consumer, Received)> = Vec::new();
            let mut more_behind = false;
            let mut left = want;
            for (lane, n) in lanes {
                let n = n.min(left);
                if n == 0 {
                    // Not asked: it may hold a backlog.
                    more_behind = true;
                    break;
                }
                match lane.queue().get(n, self.options.visibility).await {
                    Ok(messages) if !messages.is_empty() => {
                        more_behind |= messages.len() as u32 >= n;
                        left = left.saturating_sub(messages.len() as u32);
                        if std::ptr::eq(lane, self) {
                            since_low = since_low.saturating_add(messages.len() as u32);
                        } else {
                            since_low = 0;
                        }
                        taken.extend(messages.into_iter().map(|m| (lane, m)));
                        if paused.is_none() {
                            break;
                        }
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(queue = lane.queue().name(), error = %e, "polling the queue failed; backing off");
                    }
                }
            }
            if more_behind {
                // More may be visible behind it: no pace until the lanes come back short.
                paused_poll_at = None;
            }
            if more_behind {
                // Every budget at its limit: what is visible now (a dead holder's message among
                // it, or triggers whose turn came) is taken at once too; each trigger taken only
                // to be handed back is hidden until its turn, so the pass ends.
                full_poll_at = None;
            }
            if taken.is_empty() {
                tokio::select! {
                   biased;
                    _ = shutdown.cancelled() => break,
                    _ = self.wake.notified() => idle_pause = self.options.poll_min,
                    _ = tokio::time::sleep(idle_pause) => idle_pause = (idle_pause * 2).min(self.options.poll_max),
                    _ = self.pause_ended_early() => idle_pause = self.options.poll_min,
                }
                continue;
            }
            idle_pause = self.options.poll_min;
            for (from, received) in taken {
                let permit = slots
                    .clone()
                    .acquire_owned()
                    .await
                    .expect("semaphore never closed");
                let slot = Arc::new(ConsumerSlot::new(slots.clone(), seats.clone(), permit));
                let this = from.clone();
                let cancel = runs_cancel.child_token();
                tracker.spawn(async move {
                    this.process_taken(received, asked, cancel, Some(slot)).await;
                });
            }
        }
        tracker.close();
        tracing::info!(in_flight = tracker.len(), grace = ?self.options.shutdown_grace, "consumer stopping");
        if tokio::time::timeout(self.options.shutdown_grace, tracker.wait())
            .await
            .is_err()
        {
            tracing::warn!("grace period over: cancelling in-flight runs and handing their messages back");
            runs_cancel.cancel();
            tracker.wait().await;
        }
        tracing::info!("consumer stopped");
    }

    /// Handles one taken message from start to acknowledgement (or not), in a span naming the
    /// message (its delivery's span, with the record, nests inside).
    /// Call it as soon as the message was taken, hidden for the options' `visibility`.
    pub async fn process(&self, received: Received, cancel: CancellationToken) {
        self.process_taken(received, Instant::now(), cancel, None).await
    }

    /// [`process`](Self::process) of a message taken by a request sent at `asked`, holding
    /// `slot` of the consumer (given back while it waits at its budget's gate).
    async fn process_taken(
        &self,
        received: Received,
        asked: Instant,
        cancel: CancellationToken,
        slot: Option<Arc<ConsumerSlot>>,
    ) {
        let span = tracing::info_span!("message", id = %received.id, dequeue_count = received.dequeue_count);
        self.process_message(received, asked, cancel, slot)
            .instrument(span)
            .await
    }

    async fn process_message(
        &self,
        received: Received,
        asked: Instant,
        cancel: CancellationToken,
        slot: Option<Arc<ConsumerSlot>>,
    ) {
        let message = match TriggerMessage::decode(&received.body) {
            Ok(m) => m,
            Err(e) => {
                // No record to tell of: only counted.
                let outcome = self
                    .poison(&received, &received.pop_receipt, None, Error::Unreadable(e))
                    .await;
                record_outcome(&outcome);
                return;
            }
        };
        let delivery = Delivery {
            message,
            dequeue_count: received.dequeue_count,
        };
        if delivery.attempts() > self.options.max_dequeue_count {
            let error = Error::GaveUp {
                deliveries: delivery.attempts() - 1,
                max: self.options.max_dequeue_count,
                last: None,
            };
            let outcome = self
                .poison(
                    &received,
                    &received.pop_receipt,
                    Some(delivery.message.clone()),
                    error,
                )
                .await;
            delivery
                .span()
                .in_scope(|| self.runner.finished(&delivery, &outcome, &Default::default()));
            return;
        }

        // Visibility is renewed by a task of its own, so a slow renewal never stalls the run;
        // it stops when this delivery ends, however it ends.
        let receipt = Arc::new(std::sync::Mutex::new(received.pop_receipt.clone()));
        // While the delivery holds its record's lease, the renewer pushes just before each
        // renewal of it, when asked through `pushes`.
        let (push, pushes) = push_before_renewal();
        // Hidden for `visibility` from when the service took it, after our get was sent.
        let mut hidden = HiddenUntil::new(asked + self.options.visibility).with_push(push);
        if let Some(slot) = slot {
            hidden = hidden.with_slot(slot);
        }
        let stop_renewing = CancellationToken::new();
        let mut renewer = AbortOnDrop(tokio::spawn(
            keep_hidden(
                self.queue().clone(),
                received.clone(),
                receipt.clone(),
                hidden.clone(),
                self.options.clone(),
                pushes,
                stop_renewing.clone(),
            )
            .instrument(tracing::Span::current()),
        ));
        let span = delivery.span();
        let (outcome, ended) = self
            .runner
            .handle_untold(&delivery, &cancel, Some(&hidden))
            .instrument(span.clone())
            .await;
        // Stop renewing, but let an update in flight finish: cut off, it could land and change
        // the receipt without our knowing, and the delete below would then miss.
        stop_renewing.cancel();
        let _ = (&mut renewer.0).await;
        let receipt = receipt.lock().expect("receipt mutex").clone();

        let outcome = self
            .end_delivery(outcome, &received, &receipt, &delivery, &ended, &cancel)
            .instrument(span.clone())
            .await;
        span.in_scope(|| self.runner.finished(&delivery, &outcome, &ended));
    }

    /// What the consumer does with the delivered message once its delivery came to `outcome`,
    /// as the core decides ([`carriers::standalone`]): delete it, write the follow-up over it,
    /// leave it for the retry, or give it up.
    async fn end_delivery(
        &self,
        outcome: Outcome,
        received: &Received,
        receipt: &str,
        delivery: &Delivery,
        ended: &Ended,
        cancel: &CancellationToken,
    ) -> Outcome {
        match carriers::standalone(outcome.ended()) {
            carriers::Message::PersistInPlace => self.persist_follow_up(outcome, received, receipt).await,
            // Given up at once (its deferral budget is spent), whatever its attempts.
            carriers::Message::GiveUp => {
                let Outcome::Failed { error, .. } = outcome else {
                    unreachable!("only a failure is given up")
                };
                let trigger = ended.carried.clone().unwrap_or_else(|| delivery.message.clone());
                self.poison(received, receipt, Some(trigger), error).await
            }
            carriers::Message::Delete => {
                if let Err(e) = self.queue().delete(&received.id, receipt).await {
                    // The trigger was honoured; a redelivery will find nothing to do but run once more.
                    tracing::warn!(error = %e, "acknowledging the message failed; it may be delivered again");
                }
                outcome
            }
            carriers::Message::Retry => {
                // Hand the message back for a retry after a pause (or soon if we were cancelled
                // by shutdown, so another worker can take it: not before a request of ours that
                // timed out may still land, which the retry must come after).
                let delay = if cancel.is_cancelled() {
                    self.runner.lock().options().retry.late_window
                } else {
                    self.options.retry_delay
                };
                // In a superseding scope the retry names the run it retries, which noted itself
                // as pending: a later run that covers it makes the retry stand down. After a
                // debounce step that owes a run, the retry is the message it carried on as.
                let mut retry = ended.carried.clone().unwrap_or_else(|| delivery.message.clone());
                retry.after_token = ended.after_token;
                let body = if retry == delivery.message {
                    received.body.clone()
                } else {
                    retry.encode()
                };
                if let Err(e) = self
                    .queue()
                    .set_visibility(&received.id, receipt, &body, delay)
                    .await
                {
                    tracing::debug!(error = %e, "could not shorten visibility; the message reappears when it lapses");
                }
                outcome
            }
        }
    }

    /// Writes a delivery's follow-up over its message ([`Self::persist_in_place`]): its
    /// deferral, its hand-back by a paused budget, or its waiter.
    async fn persist_follow_up(&self, outcome: Outcome, received: &Received, receipt: &str) -> Outcome {
        match outcome {
            Outcome::Deferred { after, ref next, .. } => {
                // A failed update was logged; the message comes back when its visibility lapses.
                let _ = self
                    .persist_in_place(received, receipt, next, after, "persist the deferral")
                    .await;
                outcome
            }
            // Turned away by a paused budget before anything was done: the message itself,
            // hidden until the pause ends, not counted as an attempt. If the update fails, it
            // comes back when its visibility lapses (and meets the pause again).
            Outcome::Paused {
                after,
                ref next,
                ref budget,
                by,
            } => {
                let hidden = self
                    .persist_in_place(received, receipt, next, after, "hand the paused trigger back")
                    .await;
                // A resume (or a shorter pause) this worker learns of makes it visible again at
                // once, not at the pause's original end.
                if let (Ok(Some(receipt)), Some(budgets), crate::HeldBy::Pause) =
                    (hidden, self.runner.budgets(), by)
                {
                    budgets.handed_back(budget, self.queue().clone(), &received.id, receipt, after);
                }
                outcome
            }
            // The waiter is the delivered message, hidden for another period: one request,
            // which is also the acknowledgement. If the message is gone (another delivery took
            // it, or our own update landed and its answer was lost), the waiter is put afresh:
            // at worst there are two waiters, and the second stands down. (That other delivery
            // stood in for this one only after our create landed: requests that create a wait
            // marker are sent only while the message stays hidden until they land.) If the
            // update failed otherwise, the message comes back as a redelivery, which stands in.
            Outcome::Waiting { after, ref next } => {
                let gone = self
                    .persist_in_place(received, receipt, next, after, "persist the waiter")
                    .await
                    .err()
                    == Some(leasehold_lock::StoreErrorKind::NotFound);
                if gone {
                    let put = self.runner.enqueue(next, after).await;
                    if let Err(e) = put {
                        tracing::warn!(error = %e,
                            "could not put the waiter afresh; the message, if it comes back, stands in");
                    }
                }
                outcome
            }
            _ => unreachable!("only a follow-up is written over its message"),
        }
    }

    /// Turns the delivered message into `next` (its deferral, or its next wait), hidden for
    /// `after`, in one Update Message: the follow-up and the acknowledgement land together or
    /// not at all, so a crash never leaves both the old message and the new one (an extra run),
    /// nor neither (a lost trigger). `next` keeps the message's dequeue count as its re-hides, so
    /// the re-hide does not count as an attempt (nor makes its next delivery a redelivery).
    ///
    /// If the update fails, the message reappears when its visibility lapses and runs early
    /// (its logic may ask again); nothing is lost. A retried update answered "not found" may
    /// mean an earlier attempt landed (its answer lost): the receipt it made is the one we lack;
    /// or that another delivery took the message. Says how the update failed, or the receipt
    /// it landed with (`None` only under a test variant that does not update).
    async fn persist_in_place(
        &self,
        received: &Received,
        receipt: &str,
        next: &TriggerMessage,
        after: Duration,
        what: &'static str,
    ) -> Result<Option<String>, leasehold_lock::StoreErrorKind> {
        let mut next = next.clone();
        #[cfg(feature = "testing")]
        if self.runner.options().variant == crate::ProtocolVariant::DeferralDeletesThenPuts {
            // WRONG on purpose: between the delete and the put neither message exists.
            if let Err(e) = self.queue().delete(&received.id, receipt).await {
                tracing::warn!(error = %e, "could not delete the deferred message");
                return Ok(None);
            }
            if let Err(e) = self.queue().put(&next.encode(), after).await {
                tracing::warn!(error = %e, "could not put the deferral");
            }
            return Ok(None);
        }
        next.rehides = received.dequeue_count;
        let body = next.encode();
        let result = self
            .runner
            .lock()
            .options()
            .retry
            .run(what, || {
                self.queue().set_visibility(&received.id, receipt, &body, after)
            })
            .await;
        match result {
            // The receipt of the update: the message's, until it is taken again.
            Ok(receipt) => Ok(Some(receipt)),
            Err(e) => {
                // "Not found" after a retry may mean our first attempt landed (its answer lost)
                // as well as that another delivery took the message.
                tracing::warn!(step = what, error = %e,
                    "could not update the message; if it is still there, it reappears when its visibility lapses");
                Err(e.kind())
            }
        }
    }

    /// Gives the trigger up (poison entry with its reason, and a sweep) and deletes its message:
    /// [`Outcome::Poisoned`], or [`Outcome::Failed`] if it could not be given up (the message
    /// stays for a retry).
    async fn poison(
        &self,
        received: &Received,
        receipt: &str,
        trigger: Option<TriggerMessage>,
        error: Error,
    ) -> Outcome {
        let entry = PoisonMessage::new(received.body.clone(), trigger, &error, received.dequeue_count);
        match self.runner.give_up(&*self.poison, &entry).await {
            Ok(()) => {
                if let Err(e) = self.queue().delete(&received.id, receipt).await {
                    tracing::warn!(error = %e, "deleting the poisoned message failed; it may be poisoned twice");
                }
                Outcome::Poisoned { error }
            }
            Err(e) => {
                tracing::error!(error = %e, "could not give the trigger up (sweep or poison queue); the message stays for a retry");
                Outcome::Failed {
                    error: Error::storage("give the trigger up", e),
                    retriggered: false,
                }
            }
        }
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Renews a message's visibility while its run lasts, until `stop` fires (checked only between
/// updates, so the receipt always reflects the last update that landed): every
/// `visibility_renew_every`, and, while the delivery holds its record's lease, just before each
/// renewal of the lease (asked through `pushes`). Each push hides the message for `visibility`
/// (lease duration + [`CARRIER_MARGIN`]), so a dead holder's message surfaces a margin after its
/// lease expired, whenever it died: pushed before the renewal, the message is never behind the
/// lease by more than that push's flight. While the lease asks for pushes, the timer only
/// stands in for renewals that stall (half an interval late). When the message cannot be kept
/// hidden (its receipt went stale, say because an update's answer was lost), the run goes on:
/// its lease keeps it exclusive, and the message's next delivery finds the lease held and looks
/// again once it must have expired.
async fn keep_hidden(
    queue: Arc<dyn TriggerQueue>,
    received: Received,
    receipt: Arc<std::sync::Mutex<String>>,
    hidden: HiddenUntil,
    options: ConsumerOptions,
    mut pushes: PushRequests,
    stop: CancellationToken,
) {
    let mut hidden_until = Instant::now() + options.visibility;
    let mut next = Instant::now() + options.visibility_renew_every;
    let mut following = false;
    loop {
        // Answered (dropped) once this push is done, however it ends. (`hidden` holds the
        // requests' sender, so they never end while this runs.)
        let _asked = tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            Some(done) = pushes.recv() => {
                following = true;
                Some(done)
            }
            _ = sleep_until(next) => None,
        };
        let sent = Instant::now();
        let current = receipt.lock().expect("receipt mutex").clone();
        match queue
            .set_visibility(&received.id, &current, &received.body, options.visibility)
            .await
        {
            Ok(fresh) => {
                *receipt.lock().expect("receipt mutex") = fresh;
                hidden_until = sent + options.visibility;
                hidden.set(hidden_until);
                next = sent + options.visibility_renew_every;
                if following {
                    next += options.visibility_renew_every / 2;
                }
            }
            Err(e) if e.is_transient() && Instant::now() + Duration::from_secs(2) < hidden_until => {
                tracing::warn!(error = %e, "renewing message visibility failed; trying again");
                next = Instant::now() + Duration::from_secs(1);
            }
            Err(e) => {
                tracing::warn!(error = %e,
                    "message visibility can no longer be renewed: it will be delivered again, and that delivery looks again once this run's lease has expired");
                return;
            }
        }
    }
}
