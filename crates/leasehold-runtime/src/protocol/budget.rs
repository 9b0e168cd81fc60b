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

/// Where a holder that is not admitted waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Waits {
    /// In a seat of the consumer's waiting room: its slot is free for other work.
    InSeat,
    /// In its slot of the consumer (no consumer slot to give back, or a wait for the limit in a
    /// full waiting room: runs of the budget are under way, and one ends soon).
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
