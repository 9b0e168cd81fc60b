//! The most recent outcome of each recently handled record, in this process: the last delivery
//! outcome of at most [`CAPACITY`] records, the record least recently handled dropped first.
//! Both modes fill it where they count the outcome ([`sink`], installed on the runner).
//!
//! It is the process's memory only: another instance's deliveries, and everything before the
//! process started, are not in it.

use std::collections::{BTreeMap, HashMap};
use std::sync::{LazyLock, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use leasehold_runtime::{Outcome, OutcomeSink, RecordId, Scope};
use serde::Serialize;

/// Records kept.
pub const CAPACITY: usize = 1_000;

/// Longest `message` kept, in bytes.
const MAX_MESSAGE_BYTES: usize = 512;

/// The last outcome of one record's delivery in this process.
///
/// As JSON (camelCase): `{"scope", "recordId", "outcome", "finishedAt" (RFC 3339, UTC),
/// "finishedAtUnixMs", "runSeconds" (absent when nothing ran), "message"}`.
#[derive(Debug, Clone, PartialEq)]
pub struct RecentOutcome {
    pub scope: Scope,
    pub record_id: RecordId,
    /// The outcome's metric label: completed, retriggered, coalesced, rechecked, failed,
    /// lease_lost or poisoned ([`leasehold_runtime::OutcomeLabel`]).
    pub outcome: &'static str,
    pub finished_at: SystemTime,
    /// How long the logic ran, when it ran (failed runs included).
    pub run_duration: Option<Duration>,
    /// What happened, in a line: a failure's reason (the text the logs and the poison queue
    /// carry, which never holds a key or a connection string), or what a delivery without a
    /// failure did.
    pub message: String,
}

impl Serialize for RecentOutcome {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let since_epoch = self.finished_at.duration_since(UNIX_EPOCH).unwrap_or_default();
        let finished_at = time::OffsetDateTime::from(UNIX_EPOCH + since_epoch)
            .format(&time::format_description::well_known::Rfc3339)
            .map_err(serde::ser::Error::custom)?;
        let fields = if self.run_duration.is_some() { 7 } else { 6 };
        let mut out = s.serialize_struct("RecentOutcome", fields)?;
        out.serialize_field("scope", &self.scope)?;
        out.serialize_field("recordId", &self.record_id)?;
        out.serialize_field("outcome", self.outcome)?;
        out.serialize_field("finishedAt", &finished_at)?;
        out.serialize_field("finishedAtUnixMs", &(since_epoch.as_millis() as u64))?;
        match self.run_duration {
            Some(d) => out.serialize_field("runSeconds", &d.as_secs_f64())?,
            None => out.skip_field("runSeconds")?,
        }
        out.serialize_field("message", &self.message)?;
        out.end()
    }
}

impl RecentOutcome {
    fn new(
        scope: &Scope,
        record: &RecordId,
        outcome: &Outcome,
        run_duration: Option<Duration>,
        finished_at: SystemTime,
    ) -> Self {
        Self {
            scope: scope.clone(),
            record_id: record.clone(),
            outcome: outcome.label().as_str(),
            finished_at,
            run_duration,
            message: truncate(describe(outcome)),
        }
    }
}

fn describe(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Completed {
            retriggered: false, ..
        } => "ran and succeeded".into(),
        Outcome::Completed {
            retriggered: true, ..
        } => "ran and succeeded; triggers arrived during the run, so it runs once more".into(),
        Outcome::Coalesced => "a run was in progress; it runs once more after it".into(),
        Outcome::Rechecking { after } => {
            format!("the lease was held; looking again in {} s", after.as_secs())
        }
        Outcome::Retrying { error, after } => format!("{error}; retrying in {} s", after.as_secs()),
        Outcome::Poisoned { error } => format!("moved to the poison queue: {error}"),
        Outcome::Failed { error, .. } => format!("{error}; the trigger is delivered again"),
        Outcome::Superseded {
            retriggered: true, ..
        } => "stopped: a trigger arrived during the run; it runs again on the new data".into(),
        Outcome::Superseded { .. } => {
            "stopped: a trigger arrived during the run; the run that took the trigger covers it".into()
        }
        Outcome::Deferred {
            after, total, why, ..
        } => format!(
            "the logic asked to be run later ({why}); it runs again in {} s (put off {} s in all)",
            after.as_secs(),
            total.as_secs()
        ),
        Outcome::Waiting { after, .. } => format!(
            "waiting for the burst of triggers to end; looking again in {} s",
            after.as_secs()
        ),
        Outcome::Debounced { joined: true } => {
            "joined the wait for the burst to end; it runs once the burst has ended".into()
        }
        Outcome::Debounced { joined: false } => "another delivery ended the wait and runs the record".into(),
        Outcome::Paused { budget, after, .. } => format!(
            "its downstream budget ({budget}) is paused after a throttle; it comes back in {} s, not counted as an attempt",
            after.as_secs()
        ),
    }
}

fn truncate(mut text: String) -> String {
    if text.len() > MAX_MESSAGE_BYTES {
        let mut end = MAX_MESSAGE_BYTES - '…'.len_utf8();
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push('…');
    }
    text
}

type Key = (Scope, RecordId);

/// A bounded store of the last outcome per record: the record whose latest outcome is oldest
/// is dropped first once `capacity` records are held.
#[derive(Debug)]
pub struct RecentOutcomes {
    capacity: usize,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// Each record's latest outcome and its sequence number.
    latest: HashMap<Key, (u64, RecentOutcome)>,
    /// Sequence number → record, oldest first.
    order: BTreeMap<u64, Key>,
    next: u64,
}

impl RecentOutcomes {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            inner: Mutex::default(),
        }
    }

    /// Keeps `outcome` as its record's latest, dropping the least recently handled record if
    /// that makes one too many.
    pub fn insert(&self, outcome: RecentOutcome) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let seq = inner.next;
        inner.next += 1;
        let key = (outcome.scope.clone(), outcome.record_id.clone());
        if let Some((old, _)) = inner.latest.insert(key.clone(), (seq, outcome)) {
            inner.order.remove(&old);
        }
        inner.order.insert(seq, key);
        while inner.order.len() > self.capacity {
            let Some((_, oldest)) = inner.order.pop_first() else {
                break;
            };
            inner.latest.remove(&oldest);
        }
    }

    /// The latest outcome of a record, if it is still held.
    pub fn get(&self, scope: &Scope, record: &RecordId) -> Option<RecentOutcome> {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner
            .latest
            .get(&(scope.clone(), record.clone()))
            .map(|(_, o)| o.clone())
    }

    /// Up to `limit` records' latest outcomes, the most recent first.
    pub fn newest(&self, limit: usize) -> Vec<RecentOutcome> {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner
            .order
            .values()
            .rev()
            .take(limit)
            .filter_map(|key| inner.latest.get(key).map(|(_, o)| o.clone()))
            .collect()
    }

    pub fn len(&self) -> usize {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).order.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The process's store.
static STORE: LazyLock<RecentOutcomes> = LazyLock::new(|| RecentOutcomes::new(CAPACITY));

/// The latest outcome of a record's delivery in this process, if it is among the [`CAPACITY`]
/// most recently handled records.
pub fn recent_outcome(scope: &Scope, record: &RecordId) -> Option<RecentOutcome> {
    STORE.get(scope, record)
}

/// Up to `limit` records' latest outcomes in this process, the most recently handled first.
pub fn recent_outcomes(limit: usize) -> Vec<RecentOutcome> {
    STORE.newest(limit)
}

/// The sink that fills the process's store; the application installs it on its runner.
pub(crate) fn sink() -> OutcomeSink {
    OutcomeSink::new(|scope, record, outcome, run_time| {
        STORE.insert(RecentOutcome::new(
            scope,
            record,
            outcome,
            run_time,
            SystemTime::now(),
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use leasehold_runtime::{Error, LogicError};

    fn outcome(record: &str, outcome: &Outcome, at_ms: u64) -> RecentOutcome {
        RecentOutcome::new(
            &Scope::parse("account").unwrap(),
            &RecordId::parse(record).unwrap(),
            outcome,
            Some(Duration::from_millis(1500)),
            UNIX_EPOCH + Duration::from_millis(at_ms),
        )
    }

    fn records(list: &[RecentOutcome]) -> Vec<&str> {
        list.iter().map(|o| o.record_id.as_str()).collect()
    }

    #[test]
    fn the_store_holds_each_records_latest_newest_first_and_drops_the_least_recent() {
        let store = RecentOutcomes::new(3);
        for (i, r) in ["a", "b", "c"].iter().enumerate() {
            store.insert(outcome(r, &Outcome::Coalesced, i as u64));
        }
        assert_eq!(records(&store.newest(10)), ["c", "b", "a"]);
        assert_eq!(records(&store.newest(2)), ["c", "b"]);
        // "a" again: its latest replaces the earlier one and makes it the most recent.
        let failed = Outcome::Failed {
            error: Error::Logic(LogicError::new("the CRM said no")),
            retriggered: false,
        };
        store.insert(outcome("a", &failed, 10));
        assert_eq!(records(&store.newest(10)), ["a", "c", "b"]);
        assert_eq!(store.len(), 3);
        let a = store
            .get(&Scope::parse("account").unwrap(), &RecordId::parse("a").unwrap())
            .unwrap();
        assert_eq!(a.outcome, "failed");
        assert!(a.message.contains("the CRM said no"), "{}", a.message);
        // A fourth record drops the least recently handled one, "b" (not "a", handled first).
        store.insert(outcome("d", &Outcome::Coalesced, 11));
        assert_eq!(records(&store.newest(10)), ["d", "a", "c"]);
        assert!(
            store
                .get(&Scope::parse("account").unwrap(), &RecordId::parse("b").unwrap())
                .is_none()
        );
        // Same id, other scope: another record.
        let other = RecentOutcome::new(
            &Scope::parse("contact").unwrap(),
            &RecordId::parse("d").unwrap(),
            &Outcome::Coalesced,
            None,
            UNIX_EPOCH,
        );
        store.insert(other);
        assert_eq!(store.len(), 3);
        assert_eq!(store.newest(1)[0].scope.as_str(), "contact");
        assert!(
            store
                .get(&Scope::parse("account").unwrap(), &RecordId::parse("d").unwrap())
                .is_some()
        );
    }

    #[test]
    fn the_store_never_holds_more_than_its_capacity() {
        let store = RecentOutcomes::new(CAPACITY);
        for i in 0..(CAPACITY + 500) {
            store.insert(outcome(&format!("r{i}"), &Outcome::Coalesced, i as u64));
        }
        assert_eq!(store.len(), CAPACITY);
        let newest = store.newest(usize::MAX);
        assert_eq!(newest.len(), CAPACITY);
        assert_eq!(newest[0].record_id.as_str(), format!("r{}", CAPACITY + 499));
        assert_eq!(newest[CAPACITY - 1].record_id.as_str(), "r500");
    }

    #[test]
    fn an_outcome_serialises_in_camel_case_with_its_times() {
        let completed = Outcome::Completed {
            fencing_token: Some(3),
            retriggered: true,
            run_time: Duration::from_millis(1500),
        };
        // 2026-11-23T10:20:30.456Z
        let json = serde_json::to_value(outcome("r1", &completed, 1_795_429_230_456)).unwrap();
        assert_eq!(json["scope"], "account");
        assert_eq!(json["recordId"], "r1");
        assert_eq!(json["outcome"], "retriggered");
        assert_eq!(json["finishedAt"], "2026-11-23T10:20:30.456Z");
        assert_eq!(json["finishedAtUnixMs"], 1_795_429_230_456u64);
        assert_eq!(json["runSeconds"], 1.5);
        assert!(json["message"].as_str().unwrap().contains("runs once more"));
        let no_run = RecentOutcome::new(
            &Scope::parse("account").unwrap(),
            &RecordId::parse("r2").unwrap(),
            &Outcome::Coalesced,
            None,
            UNIX_EPOCH,
        );
        let json = serde_json::to_value(no_run).unwrap();
        assert!(json.get("runSeconds").is_none(), "{json}");
        assert_eq!(json["finishedAt"], "1970-01-01T00:00:00Z");
    }

    /// A run put off says when it runs again, how long it has been put off in all, and why.
    #[test]
    fn a_deferral_says_when_it_runs_again() {
        let deferred = Outcome::Deferred {
            after: Duration::from_secs(120),
            total: Duration::from_secs(840),
            asked: Some(Duration::from_secs(120)),
            why: "logic URL crm/sync answered 429 Too Many Requests, Retry-After: 120".into(),
            next: Box::new(leasehold_runtime::TriggerMessage::parse("account", "r").unwrap()),
        };
        let json = serde_json::to_value(outcome("r", &deferred, 0)).unwrap();
        assert_eq!(json["outcome"], "deferred");
        assert_eq!(
            json["message"],
            "the logic asked to be run later (logic URL crm/sync answered 429 Too Many Requests, Retry-After: 120); it runs again in 120 s (put off 840 s in all)"
        );
    }

    #[test]
    fn a_long_message_is_cut_on_a_character_boundary() {
        let long = Outcome::Failed {
            error: Error::Logic(LogicError::new("é".repeat(1000))),
            retriggered: false,
        };
        let o = outcome("r", &long, 0);
        assert!(o.message.len() <= MAX_MESSAGE_BYTES);
        assert!(o.message.ends_with('…'));
    }
}
