//! The coalescing record runner: run a record's logic under its lease, and make sure that
//! triggers arriving during a run cause exactly one more run.
//!
//! Per record there is a lock blob (`locks/<scope>/<record>`, leased while a run is in progress,
//! fencing generation in its metadata) and a retrigger marker (`retrigger/<scope>/<record>`, whose
//! existence means "a trigger arrived during a run").
//!
//! * Holder path: acquire → run logic while the guard renews → release → *then* delete the marker
//!   (202 = it was set) → if it was set, enqueue one retrigger → acknowledge.
//! * Contended path: create the marker with `If-None-Match: *`. If we created it, try the lease
//!   once more: if that succeeds we are the holder (we delete our own marker before running,
//!   since our run covers it); if it fails, the holder will find the marker after its release.
//!   If the marker already existed, whoever created it is already bound to that same second look.
//!
//! **Dead holders.** A holder's trigger message is acknowledged only after its post-release
//! marker check, so if the holder dies its message is delivered again. A redelivered message
//! (dequeue count > 1) that finds the lease held does not trust the holder — it may be its own
//! dead earlier delivery, whose lease outlives it by up to a lease duration — so instead of
//! leaving a marker nobody may read, it enqueues a recheck that becomes visible only after a
//! lease duration (plus margin) has passed, when a dead holder's lease must have expired.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use leasehold_lock::{FlagPut, LeaseLock, LockKey, StoreResult};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::message::{TriggerKind, TriggerMessage};
use crate::queue::TriggerQueue;

/// Prefix of retrigger marker blobs.
pub const MARKER_PREFIX: &str = "retrigger/";

/// What the logic is told about its run.
#[derive(Debug, Clone)]
pub struct RunContext {
    pub scope: String,
    pub record_id: String,
    /// Strictly increasing per record; `None` when fencing is off.
    pub fencing_token: Option<u64>,
    /// Fires when the run must stop: lease lost, time limit, shutdown. Results produced after it
    /// fired are not acknowledged.
    pub cancel: CancellationToken,
    /// Delivery number of this trigger (1 = first).
    pub attempt: u32,
}

/// A failed run, with the reason that ends up in logs and, eventually, the poison queue.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct LogicError(pub String);

/// A record's logic.
#[async_trait]
pub trait Logic: Send + Sync + 'static {
    async fn run(&self, run: RunContext) -> Result<(), LogicError>;
}

/// Known-wrong protocol variants, kept so the simulation can prove it catches them. Never use
/// anything but `Correct` outside tests.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProtocolVariant {
    #[default]
    Correct,
    /// Check the marker *before* releasing the lease (the seed design's class of bug).
    CheckMarkerBeforeRelease,
    /// Acknowledge a redelivered trigger that finds the lease held (trusting a possibly dead holder).
    TrustHolderOnRedelivery,
}

/// How the runner behaves.
#[derive(Debug, Clone)]
pub struct RunnerOptions {
    /// A run longer than this is cancelled, its lease released and its trigger retried.
    /// Default 9 minutes: inside the Functions Consumption plan's 10-minute limit, with a
    /// minute left to release the lease and enqueue a retrigger.
    pub run_timeout: Duration,
    /// How long a cancelled run may take to stop before it is abandoned. Default 10 s.
    pub stop_grace: Duration,
    /// Delay of a recheck; must exceed the lease duration. Default: set from the lease options
    /// (duration + 5 s) by [`RecordRunner::new`].
    pub recheck_delay: Option<Duration>,
    #[doc(hidden)]
    pub variant: ProtocolVariant,
}

impl Default for RunnerOptions {
    fn default() -> Self {
        Self {
            run_timeout: Duration::from_secs(540),
            stop_grace: Duration::from_secs(10),
            recheck_delay: None,
            variant: ProtocolVariant::Correct,
        }
    }
}

/// One delivery of a trigger message.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub message: TriggerMessage,
    /// Dequeue count of this delivery (1 = first).
    pub dequeue_count: u32,
}

impl Delivery {
    /// Deliveries of this trigger so far, including those of messages it was carried over from.
    pub fn attempts(&self) -> u32 {
        self.message.prior_attempts + self.dequeue_count
    }
}

/// What became of a delivery, and so what to do with its message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The logic ran and succeeded under the lease. Acknowledge.
    Completed {
        fencing_token: Option<u64>,
        retriggered: bool,
        run_time: Duration,
    },
    /// A run was in progress; the marker is set and that run's holder will run once more.
    /// Acknowledge.
    Coalesced,
    /// A redelivery found the lease held; a recheck is enqueued. Acknowledge.
    Rechecking { after: Duration },
    /// The message can never succeed (its scope or record cannot be a key). Poison it now.
    Rejected { reason: String },
    /// The run failed, timed out, lost its lease, was cancelled, or storage failed. Do not
    /// acknowledge: the message is delivered again (and poisoned after too many deliveries).
    Failed { reason: String, retriggered: bool },
}

impl Outcome {
    /// Whether the trigger message may be deleted.
    pub fn acknowledge(&self) -> bool {
        matches!(
            self,
            Outcome::Completed { .. } | Outcome::Coalesced | Outcome::Rechecking { .. }
        )
    }

    /// A short name for logs.
    pub fn name(&self) -> &'static str {
        match self {
            Outcome::Completed { .. } => "completed",
            Outcome::Coalesced => "coalesced",
            Outcome::Rechecking { .. } => "rechecking",
            Outcome::Rejected { .. } => "rejected",
            Outcome::Failed { .. } => "failed",
        }
    }
}

/// Runs records' logic under their leases with the coalescing protocol.
#[derive(Debug, Clone)]
pub struct RecordRunner {
    lock: LeaseLock,
    queue: Arc<dyn TriggerQueue>,
    logic: Arc<dyn Logic>,
    options: RunnerOptions,
    recheck_delay: Duration,
}

impl std::fmt::Debug for dyn Logic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Logic")
    }
}

/// The lock key of a record: `<scope>/<record>`. Scope and record must each be one key segment.
pub fn record_key(scope: &str, record_id: &str) -> Result<LockKey, String> {
    if scope.contains('/') || record_id.contains('/') {
        return Err("scope and record id must not contain '/'".into());
    }
    LockKey::new(format!("{scope}/{record_id}")).map_err(|e| e.to_string())
}

/// The marker blob of a record key.
pub fn marker_blob_name(key: &LockKey) -> String {
    format!("{MARKER_PREFIX}{key}")
}

impl RecordRunner {
    pub fn new(
        lock: LeaseLock,
        queue: Arc<dyn TriggerQueue>,
        logic: Arc<dyn Logic>,
        options: RunnerOptions,
    ) -> Self {
        let recheck_delay = options
            .recheck_delay
            .unwrap_or(lock.options().duration + Duration::from_secs(5));
        Self {
            lock,
            queue,
            logic,
            options,
            recheck_delay,
        }
    }

    pub fn lock(&self) -> &LeaseLock {
        &self.lock
    }

    pub fn queue(&self) -> &Arc<dyn TriggerQueue> {
        &self.queue
    }

    /// Handles one delivery. `cancel` stops a run from outside (shutdown, or the message's
    /// visibility could not be kept); the trigger is then not acknowledged.
    pub async fn handle(&self, delivery: &Delivery, cancel: &CancellationToken) -> Outcome {
        let msg = &delivery.message;
        let key = match record_key(&msg.scope, &msg.record_id) {
            Ok(key) => key,
            Err(reason) => return Outcome::Rejected { reason },
        };
        let started = Instant::now();
        let outcome = self.handle_key(&key, delivery, cancel).await;
        let took = started.elapsed();
        match &outcome {
            Outcome::Completed {
                fencing_token,
                retriggered,
                run_time,
            } => tracing::info!(
                scope = %msg.scope, record = %msg.record_id, kind = ?msg.kind, attempt = delivery.dequeue_count,
                fencing_token = ?fencing_token, outcome = "completed", retriggered, run_ms = run_time.as_millis() as u64,
                total_ms = took.as_millis() as u64, "record run completed"
            ),
            Outcome::Failed { reason, retriggered } => tracing::warn!(
                scope = %msg.scope, record = %msg.record_id, kind = ?msg.kind, attempt = delivery.dequeue_count,
                outcome = "failed", retriggered, total_ms = took.as_millis() as u64, %reason, "record run failed; trigger will be retried"
            ),
            other => tracing::info!(
                scope = %msg.scope, record = %msg.record_id, kind = ?msg.kind, attempt = delivery.dequeue_count,
                outcome = other.name(), total_ms = took.as_millis() as u64, "trigger handled without a run"
            ),
        }
        outcome
    }

    async fn handle_key(&self, key: &LockKey, delivery: &Delivery, cancel: &CancellationToken) -> Outcome {
        match self.lock.try_acquire(key).await {
            Ok(Some(guard)) => return self.hold(key, delivery, guard, false, cancel).await,
            Ok(None) => {}
            Err(e) => return storage_failed("acquire", e),
        }

        // Contended. A redelivery may be looking at its own dead holder's lease: look again
        // once that lease must have expired instead of trusting it.
        if delivery.dequeue_count > 1 && self.options.variant != ProtocolVariant::TrustHolderOnRedelivery {
            let recheck = delivery
                .message
                .follow_up(TriggerKind::Recheck, delivery.attempts());
            return match self.enqueue(&recheck, self.recheck_delay).await {
                Ok(()) => Outcome::Rechecking {
                    after: self.recheck_delay,
                },
                Err(e) => storage_failed("enqueue recheck", e),
            };
        }

        let marker = marker_blob_name(key);
        match self.put_marker(&marker).await {
            Ok(FlagPut::AlreadySet) => Outcome::Coalesced,
            Ok(FlagPut::Created) => match self.lock.try_acquire(key).await {
                // The holder released between our two attempts and may already have looked at
                // the marker: we hold now, and our run covers the marker we set.
                Ok(Some(guard)) => self.hold(key, delivery, guard, true, cancel).await,
                Ok(None) => Outcome::Coalesced,
                Err(e) => storage_failed("acquire", e),
            },
            Err(e) => storage_failed("set retrigger marker", e),
        }
    }

    /// The holder path, from a granted lease to the acknowledgement decision.
    async fn hold(
        &self,
        key: &LockKey,
        delivery: &Delivery,
        guard: leasehold_lock::LeaseGuard,
        clear_own_marker: bool,
        cancel: &CancellationToken,
    ) -> Outcome {
        let marker = marker_blob_name(key);
        if clear_own_marker {
            let (cleared, retried) = self
                .marker_op("clear own marker", |store| store.delete_flag(&marker))
                .await;
            match cleared {
                // Our run would cover the marker we set, but it is gone: the previous holder's
                // post-release check consumed it and is bound to enqueue a retrigger that covers
                // this trigger. Running too would be one run more than needed, so stand down —
                // but as a holder: others may have found *our* lease held and set the marker
                // since, so release and check the marker like any holder.
                Ok(false) if !retried => {
                    if let Err(e) = guard.release().await {
                        return storage_failed("release lease", e);
                    }
                    return match self.take_marker_and_retrigger(&marker, delivery).await {
                        Ok(_) => Outcome::Coalesced,
                        Err(e) => storage_failed("check retrigger marker", e),
                    };
                }
                Ok(_) => {}
                Err(e) => {
                    let _ = guard.release().await;
                    return storage_failed("clear own marker", e);
                }
            }
        }
        let token = guard.fencing_token();
        let run_cancel = cancel.child_token();
        let ctx = RunContext {
            scope: delivery.message.scope.clone(),
            record_id: delivery.message.record_id.clone(),
            fencing_token: token,
            cancel: run_cancel.clone(),
            attempt: delivery.dequeue_count,
        };
        let started = Instant::now();
        let result = self.run_logic(ctx, &guard, &run_cancel, cancel).await;
        let run_time = started.elapsed();

        if self.options.variant == ProtocolVariant::CheckMarkerBeforeRelease {
            // WRONG on purpose: a trigger that sets the marker after this check and before the
            // release below is never seen by anyone.
            let retriggered = match self.take_marker_and_retrigger(&marker, delivery).await {
                Ok(r) => r,
                Err(e) => return storage_failed("check retrigger marker", e),
            };
            let _ = guard.release().await;
            return match result {
                Ok(()) => Outcome::Completed {
                    fencing_token: token,
                    retriggered,
                    run_time,
                },
                Err(reason) => Outcome::Failed { reason, retriggered },
            };
        }

        // Release first, then look at the marker: a trigger that finds the lease held has set
        // the marker before our release, so we see it; one that comes later finds the lease free.
        if let Err(e) = guard.release().await {
            // The lease stays until it expires; a trigger seeing it in that window would rely on
            // us. Not acknowledging makes our own message come back and look again.
            return storage_failed("release lease", e);
        }
        let retriggered = match self.take_marker_and_retrigger(&marker, delivery).await {
            Ok(r) => r,
            Err(e) => return storage_failed("check retrigger marker", e),
        };
        match result {
            Ok(()) => Outcome::Completed {
                fencing_token: token,
                retriggered,
                run_time,
            },
            Err(reason) => Outcome::Failed { reason, retriggered },
        }
    }

    /// Runs the logic until it ends, the lease is lost, the time limit passes or `outer` fires.
    async fn run_logic(
        &self,
        ctx: RunContext,
        guard: &leasehold_lock::LeaseGuard,
        run_cancel: &CancellationToken,
        outer: &CancellationToken,
    ) -> Result<(), String> {
        let lost = guard.lost();
        let logic = self.logic.clone();
        let mut run = std::pin::pin!(async move { logic.run(ctx).await });
        let stop_reason = tokio::select! {
           biased;
            result = &mut run => return result.map_err(|e| format!("logic failed: {e}")),
            _ = lost.cancelled() => "lease lost during the run".to_string(),
            _ = outer.cancelled() => "run cancelled (shutdown or message visibility lost)".to_string(),
            _ = tokio::time::sleep(self.options.run_timeout) => {
                format!("run exceeded its time limit of {:?}", self.options.run_timeout)
            }
        };
        run_cancel.cancel();
        if tokio::time::timeout(self.options.stop_grace, &mut run)
            .await
            .is_err()
        {
            tracing::warn!(grace = ?self.options.stop_grace, "logic did not stop within its grace period; abandoned");
        }
        Err(stop_reason)
    }

    /// Deletes the marker; if it was set, enqueues one retrigger. A delete whose answer was lost
    /// (a transient failure before a retry) may have removed a set marker: then we retrigger
    /// anyway, because an extra run is harmless and a lost trigger is not.
    async fn take_marker_and_retrigger(&self, marker: &str, delivery: &Delivery) -> StoreResult<bool> {
        let (was_set, retried) = self
            .marker_op("check retrigger marker", |store| store.delete_flag(marker))
            .await;
        if !was_set? && !retried {
            return Ok(false);
        }
        let retrigger = delivery.message.follow_up(TriggerKind::Retrigger, 0);
        self.enqueue(&retrigger, Duration::ZERO).await?;
        Ok(true)
    }

    /// Creates the marker. If an earlier attempt's answer was lost, "already set" may mean we set
    /// it, so it counts as created (we then make the second acquire attempt a setter owes).
    async fn put_marker(&self, marker: &str) -> StoreResult<FlagPut> {
        let (put, retried) = self
            .marker_op("set retrigger marker", |store| store.put_flag(marker))
            .await;
        let put = put?;
        Ok(if retried { FlagPut::Created } else { put })
    }

    /// Runs a marker operation with retries, and says whether it was retried: after a retry a
    /// definitive-looking answer ("not there", "already there") may describe our own earlier
    /// attempt, whose answer was lost.
    async fn marker_op<'a, T, F, Fut>(&'a self, what: &str, mut op: F) -> (StoreResult<T>, bool)
    where
        F: FnMut(&'a Arc<dyn leasehold_lock::LeaseStore>) -> Fut,
        Fut: std::future::Future<Output = StoreResult<T>>,
    {
        let mut attempts = 0u32;
        let store = self.lock.store();
        let result = self
            .lock
            .options()
            .retry
            .run(what, || {
                attempts += 1;
                op(store)
            })
            .await;
        (result, attempts > 1)
    }

    async fn enqueue(&self, message: &TriggerMessage, delay: Duration) -> StoreResult<()> {
        let body = message.encode();
        self.lock
            .options()
            .retry
            .run("enqueue", || self.queue.put(&body, delay))
            .await
    }
}

fn storage_failed(what: &str, e: impl std::fmt::Display) -> Outcome {
    Outcome::Failed {
        reason: format!("storage: {what}: {e}"),
        retriggered: false,
    }
}
