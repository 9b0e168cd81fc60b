//! Start: turns an HTTP request into a trigger, or into a clear refusal that changes nothing.
//!
//! Accepted bodies: `{"scope": "...", "recordId": "..."}` (scope optional, default `default`),
//! or a Dataverse webhook body (a serialised RemoteExecutionContext). This module is pure: it
//! decides; the callers (standalone endpoint, custom handler) enqueue and answer.

use serde_json::Value;
use subtle::ConstantTimeEq;
use uuid::Uuid;

use leasehold_runtime::TriggerMessage;

/// Largest request body accepted. Dataverse sends at most 256 KB before it trims the context
/// (`x-ms-dynamics-msg-size-exceeded`); twice that leaves room for encoding differences.
pub const MAX_BODY_BYTES: usize = 512 * 1024;
/// Longest scope: Dataverse logical names are at most 50 characters.
pub const MAX_SCOPE_LEN: usize = 64;
/// Longest record id that is not a GUID.
pub const MAX_RECORD_ID_LEN: usize = 128;
/// Scope used when a plain body names none.
pub const DEFAULT_SCOPE: &str = "default";

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
        scope: String,
        record_id: String,
        reason: String,
    },
    /// Answer this 4xx with this message and enqueue nothing.
    Reject { status: u16, error: String },
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
                serde_json::json!({ "ignored": { "scope": scope, "recordId": record_id }, "reason": reason }),
            ),
            Decision::Reject { status, error } => (*status, serde_json::json!({ "error": error })),
        }
    }
}

fn reject(status: u16, error: impl Into<String>) -> Decision {
    Decision::Reject {
        status,
        error: error.into(),
    }
}

/// Decides what to do with a request to `POST /api/start`.
pub fn decide(policy: &StartPolicy, req: &StartRequest<'_>) -> Decision {
    if !req.method.eq_ignore_ascii_case("POST") {
        return reject(
            405,
            format!("method {} not allowed: POST a record id", req.method),
        );
    }
    if req.check_key {
        if let Some(expected) = &policy.api_key {
            let presented = req
                .header("x-functions-key")
                .or_else(|| req.query("code"))
                .unwrap_or("");
            if !bool::from(presented.as_bytes().ct_eq(expected.expose().as_bytes())) {
                return reject(
                    401,
                    "missing or wrong key: send it as the x-functions-key header or the code query parameter",
                );
            }
        }
    }
    if let Some(ct) = req.header("content-type") {
        let mime = ct.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
        let json = mime == "application/json" || mime == "text/json" || mime.ends_with("+json");
        if !json {
            return reject(
                415,
                format!("unsupported content type {mime:?}: send application/json"),
            );
        }
    }
    if req.body.len() > MAX_BODY_BYTES {
        return reject(
            413,
            format!(
                "body of {} bytes is over the limit of {MAX_BODY_BYTES}",
                req.body.len()
            ),
        );
    }
    if req.body.iter().all(u8::is_ascii_whitespace) {
        return reject(
            400,
            "empty body: send {\"recordId\": \"...\"} or a Dataverse webhook body",
        );
    }
    let body: Value = match serde_json::from_slice(req.body) {
        Ok(v) => v,
        Err(e) => return reject(400, format!("malformed JSON: {e}")),
    };
    let Some(object) = body.as_object() else {
        return reject(400, "the body must be a JSON object");
    };
    if crate::dataverse::looks_like_context(object) {
        return crate::dataverse::decide(policy, req.header("x-ms-dynamics-organization"), &body);
    }

    if !policy.allowed_organizations.is_empty() {
        match req.header("x-ms-dynamics-organization") {
            Some(org) if org_allowed(policy, &[org]) => {}
            Some(org) => {
                return reject(
                    403,
                    format!("organization {org:?} is not allowed to trigger this environment"),
                );
            }
            None => {
                return reject(
                    403,
                    "this environment only accepts requests from its allowed organizations",
                );
            }
        }
    }
    let scope = match object.get("scope") {
        None | Some(Value::Null) => DEFAULT_SCOPE.to_string(),
        Some(Value::String(s)) => match normalise_scope(s) {
            Ok(s) => s,
            Err(e) => return reject(400, e),
        },
        Some(_) => return reject(400, "scope must be a string"),
    };
    let record_id = match object.get("recordId") {
        None | Some(Value::Null) => return reject(400, "recordId is missing"),
        Some(Value::String(s)) => match normalise_record_id(s) {
            Ok(s) => s,
            Err(e) => return reject(400, e),
        },
        Some(_) => return reject(400, "recordId must be a string"),
    };
    let mut message = TriggerMessage::new(scope, record_id);
    message.correlation_id = req
        .header("x-ms-correlation-request-id")
        .or_else(|| object.get("correlationId").and_then(Value::as_str))
        .map(str::to_string)
        .or_else(|| Some(Uuid::new_v4().to_string()));
    Decision::Enqueue(message)
}

pub(crate) fn org_allowed(policy: &StartPolicy, names: &[&str]) -> bool {
    names.iter().any(|n| {
        policy
            .allowed_organizations
            .iter()
            .any(|a| a.eq_ignore_ascii_case(n.trim()))
    })
}

/// Scopes: 1–64 characters of letters, digits, `_ . -`, lower-cased (Dataverse logical names
/// are lower case, so `Account` and `account` are one scope).
pub fn normalise_scope(scope: &str) -> Result<String, String> {
    let scope = scope.trim();
    if scope.is_empty() {
        return Err("scope is empty".into());
    }
    if scope.len() > MAX_SCOPE_LEN {
        return Err(format!("scope is longer than {MAX_SCOPE_LEN} characters"));
    }
    if !scope
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c))
        || scope.starts_with('.')
    {
        return Err(format!(
            "scope {scope:?} may only hold letters, digits, '_', '.' and '-'"
        ));
    }
    Ok(scope.to_ascii_lowercase())
}

/// Record ids: GUIDs in any case, with or without braces, become lower-case hyphenated GUIDs (one
/// record, one key); other ids are 1–128 characters of letters, digits and `_ . : @ = + -`.
pub fn normalise_record_id(id: &str) -> Result<String, String> {
    let id = id.trim();
    if id.is_empty() {
        return Err("recordId is empty".into());
    }
    let unbraced = id
        .strip_prefix('{')
        .and_then(|s| s.strip_suffix('}'))
        .unwrap_or(id);
    if let Ok(guid) = Uuid::try_parse(unbraced) {
        if guid.is_nil() {
            return Err("recordId is the empty GUID".into());
        }
        return Ok(guid.hyphenated().to_string());
    }
    if id.len() > MAX_RECORD_ID_LEN {
        return Err(format!("recordId is longer than {MAX_RECORD_ID_LEN} characters"));
    }
    if !id
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "_.:@=+-".contains(c))
        || id.starts_with('.')
    {
        return Err(format!(
            "recordId {id:?} may only hold letters, digits and _ . : @ = + -"
        ));
    }
    Ok(id.to_string())
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
            Decision::Enqueue(m) => (&m.scope, &m.record_id),
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
            Decision::Reject { status: 403, .. }
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
        assert!(matches!(post(&own), Decision::Ignore { reason, .. } if reason.contains("integration")));
        let mut deep = dataverse("8f9c1d2e-0000-4000-8000-000000000001");
        deep["Depth"] = json!(3);
        assert!(matches!(post(&deep), Decision::Ignore { reason, .. } if reason.contains("Depth 3")));
        let mut other_org = dataverse("8f9c1d2e-0000-4000-8000-000000000001");
        other_org["OrganizationId"] = json!("11111111-2222-4333-8444-555555555555");
        other_org["OrganizationName"] = json!("fabrikam-prod");
        assert!(matches!(post(&other_org), Decision::Reject { status: 403, .. }));
        let no_id = {
            let mut c = dataverse("00000000-0000-0000-0000-000000000000");
            c["InputParameters"] = json!([]);
            c
        };
        assert!(
            matches!(post(&no_id), Decision::Reject { status: 400, error } if error.contains("no record id"))
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
            Decision::Reject { status: 401, .. }
        ));
        assert!(matches!(
            decide(&p, &req(vec![("x-functions-key".into(), "s3cre".into())], vec![])),
            Decision::Reject { status: 401, .. }
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
