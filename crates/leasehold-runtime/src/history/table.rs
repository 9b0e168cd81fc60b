//! [`TableHistory`]: history in the account's Table service, a table per period.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use leasehold_storage::table::{Entity, TABLE_NOT_FOUND, TableClient, odata_literal};
use leasehold_storage::{Op, StoreError, StoreErrorKind};
use tokio::time::Instant;

use super::naming::{MAX_HISTORY_DAYS, TableSpan};
use super::{HistoryEntry, HistoryStore, Recent, RecentQuery, newest_first, unix_ms};
use crate::record::{RecordId, Scope};

/// History in the account's Table service: one table per period of [`HistoryOptions::keep`]
/// (whole days, `P`), named `<prefix>p<P>d<yyyymmdd>` after the period's length and first day
/// (UTC), dropped whole once the period ended more than the longer of `keep` and its own length
/// ago ([`sweep`](HistoryStore::sweep): a request per period, not per entry; see `naming.rs`).
/// A scope's records are spread by a hash of the record over [`BUCKETS`] partitions
/// `<scope>|<bucket>` (the scope holds no `|`), so a write of many records' entries is a few
/// entity group transactions (one per partition per 100 records), and no partition is hot
/// however a bulk import is ordered. Each record's write is one entity whose row key is
/// `<record>|` and the newest entry's time inverted (`9999999999999 − ms`, then a random
/// suffix), so a record's entities are one key range of its partition, newest first,
/// and whose `Entries` property holds the write's entries as JSON (`Newest`, the newest entry's
/// time in 13 digits, lets [`recent`](HistoryStore::recent) filter by time). A record's history
/// within `keep` is in the current period's table and the one before: read in 2 requests (and
/// a listing of the prefix's tables, kept for [`LISTING_KEPT`], that finds the tables a
/// deployment with other days on the same prefix wrote, or the first layout's).
///
/// [`HistoryOptions::keep`]: super::HistoryOptions::keep
#[derive(Debug, Clone)]
pub struct TableHistory {
    client: TableClient,
    prefix: String,
    period_days: u64,
    /// The bounds of one [`HistoryStore::recent`] read: requests, entities, time.
    recent_bounds: (usize, usize, Duration),
    /// The prefix's tables as last listed, and when.
    listing: Arc<Mutex<Option<Listing>>>,
}

/// A listing of the prefix's tables and when it was made.
type Listing = (Instant, Arc<Vec<String>>);

/// How long a listing of the prefix's tables is used by reads before it is listed again: a
/// table another deployment (other days, same prefix) starts is read within this.
pub const LISTING_KEPT: Duration = Duration::from_secs(300);

/// The longest `Entries` property written, in bytes (the service takes 64 KiB a property).
const MAX_ENTRIES_BYTES: usize = 30_000;

/// A history table prefix that makes no valid table names ([`TableHistory::check_prefix`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{0:?} is not a valid history table prefix: 1 to {MAX_HISTORY_PREFIX_LEN} letters and digits, starting with a letter"
)]
pub struct BadHistoryPrefix(pub String);

/// The longest table name prefix: a table name is at most 63 characters, 13 of them the
/// period (`p<days>d`, days up to [`MAX_HISTORY_DAYS`]) and its date.
pub const MAX_HISTORY_PREFIX_LEN: usize = 50;

impl TableHistory {
    /// History in `client`'s account, tables named `<prefix>p<days>d<yyyymmdd>`, kept for
    /// `keep` (rounded up to whole days, at most [`MAX_HISTORY_DAYS`] a table). `prefix`:
    /// letters and digits, starting with a letter, at most [`MAX_HISTORY_PREFIX_LEN`].
    pub fn new(client: TableClient, prefix: &str, keep: Duration) -> Result<Self, BadHistoryPrefix> {
        Self::check_prefix(prefix)?;
        Ok(Self {
            client,
            prefix: prefix.to_string(),
            period_days: keep.as_secs().div_ceil(DAY.as_secs()).clamp(1, MAX_HISTORY_DAYS),
            recent_bounds: (RECENT_MAX_REQUESTS, RECENT_MAX_ENTITIES, RECENT_MAX_TIME),
            listing: Arc::default(),
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
        TableSpan::name(&self.prefix, period * self.period_days, self.period_days)
    }

    /// The prefix's tables, listed at most every [`LISTING_KEPT`] (`None`: the listing failed).
    async fn listing(&self) -> Option<Arc<Vec<String>>> {
        if let Some((at, names)) = &*self.listing.lock().unwrap()
            && at.elapsed() < LISTING_KEPT
        {
            return Some(names.clone());
        }
        match self.client.list_tables(&self.prefix).await {
            Ok(names) => {
                let names = Arc::new(names);
                *self.listing.lock().unwrap() = Some((Instant::now(), names.clone()));
                Some(names)
            }
            Err(e) => {
                tracing::debug!(error = %e, "could not list the history tables: reading this deployment's own");
                None
            }
        }
    }

    /// The tables that may hold entries of `[since_ms, until_ms]`, newest first: this
    /// history's own periods' (named from the times: found without a listing), and any other
    /// the listing has whose window meets it (a period of other days on the same prefix, a
    /// table of the first layout).
    async fn tables_for(&self, since_ms: u64, until_ms: u64) -> Vec<String> {
        let mut tables: Vec<(u64, String)> = (self.period_of(since_ms)..=self.period_of(until_ms))
            .map(|period| {
                let end = (period + 1) * self.period_days * DAY.as_millis() as u64;
                (end, self.table(period))
            })
            .collect();
        if let Some(names) = self.listing().await {
            let spans: Vec<(TableSpan, &String)> = names
                .iter()
                .filter_map(|name| Some((TableSpan::parse(&self.prefix, name)?, name)))
                .collect();
            let mut first_layout: Vec<u64> = spans
                .iter()
                .filter(|(span, _)| span.days.is_none())
                .map(|(span, _)| span.start_day)
                .collect();
            first_layout.sort_unstable();
            for (span, name) in &spans {
                let next = span
                    .days
                    .is_none()
                    .then(|| first_layout.iter().copied().find(|&d| d > span.start_day))
                    .flatten();
                let (start, end) = span.read_window(next, self.period_days);
                if start <= until_ms && end > since_ms && !tables.iter().any(|(_, t)| t == *name) {
                    tables.push((end, (*name).clone()));
                }
            }
        }
        tables.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
        tables.into_iter().map(|(_, name)| name).collect()
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

pub(super) const DAY: Duration = Duration::from_secs(24 * 3600);

/// The partitions a scope's records are spread over in each table ([`TableHistory`]): enough
/// that no partition nears the service's 2,000 entities a second (a burst of 2,000 runs a
/// second is 125 a partition), few enough that a flush of many runs is a few requests.
pub const BUCKETS: u32 = 16;

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
        let mut found = Vec::new();
        // Every table that may hold entries of the window (its own two, nearly always): tables
        // of other days may overlap, so the newest `limit` are known once all are read.
        for table in self.tables_for(since, now).await {
            let mut next = None;
            let mut got = 0;
            // A partition's page can be short and carry a continuation: read on while needed.
            for _ in 0..8 {
                let top = (limit - got.min(limit)).clamp(1, 1000) as u32;
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
                            let before = found.len();
                            found.extend(entries.into_iter().filter(|e| e.time_ms >= since));
                            got += found.len() - before;
                        }
                        Err(e) => {
                            tracing::debug!(table, error = %e, "a history entity that is not this version's: skipped")
                        }
                    }
                }
                next = more;
                if next.is_none() || got >= limit {
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
        let mut found = Vec::new();
        let (mut requests, mut scanned, mut partial) = (0, 0, false);
        'tables: for table in self.tables_for(query.since_ms, query.until_ms).await {
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
        let mut names = self.client.list_tables(&self.prefix).await?;
        // A deployment keeping longer on this prefix (its tables say how long: their periods
        // are its days) keeps its days here too: none of its entries is dropped by this one.
        let longest = names
            .iter()
            .filter_map(|name| TableSpan::parse(&self.prefix, name)?.days)
            .max()
            .unwrap_or(0);
        let keep = keep.max(DAY * longest as u32);
        let mut kept = Vec::with_capacity(names.len());
        for name in names.drain(..) {
            // Never a name it cannot read (another prefix's that starts the same, or not a
            // history table); each by its own period's length, not this history's.
            let drop = TableSpan::parse(&self.prefix, &name).is_some_and(|span| span.droppable(keep, now));
            if drop && self.client.delete_table(&name).await? {
                dropped += 1;
            } else if !drop {
                kept.push(name);
            }
        }
        *self.listing.lock().unwrap() = Some((Instant::now(), Arc::new(kept)));
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
