//! Run history: one entry for each thing that happened to a record (a run started or ended, a
//! trigger coalesced onto a run, a wait, a run put off, a trigger held by a pause, a give-up,
//! an operator's action), written off the run's path to a store every instance shares, so
//! "what happened to record X" has an answer after the instance that ran it is gone.
//!
//! [`History`] is the writer: [`History::record`] never waits and never fails — it hands the
//! entry to a task that gathers every record's entries for a moment
//! ([`HistoryOptions::flush_every`]) and hands them to the store in one write
//! ([`HistoryStore::append`]; [`TableHistory`] makes it a request per partition of records). A write that fails or hangs is
//! counted ([`HISTORY_FAILURES_TOTAL`]) and logged at most once a minute; entries beyond the
//! bounded buffer are dropped and counted ([`HISTORY_DROPPED_TOTAL`]). A run never waits for,
//! fails for, or repeats for its history.

mod memory;
mod naming;
mod table;
mod writer;

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use leasehold_storage::StoreError;
use serde::{Deserialize, Serialize};

use crate::observe::OutcomeLabel;
use crate::record::{RecordId, Scope};

pub use memory::MemoryHistory;
pub use naming::MAX_HISTORY_DAYS;
pub use table::{
    BadHistoryPrefix, LISTING_KEPT, MAX_HISTORY_PREFIX_LEN, RECENT_MAX_ENTITIES, RECENT_MAX_REQUESTS,
    RECENT_MAX_TIME, TableHistory,
};
pub use writer::{History, HistoryOptions};

/// Counter of history entries written.
pub const HISTORY_WRITTEN_TOTAL: &str = "leasehold_history_written_total";
/// Counter of history writes (requests) that failed or timed out; their entries are lost.
pub const HISTORY_FAILURES_TOTAL: &str = "leasehold_history_failures_total";
/// Counter of history entries dropped: the writer's buffer was full, or a write failed.
pub const HISTORY_DROPPED_TOTAL: &str = "leasehold_history_dropped_total";

/// The longest reason an entry keeps, in characters (cut with an ellipsis beyond).
pub const MAX_REASON_CHARS: usize = 500;

/// What happened, as a history entry's `event` names it: `started` (a run began), every
/// delivery outcome's label ([`OutcomeLabel`]: `completed`, `retriggered`, `coalesced`,
/// `failed`, `lease_lost`, `deferred`, `waiting`, `debounced`, `paused`, `poisoned`, …), and an
/// operator's `enqueued`, `requeued`, `purged` or `broken`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HistoryEvent {
    Started,
    Outcome(OutcomeLabel),
    Enqueued,
    Requeued,
    Purged,
    Broken,
}

impl HistoryEvent {
    pub fn as_str(self) -> &'static str {
        match self {
            HistoryEvent::Started => "started",
            HistoryEvent::Outcome(label) => label.as_str(),
            HistoryEvent::Enqueued => "enqueued",
            HistoryEvent::Requeued => "requeued",
            HistoryEvent::Purged => "purged",
            HistoryEvent::Broken => "broken",
        }
    }

    /// The event named `text`, if it is one.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "started" => Some(HistoryEvent::Started),
            "enqueued" => Some(HistoryEvent::Enqueued),
            "requeued" => Some(HistoryEvent::Requeued),
            "purged" => Some(HistoryEvent::Purged),
            "broken" => Some(HistoryEvent::Broken),
            other => OutcomeLabel::ALL
                .into_iter()
                .find(|l| l.as_str() == other)
                .map(HistoryEvent::Outcome),
        }
    }

    /// Whether it ends a run that started (the run's bar ends here).
    pub fn ends_a_run(self) -> bool {
        matches!(
            self,
            HistoryEvent::Outcome(
                OutcomeLabel::Completed
                    | OutcomeLabel::Retriggered
                    | OutcomeLabel::Superseded
                    | OutcomeLabel::Failed
                    | OutcomeLabel::LeaseLost
                    | OutcomeLabel::Deferred
                    | OutcomeLabel::Poisoned
            )
        )
    }
}

impl fmt::Display for HistoryEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for HistoryEvent {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for HistoryEvent {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        HistoryEvent::parse(&text)
            .ok_or_else(|| serde::de::Error::custom(format!("unknown history event {text:?}")))
    }
}

/// One thing that happened to a record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HistoryEntry {
    /// When, in milliseconds since the Unix epoch, by the writer's clock.
    pub time_ms: u64,
    pub scope: Scope,
    pub record: RecordId,
    pub event: HistoryEvent,
    /// The delivery's attempt (1 for a first delivery); 0 for an operator's action.
    #[serde(default)]
    pub attempt: u32,
    /// The run's fencing token, where a run held the lease with fencing on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fencing_token: Option<u64>,
    /// Who did it: the lease holder's name (`host:pid`), or the operator's tool.
    #[serde(default)]
    pub instance: String,
    /// The queue's lane (`high`, `low`), for a delivery.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lane: Option<String>,
    /// The downstream budget, where one was involved (a pause, a run's slot).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<String>,
    /// How long the logic ran, in milliseconds, for an entry that ends a run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_ms: Option<u64>,
    /// Until when (Unix ms): a wait, a run put off, a trigger held by a pause, a retry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correlation_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
    /// Why (a failure's error, what asked for a run later): at most [`MAX_REASON_CHARS`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl HistoryEntry {
    /// An entry for `event` of `scope`/`record`, now, with every other field empty.
    pub fn new(scope: Scope, record: RecordId, event: HistoryEvent) -> Self {
        Self {
            time_ms: unix_ms(SystemTime::now()),
            scope,
            record,
            event,
            attempt: 0,
            fencing_token: None,
            instance: String::new(),
            lane: None,
            budget: None,
            run_ms: None,
            until_ms: None,
            correlation_id: None,
            trace_id: None,
            reason: None,
        }
    }

    /// Its reason, cut to [`MAX_REASON_CHARS`] (control characters replaced by spaces).
    pub fn with_reason(mut self, reason: impl fmt::Display) -> Self {
        self.reason = Some(bounded_reason(&reason.to_string()));
        self
    }

    /// Until `after` from its time.
    pub fn until_after(mut self, after: Duration) -> Self {
        self.until_ms = Some(self.time_ms.saturating_add(after.as_millis() as u64));
        self
    }

    pub fn time(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(self.time_ms)
    }
}

/// `text` with control characters as spaces, at most [`MAX_REASON_CHARS`] characters.
pub fn bounded_reason(text: &str) -> String {
    let mut out: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(MAX_REASON_CHARS + 1)
        .collect();
    if out.chars().count() > MAX_REASON_CHARS {
        out = out.chars().take(MAX_REASON_CHARS - 1).collect();
        out.push('…');
    }
    out
}

pub(crate) fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Where history is kept.
#[async_trait]
pub trait HistoryStore: Send + Sync + fmt::Debug {
    /// Writes `entries` — all of one record, oldest first — in one request.
    async fn append(&self, entries: &[HistoryEntry]) -> Result<(), StoreError>;

    /// The record's entries no older than `keep`, newest first, at most `limit`.
    async fn read(
        &self,
        scope: &Scope,
        record: &RecordId,
        keep: Duration,
        limit: usize,
    ) -> Result<Vec<HistoryEntry>, StoreError>;

    /// Drops whole stretches of history older than `keep` (never an entry at a time); says
    /// how many.
    async fn sweep(&self, keep: Duration) -> Result<usize, StoreError>;

    /// Entries of every record (or of one scope's) in a window of time, newest first, at most
    /// `query.limit`: the deployment's recent runs. A store may bound what one call reads
    /// (see [`TableHistory`]'s); when it stopped at its bound the answer says it is partial.
    async fn recent(&self, query: &RecentQuery) -> Result<Recent, StoreError>;
}

/// What [`HistoryStore::recent`] reads.
#[derive(Debug, Clone, PartialEq)]
pub struct RecentQuery {
    /// The window, in Unix ms, both ends included.
    pub since_ms: u64,
    pub until_ms: u64,
    /// Only this scope's records.
    pub scope: Option<Scope>,
    /// Only these events; every event when empty.
    pub events: Vec<HistoryEvent>,
    /// At most this many entries (the newest).
    pub limit: usize,
}

impl RecentQuery {
    /// Whether `entry` is one the query asks for.
    pub fn wants(&self, entry: &HistoryEntry) -> bool {
        (self.since_ms..=self.until_ms).contains(&entry.time_ms)
            && self.scope.as_ref().is_none_or(|s| &entry.scope == s)
            && (self.events.is_empty() || self.events.contains(&entry.event))
    }
}

/// What [`HistoryStore::recent`] found.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Recent {
    /// Newest first.
    pub entries: Vec<HistoryEntry>,
    /// The store stopped at its bound before it had read the whole window: entries may be
    /// missing, newer ones among them (a store reads in key order, not time order).
    pub partial: bool,
    /// Stored items read (entities, for [`TableHistory`]).
    pub scanned: usize,
}

/// Newest first; of the same millisecond, the later written (the later in `found`) first.
fn newest_first(mut found: Vec<HistoryEntry>, limit: usize) -> Vec<HistoryEntry> {
    found.reverse();
    found.sort_by_key(|e| std::cmp::Reverse(e.time_ms));
    found.truncate(limit);
    found
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn entry(record: &str, event: HistoryEvent) -> HistoryEntry {
        HistoryEntry::new(
            Scope::parse("account").unwrap(),
            RecordId::parse(record).unwrap(),
            event,
        )
    }

    #[test]
    fn events_are_named_as_outcomes_are_and_read_back() {
        for event in [
            HistoryEvent::Started,
            HistoryEvent::Enqueued,
            HistoryEvent::Requeued,
            HistoryEvent::Purged,
            HistoryEvent::Broken,
        ]
        .into_iter()
        .chain(OutcomeLabel::ALL.into_iter().map(HistoryEvent::Outcome))
        {
            assert_eq!(HistoryEvent::parse(event.as_str()), Some(event));
            let json = serde_json::to_string(&event).unwrap();
            assert_eq!(serde_json::from_str::<HistoryEvent>(&json).unwrap(), event);
        }
        assert_eq!(HistoryEvent::parse("exploded"), None);
    }

    #[test]
    fn a_reason_is_bounded_and_has_no_control_characters() {
        let e = entry("1", HistoryEvent::Outcome(OutcomeLabel::Failed)).with_reason("a\nb\u{1b}[31m");
        assert_eq!(e.reason.as_deref(), Some("a b [31m"));
        let long = entry("1", HistoryEvent::Started).with_reason("é".repeat(2000));
        let reason = long.reason.unwrap();
        assert_eq!(reason.chars().count(), MAX_REASON_CHARS);
        assert!(reason.ends_with('…'));
    }
}
