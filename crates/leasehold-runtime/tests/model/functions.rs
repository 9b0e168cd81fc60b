//! Functions mode in the model: the host and each delivery's watchdog, as `runner/watched.rs`
//! drives them with the protocol core's decisions ([`carriers`]).
//!
//! The host takes a message and keeps it hidden while its handler lives (10 minutes: longer than
//! anything here), counting its own dequeues; if the handler dies, the message comes back after
//! that, and if the handler answers with a failure, the host retries it. Each delivery first puts
//! a hidden watchdog (a carrier of the delivery's duty, with the attempts so far), pushed a lease
//! ahead before each renewal: it surfaces when the handler dies (once the lease it held has
//! expired), or while the delivery still lives if it went a lease's time without a grant (a
//! *lapse*, spent like a fault). When the delivery ends, the watchdog is deleted, or rewritten into
//! its look again, its retry, its follow-up (a deferral, a waiter), or the trigger is given up; a
//! rewrite that finds the watchdog gone (it lapsed, and someone took it) puts the message afresh.

use leasehold_runtime::protocol::End;
use leasehold_runtime::protocol::carriers::{self, Ended, IfItFails, Watchdog};

use crate::consumer::comes_back;
use crate::world::{Config, Delivery, Kind, Lease, Msg, Successor, Wait, World, ok};

/// A delivery's watchdog.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Watch {
    /// Not put yet: the delivery's first request.
    Unarmed,
    /// Put, hidden, and this delivery's.
    Hidden(Msg),
    /// It surfaced while the delivery lived, and went to the queue.
    Gone,
}

impl Watch {
    pub fn hidden(self) -> Option<Msg> {
        match self {
            Watch::Hidden(m) => Some(m),
            _ => None,
        }
    }

    pub fn after_token(&mut self) -> Option<&mut u8> {
        match self {
            Watch::Hidden(m) => m.after_token.as_mut(),
            _ => None,
        }
    }
}

impl World {
    /// The watchdog's own transitions (its put, a lapse). `true` if the delivery can do nothing
    /// else yet.
    pub(crate) fn watch_successors(&self, w: usize, actor: &str, out: &mut Vec<Successor>) -> bool {
        let d = self.workers[w].delivery.as_ref().unwrap();
        match &d.watchdog {
            Some(Watch::Unarmed) => {
                self.arm(w, actor, out);
                true
            }
            Some(Watch::Hidden(m)) => {
                let r = self.record_of(w);
                if self.lapses > 0 && self.records[r].lease != Lease::Held(w as u8) {
                    let mut next = self.clone();
                    next.lapses -= 1;
                    next.put(m.clone());
                    next.workers[w].delivery.as_mut().unwrap().watchdog = Some(Watch::Gone);
                    let mut s = ok(next, actor, format!("its watchdog surfaces while it lives: {m}"));
                    s.reached = Some(20);
                    out.push(s);
                }
                false
            }
            _ => false,
        }
    }

    /// The watchdog's put, before the delivery touches anything: a carrier with the attempts so
    /// far, marked as a waiter if the delivery may leave a wait marker behind.
    fn arm(&self, w: usize, actor: &str, out: &mut Vec<Successor>) {
        let d = self.workers[w].delivery.as_ref().unwrap();
        let mut standin = Msg {
            kind: Kind::Watchdog,
            prior: d.msg.attempts(),
            dequeued: 0,
            ..d.msg.clone()
        };
        let marks = d.debouncing.as_ref().is_some_and(|x| x.path.marks_carrier());
        if marks && standin.wait.is_none() {
            standin.wait = Some(Wait::default());
        }
        let mut armed = self.clone();
        armed.workers[w].delivery.as_mut().unwrap().watchdog = Some(Watch::Hidden(standin.clone()));
        out.push(ok(armed, actor, format!("puts its watchdog, hidden: {standin}")));
        if self.faults > 0 {
            // Nothing happened yet: the host retries its message.
            let mut failed = self.with_fault_spent();
            let d = failed.workers[w].delivery.take().unwrap();
            failed.put(d.delivered());
            let mut landed = failed.clone();
            out.push(ok(
                failed,
                actor,
                "the watchdog's put fails: the host retries its message".into(),
            ));
            // Landed, its answer lost: a watchdog nobody deletes, which surfaces later.
            landed.put(standin);
            out.push(ok(
                landed,
                actor,
                "the watchdog's put lands, its answer lost: the host retries its message".into(),
            ));
        }
    }

    /// The handler's end of a delivery whose protocol ended with `end`.
    pub(crate) fn finish_watched(
        &self,
        config: &Config,
        w: usize,
        end: End,
        actor: &str,
        out: &mut Vec<Successor>,
    ) {
        let mut next = self.clone();
        let d = next.workers[w].delivery.take().unwrap();
        next.drop_guard(w, &d);
        let (ended, follow) = d.ended(end);
        let reached = d.reached(end);
        let retry = Msg {
            after_token: d.retry_token(end),
            ..d.msg.clone()
        };
        let what = format!("ends {end:?}");
        next.watched_end(config, &d, ended, follow, retry, what, reached, actor, out);
    }

    /// What the handler does with `d`'s watchdog once it `ended` (`follow`: the message that
    /// carries its duty on, if any; `retry`: what its retry is made of), as the core decides, and
    /// how the host's message fares. `self` is the world with the delivery taken out.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn watched_end(
        self,
        config: &Config,
        d: &Delivery,
        ended: Ended,
        follow: Option<Msg>,
        retry: Msg,
        what: String,
        reached: Option<usize>,
        actor: &str,
        out: &mut Vec<Successor>,
    ) {
        let attempts = u32::from(d.delivered().attempts());
        let decided = carriers::after(ended, attempts, u32::from(config.max_attempts), config.fault);
        let rewritten = match decided {
            Watchdog::Disarm | Watchdog::Dropped => None,
            Watchdog::LookAgain | Watchdog::FollowUp | Watchdog::Deferral => follow,
            Watchdog::Retry => Some(Msg {
                kind: Kind::Watchdog,
                prior: d.delivered().attempts(),
                dequeued: 0,
                ..retry.clone()
            }),
            Watchdog::GiveUp => {
                // The poison entry, then the sweep; then the watchdog is deleted.
                let mut given_up = self.clone();
                given_up.put(Msg::new(retry.record, Kind::Sweep, 0, retry.given_up + 1));
                let mut s = ok(
                    given_up.clone(),
                    actor,
                    format!("{what}: given up, a sweep is put"),
                );
                s.reached = Some(4);
                out.push(s);
                if self.faults > 0 {
                    given_up.faults -= 1;
                    given_up.surface(d);
                    out.push(ok(
                        given_up,
                        actor,
                        format!("{what}: given up, but the watchdog's delete fails"),
                    ));
                    let mut failed = self.clone();
                    failed.surface(d);
                    let what = format!("{what}: the give-up fails: the host retries");
                    out.push(comes_back(failed, d.delivered(), actor, what));
                }
                return;
            }
        };
        // The rewrite (or the delete) lands: the watchdog becomes the follow-up (put afresh if
        // it was gone), and the host's message is acknowledged.
        let mut done = self.clone();
        if let Some(m) = &rewritten {
            done.put(m.clone());
        }
        let how = match &rewritten {
            Some(m) => format!("{what}: the watchdog becomes {m}"),
            None => format!("{what}: the watchdog is deleted"),
        };
        let mut s = ok(done, actor, how);
        s.reached = if decided == Watchdog::Retry {
            Some(19)
        } else {
            reached
        };
        out.push(s);
        if self.faults == 0 {
            return;
        }
        // It fails: the watchdog surfaces as it is, when its visibility lapses.
        let mut failed = self.clone();
        failed.surface(d);
        match carriers::if_it_fails(decided) {
            IfItFails::Acknowledge => {
                failed.faults -= 1;
                out.push(ok(failed, actor, format!("{what}: the watchdog's rewrite fails")));
            }
            IfItFails::HostRetries => {
                let what = format!("{what}: the watchdog's rewrite fails: the host retries");
                out.push(comes_back(failed, d.delivered(), actor, what));
            }
            IfItFails::Failed => {
                let what = format!("{what}: the watchdog's rewrite fails");
                let unsurfaced = self.with_fault_spent();
                unsurfaced.watched_end(
                    config,
                    d,
                    Ended::Failed { gives_up: false },
                    None,
                    retry,
                    what,
                    None,
                    actor,
                    out,
                );
            }
        }
    }

    /// `d`'s watchdog, hidden and its, surfaces.
    fn surface(&mut self, d: &Delivery) {
        if let Some(Watch::Hidden(m)) = &d.watchdog {
            self.put(m.clone());
        }
    }
}
