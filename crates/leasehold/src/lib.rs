#![doc = include_str!("../README.md")]

mod app;
pub mod ops;
pub mod settings;

pub use app::{Application, Mode};
pub use settings::{LogicSetting, Settings};
