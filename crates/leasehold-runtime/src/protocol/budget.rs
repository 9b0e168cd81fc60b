//! The budget's gate: where a delivery meets its downstream budget's pause and limit
//! (docs/design.md "Downstream budgets and priority lanes").
//!
//! A delivery that may stand in for a dead holder is never held: its record must run again within
//! the recovery bound. Anything else meets a pause twice: before the lock (a pause longer than a
//! holder may wait hands it back at once, and so does a shorter one when the consumer has no seat
//! left for it to wait in), and as a holder just before its run. A holder that must wait gives its
//! slot of the consumer back for a seat of the consumer's waiting room, so that waiting holders
//! never keep the consumer from taking other work — a dead holder's message above all; with no
//! seat free, a pause hands it back.

use super::Fault;
use crate::message::TriggerKind;

/// A budget's slots on one worker, as its gate sees them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Slots {
    /// Runs of the budget under way here.
    pub in_flight: usize,
    /// Runs at once allowed here now (the adaptive limit, or the configured one).
    pub limit: usize,
    /// Deliveries of each lane waiting for a slot.
    pub high_waiting: usize,
    pub low_waiting: usize,
    /// High-lane starts since the last low-lane start, counted while the low lane waits.
    pub high_run: u32,
    /// While both lanes wait, every `low_every`-th start is the low lane's (0: never).
    pub low_every: u32,
}

/// Who asks at the gate; `T` is the driver's instant (the core has no clock).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Asker<T> {
    /// It may stand in for a dead holder: never held, by the pause or the limit (it still counts).
    pub stand_in: bool,
    /// It came by the low lane (bulk traffic).
    pub low: bool,
    /// The latest a pause may end for it to wait the pause out; a longer pause hands it back.
    pub pause_deadline: Option<T>,
}

/// The gate's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Gate<T> {
    /// Take a slot ([`start`]).
    Go,
    /// Handed back: the pause ends at `T`, later than the asker may wait.
    HandBack(T),
    /// Wait until the pause ends (`Some`), or until a slot frees (`None`).
    Wait(Option<T>),
}

/// The gate: the pause holds all but a stand-in; then a slot is free below the limit, and the
/// high lane goes first, but for every `low_every`-th start while both lanes wait.
pub fn gate<T: Ord + Copy>(slots: &Slots, paused_until: Option<T>, now: T, asker: &Asker<T>) -> Gate<T> {
    if let Some(until) = paused_until.filter(|u| !asker.stand_in && *u > now) {
        // Waited out when it ends within the wait allowed; else handed back.
        if asker.pause_deadline.is_some_and(|d| d < until) {
            return Gate::HandBack(until);
        }
        return Gate::Wait(Some(until));
    }
    let low_due = slots.low_every > 0 && slots.high_run + 1 >= slots.low_every;
    let behind_high = asker.low && slots.high_waiting > 0 && !low_due;
    let yields_to_low = !asker.low && slots.low_waiting > 0 && low_due;
    if asker.stand_in || (slots.in_flight < slots.limit && !behind_high && !yields_to_low) {
        Gate::Go
    } else {
        Gate::Wait(None)
    }
}

/// A start through the gate ([`Gate::Go`]): the slot taken, and the lanes' turn counted. Says
/// whether the deliveries waiting must be woken (a high-lane delivery may have yielded to this
/// one).
pub fn start<T>(slots: &mut Slots, asker: &Asker<T>) -> bool {
    slots.in_flight += 1;
    if asker.stand_in {
        return false;
    }
    if asker.low {
        slots.high_run = 0;
        true
    } else {
        slots.high_run = if slots.low_waiting > 0 {
            slots.high_run.saturating_add(1)
        } else {
            0
        };
        false
    }
}

/// Whether a delivery may stand in for a dead holder: a redelivery (its earlier delivery may have
/// died holding the lease), or a carrier other than a deferral as its live holder wrote it.
pub fn may_stand_in(kind: TriggerKind, redelivered: bool, released_deferral: bool) -> bool {
    redelivered || (kind.is_carrier() && !released_deferral)
}

/// Whether the consumer's slot is offered to the gate (the holder may wait in a seat of the
/// waiting room instead). Not under [`Fault::HolderKeepsItsSlot`]: the code before the waiting
/// room, where a holder waiting out a pause kept its slot.
pub fn offers_seat(fault: Fault) -> bool {
    fault != Fault::HolderKeepsItsSlot
}

/// Whether a delivery that would wait at its budget's pause is handed back before the lock:
/// `longer`, the pause ends later than a holder may wait under its lease; `room_full`, the
/// consumer has no seat left for it to wait in (it would wait in a slot a dead holder's message
/// may need).
pub fn handed_back_before_the_lock(longer: bool, room_full: bool, fault: Fault) -> bool {
    longer || (room_full && offers_seat(fault))
}

/// Whether a delivery its budget's pause does not hold is handed back before the lock for the
/// budget's limit: `at_limit`, it would wait for a slot (every slot of the limit taken, or the
/// other lane first); and either `room_full`, the consumer has no seat left for it to wait in
/// (it would take its record's lease and a fencing token only to wait in a slot of the
/// consumer for a while, then be handed back all the same), or `enough_waiting`, as many
/// holders as the limit has slots already wait for one here (one ready for each slot as it
/// frees: a holder more would only hold its lease and its message, renewing both, for a run's
/// time or more). Not under [`Fault::HolderKeepsItsSlot`] (the code before the waiting room).
pub fn handed_back_for_the_limit(
    at_limit: bool,
    room_full: bool,
    enough_waiting: bool,
    fault: Fault,
) -> bool {
    at_limit && (room_full || enough_waiting) && offers_seat(fault)
}

/// Where a holder that is not admitted waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Waits {
    /// In a seat of the consumer's waiting room: its slot is free for other work.
    InSeat,
    /// In its slot of the consumer (no consumer slot to give back, or a wait for the limit in a
    /// full waiting room: runs of the budget are under way). Standalone, for a few seconds at
    /// most: then the trigger is handed back, so that a dead holder's message finds the slot
    /// while the budget's runs are long.
    InSlot,
    /// Handed back: nowhere to wait out the pause without keeping others from work.
    HandBack,
}

/// Where a holder waits: `paused`, held by the budget's pause (not only by its limit); `seat`,
/// whether it got a seat of the waiting room (`None`: no consumer slot was offered — under
/// Functions, or used directly).
pub fn waits(paused: bool, seat: Option<bool>) -> Waits {
    match seat {
        None => Waits::InSlot,
        Some(true) => Waits::InSeat,
        Some(false) if paused => Waits::HandBack,
        Some(false) => Waits::InSlot,
    }
}

/// How long a trigger handed back at its budget's gate stays hidden, when what it waits for (the
/// pause's end, or a slot of the limit) is `left` away: until then **rounded up** to whole
/// seconds (the queue's unit; rounded down, a pause with under a second left hid the trigger for
/// none, and the consumer took it straight back and handed it back again, as fast as storage
/// answers), and **at least a second**. So a trigger handed back for a pause comes back only
/// after the pause's end: it is handed back at most once per pause.
///
/// (A spread per record on top, so that a backlog handed back for one pause does not come back
/// at one instant, was tried: it let a cohort of handed-back triggers come back just behind a
/// dead holder's message in the simulation, which then ran outside the recovery bound on 4 of
/// 2,000 seeds; left out.)
pub fn hidden_for(left: std::time::Duration) -> std::time::Duration {
    let whole = left.as_secs() + u64::from(left.subsec_nanos() > 0);
    std::time::Duration::from_secs(whole.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asker(low: bool) -> Asker<u32> {
        Asker {
            stand_in: false,
            low,
            pause_deadline: None,
        }
    }

    #[test]
    fn a_pause_holds_all_but_a_stand_in_and_hands_back_who_cannot_wait_it_out() {
        let slots = Slots {
            limit: 1,
            ..Slots::default()
        };
        assert_eq!(gate(&slots, Some(10), 5, &asker(false)), Gate::Wait(Some(10)));
        let short = Asker {
            pause_deadline: Some(8),
            ..asker(false)
        };
        assert_eq!(gate(&slots, Some(10), 5, &short), Gate::HandBack(10));
        let stand_in = Asker {
            stand_in: true,
            ..asker(false)
        };
        let full = Slots {
            in_flight: 1,
            ..slots
        };
        assert_eq!(gate(&full, Some(10), 5, &stand_in), Gate::Go);
        assert_eq!(
            gate(&slots, Some(5), 5, &asker(false)),
            Gate::Go,
            "a pause that has ended"
        );
        let exactly = Asker {
            pause_deadline: Some(10),
            ..asker(false)
        };
        assert_eq!(
            gate(&slots, Some(10), 5, &exactly),
            Gate::Wait(Some(10)),
            "a pause that ends when the asker may wait no longer is waited out"
        );
    }

    #[test]
    fn a_holder_waits_in_a_seat_else_in_its_slot_for_the_limit_and_is_handed_back_by_a_pause() {
        assert_eq!(waits(true, Some(true)), Waits::InSeat);
        assert_eq!(waits(false, Some(true)), Waits::InSeat);
        // Runs of the budget are under way, and one ends soon.
        assert_eq!(waits(false, Some(false)), Waits::InSlot);
        assert_eq!(waits(true, Some(false)), Waits::HandBack);
        assert_eq!(waits(true, None), Waits::InSlot);
    }

    #[test]
    fn the_high_lane_goes_first_but_for_every_low_every_th_start() {
        let mut slots = Slots {
            limit: 1,
            high_waiting: 1,
            low_waiting: 1,
            low_every: 3,
            ..Slots::default()
        };
        assert_eq!(gate(&slots, None, 0, &asker(true)), Gate::Wait(None));
        assert_eq!(gate(&slots, None, 0, &asker(false)), Gate::Go);
        assert!(!start(&mut slots, &asker(false)));
        assert_eq!(slots.high_run, 1);
        slots.in_flight = 0;
        start(&mut slots, &asker(false));
        slots.in_flight = 0;
        // Two high starts while the low lane waited: the third is the low lane's.
        assert_eq!(gate(&slots, None, 0, &asker(false)), Gate::Wait(None));
        assert_eq!(gate(&slots, None, 0, &asker(true)), Gate::Go);
        assert!(start(&mut slots, &asker(true)));
        assert_eq!(slots.high_run, 0);
    }

    #[test]
    fn the_high_lane_goes_first_always_with_low_every_0_and_counts_turns_only_while_the_low_lane_waits() {
        let never = Slots {
            limit: 1,
            high_waiting: 1,
            low_waiting: 1,
            high_run: 5,
            ..Slots::default()
        };
        assert_eq!(gate(&never, None, 0, &asker(true)), Gate::Wait(None));
        assert_eq!(gate(&never, None, 0, &asker(false)), Gate::Go);
        // The low lane's turn is due, but no low-lane holder waits (it left, handed back): the
        // high lane goes.
        let mut gone = Slots {
            limit: 1,
            high_run: 1,
            low_every: 2,
            ..Slots::default()
        };
        assert_eq!(gate(&gone, None, 0, &asker(false)), Gate::Go);
        start(&mut gone, &asker(false));
        assert_eq!(
            gone.high_run, 0,
            "a high-lane start with no low-lane holder waiting"
        );
    }

    #[test]
    fn a_hand_back_hides_the_trigger_past_what_it_waits_for_in_whole_seconds_and_never_for_none() {
        use std::time::Duration;
        let ms = Duration::from_millis;
        // Under a second left (a `Retry-After: 1` pause, always): a whole second, not none.
        assert_eq!(hidden_for(ms(300)), ms(1000));
        assert_eq!(hidden_for(Duration::ZERO), ms(1000));
        // Rounded up, never down.
        assert_eq!(hidden_for(ms(1001)), ms(2000));
        assert_eq!(hidden_for(ms(2000)), ms(2000));
        assert_eq!(hidden_for(ms(29_500)), ms(30_000));
    }
}
