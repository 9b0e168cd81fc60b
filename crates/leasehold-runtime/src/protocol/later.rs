//! Run later (docs/design.md "Run later"): logic that asks to be run later ends its run; the
//! record's lease is released and the retrigger marker taken *into* the deferral — a carrier
//! that stands for this trigger and every trigger that coalesced onto the run, visible after the
//! delay. Each chain has a deferral budget; once it is spent, the trigger is given up (its poison
//! entry and a sweep) instead of being put off again.
//!
//! The delay: what the logic asked (or the scope's default), no shorter than the shortest
//! deferral, and within what is left of the chain's budget. Durations are passed in: the core has
//! no clock.

use std::time::Duration;

/// What becomes of a run whose logic asked to be run later.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Later {
    /// Its deferral, visible after this long.
    Defer(Duration),
    /// The chain's deferral budget is spent: give the trigger up.
    Exhausted,
}

/// A chain's deferral budget, and the scope's bounds on a delay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Budget {
    /// The longest a chain may be put off in all.
    pub max: Duration,
    /// The shortest deferral.
    pub floor: Duration,
    /// The delay when the logic gave none.
    pub default: Duration,
}

/// The deferral of a run that `asked` to be run later, its chain put off `so_far` already.
pub fn later(asked: Option<Duration>, so_far: Duration, budget: Budget) -> Later {
    let remaining = budget.max.saturating_sub(so_far);
    if remaining < budget.floor.max(Duration::from_millis(1)) {
        return Later::Exhausted;
    }
    Later::Defer(asked.unwrap_or(budget.default).max(budget.floor).min(remaining))
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn budget() -> Budget {
        Budget {
            max: 100 * S,
            floor: 5 * S,
            default: 30 * S,
        }
    }

    #[test]
    fn a_deferral_is_what_was_asked_within_the_floor_and_what_is_left() {
        assert_eq!(later(None, Duration::ZERO, budget()), Later::Defer(30 * S));
        assert_eq!(later(Some(S), Duration::ZERO, budget()), Later::Defer(5 * S));
        assert_eq!(later(Some(60 * S), 80 * S, budget()), Later::Defer(20 * S));
    }

    #[test]
    fn a_budget_with_less_than_the_floor_left_is_spent_and_exactly_the_floor_is_not() {
        assert_eq!(later(None, 96 * S, budget()), Later::Exhausted);
        assert_eq!(later(None, 95 * S, budget()), Later::Defer(5 * S));
    }
}
