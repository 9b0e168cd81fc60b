//! Azure Table storage, for run history every instance shares: tables created, listed and
//! dropped whole (one per period), entities inserted one by one and read back a partition (a
//! record) at a time.
//!
//! There is no official Rust crate for the Table service (azure-sdk-for-rust#4304), so this speaks
//! its REST API directly, through the same path as every other storage request: an `azure_core`
//! pipeline on the runtime's HTTP client ([`crate::azure::client_options_for`]), each round trip
//! counted, bounded in time and classified by [`crate::azure::send`] (ops
//! [`Op::HistoryWrite`], [`Op::HistoryRead`] and [`Op::HistoryTable`]). Shared Key requests are
//! signed as the Table service wants (`auth.rs`); a SAS and an Entra ID token work as for blobs.
//!
//! Entities are JSON objects ([`Entity`]) sent and read with `odata=nometadata`: a property's
//! value comes back as the JSON the service keeps, without its type. Strings, booleans, 32-bit
//! integers and doubles round-trip as they are; an `Edm.Int64` or `Edm.DateTime` must be written
//! as a string with its type beside it (`"At": "2026-11-22T17:00:00Z",
//! "At@odata.type": "Edm.DateTime"`) and is read back as a string.

use std::time::Duration;

use azure_core::error::ErrorKind as AzureErrorKind;
use azure_core::http::headers::HeaderName;
use azure_core::http::policies::Policy;
use azure_core::http::policies::auth::BearerTokenAuthorizationPolicy;
use azure_core::http::{Context, Method, Pipeline, PipelineSendOptions, RawResponse, Request, Url};
use serde_json::Value;
use std::sync::Arc;

use crate::account::{Service, StorageAccount};
use crate::azure::{DEFAULT_REQUEST_TIMEOUT, client_options_for, send};
use crate::counters::{Op, OpCounters};
use crate::error::{StoreError, StoreErrorKind, StoreResult};

/// One entity: its properties by name, `PartitionKey` and `RowKey` among them (strings).
pub type Entity = serde_json::Map<String, Value>;

/// The Table service version requests name (`x-ms-version`): the newest the Table service
/// documents; Azure accepts it, and so does Azurite.
pub const TABLE_SERVICE_VERSION: &str = "2019-02-02";

/// The most entities one query answers; a larger `top` is lowered to it.
pub const MAX_PAGE: u32 = 1000;

/// Error code: the table does not exist (404). An insert that gets it may create the table and
/// try again.
pub const TABLE_NOT_FOUND: &str = "TableNotFound";
/// Error code: a table of that name exists (409).
pub const TABLE_ALREADY_EXISTS: &str = "TableAlreadyExists";
/// Error code: an entity with that `PartitionKey` and `RowKey` exists (409).
pub const ENTITY_ALREADY_EXISTS: &str = "EntityAlreadyExists";

const JSON_NO_METADATA: &str = "application/json;odata=nometadata";

/// Where the next page of a query starts: the service's continuation, handed back as it gave
/// it. A page may be short, or even empty, and still have one (the service stops at partition
/// boundaries and after five seconds): a caller reads on until there is none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Continuation {
    pub next_partition_key: String,
    pub next_row_key: Option<String>,
}

/// The Table service of one storage account.
#[derive(Clone)]
pub struct TableClient {
    pipeline: Pipeline,
    endpoint: Url,
    counters: OpCounters,
    request_timeout: Duration,
}

impl std::fmt::Debug for TableClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TableClient")
            .field("endpoint", &self.endpoint.as_str())
            .finish()
    }
}

/// Storage settings without a Table endpoint ([`TableClient::new`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "no Table endpoint: the storage settings give Blob or Queue endpoints but no TableEndpoint \
     (AzureWebJobsStorage__tableServiceUri with an identity), and one is never derived beside them"
)]
pub struct NoTableEndpoint;

impl TableClient {
    /// The Table service of `account`, recording round trips into `counters`.
    ///
    /// An identity-based account authorises with a bearer token for Azure Storage; its endpoints
    /// are https by construction ([`StorageAccount::from_identity_settings`] refuses others), so
    /// a token is never sent in the clear.
    ///
    /// An account without a Table endpoint (Blob or Queue endpoints given but no Table one: it
    /// is never derived beside them) has no Table service here: [`NoTableEndpoint`].
    pub fn new(account: &StorageAccount, counters: OpCounters) -> Result<Self, NoTableEndpoint> {
        if !account.has_table_endpoint() {
            return Err(NoTableEndpoint);
        }
        let per_try: Vec<Arc<dyn Policy>> = account
            .token_credential()
            .map(|credential| {
                Arc::new(BearerTokenAuthorizationPolicy::new(
                    credential,
                    vec!["https://storage.azure.com/.default"],
                )) as Arc<dyn Policy>
            })
            .into_iter()
            .collect();
        let pipeline = Pipeline::new(
            option_env!("CARGO_PKG_NAME"),
            option_env!("CARGO_PKG_VERSION"),
            client_options_for(account, Service::Table),
            Vec::new(),
            per_try,
            None,
        );
        Ok(Self {
            pipeline,
            endpoint: account.url(Service::Table, ""),
            counters,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
        })
    }

    /// Sets the per-request time limit.
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    pub fn counters(&self) -> &OpCounters {
        &self.counters
    }

    /// Creates the table `name`: `true` if this call created it, `false` if it existed.
    ///
    /// On Azure a table just deleted cannot be created again for a while (about 40 s): that
    /// answer (409 `TableBeingDeleted`) is transient.
    pub async fn create_table(&self, name: &str) -> StoreResult<bool> {
        let op = Op::HistoryTable;
        check_table_name(name, op)?;
        let mut request = self.request(Method::Post, "Tables", &[]);
        set_json(&mut request, &serde_json::json!({ "TableName": name }));
        match self.call(op, request).await {
            Ok(_) => Ok(true),
            Err(e) if e.code() == Some(TABLE_ALREADY_EXISTS) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Deletes the table `name` and every entity in it: `true` if it existed, `false` if not.
    pub async fn delete_table(&self, name: &str) -> StoreResult<bool> {
        let op = Op::HistoryTable;
        check_table_name(name, op)?;
        let request = self.request(Method::Delete, &format!("Tables('{name}')"), &[]);
        match self.call(op, request).await {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == StoreErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The names of the tables that start with `prefix` (all of them for an empty prefix), in
    /// the service's order (by name): one request a page of up to 1,000 names.
    pub async fn list_tables(&self, prefix: &str) -> StoreResult<Vec<String>> {
        let op = Op::HistoryTable;
        // Table names are letters and digits, all below `{`: `prefix{` bounds every name that
        // starts with `prefix`.
        let filter = format!(
            "TableName ge {} and TableName lt {}",
            odata_literal(prefix),
            odata_literal(&format!("{prefix}{{"))
        );
        let mut names = Vec::new();
        let mut next: Option<String> = None;
        loop {
            let mut query: Vec<(&str, &str)> = Vec::new();
            if !prefix.is_empty() {
                query.push(("$filter", &filter));
            }
            if let Some(next) = &next {
                query.push(("NextTableName", next));
            }
            let request = self.request(Method::Get, "Tables", &query);
            let response = self.call(op, request).await?;
            for table in page_values(op, &response)? {
                if let Some(name) = table.get("TableName").and_then(Value::as_str) {
                    names.push(name.to_string());
                }
            }
            next = header(&response, "x-ms-continuation-nexttablename");
            if next.is_none() {
                return Ok(names);
            }
        }
    }

    /// Inserts `entity` into `table` (one request, nothing sent back). `entity` must hold a
    /// `PartitionKey` and a `RowKey`, strings that are valid keys (see [`escape_key`]); either
    /// missing or invalid is refused here, before anything is sent.
    ///
    /// A table that does not exist answers [`StoreErrorKind::NotFound`] with the code
    /// [`TABLE_NOT_FOUND`] (the caller may create it and try again); an entity with the same keys
    /// answers code [`ENTITY_ALREADY_EXISTS`].
    pub async fn insert_entity(&self, table: &str, entity: &Entity) -> StoreResult<()> {
        let op = Op::HistoryWrite;
        check_table_name(table, op)?;
        for key in ["PartitionKey", "RowKey"] {
            match entity.get(key).and_then(Value::as_str) {
                Some(value) => check_key(key, value, op)?,
                None => {
                    return Err(StoreError::new(
                        StoreErrorKind::Rejected,
                        op,
                        format!("the entity has no {key} (a string)"),
                    ));
                }
            }
        }
        let mut request = self.request(Method::Post, table, &[]);
        set_json(&mut request, &Value::Object(entity.clone()));
        self.call(op, request).await.map(drop)
    }

    /// Inserts `entities` (at most [`MAX_BATCH`], all of one partition) in one request, an
    /// entity group transaction: all of them or none. Errors as [`insert_entity`]'s, from the
    /// operation that failed ([`TABLE_NOT_FOUND`] when the table does not exist).
    ///
    /// [`insert_entity`]: Self::insert_entity
    pub async fn insert_batch(&self, table: &str, entities: &[Entity]) -> StoreResult<()> {
        let op = Op::HistoryWrite;
        check_table_name(table, op)?;
        let rejected = |why: String| StoreError::new(StoreErrorKind::Rejected, op, why);
        if entities.is_empty() || entities.len() > MAX_BATCH {
            return Err(rejected(format!(
                "a batch holds 1 to {MAX_BATCH} entities, not {}",
                entities.len()
            )));
        }
        let mut partition = None;
        for entity in entities {
            for key in ["PartitionKey", "RowKey"] {
                match entity.get(key).and_then(Value::as_str) {
                    Some(value) => check_key(key, value, op)?,
                    None => return Err(rejected(format!("the entity has no {key} (a string)"))),
                }
            }
            let pk = entity.get("PartitionKey").and_then(Value::as_str);
            if *partition.get_or_insert(pk) != pk {
                return Err(rejected("a batch's entities are all of one partition".into()));
            }
        }
        let id = uuid::Uuid::new_v4().simple().to_string();
        let (batch, changeset) = (format!("batch_{id}"), format!("changeset_{id}"));
        let mut target = self.endpoint.clone();
        target
            .path_segments_mut()
            .expect("storage endpoints are base URLs")
            .pop_if_empty()
            .push(table);
        let mut body = format!("--{batch}\r\nContent-Type: multipart/mixed; boundary={changeset}\r\n\r\n");
        for entity in entities {
            body.push_str(&format!(
                "--{changeset}\r\nContent-Type: application/http\r\nContent-Transfer-Encoding: binary\r\n\r\n\
                 POST {target} HTTP/1.1\r\nContent-Type: application/json\r\nAccept: {JSON_NO_METADATA}\r\n\
                 Prefer: return-no-content\r\nDataServiceVersion: 3.0\r\n\r\n{}\r\n",
                Value::Object(entity.clone())
            ));
        }
        body.push_str(&format!("--{changeset}--\r\n\r\n--{batch}--\r\n"));
        let mut request = self.request(Method::Post, "$batch", &[]);
        request.insert_header("content-type", format!("multipart/mixed; boundary={batch}"));
        request.set_body(body.into_bytes());
        let response = self.call(op, request).await?;
        batch_failure(op, response.body().as_ref()).map_or(Ok(()), Err)
    }

    /// One page of the entities of `table` in the partition `partition_key`, in `RowKey` order
    /// (ascending: with inverted timestamps as row keys, newest first): up to `top` entities
    /// (at most [`MAX_PAGE`]; `None` for the service's page), from `continuation` (the previous
    /// page's). A missing table answers [`StoreErrorKind::NotFound`] ([`TABLE_NOT_FOUND`]).
    pub async fn query_partition(
        &self,
        table: &str,
        partition_key: &str,
        top: Option<u32>,
        continuation: Option<&Continuation>,
    ) -> StoreResult<(Vec<Entity>, Option<Continuation>)> {
        let filter = format!("PartitionKey eq {}", odata_literal(partition_key));
        self.query(table, Some(&filter), top, continuation).await
    }

    /// One page of the entities of `table` that match `filter` (an OData filter expression, as
    /// the service takes it; quote string values with [`odata_literal`]), in key order; `None`
    /// for every entity. See [`Self::query_partition`] for `top` and `continuation`.
    pub async fn query(
        &self,
        table: &str,
        filter: Option<&str>,
        top: Option<u32>,
        continuation: Option<&Continuation>,
    ) -> StoreResult<(Vec<Entity>, Option<Continuation>)> {
        let op = Op::HistoryRead;
        check_table_name(table, op)?;
        let top = top.map(|n| n.clamp(1, MAX_PAGE).to_string());
        let mut query: Vec<(&str, &str)> = Vec::new();
        if let Some(filter) = filter {
            query.push(("$filter", filter));
        }
        if let Some(top) = &top {
            query.push(("$top", top));
        }
        if let Some(next) = continuation {
            query.push(("NextPartitionKey", &next.next_partition_key));
            if let Some(row) = &next.next_row_key {
                query.push(("NextRowKey", row));
            }
        }
        let request = self.request(Method::Get, &format!("{table}()"), &query);
        let response = self.call(op, request).await?;
        let entities = page_values(op, &response)?;
        let next = header(&response, "x-ms-continuation-nextpartitionkey").map(|partition| Continuation {
            next_partition_key: partition,
            next_row_key: header(&response, "x-ms-continuation-nextrowkey"),
        });
        Ok((entities, next))
    }

    /// A request to `path` under the endpoint with the Table service's headers, asking for JSON
    /// without metadata. Query values are percent-encoded here (a space as `%20`, not `+`).
    fn request(&self, method: Method, path: &str, query: &[(&str, &str)]) -> Request {
        let mut url = self.endpoint.clone();
        url.path_segments_mut()
            .expect("storage endpoints are base URLs")
            .pop_if_empty()
            .push(path);
        if !query.is_empty() {
            url.set_query(Some(&encode_query(query)));
        }
        let mut request = Request::new(url, method);
        request.insert_header("x-ms-version", TABLE_SERVICE_VERSION);
        request.insert_header("dataserviceversion", "3.0");
        request.insert_header("maxdataserviceversion", "3.0;NetFx");
        request.insert_header("accept", JSON_NO_METADATA);
        request
    }

    /// Sends one request through [`send`]: counted as `op`, bounded by the request timeout, and
    /// any answer but a 2xx made a classified [`StoreError`] with the service's error code.
    async fn call(&self, op: Op, mut request: Request) -> StoreResult<RawResponse> {
        let pipeline = &self.pipeline;
        send(&self.counters, op, self.request_timeout, async move {
            let options = PipelineSendOptions {
                skip_checks: true,
                ..Default::default()
            };
            let response = pipeline
                .send(&Context::new(), &mut request, Some(options))
                .await?;
            if response.status().is_success() {
                Ok(response)
            } else {
                Err(http_error(response))
            }
        })
        .await
    }
}

/// The most entities one [`TableClient::insert_batch`] takes (the service's limit).
pub const MAX_BATCH: usize = 100;

/// The failure inside a batch's answer, if any: the service answers a batch 202 whatever
/// becomes of it, and a failed transaction as one part with the failing operation's status and
/// error body.
fn batch_failure(op: Op, body: &[u8]) -> Option<StoreError> {
    let text = String::from_utf8_lossy(body);
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        let Some(rest) = line.strip_prefix("HTTP/1.1 ") else {
            continue;
        };
        let status: u16 = rest.split(' ').next()?.parse().ok()?;
        if status < 300 {
            continue;
        }
        // The part's body: the first line that is JSON after its headers.
        let error = lines
            .by_ref()
            .find(|l| l.trim_start().starts_with('{'))
            .and_then(|l| odata_error(l.trim().as_bytes()));
        let (code, message) = error.unwrap_or_default();
        let code = (!code.is_empty()).then_some(code);
        let kind = crate::azure::classify(status, code.as_deref());
        return Some(StoreError::new(kind, op, message).with_status(status, code));
    }
    None
}

/// Sets a JSON body (and its type) on a write that wants nothing back.
fn set_json(request: &mut Request, body: &Value) {
    request.insert_header("content-type", "application/json");
    request.insert_header("prefer", "return-no-content");
    request.set_body(serde_json::to_vec(body).expect("a JSON value serialises"));
}

/// A non-2xx answer as the SDK's HTTP error, for [`send`] to classify: the error code from
/// `x-ms-error-code`, else from the JSON body (the Table service's `odata.error.code`).
fn http_error(response: RawResponse) -> azure_core::Error {
    let status = response.status();
    let code = header(&response, "x-ms-error-code")
        .or_else(|| odata_error(response.body().as_ref()).map(|(code, _)| code))
        .filter(|c| !c.is_empty());
    azure_core::Error::with_message(
        AzureErrorKind::HttpResponse {
            status,
            error_code: code,
            raw_response: Some(Box::new(response)),
        },
        format!("HTTP {}", u16::from(status)),
    )
}

/// The code and message of a Table service error body:
/// `{"odata.error":{"code":"TableNotFound","message":{"lang":"en-US","value":"..."}}}` (or the
/// same under `error`, with the message as a plain string).
pub(crate) fn odata_error(body: &[u8]) -> Option<(String, String)> {
    let value: Value = serde_json::from_slice(body).ok()?;
    let error = value.get("odata.error").or_else(|| value.get("error"))?;
    let code = error.get("code").and_then(Value::as_str).unwrap_or_default();
    let message = match error.get("message") {
        Some(Value::String(text)) => text.as_str(),
        Some(message) => message.get("value").and_then(Value::as_str).unwrap_or_default(),
        None => "",
    };
    Some((code.to_string(), message.to_string()))
}

fn header(response: &RawResponse, name: &'static str) -> Option<String> {
    response
        .headers()
        .get_optional_str(&HeaderName::from_static(name))
        .map(str::to_string)
        .filter(|v| !v.is_empty())
}

/// The `value` array of a query's answer.
fn page_values(op: Op, response: &RawResponse) -> StoreResult<Vec<Entity>> {
    let unreadable = |what: &str| {
        StoreError::new(
            StoreErrorKind::Transient,
            op,
            format!("unreadable answer: {what}"),
        )
    };
    let mut body: Value =
        serde_json::from_slice(response.body().as_ref()).map_err(|_| unreadable("not JSON"))?;
    let Some(Value::Array(values)) = body.get_mut("value").map(Value::take) else {
        return Err(unreadable("no value array"));
    };
    values
        .into_iter()
        .map(|v| match v {
            Value::Object(entity) => Ok(entity),
            _ => Err(unreadable("an entity that is not an object")),
        })
        .collect()
}

/// `name=value&...` with each value percent-encoded (a space as `%20`: `+` is a literal in a
/// query the service reads). Names are written as they are (`$filter`, `NextRowKey`).
fn encode_query(query: &[(&str, &str)]) -> String {
    query
        .iter()
        .map(|(name, value)| {
            // `byte_serialize` writes a space as `+` and a `+` as `%2B`, so every `+` it writes
            // is a space.
            let value: String = url::form_urlencoded::byte_serialize(value.as_bytes()).collect();
            format!("{name}={}", value.replace('+', "%20"))
        })
        .collect::<Vec<_>>()
        .join("&")
}

/// `text` as an OData string literal: in single quotes, a quote in it doubled
/// (`it's` → `'it''s'`). The literal is percent-encoded with the rest of the query when sent.
pub fn odata_literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// Whether `name` is a valid table name: 3 to 63 letters and digits, starting with a letter
/// (and not `tables`, which the service reserves).
pub fn is_valid_table_name(name: &str) -> bool {
    (3..=63).contains(&name.len())
        && name.starts_with(|c: char| c.is_ascii_alphabetic())
        && name.chars().all(|c| c.is_ascii_alphanumeric())
        && !name.eq_ignore_ascii_case("tables")
}

fn check_table_name(name: &str, op: Op) -> StoreResult<()> {
    if is_valid_table_name(name) {
        return Ok(());
    }
    Err(StoreError::new(
        StoreErrorKind::Rejected,
        op,
        format!(
            "{name:?} is not a valid table name: 3 to 63 letters and digits, starting with a letter \
             (and not \"tables\")"
        ),
    ))
}

/// Whether `c` may not appear in a `PartitionKey` or `RowKey`: `/`, `\`, `#`, `?` and the control
/// characters (U+0000 to U+001F and U+007F to U+009F), which the service refuses.
fn forbidden_in_key(c: char) -> bool {
    matches!(c, '/' | '\\' | '#' | '?') || c.is_control()
}

fn check_key(which: &str, key: &str, op: Op) -> StoreResult<()> {
    // Keys are at most 1 KiB; the service counts UTF-16 code units of two bytes.
    if key.encode_utf16().count() > 512 {
        return Err(StoreError::new(
            StoreErrorKind::Rejected,
            op,
            format!("the {which} is longer than the service's 1 KiB"),
        ));
    }
    if key.chars().any(forbidden_in_key) {
        return Err(StoreError::new(
            StoreErrorKind::Rejected,
            op,
            format!(
                "the {which} holds a character keys may not (/ \\ # ? or a control character): escape it with escape_key"
            ),
        ));
    }
    Ok(())
}

/// `text` as a valid `PartitionKey` or `RowKey`, one to one: each character keys may not hold
/// (`/`, `\`, `#`, `?`, control characters) and `%` itself become `%XX`, per UTF-8 byte, upper-case
/// hex; everything else is kept. Different texts give different keys ([`unescape_key`] gives
/// the text back), and a text with none of those characters is its own key.
pub fn escape_key(text: &str) -> String {
    let mut key = String::with_capacity(text.len());
    for c in text.chars() {
        if c == '%' || forbidden_in_key(c) {
            let mut bytes = [0u8; 4];
            for b in c.encode_utf8(&mut bytes).bytes() {
                key.push_str(&format!("%{b:02X}"));
            }
        } else {
            key.push(c);
        }
    }
    key
}

/// The text [`escape_key`] made `key` from; `None` if `key` is not something it makes.
pub fn unescape_key(key: &str) -> Option<String> {
    let mut bytes = Vec::with_capacity(key.len());
    let mut rest = key.as_bytes();
    while let Some((&b, tail)) = rest.split_first() {
        if b == b'%' {
            let hex = std::str::from_utf8(tail.get(..2)?).ok()?;
            if hex.chars().any(|c| c.is_ascii_lowercase()) {
                return None;
            }
            bytes.push(u8::from_str_radix(hex, 16).ok()?);
            rest = &tail[2..];
        } else {
            bytes.push(b);
            rest = tail;
        }
    }
    let text = String::from_utf8(bytes).ok()?;
    (escape_key(&text) == key).then_some(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_escaped_one_to_one() {
        for text in [
            "",
            "plain-key_1.2",
            "contact/42",
            "a\\b#c?d",
            "it's 100% done",
            "%2F",
            "tab\there\u{7f}\u{85}",
            "ünïcödé ✓",
        ] {
            let key = escape_key(text);
            assert!(!key.chars().any(forbidden_in_key), "{text:?} gave {key:?}");
            assert_eq!(unescape_key(&key).as_deref(), Some(text), "{key:?}");
        }
        assert_eq!(escape_key("contact/42"), "contact%2F42");
        assert_eq!(escape_key("%2F"), "%252F");
        assert_eq!(escape_key("\u{85}"), "%C2%85");
        assert_eq!(escape_key("it's"), "it's", "quotes are valid in keys");
        assert_ne!(escape_key("a/b"), escape_key("a%2Fb"));
        for not_made in ["%", "%2", "%zz", "%2f", "a/b", "%41"] {
            assert_eq!(unescape_key(not_made), None, "{not_made:?}");
        }
    }

    #[test]
    fn table_names_are_checked_before_anything_is_sent() {
        for good in ["abc", "Runs202611", &"a".repeat(63)] {
            assert!(is_valid_table_name(good), "{good}");
        }
        for bad in [
            "ab",
            "1runs",
            "run-s",
            "runs_1",
            &"a".repeat(64),
            "Tables",
            "",
            "rüns",
        ] {
            assert!(!is_valid_table_name(bad), "{bad}");
        }
        let e = check_table_name("run-s", Op::HistoryTable).unwrap_err();
        assert_eq!(e.kind(), StoreErrorKind::Rejected);
        assert!(e.to_string().contains("not a valid table name"), "{e}");
    }

    #[test]
    fn keys_with_forbidden_characters_are_refused_by_name() {
        let e = check_key("PartitionKey", "a/b", Op::HistoryWrite).unwrap_err();
        assert!(e.to_string().contains("escape_key"), "{e}");
        assert!(check_key("RowKey", "it's fine", Op::HistoryWrite).is_ok());
        assert!(check_key("RowKey", &"k".repeat(513), Op::HistoryWrite).is_err());
    }

    #[test]
    fn filters_are_quoted_and_percent_encoded() {
        assert_eq!(odata_literal("it's"), "'it''s'");
        assert_eq!(
            encode_query(&[
                ("$filter", "PartitionKey eq 'a+b''c&d'"),
                ("$top", "5"),
                ("NextRowKey", "1!8!cGFydA--")
            ]),
            "$filter=PartitionKey%20eq%20%27a%2Bb%27%27c%26d%27&$top=5&NextRowKey=1%218%21cGFydA--"
        );
    }

    #[test]
    fn table_errors_give_their_code_and_message() {
        let body = br#"{"odata.error":{"code":"EntityAlreadyExists","message":{"lang":"en-US","value":"The specified entity already exists.\nRequestId:1"}}}"#;
        let (code, message) = odata_error(body).unwrap();
        assert_eq!(code, "EntityAlreadyExists");
        assert!(message.starts_with("The specified entity already exists."));
        assert_eq!(
            odata_error(br#"{"error":{"code":"X","message":"plain"}}"#),
            Some(("X".into(), "plain".into()))
        );
        assert_eq!(odata_error(b"<Error/>"), None);
    }
}
