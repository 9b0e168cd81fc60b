//! The system at a glance: which records are held and by whom, which have a retrigger
//! pending, which wait for their burst of triggers to end, how deep the queues are and how old
//! their oldest message is.
//!
//! Built from three blob listings (the lock blobs `locks/<scope>/<record>` with their lease
//! state and metadata, the retrigger markers `retrigger/<scope>/<record>` and the wait markers
//! `waiting/<scope>/<record>`): one List Blobs request per 5,000 records, never a request per
//! record, plus four queue requests per lane.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Bound;
use std::time::SystemTime;

use leasehold_lock::{LOCK_PREFIX, RecordedHold};
use leasehold_runtime::{MARKER_PREFIX, RecordId, Scope, TriggerQueue, WAIT_PREFIX};
use leasehold_storage::azure::{BlobContainer, ListedBlob};
use serde::{Deserialize, Serialize};

use super::{Operator, OpsError, clock};

/// Most blobs one List Blobs request returns (the service's page limit).
const LIST_PAGE: u32 = 5000;
/// Held records an overview shows unless asked for another number.
pub const DEFAULT_LIMIT: usize = 100;

/// What [`Operator::overview`] shows.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OverviewQuery {
    /// Only records of this scope.
    pub scope: Option<Scope>,
    /// At most this many held records and this many pending retriggers (default 100).
    pub limit: Option<usize>,
    /// Show records after this `scope/record` (the previous page's `next`).
    pub after: Option<String>,
}

/// A queue's depth and the age of its oldest visible message.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct QueueView {
    pub name: String,
    /// Messages visible or not, as the service estimates them.
    pub approximate_messages: u64,
    /// When the oldest visible message was put (none when nothing is visible).
    #[serde(serialize_with = "clock::serialize_opt")]
    pub oldest_visible_at: Option<SystemTime>,
    pub oldest_visible_age_seconds: Option<f64>,
}

/// A record whose lease is held now.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct HeldRecord {
    pub scope: Scope,
    pub record_id: RecordId,
    /// `leased`, or `breaking` (an operator broke it; the holder is told at its next renewal).
    pub lease_state: String,
    pub holder: Option<String>,
    #[serde(serialize_with = "clock::serialize_opt")]
    pub since: Option<SystemTime>,
    pub since_age_seconds: Option<f64>,
    /// The fencing token of the current grant.
    pub generation: u64,
    pub retrigger_pending: bool,
}

/// A record whose triggers wait for its burst to end.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WaitingRecord {
    pub scope: Scope,
    pub record_id: RecordId,
    /// When its wait marker last changed: its first trigger, or the last that joined.
    #[serde(serialize_with = "clock::serialize_opt")]
    pub last_trigger_at: Option<SystemTime>,
    pub last_trigger_age_seconds: Option<f64>,
}

/// A record named by scope and id.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RecordRef {
    pub scope: Scope,
    pub record_id: RecordId,
}

/// The system at a glance.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Overview {
    #[serde(serialize_with = "clock::serialize")]
    pub at: SystemTime,
    pub scope: Option<Scope>,
    /// The high lane's trigger queue and poison queue.
    pub queue: QueueView,
    pub poison: QueueView,
    /// The low lane's (bulk traffic), when the deployment has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub low_queue: Option<QueueView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub low_poison: Option<QueueView>,
    /// Held records of this page. A page is the next `limit` records after `after` that are
    /// held or have a retrigger pending, in `scope/record` order.
    pub held: Vec<HeldRecord>,
    /// All held records (of the scope).
    pub held_count: usize,
    /// Records whose retrigger marker is set: a trigger arrived during their run and the
    /// holder has not yet taken it (those of this page).
    pub pending: Vec<RecordRef>,
    pub pending_count: usize,
    /// Records waiting for their burst of triggers to end (`LEASEHOLD_DEBOUNCE_SECONDS`), the
    /// first `limit` of them in `scope/record` order, and how long ago a trigger last joined
    /// each. One that has waited far longer than `LEASEHOLD_DEBOUNCE_MAX_SECONDS` is suspect.
    pub waiting: Vec<WaitingRecord>,
    pub waiting_count: usize,
    /// Records that have a lock blob (every record that ever ran), held or not.
    pub records_seen: usize,
    /// Pass as `after` for the next page, when there is one.
    pub next: Option<String>,
    /// Storage requests this overview took.
    pub requests: u64,
}

/// `scope/record` of a blob under `prefix`, if it names one.
fn record_of(name: &str, prefix: &str) -> Option<RecordRef> {
    let (scope, record) = name.strip_prefix(prefix)?.split_once('/')?;
    Some(RecordRef {
        scope: Scope::parse(scope).ok()?,
        record_id: RecordId::parse(record).ok()?,
    })
}

fn key_of(r: &RecordRef) -> String {
    format!("{}/{}", r.scope, r.record_id)
}

/// Every blob under `prefix`, page by page (one request a page).
async fn list_all(
    container: &BlobContainer,
    prefix: &str,
    retry: &leasehold_lock::RetryOptions,
    mut each: impl FnMut(ListedBlob),
) -> Result<(), OpsError> {
    let mut marker: Option<String> = None;
    loop {
        let page = retry
            .run("list blobs", || {
                container.list_page(prefix, marker.as_deref(), LIST_PAGE)
            })
            .await
            .map_err(|e| OpsError::storage("list blobs", e))?;
        page.blobs.into_iter().for_each(&mut each);
        match page.next_marker {
            Some(next) => marker = Some(next),
            None => return Ok(()),
        }
    }
}

impl Operator {
    /// The system at a glance (see the module's documentation for what it costs).
    pub async fn overview(&self, query: &OverviewQuery) -> Result<Overview, OpsError> {
        let before = self.requests();
        let limit = query.limit.unwrap_or(DEFAULT_LIMIT).max(1);
        let scoped = |prefix: &str| match &query.scope {
            Some(scope) => format!("{prefix}{scope}/"),
            None => prefix.to_string(),
        };
        let inner = &self.inner;
        let (high_queue, high_poison) = self.high_lane();
        let low = self.low_lane();
        let low_views = async {
            match low {
                Some((q, p)) => {
                    let (q, p) = tokio::join!(self.queue_view(&**q), self.queue_view(&**p));
                    Ok::<_, OpsError>(Some((q?, p?)))
                }
                None => Ok(None),
            }
        };
        let (markers, waits, locks, queue, poison, low_views) = tokio::join!(
            async {
                let mut pending = BTreeSet::new();
                list_all(&inner.container, &scoped(MARKER_PREFIX), &inner.retry, |blob| {
                    pending.extend(record_of(&blob.name, MARKER_PREFIX));
                })
                .await
                .map(|()| pending)
            },
            async {
                let mut waiting = BTreeMap::new();
                list_all(&inner.container, &scoped(WAIT_PREFIX), &inner.retry, |blob| {
                    if let Some(record) = record_of(&blob.name, WAIT_PREFIX) {
                        waiting.insert(key_of(&record), (record, blob.last_modified));
                    }
                })
                .await
                .map(|()| waiting)
            },
            async {
                let mut seen = 0usize;
                let mut held = Vec::new();
                list_all(&inner.container, &scoped(LOCK_PREFIX), &inner.retry, |blob| {
                    let Some(record) = record_of(&blob.name, LOCK_PREFIX) else {
                        return;
                    };
                    seen += 1;
                    if blob.lease.is_held() {
                        held.push((record, blob));
                    }
                })
                .await
                .map(|()| (seen, held))
            },
            self.queue_view(&**high_queue),
            self.queue_view(&**high_poison),
            low_views,
        );
        let (low_queue, low_poison) = low_views?.unzip();
        let pending = markers?;
        let waits = waits?;
        let (records_seen, held) = locks?;
        let now = SystemTime::now();
        let after = query.after.as_deref().unwrap_or("");
        let (held_count, pending_count) = (held.len(), pending.len());
        // One page over the records that are held or have a retrigger pending, in the order
        // blob names list in (`scope/record` as a string), so `next` pages through both.
        let mut page: BTreeMap<String, (RecordRef, Option<ListedBlob>, bool)> = BTreeMap::new();
        for (record, blob) in held {
            page.insert(key_of(&record), (record, Some(blob), false));
        }
        for record in pending {
            page.entry(key_of(&record))
                .or_insert_with(|| (record, None, false))
                .2 = true;
        }
        let mut keys = page.range::<str, _>((Bound::Excluded(after), Bound::Unbounded));
        let mut shown = Vec::new();
        let mut pending_shown = Vec::new();
        let mut last = None;
        for (key, (record, blob, retrigger_pending)) in keys.by_ref().take(limit) {
            last = Some(key.clone());
            if *retrigger_pending {
                pending_shown.push(record.clone());
            }
            let Some(blob) = blob else { continue };
            let hold = RecordedHold::of(&blob.metadata, blob.sequence);
            shown.push(HeldRecord {
                retrigger_pending: *retrigger_pending,
                lease_state: blob.lease.as_str().to_string(),
                holder: hold.holder,
                since: hold.since,
                since_age_seconds: hold.since.map(|s| clock::age_seconds(s, now)),
                generation: hold.generation,
                scope: record.scope.clone(),
                record_id: record.record_id.clone(),
            });
        }
        let next = keys.next().and(last);
        let pending = pending_shown;
        let waiting_count = waits.len();
        let waiting = waits
            .into_values()
            .take(limit)
            .map(|(record, at)| WaitingRecord {
                scope: record.scope,
                record_id: record.record_id,
                last_trigger_at: at,
                last_trigger_age_seconds: at.map(|at| clock::age_seconds(at, now)),
            })
            .collect();
        Ok(Overview {
            at: now,
            scope: query.scope.clone(),
            queue: queue?,
            poison: poison?,
            low_queue,
            low_poison,
            held: shown,
            held_count,
            pending,
            pending_count,
            waiting,
            waiting_count,
            records_seen,
            next,
            requests: self.requests() - before,
        })
    }

    /// A queue's depth (one request) and the age of its oldest visible message (one peek).
    pub(super) async fn queue_view(&self, queue: &dyn TriggerQueue) -> Result<QueueView, OpsError> {
        let retry = &self.inner.retry;
        let (depth, front) = tokio::join!(
            retry.run("queue length", || queue.approximate_len()),
            retry.run("peek", || queue.peek(1)),
        );
        let depth = depth.map_err(|e| OpsError::storage("queue length", e))?;
        let oldest = front
            .map_err(|e| OpsError::storage("peek", e))?
            .into_iter()
            .next()
            .and_then(|m| m.inserted_at);
        let now = SystemTime::now();
        Ok(QueueView {
            name: queue.name().to_string(),
            approximate_messages: depth,
            oldest_visible_at: oldest,
            oldest_visible_age_seconds: oldest.map(|at| clock::age_seconds(at, now)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blob_names_read_back_as_records() {
        let r = record_of("locks/account/8f9c1d2e-0000-4000-8000-000000000001", LOCK_PREFIX).unwrap();
        assert_eq!(
            (r.scope.as_str(), r.record_id.as_str()),
            ("account", "8f9c1d2e-0000-4000-8000-000000000001")
        );
        assert_eq!(
            record_of("retrigger/default/r1", MARKER_PREFIX)
                .unwrap()
                .record_id
                .as_str(),
            "r1"
        );
        // Not a record's blob: another prefix, no scope, or a name no record can have.
        assert!(record_of("other/default/r1", LOCK_PREFIX).is_none());
        assert!(record_of("locks/r1", LOCK_PREFIX).is_none());
        assert!(record_of("locks/default/a b", LOCK_PREFIX).is_none());
    }
}
