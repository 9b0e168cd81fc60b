//! [`TableHistory`]: history in the account's Table service, a table per period.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use leasehold_storage::table::{Entity, TABLE_NOT_FOUND, TableClient, odata_literal};
use leasehold_storage::{Op, StoreError, StoreErrorKind};
use tokio::time::Instant;

use super::{HistoryEntry, HistoryStore, Recent, RecentQuery, newest_first, unix_ms};
use crate::record::{RecordId, Scope};

/// History in the account's Table service: one table per period of [`HistoryOptions::keep`]
/// (whole days), named `<prefix><yyyymmdd>` after the period's first day (UTC), dropped whole
/// once the period ended more than `keep` ago ([`sweep`](HistoryStore::sweep): a request per
/// period, not per entry). A scope's records are spread by a hash of the record over
/// [`BUCKETS`] partitions `<scope>|<bucket>` (the scope holds no `|`), so a write of many
/// records' entries is a few entity group transactions (one per partition per 100 records), and
/// no partition is hot however a bulk import is ordered. Each record's write is one entity whose
/// row key is `<record>|` and the newest entry's time inverted (`9999999999999 − ms`, then a
/// random suffix), so a record's entities are one key range of its partition, newest first,
/// and whose `Entries` property holds the write's entries as JSON (`Newest`, the newest entry's
/// time in 13 digits, lets [`recent`](HistoryStore::recent) filter by time). A record's history
/// within `keep` is in the current period's table and the one before: read in 2 requests.
#[derive(Debug, Clone)]
pub struct TableHistory {
    client: TableClient,
    prefix: String,
    period_days: u64,
    /// The bounds of one [`HistoryStore::recent`] read: requests, entities, time.
    recent_bounds: (usize, usize, Duration),
}

/// The longest `Entries` property written, in bytes (the service takes 64 KiB a property).
const MAX_ENTRIES_BYTES: usize = 30_000;

/// A history table prefix that makes no valid table names ([`TableHistory::check_prefix`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{0:?} is not a valid history table prefix: 1 to {MAX_HISTORY_PREFIX_LEN} letters and digits, starting with a letter"
)]
pub struct BadHistoryPrefix(pub String);

/// The longest table name prefix: a table name is at most 63 characters, 8 of them the date.
pub const MAX_HISTORY_PREFIX_LEN: usize = 55;

impl TableHistory {
    /// History in `client`'s account, tables named `<prefix><yyyymmdd>`, kept for `keep`
    /// (rounded up to whole days). `prefix`: letters and digits, starting with a letter, at
    /// most [`MAX_HISTORY_PREFIX_LEN`].
    pub fn new(client: TableClient, prefix: &str, keep: Duration) -> Result<Self, BadHistoryPrefix> {
        Self::check_prefix(prefix)?;
        Ok(Self {
            client,
            prefix: prefix.to_string(),
            period_days: keep.as_secs().div_ceil(DAY.as_secs()).max(1),
            recent_bounds: (RECENT_MAX_REQUESTS, RECENT_MAX_ENTITIES, RECENT_MAX_TIME),
        })
    }

    /// The same history, one [`HistoryStore::recent`] read making at most `requests` requests
    /// and reading at most `entities` entities for at most `time` ([`RECENT_MAX_REQUESTS`],
    /// [`RECENT_MAX_ENTITIES`] and [`RECENT_MAX_TIME`] unless set; tests lower them).
    pub fn with_recent_bounds(mut self, requests: usize, entities: usize, time: Duration) -> Self {
        self.recent_bounds = (requests.max(1), entities.max(1), time);
        self
    }

    /// Whether `prefix` makes valid table names, and if not why.
    pub fn check_prefix(prefix: &str) -> Result<(), BadHistoryPrefix> {
        let valid = !prefix.is_empty()
            && prefix.len() <= MAX_HISTORY_PREFIX_LEN
            && prefix.starts_with(|c: char| c.is_ascii_alphabetic())
            && prefix.chars().all(|c| c.is_ascii_alphanumeric());
        if valid {
            return Ok(());
        }
        Err(BadHistoryPrefix(prefix.to_string()))
    }

    /// The table prefix a deployment whose blob container is `container` uses by default: its
    /// letters and digits, after `history`.
    pub fn default_prefix(container: &str) -> String {
        let mut prefix: String = format!(
            "history{}",
            container
                .chars()
                .filter(char::is_ascii_alphanumeric)
                .collect::<String>()
        );
        prefix.truncate(MAX_HISTORY_PREFIX_LEN);
        prefix
    }

    /// The period (its number since the Unix epoch) `ms` falls in.
    fn period_of(&self, ms: u64) -> u64 {
        ms / DAY.as_millis() as u64 / self.period_days
    }

    /// The table of period `period`.
    fn table(&self, period: u64) -> String {
        let (y, m, d) = civil_from_days((period * self.period_days) as i64);
        format!("{}{y:04}{m:02}{d:02}", self.prefix)
    }

    /// The period a table of this history is of, from its name.
    fn period_of_table(&self, name: &str) -> Option<u64> {
        let date = name.strip_prefix(&self.prefix)?;
        if date.len() != 8 || !date.chars().all(|c| c.is_ascii_digit()) {
            return None;
        }
        let (y, m, d) = (
            date[..4].parse().ok()?,
            date[4..6].parse().ok()?,
            date[6..].parse().ok()?,
        );
        let days = days_from_civil(y, m, d);
        (days >= 0 && (days as u64).is_multiple_of(self.period_days)).then(|| days as u64 / self.period_days)
    }

    /// The partition of `record`'s entities: its scope and its bucket, by FNV-1a (a hash that
    /// is the same on every machine and version: readers find what any writer wrote).
    fn partition(scope: &Scope, record: &RecordId) -> String {
        let mut hash: u32 = 0x811c_9dc5;
        for byte in record.as_str().bytes() {
            hash = (hash ^ u32::from(byte)).wrapping_mul(0x0100_0193);
        }
        format!("{}|{:02x}", scope.as_str(), hash % BUCKETS)
    }

    /// The first row key of `record`'s entities in its partition; `record}` bounds them above
    /// (`}` sorts just after `|`, which no record holds).
    fn row_prefix(record: &RecordId) -> String {
        format!("{}|", record.as_str())
    }

    async fn insert(&self, table: &str, entities: &[Entity]) -> Result<(), StoreError> {
        match self.client.insert_batch(table, entities).await {
            Err(e) if e.code() == Some(TABLE_NOT_FOUND) => {
                self.client.create_table(table).await?;
                self.client.insert_batch(table, entities).await
            }
            other => other,
        }
    }
}

const DAY: Duration = Duration::from_secs(24 * 3600);

/// The partitions a scope's records are spread over in each table ([`TableHistory`]): enough
/// that no partition nears the service's 2,000 entities a second (a burst of 2,000 runs a
/// second is 125 a partition), few enough that a flush of many runs is a few requests.
pub const BUCKETS: u32 = 16;

/// The civil date (proleptic Gregorian, UTC) of `days` since 1970-01-01 (H. Hinnant's).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// Days since 1970-01-01 of the civil date `y-m-d`.
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if m > 2 { m - 3 } else { m + 9 } as i64;
    let doy = (153 * mp + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[async_trait]
impl HistoryStore for TableHistory {
    async fn append(&self, entries: &[HistoryEntry]) -> Result<(), StoreError> {
        // Each record's entries as entities of at most MAX_ENTRIES_BYTES of entries (one,
        // nearly always), by table and partition.
        let mut batches: BTreeMap<(String, String), Vec<Entity>> = BTreeMap::new();
        let mut records: Vec<(&Scope, &RecordId, Vec<&HistoryEntry>)> = Vec::new();
        let mut index: HashMap<(&Scope, &RecordId), usize> = HashMap::new();
        for entry in entries {
            let at = *index.entry((&entry.scope, &entry.record)).or_insert_with(|| {
                records.push((&entry.scope, &entry.record, Vec::new()));
                records.len() - 1
            });
            records[at].2.push(entry);
        }
        for (scope, record, list) in records {
            let mut groups: Vec<Vec<&HistoryEntry>> = vec![Vec::new()];
            let mut size = 0;
            for entry in list {
                let len = serde_json::to_string(entry).map_or(0, |s| s.len()) + 1;
                if size + len > MAX_ENTRIES_BYTES && !groups.last().is_some_and(Vec::is_empty) {
                    groups.push(Vec::new());
                    size = 0;
                }
                size += len;
                groups.last_mut().expect("one group at least").push(entry);
            }
            let partition = Self::partition(scope, record);
            for group in groups {
                let newest = group.iter().map(|e| e.time_ms).max().unwrap_or(0);
                let mut events: Vec<&str> = group.iter().map(|e| e.event.as_str()).collect();
                events.dedup();
                let mut entity = Entity::new();
                entity.insert("PartitionKey".into(), partition.clone().into());
                entity.insert(
                    "RowKey".into(),
                    format!(
                        "{}{:013}-{}",
                        Self::row_prefix(record),
                        9_999_999_999_999u64.saturating_sub(newest),
                        uuid::Uuid::new_v4().simple()
                    )
                    .into(),
                );
                entity.insert("Newest".into(), format!("{newest:013}").into());
                entity.insert("Scope".into(), scope.as_str().into());
                entity.insert("Events".into(), events.join(" ").into());
                entity.insert(
                    "Entries".into(),
                    serde_json::to_string(&group)
                        .map_err(|e| {
                            StoreError::new(StoreErrorKind::Rejected, Op::HistoryWrite, e.to_string())
                        })?
                        .into(),
                );
                batches
                    .entry((self.table(self.period_of(newest)), partition.clone()))
                    .or_default()
                    .push(entity);
            }
        }
        // One entity group transaction per partition and 100 entities, all under way at once.
        let mut writes = tokio::task::JoinSet::new();
        for ((table, _), entities) in batches {
            for chunk in entities.chunks(leasehold_storage::table::MAX_BATCH) {
                let (this, table, chunk) = (self.clone(), table.clone(), chunk.to_vec());
                writes.spawn(async move { this.insert(&table, &chunk).await });
            }
        }
        let mut failed = None;
        while let Some(done) = writes.join_next().await {
            match done {
                Ok(Ok(())) => {}
                Ok(Err(e)) => failed = failed.or(Some(e)),
                Err(e) => {
                    failed = failed.or(Some(StoreError::new(
                        StoreErrorKind::Transient,
                        Op::HistoryWrite,
                        format!("a history write task failed: {e}"),
                    )))
                }
            }
        }
        failed.map_or(Ok(()), Err)
    }

    async fn read(
        &self,
        scope: &Scope,
        record: &RecordId,
        keep: Duration,
        limit: usize,
    ) -> Result<Vec<HistoryEntry>, StoreError> {
        let now = unix_ms(SystemTime::now());
        let since = now.saturating_sub(keep.as_millis() as u64);
        let filter = format!(
            "PartitionKey eq {} and RowKey ge {} and RowKey lt {}",
            odata_literal(&Self::partition(scope, record)),
            odata_literal(&Self::row_prefix(record)),
            odata_literal(&format!("{}}}", record.as_str())),
        );
        let current = self.period_of(now);
        let mut found = Vec::new();
        for period in [current, current.saturating_sub(1)] {
            if found.len() >= limit || (period != current && self.period_of(since) > period) {
                break;
            }
            let table = self.table(period);
            let mut next = None;
            // A partition's page can be short and carry a continuation: read on while needed.
            for _ in 0..8 {
                let top = (limit - found.len().min(limit)).clamp(1, 1000) as u32;
                let (entities, more) = match self
                    .client
                    .query(&table, Some(&filter), Some(top), next.as_ref())
                    .await
                {
                    Ok(page) => page,
                    Err(e) if e.kind() == StoreErrorKind::NotFound => break,
                    Err(e) => return Err(e),
                };
                for entity in entities {
                    let Some(text) = entity.get("Entries").and_then(serde_json::Value::as_str) else {
                        continue;
                    };
                    match serde_json::from_str::<Vec<HistoryEntry>>(text) {
                        Ok(mut entries) => {
                            entries.reverse();
                            found.extend(entries.into_iter().filter(|e| e.time_ms >= since));
                        }
                        Err(e) => {
                            tracing::debug!(table, error = %e, "a history entity that is not this version's: skipped")
                        }
                    }
                }
                next = more;
                if next.is_none() || found.len() >= limit {
                    break;
                }
            }
        }
        found.sort_by_key(|e| std::cmp::Reverse(e.time_ms));
        found.truncate(limit);
        Ok(found)
    }

    /// Reads the period tables covering the window, newest first, with a `$filter` on the row
    /// key (and the scope's partitions): a query across partitions, which the service answers
    /// in key order (scope, then record), not time order, so every page of the window is read
    /// before the newest `limit` are known.
    ///
    /// Bounded, so a big table cannot hold a page up: at most [`RECENT_MAX_REQUESTS`] requests,
    /// [`RECENT_MAX_ENTITIES`] entities and [`RECENT_MAX_TIME`] in all (unless set otherwise,
    /// [`TableHistory::with_recent_bounds`]). Stopped at a bound, the
    /// answer is `partial`: what it read, newest first, with entries of records later in key
    /// order (and of older tables) missing, newer ones among them. A narrower window or a scope
    /// reads less.
    async fn recent(&self, query: &RecentQuery) -> Result<Recent, StoreError> {
        let started = Instant::now();
        let (max_requests, max_entities, max_time) = self.recent_bounds;
        let filter = Self::recent_filter(query);
        let (first, last) = (self.period_of(query.since_ms), self.period_of(query.until_ms));
        let mut found = Vec::new();
        let (mut requests, mut scanned, mut partial) = (0, 0, false);
        'tables: for period in (first..=last).rev() {
            let table = self.table(period);
            let mut next = None;
            loop {
                let left = max_time.saturating_sub(started.elapsed());
                if requests >= max_requests || scanned >= max_entities || left.is_zero() {
                    partial = true;
                    break 'tables;
                }
                requests += 1;
                let top = (max_entities - scanned).min(1000) as u32;
                let page = tokio::time::timeout(
                    left,
                    self.client.query(&table, Some(&filter), Some(top), next.as_ref()),
                )
                .await;
                let (entities, more) = match page {
                    Err(_) => {
                        partial = true;
                        break 'tables;
                    }
                    Ok(Ok(page)) => page,
                    Ok(Err(e)) if e.kind() == StoreErrorKind::NotFound => break,
                    Ok(Err(e)) => return Err(e),
                };
                scanned += entities.len();
                gather(entities, query, &table, &mut found);
                next = more;
                if next.is_none() {
                    break;
                }
            }
        }
        Ok(Recent {
            entries: newest_first(found, query.limit),
            partial,
            scanned,
        })
    }

    async fn sweep(&self, keep: Duration) -> Result<usize, StoreError> {
        let now = unix_ms(SystemTime::now());
        let mut dropped = 0;
        for name in self.client.list_tables(&self.prefix).await? {
            let Some(period) = self.period_of_table(&name) else {
                continue;
            };
            // The period's end, in ms.
            let end = (period + 1) * self.period_days * DAY.as_millis() as u64;
            if end + (keep.as_millis() as u64) < now && self.client.delete_table(&name).await? {
                dropped += 1;
            }
        }
        Ok(dropped)
    }
}

/// The most requests one [`TableHistory::recent`] makes.
pub const RECENT_MAX_REQUESTS: usize = 20;
/// The most entities one [`TableHistory::recent`] reads (each holds one write's entries: a
/// run's start and end, usually).
pub const RECENT_MAX_ENTITIES: usize = 10_000;
/// The longest one [`TableHistory::recent`] reads for, all requests together.
pub const RECENT_MAX_TIME: Duration = Duration::from_secs(10);
/// How much older than its entity's row key (its newest entry) an entry may be: the writer
/// gathers a record's entries for its flush interval (2 s) before one write, and a write may
/// wait for a slot; an entity newer than a window's end by up to this may still hold entries of
/// the window.
const ENTITY_SPAN: Duration = Duration::from_secs(600);

impl TableHistory {
    /// The `$filter` of a [`HistoryStore::recent`] read: entities whose newest entry is in
    /// `[since, until + ENTITY_SPAN]`, of `scope`'s partitions if given.
    ///
    /// By `Newest` (the newest entry's time by the writer's clock, 13 digits, so compared as
    /// text it compares as a number), not by the service's `Timestamp`: the entries' times are
    /// the writer's, so the window is cut by the same clock, whatever the skew between the writer
    /// and the service.
    fn recent_filter(query: &RecentQuery) -> String {
        let until = query.until_ms.saturating_add(ENTITY_SPAN.as_millis() as u64);
        let mut filter = format!("Newest ge '{:013}' and Newest le '{until:013}'", query.since_ms);
        if let Some(scope) = &query.scope {
            // A scope's partitions are `<scope>|<bucket>`; `}` sorts just above `|`.
            filter = format!(
                "PartitionKey ge {} and PartitionKey lt {} and {filter}",
                odata_literal(&format!("{}|", scope.as_str())),
                odata_literal(&format!("{}}}", scope.as_str())),
            );
        }
        filter
    }
}

/// Reads entities' entries into `found` (the ones `query` wants).
fn gather(entities: Vec<Entity>, query: &RecentQuery, table: &str, found: &mut Vec<HistoryEntry>) {
    for entity in entities {
        let Some(text) = entity.get("Entries").and_then(serde_json::Value::as_str) else {
            continue;
        };
        match serde_json::from_str::<Vec<HistoryEntry>>(text) {
            Ok(entries) => found.extend(entries.into_iter().filter(|e| query.wants(e))),
            Err(e) => {
                tracing::debug!(table, error = %e, "a history entity that is not this version's: skipped")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table filter bounds row keys (inverted times) by the window, with room for an
    /// entity's older entries, and a scope's partitions by `|` and the next character.
    #[test]
    fn the_recent_filter_bounds_the_newest_entry_and_a_scopes_partitions() {
        let query = RecentQuery {
            since_ms: 1_000_000,
            until_ms: 2_000_000,
            scope: Some(Scope::parse("account").unwrap()),
            events: Vec::new(),
            limit: 10,
        };
        let filter = TableHistory::recent_filter(&query);
        assert_eq!(
            filter,
            "PartitionKey ge 'account|' and PartitionKey lt 'account}' and \
             Newest ge '0000001000000' and Newest le '0000002600000'"
        );
    }

    /// A record's partition is its scope and one of [`BUCKETS`], the same on every machine;
    /// records spread over all of them.
    #[test]
    fn records_spread_over_their_scopes_buckets() {
        let scope = Scope::parse("account").unwrap();
        let record = |r: &str| RecordId::parse(r).unwrap();
        assert_eq!(TableHistory::partition(&scope, &record("a")), "account|0c");
        let mut seen = std::collections::BTreeMap::<String, usize>::new();
        for i in 0..1600 {
            *seen
                .entry(TableHistory::partition(&scope, &record(&format!("rec-{i}"))))
                .or_default() += 1;
        }
        assert_eq!(seen.len(), BUCKETS as usize, "{seen:?}");
        assert!(seen.values().all(|&n| (50..=150).contains(&n)), "{seen:?}");
    }
}
