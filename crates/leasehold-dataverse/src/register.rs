//! `leasehold dataverse register | list | unregister`: wires a Dataverse (Dynamics 365)
//! environment to Leasehold's Start function through the Web API, instead of the Plug-in
//! Registration Tool.
//!
//! What is registered (see docs/dataverse.md for the documentation behind each
//! value):
//! - one webhook **service endpoint** (`serviceendpoints`: `contract` 8 Webhook, `authtype` 4
//!   WebhookKey, so Dataverse calls `<start-url>?code=<key>`, `messageformat` 2 JSON), found by
//!   name (default `leasehold-<host of the Start URL>`);
//! - per table and message one **step** (`sdkmessageprocessingsteps`: `stage` 40
//!   post-operation, `mode` 1 asynchronous, `rank` 1, `supporteddeployment` 0 server,
//!   `asyncautodelete` true), bound to that endpoint, with `filteringattributes` for Update.
//!
//! Whose an endpoint is: `register` writes a marker line into the endpoint's `description`
//! (`[leasehold-managed endpoint=<name>] written by `leasehold dataverse register`…`). Only an
//! endpoint carrying the marker for its own name is Leasehold's; `register` and `unregister`
//! refuse any other (a name starting with "leasehold" is not enough), saying what it is and
//! who made it, unless told `register --adopt` (take it over: the marker is written) or
//! `unregister --force`. `unregister` lists what it deletes and asks first (`--yes` not to).
//!
//! Two `register` runs at once converge to one endpoint: see [`register`].
//!
//! `register` is idempotent: it reads first, writes only what differs, and says what it did.
//! The key (`authvalue`) cannot be read back, so the endpoint's `description` carries a
//! fingerprint of it (the first 16 hex digits of a SHA-256 of the key): a changed key is seen and
//! written, an unchanged one is not. For the tables it is given, `register` makes the endpoint's
//! steps exactly the requested messages (a step for a message no longer asked for is removed);
//! steps for other tables are left alone.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use serde::Serialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use url::Url;
use uuid::Uuid;

use crate::client::{self, WebApi, check_url};

/// The variable holding the Start function's key.
pub const KEY_VAR: &str = "LEASEHOLD_START_KEY";
/// Every endpoint Leasehold manages has a name starting with this (how `list` finds them; not
/// what makes one Leasehold's: that is the marker).
pub const NAME_PREFIX: &str = "leasehold";
const FINGERPRINT_MARK: &str = "key fingerprint sha256:";
/// The marker: `register` writes the line `[leasehold-managed endpoint=<name>] …` into the
/// endpoint's description; an endpoint is Leasehold's only when it carries it for its own name.
pub const MARKER_OPEN: &str = "[leasehold-managed endpoint=";
const MARKER_REST: &str = "] written by `leasehold dataverse register`, which updates and deletes this endpoint and its steps; without this line it leaves the endpoint alone";
/// The description leasehold wrote before the marker: recognised to say so, never taken for it.
const EARLIER_DESCRIPTION: &str = "Leasehold's Start webhook, managed by `leasehold dataverse register`";
/// How often `register` reads back and converges before it gives up.
const MAX_ROUNDS: usize = 5;
const STATE_ENABLED: i64 = 0;
const STATUS_ENABLED: i64 = 1;
const STEP_WAS_DISABLED: &str = "it was disabled: enabled";

/// The marker line for the endpoint `name`.
fn marker_line(name: &str) -> String {
    format!("{MARKER_OPEN}{name}{MARKER_REST}")
}

/// The endpoint name a description's marker line names, if it has one.
fn marker_in(description: &str) -> Option<&str> {
    description
        .lines()
        .find_map(|l| l.trim().strip_prefix(MARKER_OPEN))
        .and_then(|rest| rest.split_once(']'))
        .map(|(name, _)| name)
}

/// Whose a webhook endpoint is, by its description.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Whose {
    /// It carries the marker for its own name.
    Leasehold,
    /// No marker, but the description leasehold wrote before the marker existed.
    EarlierLeasehold,
    /// A marker naming another endpoint: a copy or rename of Leasehold's.
    CopyOf(String),
    /// Anything else: someone else's.
    Other,
}

impl Whose {
    pub fn of(name: &str, description: &str) -> Whose {
        match marker_in(description) {
            Some(m) if m.eq_ignore_ascii_case(name) => Whose::Leasehold,
            Some(m) => Whose::CopyOf(m.to_owned()),
            None if description.contains(EARLIER_DESCRIPTION) => Whose::EarlierLeasehold,
            None => Whose::Other,
        }
    }

    fn phrase(&self) -> String {
        match self {
            Whose::Leasehold => "Leasehold's (its description carries the marker `register` writes)".into(),
            Whose::EarlierLeasehold => "an earlier leasehold's, it seems: its description is the one leasehold wrote before the marker existed, but it carries no marker".into(),
            Whose::CopyOf(m) => format!("a copy or rename of Leasehold's endpoint {m}, it seems: its marker names {m}, not this endpoint"),
            Whose::Other => format!("someone else's, it seems: its description carries no `{MARKER_OPEN}…]` line"),
        }
    }
}

// The documented values (docs/dataverse.md).
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
    /// Take over an endpoint of this name that is not marked as Leasehold's (`--adopt`).
    pub adopt: bool,
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
    /// This registration for the low lane (`--priority low`): Start's URL with `priority=low`,
    /// so every step's event is queued behind a person's saves; the endpoint named
    /// `<default>-low` unless `named` (so it is a second endpoint beside the high lane's).
    pub fn for_low_lane(mut self, named: bool) -> Result<Self> {
        if self
            .start_url
            .query_pairs()
            .any(|(k, _)| k.eq_ignore_ascii_case("priority"))
        {
            bail!("--start-url carries a priority already: give it without one, and --priority low");
        }
        self.start_url.query_pairs_mut().append_pair("priority", "low");
        if !named {
            let mut host_url = self.start_url.clone();
            host_url.set_query(None);
            self.name = format!("{}-low", default_name(&host_url));
            check_name(&self.name)?;
        }
        Ok(self)
    }

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
            adopt: false,
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
        let first = match fingerprint {
            Some(f) => format!("Leasehold's Start webhook; {FINGERPRINT_MARK}{f}"),
            None => "Leasehold's Start webhook".to_owned(),
        };
        format!("{first}\n{}", marker_line(&self.name))
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
    /// The endpoint it is (or was) a step of.
    #[serde(skip)]
    endpoint: Uuid,
}

/// Another Leasehold endpoint of the same name, removed by `register`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DuplicateReport {
    #[serde(serialize_with = "display")]
    pub id: Uuid,
    pub created_on: Option<String>,
    /// This run created it, at the same time as another run created the one kept.
    pub created_by_this_run: bool,
    #[serde(serialize_with = "display")]
    pub kept: Uuid,
    /// Its steps for other tables, moved to the one kept.
    pub moved_steps: Vec<String>,
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
    /// Other Leasehold endpoints with this name (two registers at once, or one that stopped
    /// half-way), removed.
    pub duplicates_removed: Vec<DuplicateReport>,
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
    #[serde(skip_serializing_if = "Option::is_none")]
    pub created_on: Option<String>,
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
    /// Whether it carries Leasehold's marker; `register` and `unregister` touch no other.
    pub managed_by_leasehold: bool,
    /// Whose it is, in words.
    pub whose: String,
    pub description: String,
    pub created_on: Option<String>,
    pub created_by: Option<String>,
    pub steps: Vec<StepView>,
}

/// What `list` found.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ListReport {
    pub environment_url: String,
    pub endpoints: Vec<EndpointView>,
}

/// What `unregister` is about to delete (read before it asks).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct UnregisterPlan {
    pub environment_url: String,
    pub endpoints: Vec<EndpointView>,
    /// Endpoints named leasehold… that are not Leasehold's: not deleted.
    pub left_alone: Vec<EndpointView>,
}

/// What `unregister` removed.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct UnregisterReport {
    pub environment_url: String,
    pub removed: Vec<EndpointView>,
    pub left_alone: Vec<EndpointView>,
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

const ENDPOINT_SELECT: &str = "serviceendpointid,name,url,contract,authtype,messageformat,userclaim,connectionmode,description,isauthvalueset,createdon,_createdby_value";
const ENDPOINT_EXPAND: &str = "createdby($select=fullname)";
const STEP_SELECT: &str = "sdkmessageprocessingstepid,name,stage,mode,rank,supporteddeployment,asyncautodelete,filteringattributes,statecode,_sdkmessageid_value,_sdkmessagefilterid_value,createdon";
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
        &[
            ("$select", ENDPOINT_SELECT),
            ("$filter", &filter),
            ("$expand", ENDPOINT_EXPAND),
        ],
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
        created_on: str_field(v, "createdon").map(str::to_owned),
        message_id: str_field(v, "_sdkmessageid_value").map(str::to_ascii_lowercase),
        filter_id: str_field(v, "_sdkmessagefilterid_value").map(str::to_ascii_lowercase),
        supporteddeployment: int_field(v, "supporteddeployment").unwrap_or(0),
    })
}

/// The order that picks which of several records survives: the oldest `createdon` first (one
/// without comes last), ties by the smallest id. Every run computes the same order from the same
/// records, so two runs never each keep a different one.
fn survival_order(created_on: Option<&str>, id: Uuid) -> (bool, String, Uuid) {
    (created_on.is_none(), created_on.unwrap_or("").to_owned(), id)
}

/// A webhook endpoint as read, with what decides whose it is.
#[derive(Debug, Clone)]
struct Found {
    id: Uuid,
    raw: Value,
    name: String,
    url: String,
    description: String,
    created_on: Option<String>,
    created_by: Option<String>,
    whose: Whose,
}

/// A URL to show: its query's values redacted (someone else's webhook may carry a key there).
fn shown_url(url: &str) -> String {
    match url.split_once('?') {
        None => url.to_owned(),
        Some((base, query)) => {
            let names = query
                .split('&')
                .map(|pair| format!("{}=<redacted>", pair.split_once('=').map_or(pair, |(k, _)| k)))
                .collect::<Vec<_>>();
            format!("{base}?{}", names.join("&"))
        }
    }
}

impl Found {
    fn read(v: Value) -> Result<Found> {
        let name = str_field(&v, "name").unwrap_or("").to_owned();
        let description = str_field(&v, "description").unwrap_or("").to_owned();
        Ok(Found {
            id: id_field(&v, "serviceendpointid")?,
            url: shown_url(str_field(&v, "url").unwrap_or("")),
            created_on: str_field(&v, "createdon").map(str::to_owned),
            created_by: v
                .get("createdby")
                .and_then(|u| str_field(u, "fullname"))
                .or_else(|| str_field(&v, "_createdby_value"))
                .map(str::to_owned),
            whose: Whose::of(&name, &description),
            name,
            description,
            raw: v,
        })
    }

    fn is_leaseholds(&self) -> bool {
        self.whose == Whose::Leasehold
    }

    fn order(&self) -> (bool, String, Uuid) {
        survival_order(self.created_on.as_deref(), self.id)
    }
}

/// The webhook endpoints named `name` (or, without, all whose name starts with "leasehold"),
/// in survival order.
async fn found_endpoints(api: &WebApi, name: Option<&str>) -> Result<Vec<Found>> {
    let mut out = api
        .get_all(&endpoints_query(name))
        .await?
        .into_iter()
        .map(Found::read)
        .collect::<Result<Vec<_>>>()?;
    out.sort_by_key(Found::order);
    Ok(out)
}

/// An endpoint's steps, in survival order.
async fn steps_of(api: &WebApi, endpoint: Uuid) -> Result<Vec<StepView>> {
    let mut steps = api
        .get_all(&steps_query(&endpoint.to_string()))
        .await?
        .iter()
        .map(step_view)
        .collect::<Result<Vec<_>>>()?;
    steps.sort_by_key(|s| survival_order(s.created_on.as_deref(), s.id));
    Ok(steps)
}

async fn endpoint_view(api: &WebApi, f: &Found) -> Result<EndpointView> {
    Ok(EndpointView {
        id: f.id,
        name: f.name.clone(),
        url: f.url.clone(),
        key_set: f
            .raw
            .get("isauthvalueset")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        key_fingerprint: fingerprint_in(&f.description),
        managed_by_leasehold: f.is_leaseholds(),
        whose: f.whose.phrase(),
        description: f.description.clone(),
        created_on: f.created_on.clone(),
        created_by: f.created_by.clone(),
        steps: steps_of(api, f.id).await?,
    })
}

fn env_text(api: &WebApi) -> String {
    api.environment().as_str().trim_end_matches('/').to_owned()
}

/// `dataverse list`.
pub async fn list(api: &WebApi, name: Option<&str>) -> Result<ListReport> {
    if let Some(name) = name {
        check_name(name)?;
    }
    let mut endpoints = Vec::new();
    for f in found_endpoints(api, name).await? {
        endpoints.push(endpoint_view(api, &f).await?);
    }
    Ok(ListReport {
        environment_url: env_text(api),
        endpoints,
    })
}

/// The description, on one line and cut short, to show in a message.
fn one_line(text: &str, max: usize) -> String {
    let joined = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" / ");
    if joined.chars().count() > max {
        format!("{}…", joined.chars().take(max).collect::<String>())
    } else {
        joined
    }
}

/// An endpoint that is not Leasehold's, for a refusal: what it is and who made it.
fn describe_found(f: &Found) -> String {
    let mut out = format!("  endpoint {} ({})\n    url          {}\n", f.name, f.id, f.url);
    let description = one_line(&f.description, 300);
    let _ = writeln!(
        out,
        "    description  {}",
        if description.is_empty() {
            "(none)".to_owned()
        } else {
            format!("\"{description}\"")
        }
    );
    let _ = writeln!(
        out,
        "    created      {} by {}",
        f.created_on.as_deref().unwrap_or("(date not given)"),
        f.created_by.as_deref().unwrap_or("(creator not given)")
    );
    let _ = write!(out, "    whose        {}", f.whose.phrase());
    out
}

/// The endpoints `unregister` would delete, read before it asks.
async fn to_unregister(api: &WebApi, name: Option<&str>, force: bool) -> Result<UnregisterPlan> {
    if let Some(name) = name {
        check_name(name)?;
    }
    if force && name.is_none() {
        bail!("--force deletes an endpoint that is not Leasehold's and needs --name: say which one");
    }
    let found = found_endpoints(api, name).await?;
    let (ours, others): (Vec<Found>, Vec<Found>) = found.into_iter().partition(Found::is_leaseholds);
    let delete: Vec<Found> = match name {
        Some(name) => {
            if !others.is_empty() && !force {
                let blocks = others.iter().map(describe_found).collect::<Vec<_>>().join("\n");
                let earlier = others.iter().any(|f| f.whose == Whose::EarlierLeasehold);
                bail!(
                    "the webhook endpoint named {name} in {} is not Leasehold's (its description lacks the line `{MARKER_OPEN}{name}]…` that `leasehold dataverse register` writes), so `unregister` does not delete it:\n{blocks}\n{}To delete it anyway, rerun with --name {name} --force (unregister still lists what it deletes and asks first).",
                    env_text(api),
                    if earlier {
                        "If it is Leasehold's from before the marker, `leasehold dataverse register … --name NAME --adopt` takes it over (writes the marker); or delete it as below.\n"
                    } else {
                        ""
                    }
                );
            }
            ours.into_iter()
                .chain(others.clone().into_iter().filter(|_| force))
                .collect()
        }
        None => {
            let names: BTreeSet<String> = ours.iter().map(|f| f.name.to_ascii_lowercase()).collect();
            if names.len() > 1 {
                bail!(
                    "{} Leasehold webhook endpoints are registered in {}: {}. Say which with --name",
                    names.len(),
                    env_text(api),
                    names.into_iter().collect::<Vec<_>>().join(", ")
                );
            }
            ours
        }
    };
    let left_alone = if name.is_some() && force {
        Vec::new()
    } else {
        others
    };
    let mut plan = UnregisterPlan {
        environment_url: env_text(api),
        endpoints: Vec::new(),
        left_alone: Vec::new(),
    };
    for f in &delete {
        plan.endpoints.push(endpoint_view(api, f).await?);
    }
    for f in &left_alone {
        plan.left_alone.push(endpoint_view(api, f).await?);
    }
    Ok(plan)
}

/// `dataverse unregister`, first half: what it would delete (reads only). Without `name`, the
/// Leasehold endpoint there is (several copies of one name are one registration); with it, that
/// endpoint, refused when it is not Leasehold's unless `force`.
pub async fn plan_unregister_live(api: &WebApi, name: Option<&str>, force: bool) -> Result<UnregisterPlan> {
    to_unregister(api, name, force).await
}

/// `dataverse unregister`, second half: deletes the endpoints of `plan` (Dataverse deletes their
/// steps with them). One already gone is not an error.
pub async fn unregister(api: &WebApi, plan: UnregisterPlan) -> Result<UnregisterReport> {
    for e in &plan.endpoints {
        api.delete_if_there(&format!("serviceendpoints({})", e.id))
            .await?;
    }
    Ok(UnregisterReport {
        environment_url: plan.environment_url,
        removed: plan.endpoints,
        left_alone: plan.left_alone,
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
                Some(n) => format!(
                    "find the webhook endpoint named {n}; refused unless its description carries Leasehold's marker line (or --force)"
                ),
                None => "find Leasehold's webhook endpoints: those whose description carries the marker line `register` writes (one name; others named leasehold… are left alone)".into(),
            }),
        },
        PlannedRequest {
            method: "GET",
            url: url(&steps_query("<serviceendpointid>"))?,
            body: None,
            note: Some("its steps, to list them before asking (--yes: no question)".into()),
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

/// The filters of the steps asked for; reads only, so an unsupported table or message stops
/// `register` before anything is written.
async fn wanted_steps(api: &WebApi, spec: &RegisterSpec) -> Result<Vec<Wanted>> {
    let mut wanted = Vec::new();
    for table in &spec.tables {
        for message in &spec.messages {
            let filters = api.get_all(&filters_query(table, message)).await?;
            let Some(filter) = filters.first() else {
                bail!(
                    "table '{table}' does not support the message '{message}' in {} (Dataverse has no sdkmessagefilter for {message} of {table}): check the table's logical name (not its display name) and which messages it supports",
                    env_text(api)
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
    Ok(wanted)
}

/// What `register` has done so far, over its rounds.
#[derive(Debug, Default)]
struct Progress {
    /// The endpoint this run created, if it did.
    created: Option<Uuid>,
    endpoint: Option<EndpointReport>,
    steps: Vec<StepReport>,
    other_steps: Vec<StepView>,
    duplicates: Vec<DuplicateReport>,
}

impl Progress {
    fn endpoint(&mut self, new: EndpointReport) {
        match self.endpoint.as_mut() {
            Some(old) if old.id == new.id => {
                if new.action != Action::Unchanged && old.action != Action::Created {
                    old.action = new.action;
                }
                for c in new.changes {
                    if !old.changes.contains(&c) {
                        old.changes.push(c);
                    }
                }
                if new.key == "set" {
                    old.key = "set";
                }
            }
            _ => self.endpoint = Some(new),
        }
    }

    fn step(&mut self, new: StepReport) {
        match self.steps.iter_mut().find(|s| s.id == new.id) {
            Some(old) => {
                if new.action == Action::Removed
                    || (new.action != Action::Unchanged && old.action != Action::Created)
                {
                    old.action = new.action;
                }
                for c in new.changes {
                    if !old.changes.contains(&c) {
                        old.changes.push(c);
                    }
                }
            }
            None => self.steps.push(new),
        }
    }
}

enum Round {
    /// The endpoint kept and its steps, as read back.
    Done(Uuid, Vec<StepView>),
    Again,
}

/// `dataverse register`.
///
/// Two runs at once (two pipelines, a retried step) may both find nothing and both create an
/// endpoint. So after a create, and in every round, `register` reads all of Leasehold's
/// endpoints with this name and converges them to one: the oldest (`createdon`, ties by the
/// smallest id) is kept, the others' steps for other tables are moved to it and the others are
/// deleted; then the kept one's fields and steps are made right (duplicate steps: the oldest
/// kept). A round ends with a read; when it shows one endpoint with one step per table and
/// message asked for, `register` is done, else it goes round again (at most five times). Every
/// run picks the same survivor from the same records, so two runs never delete each other's
/// choice; a run that died half-way leaves duplicates the next `register` repairs the same way.
pub async fn register(api: &WebApi, spec: &RegisterSpec) -> Result<RegisterReport> {
    let found = found_endpoints(api, Some(&spec.name)).await?;
    let foreign: Vec<&Found> = found.iter().filter(|f| !f.is_leaseholds()).collect();
    if !foreign.is_empty() && !spec.adopt {
        let blocks = foreign
            .iter()
            .map(|f| describe_found(f))
            .collect::<Vec<_>>()
            .join("\n");
        bail!(
            "the webhook endpoint named {name} in {env} is not Leasehold's (its description lacks the line `{MARKER_OPEN}{name}]…` that `leasehold dataverse register` writes), so `register` does not change it:\n{blocks}\nRegister under another --name; or, if it is Leasehold's after all (one registered before leasehold wrote the marker, say), take it over once with --adopt: register then rewrites its url, key and description (marker included) and manages its steps.",
            name = spec.name,
            env = env_text(api),
        );
    }
    let wanted = wanted_steps(api, spec).await?;
    let mut progress = Progress::default();
    // With --adopt, every endpoint of this name is Leasehold's from now on.
    let mut candidates = found;
    if candidates.is_empty() {
        let Some(key) = spec.key.as_ref() else {
            bail!(
                "creating the endpoint {} needs the Start key: set {KEY_VAR} or pass --start-key-file",
                spec.name
            );
        };
        let mut body = endpoint_fields(spec);
        body["description"] = json!(spec.description(Some(key), None));
        body["authvalue"] = json!(key.0);
        progress.created = Some(api.create("serviceendpoints", &body).await?);
        // Another register may have created one at the same time: converge with it.
        candidates = leaseholds(found_endpoints(api, Some(&spec.name)).await?);
    }
    for _ in 0..MAX_ROUNDS {
        if candidates.is_empty() {
            bail!(
                "the endpoint {} was deleted while `register` ran (an `unregister` at the same time?): run register again",
                spec.name
            );
        }
        match converge(api, spec, &wanted, &candidates, &mut progress).await {
            Ok(Round::Done(survivor, steps)) => return Ok(progress.report(api, survivor, &steps)),
            Ok(Round::Again) => {}
            // Something this round wrote to was deleted meanwhile (by another register
            // converging too): read again and go round.
            Err(e) if client::is_not_found(&e) => {}
            Err(e) => return Err(e),
        }
        candidates = leaseholds(found_endpoints(api, Some(&spec.name)).await?);
    }
    bail!(
        "the endpoint {} and its steps were still changing after {MAX_ROUNDS} rounds (other `register` runs at the same time?): run register again once they are done",
        spec.name
    )
}

fn leaseholds(found: Vec<Found>) -> Vec<Found> {
    found.into_iter().filter(Found::is_leaseholds).collect()
}

impl Progress {
    fn report(mut self, api: &WebApi, survivor: Uuid, steps: &[StepView]) -> RegisterReport {
        // Steps this run made on an endpoint that then lost went with it.
        self.steps.retain(|s| s.endpoint == survivor);
        // A step this run made that another run, converging too, removed as the younger twin.
        for s in &mut self.steps {
            if s.action != Action::Removed && !steps.iter().any(|k| k.id == s.id) {
                s.action = Action::Removed;
                s.changes
                    .push("duplicate, removed by a register running at the same time".into());
            }
        }
        // This run's create lost and the other run, converging, deleted it before this one did.
        if let Some(created) = self.created
            && created != survivor
            && !self.duplicates.iter().any(|d| d.id == created)
        {
            self.duplicates.push(DuplicateReport {
                id: created,
                created_on: None,
                created_by_this_run: true,
                kept: survivor,
                moved_steps: Vec::new(),
            });
        }
        let endpoint = self.endpoint.expect("a round reports the endpoint");
        let changed = endpoint.action != Action::Unchanged
            || self.steps.iter().any(|s| s.action != Action::Unchanged)
            || !self.duplicates.is_empty();
        RegisterReport {
            environment_url: env_text(api),
            endpoint,
            steps: self.steps,
            other_steps: self.other_steps,
            duplicates_removed: self.duplicates,
            changed,
        }
    }
}

/// One round: keep the oldest candidate, fold the others into it, make it and its steps right,
/// and read back whether that is now the whole picture.
async fn converge(
    api: &WebApi,
    spec: &RegisterSpec,
    wanted: &[Wanted],
    candidates: &[Found],
    progress: &mut Progress,
) -> Result<Round> {
    let survivor = candidates
        .iter()
        .min_by_key(|f| f.order())
        .expect("candidates")
        .clone();
    let mut survivor_steps = steps_of(api, survivor.id).await?;
    for loser in candidates.iter().filter(|f| f.id != survivor.id) {
        let mut moved = Vec::new();
        for s in steps_of(api, loser.id).await? {
            // Steps for the tables asked for are made on the survivor below; the others (a
            // table registered by an earlier call) move there unless it has them already.
            if spec.tables.contains(&s.table) || survivor_steps.iter().any(|k| k.filter_id == s.filter_id) {
                continue;
            }
            api.update(
                &format!("sdkmessageprocessingsteps({})", s.id),
                &json!({
                    "eventhandler_serviceendpoint@odata.bind": format!("/serviceendpoints({})", survivor.id)
                }),
            )
            .await?;
            moved.push(format!("{} {} ({})", s.table, s.message, s.id));
            survivor_steps.push(s);
        }
        // Gone already: the other run converging removed it.
        api.delete_if_there(&format!("serviceendpoints({})", loser.id))
            .await?;
        if !progress.duplicates.iter().any(|d| d.id == loser.id) {
            progress.duplicates.push(DuplicateReport {
                id: loser.id,
                created_on: loser.created_on.clone(),
                created_by_this_run: progress.created == Some(loser.id),
                kept: survivor.id,
                moved_steps: moved,
            });
        }
    }
    let endpoint = ensure_endpoint(api, spec, &survivor, progress.created == Some(survivor.id)).await?;
    progress.endpoint(endpoint);
    ensure_steps(api, spec, wanted, survivor.id, progress).await?;

    // Read back: one endpoint of ours with this name, one step per table and message asked for.
    let now = leaseholds(found_endpoints(api, Some(&spec.name)).await?);
    if now.len() == 1 && now[0].id == survivor.id {
        let steps = steps_of(api, survivor.id).await?;
        let single = wanted.iter().all(|w| {
            steps
                .iter()
                .filter(|s| s.filter_id.as_deref() == Some(w.filter_id.as_str()))
                .count()
                == 1
        });
        if single {
            return Ok(Round::Done(survivor.id, steps));
        }
    }
    Ok(Round::Again)
}

/// The endpoint's fields, key and description (with the marker) as asked: PATCH what differs.
async fn ensure_endpoint(
    api: &WebApi,
    spec: &RegisterSpec,
    current: &Found,
    created: bool,
) -> Result<EndpointReport> {
    let id = current.id;
    let fields = endpoint_fields(spec);
    let mut patch = serde_json::Map::new();
    let mut changes = Vec::new();
    for (field, want) in fields.as_object().expect("an object") {
        if current.raw.get(field) != Some(want) {
            patch.insert(field.clone(), want.clone());
            changes.push(field.clone());
        }
    }
    let description = str_field(&current.raw, "description");
    let key_set = current
        .raw
        .get("isauthvalueset")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let key_action = match spec.key.as_ref() {
        Some(key) if !key_set || description.and_then(fingerprint_in) != Some(key.fingerprint()) => {
            patch.insert("authvalue".into(), json!(key.0));
            changes.push("key".into());
            "set"
        }
        Some(_) if created => "set",
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
        if !current.is_leaseholds() {
            changes.push("adopted: marker written".into());
        } else if !changes.iter().any(|c| c == "key") {
            changes.push("description".into());
        }
    }
    let action = if patch.is_empty() {
        if created {
            Action::Created
        } else {
            Action::Unchanged
        }
    } else {
        api.update(&format!("serviceendpoints({id})"), &Value::Object(patch))
            .await?;
        if created { Action::Created } else { Action::Updated }
    };
    Ok(EndpointReport {
        id,
        name: spec.name.clone(),
        url: spec.start_url.to_string(),
        action,
        changes,
        key: key_action,
    })
}

/// The endpoint's steps for the tables asked for: exactly one per message asked for (the oldest
/// kept when there are several), each as asked and enabled; other messages' steps removed; other
/// tables' steps left alone.
async fn ensure_steps(
    api: &WebApi,
    spec: &RegisterSpec,
    wanted: &[Wanted],
    endpoint: Uuid,
    progress: &mut Progress,
) -> Result<()> {
    let endpoint_id = endpoint.to_string();
    let current_steps = steps_of(api, endpoint).await?;
    let mut used = BTreeSet::new();
    for w in wanted {
        let body = step_body(
            spec,
            &w.table,
            &w.message,
            &endpoint_id,
            &w.message_id,
            &w.filter_id,
        );
        // In survival order: the first is kept.
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
                    endpoint,
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
                // A disabled step sends nothing: enable it (SetState is a PATCH of statecode
                // and statuscode), and say so.
                if !current.enabled {
                    patch.insert("statecode".into(), json!(STATE_ENABLED));
                    patch.insert("statuscode".into(), json!(STATUS_ENABLED));
                    changes.push(STEP_WAS_DISABLED.into());
                }
                let action = if patch.is_empty() {
                    Action::Unchanged
                } else {
                    api.update(
                        &format!("sdkmessageprocessingsteps({})", current.id),
                        &Value::Object(patch),
                    )
                    .await
                    .with_context(|| {
                        if current.enabled {
                            format!("updating the step for {} of {}", w.message, w.table)
                        } else {
                            format!(
                                "the step for {} of {} ({}) is disabled and could not be enabled: enable it in the Plug-in Registration Tool or the maker portal, or give the identity Write on SDK Message Processing Step",
                                w.message, w.table, current.id
                            )
                        }
                    })?;
                    Action::Updated
                };
                StepReport {
                    id: current.id,
                    table: w.table.clone(),
                    message: w.message.clone(),
                    action,
                    changes,
                    filtering_attributes: attributes,
                    endpoint,
                }
            }
        };
        progress.step(report);
        // Duplicates of this step (two runs at once, a create retried by hand): the newer go.
        for extra in matching {
            used.insert(extra.id);
            api.delete_if_there(&format!("sdkmessageprocessingsteps({})", extra.id))
                .await?;
            progress.step(StepReport {
                id: extra.id,
                table: w.table.clone(),
                message: w.message.clone(),
                action: Action::Removed,
                changes: vec!["duplicate".into()],
                filtering_attributes: extra.filtering_attributes.clone(),
                endpoint,
            });
        }
    }
    // Steps for the named tables but messages no longer asked for: removed. Other tables: kept.
    progress.other_steps.clear();
    for s in current_steps.iter().filter(|s| !used.contains(&s.id)) {
        if spec.tables.contains(&s.table) {
            api.delete_if_there(&format!("sdkmessageprocessingsteps({})", s.id))
                .await?;
            progress.step(StepReport {
                id: s.id,
                table: s.table.clone(),
                message: s.message.clone(),
                action: Action::Removed,
                changes: vec!["message not asked for".into()],
                filtering_attributes: s.filtering_attributes.clone(),
                endpoint,
            });
        } else {
            progress.other_steps.push(s.clone());
        }
    }
    Ok(())
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
            "create the endpoint (its description carries the marker line that makes it Leasehold's), then GET the endpoints of this name again: if another register created one at the same time, the oldest is kept and the others deleted. When it exists: PATCH serviceendpoints(<id>) with only what differs (authvalue when the key's fingerprint differs), then GET its steps; an endpoint of this name without the marker is refused (--adopt takes it over)".into(),
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
    for d in &r.duplicates_removed {
        let _ = write!(
            out,
            "duplicate endpoint {} ({}, created {}): removed, {} kept (the oldest){}",
            e.name,
            d.id,
            d.created_on.as_deref().unwrap_or("at an unknown time"),
            d.kept,
            if d.created_by_this_run {
                "; this run created it while another register created the one kept"
            } else {
                ""
            }
        );
        if !d.moved_steps.is_empty() {
            let _ = write!(
                out,
                "; its steps for other tables moved to the one kept: {}",
                d.moved_steps.join(", ")
            );
        }
        out.push('\n');
    }
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
    let ours = r.endpoints.iter().filter(|e| e.managed_by_leasehold).count();
    let mut out = format!(
        "{} webhook endpoint(s) named {NAME_PREFIX}… in {}, {ours} of them Leasehold's:\n",
        r.endpoints.len(),
        r.environment_url
    );
    for e in &r.endpoints {
        let _ = writeln!(out, "\n{} ({})", e.name, e.id);
        if !e.managed_by_leasehold {
            let _ = writeln!(
                out,
                "  NOT LEASEHOLD'S: {}; created {} by {}. register and unregister leave it alone (register --adopt takes it over, unregister --force deletes it)",
                e.whose,
                e.created_on.as_deref().unwrap_or("(date not given)"),
                e.created_by.as_deref().unwrap_or("(creator not given)")
            );
        }
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

fn text_left_alone(out: &mut String, left_alone: &[EndpointView]) {
    for e in left_alone {
        let _ = writeln!(
            out,
            "left alone: endpoint {} ({}), url {}: not Leasehold's ({}); to delete it anyway: --name {} --force",
            e.name, e.id, e.url, e.whose, e.name
        );
    }
}

/// Text for people: what `unregister` is about to delete, before it asks.
pub fn text_unregister_plan(p: &UnregisterPlan) -> String {
    let mut out = String::new();
    if p.endpoints.is_empty() {
        let _ = writeln!(
            out,
            "nothing to remove: no Leasehold webhook endpoint (one carrying the marker `register` writes) in {}",
            p.environment_url
        );
    } else {
        let _ = writeln!(out, "unregister deletes from {}:", p.environment_url);
        for e in &p.endpoints {
            let _ = writeln!(
                out,
                "  endpoint {} ({}), url {}{}",
                e.name,
                e.id,
                e.url,
                if e.managed_by_leasehold {
                    String::new()
                } else {
                    format!(" (NOT Leasehold's, --force: {})", e.whose)
                }
            );
            for s in &e.steps {
                let _ = writeln!(out, "    and its step {} ({})", s.name, s.id);
            }
            if e.steps.is_empty() {
                let _ = writeln!(out, "    (it has no steps)");
            }
        }
        out.push_str("  (Dataverse deletes an endpoint's steps with it)\n");
    }
    text_left_alone(&mut out, &p.left_alone);
    out.trim_end().to_owned()
}

/// Text for people: `unregister`.
pub fn text_unregister(r: &UnregisterReport) -> String {
    let mut out = String::new();
    if r.removed.is_empty() {
        let _ = writeln!(
            out,
            "nothing to remove: no such Leasehold webhook endpoint in {}",
            r.environment_url
        );
    }
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
    text_left_alone(&mut out, &r.left_alone);
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

    /// `--priority low`: a second endpoint, named `…-low`, whose URL asks Start for the low lane;
    /// the steps point at it like any. A URL that names a priority already is refused.
    #[test]
    fn a_low_lane_registration_is_an_endpoint_of_its_own_asking_for_the_low_lane() {
        let low = spec(Some("key-a")).for_low_lane(false).unwrap();
        assert_eq!(low.name, "leasehold-func-leaseholddev.azurewebsites.net-low");
        assert_eq!(
            low.start_url.as_str(),
            "https://func-leaseholddev.azurewebsites.net/api/start?priority=low"
        );
        let plan = plan_register(&low).unwrap();
        let text = serde_json::to_string(&plan).unwrap();
        assert!(text.contains("/api/start?priority=low"), "{text}");
        assert!(!text.contains("key-a"), "the key never shows");
        // A name given stays.
        let named = RegisterSpec {
            name: "leasehold-bulk".into(),
            ..spec(None)
        }
        .for_low_lane(true)
        .unwrap();
        assert_eq!(named.name, "leasehold-bulk");
        let e = RegisterSpec::new(
            "https://contoso.crm.dynamics.com",
            "https://x.azurewebsites.net/api/start?priority=high",
            None,
            &["account".into()],
            &["Create".into()],
            &[],
            None,
        )
        .unwrap()
        .for_low_lane(false)
        .unwrap_err()
        .to_string();
        assert!(e.contains("priority already"), "{e}");
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
    fn the_marker_decides_whose_an_endpoint_is() {
        let s = spec(Some("key-a"));
        let written = s.description(Some(&StartKey("key-a".into())), None);
        // What register writes is Leasehold's, and keeps the fingerprint.
        assert_eq!(Whose::of(&s.name, &written), Whose::Leasehold);
        assert_eq!(
            Whose::of(&s.name.to_ascii_uppercase(), &written),
            Whose::Leasehold
        );
        assert_eq!(
            fingerprint_in(&written),
            Some(StartKey("key-a".into()).fingerprint())
        );
        assert_eq!(marker_in(&written), Some(s.name.as_str()));
        // The same description on another name: a copy or rename.
        assert_eq!(
            Whose::of("leasehold-other", &written),
            Whose::CopyOf(s.name.clone())
        );
        // What earlier versions wrote: recognised, not Leasehold's.
        assert_eq!(
            Whose::of(
                &s.name,
                "Leasehold's Start webhook, managed by `leasehold dataverse register`; key fingerprint sha256:0123456789abcdef"
            ),
            Whose::EarlierLeasehold
        );
        // A name starting with leasehold is nothing; a marker mentioned mid-line is nothing.
        for other in [
            "",
            "Sync to the property ledger",
            "leasehold",
            "see [leasehold-managed endpoint=leasehold-x] in the docs",
            "[leasehold-managed endpoint=leasehold-x",
        ] {
            assert_eq!(Whose::of("leasehold-x", other), Whose::Other, "{other:?}");
        }
        // Adopting an earlier one keeps its fingerprint when no key is given.
        let adopted = s.description(None, Some("Leasehold's Start webhook, managed by `leasehold dataverse register`; key fingerprint sha256:0123456789abcdef"));
        assert_eq!(fingerprint_in(&adopted).as_deref(), Some("0123456789abcdef"));
        assert_eq!(Whose::of(&s.name, &adopted), Whose::Leasehold);
    }

    #[test]
    fn urls_are_shown_without_their_query_values() {
        assert_eq!(shown_url("https://x.example/hook"), "https://x.example/hook");
        assert_eq!(
            shown_url("https://x.example/hook?code=s3cret&tenant=a"),
            "https://x.example/hook?code=<redacted>&tenant=<redacted>"
        );
    }

    #[test]
    fn the_oldest_survives_ties_by_the_smallest_id_and_no_date_comes_last() {
        let small = Uuid::from_u128(1);
        let big = Uuid::from_u128(2);
        let mut v = [
            survival_order(None, small),
            survival_order(Some("2026-11-23T09:00:01Z"), small),
            survival_order(Some("2026-11-23T09:00:00Z"), big),
            survival_order(Some("2026-11-23T09:00:00Z"), small),
        ];
        v.sort();
        assert_eq!(
            v.iter()
                .map(|(none, at, id)| (*none, at.as_str(), id.as_u128()))
                .collect::<Vec<_>>(),
            [
                (false, "2026-11-23T09:00:00Z", 1),
                (false, "2026-11-23T09:00:00Z", 2),
                (false, "2026-11-23T09:00:01Z", 1),
                (true, "", 1),
            ]
        );
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
