//! What the lock reports: [`Error`].

use std::time::Duration;

use leasehold_storage::StoreError;

/// Everything the lock library can report.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Storage answered with something the lock cannot work around (after retrying transient
    /// failures with backoff).
    #[error(transparent)]
    Storage(#[from] StoreError),
    /// `acquire` waited as long as it was allowed to and the key stayed held.
    #[error("lock {key:?} is still held by another holder after waiting {waited:?}")]
    Timeout { key: String, waited: Duration },
    /// The key cannot name a blob.
    #[error("invalid lock key {key:?}: {reason}")]
    InvalidKey { key: String, reason: &'static str },
    /// The lock's options do not fit together (see [`crate::LeaseOptions::validate`]).
    #[error("lock configuration: {0}")]
    Config(String),
    /// A shared join or leave met a change by another member between its read and its
    /// conditional write every time it tried (heavy churn on the key); try again later.
    #[error("the shared lock on {key:?} changed under every one of {attempts} attempts")]
    Contended { key: String, attempts: usize },
    /// The lease was lost before the operation could complete.
    #[error("lease on {key:?} was lost")]
    LeaseLost { key: String },
}

/// Result of a lock operation.
pub type Result<T> = std::result::Result<T, Error>;
