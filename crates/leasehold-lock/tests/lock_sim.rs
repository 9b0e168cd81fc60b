//! Deterministic, seeded simulation of the lock library.
//!
//! Actors take exclusive holds (`try_acquire`, `acquire`), shared holds (`try_acquire_shared`
//! with one of a few share keys) and multi-key holds (`try_acquire_many`, `acquire_many`) on a
//! few keys, on paused tokio time against one [`MemoryStore`]. Each life of an actor sees
//! storage through a fault injector. A seed decides the workload and every fault;
//! `LEASEHOLD_LOCK_SIM_SEEDS=N` runs seeds 0..N (default 2,000), `LEASEHOLD_LOCK_SIM_SEED=N`
//! replays one, `LEASEHOLD_LOCK_SIM_TRACE=1` prints what each seed did.
//!
//! Fault model (see [`Counts`] for how often each happens):
//! - requests answer slowly (a few ms, sometimes seconds), fail transiently before taking effect,
//!   or take effect and still fail (a 503, or no answer at all: a time-out after 10 s);
//! - a request gets no answer within the client time-out and half of those still land up to 4 s
//!   after the client gave up (inside the retry's 5 s late window);
//! - a holder dies: it stops renewing and never releases (`abandon`), or drops its guard (the
//!   release goes out in the background);
//! - a whole actor dies at any instant: every request of its life pends for ever, requests in
//!   flight never land, its guards stop being renewed; it comes back as a new life;
//! - an operator breaks a key's lease (with the default period);
//! - storage's clock runs up to 8 % fast against the actors' (leases expire early).
//!
//! Invariants checked on every seed, per key:
//! - (a) **fencing**: the tokens of the grants, in the order they were granted, never go down;
//!   two grants share a token only if both are shared holds with the same share key with no
//!   other grant between them (members of one shared session); no exclusive token is handed out
//!   twice, even to a grant that was lost before its caller saw it;
//! - (b) **exclusivity**: while a holder believes it holds (from the grant until its guard's
//!   `lost` fires, it starts to release, or it dies), nobody else does, except members of a
//!   shared hold with the same share key;
//! - (c) **all or nothing**: a multi-key hold that succeeded holds exactly its keys; every lease
//!   an exclusive or multi-key call acquired and does not hand out was released before the call
//!   returned, and nothing renews it afterwards.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use leasehold_lock::memory::MemoryStore;
use leasehold_lock::testing::{Effect, FaultyStore, Interceptor};
use leasehold_lock::{
    BlobProperties, ETag, LOCK_PREFIX, LeaseDuration, LeaseGuard, LeaseId, LeaseLock, LeaseOptions,
    LeaseStore, LockKey, META_GENERATION, Metadata, MultiGuard, Op, OpCounters, RetryOptions, StoreError,
    StoreErrorKind, StoreResult,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::time::{Instant, sleep, sleep_until};

/// How long a client waits for an answer.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long after the client gave up a request that got no answer may still land: inside the
/// retry's late window (5 s), as the storage layer promises.
const LATE_MAX_MS: u64 = 4_000;
/// Simulated time during which actors start new attempts.
const ACTIVE: Duration = Duration::from_secs(180);
/// Real time one seed may take before it counts as stuck (one normally takes milliseconds).
const SEED_REAL_TIME_LIMIT: Duration = Duration::from_secs(20);

const KEYS: [&str; 3] = ["sim/a", "sim/b", "sim/c"];
const SHARE_KEYS: [&str; 3] = ["batch-1", "batch-2", "batch-3"];

/// What a seed sets up.
#[derive(Debug, Clone)]
struct Plan {
    seed: u64,
    actors: usize,
    /// Keys in play (a prefix of [`KEYS`]).
    keys: usize,
    /// Share keys in play (a prefix of [`SHARE_KEYS`]).
    share_keys: usize,
    /// How much faster storage's clock runs than the actors'.
    clock_rate: f64,
    /// Chance that an actor's life ends by death (at a random instant).
    death_rate: f64,
    /// Whether storage answers slowly now and then.
    slow: bool,
    /// The generation of lock blobs that start as block blobs (as Leasehold made them before
    /// fencing moved to the sequence number), if they do: every token must be above it.
    block_blobs: Option<u64>,
}

impl Plan {
    fn from_seed(seed: u64) -> Self {
        let mut rng = SmallRng::seed_from_u64(seed ^ 0x6c6f_636b_5f73_696d);
        Plan {
            seed,
            actors: rng.random_range(3..=6),
            keys: rng.random_range(1..=3),
            share_keys: rng.random_range(1..=3),
            clock_rate: if rng.random_bool(0.5) {
                1.0 + rng.random_range(0.0..0.08)
            } else {
                1.0
            },
            death_rate: rng.random_range(0.1..0.6),
            slow: rng.random_bool(0.7),
            block_blobs: rng.random_bool(0.3).then(|| rng.random_range(0..1000)),
        }
    }
}

/// How often each thing happened (per seed, or summed over seeds).
#[derive(Debug, Clone, Default)]
struct Counts {
    requests: u64,
    exclusive_grants: u64,
    shared_grants: u64,
    /// Shared grants that founded a session (a new token) rather than joining one.
    shared_sessions: u64,
    multi_grants: u64,
    /// Keys held through multi-key grants.
    multi_keys: u64,
    /// Grants already lost when the caller got them (they never believed).
    lost_at_grant: u64,
    /// Holds whose `lost` fired while held.
    lost_while_held: u64,
    refused: u64,
    errors: u64,
    releases: u64,
    drops: u64,
    abandons: u64,
    deaths: u64,
    breaks: u64,
    slow: u64,
    transient_before: u64,
    transient_after: u64,
    timeouts: u64,
    late_landings: u64,
}

impl Counts {
    fn add(&mut self, o: &Counts) {
        macro_rules! add {
            ($($f:ident),*) => { $(self.$f += o.$f;)* };
        }
        add!(
            requests,
            exclusive_grants,
            shared_grants,
            shared_sessions,
            multi_grants,
            multi_keys,
            lost_at_grant,
            lost_while_held,
            refused,
            errors,
            releases,
            drops,
            abandons,
            deaths,
            breaks,
            slow,
            transient_before,
            transient_after,
            timeouts,
            late_landings
        );
    }
}

impl fmt::Display for Counts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "grants: {} exclusive, {} shared ({} sessions), {} multi-key ({} keys); {} lost at \
             grant, {} lost while held; {} refused, {} errors; ends: {} releases, {} drops, {} \
             abandons, {} deaths; faults: {} breaks, {} slow answers, {} transient before / {} \
             after effect, {} time-outs ({} landed late); {} requests",
            self.exclusive_grants,
            self.shared_grants,
            self.shared_sessions,
            self.multi_grants,
            self.multi_keys,
            self.lost_at_grant,
            self.lost_while_held,
            self.refused,
            self.errors,
            self.releases,
            self.drops,
            self.abandons,
            self.deaths,
            self.breaks,
            self.slow,
            self.transient_before,
            self.transient_after,
            self.timeouts,
            self.late_landings,
            self.requests,
        )
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Kind {
    Exclusive,
    Shared(&'static str),
    Multi,
}

/// One grant of one key to one holder.
#[derive(Debug, Clone)]
struct Grant {
    key: &'static str,
    kind: Kind,
    token: Option<u64>,
    actor: usize,
    life: u32,
    start: Instant,
    /// When the holder stopped believing it holds (`None` while it does).
    end: Option<Instant>,
    /// The guard's `lost` had fired before the caller got it: it never believed.
    lost_at_grant: bool,
}

/// A lease request the lock made (recorded above the fault injector): renewals and releases
/// when sent, acquires when answered.
#[derive(Debug, Clone)]
struct Sent {
    node: u64,
    op: Op,
    blob: String,
    lease: LeaseId,
    at: Instant,
    ok: bool,
}

/// An exclusive or multi-key call and what it handed out.
#[derive(Debug, Clone)]
struct Call {
    node: u64,
    keys: Vec<&'static str>,
    start: Instant,
    end: Instant,
    /// The lease ids it handed out (empty when it failed).
    handed_out: Vec<LeaseId>,
    /// For a successful multi-key call: the keys of its guards, in order.
    multi_keys: Option<Vec<String>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Violation {
    /// A token lower than one granted before it.
    TokenDecreased(String),
    /// A token handed to two sessions (item 5's class).
    TokenReused(String),
    /// Two holders believed at once.
    Overlap(String),
    /// A multi-key or exclusive call kept, or keeps renewing, a lease it did not hand out, or a
    /// multi-key hold does not hold exactly its keys.
    AllOrNothing(String),
    /// The seed did not finish in real time (a spin or a hang).
    Stuck(String),
}

impl Violation {
    fn label(&self) -> &'static str {
        match self {
            Violation::TokenDecreased(_) => "token decreased",
            Violation::TokenReused(_) => "token reused",
            Violation::Overlap(_) => "overlap",
            Violation::AllOrNothing(_) => "all or nothing",
            Violation::Stuck(_) => "stuck",
        }
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (Violation::TokenDecreased(m)
        | Violation::TokenReused(m)
        | Violation::Overlap(m)
        | Violation::AllOrNothing(m)
        | Violation::Stuck(m)) = self;
        write!(f, "{}: {m}", self.label())
    }
}

#[derive(Debug, Default)]
struct Journal {
    counts: Counts,
    grants: Vec<Grant>,
    sent: Vec<Sent>,
    calls: Vec<Call>,
    trace: Vec<String>,
}

struct World {
    plan: Plan,
    rng: Mutex<SmallRng>,
    epoch: Instant,
    store: Arc<MemoryStore>,
    journal: Mutex<Journal>,
    next_node: AtomicU64,
    tracing: bool,
}

impl World {
    fn chance(&self, p: f64) -> bool {
        self.rng.lock().unwrap().random_bool(p)
    }

    fn millis(&self, range: std::ops::Range<u64>) -> Duration {
        Duration::from_millis(self.rng.lock().unwrap().random_range(range))
    }

    fn pick<T: Copy>(&self, from: &[T]) -> T {
        from[self.rng.lock().unwrap().random_range(0..from.len())]
    }

    fn count(&self, f: impl FnOnce(&mut Counts)) {
        f(&mut self.journal.lock().unwrap().counts);
    }

    fn at(&self, t: Instant) -> f64 {
        (t - self.epoch).as_secs_f64()
    }

    fn trace(&self, line: impl FnOnce() -> String) {
        if self.tracing {
            let line = format!("t={:.3}s {}", self.at(Instant::now()), line());
            self.journal.lock().unwrap().trace.push(line);
        }
    }

    /// How long one leg of a request takes.
    fn delay(&self) -> Duration {
        if self.plan.slow && self.chance(0.03) {
            self.count(|c| c.slow += 1);
            self.millis(300..4_000)
        } else {
            self.millis(1..40)
        }
    }

    fn end_of_activity(&self) -> Instant {
        self.epoch + ACTIVE
    }
}

/// One life of one actor: its view of storage. Dead, every request it sends pends for ever.
#[derive(Clone)]
struct Node {
    world: Arc<World>,
    id: u64,
    alive: Arc<AtomicBool>,
    counters: OpCounters,
}

impl fmt::Debug for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Node({})", self.id)
    }
}

impl Node {
    fn new(world: &Arc<World>) -> Self {
        Node {
            world: world.clone(),
            id: world.next_node.fetch_add(1, Ordering::SeqCst),
            alive: Arc::new(AtomicBool::new(true)),
            counters: OpCounters::new(),
        }
    }

    async fn pend_if_dead(&self) {
        if !self.alive.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
    }

    /// The lock's store for this life: a recorder over the fault injector over the memory store.
    fn store(&self) -> Arc<dyn LeaseStore> {
        let faulty = FaultyStore::new(self.world.store.clone(), self.clone());
        Arc::new(Recorder {
            node: self.clone(),
            inner: Arc::new(faulty),
        })
    }
}

#[async_trait]
impl Interceptor for Node {
    async fn call<T: Send + 'static>(&self, op: Op, _target: &str, effect: Effect<T>) -> StoreResult<T> {
        self.pend_if_dead().await;
        let world = &self.world;
        world.count(|c| c.requests += 1);
        if world.chance(0.005) {
            // No answer within the client's time-out; half of these land afterwards.
            world.count(|c| c.timeouts += 1);
            if world.chance(0.5) {
                world.count(|c| c.late_landings += 1);
                let late = CLIENT_TIMEOUT + world.millis(0..LATE_MAX_MS);
                tokio::spawn(async move {
                    sleep(late).await;
                    let _ = effect.await;
                });
            }
            sleep(CLIENT_TIMEOUT).await;
            self.pend_if_dead().await;
            return Err(StoreError::timeout(op, CLIENT_TIMEOUT));
        }
        sleep(world.delay()).await;
        self.pend_if_dead().await;
        if world.chance(0.02) {
            world.count(|c| c.transient_before += 1);
            return Err(
                StoreError::new(StoreErrorKind::Transient, op, "injected before").with_status(503, None)
            );
        }
        let result = effect.await;
        if world.chance(0.01) {
            world.count(|c| c.transient_after += 1);
            if world.chance(0.5) {
                // Took effect; no answer came.
                sleep(CLIENT_TIMEOUT).await;
                self.pend_if_dead().await;
                return Err(StoreError::timeout(op, CLIENT_TIMEOUT));
            }
            sleep(world.delay()).await;
            self.pend_if_dead().await;
            return Err(
                StoreError::new(StoreErrorKind::Transient, op, "injected after").with_status(500, None)
            );
        }
        sleep(world.delay()).await;
        self.pend_if_dead().await;
        result
    }

    fn counters(&self) -> &OpCounters {
        &self.counters
    }
}

/// Records the lease requests the lock sends (acquires with their answers, renewals, releases).
#[derive(Debug)]
struct Recorder {
    node: Node,
    inner: Arc<dyn LeaseStore>,
}

impl Recorder {
    fn record(&self, op: Op, blob: &str, lease: LeaseId, at: Instant, ok: bool) {
        self.node.world.journal.lock().unwrap().sent.push(Sent {
            node: self.node.id,
            op,
            blob: blob.to_string(),
            lease,
            at,
            ok,
        });
    }
}

#[async_trait]
impl LeaseStore for Recorder {
    async fn create_container(&self) -> StoreResult<()> {
        self.inner.create_container().await
    }

    async fn create_blob(&self, blob: &str) -> StoreResult<()> {
        self.inner.create_blob(blob).await
    }

    async fn acquire_lease(&self, blob: &str, lease: LeaseId, duration: LeaseDuration) -> StoreResult<()> {
        let result = self.inner.acquire_lease(blob, lease, duration).await;
        // When the answer came: the call that was waiting for it is the one it belongs to.
        self.record(Op::LeaseAcquire, blob, lease, Instant::now(), result.is_ok());
        result
    }

    async fn renew_lease(&self, blob: &str, lease: LeaseId) -> StoreResult<()> {
        self.record(Op::LeaseRenew, blob, lease, Instant::now(), true);
        self.inner.renew_lease(blob, lease).await
    }

    async fn release_lease(&self, blob: &str, lease: LeaseId, if_match: Option<&ETag>) -> StoreResult<()> {
        self.record(Op::LeaseRelease, blob, lease, Instant::now(), true);
        self.inner.release_lease(blob, lease, if_match).await
    }

    async fn break_lease(&self, blob: &str, period: Duration) -> StoreResult<()> {
        self.inner.break_lease(blob, period).await
    }

    async fn properties(&self, blob: &str) -> StoreResult<BlobProperties> {
        self.inner.properties(blob).await
    }

    async fn set_metadata(
        &self,
        blob: &str,
        lease: Option<LeaseId>,
        if_match: Option<&ETag>,
        metadata: &Metadata,
    ) -> StoreResult<ETag> {
        self.inner.set_metadata(blob, lease, if_match, metadata).await
    }

    async fn increment_sequence(
        &self,
        blob: &str,
        lease: LeaseId,
        if_match: Option<&ETag>,
    ) -> StoreResult<Option<(u64, ETag)>> {
        self.inner.increment_sequence(blob, lease, if_match).await
    }

    async fn replace_with_page_blob(
        &self,
        blob: &str,
        lease: LeaseId,
        if_match: Option<&ETag>,
        sequence: u64,
        metadata: &Metadata,
    ) -> StoreResult<ETag> {
        self.inner
            .replace_with_page_blob(blob, lease, if_match, sequence, metadata)
            .await
    }

    fn counters(&self) -> &OpCounters {
        self.inner.counters()
    }
}

/// Ends the belief of one or more grants when the hold ends, however it ends (returns, or is
/// dropped because its actor died).
struct Belief {
    world: Arc<World>,
    grants: Vec<usize>,
}

impl Belief {
    fn end(&mut self) {
        let now = Instant::now();
        let mut j = self.world.journal.lock().unwrap();
        for &i in &self.grants {
            j.grants[i].end.get_or_insert(now);
        }
    }
}

impl Drop for Belief {
    fn drop(&mut self) {
        self.end();
    }
}

/// The lock options of one actor's life: the defaults (30 s lease, renewed every 10 s, lost 10 s
/// before storage could let it expire), with jitter from the seed.
fn options(world: &World, node: &Node) -> LeaseOptions {
    LeaseOptions {
        retry: RetryOptions {
            jitter_seed: Some(world.plan.seed.wrapping_mul(1_000).wrapping_add(node.id)),
            ..RetryOptions::default()
        },
        holder: format!("node-{}", node.id),
        ..LeaseOptions::default()
    }
}

async fn actor(world: Arc<World>, actor: usize) {
    let mut life = 0u32;
    while Instant::now() < world.end_of_activity() {
        let node = Node::new(&world);
        let lock = LeaseLock::new(node.store(), options(&world, &node)).unwrap();
        let death = world
            .chance(world.plan.death_rate)
            .then(|| Instant::now() + world.millis(1_000..120_000));
        let lived = {
            let live = live(&world, &node, &lock, actor, life);
            tokio::pin!(live);
            tokio::select! {
                biased;
                _ = sleep_until(death.unwrap_or(Instant::now() + Duration::from_secs(100_000))),
                    if death.is_some() => false,
                _ = &mut live => true,
            }
        };
        if !lived {
            // The future holding everything of this life was dropped at the instant of death:
            // beliefs ended there; its requests pend for ever from now on.
            node.alive.store(false, Ordering::SeqCst);
            world.count(|c| c.deaths += 1);
            world.trace(|| format!("actor {actor} life {life} (node {}) dies", node.id));
            sleep(world.millis(0..5_000)).await;
        }
        life += 1;
    }
}

/// One life of an actor: attempts until the active period is over.
async fn live(world: &Arc<World>, node: &Node, lock: &LeaseLock, actor: usize, life: u32) {
    let plan = &world.plan;
    let keys = &KEYS[..plan.keys];
    let share_keys = &SHARE_KEYS[..plan.share_keys];
    while Instant::now() < world.end_of_activity() {
        let roll = world.rng.lock().unwrap().random_range(0..100);
        match roll {
            0..30 => {
                let key = world.pick(keys);
                let k = LockKey::new(key).unwrap();
                let start = Instant::now();
                let waits = world.chance(0.3);
                let outcome = if waits {
                    match lock.acquire(&k, world.millis(0..10_000)).await {
                        Ok(g) => Ok(Some(g)),
                        Err(leasehold_lock::Error::Timeout { .. }) => Ok(None),
                        Err(e) => Err(e),
                    }
                } else {
                    lock.try_acquire(&k).await
                };
                let handed_out = match &outcome {
                    Ok(Some(g)) => vec![g.lease_id()],
                    _ => Vec::new(),
                };
                record_call(world, node, vec![key], start, handed_out, None);
                match outcome {
                    Ok(Some(guard)) => hold(world, vec![(key, guard)], Kind::Exclusive, actor, life).await,
                    other => not_granted(world, other.map(|_| ())),
                }
            }
            30..75 => {
                let key = world.pick(keys);
                let share = world.pick(share_keys);
                let k = LockKey::new(key).unwrap();
                match lock.try_acquire_shared(&k, share).await {
                    Ok(Some(guard)) => {
                        hold(world, vec![(key, guard)], Kind::Shared(share), actor, life).await
                    }
                    other => not_granted(world, other.map(|_| ())),
                }
            }
            75..95 => {
                let n = world.rng.lock().unwrap().random_range(1..=keys.len().max(2));
                let wanted: Vec<&'static str> = (0..n).map(|_| world.pick(keys)).collect();
                let ks: Vec<LockKey> = wanted.iter().map(|k| LockKey::new(*k).unwrap()).collect();
                let start = Instant::now();
                let outcome = if world.chance(0.3) {
                    match lock.acquire_many(&ks, world.millis(0..10_000)).await {
                        Ok(g) => Ok(Some(g)),
                        Err(leasehold_lock::Error::Timeout { .. }) => Ok(None),
                        Err(e) => Err(e),
                    }
                } else {
                    lock.try_acquire_many(&ks).await
                };
                let (handed_out, multi_keys) = match &outcome {
                    Ok(Some(m)) => (
                        m.guards().iter().map(LeaseGuard::lease_id).collect(),
                        Some(m.guards().iter().map(|g| g.key().to_string()).collect()),
                    ),
                    _ => (Vec::new(), None),
                };
                record_call(world, node, wanted, start, handed_out, multi_keys);
                match outcome {
                    Ok(Some(multi)) => hold_many(world, multi, actor, life).await,
                    other => not_granted(world, other.map(|_| ())),
                }
            }
            _ => {
                let key = world.pick(keys);
                world.count(|c| c.breaks += 1);
                world.trace(|| format!("actor {actor} breaks {key}"));
                let _ = lock.break_lock(&LockKey::new(key).unwrap(), "sim").await;
            }
        }
        // Shared members poll often (a joiner must catch the key as it frees up); others rest.
        let pause = if world.chance(0.5) {
            world.millis(0..300)
        } else {
            world.millis(0..3_000)
        };
        sleep(pause).await;
    }
}

fn not_granted(world: &World, outcome: leasehold_lock::Result<()>) {
    match outcome {
        Ok(()) => world.count(|c| c.refused += 1),
        Err(e) => {
            world.count(|c| c.errors += 1);
            world.trace(|| format!("error: {e}"));
        }
    }
}

fn record_call(
    world: &World,
    node: &Node,
    keys: Vec<&'static str>,
    start: Instant,
    handed_out: Vec<LeaseId>,
    multi_keys: Option<Vec<String>>,
) {
    world.journal.lock().unwrap().calls.push(Call {
        node: node.id,
        keys,
        start,
        end: Instant::now(),
        handed_out,
        multi_keys,
    });
}

/// Records the grants of one hold; returns the belief that ends them.
fn grant(
    world: &Arc<World>,
    held: &[(&'static str, Option<u64>, bool)],
    kind: Kind,
    actor: usize,
    life: u32,
) -> Belief {
    let now = Instant::now();
    let mut j = world.journal.lock().unwrap();
    let mut grants = Vec::new();
    for &(key, token, lost) in held {
        if let Kind::Shared(share) = kind
            && !lost
        {
            let founding = !j
                .grants
                .iter()
                .rev()
                .find(|g| g.key == key && !g.lost_at_grant)
                .is_some_and(|g| g.kind == Kind::Shared(share) && g.token == token);
            if founding {
                j.counts.shared_sessions += 1;
            }
        }
        match kind {
            Kind::Exclusive => j.counts.exclusive_grants += 1,
            Kind::Shared(_) => j.counts.shared_grants += 1,
            Kind::Multi => j.counts.multi_keys += 1,
        }
        if lost {
            j.counts.lost_at_grant += 1;
        }
        if world.tracing {
            let line = format!(
                "t={:.3}s actor {actor} life {life}: {key} granted {kind:?} token {token:?}{}",
                world.at(now),
                if lost { " (already lost)" } else { "" }
            );
            j.trace.push(line);
        }
        grants.push(j.grants.len());
        j.grants.push(Grant {
            key,
            kind: kind.clone(),
            token,
            actor,
            life,
            start: now,
            end: lost.then_some(now),
            lost_at_grant: lost,
        });
    }
    if kind == Kind::Multi {
        j.counts.multi_grants += 1;
    }
    Belief {
        world: world.clone(),
        grants,
    }
}

/// How long a hold lasts: mostly short, sometimes across several renewals.
fn hold_time(world: &World) -> Duration {
    if world.chance(0.8) {
        world.millis(10..3_000)
    } else {
        world.millis(3_000..45_000)
    }
}

async fn hold(
    world: &Arc<World>,
    guards: Vec<(&'static str, LeaseGuard)>,
    kind: Kind,
    actor: usize,
    life: u32,
) {
    let held: Vec<_> = guards
        .iter()
        .map(|(k, g)| (*k, g.fencing_token(), g.is_lost()))
        .collect();
    let mut belief = grant(world, &held, kind, actor, life);
    let (key, guard) = guards.into_iter().next().expect("one guard");
    let lost = guard.lost();
    tokio::select! {
        biased;
        _ = lost.cancelled() => {
            world.count(|c| c.lost_while_held += 1);
            world.trace(|| format!("actor {actor} life {life}: {key} lost"));
        }
        _ = sleep(hold_time(world)) => {}
    }
    belief.end();
    end_hold(world, actor, life, key, guard).await;
}

/// Ends a hold the way a holder does: mostly releases, sometimes dies (stops renewing, never
/// releases) or drops its guard.
async fn end_hold(world: &World, actor: usize, life: u32, key: &str, guard: LeaseGuard) {
    let roll = world.rng.lock().unwrap().random_range(0..100);
    match roll {
        0..80 => {
            world.count(|c| c.releases += 1);
            world.trace(|| format!("actor {actor} life {life}: {key} released"));
            let _ = guard.release().await;
        }
        80..90 => {
            world.count(|c| c.drops += 1);
            world.trace(|| format!("actor {actor} life {life}: {key} dropped"));
            drop(guard);
        }
        _ => {
            world.count(|c| c.abandons += 1);
            world.trace(|| format!("actor {actor} life {life}: {key} abandoned"));
            guard.abandon();
        }
    }
}

async fn hold_many(world: &Arc<World>, multi: MultiGuard, actor: usize, life: u32) {
    let held: Vec<_> = multi
        .guards()
        .iter()
        .map(|g| {
            let key = KEYS
                .iter()
                .find(|k| **k == g.key().as_str())
                .copied()
                .expect("a sim key");
            (key, g.fencing_token(), multi.lost().is_cancelled() || g.is_lost())
        })
        .collect();
    let mut belief = grant(world, &held, Kind::Multi, actor, life);
    let lost = multi.lost();
    tokio::select! {
        biased;
        _ = lost.cancelled() => {
            world.count(|c| c.lost_while_held += 1);
            world.trace(|| format!("actor {actor} life {life}: multi-key hold lost"));
        }
        _ = sleep(hold_time(world)) => {}
    }
    belief.end();
    let roll = world.rng.lock().unwrap().random_range(0..100);
    match roll {
        0..85 => {
            world.count(|c| c.releases += 1);
            let _ = multi.release().await;
        }
        _ => {
            world.count(|c| c.drops += 1);
            drop(multi);
        }
    }
}

/// What one seed did and found.
#[derive(Debug, Default)]
struct Report {
    counts: Counts,
    violations: Vec<Violation>,
    /// Printed for a failing seed.
    details: String,
}

fn run_seed(seed: u64) -> Report {
    let plan = Plan::from_seed(seed);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a runtime");
    let store = MemoryStore::new().with_clock_rate(plan.clock_rate);
    if let Some(generation) = plan.block_blobs {
        for key in &KEYS[..plan.keys] {
            let metadata = [(META_GENERATION.to_string(), generation.to_string())].into();
            store.put_block_blob(&format!("{LOCK_PREFIX}{key}"), metadata);
        }
    }
    let world = rt.block_on(async {
        let world = Arc::new(World {
            rng: Mutex::new(SmallRng::seed_from_u64(seed)),
            epoch: Instant::now(),
            store: Arc::new(store),
            journal: Mutex::default(),
            next_node: AtomicU64::new(0),
            tracing: std::env::var_os("LEASEHOLD_LOCK_SIM_TRACE").is_some(),
            plan: plan.clone(),
        });
        let actors: Vec<_> = (0..plan.actors)
            .map(|a| tokio::spawn(actor(world.clone(), a)))
            .collect();
        for a in actors {
            a.await.expect("an actor panicked");
        }
        world
    });
    drop(rt);
    check(&world)
}

/// Checks the invariants on what a seed did.
fn check(world: &World) -> Report {
    let j = world.journal.lock().unwrap();
    let at = |t: Instant| world.at(t);
    let describe = |g: &Grant| {
        format!(
            "{:?} token {:?} to actor {} life {} at {:.3}s (believed until {})",
            g.kind,
            g.token,
            g.actor,
            g.life,
            at(g.start),
            g.end.map_or("the end".to_string(), |e| format!("{:.3}s", at(e)))
        )
    };
    let mut violations = Vec::new();
    let mut by_key: BTreeMap<&str, Vec<&Grant>> = BTreeMap::new();
    for g in &j.grants {
        by_key.entry(g.key).or_default().push(g);
    }
    for (key, grants) in &by_key {
        // (a) Fencing, in grant order, over the grants that believed.
        let mut last: Option<&Grant> = None;
        for g in grants.iter().filter(|g| !g.lost_at_grant) {
            if let Some(p) = last {
                if g.token < p.token {
                    violations.push(Violation::TokenDecreased(format!(
                        "{key}: {} after {}",
                        describe(g),
                        describe(p)
                    )));
                } else if g.token == p.token && !(matches!(g.kind, Kind::Shared(_)) && g.kind == p.kind) {
                    violations.push(Violation::TokenReused(format!(
                        "{key}: {} after {}",
                        describe(g),
                        describe(p)
                    )));
                }
            }
            last = Some(g);
        }
        // Above the generation a block blob it started as had reached.
        if let Some(floor) = world.plan.block_blobs {
            for g in grants.iter().filter(|g| g.token.is_some_and(|t| t <= floor)) {
                violations.push(Violation::TokenDecreased(format!(
                    "{key}: {} not above the block blob's generation {floor}",
                    describe(g)
                )));
            }
        }
        // No exclusive token twice, and no token to two kinds, counting grants lost on arrival.
        let mut owners: HashMap<u64, &Grant> = HashMap::new();
        for g in grants {
            let Some(t) = g.token else { continue };
            match owners.get(&t) {
                Some(o) if !(matches!(g.kind, Kind::Shared(_)) && g.kind == o.kind) => {
                    violations.push(Violation::TokenReused(format!(
                        "{key}: token {t} to {} and to {}",
                        describe(o),
                        describe(g)
                    )));
                }
                Some(_) => {}
                None => {
                    owners.insert(t, g);
                }
            }
        }
        // (b) Exclusivity while believing.
        let believing: Vec<&&Grant> = grants.iter().filter(|g| !g.lost_at_grant).collect();
        for (i, a) in believing.iter().enumerate() {
            let a_end = a.end.unwrap_or(Instant::now());
            for b in &believing[i + 1..] {
                if b.start >= a_end {
                    continue;
                }
                let b_end = b.end.unwrap_or(Instant::now());
                let overlap = a.start < b_end && b.start < a_end;
                let together = matches!(a.kind, Kind::Shared(_)) && a.kind == b.kind;
                if overlap && !together {
                    violations.push(Violation::Overlap(format!(
                        "{key}: {} and {}",
                        describe(a),
                        describe(b)
                    )));
                }
            }
        }
    }
    // (c) All or nothing.
    for call in &j.calls {
        if let Some(keys) = &call.multi_keys {
            let mut want: Vec<String> = call.keys.iter().map(|k| k.to_string()).collect();
            want.sort();
            want.dedup();
            if *keys != want {
                violations.push(Violation::AllOrNothing(format!(
                    "a multi-key hold of {want:?} holds {keys:?}"
                )));
            }
        }
        let acquired: Vec<&Sent> = j
            .sent
            .iter()
            .filter(|s| {
                s.node == call.node
                    && s.op == Op::LeaseAcquire
                    && s.ok
                    && s.at >= call.start
                    && s.at <= call.end
                    && call.keys.iter().any(|k| s.blob.ends_with(k))
            })
            .collect();
        for a in acquired {
            if call.handed_out.contains(&a.lease) {
                continue;
            }
            let released = j
                .sent
                .iter()
                .any(|s| s.op == Op::LeaseRelease && s.lease == a.lease && s.at >= a.at && s.at <= call.end);
            let renewed_after = j
                .sent
                .iter()
                .any(|s| s.op == Op::LeaseRenew && s.lease == a.lease && s.at > call.end);
            if !released || renewed_after {
                let sent: Vec<String> = j
                    .sent
                    .iter()
                    .filter(|s| s.lease == a.lease)
                    .map(|s| format!("{} at {:.3}s (ok: {})", s.op, at(s.at), s.ok))
                    .collect();
                violations.push(Violation::AllOrNothing(format!(
                    "a call on {:?} ({:.3}s..{:.3}s) acquired {} (answered at {:.3}s) without handing \
                     it out; released before returning: {released}; renewed afterwards: \
                     {renewed_after}; requests with its lease id: {sent:?}",
                    call.keys,
                    at(call.start),
                    at(call.end),
                    a.blob,
                    at(a.at)
                )));
            }
        }
    }
    let mut details = format!("{:?}\n{}\n", world.plan, j.counts);
    if !violations.is_empty() || world.tracing {
        for (key, grants) in &by_key {
            details.push_str(&format!("grants of {key}:\n"));
            for g in grants {
                details.push_str(&format!("  {}\n", describe(g)));
            }
        }
    }
    if world.tracing {
        for line in &j.trace {
            details.push_str(line);
            details.push('\n');
        }
    }
    Report {
        counts: j.counts.clone(),
        violations,
        details,
    }
}

/// [`run_seed`] on its own thread, a violation of its own when it does not finish in time.
fn run_seed_bounded(seed: u64) -> Report {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name(format!("lock-sim-{seed}"))
        .spawn(move || {
            let _ = tx.send(run_seed(seed));
        })
        .expect("spawn a simulation thread");
    match rx.recv_timeout(SEED_REAL_TIME_LIMIT) {
        Ok(report) => report,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Report {
            violations: vec![Violation::Stuck(format!(
                "seed {seed} did not finish within {SEED_REAL_TIME_LIMIT:?} of real time"
            ))],
            ..Report::default()
        },
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            panic!("seed {seed}: the simulation panicked (replay with LEASEHOLD_LOCK_SIM_SEED={seed})")
        }
    }
}

/// The seeds to run: `LEASEHOLD_LOCK_SIM_SEED` alone, or 0..`LEASEHOLD_LOCK_SIM_SEEDS` (2,000).
fn seeds() -> std::ops::Range<u64> {
    if let Ok(one) = std::env::var("LEASEHOLD_LOCK_SIM_SEED") {
        let seed: u64 = one.parse().expect("LEASEHOLD_LOCK_SIM_SEED must be a number");
        return seed..seed + 1;
    }
    let n = std::env::var("LEASEHOLD_LOCK_SIM_SEEDS")
        .ok()
        .map(|v| v.parse().expect("LEASEHOLD_LOCK_SIM_SEEDS must be a number"))
        .unwrap_or(2_000);
    0..n
}

#[test]
fn lock_simulation() {
    let seeds = seeds();
    let started = std::time::Instant::now();
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let next = AtomicU64::new(seeds.start);
    let reports = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                loop {
                    let seed = next.fetch_add(1, Ordering::SeqCst);
                    if seed >= seeds.end {
                        return;
                    }
                    let report = run_seed_bounded(seed);
                    reports.lock().unwrap().push((seed, report));
                }
            });
        }
    });
    let mut reports = reports.into_inner().unwrap();
    reports.sort_by_key(|(seed, _)| *seed);
    let mut totals = Counts::default();
    let mut by_label: BTreeMap<&str, usize> = BTreeMap::new();
    let mut failing = Vec::new();
    for (seed, report) in &reports {
        totals.add(&report.counts);
        if seeds.end - seeds.start == 1 && std::env::var_os("LEASEHOLD_LOCK_SIM_TRACE").is_some() {
            println!("{}", report.details);
        }
        if !report.violations.is_empty() {
            let mut labels: Vec<_> = report.violations.iter().map(Violation::label).collect();
            labels.dedup();
            for l in labels {
                *by_label.entry(l).or_default() += 1;
            }
            failing.push(*seed);
            if failing.len() <= 5 {
                println!(
                    "seed {seed} (replay with LEASEHOLD_LOCK_SIM_SEED={seed}):\n{}",
                    report.details
                );
                for v in report.violations.iter().take(10) {
                    println!("  {v}");
                }
            }
        }
    }
    println!(
        "lock simulation: {} seeds in {:.1}s; {totals}",
        reports.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(
        failing.is_empty(),
        "{} of {} seeds broke an invariant (seeds with each: {by_label:?}); first seeds: {:?}",
        failing.len(),
        reports.len(),
        &failing[..failing.len().min(20)]
    );
}
