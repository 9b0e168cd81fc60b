//! A worker of the model: a slot of a consumer process (or, under Functions, of a host) that
//! takes a visible message — given up at the poison limit, handed back by a paused budget's first
//! gate — drives its delivery through the protocol core, and ends it as the consumer does, with
//! the core's decision ([`carriers::standalone`]); and a crash, which takes the whole process.

use leasehold_runtime::protocol::release::CHECK_MARKER;
use leasehold_runtime::protocol::supersede::RunResult;
use leasehold_runtime::protocol::{End, Machine, Step, budget, carriers};

use crate::world::{Config, Delivery, Kind, Lease, MAX_GIVE_UPS, Msg, Successor, Violation, World, ok};

impl Delivery {
    /// The queue message as delivered.
    pub(crate) fn delivered(&self) -> Msg {
        self.queued.clone().unwrap_or_else(|| self.msg.clone())
    }

    /// Its look again: a carrier with the failed attempts so far.
    pub(crate) fn look_again(&self) -> Msg {
        let kind = match self.msg.kind {
            Kind::Sweep if self.msg.dequeued > 1 => Kind::Recheck,
            Kind::Recheck | Kind::Sweep | Kind::Watchdog => self.msg.kind,
            _ => Kind::Recheck,
        };
        Msg::new(self.msg.record, kind, self.msg.attempts() - 1, self.msg.given_up)
    }

    /// Its deferral (run later); `joined`: fresh triggers joined it (the marker was set).
    pub(crate) fn deferral(&self, joined: bool) -> Msg {
        let mut deferral = Msg::new(
            self.msg.record,
            Kind::Recheck,
            self.msg.attempts() - 1,
            self.msg.given_up,
        );
        deferral.deferred = true;
        if joined {
            deferral.given_up = 0;
        } else {
            deferral.after_token = self.after_token;
        }
        deferral
    }

    /// What its protocol's `end` comes to, as the core's carriers see it, and the message that
    /// carries its duty on, if any (its look again, its deferral, its hand-back).
    pub(crate) fn ended(&self, end: End) -> (carriers::Ended, Option<Msg>) {
        match end {
            End::Coalesced => (carriers::Ended::Acknowledged, None),
            End::LookAgain => (carriers::Ended::LookAgain, Some(self.look_again())),
            End::Ran { .. } => match self.result {
                Some(RunResult::Completed | RunResult::Superseded) => (carriers::Ended::Acknowledged, None),
                _ => (carriers::Ended::Failed { gives_up: false }, None),
            },
            End::CarriedOn { joined } if self.handed_back => {
                // The message as it was (not an attempt); fresh triggers joined it if the marker
                // was set.
                let mut back = Msg {
                    prior: self.msg.attempts() - 1,
                    dequeued: 0,
                    ..self.msg.clone()
                };
                if joined {
                    back.given_up = 0;
                    back.after_token = None;
                }
                (carriers::Ended::FollowUp, Some(back))
            }
            End::CarriedOn { joined } => (carriers::Ended::Deferred, Some(self.deferral(joined))),
            End::StorageFailed { .. } => (carriers::Ended::Failed { gives_up: false }, None),
            End::StillRunning => unreachable!("not in this model"),
        }
    }

    /// What the end of its protocol reached, for the `sometimes` properties.
    pub(crate) fn reached(&self, end: End) -> Option<usize> {
        match end {
            End::Coalesced if self.stood_down => Some(10),
            End::Coalesced if self.token.is_some() => Some(3),
            End::Coalesced => Some(0),
            End::LookAgain => Some(2),
            _ => None,
        }
    }

    /// The token its retry carries after `end` (the runner's `Ended::after_token`).
    pub(crate) fn retry_token(&self, end: End) -> Option<u8> {
        match end {
            End::Ran { .. } => self.after_token,
            End::StorageFailed { step } if self.after_run || (self.stood_down && step == CHECK_MARKER) => {
                None
            }
            _ => self.msg.after_token,
        }
    }
}

impl World {
    pub(crate) fn worker_successors(&self, config: &Config, w: usize, out: &mut Vec<Successor>) {
        let worker = &self.workers[w];
        if !worker.alive {
            return;
        }
        let actor = format!("w{w}");
        // A crash of its process between any two requests of a delivery, or while it runs.
        if self.crashes > 0 && worker.delivery.is_some() {
            let mut next = self.clone();
            next.crashes -= 1;
            let process = worker.process;
            next.turns[usize::from(process)] = Default::default();
            for x in 0..self.workers.len() {
                if self.workers[x].process == process {
                    next.crash(x);
                }
            }
            out.push(ok(next, &actor, format!("dies, with its process p{process}")));
        }
        let Some(delivery) = &worker.delivery else {
            if worker.seat {
                return;
            }
            // Take any visible message.
            let mut seen = Vec::new();
            for (i, m) in self.queue.iter().enumerate() {
                if seen.contains(m) {
                    continue;
                }
                seen.push(m.clone());
                let mut next = self.clone();
                let mut msg = next.queue.remove(i);
                msg.dequeued += 1;
                let orphaned = std::mem::take(&mut msg.orphaned);
                if carriers::gives_up_at_once(msg.attempts().into(), config.max_attempts.into()) {
                    // Given up: its poison entry, then a sweep, then the message deleted.
                    if msg.given_up >= MAX_GIVE_UPS {
                        // A chain of give-ups that does not end: a state space without end too.
                        let mut s = ok(next, &actor, format!("takes {msg}: given up once more"));
                        s.violation = Some(Violation::EndlessGiveUps);
                        out.push(s);
                        continue;
                    }
                    next.put(Msg::new(msg.record, Kind::Sweep, 0, msg.given_up + 1));
                    let mut s = ok(next, &actor, format!("takes {msg}: given up, a sweep is put"));
                    s.reached = Some(4);
                    out.push(s);
                    continue;
                }
                if self.paused
                    && !msg.may_stand_in()
                    && budget::handed_back_before_the_lock(false, self.free_seat(w).is_none(), config.fault)
                {
                    // The first gate: no seat left to wait in; back when the pause ends.
                    let what =
                        format!("takes {msg}: the budget is paused and the waiting room full: handed back");
                    next.held_back.push(Msg { dequeued: 0, ..msg });
                    next.held_back.sort();
                    let mut s = ok(next, &actor, what);
                    s.reached = Some(12);
                    out.push(s);
                    continue;
                }
                let (machine, step) = Machine::start(msg.facts(config.functions), config.fault);
                let debouncing = crate::debounce::Debouncing::start(config, &msg);
                let what = format!("takes {msg}");
                next.workers[w].delivery = Some(Delivery {
                    msg,
                    machine,
                    step,
                    token: None,
                    notes: None,
                    running: None,
                    result: None,
                    noting: None,
                    after_token: None,
                    after_run: false,
                    stood_down: false,
                    waited: false,
                    handed_back: false,
                    counted: false,
                    in_slot: false,
                    for_the_dead: orphaned,
                    debouncing,
                    queued: None,
                    watchdog: config.functions.then_some(crate::functions::Watch::Unarmed),
                });
                let mut s = ok(next, &actor, what);
                if orphaned && self.paused {
                    s.reached = Some(13);
                }
                out.push(s);
            }
            return;
        };
        if config.functions && self.watch_successors(w, &actor, out) {
            return;
        }
        if let Some(debouncing) = &delivery.debouncing {
            return self.debounce_successors(config, w, debouncing.clone(), &actor, out);
        }
        match delivery.step {
            Step::Send(request) => self.request(w, request, &actor, out),
            Step::Run => self.run_successors(config, w, &actor, out),
            Step::Done(end) if config.functions => self.finish_watched(config, w, end, &actor, out),
            Step::Done(end) => self.finish(w, end, &actor, out),
        }
    }

    /// The consumer's handling of a delivery's end (standalone, as `Consumer` does, with the
    /// core's decision: [`carriers::standalone`]).
    fn finish(&self, w: usize, end: End, actor: &str, out: &mut Vec<Successor>) {
        let mut next = self.clone();
        let d = next.workers[w].delivery.take().unwrap();
        next.drop_guard(w, &d);
        let (ended, follow) = d.ended(end);
        let reached = d.reached(end);
        let what = format!("ends {end:?}");
        match carriers::standalone(ended) {
            carriers::Message::Delete => next.acknowledged(&d, what, reached, actor, out),
            carriers::Message::PersistInPlace => {
                // The follow-up, written over the message in one update (`persist_in_place`).
                let follow = follow.expect("a follow-up");
                let before = next.clone();
                let (what, reached) = if d.handed_back {
                    // Handed back by the pause: hidden until it ends.
                    if next.paused {
                        next.held_back.push(follow.clone());
                        next.held_back.sort();
                    } else {
                        next.put(follow.clone());
                    }
                    (
                        format!("{what}: {follow} is hidden until the pause ends"),
                        Some(12),
                    )
                } else {
                    next.put(follow.clone());
                    (format!("{what}: the message becomes {follow}"), reached)
                };
                let mut s = ok(next, actor, what.clone());
                s.reached = reached;
                out.push(s);
                if self.faults > 0 {
                    // The update fails: the message comes back as it was, and runs early.
                    let what = format!("{what}: the update fails, the message comes back");
                    out.push(comes_back(before, d.delivered(), actor, what));
                }
            }
            carriers::Message::Retry => {
                // The message as it was, carrying the token its delivery leaves.
                let retry = Msg {
                    after_token: d.retry_token(end),
                    ..d.msg.clone()
                };
                let what = format!("{what}: {retry} comes back for a retry");
                next.put(retry);
                out.push(ok(next, actor, what));
            }
            carriers::Message::GiveUp => unreachable!("no run asks to be given up in this model"),
        }
    }

    /// The delivery's lease guard is dropped without a release, if it still holds the lease:
    /// nobody renews it.
    pub(crate) fn drop_guard(&mut self, w: usize, d: &Delivery) {
        let r = usize::from(d.msg.record);
        if self.records[r].lease == Lease::Held(w as u8) {
            self.records[r].lease = Lease::Orphan;
        }
    }

    /// The delivered message is deleted (or the delete fails, a fault spent, and it comes
    /// back). `self` is the world with the delivery taken out.
    pub(crate) fn acknowledged(
        self,
        d: &Delivery,
        what: String,
        reached: Option<usize>,
        actor: &str,
        out: &mut Vec<Successor>,
    ) {
        let faults = self.faults;
        let mut s = ok(self.clone(), actor, format!("{what}: message deleted"));
        s.reached = reached;
        out.push(s);
        if faults > 0 {
            let what = format!("{what}: the delete fails, the message comes back");
            out.push(comes_back(self, d.delivered(), actor, what));
        }
    }

    pub(crate) fn crash(&mut self, w: usize) {
        self.workers[w].alive = false;
        let Some(d) = self.workers[w].delivery.take() else {
            return;
        };
        // The command logic is killed with its worker. The message surfaces once the lease
        // pushed before each renewal has expired (standalone: it is kept hidden a margin past
        // the lease), or when its visibility lapses if it holds none.
        // Under Functions the host's message comes back after its 10 minutes, and the watchdog
        // when its visibility lapses (pushed a lease ahead before each renewal).
        let watchdog = d.watchdog.clone().and_then(|x| x.hidden());
        for msg in std::iter::once(d.delivered()).chain(watchdog) {
            let record = &mut self.records[usize::from(d.msg.record)];
            if record.lease == Lease::Held(w as u8) {
                record.parked.push(msg);
                record.parked.sort();
            } else {
                self.put(msg);
            }
        }
        let record = &mut self.records[usize::from(d.msg.record)];
        if record.lease == Lease::Held(w as u8) {
            record.lease = Lease::Orphan;
        }
    }
}

/// The consumer's request that would have ended a delivery (its delete, or its message's update)
/// fails, a fault spent: the message comes back as it was.
pub(crate) fn comes_back(mut world: World, msg: Msg, actor: &str, what: String) -> Successor {
    world.faults -= 1;
    world.put(msg);
    ok(world, actor, what)
}
