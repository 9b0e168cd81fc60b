//! The runtime's integration tests: the deterministic simulation and the Azurite tests.

mod azurite;
mod behaviour;
mod budgets;
mod history;
mod regressions;
mod sim;

use std::time::Instant;

use leasehold_runtime::ProtocolVariant;
use sim::{FaultCounts, Violation};

/// Seeds per CI run (override with LEASEHOLD_SIM_SEEDS); LEASEHOLD_SIM_SEED replays one seed.
fn seeds() -> std::ops::Range<u64> {
    if let Ok(one) = std::env::var("LEASEHOLD_SIM_SEED") {
        let seed: u64 = one.parse().expect("LEASEHOLD_SIM_SEED must be a number");
        return seed..seed + 1;
    }
    let n = std::env::var("LEASEHOLD_SIM_SEEDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    0..n
}

/// When a run of many seeds may stop early.
#[derive(Clone, Copy)]
enum Stop {
    /// Run every seed.
    Never,
    /// Stop at the first seed that breaks safety or the recovery bound, or once more seeds made
    /// a redundant run than the allowance (mutation testing: only pass or fail matters, and a
    /// broken protocol can make every seed slow). A tolerated redundant run does not stop it.
    OnFailure { redundant_allowed: usize },
    /// Stop at the first seed with a violation this says is the one looked for (the "catches"
    /// tests: a seed that fails for another reason does not count).
    OnViolation(fn(&Violation) -> bool),
}

impl Stop {
    fn reached(self, failures: &[(u64, Vec<Violation>)]) -> bool {
        match self {
            Stop::Never => false,
            Stop::OnFailure { redundant_allowed } => {
                let safety = failures.iter().any(|(_, v)| v.iter().any(Violation::is_safety));
                safety || failures.len() > redundant_allowed
            }
            Stop::OnViolation(wanted) => failures.iter().any(|(_, v)| v.iter().any(wanted)),
        }
    }
}

/// What a run of many seeds found.
struct SeedRun {
    /// The seeds with violations, in seed order.
    failures: Vec<(u64, Vec<Violation>)>,
    counts: FaultCounts,
    runs: u64,
    /// Seeds that really ran (fewer than asked when it stopped early).
    seeds_run: u64,
    /// Every clean recovery: what died, time to the next run, restart pause.
    recoveries: Vec<(&'static str, std::time::Duration, std::time::Duration)>,
    /// Seeds with a late recovery that is the documented double fault.
    double_faults: Vec<u64>,
}

/// Runs seeds on all cores until `stop` says so.
fn run_seeds(seeds: std::ops::Range<u64>, variant: ProtocolVariant, stop: Stop) -> SeedRun {
    run_plans(seeds, sim::Plan::from_seed, variant, stop)
}

/// [`run_seeds`] with each seed's plan made by `plan` (a seed's own, changed).
fn run_plans(
    seeds: std::ops::Range<u64>,
    plan: fn(u64) -> sim::Plan,
    variant: ProtocolVariant,
    stop: Stop,
) -> SeedRun {
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let next = std::sync::atomic::AtomicU64::new(seeds.start);
    let failures = std::sync::Mutex::new(Vec::new());
    let totals = std::sync::Mutex::new((FaultCounts::default(), 0u64, 0u64, Vec::new(), Vec::new()));
    let stopped = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                loop {
                    if stopped.load(std::sync::atomic::Ordering::SeqCst) {
                        return;
                    }
                    let seed = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    if seed >= seeds.end {
                        return;
                    }
                    let report = sim::run_plan_bounded(plan(seed), variant, sim::SEED_REAL_TIME_LIMIT);
                    {
                        let mut t = totals.lock().unwrap();
                        t.0.add(&report.counts);
                        t.1 += report.runs as u64;
                        t.2 += 1;
                        t.3.extend(report.recoveries.iter().copied());
                        if report.double_faults > 0 {
                            t.4.push(seed);
                        }
                    }
                    if !report.violations.is_empty() {
                        let mut f = failures.lock().unwrap();
                        f.push((seed, report.violations));
                        if stop.reached(&f) {
                            stopped.store(true, std::sync::atomic::Ordering::SeqCst);
                        }
                    }
                }
            });
        }
    });
    let mut failures = failures.into_inner().unwrap();
    failures.sort_by_key(|(seed, _)| *seed);
    let (counts, runs, seeds_run, recoveries, mut double_faults) = totals.into_inner().unwrap();
    double_faults.sort();
    SeedRun {
        failures,
        counts,
        runs,
        seeds_run,
        recoveries,
        double_faults,
    }
}

/// Redundant runs tolerated: 0.2 % of the seeds (see [`simulation_upholds_the_invariants`]).
fn redundant_allowed(seeds: u64) -> usize {
    (seeds.max(500) / 500) as usize
}

/// Safety (invariants 1, 2 and 5: exclusive runs with rising fencing tokens, nothing lost,
/// bounded run time) and the recovery bound (4) must hold on every seed. Coalescing (3) has one
/// known gap: a trigger that acquires the lease in the moment between another holder's release
/// and that holder's marker check makes the holder's retrigger one redundant run (12 of 10,000
/// seeds). A fencing-generation check cannot remove it safely: the marker the holder consumed may
/// have been set for the new holder's run, which does not cover it. Such seeds are printed and
/// held to at most 0.2% of seeds, so a regression fails. Prints how often each fault class
/// happened.
#[test]
fn simulation_upholds_the_invariants() {
    let seeds = seeds();
    let count = seeds.end - seeds.start;
    let started = Instant::now();
    // LEASEHOLD_SIM_FAIL_FAST stops at the first seed that breaks safety or the recovery bound,
    // or once redundant runs pass their allowance (for mutation testing, where only pass or fail
    // matters and a broken protocol can make every seed slow).
    let stop = match std::env::var_os("LEASEHOLD_SIM_FAIL_FAST") {
        Some(_) => Stop::OnFailure {
            redundant_allowed: redundant_allowed(count),
        },
        None => Stop::Never,
    };
    let SeedRun {
        failures,
        counts,
        runs,
        seeds_run,
        recoveries,
        double_faults,
    } = run_seeds(seeds, ProtocolVariant::Correct, stop);
    println!(
        "simulation: {seeds_run} of {count} seeds ran, {runs} runs in {:.1?}",
        started.elapsed()
    );
    println!(
        "| holder died | deaths | median to the next run | 95th percentile | longest |\n| --- | --- | --- | --- | --- |"
    );
    for kind in [
        "standalone worker killed",
        "Functions handler killed (host alive)",
        "whole Functions host died",
    ] {
        // A killed handler's restart pause is left out: meanwhile its host has nowhere to send.
        let mut times: Vec<f64> = recoveries
            .iter()
            .filter(|(k, _, _)| *k == kind)
            .map(|(_, d, restart)| {
                let d = if kind.contains("host alive") {
                    d.saturating_sub(*restart)
                } else {
                    *d
                };
                d.as_secs_f64()
            })
            .collect();
        if times.is_empty() {
            continue;
        }
        times.sort_by(f64::total_cmp);
        let at = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
        println!(
            "| {kind} | {} | {:.1} s | {:.1} s | {:.1} s |",
            times.len(),
            at(0.5),
            at(0.95),
            times[times.len() - 1]
        );
    }
    println!("| fault class | occurrences in {count} seeds |\n| --- | --- |");
    for (name, n) in counts.rows() {
        println!("| {name} | {n} |");
    }
    let mut safety = Vec::new();
    let mut liveness = Vec::new();
    for (seed, violations) in &failures {
        if violations.iter().any(Violation::is_safety) {
            safety.push((*seed, violations));
        } else {
            liveness.push((*seed, violations));
        }
    }
    for (kind, list) in [("SAFETY/RECOVERY", &safety), ("coalescing", &liveness)] {
        let shown = if std::env::var_os("LEASEHOLD_SIM_ALL").is_some() {
            usize::MAX
        } else {
            10
        };
        for (seed, violations) in list.iter().take(shown) {
            println!(
                "{kind}: seed {seed} (replay: LEASEHOLD_SIM_SEED={seed} LEASEHOLD_SIM_TRACE=1 cargo test -p leasehold-runtime --test runtime simulation_upholds -- --nocapture):"
            );
            for v in violations.iter().take(3) {
                println!("  {v}");
            }
        }
    }
    println!(
        "simulation: {} seeds broke safety or the recovery bound, {} made a redundant run, {} recovered late \
         only through the documented double fault (a host took the dead holder's watchdog and died before \
         its handler put its own){}",
        safety.len(),
        liveness.len(),
        double_faults.len(),
        if double_faults.is_empty() {
            String::new()
        } else {
            format!(": seeds {double_faults:?}")
        }
    );
    assert!(
        safety.is_empty(),
        "{} seeds broke invariant 1, 2, 4 or 5; first seed {}",
        safety.len(),
        safety[0].0
    );
    assert!(
        liveness.len() <= redundant_allowed(count),
        "{} of {count} seeds made a redundant run (more than 0.2%)",
        liveness.len()
    );
}

#[test]
fn simulation_is_deterministic() {
    // Plain seeds, and seeds with each flow under the emulated Functions host (odd seeds): 9 and
    // 27 supersede, 13 throttles and supersedes, 15 supersedes a failing record. Each run builds
    // a runtime of its own, with its own random state: a history that depends on it (the order
    // in which a channel wakes its waiters, say) shows here. Debounce: 18 (standalone, fault-free),
    // 45 (Functions, faulty) and 21 (Functions, faulty, with a throttle and supersede).
    for seed in [1, 2, 7, 9, 13, 15, 18, 21, 27, 42, 45, 1234] {
        let a = sim::run_seed_bounded(seed, ProtocolVariant::Correct, sim::SEED_REAL_TIME_LIMIT);
        let b = sim::run_seed_bounded(seed, ProtocolVariant::Correct, sim::SEED_REAL_TIME_LIMIT);
        assert_eq!(a, b, "seed {seed} gave two different histories");
        assert!(a.runs > 0 && a.accepted > 0);
    }
}

/// Runs seeds of a known-wrong variant until one loses a trigger, and returns it: a seed that
/// fails only for another reason (a redundant run, say) does not count.
fn first_loss(variant: ProtocolVariant) -> Option<(u64, Violation)> {
    let run = run_seeds(
        0..5_000,
        variant,
        Stop::OnViolation(|v| matches!(v, Violation::Lost(_))),
    );
    run.failures.into_iter().find_map(|(seed, violations)| {
        violations
            .into_iter()
            .find(|v| matches!(v, Violation::Lost(_)))
            .map(|v| (seed, v))
    })
}

/// How many seeds the simulation needs for each known-wrong decision the protocol core keeps
/// (the model checker finds each in seconds: `tests/model`). A tool:
/// `LEASEHOLD_SIM_SEEDS=2000 cargo test -p leasehold-runtime --test runtime
/// simulation_against_the_cores_faults -- --ignored --nocapture`.
#[test]
#[ignore = "a tool: run it by name"]
fn simulation_against_the_cores_faults() {
    use leasehold_runtime::protocol::Fault;
    for fault in [
        Fault::RetriedSetAtItsWord,
        Fault::FailedReacquireCoalesces,
        Fault::StandDownSkipsMarkerCheck,
        Fault::RetriedTakeAtItsWord,
        Fault::ReacquireLeavesMarker,
        Fault::StandDownAfterRetriedClear,
        Fault::SweepLeavesMarker,
        Fault::TokenWithoutNote,
        Fault::CarriedOnRetriedTakeAtItsWord,
        Fault::StandInTrustsWaitMarker,
        Fault::WaiterStandsDownAfterRetriedDelete,
        Fault::TouchByPut,
        Fault::LookAgainDropsWatchdog,
    ] {
        let run = run_seeds(seeds(), ProtocolVariant::Core(fault), Stop::Never);
        let lost = run
            .failures
            .iter()
            .filter(|(_, v)| v.iter().any(|v| matches!(v, Violation::Lost(_))))
            .count();
        let first = run.failures.first().map(|(seed, _)| *seed);
        println!(
            "{fault:?}: {} of {} seeds fail ({lost} with a lost trigger); first: {first:?}",
            run.failures.len(),
            run.seeds_run
        );
    }
}

#[test]
fn simulation_catches_checking_the_marker_before_release() {
    let (seed, violation) = first_loss(ProtocolVariant::CheckMarkerBeforeRelease)
        .expect("the simulation should catch the check-before-release bug (a lost trigger)");
    println!("check-before-release caught by seed {seed}: {violation}");
}

/// The lease's safety margin must leave the logic time to stop (5 s) before storage, whose clock
/// may run fast, can hand the lease on. The old default of 3 s did not: the simulation finds two
/// runs overlapping when a holder's renewals fail while its logic stops. (Rare since an
/// abandoned run's lease is kept until its logic ends: about 1 seed in 20,000.)
#[test]
fn simulation_catches_a_safety_margin_shorter_than_the_stop_grace() {
    let run = run_plans(
        0..60_000,
        |seed| sim::Plan {
            safety_margin: Some(std::time::Duration::from_secs(3)),
            ..sim::Plan::from_seed(seed)
        },
        ProtocolVariant::Correct,
        Stop::OnViolation(|v| matches!(v, Violation::Overlap(_))),
    );
    let (seed, violation) = run
        .failures
        .into_iter()
        .find_map(|(seed, v)| {
            v.into_iter()
                .find(|v| matches!(v, Violation::Overlap(_)))
                .map(|v| (seed, v))
        })
        .expect("the simulation should catch a 3 s safety margin");
    println!("3 s safety margin caught by seed {seed}: {violation}");
}

/// A deferral persisted visible at once (its delay ignored) runs the record before the time the
/// logic asked for: R1 must catch it.
#[test]
fn simulation_catches_a_deferral_that_ignores_its_delay() {
    let run = run_seeds(
        0..5_000,
        ProtocolVariant::DeferralIgnoresDelay,
        Stop::OnViolation(|v| matches!(v, Violation::RunLater(_))),
    );
    let (seed, violation) = run
        .failures
        .into_iter()
        .find_map(|(seed, v)| {
            v.into_iter()
                .find(|v| matches!(v, Violation::RunLater(_)))
                .map(|v| (seed, v))
        })
        .expect("the simulation should catch a deferral that ignores its delay (R1)");
    println!("deferral ignoring its delay caught by seed {seed}: {violation}");
}

/// A standalone seed with one throttled record and a single trigger (one chain of deferrals, so
/// no other chain's run can serve it), faults on, and on every machine a crash armed after its
/// first queue delete. The correct protocol deletes nothing when it defers (one Update Message);
/// a protocol that deletes and then puts the deferral dies in between and loses the trigger.
fn one_deferred_chain_and_a_crash_after_a_delete(seed: u64) -> sim::Plan {
    use std::time::Duration;
    // Even seeds are standalone.
    let plan = sim::Plan::from_seed(seed * 2);
    let machines = plan.machines;
    sim::Plan {
        faulty: true,
        triggers: vec![(Duration::from_secs(10), 0)],
        faults: (0..machines)
            .map(|machine| {
                (
                    Duration::from_secs(1),
                    sim::Fault::CrashAfter {
                        machine,
                        op: leasehold_lock::Op::QueueDelete,
                        host_death: false,
                        restart_after: Duration::from_secs(5),
                    },
                )
            })
            .collect(),
        bad_record: None,
        poison_outage: None,
        oversized: Vec::new(),
        throttled: Some(sim::Throttle {
            record: 0,
            from: Duration::ZERO,
            to: Duration::from_secs(300),
            max_deferral: Duration::from_secs(600),
        }),
        ..plan
    }
}

#[test]
fn simulation_catches_a_deferral_that_deletes_then_puts() {
    let lost = |v: &Violation| matches!(v, Violation::Lost(_));
    let correct = run_plans(
        0..50,
        one_deferred_chain_and_a_crash_after_a_delete,
        ProtocolVariant::Correct,
        Stop::Never,
    );
    assert!(
        !correct.failures.iter().any(|(_, v)| v.iter().any(lost)),
        "the correct protocol lost a trigger in these plans: {:?}",
        correct.failures
    );
    let run = run_plans(
        0..50,
        one_deferred_chain_and_a_crash_after_a_delete,
        ProtocolVariant::DeferralDeletesThenPuts,
        Stop::OnViolation(|v| matches!(v, Violation::Lost(_))),
    );
    let (seed, violation) = run
        .failures
        .into_iter()
        .find_map(|(seed, v)| v.into_iter().find(lost).map(|v| (seed, v)))
        .expect("the simulation should catch a deferral persisted by a delete and a put (a lost trigger)");
    println!("delete-then-put deferral caught by plan {seed}: {violation}");
}

/// A supersede that releases the lease as soon as it decides to stop the run, before the logic
/// has ended: logic slow to stop (the supersede record's runs take up to 4 s to stop in half the
/// cases, more in faulty seeds) still runs when the retrigger's run starts. Exclusive (1) must
/// catch it (a superseded run is not exempt from it).
#[test]
fn simulation_catches_a_supersede_that_releases_at_cancel() {
    let overlap = |v: &Violation| matches!(v, Violation::Overlap(_));
    let run = run_seeds(
        0..5_000,
        ProtocolVariant::SupersedeReleasesAtCancel,
        Stop::OnViolation(|v| matches!(v, Violation::Overlap(_))),
    );
    let (seed, violation) = run
        .failures
        .into_iter()
        .find_map(|(seed, v)| v.into_iter().find(overlap).map(|v| (seed, v)))
        .expect("the simulation should catch a supersede that releases the lease at the stop (an overlap)");
    println!("supersede releasing at cancel caught by seed {seed}: {violation}");
}

/// Runs seeds `seeds` of a known-wrong variant until one breaks an invariant `wanted` picks, and
/// returns it (a seed failing only for another reason does not count).
fn first_caught(
    variant: ProtocolVariant,
    seeds: std::ops::Range<u64>,
    wanted: fn(&Violation) -> bool,
) -> Option<(u64, Violation)> {
    let run = run_seeds(seeds, variant, Stop::OnViolation(wanted));
    run.failures
        .into_iter()
        .find_map(|(seed, v)| v.into_iter().find(wanted).map(|v| (seed, v)))
}

/// A stand-in (path C) that does not consume the wait marker leaves an orphan, a marker whose
/// creator died before it became its waiter, and the triggers that joined it: B2 finds the
/// marker at drain (or (2) the lost triggers).
#[test]
fn simulation_catches_a_stand_in_that_trusts_the_wait_marker() {
    let (seed, violation) = first_caught(ProtocolVariant::StandInTrustsWaitMarker, 0..5_000, |v| {
        matches!(v, Violation::Debounce(_) | Violation::Lost(_))
    })
    .expect("the simulation should catch a stand-in that leaves the wait marker (B2 or a lost trigger)");
    println!("stand-in trusting the wait marker caught by seed {seed}: {violation}");
}

/// A waiter whose consume was retried, the retry answering "gone" (its own first attempt took
/// the marker, its answer lost), stands down: nobody runs for the burst, and (2) finds its
/// triggers lost. Met through the debounce seeds' aimed lost answers at a waiter's consume.
#[test]
fn simulation_catches_a_waiter_that_stands_down_after_a_retried_delete() {
    let (seed, violation) = first_caught(
        ProtocolVariant::WaiterStandsDownAfterRetriedDelete,
        0..5_000,
        |v| matches!(v, Violation::Lost(_)),
    )
    .expect("the simulation should catch a waiter that ignores its retried consume (a lost trigger)");
    println!("waiter standing down after a retried delete caught by seed {seed}: {violation}");
}

/// A joining trigger whose touch found the marker consumed, and which creates it again, leaves
/// a marker nobody waits for: B2 finds it at drain.
#[test]
fn simulation_catches_a_touch_that_creates_the_wait_marker() {
    let (seed, violation) = first_caught(ProtocolVariant::TouchByPut, 0..5_000, |v| {
        matches!(v, Violation::Debounce(_) | Violation::Lost(_))
    })
    .expect("the simulation should catch a touch that creates the wait marker (B2)");
    println!("touch by put caught by seed {seed}: {violation}");
}

#[test]
fn simulation_catches_trusting_a_dead_holder() {
    let (seed, violation) = first_loss(ProtocolVariant::TrustHolderOnRedelivery)
        .expect("the simulation should catch acking a dead holder's trigger (a lost trigger)");
    println!("trust-on-redelivery caught by seed {seed}: {violation}");
}

/// A seed replays the same: run twice in one process (each run on a runtime of its own, whose
/// `select!`s draw their branch order afresh), a seed with a downstream budget or priority lanes
/// gives the same runs at the same times. Without the budget code's `biased` selects, seed 255
/// did not; a failure here makes every seed's replay (`LEASEHOLD_SIM_SEED`) untrustworthy.
#[test]
fn simulation_budget_and_lane_seeds_replay_the_same() {
    let sampled: Vec<u64> = (0..4_000u64)
        .filter(|seed| {
            let plan = sim::Plan::from_seed(*seed);
            plan.budget.is_some() || plan.lanes.is_some()
        })
        .take(150)
        .collect();
    assert!(sampled.contains(&255), "seed 255 is among those sampled");
    for seed in sampled {
        let first = sim::run_seed_bounded(seed, ProtocolVariant::Correct, sim::SEED_REAL_TIME_LIMIT);
        let again = sim::run_seed_bounded(seed, ProtocolVariant::Correct, sim::SEED_REAL_TIME_LIMIT);
        assert_eq!(
            first.fingerprint, again.fingerprint,
            "seed {seed} ran differently the second time (replay: LEASEHOLD_SIM_SEED={seed} LEASEHOLD_SIM_TRACE=1)"
        );
    }
}

/// Prints each seed's fingerprint (its runs' times and tokens), one `seed fingerprint` line per
/// seed: to show a change to the plan leaves seeds that draw nothing new as they were (save the
/// list before the change, compare after). `LEASEHOLD_SIM_SEEDS` sets how many.
#[test]
#[ignore = "a tool: run it by name"]
fn simulation_fingerprints() {
    for seed in seeds() {
        let report = sim::run_seed_bounded(seed, ProtocolVariant::Correct, sim::SEED_REAL_TIME_LIMIT);
        // A seed that draws a throttle ([`sim::Throttle`]) is marked: it runs differently.
        // So does one that draws a supersede record ([`sim::SupersedePlan`]).
        let plan = sim::Plan::from_seed(seed);
        let mark = match (plan.throttled.is_some(), plan.supersede.is_some()) {
            (true, true) => " throttled supersede",
            (true, false) => " throttled",
            (false, true) => " supersede",
            (false, false) => "",
        };
        // And one whose supersede record's runs fail ([`sim::Plan::supersede_failures`]).
        let failing = if plan.supersede_failures > 0.0 {
            " failing"
        } else {
            ""
        };
        // And one with debounce records ([`sim::DebouncePlan`]).
        let debounce = if plan.debounce.is_some() { " debounce" } else { "" };
        // And one with a downstream budget ([`sim::BudgetPlan`]).
        let budget = if plan.budget.is_some() { " budget" } else { "" };
        // And one with priority lanes ([`sim::LanePlan`]).
        let lanes = if plan.lanes.is_some() { " lanes" } else { "" };
        // And one with a long pause and a dead holder ([`sim::LongPausePlan`]).
        let long_pause = if plan.long_pause.is_some() {
            " long-pause"
        } else {
            ""
        };
        // And one with faults aimed at a pending run's note or a deferral's marker take.
        let pending = if plan.aims_at_pending_steps() {
            " pending-aims"
        } else {
            ""
        };
        println!(
            "fingerprint {seed} {:016x}{mark}{failing}{debounce}{budget}{lanes}{long_pause}{pending}",
            report.fingerprint
        );
    }
}

/// Long-pause seeds ([`sim::LongPausePlan`]) with the priority lanes they draw kept
/// ([`sim::Plan::from_seed_keeping_lanes`]; the main simulation drops them, so its seeds stay as
/// they were). While every budget is paused, the standalone consumer used to set its 5 s pace
/// after a short batch of the high lane, or after the low lane's one due take, though the low
/// lane still held a backlog; a dead holder's message behind it then waited past the recovery
/// bound (seeds 4974, 6982, 9036, 9580 of 10,000). It now sets the pace only once every lane was
/// asked and came back short. Prints the seeds that break safety or the bound, and fails if any
/// does.
#[test]
fn simulation_long_pause_with_lanes() {
    let mut failed = Vec::new();
    let mut ran = 0;
    for seed in seeds() {
        let plan = sim::Plan::from_seed_keeping_lanes(seed);
        if plan.long_pause.is_none() || plan.lanes.is_none() || plan.mode != sim::Mode::Standalone {
            continue;
        }
        ran += 1;
        let report = sim::run_plan_bounded(plan, ProtocolVariant::Correct, sim::SEED_REAL_TIME_LIMIT);
        let broken: Vec<&Violation> = report.violations.iter().filter(|v| v.is_safety()).collect();
        if !broken.is_empty() {
            println!("seed {seed}: {broken:?}");
            failed.push(seed);
        }
    }
    println!(
        "{} of {ran} standalone long-pause seeds with lanes broke safety or the recovery bound: {failed:?}",
        failed.len()
    );
    assert!(failed.is_empty(), "{} seeds broke the bound", failed.len());
}
