//! Retrigger markers: one per record, whose existence means "a trigger arrived while a run was in
//! progress" (see [`crate::RecordRunner`] for who sets and who takes it); and, in a scope that
//! debounces, wait markers: one per record, whose existence means "triggers are waiting for the
//! record's burst to end, and a waiter will run it" (its ETag changes with every trigger that
//! joins). [`MarkerStore`] is their storage seam: [`AzureMarkers`] keeps them as empty blobs
//! `retrigger/<scope>/<record>` and `waiting/<scope>/<record>` beside the lock blobs,
//! [`MemoryMarkers`] in memory for tests and the simulation.

use std::collections::{HashMap, HashSet};
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

/// Prefix of wait marker blobs in the container.
pub const WAIT_PREFIX: &str = "waiting/";

/// Answer of [`MarkerStore::wait_consume`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitConsumed {
    /// This call deleted the wait marker.
    Consumed,
    /// There was none.
    Gone,
    /// It was there with another ETag than the one given: a trigger joined since; left as it is.
    Changed,
}

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

    /// Creates the wait marker of `key` unless it exists (`If-None-Match: *`): its ETag if this
    /// call created it, `None` if it was there ([`Op::WaitPut`]).
    async fn wait_create(&self, key: &LockKey) -> Result<Option<String>, StoreError>;

    /// Changes the wait marker's ETag (a metadata write, never a create): `false` if there is
    /// none ([`Op::WaitTouch`]).
    async fn wait_touch(&self, key: &LockKey) -> Result<bool, StoreError>;

    /// The wait marker's ETag, `None` if there is none ([`Op::WaitHead`]).
    async fn wait_look(&self, key: &LockKey) -> Result<Option<String>, StoreError>;

    /// Deletes the wait marker, only if its ETag is `if_match` when one is given
    /// ([`Op::WaitDelete`]; on Azure, a conditional delete that fails also looks,
    /// [`Op::WaitHead`], as the service answers 412 both for another ETag and for no marker).
    async fn wait_consume(&self, key: &LockKey, if_match: Option<&str>) -> Result<WaitConsumed, StoreError>;

    /// The round-trip counters this store records into.
    fn counters(&self) -> &OpCounters;
}

/// The blob name of a record key's wait marker.
fn wait_blob_name(key: &LockKey) -> String {
    format!("{WAIT_PREFIX}{key}")
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

    async fn wait_create(&self, key: &LockKey) -> Result<Option<String>, StoreError> {
        self.container
            .create_empty_tagged(&wait_blob_name(key), Op::WaitPut)
            .await
    }

    async fn wait_touch(&self, key: &LockKey) -> Result<bool, StoreError> {
        // The value only makes the write visible to a person looking at the blob: any metadata
        // write changes the ETag.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        let metadata = HashMap::from([("touched".to_string(), now.to_string())]);
        Ok(self
            .container
            .set_metadata_if_present(&wait_blob_name(key), &metadata, Op::WaitTouch)
            .await?
            .is_some())
    }

    async fn wait_look(&self, key: &LockKey) -> Result<Option<String>, StoreError> {
        self.container.etag(&wait_blob_name(key), Op::WaitHead).await
    }

    async fn wait_consume(&self, key: &LockKey, if_match: Option<&str>) -> Result<WaitConsumed, StoreError> {
        use leasehold_storage::azure::Deleted;
        Ok(
            match self
                .container
                .delete_if_match(&wait_blob_name(key), if_match, Op::WaitDelete, Op::WaitHead)
                .await?
            {
                Deleted::Deleted => WaitConsumed::Consumed,
                Deleted::NotFound => WaitConsumed::Gone,
                Deleted::Changed => WaitConsumed::Changed,
            },
        )
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
    /// Wait markers and their ETags (drawn from one counter, so no ETag is ever reused).
    waits: Mutex<(HashMap<LockKey, u64>, u64)>,
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
            waits: Mutex::default(),
            counters,
        }
    }

    /// The records whose wait marker exists (for the simulation's checks).
    pub fn waiting(&self) -> Vec<LockKey> {
        self.waits.lock().expect("wait mutex").0.keys().cloned().collect()
    }

    fn wait<T>(
        &self,
        op: Op,
        f: impl FnOnce(&mut HashMap<LockKey, u64>, &mut u64) -> T,
    ) -> Result<T, StoreError> {
        self.counters.record(op);
        let mut waits = self.waits.lock().expect("wait mutex");
        let (map, next) = &mut *waits;
        Ok(f(map, next))
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

    async fn wait_create(&self, key: &LockKey) -> Result<Option<String>, StoreError> {
        self.wait(Op::WaitPut, |map, next| {
            if map.contains_key(key) {
                return None;
            }
            *next += 1;
            map.insert(key.clone(), *next);
            Some(memory_etag(*next))
        })
    }

    async fn wait_touch(&self, key: &LockKey) -> Result<bool, StoreError> {
        self.wait(Op::WaitTouch, |map, next| match map.get_mut(key) {
            Some(tag) => {
                *next += 1;
                *tag = *next;
                true
            }
            None => false,
        })
    }

    async fn wait_look(&self, key: &LockKey) -> Result<Option<String>, StoreError> {
        self.wait(Op::WaitHead, |map, _| map.get(key).map(|t| memory_etag(*t)))
    }

    async fn wait_consume(&self, key: &LockKey, if_match: Option<&str>) -> Result<WaitConsumed, StoreError> {
        self.wait(Op::WaitDelete, |map, _| match map.get(key) {
            None => WaitConsumed::Gone,
            Some(tag) if if_match.is_some_and(|m| m != memory_etag(*tag)) => WaitConsumed::Changed,
            Some(_) => {
                map.remove(key);
                WaitConsumed::Consumed
            }
        })
    }

    fn counters(&self) -> &OpCounters {
        &self.counters
    }
}

fn memory_etag(n: u64) -> String {
    format!("\"{n}\"")
}

/// What storage says about a record now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordStatus {
    /// Its lease: held or not, by whom and since when (with fencing), its generation.
    pub lock: LockInfo,
    /// Whether a trigger arrived during a run and the holder has not yet taken the marker.
    pub retrigger_pending: bool,
    /// Whether triggers are waiting for the record's burst to end (a scope that debounces).
    pub waiting: bool,
}

/// Reads a record's status (three round trips); see also [`crate::RecordRunner::status`].
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
    let waiting = markers
        .wait_look(&key)
        .await
        .map_err(|e| Error::storage("read wait marker", e))?
        .is_some();
    Ok(RecordStatus {
        lock: info,
        retrigger_pending,
        waiting,
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

        // A wait marker: created once, its ETag changed by each touch, consumed only with the
        // ETag it has (or none), never created by a touch.
        let tag = markers.wait_create(&key).await.unwrap().unwrap();
        assert_eq!(markers.wait_create(&key).await.unwrap(), None);
        assert_eq!(
            markers.wait_look(&key).await.unwrap().as_deref(),
            Some(tag.as_str())
        );
        assert!(markers.wait_touch(&key).await.unwrap());
        let touched = markers.wait_look(&key).await.unwrap().unwrap();
        assert_ne!(touched, tag);
        assert_eq!(
            markers.wait_consume(&key, Some(&tag)).await.unwrap(),
            WaitConsumed::Changed
        );
        assert_eq!(
            markers.wait_consume(&key, Some(&touched)).await.unwrap(),
            WaitConsumed::Consumed
        );
        assert_eq!(
            markers.wait_consume(&key, None).await.unwrap(),
            WaitConsumed::Gone
        );
        assert!(!markers.wait_touch(&key).await.unwrap());
        assert_eq!(markers.wait_look(&key).await.unwrap(), None);
        assert_eq!(
            markers.wait_create(&key).await.unwrap().map(|t| t == tag),
            Some(false)
        );
        assert_eq!(
            markers.wait_consume(&key, None).await.unwrap(),
            WaitConsumed::Consumed
        );
        assert_eq!(wait_blob_name(&key), "waiting/acct/r");

        // Counters handed in are the ones recorded into (shared with the lock and the queue).
        let shared = OpCounters::new();
        let markers = MemoryMarkers::with_counters(shared.clone());
        markers.set(&key).await.unwrap();
        assert_eq!(shared.snapshot().get(Op::FlagPut), 1);
    }
}
