//! A headless Chromium driven over the DevTools protocol, for tests of the dashboard page in a
//! real browser: navigate, evaluate JavaScript, take screenshots.
//!
//! Chromium is Debian's `chromium` package (`/usr/bin/chromium`, `LEASEHOLD_CHROMIUM`
//! overrides), installed by `scripts/install-chromium.sh` (which `scripts/test.sh` runs). It is
//! started with a fresh profile in a temporary directory and `--remote-debugging-port=0`; the
//! port it chose is read from `<profile>/DevToolsActivePort`, and one WebSocket is opened to
//! its first page target. Dropping the [`Browser`] kills the process and removes the profile.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio::net::TcpStream as AsyncTcpStream;
use tokio::sync::Mutex;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

/// The install command named in failure messages.
pub const CHROMIUM_INSTALL_HINT: &str = "scripts/install-chromium.sh (apt-get install chromium)";

type Socket = WebSocketStream<MaybeTlsStream<AsyncTcpStream>>;

/// What went wrong driving the browser, said in words (for a test's failure message).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrowserError(pub String);

impl std::fmt::Display for BrowserError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BrowserError {}

impl From<String> for BrowserError {
    fn from(text: String) -> Self {
        BrowserError(text)
    }
}

impl From<&str> for BrowserError {
    fn from(text: &str) -> Self {
        BrowserError(text.to_string())
    }
}

/// A running headless Chromium and a DevTools connection to its page.
#[derive(Debug)]
pub struct Browser {
    child: Child,
    profile: PathBuf,
    socket: Mutex<Socket>,
    next_id: std::sync::atomic::AtomicU64,
    /// Uncaught exceptions the page threw (`Runtime.exceptionThrown`), as seen so far.
    exceptions: std::sync::Mutex<Vec<String>>,
}

impl Browser {
    /// Path of the Chromium executable (`LEASEHOLD_CHROMIUM` overrides `/usr/bin/chromium`).
    pub fn executable() -> PathBuf {
        std::env::var_os("LEASEHOLD_CHROMIUM")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/usr/bin/chromium"))
    }

    /// Starts Chromium headless on `about:blank` with a window of `width` × `height` CSS
    /// pixels and connects to its page.
    pub async fn launch(width: u32, height: u32) -> Result<Browser, BrowserError> {
        let exe = Self::executable();
        if !exe.exists() {
            return Err(format!(
                "Chromium is not installed at {}. Install it with: {CHROMIUM_INSTALL_HINT}",
                exe.display()
            )
            .into());
        }
        let profile = std::env::temp_dir().join(format!(
            "leasehold-chromium-{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&profile).map_err(|e| format!("creating {}: {e}", profile.display()))?;
        let log = std::fs::File::create(profile.join("chromium.log")).map_err(|e| e.to_string())?;
        let child = Command::new(&exe)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-extensions",
                "--mute-audio",
                "--hide-scrollbars",
                "--remote-debugging-port=0",
                "--remote-debugging-address=127.0.0.1",
            ])
            .arg(format!("--window-size={width},{height}"))
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log)
            .spawn()
            .map_err(|e| {
                format!(
                    "starting {}: {e}. Install it with: {CHROMIUM_INSTALL_HINT}",
                    exe.display()
                )
            })?;
        // From here the guard kills it, whatever fails next.
        let mut guard = Guard {
            child: Some(child),
            profile: profile.clone(),
        };
        let port = wait_for_port(&mut guard, &profile, Duration::from_secs(30))?;
        let ws_url = page_target(port, Duration::from_secs(10))?;
        let (socket, _) = tokio_tungstenite::connect_async(ws_url.as_str())
            .await
            .map_err(|e| format!("connecting to Chromium's DevTools at {ws_url}: {e}"))?;
        let browser = Browser {
            child: guard.child.take().expect("the child is there"),
            profile,
            socket: Mutex::new(socket),
            next_id: 1.into(),
            exceptions: std::sync::Mutex::new(Vec::new()),
        };
        browser.call("Page.enable", json!({})).await?;
        browser.call("Runtime.enable", json!({})).await?;
        Ok(browser)
    }

    /// Sends a DevTools command and returns its `result` (events in between are skipped).
    pub async fn call(&self, method: &str, params: Value) -> Result<Value, BrowserError> {
        let id = self.next_id.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let mut socket = self.socket.lock().await;
        let text = json!({ "id": id, "method": method, "params": params }).to_string();
        socket
            .send(Message::text(text))
            .await
            .map_err(|e| format!("DevTools {method}: sending: {e}"))?;
        let answer = tokio::time::timeout(Duration::from_secs(60), async {
            while let Some(message) = socket.next().await {
                let message = message.map_err(|e| BrowserError(format!("DevTools {method}: {e}")))?;
                let Message::Text(text) = message else { continue };
                let value: Value = serde_json::from_str(&text)
                    .map_err(|e| BrowserError(format!("DevTools {method}: {e}: {text}")))?;
                if value["id"].as_u64() == Some(id) {
                    return Ok(value);
                }
                if value["method"] == "Runtime.exceptionThrown" {
                    let details = &value["params"]["exceptionDetails"];
                    let text = details["exception"]["description"]
                        .as_str()
                        .or_else(|| details["text"].as_str())
                        .unwrap_or("an exception");
                    self.exceptions
                        .lock()
                        .expect("not poisoned")
                        .push(text.to_string());
                }
            }
            Err(BrowserError(format!(
                "DevTools {method}: the browser closed the connection"
            )))
        })
        .await
        .map_err(|_| format!("DevTools {method}: no answer within 60 s"))??;
        if let Some(error) = answer.get("error") {
            return Err(format!("DevTools {method} failed: {error}").into());
        }
        Ok(answer["result"].clone())
    }

    /// Navigates to `url` and waits until its document has loaded.
    pub async fn navigate(&self, url: &str) -> Result<(), BrowserError> {
        let result = self.call("Page.navigate", json!({ "url": url })).await?;
        if let Some(error) = result.get("errorText").and_then(Value::as_str) {
            return Err(format!("navigating to {url}: {error}").into());
        }
        self.wait_for(
            "document.readyState === 'complete'",
            Duration::from_secs(30),
            &format!("{url} to load"),
        )
        .await
        .map(|_| ())
    }

    /// Evaluates `expression` in the page (a promise is awaited) and returns its value.
    pub async fn eval(&self, expression: &str) -> Result<Value, BrowserError> {
        let result = self
            .call(
                "Runtime.evaluate",
                json!({ "expression": expression, "awaitPromise": true, "returnByValue": true }),
            )
            .await?;
        if let Some(exception) = result.get("exceptionDetails") {
            let text = exception["exception"]["description"]
                .as_str()
                .or_else(|| exception["text"].as_str())
                .unwrap_or("an exception");
            return Err(format!("evaluating {expression:?}: {text}").into());
        }
        Ok(result["result"]["value"].clone())
    }

    /// Evaluates `expression` until it is truthy (not `false`, `null`, `0` or `""`) and returns
    /// that value; fails naming `what` after `limit`.
    pub async fn wait_for(
        &self,
        expression: &str,
        limit: Duration,
        what: &str,
    ) -> Result<Value, BrowserError> {
        let deadline = tokio::time::Instant::now() + limit;
        let mut last;
        loop {
            match self.eval(expression).await {
                Ok(v) if truthy(&v) => return Ok(v),
                Ok(v) => last = v,
                Err(e) => last = Value::String(e.0),
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(format!("timed out after {limit:?} waiting for {what} (last: {last})").into());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A PNG of the whole page (its full height, at the window's width).
    pub async fn screenshot(&self) -> Result<Vec<u8>, BrowserError> {
        let metrics = self.call("Page.getLayoutMetrics", json!({})).await?;
        let size = &metrics["cssContentSize"];
        let (width, height) = (
            size["width"].as_f64().unwrap_or(1280.0),
            size["height"].as_f64().unwrap_or(800.0),
        );
        let result = self
            .call(
                "Page.captureScreenshot",
                json!({
                    "format": "png",
                    "captureBeyondViewport": true,
                    "clip": { "x": 0, "y": 0, "width": width, "height": height, "scale": 1 },
                }),
            )
            .await?;
        let data = result["data"].as_str().ok_or("no screenshot data")?;
        base64::engine::general_purpose::STANDARD
            .decode(data)
            .map_err(|e| format!("screenshot: {e}").into())
    }

    /// Saves [`screenshot`](Self::screenshot) to `path` (its folder is created).
    pub async fn save_screenshot(&self, path: &Path) -> Result<(), BrowserError> {
        let png = self.screenshot().await?;
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        }
        std::fs::write(path, png).map_err(|e| format!("writing {}: {e}", path.display()).into())
    }

    /// Answers the page's next `confirm()` / `alert()` with `accept`.
    pub async fn answer_dialogs(&self, accept: bool) -> Result<(), BrowserError> {
        // Overriding in the page is simpler than waiting for the dialog event over the socket.
        self.eval(&format!(
            "window.confirm = () => {accept}; window.alert = () => undefined; true"
        ))
        .await
        .map(|_| ())
    }

    /// The uncaught exceptions the page threw so far (seen while commands were answered).
    pub fn exceptions(&self) -> Vec<String> {
        self.exceptions.lock().expect("not poisoned").clone()
    }

    /// The browser's log (stdout and stderr), for failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.profile.join("chromium.log")).unwrap_or_default()
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

/// Kills a Chromium that did not get as far as a [`Browser`].
struct Guard {
    child: Option<Child>,
    profile: PathBuf,
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
            let _ = std::fs::remove_dir_all(&self.profile);
        }
    }
}

fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(_) | Value::Object(_) => true,
    }
}

/// The DevTools port Chromium chose, from `<profile>/DevToolsActivePort` (first line).
fn wait_for_port(guard: &mut Guard, profile: &Path, limit: Duration) -> Result<u16, String> {
    let deadline = Instant::now() + limit;
    let file = profile.join("DevToolsActivePort");
    loop {
        if let Some(port) = std::fs::read_to_string(&file)
            .ok()
            .and_then(|t| t.lines().next().and_then(|l| l.trim().parse::<u16>().ok()))
        {
            return Ok(port);
        }
        let child = guard.child.as_mut().expect("the child is there");
        if let Ok(Some(status)) = child.try_wait() {
            let log = std::fs::read_to_string(profile.join("chromium.log")).unwrap_or_default();
            return Err(format!(
                "Chromium exited ({status}) before it listened. Its log:\n{log}"
            ));
        }
        if Instant::now() >= deadline {
            let log = std::fs::read_to_string(profile.join("chromium.log")).unwrap_or_default();
            return Err(format!(
                "Chromium wrote no DevToolsActivePort within {limit:?}. Its log:\n{log}"
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The WebSocket URL of the first page target (`GET /json/list`).
fn page_target(port: u16, limit: Duration) -> Result<String, String> {
    let deadline = Instant::now() + limit;
    loop {
        let targets = http_get(port, "/json/list")
            .and_then(|body| serde_json::from_str::<Value>(&body).map_err(|e| e.to_string()));
        if let Ok(Value::Array(targets)) = &targets
            && let Some(url) = targets
                .iter()
                .find(|t| t["type"] == "page")
                .and_then(|t| t["webSocketDebuggerUrl"].as_str())
        {
            return Ok(url.to_string());
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "Chromium listed no page target within {limit:?}: {targets:?}"
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A plain HTTP/1.1 GET on 127.0.0.1 (the DevTools HTTP endpoint), returning the body (read up
/// to its `Content-Length`: the endpoint keeps the connection open).
fn http_get(port: u16, path: &str) -> Result<String, String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut response = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        let text = String::from_utf8_lossy(&response).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length = head.lines().find_map(|l| {
                let (name, value) = l.split_once(':')?;
                name.trim()
                    .eq_ignore_ascii_case("content-length")
                    .then(|| value.trim().parse::<usize>().ok())?
            });
            if length.is_some_and(|n| body.len() >= n) {
                return Ok(body.to_string());
            }
        }
        match stream.read(&mut chunk) {
            Ok(0) => {
                return text
                    .split_once("\r\n\r\n")
                    .map(|(_, body)| body.to_string())
                    .ok_or_else(|| format!("no HTTP body in {text:?}"));
            }
            Ok(n) => response.extend_from_slice(&chunk[..n]),
            Err(e) => return Err(format!("reading {path}: {e}")),
        }
    }
}
