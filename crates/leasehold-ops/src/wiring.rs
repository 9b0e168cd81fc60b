//! The storage one deployment uses, wired: its trigger and poison queues, its lease lock and its
//! retrigger markers, sharing one set of round-trip counters. The application's modes and the
//! operator both stand on this.

use std::sync::Arc;

use anyhow::Result;
use leasehold_lock::azure::AzureBlobStore;
use leasehold_lock::{LeaseLock, LeaseOptions};
use leasehold_runtime::{
    AzureBudgets, AzureMarkers, AzureQueue, BudgetStore, HistoryStore, MarkerStore, TableHistory,
    TriggerQueue, low_queue_name, poison_queue_name,
};
use leasehold_storage::table::TableClient;
use leasehold_storage::{OpCounters, StorageAccount};

/// Where a deployment's state lives: the part of the application's settings that the
/// operator needs (`leasehold::Settings::storage` gives it).
#[derive(Debug, Clone)]
pub struct StorageSettings {
    /// The storage account (`AzureWebJobsStorage`).
    pub account: StorageAccount,
    /// The trigger queue (`LEASEHOLD_QUEUE`), the high lane; the low lane's is its name with
    /// `-low`, and each lane's poison queue its name with `-poison`.
    pub queue: String,
    /// The container of lock blobs and retrigger markers (`LEASEHOLD_CONTAINER`).
    pub container: String,
    /// The lease's duration, renewal and retries (`LEASEHOLD_LEASE_*`).
    pub lease: LeaseOptions,
    /// Where run history is kept (`None`: `LEASEHOLD_HISTORY=false`).
    pub history: Option<HistorySettings>,
}

/// Where a deployment's run history is kept, and for how long.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HistorySettings {
    /// The history tables' names start with this (`LEASEHOLD_HISTORY_TABLE`), then the date
    /// their period starts.
    pub table_prefix: String,
    /// How long history is kept and shown (`LEASEHOLD_HISTORY_DAYS`).
    pub keep: std::time::Duration,
}

/// Queues and lock from the settings, sharing one set of round-trip counters.
#[derive(Debug)]
pub struct Wiring {
    /// The high lane (`LEASEHOLD_QUEUE`) and its poison queue.
    pub queue: Arc<dyn TriggerQueue>,
    pub poison: Arc<dyn TriggerQueue>,
    /// The low lane (`<LEASEHOLD_QUEUE>-low`) and its poison queue (`…-low-poison`).
    pub low_queue: Arc<dyn TriggerQueue>,
    pub low_poison: Arc<dyn TriggerQueue>,
    pub lock: LeaseLock,
    pub markers: Arc<dyn MarkerStore>,
    /// The downstream budgets' shared pauses (blobs `budgets/<name>` in the container).
    pub budgets: Arc<dyn BudgetStore>,
    /// The run history, in the account's Table service (`None`: `LEASEHOLD_HISTORY=false`).
    pub history: Option<Arc<dyn HistoryStore>>,
    /// The round-trip counters all of the above record into.
    pub counters: OpCounters,
}

/// Wires the deployment `settings` name (no storage request is made).
pub fn wire(settings: &StorageSettings) -> Result<Wiring> {
    let counters = OpCounters::new();
    let store = Arc::new(AzureBlobStore::new(
        &settings.account,
        &settings.container,
        counters.clone(),
    ));
    let lock = LeaseLock::new(store, settings.lease.clone())?;
    let markers = Arc::new(AzureMarkers::new(
        &settings.account,
        &settings.container,
        counters.clone(),
    ));
    let budgets = Arc::new(AzureBudgets::new(
        &settings.account,
        &settings.container,
        counters.clone(),
    ));
    let history = match &settings.history {
        Some(h) => Some(Arc::new(
            TableHistory::new(
                TableClient::new(&settings.account, counters.clone())?,
                &h.table_prefix,
                h.keep,
            )
            .map_err(|e| anyhow::anyhow!("LEASEHOLD_HISTORY_TABLE: {e}"))?,
        ) as Arc<dyn HistoryStore>),
        None => None,
    };
    Ok(Wiring {
        markers,
        budgets,
        history,
        queue: Arc::new(AzureQueue::new(
            &settings.account,
            &settings.queue,
            counters.clone(),
        )),
        poison: Arc::new(AzureQueue::new(
            &settings.account,
            &poison_queue_name(&settings.queue),
            counters.clone(),
        )),
        low_queue: Arc::new(AzureQueue::new(
            &settings.account,
            &low_queue_name(&settings.queue),
            counters.clone(),
        )),
        low_poison: Arc::new(AzureQueue::new(
            &settings.account,
            &poison_queue_name(&low_queue_name(&settings.queue)),
            counters.clone(),
        )),
        lock,
        counters,
    })
}
