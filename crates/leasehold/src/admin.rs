//! The operator dashboard: one HTML page and a JSON API over [`Operator`], in both modes.
//!
//! | `serve` | Functions | what |
//! | --- | --- | --- |
//! | `GET /admin` | `GET /api/dashboard` (function `Dashboard`, anonymous) | the page (holds no data) |
//! | `GET /api/admin/overview` | `GET /api/ops/overview` (function `Ops`; the handler checks the key) | queues, held records, pending retriggers |
//! | `GET /api/admin/records/{scope}/{recordId}` | `GET /api/ops/records/…` | a record's lease, marker and recent outcome |
//! | `POST /api/admin/records/{scope}/{recordId}/enqueue` | `POST /api/ops/records/…/enqueue` | put a trigger for the record on the (high lane's) queue, as `leasehold enqueue` does (written to its history as `enqueued`) |
//! | `GET /api/admin/runs` | `GET /api/ops/runs` | recent runs across the deployment from the history, newest first (`?scope=`, `?outcome=` (repeated or comma-separated), `?since=` (`15m`, `1h`, `24h`, `7d`; default `1h`), `?limit=` (1–1000, default 100)); `partial` when the read stopped at its bound |
//! | `GET /api/admin/poison` | `GET /api/ops/poison` | poison entries and their reasons (`?lane=low`: the low lane's, for every poison operation) |
//! | `GET /api/admin/poison/{id}` | `GET /api/ops/poison/{id}` | one entry |
//! | `POST /api/admin/poison/requeue` | `POST /api/ops/poison/requeue` | requeue a selection |
//! | `POST /api/admin/poison/purge` | `POST /api/ops/poison/purge` | delete a selection (`"confirm": true`) |
//! | `GET /api/admin/budgets` | `GET /api/ops/budgets` | every downstream budget's pause from storage, with this process's live view of it (`here`) |
//! | `POST /api/admin/budgets/{name}/resume` | `POST /api/ops/budgets/{name}/resume` | end a budget's pause (here at once, every other worker within 3 s of its next look) |
//!
//! The Functions host reserves routes that start with `admin` for its own API (it refuses to
//! load such a function), hence `ops/` there. The page is told its API base and key header by
//! `<meta>` tags filled in when it is served ([`Page`]).
//!
//! Auth, in both modes: `LEASEHOLD_ADMIN_KEY` as the `x-leasehold-admin-key` header (never a
//! cookie or the query string, so a link or a cross-site form cannot act with it), compared in
//! constant time, by Leasehold itself. Under Functions the host forwards the header in the
//! invocation and the handler checks it: the handler's port is open to every process on the
//! machine (a logic command among them), so a check left to the host alone was no check for
//! them. Without the setting the API does not exist (`serve`: 404; Functions: `Ops` answers 404
//! saying so). Refused keys are logged at most once a minute, with their count ([`Refusals`]).
//!
//! This layer has no logic of its own: it reads the request, calls the [`Operator`] (and, for
//! budgets, this process's [`Budgets`], which the mode's router builder is given) and writes what
//! it answered (its errors with their status).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use base64::Engine;
use leasehold_functions::handler::{self, HostHttpRequest};
use leasehold_functions::start::Secret;
use leasehold_runtime::{BudgetView, Budgets, Lane, RecordId, Scope, check_budget_name};
use serde::Serialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use leasehold_ops::{BudgetStatus, Operator, OpsError, OverviewQuery, PoisonQuery, PoisonSelection};

/// The header `serve`'s dashboard key travels in.
pub const KEY_HEADER: &str = "x-leasehold-admin-key";
/// Shortest `LEASEHOLD_ADMIN_KEY` taken (characters): it opens requeue and purge of the poison
/// queue, and is the only key between the network and them.
pub const MIN_KEY_CHARS: usize = 32;
/// Largest request body the API reads (a selection of poison entry ids).
pub const MAX_BODY_BYTES: usize = 16 * 1024;
/// `serve`'s page and API base.
pub const PAGE_PATH: &str = "/admin";
pub const API_BASE: &str = "/api/admin";
/// The function folders and the API base under Functions (route `ops/{*path}`, route prefix `api`).
pub const OPS_FUNCTION: &str = "Ops";
pub const DASHBOARD_FUNCTION: &str = "Dashboard";
pub const FUNCTIONS_API_BASE: &str = "/api/ops";

const PAGE: &str = include_str!("../assets/admin.html");

/// A request to the API as both modes read it: `path` is what follows the API base, without
/// its leading `/` (`poison/requeue`), still percent-encoded.
#[derive(Debug)]
pub struct ApiRequest<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub query: Vec<(String, String)>,
    pub body: &'a [u8],
}

/// The API's answer: a status and a JSON body (`{"error": …}` for a refusal).
pub type ApiAnswer = (u16, Value);

fn error(status: u16, message: impl std::fmt::Display) -> ApiAnswer {
    (status, json!({ "error": message.to_string() }))
}

fn done<T: Serialize>(result: Result<T, OpsError>) -> ApiAnswer {
    match result {
        Ok(value) => match serde_json::to_value(value) {
            Ok(v) => (200, v),
            Err(e) => error(500, format!("the answer could not be written: {e}")),
        },
        Err(e) => error(e.status(), e),
    }
}

/// Decodes `%XX` escapes of one path segment (a record id may hold any character).
fn decode_segment(segment: &str) -> Result<String, String> {
    let bytes = segment.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("{segment:?} has a bad %-escape"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("{segment:?} is not UTF-8 once decoded"))
}

/// A record named in a path, or the 400 naming what is wrong with it.
fn record_of(scope: &str, record_id: &str) -> Result<(Scope, RecordId), ApiAnswer> {
    let scope = Scope::parse(scope).map_err(|e| error(400, format!("scope: {e}")))?;
    let record_id = RecordId::parse(record_id).map_err(|e| error(400, format!("recordId: {e}")))?;
    Ok((scope, record_id))
}

fn query_value<'a>(query: &'a [(String, String)], name: &str) -> Option<&'a str> {
    query
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
        .filter(|v| !v.is_empty())
}

fn limit(query: &[(String, String)]) -> Result<Option<usize>, ApiAnswer> {
    query_value(query, "limit")
        .map(|v| {
            v.parse::<usize>()
                .map_err(|_| error(400, format!("limit must be a whole number, not {v:?}")))
        })
        .transpose()
}

/// The run list's query: `scope`, `outcome` (repeated or comma-separated), `since` (a window:
/// `15m`, `1h`, `24h`, `7d`, or seconds; `1h` unless given) and `limit`; 400 naming the bad one.
fn run_query(query: &[(String, String)]) -> Result<leasehold_ops::RunQuery, ApiAnswer> {
    let scope = query_value(query, "scope")
        .map(Scope::parse)
        .transpose()
        .map_err(|e| error(400, format!("scope: {e}")))?;
    let outcomes = query
        .iter()
        .filter(|(k, _)| k == "outcome")
        .flat_map(|(_, v)| v.split(','))
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(str::to_string)
        .collect();
    let window = match query_value(query, "since") {
        Some(text) => leasehold_ops::parse_window(text).map_err(|e| error(400, format!("since: {e}")))?,
        None => leasehold_ops::RunQuery::default().window,
    };
    Ok(leasehold_ops::RunQuery {
        scope,
        outcomes,
        window,
        limit: limit(query)?.unwrap_or(leasehold_ops::DEFAULT_RUNS_LIMIT),
    })
}

/// The operator for the lane `?lane=` names (`high`, the default, or `low`): its poison tools act
/// on that lane's poison queue. 400 for an unknown lane; 404 when the deployment has no low lane
/// (never the high lane's queue in its stead: a purge must act where it was aimed).
fn for_lane(operator: &Operator, query: &[(String, String)]) -> Result<Operator, ApiAnswer> {
    let Some(text) = query_value(query, "lane") else {
        return Ok(operator.clone());
    };
    let lane: Lane = text.parse().map_err(|e| error(400, format!("lane: {e}")))?;
    let operator = operator.clone().lane(lane);
    if operator.lane_of() != lane {
        return Err(error(404, format!("this deployment has no {lane} lane")));
    }
    Ok(operator)
}

/// A JSON body, or 400 naming what is wrong with it.
fn json_body(body: &[u8]) -> Result<Value, ApiAnswer> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(error(400, "the request needs a JSON body"));
    }
    serde_json::from_slice(body).map_err(|e| error(400, format!("the body is not JSON: {e}")))
}

fn selection(body: &Value) -> Result<PoisonSelection, ApiAnswer> {
    let mut body = body.clone();
    if let Some(map) = body.as_object_mut() {
        map.remove("confirm");
    }
    serde_json::from_value(body).map_err(|e| {
        error(
            400,
            format!(
                "the body must select entries: {{\"ids\": [..]}}, {{\"scope\": .., \"recordId\": ..}} or {{\"all\": true}} ({e})"
            ),
        )
    })
}

/// What the API acts through: the [`Operator`] over storage, and this process's downstream
/// [`Budgets`] (its live view of each, and a resume that ends a pause here at once), when it
/// runs deliveries.
#[derive(Debug, Clone)]
pub struct Backend {
    pub operator: Operator,
    pub budgets: Option<Budgets>,
}

impl Backend {
    pub fn new(operator: Operator, budgets: Option<Budgets>) -> Self {
        Self { operator, budgets }
    }
}

/// Carries out one API request.
pub async fn answer(backend: &Backend, request: &ApiRequest<'_>) -> ApiAnswer {
    let operator = &backend.operator;
    let segments: Vec<&str> = request.path.trim_matches('/').split('/').collect();
    let mut decoded = Vec::with_capacity(segments.len());
    for segment in &segments {
        match decode_segment(segment) {
            Ok(s) => decoded.push(s),
            Err(e) => return error(400, e),
        }
    }
    let parts: Vec<&str> = decoded.iter().map(String::as_str).collect();
    let method = request.method.to_ascii_uppercase();
    let (get, post) = (method == "GET", method == "POST");
    // The poison tools act on the lane the query names.
    let lane_operator;
    let operator = if parts.first() == Some(&"poison") {
        lane_operator = match for_lane(operator, &request.query) {
            Ok(o) => o,
            Err(answer) => return answer,
        };
        &lane_operator
    } else {
        operator
    };
    let wrong_method = |allowed: &str| {
        error(
            405,
            format!("{} answers {allowed} only, not {method}", request.path),
        )
    };
    match parts.as_slice() {
        ["overview"] if get => {
            let scope = match query_value(&request.query, "scope").map(Scope::parse).transpose() {
                Ok(s) => s,
                Err(e) => return error(400, format!("scope: {e}")),
            };
            let limit = match limit(&request.query) {
                Ok(l) => l,
                Err(answer) => return answer,
            };
            let query = OverviewQuery {
                scope,
                limit,
                after: query_value(&request.query, "after").map(str::to_string),
            };
            done(operator.overview(&query).await)
        }
        ["records", scope, record_id] if get => {
            let (scope, record_id) = match record_of(scope, record_id) {
                Ok(r) => r,
                Err(answer) => return answer,
            };
            let (record, history) = tokio::join!(
                operator.record(&scope, &record_id),
                operator.history(&scope, &record_id, RECORD_HISTORY_SHOWN)
            );
            // The state line from the lease and markers, and the history if there is one (off,
            // or unreadable: said so, and the record is still shown).
            let state = record.as_ref().ok().map(|view| {
                let state = leasehold_ops::RecordState::of(
                    view,
                    history.as_deref().unwrap_or_default(),
                    None,
                    std::time::SystemTime::now(),
                );
                match &history {
                    Err(e) => state.history_unreadable(&e.to_string()),
                    Ok(_) => state,
                }
            });
            let (status, mut body) = done(record);
            if status == 200
                && let Some(map) = body.as_object_mut()
            {
                map.insert("recentOutcome".into(), recent_outcome(&scope, &record_id));
                if let Some(state) = state {
                    map.insert("state".into(), json!(state.state));
                    map.insert(
                        "until".into(),
                        json!(state.until.map(leasehold_ops::clock::rfc3339)),
                    );
                    map.insert("reason".into(), json!(state.reason));
                }
                match history {
                    Ok(h) => {
                        map.insert("history".into(), json!(h));
                    }
                    Err(e) => {
                        map.insert("history".into(), json!([]));
                        map.insert("historyUnavailable".into(), json!(e.to_string()));
                    }
                }
            }
            (status, body)
        }
        ["records", scope, record_id, "enqueue"] if post => {
            let (scope, record_id) = match record_of(scope, record_id) {
                Ok(r) => r,
                Err(answer) => return answer,
            };
            match operator.enqueue(&scope, &record_id).await {
                Ok(_) => {
                    tracing::info!(%scope, record = %record_id, "dashboard: a trigger enqueued");
                    (
                        200,
                        json!({
                            "scope": scope,
                            "recordId": record_id,
                            "queue": operator.queue_name(),
                            "message": format!("enqueued {scope}/{record_id} on {}: it runs when a worker takes it", operator.queue_name()),
                        }),
                    )
                }
                Err(e) => error(e.status(), e),
            }
        }
        ["runs"] if get => match run_query(&request.query) {
            Ok(query) => done(operator.runs(&query).await),
            Err(answer) => answer,
        },
        ["poison"] if get => match limit(&request.query) {
            Ok(limit) => done(operator.poison_list(&PoisonQuery { limit }).await),
            Err(answer) => answer,
        },
        ["poison", "requeue"] if post => {
            let selection = match json_body(request.body).and_then(|b| selection(&b)) {
                Ok(s) => s,
                Err(answer) => return answer,
            };
            let report = operator.poison_requeue(&selection, &|_| {}).await;
            if let Ok(r) = &report {
                tracing::info!(report = %serde_json::to_string(r).unwrap_or_default(), "dashboard: poison entries requeued");
            }
            done(report)
        }
        ["poison", "purge"] if post => {
            let body = match json_body(request.body) {
                Ok(b) => b,
                Err(answer) => return answer,
            };
            if body.get("confirm") != Some(&Value::Bool(true)) {
                return error(
                    400,
                    "purging deletes poison entries for good: the body must include \"confirm\": true",
                );
            }
            let selection = match selection(&body) {
                Ok(s) => s,
                Err(answer) => return answer,
            };
            let report = operator.poison_purge(&selection).await;
            if let Ok(r) = &report {
                tracing::warn!(report = %serde_json::to_string(r).unwrap_or_default(), "dashboard: poison entries purged");
            }
            done(report)
        }
        ["poison", "requeue" | "purge"] => wrong_method("POST"),
        ["poison", id] if get => done(operator.poison_show(id).await),
        ["budgets"] if get => budgets(backend).await,
        ["budgets", name, "resume"] if post => resume(backend, name).await,
        ["budgets", _, "resume"] => wrong_method("POST"),
        ["records", _, _, "enqueue"] => wrong_method("POST"),
        ["overview"] | ["records", _, _] | ["poison"] | ["budgets"] | ["runs"] => wrong_method("GET"),
        ["poison", _] => wrong_method("GET"),
        _ => error(
            404,
            format!(
                "no such operation: {} (overview, records/{{scope}}/{{recordId}}, records/{{scope}}/{{recordId}}/enqueue, runs, poison, poison/{{id}}, poison/requeue, poison/purge, budgets, budgets/{{name}}/resume)",
                request.path
            ),
        ),
    }
}

/// This process's live view of one budget, as the API writes it (`here`).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct Here {
    /// The adaptive limit: runs of the budget this process starts at once.
    limit: usize,
    in_flight: usize,
    /// Deliveries waiting for a slot or the pause, per lane.
    waiting_high: usize,
    waiting_low: usize,
    /// Throttles this process has seen, and of those the ones taken as one record's refusals.
    throttles: u64,
    record_refusals: u64,
    /// How much longer this process honours the pause (it learns of a pause or resume written
    /// elsewhere within 3 s of its next look).
    paused_here_for_seconds: u64,
}

impl From<&BudgetView> for Here {
    fn from(v: &BudgetView) -> Self {
        Self {
            limit: v.limit,
            in_flight: v.in_flight,
            waiting_high: v.waiting.0,
            waiting_low: v.waiting.1,
            throttles: v.throttles,
            record_refusals: v.record_refusals,
            paused_here_for_seconds: v.paused_for.as_secs_f64().ceil() as u64,
        }
    }
}

/// `GET budgets`: every budget storage holds ([`Operator::budget_status`]), and every budget this
/// process has met that storage does not (never paused), each with this process's live view
/// (`here`; `null` when this process runs no deliveries of it). `written` says whether storage
/// holds it (only a written budget can be resumed).
async fn budgets(backend: &Backend) -> ApiAnswer {
    let stored = match backend.operator.budget_status(None).await {
        Ok(s) => s,
        Err(e) => return error(e.status(), e),
    };
    let views = backend.budgets.as_ref().map(Budgets::views).unwrap_or_default();
    let mut rows: Vec<(BudgetStatus, bool)> = stored.into_iter().map(|s| (s, true)).collect();
    for view in &views {
        if !rows.iter().any(|(s, _)| s.name == view.name) {
            rows.push((
                BudgetStatus {
                    name: view.name.clone(),
                    paused: false,
                    until: None,
                    paused_for_seconds: 0,
                    set_at: None,
                    limit: None,
                    resumed: false,
                },
                false,
            ));
        }
    }
    rows.sort_by(|a, b| a.0.name.cmp(&b.0.name));
    let mut out = Vec::with_capacity(rows.len());
    for (status, written) in rows {
        let here = views.iter().find(|v| v.name == status.name).map(Here::from);
        let mut row = match serde_json::to_value(&status) {
            Ok(v) => v,
            Err(e) => return error(500, format!("the answer could not be written: {e}")),
        };
        if let Some(map) = row.as_object_mut() {
            map.insert("written".into(), Value::Bool(written));
            map.insert(
                "here".into(),
                here.and_then(|h| serde_json::to_value(h).ok())
                    .unwrap_or(Value::Null),
            );
        }
        out.push(row);
    }
    (
        200,
        json!({
            "budgets": out,
            // Whether this process runs deliveries (and so has a live view of its budgets).
            "live": backend.budgets.is_some(),
            "at": leasehold_ops::clock::rfc3339(std::time::SystemTime::now()),
        }),
    )
}

/// `POST budgets/{name}/resume`: ends the budget's pause. Through this process's [`Budgets`]
/// when it has them (storage, and here at once: its waiting deliveries start now), else through
/// storage alone ([`Operator::budget_resume`]); every other worker follows within 3 s of its next
/// look. 400 for a bad name, 404 for a budget never paused (storage does not hold it, nor is it
/// paused here).
async fn resume(backend: &Backend, name: &str) -> ApiAnswer {
    if let Err(e) = check_budget_name(name) {
        return error(400, e);
    }
    let name = name.to_ascii_lowercase();
    let was = match &backend.budgets {
        None => match backend.operator.budget_resume(&name).await {
            Ok(was) => was,
            Err(e) => return error(e.status(), e),
        },
        Some(budgets) => {
            let paused_here = budgets
                .views()
                .iter()
                .any(|v| v.name == name && !v.paused_for.is_zero());
            let written = match budgets.store().read(&name).await {
                Ok(read) => read.is_some(),
                Err(e) => return error(503, format!("storage: read the budget: {e}")),
            };
            if !written && !paused_here {
                return error(
                    404,
                    format!(
                        "no budget {name:?} was ever paused in this deployment (see `leasehold budget status`)"
                    ),
                );
            }
            match budgets.resume(&name).await {
                Ok(was) => was || paused_here,
                Err(e) => return error(503, format!("storage: resume the budget: {e}")),
            }
        }
    };
    tracing::info!(budget = %name, was_paused = was, "dashboard: budget resumed");
    let message = if was {
        format!("resumed budget {name}: its runs start again (other workers within 3 s of their next look)")
    } else {
        format!("budget {name} was not paused; nothing to end")
    };
    (200, json!({ "name": name, "wasPaused": was, "message": message }))
}

/// The last outcome of the record if this process handled it recently
/// ([`crate::recent_outcome`]), else `null` (the page says "not run by this instance").
fn recent_outcome(scope: &Scope, record_id: &RecordId) -> Value {
    crate::recent_outcome(scope, record_id)
        .and_then(|o| serde_json::to_value(o).ok())
        .unwrap_or(Value::Null)
}

/// The dashboard page for one mode: its HTML (the mode's API base and key header filled in)
/// and the security headers it is served with. Its script and style are allowed by their
/// SHA-256 hashes, so nothing else inline (an injected tag) could run.
#[derive(Debug, Clone)]
pub struct Page {
    html: String,
    csp: String,
}

impl Page {
    /// The page for `serve` (`/api/admin`, `x-leasehold-admin-key`).
    pub fn serve() -> Self {
        Self::new(API_BASE, KEY_HEADER)
    }

    /// The page under Functions (`/api/ops`, the same key header).
    pub fn functions() -> Self {
        Self::new(FUNCTIONS_API_BASE, KEY_HEADER)
    }

    fn new(api_base: &str, key_header: &str) -> Self {
        let html = PAGE
            .replace("{{API_BASE}}", api_base)
            .replace("{{KEY_HEADER}}", key_header);
        let hash = |open: &str, close: &str| {
            let start = html
                .find(open)
                .map(|i| i + open.len())
                .expect("the page has the tag");
            let end = start + html[start..].find(close).expect("the tag is closed");
            let digest = Sha256::digest(&html.as_bytes()[start..end]);
            format!(
                "'sha256-{}'",
                base64::engine::general_purpose::STANDARD.encode(digest)
            )
        };
        let csp = format!(
            "default-src 'none'; script-src {}; style-src {}; connect-src 'self'; img-src data:; \
             base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
            hash("<script>", "</script>"),
            hash("<style>", "</style>")
        );
        Self { html, csp }
    }

    /// The page's HTML.
    pub fn html(&self) -> &str {
        &self.html
    }

    /// The headers the page is served with.
    pub fn headers(&self) -> Vec<(&'static str, &str)> {
        vec![
            ("Content-Type", "text/html; charset=utf-8"),
            ("Content-Security-Policy", &self.csp),
            ("X-Content-Type-Options", "nosniff"),
            ("Cache-Control", "no-store"),
            ("Referrer-Policy", "no-referrer"),
            ("X-Frame-Options", "DENY"),
        ]
    }
}

/// Headers of every API answer.
const API_HEADERS: [(&str, &str); 4] = [
    ("Content-Type", "application/json"),
    ("Cache-Control", "no-store"),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
];

fn with_headers(status: u16, body: Body, headers: &[(&str, &str)]) -> Response {
    let mut response = (
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        body,
    )
        .into_response();
    for (name, value) in headers {
        if let (Ok(name), Ok(value)) = (HeaderName::try_from(*name), HeaderValue::try_from(*value)) {
            response.headers_mut().insert(name, value);
        }
    }
    response
}

fn api_response((status, body): ApiAnswer) -> Response {
    with_headers(status, Body::from(body.to_string()), &API_HEADERS)
}

/// Reads a body of at most [`MAX_BODY_BYTES`], all of it within `deadline`.
async fn read_body(body: Body, limit: usize, deadline: Duration) -> Result<Bytes, ApiAnswer> {
    match tokio::time::timeout(deadline, axum::body::to_bytes(body, limit)).await {
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(e)) => {
            let e = e.into_inner();
            if e.is::<http_body_util::LengthLimitError>() {
                Err(error(413, format!("the body is over {limit} bytes")))
            } else {
                Err(error(400, format!("the body could not be read: {e}")))
            }
        }
        Err(_) => Err(error(
            408,
            format!(
                "the body did not arrive within {} s (LEASEHOLD_HTTP_BODY_TIMEOUT_SECONDS)",
                deadline.as_secs()
            ),
        )),
    }
}

/// What `serve`'s dashboard routes share.
#[derive(Debug)]
struct Served {
    backend: Backend,
    key: Secret,
    page: Page,
    body_timeout: Duration,
    refusals: Refusals,
}

/// Refused keys, logged quietly: the first at once, then at most one line a minute with the count
/// since the last (a client guessing keys cannot fill the log, and the operator still sees it).
#[derive(Debug, Default)]
pub struct Refusals {
    state: std::sync::Mutex<RefusalState>,
}

#[derive(Debug, Default)]
struct RefusalState {
    logged_at: Option<std::time::Instant>,
    unlogged: u64,
}

impl Refusals {
    /// How often a line is written at most.
    pub const EVERY: Duration = Duration::from_secs(60);

    /// Counts a refusal of a request for `path`; returns how many refusals the line it wrote
    /// covers, or `None` when it wrote none (the next line will count this one).
    pub fn refused(&self, path: &str) -> Option<u64> {
        self.refused_at(path, std::time::Instant::now())
    }

    fn refused_at(&self, path: &str, now: std::time::Instant) -> Option<u64> {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        state.unlogged += 1;
        if state
            .logged_at
            .is_some_and(|at| now.duration_since(at) < Self::EVERY)
        {
            return None;
        }
        let count = std::mem::take(&mut state.unlogged);
        state.logged_at = Some(now);
        tracing::warn!(%path, refused = count,
            "dashboard: requests without the right {KEY_HEADER} refused (this line is written at most once a minute)");
        Some(count)
    }
}

/// The refusal of a request without the right key (the same in both modes).
fn refused_answer() -> ApiAnswer {
    error(
        401,
        format!("send LEASEHOLD_ADMIN_KEY in the {KEY_HEADER} header"),
    )
}

/// `GET /admin` and `/api/admin/*` for `serve`, guarded by `key` (`LEASEHOLD_ADMIN_KEY`).
pub fn serve_router(backend: Backend, key: Secret, body_timeout: Duration) -> Router {
    let served = Arc::new(Served {
        backend,
        key,
        page: Page::serve(),
        body_timeout,
        refusals: Refusals::default(),
    });
    Router::new()
        .route(PAGE_PATH, get(serve_page))
        .route(&format!("{API_BASE}/{{*path}}"), any(serve_api))
        .route(API_BASE, any(serve_api))
        .layer(DefaultBodyLimit::disable())
        .with_state(served)
}

async fn serve_page(State(served): State<Arc<Served>>) -> Response {
    with_headers(
        200,
        Body::from(served.page.html().to_string()),
        &served.page.headers(),
    )
}

async fn serve_api(State(served): State<Arc<Served>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    // The key first: without it not a byte of the body is read.
    let presented = parts.headers.get(KEY_HEADER).and_then(|v| v.to_str().ok());
    if !served.key.matches(presented) {
        served.refusals.refused(parts.uri.path());
        let mut response = api_response(refused_answer());
        response.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("LeaseholdAdminKey"),
        );
        return response;
    }
    if let Some(length) = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<usize>().ok())
        && length > MAX_BODY_BYTES
    {
        return api_response(error(
            413,
            format!("the body is {length} bytes, over {MAX_BODY_BYTES}"),
        ));
    }
    let bytes = match read_body(body, MAX_BODY_BYTES, served.body_timeout).await {
        Ok(b) => b,
        Err(answer) => {
            let mut response = api_response(answer);
            if response.status() == StatusCode::REQUEST_TIMEOUT {
                response
                    .headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            return response;
        }
    };
    let path = parts
        .uri
        .path()
        .strip_prefix(API_BASE)
        .unwrap_or("")
        .trim_start_matches('/');
    let query = match parts.uri.query().map(url_pairs).transpose() {
        Ok(query) => query.unwrap_or_default(),
        Err(e) => return api_response(error(400, format!("the query string: {e}"))),
    };
    let request = ApiRequest {
        method: parts.method.as_str(),
        path,
        query,
        body: &bytes,
    };
    api_response(answer(&served.backend, &request).await)
}

/// The query's name/value pairs, `%XX` and `+` decoded; a bad escape is an error, not an
/// empty value (`limit=%zz` must not read as no limit).
fn url_pairs(query: &str) -> Result<Vec<(String, String)>, String> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let plus = |s: &str| s.replace('+', " ");
            Ok((decode_segment(&plus(k))?, decode_segment(&plus(v))?))
        })
        .collect()
}

/// What the custom handler's dashboard functions share.
#[derive(Debug)]
struct Hosted {
    backend: Backend,
    /// `LEASEHOLD_ADMIN_KEY`; `None`: the API is off.
    key: Option<Secret>,
    page: Page,
    body_timeout: Duration,
    refusals: Refusals,
}

/// `POST /Ops` and `POST /Dashboard` for `leasehold handler`: the Functions host's invocations
/// of the dashboard's functions. `Ops` checks `key` (`LEASEHOLD_ADMIN_KEY`) in the forwarded
/// `x-leasehold-admin-key` header itself: whoever reaches the handler's port, the host or any
/// local process, needs it.
pub fn handler_router(backend: Backend, key: Option<Secret>, body_timeout: Duration) -> Router {
    let hosted = Arc::new(Hosted {
        backend,
        key,
        page: Page::functions(),
        body_timeout,
        refusals: Refusals::default(),
    });
    Router::new()
        .route(&format!("/{OPS_FUNCTION}"), post(invoke_ops))
        .route(&format!("/{DASHBOARD_FUNCTION}"), post(invoke_dashboard))
        .layer(DefaultBodyLimit::disable())
        .with_state(hosted)
}

/// The envelope the host wraps a request in: headers, URL, metadata.
const ENVELOPE_BYTES: usize = 64 * 1024;

async fn read_invocation(body: Body, deadline: Duration) -> Result<HostHttpRequest, ApiAnswer> {
    // The host's request body is a JSON string: escaping can double its size.
    let bytes = read_body(body, 2 * MAX_BODY_BYTES + ENVELOPE_BYTES, deadline).await?;
    let payload: Value =
        serde_json::from_slice(&bytes).map_err(|e| error(400, format!("invocation is not JSON: {e}")))?;
    handler::parse_http_invocation(&payload).map_err(|e| error(400, e))
}

/// The host's answer carrying `status` and `body` to the caller (the invocation itself
/// succeeds: a 4xx for the caller is no failed invocation).
fn host_answer(status: u16, body: &str, headers: &[(&str, &str)], log: Option<String>) -> Response {
    let payload = handler::http_response(status, body, headers, log.into_iter().collect());
    with_headers(
        200,
        Body::from(payload.to_string()),
        &[("Content-Type", "application/json")],
    )
}

/// The API path from the host's request: what follows `/ops/` in its URL, or the `path` route
/// parameter.
fn hosted_path(req: &HostHttpRequest) -> String {
    let url_path = req.url.split_once("://").map_or(req.url.as_str(), |(_, rest)| {
        rest.find('/').map_or("", |i| &rest[i..])
    });
    let url_path = url_path.split(['?', '#']).next().unwrap_or("");
    let base = FUNCTIONS_API_BASE.trim_start_matches("/api");
    if let Some(i) = url_path.find(&format!("{base}/")) {
        return url_path[i + base.len() + 1..].to_string();
    }
    req.param("path").unwrap_or("").to_string()
}

async fn invoke_ops(State(hosted): State<Arc<Hosted>>, request: Request) -> Response {
    let req = match read_invocation(request.into_body(), hosted.body_timeout).await {
        Ok(r) => r,
        Err((status, body)) => return with_headers(status, Body::from(body.to_string()), &API_HEADERS),
    };
    let answer = if let Some(refused) = hosted_refusal(&hosted, &req) {
        refused
    } else if req.body.len() > MAX_BODY_BYTES {
        error(
            413,
            format!("the body is {} bytes, over {MAX_BODY_BYTES}", req.body.len()),
        )
    } else {
        let path = hosted_path(&req);
        let api = ApiRequest {
            method: &req.method,
            path: &path,
            query: req.query.clone(),
            body: &req.body,
        };
        answer(&hosted.backend, &api).await
    };
    // A refused request writes no log line of the host's (anyone can make one: the handler's
    // own line is throttled, see `Refusals`).
    let log =
        (answer.0 != 401).then(|| format!("ops: {} {} answered {}", req.method, hosted_path(&req), answer.0));
    host_answer(answer.0, &answer.1.to_string(), &API_HEADERS, log)
}

/// The refusal of an `Ops` invocation, if it is refused: the API is off, or the forwarded key
/// is not the key.
fn hosted_refusal(hosted: &Hosted, req: &HostHttpRequest) -> Option<ApiAnswer> {
    let Some(key) = &hosted.key else {
        return Some(error(
            404,
            "the dashboard's API is off: set LEASEHOLD_ADMIN_KEY (at least 32 characters) in the app settings",
        ));
    };
    if key.matches(req.header(KEY_HEADER)) {
        return None;
    }
    hosted
        .refusals
        .refused(&format!("{FUNCTIONS_API_BASE}/{}", hosted_path(req)));
    Some(refused_answer())
}

async fn invoke_dashboard(State(hosted): State<Arc<Hosted>>, request: Request) -> Response {
    if let Err((status, body)) = read_invocation(request.into_body(), hosted.body_timeout).await {
        return with_headers(status, Body::from(body.to_string()), &API_HEADERS);
    }
    host_answer(
        200,
        hosted.page.html(),
        &hosted.page.headers(),
        Some("dashboard: page served".into()),
    )
}

/// How many history entries the record view shows (the dashboard's record page).
const RECORD_HISTORY_SHOWN: usize = 50;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_names_its_api_and_key_header_and_allows_only_its_own_script() {
        let page = Page::serve();
        assert!(page.html().contains(r#"content="/api/admin""#));
        assert!(page.html().contains(r#"content="x-leasehold-admin-key""#));
        assert!(!page.html().contains("{{"), "every placeholder is filled in");
        let functions = Page::functions();
        assert!(functions.html().contains(r#"content="/api/ops""#));
        assert!(functions.html().contains(r#"content="x-leasehold-admin-key""#));
        let csp = page
            .headers()
            .into_iter()
            .find(|(k, _)| *k == "Content-Security-Policy")
            .unwrap()
            .1
            .to_string();
        assert!(
            csp.starts_with("default-src 'none'; script-src 'sha256-"),
            "{csp}"
        );
        assert!(
            !csp.contains("unsafe-inline") && csp.contains("frame-ancestors 'none'"),
            "{csp}"
        );
        // One script and one style element, no inline handlers or style attributes (the hash
        // covers the element's text only).
        for (what, count) in [
            ("<script", 1),
            ("<style", 1),
            (" onclick=", 0),
            (" style=", 0),
            ("innerHTML", 0),
        ] {
            assert_eq!(page.html().matches(what).count(), count, "{what}");
        }
        // No network fetches but its own API.
        for external in ["http://", "https://", "//fonts", "cdn"] {
            assert!(!page.html().contains(external), "{external}");
        }
    }

    /// The function folders are named as the handler routes them, and the API's route is the
    /// base the page is given.
    #[test]
    fn the_function_folders_match_the_handler() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let read = |function: &str| -> Value {
            let text = std::fs::read_to_string(root.join(function).join("function.json"))
                .unwrap_or_else(|e| panic!("{function}/function.json: {e}"));
            serde_json::from_str(&text).unwrap()
        };
        let ops = read(OPS_FUNCTION);
        assert_eq!(
            format!("/api/{}", ops["bindings"][0]["route"].as_str().unwrap()),
            format!("{FUNCTIONS_API_BASE}/{{*path}}")
        );
        assert_eq!(ops["bindings"][0]["authLevel"], "anonymous");
        assert_eq!(read(DASHBOARD_FUNCTION)["bindings"][0]["route"], "dashboard");
    }

    #[test]
    fn refused_keys_are_logged_at_most_once_a_minute_with_their_count() {
        let refusals = Refusals::default();
        let t0 = std::time::Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert_eq!(refusals.refused_at("/api/admin/overview", at(0)), Some(1));
        for s in [1, 2, 30, 59] {
            assert_eq!(refusals.refused_at("/api/admin/overview", at(s)), None, "{s} s");
        }
        // The next line counts the four it did not write and its own.
        assert_eq!(refusals.refused_at("/api/admin/poison", at(60)), Some(5));
        assert_eq!(refusals.refused_at("/api/admin/poison", at(61)), None);
        assert_eq!(refusals.refused_at("/api/admin/poison", at(200)), Some(2));
    }

    #[test]
    fn path_segments_are_percent_decoded_and_bad_escapes_refused() {
        assert_eq!(decode_segment("a%2Fb%20c").unwrap(), "a/b c");
        assert!(decode_segment("a%2").is_err());
        assert!(decode_segment("%ff").is_err());
        assert!(url_pairs("limit=%zz").is_err());
        assert_eq!(
            url_pairs("scope=account&limit=5&after=a%2Fb+c").unwrap(),
            [
                ("scope".to_string(), "account".to_string()),
                ("limit".into(), "5".into()),
                ("after".into(), "a/b c".into())
            ]
        );
    }

    #[test]
    fn the_hosted_path_comes_from_the_url_or_the_route_parameter() {
        let req = |url: &str, path: Option<&str>| HostHttpRequest {
            url: url.into(),
            params: path
                .map(|p| vec![("path".to_string(), p.to_string())])
                .unwrap_or_default(),
            ..HostHttpRequest::default()
        };
        assert_eq!(
            hosted_path(&req(
                "https://app.azurewebsites.net/api/ops/records/account/a%2Fb?x=1",
                None
            )),
            "records/account/a%2Fb"
        );
        assert_eq!(hosted_path(&req("", Some("poison/requeue"))), "poison/requeue");
    }
}
