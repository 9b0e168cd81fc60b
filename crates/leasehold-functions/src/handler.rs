//! The Azure Functions custom-handler protocol, as the host speaks it.
//!
//! The host `POST`s `/<FunctionName>` with `{"Data": {<binding>: value}, "Metadata": {...}}` and
//! expects `{"Outputs": {<binding>: value}, "Logs": [...], "ReturnValue": ...}`. Binding names
//! here must match the `function.json` files in `Start/` and `Worker/`:
//!
//! | function | trigger | outputs |
//! | --- | --- | --- |
//! | `Start` | `req` (httpTrigger) | `res` (http), `message` (queue, the high lane) or `messageLow` (the low lane's queue) |
//! | `Worker` | `trigger` (queueTrigger on the high lane) | none |
//! | `WorkerLow` | `trigger` (queueTrigger on the low lane) | none |
//!
//! Hosts differ in small ways, so both forms are accepted where they are known to vary: a
//! queue message plain or JSON-encoded as a string ("double-encoded"), `DequeueCount` as a
//! number or a string, header values as strings or arrays, a body as a string or as JSON.

use serde_json::{Map, Value, json};

use leasehold_runtime::{DecodeError, Lane, TriggerMessage};

use crate::Error;

/// Function names, as the folder names `Start/` and `Worker/` (the host calls `POST /<name>`).
pub const START_FUNCTION: &str = "Start";
pub const WORKER_FUNCTION: &str = "Worker";
/// The low lane's worker (`WorkerLow/`), triggered by `<LEASEHOLD_QUEUE>-low`.
pub const WORKER_LOW_FUNCTION: &str = "WorkerLow";
/// Binding names used in the `function.json` files.
pub const HTTP_IN: &str = "req";
pub const HTTP_OUT: &str = "res";
pub const QUEUE_OUT: &str = "message";
/// Start's output to the low lane's queue.
pub const QUEUE_OUT_LOW: &str = "messageLow";
pub const QUEUE_IN: &str = "trigger";

/// The dequeue count assumed when the host's `DequeueCount` is missing or unreadable.
pub(crate) const REDELIVERY_DEQUEUE_COUNT: u64 = 2;

/// The HTTP request inside an HTTP-trigger invocation (Start's, the dashboard's).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HostHttpRequest {
    pub method: String,
    /// The URL the caller asked for (empty when the host sent none).
    pub url: String,
    pub headers: Vec<(String, String)>,
    pub query: Vec<(String, String)>,
    /// The route parameters (`{*path}` of `ops/{*path}`, say).
    pub params: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl HostHttpRequest {
    /// The first value of a route parameter.
    pub fn param(&self, name: &str) -> Option<&str> {
        self.params
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The first value of a header (names compare without case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Reads `Data.req` of an HTTP-trigger invocation.
pub fn parse_http_invocation(payload: &Value) -> Result<HostHttpRequest, Error> {
    let req = payload
        .get("Data")
        .and_then(|d| d.get(HTTP_IN))
        .ok_or(Error::MissingBinding(HTTP_IN))?;
    let method = req
        .get("Method")
        .and_then(Value::as_str)
        .unwrap_or("POST")
        .to_string();
    let pairs = |v: Option<&Value>| -> Vec<(String, String)> {
        let Some(Value::Object(map)) = v else {
            return Vec::new();
        };
        map.iter()
            .flat_map(|(k, v)| match v {
                Value::String(s) => vec![(k.clone(), s.clone())],
                Value::Array(items) => items
                    .iter()
                    .filter_map(Value::as_str)
                    .map(|s| (k.clone(), s.to_string()))
                    .collect(),
                Value::Null => Vec::new(),
                other => vec![(k.clone(), other.to_string())],
            })
            .collect()
    };
    let body = match req.get("Body") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => s.clone().into_bytes(),
        Some(other) => other.to_string().into_bytes(),
    };
    Ok(HostHttpRequest {
        method,
        url: req.get("Url").and_then(Value::as_str).unwrap_or("").to_string(),
        headers: pairs(req.get("Headers")),
        query: pairs(req.get("Query")),
        params: pairs(req.get("Params")),
        body,
    })
}

/// The answer to a Start invocation: the caller's HTTP response in `Outputs.res` (status and
/// JSON body), and the trigger in the queue output when there is one. The host's own status is
/// always 200, so a 4xx for the caller does not count as a failed invocation.
pub(crate) fn http_invocation_response(
    status: u16,
    body: &Value,
    enqueue: Option<(&TriggerMessage, Lane)>,
    logs: Vec<String>,
) -> Value {
    let mut outputs = Map::new();
    outputs.insert(
        HTTP_OUT.into(),
        json!({
            "statusCode": status,
            "body": body.to_string(),
            "headers": { "Content-Type": "application/json" },
        }),
    );
    if let Some((message, lane)) = enqueue {
        // JSON text: the host writes it to the lane's queue (base64-encoded, as messageEncoding
        // says); JSON is never mistaken for a bare base64 token.
        let binding = match lane {
            Lane::High => QUEUE_OUT,
            Lane::Low => QUEUE_OUT_LOW,
        };
        outputs.insert(binding.into(), Value::String(message.to_json()));
    }
    json!({ "Outputs": outputs, "Logs": logs, "ReturnValue": Value::Null })
}

/// The answer to an HTTP-trigger invocation with nothing but the caller's response: `status`,
/// `body` as text, and `headers` (a function without outputs besides `res`, as the dashboard's).
pub fn http_response(status: u16, body: &str, headers: &[(&str, &str)], logs: Vec<String>) -> Value {
    let headers: Map<String, Value> = headers
        .iter()
        .map(|(k, v)| ((*k).to_string(), Value::String((*v).to_string())))
        .collect();
    json!({
        "Outputs": { HTTP_OUT: { "statusCode": status, "body": body, "headers": headers } },
        "Logs": logs,
        "ReturnValue": Value::Null,
    })
}

/// A Worker invocation: the trigger and its delivery count.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct QueueInvocation {
    /// The message as read; `Err` with the reason if it is not a trigger.
    pub message: Result<TriggerMessage, DecodeError>,
    pub raw: String,
    pub dequeue_count: u32,
    pub id: Option<String>,
}

/// Reads `Data.trigger` and `Metadata` of a Worker invocation.
pub(crate) fn parse_queue_invocation(payload: &Value) -> Result<QueueInvocation, Error> {
    let data = payload
        .get("Data")
        .and_then(|d| d.get(QUEUE_IN))
        .ok_or(Error::MissingBinding(QUEUE_IN))?;
    let raw = match data {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let message = read_trigger(data);
    let metadata = payload.get("Metadata");
    // Missing or unreadable: assume a redelivery, the safe reading (a first delivery may be
    // trusted in ways a redelivery may not).
    let dequeue_count = match metadata.and_then(|m| m.get("DequeueCount")) {
        Some(Value::Number(n)) => n.as_u64(),
        Some(Value::String(s)) => s.trim().trim_matches('"').parse().ok(),
        _ => None,
    }
    .unwrap_or(REDELIVERY_DEQUEUE_COUNT);
    let id = metadata
        .and_then(|m| m.get("Id"))
        .and_then(Value::as_str)
        .map(|s| s.trim_matches('"').to_string());
    Ok(QueueInvocation {
        message,
        raw,
        dequeue_count: u32::try_from(dequeue_count.max(1)).unwrap_or(u32::MAX),
        id,
    })
}

/// A trigger from whatever form the host passed: an object, a JSON string holding the object
/// (double-encoded), a string holding that string (triple), or base64 of the JSON.
fn read_trigger(value: &Value) -> Result<TriggerMessage, DecodeError> {
    let mut value = value.clone();
    for _ in 0..3 {
        match value {
            Value::Object(_) => return TriggerMessage::from_json(&value.to_string()),
            Value::String(s) => match serde_json::from_str::<Value>(&s) {
                Ok(inner) => value = inner,
                Err(_) => return TriggerMessage::decode(&s),
            },
            _ => return Err(DecodeError::new("expected a JSON object")),
        }
    }
    Err(DecodeError::new("nested too deeply"))
}

/// The answer to a successful Worker invocation (the host deletes the message).
pub(crate) fn queue_invocation_done(outcome: &str, logs: Vec<String>) -> Value {
    json!({ "Outputs": {}, "Logs": logs, "ReturnValue": { "outcome": outcome } })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker_payload(data: Value, dequeue: Value) -> Value {
        json!({
            "Data": { "trigger": data },
            "Metadata": {
                "DequeueCount": dequeue,
                "Id": "\"5c3a0d3c-7c55-4f7b-9d2c-2b1f0a4b9e11\"",
                "PopReceipt": "\"AgAAAAMAAAAAAAAA\"",
                "InsertionTime": "2026-11-22T02:00:00+00:00",
                "sys": { "MethodName": "Worker", "UtcNow": "2026-11-22T02:00:01Z", "RandGuid": "x" },
                "SomethingNew": 1
            }
        })
    }

    #[test]
    fn queue_trigger_in_every_encoding() {
        let m = TriggerMessage::parse("account", "8f9c1d2e-0000-4000-8000-000000000001").unwrap();
        let plain = serde_json::from_str::<Value>(&m.to_json()).unwrap();
        let double = Value::String(m.to_json());
        let triple = Value::String(Value::String(m.to_json()).to_string());
        let base64 = Value::String(m.encode());
        for (data, dc, expected) in [
            (plain, json!(1), 1),
            (double, json!("3"), 3),
            (triple, json!(4), 4),
            (base64, json!("\"5\""), 5),
        ] {
            let inv = parse_queue_invocation(&worker_payload(data.clone(), dc)).unwrap();
            assert_eq!(inv.message.as_ref().unwrap(), &m, "{data}");
            assert_eq!(inv.dequeue_count, expected, "{data}");
            assert_eq!(inv.id.as_deref(), Some("5c3a0d3c-7c55-4f7b-9d2c-2b1f0a4b9e11"));
        }
    }

    #[test]
    fn unreadable_queue_messages_are_reported_not_guessed() {
        for data in [
            json!("hello"),
            json!(42),
            json!({"scope": "a"}),
            json!("{\"scope\":\"\",\"recordId\":\"x\"}"),
        ] {
            let inv = parse_queue_invocation(&worker_payload(data.clone(), json!(1))).unwrap();
            assert!(inv.message.is_err(), "{data}");
        }
        assert!(parse_queue_invocation(&json!({"Data": {}})).is_err());
    }

    #[test]
    fn a_done_worker_invocation_names_its_outcome_and_outputs_nothing() {
        let done = queue_invocation_done("coalesced", vec!["worker: coalesced".into()]);
        assert_eq!(
            done,
            json!({ "Outputs": {}, "Logs": ["worker: coalesced"], "ReturnValue": { "outcome": "coalesced" } })
        );
    }

    #[test]
    fn a_missing_or_unreadable_dequeue_count_reads_as_a_redelivery() {
        let m = TriggerMessage::parse("account", "42").unwrap();
        for dc in [json!(null), json!("many"), json!(-1), json!({})] {
            let inv =
                parse_queue_invocation(&worker_payload(Value::String(m.to_json()), dc.clone())).unwrap();
            assert_eq!(inv.dequeue_count, 2, "{dc}");
        }
        let bare = json!({"Data": {"trigger": m.to_json()}});
        assert_eq!(parse_queue_invocation(&bare).unwrap().dequeue_count, 2);
    }

    #[test]
    fn http_request_from_the_host() {
        let payload = json!({
            "Data": { "req": {
                "Url": "https://app.azurewebsites.net/api/start?code=k",
                "Method": "POST",
                "Query": { "code": "k" },
                "Headers": { "Content-Type": ["application/json"], "x-ms-dynamics-organization": ["contoso"] },
                "Params": {},
                "Identities": [],
                "Body": "{\"recordId\":\"42\"}"
            }},
            "Metadata": {}
        });
        let req = parse_http_invocation(&payload).unwrap();
        assert_eq!(req.method, "POST");
        assert_eq!(req.body, b"{\"recordId\":\"42\"}");
        assert!(
            req.headers
                .contains(&("x-ms-dynamics-organization".into(), "contoso".into()))
        );
        assert_eq!(req.query, [("code".to_string(), "k".to_string())]);
        assert_eq!(req.url, "https://app.azurewebsites.net/api/start?code=k");
        assert_eq!(req.header("content-type"), Some("application/json"));
        let routed = json!({"Data": {"req": {"Method": "GET", "Params": {"path": "poison/abc"}}}});
        assert_eq!(
            parse_http_invocation(&routed).unwrap().param("path"),
            Some("poison/abc")
        );
        let no_body = json!({"Data": {"req": {"Method": "POST", "Headers": {}}}});
        assert!(parse_http_invocation(&no_body).unwrap().body.is_empty());
    }

    #[test]
    fn start_response_puts_the_callers_status_in_res_and_the_trigger_in_the_queue_output() {
        let m = TriggerMessage::parse("account", "42").unwrap();
        let r = http_invocation_response(
            202,
            &json!({"ok": true}),
            Some((&m, Lane::High)),
            vec!["log".into()],
        );
        assert_eq!(r["Outputs"]["res"]["statusCode"], 202);
        assert_eq!(r["Outputs"]["res"]["body"], "{\"ok\":true}");
        assert_eq!(
            TriggerMessage::from_json(r["Outputs"]["message"].as_str().unwrap()).unwrap(),
            m
        );
        assert!(r["Outputs"].get("messageLow").is_none());
        // The low lane's trigger goes to its own output, and only there.
        let low = http_invocation_response(202, &json!({"ok": true}), Some((&m, Lane::Low)), vec![]);
        assert_eq!(
            TriggerMessage::from_json(low["Outputs"]["messageLow"].as_str().unwrap()).unwrap(),
            m
        );
        assert!(low["Outputs"].get("message").is_none());
        let page = http_response(200, "<p>", &[("Content-Type", "text/html")], vec![]);
        assert_eq!(
            page["Outputs"]["res"],
            json!({"statusCode": 200, "body": "<p>", "headers": {"Content-Type": "text/html"}})
        );
        let rejected = http_invocation_response(400, &json!({"error": "x"}), None, vec![]);
        assert!(
            rejected["Outputs"].get("message").is_none(),
            "nothing enqueued on rejection"
        );
    }
}
