//! Section 9: what run history costs (issue 36), history off and on in the same run.
//!
//! * **Before the acknowledgement**: one trigger at a time (put, get, the run, the delete that
//!   acknowledges it), fencing on, history off and on; the writer is flushed before each
//!   trigger, so a history request inside the window could only be the run's own.
//! * **Throughput**: section 3's drain (a queue of triggers, 8 runs at once, no-op logic, fresh
//!   records then the same records seen again), by the minimum protocol, Leasehold with history
//!   off and Leasehold with history on (a [`TableHistory`] in the same Azurite, the writer as
//!   shipped: entries gathered for 2 s, a transaction per partition). Each on an empty Azurite of
//!   its own, the three interleaved in every round (on before off in every other round), so a
//!   noisy moment of the machine hits both alike. The seen pass follows the fresh one with the
//!   writer not flushed between them: the fresh pass's last writes land in the seen pass's
//!   window, as in steady traffic.
//! * **History requests per run**: every history request (writes, the table's creation) once
//!   the writer has written everything, over the runs of both passes.
//! * **A record's history read back**, and the **partitions** the writes spread over.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use leasehold_lock::{OpCounters, OpCounts};
use leasehold_runtime::{
    History, HistoryEntry, HistoryEvent, HistoryOptions, HistoryStore, RecordId, Scope, TableHistory,
};
use leasehold_storage::Op;
use leasehold_storage::table::TableClient;
use leasehold_test_support::Azurite;

use crate::baselines::{Design, Pass, median, pass_with};
use crate::{Probe, env, fmt, leasehold_trigger, runner, summary};

/// The sizes of section 9.
#[derive(Debug, Clone, Copy)]
pub struct Sizes {
    /// Triggers a drain.
    pub records: usize,
    /// Rounds (minimum, off and on in each).
    pub repeats: usize,
    /// Runs at once in a drain.
    pub concurrency: usize,
    /// Triggers sent one at a time for the requests before acknowledgement (fresh, then seen).
    pub triggers: usize,
    /// Records run with a 1 s logic, for history requests per run of a longer run.
    pub long_records: usize,
}

/// The history table prefix the section writes (each design on an Azurite of its own).
const PREFIX: &str = "historybench";

fn history_ops(c: &OpCounts) -> u64 {
    c.get(Op::HistoryWrite) + c.get(Op::HistoryTable) + c.get(Op::HistoryRead)
}

/// A history writer as `serve` wires it, to a table in `az`, counted in `counters`; its table
/// made by a first write (of another scope's record) before anything is measured, as a
/// deployment's is after the period's first write.
async fn history(az: &Azurite, counters: &OpCounters) -> (History, TableClient) {
    let keep = HistoryOptions::default().keep;
    let client = TableClient::new(&az.account(), counters.clone()).expect("Azurite has a Table endpoint");
    let store = TableHistory::new(client.clone(), PREFIX, keep).expect("a valid prefix");
    let history = History::new(
        Arc::new(store) as Arc<dyn HistoryStore>,
        HistoryOptions {
            instance: "bench:1".into(),
            ..HistoryOptions::default()
        },
    );
    history.record(HistoryEntry::new(
        Scope::parse("warm").unwrap(),
        RecordId::parse("warm").unwrap(),
        HistoryEvent::Started,
    ));
    history.flush().await;
    (history, client)
}

/// One design's drains in a round.
struct Drains {
    fresh: Pass,
    seen: Pass,
    /// History requests of both passes, once the writer has written everything.
    history_requests: u64,
    /// Requests to read one record's history, and the entries read.
    read: Option<(u64, usize)>,
    /// Distinct partitions written, entities written, the most entities in one partition.
    partitions: Option<(usize, usize, usize)>,
}

impl Drains {
    fn runs(&self) -> usize {
        self.fresh.records + self.seen.records
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Arm {
    Minimum,
    Off,
    On,
}

impl Arm {
    fn name(self) -> &'static str {
        match self {
            Arm::Minimum => "minimum (get, acquire, release, delete)",
            Arm::Off => "Leasehold (fencing on), history off",
            Arm::On => "Leasehold (fencing on), history on",
        }
    }
}

async fn drains(arm: Arm, records: usize, concurrency: usize, round: usize) -> Drains {
    let az = Azurite::start().expect("an Azurite for the history section");
    let e = env(&az);
    let ids: Vec<String> = (0..records).map(|i| format!("h{round}-{i}")).collect();
    let design = match arm {
        Arm::Minimum => Design::Minimum,
        Arm::Off | Arm::On => Design::Leasehold { fencing: true },
    };
    let writer = if arm == Arm::On {
        Some(history(&az, &e.counters).await)
    } else {
        None
    };
    let h = writer.as_ref().map(|(h, _)| h);
    let before = e.counters.snapshot();
    let fresh = pass_with(&e, design, &ids, concurrency, h).await;
    let seen = pass_with(&e, design, &ids, concurrency, h).await;
    let (mut read, mut partitions, mut history_requests) = (None, None, 0);
    if let Some((history, _)) = &writer {
        history.flush().await;
        let t = e.counters.snapshot();
        history_requests = history_ops(&t.since(&before));
        let scope = Scope::parse("bench").unwrap();
        let record = RecordId::parse(&ids[0]).unwrap();
        let entries = history.read(&scope, &record, 50).await.unwrap();
        read = Some((
            e.counters.snapshot().since(&t).get(Op::HistoryRead),
            entries.len(),
        ));
        partitions = Some(count_partitions(&az).await);
    }
    eprintln!(
        "history: {} (round {round}): fresh {:.0} records/s, seen {:.0} records/s, {history_requests} history requests",
        arm.name(),
        fresh.rate(),
        seen.rate()
    );
    Drains {
        fresh,
        seen,
        history_requests,
        read,
        partitions,
    }
}

/// Every history entity of the drains' scope in `az` (counted apart from the drains): distinct
/// partitions, entities, and the most entities of one partition.
async fn count_partitions(az: &Azurite) -> (usize, usize, usize) {
    let client = TableClient::new(&az.account(), OpCounters::new()).expect("Azurite has a Table endpoint");
    let mut per_partition: HashMap<String, usize> = HashMap::new();
    let mut entities = 0;
    for table in client.list_tables(PREFIX).await.unwrap() {
        let mut next = None;
        loop {
            let (page, more) = client
                .query(&table, None, Some(1000), next.as_ref())
                .await
                .unwrap();
            for entity in page {
                let key = entity
                    .get("PartitionKey")
                    .and_then(serde_json::Value::as_str)
                    .unwrap_or_default()
                    .to_string();
                if !key.starts_with("bench|") {
                    continue;
                }
                entities += 1;
                *per_partition.entry(key).or_default() += 1;
            }
            next = more;
            if next.is_none() {
                break;
            }
        }
    }
    let most = per_partition.values().copied().max().unwrap_or(0);
    (per_partition.len(), entities, most)
}

/// Requests per trigger from its put to its acknowledgement (the queue delete), one trigger at
/// a time, fencing on: (total, of which history) for each trigger, fresh records then seen.
async fn before_ack(az: &Azurite, on: bool, triggers: usize) -> (Vec<(u64, u64)>, Vec<(u64, u64)>) {
    let e = env(az);
    let mut r = runner(&e, Probe::new(Duration::ZERO), true, 30);
    let writer = if on {
        Some(history(az, &e.counters).await.0)
    } else {
        None
    };
    if let Some(h) = &writer {
        r = r.with_history(h.clone());
    }
    // The container, queue and history table exist before anything is counted.
    leasehold_trigger(&e, &r, "warm").await;
    let ids: Vec<String> = (0..triggers).map(|i| format!("ack-{i}")).collect();
    let mut out = (Vec::new(), Vec::new());
    for seen in [false, true] {
        for id in &ids {
            if let Some(h) = &writer {
                h.flush().await;
            }
            let t = e.counters.snapshot();
            leasehold_trigger(&e, &r, id).await;
            let d = e.counters.snapshot().since(&t);
            let row = (d.total(), history_ops(&d));
            if seen {
                out.1.push(row);
            } else {
                out.0.push(row);
            }
        }
    }
    if let Some(h) = &writer {
        h.flush().await;
    }
    out
}

/// History requests per run for runs of 1 s (`records` records, 8 at once, fresh), the writer
/// as shipped: a run longer than a fraction of the 2 s gathering has its start and end written
/// apart at times.
async fn long_runs(records: usize) -> (usize, u64) {
    let az = Azurite::start().expect("an Azurite for the history section");
    let e = env(&az);
    let (h, _) = history(&az, &e.counters).await;
    let probe = Probe::new(Duration::from_secs(1));
    let r = runner(&e, probe.clone(), true, 30).with_history(h.clone());
    let ids: Vec<String> = (0..records).map(|i| format!("long-{i}")).collect();
    let retry = leasehold_lock::RetryOptions::default();
    for id in &ids {
        let body = leasehold_runtime::TriggerMessage::parse("bench", id)
            .unwrap()
            .encode();
        retry
            .run("put", || e.queue.put(&body, Duration::ZERO))
            .await
            .unwrap();
    }
    let before = e.counters.snapshot();
    let consumer = leasehold_runtime::Consumer::new(
        r,
        e.poison.clone(),
        leasehold_runtime::ConsumerOptions {
            concurrency: 8,
            ..leasehold_runtime::ConsumerOptions::default()
        },
    );
    let shutdown = tokio_util::sync::CancellationToken::new();
    let task = {
        let (c, s) = (consumer.clone(), shutdown.clone());
        tokio::spawn(async move { c.run(s).await })
    };
    while probe.ends.lock().unwrap().len() < records {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    shutdown.cancel();
    task.await.unwrap();
    h.flush().await;
    let d = e.counters.snapshot().since(&before);
    (records, d.get(Op::HistoryWrite) + d.get(Op::HistoryTable))
}

fn cell(rows: &[(u64, u64)]) -> String {
    let totals: Vec<f64> = rows.iter().map(|r| r.0 as f64).collect();
    let history: u64 = rows.iter().map(|r| r.1).sum();
    format!("{} (history: {history})", summary(totals))
}

/// Section 9.
pub async fn section(az: &Azurite, sizes: &Sizes, report: &mut String) {
    let Sizes {
        records,
        repeats,
        concurrency,
        triggers,
        long_records,
    } = *sizes;
    writeln!(
        report,
        "## 9. History: what it costs (history off and on in the same run)\n"
    )
    .unwrap();
    writeln!(
        report,
        "History on: the runner writes to a `TableHistory` in the same Azurite (Table service), through the writer as `serve` ships it (entries gathered for 2 s, each partition's written as one entity group transaction, off the run's path). Fencing on, budgets wired (the shipped configuration).\n"
    )
    .unwrap();

    // 1. Before the acknowledgement.
    writeln!(
        report,
        "### Requests per trigger before its acknowledgement ({triggers} triggers one at a time: put, get, run, the delete that acknowledges; the writer flushed before each)\n"
    )
    .unwrap();
    writeln!(
        report,
        "| history | fresh record: requests, median (spread) | seen record |\n| --- | ---: | ---: |"
    )
    .unwrap();
    let mut medians = Vec::new();
    for on in [false, true] {
        let (fresh, seen) = before_ack(az, on, triggers).await;
        medians.push((
            median(fresh.iter().map(|r| r.0 as f64).collect()),
            median(seen.iter().map(|r| r.0 as f64).collect()),
        ));
        writeln!(
            report,
            "| {} | {} | {} |",
            if on { "on" } else { "off" },
            cell(&fresh),
            cell(&seen)
        )
        .unwrap();
    }
    let added = (medians[1].0 - medians[0].0, medians[1].1 - medians[0].1);
    writeln!(
        report,
        "\nAdded by history before the acknowledgement (median on − off): {} fresh, {} seen. \"history: N\": history requests inside those windows, all triggers together.\n",
        added.0, added.1
    )
    .unwrap();

    // 2. Throughput, history requests, the read, the partitions.
    writeln!(
        report,
        "### Throughput: {records} triggers a pass, {concurrency} runs at once, no-op logic, {repeats} rounds (minimum, off and on in each; on and off in turn first)\n"
    )
    .unwrap();
    let arms = [Arm::Minimum, Arm::Off, Arm::On];
    let mut rounds: Vec<Vec<Drains>> = arms.iter().map(|_| Vec::new()).collect();
    for round in 0..repeats {
        let order: [usize; 3] = if round % 2 == 0 { [0, 1, 2] } else { [2, 1, 0] };
        for i in order {
            let d = drains(arms[i], records, concurrency, round).await;
            rounds[i].push(d);
        }
    }
    writeln!(
        report,
        "| design | fresh: records/s | ratio to minimum | seen: records/s | ratio to minimum | requests per record, history's aside (fresh / seen) | history requests per run | in the timed drains, per run (fresh / seen) |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    .unwrap();
    let ratio = |i: usize, seen: bool| -> Vec<f64> {
        rounds[i]
            .iter()
            .zip(&rounds[0])
            .map(|(ours, min)| {
                if seen {
                    ours.seen.rate() / min.seen.rate()
                } else {
                    ours.fresh.rate() / min.fresh.rate()
                }
            })
            .collect()
    };
    for (i, arm) in arms.iter().enumerate() {
        let ds = &rounds[i];
        let other = |p: &Pass| (p.requests.total() - history_ops(&p.requests)) as f64 / p.records as f64;
        let in_window = |p: &Pass| history_ops(&p.requests) as f64 / p.records as f64;
        let (per_run, windows) = if *arm == Arm::On {
            (
                fmt(median(
                    ds.iter()
                        .map(|d| d.history_requests as f64 / d.runs() as f64)
                        .collect(),
                )),
                format!(
                    "{} / {}",
                    fmt(median(ds.iter().map(|d| in_window(&d.fresh)).collect())),
                    fmt(median(ds.iter().map(|d| in_window(&d.seen)).collect()))
                ),
            )
        } else {
            ("–".into(), "–".into())
        };
        writeln!(
            report,
            "| {} | {} | {:.2} | {} | {:.2} | {} / {} | {per_run} | {windows} |",
            arm.name(),
            summary(ds.iter().map(|d| d.fresh.rate()).collect()),
            median(ratio(i, false)),
            summary(ds.iter().map(|d| d.seen.rate()).collect()),
            median(ratio(i, true)),
            fmt(median(ds.iter().map(|d| other(&d.fresh)).collect())),
            fmt(median(ds.iter().map(|d| other(&d.seen)).collect())),
        )
        .unwrap();
    }
    // The fall in the ratio to the minimum, round by round (off's ratio − on's).
    let fall = |seen: bool| -> Vec<f64> {
        ratio(1, seen)
            .iter()
            .zip(ratio(2, seen))
            .map(|(off, on)| off - on)
            .collect()
    };
    let on_off = |seen: bool| -> Vec<f64> {
        rounds[2]
            .iter()
            .zip(&rounds[1])
            .map(|(on, off)| {
                if seen {
                    on.seen.rate() / off.seen.rate()
                } else {
                    on.fresh.rate() / off.fresh.rate()
                }
            })
            .collect()
    };
    writeln!(
        report,
        "\n| history on against off, per round | fresh | seen |\n| --- | ---: | ---: |\n| throughput on / off | {} | {} |\n| fall in the ratio to the minimum (off − on; the issue's limit 0.05) | {} | {} |\n",
        summary(on_off(false)),
        summary(on_off(true)),
        summary(fall(false)),
        summary(fall(true)),
    )
    .unwrap();
    let on = &rounds[2];
    let reads: Vec<(u64, usize)> = on.iter().filter_map(|d| d.read).collect();
    let parts: Vec<(usize, usize, usize)> = on.iter().filter_map(|d| d.partitions).collect();
    writeln!(report, "| history, as written | |\n| --- | ---: |").unwrap();
    if let (Some(read), Some(p)) = (reads.last(), parts.last()) {
        writeln!(
            report,
            "| requests to read one record's history (all rounds) | {} ({} entries, last round) |",
            reads
                .iter()
                .map(|r| r.0.to_string())
                .collect::<Vec<_>>()
                .join(", "),
            read.1
        )
        .unwrap();
        writeln!(
            report,
            "| partitions written, for {records} records (last round) | {} ({} entities; at most {} in one partition) |",
            p.0, p.1, p.2
        )
        .unwrap();
    }
    let (n, writes) = long_runs(long_records).await;
    writeln!(
        report,
        "| history requests per run, runs of 1 s ({n} records, 8 at once) | {} |\n",
        fmt(writes as f64 / n as f64)
    )
    .unwrap();
}
