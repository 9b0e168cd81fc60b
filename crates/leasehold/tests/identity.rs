//! Identity-based storage access, end to end, without Azure: `leasehold serve` configured only
//! with the Functions identity settings (`AzureWebJobsStorage__blobServiceUri`,
//! `__queueServiceUri`, `__credential=managedidentity`) gets its tokens from a local endpoint that
//! answers as App Service's managed-identity endpoint does (`IDENTITY_ENDPOINT`,
//! `IDENTITY_HEADER`), and speaks HTTPS to an Azurite that checks bearer tokens (`--oauth
//! basic`) with a certificate made for this test. Start, the lock, the markers and the queue all
//! go through it, and tokens that expire during a run are refreshed.

mod common;

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use leasehold_test_support::{Azurite, IdentityEndpoint, eventually, unique_name};
use tokio::process::Command;

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// Where one `leasehold serve` writes: its log, and the file its logic appends runs to.
struct Files {
    log: std::path::PathBuf,
    runs: std::path::PathBuf,
}

/// `leasehold serve` with only identity settings, its tokens from `identity` (presenting
/// `secret`), logging to a fresh directory.
fn serve_command(azurite: &Azurite, identity: &IdentityEndpoint, secret: &str) -> (Command, Files) {
    let dir = common::scratch_dir("leasehold-identity");
    let files = Files {
        log: dir.join("serve.log"),
        runs: dir.join("runs.log"),
    };
    let mut command = common::leasehold(&["serve"]);
    command
        .env("AzureWebJobsStorage__blobServiceUri", azurite.blob_uri())
        .env("AzureWebJobsStorage__queueServiceUri", azurite.queue_uri())
        .env("AzureWebJobsStorage__credential", "managedidentity")
        .env("IDENTITY_ENDPOINT", identity.url())
        .env("IDENTITY_HEADER", secret)
        .env("SSL_CERT_FILE", azurite.ca_file.as_ref().unwrap())
        .env("LEASEHOLD_QUEUE", unique_name("triggers"))
        .env("LEASEHOLD_CONTAINER", unique_name("locks"))
        .env("LEASEHOLD_LEASE_SECONDS", "15")
        .env("LEASEHOLD_POLL_MAX_SECONDS", "1")
        .env("LEASEHOLD_PORT", "0")
        .env(
            "LEASEHOLD_LOGIC_COMMAND",
            format!(
                "sleep 12; echo \"$LEASEHOLD_RECORD_ID $LEASEHOLD_FENCING_TOKEN\" >> {}",
                files.runs.display()
            ),
        )
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::from(std::fs::File::create(&files.log).unwrap()));
    (command, files)
}

/// Starts [`serve_command`] and waits for the port it logs.
async fn serve(
    azurite: &Azurite,
    identity: &IdentityEndpoint,
    secret: &str,
) -> (tokio::process::Child, u16, std::path::PathBuf, std::path::PathBuf) {
    let (mut command, Files { log, runs }) = serve_command(azurite, identity, secret);
    let child = command.spawn().unwrap();
    let port = common::serve_port(&log).await;
    (child, port, log, runs)
}

async fn start(port: u16) -> (u16, String) {
    let response = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{port}/api/start"))
        .header("content-type", "application/json")
        .body(r#"{"scope": "account", "recordId": "8f9c1d2e-0000-4000-8000-000000000001"}"#)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.text().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_runs_a_record_with_only_identity_settings_and_refreshes_tokens_during_the_run() {
    let azurite = Azurite::start_oauth().expect("an Azurite checking bearer tokens over HTTPS");
    // Tokens live 8 s; the run lasts 12 s with a 15 s lease renewed every 5 s: renewals late in
    // the run need tokens issued after the run started.
    let identity = IdentityEndpoint::start(Duration::from_secs(8));
    let (mut child, port, log, runs) = serve(&azurite, &identity, &identity.secret).await;
    let (status, body) = start(port).await;
    assert_eq!(status, 202, "{body}\n{}", read(&log));
    let issued_at_start = identity.issued();

    eventually(
        Duration::from_secs(60),
        "the run to complete under its lease",
        || async { read(&log).contains("record run completed").then_some(()) },
    )
    .await;
    assert_eq!(
        read(&runs).trim(),
        "8f9c1d2e-0000-4000-8000-000000000001 1",
        "one run, fencing token 1; log:\n{}",
        read(&log)
    );
    assert!(
        identity.issued() > issued_at_start,
        "tokens were fetched during the run ({} before it, {} after)",
        issued_at_start,
        identity.issued()
    );
    let text = read(&log);
    assert!(
        !text.contains(&identity.secret),
        "the identity header never appears in logs"
    );
    assert!(!text.contains("eyJ"), "no token appears in logs");
    child.start_kill().unwrap();
    let _ = child.wait().await;
}

/// The control: without a token (the identity endpoint refuses the wrong secret) storage refuses
/// every request, so the test above passes on tokens, not on something else. `serve` checks
/// storage at start-up and exits saying why, and nothing secret is logged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_serve_stops_at_start_up_and_says_why() {
    let azurite = Azurite::start_oauth().expect("an Azurite checking bearer tokens over HTTPS");
    let identity = IdentityEndpoint::start(Duration::from_secs(60));
    let (mut command, Files { log, .. }) = serve_command(&azurite, &identity, "not-the-secret");
    let status = command.status();
    let status = tokio::time::timeout(Duration::from_secs(60), status)
        .await
        .expect("serve exits")
        .unwrap();
    let text = read(&log);
    assert!(!status.success(), "{text}");
    assert!(text.contains("credentials were refused"), "{text}");
    assert_eq!(identity.issued(), 0);
    assert!(
        !text.contains(&identity.secret) && !text.contains("not-the-secret"),
        "{text}"
    );

    // And this Azurite does check: a request that carries no token is refused.
    let ca = std::fs::read(azurite.ca_file.as_ref().unwrap()).unwrap();
    let client = reqwest::Client::builder()
        .tls_certs_only([reqwest::Certificate::from_pem(&ca).unwrap()])
        .build()
        .unwrap();
    let anonymous = client
        .get(format!("{}/anything?comp=metadata", azurite.queue_uri()))
        .header("x-ms-version", "2025-11-05")
        .send()
        .await
        .unwrap();
    assert!(
        matches!(anonymous.status().as_u16(), 401 | 403),
        "an anonymous request answered {}",
        anonymous.status()
    );
}
