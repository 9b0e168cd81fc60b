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

pub mod browser;

/// The install command named in failure messages.
pub const INSTALL_HINT: &str = "scripts/install-azurite.sh (or: npm ci --prefix tools/azurite)";

/// A running Azurite (blob, queue and table services).
#[derive(Debug)]
pub struct Azurite {
    pub host: String,
    pub blob_port: u16,
    pub queue_port: u16,
    pub table_port: u16,
    /// With [`Azurite::start_oauth`]: the certificate authority its HTTPS certificate is signed
    /// by (PEM), for clients to trust (`SSL_CERT_FILE`).
    pub ca_file: Option<PathBuf>,
    child: Mutex<Child>,
    /// Its working folder: a file `stop` written there ends it ([`Drop`]).
    workdir: PathBuf,
}

/// Ends this Azurite (the shared one lives as long as the process): its watchdog shell sees
/// the `stop` file and kills it; waited for up to 5 s, then killed outright.
impl Drop for Azurite {
    fn drop(&mut self) {
        let _ = std::fs::write(self.workdir.join("stop"), "");
        let child = self
            .child
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while std::time::Instant::now() < deadline {
            if matches!(child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
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
        Self::spawn(Vec::new(), None)
    }

    /// Starts a new Azurite that checks Entra ID bearer tokens (`--oauth basic`: issuer,
    /// audience and lifetime are checked, the signature is not), over HTTPS with a certificate
    /// made now for 127.0.0.1 and signed by a certificate authority made now
    /// ([`Azurite::ca_file`]). Shared Key requests are still accepted.
    pub fn start_oauth() -> Result<Azurite, AzuriteUnavailable> {
        let dir = std::env::temp_dir().join(format!(
            "leasehold-azurite-tls-{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let (ca, cert, key) = tls_files().map_err(|e| format!("making a test certificate: {e}"))?;
        let write = |name: &str, text: &str| {
            let path = dir.join(name);
            std::fs::write(&path, text)
                .map(|_| path)
                .map_err(|e| format!("writing {name}: {e}"))
        };
        let (ca, cert, key) = (
            write("ca.pem", &ca)?,
            write("cert.pem", &cert)?,
            write("key.pem", &key)?,
        );
        let args = vec![
            "--oauth".to_string(),
            "basic".to_string(),
            "--cert".to_string(),
            cert.display().to_string(),
            "--key".to_string(),
            key.display().to_string(),
        ];
        Self::spawn(args, Some(ca))
    }

    /// The blob service URL of this Azurite (`http` or, with OAuth, `https`).
    pub fn blob_uri(&self) -> String {
        self.uri(self.blob_port)
    }

    /// The queue service URL of this Azurite.
    pub fn queue_uri(&self) -> String {
        self.uri(self.queue_port)
    }

    /// The table service URL of this Azurite.
    pub fn table_uri(&self) -> String {
        self.uri(self.table_port)
    }

    fn uri(&self, port: u16) -> String {
        let scheme = if self.ca_file.is_some() { "https" } else { "http" };
        format!(
            "{scheme}://{}:{port}/{}",
            self.host,
            leasehold_storage::EMULATOR_ACCOUNT
        )
    }

    fn spawn(extra_args: Vec<String>, ca_file: Option<PathBuf>) -> Result<Azurite, AzuriteUnavailable> {
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
            // A watchdog shell ends Azurite when this test process ends, however it ends, or
            // when told to (a `stop` file in its folder: `Drop`): asked first, then, after 5 s,
            // killed outright (a busy Azurite was seen to outlive a SIGTERM by minutes).
            let script = format!(
                "\"$0\" \"$@\" & child=$!; \
                 trap 'kill $child 2>/dev/null; n=0; while kill -0 $child 2>/dev/null && [ $n -lt 25 ]; do sleep 0.2; n=$((n+1)); done; kill -9 $child 2>/dev/null; wait $child' EXIT; \
                 while kill -0 {parent} 2>/dev/null && kill -0 $child 2>/dev/null && [ ! -e stop ]; do sleep 0.2; done",
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
                .args(&extra_args)
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
            if wait_for_ports(
                &mut child,
                &[blob_port, queue_port, table_port],
                Duration::from_secs(30),
            ) {
                return Ok(Azurite {
                    host: "127.0.0.1".into(),
                    blob_port,
                    queue_port,
                    table_port,
                    ca_file: ca_file.clone(),
                    child: Mutex::new(child),
                    workdir,
                });
            }
            let _ = child.kill();
            last_error = std::fs::read_to_string(workdir.join("azurite.log")).unwrap_or_default();
        }
        Err(format!("Azurite did not start listening within 30 s. Its log:\n{last_error}").into())
    }

    /// A connection string with explicit endpoints, as a user would set `AzureWebJobsStorage`.
    pub fn connection_string(&self) -> String {
        StorageAccount::emulator_connection_string(
            &self.host,
            self.blob_port,
            self.queue_port,
            self.table_port,
        )
    }

    pub fn account(&self) -> StorageAccount {
        StorageAccount::from_connection_string(&self.connection_string())
            .expect("emulator connection string parses")
    }

    /// A connection string with explicit endpoints and an account SAS (blob, queue and table; service,
    /// container and object; every permission; an hour) signed here with the emulator's key, as
    /// a user would paste from the portal.
    pub fn sas_connection_string(&self) -> String {
        self.sas_connection_string_for("sco")
    }

    /// [`sas_connection_string`](Self::sas_connection_string) for these resource types only
    /// (`o`: objects — messages and blobs — but not queues or containers themselves, as a
    /// data-only role has).
    pub fn sas_connection_string_for(&self, resource_types: &str) -> String {
        use base64::Engine;
        use hmac::Mac;
        let expiry = std::time::SystemTime::now() + Duration::from_secs(3600);
        let expiry = httpdate_iso(expiry);
        let (version, permissions) = ("2021-08-06", "rwdlacup");
        let to_sign = format!(
            "{account}\n{permissions}\nbqt\n{resource_types}\n\n{expiry}\n\nhttps,http\n{version}\n\n",
            account = leasehold_storage::EMULATOR_ACCOUNT
        );
        let key = base64::engine::general_purpose::STANDARD
            .decode(leasehold_storage::EMULATOR_KEY)
            .expect("the emulator key is base64");
        let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(&key).expect("any key length");
        mac.update(to_sign.as_bytes());
        let signature = base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes());
        let sas: String = url::form_urlencoded::Serializer::new(String::new())
            .append_pair("sv", version)
            .append_pair("ss", "bqt")
            .append_pair("srt", resource_types)
            .append_pair("sp", permissions)
            .append_pair("se", &expiry)
            .append_pair("spr", "https,http")
            .append_pair("sig", &signature)
            .finish();
        format!(
            "BlobEndpoint={};QueueEndpoint={};TableEndpoint={};SharedAccessSignature={sas}",
            self.blob_uri(),
            self.queue_uri(),
            self.table_uri()
        )
    }
}

/// `YYYY-MM-DDThh:mm:ssZ` (UTC), as a SAS's expiry is written.
fn httpdate_iso(at: std::time::SystemTime) -> String {
    let secs = at
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after the epoch")
        .as_secs() as i64;
    let (days, rest) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
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

/// For a storage call inside an [`eventually`] loop: its value, or `None` (poll again) for a
/// transient failure; any other failure panics, naming `what`. The product's callers retry
/// transient failures (a time-out, a connection reset on a loaded machine); a loop of direct
/// calls must too, rather than fail the test on one.
pub fn unless_transient<T>(result: leasehold_storage::StoreResult<T>, what: &str) -> Option<T> {
    match result {
        Ok(value) => Some(value),
        Err(e) if e.is_transient() => None,
        Err(e) => panic!("{what}: {e}"),
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

/// A certificate authority, and a certificate for 127.0.0.1 and localhost signed by it: (CA
/// certificate, certificate, key), all PEM.
fn tls_files() -> Result<(String, String, String), rcgen::Error> {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "leasehold test CA");
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate()?)?;
    let key = KeyPair::generate()?;
    let cert = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])?
        .signed_by(&key, &ca)?;
    Ok((ca.pem(), cert.pem(), key.serialize_pem()))
}

/// A local endpoint that answers like the App Service managed-identity endpoint
/// (`IDENTITY_ENDPOINT` with the `X-IDENTITY-HEADER` secret `IDENTITY_HEADER`): each request gets
/// a fresh bearer token for Azure Storage that expires after `lifetime`, in the form Azurite's
/// `--oauth basic` accepts. Counts the tokens it issued; a request without the secret gets 401.
#[derive(Debug, Clone)]
pub struct IdentityEndpoint {
    pub port: u16,
    pub secret: String,
    issued: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl IdentityEndpoint {
    pub fn start(lifetime: Duration) -> IdentityEndpoint {
        use std::io::{BufRead, BufReader, Write};
        use std::sync::Arc;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let listener = TcpListener::bind(("127.0.0.1", 0)).expect("binding the identity endpoint");
        let port = listener.local_addr().expect("identity endpoint address").port();
        let secret = uuid::Uuid::new_v4().simple().to_string();
        let issued = Arc::new(AtomicUsize::new(0));
        let (expected, counter) = (secret.clone(), issued.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let mut reader = BufReader::new(match stream.try_clone() {
                    Ok(s) => s,
                    Err(_) => continue,
                });
                let mut authorised = false;
                let mut line = String::new();
                while reader.read_line(&mut line).is_ok_and(|n| n > 0) {
                    let header = line.trim_end().to_string();
                    line.clear();
                    if header.is_empty() {
                        break;
                    }
                    if let Some((name, value)) = header.split_once(':') {
                        authorised |=
                            name.trim().eq_ignore_ascii_case("x-identity-header") && value.trim() == expected;
                    }
                }
                let (status, body) = if authorised {
                    counter.fetch_add(1, Ordering::SeqCst);
                    let expires = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .expect("after the epoch")
                        + lifetime;
                    let token = storage_token(expires.as_secs());
                    (
                        "200 OK",
                        format!(
                            r#"{{"access_token":"{token}","expires_on":"{}","resource":"https://storage.azure.com","token_type":"Bearer","client_id":"00000000-0000-0000-0000-000000000001"}}"#,
                            expires.as_secs()
                        ),
                    )
                } else {
                    (
                        "401 Unauthorized",
                        r#"{"error":"missing or wrong X-IDENTITY-HEADER"}"#.to_string(),
                    )
                };
                let mut stream = reader.into_inner();
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        IdentityEndpoint { port, secret, issued }
    }

    /// `IDENTITY_ENDPOINT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}/msi/token", self.port)
    }

    /// Tokens issued so far.
    pub fn issued(&self) -> usize {
        self.issued.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// An unsigned JWT with the claims Azurite checks: issuer, audience, issued/not-before/expiry.
fn storage_token(expires: u64) -> String {
    use base64::Engine;
    let b64 = |text: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(text);
    let now = expires.saturating_sub(3600).max(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after the epoch")
            .as_secs()
            - 60,
    );
    let header = b64(r#"{"alg":"RS256","typ":"JWT"}"#);
    let claims = b64(&format!(
        r#"{{"aud":"https://storage.azure.com","iss":"https://sts.windows.net/72f988bf-86f1-41af-91ab-2d7cd011db47/","iat":{now},"nbf":{now},"exp":{expires},"oid":"00000000-0000-0000-0000-000000000002","tid":"72f988bf-86f1-41af-91ab-2d7cd011db47"}}"#
    ));
    format!("{header}.{claims}.{}", b64("not-signed"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An Azurite of one's own stops when dropped: its ports refuse connections afterwards (the
    /// benchmark starts one per design and must not leave them running).
    #[test]
    fn a_dropped_azurite_stops() {
        let azurite = Azurite::start().unwrap();
        let port = azurite.blob_port;
        assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_ok());
        drop(azurite);
        assert!(
            std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
            "Azurite still listens on {port} after the drop"
        );
    }
}
