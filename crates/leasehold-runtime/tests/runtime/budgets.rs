//! Downstream budgets and priority lanes (issue 25) on the in-memory store and queue, with paused
//! time: the consumer serves both lanes, a pause
//! turns triggers away without counting them as attempts, a holder waits for its slot under its
//! lease and covers what coalesced meanwhile, a holder the pause outlasts hands its trigger back
//! standing for what coalesced onto it, and a carrier is never held. Each test fails without
//! the behaviour it names.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use leasehold_lock::memory::MemoryStore;
use leasehold_lock::{LeaseLock, LeaseOptions, OpCounters, RetryOptions};
use leasehold_runtime::{
    BudgetOptions, Budgets, Delivery, Logic, LogicError, MarkerStore, MemoryBudgets, MemoryMarkers,
    MemoryQueue, Outcome, RecordRunner, RunContext, RunnerOptions, TriggerKind, TriggerMessage, TriggerQueue,
};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Logic whose runs of a record last as long as the test says, and may answer "too many".
#[derive(Default)]
pub(crate) struct Downstream {
    /// Per record: how long its runs take (default 1 s).
    pub(crate) length: Mutex<HashMap<String, Duration>>,
    /// Records whose next run is throttled, with the Retry-After it gives.
    pub(crate) throttle: Mutex<HashMap<String, Option<Duration>>>,
    /// Runs so far, in start order.
    runs: Mutex<Vec<String>>,
    started: Notify,
    /// Runs under way now, and the most there were at once.
    at_once: std::sync::atomic::AtomicUsize,
    pub(crate) most_at_once: std::sync::atomic::AtomicUsize,
}

#[async_trait]
impl Logic for Downstream {
    async fn run(&self, ctx: RunContext) -> Result<(), LogicError> {
        let record = ctx.record_id.to_string();
        self.runs.lock().unwrap().push(record.clone());
        self.started.notify_waiters();
        let now = self.at_once.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        self.most_at_once
            .fetch_max(now, std::sync::atomic::Ordering::SeqCst);
        let length = self
            .length
            .lock()
            .unwrap()
            .get(&record)
            .copied()
            .unwrap_or(Duration::from_secs(1));
        tokio::time::sleep(length).await;
        self.at_once.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        if let Some(asked) = self.throttle.lock().unwrap().remove(&record) {
            return Err(LogicError::throttled(asked, "429 Too Many Requests"));
        }
        Ok(())
    }
}

impl Downstream {
    pub(crate) fn runs_of(&self, record: &str) -> usize {
        self.runs.lock().unwrap().iter().filter(|r| *r == record).count()
    }
}

pub(crate) struct Fixture {
    pub(crate) counters: OpCounters,
    pub(crate) markers: Arc<MemoryMarkers>,
    pub(crate) queue: Arc<MemoryQueue>,
    pub(crate) budget_store: Arc<MemoryBudgets>,
    pub(crate) logic: Arc<Downstream>,
    pub(crate) runner: RecordRunner,
}

pub(crate) fn fixture(max_concurrency: usize) -> Fixture {
    let counters = OpCounters::new();
    let store = Arc::new(MemoryStore::with_counters(counters.clone()));
    let markers = Arc::new(MemoryMarkers::with_counters(counters.clone()));
    let queue = Arc::new(MemoryQueue::new("triggers", counters.clone()));
    let lock = LeaseLock::new(
        store,
        LeaseOptions {
            retry: RetryOptions {
                jitter_seed: Some(1),
                ..RetryOptions::default()
            },
            ..LeaseOptions::default()
        },
    )
    .unwrap();
    let logic = Arc::new(Downstream::default());
    let budget_store = Arc::new(MemoryBudgets::new());
    let runner = RecordRunner::new(
        lock,
        markers.clone(),
        queue.clone(),
        logic.clone(),
        RunnerOptions::default(),
    )
    .with_budgets(Budgets::new(
        budget_store.clone(),
        BudgetOptions {
            max_concurrency,
            ..BudgetOptions::default()
        },
    ));
    Fixture {
        counters,
        markers,
        queue,
        budget_store,
        logic,
        runner,
    }
}

pub(crate) fn delivery(record: &str, kind: TriggerKind, dequeue_count: u32) -> Delivery {
    let mut message = TriggerMessage::parse("account", record).unwrap();
    message.kind = kind;
    Delivery {
        message,
        dequeue_count,
    }
}

pub(crate) fn trigger(record: &str) -> Delivery {
    delivery(record, TriggerKind::Trigger, 1)
}

pub(crate) async fn handle(runner: &RecordRunner, d: Delivery) -> Outcome {
    runner.handle(&d, &CancellationToken::new()).await
}

#[tokio::test(start_paused = true)]
async fn a_throttle_pauses_every_record_and_a_paused_trigger_is_handed_back_without_counting() {
    let f = fixture(4);
    f.logic
        .throttle
        .lock()
        .unwrap()
        .insert("a".into(), Some(Duration::from_secs(60)));
    // The throttled run is put off by the downstream's Retry-After.
    match handle(&f.runner, trigger("a")).await {
        Outcome::Deferred { after, .. } => assert_eq!(after, Duration::from_secs(60)),
        other => panic!("{other:?}"),
    }
    assert!(
        f.budget_store.paused_until("default").is_some(),
        "the pause is shared"
    );
    // Another record's trigger is turned away before it touches anything: the message as it is,
    // back after the pause (59 s left), and the delivery does not count.
    tokio::time::sleep(Duration::from_secs(1)).await;
    match handle(&f.runner, trigger("b")).await {
        Outcome::Paused {
            budget,
            after,
            next,
            by,
        } => {
            assert_eq!(
                (budget.as_str(), by),
                ("default", leasehold_runtime::HeldBy::Pause)
            );
            // Until the pause's end, and the record's spread (under a second).
            assert!(
                after >= Duration::from_secs(59) && after < Duration::from_secs(60),
                "{after:?}"
            );
            assert_eq!(*next, trigger("b").message);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(f.logic.runs_of("b"), 0);
    // With 30 s or less of the pause left, a trigger waits it out under its lease (triggers for
    // the record coalesce onto it meanwhile) and then runs, not before.
    tokio::time::sleep(Duration::from_secs(39)).await;
    let before = tokio::time::Instant::now();
    assert!(matches!(
        handle(&f.runner, trigger("b")).await,
        Outcome::Completed { .. }
    ));
    let took = before.elapsed();
    assert!(
        took >= Duration::from_secs(21) && took < Duration::from_secs(23),
        "ran once the pause (20 s left) was over: {took:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_garbage_or_endless_retry_after_is_defaulted_or_capped() {
    let f = fixture(4);
    // Years: the longest pause (300 s): another record's trigger is handed back for all of it.
    f.logic
        .throttle
        .lock()
        .unwrap()
        .insert("a".into(), Some(Duration::from_secs(10 * 365 * 86_400)));
    match handle(&f.runner, trigger("a")).await {
        Outcome::Deferred { after, .. } => assert_eq!(after, Duration::from_secs(300)),
        other => panic!("{other:?}"),
    }
    match handle(&f.runner, trigger("b")).await {
        // The pause, and the record's spread (under a second).
        Outcome::Paused { after, .. } => assert_eq!(after.as_secs(), 300, "{after:?}"),
        other => panic!("{other:?}"),
    }
    tokio::time::sleep(Duration::from_secs(300)).await;
    // No usable Retry-After: the default pause (10 s), which a trigger waits out.
    f.logic.throttle.lock().unwrap().insert("a".into(), None);
    match handle(&f.runner, trigger("a")).await {
        Outcome::Deferred { after, .. } => assert_eq!(after, Duration::from_secs(10)),
        other => panic!("{other:?}"),
    }
    let before = tokio::time::Instant::now();
    assert!(matches!(
        handle(&f.runner, trigger("b")).await,
        Outcome::Completed { .. }
    ));
    assert!(
        before.elapsed() >= Duration::from_secs(10),
        "{:?}",
        before.elapsed()
    );
}

/// Standalone, with every budget paused the consumer takes one batch per 5 s at most until the
/// pause ends: each message taken would only wait or be handed back (with a backlog, a pass over
/// all of it per pause), but a dead holder's message must still be taken within the recovery
/// bound.
#[tokio::test(start_paused = true)]
async fn a_consumer_takes_a_batch_per_5_s_at_most_while_every_budget_is_paused() {
    use leasehold_runtime::{Consumer, ConsumerOptions};

    let f = fixture(4);
    f.logic
        .throttle
        .lock()
        .unwrap()
        .insert("a".into(), Some(Duration::from_secs(60)));
    assert!(matches!(
        handle(&f.runner, trigger("a")).await,
        Outcome::Deferred { .. }
    ));
    for i in 0..20 {
        f.queue
            .put(
                &TriggerMessage::parse("account", &format!("b{i}"))
                    .unwrap()
                    .encode(),
                Duration::ZERO,
            )
            .await
            .unwrap();
    }
    let poison: Arc<dyn TriggerQueue> = Arc::new(MemoryQueue::new("poison", OpCounters::new()));
    let consumer = Consumer::new(f.runner.clone(), poison, ConsumerOptions::default());
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { consumer.run(shutdown).await }
    });
    let gets_before = f.counters.snapshot().get(leasehold_lock::Op::QueueGet);
    tokio::time::sleep(Duration::from_secs(50)).await;
    let gets = f.counters.snapshot().get(leasehold_lock::Op::QueueGet) - gets_before;
    // One at each 5 s, and one more at once after the first: its batch came full (16 of the
    // 20), so more might have been waiting behind it (a dead holder's message among them).
    assert!(gets <= 12, "{gets} polls in 50 s of pause");
    assert_eq!(
        f.logic.runs.lock().unwrap().len(),
        1,
        "nothing ran during the pause"
    );
    tokio::time::sleep(Duration::from_secs(30)).await;
    shutdown.cancel();
    running.await.unwrap();
    assert_eq!(f.logic.runs.lock().unwrap().len(), 21, "all ran once it ended");
}

/// A holder waits for a slot of its budget under its lease; a trigger that comes meanwhile
/// finds the lease held and sets the marker; the run, starting after it, covers it: the marker
/// is cleared before the run, so no retrigger follows (without that, one run more).
#[tokio::test(start_paused = true)]
async fn a_holder_that_waited_for_its_slot_covers_the_triggers_that_came_meanwhile() {
    let f = fixture(1);
    f.logic
        .length
        .lock()
        .unwrap()
        .insert("a".into(), Duration::from_secs(20));
    let runner = f.runner.clone();
    let long = tokio::spawn(async move { handle(&runner, trigger("a")).await });
    f.logic.started.notified().await;
    // b takes its lease, then waits for the only slot.
    let runner = f.runner.clone();
    let waiting = tokio::spawn(async move { handle(&runner, trigger("b")).await });
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(f.logic.runs_of("b"), 0, "b waits for a's slot");
    // A trigger for b meanwhile coalesces onto the waiting holder.
    assert_eq!(handle(&f.runner, trigger("b")).await, Outcome::Coalesced);
    assert!(f.markers.is_set(&trigger("b").message.key()).await.unwrap());
    assert!(matches!(long.await.unwrap(), Outcome::Completed { .. }));
    match waiting.await.unwrap() {
        Outcome::Completed { retriggered, .. } => assert!(!retriggered, "the run covered it"),
        other => panic!("{other:?}"),
    }
    assert_eq!(f.logic.runs_of("b"), 1);
    assert!(f.queue.bodies().is_empty(), "no retrigger");
}

/// A holder whose budget a throttle paused while it waited for its slot, for longer than it
/// may wait (under Functions, 30 s), hands its trigger back: as a holder — the lease released,
/// the marker taken — and the trigger handed back stands for what coalesced onto the hold: a
/// plain trigger that may not stand down for a later run (no `afterToken`).
#[tokio::test(start_paused = true)]
async fn a_holder_the_pause_outlasts_hands_its_trigger_back_for_what_coalesced_too() {
    let f = fixture(1);
    f.logic
        .length
        .lock()
        .unwrap()
        .insert("a".into(), Duration::from_secs(5));
    f.logic
        .throttle
        .lock()
        .unwrap()
        .insert("a".into(), Some(Duration::from_secs(120)));
    let poison = Arc::new(MemoryQueue::new("poison", OpCounters::new()));
    let runner = f.runner.clone();
    let throttled = tokio::spawn(async move { handle(&runner, trigger("a")).await });
    f.logic.started.notified().await;
    // b's delivery (under Functions: it waits at most 30 s) takes its lease and waits.
    let runner = f.runner.clone();
    let poison2 = poison.clone();
    let mut b = trigger("b");
    b.message.after_token = Some(7);
    let waiting = tokio::spawn(async move {
        runner
            .handle_watched(&b, &*poison2, &CancellationToken::new())
            .await
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(handle(&f.runner, trigger("b")).await, Outcome::Coalesced);
    assert!(matches!(throttled.await.unwrap(), Outcome::Deferred { .. }));
    match waiting.await.unwrap() {
        Outcome::Paused { after, next, .. } => {
            assert!(after > Duration::from_secs(100), "{after:?}");
            assert_eq!(next.kind, TriggerKind::Trigger);
            assert_eq!(next.after_token, None, "it stands for a fresh trigger now");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(f.logic.runs_of("b"), 0);
    assert!(
        !f.markers.is_set(&trigger("b").message.key()).await.unwrap(),
        "taken: the trigger handed back covers it"
    );
    let b = trigger("b").message;
    assert!(
        !f.runner.status(&b.scope, &b.record_id).await.unwrap().lock.held,
        "released"
    );
    // The hand-back is a message of its own (the watchdog became it), hidden until the pause
    // ends; the host's message is acknowledged.
    let kinds: Vec<TriggerKind> = f
        .queue
        .bodies()
        .iter()
        .map(|b| TriggerMessage::decode(b).unwrap().kind)
        .collect();
    assert_eq!(
        kinds,
        [TriggerKind::Trigger],
        "b's trigger handed back (a's deferral is the consumer's to persist)"
    );
    assert!(poison.bodies().is_empty());
}

/// A carrier (here a recheck, standing in for a dead holder) is neither turned away by a pause
/// nor held by the limit: its record runs again within the recovery bound.
#[tokio::test(start_paused = true)]
async fn a_carrier_is_never_held_by_its_budget() {
    let f = fixture(1);
    f.logic
        .length
        .lock()
        .unwrap()
        .insert("a".into(), Duration::from_secs(60));
    let runner = f.runner.clone();
    let long = tokio::spawn(async move { handle(&runner, trigger("a")).await });
    f.logic.started.notified().await;
    // The only slot is a's, for a minute: a recheck of b runs at once all the same.
    let started = tokio::time::Instant::now();
    assert!(matches!(
        handle(&f.runner, delivery("b", TriggerKind::Recheck, 1)).await,
        Outcome::Completed { .. }
    ));
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    // And through a pause.
    f.logic
        .throttle
        .lock()
        .unwrap()
        .insert("c".into(), Some(Duration::from_secs(60)));
    assert!(matches!(
        handle(&f.runner, delivery("c", TriggerKind::Recheck, 1)).await,
        Outcome::Deferred { .. }
    ));
    assert!(matches!(
        handle(&f.runner, delivery("b", TriggerKind::Watchdog, 1)).await,
        Outcome::Completed { .. }
    ));
    // A redelivered trigger (standalone: it may stand in for its own dead holder) likewise.
    assert!(matches!(
        handle(&f.runner, delivery("d", TriggerKind::Trigger, 2)).await,
        Outcome::Completed { .. }
    ));
    // But a fresh trigger is turned away.
    assert!(matches!(
        handle(&f.runner, trigger("e")).await,
        Outcome::Paused { .. }
    ));
    long.abort();
}

/// A throttled run's deferral is a recheck, a carrier, but one its live holder wrote after its
/// release: it stands in for nobody, so it meets its budget as a trigger does — turned away by
/// the pause, held by the limit. Were it let through as a carrier, each throttle's deferral
/// would start beyond the limit when it came back and be throttled again (seen in the
/// benchmark: a probe's refusal came back as a fourth run beside three). A look again made
/// from it (it found the lease held) may stand in, and is not held.
#[tokio::test(start_paused = true)]
async fn a_throttled_runs_deferral_meets_its_budget_as_a_trigger_does() {
    let f = fixture(1);
    let deferral = throttled_deferral(&f).await;
    assert_eq!(deferral.kind, TriggerKind::Recheck);
    let back = Delivery {
        message: deferral.clone(),
        dequeue_count: 1,
    };
    assert!(!back.may_stand_in());
    // Back early (a clock ahead, a copy): turned away by the pause.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(matches!(
        handle(&f.runner, back.clone()).await,
        Outcome::Paused { .. }
    ));
    // After the pause, with the only slot taken by b's run of a minute: it waits for the slot.
    tokio::time::sleep(Duration::from_secs(60)).await;
    f.logic
        .length
        .lock()
        .unwrap()
        .insert("b".into(), Duration::from_secs(60));
    let runner = f.runner.clone();
    let long = tokio::spawn(async move { handle(&runner, trigger("b")).await });
    f.logic.started.notified().await;
    let runner = f.runner.clone();
    let waiting = tokio::spawn(async move { handle(&runner, back).await });
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(f.logic.runs_of("a"), 1, "held by the limit while b runs");
    assert!(matches!(long.await.unwrap(), Outcome::Completed { .. }));
    assert!(matches!(waiting.await.unwrap(), Outcome::Completed { .. }));
    assert_eq!(f.logic.runs_of("a"), 2);
    // Its look again may stand in for a dead holder: not held by the limit.
    let again = Delivery {
        message: deferral.looking_again(TriggerKind::Recheck, 0),
        dequeue_count: 1,
    };
    assert!(again.may_stand_in());
    let runner = f.runner.clone();
    let long = tokio::spawn(async move { handle(&runner, trigger("b")).await });
    f.logic.started.notified().await;
    let started = tokio::time::Instant::now();
    assert!(matches!(
        handle(&f.runner, again).await,
        Outcome::Completed { .. }
    ));
    assert!(started.elapsed() < Duration::from_secs(5));
    long.abort();
}

/// The deferral of record `a`'s run, throttled with a minute's Retry-After.
async fn throttled_deferral(f: &Fixture) -> TriggerMessage {
    f.logic
        .throttle
        .lock()
        .unwrap()
        .insert("a".into(), Some(Duration::from_secs(60)));
    match handle(&f.runner, trigger("a")).await {
        Outcome::Deferred { next, .. } => *next,
        other => panic!("{other:?}"),
    }
}

/// A throttled run's deferral of record `a` ([`throttled_deferral`]), come back after the pause
/// to find `a`'s lease held by someone else: the deferral, and the holder.
async fn deferral_meeting_a_holder(f: &Fixture) -> (TriggerMessage, leasehold_lock::LeaseGuard) {
    let deferral = throttled_deferral(f).await;
    assert_eq!(deferral.deferral.map(|d| d.released), Some(true));
    tokio::time::sleep(Duration::from_secs(61)).await;
    let holder = f
        .runner
        .lock()
        .try_acquire(&deferral.key())
        .await
        .unwrap()
        .unwrap();
    (deferral, holder)
}

/// The look again a deferral left: of the same chain, and able to stand in (`released` cleared).
fn assert_stands_in(again: &str, deferral: &TriggerMessage) {
    let again = TriggerMessage::decode(again).unwrap();
    assert_eq!(again.deferral.map(|d| d.released), Some(false));
    assert_eq!(
        again.deferral.map(|d| d.id),
        deferral.deferral.map(|d| d.id),
        "the same chain"
    );
    assert!(
        Delivery {
            message: again,
            dequeue_count: 1
        }
        .may_stand_in()
    );
}

/// A throttled run's deferral that comes back to find the lease held looks again through the
/// runner, and that look again may stand in for the holder (`released` cleared), as any look
/// again of a trigger: the holder may be the dead one the deferral stands in for, and a look
/// again held by the limit like a trigger would wait behind it. (The runner's own call site:
/// a deferral's look again that kept `released` would be held by the limit.)
#[tokio::test(start_paused = true)]
async fn a_deferral_that_finds_the_lease_held_looks_again_as_a_stand_in() {
    let f = fixture(1);
    let (deferral, holder) = deferral_meeting_a_holder(&f).await;
    let before = f.queue.bodies().len();
    let outcome = handle(
        &f.runner,
        Delivery {
            message: deferral.clone(),
            dequeue_count: 1,
        },
    )
    .await;
    assert!(matches!(outcome, Outcome::Rechecking { .. }), "{outcome:?}");
    let bodies = f.queue.bodies();
    assert_eq!(bodies.len(), before + 1, "one look again");
    assert_stands_in(bodies.last().unwrap(), &deferral);
    holder.release().await.unwrap();
}

/// The same under Functions: the deferral's watchdog, left in place as its look again, is
/// rewritten into a message that may stand in.
#[tokio::test(start_paused = true)]
async fn under_functions_a_deferral_that_finds_the_lease_held_looks_again_as_a_stand_in() {
    let f = fixture(1);
    let (deferral, holder) = deferral_meeting_a_holder(&f).await;
    let poison = MemoryQueue::new("poison", OpCounters::new());
    let outcome = f
        .runner
        .handle_watched(
            &Delivery {
                message: deferral.clone(),
                dequeue_count: 1,
            },
            &poison,
            &CancellationToken::new(),
        )
        .await;
    assert!(matches!(outcome, Outcome::Rechecking { .. }), "{outcome:?}");
    let bodies = f.queue.bodies();
    assert_eq!(bodies.len(), 1, "the watchdog, as the look again: {bodies:?}");
    assert_stands_in(&bodies[0], &deferral);
    holder.release().await.unwrap();
}

/// Standalone, one consumer takes from both lanes: the high lane first, and while the low lane
/// has messages at least one start in `low_every` comes from it, however full the high lane is
/// (a bulk import is slowed, never starved). Without the turn, the low lane would wait for the
/// high one to empty.
#[tokio::test(start_paused = true)]
async fn the_consumer_serves_the_high_lane_first_and_never_starves_the_low_one() {
    use leasehold_runtime::{Consumer, ConsumerOptions, Lane};

    let f = fixture(8);
    let low_queue = Arc::new(MemoryQueue::new("triggers-low", OpCounters::new()));
    let lock = f.runner.lock().clone();
    let low_runner = RecordRunner::new(
        lock,
        f.markers.clone(),
        low_queue.clone(),
        f.logic.clone(),
        RunnerOptions::default(),
    )
    .with_lane(Lane::Low);
    for i in 0..12 {
        f.queue
            .put(
                &TriggerMessage::parse("account", &format!("h{i}"))
                    .unwrap()
                    .encode(),
                Duration::ZERO,
            )
            .await
            .unwrap();
    }
    for i in 0..3 {
        low_queue
            .put(
                &TriggerMessage::parse("account", &format!("l{i}"))
                    .unwrap()
                    .encode(),
                Duration::ZERO,
            )
            .await
            .unwrap();
    }
    let poison: Arc<dyn TriggerQueue> = Arc::new(MemoryQueue::new("poison", OpCounters::new()));
    let options = ConsumerOptions {
        concurrency: 1,
        batch_size: 1,
        low_every: 4,
        ..ConsumerOptions::default()
    };
    let consumer = Consumer::new(f.runner.clone(), poison.clone(), options).with_low_lane(low_runner, poison);
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { consumer.run(shutdown).await }
    });
    tokio::time::sleep(Duration::from_secs(60)).await;
    shutdown.cancel();
    running.await.unwrap();
    let order = f.logic.runs.lock().unwrap().clone();
    assert_eq!(order.len(), 15, "{order:?}");
    let lows: Vec<usize> = order
        .iter()
        .enumerate()
        .filter(|(_, r)| r.starts_with('l'))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(lows, [3, 7, 11], "one low start in every four: {order:?}");
}

/// Under Functions a trigger that meets a pause longer than it may wait is acknowledged to the
/// host and comes back as a copy, hidden until the pause ends, that carries its attempts so far:
/// the delivery does not count (its next delivery is attempt 3 again, not 4).
#[tokio::test(start_paused = true)]
async fn under_functions_a_paused_trigger_comes_back_as_a_copy_that_keeps_its_attempts() {
    let f = fixture(4);
    f.logic
        .throttle
        .lock()
        .unwrap()
        .insert("a".into(), Some(Duration::from_secs(60)));
    assert!(matches!(
        handle(&f.runner, trigger("a")).await,
        Outcome::Deferred { .. }
    ));
    let poison = MemoryQueue::new("poison", OpCounters::new());
    // The third attempt of b's trigger: a retry (two failed deliveries before), first delivered.
    let mut third = trigger("b");
    third.message.prior_attempts = 2;
    assert_eq!(third.attempts(), 3);
    let outcome = f
        .runner
        .handle_watched(&third, &poison, &CancellationToken::new())
        .await;
    let Outcome::Paused { after, next, .. } = outcome else {
        panic!("{outcome:?}")
    };
    // The pause, and the record's spread (under a second).
    assert_eq!(after.as_secs(), 60, "{after:?}");
    assert_eq!(f.logic.runs_of("b"), 0);
    let queued: Vec<TriggerMessage> = f
        .queue
        .bodies()
        .iter()
        .map(|b| TriggerMessage::decode(b).unwrap())
        .collect();
    assert_eq!(queued, [*next.clone()], "one copy, and no watchdog left");
    let again = Delivery {
        message: *next,
        dequeue_count: 1,
    };
    assert_eq!(again.attempts(), 3, "the paused delivery did not count");
    assert_eq!(f.queue.visible_len(), 0, "hidden until the pause ends");
}

/// Issue 35, item 1: the consumer of a worker whose budget is paused, with `concurrency` slots,
/// debounce in scope `saves` (its triggers skip the first gate and meet the pause under their
/// leases), and a record `dead` whose holder died at `died_at` (its message taken, its lease
/// left to expire): when does `dead` run again? The fixture's lease is 30 s and the consumer's
/// visibility 35 s (lease + the carrier margin), so the bound is `died_at` + 35 s + a poll.
struct PausedWorker {
    f: Fixture,
    shutdown: CancellationToken,
    running: tokio::task::JoinHandle<()>,
    budgets: Budgets,
}

fn paused_worker(concurrency: usize, debounce: bool) -> PausedWorker {
    limited_worker(concurrency, debounce, 8)
}

/// [`paused_worker`] whose budget's limit is `limit`.
fn limited_worker(concurrency: usize, debounce: bool, limit: usize) -> PausedWorker {
    use leasehold_runtime::{Consumer, ConsumerOptions, Debounce, PerScope, Scope};

    let mut f = fixture(limit);
    let budgets = f.runner.budgets().unwrap().clone();
    let mut options = RunnerOptions::default();
    if debounce {
        options.debounce = PerScope::new(None).with(
            Scope::parse("saves").unwrap(),
            Debounce::new(Duration::from_secs(2), Duration::from_secs(10)),
        );
    }
    f.runner = RecordRunner::new(
        f.runner.lock().clone(),
        f.markers.clone(),
        f.queue.clone(),
        f.logic.clone(),
        options,
    )
    .with_budgets(budgets.clone());
    let poison: Arc<dyn TriggerQueue> = Arc::new(MemoryQueue::new("poison", OpCounters::new()));
    let consumer = Consumer::new(
        f.runner.clone(),
        poison,
        ConsumerOptions {
            concurrency,
            ..ConsumerOptions::default()
        },
    );
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { consumer.run(shutdown).await }
    });
    PausedWorker {
        f,
        shutdown,
        running,
        budgets,
    }
}

impl PausedWorker {
    async fn put(&self, scope: &str, record: &str) {
        let body = TriggerMessage::parse(scope, record).unwrap().encode();
        self.f.queue.put(&body, Duration::ZERO).await.unwrap();
    }

    /// Pauses the budget for `pause`, as a throttled run of this worker does.
    async fn pause(&self, pause: Duration) {
        let leasehold_runtime::Admission::Go(mut permit) = self
            .budgets
            .admit(
                &"account".parse().unwrap(),
                leasehold_runtime::Lane::High,
                None,
                false,
            )
            .await
        else {
            panic!("a stand-in's slot")
        };
        permit.throttled("r", pause, false).await;
    }

    /// A holder of `record` dies now: its lease granted and never renewed nor released, and
    /// its carrier (as its message, taken and pushed just before the lease's last renewal,
    /// would) surfacing 35 s later: lease + the carrier margin.
    async fn kill_a_holder_of(&self, record: &str) {
        let mut carrier = TriggerMessage::parse("account", record).unwrap();
        self.f
            .runner
            .lock()
            .try_acquire(&carrier.key())
            .await
            .unwrap()
            .unwrap()
            .abandon();
        carrier.kind = TriggerKind::Recheck;
        self.f
            .queue
            .put(&carrier.encode(), Duration::from_secs(35))
            .await
            .unwrap();
    }

    /// When `record` first ran (time since `since`), if it did within `within`.
    async fn first_run_of(
        &self,
        record: &str,
        since: tokio::time::Instant,
        within: Duration,
    ) -> Option<Duration> {
        let deadline = since + within;
        loop {
            if self.f.logic.runs_of(record) > 0 {
                return Some(since.elapsed());
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn stop(self) {
        self.shutdown.cancel();
        self.running.await.unwrap();
    }
}

/// Way in one: triggers of a debouncing scope skip the first gate and meet the pause under their
/// leases. With a 300 s pause they waited it out, each holding a slot of the consumer: with 2
/// slots and 2 such records, a killed holder's record ran again after the pause, not within
/// lease + 5 s. Now a pause over 30 s hands them back, and one that ends sooner is waited out
/// without a slot.
#[tokio::test(start_paused = true)]
async fn a_dead_holders_record_runs_within_the_bound_while_debounce_waiters_meet_a_long_pause() {
    let w = paused_worker(2, true);
    w.pause(Duration::from_secs(300)).await;
    for record in ["s1", "s2", "s3"] {
        w.put("saves", record).await;
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    let died = tokio::time::Instant::now();
    w.kill_a_holder_of("dead").await;
    let ran = w.first_run_of("dead", died, Duration::from_secs(60)).await;
    assert!(
        ran.is_some_and(|t| t <= Duration::from_secs(35 + 5)),
        "the dead holder's record ran again after {ran:?} (bound: lease + 5 s and a poll)"
    );
    assert_eq!(
        ["s1", "s2", "s3"].map(|r| w.f.logic.runs_of(r)),
        [0, 0, 0],
        "the saves wait for the pause"
    );
    w.stop().await;
}

/// Way in two: a backlog during the pause, and a dead holder's message that surfaces when the
/// pause has less than 30 s left, when triggers pass the first gate and wait under their
/// leases. They filled every slot (killed holder's record: 123 s instead of about 20 s); now
/// they park in the waiting room, and once it is full a trigger that would wait for the pause
/// is handed back before its lease.
#[tokio::test(start_paused = true)]
async fn a_dead_holders_record_runs_within_the_bound_behind_a_backlog_at_a_pauses_end() {
    let w = paused_worker(2, false);
    let start = tokio::time::Instant::now();
    w.pause(Duration::from_secs(120)).await;
    // Saves all through the pause: one every 2 s.
    let saves = {
        let queue = w.f.queue.clone();
        tokio::spawn(async move {
            for i in 0..55 {
                let body = TriggerMessage::parse("account", &format!("b{i}"))
                    .unwrap()
                    .encode();
                queue.put(&body, Duration::ZERO).await.unwrap();
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        })
    };
    // Its message surfaces 35 s later: when the pause has 25 s left.
    tokio::time::sleep_until(start + Duration::from_secs(60)).await;
    let died = tokio::time::Instant::now();
    w.kill_a_holder_of("dead").await;
    let ran = w.first_run_of("dead", died, Duration::from_secs(90)).await;
    assert!(
        ran.is_some_and(|t| t <= Duration::from_secs(35 + 5)),
        "the dead holder's record ran again after {ran:?} (bound: lease + 5 s and a poll)"
    );
    saves.await.unwrap();
    // And the backlog drains once the pause is over: every save runs.
    tokio::time::sleep(Duration::from_secs(120)).await;
    for i in 0..55 {
        assert!(w.f.logic.runs_of(&format!("b{i}")) >= 1, "b{i} never ran");
    }
    w.stop().await;
}

/// A record of another budget is not held behind holders that wait for a paused one: they wait
/// without a slot of the consumer.
#[tokio::test(start_paused = true)]
async fn another_budgets_trigger_is_taken_while_holders_wait_for_a_short_pause() {
    let w = paused_worker(2, false);
    // Short enough to be waited out under the lease.
    w.pause(Duration::from_secs(25)).await;
    w.put("account", "w1").await;
    w.put("account", "w2").await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    // A stand-in (a recheck) of this budget runs through the pause: it needs a slot.
    let mut recheck = TriggerMessage::parse("account", "standin").unwrap();
    recheck.kind = TriggerKind::Recheck;
    w.f.queue.put(&recheck.encode(), Duration::ZERO).await.unwrap();
    let since = tokio::time::Instant::now();
    let ran = w.first_run_of("standin", since, Duration::from_secs(20)).await;
    // Every budget paused: the consumer polls every 5 s (the pace), and finds a slot.
    assert!(
        ran.is_some_and(|t| t <= Duration::from_secs(6)),
        "the stand-in waited {ran:?} for a slot that waiting holders kept"
    );
    assert_eq!([w.f.logic.runs_of("w1"), w.f.logic.runs_of("w2")], [0, 0]);
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!([w.f.logic.runs_of("w1"), w.f.logic.runs_of("w2")], [1, 1]);
    w.stop().await;
}

/// Under Functions a delivery waits out only a pause of 5 s or less: the wait holds one of the
/// host's invocations, and while all of them are held the host takes no message, a dead
/// holder's watchdog included. A 20 s pause hands the trigger back at once (it was waited out,
/// as standalone, where the wait gives the consumer's slot back).
#[tokio::test(start_paused = true)]
async fn under_functions_a_pause_over_5_s_hands_the_trigger_back_at_once() {
    let f = fixture(4);
    f.logic
        .length
        .lock()
        .unwrap()
        .insert("b".into(), Duration::from_millis(10));
    let poison = MemoryQueue::new("poison", OpCounters::new());
    // Written by another worker; this one has read it.
    f.budget_store
        .set_paused_until("default", tokio::time::Instant::now() + Duration::from_secs(20));
    let budgets = f.runner.budgets().unwrap();
    budgets.paused(&"account".parse().unwrap());
    tokio::task::yield_now().await;
    assert!(budgets.paused(&"account".parse().unwrap()).is_some());
    let started = tokio::time::Instant::now();
    let outcome = f
        .runner
        .handle_watched(&trigger("b"), &poison, &CancellationToken::new())
        .await;
    match outcome {
        Outcome::Paused { after, .. } => {
            assert!(after > Duration::from_secs(15), "{after:?}")
        }
        other => panic!("{other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(f.logic.runs_of("b"), 0);
}

/// With the waiting room full, a holder that waits for its budget's limit (not a pause) waits in
/// its slot of the consumer for 5 s at most, then hands its trigger back to come again a second
/// later: while runs of the budget are long, a dead holder's message finds the slot. Limit 1,
/// two slots: a 100 s run holds the budget and one slot, two holders fill the room, a third
/// waits in the other slot. Before the bound the killed holder's record ran again only when the
/// long run ended (96 s after its death), not within lease + 5 s.
#[tokio::test(start_paused = true)]
async fn a_dead_holders_record_runs_within_the_bound_while_holders_wait_for_the_limit() {
    let w = limited_worker(2, false, 1);
    w.f.logic
        .length
        .lock()
        .unwrap()
        .insert("long".into(), Duration::from_secs(100));
    w.put("account", "long").await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    for record in ["w1", "w2", "w3"] {
        w.put("account", record).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let died = tokio::time::Instant::now();
    w.kill_a_holder_of("dead").await;
    let ran = w.first_run_of("dead", died, Duration::from_secs(120)).await;
    println!("the dead holder's record ran again after {ran:?}");
    assert!(
        ran.is_some_and(|t| t <= Duration::from_secs(35 + 5)),
        "the dead holder's record ran again after {ran:?} (bound: lease + 5 s and a poll)"
    );
    w.stop().await;
}

/// Standalone, a trigger handed back for a 5-minute pause, and then the pause resumed: `here`
/// through this worker's own [`Budgets::resume`] (the dashboard), else in storage by another
/// process (`leasehold budget resume`), which this worker reads while it holds the trigger
/// though it starts no run. Returns how long after the resume the trigger ran. Without the
/// release of handed-back triggers it ran at the pause's original end, 5 minutes on.
async fn handed_back_then_resumed(here: bool) -> Duration {
    use leasehold_runtime::{BudgetStore, Consumer, ConsumerOptions};

    let f = fixture(4);
    f.logic
        .throttle
        .lock()
        .unwrap()
        .insert("a".into(), Some(Duration::from_secs(300)));
    assert!(matches!(
        handle(&f.runner, trigger("a")).await,
        Outcome::Deferred { .. }
    ));
    f.queue
        .put(&trigger("b").message.encode(), Duration::ZERO)
        .await
        .unwrap();
    let poison: Arc<dyn TriggerQueue> = Arc::new(MemoryQueue::new("poison", OpCounters::new()));
    let consumer = Consumer::new(f.runner.clone(), poison, ConsumerOptions::default());
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { consumer.run(shutdown).await }
    });
    // Taken, and handed back: hidden for the rest of the pause.
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert_eq!(f.logic.runs_of("b"), 0);
    assert_eq!(f.queue.peek(1).await.unwrap().len(), 0, "hidden");
    let resumed = tokio::time::Instant::now();
    if here {
        assert!(f.runner.budgets().unwrap().resume("default").await.unwrap());
    } else {
        assert!(f.budget_store.resume("default").await.unwrap());
    }
    let deadline = resumed + Duration::from_secs(300);
    while f.logic.runs_of("b") == 0 {
        assert!(tokio::time::Instant::now() < deadline, "never ran");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let after = resumed.elapsed();
    shutdown.cancel();
    running.await.unwrap();
    after
}

#[tokio::test(start_paused = true)]
async fn a_resume_here_makes_the_triggers_handed_back_for_the_pause_visible_at_once() {
    let after = handed_back_then_resumed(true).await;
    // Visible at once, and the consumer, which took one batch per 5 s while every budget was
    // paused, polls at once.
    assert!(
        after <= Duration::from_millis(500),
        "ran {after:?} after the resume"
    );
}

#[tokio::test(start_paused = true)]
async fn a_resume_in_storage_makes_the_triggers_handed_back_for_the_pause_visible_within_a_read() {
    let after = handed_back_then_resumed(false).await;
    // Read within the refresh interval (3 s), visible, polled.
    assert!(
        after <= Duration::from_millis(3500),
        "ran {after:?} after the resume"
    );
}

/// A downstream that takes 3 calls at once, 150 ms each, and answers every call past that with
/// 429 and `Retry-After: 1` (the benchmark's bulk section, in memory).
#[derive(Default)]
struct ThreeAtOnce {
    in_flight: std::sync::atomic::AtomicUsize,
    done: std::sync::atomic::AtomicUsize,
    refused: std::sync::atomic::AtomicUsize,
}

#[async_trait]
impl Logic for ThreeAtOnce {
    async fn run(&self, _ctx: RunContext) -> Result<(), LogicError> {
        use std::sync::atomic::Ordering::SeqCst;
        if self.in_flight.fetch_add(1, SeqCst) >= 3 {
            self.in_flight.fetch_sub(1, SeqCst);
            self.refused.fetch_add(1, SeqCst);
            return Err(LogicError::throttled(
                Some(Duration::from_secs(1)),
                "429 Too Many Requests",
            ));
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
        self.in_flight.fetch_sub(1, SeqCst);
        self.done.fetch_add(1, SeqCst);
        Ok(())
    }
}

/// `queued` triggers through [`ThreeAtOnce`] on one worker of 8 slots, the budget's limit
/// adaptive or not: queue updates and requests per completed run, and runs a second.
async fn bulk_through_three_at_once(adaptive: bool, queued: usize) -> (f64, f64, f64) {
    use leasehold_runtime::{Consumer, ConsumerOptions};
    use std::sync::atomic::Ordering::SeqCst;

    let f = fixture(8);
    let logic = Arc::new(ThreeAtOnce::default());
    let runner = RecordRunner::new(
        f.runner.lock().clone(),
        f.markers.clone(),
        f.queue.clone(),
        logic.clone(),
        RunnerOptions::default(),
    )
    .with_budgets(Budgets::new(
        f.budget_store.clone(),
        BudgetOptions {
            max_concurrency: 8,
            adaptive,
            ..BudgetOptions::default()
        },
    ));
    for i in 0..queued {
        let body = TriggerMessage::parse("account", &format!("bulk{i}"))
            .unwrap()
            .encode();
        f.queue.put(&body, Duration::ZERO).await.unwrap();
    }
    let poison: Arc<dyn TriggerQueue> = Arc::new(MemoryQueue::new("poison", OpCounters::new()));
    let consumer = Consumer::new(runner, poison, ConsumerOptions::default());
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { consumer.run(shutdown).await }
    });
    let before = f.counters.snapshot();
    let start = tokio::time::Instant::now();
    while logic.done.load(SeqCst) < queued && start.elapsed() < Duration::from_secs(3600) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let drained = start.elapsed();
    let after = f.counters.snapshot();
    shutdown.cancel();
    running.await.unwrap();
    assert_eq!(logic.done.load(SeqCst), queued, "every trigger ran");
    let per_run = |n: u64| n as f64 / queued as f64;
    (
        per_run(after.get(leasehold_lock::Op::QueueUpdate) - before.get(leasehold_lock::Op::QueueUpdate)),
        per_run(after.total() - before.total()),
        queued as f64 / drained.as_secs_f64(),
    )
}

/// A bulk drain through a downstream that takes 3 calls at once keeps (nearly) all the rate it
/// allows with adaptive concurrency, handing each trigger back about once at most: a guard on
/// the limit's hand-backs before the lock (issue 44, item 2), which, applied to short runs,
/// cut this drain from 19 runs a second to under 5 (a trigger handed back for a second when a
/// slot frees every 50 ms). Without adaptive concurrency the same drain costs 41 queue updates
/// per run here, as before this change (each queued trigger met again at each 1 s pause): still
/// open, printed.
#[tokio::test(start_paused = true)]
async fn a_bulk_drain_through_a_throttled_downstream_keeps_its_rate() {
    let (updates, requests, rate) = bulk_through_three_at_once(true, 500).await;
    eprintln!(
        "adaptive: {updates:.1} queue updates and {requests:.1} requests per run, {rate:.1} runs/s of 20 allowed"
    );
    assert!(rate >= 17.0, "{rate:.1} runs/s of the 20 allowed");
    assert!(updates <= 2.0, "{updates:.1} queue updates per run");
    let (updates, requests, rate) = bulk_through_three_at_once(false, 500).await;
    eprintln!(
        "not adaptive: {updates:.1} queue updates and {requests:.1} requests per run, {rate:.1} runs/s of 20 allowed"
    );
}

/// A throttle that lengthens the budget's pause by under a second is not written to storage
/// (not worth a write), but this worker keeps it: its next read of the shared pause used to end
/// the pause at the shared end, and runs started before the pause it had been asked for was
/// over — 8 of them in 30 s of `Retry-After: 1` throttles 0.9 s apart.
#[tokio::test(start_paused = true)]
async fn a_pause_lengthened_by_under_a_second_holds_through_reads_of_the_shared_one() {
    let w = paused_worker(8, false);
    w.pause(Duration::from_secs(1)).await;
    for i in 0..50 {
        w.put("account", &format!("b{i}")).await;
    }
    let start = tokio::time::Instant::now();
    while start.elapsed() < Duration::from_secs(30) {
        w.pause(Duration::from_secs(1)).await;
        tokio::time::sleep(Duration::from_millis(900)).await;
    }
    let runs: usize = (0..50).map(|i| w.f.logic.runs_of(&format!("b{i}"))).sum();
    assert_eq!(runs, 0, "runs started while the budget was paused");
    tokio::time::sleep(Duration::from_secs(60)).await;
    for i in 0..50 {
        assert_eq!(w.f.logic.runs_of(&format!("b{i}")), 1, "b{i}");
    }
    w.stop().await;
}

/// What a drain of `queued` triggers of 10 s runs costs on a worker with `concurrency` slots
/// and a budget limit of `limit`: requests and lease acquires per run.
async fn drain_of_long_runs(concurrency: usize, limit: usize, queued: usize) -> (f64, f64) {
    let w = limited_worker(concurrency, false, limit);
    for i in 0..queued {
        let record = format!("long{i}");
        w.f.logic
            .length
            .lock()
            .unwrap()
            .insert(record.clone(), Duration::from_secs(10));
        w.put("account", &record).await;
    }
    let before = w.f.counters.snapshot();
    let start = tokio::time::Instant::now();
    let runs = |w: &PausedWorker| {
        (0..queued)
            .filter(|i| w.f.logic.runs_of(&format!("long{i}")) > 0)
            .count()
    };
    while runs(&w) < queued && start.elapsed() < Duration::from_secs(3600) {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    // The last runs end.
    tokio::time::sleep(Duration::from_secs(15)).await;
    let after = w.f.counters.snapshot();
    for i in 0..queued {
        assert_eq!(w.f.logic.runs_of(&format!("long{i}")), 1, "long{i}");
    }
    let requests = (after.total() - before.total()) as f64 / queued as f64;
    let acquires = (after.get(leasehold_lock::Op::LeaseAcquire)
        - before.get(leasehold_lock::Op::LeaseAcquire)) as f64
        / queued as f64;
    w.stop().await;
    (requests, acquires)
}

/// Issue 44, item 2: with the waiting room full and the budget at its limit, each further
/// delivery took its record's lease and a fencing token, waited 5 s in the consumer's slot,
/// released and was handed back to come again a second later: 10 s runs, a limit of 2, 60
/// queued cost 9.7 lease acquires and 84 requests per run on Azurite, against 2.1 and 16 with
/// the consumer's concurrency cut to 2. Now such a delivery is handed back before the lock, at
/// its turn (its budget's pace: a run's time per slot of the limit, behind those handed back
/// before it): each trigger is handed back about once.
#[tokio::test(start_paused = true)]
async fn waiting_for_a_budgets_limit_costs_about_what_a_cut_concurrency_costs() {
    let (requests, acquires) = drain_of_long_runs(8, 2, 60).await;
    let (control_requests, control_acquires) = drain_of_long_runs(2, 2, 60).await;
    eprintln!(
        "limit 2 of 8 slots: {requests:.1} requests, {acquires:.2} lease acquires per run; \
         concurrency 2: {control_requests:.1}, {control_acquires:.2}"
    );
    // Measured here: 2.20 lease acquires and 19.9 requests per run against 2.00 and 11.6 (the
    // requests: polls of a queue whose backlog is hidden until its turns, and the marker each
    // waiting holder clears); with the holders waiting in the consumer's slots instead, 2.97
    // acquires per run here and 9.7 on Azurite.
    assert!(
        acquires <= 1.25 * control_acquires,
        "{acquires:.2} lease acquires per run (control {control_acquires:.2})"
    );
    assert!(
        requests <= 1.8 * control_requests,
        "{requests:.1} requests per run (control {control_requests:.1})"
    );
}

/// Issue 44, item 7: a resume ends the consumer's paced wait (every budget paused: one poll per
/// 5 s) at once, not at the next paced poll: a trigger put during the pause runs as soon as the
/// budget is resumed. (The existing resume tests' resumes land in other waits; removing the
/// paced wait's wake-up went unseen.)
#[tokio::test(start_paused = true)]
async fn a_resume_ends_the_consumers_paced_wait_at_once() {
    let w = paused_worker(2, false);
    w.pause(Duration::from_secs(60)).await;
    // The consumer polls the (empty) queue and paces its next poll 5 s on.
    tokio::time::sleep(Duration::from_secs(2)).await;
    w.put("account", "saved").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(w.f.logic.runs_of("saved"), 0, "the pause holds it");
    let resumed = tokio::time::Instant::now();
    w.budgets.resume("default").await.unwrap();
    let ran = w.first_run_of("saved", resumed, Duration::from_secs(10)).await;
    assert!(
        ran.is_some_and(|t| t < Duration::from_secs(1)),
        "ran {ran:?} after the resume (the paced poll was due 2.5 s later)"
    );
    w.stop().await;
}

/// Issue 44, item 7: holders that waited out a pause in the consumer's waiting room take a free
/// slot of the consumer back once admitted; runs never exceed the consumer's concurrency. (A
/// holder that ran in its seat instead let the consumer take and run more than its slots; no
/// test saw it.) Two slots, a 10 s pause, six triggers of 3 s runs.
#[tokio::test(start_paused = true)]
async fn holders_admitted_after_a_wait_take_their_slots_back() {
    let w = paused_worker(2, false);
    w.pause(Duration::from_secs(10)).await;
    for i in 0..6 {
        let record = format!("w{i}");
        w.f.logic
            .length
            .lock()
            .unwrap()
            .insert(record.clone(), Duration::from_secs(3));
        w.put("account", &record).await;
    }
    tokio::time::sleep(Duration::from_secs(60)).await;
    for i in 0..6 {
        assert_eq!(w.f.logic.runs_of(&format!("w{i}")), 1, "w{i}");
    }
    let most = w.f.logic.most_at_once.load(std::sync::atomic::Ordering::SeqCst);
    assert!(most <= 2, "{most} runs at once on a consumer of 2 slots");
    w.stop().await;
}
