#![doc = include_str!("../README.md")]

mod account;
pub mod azure;
mod counters;
mod error;
mod key;
mod lock;
pub mod memory;
mod retry;
mod shared;
mod store;

pub use account::{EMULATOR_ACCOUNT, EMULATOR_KEY, StorageAccount};
pub use counters::{Op, OpCounters, OpCounts};
pub use error::{Error, Result, StoreError, StoreErrorKind, StoreResult, redact};
pub use key::{LockKey, MAX_KEY_LEN};
pub use lock::{
    LOCK_PREFIX, LeaseGuard, LeaseLock, LeaseOptions, LockInfo, META_GENERATION, META_HOLDER, META_SHARERS,
    META_SINCE, MultiGuard, lock_blob_name,
};
pub use retry::RetryOptions;
pub use store::{
    BlobProperties, ETag, FlagPut, InvalidLeaseDuration, LeaseDuration, LeaseId, LeaseState, LeaseStore,
    Metadata,
};

/// Re-exported so library users can name the cancellation signal the guard hands out.
pub use tokio_util::sync::CancellationToken;
