//! The record logic Leasehold runs: a shell command (`LEASEHOLD_LOGIC_COMMAND`), an HTTP POST
//! (`LEASEHOLD_LOGIC_URL`), or a demo for local runs. Each is stopped when the run is cancelled
//! (lease lost, time limit, shutdown). Rust users implement `leasehold_runtime::Logic` directly.

use std::process::Stdio;
use std::time::Duration;

use async_trait::async_trait;
use leasehold_runtime::{Logic, LogicError, RunContext};
use tokio::io::AsyncReadExt;

/// How long a cancelled command gets between SIGTERM and SIGKILL.
pub const TERMINATE_GRACE: Duration = Duration::from_secs(5);
/// Bytes of a failed command's stderr kept for the failure reason.
const STDERR_TAIL: usize = 2048;

/// Runs `sh -c <command>` per record with `LEASEHOLD_SCOPE`, `LEASEHOLD_RECORD_ID`,
/// `LEASEHOLD_FENCING_TOKEN` (empty when fencing is off) and `LEASEHOLD_ATTEMPT` in its
/// environment. Exit 0 is success. On cancellation it gets SIGTERM, then SIGKILL after 5 s.
#[derive(Debug, Clone)]
pub struct CommandLogic {
    command: String,
}

impl CommandLogic {
    pub fn new(command: impl Into<String>) -> Self {
        Self {
            command: command.into(),
        }
    }
}

#[async_trait]
impl Logic for CommandLogic {
    async fn run(&self, ctx: RunContext) -> Result<(), LogicError> {
        let mut child = tokio::process::Command::new("sh")
            .arg("-c")
            .arg(&self.command)
            .env("LEASEHOLD_SCOPE", &ctx.scope)
            .env("LEASEHOLD_RECORD_ID", &ctx.record_id)
            .env(
                "LEASEHOLD_FENCING_TOKEN",
                ctx.fencing_token.map(|t| t.to_string()).unwrap_or_default(),
            )
            .env("LEASEHOLD_ATTEMPT", ctx.attempt.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::inherit())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| LogicError(format!("could not start the logic command: {e}")))?;
        let mut stderr = child.stderr.take().expect("stderr is piped");
        let collect = async move {
            let mut buf = Vec::new();
            let _ = stderr.read_to_end(&mut buf).await;
            buf
        };
        let collector = tokio::spawn(collect);
        let status = tokio::select! {
            biased;
            status = child.wait() => status,
            _ = ctx.cancel.cancelled() => {
                terminate(&mut child).await;
                return Err(LogicError("the logic command was terminated (run cancelled)".into()));
            }
        };
        let stderr = collector.await.unwrap_or_default();
        let status = status.map_err(|e| LogicError(format!("waiting for the logic command: {e}")))?;
        if status.success() {
            return Ok(());
        }
        let tail = String::from_utf8_lossy(&stderr[stderr.len().saturating_sub(STDERR_TAIL)..])
            .trim()
            .to_string();
        let code = status
            .code()
            .map_or_else(|| "a signal".to_string(), |c| format!("code {c}"));
        Err(LogicError(if tail.is_empty() {
            format!("the logic command exited with {code}")
        } else {
            format!("the logic command exited with {code}: {tail}")
        }))
    }
}

/// SIGTERM (through `kill`, so no unsafe code), then SIGKILL if it has not exited in time.
async fn terminate(child: &mut tokio::process::Child) {
    if let Some(pid) = child.id() {
        let _ = tokio::process::Command::new("kill")
            .arg("-TERM")
            .arg(pid.to_string())
            .status()
            .await;
        if tokio::time::timeout(TERMINATE_GRACE, child.wait()).await.is_ok() {
            return;
        }
    }
    let _ = child.kill().await;
}

/// POSTs `{"scope", "recordId", "fencingToken", "attempt"}` to a URL per record (the fencing
/// token also as the `x-leasehold-fencing-token` header). Any 2xx is success. On cancellation the
/// request is abandoned (the connection is closed).
#[derive(Debug, Clone)]
pub struct UrlLogic {
    url: reqwest::Url,
    client: reqwest::Client,
}

impl UrlLogic {
    pub fn new(url: &str, timeout: Duration) -> Result<Self, String> {
        let url = reqwest::Url::parse(url).map_err(|e| format!("not a URL: {e}"))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err("the URL must be http or https".into());
        }
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .map_err(|e| e.to_string())?;
        Ok(Self { url, client })
    }
}

#[async_trait]
impl Logic for UrlLogic {
    async fn run(&self, ctx: RunContext) -> Result<(), LogicError> {
        let body = serde_json::json!({
            "scope": ctx.scope,
            "recordId": ctx.record_id,
            "fencingToken": ctx.fencing_token,
            "attempt": ctx.attempt,
        });
        let mut request = self.client.post(self.url.clone()).json(&body);
        if let Some(token) = ctx.fencing_token {
            request = request.header("x-leasehold-fencing-token", token.to_string());
        }
        let response = tokio::select! {
            biased;
            _ = ctx.cancel.cancelled() => return Err(LogicError("the logic request was abandoned (run cancelled)".into())),
            r = request.send() => r,
        };
        // Only the host and path are named: a query string may hold a key.
        let target = format!("{}{}", self.url.host_str().unwrap_or(""), self.url.path());
        let response =
            response.map_err(|e| LogicError(format!("logic URL {target}: {}", e.without_url())))?;
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        let text = response.text().await.unwrap_or_default();
        let snippet: String = text.chars().take(500).collect();
        Err(LogicError(format!(
            "logic URL {target} answered {status}: {snippet}"
        )))
    }
}

/// For local runs: logs the record and waits a few seconds (honouring cancellation).
#[derive(Debug, Clone)]
pub struct DemoLogic {
    pub duration: Duration,
}

#[async_trait]
impl Logic for DemoLogic {
    async fn run(&self, ctx: RunContext) -> Result<(), LogicError> {
        tracing::info!(scope = %ctx.scope, record = %ctx.record_id, fencing_token = ?ctx.fencing_token,
            "demo logic: working on the record for {:?}", self.duration);
        tokio::select! {
            biased;
            _ = ctx.cancel.cancelled() => Err(LogicError("demo logic cancelled".into())),
            _ = tokio::time::sleep(self.duration) => Ok(()),
        }
    }
}
