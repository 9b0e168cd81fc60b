//! Retrigger markers: one per record, whose existence means "a trigger arrived while a run was in
//! progress" (see [`crate::RecordRunner`] for who sets and who takes it). [`MarkerStore`] is their
//! storage seam: [`AzureMarkers`] keeps them as empty blobs `retrigger/<scope>/<record>` beside the
//! lock blobs, [`MemoryMarkers`] in memory for tests and the simulation.

use std::collections::HashSet;
use std::fmt;
use std::sync::Mutex;

use async_trait::async_trait;
use leasehold_lock::{LeaseLock, LockInfo, LockKey};
use leasehold_storage::azure::BlobContainer;
use leasehold_storage::{Op, OpCounters, StorageAccount, StoreError};

use crate::error::Error;
use crate::record::{RecordId, Scope, record_key};

/// Prefix of retrigger marker blobs in the container.
pub const MARKER_PREFIX: &str = "retrigger/";

/// Answer of [`MarkerStore::set`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MarkerSet {
    /// The marker was not set and this call set it.
    Created,
    /// The marker was set already; nothing was written.
    AlreadySet,
}

/// Where retrigger markers are kept. Each method is one round trip (setting the first marker in
/// a container that does not exist yet creates the container: two).
#[async_trait]
pub trait MarkerStore: Send + Sync + fmt::Debug + 'static {
    /// Sets the marker of `key` unless it is set (`If-None-Match: *`): whoever creates it knows
    /// it did.
    async fn set(&self, key: &LockKey) -> Result<MarkerSet, StoreError>;

    /// Clears the marker of `key`: `true` if it was set.
    async fn take(&self, key: &LockKey) -> Result<bool, StoreError>;

    /// Whether the marker of `key` is set (a read for status displays; the protocol never reads
    /// a marker without taking it).
    async fn is_set(&self, key: &LockKey) -> Result<bool, StoreError>;

    /// The round-trip counters this store records into.
    fn counters(&self) -> &OpCounters;
}

/// The blob name of a record key's marker.
fn blob_name(key: &LockKey) -> String {
    format!("{MARKER_PREFIX}{key}")
}

/// Markers as empty blobs in a container (the lock's own, in Leasehold).
#[derive(Debug, Clone)]
pub struct AzureMarkers {
    container: BlobContainer,
}

impl AzureMarkers {
    /// Markers in `container` of `account`, recording round trips into `counters`.
    pub fn new(account: &StorageAccount, container: &str, counters: OpCounters) -> Self {
        Self {
            container: BlobContainer::new(account, container, counters),
        }
    }
}

#[async_trait]
impl MarkerStore for AzureMarkers {
    async fn set(&self, key: &LockKey) -> Result<MarkerSet, StoreError> {
        let created = self
            .container
            .put_empty_if_absent(&blob_name(key), Op::FlagPut)
            .await?;
        Ok(if created {
            MarkerSet::Created
        } else {
            MarkerSet::AlreadySet
        })
    }

    async fn take(&self, key: &LockKey) -> Result<bool, StoreError> {
        self.container
            .delete_if_present(&blob_name(key), Op::FlagDelete)
            .await
    }

    async fn is_set(&self, key: &LockKey) -> Result<bool, StoreError> {
        self.container.exists(&blob_name(key)).await
    }

    fn counters(&self) -> &OpCounters {
        self.container.counters()
    }
}

/// Markers in memory, counting round trips as [`AzureMarkers`] would (a container is taken to
/// exist: the lock's first use creates it before any marker is set).
#[derive(Debug, Default)]
pub struct MemoryMarkers {
    set: Mutex<HashSet<LockKey>>,
    counters: OpCounters,
}

impl MemoryMarkers {
    pub fn new() -> Self {
        Self::default()
    }

    /// A store that records into the given counters.
    pub fn with_counters(counters: OpCounters) -> Self {
        Self {
            set: Mutex::default(),
            counters,
        }
    }

    fn with<T>(&self, op: Op, f: impl FnOnce(&mut HashSet<LockKey>) -> T) -> Result<T, StoreError> {
        self.counters.record(op);
        Ok(f(&mut self.set.lock().expect("marker set mutex")))
    }
}

#[async_trait]
impl MarkerStore for MemoryMarkers {
    async fn set(&self, key: &LockKey) -> Result<MarkerSet, StoreError> {
        self.with(Op::FlagPut, |set| {
            if set.insert(key.clone()) {
                MarkerSet::Created
            } else {
                MarkerSet::AlreadySet
            }
        })
    }

    async fn take(&self, key: &LockKey) -> Result<bool, StoreError> {
        self.with(Op::FlagDelete, |set| set.remove(key))
    }

    async fn is_set(&self, key: &LockKey) -> Result<bool, StoreError> {
        self.with(Op::BlobProperties, |set| set.contains(key))
    }

    fn counters(&self) -> &OpCounters {
        &self.counters
    }
}

/// What storage says about a record now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordStatus {
    /// Its lease: held or not, by whom and since when (with fencing), its generation.
    pub lock: LockInfo,
    /// Whether a trigger arrived during a run and the holder has not yet taken the marker.
    pub retrigger_pending: bool,
}

/// Reads a record's status (two round trips); see also [`crate::RecordRunner::status`].
pub async fn record_status(
    lock: &LeaseLock,
    markers: &dyn MarkerStore,
    scope: &Scope,
    record_id: &RecordId,
) -> Result<RecordStatus, Error> {
    let key = record_key(scope, record_id);
    let info = lock
        .inspect(&key)
        .await
        .map_err(|e| Error::storage("inspect lease", e))?;
    let retrigger_pending = markers
        .is_set(&key)
        .await
        .map_err(|e| Error::storage("read retrigger marker", e))?;
    Ok(RecordStatus {
        lock: info,
        retrigger_pending,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_marker_is_created_once_and_taken_once() {
        let markers = MemoryMarkers::new();
        let key = LockKey::new("acct/r").unwrap();
        assert!(!markers.is_set(&key).await.unwrap());
        assert_eq!(markers.set(&key).await.unwrap(), MarkerSet::Created);
        assert_eq!(markers.set(&key).await.unwrap(), MarkerSet::AlreadySet);
        assert!(markers.is_set(&key).await.unwrap());
        assert!(markers.take(&key).await.unwrap());
        assert!(!markers.take(&key).await.unwrap());
        let counts = markers.counters().snapshot();
        assert_eq!(
            (
                counts.get(Op::FlagPut),
                counts.get(Op::FlagDelete),
                counts.get(Op::BlobProperties)
            ),
            (2, 2, 2)
        );
        assert_eq!(blob_name(&key), "retrigger/acct/r");

        // Counters handed in are the ones recorded into (shared with the lock and the queue).
        let shared = OpCounters::new();
        let markers = MemoryMarkers::with_counters(shared.clone());
        markers.set(&key).await.unwrap();
        assert_eq!(shared.snapshot().get(Op::FlagPut), 1);
    }
}
