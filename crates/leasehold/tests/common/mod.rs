//! The harness the integration tests of `leasehold` share (each includes it with `mod common;`):
//! an isolated deployment's settings on the shared Azurite, the application run in-process, the
//! real binary run with a cleared environment, and small HTTP helpers.

// Each test binary uses only part of this.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use leasehold_test_support::{Azurite, unique_name};

/// The `leasehold` binary Cargo built for these tests.
pub const BIN: &str = env!("CARGO_BIN_EXE_leasehold");

/// A new, empty directory of its own under the system's temporary directory.
pub fn scratch_dir(prefix: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(unique_name(prefix));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The settings of a deployment on the shared Azurite with its own trigger queue and lock
/// container.
pub fn storage_vars(queue: &str, container: &str) -> Vec<(String, String)> {
    vec![
        (
            "AzureWebJobsStorage".into(),
            Azurite::shared().connection_string(),
        ),
        ("LEASEHOLD_QUEUE".into(), queue.into()),
        ("LEASEHOLD_CONTAINER".into(), container.into()),
    ]
}

/// [`storage_vars`] and what a serving deployment needs in a test: any free port
/// (`LEASEHOLD_PORT` 0, no port chosen in advance to race for) and polling every second at most.
pub fn serve_vars(queue: &str, container: &str) -> Vec<(String, String)> {
    let mut vars = storage_vars(queue, container);
    vars.push(("LEASEHOLD_PORT".into(), "0".into()));
    vars.push(("LEASEHOLD_POLL_MAX_SECONDS".into(), "1".into()));
    vars
}

/// `vars` and then `extra`: later values win, as they do in an environment.
pub fn with<V: AsRef<str>>(vars: Vec<(String, String)>, extra: &[(&str, V)]) -> BTreeMap<String, String> {
    let mut vars: BTreeMap<_, _> = vars.into_iter().collect();
    vars.extend(extra.iter().map(|(k, v)| (k.to_string(), v.as_ref().to_string())));
    vars
}

/// Builds the application as the binary would, logic commands supervised by the real binary.
pub async fn build(
    settings: leasehold::Settings,
    mode: leasehold::Mode,
) -> anyhow::Result<leasehold::Application> {
    leasehold::Application::build_with_supervisor(settings, mode, Some(BIN.into())).await
}

/// The application running in this test process (port 0: no port chosen in advance). Stopped
/// by [`Running::stop`]; told to stop when dropped too (a failed test).
pub struct Running {
    pub port: u16,
    stop: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Running {
    /// [`build`]s and runs the application.
    pub async fn start(settings: leasehold::Settings, mode: leasehold::Mode) -> Self {
        Self::run(build(settings, mode).await.unwrap())
    }

    /// Runs an application built by the test.
    pub fn run(app: leasehold::Application) -> Self {
        let port = app.port();
        assert_ne!(port, 0);
        let stop = tokio_util::sync::CancellationToken::new();
        let task = tokio::spawn(app.run_until_stopped(stop.clone()));
        Self { port, stop, task }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// Stops it as SIGTERM would and waits (30 s at most) until it has handed its work back;
    /// returns how long that took.
    pub async fn stop(mut self) -> Duration {
        let from = Instant::now();
        self.stop.cancel();
        tokio::time::timeout(Duration::from_secs(30), &mut self.task)
            .await
            .expect("the application did not stop within 30 s")
            .unwrap()
            .unwrap();
        from.elapsed()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
