//! The model: storage (each record's lease with its fencing sequence, its retrigger marker and
//! notes; a downstream budget's pause), the queue (messages visible, taken, parked behind a dead
//! holder's lease, handed back until a pause ends), the workers (each a slot of a consumer
//! process driving one delivery through the protocol core's [`Machine`], as the runner does; with
//! a budget, as many seats of the process's waiting room) and the environment (triggers from
//! Start, faults, crashes, throttles). Every transition is one event of one
//! actor; [`World::successors`] lists all of them, and the checker tries every one.

use leasehold_runtime::TriggerKind;
use leasehold_runtime::protocol::release::CHECK_MARKER;
use leasehold_runtime::protocol::supersede::RunResult;
use leasehold_runtime::protocol::{Answer, End, Facts, Fault, Machine, Request, Step};
use leasehold_runtime::protocol::{budget, carriers};

/// What a configuration allows.
#[derive(Debug, Clone, Copy)]
pub struct Config {
    pub name: &'static str,
    /// Consumer processes, each with this many slots (deliveries at once).
    pub processes: &'static [u8],
    /// Records, and the triggers Start sends for each.
    pub records: u8,
    pub triggers: u8,
    /// Times a throttle pauses the records' downstream budget (each pause short enough to be
    /// waited out under a lease); with it, each process has a waiting room of as many seats as
    /// it has slots.
    pub pauses: u8,
    /// Storage requests that fail (before or after taking effect) or lose their answer.
    pub faults: u8,
    /// Processes that die (at any point between two requests of one of their deliveries).
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
    /// The scope debounces: a trigger waits for its record's burst to end (a wait marker, its
    /// waiter), and a possible stand-in consumes a marker its dead creator left.
    pub debounce: bool,
    /// Functions mode: a host takes each message (and keeps it hidden while its handler lives,
    /// counting its own dequeues); each delivery puts a watchdog first, which carries its duty if
    /// the host dies, and is deleted or rewritten into its retry, look again or follow-up.
    pub functions: bool,
    /// Functions: times a delivery's watchdog surfaces while the delivery still lives (it went a
    /// lease's time without a grant), and another instance takes it.
    pub lapses: u8,
    /// The poison limit: a message delivered more often than this is given up.
    pub max_attempts: u8,
    pub fault: Fault,
}

/// A queue message, as far as the protocol's decisions go.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Msg {
    pub record: u8,
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
    /// A dead holder's message, surfaced once its lease expired and not yet taken again.
    pub orphaned: bool,
    /// Debounce: the message is a waiter (or a carrier marked as one).
    pub wait: Option<Wait>,
}

/// A waiter's wait, as its message carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Wait {
    /// The wait marker's ETag it saw last, if known.
    pub etag: Option<u8>,
    /// Quiet periods waited so far.
    pub waited: u8,
    /// An earlier wake's consume may have consumed the marker.
    pub owed: bool,
}

impl std::fmt::Display for Msg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = if self.deferred {
            "deferral".to_string()
        } else {
            format!("{:?}", self.kind)
        };
        write!(f, "r{}: a {kind} (delivery {}", self.record, self.dequeued)?;
        if self.prior > 0 {
            write!(f, ", {} failed before", self.prior)?;
        }
        if self.given_up > 0 {
            write!(f, ", given up {}", self.given_up)?;
        }
        if let Some(t) = self.after_token {
            write!(f, ", after token {t}")?;
        }
        if let Some(w) = self.wait {
            write!(
                f,
                ", a waiter: etag {:?}, waited {}, owed {}",
                w.etag, w.waited, w.owed
            )?;
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
    /// Functions: a delivery's watchdog, or what it was rewritten into as its retry.
    Watchdog,
}

impl Kind {
    pub(crate) fn trigger_kind(self) -> TriggerKind {
        match self {
            Kind::Trigger => TriggerKind::Trigger,
            Kind::Retrigger => TriggerKind::Retrigger,
            Kind::Recheck => TriggerKind::Recheck,
            Kind::Sweep => TriggerKind::Sweep,
            Kind::Watchdog => TriggerKind::Watchdog,
        }
    }
}

impl Msg {
    pub(crate) fn new(record: u8, kind: Kind, prior: u8, given_up: u8) -> Self {
        Self {
            record,
            kind,
            dequeued: 0,
            prior,
            given_up,
            after_token: None,
            deferred: false,
            orphaned: false,
            wait: None,
        }
    }

    pub(crate) fn attempts(&self) -> u8 {
        self.prior + self.dequeued.max(1)
    }

    /// Whether its delivery may stand in for a dead holder (never held by a budget's pause).
    pub(crate) fn may_stand_in(&self) -> bool {
        budget::may_stand_in(self.kind.trigger_kind(), self.dequeued > 1, self.deferred)
    }

    /// What the protocol core is told of its delivery (`watched`: under Functions).
    pub(crate) fn facts(&self, watched: bool) -> Facts {
        Facts {
            kind: self.kind.trigger_kind(),
            redelivered: self.dequeued > 1,
            given_up: u32::from(self.given_up),
            watched,
        }
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
    /// It waited at its budget's gate (it takes the marker before its run).
    pub waited: bool,
    /// A paused budget handed it back before its run.
    pub handed_back: bool,
    /// Its message is a dead holder's, taken again once the lease expired (with a budget).
    pub for_the_dead: bool,
    /// Its debounce step, while it lasts.
    pub debouncing: Option<crate::debounce::Debouncing>,
    /// The queue message as delivered, if it carries on as another (after its debounce step):
    /// what comes back if the consumer's delete fails or its process dies.
    pub queued: Option<Msg>,
    /// Functions: its watchdog.
    pub watchdog: Option<crate::functions::Watch>,
}

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

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Noting {
    pub note: Option<u8>,
    pub if_written: Option<u8>,
    pub if_not: Option<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Worker {
    pub alive: bool,
    /// Its process.
    pub process: u8,
    /// A seat of the process's waiting room: it only ever holds a delivery parked there.
    pub seat: bool,
    pub delivery: Option<Delivery>,
}

/// One record in storage, and what the checks know of it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Record {
    pub lease: Lease,
    pub sequence: u8,
    /// Supersede: the lock blob's `pending` note (the token of a run whose retry pends).
    pub pending: Option<u8>,
    pub marker: bool,
    /// Debounce: the wait marker's ETag, if there is one, and the ETags handed out so far.
    pub wait: Option<u8>,
    pub etags: u8,
    /// Messages of dead holders, hidden until the lease has expired.
    pub parked: Vec<Msg>,
    /// Triggers sent so far (bit per trigger), and those covered: a run that started after them
    /// completed.
    pub sent: u8,
    pub covered: u8,
    /// The token of the latest run started: the downstream accepts only rising tokens.
    pub last_token: u8,
    /// Runs started so far.
    pub runs: u8,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct World {
    pub records: Vec<Record>,
    /// Visible messages (sorted).
    pub queue: Vec<Msg>,
    pub workers: Vec<Worker>,
    /// The downstream budget is paused, and the throttles left to pause it.
    pub paused: bool,
    pub pauses: u8,
    /// Messages handed back by the pause, hidden until it ends.
    pub held_back: Vec<Msg>,
    pub faults: u8,
    pub crashes: u8,
    pub logic_failures: u8,
    pub lost_leases: u8,
    pub ask_later: u8,
    pub lapses: u8,
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
    /// A delivery standing in for a dead holder is held by the budget's pause.
    StandInHeld,
}

/// What a backward search over the explored graph found wrong (see `check`).
pub const STARVED: &str = "a dead holder's message waits for the budget's pause to end: no slot of a live consumer can take it before";

/// Things the model can reach, for the `sometimes` properties.
pub const SOMETIMES: [&str; 21] = [
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
    "a holder waited out a pause in a seat of the waiting room",
    "a paused budget handed a trigger back",
    "a dead holder's message was taken during a pause",
    "a trigger joined a burst that waits for quiet",
    "a waiter waited another quiet period: a trigger joined since its last look",
    "a waiter consumed its wait marker and carried on to run the record",
    "a possible stand-in consumed a wait marker its creator left",
    "a watchdog (a dead handler's, or a failed run's retry) ran the record",
    "a failed run's watchdog became its retry",
    "a watchdog surfaced while its delivery still lived",
];

pub struct Successor {
    pub world: World,
    pub event: Event,
    pub violation: Option<Violation>,
    /// Index into [`SOMETIMES`] of what this transition reached, if anything.
    pub reached: Option<usize>,
    /// The budget's pause ends (the bound on recovery must not depend on it).
    pub pause_ends: bool,
}

impl World {
    pub fn initial(config: &Config) -> Self {
        let record = Record {
            lease: Lease::Free,
            sequence: 0,
            pending: None,
            marker: false,
            wait: None,
            etags: 0,
            parked: Vec::new(),
            sent: 0,
            covered: 0,
            last_token: 0,
            runs: 0,
        };
        let mut workers = Vec::new();
        for (p, &slots) in config.processes.iter().enumerate() {
            let seats = if config.pauses > 0 { slots } else { 0 };
            for seat in
                std::iter::repeat_n(false, slots.into()).chain(std::iter::repeat_n(true, seats.into()))
            {
                workers.push(Worker {
                    alive: true,
                    process: p as u8,
                    seat,
                    delivery: None,
                });
            }
        }
        Self {
            records: vec![record; config.records.into()],
            queue: Vec::new(),
            workers,
            paused: false,
            pauses: config.pauses,
            held_back: Vec::new(),
            faults: config.faults,
            crashes: config.crashes,
            logic_failures: config.logic_failures,
            lost_leases: config.lost_leases,
            ask_later: config.ask_later,
            lapses: config.lapses,
        }
    }

    /// The record worker `w`'s delivery is for.
    pub(crate) fn record_of(&self, w: usize) -> usize {
        self.workers[w].delivery.as_ref().unwrap().msg.record.into()
    }

    /// What is wrong with an end, if anything: a trigger sent and not covered by a run (with
    /// logic that always fails nothing is covered; what is checked then is that the give-ups
    /// end), or a wait marker left (one left has no waiter, and a trigger that joined it would be
    /// lost).
    pub fn unhonoured(&self, config: &Config) -> Option<&'static str> {
        if !config.always_fails && self.records.iter().any(|r| r.sent & !r.covered != 0) {
            Some(
                "nothing more can happen, and a trigger was never followed by a completed run that started after it",
            )
        } else if self.records.iter().any(|r| r.wait.is_some()) {
            Some(
                "nothing more can happen, and a wait marker is left that nobody waits for: a trigger that joins it is lost",
            )
        } else {
            None
        }
    }

    /// Whether a dead holder's message waits in the queue while the budget is paused.
    pub fn starving(&self) -> bool {
        self.paused && self.queue.iter().any(|m| m.orphaned)
    }

    pub fn successors(&self, config: &Config) -> Vec<Successor> {
        let mut out = Vec::new();
        for (r, record) in self.records.iter().enumerate() {
            // Start sends the record's next trigger.
            let sent = record.sent.count_ones() as u8;
            if sent < config.triggers {
                let mut next = self.clone();
                next.records[r].sent |= 1 << sent;
                next.put(Msg::new(r as u8, Kind::Trigger, 0, 0));
                out.push(ok(next, "start", format!("r{r}: trigger #{sent} enqueued")));
            }
            // A lease nobody renews expires; the messages parked behind it surface.
            if record.lease == Lease::Orphan {
                let mut next = self.clone();
                next.records[r].lease = Lease::Free;
                let parked = std::mem::take(&mut next.records[r].parked);
                let reached = (!parked.is_empty()).then_some(6);
                for mut m in parked {
                    // Marked only where the property that needs it is checked (it adds states).
                    m.orphaned = config.pauses > 0;
                    next.put(m);
                }
                let mut s = ok(next, "storage", format!("r{r}: the unrenewed lease expires"));
                s.reached = reached;
                out.push(s);
            }
        }
        if self.paused {
            let mut next = self.clone();
            next.paused = false;
            for m in std::mem::take(&mut next.held_back) {
                next.put(m);
            }
            let mut s = ok(next, "budget", "the pause ends".into());
            s.pause_ends = true;
            out.push(s);
        } else if self.pauses > 0 {
            let mut next = self.clone();
            next.pauses -= 1;
            next.paused = true;
            out.push(ok(next, "budget", "a throttle pauses the budget".into()));
        }
        for w in 0..self.workers.len() {
            self.worker_successors(config, w, &mut out);
        }
        out
    }

    /// Faults, crashes, failed runs and lost leases spent so far. Under Functions a crash counts
    /// twice: the dead handler's duty has two carriers, its watchdog (after the lease) and the
    /// host's redelivery (after the host's 10 minutes), and each may run the record.
    pub(crate) fn spent(&self, config: &Config) -> u8 {
        let crash = if config.functions { 2 } else { 1 };
        (config.faults - self.faults)
            + crash * (config.crashes - self.crashes)
            + (config.logic_failures - self.logic_failures)
            + (config.lost_leases - self.lost_leases)
            + (config.ask_later - self.ask_later)
            + (config.lapses - self.lapses)
    }

    /// A free seat of worker `w`'s process's waiting room, if one is.
    pub(crate) fn free_seat(&self, w: usize) -> Option<usize> {
        let process = self.workers[w].process;
        self.workers
            .iter()
            .position(|x| x.alive && x.seat && x.process == process && x.delivery.is_none())
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
        for record in &mut self.records {
            f(&mut record.sequence);
            f(&mut record.last_token);
            if let Some(t) = &mut record.pending {
                f(t);
            }
            for t in record.parked.iter_mut().filter_map(|m| m.after_token.as_mut()) {
                f(t);
            }
        }
        let queued = self.queue.iter_mut().chain(self.held_back.iter_mut());
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
                d.queued.as_mut().and_then(|m| m.after_token.as_mut()),
                d.watchdog.as_mut().and_then(|w| w.after_token()),
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
        // A crash of its process between any two requests of a delivery, or while it runs.
        if self.crashes > 0 && worker.delivery.is_some() {
            let mut next = self.clone();
            next.crashes -= 1;
            let process = worker.process;
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

    fn crash(&mut self, w: usize) {
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

    /// Every way storage may answer `request` from worker `w`.
    fn request(&self, w: usize, request: Request, actor: &str, out: &mut Vec<Successor>) {
        let me = w as u8;
        let r = self.record_of(w);
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
                let lease = self.records[r].lease;
                let free = matches!(lease, Lease::Free) || lease == Lease::Held(me);
                if free {
                    granted.records[r].lease = Lease::Held(me);
                    granted.records[r].sequence += 1;
                    let token = granted.records[r].sequence;
                    granted.workers[w].delivery.as_mut().unwrap().token = Some(token);
                    ways.push((
                        granted,
                        Answer::Granted,
                        format!("acquire: granted, token {token}"),
                    ));
                    if faulty {
                        let mut landed = spend(self);
                        landed.records[r].lease = Lease::Orphan;
                        landed.records[r].sequence += 1;
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
                let changed = after.records[r].marker != set;
                after.records[r].marker = set;
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
                if self.records[r].lease == Lease::Held(me) {
                    let mut after = self.clone();
                    after.records[r].lease = Lease::Free;
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
                    Msg::new(d.msg.record, Kind::Retrigger, 0, 0)
                } else {
                    d.look_again()
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

/// The consumer's request that would have ended a delivery (its delete, or its message's update)
/// fails, a fault spent: the message comes back as it was.
pub(crate) fn comes_back(mut world: World, msg: Msg, actor: &str, what: String) -> Successor {
    world.faults -= 1;
    world.put(msg);
    ok(world, actor, what)
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
        pause_ends: false,
    }
}
