//! The model: storage (each record's lease with its fencing sequence, its retrigger marker and
//! notes; a downstream budget's pause), the queue (messages visible, taken, parked behind a dead
//! holder's lease, handed back until a pause ends), the workers (each a slot of a consumer
//! process driving one delivery through the protocol core's [`Machine`], as the runner does; with
//! a budget, as many seats of the process's waiting room) and the environment (triggers from
//! Start, faults, crashes, throttles). Every transition is one event of one
//! actor; [`World::successors`] lists all of them, and the checker tries every one.
//!
//! This file holds the state and the environment's events; a worker's are in `consumer.rs`
//! (take, end, crash), `storage.rs` (the answers to the lock protocol's requests), `run.rs` (the
//! hold between grant and release), `debounce.rs` and `functions.rs`.

use leasehold_runtime::TriggerKind;
use leasehold_runtime::protocol::budget;
use leasehold_runtime::protocol::supersede::RunResult;
use leasehold_runtime::protocol::{Facts, Fault, Machine, Step};

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
    /// waited out under a lease); with it (or a limit), each process has a waiting room of as
    /// many seats as it has slots.
    pub pauses: u8,
    /// The budget's limit: runs of it at once on each process (0: none).
    pub limit: u8,
    /// Records `0..low_records` come by the low lane (bulk traffic), the others by the high lane.
    pub low_records: u8,
    /// While both lanes wait for a slot of the budget, every `low_every`-th start is the low
    /// lane's (the budget's `low_every`; the property checked, and what the core's gate is told).
    pub low_every: u8,
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
    /// Counted among its lane's holders waiting for a slot of the budget (not for its pause).
    pub counted: bool,
    /// It waits in its slot of the consumer, the waiting room full: for a few seconds at most
    /// (the runner's `MAX_LIMIT_WAIT_IN_SLOT`), so it may be handed back at any moment.
    pub in_slot: bool,
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
    /// Each process's turns between the lanes at its budget's gate.
    pub turns: Vec<Turns>,
    pub faults: u8,
    pub crashes: u8,
    pub logic_failures: u8,
    pub lost_leases: u8,
    pub ask_later: u8,
    pub lapses: u8,
}

/// The turns between the lanes at one process's budget gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Turns {
    /// The core's count ([`budget::Slots::high_run`]).
    pub high_run: u32,
    /// The model's own: high-lane starts in a row while a low-lane holder waited for a slot.
    pub in_a_row: u8,
}

/// One transition, for a counterexample's trace.
#[derive(Debug, Clone)]
pub struct Event {
    pub actor: String,
    pub what: String,
}

/// More give-ups of one chain than any configuration's triggers can cause: the give-up → sweep
/// cycle does not end.
pub(crate) const MAX_GIVE_UPS: u8 = 8;

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
    /// A run of the budget starts beyond its limit on its process (not a stand-in's).
    OverLimit {
        in_flight: usize,
    },
    /// More high-lane starts in a row than the low lane's share allows while a low-lane holder
    /// waits for a slot.
    LowLaneStarved {
        in_a_row: u8,
    },
    /// A low-lane start ahead of a high-lane holder waiting for a slot, though it was not the
    /// low lane's turn (`in_a_row` high-lane starts before it).
    HighLaneNotFirst {
        in_a_row: u8,
    },
}

/// What a backward search over the explored graph found wrong (see `check`).
pub const STARVED: &str = "a dead holder's message waits for the budget's pause to end: no slot of a live consumer can take it before";

/// Things the model can reach, for the `sometimes` properties.
pub const SOMETIMES: [&str; 26] = [
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
    "a holder waited for a slot of its budget's limit",
    "a high-lane holder started while a low-lane holder waited for a slot",
    "a low-lane holder took its turn ahead of a waiting high-lane holder",
    "a dead holder's message started its run beyond the budget's limit",
    "a holder's wait in its slot ran out and its trigger was handed back",
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
            let seats = if config.pauses > 0 || config.limit > 0 {
                slots
            } else {
                0
            };
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
            turns: vec![Turns::default(); config.processes.len()],
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

    /// Whether record `r` comes by the low lane.
    pub(crate) fn low_lane(config: &Config, r: u8) -> bool {
        r < config.low_records
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

    /// This state with one fault of the configuration's budget spent (a request that fails or
    /// loses its answer).
    pub(crate) fn with_fault_spent(&self) -> World {
        let mut x = self.clone();
        x.faults -= 1;
        x
    }

    pub(crate) fn put(&mut self, m: Msg) {
        let at = self.queue.partition_point(|q| q <= &m);
        self.queue.insert(at, m);
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
        pause_ends: false,
    }
}
