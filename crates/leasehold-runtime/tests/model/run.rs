//! A holder's run in the model, between its grant (the marker dealt with) and its release: what
//! the runner still does itself around the core's [`Step::Run`] — supersede's notes, the logic,
//! the `pending` note — with the core's decisions ([`supersede`]) where it has them.

use leasehold_runtime::protocol::budget;
use leasehold_runtime::protocol::supersede::{self, RunResult};
use leasehold_runtime::protocol::{Answer, Fault, RunEnd};

use crate::world::{Config, Delivery, Event, Lease, Noting, Successor, Violation, World, ok};

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
                let mut next = self.with_fault_spent();
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
            None => match budget::gate(
                &self.slots(config, w),
                self.paused.then_some(1),
                0,
                &self.asker(config, w),
            ) {
                budget::Gate::Go => self.start_logic(w, actor, config, out),
                budget::Gate::Wait(pause) => self.wait_at_gate(config, w, pause.is_some(), actor, out),
                budget::Gate::HandBack(_) => unreachable!("the model's pauses are short enough to wait out"),
            },
            Some(before) => self.end_logic(config, w, before, actor, out),
        }
    }

    /// The budget's slots on worker `w`'s process, as its gate sees them: the runs under way
    /// there, the holders counted waiting for a slot in each lane, and the turns.
    fn slots(&self, config: &Config, w: usize) -> budget::Slots {
        let process = self.workers[w].process;
        let here: Vec<&Delivery> = self
            .workers
            .iter()
            .filter(|x| x.alive && x.process == process)
            .filter_map(|x| x.delivery.as_ref())
            .collect();
        let waiting = |low: bool| {
            here.iter()
                .filter(|d| d.counted && World::low_lane(config, d.msg.record) == low)
                .count()
        };
        budget::Slots {
            in_flight: here.iter().filter(|d| d.running.is_some()).count(),
            limit: if config.limit == 0 {
                usize::MAX
            } else {
                config.limit.into()
            },
            high_waiting: waiting(false),
            low_waiting: waiting(true),
            high_run: self.turns[usize::from(process)].high_run,
            // The gate before the low lane's turn at starts: as one told `low_every` 0.
            low_every: if config.fault == Fault::HighLaneAlwaysFirst {
                0
            } else {
                config.low_every.into()
            },
        }
    }

    /// Worker `w`'s holder at its budget's gate (no deadline: the model's pauses are short).
    fn asker(&self, config: &Config, w: usize) -> budget::Asker<u8> {
        let d = self.workers[w].delivery.as_ref().unwrap();
        budget::Asker {
            stand_in: d.msg.may_stand_in(),
            low: World::low_lane(config, d.msg.record),
            pause_deadline: None,
        }
    }

    /// A start through the gate: the core counts the lanes' turns; the model checks the limit and
    /// the low lane's share by its own count.
    fn start_at_gate(&mut self, config: &Config, w: usize) -> (Option<Violation>, Option<usize>) {
        let mut slots = self.slots(config, w);
        let asker = self.asker(config, w);
        let process = usize::from(self.workers[w].process);
        let turns = &mut self.turns[process];
        budget::start(&mut slots, &asker);
        turns.high_run = slots.high_run;
        let d = self.workers[w].delivery.as_mut().unwrap();
        d.counted = false;
        d.in_slot = false;
        let in_flight = slots.in_flight - 1;
        if asker.stand_in {
            // Beyond the limit if need be, and no turn of either lane.
            let beyond = config.limit > 0 && in_flight >= config.limit.into();
            return (None, beyond.then_some(24));
        }
        if config.limit > 0 && in_flight >= config.limit.into() {
            return (Some(Violation::OverLimit { in_flight }), None);
        }
        let (low_waiting, high_waiting) = (slots.low_waiting, slots.high_waiting);
        if asker.low {
            // Ahead of a waiting high-lane holder only on the low lane's turn.
            let turn = config.low_every > 0 && turns.in_a_row + 1 >= config.low_every;
            let in_a_row = std::mem::take(&mut turns.in_a_row);
            return match high_waiting {
                0 => (None, None),
                _ if turn => (None, Some(23)),
                _ => (Some(Violation::HighLaneNotFirst { in_a_row }), None),
            };
        }
        if low_waiting == 0 {
            turns.in_a_row = 0;
            return (None, None);
        }
        turns.in_a_row += 1;
        if config.low_every > 0 && turns.in_a_row >= config.low_every {
            let in_a_row = turns.in_a_row;
            return (Some(Violation::LowLaneStarved { in_a_row }), None);
        }
        (None, Some(22))
    }

    fn start_logic(&self, w: usize, actor: &str, config: &Config, out: &mut Vec<Successor>) {
        let d = self.workers[w].delivery.as_ref().unwrap();
        let r = self.record_of(w);
        let record = &self.records[r];
        let mut next = self.clone();
        let (at_gate, turn) = next.start_at_gate(config, w);
        let token = d.token.expect("a run has a token");
        let others = self.workers.iter().enumerate().any(|(o, x)| {
            o != w
                && x.alive
                && x.delivery
                    .as_ref()
                    .is_some_and(|d| d.running.is_some() && usize::from(d.msg.record) == r)
        });
        let allowed = record.sent.count_ones() as u8 + self.spent(config);
        let violation = if at_gate.is_some() {
            at_gate
        } else if others {
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
            _ => turn,
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
            ways.push((self.with_fault_spent(), false, "the note's write fails".into()));
            ways.push((
                written.with_fault_spent(),
                false,
                "the note's write lands, its answer lost".into(),
            ));
        }
        for (mut next, written, what) in ways {
            let d = next.workers[w].delivery.as_mut().unwrap();
            d.noting = None;
            d.after_token = if written { noting.if_written } else { noting.if_not };
            next.ran(w);
            out.push(ok(next, actor, what));
        }
    }

    /// A holder the gate holds (it is not a stand-in), for the pause or for a slot of the
    /// budget's limit: it waits in a seat of its process's waiting room, in its slot, or is
    /// handed back, as the core decides.
    fn wait_at_gate(&self, config: &Config, w: usize, paused: bool, actor: &str, out: &mut Vec<Successor>) {
        let d = self.workers[w].delivery.as_ref().unwrap();
        if d.waited {
            // Waiting (in its slot or its seat) until the pause ends or a slot frees; counted
            // among its lane's waiting the first time it waits for a slot.
            if d.in_slot {
                // A wait in its slot of the consumer is bounded (the runner's
                // `MAX_LIMIT_WAIT_IN_SLOT`, or a pause it meets there): the model has no time,
                // so it may run out at any moment. Handed back, as a holder.
                let mut next = self.clone();
                let nd = next.workers[w].delivery.as_mut().unwrap();
                nd.in_slot = false;
                nd.counted = false;
                nd.handed_back = true;
                nd.step = nd.machine.on(Answer::RunEnded(RunEnd::CarriedOn));
                let mut s = ok(
                    next,
                    actor,
                    "its wait in its slot runs out: handed back, as a holder".into(),
                );
                s.reached = Some(25);
                out.push(s);
            }
            if !paused && !d.counted {
                let mut next = self.clone();
                next.workers[w].delivery.as_mut().unwrap().counted = true;
                out.push(ok(
                    next,
                    actor,
                    "the pause over, waits on for a slot of its budget".into(),
                ));
            }
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
        let (wait, reached) = if paused {
            ("waits out the pause", Some(11))
        } else {
            ("waits for a slot of its budget", Some(21))
        };
        let (what, reached) = match budget::waits(paused, seat.map(|s| s.is_some())) {
            budget::Waits::InSeat => {
                let mut moved = next.workers[w].delivery.take().unwrap();
                moved.waited = true;
                moved.counted = !paused;
                let to = seat.flatten().unwrap();
                if let Some(record) = next.records.iter_mut().find(|r| r.lease == Lease::Held(w as u8)) {
                    record.lease = Lease::Held(to as u8);
                }
                next.workers[to].delivery = Some(moved);
                (format!("{wait} in seat w{to}: its slot is free"), reached)
            }
            budget::Waits::InSlot => {
                let nd = next.workers[w].delivery.as_mut().unwrap();
                nd.waited = true;
                nd.counted = !paused;
                // Bounded when it was offered a seat and found none (not when it was offered
                // none: the code before the waiting room, `HolderKeepsItsSlot`).
                nd.in_slot = seat.is_some();
                (format!("{wait} in its slot"), reached.filter(|_| !paused))
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
