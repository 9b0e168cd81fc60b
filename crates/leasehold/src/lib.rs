#![doc = include_str!("../README.md")]

pub mod admin;
mod app;
#[cfg(unix)]
pub mod init;
pub mod recent;
mod server;
pub mod settings;
pub mod telemetry;
pub mod traces;

pub use app::{Application, Mode};
pub use recent::{RecentOutcome, recent_outcome, recent_outcomes};
pub use server::{HttpOptions, MAX_HEADER_BYTES, MAX_REQUESTS_PER_CONNECTION};
pub use settings::{LogicSetting, Settings};
