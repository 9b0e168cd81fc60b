//! Deterministic, seeded simulation of the coalescing protocol: in-memory lease store and queue
//! behind per-node fault injectors (delays, transient errors before and after the operation took
//! effect), several workers, random trigger arrivals and logic durations, crashes at random
//! instants (a crashed node's storage calls never return, so it releases nothing), lease expiry,
//! redelivery, and both queue modes: the real standalone `Consumer`, and an emulation of the
//! Functions host (10-minute visibility, failed invocations back after `visibilityTimeout`).
//!
//! Checked on every schedule: (1) no two runs of a record overlap, fencing tokens strictly rise
//! in run order; (2) every accepted trigger is followed by a completed run that started after
//! it; (3) fault-free schedules: triggers that arrived before a run started cause at most one run
//! after it; (4) a record whose holder crashed runs again within the recovery bound.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use leasehold_lock::memory::MemoryStore;
use leasehold_lock::{
    BlobProperties, ETag, FlagPut, LeaseId, LeaseLock, LeaseOptions, LeaseStore, Metadata, Op, OpCounters,
    RetryOptions, StoreError, StoreErrorKind, StoreResult,
};
use leasehold_runtime::{
    Consumer, ConsumerOptions, Delivery, Logic, LogicError, MemoryQueue, ProtocolVariant, Received,
    RecordRunner, RunContext, RunnerOptions, TriggerKind, TriggerMessage, TriggerQueue,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Standalone,
    FunctionsHost,
}

/// Everything one seed decides.
#[derive(Debug, Clone)]
pub struct Plan {
    pub seed: u64,
    pub mode: Mode,
    pub faulty: bool,
    pub workers: usize,
    pub triggers: Vec<(Duration, usize)>,
    pub crashes: Vec<(Duration, usize, Duration)>,
    pub fencing: bool,
}

impl Plan {
    pub fn from_seed(seed: u64) -> Self {
        let mut rng = SmallRng::seed_from_u64(seed ^ 0x5eed);
        let mode = if seed % 2 == 0 {
            Mode::Standalone
        } else {
            Mode::FunctionsHost
        };
        let faulty = seed % 10 < 7;
        let records = rng.random_range(1..=3);
        let workers = rng.random_range(2..=3);
        let n = rng.random_range(3..=14);
        let mut triggers: Vec<_> = (0..n)
            .map(|_| {
                // Bursts: a third of triggers land within a second of another.
                (
                    Duration::from_millis(rng.random_range(0..90_000)),
                    rng.random_range(0..records),
                )
            })
            .collect();
        for i in 0..n / 3 {
            let (t, r) = triggers[i];
            triggers.push((t + Duration::from_millis(rng.random_range(0..1_000)), r));
        }
        triggers.sort();
        let crashes = if faulty {
            (0..rng.random_range(0..=2))
                .map(|_| {
                    (
                        Duration::from_millis(rng.random_range(0..100_000)),
                        rng.random_range(0..workers),
                        Duration::from_millis(rng.random_range(0..15_000)),
                    )
                })
                .collect()
        } else {
            Vec::new()
        };
        Self {
            seed,
            mode,
            faulty,
            workers,
            triggers,
            crashes,
            fencing: seed % 3 != 0,
        }
    }
}

/// Faults stop here so the system can drain; checks look at the state after that.
const FAULT_PHASE: Duration = Duration::from_secs(130);
const DRAIN_LIMIT: Duration = Duration::from_secs(1800);
const LEASE: Duration = Duration::from_secs(30);
/// Standalone visibility: lease duration + renewal interval (the consumer's default rule).
const VISIBILITY: Duration = Duration::from_secs(40);
const HOST_RETRY_VISIBILITY: Duration = Duration::from_secs(5);

#[derive(Debug, Clone)]
struct RunRecord {
    node: usize,
    record: String,
    token: Option<u64>,
    start: Instant,
    end: Option<Instant>,
    completed: bool,
}

#[derive(Debug, Default)]
struct Journal {
    runs: Vec<RunRecord>,
    active: HashMap<String, usize>,
    last_token: HashMap<String, u64>,
    accepted: Vec<(String, Instant)>,
    /// When each external trigger's delivery began being handled (first time).
    arrivals: Vec<(String, Instant)>,
    /// When a node died, the records it was running, and how long until it was back.
    crashes: Vec<(Instant, Vec<String>, Duration)>,
    /// Gets that took effect but whose answer was lost: their messages stay hidden for a whole
    /// visibility period (10 minutes under the Functions host), which no protocol can shorten.
    lost_gets: Vec<Instant>,
    violations: Vec<String>,
    poisoned: Vec<String>,
}

/// Shared state of one simulated world.
pub struct World {
    rng: Mutex<SmallRng>,
    faults: AtomicBool,
    blob: Arc<MemoryStore>,
    queue: Arc<MemoryQueue>,
    journal: Mutex<Journal>,
    epoch: Instant,
    logic_rng: Mutex<SmallRng>,
}

impl World {
    fn chance(&self, p: f64) -> bool {
        self.faults.load(Ordering::SeqCst) && self.rng.lock().unwrap().random_bool(p)
    }

    fn delay(&self) -> Duration {
        Duration::from_millis(self.rng.lock().unwrap().random_range(0..250))
    }

    fn violation(&self, text: String) {
        self.journal.lock().unwrap().violations.push(text);
    }

    fn at(&self, t: Instant) -> f64 {
        (t - self.epoch).as_secs_f64()
    }
}

/// One node's view of storage: delays, transient failures, and silence after a crash.
#[derive(Clone)]
struct Node {
    world: Arc<World>,
    alive: Arc<AtomicBool>,
    counters: OpCounters,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Node")
    }
}

impl Node {
    async fn before(&self, op: Op) -> StoreResult<()> {
        if !self.alive.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        self.counters.record(op);
        tokio::time::sleep(self.world.delay()).await;
        if !self.alive.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        if self.world.chance(0.02) {
            return Err(
                StoreError::new(StoreErrorKind::Transient, op, "injected before").with_status(503, None)
            );
        }
        Ok(())
    }

    /// The call took effect, but its answer may be lost.
    async fn after<T>(&self, op: Op, result: StoreResult<T>) -> StoreResult<T> {
        tokio::time::sleep(self.world.delay()).await;
        if !self.alive.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        if self.world.chance(0.01) {
            return Err(
                StoreError::new(StoreErrorKind::Transient, op, "injected after").with_status(500, None)
            );
        }
        result
    }
}

macro_rules! faulty {
    ($self:ident, $op:expr, $call:expr) => {{
        $self.before($op).await?;
        let r = $call.await;
        $self.after($op, r).await
    }};
}

#[async_trait]
impl LeaseStore for Node {
    async fn create_container(&self) -> StoreResult<()> {
        faulty!(self, Op::ContainerCreate, self.world.blob.create_container())
    }
    async fn create_blob(&self, blob: &str) -> StoreResult<()> {
        faulty!(self, Op::BlobCreate, self.world.blob.create_blob(blob))
    }
    async fn acquire_lease(&self, blob: &str, lease: LeaseId, duration: Duration) -> StoreResult<()> {
        faulty!(
            self,
            Op::LeaseAcquire,
            self.world.blob.acquire_lease(blob, lease, duration)
        )
    }
    async fn renew_lease(&self, blob: &str, lease: LeaseId) -> StoreResult<()> {
        faulty!(self, Op::LeaseRenew, self.world.blob.renew_lease(blob, lease))
    }
    async fn release_lease(&self, blob: &str, lease: LeaseId, if_match: Option<&ETag>) -> StoreResult<()> {
        faulty!(
            self,
            Op::LeaseRelease,
            self.world.blob.release_lease(blob, lease, if_match)
        )
    }
    async fn break_lease(&self, blob: &str) -> StoreResult<()> {
        faulty!(self, Op::LeaseBreak, self.world.blob.break_lease(blob))
    }
    async fn properties(&self, blob: &str) -> StoreResult<BlobProperties> {
        faulty!(self, Op::BlobProperties, self.world.blob.properties(blob))
    }
    async fn set_metadata(
        &self,
        blob: &str,
        lease: Option<LeaseId>,
        if_match: Option<&ETag>,
        metadata: &Metadata,
    ) -> StoreResult<ETag> {
        faulty!(
            self,
            Op::BlobSetMetadata,
            self.world.blob.set_metadata(blob, lease, if_match, metadata)
        )
    }
    async fn put_flag(&self, blob: &str) -> StoreResult<FlagPut> {
        faulty!(self, Op::FlagPut, self.world.blob.put_flag(blob))
    }
    async fn delete_flag(&self, blob: &str) -> StoreResult<bool> {
        faulty!(self, Op::FlagDelete, self.world.blob.delete_flag(blob))
    }
    async fn flag_exists(&self, blob: &str) -> StoreResult<bool> {
        faulty!(self, Op::BlobProperties, self.world.blob.flag_exists(blob))
    }
    fn counters(&self) -> &OpCounters {
        &self.counters
    }
}

#[async_trait]
impl TriggerQueue for Node {
    fn name(&self) -> &str {
        "sim"
    }
    async fn put(&self, body: &str, delay: Duration) -> StoreResult<()> {
        faulty!(self, Op::QueuePut, self.world.queue.put(body, delay))
    }
    async fn get(&self, max: u32, visibility: Duration) -> StoreResult<Vec<Received>> {
        self.before(Op::QueueGet).await?;
        let taken = self.world.queue.get(max, visibility).await;
        let answered = self.after(Op::QueueGet, Ok(())).await;
        let taken = taken?;
        let now = Instant::now();
        let mut j = self.world.journal.lock().unwrap();
        if let Err(e) = answered {
            if !taken.is_empty() {
                j.lost_gets.push(now);
            }
            return Err(e);
        }
        // A trigger arrives when a worker first receives it.
        for m in &taken {
            if let Ok(t) = TriggerMessage::decode(&m.body) {
                if t.kind == TriggerKind::Trigger && m.dequeue_count == 1 {
                    j.arrivals.push((t.record_id, now));
                }
            }
        }
        Ok(taken)
    }
    async fn delete(&self, id: &str, pop_receipt: &str) -> StoreResult<()> {
        faulty!(self, Op::QueueDelete, self.world.queue.delete(id, pop_receipt))
    }
    async fn set_visibility(
        &self,
        id: &str,
        receipt: &str,
        body: &str,
        visibility: Duration,
    ) -> StoreResult<String> {
        faulty!(
            self,
            Op::QueueUpdate,
            self.world.queue.set_visibility(id, receipt, body, visibility)
        )
    }
    async fn approximate_len(&self) -> StoreResult<u64> {
        self.world.queue.approximate_len().await
    }
    fn counters(&self) -> &OpCounters {
        &self.counters
    }
}

/// Poison queue that records what lands in it.
struct PoisonSink(Arc<World>, OpCounters);

impl std::fmt::Debug for PoisonSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PoisonSink")
    }
}

#[async_trait]
impl TriggerQueue for PoisonSink {
    fn name(&self) -> &str {
        "sim-poison"
    }
    async fn put(&self, body: &str, _delay: Duration) -> StoreResult<()> {
        self.0.journal.lock().unwrap().poisoned.push(body.to_string());
        Ok(())
    }
    async fn get(&self, _max: u32, _v: Duration) -> StoreResult<Vec<Received>> {
        Ok(Vec::new())
    }
    async fn delete(&self, _id: &str, _r: &str) -> StoreResult<()> {
        Ok(())
    }
    async fn set_visibility(&self, _: &str, _: &str, _: &str, _: Duration) -> StoreResult<String> {
        Ok(String::new())
    }
    async fn approximate_len(&self) -> StoreResult<u64> {
        Ok(0)
    }
    fn counters(&self) -> &OpCounters {
        &self.1
    }
}

/// Logic that records each run, honours cancellation, sometimes fails, and freezes (its run
/// ending at that instant) when its node is killed.
struct SimLogic(Arc<World>, CancellationToken, usize);

struct ActiveRun {
    world: Arc<World>,
    index: usize,
    done: bool,
}

impl Drop for ActiveRun {
    fn drop(&mut self) {
        // The run ends here whether it finished or was cancelled (a killed node's runs were
        // ended at the kill).
        let mut j = self.world.journal.lock().unwrap();
        if j.runs[self.index].end.is_some() {
            return;
        }
        let record = j.runs[self.index].record.clone();
        j.runs[self.index].end = Some(Instant::now());
        j.runs[self.index].completed = self.done;
        *j.active.get_mut(&record).unwrap() -= 1;
    }
}

#[async_trait]
impl Logic for SimLogic {
    async fn run(&self, ctx: RunContext) -> Result<(), LogicError> {
        let world = &self.0;
        let (duration, fails) = {
            let mut rng = world.logic_rng.lock().unwrap();
            let long = rng.random_bool(0.2);
            let d = if long {
                rng.random_range(20_000..70_000)
            } else {
                rng.random_range(100..5_000)
            };
            (
                Duration::from_millis(d),
                world.faults.load(Ordering::SeqCst) && rng.random_bool(0.05),
            )
        };
        let index = {
            let mut j = world.journal.lock().unwrap();
            let now = Instant::now();
            let active = j.active.entry(ctx.record_id.clone()).or_default();
            *active += 1;
            if *active > 1 {
                let text = format!(
                    "overlap: two runs of {} at t={:.3}s",
                    ctx.record_id,
                    world.at(now)
                );
                j.violations.push(text);
            }
            if let Some(token) = ctx.fencing_token {
                let last = j.last_token.insert(ctx.record_id.clone(), token).unwrap_or(0);
                if token <= last {
                    let text = format!("fencing: token {token} after {last} for {}", ctx.record_id);
                    j.violations.push(text);
                }
            }
            j.runs.push(RunRecord {
                node: self.2,
                record: ctx.record_id.clone(),
                token: ctx.fencing_token,
                start: now,
                end: None,
                completed: false,
            });
            j.runs.len() - 1
        };
        let mut run = ActiveRun {
            world: world.clone(),
            index,
            done: false,
        };
        tokio::select! {
            biased;
            _ = self.1.cancelled() => {
                drop(run);
                std::future::pending().await
            }
            _ = ctx.cancel.cancelled() => Err(LogicError("cancelled".into())),
            _ = tokio::time::sleep(duration) => {
                if fails {
                    Err(LogicError("injected logic failure".into()))
                } else {
                    run.done = true;
                    Ok(())
                }
            }
        }
    }
}

/// Outcome of one seed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub runs: usize,
    pub accepted: usize,
    pub crashes: usize,
    pub violations: Vec<String>,
    pub fingerprint: u64,
}

fn lease_options(plan: &Plan, node: u64) -> LeaseOptions {
    LeaseOptions {
        duration: LEASE,
        renew_every: Duration::from_secs(10),
        safety_margin: Duration::from_secs(3),
        fencing: plan.fencing,
        retry: RetryOptions {
            jitter_seed: Some(plan.seed ^ node),
            ..RetryOptions::default()
        },
        holder: format!("node{node}"),
    }
}

/// Runs one seed to completion and checks the invariants.
pub fn run_seed(seed: u64, variant: ProtocolVariant) -> Report {
    let plan = Plan::from_seed(seed);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(simulate(plan, variant))
}

async fn simulate(plan: Plan, variant: ProtocolVariant) -> Report {
    let world = Arc::new(World {
        rng: Mutex::new(SmallRng::seed_from_u64(plan.seed)),
        faults: AtomicBool::new(plan.faulty),
        blob: Arc::new(MemoryStore::new()),
        queue: Arc::new(MemoryQueue::new("sim", OpCounters::new())),
        journal: Mutex::default(),
        epoch: Instant::now(),
        logic_rng: Mutex::new(SmallRng::seed_from_u64(plan.seed.rotate_left(17))),
    });
    let counters = OpCounters::new();
    // A node is a worker process. In standalone mode it is the consumer; in host mode it is the
    // custom handler, and the (emulated) Functions host in front of it survives its crashes.
    let slots: Vec<Slot> = (0..plan.workers).map(|_| Arc::new(Mutex::new(None))).collect();
    let mut nodes: Vec<(
        Arc<AtomicBool>,
        Option<tokio::task::JoinHandle<()>>,
        CancellationToken,
    )> = Vec::new();
    let start_node = |index: usize, generation: u64| {
        let alive = Arc::new(AtomicBool::new(true));
        let killed = CancellationToken::new();
        let node = Node {
            world: world.clone(),
            alive: alive.clone(),
            counters: counters.clone(),
        };
        let store: Arc<dyn LeaseStore> = Arc::new(node.clone());
        let lock = LeaseLock::new(store, lease_options(&plan, (index as u64) << 8 | generation)).unwrap();
        let queue: Arc<dyn TriggerQueue> = Arc::new(node.clone());
        let runner_options = RunnerOptions {
            run_timeout: Duration::from_secs(120),
            variant,
            ..RunnerOptions::default()
        };
        let logic = Arc::new(SimLogic(world.clone(), killed.clone(), index));
        let runner = RecordRunner::new(lock, queue.clone(), logic, runner_options);
        let poison: Arc<dyn TriggerQueue> = Arc::new(PoisonSink(world.clone(), counters.clone()));
        let handle = match plan.mode {
            Mode::Standalone => {
                let options = ConsumerOptions {
                    visibility: VISIBILITY,
                    max_dequeue_count: 50,
                    poll_max: Duration::from_secs(2),
                    ..ConsumerOptions::default()
                };
                let consumer = Consumer::new(runner, poison, options);
                let s = killed.clone();
                Some(tokio::spawn(async move { consumer.run(s).await }))
            }
            Mode::FunctionsHost => {
                *slots[index].lock().unwrap() = Some(Handler {
                    runner,
                    killed: killed.clone(),
                });
                None
            }
        };
        (alive, handle, killed)
    };
    for i in 0..plan.workers {
        nodes.push(start_node(i, 0));
    }
    let mut hosts = Vec::new();
    if plan.mode == Mode::FunctionsHost {
        for slot in &slots {
            let host_node = Node {
                world: world.clone(),
                alive: Arc::new(AtomicBool::new(true)),
                counters: counters.clone(),
            };
            hosts.push(tokio::spawn(host(
                world.clone(),
                Arc::new(host_node),
                slot.clone(),
            )));
        }
    }

    // Start: accept triggers at their times (a put that succeeded is an accepted trigger).
    let injector = {
        let world = world.clone();
        let triggers = plan.triggers.clone();
        tokio::spawn(async move {
            for (at, record) in triggers {
                tokio::time::sleep_until(world.epoch + at).await;
                let msg = TriggerMessage::new("sim", format!("r{record}"));
                world.queue.put(&msg.encode(), Duration::ZERO).await.unwrap();
                world
                    .journal
                    .lock()
                    .unwrap()
                    .accepted
                    .push((msg.record_id.clone(), Instant::now()));
            }
        })
    };

    // Crashes: kill a node at an instant (its calls never return, its tasks are dropped), then
    // start a fresh one in its place after a pause.
    let mut crashes = plan.crashes.clone();
    crashes.sort();
    for (generation, (at, index, restart_after)) in (1..).zip(crashes) {
        tokio::time::sleep_until(world.epoch + at).await;
        let (alive, handle, killed) = &nodes[index];
        alive.store(false, Ordering::SeqCst);
        killed.cancel();
        if let Some(handle) = handle {
            handle.abort();
        }
        *slots[index].lock().unwrap() = None;
        // A dead process runs nothing: its open runs end at this instant.
        let holding: Vec<String> = {
            let mut j = world.journal.lock().unwrap();
            let now = Instant::now();
            let mut ended = Vec::new();
            for r in j.runs.iter_mut().filter(|r| r.node == index && r.end.is_none()) {
                r.end = Some(now);
                ended.push(r.record.clone());
            }
            for record in &ended {
                *j.active.get_mut(record).unwrap() -= 1;
            }
            ended
        };
        world
            .journal
            .lock()
            .unwrap()
            .crashes
            .push((Instant::now(), holding, restart_after));
        tokio::time::sleep(restart_after).await;
        nodes[index] = start_node(index, generation);
    }

    tokio::time::sleep_until(world.epoch + FAULT_PHASE).await;
    world.faults.store(false, Ordering::SeqCst);
    injector.await.unwrap();

    // Drain: wait until no message is left and no run is active.
    let deadline = world.epoch + FAULT_PHASE + DRAIN_LIMIT;
    loop {
        let idle =
            world.queue.bodies().is_empty() && world.journal.lock().unwrap().active.values().all(|n| *n == 0);
        if idle {
            break;
        }
        if Instant::now() >= deadline {
            world.violation(format!(
                "did not drain within {DRAIN_LIMIT:?}: {} messages left",
                world.queue.bodies().len()
            ));
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    for (alive, handle, killed) in &nodes {
        alive.store(false, Ordering::SeqCst);
        killed.cancel();
        if let Some(handle) = handle {
            handle.abort();
        }
    }
    for host in hosts {
        host.abort();
    }
    check(&plan, &world)
}

/// A custom handler process as the host sees it.
struct Handler {
    runner: RecordRunner,
    killed: CancellationToken,
}

type Slot = Arc<Mutex<Option<Handler>>>;

/// The Functions host, emulated: takes messages hidden for 10 minutes, invokes the handler,
/// deletes on success, makes the message visible again after `visibilityTimeout` when the
/// invocation fails (including when the handler process dies or is not running), poisons after
/// `maxDequeueCount`.
async fn host(world: Arc<World>, queue: Arc<Node>, slot: Slot) {
    loop {
        let batch = queue.get(16, Duration::from_secs(600)).await.unwrap_or_default();
        if batch.is_empty() {
            tokio::time::sleep(Duration::from_secs(2)).await;
            continue;
        }
        for m in batch {
            let handler = slot
                .lock()
                .unwrap()
                .as_ref()
                .map(|h| (h.runner.clone(), h.killed.clone()));
            let (queue, world) = (queue.clone(), world.clone());
            tokio::spawn(async move {
                let Ok(message) = TriggerMessage::decode(&m.body) else {
                    return;
                };
                let delivery = Delivery {
                    message,
                    dequeue_count: m.dequeue_count,
                };
                if delivery.attempts() > 50 {
                    world.journal.lock().unwrap().poisoned.push(m.body.clone());
                    let _ = queue.delete(&m.id, &m.pop_receipt).await;
                    return;
                }
                let acknowledged = match handler {
                    Some((runner, killed)) => {
                        let never = CancellationToken::new();
                        tokio::select! {
                            biased;
                            _ = killed.cancelled() => false,
                            outcome = runner.handle(&delivery, &never) => outcome.acknowledge(),
                        }
                    }
                    None => false,
                };
                if std::env::var_os("LEASEHOLD_SIM_TRACE").is_some() {
                    println!(
                        "host: {} dc={} {:?} {} acked={acknowledged} at {:.3}s",
                        m.id,
                        m.dequeue_count,
                        delivery.message.kind,
                        delivery.message.record_id,
                        world.at(Instant::now())
                    );
                }
                // The host retries its own storage calls.
                let retry = RetryOptions {
                    jitter_seed: Some(7),
                    ..RetryOptions::default()
                };
                if acknowledged {
                    let _ = retry
                        .run("host delete", || queue.delete(&m.id, &m.pop_receipt))
                        .await;
                } else {
                    let visible =
                        || queue.set_visibility(&m.id, &m.pop_receipt, &m.body, HOST_RETRY_VISIBILITY);
                    let _ = retry.run("host retry", visible).await;
                }
            });
        }
    }
}

fn check(plan: &Plan, world: &World) -> Report {
    let j = world.journal.lock().unwrap();
    let mut violations = j.violations.clone();
    if !j.poisoned.is_empty() {
        violations.push(format!("{} triggers poisoned", j.poisoned.len()));
    }
    // (2) Nothing lost.
    for (record, t) in &j.accepted {
        let served = j
            .runs
            .iter()
            .any(|r| &r.record == record && r.start > *t && r.completed);
        if !served {
            violations.push(format!(
                "lost: trigger for {record} accepted at t={:.3}s never served",
                world.at(*t)
            ));
        }
    }
    // (3) Coalescing, fault-free only: for runs R1 < R2 < R3 of a record, some trigger must have
    // arrived (been first received by a worker) after R1 started and before R3 started:
    // triggers that arrived before or during a run cause at most one more run.
    if !plan.faulty {
        let mut by_record: HashMap<&str, Vec<&RunRecord>> = HashMap::new();
        for r in &j.runs {
            by_record.entry(&r.record).or_default().push(r);
        }
        for (record, runs) in by_record {
            for w in runs.windows(3) {
                let fresh = j
                    .arrivals
                    .iter()
                    .any(|(rec, t)| rec == record && *t > w[0].start && *t < w[2].start);
                if !fresh {
                    violations.push(format!(
                        "coalescing: {record} ran at t={:.3}s and twice more (t={:.3}s, t={:.3}s) with no new trigger",
                        world.at(w[0].start),
                        world.at(w[1].start),
                        world.at(w[2].start)
                    ));
                }
            }
        }
    }
    // (4) Bounded recovery: a record whose run died with its node runs again within lease
    // duration + visibility period + recheck delay (+ polling and slack).
    // Standalone: the message reappears only after the dead holder's lease expired (visibility
    // >= lease + renewal interval), so it runs at once: visibility + polling + slack.
    // Functions host: the message is back after visibilityTimeout (5 s) while the lease may still
    // be live, so a recheck follows: lease + 5 s + visibilityTimeout + polling + slack.
    let slack = Duration::from_secs(2) + Duration::from_secs(10);
    let bound = match plan.mode {
        Mode::Standalone => VISIBILITY + slack,
        Mode::FunctionsHost => LEASE + Duration::from_secs(5) + HOST_RETRY_VISIBILITY + slack,
    };
    let bound_after = |restart: Duration| match plan.mode {
        // Under the Functions host, the host whose handler died keeps taking messages and fails
        // them until its handler is back: the restart time adds to the bound.
        Mode::FunctionsHost => bound + restart,
        Mode::Standalone => bound,
    };
    for (at, records, restart) in &j.crashes {
        // The bound holds once faults stop: another crash inside the window (which may leave a
        // dead node holding the lease again) moves the deadline to that crash's own bound.
        let mut deadline = *at + bound_after(*restart);
        for (later, _, later_restart) in &j.crashes {
            if *later > *at && *later <= deadline {
                deadline = deadline.max(*later + bound_after(*later_restart));
            }
        }
        for record in records {
            let recovered = j
                .runs
                .iter()
                .any(|r| &r.record == record && r.start > *at && r.start <= deadline);
            let later_restart = j.runs.iter().any(|r| &r.record == record && r.start > *at);
            let queue_withheld = j.lost_gets.iter().any(|t| *t >= *at && *t <= deadline);
            if later_restart && !recovered && !queue_withheld {
                violations.push(format!(
                    "recovery: {record} crashed at t={:.3}s and did not run again by t={:.3}s",
                    world.at(*at),
                    world.at(deadline)
                ));
            }
        }
    }
    if std::env::var_os("LEASEHOLD_SIM_TRACE").is_some() {
        println!("{plan:?}");
        for r in &j.runs {
            println!(
                "run {} token {:?} {:.3}s..{:?} completed={}",
                r.record,
                r.token,
                world.at(r.start),
                r.end.map(|e| world.at(e)),
                r.completed
            );
        }
        for (t, recs, _) in &j.crashes {
            println!("crash at {:.3}s holding {recs:?}", world.at(*t));
        }
        for (rec, t) in &j.accepted {
            println!("accepted {rec} at {:.3}s", world.at(*t));
        }
    }
    let mut fingerprint = 0xcbf29ce484222325u64;
    for r in &j.runs {
        for v in [
            (r.start - world.epoch).as_nanos() as u64,
            r.end.map_or(0, |e| (e - world.epoch).as_nanos() as u64),
            r.token.unwrap_or(0),
        ] {
            fingerprint = (fingerprint ^ v).wrapping_mul(0x100000001b3);
        }
    }
    Report {
        runs: j.runs.len(),
        accepted: j.accepted.len(),
        crashes: j.crashes.len(),
        violations,
        fingerprint,
    }
}
