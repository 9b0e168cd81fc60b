//! `leasehold dataverse register | list | unregister`: wires a Dataverse (Dynamics 365)
//! environment to Leasehold's Start function through the Web API, instead of the Plug-in
//! Registration Tool.
//!
//! What is registered (see the README, "Wiring Dataverse", for the documentation behind each
//! value):
//! - one webhook **service endpoint** (`serviceendpoints`: `contract` 8 Webhook, `authtype` 4
//!   WebhookKey, so Dataverse calls `<start-url>?code=<key>`, `messageformat` 2 JSON), found by
//!   name (default `leasehold-<host of the Start URL>`);
//! - per table and message one **step** (`sdkmessageprocessingsteps`: `stage` 40
//!   post-operation, `mode` 1 asynchronous, `rank` 1, `supporteddeployment` 0 server,
//!   `asyncautodelete` true), bound to that endpoint, with `filteringattributes` for Update.
//!
//! `register` is idempotent: it reads first, writes only what differs, and says what it did.
//! The key (`authvalue`) cannot be read back, so the endpoint's `description` carries a
//! fingerprint of it (the first 16 hex digits of a SHA-256 of the key): a changed key is seen and
//! written, an unchanged one is not. For the tables it is given, `register` makes the endpoint's
//! steps exactly the requested messages (a step for a message no longer asked for is removed);
//! steps for other tables are left alone.

mod client;
mod command;
mod credential;

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use serde::Serialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use url::Url;
use uuid::Uuid;

pub use client::{RetryPolicy, WebApi, check_url, environment_url};
pub use command::{DataverseCommand, run};
pub use credential::{Credential, TOKEN_VAR};

/// The variable holding the Start function's key.
pub const KEY_VAR: &str = "LEASEHOLD_START_KEY";
/// Every endpoint Leasehold manages has a name starting with this.
pub const NAME_PREFIX: &str = "leasehold";
const FINGERPRINT_MARK: &str = "key fingerprint sha256:";

// The documented values (README, "Wiring Dataverse").
const CONTRACT_WEBHOOK: i64 = 8;
const AUTHTYPE_WEBHOOK_KEY: i64 = 4;
const MESSAGEFORMAT_JSON: i64 = 2;
const USERCLAIM_NONE: i64 = 1;
const CONNECTIONMODE_NORMAL: i64 = 1;
const STAGE_POST_OPERATION: i64 = 40;
const MODE_ASYNCHRONOUS: i64 = 1;
const RANK: i64 = 1;
const SUPPORTED_DEPLOYMENT_SERVER: i64 = 0;

/// The SDK messages a webhook step is usually registered for, in their documented spelling;
/// others are accepted as typed.
const KNOWN_MESSAGES: &[&str] = &[
    "Create",
    "Update",
    "Delete",
    "Assign",
    "SetState",
    "SetStateDynamicEntity",
    "Merge",
    "Associate",
    "Disassociate",
    "GrantAccess",
    "ModifyAccess",
    "RevokeAccess",
    "Win",
    "Lose",
    "QualifyLead",
];

/// The Start function's key: from `LEASEHOLD_START_KEY` or a file, never the command line.
#[derive(Clone)]
pub struct StartKey(String);

impl std::fmt::Debug for StartKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StartKey(<redacted>)")
    }
}

impl StartKey {
    /// From `file` when given, else from `LEASEHOLD_START_KEY`; `None` when neither is set.
    pub fn load(file: Option<&Path>) -> Result<Option<StartKey>> {
        let raw = match file {
            Some(path) => std::fs::read_to_string(path)
                .with_context(|| format!("reading the Start key from {}", path.display()))?,
            None => match std::env::var(KEY_VAR) {
                Ok(v) => v,
                Err(std::env::VarError::NotPresent) => return Ok(None),
                Err(e) => bail!("{KEY_VAR}: {e}"),
            },
        };
        let key = raw.trim();
        let source = match file {
            Some(path) => path.display().to_string(),
            None => KEY_VAR.to_owned(),
        };
        if key.is_empty() {
            bail!("the Start key in {source} is empty");
        }
        if key.chars().any(|c| c.is_whitespace() || c.is_control()) {
            bail!("the Start key in {source} holds whitespace: give the key alone");
        }
        if key.len() > 2048 {
            bail!("the Start key in {source} is longer than the 2,048 characters authvalue holds");
        }
        Ok(Some(StartKey(key.to_owned())))
    }

    /// The first 16 hex digits of SHA-256 over the key: enough to see a rotation, useless for
    /// guessing a random Functions key.
    pub fn fingerprint(&self) -> String {
        let digest = Sha256::digest(format!("leasehold-start-key\n{}", self.0).as_bytes());
        digest.iter().take(8).map(|b| format!("{b:02x}")).collect()
    }
}

/// What to register.
#[derive(Debug, Clone)]
pub struct RegisterSpec {
    pub environment: Url,
    pub start_url: Url,
    pub name: String,
    pub tables: Vec<String>,
    pub messages: Vec<String>,
    pub filtering_attributes: Vec<String>,
    pub key: Option<StartKey>,
}

fn display<S: serde::Serializer>(id: &Uuid, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.collect_str(id)
}

fn check_name(name: &str) -> Result<()> {
    if !name.starts_with(NAME_PREFIX)
        || name.len() > 100
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        bail!(
            "--name '{name}': a Leasehold endpoint's name starts with '{NAME_PREFIX}' (that is how `list` and `unregister` find it) and has at most 100 letters, digits, '-', '_' or '.'"
        );
    }
    Ok(())
}

/// The default endpoint name: `leasehold-<host of the Start URL>`.
pub fn default_name(start_url: &Url) -> String {
    format!("{NAME_PREFIX}-{}", start_url.host_str().unwrap_or("start"))
}

fn logical_names(values: &[String], what: &str) -> Result<Vec<String>> {
    let mut out: Vec<String> = Vec::new();
    for v in values.iter().map(|v| v.trim()).filter(|v| !v.is_empty()) {
        let lower = v.to_ascii_lowercase();
        if !lower.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') || lower.len() > 100 {
            bail!(
                "{what} '{v}' is not a logical name (letters, digits and '_', like account or new_project)"
            );
        }
        if !out.contains(&lower) {
            out.push(lower);
        }
    }
    Ok(out)
}

impl RegisterSpec {
    /// Checks and normalises the command line's values.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        environment_url: &str,
        start_url: &str,
        name: Option<String>,
        tables: &[String],
        messages: &[String],
        filtering_attributes: &[String],
        key: Option<StartKey>,
    ) -> Result<Self> {
        let environment = client::environment_url(environment_url)?;
        let start_url = check_url(start_url, "--start-url")?;
        if start_url
            .query_pairs()
            .any(|(k, _)| k.eq_ignore_ascii_case("code"))
        {
            bail!(
                "--start-url carries a ?code= key: give the URL without it; the key comes from {KEY_VAR} or --start-key-file (Dataverse appends ?code=<key> itself)"
            );
        }
        if start_url.port().is_some_and(|p| p != 443 && p != 80) && start_url.scheme() == "https" {
            bail!("--start-url: Dataverse calls webhooks on ports 80 and 443 only");
        }
        let name = name.unwrap_or_else(|| default_name(&start_url));
        check_name(&name)?;
        let tables = logical_names(tables, "--table")?;
        if tables.is_empty() {
            bail!("--table: name at least one table (its logical name, like account)");
        }
        let mut canonical: Vec<String> = Vec::new();
        for m in messages.iter().map(|m| m.trim()).filter(|m| !m.is_empty()) {
            if !m.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                bail!("--messages '{m}' is not an SDK message name (like Create or Update)");
            }
            let m = KNOWN_MESSAGES
                .iter()
                .find(|k| k.eq_ignore_ascii_case(m))
                .map(|k| k.to_string())
                .unwrap_or_else(|| m.to_owned());
            if !canonical.contains(&m) {
                canonical.push(m);
            }
        }
        if canonical.is_empty() {
            bail!("--messages: name at least one message (like Create,Update)");
        }
        let filtering_attributes = logical_names(filtering_attributes, "--filtering-attributes")?;
        if !filtering_attributes.is_empty() && !canonical.iter().any(|m| m == "Update") {
            bail!(
                "--filtering-attributes apply to the Update message only, and --messages does not include Update"
            );
        }
        Ok(RegisterSpec {
            environment,
            start_url,
            name,
            tables,
            messages: canonical,
            filtering_attributes,
            key,
        })
    }

    fn attributes_for(&self, message: &str) -> Vec<String> {
        if message == "Update" {
            self.filtering_attributes.clone()
        } else {
            Vec::new()
        }
    }

    fn description(&self, key: Option<&StartKey>, existing: Option<&str>) -> String {
        let fingerprint = key
            .map(StartKey::fingerprint)
            .or_else(|| existing.and_then(fingerprint_in));
        match fingerprint {
            Some(f) => format!(
                "Leasehold's Start webhook, managed by `leasehold dataverse register`; {FINGERPRINT_MARK}{f}"
            ),
            None => "Leasehold's Start webhook, managed by `leasehold dataverse register`".to_owned(),
        }
    }

    fn step_name(&self, table: &str, message: &str) -> String {
        format!("{}: {message} of {table}", self.name)
    }
}

fn fingerprint_in(description: &str) -> Option<String> {
    let at = description.find(FINGERPRINT_MARK)? + FINGERPRINT_MARK.len();
    let f: String = description[at..]
        .chars()
        .take_while(|c| c.is_ascii_hexdigit())
        .collect();
    (!f.is_empty()).then_some(f)
}

/// The endpoint's fields (without the key).
fn endpoint_fields(spec: &RegisterSpec) -> Value {
    json!({
        "name": spec.name,
        "url": spec.start_url.as_str(),
        "contract": CONTRACT_WEBHOOK,
        "authtype": AUTHTYPE_WEBHOOK_KEY,
        "messageformat": MESSAGEFORMAT_JSON,
        "userclaim": USERCLAIM_NONE,
        "connectionmode": CONNECTIONMODE_NORMAL,
    })
}

fn step_body(
    spec: &RegisterSpec,
    table: &str,
    message: &str,
    endpoint: &str,
    message_id: &str,
    filter_id: &str,
) -> Value {
    let mut body = json!({
        "name": spec.step_name(table, message),
        "description": format!("Leasehold: {message} of {table} to {}", spec.start_url),
        "stage": STAGE_POST_OPERATION,
        "mode": MODE_ASYNCHRONOUS,
        "rank": RANK,
        "supporteddeployment": SUPPORTED_DEPLOYMENT_SERVER,
        "asyncautodelete": true,
        "eventhandler_serviceendpoint@odata.bind": format!("/serviceendpoints({endpoint})"),
        "sdkmessageid@odata.bind": format!("/sdkmessages({message_id})"),
        "sdkmessagefilterid@odata.bind": format!("/sdkmessagefilters({filter_id})"),
    });
    let attributes = spec.attributes_for(message);
    if !attributes.is_empty() {
        body["filteringattributes"] = json!(attributes.join(","));
    }
    body
}

/// What was done to a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Action {
    Created,
    Updated,
    Unchanged,
    Removed,
}

impl std::fmt::Display for Action {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Action::Created => "created",
            Action::Updated => "updated",
            Action::Unchanged => "unchanged",
            Action::Removed => "removed",
        })
    }
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointReport {
    #[serde(serialize_with = "display")]
    pub id: Uuid,
    pub name: String,
    pub url: String,
    pub action: Action,
    /// What differed (field names; the key as "key").
    pub changes: Vec<String>,
    /// "set" (created or rotated), "unchanged", or "kept" (no key given).
    pub key: &'static str,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StepReport {
    #[serde(serialize_with = "display")]
    pub id: Uuid,
    pub table: String,
    pub message: String,
    pub action: Action,
    pub changes: Vec<String>,
    pub filtering_attributes: Vec<String>,
}

/// What `register` did.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RegisterReport {
    pub environment_url: String,
    pub endpoint: EndpointReport,
    pub steps: Vec<StepReport>,
    /// Steps of this endpoint for tables not named this time (left alone).
    pub other_steps: Vec<StepView>,
    /// Whether anything was written.
    pub changed: bool,
}

/// A step as `list` shows it.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StepView {
    #[serde(serialize_with = "display")]
    pub id: Uuid,
    pub name: String,
    pub table: String,
    pub message: String,
    pub stage: i64,
    pub mode: i64,
    pub rank: i64,
    pub asyncautodelete: bool,
    pub filtering_attributes: Vec<String>,
    pub enabled: bool,
    #[serde(skip)]
    message_id: Option<String>,
    #[serde(skip)]
    filter_id: Option<String>,
    #[serde(skip)]
    supporteddeployment: i64,
}

/// An endpoint as `list` shows it.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointView {
    #[serde(serialize_with = "display")]
    pub id: Uuid,
    pub name: String,
    pub url: String,
    pub key_set: bool,
    pub key_fingerprint: Option<String>,
    pub steps: Vec<StepView>,
}

/// What `list` found.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ListReport {
    pub environment_url: String,
    pub endpoints: Vec<EndpointView>,
}

/// What `unregister` removed.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct UnregisterReport {
    pub environment_url: String,
    pub removed: Vec<EndpointView>,
}

/// One request `--dry-run` would send.
#[derive(Debug, Serialize)]
pub struct PlannedRequest {
    pub method: &'static str,
    pub url: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub body: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

const ENDPOINT_SELECT: &str = "serviceendpointid,name,url,contract,authtype,messageformat,userclaim,connectionmode,description,isauthvalueset";
const STEP_SELECT: &str = "sdkmessageprocessingstepid,name,stage,mode,rank,supporteddeployment,asyncautodelete,filteringattributes,statecode,_sdkmessageid_value,_sdkmessagefilterid_value";
const STEP_EXPAND: &str = "sdkmessagefilterid($select=primaryobjecttypecode),sdkmessageid($select=name)";

fn endpoints_query(name: Option<&str>) -> String {
    let filter = match name {
        Some(name) => format!(
            "contract eq {CONTRACT_WEBHOOK} and name eq {}",
            client::literal(name)
        ),
        None => format!(
            "contract eq {CONTRACT_WEBHOOK} and startswith(name,{})",
            client::literal(NAME_PREFIX)
        ),
    };
    client::query(
        "serviceendpoints",
        &[("$select", ENDPOINT_SELECT), ("$filter", &filter)],
    )
}

fn steps_query(endpoint: &str) -> String {
    client::query(
        "sdkmessageprocessingsteps",
        &[
            ("$select", STEP_SELECT),
            ("$filter", &format!("_eventhandler_value eq {endpoint}")),
            ("$expand", STEP_EXPAND),
        ],
    )
}

fn filters_query(table: &str, message: &str) -> String {
    client::query(
        "sdkmessagefilters",
        &[
            (
                "$select",
                "sdkmessagefilterid,_sdkmessageid_value,iscustomprocessingstepallowed",
            ),
            (
                "$filter",
                &format!(
                    "sdkmessageid/name eq {} and primaryobjecttypecode eq {}",
                    client::literal(message),
                    client::literal(table)
                ),
            ),
        ],
    )
}

fn str_field<'a>(v: &'a Value, field: &str) -> Option<&'a str> {
    v.get(field).and_then(Value::as_str)
}

fn int_field(v: &Value, field: &str) -> Option<i64> {
    v.get(field).and_then(Value::as_i64)
}

fn id_field(v: &Value, field: &str) -> Result<Uuid> {
    let raw = str_field(v, field).ok_or_else(|| anyhow!("the answer lacks {field}"))?;
    Uuid::parse_str(raw).with_context(|| format!("{field} '{raw}' is not a GUID"))
}

fn attribute_set(raw: Option<&str>) -> BTreeSet<String> {
    raw.unwrap_or("")
        .split(',')
        .map(|a| a.trim().to_ascii_lowercase())
        .filter(|a| !a.is_empty())
        .collect()
}

fn step_view(v: &Value) -> Result<StepView> {
    let table = v
        .get("sdkmessagefilterid")
        .and_then(|f| str_field(f, "primaryobjecttypecode"))
        .unwrap_or("(any table)")
        .to_owned();
    let message = v
        .get("sdkmessageid")
        .and_then(|m| str_field(m, "name"))
        .unwrap_or("(unknown message)")
        .to_owned();
    Ok(StepView {
        id: id_field(v, "sdkmessageprocessingstepid")?,
        name: str_field(v, "name").unwrap_or("").to_owned(),
        table,
        message,
        stage: int_field(v, "stage").unwrap_or(0),
        mode: int_field(v, "mode").unwrap_or(0),
        rank: int_field(v, "rank").unwrap_or(0),
        asyncautodelete: v.get("asyncautodelete").and_then(Value::as_bool).unwrap_or(false),
        filtering_attributes: attribute_set(str_field(v, "filteringattributes"))
            .into_iter()
            .collect(),
        enabled: int_field(v, "statecode").unwrap_or(0) == 0,
        message_id: str_field(v, "_sdkmessageid_value").map(str::to_ascii_lowercase),
        filter_id: str_field(v, "_sdkmessagefilterid_value").map(str::to_ascii_lowercase),
        supporteddeployment: int_field(v, "supporteddeployment").unwrap_or(0),
    })
}

async fn endpoint_views(api: &WebApi, name: Option<&str>) -> Result<Vec<EndpointView>> {
    let mut out = Vec::new();
    for e in api.get_all(&endpoints_query(name)).await? {
        let id = id_field(&e, "serviceendpointid")?;
        let steps = api
            .get_all(&steps_query(&id.to_string()))
            .await?
            .iter()
            .map(step_view)
            .collect::<Result<Vec<_>>>()?;
        out.push(EndpointView {
            id,
            name: str_field(&e, "name").unwrap_or("").to_owned(),
            url: str_field(&e, "url").unwrap_or("").to_owned(),
            key_set: e.get("isauthvalueset").and_then(Value::as_bool).unwrap_or(false),
            key_fingerprint: str_field(&e, "description").and_then(fingerprint_in),
            steps,
        });
    }
    Ok(out)
}

/// `dataverse list`.
pub async fn list(api: &WebApi, name: Option<&str>) -> Result<ListReport> {
    if let Some(name) = name {
        check_name(name)?;
    }
    Ok(ListReport {
        environment_url: api.environment().as_str().trim_end_matches('/').to_owned(),
        endpoints: endpoint_views(api, name).await?,
    })
}

/// The endpoints `unregister` would remove: the one named, or the only Leasehold endpoint.
async fn to_unregister(api: &WebApi, name: Option<&str>) -> Result<Vec<EndpointView>> {
    if let Some(name) = name {
        check_name(name)?;
    }
    let found = endpoint_views(api, name).await?;
    if name.is_none() && found.len() > 1 {
        bail!(
            "{} Leasehold webhook endpoints are registered in {}: {}. Say which with --name",
            found.len(),
            api.environment().as_str().trim_end_matches('/'),
            found
                .iter()
                .map(|e| e.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(found)
}

/// `dataverse unregister`: deletes the endpoint; Dataverse deletes its steps with it.
pub async fn unregister(api: &WebApi, name: Option<&str>) -> Result<UnregisterReport> {
    let found = to_unregister(api, name).await?;
    for e in &found {
        api.delete(&format!("serviceendpoints({})", e.id)).await?;
    }
    Ok(UnregisterReport {
        environment_url: api.environment().as_str().trim_end_matches('/').to_owned(),
        removed: found,
    })
}

/// The requests `unregister` would send.
pub fn plan_unregister(api_base: &Url, name: Option<&str>) -> Result<Vec<PlannedRequest>> {
    if let Some(name) = name {
        check_name(name)?;
    }
    let url = |p: &str| -> Result<String> { Ok(api_base.join(client::API_PATH)?.join(p)?.to_string()) };
    Ok(vec![
        PlannedRequest {
            method: "GET",
            url: url(&endpoints_query(name))?,
            body: None,
            note: Some(match name {
                Some(n) => format!("find the webhook endpoint named {n}"),
                None => {
                    "find Leasehold's webhook endpoints (there must be exactly one without --name)".into()
                }
            }),
        },
        PlannedRequest {
            method: "GET",
            url: url(&steps_query("<serviceendpointid>"))?,
            body: None,
            note: Some("its steps (to report them)".into()),
        },
        PlannedRequest {
            method: "DELETE",
            url: url("serviceendpoints(<serviceendpointid>)")?,
            body: None,
            note: Some("Dataverse deletes the endpoint's steps with it".into()),
        },
    ])
}

/// One (table, message) to register, with the ids Dataverse knows it by.
#[derive(Debug)]
struct Wanted {
    table: String,
    message: String,
    message_id: String,
    filter_id: String,
}

/// `dataverse register`.
pub async fn register(api: &WebApi, spec: &RegisterSpec) -> Result<RegisterReport> {
    // Reads first: an unsupported table or message stops us before anything is written.
    let existing = api.get_all(&endpoints_query(Some(&spec.name))).await?;
    if existing.len() > 1 {
        bail!(
            "{} webhook endpoints are named {} in {}: remove them with `leasehold dataverse unregister --name {}` and register again",
            existing.len(),
            spec.name,
            api.environment().as_str().trim_end_matches('/'),
            spec.name
        );
    }
    let mut wanted = Vec::new();
    for table in &spec.tables {
        for message in &spec.messages {
            let filters = api.get_all(&filters_query(table, message)).await?;
            let Some(filter) = filters.first() else {
                bail!(
                    "table '{table}' does not support the message '{message}' in {} (Dataverse has no sdkmessagefilter for {message} of {table}): check the table's logical name (not its display name) and which messages it supports",
                    api.environment().as_str().trim_end_matches('/')
                );
            };
            if filter
                .get("iscustomprocessingstepallowed")
                .and_then(Value::as_bool)
                == Some(false)
            {
                bail!("Dataverse does not allow custom steps for {message} of {table}");
            }
            wanted.push(Wanted {
                table: table.clone(),
                message: message.clone(),
                message_id: id_field(filter, "_sdkmessageid_value")?.to_string(),
                filter_id: id_field(filter, "sdkmessagefilterid")?.to_string(),
            });
        }
    }

    // The endpoint.
    let fields = endpoint_fields(spec);
    let endpoint = match existing.first() {
        None => {
            let Some(key) = spec.key.as_ref() else {
                bail!(
                    "creating the endpoint {} needs the Start key: set {KEY_VAR} or pass --start-key-file",
                    spec.name
                );
            };
            let mut body = fields.clone();
            body["description"] = json!(spec.description(Some(key), None));
            body["authvalue"] = json!(key.0);
            let id = api.create("serviceendpoints", &body).await?;
            EndpointReport {
                id,
                name: spec.name.clone(),
                url: spec.start_url.to_string(),
                action: Action::Created,
                changes: Vec::new(),
                key: "set",
            }
        }
        Some(current) => {
            let id = id_field(current, "serviceendpointid")?;
            let mut patch = serde_json::Map::new();
            let mut changes = Vec::new();
            for (field, want) in fields.as_object().expect("an object") {
                if current.get(field) != Some(want) {
                    patch.insert(field.clone(), want.clone());
                    changes.push(field.clone());
                }
            }
            let description = str_field(current, "description");
            let key_set = current
                .get("isauthvalueset")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            let key_action = match spec.key.as_ref() {
                Some(key) if !key_set || description.and_then(fingerprint_in) != Some(key.fingerprint()) => {
                    patch.insert("authvalue".into(), json!(key.0));
                    changes.push("key".into());
                    "set"
                }
                Some(_) => "unchanged",
                None if !key_set => bail!(
                    "the endpoint {} has no key set: give the Start key ({KEY_VAR} or --start-key-file)",
                    spec.name
                ),
                None => "kept",
            };
            let want_description = spec.description(spec.key.as_ref(), description);
            if description != Some(want_description.as_str()) {
                patch.insert("description".into(), json!(want_description));
                if !changes.iter().any(|c| c == "key") {
                    changes.push("description".into());
                }
            }
            let action = if patch.is_empty() {
                Action::Unchanged
            } else {
                api.update(&format!("serviceendpoints({id})"), &Value::Object(patch))
                    .await?;
                Action::Updated
            };
            EndpointReport {
                id,
                name: spec.name.clone(),
                url: spec.start_url.to_string(),
                action,
                changes,
                key: key_action,
            }
        }
    };
    let endpoint_id = endpoint.id.to_string();

    // The steps.
    let current_steps: Vec<StepView> = if endpoint.action == Action::Created {
        Vec::new()
    } else {
        api.get_all(&steps_query(&endpoint_id))
            .await?
            .iter()
            .map(step_view)
            .collect::<Result<_>>()?
    };
    let mut used = BTreeSet::new();
    let mut steps = Vec::new();
    for w in &wanted {
        let body = step_body(
            spec,
            &w.table,
            &w.message,
            &endpoint_id,
            &w.message_id,
            &w.filter_id,
        );
        let mut matching = current_steps
            .iter()
            .filter(|s| s.filter_id.as_deref() == Some(w.filter_id.as_str()));
        let attributes = spec.attributes_for(&w.message);
        let report = match matching.next() {
            None => {
                let id = api.create("sdkmessageprocessingsteps", &body).await?;
                StepReport {
                    id,
                    table: w.table.clone(),
                    message: w.message.clone(),
                    action: Action::Created,
                    changes: Vec::new(),
                    filtering_attributes: attributes,
                }
            }
            Some(current) => {
                used.insert(current.id);
                let mut patch = serde_json::Map::new();
                let mut changes = Vec::new();
                let mut differs = |field: &str, same: bool| {
                    if !same {
                        patch.insert(field.to_owned(), body.get(field).cloned().unwrap_or(Value::Null));
                        changes.push(field.to_owned());
                    }
                };
                differs("name", current.name == spec.step_name(&w.table, &w.message));
                differs("stage", current.stage == STAGE_POST_OPERATION);
                differs("mode", current.mode == MODE_ASYNCHRONOUS);
                differs("rank", current.rank == RANK);
                differs(
                    "supporteddeployment",
                    current.supporteddeployment == SUPPORTED_DEPLOYMENT_SERVER,
                );
                differs("asyncautodelete", current.asyncautodelete);
                differs(
                    "filteringattributes",
                    current
                        .filtering_attributes
                        .iter()
                        .cloned()
                        .collect::<BTreeSet<_>>()
                        == attributes.iter().cloned().collect::<BTreeSet<_>>(),
                );
                if current.message_id.as_deref() != Some(w.message_id.as_str()) {
                    patch.insert(
                        "sdkmessageid@odata.bind".into(),
                        body["sdkmessageid@odata.bind"].clone(),
                    );
                    changes.push("sdkmessageid".into());
                }
                let action = if patch.is_empty() {
                    Action::Unchanged
                } else {
                    api.update(
                        &format!("sdkmessageprocessingsteps({})", current.id),
                        &Value::Object(patch),
                    )
                    .await?;
                    Action::Updated
                };
                StepReport {
                    id: current.id,
                    table: w.table.clone(),
                    message: w.message.clone(),
                    action,
                    changes,
                    filtering_attributes: attributes,
                }
            }
        };
        steps.push(report);
        // Duplicates of this step (a create that was retried by hand, say): removed.
        for extra in matching {
            used.insert(extra.id);
            api.delete(&format!("sdkmessageprocessingsteps({})", extra.id))
                .await?;
            steps.push(StepReport {
                id: extra.id,
                table: w.table.clone(),
                message: w.message.clone(),
                action: Action::Removed,
                changes: vec!["duplicate".into()],
                filtering_attributes: extra.filtering_attributes.clone(),
            });
        }
    }
    // Steps for the named tables but messages no longer asked for: removed. Other tables: kept.
    let mut other_steps = Vec::new();
    for s in current_steps.iter().filter(|s| !used.contains(&s.id)) {
        if spec.tables.contains(&s.table) {
            api.delete(&format!("sdkmessageprocessingsteps({})", s.id))
                .await?;
            steps.push(StepReport {
                id: s.id,
                table: s.table.clone(),
                message: s.message.clone(),
                action: Action::Removed,
                changes: vec!["message not asked for".into()],
                filtering_attributes: s.filtering_attributes.clone(),
            });
        } else {
            other_steps.push(s.clone());
        }
    }
    let changed = endpoint.action != Action::Unchanged || steps.iter().any(|s| s.action != Action::Unchanged);
    Ok(RegisterReport {
        environment_url: api.environment().as_str().trim_end_matches('/').to_owned(),
        endpoint,
        steps,
        other_steps,
        changed,
    })
}

/// The requests `register` sends to an environment where nothing is registered yet (the key
/// redacted). A live run reads first and writes only what differs: PATCH instead of POST for
/// what exists, nothing for what is already right.
pub fn plan_register(spec: &RegisterSpec) -> Result<Vec<PlannedRequest>> {
    let api = spec.environment.join(client::API_PATH)?;
    let url = |p: &str| -> Result<String> { Ok(api.join(p)?.to_string()) };
    let mut out = vec![PlannedRequest {
        method: "GET",
        url: url(&endpoints_query(Some(&spec.name)))?,
        body: None,
        note: Some(format!("find the webhook endpoint named {}", spec.name)),
    }];
    for table in &spec.tables {
        for message in &spec.messages {
            out.push(PlannedRequest {
                method: "GET",
                url: url(&filters_query(table, message))?,
                body: None,
                note: Some(format!(
                    "the ids of {message} of {table} (none: the table does not support the message, and nothing is written)"
                )),
            });
        }
    }
    let mut endpoint = endpoint_fields(spec);
    endpoint["description"] = json!(spec.description(spec.key.as_ref(), None));
    endpoint["authvalue"] = json!(if spec.key.is_some() {
        "<redacted>"
    } else {
        "<no key given: set LEASEHOLD_START_KEY or --start-key-file>"
    });
    out.push(PlannedRequest {
        method: "POST",
        url: url("serviceendpoints")?,
        body: Some(endpoint),
        note: Some(
            "create the endpoint; when it exists: PATCH serviceendpoints(<id>) with only what differs (authvalue when the key's fingerprint differs), then GET its steps".into(),
        ),
    });
    for table in &spec.tables {
        for message in &spec.messages {
            out.push(PlannedRequest {
                method: "POST",
                url: url("sdkmessageprocessingsteps")?,
                body: Some(step_body(
                    spec,
                    table,
                    message,
                    "<serviceendpointid>",
                    &format!("<_sdkmessageid_value of {message}>"),
                    &format!("<sdkmessagefilterid of {message} of {table}>"),
                )),
                note: Some(format!(
                    "the step for {message} of {table}; when it exists: PATCH with only what differs"
                )),
            });
        }
    }
    Ok(out)
}

/// Text for people: the plan of a `--dry-run`.
pub fn text_plan(requests: &[PlannedRequest]) -> String {
    let mut out = String::from("dry run: nothing is sent. The requests (the key redacted):\n");
    for (i, r) in requests.iter().enumerate() {
        let _ = writeln!(out, "\n{}. {} {}", i + 1, r.method, r.url);
        if let Some(note) = &r.note {
            let _ = writeln!(out, "   # {note}");
        }
        if let Some(body) = &r.body {
            let pretty = serde_json::to_string_pretty(body).unwrap_or_default();
            for line in pretty.lines() {
                let _ = writeln!(out, "   {line}");
            }
        }
    }
    out.trim_end().to_owned()
}

fn describe_step(s: &StepView) -> String {
    let mut line = format!(
        "{} {}: {}{}, rank {}",
        s.table,
        s.message,
        match s.stage {
            40 => "post-operation".to_owned(),
            20 => "pre-operation".to_owned(),
            10 => "pre-validation".to_owned(),
            n => format!("stage {n}"),
        },
        if s.mode == 1 {
            ", asynchronous"
        } else {
            ", synchronous"
        },
        s.rank
    );
    if s.asyncautodelete {
        line.push_str(", succeeded jobs deleted");
    }
    if !s.filtering_attributes.is_empty() {
        let _ = write!(
            line,
            ", filtering attributes {}",
            s.filtering_attributes.join(",")
        );
    }
    if !s.enabled {
        line.push_str(", DISABLED");
    }
    line
}

/// Text for people: what `register` did.
pub fn text_register(r: &RegisterReport) -> String {
    let mut out = String::new();
    let e = &r.endpoint;
    let _ = write!(
        out,
        "endpoint {} ({}) in {}: {}",
        e.name, e.id, r.environment_url, e.action
    );
    match e.action {
        Action::Created => {
            let _ = write!(out, " (url {}, key set)", e.url);
        }
        Action::Updated => {
            let _ = write!(out, " ({})", e.changes.join(", "));
        }
        _ => {}
    }
    if e.action != Action::Created {
        let _ = write!(
            out,
            "; key {}",
            match e.key {
                "set" => "set (it differed from the one registered)",
                "kept" => "kept (none given)",
                _ => "unchanged",
            }
        );
    }
    out.push('\n');
    for s in &r.steps {
        let _ = write!(out, "step {} {} ({}): {}", s.table, s.message, s.id, s.action);
        if !s.changes.is_empty() {
            let _ = write!(out, " ({})", s.changes.join(", "));
        }
        if !s.filtering_attributes.is_empty() && s.action != Action::Removed {
            let _ = write!(out, "; filtering attributes {}", s.filtering_attributes.join(","));
        }
        out.push('\n');
    }
    for s in &r.other_steps {
        let _ = writeln!(
            out,
            "step {} {} ({}): kept (another table)",
            s.table, s.message, s.id
        );
    }
    out.push_str(if r.changed {
        "registered: Dataverse now sends these events to Leasehold's Start"
    } else {
        "nothing changed: the registration was already as asked"
    });
    out
}

/// Text for people: `list`.
pub fn text_list(r: &ListReport) -> String {
    if r.endpoints.is_empty() {
        return format!("no Leasehold webhook endpoints in {}", r.environment_url);
    }
    let mut out = format!(
        "{} Leasehold webhook endpoint(s) in {}:\n",
        r.endpoints.len(),
        r.environment_url
    );
    for e in &r.endpoints {
        let _ = writeln!(out, "\n{} ({})", e.name, e.id);
        let _ = writeln!(out, "  url  {}", e.url);
        let _ = writeln!(
            out,
            "  key  {}",
            match (&e.key_set, &e.key_fingerprint) {
                (false, _) => "NOT SET".to_owned(),
                (true, Some(f)) => format!("set (fingerprint {f})"),
                (true, None) => "set (not by Leasehold: no fingerprint)".to_owned(),
            }
        );
        if e.steps.is_empty() {
            out.push_str("  no steps: Dataverse sends it nothing\n");
        }
        for s in &e.steps {
            let _ = writeln!(out, "  step {}", describe_step(s));
        }
    }
    out.trim_end().to_owned()
}

/// Text for people: `unregister`.
pub fn text_unregister(r: &UnregisterReport) -> String {
    if r.removed.is_empty() {
        return format!(
            "nothing to remove: no such Leasehold webhook endpoint in {}",
            r.environment_url
        );
    }
    let mut out = String::new();
    for e in &r.removed {
        let _ = writeln!(
            out,
            "removed endpoint {} ({}) from {} and with it its {} step(s){}",
            e.name,
            e.id,
            r.environment_url,
            e.steps.len(),
            if e.steps.is_empty() {
                String::new()
            } else {
                format!(
                    ": {}",
                    e.steps
                        .iter()
                        .map(|s| format!("{} {}", s.table, s.message))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            }
        );
    }
    out.trim_end().to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(key: Option<&str>) -> RegisterSpec {
        RegisterSpec::new(
            "https://contoso.crm.dynamics.com",
            "https://func-leaseholddev.azurewebsites.net/api/start",
            None,
            &["Account".into()],
            &["create".into(), "Update".into()],
            &["name".into(), "statuscode".into()],
            key.map(|k| StartKey(k.into())),
        )
        .unwrap()
    }

    #[test]
    fn spec_normalises_and_refuses() {
        let s = spec(None);
        assert_eq!(s.name, "leasehold-func-leaseholddev.azurewebsites.net");
        assert_eq!(s.tables, ["account"]);
        assert_eq!(s.messages, ["Create", "Update"]);
        assert_eq!(s.attributes_for("Create"), Vec::<String>::new());
        assert_eq!(s.attributes_for("Update"), ["name", "statuscode"]);
        let e = RegisterSpec::new(
            "https://contoso.crm.dynamics.com",
            "https://x.azurewebsites.net/api/start?code=abc",
            None,
            &["account".into()],
            &["Create".into()],
            &[],
            None,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("?code="), "{e}");
        let e = RegisterSpec::new(
            "https://contoso.crm.dynamics.com",
            "https://x.azurewebsites.net/api/start",
            Some("mine".into()),
            &["account".into()],
            &["Create".into()],
            &[],
            None,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("starts with 'leasehold'"), "{e}");
        let e = RegisterSpec::new(
            "https://contoso.crm.dynamics.com",
            "https://x.azurewebsites.net/api/start",
            None,
            &["account".into()],
            &["Create".into()],
            &["name".into()],
            None,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("Update message only"), "{e}");
    }

    #[test]
    fn fingerprint_round_trips_and_differs() {
        let a = StartKey("key-a".into());
        let b = StartKey("key-b".into());
        assert_eq!(a.fingerprint().len(), 16);
        assert_ne!(a.fingerprint(), b.fingerprint());
        let d = spec(Some("key-a")).description(Some(&a), None);
        assert_eq!(fingerprint_in(&d), Some(a.fingerprint()));
        assert!(!d.contains("key-a"));
        assert_eq!(format!("{a:?}"), "StartKey(<redacted>)");
    }

    #[test]
    fn plan_redacts_the_key() {
        let plan = plan_register(&spec(Some("super-secret-key"))).unwrap();
        let text = text_plan(&plan);
        assert!(!text.contains("super-secret-key"));
        assert!(text.contains("<redacted>"));
        assert!(
            text.contains("POST https://contoso.crm.dynamics.com/api/data/v9.2/sdkmessageprocessingsteps")
        );
        assert!(text.contains("\"filteringattributes\": \"name,statuscode\""));
        assert_eq!(plan.iter().filter(|r| r.method == "POST").count(), 3);
    }
}
