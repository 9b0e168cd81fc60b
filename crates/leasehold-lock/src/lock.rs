//! [`LeaseLock`]: per-key locks on blob leases, with renewal, a lost-lease signal and fencing.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use leasehold_storage::{RetryOptions, StoreErrorKind, StoreResult};

use crate::error::{Error, Result};
use crate::key::LockKey;
use crate::store::{ETag, LeaseDuration, LeaseId, LeaseState, LeaseStore, Metadata};

/// Metadata name of the fencing generation a lock blob's metadata records: the generation of a
/// block lock blob (made before fencing moved to the page blob's sequence number), and on a page
/// blob the grant its holder and time belong to.
pub const META_GENERATION: &str = "leasehold_generation";
/// Metadata name of the holder's description (host, process).
pub const META_HOLDER: &str = "leasehold_holder";
/// Metadata name of the grant time, milliseconds since the Unix epoch.
pub const META_SINCE: &str = "leasehold_since";
/// Metadata name of the member list of a shared hold.
pub const META_SHARERS: &str = "leasehold_sharers";
/// Metadata name of the shared lease id the member list belongs to.
pub const META_SHARE_GROUP: &str = "leasehold_share_group";
/// Metadata name of the fencing generation the shared hold's session was granted (the token its
/// members share). A joiner inherits the session's token only while the generation is still
/// this one.
pub const META_SHARE_GENERATION: &str = "leasehold_share_generation";

/// Prefix of lock blob names inside the container.
pub const LOCK_PREFIX: &str = "locks/";
/// Prefix of the metadata names that hold holders' notes ([`LeaseGuard::note`]).
pub const META_NOTE_PREFIX: &str = "leasehold_note_";

/// How locks are held.
#[derive(Debug, Clone)]
pub struct LeaseOptions {
    /// Lease duration asked of storage. Default 30 s: a dead holder blocks its key for at most
    /// this long, and renewal every 10 s leaves two more tries before expiry.
    pub duration: LeaseDuration,
    /// How often the guard renews. Default 10 s (a third of the duration).
    pub renew_every: Duration,
    /// The guard declares the lease lost this long before storage could let it expire
    /// (measured from when the last successful renewal was *sent*). The margin must cover
    /// stopping the work done under the lock (a runner's stop grace) plus clock-rate
    /// differences between this machine and storage: work must be dead before storage can
    /// grant the lease to anyone else. Default 10 s (a third of the duration).
    pub safety_margin: Duration,
    /// Take a fencing token on every grant: one more round trip (an increment of the lock
    /// blob's sequence number). Default on.
    pub fencing: bool,
    /// Retrying of transient storage failures.
    pub retry: RetryOptions,
    /// Who holds: written to the lock blob (with fencing, once the lease has been renewed) for
    /// operators. Default `host:pid`.
    pub holder: String,
}

impl Default for LeaseOptions {
    fn default() -> Self {
        Self {
            duration: LeaseDuration::default(),
            renew_every: Duration::from_secs(10),
            safety_margin: Duration::from_secs(10),
            fencing: true,
            retry: RetryOptions::default(),
            holder: default_holder(),
        }
    }
}

impl LeaseOptions {
    /// Options for a lease of `duration`, renewed every third of it and declared lost a third
    /// of it before storage could let it expire (the defaults, scaled).
    pub fn with_duration(duration: LeaseDuration) -> Self {
        let third = duration.as_duration() / 3;
        Self {
            duration,
            renew_every: third,
            safety_margin: third,
            ..Self::default()
        }
    }

    /// Checks the renewal interval and safety margin against the duration.
    pub fn validate(&self) -> Result<()> {
        if self.renew_every.is_zero() || self.renew_every + self.safety_margin >= self.duration.as_duration()
        {
            return Err(Error::Config(format!(
                "renew interval {:?} plus safety margin {:?} must be shorter than the lease duration {:?}",
                self.renew_every, self.safety_margin, self.duration
            )));
        }
        Ok(())
    }
}

fn default_holder() -> String {
    let host = std::env::var("HOSTNAME")
        .or_else(|_| std::env::var("COMPUTERNAME"))
        .or_else(|_| std::fs::read_to_string("/etc/hostname").map(|s| s.trim().to_string()))
        .unwrap_or_else(|_| "unknown-host".into());
    format!("{host}:{}", std::process::id())
}

fn unix_millis_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The blob that carries the lease for `key`.
pub fn lock_blob_name(key: &LockKey) -> String {
    format!("{LOCK_PREFIX}{key}")
}

/// What [`LeaseLock::inspect`] finds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockInfo {
    pub key: LockKey,
    /// Whether a lease is active now.
    pub held: bool,
    /// The lease state as storage reports it (`None`: the key was never used).
    pub state: Option<LeaseState>,
    /// Who holds (or last held) the key, as the last fenced grant recorded it. A grant records
    /// it once its lease has been renewed, so a hold shorter than the renewal interval shows
    /// none (a shared hold's founder records it at once).
    pub holder: Option<String>,
    /// Time of the last fenced grant, recorded with the holder.
    pub since: Option<SystemTime>,
    /// The last fencing token granted (0 if none yet).
    pub generation: u64,
    /// Members of a shared hold.
    pub sharers: Vec<String>,
    /// Holders' notes ([`LeaseGuard::write_notes`]), by name (without their prefix).
    pub notes: Metadata,
}

/// Per-key locks on blob leases in one store. Cheap to clone.
#[derive(Debug, Clone)]
pub struct LeaseLock {
    store: Arc<dyn LeaseStore>,
    options: Arc<LeaseOptions>,
}

impl LeaseLock {
    /// A lock manager on `store`. Fails if the options break Azure's limits.
    pub fn new(store: Arc<dyn LeaseStore>, options: LeaseOptions) -> Result<Self> {
        options.validate()?;
        Ok(Self {
            store,
            options: Arc::new(options),
        })
    }

    pub fn store(&self) -> &Arc<dyn LeaseStore> {
        &self.store
    }

    pub fn options(&self) -> &LeaseOptions {
        &self.options
    }

    /// Tries once to take `key`: `Ok(None)` if someone else holds it. Creates the lock blob (and
    /// container) on first use. Round trips when free: 1 (2 with fencing); when held: 1.
    ///
    /// A break of a lease with the caller's own id (an earlier acquire with that id that took
    /// effect after the caller gave up on it) answers with an error of kind
    /// [`StoreErrorKind::LeaseBreaking`]: neither held by someone else nor free; try again once
    /// the break is over.
    pub async fn try_acquire(&self, key: &LockKey) -> Result<Option<LeaseGuard>> {
        self.try_acquire_as(key, LeaseId::random()).await
    }

    /// [`try_acquire`](Self::try_acquire) proposing a lease id of the caller's choosing. Storage
    /// grants (and renews) a lease to whoever presents the active id, so ids must be unique per
    /// holder.
    pub async fn try_acquire_as(&self, key: &LockKey, lease: LeaseId) -> Result<Option<LeaseGuard>> {
        let blob = lock_blob_name(key);
        let sent = Instant::now();
        if !self.acquire_creating(&blob, lease).await? {
            return Ok(None);
        }
        // The lease is ours from here: renew it from this moment, so a slow fencing write cannot
        // outlive it unnoticed.
        let mut guard = LeaseGuard::start(self, key.clone(), blob, lease, None, sent, None);
        if self.options.fencing {
            match self.fence(&guard.blob, lease).await {
                Ok(token) => {
                    guard.fencing = Some(token);
                    guard.record_holder_once_renewed(token);
                }
                Err(e) => {
                    // Whether the lease ran out meanwhile (412) or storage failed, the grant did
                    // not complete: an error, never "held by someone else" — a caller told
                    // "held" would rely on a holder that does not exist.
                    let _ = guard.release().await;
                    return Err(match e {
                        Error::Storage(s) if s.kind() == StoreErrorKind::LeaseLost => lease_lost(key),
                        other => other,
                    });
                }
            }
        }
        tracing::debug!(%key, %lease, fencing = ?guard.fencing, "lease acquired");
        Ok(Some(guard))
    }

    /// Waits up to `timeout` for `key`, trying again after jittered, growing pauses (50 ms to
    /// 2 s). `Err(Error::Timeout)` if it stays held.
    pub async fn acquire(&self, key: &LockKey, timeout: Duration) -> Result<LeaseGuard> {
        let deadline = Instant::now() + timeout;
        let mut pauses = wait_backoff(&self.options.retry);
        loop {
            match self.try_acquire(key).await {
                Ok(Some(guard)) => return Ok(guard),
                Ok(None) => {}
                Err(Error::Storage(e)) if e.kind() == StoreErrorKind::LeaseBreaking => {}
                Err(e) => return Err(e),
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    key: key.to_string(),
                    waited: timeout,
                });
            }
            let pause = pauses.next().unwrap_or(Duration::from_secs(2));
            sleep_until((now + pause).min(deadline)).await;
        }
    }

    /// Takes all `keys` or none: tries them once each in sorted order (so two callers never
    /// deadlock) and releases what it took if any is held. `Ok(None)` if any was held.
    pub async fn try_acquire_many(&self, keys: &[LockKey]) -> Result<Option<MultiGuard>> {
        let mut keys = keys.to_vec();
        keys.sort();
        keys.dedup();
        let mut taken = Vec::with_capacity(keys.len());
        for key in &keys {
            match self.try_acquire(key).await {
                Ok(Some(guard)) => taken.push(guard),
                outcome => {
                    release_all(taken).await;
                    return outcome.map(|_| None);
                }
            }
        }
        Ok(Some(MultiGuard::new(taken)))
    }

    /// Waits up to `timeout` to take all `keys` at once (see [`try_acquire_many`](Self::try_acquire_many)).
    pub async fn acquire_many(&self, keys: &[LockKey], timeout: Duration) -> Result<MultiGuard> {
        let deadline = Instant::now() + timeout;
        let mut pauses = wait_backoff(&self.options.retry);
        loop {
            if let Some(guard) = self.try_acquire_many(keys).await? {
                return Ok(guard);
            }
            let now = Instant::now();
            if now >= deadline {
                let key = keys.iter().map(LockKey::as_str).collect::<Vec<_>>().join(", ");
                return Err(Error::Timeout { key, waited: timeout });
            }
            let pause = pauses.next().unwrap_or(Duration::from_secs(2));
            sleep_until((now + pause).min(deadline)).await;
        }
    }

    /// Holds `key` together with every other caller presenting the same `share_key` (the unlock
    /// key of a `TryLock(lockKey, unlockKey, duration)` API). The key is free again when the last
    /// member releases, or when the lease lapses because no member renews it. A member's release
    /// never frees the key under another member. `Ok(None)` if a holder with another share key
    /// (or an exclusive holder) has it.
    pub async fn try_acquire_shared(&self, key: &LockKey, share_key: &str) -> Result<Option<LeaseGuard>> {
        crate::shared::join(self, key, share_key).await
    }

    /// Ends whatever lease is on `key`, for operators, safely: nobody can renew it from now on,
    /// so its holder's guard fires `lost` at its next renewal and the work stops, and nobody can
    /// acquire it until the time it had left has passed (at most the lease duration) — so the
    /// broken holder's work is gone before anyone else starts. The reason is logged.
    pub async fn break_lock(&self, key: &LockKey, reason: &str) -> Result<()> {
        self.break_lock_after(key, reason, self.options.duration.as_duration())
            .await
    }

    /// [`break_lock`](Self::break_lock) with the key free again after `period` at most
    /// (zero: at once). Only for a holder known to be dead: a live one may still be working
    /// when the next holder starts.
    pub async fn break_lock_after(&self, key: &LockKey, reason: &str, period: Duration) -> Result<()> {
        let blob = lock_blob_name(key);
        tracing::warn!(%key, reason, ?period, "breaking lease");
        match self
            .retry("break lease", || self.store.break_lease(&blob, period))
            .await
        {
            Err(e) if e.kind() == StoreErrorKind::NotFound => Ok(()),
            other => other.map_err(Error::from),
        }
    }

    /// Whether `key` is held, by whom and since when, and its last fencing generation. One round trip.
    pub async fn inspect(&self, key: &LockKey) -> Result<LockInfo> {
        let blob = lock_blob_name(key);
        match self.retry("inspect", || self.store.properties(&blob)).await {
            Ok(props) => {
                let recorded = RecordedHold::of(&props.metadata, props.sequence);
                Ok(LockInfo {
                    key: key.clone(),
                    held: props.lease_state.is_held(),
                    state: Some(props.lease_state),
                    holder: recorded.holder,
                    since: recorded.since,
                    generation: recorded.generation,
                    sharers: crate::shared::live_members(&props.metadata, recorded.generation),
                    notes: notes_of(&props.metadata),
                })
            }
            Err(e) if e.kind() == StoreErrorKind::NotFound => Ok(LockInfo {
                key: key.clone(),
                held: false,
                state: None,
                holder: None,
                since: None,
                generation: 0,
                sharers: Vec::new(),
                notes: Metadata::new(),
            }),
            Err(e) => Err(e.into()),
        }
    }

    pub(crate) async fn retry<T, F, Fut>(&self, what: &str, attempt: F) -> StoreResult<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = StoreResult<T>>,
    {
        self.options.retry.run(what, attempt).await
    }

    /// Acquires with `lease`, creating the blob on first use. `false` when someone else holds it.
    pub(crate) async fn acquire_creating(&self, blob: &str, lease: LeaseId) -> Result<bool> {
        let duration = self.options.duration;
        let acquire = || self.store.acquire_lease(blob, lease, duration);
        match self.retry("acquire lease", acquire).await {
            Ok(()) => return Ok(true),
            Err(e) if e.kind() == StoreErrorKind::LeaseAlreadyPresent => return Ok(false),
            Err(e) if e.kind() == StoreErrorKind::NotFound => {}
            Err(e) => return Err(e.into()),
        }
        // First use of this key: create the blob (and container); losing that race is fine.
        self.retry("create lock blob", || self.store.create_blob(blob))
            .await?;
        match self.retry("acquire lease", acquire).await {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == StoreErrorKind::LeaseAlreadyPresent => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Takes the next fencing token of `blob`, held with `lease`: one increment of the page
    /// blob's sequence number, which storage does only for the lease holder and answers with
    /// the new value, so tokens strictly increase per key. A retry after a lost answer skips a
    /// number, which fencing does not mind (a downstream only compares tokens).
    ///
    /// A lock blob made before fencing moved to the sequence number (a block blob, with the
    /// generation in its metadata) is first replaced, under the lease, by a page blob at that
    /// generation ([`move_to_page_blob`](Self::move_to_page_blob)).
    ///
    /// The grant writes nothing else: the holder's name and the grant time are written once
    /// the lease has been renewed ([`LeaseGuard::record_holder_once_renewed`]), and what a
    /// shared hold left behind shows itself as over, since its generation is no longer the
    /// blob's (see `shared.rs`).
    pub(crate) async fn fence(&self, blob: &str, lease: LeaseId) -> Result<u64> {
        for _ in 0..3 {
            let increment = || self.store.increment_sequence(blob, lease, None);
            match self.retry("take fencing token", increment).await? {
                Some((token, _)) => return Ok(token),
                None => drop(self.move_to_page_blob(blob, lease, None).await?),
            }
        }
        Err(leasehold_storage::StoreError::new(
            StoreErrorKind::Rejected,
            leasehold_storage::Op::BlobSequenceIncrement,
            format!("lock blob {blob} stays a block blob after being replaced by a page blob"),
        )
        .into())
    }

    /// Replaces a block lock blob, under `lease`, by a zero-length page blob whose sequence
    /// number is the generation the block blob's metadata recorded, keeping the metadata (notes
    /// and all): the next token is one more than the last one granted. Only the lease holder
    /// can write the blob, so nobody grants a token in between. Nothing to do if the blob is a
    /// page blob already (an earlier attempt whose answer was lost). `if_match`: the ETag the
    /// caller read the block blob at, if it must not have changed since. The new ETag if this
    /// call replaced the blob; `None` if it found it changed (a page blob already, or written
    /// since the caller's read): look again.
    pub(crate) async fn move_to_page_blob(
        &self,
        blob: &str,
        lease: LeaseId,
        if_match: Option<&ETag>,
    ) -> Result<Option<ETag>> {
        let props = self
            .retry("read fencing generation", || self.store.properties(blob))
            .await?;
        if props.sequence.is_some() || if_match.is_some_and(|tag| *tag != props.etag) {
            return Ok(None);
        }
        let generation = generation_of(&props.metadata);
        let replace = || {
            self.store
                .replace_with_page_blob(blob, lease, Some(&props.etag), generation, &props.metadata)
        };
        match self.retry("move lock blob to a page blob", replace).await {
            Ok(etag) => {
                tracing::info!(%blob, generation, "lock blob moved to a page blob: its fencing generation is now its sequence number");
                Ok(Some(etag))
            }
            // Changed since the read: by an attempt of ours whose answer was lost, or by a
            // member of a shared hold (the lease holders).
            Err(e) if e.kind() == StoreErrorKind::ConditionNotMet => Ok(None),
            Err(e) => Err(e.into()),
        }
    }
}

/// What a lock blob says of its last grant: for [`LeaseLock::inspect`], and for tools that list
/// lock blobs (a listing shows each blob's metadata and sequence number).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedHold {
    /// The last fencing token granted (0 if none yet).
    pub generation: u64,
    /// Who holds (or last held) it, if its grant recorded itself.
    pub holder: Option<String>,
    /// When that grant was made, if it recorded itself.
    pub since: Option<SystemTime>,
}

impl RecordedHold {
    /// From a lock blob's metadata and, for a page blob, its sequence number. A grant records
    /// its holder and time after its first renewal, naming its generation: a record naming an
    /// earlier one belongs to an earlier grant and is not shown.
    pub fn of(metadata: &Metadata, sequence: Option<u64>) -> Self {
        let generation = sequence.unwrap_or_else(|| generation_of(metadata));
        let recorded = generation_of(metadata) == generation;
        Self {
            generation,
            holder: metadata.get(META_HOLDER).filter(|_| recorded).cloned(),
            since: metadata
                .get(META_SINCE)
                .filter(|_| recorded)
                .and_then(|v| v.parse::<u64>().ok())
                .map(|ms| UNIX_EPOCH + Duration::from_millis(ms)),
        }
    }
}

/// The notes in a lock blob's metadata, by name without [`META_NOTE_PREFIX`].
pub(crate) fn notes_of(metadata: &Metadata) -> Metadata {
    metadata
        .iter()
        .filter_map(|(k, v)| Some((k.strip_prefix(META_NOTE_PREFIX)?.to_string(), v.clone())))
        .collect()
}

pub(crate) fn generation_of(metadata: &Metadata) -> u64 {
    metadata
        .get(META_GENERATION)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

pub(crate) fn holder_metadata(options: &LeaseOptions, metadata: &mut Metadata) {
    metadata.insert(META_HOLDER.into(), options.holder.clone());
    metadata.insert(META_SINCE.into(), unix_millis_now().to_string());
}

fn wait_backoff(retry: &RetryOptions) -> impl Iterator<Item = Duration> {
    use backon::BackoffBuilder;
    let mut b = backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(50))
        .with_max_delay(Duration::from_secs(2))
        .without_max_times()
        .with_jitter();
    if let Some(seed) = retry.jitter_seed {
        b = b.with_jitter_seed(seed);
    }
    b.build()
}

async fn release_all(guards: Vec<LeaseGuard>) {
    for guard in guards.into_iter().rev() {
        if let Err(e) = guard.release().await {
            tracing::warn!(error = %e, "releasing a partly acquired key set");
        }
    }
}

/// A held lease. Renews itself in the background; fires [`lost`](Self::lost) when it cannot be
/// sure it still holds the lease; releases on [`release`](Self::release) or, best effort, on drop.
#[derive(Debug)]
pub struct LeaseGuard {
    key: LockKey,
    blob: String,
    lease: LeaseId,
    fencing: Option<u64>,
    lost: CancellationToken,
    stop: CancellationToken,
    renewed: watch::Receiver<Instant>,
    renewer: Option<JoinHandle<()>>,
    lock: LeaseLock,
    member: Option<String>,
    done: bool,
    /// The lock blob's metadata, read the first time a note is asked for and kept in step with
    /// what this holder writes since.
    metadata: MetadataCell,
    /// Fires at the first successful renewal (a one-shot, which wakes its one waiter at once:
    /// the renewals' watch channel wakes its waiters in no fixed order).
    first_renewal: Option<oneshot::Receiver<()>>,
    /// What the renew loop runs before each renewal ([`Self::before_each_renewal`]).
    before_renewal: BeforeSlot,
    /// Writes the holder's name once the lease has been renewed (fencing on, exclusive holds).
    recorder: Option<AbortOnDropHandle<()>>,
}

/// The metadata of a held lock blob, read at most once and written only under the lease, one
/// change at a time (notes, the holder's name).
#[derive(Debug, Clone)]
struct MetadataCell {
    lock: LeaseLock,
    key: LockKey,
    blob: String,
    lease: LeaseId,
    cache: Arc<tokio::sync::Mutex<Option<Metadata>>>,
}

impl MetadataCell {
    /// The metadata in `cache`, read from the blob if it is not there yet. Only lease holders
    /// write the blob, so what was read stays true while we hold.
    async fn load<'a>(&self, cache: &'a mut Option<Metadata>) -> Result<&'a mut Metadata> {
        if cache.is_none() {
            let props = self
                .lock
                .retry("read lock notes", || self.lock.store.properties(&self.blob))
                .await?;
            *cache = Some(props.metadata);
        }
        Ok(cache.as_mut().expect("filled above"))
    }

    async fn read(&self) -> Result<Metadata> {
        let mut cache = self.cache.lock().await;
        self.load(&mut cache).await.cloned()
    }

    /// Applies `change` to the metadata in one write under the lease (retried on transient
    /// failures): a write that comes late cannot land under a later holder (`LeaseLost`).
    async fn change(&self, what: &str, change: impl FnOnce(&mut Metadata)) -> Result<()> {
        let mut cache = self.cache.lock().await;
        let mut metadata = self.load(&mut cache).await?.clone();
        change(&mut metadata);
        let write = || {
            self.lock
                .store
                .set_metadata(&self.blob, Some(self.lease), None, &metadata)
        };
        match self.lock.retry(what, write).await {
            Ok(_) => {
                *cache = Some(metadata);
                Ok(())
            }
            Err(e) if e.kind() == StoreErrorKind::LeaseLost => Err(lease_lost(&self.key)),
            Err(e) => Err(e.into()),
        }
    }
}

impl LeaseGuard {
    pub(crate) fn start(
        lock: &LeaseLock,
        key: LockKey,
        blob: String,
        lease: LeaseId,
        fencing: Option<u64>,
        granted_at: Instant,
        member: Option<String>,
    ) -> Self {
        let lost = CancellationToken::new();
        let stop = CancellationToken::new();
        let (renewed_tx, renewed) = watch::channel(granted_at);
        let (first_renewal_tx, first_renewal) = oneshot::channel();
        let before_renewal = BeforeSlot::default();
        let renewer = tokio::spawn(renew_loop(
            lock.store.clone(),
            blob.clone(),
            lease,
            lock.options.clone(),
            granted_at,
            lost.clone(),
            stop.clone(),
            Renewed {
                every: renewed_tx,
                first: Some(first_renewal_tx),
                before: before_renewal.clone(),
            },
        ));
        let metadata = MetadataCell {
            lock: lock.clone(),
            key: key.clone(),
            blob: blob.clone(),
            lease,
            cache: Arc::default(),
        };
        Self {
            key,
            blob,
            lease,
            fencing,
            lost,
            stop,
            renewed,
            renewer: Some(renewer),
            lock: lock.clone(),
            member,
            done: false,
            metadata,
            first_renewal: Some(first_renewal),
            before_renewal,
            recorder: None,
        }
    }

    /// Once the lease has been renewed (so only for holds longer than the renewal interval),
    /// writes who holds it, since when and with which token, for operators (`inspect`), and
    /// drops what a shared hold left behind. Left out of the grant to keep it at two round
    /// trips; a short hold is never recorded. Stops with the hold.
    pub(crate) fn record_holder_once_renewed(&mut self, token: u64) {
        let Some(renewed) = self.first_renewal.take() else {
            return;
        };
        let metadata = self.metadata.clone();
        let since = unix_millis_now();
        let task = async move {
            if renewed.await.is_err() {
                return;
            }
            let holder = metadata.lock.options.holder.clone();
            let written = metadata
                .change("record lock holder", |md| {
                    for shared in [META_SHARERS, META_SHARE_GROUP, META_SHARE_GENERATION] {
                        md.remove(shared);
                    }
                    md.insert(META_GENERATION.into(), token.to_string());
                    md.insert(META_HOLDER.into(), holder);
                    md.insert(META_SINCE.into(), since.to_string());
                })
                .await;
            if let Err(e) = written {
                tracing::debug!(key = %metadata.key, error = %e, "could not record the lock's holder");
            }
        };
        self.recorder = Some(AbortOnDropHandle::new(tokio::spawn(task)));
    }

    pub fn key(&self) -> &LockKey {
        &self.key
    }

    pub fn lease_id(&self) -> LeaseId {
        self.lease
    }

    /// The fencing token of this grant (`None` when fencing is off). Strictly greater than every
    /// token granted before for this key; pass it to downstream writes so they can refuse a
    /// stale holder.
    pub fn fencing_token(&self) -> Option<u64> {
        self.fencing
    }

    /// Fires when the lease is lost: a renewal was refused definitively, or no renewal succeeded
    /// in time. Work done under the lock must stop when it fires.
    pub fn lost(&self) -> CancellationToken {
        self.lost.clone()
    }

    pub fn is_lost(&self) -> bool {
        self.lost.is_cancelled()
    }

    /// Changes each time a renewal succeeds, to the instant that renewal was sent (storage
    /// extended the lease to at least that instant plus the duration). For work that must keep
    /// something else in step with the lease, such as a watchdog message's visibility.
    pub fn renewals(&self) -> watch::Receiver<Instant> {
        self.renewed.clone()
    }

    /// Runs `work` just before each renewal is sent (and before a retry of one, once a second has
    /// passed since it last ran), started a quarter of a second early and for at
    /// most a fifth of the renewal interval and 2 s (the renewal then goes out anyway). For something that must
    /// outlast the lease by a fixed margin if the holder dies, such as a carrier message's
    /// visibility: pushed just *before* each renewal, it is never behind the lease by more than
    /// the push's own flight, whenever the holder dies; pushed after each renewal (with
    /// [`renewals`](Self::renewals)), a death between a renewal and its push leaves it a whole
    /// renewal interval behind. Replaces any work set before.
    pub fn before_each_renewal(&self, work: BeforeRenewal) {
        self.before_renewal.set(work);
    }

    /// A note on the key, as the last holder to write it left it (or as this holder wrote it
    /// since). Notes are small texts a holder leaves for the key's next holders (how many runs
    /// in a row were cut short, say). The first call reads them (one round trip); later ones
    /// answer from what was read. Not kept on shared holds (`Config` error).
    pub async fn note(&self, name: &str) -> Result<Option<String>> {
        self.refuse_shared()?;
        Ok(self
            .metadata
            .read()
            .await?
            .remove(&format!("{META_NOTE_PREFIX}{name}")))
    }

    /// Sets (`Some`) or removes (`None`) notes, in one write under this lease (retried on
    /// transient failures; read first if no note was read yet): it lands only while this holder
    /// holds the lease, so a write that comes late can never change a later holder's notes
    /// (`LeaseLost`). Names are letters, digits and `_`; values plain ASCII text. Not kept on
    /// shared holds (`Config` error).
    pub async fn write_notes(&self, changes: &[(&str, Option<String>)]) -> Result<()> {
        self.refuse_shared()?;
        self.metadata
            .change("write notes", |metadata| {
                for (name, value) in changes {
                    let key = format!("{META_NOTE_PREFIX}{name}");
                    match value {
                        Some(v) => metadata.insert(key, v.clone()),
                        None => metadata.remove(&key),
                    };
                }
            })
            .await
    }

    /// The members of a shared hold write its metadata with `If-Match` only; a note written
    /// without would race their member list.
    fn refuse_shared(&self) -> Result<()> {
        match self.member {
            Some(_) => Err(Error::Config("notes are not kept on a shared hold".into())),
            None => Ok(()),
        }
    }

    /// Stops renewing and releases the lease. A lease that was already lost is not an error.
    pub async fn release(mut self) -> Result<()> {
        self.done = true;
        self.recorder.take();
        self.stop_renewing().await;
        if let Some(member) = self.member.take() {
            return crate::shared::leave(&self.lock, &self.blob, self.lease, &member).await;
        }
        release_lease(&self.lock, &self.key, &self.blob, self.lease, None).await
    }

    /// Stops renewing without releasing: the lease lapses after its duration. This is what a
    /// crashed process leaves behind; tests and simulations use it.
    pub fn abandon(mut self) {
        self.done = true;
        self.stop.cancel();
        if let Some(renewer) = self.renewer.take() {
            renewer.abort();
        }
    }

    async fn stop_renewing(&mut self) {
        self.stop.cancel();
        if let Some(renewer) = self.renewer.take() {
            let _ = renewer.await;
        }
    }
}

pub(crate) async fn release_lease(
    lock: &LeaseLock,
    key: &LockKey,
    blob: &str,
    lease: LeaseId,
    if_match: Option<&ETag>,
) -> Result<()> {
    match lock
        .retry("release lease", || {
            lock.store.release_lease(blob, lease, if_match)
        })
        .await
    {
        Ok(()) => {
            tracing::debug!(%key, %lease, "lease released");
            Ok(())
        }
        // Already gone (expired and taken, broken, or an earlier attempt succeeded and its
        // answer was lost): nothing of ours is left to release.
        Err(e) if e.kind() == StoreErrorKind::LeaseLost => {
            tracing::debug!(%key, %lease, "lease was already gone at release");
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        self.stop.cancel();
        if let Some(renewer) = self.renewer.take() {
            renewer.abort();
        }
        // Best effort: hand the release to the runtime if there still is one.
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            let lock = self.lock.clone();
            let (key, blob, lease, member) = (
                self.key.clone(),
                self.blob.clone(),
                self.lease,
                self.member.take(),
            );
            handle.spawn(async move {
                let result = match member {
                    Some(member) => crate::shared::leave(&lock, &blob, lease, &member).await,
                    None => release_lease(&lock, &key, &blob, lease, None).await,
                };
                if let Err(e) = result {
                    tracing::warn!(%key, error = %e, "release on drop failed; the lease will lapse");
                }
            });
        }
    }
}

/// Where the renew loop tells of its renewals: every one, and the first once; and what it runs
/// before each.
struct Renewed {
    every: watch::Sender<Instant>,
    first: Option<oneshot::Sender<()>>,
    before: BeforeSlot,
}

/// Where a guard keeps its [`BeforeRenewal`] work, shared with its renew loop.
#[derive(Clone, Default)]
struct BeforeSlot(Arc<std::sync::Mutex<Option<BeforeRenewal>>>);

impl BeforeSlot {
    fn get(&self) -> Option<BeforeRenewal> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn set(&self, work: BeforeRenewal) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(work);
    }
}

impl fmt::Debug for BeforeSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.get().is_some() {
            "BeforeSlot(set)"
        } else {
            "BeforeSlot(empty)"
        })
    }
}

/// How early the renew loop starts a holder's [`BeforeRenewal`] work (at most a tenth of the
/// renewal interval): the renewal then goes out about when it would without it.
const BEFORE_RENEWAL_LEAD: Duration = Duration::from_millis(250);

/// How long after it last ran a holder's [`BeforeRenewal`] work runs again before a retried
/// renewal.
const BEFORE_RENEWAL_AGAIN: Duration = Duration::from_secs(1);

/// Work a holder runs just before each renewal of its lease is sent
/// ([`LeaseGuard::before_each_renewal`]).
pub type BeforeRenewal =
    Arc<dyn Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> + Send + Sync>;

#[allow(clippy::too_many_arguments)]
/// Renews every `renew_every`; declares the lease lost on a definitive refusal or when the local
/// deadline (last renewal sent + duration − safety margin) passes without a success.
async fn renew_loop(
    store: Arc<dyn LeaseStore>,
    blob: String,
    lease: LeaseId,
    options: Arc<LeaseOptions>,
    granted_at: Instant,
    lost: CancellationToken,
    stop: CancellationToken,
    mut renewed: Renewed,
) {
    let valid_for = options.duration.as_duration() - options.safety_margin;
    let mut deadline = granted_at + valid_for;
    let mut next = granted_at + options.renew_every;
    let mut failures = 0u32;
    let mut last_before: Option<Instant> = None;
    loop {
        // Wake a little early: work to run before the renewal (read after the sleep, so work
        // set after the grant runs before the first renewal too) then still lets the renewal go
        // out about on time.
        let lead = BEFORE_RENEWAL_LEAD.min(options.renew_every / 10);
        tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            _ = sleep_until(deadline) => break,
            _ = sleep_until(next - lead) => {}
        }
        // Before a retry only if the work last ran a second ago or more: it keeps pace with the
        // lease (within its margin) without a request more for each quick retry.
        let due = last_before.is_none_or(|at: Instant| at.elapsed() >= BEFORE_RENEWAL_AGAIN);
        match renewed.before.get().filter(|_| due) {
            Some(before) => {
                last_before = Some(Instant::now());
                // Bounded: the renewal goes out whatever the work does.
                let limit = (options.renew_every / 5).min(Duration::from_secs(2));
                tokio::select! {
                    biased;
                    _ = stop.cancelled() => return,
                    _ = sleep_until(deadline) => break,
                    _ = tokio::time::timeout(limit, before()) => {}
                }
            }
            None => tokio::select! {
                biased;
                _ = stop.cancelled() => return,
                _ = sleep_until(deadline) => break,
                _ = sleep_until(next) => {}
            },
        }
        let sent = Instant::now();
        let outcome = tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            _ = sleep_until(deadline) => break,
            r = store.renew_lease(&blob, lease) => r,
        };
        match outcome {
            Ok(()) => {
                failures = 0;
                deadline = sent + valid_for;
                next = sent + options.renew_every;
                renewed.every.send_replace(sent);
                if let Some(first) = renewed.first.take() {
                    let _ = first.send(());
                }
            }
            Err(e) if e.is_transient() => {
                failures += 1;
                tracing::warn!(%blob, error = %e, failures, "lease renewal failed; trying again");
                let pause = options.retry.min_delay * 2u32.saturating_pow(failures.min(4));
                next = Instant::now() + pause.min(options.retry.max_delay);
            }
            Err(e) => {
                tracing::warn!(%blob, error = %e, "lease renewal refused: lease lost");
                lost.cancel();
                return;
            }
        }
    }
    tracing::warn!(%blob, "no lease renewal succeeded in time: lease treated as lost");
    lost.cancel();
}

/// Several keys held together (from [`LeaseLock::try_acquire_many`]). Dropped without
/// [`release`](Self::release), each key is released in the background, as a dropped
/// [`LeaseGuard`] is.
#[derive(Debug)]
pub struct MultiGuard {
    guards: Vec<LeaseGuard>,
    lost: CancellationToken,
    /// Fires `lost` when a guard's does. Aborted when the hold ends: a dropped guard's `lost`
    /// never fires, so the watcher would otherwise wait for ever.
    watcher: AbortOnDropHandle<()>,
}

impl MultiGuard {
    fn new(guards: Vec<LeaseGuard>) -> Self {
        let lost = CancellationToken::new();
        let tokens: Vec<_> = guards.iter().map(LeaseGuard::lost).collect();
        let combined = lost.clone();
        let watcher = AbortOnDropHandle::new(tokio::spawn(async move {
            let any = tokens.iter().map(|t| Box::pin(t.cancelled()));
            if tokens.is_empty() {
                return;
            }
            futures_select_all(any.collect()).await;
            combined.cancel();
        }));
        Self {
            guards,
            lost,
            watcher,
        }
    }

    /// The guards, in key order.
    pub fn guards(&self) -> &[LeaseGuard] {
        &self.guards
    }

    /// Fires when any of the leases is lost.
    pub fn lost(&self) -> CancellationToken {
        self.lost.clone()
    }

    /// Releases every key (in reverse order); reports the first failure after trying them all.
    pub async fn release(self) -> Result<()> {
        self.watcher.abort();
        let mut first_err = None;
        for guard in self.guards.into_iter().rev() {
            if let Err(e) = guard.release().await {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

/// Waits for the first of several futures.
async fn futures_select_all<F: std::future::Future<Output = ()> + Unpin>(mut futures: Vec<F>) {
    std::future::poll_fn(|cx| {
        for f in futures.iter_mut() {
            if std::pin::Pin::new(f).poll(cx).is_ready() {
                return std::task::Poll::Ready(());
            }
        }
        std::task::Poll::Pending
    })
    .await
}

pub(crate) fn lease_lost(key: &LockKey) -> Error {
    Error::LeaseLost { key: key.to_string() }
}
