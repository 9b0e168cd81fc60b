//! HTTP surfaces: the standalone Start endpoint (`POST /api/start`, `GET /healthz`) and the
//! custom-handler endpoints (`GET /` for the host's readiness probe, `POST /Start`,
//! `POST /Worker`).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use leasehold_lock::RetryOptions;
use leasehold_runtime::{
    Delivery, Error, HistoryEntry, HistoryEvent, Lane, Outcome, PoisonMessage, RecordRunner, TriggerMessage,
    TriggerQueue, record_outcome,
};
use serde_json::{Value, json};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::handler::{self, START_FUNCTION, WORKER_FUNCTION, WORKER_LOW_FUNCTION};
use crate::start::{
    Decision, MAX_BODY_BYTES, Rejection, StartPolicy, StartRequest, check_head, decide, trace_decision,
};

/// Counter of Start's answers to its callers, by `status` (the HTTP status the caller gets: in
/// handler mode the one in `Outputs.res`, not the 200 the host gets).
pub const START_RESPONSES_TOTAL: &str = "leasehold_start_responses_total";

fn count_start_response(status: u16) {
    metrics::counter!(START_RESPONSES_TOTAL, "status" => status.to_string()).increment(1);
}

/// Largest custom-handler invocation accepted (a Start body plus the host's envelope).
const MAX_INVOCATION_BYTES: usize = 2 * MAX_BODY_BYTES + 64 * 1024;

/// One lane: its trigger queue, its poison queue and the runner of its deliveries.
#[derive(Debug, Clone)]
pub struct LaneParts {
    /// The lane's trigger queue (standalone Start enqueues here).
    pub queue: Arc<dyn TriggerQueue>,
    /// Its poison queue (a Worker invocation with an unreadable message goes here).
    pub poison: Arc<dyn TriggerQueue>,
    /// Its runner (whose queue is the lane's: follow-ups stay in the lane).
    pub runner: RecordRunner,
}

/// What both HTTP surfaces share.
#[derive(Debug, Clone)]
pub struct App {
    pub policy: StartPolicy,
    /// The high lane (a person's save: the default) and the low lane (bulk traffic).
    pub high: LaneParts,
    pub low: LaneParts,
    /// Wakes the in-process consumer after an enqueue (standalone).
    pub wake: Option<Arc<Notify>>,
    /// Fires on shutdown: in-flight Worker invocations are cancelled and answered as failures.
    pub shutdown: CancellationToken,
    /// How long a request body may take to arrive, all of it (`LEASEHOLD_HTTP_BODY_TIMEOUT_SECONDS`):
    /// a client sending slowly is answered 408 and its connection closed.
    pub body_timeout: Duration,
}

/// `POST /api/start` and `GET /healthz` for `leasehold serve`.
pub fn standalone_router(app: App) -> Router {
    Router::new()
        .route("/api/start", any(standalone_start))
        .route(
            "/healthz",
            get(|| async { axum::Json(json!({ "status": "ok" })) }),
        )
        .layer(DefaultBodyLimit::disable())
        .with_state(Arc::new(app))
}

impl App {
    pub fn lane(&self, lane: Lane) -> &LaneParts {
        match lane {
            Lane::High => &self.high,
            Lane::Low => &self.low,
        }
    }
}

/// `GET /`, `POST /Start`, `POST /Worker`, `POST /WorkerLow` for `leasehold handler`.
pub fn handler_router(app: App) -> Router {
    Router::new()
        .route("/", get(|| async { "leasehold custom handler ready" }))
        .route("/{function}", post(invoke))
        .layer(DefaultBodyLimit::disable())
        .with_state(Arc::new(app))
}

/// A layer for the custom handler's port (loopback, and its one rightful client the Functions
/// host, which sends no `Origin` and calls `127.0.0.1`): refuses with 403 what a web page in a
/// developer's browser sends there ([`crate::start::refuse_web_pages`]), so a page cannot run
/// the logic through `/Worker` with a `no-cors` POST while `func start` runs.
pub async fn refuse_web_pages(request: Request, next: axum::middleware::Next) -> Response {
    // Checked before the await, with nothing borrowed across it (a body is not `Sync`).
    let refused = {
        let value = |name: &str| request.headers().get(name).and_then(|v| v.to_str().ok());
        crate::start::refuse_web_pages(value("origin"), value("host")).err()
    };
    if let Some(refused) = refused {
        tracing::warn!(path = %request.uri().path(), error = %refused, "handler: request from a web page refused");
        return json_response(403, json!({ "error": refused.to_string() }));
    }
    next.run(request).await
}

fn json_response(status: u16, body: Value) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, axum::Json(body)).into_response()
}

async fn standalone_start(State(app): State<Arc<App>>, request: Request) -> Response {
    let response = answer_start(&app, request).await;
    count_start_response(response.status().as_u16());
    response
}

async fn answer_start(app: &App, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let mut request = start_request(&parts);
    // Method, key, content type and declared length first: a client without the key is answered
    // without a byte of its body being read.
    let mut body = body;
    if let Err(rejection) = check_head(&app.policy, &request) {
        // Only once the key checked out (it is checked first): see `drain`. Not when the client
        // waits for `100 Continue` before it sends the body: reading would invite the upload.
        let waits = parts
            .headers
            .get(axum::http::header::EXPECT)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
        // Nor when more is declared than could be drained: the client meets a reset either way,
        // so it gets its answer at once.
        if let Rejection::BodyTooLarge(declared) = rejection
            && !waits
            && declared <= MAX_BODY_BYTES + DRAIN_BYTES
        {
            drain(&mut body).await;
        }
        return refuse(rejection);
    }
    let bytes = match read_body(&mut body, MAX_BODY_BYTES, app.body_timeout).await {
        Ok(b) => b,
        Err(rejection) => {
            if matches!(rejection, Rejection::BodyTooLarge(_)) {
                drain(&mut body).await;
            }
            return refuse(rejection);
        }
    };
    request.body = &bytes;
    let mut decision = decide(&app.policy, &request);
    let span = trace_decision(&mut decision, &request, |lane| {
        app.lane(lane).queue.name().to_string()
    });
    let (status, body) = carry_out(app, &decision).await;
    if let Some(span) = span {
        if status >= 400 {
            span.fail(format!("not enqueued: {status}"));
        }
        span.end();
    }
    json_response(status, body)
}

/// The head of a standalone request as Start reads it (the body is filled in once read).
fn start_request(parts: &Parts) -> StartRequest<'_> {
    let headers = parts
        .headers
        .iter()
        .filter_map(|(k, v)| v.to_str().ok().map(|v| (k.as_str().to_string(), v.to_string())))
        .collect();
    StartRequest {
        method: parts.method.as_str(),
        headers,
        query: parts.uri.query().map(url_pairs).unwrap_or_default(),
        body: &[],
        check_key: true,
    }
}

/// Answers a refusal (logged as Start logs every decision).
fn refuse(rejection: Rejection) -> Response {
    let decision = Decision::Reject(rejection);
    log_decision(&decision);
    let (status, body) = decision.response();
    let mut response = json_response(status, body);
    if status == 408 || status == 413 {
        // The rest of the body is not read: the connection cannot carry another request.
        response.headers_mut().insert(
            axum::http::header::CONNECTION,
            axum::http::HeaderValue::from_static("close"),
        );
    }
    response
}

/// Reads a body of at most `limit` bytes, all of it within `deadline` (however it trickles in).
/// Past the limit it stops, leaving the rest in `body` (to [`drain`]).
async fn read_body(body: &mut Body, limit: usize, deadline: Duration) -> Result<Bytes, Rejection> {
    use http_body_util::BodyExt;
    let read = async {
        let mut bytes = Vec::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| Rejection::BodyUnreadable(e.to_string()))?;
            if let Some(data) = frame.data_ref() {
                if bytes.len() + data.len() > limit {
                    return Err(Rejection::BodyTooLarge(limit + 1));
                }
                bytes.extend_from_slice(data);
            }
        }
        Ok(Bytes::from(bytes))
    };
    match tokio::time::timeout(deadline, read).await {
        Ok(result) => result,
        Err(_) => Err(Rejection::BodyTimeout(deadline.as_secs())),
    }
}

/// Most of a refused body read and thrown away before the 413, and for how long.
const DRAIN_BYTES: usize = 4 * 1024 * 1024;
const DRAIN_TIME: Duration = Duration::from_secs(5);

/// Reads and throws away what is left of a body that is too large (at most [`DRAIN_BYTES`],
/// within [`DRAIN_TIME`]) before the 413 is sent and the connection closed. A client that writes
/// its whole body before reading the answer (most do: curl, Python's urllib, .NET) otherwise
/// meets a connection reset mid-write, closed with its unread bytes, and never sees the 413.
async fn drain(body: &mut Body) {
    use http_body_util::BodyExt;
    let _ = tokio::time::timeout(DRAIN_TIME, async {
        let mut drained = 0;
        while drained < DRAIN_BYTES {
            match body.frame().await {
                Some(Ok(frame)) => drained += frame.data_ref().map_or(0, Bytes::len),
                _ => break,
            }
        }
    })
    .await;
}

fn url_pairs(query: &str) -> Vec<(String, String)> {
    url::form_urlencoded::parse(query.as_bytes())
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect()
}

/// Logs a decision and, for an accepted trigger in standalone mode, enqueues it.
async fn carry_out(app: &App, decision: &Decision) -> (u16, Value) {
    match decision {
        Decision::Enqueue(message, lane) => {
            let body = message.encode();
            let queue = &app.lane(*lane).queue;
            let put = RetryOptions::default()
                .run("enqueue trigger", || queue.put(&body, Duration::ZERO))
                .await;
            if let Err(e) = put {
                tracing::error!(scope = %message.scope, record = %message.record_id, error = %e, "start: queue unreachable; trigger not accepted");
                return (
                    503,
                    json!({ "error": format!("the trigger queue cannot be reached: {e}") }),
                );
            }
            if let Some(wake) = &app.wake {
                wake.notify_one();
            }
            record_accepted(app, message, *lane);
            log_decision(decision);
            decision.response()
        }
        other => {
            log_decision(other);
            other.response()
        }
    }
}

/// Writes Start's `enqueued` entry to the record's history (off the request's path: the writer
/// never waits), so a save that arrived is on record before any run: its time, lane, correlation
/// id and trace, and a record nobody has taken yet reads as `queued`.
fn record_accepted(app: &App, message: &TriggerMessage, lane: Lane) {
    let runner = &app.lane(lane).runner;
    let Some(history) = runner.history() else {
        return;
    };
    let mut entry = HistoryEntry::new(
        message.scope.clone(),
        message.record_id.clone(),
        HistoryEvent::Enqueued,
    );
    entry.instance = runner.lock().options().holder.clone();
    entry.lane = Some(lane.as_str().to_string());
    entry.correlation_id = message.correlation_id.clone();
    entry.trace_id = message.trace().map(|t| t.trace_id_hex());
    history.record(entry.with_reason(format!("by Start, on {}", app.lane(lane).queue.name())));
}

fn log_decision(decision: &Decision) {
    match decision {
        Decision::Enqueue(m, lane) => tracing::info!(scope = %m.scope, record = %m.record_id,
            correlation_id = m.correlation_id.as_deref().unwrap_or(""), %lane, outcome = "enqueued",
            trace_id = m.trace().map(|t| t.trace_id_hex()).unwrap_or_default(), "start: trigger accepted"),
        Decision::Ignore {
            scope,
            record_id,
            reason,
        } => {
            tracing::info!(%scope, record = %record_id, outcome = "ignored", %reason, "start: trigger ignored")
        }
        Decision::Reject(rejection) => {
            tracing::warn!(status = rejection.status(), error = %rejection, outcome = "rejected", "start: request refused")
        }
    }
}

async fn invoke(State(app): State<Arc<App>>, Path(function): Path<String>, request: Request) -> Response {
    let body = match read_body(&mut request.into_body(), MAX_INVOCATION_BYTES, app.body_timeout).await {
        Ok(b) => b,
        Err(rejection) => return refuse(rejection),
    };
    let payload: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return json_response(400, json!({ "error": format!("invocation is not JSON: {e}") })),
    };
    match function.as_str() {
        START_FUNCTION => invoke_start(&app, &payload).await,
        WORKER_FUNCTION => invoke_worker(&app, app.lane(Lane::High), &payload).await,
        WORKER_LOW_FUNCTION => invoke_worker(&app, app.lane(Lane::Low), &payload).await,
        other => json_response(404, json!({ "error": format!("no function named {other:?}") })),
    }
}

async fn invoke_start(app: &App, payload: &Value) -> Response {
    let req = match handler::parse_http_invocation(payload) {
        Ok(r) => r,
        Err(e) => return json_response(400, json!({ "error": e.to_string() })),
    };
    // The host already checked the function key (authLevel: function).
    let request = StartRequest {
        method: &req.method,
        headers: req.headers.clone(),
        query: req.query.clone(),
        body: &req.body,
        check_key: false,
    };
    let mut decision = decide(&app.policy, &request);
    // The host puts the message (the output binding) once we answer: the span ends with the
    // answer.
    let _span = trace_decision(&mut decision, &request, |lane| {
        app.lane(lane).queue.name().to_string()
    });
    if let Decision::Enqueue(message, lane) = &decision {
        // The host puts it once we answer.
        record_accepted(app, message, *lane);
    }
    log_decision(&decision);
    let (status, body) = decision.response();
    count_start_response(status);
    let enqueue = match &decision {
        Decision::Enqueue(m, lane) => Some((m, *lane)),
        _ => None,
    };
    let log = format!("start: {}", body);
    json_response(
        200,
        handler::http_invocation_response(status, &body, enqueue, vec![log]),
    )
}

async fn invoke_worker(app: &App, lane: &LaneParts, payload: &Value) -> Response {
    let invocation = match handler::parse_queue_invocation(payload) {
        Ok(i) => i,
        Err(e) => return json_response(400, json!({ "error": e.to_string() })),
    };
    let message = match invocation.message {
        Ok(m) => m,
        Err(e) => {
            return poison_unreadable(
                lane,
                &invocation.raw,
                invocation.dequeue_count,
                Error::Unreadable(e),
            )
            .await;
        }
    };
    let delivery = Delivery {
        message: message.clone(),
        dequeue_count: invocation.dequeue_count,
    };
    // The host keeps its message hidden for 10 minutes whatever happens to us: the watchdog
    // carries this delivery if our host dies, and carries a failed run's retry.
    let outcome = lane
        .runner
        .handle_watched(&delivery, &*lane.poison, &app.shutdown)
        .await;
    let log = format!(
        "worker: {} {}/{}: {}",
        outcome.name(),
        message.scope,
        message.record_id,
        describe(&outcome)
    );
    match &outcome {
        o if o.acknowledge() => json_response(200, handler::queue_invocation_done(o.name(), vec![log])),
        // Any non-2xx fails the invocation: the host makes the message visible again after
        // visibilityTimeout and poisons it after maxDequeueCount.
        _ => json_response(
            500,
            json!({ "Outputs": {}, "Logs": [log], "error": describe(&outcome) }),
        ),
    }
}

fn describe(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Completed {
            fencing_token,
            retriggered,
            run_time,
        } => {
            format!("ran in {run_time:?} with fencing token {fencing_token:?}, retriggered: {retriggered}")
        }
        Outcome::Coalesced => "a run is in progress; it will run once more".into(),
        Outcome::Rechecking { after } => format!("lease held after a redelivery; rechecking in {after:?}"),
        Outcome::Retrying { error, after } => format!("{error}; retrying in {after:?}"),
        Outcome::Poisoned { error } => format!("moved to the poison queue: {error}"),
        Outcome::Failed { error, .. } => error.to_string(),
        Outcome::Superseded {
            fencing_token,
            retriggered,
            run_time,
        } => format!(
            "stopped after {run_time:?} with fencing token {fencing_token:?}: a trigger arrived during the run (supersede); retriggered: {retriggered}"
        ),
        Outcome::Deferred {
            after, total, why, ..
        } => {
            format!(
                "the logic asked to be run later ({why}); runs again in {after:?} (put off {total:?} in all)"
            )
        }
        Outcome::Waiting { after, .. } => {
            format!("waiting for the record's burst of triggers to end; looking again in {after:?}")
        }
        Outcome::Debounced { joined: true } => {
            "joined the record's wait: it runs once its burst of triggers has ended".into()
        }
        Outcome::Debounced { joined: false } => "another delivery ended this wait and runs the record".into(),
        Outcome::Paused { budget, after, .. } => format!(
            "downstream budget {budget} is paused after a throttle; the trigger comes back in {after:?}, not counted as an attempt"
        ),
    }
}

/// A message that can never be a trigger: moved to the poison queue with its reason (the host
/// would only retry it five times and then poison it without one), and the invocation succeeds.
async fn poison_unreadable(app: &LaneParts, raw: &str, dequeue_count: u32, error: Error) -> Response {
    let poison = PoisonMessage::new(raw.to_string(), None, &error, dequeue_count);
    let encoded = poison.encode();
    let reason = poison.reason();
    match RetryOptions::default()
        .run("write poison", || app.poison.put(&encoded, Duration::ZERO))
        .await
    {
        Ok(_) => {
            tracing::error!(%reason, poison_queue = app.poison.name(), "worker: message moved to the poison queue");
            record_outcome(&Outcome::Poisoned { error });
            json_response(
                200,
                handler::queue_invocation_done("poisoned", vec![format!("poisoned: {reason}")]),
            )
        }
        Err(e) => {
            let answer = json_response(
                500,
                json!({ "error": format!("could not write to the poison queue: {e}") }),
            );
            record_outcome(&Outcome::Failed {
                error: Error::Storage {
                    step: "write poison",
                    error: e.into(),
                },
                retriggered: false,
            });
            answer
        }
    }
}
