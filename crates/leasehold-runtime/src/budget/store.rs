//! Where budgets' pauses are shared between workers: the [`BudgetStore`] seam, its blobs in
//! Azure Storage ([`AzureBudgets`]) and its twin in memory ([`MemoryBudgets`]).

use super::*;

/// A budget's pause as storage holds it ([`BudgetStore::read`]).
#[derive(Debug, Clone, PartialEq)]
pub struct SharedPause {
    /// How much longer it lasts, measured on storage's clock when the blob says when it was
    /// written (zero: over, or resumed).
    pub left: Duration,
    /// When it was set, by storage's clock where known.
    pub set_at: Option<SystemTime>,
    /// The adaptive limit the worker that set it had cut to (runs at once on that worker).
    pub limit: Option<u32>,
    /// Whether an operator ended it (`leasehold budget resume`).
    pub resumed: bool,
}

/// Where budgets' pauses are shared between workers. Each method is one round trip (the first
/// write of a budget in a container: two or three; listing: one per 5,000 budgets).
#[async_trait]
pub trait BudgetStore: Send + Sync + fmt::Debug + 'static {
    /// The budget `name`'s pause as last written (`None`: never written).
    async fn read(&self, name: &str) -> Result<Option<SharedPause>, StoreError>;

    /// Pauses the budget `name` for `pause` from now (replacing what was written), noting the
    /// limit the writer cut to.
    async fn write(&self, name: &str, pause: Duration, limit: u32) -> Result<(), StoreError>;

    /// Ends the budget `name`'s pause now (every worker stops honouring it at its next read).
    /// Says whether it was paused.
    async fn resume(&self, name: &str) -> Result<bool, StoreError>;

    /// The names of every budget ever paused in this store.
    async fn names(&self) -> Result<Vec<String>, StoreError>;

    /// The round-trip counters this store records into.
    fn counters(&self) -> &OpCounters;
}

/// Budgets as empty blobs `budgets/<name>` whose metadata holds the pause's length
/// (`pausems`), measured from the blob's `Last-Modified` and read against the `Date` of the
/// answer: both storage's clock, so no worker's clock (one running ahead, say) lengthens
/// anyone's pause. For workers of earlier versions, the end by the writer's clock
/// (`pauseduntilms`) too, which this version reads only from a blob without `pausems`.
#[derive(Debug, Clone)]
pub struct AzureBudgets {
    container: BlobContainer,
}

impl AzureBudgets {
    /// Budgets in `container` of `account`, recording round trips into `counters`.
    pub fn new(account: &StorageAccount, container: &str, counters: OpCounters) -> Self {
        Self {
            container: BlobContainer::new(account, container, counters),
        }
    }

    /// Budgets in the blob container `container` (its round trips counted as it counts them).
    pub fn in_container(container: BlobContainer) -> Self {
        Self { container }
    }

    async fn put_metadata(&self, name: &str, metadata: &HashMap<String, String>) -> Result<bool, StoreError> {
        let blob = format!("{BUDGET_PREFIX}{name}");
        Ok(self
            .container
            .set_metadata_if_present(&blob, metadata, Op::BudgetWrite)
            .await?
            .is_some())
    }
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// The metadata key of a budget blob holding the pause's length in milliseconds, from the
/// blob's last write.
pub(super) const PAUSE_MS: &str = "pausems";
/// The limit its writer cut to.
const LIMIT: &str = "limit";
/// Set (to the time, Unix ms by the operator's clock) when an operator resumed the budget.
const RESUMED: &str = "resumedms";

/// What a budget blob's metadata says, read at storage's clock where it can be.
pub(super) fn shared_pause(timed: &leasehold_storage::azure::TimedMetadata) -> SharedPause {
    let m = &timed.metadata;
    let number = |key: &str| m.get(key).and_then(|v| v.parse::<u64>().ok());
    let left = match (number(PAUSE_MS), timed.last_modified, timed.answered_at) {
        // Resumed (or a pause of nothing).
        (Some(0), _, _) => Duration::ZERO,
        // Storage's clock both ends. `Last-Modified` is to the second, rounded down: a second
        // is added, so a pause read never ends before the one written (the writer's own would
        // otherwise be cut short by its next read). `Date` is rounded down too, so a read in
        // the second of the write would say a second more than the pause's length: never more.
        (Some(ms), Some(written), Some(now)) => {
            (written + Duration::from_secs(1) + Duration::from_millis(ms))
                .duration_since(now)
                .unwrap_or(Duration::ZERO)
                .min(Duration::from_millis(ms))
        }
        // Written by an earlier version: the writer's clock against ours.
        _ => {
            let until = number(PAUSED_UNTIL).unwrap_or(0);
            let now = unix_ms(SystemTime::now());
            Duration::from_millis(until.saturating_sub(now))
        }
    };
    SharedPause {
        left,
        set_at: timed.last_modified,
        limit: number(LIMIT).map(|l| l.min(u32::MAX as u64) as u32),
        resumed: m.contains_key(RESUMED),
    }
}

#[async_trait]
impl BudgetStore for AzureBudgets {
    async fn read(&self, name: &str) -> Result<Option<SharedPause>, StoreError> {
        let timed = self
            .container
            .metadata_with_clock(&format!("{BUDGET_PREFIX}{name}"), Op::BudgetRead)
            .await?;
        Ok(timed.as_ref().map(shared_pause))
    }

    async fn write(&self, name: &str, pause: Duration, limit: u32) -> Result<(), StoreError> {
        let blob = format!("{BUDGET_PREFIX}{name}");
        let metadata = HashMap::from([
            (PAUSE_MS.to_string(), pause.as_millis().to_string()),
            (
                PAUSED_UNTIL.to_string(),
                unix_ms(SystemTime::now() + pause).to_string(),
            ),
            (LIMIT.to_string(), limit.to_string()),
        ]);
        if self.put_metadata(name, &metadata).await? {
            return Ok(());
        }
        // The budget's first pause: create its blob (and the container, the first time), then
        // write.
        self.container.put_empty_if_absent(&blob, Op::BudgetWrite).await?;
        self.put_metadata(name, &metadata).await?;
        Ok(())
    }

    async fn resume(&self, name: &str) -> Result<bool, StoreError> {
        let was = self.read(name).await?;
        let Some(was) = was else {
            return Ok(false);
        };
        let mut metadata = HashMap::from([
            (PAUSE_MS.to_string(), "0".to_string()),
            (PAUSED_UNTIL.to_string(), "0".to_string()),
            (RESUMED.to_string(), unix_ms(SystemTime::now()).to_string()),
        ]);
        if let Some(limit) = was.limit {
            metadata.insert(LIMIT.to_string(), limit.to_string());
        }
        self.put_metadata(name, &metadata).await?;
        Ok(!was.left.is_zero())
    }

    async fn names(&self) -> Result<Vec<String>, StoreError> {
        let mut names = Vec::new();
        let mut marker: Option<String> = None;
        loop {
            let page = match self
                .container
                .list_page(BUDGET_PREFIX, marker.as_deref(), 5000)
                .await
            {
                Ok(page) => page,
                Err(e) if e.kind() == leasehold_storage::StoreErrorKind::NotFound => return Ok(names),
                Err(e) => return Err(e),
            };
            names.extend(
                page.blobs
                    .into_iter()
                    .filter_map(|b| b.name.strip_prefix(BUDGET_PREFIX).map(str::to_string)),
            );
            match page.next_marker {
                Some(next) => marker = Some(next),
                None => return Ok(names),
            }
        }
    }

    fn counters(&self) -> &OpCounters {
        self.container.counters()
    }
}

/// Budgets in memory, on the runtime's clock (paused in tests and the simulation), counting
/// round trips as [`AzureBudgets`] would once its blobs exist.
#[derive(Debug, Default)]
pub struct MemoryBudgets {
    paused: Mutex<HashMap<String, MemoryPause>>,
    counters: OpCounters,
}

#[derive(Debug, Clone, Copy)]
struct MemoryPause {
    until: Instant,
    limit: u32,
    resumed: bool,
}

impl MemoryBudgets {
    pub fn new() -> Self {
        Self::default()
    }

    /// A store that records into the given counters.
    pub fn with_counters(counters: OpCounters) -> Self {
        Self {
            paused: Mutex::default(),
            counters,
        }
    }

    /// When the budget's pause ends, as written (for tests).
    pub fn paused_until(&self, name: &str) -> Option<Instant> {
        self.paused
            .lock()
            .expect("budget mutex")
            .get(name)
            .map(|p| p.until)
    }

    /// Writes a pause ending at `until` as another worker, or a clock running ahead, would
    /// (for tests): no cap, no limit.
    pub fn set_paused_until(&self, name: &str, until: Instant) {
        self.paused.lock().expect("budget mutex").insert(
            name.to_string(),
            MemoryPause {
                until,
                limit: 0,
                resumed: false,
            },
        );
    }
}

#[async_trait]
impl BudgetStore for MemoryBudgets {
    async fn read(&self, name: &str) -> Result<Option<SharedPause>, StoreError> {
        self.counters.record(Op::BudgetRead);
        let now = Instant::now();
        Ok(self
            .paused
            .lock()
            .expect("budget mutex")
            .get(name)
            .map(|p| SharedPause {
                left: p.until.saturating_duration_since(now),
                set_at: None,
                limit: (p.limit > 0).then_some(p.limit),
                resumed: p.resumed,
            }))
    }

    async fn write(&self, name: &str, pause: Duration, limit: u32) -> Result<(), StoreError> {
        self.counters.record(Op::BudgetWrite);
        self.paused.lock().expect("budget mutex").insert(
            name.to_string(),
            MemoryPause {
                until: Instant::now() + pause,
                limit,
                resumed: false,
            },
        );
        Ok(())
    }

    async fn resume(&self, name: &str) -> Result<bool, StoreError> {
        self.counters.record(Op::BudgetRead);
        let now = Instant::now();
        let mut paused = self.paused.lock().expect("budget mutex");
        let Some(p) = paused.get_mut(name) else {
            return Ok(false);
        };
        self.counters.record(Op::BudgetWrite);
        let was = p.until > now;
        p.until = now;
        p.resumed = true;
        Ok(was)
    }

    async fn names(&self) -> Result<Vec<String>, StoreError> {
        let mut names: Vec<String> = self
            .paused
            .lock()
            .expect("budget mutex")
            .keys()
            .cloned()
            .collect();
        names.sort();
        Ok(names)
    }

    fn counters(&self) -> &OpCounters {
        &self.counters
    }
}
