#![doc = include_str!("../README.md")]

pub mod azure;
mod error;
mod key;
mod lock;
pub mod memory;
mod shared;
mod store;
#[cfg(feature = "testing")]
pub mod testing;

pub use error::{Error, Result};
pub use key::{LockKey, MAX_KEY_LEN};
/// The shared storage access this crate is built on; re-exported so the types of this crate's
/// API can be named from here.
pub use leasehold_storage::{
    Op, OpCounters, OpCounts, RetryOptions, StorageAccount, StoreError, StoreErrorKind, StoreResult,
};
pub use lock::{
    BeforeRenewal, LOCK_PREFIX, LeaseGuard, LeaseLock, LeaseOptions, LockInfo, META_GENERATION, META_HOLDER,
    META_SHARERS, META_SINCE, MultiGuard, RecordedHold, lock_blob_name,
};
pub use store::{
    BlobProperties, ETag, InvalidLeaseDuration, LeaseDuration, LeaseId, LeaseState, LeaseStore, Metadata,
};

/// Re-exported so library users can name the cancellation signal the guard hands out.
pub use tokio_util::sync::CancellationToken;
