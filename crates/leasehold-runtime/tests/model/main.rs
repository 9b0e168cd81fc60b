//! The model checker: every interleaving of a small deployment, driven through the protocol
//! core ([`leasehold_runtime::protocol`]) that the runner ships. See docs/proof.md "The model
//! checker".
//!
//! `cargo test -p leasehold-runtime --test model -- --nocapture` checks the configurations that
//! fit in CI and prints their figures; `-- --ignored` the larger ones. A violation prints the
//! shortest sequence of events that reaches it, one line per event.

mod check;
mod consumer;
mod debounce;
mod functions;
mod run;
mod storage;
mod structure;
mod world;

use leasehold_runtime::protocol::Fault;

use check::{Report, check};
use world::{Config, SOMETIMES};

/// Two workers, one record, standalone: every interleaving of two triggers with a storage
/// fault, a crash and a failed run anywhere.
const BASE: Config = Config {
    name: "2 workers, 2 triggers, 1 fault, 1 crash, 1 failed run",
    processes: &[1, 1],
    records: 1,
    triggers: 2,
    pauses: 0,
    limit: 0,
    low_records: 0,
    low_every: 0,
    faults: 1,
    crashes: 1,
    logic_failures: 1,
    lost_leases: 0,
    always_fails: false,
    ask_later: 0,
    supersede: false,
    debounce: false,
    functions: false,
    lapses: 0,
    max_attempts: 2,
    fault: Fault::None,
};

/// Where the configurations with supersede begin in [`CHECKED`], those with a budget, with
/// debounce, under Functions, and with the budget's limit and both lanes.
const SUPERSEDE: usize = 7;
const BUDGET: usize = 9;
const DEBOUNCE: usize = 10;
const FUNCTIONS: usize = 12;
const LANES: usize = 15;

/// The configurations CI checks.
const CHECKED: [Config; 16] = [
    BASE,
    Config {
        name: "2 workers, 3 triggers, 1 fault, 1 crash",
        triggers: 3,
        logic_failures: 0,
        ..BASE
    },
    Config {
        name: "2 workers, 2 triggers, 2 faults",
        faults: 2,
        crashes: 0,
        logic_failures: 0,
        ..BASE
    },
    Config {
        name: "2 workers, 2 triggers, 1 fault, 2 failed runs (give-ups and sweeps)",
        crashes: 0,
        logic_failures: 2,
        ..BASE
    },
    Config {
        name: "2 workers, 3 triggers, 2 failed runs (give-ups and sweeps)",
        triggers: 3,
        faults: 0,
        crashes: 0,
        logic_failures: 2,
        ..BASE
    },
    Config {
        name: "2 workers, 2 triggers, logic that always fails",
        faults: 0,
        crashes: 0,
        logic_failures: 0,
        always_fails: true,
        ..BASE
    },
    Config {
        name: "2 workers, 2 triggers, 1 crash, 1 lost lease, 1 failed run",
        faults: 0,
        lost_leases: 1,
        ..BASE
    },
    Config {
        name: "supersede: 2 workers, 2 triggers, 1 fault, 1 failed run, 1 run put off",
        crashes: 0,
        ask_later: 1,
        supersede: true,
        ..BASE
    },
    Config {
        name: "supersede: 2 workers, 3 triggers, 1 fault, 1 run put off",
        triggers: 3,
        crashes: 0,
        logic_failures: 0,
        ask_later: 1,
        supersede: true,
        ..BASE
    },
    Config {
        name: "budget: 2 processes (2 slots, 1 slot), 3 records, 1 crash, 1 pause",
        processes: &[2, 1],
        records: 3,
        triggers: 1,
        pauses: 1,
        faults: 0,
        logic_failures: 0,
        ..BASE
    },
    Config {
        name: "debounce: 2 workers, 2 triggers, 1 fault, 1 crash",
        logic_failures: 0,
        debounce: true,
        ..BASE
    },
    Config {
        name: "debounce: 2 workers, 3 triggers, 1 fault",
        triggers: 3,
        crashes: 0,
        logic_failures: 0,
        debounce: true,
        ..BASE
    },
    Config {
        name: "functions: 2 workers, 2 triggers, 1 fault, 1 crash, 1 failed run",
        functions: true,
        ..BASE
    },
    Config {
        name: "functions and debounce: 2 workers, 2 triggers, 1 fault, 1 crash",
        logic_failures: 0,
        debounce: true,
        functions: true,
        ..BASE
    },
    Config {
        name: "functions: 2 workers, 2 triggers, 1 fault, 1 lapse",
        crashes: 0,
        logic_failures: 0,
        lapses: 1,
        functions: true,
        ..BASE
    },
    Config {
        name: "lanes: 2 processes (2 slots, 1 slot), 4 records (r0 by the low lane), a limit of 1, the low lane's turn every 2nd start, 1 crash",
        processes: &[2, 1],
        records: 4,
        triggers: 1,
        limit: 1,
        low_records: 1,
        low_every: 2,
        faults: 0,
        logic_failures: 0,
        ..BASE
    },
];

/// Larger configurations: `cargo test -p leasehold-runtime --test model -- --ignored --nocapture`
/// (about 90 s). Three workers with three triggers, or two with three triggers, two faults and a
/// failed run or a lost lease, are beyond 12 million states (more memory than this 2-core, 24 GiB
/// machine should give a test).
const LARGER: [Config; 2] = [
    Config {
        name: "3 workers, 2 triggers, 1 fault, 1 crash, 1 failed run",
        processes: &[1, 1, 1],
        ..BASE
    },
    Config {
        name: "2 workers, 3 triggers, 2 faults, 1 crash",
        triggers: 3,
        faults: 2,
        logic_failures: 0,
        ..BASE
    },
];

fn holds(config: Config) -> Report {
    let report = check(&config);
    println!("{report}");
    assert!(report.violation.is_none(), "{report}");
    report
}

fn all_hold(configs: &[Config]) -> Vec<bool> {
    let mut reached = vec![false; SOMETIMES.len()];
    for config in configs {
        let report = holds(*config);
        for (all, this) in reached.iter_mut().zip(report.reached.iter()) {
            *all |= *this;
        }
    }
    reached
}

/// The lock protocol alone (run policy `queue`), every configuration: see docs/proof.md.
#[test]
fn the_protocol_holds_in_every_interleaving_of_small_deployments() {
    let reached = all_hold(&CHECKED[..SUPERSEDE]);
    for (what, reached) in SOMETIMES.iter().zip(reached).take(8) {
        assert!(reached, "no configuration reaches: {what}");
    }
}

/// With supersede and run later: a retry's token, the `pending` note, deferrals.
#[test]
fn supersede_and_run_later_hold_in_every_interleaving_of_small_deployments() {
    let reached = all_hold(&CHECKED[SUPERSEDE..BUDGET]);
    for (what, reached) in SOMETIMES.iter().zip(reached).skip(8).take(3) {
        assert!(reached, "no configuration reaches: {what}");
    }
}

/// With a downstream budget's pause: holders wait it out in seats of the waiting room, and a dead
/// holder's message is taken before the pause ends.
#[test]
fn a_budgets_pause_never_holds_a_dead_holders_record_in_any_interleaving() {
    let reached = all_hold(&CHECKED[BUDGET..DEBOUNCE]);
    for (what, reached) in SOMETIMES.iter().zip(reached).skip(11).take(3) {
        assert!(reached, "no configuration reaches: {what}");
    }
}

/// With debounce: triggers wait for their burst to end, join it, and a dead creator's marker is
/// consumed by its stand-in.
#[test]
fn debounce_holds_in_every_interleaving_of_small_deployments() {
    let reached = all_hold(&CHECKED[DEBOUNCE..FUNCTIONS]);
    for (what, reached) in SOMETIMES.iter().zip(reached).skip(14).take(4) {
        assert!(reached, "no configuration reaches: {what}");
    }
}

/// Functions mode: the host, each delivery's watchdog, its rewrite into the retry or the look
/// again, and a watchdog that surfaces while its delivery lives.
#[test]
fn functions_mode_holds_in_every_interleaving_of_small_deployments() {
    let reached = all_hold(&CHECKED[FUNCTIONS..LANES]);
    for (what, reached) in SOMETIMES.iter().zip(reached).skip(18).take(3) {
        assert!(reached, "no configuration reaches: {what}");
    }
}

/// With the budget's limit and both lanes: holders wait for a slot (in seats of the waiting
/// room), a stand-in goes beyond the limit, and while both lanes wait the low lane has its turn.
#[test]
fn a_budgets_limit_and_lanes_hold_in_every_interleaving() {
    let reached = all_hold(&CHECKED[LANES..]);
    for (what, reached) in SOMETIMES.iter().zip(reached).skip(21) {
        assert!(reached, "no configuration reaches: {what}");
    }
}

/// The larger configurations' bound on states: about 3 GB of memory.
const LARGER_MAX_STATES: usize = 8_000_000;

#[test]
#[ignore = "larger configurations: minutes"]
fn the_protocol_holds_in_larger_deployments() {
    for config in LARGER {
        let report = check::search(&config, LARGER_MAX_STATES);
        println!("{report}");
        assert!(report.violation.is_none(), "{report}");
    }
}

/// Every known-wrong decision kept in the core that loses a trigger or adds a run is caught, each
/// with the shortest sequence that shows it (printed with `--nocapture`). Not
/// [`Fault::SweepLeavesMarker`] (F7): a sweep that leaves the marker runs the record once more
/// after a give-up, which the configurations' bound on runs (one per trigger, one more per fault
/// spent) allows; its deterministic tests catch it.
#[test]
fn every_known_fault_is_caught() {
    let mut missed = Vec::new();
    let faults = [
        (Fault::RetriedSetAtItsWord, 0),
        (Fault::FailedReacquireCoalesces, 0),
        (Fault::StandDownSkipsMarkerCheck, 0),
        (Fault::RetriedTakeAtItsWord, 0),
        (Fault::ReacquireLeavesMarker, 0),
        (Fault::StandDownAfterRetriedClear, 0),
        (Fault::CheckMarkerBeforeRelease, 0),
        (Fault::TrustHolderOnRedelivery, 0),
        (Fault::TokenWithoutNote, SUPERSEDE),
        (Fault::CarriedOnRetriedTakeAtItsWord, SUPERSEDE + 1),
        (Fault::HolderKeepsItsSlot, BUDGET),
        (Fault::StandInTrustsWaitMarker, DEBOUNCE),
        (Fault::WaiterStandsDownAfterRetriedDelete, DEBOUNCE),
        (Fault::TouchByPut, DEBOUNCE + 1),
        (Fault::LookAgainDropsWatchdog, FUNCTIONS),
        (Fault::HighLaneAlwaysFirst, LANES),
    ];
    for (fault, config) in faults {
        let report = check(&Config {
            fault,
            ..CHECKED[config]
        });
        match report.violation {
            Some(_) => println!("{report}"),
            None => missed.push(fault),
        }
    }
    assert!(missed.is_empty(), "not caught: {missed:?}");
}
