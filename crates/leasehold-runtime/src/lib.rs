#![doc = include_str!("../README.md")]

mod budget;
mod consumer;
mod error;
mod flow;
mod history;
mod markers;
mod message;
pub mod observe;
mod outcome;
mod poison;
pub mod protocol;
mod queue;
mod record;
mod runner;
mod slot;
#[cfg(feature = "testing")]
pub mod testing;
pub mod trace;
mod watchdog;

pub use budget::{
    Admission, AzureBudgets, BUDGET_PREFIX, BadBudgetName, BudgetOptions, BudgetPermit, BudgetStore,
    BudgetView, Budgets, DEFAULT_BUDGET, HeldBy, Lane, MAX_LIMIT_TURN, MemoryBudgets, SharedPause, Waiting,
    check_budget_name,
};
pub use consumer::{Consumer, ConsumerOptions, low_queue_name, poison_queue_name};
pub use error::{Error, LogicError};
pub use flow::{PerScope, PerScopeError};
pub use history::{
    BadHistoryPrefix, HISTORY_DROPPED_TOTAL, HISTORY_FAILURES_TOTAL, HISTORY_WRITTEN_TOTAL, History,
    HistoryEntry, HistoryEvent, HistoryOptions, HistoryStore, LISTING_KEPT, MAX_HISTORY_DAYS,
    MAX_HISTORY_PREFIX_LEN, MAX_REASON_CHARS, MemoryHistory, RECENT_MAX_ENTITIES, RECENT_MAX_REQUESTS,
    RECENT_MAX_TIME, Recent, RecentQuery, TableHistory, bounded_reason,
};
pub use markers::{
    AzureMarkers, MARKER_PREFIX, MarkerSet, MarkerStore, MemoryMarkers, RecordStatus, WAIT_PREFIX,
    WaitConsumed, record_status,
};
pub use message::{DecodeError, Deferral, MAX_CORRELATION_ID_LEN, TriggerKind, TriggerMessage, Wait};
pub use observe::{OutcomeLabel, OutcomeSink, record_outcome};
pub use outcome::Outcome;
pub use poison::PoisonMessage;
pub use queue::{AzureQueue, Enqueued, MAX_MESSAGE_BYTES, MemoryQueue, Peeked, Received, TriggerQueue};
pub use record::{Field, InvalidName, MAX_RECORD_ID_LEN, MAX_SCOPE_LEN, RecordId, Scope, record_key};
#[cfg(feature = "testing")]
pub use runner::ProtocolVariant;
pub use runner::{
    CARRIER_MARGIN, Debounce, Delivery, Logic, RecordRunner, RunContext, RunPolicy, RunnerOptions,
    SUPERSEDED_NOTE, WATCHDOG_MARGIN, superseded_streak,
};
