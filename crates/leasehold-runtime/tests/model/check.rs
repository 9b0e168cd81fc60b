//! A breadth-first search over every state the model reaches: safety on each transition, the
//! promise ("nothing lost") on each state where nothing more can happen, and liveness as "from
//! every state, such an end stays reachable" (no trap a fair scheduler could not leave).

use std::collections::HashMap;
use std::fmt;
use std::time::{Duration, Instant};

use crate::world::{Config, Event, SOMETIMES, Violation, World};

/// A bound on the search, so a model that does not end fails instead of eating the machine.
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

pub fn check(config: &Config) -> Report {
    let started = Instant::now();
    let initial = World::initial(config);
    let mut index: HashMap<World, u32> = HashMap::new();
    let mut states: Vec<World> = Vec::new();
    // How each state was first reached: its parent and the event.
    let mut parent: Vec<Option<(u32, Event)>> = Vec::new();
    let mut edges: Vec<Vec<u32>> = vec![Vec::new()];
    index.insert(initial.clone(), 0);
    states.push(initial);
    parent.push(None);
    let mut reached = vec![false; SOMETIMES.len()];
    let mut transitions = 0usize;
    let mut violation = None;
    let mut next = 0usize;
    'search: while next < states.len() {
        if states.len() > MAX_STATES {
            violation = Some((
                format!("more than {MAX_STATES} states: the model does not end"),
                path(&parent, (states.len() - 1) as u32),
            ));
            break;
        }
        let world = states[next].clone();
        let successors = world.successors(config);
        let mut out = Vec::with_capacity(successors.len());
        for mut s in successors {
            s.world.normalise();
            transitions += 1;
            if let Some(r) = s.reached {
                reached[r] = true;
            }
            let id = match index.get(&s.world) {
                Some(&id) => id,
                None => {
                    let id = states.len() as u32;
                    index.insert(s.world.clone(), id);
                    states.push(s.world);
                    parent.push(Some((next as u32, s.event.clone())));
                    edges.push(Vec::new());
                    id
                }
            };
            out.push(id);
            if let Some(v) = s.violation {
                let mut trace = path(&parent, next as u32);
                trace.push(s.event);
                violation = Some((describe(&v), trace));
                break 'search;
            }
        }
        if out.is_empty() && !world.honoured(config) {
            violation = Some((
                "nothing more can happen, and a trigger was never followed by a completed run that started after it".into(),
                path(&parent, next as u32),
            ));
            break;
        }
        edges[next] = out;
        next += 1;
    }
    let mut ends = 0;
    let mut most_runs = 0;
    if violation.is_none() {
        // Liveness: every state can still reach an end where every trigger is honoured.
        let n = states.len();
        let mut back: Vec<Vec<u32>> = vec![Vec::new(); n];
        for (from, outs) in edges.iter().enumerate() {
            for &to in outs {
                back[to as usize].push(from as u32);
            }
        }
        let mut good = vec![false; n];
        let mut stack: Vec<u32> = Vec::new();
        for (i, outs) in edges.iter().enumerate() {
            if outs.is_empty() {
                ends += 1;
                most_runs = most_runs.max(states[i].runs);
                good[i] = true;
                stack.push(i as u32);
            }
        }
        while let Some(s) = stack.pop() {
            for &p in &back[s as usize] {
                if !good[p as usize] {
                    good[p as usize] = true;
                    stack.push(p);
                }
            }
        }
        if let Some(stuck) = good.iter().position(|g| !g) {
            violation = Some((
                "a trap: from here no end is reachable where every trigger is honoured".into(),
                path(&parent, stuck as u32),
            ));
        }
    }
    Report {
        config: *config,
        states: states.len(),
        transitions,
        ends,
        most_runs,
        took: started.elapsed(),
        reached,
        violation,
    }
}

fn path(parent: &[Option<(u32, Event)>], mut at: u32) -> Vec<Event> {
    let mut events = Vec::new();
    while let Some((p, e)) = &parent[at as usize] {
        events.push(e.clone());
        at = *p;
    }
    events.reverse();
    events
}

fn describe(v: &Violation) -> String {
    match v {
        Violation::TwoRuns => "two runs of the record at once".into(),
        Violation::EndlessGiveUps => {
            "a trigger's chain is given up again and again: the give-up cycle does not end".into()
        }
        Violation::ExtraRun { runs, allowed } => {
            format!("run {runs} of the record, where the triggers sent and the faults spent allow {allowed}")
        }
        Violation::TokenNotRising { token, last } => {
            format!("a run's fencing token {token} does not rise above the last run's {last}")
        }
    }
}
