//! A record's run history as every instance wrote it: `leasehold history --scope S RECORD` (and
//! the admin API's record view), newest first. An operator's own actions on a record (enqueue,
//! requeue, purge, break) are written to it too.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use leasehold_runtime::{HistoryEntry, HistoryEvent, RecordId, Scope};
use serde::Serialize;

use crate::{Operator, OpsError};

/// The most entries one history read shows.
pub const MAX_HISTORY_LIMIT: usize = 1000;

/// One history entry as the command line and the admin API show it.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct HistoryView {
    /// When (RFC 3339, by the writer's clock).
    #[serde(serialize_with = "crate::clock::serialize")]
    pub time: SystemTime,
    /// What happened: `started`, a delivery's outcome (`completed`, `retriggered`, `coalesced`,
    /// `failed`, `lease_lost`, `deferred`, `waiting`, `debounced`, `paused`, `poisoned`,
    /// `superseded`, `rechecked`), or an operator's `enqueued`, `requeued`, `purged`, `broken`.
    pub event: String,
    /// The delivery's attempt (0 for an operator's action).
    pub attempt: u32,
    pub fencing_token: Option<u64>,
    /// Who: the lease holder's name (`host:pid`), or `leasehold <command>` for an operator.
    pub instance: String,
    pub lane: Option<String>,
    pub budget: Option<String>,
    /// How long the logic ran, for an entry that ends a run.
    pub run_seconds: Option<f64>,
    /// Until when: a wait, a run put off, a trigger held by a pause, a retry.
    #[serde(serialize_with = "crate::clock::serialize_opt")]
    pub until: Option<SystemTime>,
    pub correlation_id: Option<String>,
    pub trace_id: Option<String>,
    pub reason: Option<String>,
}

fn at(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}

impl From<&HistoryEntry> for HistoryView {
    fn from(e: &HistoryEntry) -> Self {
        Self {
            time: at(e.time_ms),
            event: e.event.to_string(),
            attempt: e.attempt,
            fencing_token: e.fencing_token,
            instance: e.instance.clone(),
            lane: e.lane.clone(),
            budget: e.budget.clone(),
            run_seconds: e.run_ms.map(|ms| ms as f64 / 1000.0),
            until: e.until_ms.map(at),
            correlation_id: e.correlation_id.clone(),
            trace_id: e.trace_id.clone(),
            reason: e.reason.clone(),
        }
    }
}

impl HistoryView {
    /// One line a person reads: when, what, and what came with it.
    pub fn line(&self) -> String {
        let mut parts = vec![crate::clock::rfc3339(self.time), self.event.clone()];
        if self.attempt > 1 {
            parts.push(format!("attempt {}", self.attempt));
        }
        if let Some(token) = self.fencing_token {
            parts.push(format!("token {token}"));
        }
        if let Some(s) = self.run_seconds {
            parts.push(format!("ran {}", crate::clock::span(Duration::from_secs_f64(s))));
        }
        if let Some(until) = self.until {
            parts.push(format!("until {}", crate::clock::rfc3339(until)));
        }
        if let Some(budget) = &self.budget
            && self.event == "paused"
        {
            parts.push(format!("budget {budget}"));
        }
        if let Some(lane) = self.lane.as_deref().filter(|l| *l != "high") {
            parts.push(format!("{lane} lane"));
        }
        if !self.instance.is_empty() {
            parts.push(format!("on {}", self.instance));
        }
        let mut line = parts.join("  ");
        if let Some(reason) = &self.reason {
            line.push_str(&format!("  — {reason}"));
        }
        line
    }
}

impl Operator {
    /// The history of `scope`/`record`, newest first, at most `limit` entries (1 to
    /// [`MAX_HISTORY_LIMIT`]): two requests (the current period's table and the one before).
    pub async fn history(
        &self,
        scope: &Scope,
        record: &RecordId,
        limit: usize,
    ) -> Result<Vec<HistoryView>, OpsError> {
        if !(1..=MAX_HISTORY_LIMIT).contains(&limit) {
            return Err(OpsError::BadRequest(format!(
                "the limit must be 1–{MAX_HISTORY_LIMIT}, not {limit}"
            )));
        }
        let Some((store, keep)) = &self.inner.history else {
            return Err(OpsError::BadRequest(
                "run history is off in this deployment (LEASEHOLD_HISTORY=false)".into(),
            ));
        };
        let entries = store
            .read(scope, record, *keep, limit)
            .await
            .map_err(|e| OpsError::storage("read the record's history", e))?;
        Ok(entries.iter().map(HistoryView::from).collect())
    }

    /// Writes an operator's `event` on `scope`/`record` to the history (if on), as `instance`
    /// (`leasehold <command>`), with `reason`. Best effort: an operator's action never fails for
    /// its history (a failure is logged).
    pub async fn note(
        &self,
        scope: &Scope,
        record: &RecordId,
        event: HistoryEvent,
        instance: &str,
        reason: Option<&str>,
    ) {
        let Some((store, _)) = &self.inner.history else {
            return;
        };
        let mut entry = HistoryEntry::new(scope.clone(), record.clone(), event);
        entry.instance = instance.to_string();
        if let Some(reason) = reason {
            entry = entry.with_reason(reason);
        }
        if let Err(e) = store.append(&[entry]).await {
            tracing::warn!(%scope, record = %record, error = %e, "could not write the action to the record's history");
        }
    }
}
