//! The harness the integration tests of `leasehold` share (each includes it with `mod common;`):
//! an isolated deployment's settings on the shared Azurite, the application run in-process, the
//! real binary run with a cleared environment, and small HTTP helpers.

// Each test binary uses only part of this.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use leasehold_lock::OpCounters;
use leasehold_runtime::AzureQueue;
use leasehold_test_support::{Azurite, eventually, unique_name};
use serde_json::Value;
use tokio::process::Command;

/// The `leasehold` binary Cargo built for these tests.
pub const BIN: &str = env!("CARGO_BIN_EXE_leasehold");

/// A new, empty directory of its own under the system's temporary directory.
pub fn scratch_dir(prefix: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(unique_name(prefix));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// One isolated deployment on the shared Azurite: its own trigger queue and lock container, and
/// a scratch directory (`leasehold-<test file>-…`). A test file adds the methods it needs.
pub struct Env {
    pub queue: String,
    pub container: String,
    pub dir: PathBuf,
}

impl Env {
    pub fn new() -> Self {
        Self {
            queue: unique_name("triggers"),
            container: unique_name("locks"),
            dir: scratch_dir(concat!("leasehold-", env!("CARGO_CRATE_NAME"))),
        }
    }
}

/// The mode the tests run `serve` in: its port from the settings, the logic from them too.
pub fn standalone() -> leasehold::Mode {
    leasehold::Mode::Standalone {
        port: None,
        demo: false,
    }
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
    /// The health listener's port (`LEASEHOLD_HEALTH_PORT`).
    pub health_port: Option<u16>,
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
        let health_port = app.health_port();
        assert_ne!(port, 0);
        let stop = tokio_util::sync::CancellationToken::new();
        let task = tokio::spawn(app.run_until_stopped(stop.clone()));
        Self {
            port,
            health_port,
            stop,
            task,
        }
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

/// `program` with `args`, nothing of this process's environment but `PATH`, no stdin, and
/// killed when dropped; its settings and where its output goes are the caller's.
pub fn command(program: impl AsRef<OsStr>, args: &[&str]) -> Command {
    let mut cmd = Command::new(program);
    cmd.args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .stdin(Stdio::null())
        .kill_on_drop(true);
    cmd
}

/// The `leasehold` binary as [`command`].
pub fn leasehold(args: &[&str]) -> Command {
    command(BIN, args)
}

/// The port `serve` logs it listens on (`addr=127.0.0.1:N` in text, `"addr":"127.0.0.1:N"` in
/// JSON), once the whole number is written (something follows it).
pub fn logged_port(log: &str) -> Option<u16> {
    let at = ["addr=127.0.0.1:", "\"addr\":\"127.0.0.1:"]
        .iter()
        .find_map(|p| log.find(p).map(|i| i + p.len()))?;
    let rest = &log[at..];
    rest[..rest.find(|c: char| !c.is_ascii_digit())?].parse().ok()
}

/// Waits (30 s at most) for `serve` to log its port in the file `log`.
pub async fn serve_port(log: &Path) -> u16 {
    eventually(Duration::from_secs(30), "serve to log its address", || async {
        logged_port(&std::fs::read_to_string(log).unwrap_or_default())
    })
    .await
}

/// Waits (30 s at most) until a GET of `url` succeeds.
pub async fn answers(url: &str, what: &str) {
    let client = reqwest::Client::new();
    eventually(Duration::from_secs(30), what, || async {
        client
            .get(url)
            .send()
            .await
            .ok()
            .filter(|r| r.status().is_success())
            .map(|_| ())
    })
    .await;
}

/// A queue on the shared Azurite.
pub fn queue(name: &str) -> AzureQueue {
    AzureQueue::new(&Azurite::shared().account(), name, OpCounters::new())
}

/// `GET url` with `headers`.
pub async fn get(url: &str, headers: &[(&str, &str)]) -> reqwest::Response {
    let mut request = reqwest::Client::new().get(url);
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    request.send().await.unwrap()
}

/// `POST url` of `body` with `headers`: the status, and the answer's JSON (`Null` if none).
pub async fn post(url: &str, body: &str, headers: &[(&str, &str)]) -> (u16, Value) {
    let mut request = reqwest::Client::new().post(url).body(body.to_string());
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}
