//! The lock's storage seam. Every Azure call the lock makes goes through [`LeaseStore`];
//! [`crate::azure::AzureBlobStore`] speaks to Azure Blob Storage (or Azurite) and
//! [`crate::memory::MemoryStore`] is an exact, deterministic model for unit tests and simulation.
//!
//! Each method is one round trip on the hot path (and is counted as one). Creating a missing
//! container on first use is the only place a method may send more than one request.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use async_trait::async_trait;

use leasehold_storage::{OpCounters, StoreResult};

/// A lease id: a GUID chosen by the acquirer ("proposed lease id").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseId(pub uuid::Uuid);

impl LeaseId {
    pub fn random() -> Self {
        Self(uuid::Uuid::new_v4())
    }

    /// A lease id every caller computes alike from `parts` (used by shared holders, who must all
    /// present the same id).
    pub fn derived(parts: &[&str]) -> Self {
        const NAMESPACE: uuid::Uuid = uuid::Uuid::from_u128(0x6c65_6173_6568_6f6c_642d_6c6f_636b_0001);
        Self(uuid::Uuid::new_v5(&NAMESPACE, parts.join("\u{1f}").as_bytes()))
    }
}

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A lease duration storage grants: whole seconds from 15 to 60 (Azure's limits for a lease that
/// expires). Checked once, where it is made; everything after takes it as it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LeaseDuration(u8);

impl LeaseDuration {
    /// The shortest lease storage grants, in seconds.
    pub const MIN_SECS: u64 = 15;
    /// The longest lease storage grants (short of an infinite one), in seconds.
    pub const MAX_SECS: u64 = 60;

    /// A lease of `secs` seconds, if storage grants one that long.
    pub fn from_secs(secs: u64) -> Result<Self, InvalidLeaseDuration> {
        Self::try_from(Duration::from_secs(secs))
    }

    /// Whole seconds, as the `x-ms-lease-duration` header carries them.
    pub fn secs(self) -> u8 {
        self.0
    }

    pub fn as_duration(self) -> Duration {
        Duration::from_secs(u64::from(self.0))
    }
}

impl Default for LeaseDuration {
    /// 30 s: a dead holder blocks its key for at most this long.
    fn default() -> Self {
        Self(30)
    }
}

impl TryFrom<Duration> for LeaseDuration {
    type Error = InvalidLeaseDuration;

    fn try_from(duration: Duration) -> Result<Self, InvalidLeaseDuration> {
        let secs = duration.as_secs();
        if (Self::MIN_SECS..=Self::MAX_SECS).contains(&secs) && duration.subsec_nanos() == 0 {
            Ok(Self(secs as u8))
        } else {
            Err(InvalidLeaseDuration(duration))
        }
    }
}

impl From<LeaseDuration> for Duration {
    fn from(d: LeaseDuration) -> Duration {
        d.as_duration()
    }
}

/// A duration storage would refuse for a lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("lease duration must be whole seconds from 15 to 60 (Azure's limits), not {0:?}")]
pub struct InvalidLeaseDuration(pub Duration);

/// An entity tag, for optimistic concurrency (`If-Match`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ETag(pub String);

/// User metadata on a blob. Names are lower-case C# identifiers (`leasehold_generation`).
pub type Metadata = BTreeMap<String, String>;

/// The lease state of a blob as the service reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseState {
    /// Never leased, or released.
    Available,
    /// A lease is active.
    Leased,
    /// A lease ran out without being renewed or released.
    Expired,
    /// A lease is being broken (break period still running).
    Breaking,
    /// A lease was broken.
    Broken,
}

impl LeaseState {
    /// Whether someone holds the blob now (a breaking lease is still held until its period ends).
    pub fn is_held(self) -> bool {
        matches!(self, LeaseState::Leased | LeaseState::Breaking)
    }
}

/// What one `properties` call tells about a blob.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlobProperties {
    pub lease_state: LeaseState,
    pub metadata: Metadata,
    pub etag: ETag,
    /// A page blob's sequence number (the fencing generation of a lock blob); `None` for a
    /// block blob (a lock blob made before fencing moved to the sequence number).
    pub sequence: Option<u64>,
}

/// The storage operations the lock and the runner need, one round trip each.
///
/// Errors carry a [`crate::StoreErrorKind`]: lease conflicts, lost leases, missing blobs and
/// failed preconditions are *definitive*; only `Transient` errors are worth retrying, and the
/// callers in this crate do that (with backoff), not the stores.
#[async_trait]
pub trait LeaseStore: Send + Sync + fmt::Debug + 'static {
    /// Creates the container if it does not exist (an existing one is success). The other calls
    /// create it on first use by themselves; this is for start-up checks and tools.
    async fn create_container(&self) -> StoreResult<()>;

    /// Creates a zero-length page blob at sequence number 0 (and its container) if the blob
    /// does not exist. Losing a creation race is success.
    async fn create_blob(&self, blob: &str) -> StoreResult<()>;

    /// Acquires a lease of `duration` with the proposed id. Answers `NotFound` if the
    /// blob (or container) is missing and `LeaseAlreadyPresent` if another id holds it; with the
    /// id that holds it, it succeeds and renews.
    async fn acquire_lease(&self, blob: &str, lease: LeaseId, duration: LeaseDuration) -> StoreResult<()>;

    /// Renews a lease; `LeaseLost` if the id no longer holds it.
    async fn renew_lease(&self, blob: &str, lease: LeaseId) -> StoreResult<()>;

    /// Releases a lease; `LeaseLost` if the id does not hold it; `ConditionNotMet` if `if_match`
    /// is given and the blob's ETag differs.
    async fn release_lease(&self, blob: &str, lease: LeaseId, if_match: Option<&ETag>) -> StoreResult<()>;

    /// Breaks whatever lease is on the blob: nobody can renew it from now on, and nobody can
    /// acquire it for the shorter of `period` and the time it has left (zero: free at once).
    /// No lease is success.
    async fn break_lease(&self, blob: &str, period: Duration) -> StoreResult<()>;

    /// Lease state, metadata and ETag of a blob.
    async fn properties(&self, blob: &str) -> StoreResult<BlobProperties>;

    /// Replaces a blob's metadata; `lease` must name the active lease if there is one. Returns
    /// the new ETag.
    async fn set_metadata(
        &self,
        blob: &str,
        lease: Option<LeaseId>,
        if_match: Option<&ETag>,
        metadata: &Metadata,
    ) -> StoreResult<ETag>;

    /// Adds one to a page blob's sequence number, under `lease` (the active lease's id) and
    /// `if_match` if given, touching nothing else, and answers the new number and ETag. Only the
    /// lease holder can do it (`LeaseLost` otherwise), so the numbers one key hands out strictly
    /// increase. Not idempotent: a retry after a lost answer skips a number. `Ok(None)` if the
    /// blob is a block blob (storage refuses the action on one).
    async fn increment_sequence(
        &self,
        blob: &str,
        lease: LeaseId,
        if_match: Option<&ETag>,
    ) -> StoreResult<Option<(u64, ETag)>>;

    /// Replaces the blob, under `lease` and `if_match` if given, with a zero-length page blob at
    /// `sequence` carrying `metadata` (the lease stays). Turns a block lock blob into a page blob
    /// without its generation going backwards. Returns the new ETag.
    async fn replace_with_page_blob(
        &self,
        blob: &str,
        lease: LeaseId,
        if_match: Option<&ETag>,
        sequence: u64,
        metadata: &Metadata,
    ) -> StoreResult<ETag>;

    /// The round-trip counters this store records into.
    fn counters(&self) -> &OpCounters;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_durations_outside_azure_limits_are_refused() {
        assert_eq!(LeaseDuration::from_secs(15).unwrap().secs(), 15);
        assert_eq!(
            LeaseDuration::from_secs(60).unwrap().as_duration(),
            Duration::from_secs(60)
        );
        assert_eq!(LeaseDuration::default().secs(), 30);
        for bad in [
            Duration::from_secs(14),
            Duration::from_secs(61),
            Duration::from_millis(15_500),
        ] {
            let e = LeaseDuration::try_from(bad).unwrap_err();
            assert!(e.to_string().contains("from 15 to 60"), "{e}");
        }
    }
}
