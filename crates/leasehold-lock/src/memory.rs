//! An in-memory [`LeaseStore`] that follows Azure's lease rules, with time from tokio (so paused
//! time drives lease expiry). For unit tests and the deterministic simulation, never a stand-in
//! for proving the Azure path.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

use leasehold_storage::{Op, OpCounters, StoreError, StoreErrorKind, StoreResult};

use crate::store::{BlobProperties, ETag, LeaseDuration, LeaseId, LeaseState, LeaseStore, Metadata};

#[derive(Debug, Clone)]
enum Lease {
    None,
    Active {
        id: LeaseId,
        expires: Instant,
        duration: Duration,
    },
    /// Broken with a break period: nobody can acquire or renew until `until`; the holder may
    /// still release.
    Breaking {
        id: LeaseId,
        until: Instant,
    },
    Broken,
}

#[derive(Debug, Clone)]
struct Blob {
    lease: Lease,
    metadata: Metadata,
    etag: u64,
    /// A page blob's sequence number; `None` for a block blob.
    sequence: Option<u64>,
    /// A lease that ran out, kept so its holder may still renew it (as Azure allows) until
    /// someone else acquires or the blob is written.
    expired: Option<(LeaseId, Duration)>,
}

#[derive(Debug, Default)]
struct State {
    container_exists: bool,
    blobs: HashMap<String, Blob>,
    next_etag: u64,
}

/// In-memory blob container with Azure lease semantics.
#[derive(Debug)]
pub struct MemoryStore {
    state: Mutex<State>,
    counters: OpCounters,
    /// How much faster storage's clock runs than the caller's (1.0: alike).
    clock_rate: f64,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::with_counters(OpCounters::default())
    }
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// A store that records into the given counters.
    pub fn with_counters(counters: OpCounters) -> Self {
        Self {
            state: Mutex::default(),
            counters,
            clock_rate: 1.0,
        }
    }

    /// Storage's clock runs `rate` times as fast as the caller's (tokio's): a lease of `d` ends
    /// after `d / rate` by the caller's clock. For simulating clock-rate differences.
    pub fn with_clock_rate(mut self, rate: f64) -> Self {
        assert!(rate > 0.0, "a clock rate is positive");
        self.clock_rate = rate;
        self
    }

    /// Puts a lock blob as Leasehold made them before fencing moved to the sequence number: a
    /// block blob whose fencing generation is in its metadata (for tests of the move). Creates
    /// the container.
    pub fn put_block_blob(&self, name: &str, metadata: Metadata) {
        let mut state = self.state.lock().expect("poisoned");
        state.container_exists = true;
        let mut blob = state.new_blob();
        blob.sequence = None;
        blob.metadata = metadata;
        state.blobs.insert(name.to_string(), blob);
    }

    /// One write of `op` under `lease` and `if_match` (refused as Azure refuses it): `change`
    /// alters the blob and answers what the write answers, or `None` to leave it as it is. A
    /// change gets a new ETag and ends the chance to renew an expired lease, as in Azure.
    fn write<T>(
        &self,
        op: Op,
        name: &str,
        lease: Option<LeaseId>,
        if_match: Option<&ETag>,
        change: impl FnOnce(&mut Blob) -> Option<T>,
    ) -> StoreResult<Option<(T, ETag)>> {
        self.with_state(op, |s, _| {
            let etag = s.next_etag + 1;
            let Some(blob) = s.blobs.get_mut(name) else {
                return Err(not_found(s, op));
            };
            check_write(blob, lease, if_match, op)?;
            let Some(answer) = change(blob) else {
                return Ok(None);
            };
            blob.etag = etag;
            blob.expired = None;
            s.next_etag = etag;
            Ok(Some((answer, ETag(etag.to_string()))))
        })
    }

    /// When the active lease on `name` ends, by the caller's (tokio's) clock; `None` if no lease
    /// is active (for tests).
    pub fn lease_expiry(&self, name: &str) -> Option<Instant> {
        match self.state.lock().expect("poisoned").blobs.get(name)?.lease {
            Lease::Active { expires, .. } if expires > Instant::now() => Some(expires),
            _ => None,
        }
    }

    /// Names of the blobs that exist, sorted (for tests).
    pub fn blob_names(&self) -> Vec<String> {
        let mut names: Vec<_> = self
            .state
            .lock()
            .expect("poisoned")
            .blobs
            .keys()
            .cloned()
            .collect();
        names.sort();
        names
    }

    fn with_state<T>(&self, op: Op, f: impl FnOnce(&mut State, Instant) -> StoreResult<T>) -> StoreResult<T> {
        self.counters.record(op);
        let mut state = self.state.lock().expect("memory store mutex poisoned");
        let now = Instant::now();
        for blob in state.blobs.values_mut() {
            if let Lease::Active {
                id,
                expires,
                duration,
            } = blob.lease
                && expires <= now
            {
                blob.lease = Lease::None;
                blob.expired = Some((id, duration));
            }
            if let Lease::Breaking { until, .. } = blob.lease
                && until <= now
            {
                blob.lease = Lease::Broken;
            }
        }
        f(&mut state, now)
    }
}

fn err(kind: StoreErrorKind, op: Op, status: u16, code: &str) -> StoreError {
    StoreError::new(kind, op, "").with_status(status, Some(code.to_string()))
}

/// What Azure answers a renew or release naming a lease id that does not hold the blob.
fn not_ours(lease: &Lease, op: Op) -> StoreError {
    let code = match lease {
        Lease::Active { .. } => "LeaseIdMismatchWithLeaseOperation",
        _ => "LeaseNotPresentWithLeaseOperation",
    };
    err(StoreErrorKind::LeaseLost, op, 409, code)
}

fn not_found(state: &State, op: Op) -> StoreError {
    if state.container_exists {
        err(StoreErrorKind::NotFound, op, 404, "BlobNotFound")
    } else {
        err(StoreErrorKind::NotFound, op, 404, "ContainerNotFound")
    }
}

impl State {
    fn bump(&mut self) -> u64 {
        self.next_etag += 1;
        self.next_etag
    }

    fn new_blob(&mut self) -> Blob {
        Blob {
            lease: Lease::None,
            metadata: Metadata::new(),
            etag: self.bump(),
            sequence: Some(0),
            expired: None,
        }
    }
}

/// Whether a write under `lease` (and `if_match`) may land on `blob`: Azure's answers to a
/// write that names the wrong lease, none on a leased blob, or a stale ETag.
fn check_write(blob: &Blob, lease: Option<LeaseId>, if_match: Option<&ETag>, op: Op) -> StoreResult<()> {
    if let Some(tag) = if_match
        && tag.0 != blob.etag.to_string()
    {
        return Err(err(StoreErrorKind::ConditionNotMet, op, 412, "ConditionNotMet"));
    }
    match (&blob.lease, lease) {
        (Lease::Active { id, .. }, Some(given)) if *id == given => Ok(()),
        (Lease::Active { .. }, None) => Err(err(StoreErrorKind::LeaseLost, op, 412, "LeaseIdMissing")),
        (Lease::Active { .. }, Some(_)) => Err(err(
            StoreErrorKind::LeaseLost,
            op,
            412,
            "LeaseIdMismatchWithBlobOperation",
        )),
        (_, Some(_)) => Err(err(
            StoreErrorKind::LeaseLost,
            op,
            412,
            "LeaseNotPresentWithBlobOperation",
        )),
        (_, None) => Ok(()),
    }
}

fn lease_state(blob: &Blob) -> LeaseState {
    match blob.lease {
        Lease::Active { .. } => LeaseState::Leased,
        Lease::Breaking { .. } => LeaseState::Breaking,
        Lease::Broken => LeaseState::Broken,
        Lease::None if blob.expired.is_some() => LeaseState::Expired,
        Lease::None => LeaseState::Available,
    }
}

#[async_trait]
impl LeaseStore for MemoryStore {
    async fn create_container(&self) -> StoreResult<()> {
        self.with_state(Op::ContainerCreate, |s, _| {
            s.container_exists = true;
            Ok(())
        })
    }

    async fn create_blob(&self, name: &str) -> StoreResult<()> {
        let needs_container = !self.state.lock().expect("poisoned").container_exists;
        if needs_container {
            self.create_container().await?;
        }
        self.with_state(Op::BlobCreate, |s, _| {
            if !s.blobs.contains_key(name) {
                let blob = s.new_blob();
                s.blobs.insert(name.to_string(), blob);
            }
            Ok(())
        })
    }

    async fn acquire_lease(&self, name: &str, lease: LeaseId, duration: LeaseDuration) -> StoreResult<()> {
        let duration = duration.as_duration().div_f64(self.clock_rate);
        let op = Op::LeaseAcquire;
        self.with_state(op, |s, now| {
            if !s.container_exists || !s.blobs.contains_key(name) {
                return Err(not_found(s, op));
            }
            let blob = s.blobs.get_mut(name).expect("checked above");
            match blob.lease {
                Lease::Active { id, .. } if id != lease => Err(err(
                    StoreErrorKind::LeaseAlreadyPresent,
                    op,
                    409,
                    "LeaseAlreadyPresent",
                )),
                // As Azure (and Azurite): the breaking lease's own id is told apart.
                Lease::Breaking { id, .. } if id == lease => Err(err(
                    StoreErrorKind::LeaseBreaking,
                    op,
                    409,
                    "LeaseIsBreakingAndCannotBeAcquired",
                )),
                Lease::Breaking { .. } => Err(err(
                    StoreErrorKind::LeaseAlreadyPresent,
                    op,
                    409,
                    "LeaseAlreadyPresent",
                )),
                _ => {
                    blob.lease = Lease::Active {
                        id: lease,
                        expires: now + duration,
                        duration,
                    };
                    blob.expired = None;
                    Ok(())
                }
            }
        })
    }

    async fn renew_lease(&self, name: &str, lease: LeaseId) -> StoreResult<()> {
        let op = Op::LeaseRenew;
        self.with_state(op, |s, now| {
            let Some(blob) = s.blobs.get_mut(name) else {
                return Err(not_found(s, op));
            };
            match blob.lease {
                Lease::Active { id, duration, .. } if id == lease => {
                    blob.lease = Lease::Active {
                        id,
                        expires: now + duration,
                        duration,
                    };
                    Ok(())
                }
                // Azure lets the holder renew a lease that ran out, as long as nobody else
                // acquired it and the blob was not written in between.
                Lease::None if blob.expired.is_some_and(|(id, _)| id == lease) => {
                    let (id, duration) = blob.expired.take().expect("checked");
                    blob.lease = Lease::Active {
                        id,
                        expires: now + duration,
                        duration,
                    };
                    Ok(())
                }
                ref other => Err(not_ours(other, op)),
            }
        })
    }

    async fn release_lease(&self, name: &str, lease: LeaseId, if_match: Option<&ETag>) -> StoreResult<()> {
        let op = Op::LeaseRelease;
        self.with_state(op, |s, _| {
            let Some(blob) = s.blobs.get_mut(name) else {
                return Err(not_found(s, op));
            };
            if let Some(tag) = if_match
                && tag.0 != blob.etag.to_string()
            {
                return Err(err(StoreErrorKind::ConditionNotMet, op, 412, "ConditionNotMet"));
            }
            match blob.lease {
                Lease::Active { id, .. } | Lease::Breaking { id, .. } if id == lease => {
                    blob.lease = Lease::None;
                    Ok(())
                }
                Lease::None if blob.expired.is_some_and(|(id, _)| id == lease) => {
                    blob.expired = None;
                    Ok(())
                }
                ref other => Err(not_ours(other, op)),
            }
        })
    }

    async fn break_lease(&self, name: &str, period: Duration) -> StoreResult<()> {
        let period = period.div_f64(self.clock_rate);
        let op = Op::LeaseBreak;
        self.with_state(op, |s, now| {
            let Some(blob) = s.blobs.get_mut(name) else {
                return Err(not_found(s, op));
            };
            match blob.lease {
                // Azure ends the lease after the shorter of the period and the time it has left.
                Lease::Active { id, expires, .. } if !period.is_zero() => {
                    blob.lease = Lease::Breaking {
                        id,
                        until: (now + period).min(expires),
                    };
                }
                // Breaking again can only shorten the break, as in Azure (and Azurite).
                Lease::Breaking { id, until } if !period.is_zero() => {
                    blob.lease = Lease::Breaking {
                        id,
                        until: (now + period).min(until),
                    };
                }
                Lease::Active { .. } | Lease::Breaking { .. } => blob.lease = Lease::Broken,
                _ => {}
            }
            blob.expired = None;
            Ok(())
        })
    }

    async fn properties(&self, name: &str) -> StoreResult<BlobProperties> {
        let op = Op::BlobProperties;
        self.with_state(op, |s, _| {
            let Some(blob) = s.blobs.get(name) else {
                return Err(not_found(s, op));
            };
            Ok(BlobProperties {
                lease_state: lease_state(blob),
                metadata: blob.metadata.clone(),
                etag: ETag(blob.etag.to_string()),
                sequence: blob.sequence,
            })
        })
    }

    async fn set_metadata(
        &self,
        name: &str,
        lease: Option<LeaseId>,
        if_match: Option<&ETag>,
        metadata: &Metadata,
    ) -> StoreResult<ETag> {
        let written = self.write(Op::BlobSetMetadata, name, lease, if_match, |blob| {
            blob.metadata = metadata.clone();
            Some(())
        })?;
        Ok(written.expect("a metadata write always changes the blob").1)
    }

    async fn increment_sequence(
        &self,
        name: &str,
        lease: LeaseId,
        if_match: Option<&ETag>,
    ) -> StoreResult<Option<(u64, ETag)>> {
        // Azure checks the conditions and the lease first, then refuses a block blob (400
        // `InvalidOperation`): no change.
        self.write(Op::BlobSequenceIncrement, name, Some(lease), if_match, |blob| {
            blob.sequence.as_mut().map(|sequence| {
                *sequence += 1;
                *sequence
            })
        })
    }

    async fn replace_with_page_blob(
        &self,
        name: &str,
        lease: LeaseId,
        if_match: Option<&ETag>,
        sequence: u64,
        metadata: &Metadata,
    ) -> StoreResult<ETag> {
        let written = self.write(Op::BlobCreate, name, Some(lease), if_match, |blob| {
            blob.sequence = Some(sequence);
            blob.metadata = metadata.clone();
            Some(())
        })?;
        Ok(written.expect("a replacement always changes the blob").1)
    }

    fn counters(&self) -> &OpCounters {
        &self.counters
    }
}
