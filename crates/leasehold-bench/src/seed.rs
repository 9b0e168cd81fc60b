//! A faithful implementation of the seed design Leasehold replaces (see DESIGN.md), on the same
//! storage seam, so both are measured alike.
//!
//! Every state change is a "locked update" of a blob: container create-if-not-exists, exists,
//! upload (if missing), acquire a 15 s lease (on contention wait a random 250–1000 ms, up to 3
//! tries), get, put, release. A trigger: a locked update of the lock blob sets "processing since
//! now" (or finds a fresh timestamp: busy, retried after random waits, then it sets the flag blob
//! and leaves); the logic runs; a locked update of the flag blob takes "pending" (if it was set,
//! the logic runs again); a locked update of the lock blob clears "processing"; the lock blob is
//! deleted. The flag is checked before the lock is cleared, and a crash leaves "processing" set
//! for 15 minutes: the two flaws DESIGN.md describes.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use leasehold_lock::{LeaseDuration, LeaseId, LeaseStore, Metadata, StoreErrorKind, StoreResult};
use leasehold_runtime::{Logic, RunContext};
use leasehold_storage::Op;
use leasehold_storage::azure::BlobContainer;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio_util::sync::CancellationToken;

const STALE_AFTER_MS: u64 = 15 * 60 * 1000;

pub struct Seed {
    store: Arc<dyn LeaseStore>,
    /// The same container, for what the lock's seam does not do (existence checks, deletes).
    container: BlobContainer,
    logic: Arc<dyn Logic>,
    rng: Mutex<SmallRng>,
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

impl Seed {
    pub fn new(
        store: Arc<dyn LeaseStore>,
        container: BlobContainer,
        logic: Arc<dyn Logic>,
        seed: u64,
    ) -> Self {
        Self {
            store,
            container,
            logic,
            rng: Mutex::new(SmallRng::seed_from_u64(seed)),
        }
    }

    async fn random_wait(&self) {
        let ms = self.rng.lock().unwrap().random_range(250..=1000);
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }

    /// The seed's read-modify-write of a blob under a short lease. `None`: the lease stayed busy.
    async fn locked_update<R>(
        &self,
        blob: &str,
        change: impl Fn(&Metadata) -> (Metadata, R),
    ) -> StoreResult<Option<R>> {
        self.store.create_container().await?;
        if !self.container.exists(blob).await? {
            self.store.create_blob(blob).await?;
        }
        let lease = LeaseId::random();
        let mut acquired = false;
        for attempt in 0..3 {
            let duration = LeaseDuration::from_secs(15).expect("the shortest lease Azure grants");
            match self.store.acquire_lease(blob, lease, duration).await {
                Ok(()) => {
                    acquired = true;
                    break;
                }
                Err(e) if e.kind() == StoreErrorKind::LeaseAlreadyPresent && attempt < 2 => {
                    self.random_wait().await
                }
                Err(e) if e.kind() == StoreErrorKind::LeaseAlreadyPresent => {}
                // Deleted by a finishing holder in the meantime: the seed just gives up this try.
                Err(e) if e.kind() == StoreErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(e),
            }
        }
        if !acquired {
            return Ok(None);
        }
        let props = match self.store.properties(blob).await {
            Ok(p) => p,
            Err(e) if e.kind() == StoreErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let (metadata, result) = change(&props.metadata);
        match self.store.set_metadata(blob, Some(lease), None, &metadata).await {
            Ok(_) => {}
            Err(e) if matches!(e.kind(), StoreErrorKind::LeaseLost | StoreErrorKind::NotFound) => {
                return Ok(None);
            }
            Err(e) => return Err(e),
        }
        let _ = self.store.release_lease(blob, lease, None).await;
        Ok(Some(result))
    }

    /// Handles one trigger for `record` the seed's way. Returns the number of logic runs it made.
    pub async fn handle(&self, record: &str) -> StoreResult<u32> {
        let lock = format!("seed-lock/{record}");
        let flag = format!("seed-flag/{record}");
        let mut began = false;
        for attempt in 0..3 {
            let begin = self
                .locked_update(&lock, |md| {
                    let busy = md
                        .get("processing")
                        .and_then(|v| v.parse::<u64>().ok())
                        .is_some_and(|t| now_ms() - t < STALE_AFTER_MS);
                    if busy {
                        (md.clone(), false)
                    } else {
                        let mut md = md.clone();
                        md.insert("processing".into(), now_ms().to_string());
                        (md, true)
                    }
                })
                .await?;
            if begin == Some(true) {
                began = true;
                break;
            }
            if attempt < 2 {
                self.random_wait().await;
            }
        }
        if !began {
            // Busy: leave a flag for the holder.
            self.locked_update(&flag, |md| {
                let mut md = md.clone();
                md.insert("pending".into(), "true".into());
                (md, ())
            })
            .await?;
            return Ok(0);
        }
        let mut runs = 0;
        loop {
            let ctx = RunContext {
                scope: "seed".parse().expect("a scope"),
                record_id: record.parse().expect("a record id"),
                fencing_token: None,
                cancel: CancellationToken::new(),
                attempt: 1,
                deferred: std::time::Duration::ZERO,
                trace: None,
            };
            let _ = self.logic.run(ctx).await;
            runs += 1;
            // Checked *before* the lock is cleared: a trigger in between is lost.
            let pending = self
                .locked_update(&flag, |md| {
                    let was = md.get("pending").is_some_and(|v| v == "true");
                    let mut md = md.clone();
                    md.remove("pending");
                    (md, was)
                })
                .await?;
            if pending != Some(true) {
                break;
            }
        }
        self.locked_update(&lock, |md| {
            let mut md = md.clone();
            md.remove("processing");
            (md, ())
        })
        .await?;
        let _ = self.container.delete_if_present(&lock, Op::FlagDelete).await;
        Ok(runs)
    }
}
