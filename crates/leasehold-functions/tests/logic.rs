//! The URL logic runner against a real HTTP endpoint. The command runner needs its supervisor
//! (the `leasehold` binary): its tests are in `crates/leasehold/tests/logic_tree.rs`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use leasehold_functions::logic::UrlLogic;
use leasehold_runtime::{Logic, RunContext};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

fn ctx(record: &str, token: Option<u64>) -> RunContext {
    RunContext {
        scope: "account".parse().unwrap(),
        record_id: record.parse().unwrap(),
        fencing_token: token,
        cancel: CancellationToken::new(),
        attempt: 1,
        deferred: std::time::Duration::ZERO,
        trace: None,
    }
}

/// A request the endpoint saw: its JSON body and its fencing-token header.
type Seen = (Value, Option<String>);

#[tokio::test]
async fn url_logic_posts_the_record_and_the_status_counts() {
    let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let arrived = Arc::new(tokio::sync::Notify::new());
    let slow_arrived = arrived.clone();
    let record = seen.clone();
    let app = Router::new()
        .route(
            "/run",
            post(move |headers: HeaderMap, body: axum::Json<Value>| {
                let record = record.clone();
                async move {
                    let token = headers
                        .get("x-leasehold-fencing-token")
                        .map(|v| v.to_str().unwrap().to_string());
                    let fails = body["recordId"] == "bad";
                    record.lock().unwrap().push((body.0, token));
                    if fails {
                        (StatusCode::CONFLICT, "stale fencing token")
                    } else {
                        (StatusCode::OK, "done")
                    }
                }
            }),
        )
        .route(
            "/slow",
            post(move || {
                let arrived = slow_arrived.clone();
                async move {
                    arrived.notify_one();
                    tokio::time::sleep(Duration::from_secs(600)).await
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let logic = UrlLogic::new(&format!("http://{addr}/run?key=SECRET"), Duration::from_secs(30)).unwrap();
    logic.run(ctx("42", Some(9))).await.unwrap();
    let (body, token) = seen.lock().unwrap()[0].clone();
    assert_eq!(body["recordId"], "42");
    assert_eq!(body["fencingToken"], 9);
    assert_eq!(token.as_deref(), Some("9"));
    let err = logic.run(ctx("bad", Some(10))).await.unwrap_err().to_string();
    assert!(
        err.contains("409") && err.contains("stale fencing token"),
        "{err}"
    );
    assert!(!err.contains("SECRET"), "the query string leaked: {err}");

    let slow = UrlLogic::new(&format!("http://{addr}/slow"), Duration::from_secs(600)).unwrap();
    let run = ctx("42", Some(11));
    let cancel = run.cancel.clone();
    let task = tokio::spawn(async move { slow.run(run).await });
    arrived.notified().await; // the request is in flight
    cancel.cancel();
    let err = tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    assert!(err.to_string().contains("abandoned"), "{err}");

    assert!(UrlLogic::new("ftp://x", Duration::from_secs(1)).is_err());
}

/// 429, and 503 with `Retry-After`, ask to be run later (after the delay it gives, in seconds or
/// as an HTTP-date against the answer's `Date`); a 503 without it, and any other status, is a
/// failure. The logic is told how long its trigger was put off.
#[tokio::test]
async fn url_logic_answered_429_or_503_with_retry_after_asks_to_be_run_later() {
    let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let record = seen.clone();
    let app = Router::new().route(
        "/run",
        post(move |body: axum::Json<Value>| {
            let record = record.clone();
            async move {
                record.lock().unwrap().push((body.0.clone(), None));
                let case = body["recordId"].as_str().unwrap().to_string();
                let mut headers = HeaderMap::new();
                let status = match case.as_str() {
                    "seconds" => {
                        headers.insert("retry-after", "12".parse().unwrap());
                        StatusCode::TOO_MANY_REQUESTS
                    }
                    "date" => {
                        headers.insert("date", "Wed, 25 Nov 2026 10:00:00 GMT".parse().unwrap());
                        headers.insert("retry-after", "Wed, 25 Nov 2026 10:00:40 GMT".parse().unwrap());
                        StatusCode::SERVICE_UNAVAILABLE
                    }
                    "none" => StatusCode::TOO_MANY_REQUESTS,
                    "garbled" => {
                        headers.insert("retry-after", "later".parse().unwrap());
                        StatusCode::TOO_MANY_REQUESTS
                    }
                    "outage" => StatusCode::SERVICE_UNAVAILABLE,
                    _ => {
                        headers.insert("retry-after", "12".parse().unwrap());
                        StatusCode::INTERNAL_SERVER_ERROR
                    }
                };
                (status, headers, "busy")
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let logic = UrlLogic::new(&format!("http://{addr}/run?key=SECRET"), Duration::from_secs(30)).unwrap();

    for (case, wants) in [
        ("seconds", Some(Some(Duration::from_secs(12)))),
        ("date", Some(Some(Duration::from_secs(40)))),
        ("none", Some(None)),
        ("garbled", Some(None)),
        ("outage", None),
        ("other", None),
    ] {
        let mut run = ctx(case, Some(3));
        run.deferred = Duration::from_secs(61);
        let err = logic.run(run).await.unwrap_err();
        assert_eq!(err.asks_to_run_later(), wants, "{case}: {err}");
        // Every "too many" pauses the run's downstream budget too.
        assert_eq!(err.is_throttled(), wants.is_some(), "{case}: {err}");
        assert!(!err.to_string().contains("SECRET"), "{err}");
    }
    let first = logic.run(ctx("seconds", None)).await.unwrap_err().to_string();
    assert!(
        first.contains("429") && first.contains("Retry-After: 12"),
        "{first}"
    );
    assert_eq!(seen.lock().unwrap()[0].0["deferredSeconds"], 61);
}

/// A 3xx is a failed run naming the status and where it pointed, and is not followed: a
/// 301/302/303 followed would turn the POST into a GET, and the GET's 2xx would count as a run.
#[tokio::test]
async fn url_logic_does_not_follow_redirects() {
    let target_hits = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let hits = target_hits.clone();
    let app = Router::new()
        .route(
            "/moved",
            post(|| async {
                (
                    StatusCode::FOUND,
                    [(axum::http::header::LOCATION, "/elsewhere?sig=SECRET")],
                    "",
                )
            }),
        )
        .route(
            "/elsewhere",
            axum::routing::any(move || {
                let hits = hits.clone();
                async move {
                    hits.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    (StatusCode::OK, "done")
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let logic = UrlLogic::new(&format!("http://{addr}/moved"), Duration::from_secs(30)).unwrap();
    let err = logic.run(ctx("42", Some(9))).await.unwrap_err().to_string();
    assert!(
        err.contains("302") && err.contains(&format!("http://{addr}/elsewhere")),
        "the error names the status and the Location: {err}"
    );
    assert!(
        !err.contains("SECRET"),
        "the Location's query string leaked: {err}"
    );
    assert_eq!(
        target_hits.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the redirect target was requested"
    );
}
