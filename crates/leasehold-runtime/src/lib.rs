#![doc = include_str!("../README.md")]

mod consumer;
mod message;
pub mod queue;
mod runner;
mod watchdog;

pub use consumer::{Consumer, ConsumerOptions, PoisonMessage, poison_queue_name};
pub use message::{DecodeError, TriggerKind, TriggerMessage};
pub use queue::{AzureQueue, Enqueued, MemoryQueue, Received, TriggerQueue};
#[cfg(feature = "testing")]
pub use runner::ProtocolVariant;
pub use runner::{
    Delivery, Logic, LogicError, MARKER_PREFIX, Outcome, RecordRunner, RunContext, RunnerOptions,
    WATCHDOG_MARGIN, marker_blob_name, record_key,
};
