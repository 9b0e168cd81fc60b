#![doc = include_str!("../README.md")]

mod consumer;
mod message;
pub mod queue;
mod runner;

pub use consumer::{Consumer, ConsumerOptions, PoisonMessage, poison_queue_name};
pub use message::{DecodeError, TriggerKind, TriggerMessage};
pub use queue::{AzureQueue, MemoryQueue, Received, TriggerQueue};
pub use runner::{
    Delivery, Logic, LogicError, MARKER_PREFIX, Outcome, ProtocolVariant, RecordRunner, RunContext,
    RunnerOptions, marker_blob_name, record_key,
};
