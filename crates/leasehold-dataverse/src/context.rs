//! Dataverse (Dynamics 365) webhook bodies: the JSON serialisation of a RemoteExecutionContext.
//!
//! The record is `PrimaryEntityName` / `PrimaryEntityId`; in some Create stages the id is the
//! empty GUID, and then it is `InputParameters["Target"].Id` or `OutputParameters["id"]`.
//! Collections are WCF-style lists of `{"key": ..., "value": ...}`. When the context is over
//! 256 KB, Dataverse drops `InputParameters`, `ParentContext` and the images and sets the
//! `x-ms-dynamics-msg-size-exceeded` header; the primary name and id remain, which is all we need.

use serde_json::{Map, Value};
use uuid::Uuid;

use leasehold_runtime::{InvalidName, RecordId, Scope};

/// Why a Dataverse context names no record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NoRecord {
    #[error("PrimaryEntityName is missing")]
    NoEntityName,
    #[error("PrimaryEntityName: {0}")]
    InvalidEntityName(InvalidName),
    #[error(
        "no record id: PrimaryEntityId is missing or empty and neither Target.Id nor OutputParameters[id] is set"
    )]
    NoRecordId,
}

/// Whether a JSON object is a RemoteExecutionContext (rather than a plain `{recordId}` body).
pub fn looks_like_context(object: &Map<String, Value>) -> bool {
    object.contains_key("PrimaryEntityId")
        || object.contains_key("PrimaryEntityName")
        || object.contains_key("MessageName")
}

/// Looks up `key` in a WCF key/value list (or a plain JSON object, which some tools send).
pub fn lookup<'a>(collection: Option<&'a Value>, key: &str) -> Option<&'a Value> {
    match collection? {
        Value::Array(items) => items
            .iter()
            .find(|kv| {
                kv.get("key")
                    .and_then(Value::as_str)
                    .is_some_and(|k| k.eq_ignore_ascii_case(key))
            })
            .and_then(|kv| kv.get("value")),
        Value::Object(map) => map
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(key))
            .map(|(_, v)| v),
        _ => None,
    }
}

/// A GUID value (braces allowed), unless it is the empty GUID.
pub fn guid_of(value: Option<&Value>) -> Option<Uuid> {
    let text = value?.as_str()?;
    let text = text.trim().trim_start_matches('{').trim_end_matches('}');
    Uuid::try_parse(text).ok().filter(|g| !g.is_nil())
}

/// The record a context is about: (scope, record id), or why it names none.
pub fn record_of(context: &Value) -> Result<(Scope, RecordId), NoRecord> {
    let name = context.get("PrimaryEntityName").and_then(Value::as_str);
    let target = lookup(context.get("InputParameters"), "Target");
    let name = name
        .filter(|n| !n.trim().is_empty() && *n != "none")
        .or_else(|| target.and_then(|t| t.get("LogicalName")).and_then(Value::as_str))
        .ok_or(NoRecord::NoEntityName)?;
    let scope = Scope::parse(name).map_err(NoRecord::InvalidEntityName)?;
    let id = guid_of(context.get("PrimaryEntityId"))
        .or_else(|| guid_of(target.and_then(|t| t.get("Id"))))
        .or_else(|| guid_of(lookup(context.get("OutputParameters"), "id")))
        .ok_or(NoRecord::NoRecordId)?;
    let id = RecordId::from_guid(id).expect("guid_of never yields the empty GUID");
    Ok((scope, id))
}
