#![doc = include_str!("../README.md")]

mod account;
mod auth;
pub mod azure;
mod counters;
mod error;
mod retry;
pub mod table;

pub use account::{
    EMULATOR_ACCOUNT, EMULATOR_KEY, InvalidConnectionString, InvalidIdentitySettings, Service, StorageAccount,
};
pub use counters::{Op, OpCounters, OpCounts};
pub use error::{StoreError, StoreErrorKind, StoreResult, redact};
pub use retry::RetryOptions;
