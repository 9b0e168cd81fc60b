//! A delivery's slot of its consumer, given back while it waits at its budget's gate.

use std::sync::Arc;

/// A delivery's slot of its consumer. While the delivery waits at its budget's gate (for a
/// pause to end, or for a slot of the budget) it gives the slot back and waits in a seat of
/// the consumer's waiting room, so waiting holders never keep the consumer from taking other
/// work: a dead holder's message, a trigger of another budget, the other lane. The room has
/// as many seats as the consumer has slots; when it is full, a pause hands a delivery back
/// instead, and a wait for the limit goes on in its slot for a few seconds at most (runs of the
/// budget are under way, but may be long), then hands it back to come again a second later.
/// Once admitted, the delivery takes a free slot back, or runs in its seat when none is free
/// (it never waits for a slot while holding a slot of its budget: that could wait forever).
#[derive(Debug)]
pub(crate) struct ConsumerSlot {
    slots: Arc<tokio::sync::Semaphore>,
    seats: Arc<tokio::sync::Semaphore>,
    held: std::sync::Mutex<tokio::sync::OwnedSemaphorePermit>,
}

impl ConsumerSlot {
    pub(crate) fn new(
        slots: Arc<tokio::sync::Semaphore>,
        seats: Arc<tokio::sync::Semaphore>,
        permit: tokio::sync::OwnedSemaphorePermit,
    ) -> Self {
        Self {
            slots,
            seats,
            held: std::sync::Mutex::new(permit),
        }
    }

    /// Whether the waiting room is full (a delivery that must wait would keep its slot).
    pub(crate) fn room_full(&self) -> bool {
        self.seats.available_permits() == 0
    }

    fn holds_slot(held: &tokio::sync::OwnedSemaphorePermit, slots: &Arc<tokio::sync::Semaphore>) -> bool {
        Arc::ptr_eq(held.semaphore(), slots)
    }

    /// Gives the slot back for a seat, if one is free. Says whether it did (or already had).
    pub(crate) fn park(&self) -> bool {
        let mut held = self.held.lock().expect("consumer slot mutex");
        if !Self::holds_slot(&held, &self.slots) {
            return true;
        }
        match self.seats.clone().try_acquire_owned() {
            Ok(seat) => {
                // The slot is freed as the seat replaces it.
                *held = seat;
                true
            }
            Err(_) => false,
        }
    }

    /// Takes a slot back for the seat, if one is free; else keeps the seat.
    pub(crate) fn unpark(&self) {
        let mut held = self.held.lock().expect("consumer slot mutex");
        if Self::holds_slot(&held, &self.slots) {
            return;
        }
        if let Ok(slot) = self.slots.clone().try_acquire_owned() {
            *held = slot;
        }
    }
}
