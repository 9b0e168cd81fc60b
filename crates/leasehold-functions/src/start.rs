//! Start: turns an HTTP request into a trigger, or into a clear refusal that changes nothing.
//!
//! Accepted bodies: `{"scope": "...", "recordId": "..."}` (scope optional, default `default`),
//! or a Dataverse webhook body (a serialised RemoteExecutionContext). This module is pure: it
//! decides; the callers (standalone endpoint, custom handler) enqueue and answer.

use serde_json::Value;
use sha2::{Digest, Sha256};
use subtle::{Choice, ConstantTimeEq};
use uuid::Uuid;

use leasehold_runtime::trace::{self, Span, TRACEPARENT, TRACESTATE, TraceContext};

use leasehold_runtime::{Field, InvalidName, Lane, MAX_CORRELATION_ID_LEN, RecordId, Scope, TriggerMessage};

use leasehold_dataverse::context::{NoRecord, guid_of, looks_like_context, record_of};

/// Largest request body accepted. Dataverse sends at most 256 KB before it trims the context
/// (`x-ms-dynamics-msg-size-exceeded`); twice that leaves room for encoding differences.
pub const MAX_BODY_BYTES: usize = 512 * 1024;

/// A secret (an API key): its `Debug` and `Display` never show it; [`expose`](Self::expose)
/// reads it where it is needed.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The secret itself, for the one place that compares or sends it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether `presented` is this secret, compared in constant time (SHA-256 digests of both,
    /// so neither the time taken nor anything else tells how much of it a guess got right).
    pub fn matches(&self, presented: Option<&str>) -> bool {
        key_matches(self, presented).into()
    }
}

impl From<&str> for Secret {
    fn from(value: &str) -> Self {
        Self::new(value)
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// What Start needs to know besides the request.
#[derive(Clone, Default, Debug)]
pub struct StartPolicy {
    /// `LEASEHOLD_API_KEY`: when set (standalone mode), requests must present it as the
    /// `x-functions-key` header or the `code` query parameter.
    pub api_key: Option<Secret>,
    /// `LEASEHOLD_ALLOWED_ORGANIZATIONS`: when set, only requests naming one of these
    /// organisations (id, unique name or host, case-insensitive) are accepted.
    pub allowed_organizations: Vec<String>,
    /// `LEASEHOLD_INTEGRATION_USER_IDS`: events initiated by these users (the integration's own
    /// writes) are ignored, which breaks write-back loops.
    pub integration_user_ids: Vec<Uuid>,
    /// `LEASEHOLD_MAX_DEPTH`: Dataverse events deeper than this are ignored.
    pub max_depth: Option<u64>,
    /// `LEASEHOLD_LOW_PRIORITY_USER_IDS`: events initiated by these users (an import's or an
    /// integration's) go to the low lane.
    pub low_priority_user_ids: Vec<Uuid>,
    /// With no key: refuse what only a web page sends ([`refuse_web_pages`]). Set where Start
    /// listens on loopback without a key (standalone); not behind a front end that
    /// authenticates callers (`LEASEHOLD_INSECURE_NO_START_KEY`), whose `Host` is public.
    pub refuse_web_pages: bool,
}

/// The parts of an HTTP request Start looks at.
#[derive(Debug, Clone, Default)]
pub struct StartRequest<'a> {
    pub method: &'a str,
    /// Header (name, value) pairs; names compared case-insensitively.
    pub headers: Vec<(String, String)>,
    /// Query (name, value) pairs.
    pub query: Vec<(String, String)>,
    pub body: &'a [u8],
    /// Whether Start must check the API key itself (standalone) or the host did (handler).
    pub check_key: bool,
}

impl StartRequest<'_> {
    /// The caller's trace context (`traceparent`, `tracestate`), if it sent a valid one; an
    /// invalid one is ignored (W3C: the trace starts afresh), never refused.
    pub fn trace_context(&self) -> Option<TraceContext> {
        TraceContext::parse(self.header(TRACEPARENT)?, self.header(TRACESTATE))
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn query(&self, name: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The header a caller (or the Functions host) names its correlation id in.
const CORRELATION_HEADER: &str = "x-ms-correlation-request-id";

/// Start's decision.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Enqueue this trigger in this lane's queue and answer 202.
    Enqueue(TriggerMessage, Lane),
    /// Answer 200 and enqueue nothing (loop protection); the reason is logged and returned.
    Ignore {
        scope: Scope,
        record_id: RecordId,
        reason: IgnoreReason,
    },
    /// Answer the rejection's 4xx with its text and enqueue nothing.
    Reject(Rejection),
}

/// Why Start refused a request. Each owns the HTTP status it is answered with; nothing was
/// enqueued.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Rejection {
    #[error("method {0} not allowed: POST a record id")]
    MethodNotAllowed(String),
    #[error("missing or wrong key: send it as the x-functions-key header or the code query parameter")]
    WrongKey,
    #[error("unsupported content type {0:?}: send application/json")]
    UnsupportedContentType(String),
    /// No `Content-Type`: a web page can send such a POST cross-site without asking the server
    /// first (no CORS preflight), so Start never takes one.
    #[error("no Content-Type: send Content-Type: application/json")]
    MissingContentType,
    /// A Start without a key (on loopback) refuses what only a web page in a browser sends: an
    /// `Origin` header, or a `Host` that is a name other than `localhost` (a DNS-rebinding page
    /// reaches 127.0.0.1 under its own name).
    #[error("{0}")]
    FromAWebPage(String),
    #[error("body of {0} bytes is over the limit of {MAX_BODY_BYTES}")]
    BodyTooLarge(usize),
    #[error("empty body: send {{\"recordId\": \"...\"}} or a Dataverse webhook body")]
    EmptyBody,
    #[error("malformed JSON: {0}")]
    MalformedJson(String),
    #[error("the body must be a JSON object")]
    NotAnObject,
    /// The organisation named (by header or in the Dataverse context) is not allowed.
    #[error("organization {0:?} is not allowed to trigger this environment")]
    OrganizationNotAllowed(String),
    /// Allowed organisations are set and the request names none.
    #[error("this environment only accepts requests from its allowed organizations")]
    OrganizationNotNamed,
    #[error("{0} must be a string")]
    NotAString(Field),
    #[error("recordId is missing")]
    MissingRecordId,
    #[error(transparent)]
    InvalidName(#[from] InvalidName),
    /// A Dataverse context that names no record.
    #[error(transparent)]
    NoRecord(#[from] NoRecord),
    /// A correlation id Start will not carry: the header `x-ms-correlation-request-id`, the
    /// body's `correlationId` or the Dataverse `CorrelationId`.
    #[error("{field} {problem}")]
    InvalidCorrelationId {
        field: &'static str,
        problem: CorrelationIdProblem,
    },
    /// A Dataverse `Depth` that is not a whole number, or none while `LEASEHOLD_MAX_DEPTH` is set:
    /// loop protection cannot be applied, so the event is refused rather than let through.
    #[error("{0}")]
    UnreadableDepth(DepthProblem),
    /// The body did not arrive within the body-read deadline.
    #[error("the body did not arrive within {0} s")]
    BodyTimeout(u64),
    /// The body could not be read (the connection failed while it was being sent).
    #[error("the body could not be read: {0}")]
    BodyUnreadable(String),
    /// A priority (the `priority` query parameter or body field) that is not `high` or `low`.
    #[error("{field} must be \"high\" or \"low\", not {value}")]
    InvalidPriority { field: &'static str, value: String },
}

/// What is wrong with a correlation id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CorrelationIdProblem {
    #[error("is {0} bytes, over the limit of {MAX_CORRELATION_ID_LEN}")]
    TooLong(usize),
    /// Anything but `!` to `~` (no spaces, no control characters, no non-ASCII): it is logged
    /// and carried in every message of the trigger.
    #[error("may hold only visible ASCII characters (! to ~)")]
    NotVisibleAscii,
    #[error("must be a string")]
    NotAString,
}

/// What is wrong with a Dataverse `Depth`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DepthProblem {
    #[error("Depth must be a whole number (Dataverse sends one): loop protection cannot be applied")]
    NotAWholeNumber,
    #[error("Depth is missing: LEASEHOLD_MAX_DEPTH is set, so a Dataverse body must carry it")]
    Missing,
}

impl Rejection {
    /// The HTTP status to answer with.
    pub fn status(&self) -> u16 {
        match self {
            Rejection::MethodNotAllowed(_) => 405,
            Rejection::WrongKey => 401,
            Rejection::UnsupportedContentType(_) | Rejection::MissingContentType => 415,
            Rejection::FromAWebPage(_) => 403,
            Rejection::BodyTooLarge(_) => 413,
            Rejection::OrganizationNotAllowed(_) | Rejection::OrganizationNotNamed => 403,
            Rejection::EmptyBody
            | Rejection::MalformedJson(_)
            | Rejection::NotAnObject
            | Rejection::NotAString(_)
            | Rejection::MissingRecordId
            | Rejection::InvalidName(_)
            | Rejection::NoRecord(_)
            | Rejection::InvalidCorrelationId { .. }
            | Rejection::UnreadableDepth(_)
            | Rejection::InvalidPriority { .. }
            | Rejection::BodyUnreadable(_) => 400,
            Rejection::BodyTimeout(_) => 408,
        }
    }
}

/// Why Start accepted a request but enqueued nothing: loop protection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IgnoreReason {
    /// The event was the integration's own write (`InitiatingUserId` is one of
    /// `LEASEHOLD_INTEGRATION_USER_IDS`).
    #[error("initiated by the integration's own user {0}: ignored to break a write-back loop")]
    IntegrationUser(Uuid),
    /// The event is deeper than `LEASEHOLD_MAX_DEPTH`.
    #[error("Depth {depth} is over the maximum {max}: ignored to break a loop")]
    TooDeep { depth: u64, max: u64 },
}

impl Decision {
    /// The HTTP status and JSON body to answer with once the decision is carried out.
    pub fn response(&self) -> (u16, Value) {
        match self {
            Decision::Enqueue(m, lane) => (
                202,
                serde_json::json!({
                    "enqueued": { "scope": m.scope, "recordId": m.record_id },
                    "correlationId": m.correlation_id,
                    "priority": lane.as_str(),
                    "traceId": m.trace().map(|t| t.trace_id_hex()),
                }),
            ),
            Decision::Ignore {
                scope,
                record_id,
                reason,
            } => (
                200,
                serde_json::json!({ "ignored": { "scope": scope, "recordId": record_id }, "reason": reason.to_string() }),
            ),
            Decision::Reject(rejection) => (
                rejection.status(),
                serde_json::json!({ "error": rejection.to_string() }),
            ),
        }
    }
}

/// Starts the `send` span of an accepted trigger, under the caller's trace context (or a new
/// trace: Dataverse sends none), and puts its context in the message: the answer then names
/// the trace ([`Decision::response`]'s `traceId`), and every delivery of the trigger joins it.
/// `queue_of` names the queue of a lane. End the span once the message is put.
pub fn trace_decision(
    decision: &mut Decision,
    req: &StartRequest<'_>,
    queue_of: impl Fn(Lane) -> String,
) -> Option<Span> {
    let Decision::Enqueue(message, lane) = decision else {
        return None;
    };
    Some(trace::send(
        &queue_of(*lane),
        message,
        req.trace_context().as_ref(),
    ))
}

/// Decides what to do with a request to `POST /api/start`.
pub fn decide(policy: &StartPolicy, req: &StartRequest<'_>) -> Decision {
    match accept(policy, req) {
        Ok(decision) => decision,
        Err(rejection) => Decision::Reject(rejection),
    }
}

/// The checks that need only the request head (method, key, content type, declared length).
/// The standalone endpoint runs them before it reads the body, so a client without the key
/// cannot make it read (and hold) a body; [`decide`] runs them too.
pub fn check_head(policy: &StartPolicy, req: &StartRequest<'_>) -> Result<(), Rejection> {
    if !req.method.eq_ignore_ascii_case("POST") {
        return Err(Rejection::MethodNotAllowed(req.method.to_string()));
    }
    if req.check_key && !key_accepted(policy, req.header("x-functions-key"), req.query("code")) {
        return Err(Rejection::WrongKey);
    }
    if req.check_key && policy.api_key.is_none() && policy.refuse_web_pages {
        refuse_web_pages(req.header("origin"), req.header("host"))?;
    }
    let Some(ct) = req.header("content-type") else {
        return Err(Rejection::MissingContentType);
    };
    let mime = ct.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    let json = mime == "application/json" || mime == "text/json" || mime.ends_with("+json");
    if !json {
        return Err(Rejection::UnsupportedContentType(mime));
    }
    if let Some(length) = req
        .header("content-length")
        .and_then(|l| l.trim().parse::<usize>().ok())
        && length > MAX_BODY_BYTES
    {
        return Err(Rejection::BodyTooLarge(length));
    }
    Ok(())
}

/// For a loopback endpoint without a key (Start, `/metrics`, the custom handler's port):
/// refuses a request a web page made, given its `Origin` and `Host` headers. Browsers send
/// `Origin` with every POST a page makes (cross-site or not, `no-cors` too); programs
/// (Dataverse, a plug-in, curl, the Functions host) send none. A page that rebound its own DNS
/// name to 127.0.0.1 is same-origin, but its requests carry its name as `Host`: only an IP
/// address or `localhost` is taken.
pub fn refuse_web_pages(origin: Option<&str>, host: Option<&str>) -> Result<(), Rejection> {
    if let Some(origin) = origin {
        return Err(Rejection::FromAWebPage(format!(
            "a request from a web page (Origin {:?}) is refused: this Start has no key \
             (LEASEHOLD_API_KEY), so only programs on this machine may call it",
            printable(origin)
        )));
    }
    if let Some(host) = host {
        let name = match host.strip_prefix('[') {
            Some(v6) => v6.split(']').next().unwrap_or(""),
            None => host.rsplit_once(':').map_or(host, |(name, _port)| name),
        };
        let local = name.eq_ignore_ascii_case("localhost") || name.parse::<std::net::IpAddr>().is_ok();
        if !local {
            return Err(Rejection::FromAWebPage(format!(
                "Host {:?} is refused: this Start has no key (LEASEHOLD_API_KEY), so it answers only \
                 requests addressed to an IP address or localhost",
                printable(host)
            )));
        }
    }
    Ok(())
}

/// `text` cut to 100 characters with control characters replaced, for an error message.
fn printable(text: &str) -> String {
    text.chars()
        .take(100)
        .map(|c| if c.is_control() { '?' } else { c })
        .collect()
}

/// Whether a request presenting `header` (its `x-functions-key`) and `code` (its `code` query
/// parameter) may pass where Start's key is asked for: always when there is no key
/// (`LEASEHOLD_API_KEY` unset), else when either carries it, compared as [`check_head`] does
/// (in constant time, both always compared). `GET /metrics` is guarded by this too.
pub fn key_accepted(policy: &StartPolicy, header: Option<&str>, code: Option<&str>) -> bool {
    match &policy.api_key {
        None => true,
        Some(expected) => bool::from(key_matches(expected, header) | key_matches(expected, code)),
    }
}

/// Whether `presented` is the key. SHA-256 digests of both are compared in constant time, so
/// neither the time taken nor anything else tells how much of the key, or how long a key, a
/// guess got right.
fn key_matches(expected: &Secret, presented: Option<&str>) -> Choice {
    let Some(presented) = presented else {
        return Choice::from(0);
    };
    let presented = Sha256::digest(presented.as_bytes());
    let expected = Sha256::digest(expected.expose().as_bytes());
    presented.as_slice().ct_eq(expected.as_slice())
}

/// A correlation id as Start carries it: `None` when absent or empty, refused when it is over
/// [`MAX_CORRELATION_ID_LEN`] bytes or holds anything but visible ASCII (it is logged, and
/// carried in every message of the trigger and in its poison entry).
fn correlation_id(field: &'static str, value: Option<&Value>) -> Result<Option<String>, Rejection> {
    let refuse = |problem| Rejection::InvalidCorrelationId { field, problem };
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => checked_correlation_id(field, s),
        Some(_) => Err(refuse(CorrelationIdProblem::NotAString)),
    }
}

fn checked_correlation_id(field: &'static str, value: &str) -> Result<Option<String>, Rejection> {
    let refuse = |problem| Rejection::InvalidCorrelationId { field, problem };
    if value.is_empty() {
        Ok(None)
    } else if value.len() > MAX_CORRELATION_ID_LEN {
        Err(refuse(CorrelationIdProblem::TooLong(value.len())))
    } else if !value.bytes().all(|b| b.is_ascii_graphic()) {
        Err(refuse(CorrelationIdProblem::NotVisibleAscii))
    } else {
        Ok(Some(value.to_string()))
    }
}

fn accept(policy: &StartPolicy, req: &StartRequest<'_>) -> Result<Decision, Rejection> {
    check_head(policy, req)?;
    if req.body.len() > MAX_BODY_BYTES {
        return Err(Rejection::BodyTooLarge(req.body.len()));
    }
    if req.body.iter().all(u8::is_ascii_whitespace) {
        return Err(Rejection::EmptyBody);
    }
    let body: Value =
        serde_json::from_slice(req.body).map_err(|e| Rejection::MalformedJson(e.to_string()))?;
    let Some(object) = body.as_object() else {
        return Err(Rejection::NotAnObject);
    };
    let from_header = match req.header(CORRELATION_HEADER) {
        Some(h) => checked_correlation_id(CORRELATION_HEADER, h)?,
        None => None,
    };
    let query_lane = match req.query("priority") {
        None => None,
        Some(v) => Some(parse_priority("the priority query parameter", v)?),
    };
    if looks_like_context(object) {
        return decide_dataverse(
            policy,
            req.header("x-ms-dynamics-organization"),
            &body,
            from_header,
            query_lane,
        );
    }

    if !policy.allowed_organizations.is_empty() {
        match req.header("x-ms-dynamics-organization") {
            Some(org) if org_allowed(policy, &[org]) => {}
            Some(org) => return Err(Rejection::OrganizationNotAllowed(org.to_string())),
            None => return Err(Rejection::OrganizationNotNamed),
        }
    }
    let scope = match object.get("scope") {
        None | Some(Value::Null) => Scope::default(),
        Some(Value::String(s)) => Scope::parse(s)?,
        Some(_) => return Err(Rejection::NotAString(Field::Scope)),
    };
    let record_id = match object.get("recordId") {
        None | Some(Value::Null) => return Err(Rejection::MissingRecordId),
        Some(Value::String(s)) => RecordId::parse(s)?,
        Some(_) => return Err(Rejection::NotAString(Field::RecordId)),
    };
    // Both are checked when both are sent (the header wins): a bad one is refused, not ignored.
    let from_body = correlation_id("correlationId", object.get("correlationId"))?;
    let body_lane = match object.get("priority") {
        None | Some(Value::Null) => None,
        Some(Value::String(v)) => Some(parse_priority("the body's priority", v)?),
        Some(other) => {
            return Err(Rejection::InvalidPriority {
                field: "the body's priority",
                value: printable(&other.to_string()),
            });
        }
    };
    let mut message = TriggerMessage::new(scope, record_id);
    message.correlation_id = from_header
        .or(from_body)
        .or_else(|| Some(Uuid::new_v4().to_string()));
    Ok(Decision::Enqueue(message, lower(query_lane, body_lane)))
}

/// A priority as a caller names it: `high` or `low`, any case.
fn parse_priority(field: &'static str, value: &str) -> Result<Lane, Rejection> {
    value.parse().map_err(|_| Rejection::InvalidPriority {
        field,
        value: format!("{:?}", printable(value)),
    })
}

/// The lane of a trigger whose sources said these: low if any said low.
fn lower(a: Option<Lane>, b: Option<Lane>) -> Lane {
    a.into_iter().chain(b).max().unwrap_or_default()
}

fn org_allowed(policy: &StartPolicy, names: &[&str]) -> bool {
    names.iter().any(|n| {
        policy
            .allowed_organizations
            .iter()
            .any(|a| a.eq_ignore_ascii_case(n.trim()))
    })
}

/// The context's `Depth`: `None` when absent, refused when it is not a whole number (a number,
/// or a string of digits).
fn depth_of(context: &Value) -> Result<Option<u64>, Rejection> {
    let unreadable = || Rejection::UnreadableDepth(DepthProblem::NotAWholeNumber);
    match context.get("Depth") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => n.as_u64().map(Some).ok_or_else(unreadable),
        Some(Value::String(s)) => s.trim().parse().map(Some).map_err(|_| unreadable()),
        Some(_) => Err(unreadable()),
    }
}

/// Decides on a Dataverse context (read by [`leasehold_dataverse::context`]);
/// `header_correlation_id` (already checked) is used when the context carries no `CorrelationId`.
fn decide_dataverse(
    policy: &StartPolicy,
    org_header: Option<&str>,
    context: &Value,
    header_correlation_id: Option<String>,
    query_lane: Option<Lane>,
) -> Result<Decision, Rejection> {
    if !policy.allowed_organizations.is_empty() {
        let names: Vec<&str> = ["OrganizationId", "OrganizationName"]
            .iter()
            .filter_map(|k| context.get(*k).and_then(Value::as_str))
            .chain(org_header)
            .collect();
        if !org_allowed(policy, &names) {
            let named = names.first().copied().unwrap_or("(none named)");
            return Err(Rejection::OrganizationNotAllowed(named.to_string()));
        }
    }
    let (scope, record_id) = record_of(context)?;
    let depth = depth_of(context)?;
    let correlation_id = correlation_id("CorrelationId", context.get("CorrelationId"))?;
    if let Some(user) = guid_of(context.get("InitiatingUserId"))
        && policy.integration_user_ids.contains(&user)
    {
        return Ok(Decision::Ignore {
            scope,
            record_id,
            reason: IgnoreReason::IntegrationUser(user),
        });
    }
    if let Some(max) = policy.max_depth {
        // Loop protection is on: an event that does not say how deep it is is not let through.
        let depth = depth.ok_or(Rejection::UnreadableDepth(DepthProblem::Missing))?;
        if depth > max {
            return Ok(Decision::Ignore {
                scope,
                record_id,
                reason: IgnoreReason::TooDeep { depth, max },
            });
        }
    }
    // An import's or an integration's events go to the low lane.
    let user_lane = guid_of(context.get("InitiatingUserId"))
        .filter(|user| policy.low_priority_user_ids.contains(user))
        .map(|_| Lane::Low);
    let mut message = TriggerMessage::new(scope, record_id);
    message.correlation_id = correlation_id.or(header_correlation_id);
    Ok(Decision::Enqueue(message, lower(query_lane, user_lane)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const ORG: &str = "4e1f4ab1-5d2c-4b4c-9c7a-1f0c2b6a7d11";
    const APP_USER: &str = "0b8f6a44-2f0e-4a3b-9a61-6f2f6c0d9e01";

    fn policy() -> StartPolicy {
        StartPolicy {
            api_key: None,
            allowed_organizations: vec![ORG.into(), "contoso".into()],
            integration_user_ids: vec![Uuid::parse_str(APP_USER).unwrap()],
            max_depth: Some(2),
            refuse_web_pages: false,
            low_priority_user_ids: vec![Uuid::parse_str(IMPORT_USER).unwrap()],
        }
    }

    const IMPORT_USER: &str = "7d2c1e7a-0b9a-4c51-8f0e-2a1b3c4d5e6f";

    /// Issue 25: the lane a trigger goes to. Low when `?priority=low`, a body's
    /// `"priority": "low"`, or a Dataverse event initiated by a user listed as low priority;
    /// high otherwise. An unknown priority is a 400 naming where it came from, and nothing is
    /// enqueued.
    #[test]
    fn a_trigger_goes_to_the_lane_its_priority_or_its_user_names() {
        let lane_of = |query: &[(&str, &str)], body: Value| {
            let body = body.to_string();
            let req = StartRequest {
                method: "POST",
                headers: json_type(),
                query: query
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                body: body.as_bytes(),
                check_key: false,
            };
            decide(
                &StartPolicy {
                    allowed_organizations: vec![],
                    ..policy()
                },
                &req,
            )
        };
        let lane = |d: Decision| match d {
            Decision::Enqueue(_, lane) => lane,
            other => panic!("{other:?}"),
        };
        let plain = json!({"recordId": "42"});
        assert_eq!(lane(lane_of(&[], plain.clone())), Lane::High);
        assert_eq!(lane(lane_of(&[("priority", "low")], plain.clone())), Lane::Low);
        assert_eq!(lane(lane_of(&[("priority", "LOW")], plain.clone())), Lane::Low);
        assert_eq!(lane(lane_of(&[("priority", "high")], plain.clone())), Lane::High);
        assert_eq!(
            lane(lane_of(&[], json!({"recordId": "42", "priority": "low"}))),
            Lane::Low
        );
        // Either saying low is enough.
        assert_eq!(
            lane(lane_of(
                &[("priority", "high")],
                json!({"recordId": "42", "priority": "low"})
            )),
            Lane::Low
        );
        let (status, answer) = lane_of(&[("priority", "low")], plain.clone()).response();
        assert_eq!((status, answer["priority"].as_str()), (202, Some("low")));
        for (query, body, names) in [
            (
                vec![("priority", "urgent")],
                plain.clone(),
                "the priority query parameter",
            ),
            (
                vec![],
                json!({"recordId": "42", "priority": "urgent"}),
                "the body's priority",
            ),
            (
                vec![],
                json!({"recordId": "42", "priority": 1}),
                "the body's priority",
            ),
        ] {
            let d = lane_of(&query, body);
            let Decision::Reject(r) = &d else { panic!("{d:?}") };
            assert_eq!(r.status(), 400);
            assert!(
                r.to_string().contains(names) && r.to_string().contains("\"high\" or \"low\""),
                "{r}"
            );
        }
        // A Dataverse event: the endpoint's query (a second registration), or its user.
        let event = |user: &str| {
            json!({
                "MessageName": "Update", "PrimaryEntityName": "account",
                "PrimaryEntityId": "6e1f4ab1-5d2c-4b4c-9c7a-1f0c2b6a7d11",
                "InitiatingUserId": user, "Depth": 1,
                "OrganizationId": ORG,
            })
        };
        let person = "1a2b3c4d-0000-4000-8000-000000000001";
        assert_eq!(lane(lane_of(&[], event(person))), Lane::High);
        assert_eq!(lane(lane_of(&[], event(IMPORT_USER))), Lane::Low);
        assert_eq!(lane(lane_of(&[("priority", "low")], event(person))), Lane::Low);
        let d = lane_of(&[("priority", "soon")], event(person));
        assert!(
            matches!(d, Decision::Reject(Rejection::InvalidPriority { .. })),
            "{d:?}"
        );
    }

    fn json_type() -> Vec<(String, String)> {
        vec![("Content-Type".into(), "application/json".into())]
    }

    /// Issue 22, item 6: with no Content-Type a web page's POST needs no CORS preflight, and a
    /// keyless Start on loopback took one. Now a Content-Type of JSON is required everywhere,
    /// and a keyless Start refuses what only a page sends (Origin, a DNS name as Host).
    #[test]
    fn start_takes_json_only_and_a_keyless_start_refuses_web_pages() {
        let open = StartPolicy {
            refuse_web_pages: true,
            ..StartPolicy::default()
        };
        let keyed = StartPolicy {
            api_key: Some("s3cret".into()),
            ..StartPolicy::default()
        };
        let head = |headers: &[(&str, &str)]| StartRequest {
            method: "POST",
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            check_key: true,
            ..StartRequest::default()
        };
        // What a page's `fetch(url, {method: "POST", body})` sends: no preflight, no Content-Type
        // (or text/plain).
        for policy in [&open, &keyed] {
            let key = ("x-functions-key", "s3cret");
            let no_type = check_head(policy, &head(&[key])).unwrap_err();
            assert_eq!(no_type, Rejection::MissingContentType);
            assert_eq!(no_type.status(), 415);
            assert!(no_type.to_string().contains("Content-Type: application/json"));
            assert_eq!(
                check_head(policy, &head(&[key, ("content-type", "text/plain")])),
                Err(Rejection::UnsupportedContentType("text/plain".into()))
            );
        }
        let json = ("content-type", "application/json");
        // Keyless: programs on this machine are served...
        for host in [
            "127.0.0.1:7071",
            "localhost:7071",
            "LOCALHOST",
            "[::1]:7071",
            "10.0.0.4",
        ] {
            assert_eq!(
                check_head(&open, &head(&[json, ("host", host)])),
                Ok(()),
                "{host}"
            );
        }
        assert_eq!(check_head(&open, &head(&[json])), Ok(()));
        // ...a page is not, cross-site (Origin) or rebound to 127.0.0.1 under its own name.
        for headers in [
            &[
                json,
                ("host", "127.0.0.1:7071"),
                ("origin", "https://evil.example"),
            ][..],
            &[json, ("host", "127.0.0.1:7071"), ("origin", "null")][..],
            &[json, ("host", "rebind.evil.example:7071")][..],
        ] {
            let refused = check_head(&open, &head(headers)).unwrap_err();
            assert!(matches!(refused, Rejection::FromAWebPage(_)), "{headers:?}");
            assert_eq!(refused.status(), 403);
            assert!(refused.to_string().contains("LEASEHOLD_API_KEY"), "{refused}");
        }
        // With a key, the key is the guard: a browser-based caller with the key is served.
        let keyed_page = [
            json,
            ("x-functions-key", "s3cret"),
            ("origin", "https://crm.example"),
            ("host", "leasehold.example"),
        ];
        assert_eq!(check_head(&keyed, &head(&keyed_page)), Ok(()));
        // Under Functions (the host checks the key) none of this applies but the type.
        let hosted = StartRequest {
            check_key: false,
            ..head(&[json, ("origin", "https://crm.example"), ("host", "app.example")])
        };
        assert_eq!(check_head(&open, &hosted), Ok(()));
        // Beyond loopback without a key (a front end authenticates callers, and `Host` is its
        // public name): not a loopback endpoint, so no web-page check.
        let fronted = StartPolicy::default();
        assert_eq!(
            check_head(&fronted, &head(&[json, ("host", "leasehold.example.com")])),
            Ok(())
        );
    }

    fn post(body: &Value) -> Decision {
        let text = body.to_string();
        decide(
            &policy(),
            &StartRequest {
                method: "POST",
                headers: json_type(),
                body: text.as_bytes(),
                ..StartRequest::default()
            },
        )
    }

    /// A Dataverse Update webhook body, shaped as Dataverse serialises RemoteExecutionContext.
    fn dataverse(primary_id: &str) -> Value {
        json!({
            "BusinessUnitId": "1b7d7c3e-3f5b-4b6e-8f0a-6a2c1d3e4f50",
            "CorrelationId": "9a0c2f1e-6b7d-4c8e-9f0a-1b2c3d4e5f60",
            "Depth": 1,
            "InitiatingUserId": "7d3c2b1a-0f9e-4d8c-8b7a-6f5e4d3c2b1a",
            "InputParameters": [{
                "key": "Target",
                "value": {
                    "__type": "Entity:http://schemas.microsoft.com/xrm/2011/Contracts",
                    "Attributes": [{ "key": "name", "value": "Fourth Coffee" }],
                    "Id": "8F9C1D2E-0000-4000-8000-000000000001",
                    "LogicalName": "account"
                }
            }],
            "IsExecutingOffline": false,
            "MessageName": "Update",
            "Mode": 1,
            "OperationCreatedOn": "/Date(1506384247000)/",
            "OrganizationId": ORG,
            "OrganizationName": "contoso",
            "OutputParameters": [],
            "PostEntityImages": [],
            "PreEntityImages": [],
            "PrimaryEntityId": primary_id,
            "PrimaryEntityName": "account",
            "Stage": 40,
            "UserId": "7d3c2b1a-0f9e-4d8c-8b7a-6f5e4d3c2b1a",
            "ParentContext": null
        })
    }

    fn enqueued(d: &Decision) -> (&str, &str) {
        match d {
            Decision::Enqueue(m, _) => (m.scope.as_str(), m.record_id.as_str()),
            other => panic!("expected an enqueue, got {other:?}"),
        }
    }

    #[test]
    fn a_secret_is_never_printed() {
        let policy = StartPolicy {
            api_key: Some("s3cret".into()),
            ..StartPolicy::default()
        };
        let shown = format!(
            "{policy:?} {} {:?}",
            policy.api_key.as_ref().unwrap(),
            policy.api_key
        );
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("<redacted>"), "{shown}");
        assert_eq!(policy.api_key.unwrap().expose(), "s3cret");
    }

    #[test]
    fn plain_bodies_with_normalised_ids() {
        let open = StartPolicy::default();
        let plain = |body: Value| {
            let text = body.to_string();
            decide(
                &open,
                &StartRequest {
                    method: "POST",
                    headers: json_type(),
                    body: text.as_bytes(),
                    ..StartRequest::default()
                },
            )
        };
        let d = plain(json!({"scope": "Account", "recordId": "{8F9C1D2E-0000-4000-8000-000000000001}"}));
        assert_eq!(enqueued(&d), ("account", "8f9c1d2e-0000-4000-8000-000000000001"));
        let d = plain(json!({"recordId": "order-42"}));
        assert_eq!(enqueued(&d), ("default", "order-42"));
        // With an allow-list, a plain body must name an allowed organisation.
        assert!(matches!(
            post(&json!({"recordId": "x"})),
            Decision::Reject(Rejection::OrganizationNotNamed)
        ));
        // Allowed organisation required for plain bodies too when an allow-list is set.
        let text = json!({"recordId": "x"}).to_string();
        let with_org = StartRequest {
            method: "POST",
            headers: [
                json_type(),
                vec![("X-MS-Dynamics-Organization".into(), "Contoso".into())],
            ]
            .concat(),
            body: text.as_bytes(),
            ..StartRequest::default()
        };
        assert!(matches!(decide(&policy(), &with_org), Decision::Enqueue(..)));
    }

    #[test]
    fn dataverse_update_create_and_trimmed_bodies() {
        let d = post(&dataverse("8f9c1d2e-0000-4000-8000-000000000001"));
        assert_eq!(enqueued(&d), ("account", "8f9c1d2e-0000-4000-8000-000000000001"));
        let Decision::Enqueue(m, _) = &d else {
            unreachable!()
        };
        assert_eq!(
            m.correlation_id.as_deref(),
            Some("9a0c2f1e-6b7d-4c8e-9f0a-1b2c3d4e5f60")
        );

        // Create, pre-operation: the primary id is the empty GUID; the Target carries it.
        let d = post(&dataverse("00000000-0000-0000-0000-000000000000"));
        assert_eq!(enqueued(&d), ("account", "8f9c1d2e-0000-4000-8000-000000000001"));

        // Create where only OutputParameters["id"] has it.
        let mut create = dataverse("00000000-0000-0000-0000-000000000000");
        create["InputParameters"] = json!([]);
        create["OutputParameters"] =
            json!([{ "key": "id", "value": "{5A5A5A5A-0000-4000-8000-000000000002}" }]);
        assert_eq!(
            enqueued(&post(&create)),
            ("account", "5a5a5a5a-0000-4000-8000-000000000002")
        );

        // Over 256 KB: Dataverse drops InputParameters, images and ParentContext.
        let mut trimmed = dataverse("8f9c1d2e-0000-4000-8000-000000000001");
        for k in [
            "InputParameters",
            "PreEntityImages",
            "PostEntityImages",
            "ParentContext",
        ] {
            trimmed.as_object_mut().unwrap().remove(k);
        }
        assert_eq!(
            enqueued(&post(&trimmed)).1,
            "8f9c1d2e-0000-4000-8000-000000000001"
        );
    }

    #[test]
    fn loop_protection_and_organisations() {
        let mut own = dataverse("8f9c1d2e-0000-4000-8000-000000000001");
        own["InitiatingUserId"] = json!(APP_USER.to_uppercase());
        assert!(
            matches!(post(&own), Decision::Ignore { reason: IgnoreReason::IntegrationUser(u), .. } if u.to_string() == APP_USER)
        );
        let mut deep = dataverse("8f9c1d2e-0000-4000-8000-000000000001");
        deep["Depth"] = json!(3);
        assert!(matches!(
            post(&deep),
            Decision::Ignore {
                reason: IgnoreReason::TooDeep { depth: 3, max: 2 },
                ..
            }
        ));
        let mut other_org = dataverse("8f9c1d2e-0000-4000-8000-000000000001");
        other_org["OrganizationId"] = json!("11111111-2222-4333-8444-555555555555");
        other_org["OrganizationName"] = json!("fabrikam-prod");
        assert!(matches!(post(&other_org), Decision::Reject(r) if r.status() == 403));
        let no_id = {
            let mut c = dataverse("00000000-0000-0000-0000-000000000000");
            c["InputParameters"] = json!([]);
            c
        };
        assert!(
            matches!(post(&no_id), Decision::Reject(r @ Rejection::NoRecord(NoRecord::NoRecordId)) if r.status() == 400)
        );
    }

    #[test]
    fn the_key_is_checked_in_constant_time_from_header_or_query() {
        let p = StartPolicy {
            api_key: Some("s3cret".into()),
            ..StartPolicy::default()
        };
        let body = br#"{"recordId":"1"}"#;
        let req = |headers: Vec<(String, String)>, query: Vec<(String, String)>| StartRequest {
            method: "POST",
            headers: [json_type(), headers].concat(),
            query,
            body,
            check_key: true,
        };
        assert!(matches!(
            decide(&p, &req(vec![], vec![])),
            Decision::Reject(Rejection::WrongKey)
        ));
        assert!(matches!(
            decide(&p, &req(vec![("x-functions-key".into(), "s3cre".into())], vec![])),
            Decision::Reject(Rejection::WrongKey)
        ));
        assert!(matches!(
            decide(
                &p,
                &req(vec![("x-functions-key".into(), "s3cret".into())], vec![])
            ),
            Decision::Enqueue(..)
        ));
        assert!(matches!(
            decide(&p, &req(vec![], vec![("code".into(), "s3cret".into())])),
            Decision::Enqueue(..)
        ));
        let (_, body) = decide(&p, &req(vec![], vec![])).response();
        assert!(!body.to_string().contains("s3cret"));
        // Either place may carry it: a wrong header does not spoil a right `code`, nor the reverse.
        assert!(matches!(
            decide(
                &p,
                &req(
                    vec![("x-functions-key".into(), "wrong".into())],
                    vec![("code".into(), "s3cret".into())]
                )
            ),
            Decision::Enqueue(..)
        ));
        assert!(matches!(
            decide(
                &p,
                &req(
                    vec![("x-functions-key".into(), "s3cret".into())],
                    vec![("code".into(), "wrong".into())]
                )
            ),
            Decision::Enqueue(..)
        ));
        for wrong in ["s3cret ", "S3CRET", "s3cret\0", "", "s3cret-and-more"] {
            assert!(
                matches!(
                    decide(&p, &req(vec![("x-functions-key".into(), wrong.into())], vec![])),
                    Decision::Reject(Rejection::WrongKey)
                ),
                "{wrong:?}"
            );
        }
    }

    #[test]
    fn the_head_is_checked_before_the_body_is_read() {
        let p = StartPolicy {
            api_key: Some("s3cret".into()),
            ..StartPolicy::default()
        };
        let head = |headers: Vec<(&str, &str)>| StartRequest {
            method: "POST",
            headers: std::iter::once(("content-type", "application/json"))
                .chain(headers)
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            check_key: true,
            ..StartRequest::default()
        };
        assert_eq!(
            check_head(&p, &head(vec![("content-length", "400000")])),
            Err(Rejection::WrongKey)
        );
        assert_eq!(
            check_head(
                &p,
                &head(vec![
                    ("x-functions-key", "s3cret"),
                    ("content-length", "10485760")
                ])
            ),
            Err(Rejection::BodyTooLarge(10_485_760))
        );
        assert_eq!(
            check_head(
                &p,
                &head(vec![("x-functions-key", "s3cret"), ("content-length", "40")])
            ),
            Ok(())
        );
    }

    fn with_header(body: &Value, headers: Vec<(&str, String)>) -> Decision {
        let text = body.to_string();
        decide(
            &StartPolicy::default(),
            &StartRequest {
                method: "POST",
                headers: json_type()
                    .into_iter()
                    .chain(headers.into_iter().map(|(k, v)| (k.to_string(), v)))
                    .collect(),
                body: text.as_bytes(),
                ..StartRequest::default()
            },
        )
    }

    /// The 400 a correlation id is refused with, and its text.
    fn refused_correlation_id(d: &Decision) -> (&'static str, String) {
        match d {
            Decision::Reject(r @ Rejection::InvalidCorrelationId { field, .. }) => {
                assert_eq!(r.status(), 400);
                (*field, d.response().1["error"].as_str().unwrap().to_string())
            }
            other => panic!("expected a refused correlation id, got {other:?}"),
        }
    }

    #[test]
    fn correlation_ids_are_held_to_128_visible_ascii_bytes_from_every_source() {
        let plain = json!({"recordId": "42"});
        let longest = "c".repeat(MAX_CORRELATION_ID_LEN);
        let too_long = "c".repeat(MAX_CORRELATION_ID_LEN + 1);

        // The header.
        let d = with_header(&plain, vec![(CORRELATION_HEADER, longest.clone())]);
        let Decision::Enqueue(m, _) = &d else {
            panic!("{d:?}")
        };
        assert_eq!(m.correlation_id.as_deref(), Some(longest.as_str()));
        let (field, text) = refused_correlation_id(&with_header(
            &plain,
            vec![(CORRELATION_HEADER, "x".repeat(48 * 1024))],
        ));
        assert_eq!(field, "x-ms-correlation-request-id");
        assert_eq!(
            text,
            "x-ms-correlation-request-id is 49152 bytes, over the limit of 128"
        );
        for bad in ["a b", "tab\there", "line\nbreak", "caf\u{e9}", "\u{7f}"] {
            let (field, text) =
                refused_correlation_id(&with_header(&plain, vec![(CORRELATION_HEADER, bad.into())]));
            assert_eq!(field, CORRELATION_HEADER);
            assert!(text.contains("visible ASCII"), "{text}");
        }

        // The body's correlationId (checked even when the header wins).
        let (field, text) = refused_correlation_id(&with_header(
            &json!({"recordId": "42", "correlationId": too_long}),
            vec![],
        ));
        assert_eq!(field, "correlationId");
        assert!(text.contains("129 bytes, over the limit of 128"), "{text}");
        let (field, _) = refused_correlation_id(&with_header(
            &json!({"recordId": "42", "correlationId": "a\u{0}b"}),
            vec![(CORRELATION_HEADER, "fine".into())],
        ));
        assert_eq!(field, "correlationId");
        let (_, text) = refused_correlation_id(&with_header(
            &json!({"recordId": "42", "correlationId": 7}),
            vec![],
        ));
        assert_eq!(text, "correlationId must be a string");
        // Absent or empty: Start makes one up.
        for body in [plain.clone(), json!({"recordId": "42", "correlationId": ""})] {
            let d = with_header(&body, vec![]);
            let Decision::Enqueue(m, _) = &d else {
                panic!("{d:?}")
            };
            assert_eq!(m.correlation_id.as_ref().map(String::len), Some(36));
        }

        // Dataverse's CorrelationId, and the header beside a Dataverse body.
        let mut context = dataverse("8f9c1d2e-0000-4000-8000-000000000001");
        context["CorrelationId"] = json!(too_long);
        let (field, _) = refused_correlation_id(&with_header(&context, vec![]));
        assert_eq!(field, "CorrelationId");
        context["CorrelationId"] = json!("9a0c2f1e-6b7d-4c8e-9f0a-1b2c3d4e5f60");
        let (field, _) = refused_correlation_id(&with_header(
            &context,
            vec![(CORRELATION_HEADER, too_long.clone())],
        ));
        assert_eq!(field, CORRELATION_HEADER);
        // A context without one takes the header's.
        context.as_object_mut().unwrap().remove("CorrelationId");
        let d = with_header(&context, vec![(CORRELATION_HEADER, "from-header".into())]);
        let Decision::Enqueue(m, _) = &d else {
            panic!("{d:?}")
        };
        assert_eq!(m.correlation_id.as_deref(), Some("from-header"));
    }

    #[test]
    fn an_unreadable_depth_is_refused_not_let_through() {
        let refused = |depth: Value| {
            let mut context = dataverse("8f9c1d2e-0000-4000-8000-000000000001");
            context["Depth"] = depth;
            post(&context)
        };
        for depth in [json!("deep"), json!(-1), json!(1.5), json!([3]), json!({"n": 3})] {
            let d = refused(depth.clone());
            assert!(
                matches!(&d, Decision::Reject(r @ Rejection::UnreadableDepth(DepthProblem::NotAWholeNumber)) if r.status() == 400),
                "{depth}: {d:?}"
            );
            assert!(d.response().1["error"].as_str().unwrap().contains("Depth"));
        }
        // A number sent as text is read.
        assert!(matches!(
            refused(json!("3")),
            Decision::Ignore {
                reason: IgnoreReason::TooDeep { depth: 3, max: 2 },
                ..
            }
        ));
        // Missing while LEASEHOLD_MAX_DEPTH is set: refused; without the setting: not needed.
        let mut context = dataverse("8f9c1d2e-0000-4000-8000-000000000001");
        context.as_object_mut().unwrap().remove("Depth");
        assert!(matches!(
            post(&context),
            Decision::Reject(Rejection::UnreadableDepth(DepthProblem::Missing))
        ));
        assert!(matches!(with_header(&context, vec![]), Decision::Enqueue(..)));
        // An unreadable one is refused even without the setting: it is not a Dataverse body.
        context["Depth"] = json!("deep");
        assert!(matches!(
            with_header(&context, vec![]),
            Decision::Reject(Rejection::UnreadableDepth(_))
        ));
    }
}
