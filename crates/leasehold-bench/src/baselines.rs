//! Section 3: throughput against the baselines a user would compare with, at the same
//! concurrency, for fresh records and for records seen before (each design on an empty Azurite
//! of its own); where the requests and the CPU go; and how each scales with concurrency (a table
//! and an SVG plot).
//!
//! The baselines:
//! * **minimum**: the least a correct per-record lock can do per trigger — queue get, lease
//!   acquire (create the lock blob first for a record never seen), run, lease release, queue
//!   delete. No coalescing (a trigger arriving mid-run waits for the lease or is lost), no
//!   fencing.
//! * **Leasehold**, fencing off and on: `serve`'s consumer and runner.
//! * **seed design**: the first design this project replaced (`seed.rs`).
//!
//! Every design drains the same number of triggers already on its queue (the producer's put is
//! not timed or counted), with the same number of runs at once and a no-op logic.

use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use leasehold_lock::{LeaseDuration, LeaseId, OpCounts, StoreErrorKind};
use leasehold_runtime::{Consumer, ConsumerOptions, History, TriggerMessage};
use leasehold_storage::Op;
use leasehold_test_support::Azurite;
use tokio_util::sync::CancellationToken;

use crate::{Env, Probe, env, fmt, runner, seed, summary};

/// A design under measurement.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Design {
    Minimum,
    Leasehold { fencing: bool },
    Seed,
}

impl Design {
    fn name(self) -> &'static str {
        match self {
            Design::Minimum => "minimum (get, acquire, release, delete)",
            Design::Leasehold { fencing: false } => "Leasehold, fencing off",
            Design::Leasehold { fencing: true } => "Leasehold, fencing on (default)",
            Design::Seed => "seed design",
        }
    }

    fn short(self) -> &'static str {
        match self {
            Design::Minimum => "minimum",
            Design::Leasehold { fencing: false } => "Leasehold, fencing off",
            Design::Leasehold { fencing: true } => "Leasehold, fencing on",
            Design::Seed => "seed",
        }
    }
}

/// One drain of a queue of triggers.
#[derive(Debug, Clone)]
pub(crate) struct Pass {
    pub(crate) records: usize,
    pub(crate) elapsed: Duration,
    pub(crate) requests: OpCounts,
    /// CPU time of this process (user + system) during the drain.
    cpu: Duration,
    /// TCP connections opened on the machine during the drain (`/proc/net/snmp` ActiveOpens:
    /// system-wide; Azurite opens none, so on an otherwise idle machine they are this
    /// process's).
    connections: u64,
}

impl Pass {
    pub(crate) fn rate(&self) -> f64 {
        self.records as f64 / self.elapsed.as_secs_f64()
    }

    fn per_record(&self) -> f64 {
        self.requests.total() as f64 / self.records as f64
    }

    fn cpu_per_1000(&self) -> f64 {
        self.cpu.as_secs_f64() * 1000.0 * 1000.0 / self.records as f64
    }

    fn connections_per_1000_requests(&self) -> f64 {
        self.connections as f64 * 1000.0 / self.requests.total().max(1) as f64
    }
}

/// This process's CPU time so far (user + system), from `/proc/self/stat` (in ticks of 10 ms).
fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which may hold spaces), from the 3rd: state, ppid, …;
    // utime and stime are the 14th and 15th.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<u64> = after
        .split_whitespace()
        .skip(1)
        .map(|f| f.parse().unwrap_or(0))
        .collect();
    let ticks = fields.get(10).copied().unwrap_or(0) + fields.get(11).copied().unwrap_or(0);
    Duration::from_millis(ticks * 10)
}

/// TCP connections actively opened on this machine so far (`Tcp: ActiveOpens`).
fn tcp_active_opens() -> u64 {
    let snmp = std::fs::read_to_string("/proc/net/snmp").unwrap_or_default();
    let mut tcp = snmp.lines().filter(|l| l.starts_with("Tcp:"));
    let (Some(names), Some(values)) = (tcp.next(), tcp.next()) else {
        return 0;
    };
    names
        .split_whitespace()
        .zip(values.split_whitespace())
        .find(|(n, _)| *n == "ActiveOpens")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0)
}

/// Puts a trigger for each of `records`, then drains them `design`'s way with `concurrency`
/// runs at once; what the drain took.
async fn pass(e: &Env, design: Design, records: &[String], concurrency: usize) -> Pass {
    pass_with(e, design, records, concurrency, None).await
}

/// [`pass`], Leasehold's runner writing its run history to `history` where given (section 9).
pub(crate) async fn pass_with(
    e: &Env,
    design: Design,
    records: &[String],
    concurrency: usize,
    history: Option<&History>,
) -> Pass {
    // Puts in a row meet a refused connection now and then on a loaded machine: retried, as
    // Start's are (the puts are before the counted drain).
    let retry = leasehold_lock::RetryOptions::default();
    for record in records {
        let body = TriggerMessage::parse("bench", record).unwrap().encode();
        retry
            .run("put", || e.queue.put(&body, Duration::ZERO))
            .await
            .unwrap();
    }
    let n = records.len();
    let before = e.counters.snapshot();
    let (cpu, connections) = (cpu_time(), tcp_active_opens());
    let t = Instant::now();
    match design {
        Design::Leasehold { fencing } => {
            let probe = Probe::new(Duration::ZERO);
            let options = ConsumerOptions {
                concurrency,
                ..ConsumerOptions::default()
            };
            let mut runner = runner(e, probe.clone(), fencing, 30);
            if let Some(history) = history {
                runner = runner.with_history(history.clone());
            }
            let consumer = Consumer::new(runner, e.poison.clone(), options);
            let shutdown = CancellationToken::new();
            let task = {
                let (c, s) = (consumer.clone(), shutdown.clone());
                tokio::spawn(async move { c.run(s).await })
            };
            while probe.ends.lock().unwrap().len() < n {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            shutdown.cancel();
            task.await.unwrap();
        }
        Design::Minimum | Design::Seed => {
            let seed = (design == Design::Seed).then(|| {
                Arc::new(seed::Seed::new(
                    e.store.clone(),
                    e.container.clone(),
                    Probe::new(Duration::ZERO),
                    1,
                ))
            });
            // As the consumer takes them: a batch of as many as there are free slots (at most
            // 32, the queue's limit), each run in a task of its own.
            let slots = Arc::new(tokio::sync::Semaphore::new(concurrency));
            let mut runs = tokio::task::JoinSet::new();
            let mut taken = 0;
            while taken < n {
                let first = slots.clone().acquire_owned().await.unwrap();
                let want = (slots.available_permits() + 1).min(32) as u32;
                let got = e.queue.get(want, Duration::from_secs(60)).await.unwrap();
                if got.is_empty() {
                    drop(first);
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    continue;
                }
                let mut first = Some(first);
                for m in got {
                    let permit = match first.take() {
                        Some(p) => p,
                        None => slots.clone().acquire_owned().await.unwrap(),
                    };
                    taken += 1;
                    let (queue, store, seed) = (e.queue.clone(), e.store.clone(), seed.clone());
                    runs.spawn(async move {
                        let record = TriggerMessage::decode(&m.body).unwrap().record_id.to_string();
                        match &seed {
                            Some(seed) => {
                                seed.handle(&record).await.unwrap();
                            }
                            None => minimum_run(store.as_ref(), &record).await,
                        }
                        queue.delete(&m.id, &m.pop_receipt).await.unwrap();
                        drop(permit);
                    });
                }
            }
            while let Some(run) = runs.join_next().await {
                run.unwrap();
            }
        }
    }
    Pass {
        records: n,
        elapsed: t.elapsed(),
        requests: e.counters.snapshot().since(&before),
        cpu: cpu_time().saturating_sub(cpu),
        connections: tcp_active_opens().saturating_sub(connections),
    }
}

/// The minimum protocol's run of `record`: acquire its lease (creating the lock blob the first
/// time), run nothing, release.
async fn minimum_run(store: &dyn leasehold_lock::LeaseStore, record: &str) {
    let blob = format!("min-lock/{record}");
    let lease = LeaseId::random();
    let duration = LeaseDuration::from_secs(15).unwrap();
    match store.acquire_lease(&blob, lease, duration).await {
        Ok(()) => {}
        Err(e) if e.kind() == StoreErrorKind::NotFound => {
            store.create_blob(&blob).await.unwrap();
            store.acquire_lease(&blob, lease, duration).await.unwrap();
        }
        Err(e) => panic!("minimum: acquire {blob}: {e}"),
    }
    store.release_lease(&blob, lease, None).await.unwrap();
}

/// A fresh pass (records never seen) and then a seen one (the same records again), each on
/// its own queue of `records` triggers, on an Azurite of their own: Azurite keeps everything in
/// one process's memory and slows as it fills (past a few thousand blobs it stalls for more than
/// 10 s at times), so every design starts from an empty one.
async fn fresh_and_seen(design: Design, records: usize, concurrency: usize, round: usize) -> (Pass, Pass) {
    let az = Azurite::start().expect("an Azurite for the baselines");
    let e = env(&az);
    let ids: Vec<String> = (0..records).map(|i| format!("r{round}-{i}")).collect();
    let fresh = pass(&e, design, &ids, concurrency).await;
    let seen = pass(&e, design, &ids, concurrency).await;
    eprintln!(
        "baselines: {} at {concurrency}: fresh {:.0} records/s, seen {:.0} records/s",
        design.short(),
        fresh.rate(),
        seen.rate()
    );
    (fresh, seen)
}

const DESIGNS: [Design; 4] = [
    Design::Minimum,
    Design::Leasehold { fencing: false },
    Design::Leasehold { fencing: true },
    Design::Seed,
];

/// Requests per record of each kind that occurs, e.g. "get 1, acquire 1, release 1, delete 1".
fn by_kind(pass: &Pass) -> String {
    Op::ALL
        .iter()
        .filter(|op| pass.requests.get(**op) > 0)
        .map(|op| {
            format!(
                "{} {}",
                op.name(),
                fmt(pass.requests.get(*op) as f64 / pass.records as f64)
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

pub(crate) fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// The sizes of section 3.
#[derive(Debug, Clone, Copy)]
pub struct Sizes {
    /// Triggers a pass.
    pub records: usize,
    /// Rounds (designs interleaved within a round, so a noisy moment hits all of them).
    pub repeats: usize,
    /// Runs at once for the baselines table.
    pub concurrency: usize,
    /// Triggers a pass for the scaling curve.
    pub scaling_records: usize,
}

/// Section 3: the baselines, then the scaling curve, plotted to `plot`.
pub async fn section(sizes: &Sizes, plot: &Path, report: &mut String) {
    let Sizes {
        records,
        repeats,
        concurrency,
        scaling_records,
    } = *sizes;
    writeln!(
        report,
        "## 3. Throughput against the baselines: {records} triggers a pass, {concurrency} runs at once, no-op logic, median of {repeats}\n"
    )
    .unwrap();
    writeln!(
        report,
        "Each design drains triggers already on its queue (the producer's put is neither timed nor counted). A fresh pass runs records never seen (no lock blob yet); a seen pass runs the same records again. Ratio: to the minimum protocol in the same round. CPU: this process's (user + system) per 1,000 records, seen pass. Connections: TCP connections opened on the machine per 1,000 requests, seen pass.\n"
    )
    .unwrap();
    let mut rounds: Vec<Vec<(Pass, Pass)>> = vec![Vec::new(); DESIGNS.len()];
    for round in 0..repeats {
        for (i, design) in DESIGNS.iter().enumerate() {
            rounds[i].push(fresh_and_seen(*design, records, concurrency, round).await);
        }
    }
    writeln!(
        report,
        "| design | fresh: records/s | ratio | requests per record | seen: records/s | ratio | requests per record | CPU ms per 1,000 | connections per 1,000 requests |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    .unwrap();
    for (i, design) in DESIGNS.iter().enumerate() {
        let passes = &rounds[i];
        // The ratio to the minimum's pass of the same round: `seen` false for the fresh passes.
        let ratio = |seen: bool| {
            median(
                passes
                    .iter()
                    .zip(&rounds[0])
                    .map(|(ours, min)| {
                        if seen {
                            ours.1.rate() / min.1.rate()
                        } else {
                            ours.0.rate() / min.0.rate()
                        }
                    })
                    .collect(),
            )
        };
        writeln!(
            report,
            "| {} | {} | {:.2} | {} | {} | {:.2} | {} | {:.0} | {:.1} |",
            design.name(),
            summary(passes.iter().map(|p| p.0.rate()).collect()),
            ratio(false),
            fmt(median(passes.iter().map(|p| p.0.per_record()).collect())),
            summary(passes.iter().map(|p| p.1.rate()).collect()),
            ratio(true),
            fmt(median(passes.iter().map(|p| p.1.per_record()).collect())),
            median(passes.iter().map(|p| p.1.cpu_per_1000()).collect()),
            median(
                passes
                    .iter()
                    .map(|p| p.1.connections_per_1000_requests())
                    .collect()
            ),
        )
        .unwrap();
    }
    writeln!(
        report,
        "\nRequests per record by kind (last round; the consumer's polls included):\n"
    )
    .unwrap();
    writeln!(report, "| design | fresh | seen |\n| --- | --- | --- |").unwrap();
    for (i, design) in DESIGNS.iter().enumerate() {
        let (fresh, seen) = rounds[i].last().unwrap();
        writeln!(
            report,
            "| {} | {} | {} |",
            design.short(),
            by_kind(fresh),
            by_kind(seen)
        )
        .unwrap();
    }
    writeln!(report).unwrap();
    scaling(scaling_records, plot, report).await;
}

/// Concurrencies of the scaling curve.
const LEVELS: [usize; 6] = [1, 2, 4, 8, 16, 32];

/// Throughput (seen records) at each concurrency, for the minimum and Leasehold; a table and an
/// SVG plot at `plot`.
async fn scaling(records: usize, plot: &Path, report: &mut String) {
    let designs = [
        Design::Minimum,
        Design::Leasehold { fencing: false },
        Design::Leasehold { fencing: true },
    ];
    writeln!(
        report,
        "### Scaling: seen records per second by concurrency ({records} triggers a pass, one process)\n"
    )
    .unwrap();
    writeln!(
        report,
        "| runs at once | {} | {} | {} | Leasehold (fencing on) / minimum |\n| ---: | ---: | ---: | ---: | ---: |",
        designs[0].short(),
        designs[1].short(),
        designs[2].short()
    )
    .unwrap();
    let mut series: Vec<Vec<(usize, f64)>> = vec![Vec::new(); designs.len()];
    for (level_index, level) in LEVELS.iter().enumerate() {
        let mut rates = Vec::new();
        for (i, design) in designs.iter().enumerate() {
            let (_, seen) = fresh_and_seen(*design, records, *level, 100 + level_index).await;
            series[i].push((*level, seen.rate()));
            rates.push(seen.rate());
        }
        writeln!(
            report,
            "| {level} | {:.0} | {:.0} | {:.0} | {:.2} |",
            rates[0],
            rates[1],
            rates[2],
            rates[2] / rates[0]
        )
        .unwrap();
    }
    match draw(&designs, &series, plot) {
        Ok(()) => writeln!(report, "\nPlot: `{}`.\n", plot.display()).unwrap(),
        Err(e) => writeln!(report, "\nThe plot could not be drawn: {e}\n").unwrap(),
    }
}

/// The scaling curve as an SVG: records per second against runs at once (log 2 axis).
fn draw(
    designs: &[Design],
    series: &[Vec<(usize, f64)>],
    path: &Path,
) -> Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let top = series.iter().flatten().map(|(_, r)| *r).fold(1.0_f64, f64::max) * 1.15;
    let root = SVGBackend::new(path, (760, 440)).into_drawing_area();
    root.fill(&WHITE)?;
    // x: log2 of the concurrency, so 1, 2, 4, … 32 are evenly spaced.
    let last = (LEVELS.len() - 1) as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Seen records per second by runs at once (Azurite, one process)",
            ("sans-serif", 17),
        )
        .margin(14)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(-0.2f64..last + 0.2, 0f64..top)?;
    chart
        .configure_mesh()
        .x_desc("runs at once")
        .y_desc("records/s")
        .x_labels(LEVELS.len())
        .x_label_formatter(&|x| format!("{}", 2u32.pow(x.round().max(0.0) as u32)))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .light_line_style(WHITE)
        .bold_line_style(RGBColor(225, 225, 225))
        .draw()?;
    let colours = [
        RGBColor(120, 120, 120),
        RGBColor(31, 119, 180),
        RGBColor(214, 39, 40),
    ];
    for ((design, points), colour) in designs.iter().zip(series).zip(colours) {
        let points: Vec<(f64, f64)> = points.iter().map(|(c, r)| ((*c as f64).log2(), *r)).collect();
        chart
            .draw_series(LineSeries::new(points.clone(), colour.stroke_width(2)))?
            .label(design.short())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 22, y)], colour.stroke_width(2)));
        chart.draw_series(points.iter().map(|p| Circle::new(*p, 3, colour.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK.mix(0.3))
        .draw()?;
    root.present()?;
    Ok(())
}
