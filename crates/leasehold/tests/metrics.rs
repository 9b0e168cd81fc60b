//! Metrics against a real Azurite: `serve`'s `GET /metrics` (Prometheus text, read with a
//! parser, behind Start's key), the handler's metrics event (JSON logs of the real binary), and
//! the recent-outcomes store filled by a delivery.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use common::Running;
use leasehold::telemetry::{EVENT_TARGET, OLDEST_MESSAGE_AGE_SECONDS, POISON_MESSAGES, QUEUE_MESSAGES};
use leasehold_runtime::{RecordId, Scope, TriggerMessage};
use leasehold_test_support::{eventually, unique_name};
use prometheus_parse::{Sample, Scrape, Value};
use serde_json::{Value as Json, json};

const KEY: &str = "metrics-test-key";

/// Settings of one isolated environment (its own queue and container), as the environment
/// would give them.
fn vars(extra: &[(&str, &str)]) -> BTreeMap<String, String> {
    common::with(
        common::serve_vars(&unique_name("triggers"), &unique_name("locks")),
        extra,
    )
}

/// `serve` in this process.
async fn serve(extra: &[(&str, &str)]) -> Running {
    Running::start(
        leasehold::Settings::from_vars(vars(extra)).unwrap(),
        common::standalone(),
    )
    .await
}

async fn scrape(url: &str, headers: &[(&str, &str)]) -> (u16, String) {
    let response = common::get(url, headers).await;
    (response.status().as_u16(), response.text().await.unwrap())
}

fn parse(body: &str) -> Scrape {
    Scrape::parse(body.lines().map(|l| Ok(l.to_string()))).expect("Prometheus text format")
}

/// The value of a counter or gauge sample with these labels (0 when absent).
fn value(scrape: &Scrape, metric: &str, labels: &[(&str, &str)]) -> f64 {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == metric && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s: &Sample| match s.value {
            Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => v,
            _ => 0.0,
        })
        .sum()
}

/// The number of observations of a histogram with these labels (its `+Inf` bucket).
fn observations(scrape: &Scrape, metric: &str, labels: &[(&str, &str)]) -> f64 {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == metric && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .filter_map(|s| match &s.value {
            Value::Histogram(buckets) => buckets
                .iter()
                .find(|b| b.less_than.is_infinite())
                .map(|b| b.count),
            _ => None,
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_exposes_prometheus_metrics_behind_the_start_key() {
    let app = serve(&[
        ("LEASEHOLD_API_KEY", KEY),
        ("LEASEHOLD_ADMIN_KEY", "metrics-test-admin-key-0f1e2d3c4b5a6978"),
        ("LEASEHOLD_DEMO_SECONDS", "0"),
    ])
    .await;
    let record = unique_name("record");
    let (scope, record_id) = (
        Scope::parse("account").unwrap(),
        RecordId::parse(&record).unwrap(),
    );
    let response = reqwest::Client::new()
        .post(app.url("/api/start"))
        .header("x-functions-key", KEY)
        .json(&json!({"scope": "account", "recordId": record}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 202);

    // The delivery's outcome reaches the recent-outcomes store where it is counted.
    let recent = eventually(Duration::from_secs(30), "the record's outcome", || async {
        leasehold::recent_outcome(&scope, &record_id)
    })
    .await;
    assert_eq!(recent.outcome, "completed", "{recent:?}");
    assert!(recent.run_duration.is_some(), "{recent:?}");
    assert!(
        leasehold::recent_outcomes(usize::MAX)
            .iter()
            .any(|o| o.record_id == record_id),
        "listed among the recent outcomes"
    );
    // The dashboard shows it with the record.
    let shown: Json = reqwest::Client::new()
        .get(app.url(&format!("/api/admin/records/account/{record}")))
        .header("x-leasehold-admin-key", "metrics-test-admin-key-0f1e2d3c4b5a6978")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(shown["recentOutcome"]["outcome"], "completed", "{shown}");
    assert_eq!(shown["recentOutcome"]["recordId"], record.as_str(), "{shown}");
    assert!(shown["recentOutcome"]["runSeconds"].is_number(), "{shown}");

    // Without the key, or with a wrong one: 401, and no metrics in the answer.
    for headers in [vec![], vec![("x-functions-key", "wrong")]] {
        let (status, body) = scrape(&app.url("/metrics"), &headers).await;
        assert_eq!(status, 401, "{headers:?}: {body}");
        assert!(!body.contains("leasehold_"), "{body}");
    }
    let (status, _) = scrape(&app.url("/metrics?code=wrong"), &[]).await;
    assert_eq!(status, 401);

    // With the key (header or code): the metrics, read by a parser of the text format.
    let (status, body) = scrape(&app.url("/metrics"), &[("x-functions-key", KEY)]).await;
    assert_eq!(status, 200, "{body}");
    let metrics = parse(&body);
    assert!(
        value(
            &metrics,
            "leasehold_deliveries_total",
            &[("outcome", "completed")]
        ) >= 1.0,
        "{body}"
    );
    assert!(
        value(
            &metrics,
            "leasehold_storage_requests_total",
            &[("op", "lease_acquire")]
        ) >= 1.0,
        "{body}"
    );
    assert!(
        value(
            &metrics,
            "leasehold_storage_requests_total",
            &[("op", "queue_get")]
        ) >= 1.0,
        "{body}"
    );
    assert!(
        value(&metrics, "leasehold_start_responses_total", &[("status", "202")]) >= 1.0,
        "{body}"
    );
    assert!(
        observations(&metrics, "leasehold_run_duration_seconds", &[]) >= 1.0,
        "{body}"
    );
    assert!(
        observations(&metrics, "leasehold_lock_seconds", &[("step", "grant")]) >= 1.0
            && observations(&metrics, "leasehold_lock_seconds", &[("step", "release")]) >= 1.0,
        "{body}"
    );
    // The gauges are sampled at start-up (the queues exist by then).
    for gauge in [QUEUE_MESSAGES, POISON_MESSAGES, OLDEST_MESSAGE_AGE_SECONDS] {
        assert!(
            metrics.samples.iter().any(|s| s.metric == gauge),
            "{gauge} missing: {body}"
        );
    }
    // The refused scrapes were refused before anything was counted as a Start answer.
    assert_eq!(
        value(&metrics, "leasehold_start_responses_total", &[("status", "401")]),
        0.0,
        "{body}"
    );
    let (status, body) = scrape(&app.url(&format!("/metrics?code={KEY}")), &[]).await;
    assert_eq!(status, 200, "{body}");
    println!(
        "[metrics] GET /metrics: {} bytes, {} samples",
        body.len(),
        parse(&body).samples.len()
    );
    if std::env::var_os("LEASEHOLD_PRINT_METRICS").is_some() {
        println!("{body}");
    }

    // A second application in the same process (no key: loopback only) shares the one
    // recorder: its /metrics is open and shows the first one's counts.
    let open = serve(&[("LEASEHOLD_DEMO_SECONDS", "0")]).await;
    let (status, body) = scrape(&open.url("/metrics"), &[]).await;
    assert_eq!(status, 200, "{body}");
    assert!(
        value(
            &parse(&body),
            "leasehold_deliveries_total",
            &[("outcome", "completed")]
        ) >= 1.0,
        "{body}"
    );
    open.stop().await;
    app.stop().await;
}

/// The fields docs/operating.md (*Metrics*) documents for the metrics event (besides the gauges, absent when a
/// sample failed, and the quantiles, absent without observations).
const EVENT_FIELDS: &[&str] = &[
    "interval_seconds",
    "deliveries_completed",
    "deliveries_retriggered",
    "deliveries_coalesced",
    "deliveries_rechecked",
    "deliveries_failed",
    "deliveries_lease_lost",
    "deliveries_poisoned",
    "deliveries_deferred",
    "deliveries_superseded",
    "deliveries_waiting",
    "deliveries_debounced",
    "deliveries_paused",
    "storage_requests",
    "storage_errors",
    "storage_errors_transient",
    "start_2xx",
    "start_4xx",
    "start_5xx",
    "runs",
    "run_duration_sum_seconds",
];

/// The metrics events in a JSON log.
fn metrics_events(log: &str) -> Vec<Json> {
    log.lines()
        .filter_map(|l| serde_json::from_str::<Json>(l).ok())
        .filter(|e| e["target"] == EVENT_TARGET && e["message"] == "metrics")
        .collect()
}

fn total(events: &[Json], field: &str) -> u64 {
    events.iter().map(|e| e[field].as_u64().unwrap_or(0)).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handler_logs_a_metrics_event_with_the_changes_of_each_interval() {
    let dir = common::scratch_dir("leasehold-metrics");
    let (stdout, stderr): (PathBuf, PathBuf) = (dir.join("stdout.log"), dir.join("stderr.log"));
    let mut command = common::leasehold(&["handler"]);
    command
        .envs(vars(&[
            // Any free port, read from the log: none chosen in advance to race for.
            ("FUNCTIONS_CUSTOMHANDLER_PORT", "0"),
            ("LEASEHOLD_METRICS_INTERVAL_SECONDS", "1"),
            ("LEASEHOLD_LOG_FORMAT", "json"),
            (
                "LEASEHOLD_LOGIC_COMMAND",
                "test \"$LEASEHOLD_RECORD_ID\" != fails",
            ),
            ("RUST_LOG", "info"),
        ]))
        .stdout(std::fs::File::create(&stdout).unwrap())
        .stderr(std::fs::File::create(&stderr).unwrap());
    let mut child = command.spawn().unwrap();
    let port = eventually(Duration::from_secs(30), "the handler to log its port", || async {
        let log = std::fs::read_to_string(&stderr).unwrap_or_default();
        let line = log.lines().find(|l| l.contains("custom handler listening"))?;
        serde_json::from_str::<Json>(line).ok()?["port"].as_u64()
    })
    .await;
    let base = format!("http://127.0.0.1:{port}");
    common::answers(&format!("{base}/"), "the handler to answer GET /").await;
    let client = reqwest::Client::new();
    let invoke = |function: &'static str, payload: Json| {
        let (client, url) = (client.clone(), format!("{base}/{function}"));
        async move {
            let r = client.post(url).json(&payload).send().await.unwrap();
            (r.status().as_u16(), r.json::<Json>().await.unwrap_or(Json::Null))
        }
    };
    let worker = |record: &str| {
        json!({
            "Data": { "trigger": TriggerMessage::parse("account", record).unwrap().to_json() },
            "Metadata": { "DequeueCount": "1", "Id": "\"9b1f\"", "PopReceipt": "\"AgAA\"",
                          "sys": { "MethodName": "Worker" } }
        })
    };

    // One completed run, one failed (its retry queued), one accepted Start.
    let (status, r) = invoke("Worker", worker("metrics-ok")).await;
    assert_eq!(
        (status, &r["ReturnValue"]["outcome"]),
        (200, &json!("completed")),
        "{r}"
    );
    let (status, r) = invoke("Worker", worker("fails")).await;
    assert_eq!(
        (status, &r["ReturnValue"]["outcome"]),
        (200, &json!("retrying")),
        "{r}"
    );
    let start = json!({
        "Data": { "req": {
            "Url": format!("{base}/api/start"), "Method": "POST", "Query": {},
            "Headers": { "Content-Type": ["application/json"] }, "Params": {}, "Identities": [],
            "Body": json!({"scope": "account", "recordId": "metrics-start"}).to_string()
        } },
        "Metadata": { "sys": { "MethodName": "Start" } }
    });
    let (status, r) = invoke("Start", start).await;
    assert_eq!(
        (status, &r["Outputs"]["res"]["statusCode"]),
        (200, &json!(202)),
        "{r}"
    );

    // The events' changes add up to what happened, once: each event says what changed since
    // the one before, so two more events later the totals are still the same.
    let read = || metrics_events(&std::fs::read_to_string(&stdout).unwrap_or_default());
    let seen = eventually(
        Duration::from_secs(20),
        "events counting the deliveries",
        || async {
            let events = read();
            (total(&events, "deliveries_completed") >= 1
                && total(&events, "deliveries_failed") >= 1
                && total(&events, "start_2xx") >= 1)
                .then_some(events.len())
        },
    )
    .await;
    let events = eventually(Duration::from_secs(20), "two more events", || async {
        let events = read();
        (events.len() >= seen + 2).then_some(events)
    })
    .await;
    assert_eq!(total(&events, "deliveries_completed"), 1);
    assert_eq!(total(&events, "deliveries_failed"), 1);
    assert_eq!(total(&events, "deliveries_poisoned"), 0);
    assert_eq!(total(&events, "start_2xx"), 1);
    assert_eq!(total(&events, "start_4xx"), 0);
    assert_eq!(total(&events, "runs"), 2, "the failed run is a run too");
    assert!(total(&events, "storage_requests") >= 6, "{events:?}");
    for event in &events {
        for field in EVENT_FIELDS {
            assert!(
                event.get(*field).is_some_and(Json::is_number),
                "{field} in {event}"
            );
        }
        // Fields are flat, at the top level of the line.
        assert!(event.get("fields").is_none(), "{event}");
        // The queues answered: the gauges are there, the trigger queue holds the failed run's
        // retry (hidden for the retry delay).
        for gauge in ["queue_messages", "poison_messages", "oldest_message_age_seconds"] {
            assert!(
                event.get(gauge).is_some_and(Json::is_number),
                "{gauge} in {event}"
            );
        }
    }
    let with_runs = events
        .iter()
        .find(|e| e["runs"].as_u64() > Some(0))
        .expect("an event with the runs");
    println!("[metrics] handler event: {with_runs}");
    assert!(
        with_runs["run_duration_p50_seconds"].is_number()
            && with_runs["run_duration_p95_seconds"].is_number()
            && with_runs["run_duration_max_seconds"].is_number()
            && with_runs["lock_grant_p95_seconds"].is_number(),
        "{with_runs}"
    );
    assert!(
        events.iter().any(|e| e["queue_messages"].as_u64() >= Some(1)),
        "the retry is in the queue: {events:?}"
    );
    // The event goes to stdout only; everything else stays on stderr.
    let errors = std::fs::read_to_string(&stderr).unwrap();
    assert!(metrics_events(&errors).is_empty(), "metrics events on stderr");
    assert!(errors.contains("record run completed"), "{errors}");

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id().unwrap() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert!(child.wait().await.unwrap().success());
}
