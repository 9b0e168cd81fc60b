//! [`MemoryHistory`]: history in memory, for tests and the simulation.

use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use leasehold_storage::StoreError;

use super::{HistoryEntry, HistoryStore, Recent, RecentQuery, newest_first, unix_ms};
use crate::record::{RecordId, Scope};

/// History in memory: for tests and the simulation.
#[derive(Debug, Default)]
pub struct MemoryHistory {
    entries: Mutex<Vec<HistoryEntry>>,
    /// Appends (requests) made.
    appends: Mutex<u64>,
}

impl MemoryHistory {
    pub fn new() -> Self {
        Self::default()
    }

    /// Every entry kept, oldest first.
    pub fn all(&self) -> Vec<HistoryEntry> {
        self.entries.lock().unwrap().clone()
    }

    /// How many appends (requests) were made.
    pub fn appends(&self) -> u64 {
        *self.appends.lock().unwrap()
    }
}

#[async_trait]
impl HistoryStore for MemoryHistory {
    async fn append(&self, entries: &[HistoryEntry]) -> Result<(), StoreError> {
        *self.appends.lock().unwrap() += 1;
        self.entries.lock().unwrap().extend_from_slice(entries);
        Ok(())
    }

    async fn read(
        &self,
        scope: &Scope,
        record: &RecordId,
        keep: Duration,
        limit: usize,
    ) -> Result<Vec<HistoryEntry>, StoreError> {
        let since = unix_ms(SystemTime::now()).saturating_sub(keep.as_millis() as u64);
        let mut found: Vec<HistoryEntry> = self
            .entries
            .lock()
            .unwrap()
            .iter()
            .filter(|e| &e.scope == scope && &e.record == record && e.time_ms >= since)
            .cloned()
            .collect();
        // Newest first; of the same millisecond, the later written first.
        found.reverse();
        found.sort_by_key(|e| std::cmp::Reverse(e.time_ms));
        found.truncate(limit);
        Ok(found)
    }

    async fn sweep(&self, keep: Duration) -> Result<usize, StoreError> {
        let since = unix_ms(SystemTime::now()).saturating_sub(keep.as_millis() as u64);
        let mut entries = self.entries.lock().unwrap();
        let before = entries.len();
        entries.retain(|e| e.time_ms >= since);
        Ok(usize::from(entries.len() < before))
    }

    async fn recent(&self, query: &RecentQuery) -> Result<Recent, StoreError> {
        let entries = self.entries.lock().unwrap();
        let found: Vec<HistoryEntry> = entries.iter().filter(|e| query.wants(e)).cloned().collect();
        Ok(Recent {
            entries: newest_first(found, query.limit),
            partial: false,
            scanned: entries.len(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::HistoryEvent;
    use crate::observe::OutcomeLabel;

    /// `recent` reads every record's entries in the window, of the scope and events asked,
    /// newest first, at most `limit`.
    #[tokio::test]
    async fn recent_entries_across_records_are_filtered_and_newest_first() {
        let store = MemoryHistory::new();
        let at = |record: &str, scope: &str, event, ms: u64| {
            let mut e = HistoryEntry::new(
                Scope::parse(scope).unwrap(),
                RecordId::parse(record).unwrap(),
                event,
            );
            e.time_ms = ms;
            e
        };
        let completed = HistoryEvent::Outcome(OutcomeLabel::Completed);
        let failed = HistoryEvent::Outcome(OutcomeLabel::Failed);
        store
            .append(&[
                at("1", "account", HistoryEvent::Started, 1_000),
                at("1", "account", completed, 2_000),
            ])
            .await
            .unwrap();
        store.append(&[at("2", "contact", failed, 3_000)]).await.unwrap();
        store
            .append(&[at("3", "account", completed, 9_000)])
            .await
            .unwrap();
        store.append(&[at("4", "account", completed, 500)]).await.unwrap();
        let query = |scope: Option<&str>, events: Vec<HistoryEvent>, limit| RecentQuery {
            since_ms: 1_000,
            until_ms: 5_000,
            scope: scope.map(|s| Scope::parse(s).unwrap()),
            events,
            limit,
        };
        let ids = |r: Recent| -> Vec<(String, &'static str)> {
            assert!(!r.partial);
            r.entries
                .iter()
                .map(|e| (e.record.as_str().to_string(), e.event.as_str()))
                .collect()
        };
        let all = store.recent(&query(None, vec![], 10)).await.unwrap();
        assert_eq!(
            ids(all),
            [
                ("2".to_string(), "failed"),
                ("1".into(), "completed"),
                ("1".into(), "started")
            ],
            "the window only (not 500 nor 9000), newest first"
        );
        let runs = store
            .recent(&query(Some("account"), vec![completed, failed], 10))
            .await
            .unwrap();
        assert_eq!(ids(runs), [("1".to_string(), "completed")], "the scope's runs");
        let failures = store.recent(&query(None, vec![failed], 10)).await.unwrap();
        assert_eq!(ids(failures), [("2".to_string(), "failed")]);
        let one = store.recent(&query(None, vec![], 1)).await.unwrap();
        assert_eq!(ids(one), [("2".to_string(), "failed")], "the newest of them");
    }
}
