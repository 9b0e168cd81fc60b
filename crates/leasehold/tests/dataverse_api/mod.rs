//! A local stand-in for the Dataverse Web API, for `leasehold dataverse` tests. It ENFORCES the
//! request shapes Microsoft documents (docs/dataverse.md) and answers as the Web API
//! does, so a client that passes here sends what the documentation says:
//!
//! - `/api/data/v9.2/` with `OData-Version: 4.0`, `OData-MaxVersion: 4.0`, `Accept:
//!   application/json`, `Content-Type: application/json` on writes, `Authorization: Bearer`;
//! - the entity sets `serviceendpoints`, `sdkmessageprocessingsteps`, `sdkmessages`,
//!   `sdkmessagefilters`, their columns, required fields and the values Leasehold may use
//!   (`contract` 8, `authtype` 4/5/6, `messageformat` 2, `stage` 40 for `mode` 1, …); an
//!   unknown property is a 400 as on the real service; `authvalue` cannot be read;
//! - navigation properties in `@odata.bind` by their lower-case names with `/set(id)` values
//!   that must exist; a PascalCase one is the real "undeclared property" 400;
//! - `$select`, `$filter` (eq, and, startswith, `sdkmessageid/name`), `$expand` of a step's
//!   message and filter; spaces as `%20`;
//! - create answers 204 with `OData-EntityId`; errors are `{"error":{"code","message"}}`;
//!   deleting an endpoint deletes its steps; a table without a filter for a message answers
//!   an empty `value`;
//! - `createdon` (whole seconds, from a clock that ticks one second per record, so the order of
//!   creates is the order of `createdon`) and `_createdby_value` on endpoints and steps, and
//!   `$expand=createdby($select=fullname)` on endpoints; `systemusers` are only for that expand;
//! - a step's `statecode`/`statuscode` pair (0/1 enabled, 1/2 disabled), set by PATCH as the
//!   reference documents for SetState;
//! - switches force the next N requests to 401 or to 429 with `Retry-After`, and hold the next
//!   N creates of a set until all N have arrived (two `register` runs racing, made
//!   deterministic: both have read "nothing there" before either create lands).

#![allow(dead_code)]
// Test code: the error of these helpers is the HTTP answer itself.
#![allow(clippy::result_large_err)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};
use uuid::Uuid;

type Record = Map<String, Value>;

const SE_READ: &[&str] = &[
    "serviceendpointid",
    "name",
    "url",
    "contract",
    "authtype",
    "messageformat",
    "userclaim",
    "connectionmode",
    "description",
    "isauthvalueset",
    "createdon",
    "_createdby_value",
];
const STEP_READ: &[&str] = &[
    "sdkmessageprocessingstepid",
    "name",
    "description",
    "stage",
    "mode",
    "rank",
    "supporteddeployment",
    "asyncautodelete",
    "filteringattributes",
    "statecode",
    "statuscode",
    "_sdkmessageid_value",
    "_sdkmessagefilterid_value",
    "_eventhandler_value",
    "createdon",
    "_createdby_value",
];
const FILTER_READ: &[&str] = &[
    "sdkmessagefilterid",
    "_sdkmessageid_value",
    "primaryobjecttypecode",
    "iscustomprocessingstepallowed",
];
const MESSAGE_READ: &[&str] = &["sdkmessageid", "name"];

/// A forced answer for the next `times` requests.
#[derive(Debug, Clone)]
pub struct Force {
    pub status: u16,
    pub retry_after: Option<u64>,
    pub times: u32,
}

#[derive(Debug, Default)]
pub struct State {
    base: String,
    token: String,
    messages: BTreeMap<Uuid, String>,
    /// (message id, table)
    filters: BTreeMap<Uuid, (Uuid, String)>,
    pub endpoints: BTreeMap<Uuid, Record>,
    pub steps: BTreeMap<Uuid, Record>,
    /// "METHOD /path?query" of every request that reached the server.
    pub requests: Vec<String>,
    /// Successful POST/PATCH/DELETE.
    pub writes: Vec<String>,
    pub force: Option<Force>,
    /// fullname by systemuserid; `caller` is the token's user.
    pub users: BTreeMap<Uuid, String>,
    pub caller: Uuid,
    /// Seconds past the base time of the next `createdon`.
    clock: u64,
    /// How many holds released all their requests together.
    pub holds_released: u32,
}

/// Creates of `set` held until `remaining` more have arrived.
#[derive(Debug)]
struct Hold {
    set: String,
    remaining: usize,
    barrier: Arc<tokio::sync::Barrier>,
}

impl State {
    /// The next `createdon`: 2026-11-23T09:00:00Z plus one second per record.
    pub fn tick(&mut self) -> String {
        let n = self.clock;
        self.clock += 1;
        format!(
            "2026-11-23T{:02}:{:02}:{:02}Z",
            9 + n / 3600,
            (n / 60) % 60,
            n % 60
        )
    }

    /// A user (for `createdby`).
    pub fn add_user(&mut self, fullname: &str) -> Uuid {
        let id = Uuid::new_v4();
        self.users.insert(id, fullname.to_owned());
        id
    }

    /// An endpoint made by someone else (`fields` as the Web API stores them, `authvalue`
    /// included), created by `creator`. Its id.
    pub fn seed_endpoint(&mut self, fields: Value, creator: Uuid) -> Uuid {
        let Value::Object(mut record) = fields else {
            panic!("an endpoint is an object")
        };
        record.insert("createdon".into(), json!(self.tick()));
        record.insert("_createdby_value".into(), json!(creator.to_string()));
        let id = Uuid::new_v4();
        self.endpoints.insert(id, record);
        id
    }

    /// A step of `endpoint` for `message` of `table`, made by `creator`, with `fields` on top
    /// of the usual ones (stage 40, mode 1, rank 1, enabled). Its id.
    pub fn seed_step(
        &mut self,
        endpoint: Uuid,
        table: &str,
        message: &str,
        fields: Value,
        creator: Uuid,
    ) -> Uuid {
        let (filter, (message_id, _)) = self
            .filters
            .iter()
            .find(|(_, (m, t))| t == table && self.messages.get(m).is_some_and(|n| n == message))
            .map(|(f, v)| (*f, v.clone()))
            .expect("a filter for that table and message");
        let mut record = Record::new();
        for (k, v) in [
            ("name", json!(format!("{message} of {table}"))),
            ("stage", json!(40)),
            ("mode", json!(1)),
            ("rank", json!(1)),
            ("supporteddeployment", json!(0)),
            ("asyncautodelete", json!(true)),
            ("statecode", json!(0)),
            ("statuscode", json!(1)),
        ] {
            record.insert(k.into(), v);
        }
        record.insert("_eventhandler_value".into(), json!(endpoint.to_string()));
        record.insert("_sdkmessageid_value".into(), json!(message_id.to_string()));
        record.insert("_sdkmessagefilterid_value".into(), json!(filter.to_string()));
        if let Value::Object(extra) = fields {
            record.extend(extra);
        }
        record.insert("createdon".into(), json!(self.tick()));
        record.insert("_createdby_value".into(), json!(creator.to_string()));
        let id = Uuid::new_v4();
        self.steps.insert(id, record);
        id
    }
}

/// The running server; stops when dropped.
#[derive(Debug)]
pub struct FakeDataverse {
    pub url: String,
    pub token: String,
    state: Arc<Mutex<State>>,
    hold: Arc<Mutex<Option<Hold>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeDataverse {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FakeDataverse {
    pub async fn start() -> FakeDataverse {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://127.0.0.1:{}", listener.local_addr().unwrap().port());
        let token = format!("test-token-{}", Uuid::new_v4());
        let mut state = State {
            base: format!("{url}/api/data/v9.2/"),
            token: token.clone(),
            ..State::default()
        };
        state.caller = state.add_user("Leasehold Deployer (the token's user)");
        let mut message_ids = BTreeMap::new();
        for m in ["Create", "Update", "Delete"] {
            let id = Uuid::new_v4();
            state.messages.insert(id, m.to_owned());
            message_ids.insert(m, id);
        }
        // systemuser has no Delete (users are disabled, not deleted).
        for (table, messages) in [
            ("account", &["Create", "Update", "Delete"][..]),
            ("contact", &["Create", "Update", "Delete"][..]),
            ("systemuser", &["Create", "Update"][..]),
        ] {
            for m in messages {
                state
                    .filters
                    .insert(Uuid::new_v4(), (message_ids[m], table.to_owned()));
            }
        }
        let state = Arc::new(Mutex::new(state));
        let hold: Arc<Mutex<Option<Hold>>> = Arc::new(Mutex::new(None));
        let shared = state.clone();
        let holds = hold.clone();
        let app =
            axum::Router::new().fallback(move |method: Method, uri: Uri, headers: HeaderMap, body: Bytes| {
                let state = shared.clone();
                let holds = holds.clone();
                async move {
                    let barrier = if method == Method::POST {
                        let mut h = holds.lock().unwrap();
                        match h.as_mut() {
                            Some(x) if x.remaining > 0 && uri.path().ends_with(&format!("/{}", x.set)) => {
                                x.remaining -= 1;
                                Some(x.barrier.clone())
                            }
                            _ => None,
                        }
                    } else {
                        None
                    };
                    if let Some(b) = barrier {
                        // Both held, or 30 s passed (then the test sees holds_released 0).
                        if let Ok(r) =
                            tokio::time::timeout(std::time::Duration::from_secs(30), b.wait()).await
                            && r.is_leader()
                        {
                            state.lock().unwrap().holds_released += 1;
                        }
                    }
                    handle(&state, method, uri, headers, body)
                }
            });
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        FakeDataverse {
            url,
            token,
            state,
            hold,
            task,
        }
    }

    /// Holds the next `n` POSTs to `set` until all `n` have arrived, then answers them.
    pub fn hold_creates(&self, set: &str, n: usize) {
        *self.hold.lock().unwrap() = Some(Hold {
            set: set.to_owned(),
            remaining: n,
            barrier: Arc::new(tokio::sync::Barrier::new(n)),
        });
    }

    pub fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap()
    }

    pub fn force(&self, force: Force) {
        self.state().force = Some(force);
    }
}

fn error(status: StatusCode, code: &str, message: &str) -> Response {
    (
        status,
        [
            ("OData-Version", "4.0"),
            ("Content-Type", "application/json; odata.metadata=minimal"),
        ],
        json!({"error": {"code": code, "message": message}}).to_string(),
    )
        .into_response()
}

fn bad(message: &str) -> Response {
    error(StatusCode::BAD_REQUEST, "0x80048d19", message)
}

fn not_found(entity: &str, id: &str) -> Response {
    error(
        StatusCode::NOT_FOUND,
        "0x80040217",
        &format!("{entity} With Id = {id} Does Not Exist"),
    )
}

fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

fn handle(state: &Mutex<State>, method: Method, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let mut st = state.lock().unwrap();
    let target = uri
        .path_and_query()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_default();
    st.requests.push(format!("{method} {target}"));
    if let Some(force) = st.force.as_mut()
        && force.times > 0
    {
        force.times -= 1;
        let status = StatusCode::from_u16(force.status).unwrap();
        let retry_after = force.retry_after;
        if status == StatusCode::UNAUTHORIZED {
            return (
                status,
                [(
                    "WWW-Authenticate",
                    "Bearer authorization_uri=https://login.microsoftonline.com/common/oauth2/authorize",
                )],
                "",
            )
                .into_response();
        }
        let mut response = error(
            status,
            "0x80072322",
            "Number of requests exceeded the limit of 6000 over time window of 300 seconds.",
        );
        if let Some(secs) = retry_after {
            response
                .headers_mut()
                .insert("Retry-After", HeaderValue::from_str(&secs.to_string()).unwrap());
        }
        return response;
    }
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or("");
    if header("authorization") != format!("Bearer {}", st.token) {
        return (StatusCode::UNAUTHORIZED, [("WWW-Authenticate", "Bearer")], "").into_response();
    }
    if header("odata-version") != "4.0" || header("odata-maxversion") != "4.0" {
        return bad("The request needs the headers OData-Version: 4.0 and OData-MaxVersion: 4.0.");
    }
    if !header("accept").contains("application/json") {
        return error(
            StatusCode::NOT_ACCEPTABLE,
            "0x80060888",
            "Accept must be application/json.",
        );
    }
    let Some(resource) = uri.path().strip_prefix("/api/data/v9.2/") else {
        return error(
            StatusCode::NOT_FOUND,
            "0x8006088a",
            &format!("Resource not found for the segment '{}'.", uri.path()),
        );
    };
    let (set, id) = match resource.find('(') {
        Some(open) if resource.ends_with(')') => {
            let Ok(id) = Uuid::parse_str(&resource[open + 1..resource.len() - 1]) else {
                return bad(&format!("Bad key in '{resource}'."));
            };
            (&resource[..open], Some(id))
        }
        Some(_) => return bad(&format!("Bad resource '{resource}'.")),
        None => (resource, None),
    };
    // Query options.
    let raw_query = uri.query().unwrap_or("");
    if raw_query.contains('+') {
        return bad("A '+' in the query: spaces must be sent as %20.");
    }
    let mut options = BTreeMap::new();
    for pair in raw_query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let (Some(k), Some(v)) = (percent_decode(k), percent_decode(v)) else {
            return bad("Bad percent-encoding in the query.");
        };
        if !matches!(k.as_str(), "$select" | "$filter" | "$expand") {
            return bad(&format!("The query parameter '{k}' is not supported."));
        }
        options.insert(k, v);
    }
    let writes = matches!(method, Method::POST | Method::PATCH);
    if writes && !header("content-type").starts_with("application/json") {
        return error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "0x80048d19",
            "Content-Type must be application/json.",
        );
    }
    let body: Option<Record> = if writes {
        match serde_json::from_slice::<Value>(&body) {
            Ok(Value::Object(m)) => Some(m),
            _ => return bad("The request body is not a JSON object."),
        }
    } else {
        None
    };
    let response = match (method.clone(), set, id) {
        (
            Method::GET,
            "serviceendpoints" | "sdkmessageprocessingsteps" | "sdkmessagefilters" | "sdkmessages",
            id,
        ) => get(&st, set, id, &options),
        (Method::POST, "serviceendpoints", None) => create_endpoint(&mut st, body.unwrap()),
        (Method::PATCH, "serviceendpoints", Some(id)) => update_endpoint(&mut st, id, body.unwrap()),
        (Method::DELETE, "serviceendpoints", Some(id)) => {
            if st.endpoints.remove(&id).is_none() {
                return not_found("serviceendpoint", &id.to_string());
            }
            let idv = json!(id.to_string());
            st.steps.retain(|_, s| s.get("_eventhandler_value") != Some(&idv));
            no_content(None)
        }
        (Method::POST, "sdkmessageprocessingsteps", None) => create_step(&mut st, body.unwrap()),
        (Method::PATCH, "sdkmessageprocessingsteps", Some(id)) => update_step(&mut st, id, body.unwrap()),
        (Method::DELETE, "sdkmessageprocessingsteps", Some(id)) => {
            if st.steps.remove(&id).is_none() {
                return not_found("sdkmessageprocessingstep", &id.to_string());
            }
            no_content(None)
        }
        (_, "serviceendpoints" | "sdkmessageprocessingsteps" | "sdkmessagefilters" | "sdkmessages", _) => {
            error(
                StatusCode::METHOD_NOT_ALLOWED,
                "0x80060888",
                &format!("{method} is not supported on {set}."),
            )
        }
        _ => error(
            StatusCode::NOT_FOUND,
            "0x8006088a",
            &format!("Resource not found for the segment '{set}'."),
        ),
    };
    if response.status().is_success() && method != Method::GET {
        st.writes.push(format!("{method} {target}"));
    }
    response
}

fn no_content(entity_id: Option<String>) -> Response {
    let mut r = (StatusCode::NO_CONTENT, [("OData-Version", "4.0")]).into_response();
    if let Some(e) = entity_id {
        r.headers_mut()
            .insert("OData-EntityId", HeaderValue::from_str(&e).unwrap());
    }
    r
}

fn type_name(set: &str) -> &str {
    set.trim_end_matches('s')
}

// ---- reads

fn rows(st: &State, set: &str) -> Vec<Record> {
    match set {
        "serviceendpoints" => st
            .endpoints
            .iter()
            .map(|(id, r)| {
                let mut r = r.clone();
                let set = r
                    .remove("authvalue")
                    .is_some_and(|v| v.as_str().is_some_and(|s| !s.is_empty()));
                r.insert("serviceendpointid".into(), json!(id.to_string()));
                r.insert("isauthvalueset".into(), json!(set));
                r
            })
            .collect(),
        "sdkmessageprocessingsteps" => st
            .steps
            .iter()
            .map(|(id, r)| {
                let mut r = r.clone();
                r.insert("sdkmessageprocessingstepid".into(), json!(id.to_string()));
                r
            })
            .collect(),
        "sdkmessagefilters" => st
            .filters
            .iter()
            .map(|(id, (message, table))| {
                let mut r = Record::new();
                r.insert("sdkmessagefilterid".into(), json!(id.to_string()));
                r.insert("_sdkmessageid_value".into(), json!(message.to_string()));
                r.insert("primaryobjecttypecode".into(), json!(table));
                r.insert("iscustomprocessingstepallowed".into(), json!(true));
                r
            })
            .collect(),
        "systemusers" => st
            .users
            .iter()
            .map(|(id, name)| {
                let mut r = Record::new();
                r.insert("systemuserid".into(), json!(id.to_string()));
                r.insert("fullname".into(), json!(name));
                r
            })
            .collect(),
        "sdkmessages" => st
            .messages
            .iter()
            .map(|(id, name)| {
                let mut r = Record::new();
                r.insert("sdkmessageid".into(), json!(id.to_string()));
                r.insert("name".into(), json!(name));
                r
            })
            .collect(),
        _ => Vec::new(),
    }
}

fn readable(set: &str) -> &'static [&'static str] {
    match set {
        "serviceendpoints" => SE_READ,
        "sdkmessageprocessingsteps" => STEP_READ,
        "sdkmessagefilters" => FILTER_READ,
        "systemusers" => &["systemuserid", "fullname"],
        _ => MESSAGE_READ,
    }
}

fn id_column(set: &str) -> &'static str {
    match set {
        "serviceendpoints" => "serviceendpointid",
        "sdkmessageprocessingsteps" => "sdkmessageprocessingstepid",
        "sdkmessagefilters" => "sdkmessagefilterid",
        "systemusers" => "systemuserid",
        _ => "sdkmessageid",
    }
}

fn select(set: &str, record: &Record, select: Option<&String>) -> Result<Record, Response> {
    let columns: Vec<&str> = match select {
        Some(s) => s.split(',').map(str::trim).collect(),
        None => readable(set).to_vec(),
    };
    let mut out = Record::new();
    for c in columns {
        if !readable(set).contains(&c) {
            return Err(bad(&format!(
                "Could not find a property named '{c}' on type 'Microsoft.Dynamics.CRM.{}'.",
                type_name(set)
            )));
        }
        out.insert(c.to_owned(), record.get(c).cloned().unwrap_or(Value::Null));
    }
    Ok(out)
}

/// One `$filter` clause's value: 'string', integer, true/false or a bare GUID.
fn literal(raw: &str) -> Option<Value> {
    let raw = raw.trim();
    if let Some(inner) = raw.strip_prefix('\'').and_then(|r| r.strip_suffix('\'')) {
        if inner.replace("''", "").contains('\'') {
            return None;
        }
        return Some(json!(inner.replace("''", "'")));
    }
    if let Ok(n) = raw.parse::<i64>() {
        return Some(json!(n));
    }
    match raw {
        "true" => Some(json!(true)),
        "false" => Some(json!(false)),
        _ => Uuid::parse_str(raw).ok().map(|u| json!(u.to_string())),
    }
}

fn matches(st: &State, set: &str, record: &Record, filter: &str) -> Result<bool, Response> {
    for clause in filter.split(" and ") {
        let clause = clause.trim();
        if let Some(args) = clause
            .strip_prefix("startswith(")
            .and_then(|c| c.strip_suffix(')'))
        {
            let (field, prefix) = args.split_once(',').ok_or_else(|| bad("Bad startswith."))?;
            if !readable(set).contains(&field.trim()) {
                return Err(bad(&format!("Could not find a property named '{field}'.")));
            }
            let Some(Value::String(prefix)) = literal(prefix) else {
                return Err(bad("startswith needs a string."));
            };
            if !record
                .get(field.trim())
                .and_then(Value::as_str)
                .is_some_and(|v| v.starts_with(&prefix))
            {
                return Ok(false);
            }
            continue;
        }
        let mut parts = clause.splitn(3, ' ');
        let (Some(field), Some("eq"), Some(value)) = (parts.next(), parts.next(), parts.next()) else {
            return Err(bad(&format!("Syntax error in $filter at '{clause}'.")));
        };
        let want = literal(value).ok_or_else(|| bad(&format!("Bad literal '{value}' in $filter.")))?;
        let have = if set == "sdkmessagefilters" && field == "sdkmessageid/name" {
            let message = record
                .get("_sdkmessageid_value")
                .and_then(Value::as_str)
                .and_then(|m| Uuid::parse_str(m).ok());
            message.and_then(|m| st.messages.get(&m)).map(|n| json!(n))
        } else if readable(set).contains(&field) {
            record.get(field).cloned()
        } else {
            return Err(bad(&format!(
                "Could not find a property named '{field}' on type 'Microsoft.Dynamics.CRM.{}'.",
                type_name(set)
            )));
        };
        let equal = match (&have, &want) {
            // Dataverse compares strings without regard to case.
            (Some(Value::String(a)), Value::String(b)) => a.eq_ignore_ascii_case(b),
            (Some(a), b) => a == b,
            (None, _) => false,
        };
        if !equal {
            return Ok(false);
        }
    }
    Ok(true)
}

/// `sdkmessagefilterid($select=primaryobjecttypecode),sdkmessageid($select=name)`
fn expand(st: &State, set: &str, record: &mut Record, raw: &str) -> Result<(), Response> {
    let mut depth = 0;
    let mut start = 0;
    let mut items = Vec::new();
    for (i, c) in raw.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&raw[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&raw[start..]);
    for item in items {
        let (nav, inner) = match item.find('(') {
            Some(open) => (&item[..open], Some(&item[open + 1..item.len() - 1])),
            None => (item, None),
        };
        let sel = inner.and_then(|i| i.strip_prefix("$select=")).map(str::to_owned);
        let (target_set, key) = match (set, nav) {
            ("sdkmessageprocessingsteps", "sdkmessagefilterid") => {
                ("sdkmessagefilters", "_sdkmessagefilterid_value")
            }
            ("sdkmessageprocessingsteps", "sdkmessageid") => ("sdkmessages", "_sdkmessageid_value"),
            ("serviceendpoints", "createdby") => ("systemusers", "_createdby_value"),
            (set, other) => {
                return Err(bad(&format!(
                    "Could not find a navigation property named '{other}' on type 'Microsoft.Dynamics.CRM.{}'.",
                    type_name(set)
                )));
            }
        };
        let target = record.get(key).and_then(Value::as_str).map(str::to_owned);
        let related = rows(st, target_set)
            .into_iter()
            .find(|r| r.get(id_column(target_set)).and_then(Value::as_str) == target.as_deref());
        let value = match related {
            Some(r) => Value::Object(select(target_set, &r, sel.as_ref())?),
            None => Value::Null,
        };
        record.insert(nav.to_owned(), value);
    }
    Ok(())
}

fn get(st: &State, set: &str, id: Option<Uuid>, options: &BTreeMap<String, String>) -> Response {
    let all = rows(st, set);
    let mut out = Vec::new();
    for r in all {
        if let Some(id) = id
            && r.get(id_column(set)).and_then(Value::as_str) != Some(id.to_string().as_str())
        {
            continue;
        }
        if let Some(f) = options.get("$filter") {
            match matches(st, set, &r, f) {
                Ok(true) => {}
                Ok(false) => continue,
                Err(e) => return e,
            }
        }
        let mut selected = match select(set, &r, options.get("$select")) {
            Ok(s) => s,
            Err(e) => return e,
        };
        if let Some(x) = options.get("$expand") {
            if set != "sdkmessageprocessingsteps" && set != "serviceendpoints" {
                return bad(
                    "$expand is supported here only on sdkmessageprocessingsteps and serviceendpoints.",
                );
            }
            // Expand reads the lookup values even when $select left them out.
            let mut full = r.clone();
            if let Err(e) = expand(st, set, &mut full, x) {
                return e;
            }
            for nav in ["sdkmessagefilterid", "sdkmessageid", "createdby"] {
                if let Some(v) = full.remove(nav) {
                    selected.insert(nav.into(), v);
                }
            }
        }
        selected.insert("@odata.etag".into(), json!("W/\"1\""));
        out.push(Value::Object(selected));
    }
    let body = match id {
        Some(id) => match out.into_iter().next() {
            Some(one) => one,
            None => return not_found(type_name(set), &id.to_string()),
        },
        None => json!({"@odata.context": format!("{}$metadata#{set}", st.base), "value": out}),
    };
    (
        StatusCode::OK,
        [
            ("OData-Version", "4.0"),
            ("Content-Type", "application/json; odata.metadata=minimal"),
        ],
        body.to_string(),
    )
        .into_response()
}

// ---- writes

fn undeclared(key: &str) -> Response {
    let property = key.trim_end_matches("@odata.bind");
    bad(&format!(
        "An undeclared property '{property}' which only has property annotations in the payload but no property value was found in the payload. In OData, only declared navigation properties and declared named streams can be represented as properties without values."
    ))
}

fn unknown_property(key: &str, set: &str) -> Response {
    bad(&format!(
        "The property '{key}' does not exist on type 'Microsoft.Dynamics.CRM.{}'. Make sure to only use property names that are defined by the type or mark the type as open type.",
        type_name(set)
    ))
}

fn int(body: &Record, key: &str) -> Result<Option<i64>, Response> {
    match body.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_i64()
            .map(Some)
            .ok_or_else(|| bad(&format!("'{key}' must be an integer (Edm.Int32)."))),
    }
}

fn string(body: &Record, key: &str) -> Result<Option<String>, Response> {
    match body.get(key) {
        None => Ok(None),
        Some(Value::Null) if key == "filteringattributes" || key == "description" => Ok(Some(String::new())),
        Some(v) => v
            .as_str()
            .map(|s| Some(s.to_owned()))
            .ok_or_else(|| bad(&format!("'{key}' must be a string (Edm.String)."))),
    }
}

fn check_choice(body: &Record, key: &str, allowed: &[i64]) -> Result<(), Response> {
    if let Some(v) = int(body, key)?
        && !allowed.contains(&v)
    {
        return Err(bad(&format!(
            "{v} is not a valid value for '{key}' here (allowed: {allowed:?})."
        )));
    }
    Ok(())
}

const SE_WRITE: &[&str] = &[
    "name",
    "url",
    "contract",
    "authtype",
    "authvalue",
    "messageformat",
    "userclaim",
    "connectionmode",
    "description",
];

fn check_endpoint(body: &Record, creating: bool) -> Result<(), Response> {
    for key in body.keys() {
        if key.contains('@') {
            return Err(undeclared(key));
        }
        if !SE_WRITE.contains(&key.as_str()) {
            return Err(unknown_property(key, "serviceendpoints"));
        }
    }
    // Webhooks only: 8 (Webhook); the key types Dataverse offers for them: 4, 5, 6.
    check_choice(body, "contract", &[8])?;
    check_choice(body, "authtype", &[4, 5, 6])?;
    check_choice(body, "messageformat", &[2])?;
    check_choice(body, "userclaim", &[1])?;
    check_choice(body, "connectionmode", &[1])?;
    if let Some(url) = string(body, "url")? {
        let ok = url.starts_with("https://")
            || url.starts_with("http://127.0.0.1")
            || url.starts_with("http://localhost");
        if !ok || url.contains("code=") {
            return Err(bad(&format!("'{url}' is not a valid webhook URL.")));
        }
    }
    if let Some(name) = string(body, "name")?
        && name.trim().is_empty()
    {
        return Err(bad("'name' is required."));
    }
    string(body, "description")?;
    if let Some(v) = string(body, "authvalue")?
        && (v.is_empty() || v.len() > 2048)
    {
        return Err(bad("'authvalue' must hold 1 to 2,048 characters."));
    }
    if creating {
        for key in ["name", "url", "contract", "authtype", "connectionmode"] {
            if !body.contains_key(key) {
                return Err(bad(&format!(
                    "'{key}' is required to create a webhook service endpoint."
                )));
            }
        }
        if int(body, "authtype")? == Some(4) && !body.contains_key("authvalue") {
            return Err(bad("A WebhookKey endpoint needs 'authvalue'."));
        }
    }
    Ok(())
}

fn create_endpoint(st: &mut State, body: Record) -> Response {
    if let Err(e) = check_endpoint(&body, true) {
        return e;
    }
    let mut body = body;
    body.insert("createdon".into(), json!(st.tick()));
    body.insert("_createdby_value".into(), json!(st.caller.to_string()));
    let id = Uuid::new_v4();
    st.endpoints.insert(id, body);
    no_content(Some(format!("{}serviceendpoints({id})", st.base)))
}

fn update_endpoint(st: &mut State, id: Uuid, body: Record) -> Response {
    if let Err(e) = check_endpoint(&body, false) {
        return e;
    }
    let base = st.base.clone();
    let Some(current) = st.endpoints.get_mut(&id) else {
        return not_found("serviceendpoint", &id.to_string());
    };
    current.extend(body);
    no_content(Some(format!("{base}serviceendpoints({id})")))
}

const STEP_WRITE: &[&str] = &[
    "name",
    "description",
    "stage",
    "mode",
    "rank",
    "supporteddeployment",
    "asyncautodelete",
    "filteringattributes",
    "statecode",
    "statuscode",
];

/// `/set(guid)` (leading slash optional) naming an existing record of `set`.
fn bind(st: &State, value: &Value, set: &str) -> Result<Uuid, Response> {
    let raw = value
        .as_str()
        .ok_or_else(|| bad("An @odata.bind value must be a string."))?;
    let raw = raw.strip_prefix('/').unwrap_or(raw);
    let id = raw
        .strip_prefix(set)
        .and_then(|r| r.strip_prefix('('))
        .and_then(|r| r.strip_suffix(')'))
        .and_then(|g| Uuid::parse_str(g).ok())
        .ok_or_else(|| bad(&format!("'{raw}' is not a reference to {set}(<id>).")))?;
    let exists = match set {
        "serviceendpoints" => st.endpoints.contains_key(&id),
        "sdkmessages" => st.messages.contains_key(&id),
        "sdkmessagefilters" => st.filters.contains_key(&id),
        _ => false,
    };
    if !exists {
        return Err(not_found(type_name(set), &id.to_string()));
    }
    Ok(id)
}

fn apply_step(st: &State, current: &mut Record, body: Record, creating: bool) -> Result<(), Response> {
    // SetState by PATCH: a statecode without a statuscode takes that state's default status.
    if body.contains_key("statecode") && !body.contains_key("statuscode") {
        let default = match body.get("statecode").and_then(Value::as_i64) {
            Some(1) => 2,
            _ => 1,
        };
        current.insert("statuscode".into(), json!(default));
    }
    let mut binds = Map::new();
    for (key, value) in body {
        match key.as_str() {
            "eventhandler_serviceendpoint@odata.bind" => {
                let id = bind(st, &value, "serviceendpoints")?;
                binds.insert("_eventhandler_value".into(), json!(id.to_string()));
            }
            "sdkmessageid@odata.bind" => {
                let id = bind(st, &value, "sdkmessages")?;
                binds.insert("_sdkmessageid_value".into(), json!(id.to_string()));
            }
            "sdkmessagefilterid@odata.bind" => {
                let id = bind(st, &value, "sdkmessagefilters")?;
                binds.insert("_sdkmessagefilterid_value".into(), json!(id.to_string()));
            }
            k if k.ends_with("@odata.bind") => return Err(undeclared(k)),
            k if STEP_WRITE.contains(&k) => {
                current.insert(key, value);
            }
            k => return Err(unknown_property(k, "sdkmessageprocessingsteps")),
        }
    }
    current.extend(binds);
    for key in [
        "stage",
        "mode",
        "rank",
        "supporteddeployment",
        "statecode",
        "statuscode",
    ] {
        int(current, key)?;
    }
    check_choice(current, "stage", &[10, 20, 40])?;
    check_choice(current, "mode", &[0, 1])?;
    check_choice(current, "supporteddeployment", &[0, 1, 2])?;
    check_choice(current, "statecode", &[0, 1])?;
    let pair = (int(current, "statecode")?, int(current, "statuscode")?);
    if !matches!(pair, (Some(0), Some(1)) | (Some(1), Some(2)) | (None, _)) {
        return Err(bad(&format!(
            "statuscode {:?} is not valid for statecode {:?} (Enabled 0 goes with 1, Disabled 1 with 2).",
            pair.1, pair.0
        )));
    }
    if let Some(v) = current.get("asyncautodelete")
        && !v.is_boolean()
    {
        return Err(bad("'asyncautodelete' must be a boolean."));
    }
    string(current, "name")?;
    string(current, "filteringattributes")?;
    if creating {
        for key in [
            "name",
            "stage",
            "mode",
            "rank",
            "_eventhandler_value",
            "_sdkmessageid_value",
        ] {
            if !current.contains_key(key) {
                let shown = match key {
                    "_eventhandler_value" => "eventhandler_serviceendpoint@odata.bind",
                    "_sdkmessageid_value" => "sdkmessageid@odata.bind",
                    k => k,
                };
                return Err(bad(&format!("'{shown}' is required to create a step.")));
            }
        }
    }
    let mode = int(current, "mode")?;
    if mode == Some(1) && int(current, "stage")? != Some(40) {
        return Err(bad(
            "An asynchronous step (mode 1) must be registered on the post-operation stage (40).",
        ));
    }
    if current.get("asyncautodelete") == Some(&json!(true)) && mode != Some(1) {
        return Err(bad(
            "asyncautodelete applies to asynchronous steps (mode 1) only.",
        ));
    }
    let message = current
        .get("_sdkmessageid_value")
        .and_then(Value::as_str)
        .and_then(|m| Uuid::parse_str(m).ok());
    if let Some(filter) = current
        .get("_sdkmessagefilterid_value")
        .and_then(Value::as_str)
        .and_then(|f| Uuid::parse_str(f).ok())
        && st.filters.get(&filter).map(|(m, _)| *m) != message
    {
        return Err(bad(
            "The sdkmessagefilter is for another sdkmessage than the step's.",
        ));
    }
    let is_update = message
        .and_then(|m| st.messages.get(&m))
        .is_some_and(|n| n == "Update");
    let attributes = current
        .get("filteringattributes")
        .and_then(Value::as_str)
        .unwrap_or("");
    if !attributes.is_empty() && !is_update {
        return Err(bad("Filtering attributes are valid for the Update message only."));
    }
    Ok(())
}

fn create_step(st: &mut State, body: Record) -> Response {
    let mut record = Record::new();
    record.insert("statecode".into(), json!(0));
    record.insert("statuscode".into(), json!(1));
    record.insert("asyncautodelete".into(), json!(false));
    record.insert("supporteddeployment".into(), json!(0));
    if let Err(e) = apply_step(st, &mut record, body, true) {
        return e;
    }
    record.insert("createdon".into(), json!(st.tick()));
    record.insert("_createdby_value".into(), json!(st.caller.to_string()));
    let id = Uuid::new_v4();
    st.steps.insert(id, record);
    no_content(Some(format!("{}sdkmessageprocessingsteps({id})", st.base)))
}

fn update_step(st: &mut State, id: Uuid, body: Record) -> Response {
    let Some(mut record) = st.steps.get(&id).cloned() else {
        return not_found("sdkmessageprocessingstep", &id.to_string());
    };
    if let Err(e) = apply_step(st, &mut record, body, false) {
        return e;
    }
    st.steps.insert(id, record);
    no_content(Some(format!("{}sdkmessageprocessingsteps({id})", st.base)))
}
