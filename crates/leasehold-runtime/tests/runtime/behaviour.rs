//! Runner and consumer behaviour on the in-memory store and queue, with paused time: run time
//! limit, lease loss, failures, redelivery rechecks, poison and graceful shutdown.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use leasehold_lock::memory::MemoryStore;
use leasehold_lock::{LeaseLock, LeaseOptions, LeaseStore, OpCounters, RetryOptions};
use leasehold_runtime::{
    Consumer, ConsumerOptions, Delivery, Error, Field, Lane, Logic, LogicError, MemoryMarkers, MemoryQueue,
    Outcome, PoisonMessage, RecordRunner, RunContext, RunnerOptions, TriggerKind, TriggerMessage,
    TriggerQueue,
};
use tokio_util::sync::CancellationToken;

/// What the logic does.
#[derive(Clone, Copy)]
enum Behaviour {
    /// Waits for cancellation (and records that it saw it).
    Hang,
    Fail,
}

struct TestLogic {
    behaviour: Behaviour,
    cancelled: AtomicUsize,
    runs: AtomicUsize,
    started: tokio::sync::Notify,
}

impl TestLogic {
    fn new(behaviour: Behaviour) -> Arc<Self> {
        Arc::new(Self {
            behaviour,
            cancelled: 0.into(),
            runs: 0.into(),
            started: tokio::sync::Notify::new(),
        })
    }
}

#[async_trait]
impl Logic for TestLogic {
    async fn run(&self, ctx: RunContext) -> Result<(), LogicError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        self.started.notify_one();
        match self.behaviour {
            Behaviour::Hang => {
                ctx.cancel.cancelled().await;
                self.cancelled.fetch_add(1, Ordering::SeqCst);
                Err(LogicError::new("stopped"))
            }
            Behaviour::Fail => Err(LogicError::new("the CRM said no")),
        }
    }
}

struct World {
    store: Arc<MemoryStore>,
    markers: Arc<MemoryMarkers>,
    queue: Arc<MemoryQueue>,
    poison: Arc<MemoryQueue>,
}

fn world() -> World {
    let counters = OpCounters::new();
    World {
        store: Arc::new(MemoryStore::with_counters(counters.clone())),
        markers: Arc::new(MemoryMarkers::with_counters(counters.clone())),
        queue: Arc::new(MemoryQueue::new("triggers", counters.clone())),
        poison: Arc::new(MemoryQueue::new("triggers-poison", counters)),
    }
}

fn lock(world: &World) -> LeaseLock {
    let options = LeaseOptions {
        retry: RetryOptions {
            jitter_seed: Some(1),
            ..RetryOptions::default()
        },
        ..LeaseOptions::default()
    };
    LeaseLock::new(world.store.clone() as Arc<dyn LeaseStore>, options).unwrap()
}

fn runner(world: &World, logic: Arc<dyn Logic>, options: RunnerOptions) -> RecordRunner {
    RecordRunner::new(
        lock(world),
        world.markers.clone(),
        world.queue.clone(),
        logic,
        options,
    )
}

fn delivery(record: &str, dequeue_count: u32) -> Delivery {
    Delivery {
        message: TriggerMessage::parse("acct", record).unwrap(),
        dequeue_count,
    }
}

async fn held(world: &World, record: &str) -> bool {
    let key = TriggerMessage::parse("acct", record).unwrap().key();
    lock(world).inspect(&key).await.unwrap().held
}

#[tokio::test(start_paused = true)]
async fn a_run_over_its_time_limit_is_cancelled_released_and_not_acknowledged() {
    let world = world();
    let logic = TestLogic::new(Behaviour::Hang);
    let options = RunnerOptions {
        run_timeout: Duration::from_secs(90),
        ..RunnerOptions::default()
    };
    let runner = runner(&world, logic.clone(), options);
    let started = tokio::time::Instant::now();
    let outcome = within(
        Duration::from_secs(300),
        "a run over its 90 s time limit",
        runner.handle(&delivery("slow", 1), &CancellationToken::new()),
    )
    .await;
    assert_eq!(
        started.elapsed(),
        Duration::from_secs(90),
        "cancelled exactly at the limit"
    );
    assert!(
        matches!(&outcome, Outcome::Failed { error: Error::TimedOut(limit), .. } if *limit == Duration::from_secs(90)),
        "{outcome:?}"
    );
    assert!(!outcome.acknowledge());
    assert_eq!(
        logic.cancelled.load(Ordering::SeqCst),
        1,
        "the logic was told to stop"
    );
    let lock = lock(&world);
    assert!(
        !lock
            .inspect(&TriggerMessage::parse("acct", "slow").unwrap().key())
            .await
            .unwrap()
            .held,
        "lease released"
    );
}

#[tokio::test(start_paused = true)]
async fn a_run_that_loses_its_lease_is_told_at_once_and_not_acknowledged() {
    let world = world();
    let logic = TestLogic::new(Behaviour::Hang);
    let runner = runner(&world, logic.clone(), RunnerOptions::default());
    let handle = {
        let runner = runner.clone();
        tokio::spawn(async move {
            runner
                .handle(&delivery("stolen", 1), &CancellationToken::new())
                .await
        })
    };
    started(&logic.started).await;
    let operator = lock(&world);
    operator
        .break_lock(&TriggerMessage::parse("acct", "stolen").unwrap().key(), "test")
        .await
        .unwrap();
    let broke_at = tokio::time::Instant::now();
    let outcome = within(Duration::from_secs(300), "a run whose lease was broken", handle)
        .await
        .unwrap();
    // The next renewal (every 10 s) is refused: the run hears of it then, not at expiry.
    assert!(
        broke_at.elapsed() <= Duration::from_secs(10),
        "told after {:?}",
        broke_at.elapsed()
    );
    assert!(
        matches!(
            &outcome,
            Outcome::Failed {
                error: Error::LeaseLost,
                ..
            }
        ),
        "{outcome:?}"
    );
    assert_eq!(logic.cancelled.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn a_failed_run_still_honours_triggers_that_arrived_during_it() {
    let world = world();
    let failing = TestLogic::new(Behaviour::Fail);
    let runner_a = runner(&world, failing, RunnerOptions::default());
    // A second trigger arrives while the first run holds the lease: emulate by setting the marker
    // from a contender while a hanging run holds it, then let the holder fail.
    let hanging = TestLogic::new(Behaviour::Hang);
    let runner_h = runner(&world, hanging.clone(), RunnerOptions::default());
    let cancel = CancellationToken::new();
    let holder = {
        let (runner_h, cancel) = (runner_h.clone(), cancel.clone());
        tokio::spawn(async move { runner_h.handle(&delivery("r", 1), &cancel).await })
    };
    started(&hanging.started).await;
    assert_eq!(
        runner_a
            .handle(&delivery("r", 1), &CancellationToken::new())
            .await,
        Outcome::Coalesced
    );
    cancel.cancel(); // the holder's run ends unsuccessfully
    let outcome = within(Duration::from_secs(300), "a cancelled run", holder)
        .await
        .unwrap();
    assert!(
        matches!(
            outcome,
            Outcome::Failed {
                retriggered: true,
                ..
            }
        ),
        "{outcome:?}"
    );
    let retriggers: Vec<_> = world
        .queue
        .bodies()
        .iter()
        .map(|b| TriggerMessage::decode(b).unwrap().kind)
        .collect();
    assert_eq!(retriggers, [TriggerKind::Retrigger]);
}

#[tokio::test(start_paused = true)]
async fn a_redelivery_that_finds_the_lease_held_schedules_a_recheck_after_a_renewal_interval() {
    let world = world();
    let hanging = TestLogic::new(Behaviour::Hang);
    let runner = runner(&world, hanging.clone(), RunnerOptions::default());
    let cancel = CancellationToken::new();
    let holder = {
        let (runner, cancel) = (runner.clone(), cancel.clone());
        tokio::spawn(async move { runner.handle(&delivery("r", 1), &cancel).await })
    };
    started(&hanging.started).await;
    let now = tokio::time::Instant::now();
    let outcome = runner.handle(&delivery("r", 2), &CancellationToken::new()).await;
    assert_eq!(
        outcome,
        Outcome::Rechecking {
            after: Duration::from_secs(15)
        }
    );
    let body = &world.queue.bodies()[0];
    let recheck = TriggerMessage::decode(body).unwrap();
    // The redelivery counts as a failed attempt (the first delivery's holder died); the
    // delivery that only looked does not, so a chain of rechecks behind a long run never
    // reaches the poison limit unrun.
    assert_eq!((recheck.kind, recheck.prior_attempts), (TriggerKind::Recheck, 1));
    // Renewal interval + 5 s: early enough that a dead holder's record is not kept waiting
    // (coming before its lease expired only means looking once more).
    assert_eq!(
        world.queue.next_visible_at().unwrap() - now,
        Duration::from_secs(15)
    );
    cancel.cancel();
    within(Duration::from_secs(300), "a cancelled run", holder)
        .await
        .unwrap();
}

/// A record id that cannot be part of a key never becomes a trigger, whoever wrote it: the
/// runner only ever sees records that have a key.
#[test]
fn a_record_id_that_cannot_be_a_key_is_no_trigger() {
    let refused = TriggerMessage::parse("acct", "a/b").unwrap_err();
    assert_eq!(refused.field(), Field::RecordId);
    let written_by_a_tool = r#"{"scope":"acct","recordId":"a/b"}"#;
    let e = TriggerMessage::decode(written_by_a_tool).unwrap_err();
    assert!(e.to_string().contains("recordId \"a/b\" may only hold"), "{e}");
}

#[tokio::test(start_paused = true)]
async fn a_trigger_that_keeps_failing_ends_in_the_poison_queue_with_its_reason() {
    let world = world();
    let logic = TestLogic::new(Behaviour::Fail);
    let runner = runner(&world, logic.clone(), RunnerOptions::default());
    let options = ConsumerOptions {
        max_dequeue_count: 3,
        retry_delay: Duration::from_secs(1),
        ..ConsumerOptions::default()
    };
    let consumer = Consumer::new(runner, world.poison.clone(), options);
    world
        .queue
        .put(
            &TriggerMessage::parse("acct", "doomed").unwrap().encode(),
            Duration::ZERO,
        )
        .await
        .unwrap();
    world
        .queue
        .put("this is not a trigger", Duration::ZERO)
        .await
        .unwrap();
    let shutdown = CancellationToken::new();
    let task = {
        let (consumer, shutdown) = (consumer.clone(), shutdown.clone());
        tokio::spawn(async move { consumer.run(shutdown).await })
    };
    leasehold_test_support::eventually(Duration::from_secs(600), "two poison entries", || async {
        (world.poison.bodies().len() >= 2).then_some(())
    })
    .await;
    shutdown.cancel();
    within(Duration::from_secs(300), "a consumer shutting down", task)
        .await
        .unwrap();
    let left: Vec<TriggerMessage> = world
        .queue
        .bodies()
        .iter()
        .map(|b| TriggerMessage::decode(b).unwrap())
        .collect();
    assert_eq!(
        left.iter()
            .map(|m| (m.kind, m.record_id.as_str()))
            .collect::<Vec<_>>(),
        [(TriggerKind::Sweep, "doomed")],
        "poisoned messages leave the trigger queue; the readable one leaves a sweep behind"
    );
    assert_eq!(
        logic.runs.load(Ordering::SeqCst),
        3,
        "tried max_dequeue_count times"
    );
    let poisoned: Vec<PoisonMessage> = world
        .poison
        .bodies()
        .iter()
        .map(|b| PoisonMessage::decode(b).unwrap())
        .collect();
    assert!(
        poisoned
            .iter()
            .any(|p| p.reason().starts_with("unreadable message")),
        "{poisoned:?}"
    );
    let doomed = poisoned.iter().find(|p| p.trigger.is_some()).unwrap();
    assert!(
        doomed.reason().contains("gave up after 3 deliveries"),
        "{}",
        doomed.reason()
    );
}

#[tokio::test(start_paused = true)]
async fn shutdown_finishes_short_runs_and_hands_back_long_ones() {
    let world = world();
    let logic = TestLogic::new(Behaviour::Hang);
    let runner = runner(&world, logic.clone(), RunnerOptions::default());
    let options = ConsumerOptions {
        shutdown_grace: Duration::from_secs(5),
        ..ConsumerOptions::default()
    };
    let consumer = Consumer::new(runner, world.poison.clone(), options);
    world
        .queue
        .put(
            &TriggerMessage::parse("acct", "long").unwrap().encode(),
            Duration::ZERO,
        )
        .await
        .unwrap();
    let shutdown = CancellationToken::new();
    let task = {
        let (consumer, shutdown) = (consumer.clone(), shutdown.clone());
        tokio::spawn(async move { consumer.run(shutdown).await })
    };
    started(&logic.started).await;
    let asked = tokio::time::Instant::now();
    shutdown.cancel();
    within(Duration::from_secs(300), "a consumer shutting down", task)
        .await
        .unwrap();
    assert_eq!(
        asked.elapsed(),
        Duration::from_secs(5),
        "stopped at the end of the grace period"
    );
    assert_eq!(logic.cancelled.load(Ordering::SeqCst), 1, "the run was cancelled");
    assert!(!held(&world, "long").await, "its lease was released");
    // Handed back: visible again soon for another worker, once a request of the stopped
    // delivery that timed out can no longer land (the storage retry's late window, 5 s).
    assert_eq!(
        world.queue.next_visible_at().unwrap(),
        tokio::time::Instant::now() + Duration::from_secs(5)
    );
}

/// Awaits `run` for at most `limit` of simulated time, and fails there if it has not ended: a
/// protocol fault that keeps a run from ending (a time limit not enforced, a lost lease not told,
/// a shutdown that never hands back) must fail its test, not hang it. With time paused, the
/// lease's renewals would otherwise move the clock on for ever and the test would never return.
async fn within<T>(limit: Duration, what: &str, run: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(limit, run)
        .await
        .unwrap_or_else(|_| panic!("{what} did not end within {limit:?} of simulated time"))
}

/// Waits for a logic run to start; fails (instead of hanging) if none starts within a minute of
/// simulated time.
async fn started(signal: &tokio::sync::Notify) {
    tokio::time::timeout(Duration::from_secs(60), signal.notified())
        .await
        .expect("the logic should have started");
}

/// Logic that logs when each run starts and ends, each run lasting `length`.
struct Timed {
    length: Duration,
    log: std::sync::Mutex<Vec<(&'static str, tokio::time::Instant)>>,
}

#[async_trait::async_trait]
impl Logic for Timed {
    async fn run(&self, _ctx: leasehold_runtime::RunContext) -> Result<(), leasehold_runtime::LogicError> {
        self.log
            .lock()
            .unwrap()
            .push(("start", tokio::time::Instant::now()));
        tokio::time::sleep(self.length).await;
        self.log
            .lock()
            .unwrap()
            .push(("end", tokio::time::Instant::now()));
        Ok(())
    }
}

/// A run's retrigger wakes the consumer of its own process, as Start does: the follow-up run
/// starts at the instant the first one's follow-ups are written (paused time: the in-memory
/// queue answers at once), not when the consumer's idle back-off ends. Without the wake it
/// started up to `poll_max` later (here 30 s; 0.1–2 s by default). In either lane: one loop
/// polls both.
#[tokio::test(start_paused = true)]
async fn a_retrigger_wakes_the_consumer_of_its_own_process() {
    for lane in [Lane::High, Lane::Low] {
        let world = world();
        let logic = Arc::new(Timed {
            length: Duration::from_secs(20),
            log: Default::default(),
        });
        let options = ConsumerOptions {
            poll_min: Duration::from_secs(1),
            poll_max: Duration::from_secs(30),
            ..ConsumerOptions::default()
        };
        let high = runner(&world, logic.clone(), RunnerOptions::default());
        let low_queue = Arc::new(MemoryQueue::new("triggers-low", OpCounters::new()));
        let low = RecordRunner::new(
            lock(&world),
            world.markers.clone(),
            low_queue.clone(),
            logic.clone(),
            RunnerOptions::default(),
        )
        .with_lane(Lane::Low);
        let consumer =
            Consumer::new(high, world.poison.clone(), options).with_low_lane(low, world.poison.clone());
        let queue: Arc<MemoryQueue> = if lane == Lane::Low {
            low_queue
        } else {
            world.queue.clone()
        };
        let trigger = TriggerMessage::parse("acct", "saved-twice").unwrap().encode();
        queue.put(&trigger, Duration::ZERO).await.unwrap();
        let shutdown = CancellationToken::new();
        let task = {
            let (consumer, shutdown) = (consumer.clone(), shutdown.clone());
            tokio::spawn(async move { consumer.run(shutdown).await })
        };
        // A second save during the run: it coalesces (the marker), and the consumer, finding
        // nothing more, backs off towards 30 s between polls.
        tokio::time::sleep(Duration::from_secs(1)).await;
        queue.put(&trigger, Duration::ZERO).await.unwrap();
        leasehold_test_support::eventually(Duration::from_secs(120), "the follow-up run", || async {
            (logic.log.lock().unwrap().len() >= 3).then_some(())
        })
        .await;
        shutdown.cancel();
        within(Duration::from_secs(300), "a consumer shutting down", task)
            .await
            .unwrap();
        let log = logic.log.lock().unwrap().clone();
        assert_eq!(
            log.iter().map(|(what, _)| *what).collect::<Vec<_>>()[..3],
            ["start", "end", "start"]
        );
        assert_eq!(
            log[2].1 - log[1].1,
            Duration::ZERO,
            "{lane} lane: the follow-up started when the first run's retrigger was put"
        );
    }
}
