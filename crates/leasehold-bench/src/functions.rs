//! Section 4b: the Worker function through the custom handler, the Functions host emulated as
//! the tests do (a `POST /Worker` with the queue trigger's payload), on loopback: invocations a
//! second, and what the handler adds to each against the same runner called in process.
//!
//! The logic is a URL (`LEASEHOLD_LOGIC_URL`) answered 200 at once by a stub server in this
//! process, so no process is spawned per run; the stub's own round trip is measured apart.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use leasehold_runtime::{Delivery, TriggerMessage};
use leasehold_test_support::{Azurite, unique_name};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::{Probe, env, fmt, leasehold_exe, ms, percentile, runner};

/// A server answering every HTTP/1.1 request with an empty 200, keeping connections open.
async fn stub_server() -> Result<u16> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buffer = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    // One request: its headers, then as many body bytes as it says.
                    let end = loop {
                        if let Some(i) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i + 4;
                        }
                        match stream.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buffer.extend_from_slice(&chunk[..n]),
                        }
                    };
                    let head = String::from_utf8_lossy(&buffer[..end]).to_ascii_lowercase();
                    let length: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0);
                    while buffer.len() < end + length {
                        match stream.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buffer.extend_from_slice(&chunk[..n]),
                        }
                    }
                    buffer.drain(..end + length);
                    if stream
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    Ok(port)
}

/// The Worker invocation the host sends for a queue message carrying `message`.
fn invocation(message: &TriggerMessage) -> serde_json::Value {
    json!({
        "Data": { "trigger": message.to_json() },
        "Metadata": { "DequeueCount": 1, "Id": "\"bench\"", "PopReceipt": "\"AgAA\"",
                      "sys": { "MethodName": "Worker" } }
    })
}

/// Section 4b: `invocations` invocations one at a time (latency), then as many 8 at a time
/// (throughput).
pub async fn section(az: &Azurite, invocations: usize, report: &mut String) -> Result<()> {
    writeln!(
        report,
        "## 4b. Functions mode: the Worker through the custom handler on loopback (the host emulated), fencing on, URL logic answered at once\n"
    )
    .unwrap();
    let exe = leasehold_exe()?;
    let stub = stub_server().await?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let (queue, container) = (unique_name("bench"), unique_name("bench"));
    let mut handler = tokio::process::Command::new(&exe)
        .env_clear()
        .env("FUNCTIONS_CUSTOMHANDLER_PORT", port.to_string())
        .env("AzureWebJobsStorage", az.connection_string())
        .env("LEASEHOLD_QUEUE", &queue)
        .env("LEASEHOLD_CONTAINER", &container)
        .env("LEASEHOLD_LOGIC_URL", format!("http://127.0.0.1:{stub}/run"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let started = Instant::now();
    while tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err() {
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(30),
            "handler not ready in 30 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let client = reqwest::Client::new();
    let url = format!("http://127.0.0.1:{port}/Worker");
    let invoke = |record: String| {
        let (client, url) = (client.clone(), url.clone());
        async move {
            let message = TriggerMessage::parse("bench", &record).unwrap();
            let t = Instant::now();
            let answer = client
                .post(&url)
                .json(&invocation(&message))
                .send()
                .await
                .context("invoking the Worker")?;
            anyhow::ensure!(
                answer.status().is_success(),
                "the Worker answered {}",
                answer.status()
            );
            let body: serde_json::Value = answer.json().await?;
            anyhow::ensure!(
                body["ReturnValue"]["outcome"] == "completed",
                "the Worker's outcome: {body}"
            );
            Ok::<f64, anyhow::Error>(ms(t.elapsed()))
        }
    };
    // The records exist (their lock blobs), as in steady traffic; the queues and container
    // too.
    for i in 0..invocations {
        invoke(format!("fn-{i}")).await?;
    }
    let mut handler_ms = Vec::new();
    for i in 0..invocations {
        handler_ms.push(invoke(format!("fn-{i}")).await?);
    }
    // Throughput: 8 at a time, as the host's batch (4) plus its threshold (2) would not reach;
    // 8 is serve's concurrency, for comparison with section 3.
    let t = Instant::now();
    let slots = Arc::new(tokio::sync::Semaphore::new(8));
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..invocations {
        let permit = slots.clone().acquire_owned().await?;
        let call = invoke(format!("fn-{i}"));
        calls.spawn(async move {
            let r = call.await;
            drop(permit);
            r
        });
    }
    while let Some(r) = calls.join_next().await {
        r??;
    }
    let per_second = invocations as f64 / t.elapsed().as_secs_f64();
    handler.kill().await?;

    // The same runs in process: the runner under Functions (`handle_watched`: watchdog put and
    // delete), fencing on, a no-op logic, on the same Azurite.
    let e = env(az);
    let r = runner(&e, Probe::new(Duration::ZERO), true, 30);
    let mut in_process = Vec::new();
    for pass in 0..2 {
        for i in 0..invocations {
            let delivery = Delivery {
                message: TriggerMessage::parse("bench", &format!("fn-{i}")).unwrap(),
                dequeue_count: 1,
            };
            let t = Instant::now();
            r.handle_watched(&delivery, e.poison.as_ref(), &CancellationToken::new())
                .await;
            if pass == 1 {
                in_process.push(ms(t.elapsed()));
            }
        }
    }
    // The logic's own call: one POST to the stub, on a kept-alive connection.
    let stub_url = format!("http://127.0.0.1:{stub}/run");
    let mut stub_ms = Vec::new();
    for _ in 0..invocations {
        let t = Instant::now();
        client.post(&stub_url).body("{}").send().await?;
        stub_ms.push(ms(t.elapsed()));
    }

    let p = |xs: &Vec<f64>, q: f64| percentile(xs.clone(), q);
    let added = |q: f64| p(&handler_ms, q) - p(&in_process, q) - p(&stub_ms, q);
    writeln!(report, "| what | p50 ms | p99 ms |\n| --- | ---: | ---: |").unwrap();
    for (what, p50, p99) in [
        (
            "a Worker invocation through the handler (one at a time)",
            p(&handler_ms, 0.5),
            p(&handler_ms, 0.99),
        ),
        (
            "the same run in process (`handle_watched`, no-op logic)",
            p(&in_process, 0.5),
            p(&in_process, 0.99),
        ),
        (
            "the logic's call to the stub (a loopback POST)",
            p(&stub_ms, 0.5),
            p(&stub_ms, 0.99),
        ),
        (
            "**added by the handler** (invocation − in process − the logic's call)",
            added(0.5),
            added(0.99),
        ),
    ] {
        writeln!(report, "| {what} | {} | {} |", fmt(p50), fmt(p99)).unwrap();
    }
    writeln!(
        report,
        "\n{} invocations a pass; 8 at a time: **{per_second:.0} Worker invocations per second** (one handler process, Azurite on the same machine).\n",
        invocations
    )
    .unwrap();
    Ok(())
}
