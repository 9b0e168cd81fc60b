#![doc = include_str!("../README.md")]

mod error;
pub mod handler;
pub mod http;
pub mod logic;
pub mod start;

pub use error::Error;
