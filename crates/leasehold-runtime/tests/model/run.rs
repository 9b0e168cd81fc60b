//! A holder's run in the model, between its grant (the marker dealt with) and its release: what
//! the runner still does itself around the core's [`Step::Run`] — supersede's notes, the logic,
//! the `pending` note — with the core's decisions ([`supersede`]) where it has them.

use leasehold_runtime::protocol::budget;
use leasehold_runtime::protocol::supersede::{self, RunResult};
use leasehold_runtime::protocol::{Answer, RunEnd};

use crate::world::{Config, Event, Lease, Noting, Successor, Violation, World, ok};

/// A token of the model as the core's (and back): the model keeps them small, by rank.
fn wide(t: Option<u8>) -> Option<u64> {
    t.map(u64::from)
}

fn narrow(t: Option<u64>) -> Option<u8> {
    t.map(|t| u8::try_from(t).expect("model tokens are small"))
}

impl World {
    pub(crate) fn run_successors(&self, config: &Config, w: usize, actor: &str, out: &mut Vec<Successor>) {
        let d = self.workers[w].delivery.as_ref().unwrap();
        let r = self.record_of(w);
        if config.supersede && d.notes.is_none() && d.result.is_none() {
            // Supersede: the record's notes, read at the grant.
            let mut next = self.clone();
            let pending = self.records[r].pending;
            let nd = next.workers[w].delivery.as_mut().unwrap();
            nd.notes = Some(pending);
            let mut s = if supersede::stands_down(wide(nd.msg.after_token), wide(pending)) {
                nd.stood_down = true;
                nd.step = nd.machine.on(Answer::RunEnded(RunEnd::StoodDown));
                ok(
                    next,
                    actor,
                    format!("reads the notes: pending {pending:?}; a later run took its duty: stands down"),
                )
            } else {
                ok(next, actor, format!("reads the notes: pending {pending:?}"))
            };
            s.reached = None;
            out.push(s);
            if self.faults > 0 {
                let mut next = self.clone();
                next.faults -= 1;
                let nd = next.workers[w].delivery.as_mut().unwrap();
                nd.step = nd
                    .machine
                    .on(Answer::RunEnded(RunEnd::FailedBefore("read the record's notes")));
                out.push(ok(next, actor, "reads the notes: fails".into()));
            }
            return;
        }
        if let Some(noting) = d.noting {
            self.write_note(config, w, noting, actor, out);
            return;
        }
        match d.running {
            None if self.paused && !d.msg.may_stand_in() => self.wait_at_gate(config, w, actor, out),
            None => self.start_logic(w, actor, config, out),
            Some(before) => self.end_logic(config, w, before, actor, out),
        }
    }

    fn start_logic(&self, w: usize, actor: &str, config: &Config, out: &mut Vec<Successor>) {
        let d = self.workers[w].delivery.as_ref().unwrap();
        let r = self.record_of(w);
        let record = &self.records[r];
        let mut next = self.clone();
        let token = d.token.expect("a run has a token");
        let others = self.workers.iter().enumerate().any(|(o, x)| {
            o != w
                && x.alive
                && x.delivery
                    .as_ref()
                    .is_some_and(|d| d.running.is_some() && usize::from(d.msg.record) == r)
        });
        let allowed = record.sent.count_ones() as u8 + self.spent(config);
        let violation = if others {
            Some(Violation::TwoRuns)
        } else if token <= record.last_token {
            Some(Violation::TokenNotRising {
                token,
                last: record.last_token,
            })
        } else if record.runs >= allowed && !config.always_fails {
            Some(Violation::ExtraRun {
                runs: record.runs + 1,
                allowed,
            })
        } else {
            None
        };
        next.records[r].last_token = token;
        next.records[r].runs += 1;
        if d.waited {
            // Triggers that found the lease held while it waited set the marker: the run, starting
            // after them, covers them (a take that fails leaves it for the usual retrigger).
            next.records[r].marker = false;
        }
        let nd = next.workers[w].delivery.as_mut().unwrap();
        nd.running = Some(record.sent);
        let reached = match nd.msg.kind {
            crate::world::Kind::Retrigger => Some(1),
            crate::world::Kind::Sweep => Some(5),
            crate::world::Kind::Watchdog => Some(18),
            _ if nd.msg.deferred => Some(9),
            _ => None,
        };
        out.push(Successor {
            world: next,
            event: Event {
                actor: actor.to_string(),
                what: format!("the logic starts (token {token})"),
            },
            violation,
            reached,
            pause_ends: false,
        });
    }

    /// Every way the logic may end.
    fn end_logic(&self, config: &Config, w: usize, before: u8, actor: &str, out: &mut Vec<Successor>) {
        let d = self.workers[w].delivery.as_ref().unwrap();
        let r = self.record_of(w);
        let retried = d.msg.attempts() < config.max_attempts;
        let mut ends: Vec<(World, RunResult, String, Option<usize>)> = Vec::new();
        if !config.always_fails {
            let mut next = self.clone();
            next.records[r].covered |= before;
            ends.push((next, RunResult::Completed, "the logic completes".into(), None));
        }
        if config.always_fails || self.logic_failures > 0 {
            let mut next = self.clone();
            if !config.always_fails {
                next.logic_failures -= 1;
            }
            ends.push((
                next,
                RunResult::Failed { retried },
                "the logic fails".into(),
                None,
            ));
        }
        if self.ask_later > 0 {
            let mut next = self.clone();
            next.ask_later -= 1;
            ends.push((
                next,
                RunResult::Deferred,
                "the logic asks to be run later".into(),
                None,
            ));
        }
        if config.supersede && self.records[r].marker {
            // The watch reads the marker after a renewal: a trigger arrived during the run.
            ends.push((
                self.clone(),
                RunResult::Superseded,
                "the marker is set: the run is stopped (superseded)".into(),
                Some(8),
            ));
        }
        if self.lost_leases > 0 && self.records[r].lease == Lease::Held(w as u8) {
            // Told 10 s before storage could let it expire, the logic stopped within its grace:
            // by the time anyone else can acquire, it has ended.
            let mut next = self.clone();
            next.lost_leases -= 1;
            next.records[r].lease = Lease::Free;
            ends.push((
                next,
                RunResult::Failed { retried },
                "loses its lease; the logic is stopped".into(),
                Some(7),
            ));
        }
        for (mut next, result, what, reached) in ends {
            next.after_logic(config, w, result);
            let mut s = ok(next, actor, what);
            s.reached = reached;
            out.push(s);
        }
    }

    /// The run's decisions once its logic has ended: the note to write (supersede), or on to
    /// the release.
    fn after_logic(&mut self, config: &Config, w: usize, result: RunResult) {
        let lost = self.records[self.record_of(w)].lease != Lease::Held(w as u8);
        let d = self.workers[w].delivery.as_mut().unwrap();
        d.running = None;
        d.result = Some(result);
        if let Some(pending) = d.notes {
            let decided = supersede::after_run(
                result,
                wide(d.msg.after_token),
                u32::from(d.msg.given_up),
                wide(pending),
                wide(d.token),
            );
            match decided.note {
                // Nothing can be written under a lost lease.
                _ if lost => d.after_token = narrow(decided.after_token(false, config.fault)),
                Some(note) if narrow(note) != pending => {
                    d.noting = Some(Noting {
                        note: narrow(note),
                        if_written: narrow(decided.after_token(true, config.fault)),
                        if_not: narrow(decided.after_token(false, config.fault)),
                    });
                    return;
                }
                _ => d.after_token = narrow(decided.after_token(true, config.fault)),
            }
        }
        self.ran(w);
    }

    /// The `pending` note's write, under the lease, before the release.
    fn write_note(&self, _config: &Config, w: usize, noting: Noting, actor: &str, out: &mut Vec<Successor>) {
        let r = self.record_of(w);
        let mine = self.records[r].lease == Lease::Held(w as u8);
        let mut ways = Vec::new();
        let mut written = self.clone();
        if mine {
            written.records[r].pending = noting.note;
        }
        ways.push((written.clone(), mine, format!("notes pending {:?}", noting.note)));
        if self.faults > 0 && mine {
            let mut refused = self.clone();
            refused.faults -= 1;
            ways.push((refused, false, "the note's write fails".into()));
            let mut landed = written;
            landed.faults -= 1;
            ways.push((landed, false, "the note's write lands, its answer lost".into()));
        }
        for (mut next, written, what) in ways {
            let d = next.workers[w].delivery.as_mut().unwrap();
            d.noting = None;
            d.after_token = if written { noting.if_written } else { noting.if_not };
            next.ran(w);
            out.push(ok(next, actor, what));
        }
    }

    /// A holder at its budget's gate while the pause lasts (it is not a stand-in): it waits in a
    /// seat of its process's waiting room, in its slot, or is handed back, as the core decides.
    fn wait_at_gate(&self, config: &Config, w: usize, actor: &str, out: &mut Vec<Successor>) {
        let d = self.workers[w].delivery.as_ref().unwrap();
        if d.waited {
            // Waiting (in its slot or its seat) until the pause ends.
            return;
        }
        if d.for_the_dead {
            // Its record must run again within the recovery bound, pause or not.
            let mut s = ok(
                self.clone(),
                actor,
                "stands in for a dead holder, and is held by the pause".into(),
            );
            s.violation = Some(Violation::StandInHeld);
            out.push(s);
            return;
        }
        let seat = budget::offers_seat(config.fault).then(|| self.free_seat(w));
        let mut next = self.clone();
        let (what, reached) = match budget::waits(true, seat.map(|s| s.is_some())) {
            budget::Waits::InSeat => {
                let mut moved = next.workers[w].delivery.take().unwrap();
                moved.waited = true;
                let to = seat.flatten().unwrap();
                if let Some(record) = next.records.iter_mut().find(|r| r.lease == Lease::Held(w as u8)) {
                    record.lease = Lease::Held(to as u8);
                }
                next.workers[to].delivery = Some(moved);
                (
                    format!("waits out the pause in seat w{to}: its slot is free"),
                    Some(11),
                )
            }
            budget::Waits::InSlot => {
                next.workers[w].delivery.as_mut().unwrap().waited = true;
                ("waits out the pause in its slot".to_string(), None)
            }
            budget::Waits::HandBack => {
                let nd = next.workers[w].delivery.as_mut().unwrap();
                nd.handed_back = true;
                nd.step = nd.machine.on(Answer::RunEnded(RunEnd::CarriedOn));
                ("no seat free: handed back, as a holder".to_string(), Some(12))
            }
        };
        let mut s = ok(next, actor, what);
        s.reached = reached;
        out.push(s);
    }

    /// On to the release: the run's decisions are made.
    fn ran(&mut self, w: usize) {
        let d = self.workers[w].delivery.as_mut().unwrap();
        d.after_run = true;
        let end = if d.result == Some(RunResult::Deferred) {
            RunEnd::CarriedOn
        } else {
            RunEnd::Ran
        };
        d.step = d.machine.on(Answer::RunEnded(end));
    }
}
