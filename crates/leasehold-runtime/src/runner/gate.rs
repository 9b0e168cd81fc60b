//! The budget's gate as the runner meets it: before the lock (`RecordRunner::paused`) and as a
//! holder just before its run (`RecordRunner::slot`); the decisions are the core's
//! ([`crate::protocol::budget`]).

use super::*;

impl RecordRunner {
    /// The outcome of a delivery its downstream budget's pause turns away before it does
    /// anything ([`Budgets::paused`]): [`Outcome::Paused`] with the message as it is, for a
    /// standalone caller to hide again in place (see [`handle_watched`](Self::handle_watched)
    /// for Functions). `None`: go on.
    ///
    /// Only a pause that outlasts what a holder may wait under its lease (`longest_wait`: 30 s
    /// standalone, [`MAX_PAUSE_WAIT_WATCHED`] under Functions) turns a delivery away; a shorter
    /// one is waited out under the lease. And only a trigger
    /// that would run is turned away: not one that may stand in for a dead holder, whose record
    /// must run again within the recovery bound ([`Delivery::may_stand_in`]: a carrier other
    /// than a deferral as its holder wrote it, or a redelivery, which hidden again in place
    /// would no longer look like one), a debounce waiter or stand-in (its wait has its own
    /// clock, and the lease is where it meets the pause), nor a trigger that is about to wait
    /// for its burst to end (it will not run now anyway). The holder of the lease meets the
    /// pause again before its run ([`slot`](Self::slot)). A shorter pause turns a delivery away
    /// too when the consumer has no room left for deliveries that wait at a gate (`slot`): it
    /// would wait holding a slot of the consumer, which a dead holder's message may need.
    pub(super) fn paused(
        &self,
        delivery: &Delivery,
        slot: Option<&ConsumerSlot>,
        longest_wait: Duration,
    ) -> Option<Outcome> {
        let budgets = self.budgets.as_ref()?;
        let message = &delivery.message;
        if delivery.may_stand_in() || message.wait.is_some() {
            return None;
        }
        if message.kind == TriggerKind::Trigger && self.options.debounce.get(&message.scope).is_some() {
            return None;
        }
        let room_full = slot.is_some_and(ConsumerSlot::room_full);
        let Some((budget, after)) = budgets.paused(&message.scope) else {
            // Not paused, but at its limit with nowhere to wait: back at its turn, before it
            // takes the record's lease (and a fencing token) only to wait in the consumer's slot.
            // Only for a consumer's delivery (`slot`): it can be handed back in place; used
            // directly, or under Functions (whose wait for a slot is bounded), a holder waits.
            slot?;
            let (at_limit, enough_waiting) = budgets.limit_holds(&message.scope, self.lane);
            if !crate::protocol::budget::handed_back_for_the_limit(
                at_limit,
                room_full,
                enough_waiting,
                self.fault(),
            ) {
                return None;
            }
            let (budget, after) = budgets.limit_turn(&message.scope, self.lane);
            return Some(Outcome::Paused {
                budget,
                after: hand_back_hidden(message, after),
                by: HeldBy::Limit,
                next: Box::new(message.clone()),
            });
        };
        // A pause that ends within what a holder may wait is waited out under the lease (where
        // triggers for the record coalesce onto it), not handed back: handing back costs the
        // message a round trip and, with a backlog, a pass over all of it per pause.
        if !crate::protocol::budget::handed_back_before_the_lock(
            after > longest_wait,
            room_full,
            self.fault(),
        ) {
            return None;
        }
        Some(Outcome::Paused {
            budget,
            after: hand_back_hidden(message, after),
            by: HeldBy::Pause,
            next: Box::new(message.clone()),
        })
    }

    /// A holder's slot of its downstream budget, taken just before its run ([`Budgets::admit`]):
    /// it waits for one while its lease is renewed, a delivery of the high lane before any of the
    /// low lane but for the low lane's share (under Functions at most [`MAX_SLOT_WAIT_WATCHED`]:
    /// the host's invocation must not be held for minutes). A pause is waited out only if it
    /// ends within 30 s ([`MAX_PAUSE_WAIT_WATCHED`] under Functions), whether or not the
    /// delivery saw it at the first gate. Standalone, a holder about to wait gives its slot of
    /// the consumer back for a seat of the consumer's waiting room (`consumer_slot`,
    /// [`ConsumerSlot`]); with no seat free, a pause hands it back, and a wait for the limit
    /// goes on in its slot for at most [`MAX_LIMIT_WAIT_IN_SLOT`]. `Err((budget, after))`: the
    /// budget is paused past that wait (or, under Functions, no slot came in time): the trigger
    /// is handed back, hidden for `after`, without running. A delivery that may stand in for a dead holder
    /// ([`Delivery::may_stand_in`]) is neither put off by a pause nor held by the limit; its run
    /// counts all the same. `Ok(None)`: no budgets.
    pub(super) async fn slot(
        &self,
        delivery: &Delivery,
        cancel: &CancellationToken,
        watched: bool,
        consumer_slot: Option<&ConsumerSlot>,
    ) -> Result<Option<Slot>, (String, Duration, HeldBy)> {
        let Some(budgets) = &self.budgets else {
            return Ok(None);
        };
        let message = &delivery.message;
        let park = consumer_slot
            .filter(|_| crate::protocol::budget::offers_seat(self.fault()))
            .map(|s| move || s.park());
        let waiting = Waiting {
            stand_in: delivery.may_stand_in(),
            // Under Functions the host's invocation must not be held for minutes.
            slot: watched.then_some(MAX_SLOT_WAIT_WATCHED),
            // In both modes a pause is waited out under the lease only if it ends soon: a
            // holder's wait holds its lease and its message, and standalone, while it waits,
            // its slot of the consumer goes to other work if the consumer has room. Under
            // Functions it holds one of the host's invocations, which a dead holder's watchdog
            // may need: only a pause of a few seconds is waited out there.
            pause: Some(if watched {
                MAX_PAUSE_WAIT_WATCHED
            } else {
                MAX_SLOT_WAIT_WATCHED
            }),
            park: park.as_ref().map(|p| p as &(dyn Fn() -> bool + Send + Sync)),
            // With no seat free, a wait for the limit goes on in the consumer's slot, which a
            // dead holder's message may need while the budget's runs are long: for a while only.
            in_slot: Some(MAX_LIMIT_WAIT_IN_SLOT),
        };
        let admitted = tokio::select! {
            // Biased, so the same instants give the same choice (the simulation replays).
            biased;
            admitted = budgets.admit_with(&message.scope, self.lane, waiting) => admitted,
            // Stopped while waiting: the caller's cancellation ends the run (`Cancelled`).
            _ = cancel.cancelled() => return Ok(None),
        };
        // Back to a slot of the consumer for the run, if one is free (else the seat it waited
        // in stands for one: never waiting for a slot while holding the budget's).
        if let Some(s) = consumer_slot {
            s.unpark();
        }
        match admitted {
            Admission::Go(permit) => Ok(Some(Slot {
                waited: permit.waited(),
                permit,
            })),
            Admission::Paused { budget, after, by } => Err((budget, hand_back_hidden(message, after), by)),
        }
    }
}

/// How long a trigger handed back at its budget's gate with `left` to wait stays hidden: past
/// what it waits for, in whole seconds ([`budget::hidden_for`]).
fn hand_back_hidden(_message: &TriggerMessage, left: Duration) -> Duration {
    crate::protocol::budget::hidden_for(left)
}

/// How a run's logic ended, for its downstream budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LogicEnd {
    Succeeded,
    /// The downstream said "too many"; the pause its budget takes (`None`: no budgets).
    Throttled(Option<Duration>),
    Other,
}

/// A holder's slot of its budget (`RecordRunner::slot`).
pub(super) struct Slot {
    pub(super) permit: BudgetPermit,
    /// Whether the holder had to wait for it (time passed under its lease).
    pub(super) waited: bool,
}

/// Tells a run's budget slot how its run went (a throttle pauses the budget).
pub(super) async fn tell_budget(permit: &mut BudgetPermit, record: &str, end: LogicEnd, again: bool) {
    match end {
        LogicEnd::Succeeded => permit.succeeded(),
        LogicEnd::Throttled(Some(pause)) => permit.throttled(record, pause, again).await,
        _ => {}
    }
}

/// The longest a delivery under Functions waits for a slot of its budget before it is put back
/// to come again a second later: the host's invocation must not be held for minutes. A pause
/// longer than this hands a trigger back before the lock, in both modes.
pub(super) const MAX_SLOT_WAIT_WATCHED: Duration = Duration::from_secs(30);

/// The longest a standalone holder waits for its budget's limit in its slot of the consumer
/// (the waiting room full) before its trigger is handed back, to come again a second later: the
/// slot may be the one a dead holder's message needs, and the budget's runs may be long. At
/// most this is added to the recovery bound while holders wait for the limit in a full room.
pub(super) const MAX_LIMIT_WAIT_IN_SLOT: Duration = Duration::from_secs(5);

/// The longest pause a delivery under Functions waits out under its lease (a longer one hands
/// it back): the wait holds one of the host's invocations, and while the host's invocations are
/// all held it takes no message, a dead holder's watchdog included. At most this is added to
/// the recovery bound during a pause.
pub(super) const MAX_PAUSE_WAIT_WATCHED: Duration = Duration::from_secs(5);
