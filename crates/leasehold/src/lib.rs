#![doc = include_str!("../README.md")]

pub mod admin;
mod app;
pub mod dataverse;
pub mod ops;
mod server;
pub mod settings;

pub use app::{Application, Mode};
pub use server::{HttpOptions, MAX_HEADER_BYTES};
pub use settings::{LogicSetting, Settings};
