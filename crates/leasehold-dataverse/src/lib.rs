#![doc = include_str!("../README.md")]

mod client;
mod command;
pub mod context;
mod credential;
mod register;

pub use client::{RetryPolicy, WebApi, check_url, environment_url};
pub use command::{DataverseCommand, run};
pub use credential::{Credential, TOKEN_VAR};
pub use register::*;
