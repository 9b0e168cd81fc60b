//! [`LeaseLock`]: per-key locks on blob leases, with renewal, a lost-lease signal and fencing.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use leasehold_storage::{RetryOptions, StoreErrorKind, StoreResult};

use crate::error::{Error, Result};
use crate::key::LockKey;
use crate::store::{ETag, LeaseDuration, LeaseId, LeaseState, LeaseStore, Metadata};

/// Metadata name of the fencing generation on a lock blob.
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
    /// Write a fencing generation on every grant (2 extra round trips). Default on.
    pub fencing: bool,
    /// Retrying of transient storage failures.
    pub retry: RetryOptions,
    /// Who holds: written to the lock blob (with fencing) for operators. Default `host:pid`.
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
    /// Holder written at the last fenced grant.
    pub holder: Option<String>,
    /// Time of the last fenced grant.
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
    /// container) on first use. Round trips when free: 1 (3 with fencing); when held: 1.
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
            match self.bump_generation(&guard.blob, lease).await {
                Ok((token, metadata)) => {
                    guard.fencing = Some(token);
                    guard.metadata = std::sync::Mutex::new(Some(metadata));
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
                let since = props
                    .metadata
                    .get(META_SINCE)
                    .and_then(|v| v.parse::<u64>().ok())
                    .map(|ms| UNIX_EPOCH + Duration::from_millis(ms));
                Ok(LockInfo {
                    key: key.clone(),
                    held: props.lease_state.is_held(),
                    state: Some(props.lease_state),
                    holder: props.metadata.get(META_HOLDER).cloned(),
                    since,
                    generation: generation_of(&props.metadata),
                    sharers: crate::shared::members(&props.metadata),
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

    /// Reads the generation and writes generation + 1 under our lease; returns the new token.
    /// Strictly increasing per key because only the lease holder can write the blob.
    ///
    /// The write also drops what a shared hold left (its group, member list and generation):
    /// that session is over, since we hold the lease. Carried along, it would let a joiner of
    /// that group who read the blob during our hold take the list for a live session once our
    /// lease ended, and join it with *our* token instead of founding a session with a new one.
    ///
    /// Holders' notes ([`META_NOTE_PREFIX`]) are kept: they describe the key, not a hold. Returns
    /// the token and the metadata as written.
    async fn bump_generation(&self, blob: &str, lease: LeaseId) -> Result<(u64, Metadata)> {
        let props = self
            .retry("read fencing generation", || self.store.properties(blob))
            .await?;
        let token = generation_of(&props.metadata) + 1;
        let mut metadata = props.metadata;
        for shared in [META_SHARERS, META_SHARE_GROUP, META_SHARE_GENERATION] {
            metadata.remove(shared);
        }
        metadata.insert(META_GENERATION.into(), token.to_string());
        metadata.insert(META_HOLDER.into(), self.options.holder.clone());
        metadata.insert(META_SINCE.into(), unix_millis_now().to_string());
        // Idempotent: a retry after a lost answer writes the same values again.
        self.retry("write fencing generation", || {
            self.store.set_metadata(blob, Some(lease), None, &metadata)
        })
        .await?;
        Ok((token, metadata))
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
    /// The lock blob's metadata as this grant wrote it (fencing on), kept in step with the notes
    /// this holder writes since.
    metadata: std::sync::Mutex<Option<Metadata>>,
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
        let renewer = tokio::spawn(renew_loop(
            lock.store.clone(),
            blob.clone(),
            lease,
            lock.options.clone(),
            granted_at,
            lost.clone(),
            stop.clone(),
            renewed_tx,
        ));
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
            metadata: std::sync::Mutex::new(None),
        }
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

    /// A note on the key, as it was at this grant or as this holder last wrote it. Notes are
    /// small texts a holder leaves for the key's next holders (how many runs in a row were cut
    /// short, say); they are read with the fencing generation, at no extra cost, so only with
    /// fencing on (`None` otherwise).
    pub fn note(&self, name: &str) -> Option<String> {
        let metadata = self.metadata.lock().unwrap_or_else(|e| e.into_inner());
        metadata
            .as_ref()?
            .get(&format!("{META_NOTE_PREFIX}{name}"))
            .cloned()
    }

    /// Sets (`Some`) or removes (`None`) notes, in one write under this lease (retried on
    /// transient failures): it lands only while this holder holds the lease, so a write that
    /// comes late can never change a later holder's notes (`LeaseLost`). Names are letters,
    /// digits and `_`; values plain ASCII text. Needs fencing (`Config` error otherwise).
    pub async fn write_notes(&self, changes: &[(&str, Option<String>)]) -> Result<()> {
        let mut metadata = self
            .metadata
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| Error::Config("notes need fencing (LeaseOptions::fencing)".into()))?;
        for (name, value) in changes {
            let key = format!("{META_NOTE_PREFIX}{name}");
            match value {
                Some(v) => metadata.insert(key, v.clone()),
                None => metadata.remove(&key),
            };
        }
        let written = self
            .lock
            .retry("write notes", || {
                self.lock
                    .store
                    .set_metadata(&self.blob, Some(self.lease), None, &metadata)
            })
            .await;
        match written {
            Ok(_) => {
                *self.metadata.lock().unwrap_or_else(|e| e.into_inner()) = Some(metadata);
                Ok(())
            }
            Err(e) if e.kind() == StoreErrorKind::LeaseLost => Err(lease_lost(&self.key)),
            Err(e) => Err(e.into()),
        }
    }

    /// Stops renewing and releases the lease. A lease that was already lost is not an error.
    pub async fn release(mut self) -> Result<()> {
        self.done = true;
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
    renewed: watch::Sender<Instant>,
) {
    let valid_for = options.duration.as_duration() - options.safety_margin;
    let mut deadline = granted_at + valid_for;
    let mut next = granted_at + options.renew_every;
    let mut failures = 0u32;
    loop {
        tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            _ = sleep_until(deadline) => break,
            _ = sleep_until(next) => {}
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
                renewed.send_replace(sent);
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
