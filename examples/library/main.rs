//! Leasehold as a Rust library: your logic in your own program, with Leasehold's lock, runner
//! and queue consumer around it, on Azure Storage (or Azurite).
//!
//! ```text
//! AzureWebJobsStorage=UseDevelopmentStorage=true cargo run -p leasehold --example library
//! leasehold enqueue --scope account 42        # in another terminal: "synced account/42 …"
//! ```
//!
//! The queue, container and poison queue are the executable's defaults, so `leasehold enqueue`,
//! `leasehold status` and `leasehold poison` work on this program's records too.

use std::sync::Arc;

use async_trait::async_trait;
use leasehold_lock::azure::AzureBlobStore;
use leasehold_lock::{LeaseLock, LeaseOptions, OpCounters};
use leasehold_runtime::{
    AzureMarkers, AzureQueue, Consumer, ConsumerOptions, Logic, LogicError, RecordRunner, RunContext,
    RunnerOptions, poison_queue_name,
};
use leasehold_storage::StorageAccount;
use tokio_util::sync::CancellationToken;

/// A record's logic. Leasehold runs it under the record's lease: never two runs of one record at
/// once, one follow-up run for a burst of triggers, a retry (then the poison queue) on an error.
#[derive(Debug)]
pub struct SyncToErp {
    /// Where each run is reported (a real logic would write to the ERP instead).
    pub done: tokio::sync::mpsc::UnboundedSender<String>,
}

#[async_trait]
impl Logic for SyncToErp {
    async fn run(&self, run: RunContext) -> Result<(), LogicError> {
        // Send `run.fencing_token` with every write, so a store that checks it refuses a holder
        // whose lease was lost; stop early when `run.cancel` fires.
        let token = run.fencing_token.unwrap_or_default();
        tokio::select! {
            _ = run.cancel.cancelled() => return Err(LogicError::new("stopped: the lease was lost or we are shutting down")),
            _ = tokio::time::sleep(std::time::Duration::from_millis(100)) => {}
        }
        let line = format!(
            "synced {}/{} with fencing token {token}, attempt {}",
            run.scope, run.record_id, run.attempt
        );
        println!("{line}");
        self.done
            .send(line)
            .map_err(|_| LogicError::new("nobody is listening"))
    }
}

/// Consumes `queue` (and locks in `container`) of the account in `connection_string` with
/// `logic` until `stop` fires.
pub async fn serve(
    connection_string: &str,
    queue: &str,
    container: &str,
    logic: Arc<dyn Logic>,
    stop: CancellationToken,
) -> Result<(), Box<dyn std::error::Error>> {
    let account = StorageAccount::from_connection_string(connection_string)?;
    // One set of counters: every storage round trip of the three, counted together.
    let counters = OpCounters::new();
    let lock = LeaseLock::new(
        Arc::new(AzureBlobStore::new(&account, container, counters.clone())),
        LeaseOptions::default(),
    )?;
    let markers = Arc::new(AzureMarkers::new(&account, container, counters.clone()));
    let triggers = Arc::new(AzureQueue::new(&account, queue, counters.clone()));
    let poison = Arc::new(AzureQueue::new(&account, &poison_queue_name(queue), counters));
    let runner = RecordRunner::new(lock, markers, triggers, logic, RunnerOptions::default());
    Consumer::new(runner, poison, ConsumerOptions::default())
        .run(stop)
        .await;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let connection = std::env::var("AzureWebJobsStorage")
        .map_err(|_| "set AzureWebJobsStorage (UseDevelopmentStorage=true for Azurite)")?;
    let (done, mut reports) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move { while reports.recv().await.is_some() {} });
    let stop = CancellationToken::new();
    let on_ctrl_c = stop.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        on_ctrl_c.cancel();
    });
    serve(
        &connection,
        "leasehold-triggers",
        "leasehold-locks",
        Arc::new(SyncToErp { done }),
        stop,
    )
    .await
}
