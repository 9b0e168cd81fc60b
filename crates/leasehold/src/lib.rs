//! The Leasehold application as a library: the binary (`src/main.rs`) only parses the command
//! line, sets up logging and signals, and calls into this.
//!
//! - [`Application`]: the long-running modes. [`Application::build`] binds the listener and
//!   wires storage, lock, runner and logic from [`Settings`]; [`Application::port`] says where it
//!   listens (port 0 picks a free one, which is how the end-to-end tests run it in-process);
//!   [`Application::run_until_stopped`] serves until its shutdown token fires, then hands back
//!   in-flight work.
//! - [`ops`]: the one-shot operator commands (`enqueue`, `status`, `break`).
//! - [`settings`]: every setting, read from the environment with the names Azure Functions
//!   users know.

mod app;
pub mod ops;
pub mod settings;

pub use app::{Application, Mode};
pub use settings::{LogicSetting, Settings};
