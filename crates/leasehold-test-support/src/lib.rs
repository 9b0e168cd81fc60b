//! Test support: a real Azurite, started once per test binary on free ports with in-memory
//! persistence, and unique container/queue names per test.
//!
//! Azurite comes from the npm registry, pinned in `tools/azurite/package-lock.json` and installed
//! by `scripts/install-azurite.sh` (the README's test command runs it). If it is missing, tests
//! fail with a message naming that command; they never skip silently.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use leasehold_storage::StorageAccount;

/// The install command named in failure messages.
pub const INSTALL_HINT: &str = "scripts/install-azurite.sh (or: npm ci --prefix tools/azurite)";

/// A running Azurite (blob and queue services).
#[derive(Debug)]
pub struct Azurite {
    pub host: String,
    pub blob_port: u16,
    pub queue_port: u16,
    _child: Mutex<Child>,
}

static AZURITE: OnceLock<Result<Azurite, AzuriteUnavailable>> = OnceLock::new();

/// Why Azurite could not be started, with what to do about it.
#[derive(Debug, Clone)]
pub struct AzuriteUnavailable(String);

impl std::fmt::Display for AzuriteUnavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for AzuriteUnavailable {}

impl From<String> for AzuriteUnavailable {
    fn from(text: String) -> Self {
        Self(text)
    }
}

impl Azurite {
    /// The Azurite of this test binary, started on first call.
    pub fn shared() -> &'static Azurite {
        // A failed start is remembered, so every test reports it at once instead of retrying.
        match AZURITE.get_or_init(Azurite::start) {
            Ok(azurite) => azurite,
            Err(e) => panic!("{e}"),
        }
    }

    /// Path of the pinned Azurite executable (`LEASEHOLD_AZURITE` overrides).
    pub fn executable() -> PathBuf {
        if let Some(path) = std::env::var_os("LEASEHOLD_AZURITE") {
            return PathBuf::from(path);
        }
        workspace_root().join("tools/azurite/node_modules/.bin/azurite")
    }

    /// Starts a new Azurite; it exits when this process does.
    pub fn start() -> Result<Azurite, AzuriteUnavailable> {
        let exe = Self::executable();
        if !exe.exists() {
            return Err(format!(
                "Azurite is not installed at {}. Install it with: {INSTALL_HINT}",
                exe.display()
            )
            .into());
        }
        let mut last_error = String::new();
        // Free ports are found by binding port 0; another process may take one before Azurite
        // binds it, so a failed start is tried again on new ports.
        for _ in 0..3 {
            let (blob_port, queue_port, table_port) = (free_port(), free_port(), free_port());
            let workdir =
                std::env::temp_dir().join(format!("leasehold-azurite-{}-{blob_port}", std::process::id()));
            std::fs::create_dir_all(&workdir).map_err(|e| format!("creating {}: {e}", workdir.display()))?;
            let log = std::fs::File::create(workdir.join("azurite.log")).map_err(|e| e.to_string())?;
            // A watchdog shell ends Azurite when this test process ends, however it ends.
            let script = format!(
                "\"$0\" \"$@\" & child=$!; trap 'kill $child 2>/dev/null' EXIT; \
                 while kill -0 {parent} 2>/dev/null && kill -0 $child 2>/dev/null; do sleep 0.5; done",
                parent = std::process::id()
            );
            let child = Command::new("sh")
                .arg("-c")
                .arg(script)
                .arg(&exe)
                .args([
                    "--inMemoryPersistence",
                    "--skipApiVersionCheck",
                    "--disableTelemetry",
                    "--silent",
                ])
                .args([
                    "--blobHost",
                    "127.0.0.1",
                    "--queueHost",
                    "127.0.0.1",
                    "--tableHost",
                    "127.0.0.1",
                ])
                .args(["--blobPort", &blob_port.to_string()])
                .args(["--queuePort", &queue_port.to_string()])
                .args(["--tablePort", &table_port.to_string()])
                .current_dir(&workdir)
                .stdin(Stdio::null())
                .stdout(log.try_clone().map_err(|e| e.to_string())?)
                .stderr(log)
                .spawn()
                .map_err(|e| {
                    format!(
                        "starting Azurite ({}): {e}. Install it with: {INSTALL_HINT}",
                        exe.display()
                    )
                })?;
            let mut child = child;
            if wait_for_ports(&mut child, &[blob_port, queue_port], Duration::from_secs(30)) {
                return Ok(Azurite {
                    host: "127.0.0.1".into(),
                    blob_port,
                    queue_port,
                    _child: Mutex::new(child),
                });
            }
            let _ = child.kill();
            last_error = std::fs::read_to_string(workdir.join("azurite.log")).unwrap_or_default();
        }
        Err(format!("Azurite did not start listening within 30 s. Its log:\n{last_error}").into())
    }

    /// A connection string with explicit endpoints, as a user would set `AzureWebJobsStorage`.
    pub fn connection_string(&self) -> String {
        StorageAccount::emulator_connection_string(&self.host, self.blob_port, self.queue_port)
    }

    pub fn account(&self) -> StorageAccount {
        StorageAccount::from_connection_string(&self.connection_string())
            .expect("emulator connection string parses")
    }
}

/// A name no other test uses: `prefix-<12 hex>`; valid for containers and queues (3–63
/// lower-case letters, digits and single hyphens).
pub fn unique_name(prefix: &str) -> String {
    let id = uuid::Uuid::new_v4().simple().to_string();
    format!("{prefix}-{}", &id[..12])
}

/// Repository root (two levels above this crate).
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("workspace root exists")
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Waits until every port accepts connections; gives up early if the process exits.
fn wait_for_ports(child: &mut Child, ports: &[u16], limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    let open = |port: u16| {
        TcpStream::connect_timeout(
            &SocketAddr::from(([127, 0, 0, 1], port)),
            Duration::from_millis(200),
        )
        .is_ok()
    };
    while Instant::now() < deadline {
        if ports.iter().all(|p| open(*p)) {
            return true;
        }
        if matches!(child.try_wait(), Ok(Some(_))) {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

/// Polls `check` until it returns `Some` or `limit` passes (for tests that wait on another
/// process; never a bare sleep).
pub async fn eventually<T, F, Fut>(limit: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("timed out after {limit:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A TCP proxy on a free port in front of `127.0.0.1:<target>` that counts the connections it
/// accepts: how a test sees whether clients reuse connections. Each connection is relayed by two
/// threads until either side closes; the listener lives as long as the test process.
#[derive(Debug, Clone)]
pub struct CountingProxy {
    pub port: u16,
    accepted: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl CountingProxy {
    pub fn start(target: u16) -> CountingProxy {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let listener = TcpListener::bind(("127.0.0.1", 0)).expect("binding the proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = accepted.clone();
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                counter.fetch_add(1, Ordering::SeqCst);
                let Ok(server) = TcpStream::connect(("127.0.0.1", target)) else {
                    continue;
                };
                let relay = |mut from: TcpStream, mut to: TcpStream| {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(std::net::Shutdown::Write);
                    })
                };
                if let (Ok(c2), Ok(s2)) = (client.try_clone(), server.try_clone()) {
                    relay(client, server);
                    relay(s2, c2);
                }
            }
        });
        CountingProxy { port, accepted }
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }
}
