//! The one-shot operator commands. Each returns the text the command prints.

use std::time::{Duration, UNIX_EPOCH};

use anyhow::Result;
use leasehold_lock::RetryOptions;
use leasehold_runtime::{RecordId, Scope, TriggerMessage, poison_queue_name, record_key, record_status};

use crate::app::wire;
use crate::settings::Settings;

/// Puts a trigger for a record on the queue, as Start would.
pub async fn enqueue(settings: &Settings, scope: &Scope, record_id: &RecordId) -> Result<String> {
    let message = TriggerMessage::new(scope.clone(), record_id.clone());
    let wiring = wire(settings)?;
    let body = message.encode();
    RetryOptions::default()
        .run("enqueue", || wiring.queue.put(&body, Duration::ZERO))
        .await?;
    Ok(format!(
        "enqueued {}/{} on {}",
        message.scope, message.record_id, settings.queue
    ))
}

/// The queue and poison queue depths and, for a record, its lease (held, holder, since,
/// fencing generation) and whether a retrigger is pending; as text or JSON.
pub async fn status(
    settings: &Settings,
    scope: &Scope,
    record_id: Option<&RecordId>,
    json: bool,
) -> Result<String> {
    let wiring = wire(settings)?;
    let depth = wiring.queue.approximate_len().await?;
    let poison = wiring.poison.approximate_len().await?;
    let mut report = serde_json::json!({
        "queue": { "name": settings.queue, "approximateMessages": depth },
        "poison": { "name": poison_queue_name(&settings.queue), "approximateMessages": poison },
    });
    if let Some(record_id) = record_id {
        let status = record_status(&wiring.lock, &*wiring.markers, scope, record_id).await?;
        let info = status.lock;
        let since = info
            .since
            .map(|t| t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()));
        report["record"] = serde_json::json!({
            "scope": scope,
            "recordId": record_id,
            "held": info.held,
            "leaseState": info.state.map(|s| format!("{s:?}").to_lowercase()),
            "holder": info.holder,
            "sinceUnixSeconds": since,
            "generation": info.generation,
            "retriggerPending": status.retrigger_pending,
        });
    }
    if json {
        return Ok(serde_json::to_string_pretty(&report)?);
    }
    let mut out = Vec::new();
    if let Some(r) = report.get("record") {
        out.push(format!(
            "record      {}/{}",
            r["scope"].as_str().unwrap_or(""),
            r["recordId"].as_str().unwrap_or("")
        ));
        let held = if r["held"].as_bool() == Some(true) {
            "held"
        } else {
            "free"
        };
        let state = r["leaseState"].as_str().unwrap_or("never used");
        out.push(format!("lease       {held} ({state})"));
        if let Some(holder) = r["holder"].as_str() {
            out.push(format!(
                "holder      {holder} (last fenced grant, {} s since the epoch)",
                r["sinceUnixSeconds"]
            ));
        }
        out.push(format!("generation  {}", r["generation"]));
        out.push(format!(
            "retrigger   {}",
            if r["retriggerPending"].as_bool() == Some(true) {
                "pending"
            } else {
                "none"
            }
        ));
    }
    out.push(format!("queue       {}: about {depth} messages", settings.queue));
    out.push(format!(
        "poison      {}: about {poison} messages",
        poison_queue_name(&settings.queue)
    ));
    Ok(out.join("\n"))
}

/// Breaks a record's lease: its run is told at its next renewal and stops; the record is free
/// once that run released it or its lease would have expired, or at once with `now` (only for
/// a holder known to be dead).
pub async fn break_lease(
    settings: &Settings,
    scope: &Scope,
    record_id: &RecordId,
    reason: &str,
    now: bool,
) -> Result<String> {
    let key = record_key(scope, record_id);
    let wiring = wire(settings)?;
    if now {
        wiring.lock.break_lock_after(&key, reason, Duration::ZERO).await?;
        Ok(format!(
            "broke the lease on {key} ({reason}); the record is free now"
        ))
    } else {
        wiring.lock.break_lock(&key, reason).await?;
        Ok(format!(
            "broke the lease on {key} ({reason}); its run is told at its next renewal, and the record is free once \
             that run released it or the lease would have expired (at most {} s)",
            settings.lease.duration.secs()
        ))
    }
}
