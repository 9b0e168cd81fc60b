//! Start: turns an HTTP request into a trigger, or into a clear refusal that changes nothing.
//!
//! Accepted bodies: `{"scope": "...", "recordId": "..."}` (scope optional, default `default`),
//! or a Dataverse webhook body (a serialised RemoteExecutionContext). This module is pure: it
//! decides; the callers (standalone endpoint, custom handler) enqueue and answer.

use serde_json::Value;
use subtle::ConstantTimeEq;
use uuid::Uuid;

use leasehold_runtime::{Field, InvalidName, RecordId, Scope, TriggerMessage};

use crate::dataverse::NoRecord;

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

/// Start's decision.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Enqueue this trigger and answer 202.
    Enqueue(TriggerMessage),
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
}

impl Rejection {
    /// The HTTP status to answer with.
    pub fn status(&self) -> u16 {
        match self {
            Rejection::MethodNotAllowed(_) => 405,
            Rejection::WrongKey => 401,
            Rejection::UnsupportedContentType(_) => 415,
            Rejection::BodyTooLarge(_) => 413,
            Rejection::OrganizationNotAllowed(_) | Rejection::OrganizationNotNamed => 403,
            Rejection::EmptyBody
            | Rejection::MalformedJson(_)
            | Rejection::NotAnObject
            | Rejection::NotAString(_)
            | Rejection::MissingRecordId
            | Rejection::InvalidName(_)
            | Rejection::NoRecord(_) => 400,
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
            Decision::Enqueue(m) => (
                202,
                serde_json::json!({
                    "enqueued": { "scope": m.scope, "recordId": m.record_id },
                    "correlationId": m.correlation_id,
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

/// Decides what to do with a request to `POST /api/start`.
pub fn decide(policy: &StartPolicy, req: &StartRequest<'_>) -> Decision {
    match accept(policy, req) {
        Ok(decision) => decision,
        Err(rejection) => Decision::Reject(rejection),
    }
}

fn accept(policy: &StartPolicy, req: &StartRequest<'_>) -> Result<Decision, Rejection> {
    if !req.method.eq_ignore_ascii_case("POST") {
        return Err(Rejection::MethodNotAllowed(req.method.to_string()));
    }
    if req.check_key
        && let Some(expected) = &policy.api_key
    {
        let presented = req
            .header("x-functions-key")
            .or_else(|| req.query("code"))
            .unwrap_or("");
        if !bool::from(presented.as_bytes().ct_eq(expected.expose().as_bytes())) {
            return Err(Rejection::WrongKey);
        }
    }
    if let Some(ct) = req.header("content-type") {
        let mime = ct.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
        let json = mime == "application/json" || mime == "text/json" || mime.ends_with("+json");
        if !json {
            return Err(Rejection::UnsupportedContentType(mime));
        }
    }
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
    if crate::dataverse::looks_like_context(object) {
        return crate::dataverse::decide(policy, req.header("x-ms-dynamics-organization"), &body);
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
    let mut message = TriggerMessage::new(scope, record_id);
    message.correlation_id = req
        .header("x-ms-correlation-request-id")
        .or_else(|| object.get("correlationId").and_then(Value::as_str))
        .map(str::to_string)
        .or_else(|| Some(Uuid::new_v4().to_string()));
    Ok(Decision::Enqueue(message))
}

pub(crate) fn org_allowed(policy: &StartPolicy, names: &[&str]) -> bool {
    names.iter().any(|n| {
        policy
            .allowed_organizations
            .iter()
            .any(|a| a.eq_ignore_ascii_case(n.trim()))
    })
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
        }
    }

    fn post(body: &Value) -> Decision {
        let text = body.to_string();
        decide(
            &policy(),
            &StartRequest {
                method: "POST",
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
            Decision::Enqueue(m) => (m.scope.as_str(), m.record_id.as_str()),
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
            headers: vec![("X-MS-Dynamics-Organization".into(), "Contoso".into())],
            body: text.as_bytes(),
            ..StartRequest::default()
        };
        assert!(matches!(decide(&policy(), &with_org), Decision::Enqueue(_)));
    }

    #[test]
    fn dataverse_update_create_and_trimmed_bodies() {
        let d = post(&dataverse("8f9c1d2e-0000-4000-8000-000000000001"));
        assert_eq!(enqueued(&d), ("account", "8f9c1d2e-0000-4000-8000-000000000001"));
        let Decision::Enqueue(m) = &d else { unreachable!() };
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
            headers,
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
            Decision::Enqueue(_)
        ));
        assert!(matches!(
            decide(&p, &req(vec![], vec![("code".into(), "s3cret".into())])),
            Decision::Enqueue(_)
        ));
        let (_, body) = decide(&p, &req(vec![], vec![])).response();
        assert!(!body.to_string().contains("s3cret"));
    }
}
