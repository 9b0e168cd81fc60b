//! The runner and consumer against a real Azurite: real leases, real queue, real round trips.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use leasehold_lock::azure::AzureBlobStore;
use leasehold_lock::{LeaseDuration, LeaseLock, LeaseOptions, Op, OpCounters, OpCounts};
use leasehold_runtime::{
    AzureMarkers, AzureQueue, Consumer, ConsumerOptions, Delivery, Logic, LogicError, MarkerSet, MarkerStore,
    Outcome, RecordRunner, RunContext, RunnerOptions, TriggerMessage, TriggerQueue, poison_queue_name,
    record_status,
};
use leasehold_test_support::{Azurite, eventually, unique_name, unless_transient};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Shortest lease Azure allows, so the crash test is quick.
fn lease_options(fencing: bool) -> LeaseOptions {
    LeaseOptions {
        duration: LeaseDuration::from_secs(15).unwrap(),
        renew_every: Duration::from_secs(5),
        safety_margin: Duration::from_secs(2),
        fencing,
        holder: "azurite-test".into(),
        ..LeaseOptions::default()
    }
}

#[derive(Debug, Clone)]
struct Run {
    record: String,
    start: Instant,
    end: Option<Instant>,
    completed: bool,
}

/// Logic that records runs, detects overlap per record, and can be held open by the test.
#[derive(Default)]
struct Recorder {
    runs: Mutex<Vec<Run>>,
    active: Mutex<std::collections::HashMap<String, usize>>,
    overlaps: AtomicUsize,
    duration: Mutex<Duration>,
    hold: tokio::sync::Notify,
    holding: AtomicBool,
    started: AtomicUsize,
}

impl Recorder {
    fn with_duration(d: Duration) -> Arc<Self> {
        let r = Arc::new(Self::default());
        *r.duration.lock().unwrap() = d;
        r
    }

    fn completed_after(&self, record: &str, t: Instant) -> bool {
        self.runs
            .lock()
            .unwrap()
            .iter()
            .any(|r| r.record == record && r.start > t && r.completed)
    }

    fn runs_of(&self, record: &str) -> usize {
        self.runs
            .lock()
            .unwrap()
            .iter()
            .filter(|r| r.record == record)
            .count()
    }
}

#[async_trait]
impl Logic for Recorder {
    async fn run(&self, ctx: RunContext) -> Result<(), LogicError> {
        let index = {
            let mut active = self.active.lock().unwrap();
            let n = active.entry(ctx.record_id.to_string()).or_default();
            *n += 1;
            if *n > 1 {
                self.overlaps.fetch_add(1, Ordering::SeqCst);
            }
            let mut runs = self.runs.lock().unwrap();
            runs.push(Run {
                record: ctx.record_id.to_string(),
                start: Instant::now(),
                end: None,
                completed: false,
            });
            runs.len() - 1
        };
        self.started.fetch_add(1, Ordering::SeqCst);
        let duration = *self.duration.lock().unwrap();
        let outcome = tokio::select! {
            biased;
            _ = ctx.cancel.cancelled() => Err(LogicError::new("cancelled")),
            _ = async {
                if self.holding.load(Ordering::SeqCst) {
                    self.hold.notified().await;
                } else {
                    tokio::time::sleep(duration).await;
                }
            } => Ok(()),
        };
        *self
            .active
            .lock()
            .unwrap()
            .get_mut(ctx.record_id.as_str())
            .unwrap() -= 1;
        let mut runs = self.runs.lock().unwrap();
        runs[index].end = Some(Instant::now());
        runs[index].completed = outcome.is_ok();
        outcome
    }
}

struct Setup {
    counters: OpCounters,
    queue: Arc<dyn TriggerQueue>,
    poison: Arc<dyn TriggerQueue>,
    container: String,
}

fn setup() -> Setup {
    let queue_name = unique_name("triggers");
    let account = Azurite::shared().account();
    let counters = OpCounters::new();
    Setup {
        queue: Arc::new(AzureQueue::new(&account, &queue_name, counters.clone())),
        poison: Arc::new(AzureQueue::new(
            &account,
            &poison_queue_name(&queue_name),
            counters.clone(),
        )),
        container: unique_name("locks"),
        counters,
    }
}

fn runner(setup: &Setup, logic: Arc<dyn Logic>, fencing: bool) -> RecordRunner {
    let account = Azurite::shared().account();
    let store = Arc::new(AzureBlobStore::new(
        &account,
        &setup.container,
        setup.counters.clone(),
    ));
    let lock = LeaseLock::new(store, lease_options(fencing)).unwrap();
    let markers = Arc::new(AzureMarkers::new(
        &account,
        &setup.container,
        setup.counters.clone(),
    ));
    RecordRunner::new(
        lock,
        markers,
        setup.queue.clone(),
        logic,
        RunnerOptions::default(),
    )
}

/// A runner as `leasehold serve` and `leasehold handler` ship it ([`RecordRunner::shipped`]):
/// drawing on a downstream budget (default options) whose blob is in the setup's container,
/// its requests counted with the rest.
fn shipped_runner(setup: &Setup, logic: Arc<dyn Logic>, fencing: bool) -> RecordRunner {
    let account = Azurite::shared().account();
    let store = Arc::new(AzureBlobStore::new(
        &account,
        &setup.container,
        setup.counters.clone(),
    ));
    let lock = LeaseLock::new(store, lease_options(fencing)).unwrap();
    let markers = Arc::new(AzureMarkers::new(
        &account,
        &setup.container,
        setup.counters.clone(),
    ));
    let budgets = leasehold_runtime::Budgets::new(
        Arc::new(leasehold_runtime::AzureBudgets::new(
            &account,
            &setup.container,
            setup.counters.clone(),
        )),
        leasehold_runtime::BudgetOptions::default(),
    );
    RecordRunner::shipped(
        lock,
        markers,
        setup.queue.clone(),
        logic,
        RunnerOptions::default(),
        &budgets,
        leasehold_runtime::Lane::High,
    )
}

/// A trigger's requests, less the budget's background read of its pause (one per
/// `refresh_every`, 3 s, per worker while it starts runs of the budget, off the run's path),
/// which is reported apart.
fn per_trigger(counts: &OpCounts) -> u64 {
    counts.total() - counts.get(Op::BudgetRead)
}

fn consumer_options() -> ConsumerOptions {
    ConsumerOptions {
        visibility: Duration::from_secs(20),
        visibility_renew_every: Duration::from_secs(5),
        poll_max: Duration::from_millis(500),
        retry_delay: Duration::from_secs(1),
        ..ConsumerOptions::default()
    }
}

/// Start's part (put) and a worker's part (get, handle, delete) for one trigger; returns the
/// outcome.
async fn one_trigger(setup: &Setup, runner: &RecordRunner, record: &str) -> Outcome {
    deliver(setup, runner, record, false).await
}

/// One trigger through the queue: put, get, the runner (`watched`: as under Functions, with a
/// watchdog), delete if acknowledged.
async fn deliver(setup: &Setup, runner: &RecordRunner, record: &str, watched: bool) -> Outcome {
    setup
        .queue
        .put(
            &TriggerMessage::parse("acct", record).unwrap().encode(),
            Duration::ZERO,
        )
        .await
        .unwrap();
    let received = eventually(Duration::from_secs(10), "the trigger to be visible", || async {
        let mut got = unless_transient(
            setup.queue.get(1, Duration::from_secs(30)).await,
            "taking the trigger",
        )?;
        got.pop()
    })
    .await;
    let delivery = Delivery {
        message: TriggerMessage::decode(&received.body).unwrap(),
        dequeue_count: 1,
    };
    let outcome = if watched {
        runner
            .handle_watched(&delivery, &*setup.poison, &CancellationToken::new())
            .await
    } else {
        runner.handle(&delivery, &CancellationToken::new()).await
    };
    if outcome.acknowledge() {
        setup
            .queue
            .delete(&received.id, &received.pop_receipt)
            .await
            .unwrap();
    }
    outcome
}

fn counted(setup: &Setup, since: &OpCounts) -> OpCounts {
    setup.counters.snapshot().since(since)
}

/// Round trips per trigger, queue operations included, once the queue, container and record
/// exist: uncontended 6 (8 with fencing); a trigger during a run 6 for the first (it makes the
/// second acquire a marker's creator owes) and 5 for the rest.
/// Markers on Azurite: the first set on a container that does not exist yet creates it; a
/// marker is created once (whoever creates it knows), read, and taken once; the runner's status
/// reads it beside the lease.
#[tokio::test]
async fn markers_are_created_once_and_taken_once() {
    let account = Azurite::shared().account();
    let counters = OpCounters::new();
    let container = unique_name("markers");
    let markers = AzureMarkers::new(&account, &container, counters.clone());
    let message = TriggerMessage::parse("acct", "m").unwrap();
    let key = message.key();
    assert!(!markers.is_set(&key).await.unwrap(), "no container yet: not set");
    assert_eq!(markers.set(&key).await.unwrap(), MarkerSet::Created);
    let counts = counters.snapshot();
    assert_eq!(
        (counts.get(Op::FlagPut), counts.get(Op::ContainerCreate)),
        (2, 1),
        "the first set creates the container and is sent once more: {counts}"
    );
    assert_eq!(
        markers.counters().snapshot(),
        counters.snapshot(),
        "the store records into the counters it was given"
    );
    assert_eq!(markers.set(&key).await.unwrap(), MarkerSet::AlreadySet);
    assert!(markers.is_set(&key).await.unwrap());

    let store = Arc::new(AzureBlobStore::new(&account, &container, counters.clone()));
    let lock = LeaseLock::new(store, lease_options(true)).unwrap();
    let status = record_status(&lock, &markers, &message.scope, &message.record_id)
        .await
        .unwrap();
    assert!(status.retrigger_pending && !status.lock.held, "{status:?}");

    assert!(markers.take(&key).await.unwrap());
    assert!(!markers.take(&key).await.unwrap());
    assert!(!markers.is_set(&key).await.unwrap());
}

/// Wait markers on Azurite, as the debounce paths assume them: created once (`If-None-Match: *`,
/// whoever creates it gets its ETag), looked at with the same ETag, touched (a metadata write:
/// the ETag changes, and a touch never creates one), consumed only with the ETag it has (a stale
/// one is a 412 that leaves it), or unconditionally; a marker made again gets a new ETag. Each
/// call is one round trip (the first create on a container that does not exist yet: two, and
/// the container create; a conditional consume that fails: a look after the 412, which the
/// service answers for a deleted marker too).
#[tokio::test]
async fn wait_markers_are_created_touched_and_consumed_as_debounce_assumes() {
    use leasehold_runtime::WaitConsumed;

    let account = Azurite::shared().account();
    let counters = OpCounters::new();
    let markers = AzureMarkers::new(&account, &unique_name("waits"), counters.clone());
    let key = TriggerMessage::parse("acct", "w").unwrap().key();

    // What one call sent: exactly one request of `op`.
    let sent = |before: OpCounts, op: Op, call: &str| {
        let counts = counters.snapshot().since(&before);
        assert_eq!(
            (counts.get(op), counts.total()),
            (1, 1),
            "{call}: one {op} request and nothing else: {counts}"
        );
    };

    let t = counters.snapshot();
    let created = markers.wait_create(&key).await.unwrap().expect("created");
    let counts = counters.snapshot().since(&t);
    assert_eq!(
        (
            counts.get(Op::WaitPut),
            counts.get(Op::ContainerCreate),
            counts.total()
        ),
        (2, 1, 3),
        "the first create makes the container and is sent once more: {counts}"
    );
    assert!(!created.is_empty(), "an ETag: {created:?}");

    let t = counters.snapshot();
    assert_eq!(markers.wait_create(&key).await.unwrap(), None, "there already");
    sent(t, Op::WaitPut, "create again");

    let t = counters.snapshot();
    assert_eq!(
        markers.wait_look(&key).await.unwrap().as_deref(),
        Some(created.as_str()),
        "a look sees the ETag the create answered, written the same way"
    );
    sent(t, Op::WaitHead, "look");

    let t = counters.snapshot();
    assert!(markers.wait_touch(&key).await.unwrap(), "touched");
    sent(t, Op::WaitTouch, "touch");
    let touched = markers.wait_look(&key).await.unwrap().expect("still there");
    assert_ne!(touched, created, "a touch changes the ETag");

    // A failed conditional delete is a 412 whether the marker changed or is gone: a look
    // tells which (a second round trip, only then).
    let looked = |before: OpCounts, call: &str| {
        let counts = counters.snapshot().since(&before);
        assert_eq!(
            (
                counts.get(Op::WaitDelete),
                counts.get(Op::WaitHead),
                counts.total()
            ),
            (1, 1, 2),
            "{call}: a delete, then a look: {counts}"
        );
    };
    let t = counters.snapshot();
    assert_eq!(
        markers.wait_consume(&key, Some(&created)).await.unwrap(),
        WaitConsumed::Changed,
        "a stale ETag: 412, left as it is"
    );
    looked(t, "consume with a stale ETag");
    assert_eq!(
        markers.wait_look(&key).await.unwrap().as_deref(),
        Some(touched.as_str()),
        "the marker stays, untouched"
    );

    let t = counters.snapshot();
    assert_eq!(
        markers.wait_consume(&key, Some(&touched)).await.unwrap(),
        WaitConsumed::Consumed
    );
    sent(t, Op::WaitDelete, "consume with the current ETag");

    let t = counters.snapshot();
    assert_eq!(
        markers.wait_consume(&key, Some(&touched)).await.unwrap(),
        WaitConsumed::Gone,
        "conditional consume of a deleted marker: gone, not changed (Azurite answers 412)"
    );
    looked(t, "consume again (conditional)");
    let t = counters.snapshot();
    assert_eq!(
        markers.wait_consume(&key, None).await.unwrap(),
        WaitConsumed::Gone
    );
    sent(t, Op::WaitDelete, "consume again (unconditional)");

    let t = counters.snapshot();
    assert!(!markers.wait_touch(&key).await.unwrap(), "nothing to touch");
    sent(t, Op::WaitTouch, "touch of a deleted marker");
    let t = counters.snapshot();
    assert_eq!(
        markers.wait_look(&key).await.unwrap(),
        None,
        "a touch never creates the marker"
    );
    sent(t, Op::WaitHead, "look at a deleted marker");

    let t = counters.snapshot();
    let again = markers.wait_create(&key).await.unwrap().expect("created again");
    sent(t, Op::WaitPut, "create after a consume");
    assert!(
        again != created && again != touched,
        "a marker made again has a new ETag: {again} (before: {created}, {touched})"
    );

    // Unconditional: whatever its ETag (touched since the create).
    assert!(markers.wait_touch(&key).await.unwrap());
    let t = counters.snapshot();
    assert_eq!(
        markers.wait_consume(&key, None).await.unwrap(),
        WaitConsumed::Consumed
    );
    sent(t, Op::WaitDelete, "unconditional consume");
    assert_eq!(markers.wait_look(&key).await.unwrap(), None);

    // The ETag a metadata write answers is written as a look writes it (quotes included).
    let blob =
        leasehold_storage::azure::BlobContainer::new(&account, &unique_name("waits"), OpCounters::new());
    blob.create().await.unwrap();
    let made = blob.create_empty_tagged("b", Op::WaitPut).await.unwrap().unwrap();
    let metadata = std::collections::HashMap::from([("k".to_string(), "v".to_string())]);
    let written = blob
        .set_metadata_if_present("b", &metadata, Op::WaitTouch)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        blob.etag("b", Op::WaitHead).await.unwrap().as_deref(),
        Some(written.as_str())
    );
    assert_ne!(made, written);
    assert!(
        made.starts_with('"') && made.ends_with('"'),
        "quoted as the service sends it: {made}"
    );

    // A record's status shows its wait marker.
    let container = unique_name("waits");
    let markers = AzureMarkers::new(&account, &container, counters.clone());
    let message = TriggerMessage::parse("acct", "w").unwrap();
    let store = Arc::new(AzureBlobStore::new(&account, &container, counters.clone()));
    let lock = LeaseLock::new(store, lease_options(false)).unwrap();
    markers.wait_create(&key).await.unwrap().expect("created");
    let status = record_status(&lock, &markers, &message.scope, &message.record_id)
        .await
        .unwrap();
    assert!(status.waiting && !status.retrigger_pending, "{status:?}");
    assert_eq!(
        markers.counters().snapshot(),
        counters.snapshot(),
        "the store records into the counters it was given"
    );
}

/// A message Leasehold puts (a trigger, a retrigger, a poison entry) is kept until it is taken:
/// by default Azure drops a queue message 7 days after it was put, unread and unreported.
#[tokio::test]
async fn messages_are_kept_until_taken() {
    let account = Azurite::shared().account();
    let queue = AzureQueue::new(&account, &unique_name("ttl"), OpCounters::new());
    queue.put("now", Duration::ZERO).await.unwrap();
    queue.put("later", Duration::from_secs(1)).await.unwrap();
    let peeked = queue.peek(32).await.unwrap();
    assert_eq!(peeked.len(), 1, "the delayed one is not visible yet: {peeked:?}");
    assert_eq!(peeked[0].expires_at, None, "{:?} expires", peeked[0]);
    assert!(
        peeked[0].inserted_at.is_some(),
        "the service's dates are read: {peeked:?}"
    );
}

/// Issue 44, item 1: a message hidden again for under a second stays hidden (the service's unit
/// is a second: the time was rounded down, to none, and a trigger handed back for a pause with
/// under a second left was taken straight back, again and again).
#[tokio::test]
async fn a_message_hidden_for_under_a_second_is_not_visible_at_once() {
    let account = Azurite::shared().account();
    let queue = AzureQueue::new(&account, &unique_name("hide"), OpCounters::new());
    queue.put("handed back", Duration::ZERO).await.unwrap();
    let taken = queue.get(1, Duration::from_secs(30)).await.unwrap();
    let [taken] = taken.as_slice() else {
        panic!("one message: {taken:?}")
    };
    queue
        .set_visibility(
            &taken.id,
            &taken.pop_receipt,
            "handed back",
            Duration::from_millis(300),
        )
        .await
        .unwrap();
    let again = queue.get(1, Duration::from_secs(30)).await.unwrap();
    assert!(again.is_empty(), "visible at once: {again:?}");
    // And it does come back, once its whole second is over.
    tokio::time::sleep(Duration::from_millis(2100)).await;
    assert_eq!(queue.get(1, Duration::from_secs(30)).await.unwrap().len(), 1);
}

#[tokio::test]
async fn round_trips_per_trigger() {
    for fencing in [false, true] {
        let setup = setup();
        let logic = Recorder::with_duration(Duration::from_millis(10));
        let runner = shipped_runner(&setup, logic.clone(), fencing);
        one_trigger(&setup, &runner, "warm-up").await; // creates queue, container, blob

        let t0 = setup.counters.snapshot();
        let outcome = one_trigger(&setup, &runner, "warm-up").await;
        assert!(
            matches!(
                outcome,
                Outcome::Completed {
                    retriggered: false,
                    ..
                }
            ),
            "{outcome:?}"
        );
        let uncontended = counted(&setup, &t0);
        println!("[azurite] fencing={fencing}: uncontended trigger: {uncontended}");
        // Queue put, get and delete; lease acquire (and the token's increment, fencing on) and
        // release; the marker's take: once, the slot of the budget being free at once (a
        // second take before the run only after a wait for it).
        assert_eq!(
            per_trigger(&uncontended),
            if fencing { 7 } else { 6 },
            "{uncontended}"
        );
        assert!(uncontended.get(Op::BudgetRead) <= 1, "{uncontended}");

        // A long run holds the record; two triggers arrive during it.
        logic.holding.store(true, Ordering::SeqCst);
        let holder = {
            let (runner, q) = (runner.clone(), setup.queue.clone());
            tokio::spawn(async move {
                let msg = TriggerMessage::parse("acct", "warm-up").unwrap();
                let delivery = Delivery {
                    message: msg,
                    dequeue_count: 1,
                };
                let _ = q;
                runner.handle(&delivery, &CancellationToken::new()).await
            })
        };
        eventually(Duration::from_secs(10), "the holder's run to start", || async {
            (logic.started.load(Ordering::SeqCst) >= 3).then_some(())
        })
        .await;
        let t1 = setup.counters.snapshot();
        assert_eq!(one_trigger(&setup, &runner, "warm-up").await, Outcome::Coalesced);
        let first = counted(&setup, &t1);
        let t2 = setup.counters.snapshot();
        assert_eq!(one_trigger(&setup, &runner, "warm-up").await, Outcome::Coalesced);
        let second = counted(&setup, &t2);
        println!("[azurite] fencing={fencing}: first trigger during a run: {first}");
        println!("[azurite] fencing={fencing}: later trigger during a run: {second}");
        assert_eq!(per_trigger(&first), 6, "{first}");
        assert_eq!(per_trigger(&second), 5, "{second}");

        // The holder finishes, finds the marker and enqueues exactly one retrigger.
        logic.holding.store(false, Ordering::SeqCst);
        let t3 = setup.counters.snapshot();
        logic.hold.notify_one();
        let outcome = holder.await.unwrap();
        assert!(
            matches!(
                outcome,
                Outcome::Completed {
                    retriggered: true,
                    ..
                }
            ),
            "{outcome:?}"
        );
        let tail = counted(&setup, &t3);
        println!("[azurite] fencing={fencing}: holder's end with a retrigger: {tail}");
        assert_eq!(
            setup.queue.approximate_len().await.unwrap(),
            1,
            "exactly one retrigger"
        );
    }
}

/// Under Functions each delivery adds its watchdog's put and delete: 2 round trips more than
/// standalone, uncontended or not (a run shorter than a renewal interval pushes it never).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trips_per_trigger_under_functions() {
    for fencing in [false, true] {
        let setup = setup();
        let logic = Recorder::with_duration(Duration::from_millis(10));
        let runner = shipped_runner(&setup, logic.clone(), fencing);
        deliver(&setup, &runner, "warm-up", true).await;
        let t0 = setup.counters.snapshot();
        let outcome = deliver(&setup, &runner, "warm-up", true).await;
        assert!(matches!(outcome, Outcome::Completed { .. }), "{outcome:?}");
        let uncontended = counted(&setup, &t0);
        println!("[azurite] functions, fencing={fencing}: uncontended trigger: {uncontended}");
        assert_eq!(
            per_trigger(&uncontended),
            if fencing { 9 } else { 8 },
            "{uncontended}"
        );
        assert_eq!(
            setup.queue.approximate_len().await.unwrap(),
            0,
            "no watchdog left"
        );
    }
}

/// Many concurrent triggers for a few records through two real consumers: no overlap, every
/// trigger served by a run that started after it, and bursts coalesced.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_triggers_are_exclusive_and_coalesced() {
    let setup = setup();
    let logic = Recorder::with_duration(Duration::from_millis(400));
    let shutdown = CancellationToken::new();
    let mut consumers = Vec::new();
    for _ in 0..2 {
        let consumer = Consumer::new(
            runner(&setup, logic.clone(), true),
            setup.poison.clone(),
            consumer_options(),
        );
        let s = shutdown.clone();
        consumers.push(tokio::spawn(async move { consumer.run(s).await }));
    }
    let records = ["r1", "r2", "r3"];
    let mut accepted = Vec::new();
    for round in 0..10 {
        for record in records {
            let msg = TriggerMessage::parse("acct", record).unwrap();
            // The instant before the put: a consumer may take the message and start its run
            // before this task sees the put's answer (a loaded machine schedules it late), and
            // that run serves the trigger.
            let before = Instant::now();
            setup.queue.put(&msg.encode(), Duration::ZERO).await.unwrap();
            accepted.push((record, before));
        }
        if round % 3 == 2 {
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
    eventually(Duration::from_secs(30), "every trigger to be served", || async {
        accepted
            .iter()
            .all(|(record, t)| logic.completed_after(record, *t))
            .then_some(())
    })
    .await;
    shutdown.cancel();
    for c in consumers {
        c.await.unwrap();
    }
    assert_eq!(
        logic.overlaps.load(Ordering::SeqCst),
        0,
        "two runs of one record overlapped"
    );
    for record in records {
        let runs = logic.runs_of(record);
        println!("[azurite] {record}: 10 triggers, {runs} runs");
        assert!(runs < 10, "{record}: {runs} runs for 10 triggers: not coalesced");
    }
    assert_eq!(setup.poison.approximate_len().await.unwrap(), 0);
}

/// A holder killed mid-run (its runtime torn down: no release, no more renewals) is recovered
/// without operator action: the record runs again within lease duration + visibility + recheck.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_holder_is_recovered() {
    let setup = setup();
    let victim_logic = Recorder::with_duration(Duration::from_secs(3600));
    victim_logic.holding.store(true, Ordering::SeqCst);

    // The victim: a consumer on its own runtime, so killing it drops every task it has.
    let victim_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let victim = Consumer::new(
        runner(&setup, victim_logic.clone(), true),
        setup.poison.clone(),
        consumer_options(),
    );
    victim_rt.spawn(async move { victim.run(CancellationToken::new()).await });

    setup
        .queue
        .put(
            &TriggerMessage::parse("acct", "doomed").unwrap().encode(),
            Duration::ZERO,
        )
        .await
        .unwrap();
    eventually(Duration::from_secs(20), "the victim's run to start", || async {
        (victim_logic.started.load(Ordering::SeqCst) == 1).then_some(())
    })
    .await;
    victim_rt.shutdown_background();
    let killed_at = Instant::now();

    // Nothing was released: the dead holder's lease is still there.
    let probe = runner(&setup, Recorder::with_duration(Duration::ZERO), true);
    let key = leasehold_runtime::TriggerMessage::parse("acct", "doomed")
        .unwrap()
        .key();
    assert!(
        probe.lock().inspect(&key).await.unwrap().held,
        "a killed holder must not release"
    );

    let survivor_logic = Recorder::with_duration(Duration::from_millis(100));
    let survivor = Consumer::new(
        runner(&setup, survivor_logic.clone(), true),
        setup.poison.clone(),
        consumer_options(),
    );
    let shutdown = CancellationToken::new();
    let s = shutdown.clone();
    let survivor_task = tokio::spawn(async move { survivor.run(s).await });
    eventually(
        Duration::from_secs(90),
        "the record to run again after the crash",
        || async { survivor_logic.completed_after("doomed", killed_at).then_some(()) },
    )
    .await;
    let recovered = killed_at.elapsed();
    shutdown.cancel();
    survivor_task.await.unwrap();
    println!(
        "[azurite] recovery after a killed holder: {recovered:.1?} (lease 15 s renewed every 5 s, visibility 20 s)"
    );
    // Visibility (20 s) >= lease (15 s) + renewal interval (5 s): the message reappears only once
    // the dead lease has expired and runs at once. Polling and run time add well under 10 s.
    assert!(
        recovered <= Duration::from_secs(20 + 10),
        "recovered only after {recovered:?}"
    );
}

/// Logic that, once armed, asks to be run later after 2 s on its next run, then succeeds.
#[derive(Default)]
struct Throttled(AtomicBool);

#[async_trait]
impl Logic for Throttled {
    async fn run(&self, _ctx: RunContext) -> Result<(), LogicError> {
        if self.0.swap(false, Ordering::SeqCst) {
            Err(LogicError::run_later(Some(Duration::from_secs(2)), "429"))
        } else {
            Ok(())
        }
    }
}

/// A run put off costs what a completed run costs, standalone and under Functions: the update
/// of the delivered message (standalone) or the rewrite of the watchdog (Functions) takes the
/// place of the delete. The deferred message is hidden for the delay on Azurite, keeps its
/// deferral, and its delivery is not an attempt (its dequeue count, 2, less its re-hides, 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deferral_costs_what_a_run_costs_on_azurite() {
    for watched in [false, true] {
        let setup = setup();
        let logic = Arc::new(Throttled::default());
        let runner = runner(&setup, logic.clone(), false);
        // Creates the queue, the container and the record's blob.
        one_trigger(&setup, &runner, "warm-up").await;
        logic.0.store(true, Ordering::SeqCst);
        let consumer = Consumer::new(runner.clone(), setup.poison.clone(), consumer_options());
        let t0 = setup.counters.snapshot();
        setup
            .queue
            .put(
                &TriggerMessage::parse("acct", "warm-up").unwrap().encode(),
                Duration::ZERO,
            )
            .await
            .unwrap();
        let received = setup
            .queue
            .get(1, Duration::from_secs(30))
            .await
            .unwrap()
            .remove(0);
        let deferred_at = Instant::now();
        if watched {
            let delivery = Delivery {
                message: TriggerMessage::decode(&received.body).unwrap(),
                dequeue_count: received.dequeue_count,
            };
            let outcome = runner
                .handle_watched(&delivery, &*setup.poison, &CancellationToken::new())
                .await;
            assert!(matches!(outcome, Outcome::Deferred { .. }), "{outcome:?}");
            setup
                .queue
                .delete(&received.id, &received.pop_receipt)
                .await
                .unwrap();
        } else {
            consumer.process(received, CancellationToken::new()).await;
        }
        let cost = counted(&setup, &t0);
        let mode = if watched { "functions" } else { "standalone" };
        println!("[azurite] {mode}: a trigger whose run is put off: {cost}");
        assert_eq!(cost.total(), if watched { 8 } else { 6 }, "{cost}");
        assert_eq!(cost.get(Op::QueueUpdate), 1, "{cost}");
        assert!(
            setup
                .queue
                .get(1, Duration::from_secs(30))
                .await
                .unwrap()
                .is_empty(),
            "hidden for 2 s"
        );
        let again = eventually(Duration::from_secs(10), "the deferred run to show", || async {
            unless_transient(setup.queue.get(1, Duration::from_secs(30)).await, "taking it")?.pop()
        })
        .await;
        assert!(deferred_at.elapsed() >= Duration::from_secs(2));
        let message = TriggerMessage::decode(&again.body).unwrap();
        assert_eq!(message.deferral.map(|d| (d.total_ms, d.hops)), Some((2000, 1)));
        let delivery = Delivery {
            message,
            dequeue_count: again.dequeue_count,
        };
        assert_eq!(delivery.attempts(), 1, "{mode}: {delivery:?}");
        let outcome = runner.handle(&delivery, &CancellationToken::new()).await;
        assert!(matches!(outcome, Outcome::Completed { .. }), "{outcome:?}");
    }
}

/// A budget's pause written by one worker (process) is read by another from the same blob, at
/// a request per look no more often than its refresh interval, and a write that does not
/// lengthen the pause is not sent again.
#[tokio::test]
async fn a_budget_pause_written_by_one_worker_stops_run_starts_on_another() {
    use leasehold_runtime::{Admission, AzureBudgets, BudgetOptions, BudgetStore, Budgets, Lane};

    let account = Azurite::shared().account();
    let container = unique_name("budgets");
    let (one_counters, two_counters) = (OpCounters::new(), OpCounters::new());
    let store_one = Arc::new(AzureBudgets::new(&account, &container, one_counters.clone()));
    let store_two = Arc::new(AzureBudgets::new(&account, &container, two_counters.clone()));
    let options = BudgetOptions {
        refresh_every: Duration::from_millis(300),
        ..BudgetOptions::default()
    };
    let one = Budgets::new(store_one.clone(), options.clone());
    let two = Budgets::new(store_two.clone(), options);
    let scope: leasehold_runtime::Scope = "account".parse().unwrap();

    // Nothing written yet: not paused, and reading a budget never written is no error.
    assert_eq!(store_two.read("default").await.unwrap(), None);
    assert_eq!(two.paused(&scope), None);

    // Worker one's run is throttled for 30 s: the first write creates the container and blob.
    let Admission::Go(mut permit) = one.admit(&scope, Lane::High, None, true).await else {
        panic!("a free budget gives a slot")
    };
    permit.throttled("r", Duration::from_secs(30), false).await;
    drop(permit);
    let shared = store_two.read("default").await.unwrap().expect("written");
    let left = shared.left;
    // Measured on storage's clock: from the blob's Last-Modified (to the second, rounded down:
    // a second is added) to the answer's Date.
    assert!(
        left > Duration::from_secs(25) && left <= Duration::from_secs(32),
        "{shared:?}"
    );
    assert!(shared.set_at.is_some() && !shared.resumed, "{shared:?}");
    assert_eq!(
        shared.limit,
        Some(8),
        "the writer's limit: nothing else was in flight, no cut"
    );
    // A throttle that does not lengthen it is not written again.
    let writes = one_counters.snapshot().get(Op::BudgetWrite);
    let Admission::Paused { .. } = one.admit(&scope, Lane::High, Some(Duration::ZERO), true).await else {
        panic!("paused")
    };
    assert_eq!(one_counters.snapshot().get(Op::BudgetWrite), writes);

    // Worker two learns of it at a look after its refresh interval, without waiting on the read.
    let (budget, after) = eventually(Duration::from_secs(10), "worker two to see the pause", || async {
        two.paused(&scope)
    })
    .await;
    assert_eq!(budget, "default");
    assert!(after > Duration::from_secs(20), "{after:?}");
    // Looks cost at most one read per refresh interval, however many there are.
    let reads = two_counters.snapshot().get(Op::BudgetRead);
    for _ in 0..1000 {
        two.paused(&scope);
    }
    tokio::task::yield_now().await;
    assert!(two_counters.snapshot().get(Op::BudgetRead) <= reads + 1);

    // Resumed in storage (an operator): over for every reader, and worker two follows it down
    // at its next read.
    assert!(store_one.resume("default").await.unwrap());
    let shared = store_two.read("default").await.unwrap().expect("still there");
    assert_eq!(shared.left, Duration::ZERO);
    assert!(shared.resumed);
    eventually(
        Duration::from_secs(10),
        "worker two to see the resume",
        || async { two.paused(&scope).is_none().then_some(()) },
    )
    .await;
    assert_eq!(store_two.names().await.unwrap(), ["default"]);
}

/// A budget blob an earlier version wrote (its end by the writer's clock only), two days ahead
/// as a writer whose clock runs ahead leaves it, is honoured for at most the longest pause.
#[tokio::test]
async fn a_budget_pause_read_from_storage_is_capped() {
    use leasehold_runtime::{AzureBudgets, BudgetOptions, BudgetStore, Budgets};

    let account = Azurite::shared().account();
    let container = unique_name("budgets");
    let blobs = leasehold_storage::azure::BlobContainer::new(&account, &container, OpCounters::new());
    blobs
        .put_empty_if_absent("budgets/default", Op::BudgetWrite)
        .await
        .unwrap();
    let ahead = std::time::SystemTime::now() + Duration::from_secs(2 * 86_400);
    let until = ahead.duration_since(std::time::UNIX_EPOCH).unwrap().as_millis();
    let metadata = std::collections::HashMap::from([("pauseduntilms".to_string(), until.to_string())]);
    blobs
        .set_metadata_if_present("budgets/default", &metadata, Op::BudgetWrite)
        .await
        .unwrap()
        .unwrap();
    let store = Arc::new(AzureBudgets::new(&account, &container, OpCounters::new()));
    let stored = store.read("default").await.unwrap().unwrap().left;
    assert!(stored > Duration::from_secs(86_400), "{stored:?}");
    let budgets = Budgets::new(
        store,
        BudgetOptions {
            refresh_every: Duration::from_millis(100),
            ..BudgetOptions::default()
        },
    );
    let scope: leasehold_runtime::Scope = "account".parse().unwrap();
    let (_, left) = eventually(Duration::from_secs(10), "the pause to be read", || async {
        budgets.paused(&scope)
    })
    .await;
    assert!(left <= Duration::from_secs(300), "{left:?}: not capped");
}

/// Run history in Azurite's Table service (issue 36): a record's entries, written by two
/// instances, read back newest first in two requests (the current period's table and the one
/// before); a bulk of records is one partition each; entries older than the days kept are not
/// shown; a sweep drops whole tables whose period ended more than the days kept ago (a list and
/// one request a table), never the current one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_history_is_written_and_read_back_in_two_requests_and_dropped_a_table_at_a_time() {
    use leasehold_runtime::{
        HistoryEntry, HistoryEvent, HistoryStore, OutcomeLabel, RecordId, Scope, TableHistory,
    };
    use leasehold_storage::table::TableClient;
    let account = Azurite::shared().account();
    let counters = OpCounters::new();
    let prefix = format!("h{}", &unique_name("t").replace('-', "")[..12]);
    let day = Duration::from_secs(24 * 3600);
    let keep = 2 * day;
    let client = TableClient::new(&account, counters.clone()).unwrap();
    let history = TableHistory::new(client.clone(), &prefix, keep).unwrap();
    let scope = Scope::parse("account").unwrap();
    let record = RecordId::parse("8f9c1d2e-0000-4000-8000-000000000001").unwrap();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let entry = |event, ago: Duration, instance: &str, record: &RecordId| {
        let mut e = HistoryEntry::new(scope.clone(), record.clone(), event);
        e.time_ms = now_ms - ago.as_millis() as u64;
        e.instance = instance.into();
        e
    };
    // Instance a: a run of 3 s, one write (as the writer gathers it). Instance b: a coalesced
    // trigger, a write of its own. Then one too old to show (5 days: its period's table is two
    // periods back), and another record's.
    history
        .append(&[
            entry(HistoryEvent::Started, Duration::from_secs(10), "a:1", &record),
            entry(
                HistoryEvent::Outcome(OutcomeLabel::Completed),
                Duration::from_secs(7),
                "a:1",
                &record,
            ),
        ])
        .await
        .unwrap();
    history
        .append(&[entry(
            HistoryEvent::Outcome(OutcomeLabel::Coalesced),
            Duration::from_secs(8),
            "b:2",
            &record,
        )])
        .await
        .unwrap();
    history
        .append(&[entry(HistoryEvent::Started, 5 * day, "a:1", &record)])
        .await
        .unwrap();
    let other = RecordId::parse("other").unwrap();
    history
        .append(&[entry(
            HistoryEvent::Started,
            Duration::from_secs(1),
            "a:1",
            &other,
        )])
        .await
        .unwrap();
    let reads_before = counters.snapshot().get(Op::HistoryRead);
    let read = history.read(&scope, &record, keep, 50).await.unwrap();
    let seen: Vec<(&str, &str)> = read
        .iter()
        .map(|e| (e.event.as_str(), e.instance.as_str()))
        .collect();
    assert_eq!(
        seen,
        [("completed", "a:1"), ("coalesced", "b:2"), ("started", "a:1")],
        "newest first, both instances', nothing older than the days kept, no other record's"
    );
    assert!(
        counters.snapshot().get(Op::HistoryRead) - reads_before <= 2,
        "a record's history in two requests at most"
    );
    assert_eq!(history.read(&scope, &record, keep, 1).await.unwrap().len(), 1);

    // The 5-day-old entry's table is dropped by a sweep; the current one is kept.
    let tables = client.list_tables(&prefix).await.unwrap();
    assert!(tables.len() >= 2, "{tables:?}");
    let dropped = history.sweep(keep).await.unwrap();
    assert_eq!(dropped, 1, "{tables:?}");
    let left = client.list_tables(&prefix).await.unwrap();
    assert_eq!(left.len(), tables.len() - 1, "{left:?}");
    assert_eq!(history.read(&scope, &record, keep, 50).await.unwrap().len(), 3);
    for table in left {
        client.delete_table(&table).await.unwrap();
    }
}

/// The deployment's recent runs from Azurite's Table service (issue 36): entries of every
/// record in a window, across partitions and the period tables the window covers, newest
/// first; of one scope only (a scope whose name starts the same is not it); of the events
/// asked; an entity written after the window's end still gives its entries within it; and a
/// read stopped at its bound says it is partial.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recent_runs_are_read_across_records_by_window_and_scope_and_say_when_partial() {
    use leasehold_runtime::{
        HistoryEntry, HistoryEvent, HistoryStore, OutcomeLabel, RecentQuery, RecordId, Scope, TableHistory,
    };
    use leasehold_storage::table::TableClient;
    let account = Azurite::shared().account();
    let counters = OpCounters::new();
    let prefix = format!("r{}", &unique_name("t").replace('-', "")[..12]);
    let day = Duration::from_secs(24 * 3600);
    let keep = day;
    let client = TableClient::new(&account, counters.clone()).unwrap();
    let history = TableHistory::new(client.clone(), &prefix, keep).unwrap();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let entry = |scope: &str, record: &str, event, ago: Duration| {
        let mut e = HistoryEntry::new(
            Scope::parse(scope).unwrap(),
            RecordId::parse(record).unwrap(),
            event,
        );
        e.time_ms = now_ms - ago.as_millis() as u64;
        e.instance = "a:1".into();
        e
    };
    let (started, completed, failed) = (
        HistoryEvent::Started,
        HistoryEvent::Outcome(OutcomeLabel::Completed),
        HistoryEvent::Outcome(OutcomeLabel::Failed),
    );
    let secs = Duration::from_secs;
    // Runs of three records of `account`, one of `accounts` (a scope whose name starts the same)
    // and one of `contact`; one run of `account` yesterday (the period table before: keep is a
    // day), one an hour ago.
    for batch in [
        vec![
            entry("account", "a1", started, secs(30)),
            entry("account", "a1", completed, secs(28)),
        ],
        vec![
            entry("account", "a2", started, secs(20)),
            entry("account", "a2", failed, secs(19)),
        ],
        vec![entry("accounts", "b1", completed, secs(10))],
        vec![entry("contact", "c1", completed, secs(5))],
        vec![entry("account", "a3", completed, secs(3600))],
        vec![entry("account", "a4", completed, day + secs(60))],
    ] {
        history.append(&batch).await.unwrap();
    }
    let query =
        |scope: Option<&str>, since: Duration, until: Duration, events: Vec<HistoryEvent>| RecentQuery {
            since_ms: now_ms - since.as_millis() as u64,
            until_ms: now_ms - until.as_millis() as u64,
            scope: scope.map(|s| Scope::parse(s).unwrap()),
            events,
            limit: 100,
        };
    let seen = |r: &leasehold_runtime::Recent| -> Vec<String> {
        r.entries
            .iter()
            .map(|e| format!("{}/{} {}", e.scope.as_str(), e.record.as_str(), e.event))
            .collect()
    };
    let runs = vec![completed, failed];
    let recent = history
        .recent(&query(None, secs(15 * 60), secs(0), runs.clone()))
        .await
        .unwrap();
    assert!(!recent.partial, "{recent:?}");
    assert_eq!(
        seen(&recent),
        [
            "contact/c1 completed",
            "accounts/b1 completed",
            "account/a2 failed",
            "account/a1 completed"
        ],
        "every record's runs in the last 15 minutes, newest first"
    );
    let scoped = history
        .recent(&query(Some("account"), secs(15 * 60), secs(0), runs.clone()))
        .await
        .unwrap();
    assert_eq!(
        seen(&scoped),
        ["account/a2 failed", "account/a1 completed"],
        "not accounts'"
    );
    let week = history
        .recent(&query(Some("account"), 2 * day, secs(0), vec![completed]))
        .await
        .unwrap();
    assert_eq!(
        seen(&week),
        [
            "account/a1 completed",
            "account/a3 completed",
            "account/a4 completed"
        ],
        "yesterday's from the table before: {:?}",
        client.list_tables(&prefix).await.unwrap()
    );
    // A window that ends between a run's start and end: the start is in it, though the entity
    // (keyed by its newest entry) is after the window's end.
    let before_end = history
        .recent(&query(Some("account"), secs(29 + 60), secs(29), vec![]))
        .await
        .unwrap();
    assert_eq!(seen(&before_end), ["account/a1 started"]);

    // Stopped at a bound: partial, with what it read.
    let bounded = history.clone().with_recent_bounds(1, 2, secs(10));
    let partial = bounded
        .recent(&query(None, secs(15 * 60), secs(0), vec![]))
        .await
        .unwrap();
    assert!(partial.partial, "{partial:?}");
    assert_eq!(partial.scanned, 2, "{partial:?}");
    for table in client.list_tables(&prefix).await.unwrap() {
        client.delete_table(&table).await.unwrap();
    }
}

/// Issue 44: a change of `LEASEHOLD_HISTORY_DAYS` either way loses no entry younger than the
/// longer setting. Two deployments share a prefix, one keeping 7 days and one keeping 1 (as one
/// deployment before and after a change, or two with other days): each writes its entries of
/// the last 7 days, each sweeps with its own days. No entry younger than 7 days is dropped (the
/// old rule took a 7-day table for a 1-day one from its name and dropped entries 74 s old), each
/// reads the other's within its own days, and a table of the first layout
/// (`<prefix><yyyymmdd>`, its length not in its name) is not dropped days after its date.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_of_history_days_either_way_loses_no_entry_younger_than_the_longer_setting() {
    use leasehold_runtime::{
        HistoryEntry, HistoryEvent, HistoryStore, RecentQuery, RecordId, Scope, TableHistory,
    };
    use leasehold_storage::table::TableClient;
    let account = Azurite::shared().account();
    let prefix = format!("d{}", &unique_name("t").replace('-', "")[..12]);
    let day = Duration::from_secs(24 * 3600);
    let client = TableClient::new(&account, OpCounters::new()).unwrap();
    let seven = TableHistory::new(client.clone(), &prefix, 7 * day).unwrap();
    let one = TableHistory::new(client.clone(), &prefix, day).unwrap();
    let scope = Scope::parse("account").unwrap();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let (r7, r1) = (
        RecordId::parse("by-seven").unwrap(),
        RecordId::parse("by-one").unwrap(),
    );
    let hour = Duration::from_secs(3600);
    // Ages under 7 days, spread so that whichever day of its period today is, the 7-day
    // deployment writes to two period tables, the older one started 7 days ago or more.
    let ages7 = [
        Duration::from_secs(74),
        23 * hour,
        2 * day,
        3 * day,
        4 * day,
        5 * day,
        6 * day,
        6 * day + 23 * hour,
    ];
    let ages1 = [
        Duration::from_secs(74),
        12 * hour,
        day + hour,
        3 * day,
        6 * day + 23 * hour,
    ];
    for (history, record, ages) in [(&seven, &r7, &ages7[..]), (&one, &r1, &ages1[..])] {
        for (i, age) in ages.iter().enumerate() {
            let mut e = HistoryEntry::new(scope.clone(), record.clone(), HistoryEvent::Started);
            e.time_ms = now_ms - age.as_millis() as u64;
            e.attempt = i as u32 + 1;
            // One write an entry: an entity goes to the table of its newest entry's period.
            history.append(&[e]).await.unwrap();
        }
    }
    // A table of the first layout, dated 3 days ago.
    let (y, m, d) = {
        let days = (now_ms / 1000 / 86_400 - 3) as i64;
        // H. Hinnant's civil_from_days.
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z.rem_euclid(146_097);
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let d = doy - (153 * mp + 2) / 5 + 1;
        let m = if mp < 10 { mp + 3 } else { mp - 9 };
        (yoe + era * 400 + i64::from(m <= 2), m, d)
    };
    let first_layout = format!("{prefix}{y:04}{m:02}{d:02}");
    client.create_table(&first_layout).await.unwrap();
    // An entry of the 7-day deployment 2 days old, written there as the code before wrote it
    // (the partition by FNV-1a of the record over 16 buckets, the row key by inverted time).
    {
        let mut e = HistoryEntry::new(scope.clone(), r7.clone(), HistoryEvent::Started);
        e.time_ms = now_ms - (2 * day).as_millis() as u64;
        e.attempt = 99;
        let mut hash: u32 = 0x811c_9dc5;
        for byte in r7.as_str().bytes() {
            hash = (hash ^ u32::from(byte)).wrapping_mul(0x0100_0193);
        }
        let mut entity = leasehold_storage::table::Entity::new();
        entity.insert("PartitionKey".into(), format!("account|{:02x}", hash % 16).into());
        entity.insert(
            "RowKey".into(),
            format!("{}|{:013}-x", r7.as_str(), 9_999_999_999_999u64 - e.time_ms).into(),
        );
        entity.insert("Newest".into(), format!("{:013}", e.time_ms).into());
        entity.insert("Entries".into(), serde_json::to_string(&[e]).unwrap().into());
        client.insert_entity(&first_layout, &entity).await.unwrap();
    }
    let tables = client.list_tables(&prefix).await.unwrap();

    // Both deployments sweep, each with its own days, in either order.
    one.sweep(day).await.unwrap();
    seven.sweep(7 * day).await.unwrap();
    one.sweep(day).await.unwrap();
    let left = client.list_tables(&prefix).await.unwrap();

    let attempts = |entries: Vec<HistoryEntry>| -> Vec<u32> {
        let mut a: Vec<u32> = entries.iter().map(|e| e.attempt).collect();
        a.sort_unstable();
        a
    };
    let all7: Vec<u32> = (1..=ages7.len() as u32).chain([99]).collect();
    let all1: Vec<u32> = (1..=ages1.len() as u32).collect();
    let read = |history: &TableHistory, record: &RecordId, keep: Duration| {
        let (history, record, scope) = (history.clone(), record.clone(), scope.clone());
        async move { history.read(&scope, &record, keep, 100).await.unwrap() }
    };
    assert_eq!(
        attempts(read(&seven, &r7, 7 * day).await),
        all7,
        "the 7-day deployment's entries, all younger than 7 days (one in a table of the first layout), after both swept (before: {tables:?}, after: {left:?})"
    );
    assert_eq!(
        attempts(read(&seven, &r1, 7 * day).await),
        all1,
        "the 1-day deployment's entries, read by the 7-day one (before: {tables:?}, after: {left:?})"
    );
    assert_eq!(
        attempts(read(&one, &r1, day).await),
        [1, 2],
        "its own within a day"
    );
    assert_eq!(
        attempts(read(&one, &r7, day).await),
        [1, 2],
        "the 7-day deployment's within a day"
    );
    assert!(
        left.contains(&first_layout),
        "a table of the first layout was dropped: {left:?}"
    );
    let recent = seven
        .recent(&RecentQuery {
            since_ms: now_ms - (7 * day).as_millis() as u64,
            until_ms: now_ms,
            scope: None,
            events: Vec::new(),
            limit: 100,
        })
        .await
        .unwrap();
    assert_eq!(
        recent.entries.len(),
        ages7.len() + ages1.len() + 1,
        "the run list finds both deployments' entries and the first layout's: {recent:?}"
    );
    for table in client.list_tables(&prefix).await.unwrap() {
        client.delete_table(&table).await.unwrap();
    }
}

/// Issue 44, item 7: a busy record's history read with a limit gives its newest entries, not its
/// oldest: each write of a record is an entity whose row key holds the newest entry's time
/// inverted, so a read of the key range in order meets the newest first and stops at the
/// limit. (Ordered by time instead, `leasehold history --limit N` and the record page showed a
/// busy record's oldest entries; no test saw it.)
#[tokio::test]
async fn a_records_history_read_with_a_limit_gives_its_newest_entries() {
    use leasehold_runtime::{
        HistoryEntry, HistoryEvent, HistoryStore, OutcomeLabel, RecordId, Scope, TableHistory,
    };
    use leasehold_storage::table::TableClient;
    let account = Azurite::shared().account();
    let prefix = format!("h{}", &unique_name("n").replace('-', "")[..12]);
    let keep = Duration::from_secs(24 * 3600);
    let client = TableClient::new(&account, OpCounters::new()).unwrap();
    let history = TableHistory::new(client, &prefix, keep).unwrap();
    let scope = Scope::parse("account").unwrap();
    let record = RecordId::parse("busy").unwrap();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    // Six writes, oldest first, a minute apart: each its own entity.
    for minutes_ago in (1..=6u64).rev() {
        let mut e = HistoryEntry::new(
            scope.clone(),
            record.clone(),
            HistoryEvent::Outcome(OutcomeLabel::Completed),
        );
        e.time_ms = now_ms - minutes_ago * 60_000;
        e.instance = format!("{minutes_ago} min ago");
        history.append(&[e]).await.unwrap();
    }
    let read = history.read(&scope, &record, keep, 2).await.unwrap();
    let seen: Vec<&str> = read.iter().map(|e| e.instance.as_str()).collect();
    assert_eq!(seen, ["1 min ago", "2 min ago"]);
}
