//! The model: storage (the record's lease with its fencing sequence, the retrigger marker), the
//! queue (messages visible, taken, parked behind a dead holder's lease), the workers (each
//! driving one delivery through the protocol core's [`Machine`], as the runner does) and the
//! environment (triggers from Start, faults, crashes). Every transition is one event of one
//! actor; [`World::successors`] lists all of them, and the checker tries every one.

use leasehold_runtime::TriggerKind;
use leasehold_runtime::protocol::release::CHECK_MARKER;
use leasehold_runtime::protocol::supersede::RunResult;
use leasehold_runtime::protocol::{Answer, End, Facts, Fault, Machine, Request, Step};

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
    /// Runs whose logic asks to be run later.
    pub ask_later: u8,
    /// The scope supersedes: a run is stopped for a trigger that arrived during it, and a retry
    /// carries its run's token (`afterToken`), standing down if a later run took its duty over.
    pub supersede: bool,
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
    /// Supersede: the token of the run whose retry or deferral this is.
    pub after_token: Option<u8>,
    /// A run's deferral (run later).
    pub deferred: bool,
}

impl std::fmt::Display for Msg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = if self.deferred {
            "deferral".to_string()
        } else {
            format!("{:?}", self.kind)
        };
        write!(f, "a {kind} (delivery {}", self.dequeued)?;
        if self.prior > 0 {
            write!(f, ", {} failed before", self.prior)?;
        }
        if self.given_up > 0 {
            write!(f, ", given up {}", self.given_up)?;
        }
        if let Some(t) = self.after_token {
            write!(f, ", after token {t}")?;
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
    pub(crate) fn new(kind: Kind, prior: u8, given_up: u8) -> Self {
        Self {
            kind,
            dequeued: 0,
            prior,
            given_up,
            after_token: None,
            deferred: false,
        }
    }

    pub(crate) fn attempts(&self) -> u8 {
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
    /// Supersede: the `pending` note read at the grant, once read.
    pub notes: Option<Option<u8>>,
    /// The run in progress: the triggers sent before it started (bit per trigger).
    pub running: Option<u8>,
    /// How its run ended, once it has.
    pub result: Option<RunResult>,
    /// The `pending` note to write before the release, with the token its retry carries if the
    /// write succeeds and if it does not.
    pub noting: Option<Noting>,
    /// The token its retry or deferral carries.
    pub after_token: Option<u8>,
    /// Its run's decisions are made: from the release on, a storage failure hands no token on.
    pub after_run: bool,
    /// It stood down for a later run (supersede).
    pub stood_down: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Noting {
    pub note: Option<u8>,
    pub if_written: Option<u8>,
    pub if_not: Option<u8>,
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
    /// Supersede: the lock blob's `pending` note (the token of a run whose retry pends).
    pub pending: Option<u8>,
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
    pub ask_later: u8,
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
pub const SOMETIMES: [&str; 11] = [
    "a trigger coalesced onto a run",
    "a retrigger ran the record again",
    "a carrier looked again",
    "a holder stood down",
    "a trigger was given up and swept",
    "a sweep ran the record",
    "a dead holder's lease expired and its message ran",
    "a run lost its lease",
    "a run was superseded by a trigger that arrived during it",
    "a run was put off and its deferral ran",
    "a retry stood down for a later run that took its duty over",
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
            pending: None,
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
            ask_later: config.ask_later,
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
    pub(crate) fn spent(&self, config: &Config) -> u8 {
        (config.faults - self.faults)
            + (config.crashes - self.crashes)
            + (config.logic_failures - self.logic_failures)
            + (config.lost_leases - self.lost_leases)
            + (config.ask_later - self.ask_later)
    }

    /// Renumbers the fencing tokens by rank: only their order matters (the downstream accepts a
    /// run's writes if its token rises above the last), and without this a schedule that grants
    /// forever without running (two contenders standing down for each other, round after round)
    /// would make the state space infinite instead of a cycle.
    pub fn normalise(&mut self) {
        let mut tokens: Vec<u8> = Vec::new();
        self.each_token(|t| tokens.push(*t));
        tokens.push(0);
        tokens.sort_unstable();
        tokens.dedup();
        // Token 0 ("none yet") stays 0; the others by rank from 1.
        self.each_token(|t| *t = tokens.iter().position(|x| x == t).unwrap() as u8);
    }

    /// Every fencing token the state holds.
    fn each_token(&mut self, mut f: impl FnMut(&mut u8)) {
        f(&mut self.sequence);
        f(&mut self.last_token);
        if let Some(t) = &mut self.pending {
            f(t);
        }
        let queued = self.queue.iter_mut().chain(self.parked.iter_mut());
        for t in queued.filter_map(|m| m.after_token.as_mut()) {
            f(t);
        }
        for d in self.workers.iter_mut().filter_map(|w| w.delivery.as_mut()) {
            let noting = d
                .noting
                .as_mut()
                .map(|n| [n.note.as_mut(), n.if_written.as_mut(), n.if_not.as_mut()]);
            let tokens = [
                d.token.as_mut(),
                d.notes.as_mut().and_then(|n| n.as_mut()),
                d.after_token.as_mut(),
                d.msg.after_token.as_mut(),
            ];
            for t in tokens.into_iter().chain(noting.into_iter().flatten()).flatten() {
                f(t);
            }
        }
    }

    pub(crate) fn put(&mut self, m: Msg) {
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
                    notes: None,
                    running: None,
                    result: None,
                    noting: None,
                    after_token: None,
                    after_run: false,
                    stood_down: false,
                });
                out.push(ok(next, &actor, what));
            }
            return;
        };
        match delivery.step {
            Step::Send(request) => self.request(w, request, &actor, out),
            Step::Run => self.run_successors(config, w, &actor, out),
            Step::Done(end) => self.finish(w, end, &actor, out),
        }
    }

    /// The consumer's handling of a delivery's end (standalone, as `Consumer` does).
    fn finish(&self, w: usize, end: End, actor: &str, out: &mut Vec<Successor>) {
        let mut next = self.clone();
        let d = next.workers[w].delivery.take().unwrap();
        if next.lease == Lease::Held(w as u8) {
            // The guard is dropped without a release: nobody renews the lease.
            next.lease = Lease::Orphan;
        }
        let reached = match end {
            End::Coalesced if d.stood_down => Some(10),
            End::Coalesced if d.token.is_some() => Some(3),
            End::Coalesced => Some(0),
            End::LookAgain => Some(2),
            _ => None,
        };
        // What comes back if the message is not acknowledged: the message as it was, carrying
        // the token its delivery leaves (the runner's `Ended::after_token`).
        let mut retry = d.msg.clone();
        let acknowledge = match end {
            End::Coalesced | End::LookAgain => true,
            End::Ran { .. } => match d.result {
                Some(RunResult::Completed | RunResult::Superseded) => true,
                _ => {
                    retry.after_token = d.after_token;
                    false
                }
            },
            End::CarriedOn { joined } => {
                // The deferral, written over the message in one update (`persist_in_place`).
                let mut deferral = Msg::new(Kind::Recheck, d.msg.attempts() - 1, d.msg.given_up);
                deferral.deferred = true;
                if joined {
                    deferral.given_up = 0;
                } else {
                    deferral.after_token = d.after_token;
                }
                next.put(deferral.clone());
                let mut s = ok(
                    next.clone(),
                    actor,
                    format!("ends {end:?}: the message becomes {deferral}"),
                );
                s.reached = reached;
                out.push(s);
                if self.faults > 0 {
                    // The update fails: the message comes back as it was, and runs early.
                    let mut failed = self.clone();
                    let d = failed.workers[w].delivery.take().unwrap();
                    failed.faults -= 1;
                    failed.put(d.msg);
                    out.push(ok(
                        failed,
                        actor,
                        format!("ends {end:?}: the update fails, the message comes back"),
                    ));
                }
                return;
            }
            End::StillRunning => unreachable!("not in this model"),
            End::StorageFailed { step } => {
                if d.after_run || (d.stood_down && step == CHECK_MARKER) {
                    retry.after_token = None;
                }
                false
            }
        };
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
            let what = format!("ends {end:?}: {retry} comes back for a retry");
            next.put(retry);
            out.push(ok(next, actor, what));
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

pub(crate) fn ok(world: World, actor: &str, what: String) -> Successor {
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
