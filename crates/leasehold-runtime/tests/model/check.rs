//! A breadth-first search over every state the model reaches: safety on each transition, the
//! promise ("nothing lost") on each state where nothing more can happen, and liveness as "from
//! every state, such an end stays reachable" (no trap a fair scheduler could not leave).

use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasherDefault, Hash, Hasher};
use std::time::{Duration, Instant};

use crate::world::{Config, Event, SOMETIMES, STARVED, Violation, World};

/// A bound on the search, so a model that does not end fails instead of eating the machine
/// (about 400 bytes a state, with its transitions).
const MAX_STATES: usize = 3_000_000;

pub struct Report {
    pub config: Config,
    pub states: usize,
    pub transitions: usize,
    pub ends: usize,
    /// The most runs any interleaving takes to its end.
    pub most_runs: u8,
    pub took: Duration,
    pub reached: Vec<bool>,
    /// The first violation found, with the events that lead to it.
    pub violation: Option<(String, Vec<Event>)>,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({:?}): {} states, {} transitions",
            self.config.name, self.config.fault, self.states, self.transitions
        )?;
        if self.violation.is_none() {
            write!(f, ", {} ends, at most {} runs", self.ends, self.most_runs)?;
        }
        writeln!(f, ", {:.1} s", self.took.as_secs_f64())?;
        if let Some((what, events)) = &self.violation {
            writeln!(f, "VIOLATION: {what}")?;
            for (i, e) in events.iter().enumerate() {
                writeln!(f, "  {:>3}. {:<7} {}", i + 1, e.actor, e.what)?;
            }
        }
        Ok(())
    }
}

/// FxHash (rustc's): fast, and good enough for states the search compares in full anyway.
#[derive(Default)]
struct Fx(u64);

impl Fx {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

impl Hasher for Fx {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
    }
    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }
    fn write_u32(&mut self, i: u32) {
        self.add(u64::from(i));
    }
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }
}

/// The states found so far, each stored once: a state's id is its place in `states`; `first`
/// maps a hash to the first id with it, `chain` each id to the next with the same hash.
struct Seen {
    states: Vec<World>,
    first: HashMap<u64, u32, BuildHasherDefault<Fx>>,
    chain: Vec<u32>,
}

const NONE: u32 = u32::MAX;

impl Seen {
    /// The id of `world`, and whether it is new.
    fn id(&mut self, world: World) -> (u32, bool) {
        let mut hasher = Fx::default();
        world.hash(&mut hasher);
        let hash = hasher.finish();
        let fresh = self.states.len() as u32;
        let mut at = *self.first.entry(hash).or_insert(fresh);
        if at == fresh {
            self.states.push(world);
            self.chain.push(NONE);
            return (fresh, true);
        }
        loop {
            if self.states[at as usize] == world {
                return (at, false);
            }
            if self.chain[at as usize] == NONE {
                self.chain[at as usize] = fresh;
                self.states.push(world);
                self.chain.push(NONE);
                return (fresh, true);
            }
            at = self.chain[at as usize];
        }
    }
}

pub fn check(config: &Config) -> Report {
    search(config, MAX_STATES)
}

/// [`check`], with a bound of `max_states` states.
pub fn search(config: &Config, max_states: usize) -> Report {
    let started = Instant::now();
    let mut seen = Seen {
        states: Vec::new(),
        first: HashMap::default(),
        chain: Vec::new(),
    };
    seen.id(World::initial(config));
    // How each state was first reached: its parent and which of the parent's successors.
    let mut parent: Vec<(u32, u16)> = vec![(NONE, 0)];
    // The transitions out of state i: `to[from[i]..from[i + 1]]` (states are explored in order).
    let mut from: Vec<u32> = vec![0];
    let mut to: Vec<u32> = Vec::new();
    // Whether each transition is the end of the budget's pause.
    let mut pause_ends: Vec<bool> = Vec::new();
    let mut reached = vec![false; SOMETIMES.len()];
    let mut transitions = 0usize;
    let mut violation = None;
    let mut ends = Vec::new();
    let mut most_runs = 0;
    let mut next = 0usize;
    'search: while next < seen.states.len() {
        if seen.states.len() > max_states {
            violation = Some((
                format!("more than {max_states} states: the model does not end"),
                path(config, &seen.states, &parent, next as u32),
            ));
            break;
        }
        let successors = seen.states[next].successors(config);
        let count = successors.len();
        for (k, mut s) in successors.into_iter().enumerate() {
            s.world.normalise();
            transitions += 1;
            if let Some(r) = s.reached {
                reached[r] = true;
            }
            let (id, new) = seen.id(s.world);
            if new {
                parent.push((next as u32, k as u16));
            }
            to.push(id);
            pause_ends.push(s.pause_ends);
            if let Some(v) = s.violation {
                let mut trace = path(config, &seen.states, &parent, next as u32);
                trace.push(s.event);
                violation = Some((describe(&v), trace));
                break 'search;
            }
        }
        if count == 0 {
            let world = &seen.states[next];
            if let Some(wrong) = world.unhonoured(config) {
                violation = Some((wrong.into(), path(config, &seen.states, &parent, next as u32)));
                break;
            }
            ends.push(next as u32);
            most_runs = most_runs.max(world.records.iter().map(|r| r.runs).max().unwrap_or(0));
        }
        from.push(to.len() as u32);
        next += 1;
    }
    let states = seen.states.len();
    if violation.is_none() {
        // Liveness: every state can still reach an end where every trigger is honoured. Backwards
        // from the ends over the reversed transitions.
        let mut into: Vec<u32> = vec![0; states + 1];
        for &t in &to {
            into[t as usize + 1] += 1;
        }
        for i in 0..states {
            into[i + 1] += into[i];
        }
        // For each state, the transitions into it (`back_edge`) and where they come from
        // (`back`), in `into[state]..into[state + 1]`.
        let mut source = vec![0u32; to.len()];
        for f in 0..states {
            source[from[f] as usize..from[f + 1] as usize].fill(f as u32);
        }
        let mut back = vec![0u32; to.len()];
        let mut back_edge = vec![0u32; to.len()];
        let mut fill = into.clone();
        for (e, &t) in to.iter().enumerate() {
            let at = fill[t as usize] as usize;
            back[at] = source[e];
            back_edge[at] = e as u32;
            fill[t as usize] += 1;
        }
        let reach = |start: Vec<u32>, skip_pause_end: bool| {
            let mut good = vec![false; states];
            for &s in &start {
                good[s as usize] = true;
            }
            let mut stack = start;
            while let Some(s) = stack.pop() {
                let range = into[s as usize] as usize..into[s as usize + 1] as usize;
                for (&p, &e) in back[range.clone()].iter().zip(&back_edge[range]) {
                    if skip_pause_end && pause_ends[e as usize] {
                        continue;
                    }
                    if !good[p as usize] {
                        good[p as usize] = true;
                        stack.push(p);
                    }
                }
            }
            good
        };
        let good = reach(ends.clone(), false);
        if let Some(stuck) = good.iter().position(|g| !g) {
            violation = Some((
                "a trap: from here no end is reachable where every trigger is honoured".into(),
                path(config, &seen.states, &parent, stuck as u32),
            ));
        }
        if violation.is_none() && config.pauses > 0 {
            // The recovery bound must not depend on a pause: from every state where a dead
            // holder's message waits while the budget is paused, a slot can take it before the
            // pause ends.
            let unstarved: Vec<u32> = (0..states as u32)
                .filter(|&s| !seen.states[s as usize].starving())
                .collect();
            let good = reach(unstarved, true);
            if let Some(starved) = good.iter().position(|g| !g) {
                violation = Some((
                    STARVED.into(),
                    path(config, &seen.states, &parent, starved as u32),
                ));
            }
        }
    }
    Report {
        config: *config,
        states,
        transitions,
        ends: ends.len(),
        most_runs,
        took: started.elapsed(),
        reached,
        violation,
    }
}

/// The events from the initial state to state `at`, each found again among its parent's
/// successors (the search keeps no text per state).
fn path(config: &Config, states: &[World], parent: &[(u32, u16)], mut at: u32) -> Vec<Event> {
    let mut events = Vec::new();
    while let Some(&(p, k)) = parent.get(at as usize).filter(|(p, _)| *p != NONE) {
        let mut successors = states[p as usize].successors(config);
        events.push(successors.swap_remove(k as usize).event);
        at = p;
    }
    events.reverse();
    events
}

fn describe(v: &Violation) -> String {
    match v {
        Violation::TwoRuns => "two runs of the record at once".into(),
        Violation::StandInHeld => {
            "a delivery standing in for a dead holder waits for the budget's pause".into()
        }
        Violation::EndlessGiveUps => {
            "a trigger's chain is given up again and again: the give-up cycle does not end".into()
        }
        Violation::ExtraRun { runs, allowed } => {
            format!("run {runs} of the record, where the triggers sent and the faults spent allow {allowed}")
        }
        Violation::OverLimit { in_flight } => {
            format!(
                "a run of the budget starts beside {in_flight} under way on its process, beyond the limit"
            )
        }
        Violation::LowLaneStarved { in_a_row } => format!(
            "a high-lane start, {in_a_row} in a row while a low-lane holder waits for a slot: the low lane's turn was skipped"
        ),
        Violation::HighLaneNotFirst { in_a_row } => format!(
            "a low-lane start ahead of a waiting high-lane holder after {in_a_row} high-lane starts in a row: not the low lane's turn"
        ),
        Violation::TokenNotRising { token, last } => {
            format!("a run's fencing token {token} does not rise above the last run's {last}")
        }
    }
}
