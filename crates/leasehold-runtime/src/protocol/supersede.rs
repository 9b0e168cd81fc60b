//! Supersede's pending run: the decisions around the lock blob's `pending` note and a retry's
//! `afterToken` (docs/design.md "Supersede", "A run waiting in retry backoff is superseded too").
//!
//! A holder with token g whose run fails with a retry coming, or is put off, notes `pending = g`
//! under its lease before releasing, and its retry (or deferral) carries `afterToken = g` — only
//! if that write succeeded (and, for a deferral, only if its take after the release found no
//! marker, nor may have: [`super::End::CarriedOn`]'s `joined`). A later holder whose run completes
//! or is superseded removes the note; one that pends notes itself instead. A delivery carrying
//! `afterToken = g`, once granted, runs if the note still says g, and otherwise stands down as a
//! holder: the note changed only by a holder that acquired after g released, hence started after
//! the trigger the retry stands for, and that covered it (completed, or was superseded and
//! retriggered) or pends itself.
//!
//! All tokens here are fencing tokens; `None` is "no note" or "no token".

use super::Fault;

/// Whether a granted delivery carrying `after_token` stands down: the note no longer names its
/// run, so a later run took its duty over.
pub fn stands_down(after_token: Option<u64>, pending: Option<u64>) -> bool {
    after_token.is_some_and(|after| pending != Some(after))
}

/// How a run ended, as far as its pending note goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RunResult {
    /// Completed: it covers a pending run (it started after that run's trigger).
    Completed,
    /// Stopped for a trigger that arrived during it: its retrigger covers the pending run too.
    Superseded,
    /// Failed: `retried` when a retry of its own will come (not given up, under the limit).
    Failed { retried: bool },
    /// Put off: its deferral will run it later.
    Deferred,
    /// Put off with its deferral budget spent: given up.
    GivenUp,
}

impl RunResult {
    /// Whether the trigger will be tried again by a message of its own (a retry or its
    /// deferral): then it pends.
    pub fn pends(self) -> bool {
        matches!(self, RunResult::Failed { retried: true } | RunResult::Deferred)
    }
}

/// What a run that read the notes at its grant does with them before its release.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Pending {
    /// The note to write: `Some(Some(g))` this run pends; `Some(None)` none pends any more;
    /// `None` leave it as it is.
    pub note: Option<Option<u64>>,
    pends: bool,
    continues: bool,
    before: Option<u64>,
    token: Option<u64>,
}

/// Decides the note of a run with fencing token `token` that read `pending` at its grant, whose
/// delivery carried `after_token` and belongs to a chain given up `given_up` times.
pub fn after_run(
    result: RunResult,
    after_token: Option<u64>,
    given_up: u32,
    pending: Option<u64>,
    token: Option<u64>,
) -> Pending {
    // The pending run's own retry (or deferral) carries on its chain: it leaves the note as it
    // is, and its next retry keeps the token. Rewriting the note first would strand the message
    // that still carries the old token if it came back before being rewritten (a crash, a failed
    // update), and it would stand down for itself.
    let continues = pending.is_some() && after_token == pending;
    let pends = result.pends();
    let note = match result {
        _ if continues => None,
        // Only a chain never given up may take another's duty: a given-up chain's sweep asks the
        // marker first, and would not cover the pending run's trigger.
        _ if pends && given_up == 0 => Some(token),
        _ if pends => None,
        // This run covers the pending one: it started after that run's trigger.
        RunResult::Completed | RunResult::Superseded => Some(None),
        // Given up: the note stays as it is (the give-up's sweep covers this trigger).
        _ => None,
    };
    Pending {
        note,
        pends,
        continues,
        before: pending,
        token,
    }
}

impl Pending {
    /// The token the run's retry or deferral carries, once the note was written (`written`:
    /// the notes now say what [`note`](Self::note) asked, or nothing was to be written): the
    /// pending run's own chain keeps its token; a run that noted itself hands its own on, but only
    /// if the note was written; anything else carries none (and so never stands down).
    pub fn after_token(&self, written: bool, fault: Fault) -> Option<u64> {
        if !self.pends {
            None
        } else if self.continues {
            self.before
        } else if (written || fault == Fault::TokenWithoutNote) && self.note == Some(self.token) {
            self.token
        } else {
            None
        }
    }
}
