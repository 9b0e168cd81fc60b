//! The model: storage (the record's lease with its fencing sequence, the retrigger marker), the
//! queue (messages visible, taken, parked behind a dead holder's lease), the workers (each
//! driving one delivery through the protocol core's [`Machine`], as the runner does) and the
//! environment (triggers from Start, faults, crashes). Every transition is one event of one
//! actor; [`World::successors`] lists all of them, and the checker tries every one.

use leasehold_runtime::TriggerKind;
use leasehold_runtime::protocol::{Answer, End, Facts, Fault, Machine, Request, RunEnd, Step};

/// What a configuration allows.
#[derive(Debug, Clone, Copy)]
pub struct Config {
    pub name: &'static str,
    pub workers: usize,
    pub triggers: u8,
    /// Storage requests that fail (before or after taking effect) or lose their answer.
    pub faults: u8,
    /// Workers that die (at any point between two requests).
    pub crashes: u8,
    /// Runs whose logic fails.
    pub logic_failures: u8,
    /// The record's logic never succeeds (every run fails, without limit): the triggers end in the
    /// poison queue, and what is checked is that the give-ups end.
    pub always_fails: bool,
    /// Runs whose holder loses its lease (cut off from storage).
    pub lost_leases: u8,
    /// The poison limit: a message delivered more often than this is given up.
    pub max_attempts: u8,
    pub fault: Fault,
}

/// A queue message, as far as the protocol's decisions go.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Msg {
    pub kind: Kind,
    /// Deliveries of this message so far.
    pub dequeued: u8,
    /// Failed deliveries carried over from the messages it continues.
    pub prior: u8,
    pub given_up: u8,
}

impl std::fmt::Display for Msg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "a {:?} (delivery {}", self.kind, self.dequeued)?;
        if self.prior > 0 {
            write!(f, ", {} failed before", self.prior)?;
        }
        if self.given_up > 0 {
            write!(f, ", given up {}", self.given_up)?;
        }
        write!(f, ")")
    }
}

/// [`TriggerKind`], ordered (for a canonical queue).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Trigger,
    Retrigger,
    Recheck,
    Sweep,
}

impl Kind {
    fn trigger_kind(self) -> TriggerKind {
        match self {
            Kind::Trigger => TriggerKind::Trigger,
            Kind::Retrigger => TriggerKind::Retrigger,
            Kind::Recheck => TriggerKind::Recheck,
            Kind::Sweep => TriggerKind::Sweep,
        }
    }
}

impl Msg {
    fn new(kind: Kind, prior: u8, given_up: u8) -> Self {
        Self {
            kind,
            dequeued: 0,
            prior,
            given_up,
        }
    }

    fn attempts(&self) -> u8 {
        self.prior + self.dequeued.max(1)
    }
}

/// The record's lease in storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Lease {
    Free,
    /// Held by worker `w`'s delivery, which knows it and renews it while it lives.
    Held(u8),
    /// Held under an id nobody renews (a grant whose answer was lost, a holder that died or gave
    /// up): it expires.
    Orphan,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Delivery {
    pub msg: Msg,
    pub machine: Machine,
    /// What the machine asked for last.
    pub step: Step,
    /// The fencing token of its grant, once granted.
    pub token: Option<u8>,
    /// The run in progress: the triggers sent before it started (bit per trigger).
    pub running: Option<u8>,
    /// How its run ended (`true`: the logic completed).
    pub ran_ok: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Worker {
    pub alive: bool,
    pub delivery: Option<Delivery>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct World {
    pub lease: Lease,
    pub sequence: u8,
    pub marker: bool,
    /// Visible messages (sorted).
    pub queue: Vec<Msg>,
    /// Messages of dead holders, hidden until their lease has expired.
    pub parked: Vec<Msg>,
    pub workers: Vec<Worker>,
    /// Triggers sent so far (bit per trigger), and those covered: a run that started after them
    /// completed.
    pub sent: u8,
    pub covered: u8,
    pub faults: u8,
    pub crashes: u8,
    pub logic_failures: u8,
    pub lost_leases: u8,
    /// The token of the latest run started: the downstream accepts only rising tokens.
    pub last_token: u8,
    /// Runs started so far.
    pub runs: u8,
}

/// One transition, for a counterexample's trace.
#[derive(Debug, Clone)]
pub struct Event {
    pub actor: String,
    pub what: String,
}

/// More give-ups of one chain than any configuration's triggers can cause: the give-up → sweep
/// cycle does not end.
const MAX_GIVE_UPS: u8 = 8;

/// What a check of one state found wrong.
#[derive(Debug, Clone)]
pub enum Violation {
    TwoRuns,
    /// More runs than the triggers sent and the faults spent account for: each trigger causes
    /// at most one run, and each fault at most one run more.
    ExtraRun {
        runs: u8,
        allowed: u8,
    },
    TokenNotRising {
        token: u8,
        last: u8,
    },
    EndlessGiveUps,
}

/// Things the model can reach, for the `sometimes` properties.
pub const SOMETIMES: [&str; 8] = [
    "a trigger coalesced onto a run",
    "a retrigger ran the record again",
    "a carrier looked again",
    "a holder stood down",
    "a trigger was given up and swept",
    "a sweep ran the record",
    "a dead holder's lease expired and its message ran",
    "a run lost its lease",
];

pub struct Successor {
    pub world: World,
    pub event: Event,
    pub violation: Option<Violation>,
    /// Index into [`SOMETIMES`] of what this transition reached, if anything.
    pub reached: Option<usize>,
}

impl World {
    pub fn initial(config: &Config) -> Self {
        Self {
            lease: Lease::Free,
            sequence: 0,
            marker: false,
            queue: Vec::new(),
            parked: Vec::new(),
            workers: vec![
                Worker {
                    alive: true,
                    delivery: None
                };
                config.workers
            ],
            sent: 0,
            covered: 0,
            faults: config.faults,
            crashes: config.crashes,
            logic_failures: config.logic_failures,
            lost_leases: config.lost_leases,
            last_token: 0,
            runs: 0,
        }
    }

    /// Whether every trigger sent is honoured: covered by a run. (With logic that always fails
    /// nothing is covered; what is checked then is that the give-ups end.)
    pub fn honoured(&self, config: &Config) -> bool {
        config.always_fails || self.sent & !self.covered == 0
    }

    pub fn successors(&self, config: &Config) -> Vec<Successor> {
        let mut out = Vec::new();
        // Start sends the next trigger.
        let sent = self.sent.count_ones() as u8;
        if sent < config.triggers {
            let mut next = self.clone();
            next.sent |= 1 << sent;
            next.put(Msg::new(Kind::Trigger, 0, 0));
            out.push(ok(next, "start", format!("trigger #{sent} enqueued")));
        }
        // A lease nobody renews expires; the messages parked behind it surface.
        if self.lease == Lease::Orphan {
            let mut next = self.clone();
            next.lease = Lease::Free;
            let parked = std::mem::take(&mut next.parked);
            let reached = (!parked.is_empty()).then_some(6);
            for m in parked {
                next.put(m);
            }
            let mut s = ok(next, "storage", "the unrenewed lease expires".into());
            s.reached = reached;
            out.push(s);
        }
        for w in 0..self.workers.len() {
            self.worker_successors(config, w, &mut out);
        }
        out
    }

    /// Faults, crashes, failed runs and lost leases spent so far.
    fn spent(&self, config: &Config) -> u8 {
        (config.faults - self.faults)
            + (config.crashes - self.crashes)
            + (config.logic_failures - self.logic_failures)
            + (config.lost_leases - self.lost_leases)
    }

    /// Renumbers the fencing tokens by rank: only their order matters (the downstream accepts a
    /// run's writes if its token rises above the last), and without this a schedule that grants
    /// forever without running (two contenders standing down for each other, round after round)
    /// would make the state space infinite instead of a cycle.
    pub fn normalise(&mut self) {
        let mut tokens: Vec<u8> = vec![self.sequence, self.last_token];
        tokens.extend(self.workers.iter().filter_map(|w| w.delivery.as_ref()?.token));
        tokens.sort_unstable();
        tokens.dedup();
        let rank = |t: u8| tokens.iter().position(|&x| x == t).unwrap() as u8;
        // Token 0 ("no run yet") stays 0.
        let shift = u8::from(tokens[0] != 0);
        self.sequence = rank(self.sequence) + shift;
        self.last_token = if self.last_token == 0 {
            0
        } else {
            rank(self.last_token) + shift
        };
        for w in &mut self.workers {
            if let Some(d) = &mut w.delivery
                && let Some(t) = &mut d.token
            {
                *t = rank(*t) + shift;
            }
        }
    }

    fn put(&mut self, m: Msg) {
        let at = self.queue.partition_point(|q| q <= &m);
        self.queue.insert(at, m);
    }

    fn worker_successors(&self, config: &Config, w: usize, out: &mut Vec<Successor>) {
        let worker = &self.workers[w];
        if !worker.alive {
            return;
        }
        let actor = format!("w{w}");
        // A crash between any two requests of a delivery, or while it runs.
        if self.crashes > 0 && worker.delivery.is_some() {
            let mut next = self.clone();
            next.crashes -= 1;
            next.crash(w);
            out.push(ok(next, &actor, "dies".into()));
        }
        let Some(delivery) = &worker.delivery else {
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
                if msg.attempts() > config.max_attempts {
                    // Given up: its poison entry, then a sweep, then the message deleted.
                    if msg.given_up >= MAX_GIVE_UPS {
                        // A chain of give-ups that does not end: a state space without end too.
                        let mut s = ok(next, &actor, format!("takes {msg}: given up once more"));
                        s.violation = Some(Violation::EndlessGiveUps);
                        out.push(s);
                        continue;
                    }
                    next.put(Msg::new(Kind::Sweep, 0, msg.given_up + 1));
                    let mut s = ok(next, &actor, format!("takes {msg}: given up, a sweep is put"));
                    s.reached = Some(4);
                    out.push(s);
                    continue;
                }
                let facts = Facts {
                    kind: msg.kind.trigger_kind(),
                    redelivered: msg.dequeued > 1,
                    given_up: u32::from(msg.given_up),
                    watched: false,
                };
                let (machine, step) = Machine::start(facts, config.fault);
                let what = format!("takes {msg}");
                next.workers[w].delivery = Some(Delivery {
                    msg,
                    machine,
                    step,
                    token: None,
                    running: None,
                    ran_ok: None,
                });
                out.push(ok(next, &actor, what));
            }
            return;
        };
        match delivery.step {
            Step::Send(request) => self.request(w, request, &actor, out),
            Step::Run => match delivery.running {
                None => {
                    // The logic starts.
                    let mut next = self.clone();
                    let token = delivery.token.expect("a run has a token");
                    let others = self.workers.iter().enumerate().any(|(o, x)| {
                        o != w && x.alive && x.delivery.as_ref().is_some_and(|d| d.running.is_some())
                    });
                    let allowed = self.sent.count_ones() as u8 + self.spent(config);
                    let violation = if others {
                        Some(Violation::TwoRuns)
                    } else if self.runs >= allowed && !config.always_fails {
                        Some(Violation::ExtraRun {
                            runs: self.runs + 1,
                            allowed,
                        })
                    } else if token <= self.last_token {
                        Some(Violation::TokenNotRising {
                            token,
                            last: self.last_token,
                        })
                    } else {
                        None
                    };
                    next.last_token = token;
                    next.runs += 1;
                    let d = next.workers[w].delivery.as_mut().unwrap();
                    d.running = Some(self.sent);
                    let reached = match d.msg.kind {
                        Kind::Retrigger => Some(1),
                        Kind::Sweep => Some(5),
                        _ => None,
                    };
                    out.push(Successor {
                        world: next,
                        event: Event {
                            actor,
                            what: format!("the logic starts (token {token})"),
                        },
                        violation,
                        reached,
                    });
                }
                Some(before) => {
                    let ended = |next: &mut World, ok: bool| {
                        let d = next.workers[w].delivery.as_mut().unwrap();
                        d.running = None;
                        d.ran_ok = Some(ok);
                        d.step = d.machine.on(Answer::RunEnded(RunEnd::Ran));
                    };
                    if config.always_fails {
                        let mut next = self.clone();
                        ended(&mut next, false);
                        out.push(ok(next, &actor, "the logic fails".into()));
                    } else {
                        let mut next = self.clone();
                        next.covered |= before;
                        ended(&mut next, true);
                        out.push(ok(next, &actor, "the logic completes".into()));
                    }
                    if self.logic_failures > 0 && !config.always_fails {
                        let mut next = self.clone();
                        next.logic_failures -= 1;
                        ended(&mut next, false);
                        out.push(ok(next, &actor, "the logic fails".into()));
                    }
                    if self.lost_leases > 0 && self.lease == Lease::Held(w as u8) {
                        // Told 10 s before storage could let it expire, the logic stopped within
                        // its grace: by the time anyone else can acquire, it has ended.
                        let mut next = self.clone();
                        next.lost_leases -= 1;
                        next.lease = Lease::Free;
                        ended(&mut next, false);
                        let mut s = ok(next, &actor, "loses its lease; the logic is stopped".into());
                        s.reached = Some(7);
                        out.push(s);
                    }
                }
            },
            Step::Done(end) => self.finish(w, end, &actor, out),
        }
    }

    /// The consumer's handling of a delivery's end (standalone, as `Consumer` does).
    fn finish(&self, w: usize, end: End, actor: &str, out: &mut Vec<Successor>) {
        let delivery = self.workers[w].delivery.as_ref().unwrap();
        let acknowledge = match end {
            End::Coalesced | End::LookAgain => true,
            End::Ran { .. } => delivery.ran_ok == Some(true),
            End::CarriedOn { .. } | End::StillRunning => unreachable!("not in this model"),
            End::StorageFailed { .. } => false,
        };
        let reached = match end {
            End::Coalesced if delivery.token.is_some() => Some(3),
            End::Coalesced => Some(0),
            End::LookAgain => Some(2),
            _ => None,
        };
        let mut next = self.clone();
        let d = next.workers[w].delivery.take().unwrap();
        if next.lease == Lease::Held(w as u8) {
            // The guard is dropped without a release: nobody renews the lease.
            next.lease = Lease::Orphan;
        }
        if acknowledge {
            let mut s = ok(next.clone(), actor, format!("ends {end:?}: message deleted"));
            s.reached = reached;
            out.push(s);
            if self.faults > 0 {
                // The delete fails: the message comes back.
                next.faults -= 1;
                next.put(d.msg);
                out.push(ok(
                    next,
                    actor,
                    format!("ends {end:?}: the delete fails, the message comes back"),
                ));
            }
        } else {
            next.put(d.msg);
            out.push(ok(
                next,
                actor,
                format!("ends {end:?}: the message comes back for a retry"),
            ));
        }
    }

    fn crash(&mut self, w: usize) {
        self.workers[w].alive = false;
        let Some(d) = self.workers[w].delivery.take() else {
            return;
        };
        // The command logic is killed with its worker. The message surfaces once the lease
        // pushed before each renewal has expired (standalone: it is kept hidden a margin past
        // the lease), or when its visibility lapses if it holds none.
        if self.lease == Lease::Held(w as u8) {
            self.lease = Lease::Orphan;
            self.parked.push(d.msg);
            self.parked.sort();
        } else {
            self.put(d.msg);
        }
    }

    /// Every way storage may answer `request` from worker `w`.
    fn request(&self, w: usize, request: Request, actor: &str, out: &mut Vec<Successor>) {
        let me = w as u8;
        // (effect, answer, a fault spent, what)
        let mut ways: Vec<(World, Answer, String)> = Vec::new();
        let faulty = self.faults > 0;
        let spend = |world: &World| {
            let mut x = world.clone();
            x.faults -= 1;
            x
        };
        match request {
            Request::Acquire => {
                let mut granted = self.clone();
                let free = matches!(self.lease, Lease::Free) || self.lease == Lease::Held(me);
                if free {
                    granted.lease = Lease::Held(me);
                    granted.sequence += 1;
                    let token = granted.sequence;
                    granted.workers[w].delivery.as_mut().unwrap().token = Some(token);
                    ways.push((
                        granted,
                        Answer::Granted,
                        format!("acquire: granted, token {token}"),
                    ));
                    if faulty {
                        let mut landed = spend(self);
                        landed.lease = Lease::Orphan;
                        landed.sequence += 1;
                        ways.push((
                            landed,
                            Answer::Failed,
                            "acquire: granted, but the answer is lost".into(),
                        ));
                    }
                } else {
                    ways.push((self.clone(), Answer::Held, "acquire: held".into()));
                }
                if faulty {
                    ways.push((spend(self), Answer::Failed, "acquire: fails".into()));
                }
            }
            Request::SetMarker | Request::TakeMarker { .. } => {
                let set = request == Request::SetMarker;
                let name = if set { "set marker" } else { "take marker" };
                let mut after = self.clone();
                let changed = after.marker != set;
                after.marker = set;
                ways.push((
                    after.clone(),
                    Answer::Marker {
                        changed,
                        retried: false,
                    },
                    format!("{name}: changed {changed}"),
                ));
                if faulty {
                    ways.push((
                        spend(&after),
                        Answer::Marker {
                            changed: false,
                            retried: true,
                        },
                        format!("{name}: landed, answer lost; the retry: unchanged"),
                    ));
                    ways.push((
                        spend(&after),
                        Answer::Marker {
                            changed,
                            retried: true,
                        },
                        format!("{name}: first attempt failed; the retry: changed {changed}"),
                    ));
                    ways.push((
                        spend(&after),
                        Answer::Failed,
                        format!("{name}: landed, then every retry fails"),
                    ));
                    ways.push((spend(self), Answer::Failed, format!("{name}: fails")));
                }
            }
            Request::Release => {
                if self.lease == Lease::Held(me) {
                    let mut after = self.clone();
                    after.lease = Lease::Free;
                    ways.push((after.clone(), Answer::Done, "release".into()));
                    if faulty {
                        ways.push((
                            spend(&after),
                            Answer::Failed,
                            "release: landed, answer lost".into(),
                        ));
                        ways.push((spend(self), Answer::Failed, "release: fails".into()));
                    }
                } else {
                    ways.push((
                        self.clone(),
                        Answer::Failed,
                        "release: the lease is not ours".into(),
                    ));
                }
            }
            Request::PutRetrigger | Request::PutLookAgain => {
                let d = self.workers[w].delivery.as_ref().unwrap();
                let m = if request == Request::PutRetrigger {
                    Msg::new(Kind::Retrigger, 0, 0)
                } else {
                    let kind = match d.msg.kind {
                        Kind::Sweep if d.msg.dequeued > 1 => Kind::Recheck,
                        Kind::Recheck | Kind::Sweep => d.msg.kind,
                        _ => Kind::Recheck,
                    };
                    Msg::new(kind, d.msg.attempts() - 1, d.msg.given_up)
                };
                let mut after = self.clone();
                after.put(m.clone());
                ways.push((after.clone(), Answer::Done, format!("put {m}")));
                if faulty {
                    ways.push((
                        spend(&after),
                        Answer::Failed,
                        format!("put {m}: landed, answer lost"),
                    ));
                    ways.push((spend(self), Answer::Failed, format!("put {m}: fails")));
                }
            }
        }
        for (mut world, answer, what) in ways {
            let d = world.workers[w].delivery.as_mut().unwrap();
            d.step = d.machine.on(answer);
            out.push(ok(world, actor, what));
        }
    }
}

fn ok(world: World, actor: &str, what: String) -> Successor {
    Successor {
        world,
        event: Event {
            actor: actor.to_string(),
            what,
        },
        violation: None,
        reached: None,
    }
}
