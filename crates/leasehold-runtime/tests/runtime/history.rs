//! Run history (issue 36) on the in-memory stores with paused time: what a delivery writes for
//! each thing that happens to its record, and that history never holds a run up.

use std::sync::Arc;
use std::time::Duration;

use leasehold_runtime::{History, HistoryEntry, HistoryOptions, MemoryHistory, Outcome, RecordId, Scope};

use crate::budgets::{fixture, handle, trigger};

fn history_of(store: &MemoryHistory, record: &str) -> Vec<HistoryEntry> {
    store
        .all()
        .into_iter()
        .filter(|e| e.record.as_str() == record)
        .collect()
}

/// A run writes `started` then `completed`, with its token, attempt, lane, budget, instance and
/// run time; a trigger that comes during it writes `coalesced`; the retrigger's run writes its
/// own. A throttled run writes `deferred` with until when and why; a trigger turned away by the
/// pause writes `paused` with its budget and until when. A run's start and end, and what
/// coalesced onto it, cost one write when they fall within the flush interval.
#[tokio::test(start_paused = true)]
async fn each_thing_that_happens_to_a_record_is_written_once() {
    let f = fixture(4);
    let store = Arc::new(MemoryHistory::new());
    let history = History::new(
        store.clone(),
        HistoryOptions {
            flush_every: Duration::from_secs(5),
            ..HistoryOptions::default()
        },
    );
    let runner = f.runner.clone().with_history(history.clone());
    f.logic
        .length
        .lock()
        .unwrap()
        .insert("a".into(), Duration::from_secs(2));
    let first = tokio::spawn({
        let runner = runner.clone();
        async move { handle(&runner, trigger("a")).await }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(matches!(handle(&runner, trigger("a")).await, Outcome::Coalesced));
    let Outcome::Completed {
        fencing_token,
        retriggered: true,
        ..
    } = first.await.unwrap()
    else {
        panic!("the first run retriggers");
    };
    history.flush().await;
    let entries = history_of(&store, "a");
    let events: Vec<&str> = entries.iter().map(|e| e.event.as_str()).collect();
    assert_eq!(events, ["started", "coalesced", "retriggered"], "{entries:#?}");
    let (started, ended) = (&entries[0], &entries[2]);
    assert_eq!(started.fencing_token, fencing_token);
    assert_eq!(ended.fencing_token, fencing_token);
    assert_eq!(ended.run_ms, Some(2000));
    assert_eq!(ended.attempt, 1);
    assert_eq!(ended.lane.as_deref(), Some("high"));
    assert_eq!(ended.budget.as_deref(), Some("default"));
    assert!(!ended.instance.is_empty());
    assert_eq!(
        store.appends(),
        1,
        "one write for the run and what coalesced onto it"
    );

    // Read back newest first, through the writer.
    let read = history
        .read(
            &Scope::parse("account").unwrap(),
            &RecordId::parse("a").unwrap(),
            2,
        )
        .await
        .unwrap();
    assert_eq!(
        read.iter().map(|e| e.event.as_str()).collect::<Vec<_>>(),
        ["retriggered", "coalesced"]
    );

    // A throttle: `deferred` until the Retry-After, with why; then another record is paused.
    f.logic
        .throttle
        .lock()
        .unwrap()
        .insert("t".into(), Some(Duration::from_secs(60)));
    assert!(matches!(
        handle(&runner, trigger("t")).await,
        Outcome::Deferred { .. }
    ));
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(matches!(
        handle(&runner, trigger("p")).await,
        Outcome::Paused { .. }
    ));
    history.flush().await;
    let t = history_of(&store, "t");
    let deferred = t.last().unwrap();
    assert_eq!(deferred.event.as_str(), "deferred");
    assert_eq!(deferred.until_ms.map(|u| u - deferred.time_ms), Some(60_000));
    assert!(
        deferred.reason.as_deref().unwrap().contains("429"),
        "{deferred:?}"
    );
    let p = history_of(&store, "p");
    assert_eq!(p.len(), 1, "{p:?}");
    assert_eq!(p[0].event.as_str(), "paused");
    assert_eq!(p[0].budget.as_deref(), Some("default"));
    assert_eq!(p[0].until_ms.map(|u| u - p[0].time_ms), Some(59_000));
}

/// Issue 44, item 3: the sweep of a trigger given up twice, delivered when no trigger came for
/// its record since (the marker not set), stands down without a run: its outcome is
/// `coalesced` (a holder's stand-down), and its history entry says what it was — a sweep that
/// found no trigger left to honour — so that the record's state line does not read it as a
/// trigger on its way.
#[tokio::test(start_paused = true)]
async fn a_sweep_that_finds_nothing_owed_says_so_in_the_history() {
    let f = fixture(4);
    let store = Arc::new(MemoryHistory::new());
    let history = History::new(store.clone(), HistoryOptions::default());
    let runner = f.runner.clone().with_history(history.clone());
    let mut sweep = crate::budgets::delivery("s", leasehold_runtime::TriggerKind::Sweep, 1);
    sweep.message.given_up = 2;
    assert!(matches!(handle(&runner, sweep).await, Outcome::Coalesced));
    assert_eq!(f.logic.runs_of("s"), 0, "nothing ran");
    history.flush().await;
    let entries = history_of(&store, "s");
    assert_eq!(entries.len(), 1, "{entries:#?}");
    assert_eq!(entries[0].event.as_str(), "coalesced");
    let reason = entries[0].reason.as_deref().unwrap_or_default();
    assert!(
        reason.contains("a sweep after a give-up found no trigger left to honour"),
        "{entries:#?}"
    );
    // A trigger that coalesces onto a run says nothing of the kind.
    f.logic
        .length
        .lock()
        .unwrap()
        .insert("t".into(), Duration::from_secs(2));
    let first = tokio::spawn({
        let runner = runner.clone();
        async move { handle(&runner, trigger("t")).await }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(matches!(handle(&runner, trigger("t")).await, Outcome::Coalesced));
    first.await.unwrap();
    history.flush().await;
    let coalesced = history_of(&store, "t");
    assert!(
        coalesced
            .iter()
            .filter(|e| e.event.as_str() == "coalesced")
            .all(|e| e.reason.is_none()),
        "{coalesced:#?}"
    );
}
