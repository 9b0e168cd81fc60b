//! The poison queue: list, show, requeue and purge what was given up.
//!
//! Azure queues can show (peek) only the first 32 visible messages, and can delete or change a
//! message only with the receipt of taking it. So anything beyond a peek *scans*: it takes the
//! entries 32 at a time, hiding them for a while (60 s, or two seconds a batch for a deep
//! queue), acts on the ones selected, and puts the others back (visible at once). If the scan dies, the entries it hid come back on their
//! own when the hiding ends: nothing is lost.
//!
//! A requeue puts a fresh trigger for the entry's record on the trigger queue first and removes
//! the entry only after that put succeeded. Dying between the two leaves the trigger in both
//! places (the record runs, and the entry is still there to look at or purge), never in
//! neither.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, SystemTime};

use leasehold_runtime::{PoisonMessage, Received, RecordId, Scope, TriggerMessage};
use leasehold_storage::StoreErrorKind;
use serde::{Deserialize, Serialize};

use super::{Operator, OpsError, QueueView, clock};

/// Most entries one peek shows (the service's limit).
pub const PEEK_MAX: usize = 32;
/// Most of an unreadable entry's body shown, in bytes.
const BODY_SHOWN: usize = 4 * 1024;

/// What [`Operator::poison_list`] shows.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PoisonQuery {
    /// At most this many entries (default 32). Up to 32 are peeked, with no side effect; more
    /// are scanned (taken and put back, see the module documentation).
    pub limit: Option<usize>,
}

/// One poison entry, as read from the queue.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PoisonEntry {
    /// The queue message id: what `show`, `requeue` and `purge` take.
    pub id: String,
    /// When the entry was written (when the trigger was given up).
    #[serde(serialize_with = "clock::serialize_opt")]
    pub inserted_at: Option<SystemTime>,
    pub scope: Option<Scope>,
    pub record_id: Option<RecordId>,
    /// The given-up message's kind (`trigger`, `retrigger`, `sweep`, …).
    pub kind: Option<String>,
    /// Why it was given up.
    pub reason: String,
    /// Failed deliveries of the trigger, counting those of the messages it was carried over from.
    pub attempts: u32,
    pub correlation_id: Option<String>,
    /// Whether the entry holds a trigger (and can be requeued); an unreadable message cannot.
    pub is_trigger: bool,
    /// The body of a message that is no trigger (its start, when long).
    pub body: Option<String>,
    /// The trigger to requeue (not shown: `scope`, `recordId` and `correlationId` say it).
    #[serde(skip)]
    trigger: Option<TriggerMessage>,
}

/// The entries of one record in a listing.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PoisonRecord {
    pub scope: Scope,
    pub record_id: RecordId,
    pub entries: usize,
    /// The highest attempt count among the entries.
    pub attempts: u32,
    #[serde(serialize_with = "clock::serialize_opt")]
    pub first_seen: Option<SystemTime>,
    #[serde(serialize_with = "clock::serialize_opt")]
    pub last_seen: Option<SystemTime>,
    /// The reason of the latest entry.
    pub reason: String,
}

/// A poison listing.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PoisonList {
    #[serde(serialize_with = "clock::serialize")]
    pub at: SystemTime,
    pub poison: QueueView,
    /// Oldest first.
    pub entries: Vec<PoisonEntry>,
    /// The entries grouped by record, the most recently poisoned first.
    pub records: Vec<PoisonRecord>,
    /// Whether `entries` is every visible entry (not cut at the limit).
    pub complete: bool,
}

/// Which entries [`Operator::poison_requeue`] and [`Operator::poison_purge`] act on: JSON
/// `{"ids": [..]}`, `{"scope": "..", "recordId": ".."}` (either or both), or `{"all": true}`.
///
/// Unknown fields are refused: a misspelt `recordID` must not quietly widen a purge to the whole
/// scope.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoisonSelection {
    #[serde(default)]
    pub ids: Vec<String>,
    pub scope: Option<Scope>,
    pub record_id: Option<RecordId>,
    #[serde(default)]
    pub all: bool,
}

impl PoisonSelection {
    /// Entries with these ids.
    pub fn ids(ids: impl IntoIterator<Item = String>) -> Self {
        Self {
            ids: ids.into_iter().collect(),
            ..Self::default()
        }
    }

    /// Every entry.
    pub fn all() -> Self {
        Self {
            all: true,
            ..Self::default()
        }
    }

    /// Entries of a scope, or of one record.
    pub fn matching(scope: Option<Scope>, record_id: Option<RecordId>) -> Self {
        Self {
            scope,
            record_id,
            ..Self::default()
        }
    }

    fn check(&self) -> Result<(), OpsError> {
        let by_id = !self.ids.is_empty();
        let by_record = self.scope.is_some() || self.record_id.is_some();
        match (by_id, by_record, self.all) {
            (true, false, false) | (false, true, false) | (false, false, true) => Ok(()),
            (false, false, false) => Err(OpsError::BadRequest(
                "select the entries: ids, a scope and/or a record id, or all".into(),
            )),
            _ => Err(OpsError::BadRequest(
                "select the entries one way only: ids, a scope and/or a record id, or all".into(),
            )),
        }
    }

    fn selects(&self, entry: &PoisonEntry) -> bool {
        if self.all {
            return true;
        }
        if !self.ids.is_empty() {
            return self.ids.contains(&entry.id);
        }
        self.scope
            .as_ref()
            .is_none_or(|s| entry.scope.as_ref() == Some(s))
            && self
                .record_id
                .as_ref()
                .is_none_or(|r| entry.record_id.as_ref() == Some(r))
    }

    /// Whether every selected entry has been seen (only ids can be all found before the end).
    fn satisfied(&self, found: &BTreeSet<String>) -> bool {
        !self.ids.is_empty() && self.ids.iter().all(|id| found.contains(id))
    }
}

/// How far a requeue or purge has come (reported as it goes).
#[derive(Debug, Clone, Copy, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Progress {
    /// Entries looked at so far.
    pub scanned: usize,
    /// Entries acted on so far.
    pub done: usize,
    /// The poison queue's approximate depth when the operation began.
    pub total: u64,
}

/// An entry requeued as a fresh trigger.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Requeued {
    pub id: String,
    pub scope: Scope,
    pub record_id: RecordId,
    pub correlation_id: Option<String>,
}

/// An entry not acted on, and why.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Skipped {
    pub id: String,
    pub why: String,
}

/// What [`Operator::poison_requeue`] did.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RequeueReport {
    pub requeued: Vec<Requeued>,
    /// Selected entries that hold no trigger (nothing to requeue; purge them).
    pub skipped: Vec<Skipped>,
    /// Selected entries a storage step failed for; each is still in the poison queue (and, if
    /// its trigger was put, on the trigger queue too).
    pub failed: Vec<Skipped>,
    /// Ids asked for that are not in the poison queue (or are hidden by another scan).
    pub not_found: Vec<String>,
    pub scanned: usize,
    /// Whether the scan reached the end of the queue (else run it again for the rest).
    pub complete: bool,
    /// What was done, in one sentence.
    pub message: String,
}

/// What [`Operator::poison_purge`] did.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PurgeReport {
    pub purged: Vec<String>,
    pub failed: Vec<Skipped>,
    pub not_found: Vec<String>,
    pub scanned: usize,
    /// Whether the scan reached the end of the queue (else run it again for the rest).
    pub complete: bool,
    pub message: String,
}

/// What a scan does with an entry it took.
enum Act {
    /// Put it back.
    Keep,
    Requeue,
    Purge,
}

/// Reads a poison queue message: an entry Leasehold wrote, a bare trigger (the Functions host
/// moves a message there itself after `maxDequeueCount` deliveries), or something else.
fn entry_of(id: String, inserted_at: Option<SystemTime>, body: &str) -> PoisonEntry {
    let from_trigger = |trigger: TriggerMessage, reason: String, attempts: u32| PoisonEntry {
        id: id.clone(),
        inserted_at,
        scope: Some(trigger.scope.clone()),
        record_id: Some(trigger.record_id.clone()),
        kind: Some(kind_name(&trigger)),
        reason,
        attempts,
        correlation_id: trigger.correlation_id.clone(),
        is_trigger: true,
        body: None,
        trigger: Some(trigger),
    };
    if let Ok(poison) = PoisonMessage::decode(body) {
        let attempts = poison.dequeue_count + poison.trigger.as_ref().map_or(0, |t| t.prior_attempts);
        return match poison.trigger.clone() {
            Some(trigger) => from_trigger(trigger, poison.reason().to_string(), attempts),
            None => PoisonEntry {
                id,
                inserted_at,
                scope: None,
                record_id: None,
                kind: None,
                reason: poison.reason().to_string(),
                attempts,
                correlation_id: None,
                is_trigger: false,
                body: Some(shown(&poison.body(), poison.is_cut())),
                trigger: None,
            },
        };
    }
    if let Ok(trigger) = TriggerMessage::decode(body) {
        // The host's own count of failed deliveries is not kept (the message here is a new
        // one, and this queue's dequeue count only says how often operators' scans took it).
        let attempts = trigger.prior_attempts;
        return from_trigger(
            trigger,
            "moved here by the Functions host after its maxDequeueCount deliveries (host.json): \
             the handler could not be reached or kept failing without answering"
                .into(),
            attempts,
        );
    }
    PoisonEntry {
        id,
        inserted_at,
        scope: None,
        record_id: None,
        kind: None,
        reason: "not an entry Leasehold wrote, nor a trigger".into(),
        attempts: 0,
        correlation_id: None,
        is_trigger: false,
        body: Some(shown(body, false)),
        trigger: None,
    }
}

fn kind_name(trigger: &TriggerMessage) -> String {
    serde_json::to_value(trigger.kind)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

fn shown(body: &str, cut_already: bool) -> String {
    if body.len() <= BODY_SHOWN {
        return if cut_already {
            format!("{body} […]")
        } else {
            body.to_string()
        };
    }
    let mut end = BODY_SHOWN;
    while !body.is_char_boundary(end) {
        end -= 1;
    }
    format!("{} […]", &body[..end])
}

/// Entries grouped by record, the most recently poisoned first.
fn by_record(entries: &[PoisonEntry]) -> Vec<PoisonRecord> {
    let mut records: BTreeMap<(Scope, RecordId), PoisonRecord> = BTreeMap::new();
    for e in entries {
        let (Some(scope), Some(record_id)) = (&e.scope, &e.record_id) else {
            continue;
        };
        let r = records
            .entry((scope.clone(), record_id.clone()))
            .or_insert_with(|| PoisonRecord {
                scope: scope.clone(),
                record_id: record_id.clone(),
                entries: 0,
                attempts: 0,
                first_seen: e.inserted_at,
                last_seen: e.inserted_at,
                reason: e.reason.clone(),
            });
        r.entries += 1;
        r.attempts = r.attempts.max(e.attempts);
        if e.inserted_at < r.first_seen {
            r.first_seen = e.inserted_at;
        }
        if e.inserted_at >= r.last_seen {
            r.last_seen = e.inserted_at;
            r.reason = e.reason.clone();
        }
    }
    let mut out: Vec<_> = records.into_values().collect();
    out.sort_by_key(|r| std::cmp::Reverse(r.last_seen));
    out
}

/// An entry taken by a scan, with what it takes to change it.
struct Taken {
    received: Received,
    entry: PoisonEntry,
}

/// The result of a scan.
#[derive(Default)]
struct Scan {
    scanned: usize,
    kept: Vec<PoisonEntry>,
    requeued: Vec<Requeued>,
    skipped: Vec<Skipped>,
    failed: Vec<Skipped>,
    purged: Vec<String>,
    found: BTreeSet<String>,
    /// The scan stopped before the end of the queue (see [`Operator::scan`]).
    stopped_short: bool,
}

impl Operator {
    /// The poison entries, oldest first, and the same grouped by record.
    pub async fn poison_list(&self, query: &PoisonQuery) -> Result<PoisonList, OpsError> {
        let limit = query.limit.unwrap_or(PEEK_MAX).max(1);
        let (poison, entries, complete) = if limit <= PEEK_MAX {
            let poison = self.queue_view(&*self.inner.poison).await?;
            let peeked = self
                .inner
                .retry
                .run("peek poison", || self.inner.poison.peek(limit as u32))
                .await
                .map_err(|e| OpsError::storage("peek poison", e))?;
            // Every visible entry, unless the queue holds more than were shown.
            let complete = peeked.len() < limit || (peeked.len() as u64) >= poison.approximate_messages;
            let entries = peeked
                .into_iter()
                .map(|m| entry_of(m.id, m.inserted_at, &m.body))
                .collect::<Vec<_>>();
            (poison, entries, complete)
        } else {
            let scan = self
                .scan(&PoisonSelection::default(), |_| Act::Keep, Some(limit), &|_| {})
                .await?;
            // Read after the scan (which may have waited for another to end), so the depth is
            // of the queue this listing saw.
            let poison = self.queue_view(&*self.inner.poison).await?;
            let taken = scan.kept.len();
            // Every entry, unless the scan stopped short, kept more than the limit (it keeps
            // whole batches of 32), or the queue holds more than it took.
            let complete = !scan.stopped_short
                && taken <= limit
                && (taken < limit || (taken as u64) >= poison.approximate_messages);
            let mut entries = scan.kept;
            // The first `limit` in queue order.
            entries.truncate(limit);
            entries.sort_by_key(|e| e.inserted_at);
            (poison, entries, complete)
        };
        Ok(PoisonList {
            at: SystemTime::now(),
            poison,
            records: by_record(&entries),
            entries,
            complete,
        })
    }

    /// One entry, found by its id (a scan that stops at the entry).
    pub async fn poison_show(&self, id: &str) -> Result<PoisonEntry, OpsError> {
        // The front of the queue first, with no side effect.
        let peeked = self
            .inner
            .retry
            .run("peek poison", || self.inner.poison.peek(PEEK_MAX as u32))
            .await
            .map_err(|e| OpsError::storage("peek poison", e))?;
        if let Some(m) = peeked.into_iter().find(|m| m.id == id) {
            return Ok(entry_of(m.id, m.inserted_at, &m.body));
        }
        let selection = PoisonSelection::ids([id.to_string()]);
        let scan = self.scan(&selection, |_| Act::Keep, None, &|_| {}).await?;
        scan.kept
            .into_iter()
            .find(|e| e.id == id)
            .ok_or_else(|| not_in_poison(self.poison_name(), id))
    }

    /// Puts a fresh trigger on the trigger queue for each selected entry, then removes the
    /// entry. Entries that hold no trigger are skipped (and said so).
    pub async fn poison_requeue(
        &self,
        selection: &PoisonSelection,
        progress: &(dyn Fn(&Progress) + Send + Sync),
    ) -> Result<RequeueReport, OpsError> {
        selection.check()?;
        let scan = self.scan(selection, |_| Act::Requeue, None, progress).await?;
        let not_found = missing(selection, &scan.found);
        let message = format!(
            "requeued {} entr{} as fresh triggers{}{}{}",
            scan.requeued.len(),
            if scan.requeued.len() == 1 { "y" } else { "ies" },
            count_clause(scan.skipped.len(), "skipped (no trigger in them)"),
            count_clause(scan.failed.len(), "failed (still in the poison queue)"),
            count_clause(not_found.len(), "not found"),
        ) + short_clause(scan.stopped_short);
        Ok(RequeueReport {
            complete: !scan.stopped_short,
            requeued: scan.requeued,
            skipped: scan.skipped,
            failed: scan.failed,
            not_found,
            scanned: scan.scanned,
            message,
        })
    }

    /// Removes the selected entries for good.
    pub async fn poison_purge(&self, selection: &PoisonSelection) -> Result<PurgeReport, OpsError> {
        selection.check()?;
        let scan = self.scan(selection, |_| Act::Purge, None, &|_| {}).await?;
        let not_found = missing(selection, &scan.found);
        let message = format!(
            "purged {} entr{}{}{}",
            scan.purged.len(),
            if scan.purged.len() == 1 { "y" } else { "ies" },
            count_clause(scan.failed.len(), "failed (still in the poison queue)"),
            count_clause(not_found.len(), "not found"),
        ) + short_clause(scan.stopped_short);
        Ok(PurgeReport {
            complete: !scan.stopped_short,
            purged: scan.purged,
            failed: scan.failed,
            not_found,
            scanned: scan.scanned,
            message,
        })
    }

    /// Takes the poison entries 32 at a time (hidden for the scan's hiding time), does `act`
    /// with those `selection` selects (every entry for an empty selection) and puts the rest
    /// back. Stops at the end of the queue, once `keep_at_most` entries are kept, or once every
    /// id selected is found.
    async fn scan(
        &self,
        selection: &PoisonSelection,
        act: impl Fn(&PoisonEntry) -> Act,
        keep_at_most: Option<usize>,
        progress: &(dyn Fn(&Progress) + Send + Sync),
    ) -> Result<Scan, OpsError> {
        // One scan at a time per operator (the dashboard's requests share one): a second scan
        // would hide the entries the first has yet to reach, and the first would stop short of
        // them believing it reached the end.
        let _turn = self.inner.scans.lock().await;
        let poison = &*self.inner.poison;
        let total = poison.approximate_len().await.unwrap_or(0);
        // Hidden long enough for the whole scan to get round before the first batch comes back
        // (two seconds a batch of 32, acting on each, is generous against Azure's latencies);
        // what is not acted on is put back at once at the end anyway.
        let hide = self
            .inner
            .scan_hide
            .max(Duration::from_secs(2 * total.div_ceil(PEEK_MAX as u64)));
        // An empty selection (a listing) takes in every entry.
        let everything = selection.check().is_err();
        let mut scan = Scan::default();
        let mut batches = 0u64;
        let max_batches = 4 * (total.div_ceil(PEEK_MAX as u64) + 2) + 100;
        // Entries to put back, by id (a receipt is replaced if an entry comes round again), and
        // the order they were taken in: they are put back in that order, so the queue (which
        // hands out entries by the time they became visible) keeps its oldest first.
        let mut put_back: HashMap<String, Taken> = HashMap::new();
        let mut taken_order: Vec<String> = Vec::new();
        let outcome = async {
            loop {
                let batch = self
                    .inner
                    .retry
                    .run("take poison entries", || poison.get(PEEK_MAX as u32, hide))
                    .await
                    .map_err(|e| OpsError::storage("take poison entries", e))?;
                if batch.is_empty() {
                    return Ok(());
                }
                batches += 1;
                let (mut new, mut rehidden) = (0, 0);
                for received in batch {
                    if let Some(again) = put_back.get_mut(&received.id) {
                        // Came round again (the scan outlasted the hiding, as a long one over a
                        // deep queue can): hide it afresh so the rest of the queue can be
                        // reached, and keep the receipt that now changes it.
                        match poison
                            .set_visibility(&received.id, &received.pop_receipt, &received.body, hide)
                            .await
                        {
                            Ok(receipt) => {
                                rehidden += 1;
                                again.received = Received {
                                    pop_receipt: receipt,
                                    ..received
                                }
                            }
                            Err(_) => again.received = received,
                        }
                        continue;
                    }
                    new += 1;
                    scan.scanned += 1;
                    taken_order.push(received.id.clone());
                    let entry = entry_of(received.id.clone(), received.inserted_at, &received.body);
                    let selected = everything || selection.selects(&entry);
                    if selected {
                        scan.found.insert(entry.id.clone());
                    }
                    let taken = Taken { received, entry };
                    match if selected { act(&taken.entry) } else { Act::Keep } {
                        Act::Keep => {
                            if selected {
                                scan.kept.push(taken.entry.clone());
                            }
                            put_back.insert(taken.received.id.clone(), taken);
                        }
                        Act::Requeue => self.requeue_one(taken, &mut scan, &mut put_back).await,
                        Act::Purge => self.purge_one(taken, &mut scan, &mut put_back).await,
                    }
                    progress(&Progress {
                        scanned: scan.scanned,
                        done: scan.requeued.len() + scan.purged.len(),
                        total,
                    });
                }
                if selection.satisfied(&scan.found)
                    || keep_at_most.is_some_and(|most| scan.kept.len() >= most)
                {
                    return Ok(());
                }
                // Nothing new, and what came round could not be hidden again (or the queue keeps
                // giving far more than it held): stop, and say the scan did not reach the end.
                if (new == 0 && rehidden == 0) || batches > max_batches {
                    scan.stopped_short = true;
                    return Ok(());
                }
            }
        }
        .await;
        // Put back what was not acted on, whatever happened above; what cannot be put back
        // comes back by itself when its hiding ends.
        for id in taken_order {
            let Some(taken) = put_back.remove(&id) else {
                continue; // acted on: requeued or purged
            };
            let r = &taken.received;
            match self
                .inner
                .retry
                .run("put a poison entry back", || {
                    poison.set_visibility(&r.id, &r.pop_receipt, &r.body, Duration::ZERO)
                })
                .await
            {
                Ok(_) => {}
                // The receipt no longer fits: an earlier try whose answer was lost put it back
                // (which changed the receipt), or its hiding ended and another reader took it.
                Err(e) if e.kind() == StoreErrorKind::NotFound => {
                    tracing::debug!(
                        id,
                        "poison: an entry to put back was no longer ours (already back, or taken by another reader)"
                    );
                }
                Err(e) => {
                    tracing::warn!(id, error = %e, hide_seconds = hide.as_secs(),
                        "poison: could not put an entry back at once; it comes back when its hiding ends");
                }
            }
        }
        outcome.map(|()| scan)
    }

    async fn requeue_one(&self, taken: Taken, scan: &mut Scan, put_back: &mut HashMap<String, Taken>) {
        let Some(original) = taken.entry.trigger.clone() else {
            scan.skipped.push(Skipped {
                id: taken.entry.id.clone(),
                why: "the entry holds no trigger (an unreadable message): purge it".into(),
            });
            put_back.insert(taken.received.id.clone(), taken);
            return;
        };
        // A fresh trigger: a new chain with no attempts behind it, the source's correlation id.
        let mut fresh = TriggerMessage::new(original.scope.clone(), original.record_id.clone());
        fresh.correlation_id = original.correlation_id.clone();
        let body = fresh.encode();
        let id = taken.entry.id.clone();
        if let Err(e) = self
            .inner
            .retry
            .run("requeue", || self.inner.queue.put(&body, Duration::ZERO))
            .await
        {
            scan.failed.push(Skipped {
                id,
                why: format!("putting the trigger failed: {e}"),
            });
            put_back.insert(taken.received.id.clone(), taken);
            return;
        }
        tracing::info!(scope = %fresh.scope, record = %fresh.record_id, poison_id = %id,
            correlation_id = fresh.correlation_id.as_deref().unwrap_or(""),
            "poison: requeued as a fresh trigger");
        let requeued = Requeued {
            id: id.clone(),
            scope: fresh.scope,
            record_id: fresh.record_id,
            correlation_id: fresh.correlation_id,
        };
        // Only now the entry goes: dying before this leaves it in both places.
        match self.delete_taken(&taken).await {
            Ok(()) => {}
            Err(Removal::Gone) => scan.failed.push(Skipped {
                id,
                why: format!("requeued; removing the entry then {GONE}"),
            }),
            Err(Removal::Failed(why)) => {
                scan.failed.push(Skipped {
                    id,
                    why: format!(
                        "requeued, but removing the entry failed ({why}); it stays in the poison queue"
                    ),
                });
                // Visible again at the end of the scan, and not taken up again before it.
                put_back.insert(taken.received.id.clone(), taken);
            }
        }
        scan.requeued.push(requeued);
    }

    async fn purge_one(&self, taken: Taken, scan: &mut Scan, put_back: &mut HashMap<String, Taken>) {
        let id = taken.entry.id.clone();
        match self.delete_taken(&taken).await {
            Ok(()) => {
                tracing::info!(poison_id = %id, scope = ?taken.entry.scope.as_ref().map(Scope::as_str),
                    record = ?taken.entry.record_id.as_ref().map(RecordId::as_str), "poison: purged an entry");
                scan.purged.push(id);
            }
            Err(Removal::Gone) => scan.failed.push(Skipped {
                id,
                why: format!("removing the entry {GONE}"),
            }),
            Err(Removal::Failed(why)) => {
                scan.failed.push(Skipped { id, why });
                put_back.insert(taken.received.id.clone(), taken);
            }
        }
    }

    async fn delete_taken(&self, taken: &Taken) -> Result<(), Removal> {
        let r = &taken.received;
        match self
            .inner
            .retry
            .run("remove poison entry", || {
                self.inner.poison.delete(&r.id, &r.pop_receipt)
            })
            .await
        {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == StoreErrorKind::NotFound => Err(Removal::Gone),
            Err(e) => Err(Removal::Failed(e.to_string())),
        }
    }
}

/// Why an entry was not removed.
enum Removal {
    /// The queue no longer knows the receipt: an earlier try whose answer was lost removed the
    /// entry, or the hiding ran out and another reader took it.
    Gone,
    /// Storage refused or did not answer; the entry is still there.
    Failed(String),
}

const GONE: &str = "answered \"not found\": an earlier try whose answer was lost removed it, or another \
                    reader took it meanwhile (look with `leasehold poison list`)";

fn missing(selection: &PoisonSelection, found: &BTreeSet<String>) -> Vec<String> {
    selection
        .ids
        .iter()
        .filter(|id| !found.contains(*id))
        .cloned()
        .collect()
}

fn short_clause(stopped_short: bool) -> &'static str {
    if stopped_short {
        "; the scan stopped before the end of the queue (entries kept coming round): run it again for the rest"
    } else {
        ""
    }
}

fn count_clause(n: usize, what: &str) -> String {
    if n == 0 {
        String::new()
    } else {
        format!("; {n} {what}")
    }
}

fn not_in_poison(queue: &str, id: &str) -> OpsError {
    OpsError::NotFound(format!(
        "no entry {id:?} in the poison queue {queue} (ids are shown by `leasehold poison list`)"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::Ordering::SeqCst;

    use async_trait::async_trait;
    use leasehold_lock::memory::MemoryStore;
    use leasehold_lock::{LeaseLock, LeaseOptions};
    use leasehold_runtime::{Enqueued, Error, MemoryMarkers, MemoryQueue, Peeked, TriggerKind, TriggerQueue};
    use leasehold_storage::azure::BlobContainer;
    use leasehold_storage::{Op, OpCounters, StorageAccount, StoreError, StoreResult};

    /// A queue over a memory queue whose puts take a while (of paused time), whose deletes
    /// can be made to fail or to answer "not found", and which can hand out a new entry at
    /// every get (a queue something keeps filling), counting gets.
    #[derive(Debug)]
    struct Slow {
        inner: MemoryQueue,
        put_takes: Duration,
        deletes_fail: bool,
        deletes_not_found: bool,
        endless: Option<std::sync::atomic::AtomicU64>,
        /// Putting an entry back (a visibility of zero) fails this many more times, transiently.
        put_back_failures: std::sync::atomic::AtomicU32,
    }

    impl Slow {
        /// Over `inner`, with nothing slow or failing.
        fn over(inner: MemoryQueue) -> Self {
            Self {
                inner,
                put_takes: Duration::ZERO,
                deletes_fail: false,
                deletes_not_found: false,
                endless: None,
                put_back_failures: 0.into(),
            }
        }
    }

    #[async_trait]
    impl TriggerQueue for Slow {
        fn name(&self) -> &str {
            self.inner.name()
        }
        async fn put(&self, body: &str, delay: Duration) -> StoreResult<Enqueued> {
            tokio::time::sleep(self.put_takes).await;
            self.inner.put(body, delay).await
        }
        async fn get(&self, max: u32, visibility: Duration) -> StoreResult<Vec<Received>> {
            if let Some(gets) = &self.endless {
                let n = gets.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                return Ok(vec![Received {
                    id: format!("endless{n}"),
                    pop_receipt: "r".into(),
                    dequeue_count: 1,
                    body: "not a trigger".into(),
                    inserted_at: None,
                }]);
            }
            self.inner.get(max, visibility).await
        }
        async fn delete(&self, id: &str, receipt: &str) -> StoreResult<()> {
            if self.deletes_not_found {
                return Err(
                    StoreError::new(StoreErrorKind::NotFound, Op::QueueDelete, "").with_status(404, None)
                );
            }
            if self.deletes_fail {
                return Err(
                    StoreError::new(StoreErrorKind::Rejected, Op::QueueDelete, "refused")
                        .with_status(403, None),
                );
            }
            self.inner.delete(id, receipt).await
        }
        async fn set_visibility(
            &self,
            id: &str,
            receipt: &str,
            body: &str,
            v: Duration,
        ) -> StoreResult<String> {
            if self.endless.is_some() {
                return Ok("r".into());
            }
            if v.is_zero()
                && self
                    .put_back_failures
                    .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
                    .is_ok()
            {
                return Err(
                    StoreError::new(StoreErrorKind::Transient, Op::QueueUpdate, "busy")
                        .with_status(503, None),
                );
            }
            self.inner.set_visibility(id, receipt, body, v).await
        }
        async fn approximate_len(&self) -> StoreResult<u64> {
            self.inner.approximate_len().await
        }
        async fn peek(&self, max: u32) -> StoreResult<Vec<Peeked>> {
            self.inner.peek(max).await
        }
        fn counters(&self) -> &OpCounters {
            self.inner.counters()
        }
    }

    fn slow(name: &str, put_takes: Duration, deletes_fail: bool) -> Arc<Slow> {
        Arc::new(Slow {
            put_takes,
            deletes_fail,
            ..Slow::over(MemoryQueue::new(name, OpCounters::new()))
        })
    }

    /// [`slow`] over a queue that hands out in put order: an entry whose hiding ends comes round
    /// ahead of those put after it (Azure promises no order; this is the one that tries a scan).
    fn put_order(name: &str) -> Arc<Slow> {
        Arc::new(Slow::over(
            MemoryQueue::new(name, OpCounters::new()).with_put_order_delivery(),
        ))
    }

    /// An operator over memory queues (the container is never contacted by poison operations).
    fn operator(queue: Arc<Slow>, poison: Arc<Slow>) -> Operator {
        let lock = LeaseLock::new(Arc::new(MemoryStore::new()), LeaseOptions::default()).unwrap();
        let account = StorageAccount::emulator("127.0.0.1", 1, 2);
        Operator::from_parts(
            queue,
            poison,
            lock,
            Arc::new(MemoryMarkers::new()),
            BlobContainer::new(&account, "unused", OpCounters::new()),
            OpCounters::new(),
        )
        .with_scan_hide(Duration::from_secs(1))
    }

    async fn fill(poison: &Slow, records: impl Iterator<Item = String>) {
        for r in records {
            let t = trigger(&r);
            let error = Error::Logic(leasehold_runtime::LogicError::new("boom"));
            let entry = PoisonMessage::new(t.encode(), Some(t), &error, 5).encode();
            poison.inner.put(&entry, Duration::ZERO).await.unwrap();
        }
    }

    /// A requeue that outlasts the hiding of the entries it keeps: they come round again
    /// ahead of the rest of the queue, are hidden afresh, and the scan still reaches the end.
    #[tokio::test(start_paused = true)]
    async fn a_scan_that_outlasts_its_hiding_still_reaches_the_end_of_the_queue() {
        let (queue, poison) = (slow("q", Duration::from_secs(1), false), put_order("p"));
        fill(&poison, (0..64).map(|i| format!("keep{i:02}"))).await;
        fill(&poison, (0..36).map(|i| format!("go{i:02}"))).await;
        // Requeue the "go" records by id: they sit behind 64 entries the scan keeps.
        let ids: Vec<String> = {
            let all = operator(queue.clone(), poison.clone())
                .poison_list(&PoisonQuery { limit: Some(200) })
                .await
                .unwrap();
            all.entries
                .into_iter()
                .filter(|e| e.record_id.as_ref().is_some_and(|r| r.as_str().starts_with("go")))
                .map(|e| e.id)
                .collect()
        };
        assert_eq!(ids.len(), 36);
        let report = operator(queue.clone(), poison.clone())
            .poison_requeue(&PoisonSelection::ids(ids), &|_| {})
            .await
            .unwrap();
        assert_eq!(report.requeued.len(), 36, "{}", report.message);
        assert!(
            report.complete && report.not_found.is_empty(),
            "{}",
            report.message
        );
        assert_eq!(queue.inner.bodies().len(), 36);
        // The kept entries are all there, and visible at once.
        assert_eq!(poison.inner.bodies().len(), 64);
        assert_eq!(
            poison.inner.get(32, Duration::from_secs(30)).await.unwrap().len(),
            32
        );
        assert_eq!(
            poison.inner.get(32, Duration::from_secs(30)).await.unwrap().len(),
            32
        );
    }

    /// A requeue whose removal of the entry fails leaves the entry in the poison queue, visible
    /// again at once (not hidden for the scan's hiding), and taken up only once.
    #[tokio::test(start_paused = true)]
    async fn a_failed_removal_puts_the_entry_back_and_requeues_it_once() {
        let (queue, poison) = (slow("q", Duration::ZERO, false), slow("p", Duration::ZERO, true));
        fill(&poison, (0..3).map(|i| format!("r{i}"))).await;
        let report = operator(queue.clone(), poison.clone())
            .poison_requeue(&PoisonSelection::all(), &|_| {})
            .await
            .unwrap();
        assert_eq!(
            (report.requeued.len(), report.failed.len()),
            (3, 3),
            "{}",
            report.message
        );
        assert!(report.failed[0].why.contains("stays in the poison queue"));
        assert_eq!(queue.inner.bodies().len(), 3, "each requeued once");
        assert_eq!(
            poison.inner.peek(32).await.unwrap().len(),
            3,
            "visible again at once"
        );
    }

    fn trigger(record: &str) -> TriggerMessage {
        TriggerMessage::new(Scope::parse("account").unwrap(), RecordId::parse(record).unwrap())
    }

    #[test]
    fn entries_read_from_what_leasehold_and_the_host_put_there() {
        let mut t = trigger("r1");
        t.prior_attempts = 2;
        t.kind = TriggerKind::Sweep;
        let ours = PoisonMessage::new(t.encode(), Some(t.clone()), &Error::LeaseLost, 5);
        let e = entry_of("m1".into(), None, &ours.encode());
        assert!(e.is_trigger);
        assert_eq!((e.attempts, e.kind.as_deref()), (7, Some("sweep")));
        assert_eq!(e.reason, "lease lost during the run");
        // The host's own move: a bare trigger.
        let e = entry_of("m2".into(), None, &trigger("r2").encode());
        assert!(e.is_trigger && e.reason.contains("maxDequeueCount"));
        assert_eq!(e.attempts, 0);
        // Anything else is shown, not requeued.
        let e = entry_of("m3".into(), None, &"x".repeat(10_000));
        assert!(!e.is_trigger);
        assert_eq!(e.body.unwrap(), format!("{} […]", "x".repeat(4096)));
        // Cut at a character boundary: 4,096 bytes of 3-byte characters keep 1,365 of them.
        let e = entry_of("m4".into(), None, &"€".repeat(3_000));
        assert_eq!(e.body.unwrap(), format!("{} […]", "€".repeat(1365)));
    }

    #[test]
    fn a_selection_names_its_entries_one_way() {
        assert_eq!(PoisonSelection::default().check().unwrap_err().status(), 400);
        let both = PoisonSelection {
            all: true,
            ids: vec!["a".into()],
            ..Default::default()
        };
        assert_eq!(both.check().unwrap_err().status(), 400);
        let e = entry_of("m1".into(), None, &trigger("r1").encode());
        assert!(PoisonSelection::all().selects(&e));
        assert!(PoisonSelection::ids(["m1".to_string()]).selects(&e));
        assert!(!PoisonSelection::ids(["m2".to_string()]).selects(&e));
        let scope = Scope::parse("account").ok();
        assert!(PoisonSelection::matching(scope.clone(), None).selects(&e));
        assert!(!PoisonSelection::matching(Scope::parse("contact").ok(), None).selects(&e));
        assert!(PoisonSelection::matching(None, RecordId::parse("r1").ok()).selects(&e));
        assert!(PoisonSelection::matching(scope.clone(), None).check().is_ok());
        assert!(
            PoisonSelection::matching(None, RecordId::parse("r1").ok())
                .check()
                .is_ok()
        );
        let empty = PoisonSelection::default().check().unwrap_err().to_string();
        assert!(empty.starts_with("select the entries: "), "{empty}");
        assert!(!PoisonSelection::matching(scope, RecordId::parse("r2").ok()).selects(&e));
        let parsed: PoisonSelection = serde_json::from_str(r#"{"scope":"account","recordId":"r1"}"#).unwrap();
        assert!(parsed.check().is_ok() && parsed.selects(&e));
        // A misspelt field is an error, not a wider selection.
        let typo = serde_json::from_str::<PoisonSelection>(r#"{"scope":"account","recordID":"r1"}"#);
        assert!(typo.unwrap_err().to_string().contains("recordID"));
    }

    #[test]
    fn entries_group_by_record_with_first_and_last_seen() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        let mut a = entry_of("m1".into(), Some(t0), &trigger("r1").encode());
        a.reason = "first".into();
        let mut b = entry_of(
            "m2".into(),
            Some(t0 + Duration::from_secs(60)),
            &trigger("r1").encode(),
        );
        b.reason = "second".into();
        b.attempts = 3;
        let c = entry_of(
            "m3".into(),
            Some(t0 + Duration::from_secs(30)),
            &trigger("r2").encode(),
        );
        let mut older = entry_of(
            "m0".into(),
            Some(t0 - Duration::from_secs(10)),
            &trigger("r1").encode(),
        );
        older.reason = "oldest".into();
        let records = by_record(&[a, b, c, older]);
        assert_eq!(records[0].record_id.as_str(), "r1");
        assert_eq!(
            (
                records[0].entries,
                records[0].attempts,
                records[0].reason.as_str()
            ),
            (3, 3, "second")
        );
        assert_eq!(records[0].first_seen, Some(t0 - Duration::from_secs(10)));
        assert_eq!(records[0].last_seen, Some(t0 + Duration::from_secs(60)));
        assert_eq!(records[1].record_id.as_str(), "r2");
    }

    fn ids_of(list: &PoisonList, prefix: &str) -> Vec<String> {
        list.entries
            .iter()
            .filter(|e| {
                e.record_id
                    .as_ref()
                    .is_some_and(|r| r.as_str().starts_with(prefix))
            })
            .map(|e| e.id.clone())
            .collect()
    }

    /// Listing: a peek up to 32, a scan beyond, and `complete` says whether every entry is in.
    #[tokio::test(start_paused = true)]
    async fn a_listing_says_whether_it_holds_every_entry() {
        let (queue, poison) = (slow("q", Duration::ZERO, false), slow("p", Duration::ZERO, false));
        fill(&poison, (0..10).map(|i| format!("r{i:02}"))).await;
        let op = operator(queue.clone(), poison.clone());
        let peeked = op.poison_list(&PoisonQuery::default()).await.unwrap();
        assert_eq!((peeked.entries.len(), peeked.complete), (10, true));
        let few = op.poison_list(&PoisonQuery { limit: Some(4) }).await.unwrap();
        assert_eq!((few.entries.len(), few.complete), (4, false));
        // Entries another reader holds hidden are not "more": every visible one is shown.
        let held = poison.inner.get(3, Duration::from_secs(30)).await.unwrap();
        let visible = op.poison_list(&PoisonQuery::default()).await.unwrap();
        assert_eq!((visible.entries.len(), visible.complete), (7, true));
        let scanned = op.poison_list(&PoisonQuery { limit: Some(100) }).await.unwrap();
        assert_eq!((scanned.entries.len(), scanned.complete), (7, true));
        for m in held {
            poison
                .inner
                .set_visibility(&m.id, &m.pop_receipt, &m.body, Duration::ZERO)
                .await
                .unwrap();
        }
        fill(&poison, (10..50).map(|i| format!("r{i:02}"))).await;
        // A scan takes whole batches (32 + 18 here): cut to 40 of 50, it is not complete.
        let cut = op.poison_list(&PoisonQuery { limit: Some(40) }).await.unwrap();
        assert_eq!((cut.entries.len(), cut.complete), (40, false));
        fill(&poison, (50..100).map(|i| format!("r{i:02}"))).await;
        let peeked = op.poison_list(&PoisonQuery::default()).await.unwrap();
        assert_eq!((peeked.entries.len(), peeked.complete), (32, false));
        let all = op.poison_list(&PoisonQuery { limit: Some(200) }).await.unwrap();
        assert_eq!((all.entries.len(), all.complete), (100, true));
        let some = op.poison_list(&PoisonQuery { limit: Some(40) }).await.unwrap();
        assert_eq!((some.entries.len(), some.complete), (40, false));
        // Exactly two batches taken, exactly the limit, and more in the queue: not complete.
        let two = op.poison_list(&PoisonQuery { limit: Some(64) }).await.unwrap();
        assert_eq!((two.entries.len(), two.complete), (64, false));
        let most = op.poison_list(&PoisonQuery { limit: Some(90) }).await.unwrap();
        assert_eq!(
            (most.entries.len(), most.complete),
            (90, false),
            "cut to the limit"
        );
        // Oldest first, and every entry visible again after the scans.
        assert_eq!(all.entries[0].record_id.as_ref().unwrap().as_str(), "r00");
        assert_eq!(poison.inner.peek(32).await.unwrap().len(), 32);
    }

    /// Acting by id stops once every id is found; purge removes what it names and counts it.
    #[tokio::test(start_paused = true)]
    async fn purge_by_id_removes_those_entries_and_stops_when_it_found_them() {
        let (queue, poison) = (slow("q", Duration::ZERO, false), slow("p", Duration::ZERO, false));
        fill(&poison, (0..100).map(|i| format!("r{i:02}"))).await;
        let op = operator(queue.clone(), poison.clone());
        let list = op.poison_list(&PoisonQuery { limit: Some(200) }).await.unwrap();
        let front = ids_of(&list, "r0");
        assert_eq!(front.len(), 10);
        let report = op
            .poison_purge(&PoisonSelection::ids(front.clone()))
            .await
            .unwrap();
        assert_eq!(report.purged, front);
        assert!(report.complete && report.failed.is_empty() && report.not_found.is_empty());
        assert_eq!(
            report.scanned, 32,
            "it stopped after the batch that held the last id"
        );
        assert_eq!(poison.inner.bodies().len(), 90);
        assert!(
            queue.inner.bodies().is_empty(),
            "a purge puts nothing on the trigger queue"
        );
    }

    /// A listing asked for while a requeue of everything runs (the dashboard refreshing during
    /// "Requeue all") waits its turn: it does not hide the entries the requeue has yet to
    /// reach, so the requeue gets every one, and the listing then finds the queue empty.
    #[tokio::test(start_paused = true)]
    async fn a_listing_during_a_requeue_waits_for_it() {
        let (queue, poison) = (
            slow("q", Duration::from_secs(1), false),
            slow("p", Duration::ZERO, false),
        );
        fill(&poison, (0..40).map(|i| format!("r{i:02}"))).await;
        let op = operator(queue.clone(), poison.clone());
        let requeue = tokio::spawn({
            let op = op.clone();
            async move { op.poison_requeue(&PoisonSelection::all(), &|_| {}).await }
        });
        // Into the first batch of 32 (a second a put), then a listing that scans.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let listing = op.poison_list(&PoisonQuery { limit: Some(100) }).await.unwrap();
        let report = requeue.await.unwrap().unwrap();
        assert_eq!(report.requeued.len(), 40, "{}", report.message);
        assert!(listing.entries.is_empty(), "{:?}", listing.entries);
        assert_eq!(queue.inner.bodies().len(), 40);
        assert!(poison.inner.bodies().is_empty());
    }

    /// Progress counts what was looked at and what was done.
    #[tokio::test(start_paused = true)]
    async fn a_requeue_reports_its_progress() {
        let (queue, poison) = (slow("q", Duration::ZERO, false), slow("p", Duration::ZERO, false));
        fill(&poison, (0..5).map(|i| format!("r{i}"))).await;
        poison.inner.put("not a trigger", Duration::ZERO).await.unwrap();
        let seen = std::sync::Mutex::new(Vec::new());
        let report = operator(queue.clone(), poison.clone())
            .poison_requeue(&PoisonSelection::all(), &|p| {
                seen.lock().unwrap().push((p.scanned, p.done, p.total))
            })
            .await
            .unwrap();
        assert_eq!(
            (report.requeued.len(), report.skipped.len(), report.scanned),
            (5, 1, 6)
        );
        assert_eq!(
            seen.into_inner().unwrap(),
            [(1, 1, 6), (2, 2, 6), (3, 3, 6), (4, 4, 6), (5, 5, 6), (6, 5, 6)]
        );
    }

    /// Putting an entry back is retried: a transient failure there does not leave it hidden
    /// for the scan's whole hiding time.
    #[tokio::test(start_paused = true)]
    async fn putting_an_entry_back_is_retried() {
        let queue = slow("q", Duration::ZERO, false);
        let poison = Arc::new(Slow {
            put_back_failures: 2.into(),
            ..Slow::over(MemoryQueue::new("p", OpCounters::new()))
        });
        fill(&poison, (0..3).map(|i| format!("r{i}"))).await;
        let list = operator(queue, poison.clone())
            .poison_list(&PoisonQuery { limit: Some(100) })
            .await
            .unwrap();
        assert_eq!(list.entries.len(), 3);
        assert_eq!(poison.put_back_failures.load(SeqCst), 0, "both failures were met");
        assert_eq!(
            poison.inner.peek(32).await.unwrap().len(),
            3,
            "every entry back at once"
        );
    }

    /// A delete answering "not found" (an earlier try removed it, or another reader took it)
    /// is reported as such, and the entry is not put back under a stale receipt.
    #[tokio::test(start_paused = true)]
    async fn a_removal_answered_not_found_is_reported_as_gone() {
        let queue = slow("q", Duration::ZERO, false);
        let poison = Arc::new(Slow {
            deletes_not_found: true,
            ..Slow::over(MemoryQueue::new("p", OpCounters::new()))
        });
        fill(&poison, std::iter::once("r1".to_string())).await;
        let report = operator(queue, poison.clone())
            .poison_purge(&PoisonSelection::all())
            .await
            .unwrap();
        assert!(report.purged.is_empty());
        assert!(report.failed[0].why.contains("not found"), "{:?}", report.failed);
        // Not put back: it stays hidden under the scan's take until that ends.
        assert!(poison.inner.peek(32).await.unwrap().is_empty());
    }

    /// A queue that never runs dry (something keeps filling it) does not keep a scan going for
    /// ever: it stops after 4 × (batches the queue held + 2) + 100 batches, and says so.
    #[tokio::test(start_paused = true)]
    async fn a_scan_of_a_queue_that_never_runs_dry_stops_and_says_so() {
        let queue = slow("q", Duration::ZERO, false);
        let poison = Arc::new(Slow {
            endless: Some(0.into()),
            ..Slow::over(MemoryQueue::new("p", OpCounters::new()))
        });
        let report = operator(queue, poison.clone())
            .poison_purge(&PoisonSelection::all())
            .await
            .unwrap();
        assert!(
            !report.complete && report.message.contains("run it again"),
            "{}",
            report.message
        );
        // The queue held nothing when the scan began: 4 × (0 + 2) + 100 = 108 batches, then one more.
        let gets = poison
            .endless
            .as_ref()
            .unwrap()
            .load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!((gets, report.scanned), (109, 109));
    }

    /// `show` finds an entry at the front (a peek) and behind it (a scan), and says when there
    /// is none.
    #[tokio::test(start_paused = true)]
    async fn show_finds_an_entry_wherever_it_is() {
        let (queue, poison) = (slow("q", Duration::ZERO, false), slow("p", Duration::ZERO, false));
        fill(&poison, (0..50).map(|i| format!("r{i:02}"))).await;
        let op = operator(queue, poison.clone());
        let list = op.poison_list(&PoisonQuery { limit: Some(100) }).await.unwrap();
        for wanted in ["r01", "r45"] {
            let id = ids_of(&list, wanted).remove(0);
            let shown = op.poison_show(&id).await.unwrap();
            assert_eq!(
                (shown.id.as_str(), shown.record_id.unwrap().as_str()),
                (id.as_str(), wanted)
            );
        }
        assert_eq!(op.poison_show("nothing").await.unwrap_err().status(), 404);
        assert_eq!(
            poison.inner.peek(32).await.unwrap().len(),
            32,
            "all visible again"
        );
    }

    /// What a scan took comes back by itself if the scan dies: after its hiding, which is 2 s
    /// a batch of 32 entries in the queue when that is longer than the set hiding.
    #[tokio::test(start_paused = true)]
    async fn a_dead_scans_entries_come_back_when_its_hiding_ends() {
        // In put order, so the entries the scan hid are at the front as soon as they are back.
        let (queue, poison) = (slow("q", Duration::from_secs(1000), false), put_order("p"));
        fill(&poison, (0..100).map(|i| format!("r{i:02}"))).await;
        let op = operator(queue, poison.clone());
        // Dies in its first put: the first batch of 32 is taken, hidden for 2 × 4 = 8 s.
        let died = tokio::time::timeout(
            Duration::from_millis(10),
            op.poison_requeue(&PoisonSelection::all(), &|_| {}),
        )
        .await;
        assert!(died.is_err());
        let front = || async {
            let peeked = poison.inner.peek(1).await.unwrap();
            TriggerMessage::decode(
                &PoisonMessage::decode(&peeked[0].body)
                    .unwrap()
                    .trigger
                    .unwrap()
                    .encode(),
            )
            .unwrap()
            .record_id
            .to_string()
        };
        tokio::time::sleep(Duration::from_millis(7_900)).await;
        assert_eq!(front().await, "r32", "still hidden just before 8 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(front().await, "r00", "back after 8 s");
        assert_eq!(poison.inner.bodies().len(), 100, "nothing lost");
    }

    /// Ids not in the queue are named, and the message counts what was done and what not.
    #[tokio::test(start_paused = true)]
    async fn a_requeue_names_the_ids_it_did_not_find() {
        let (queue, poison) = (slow("q", Duration::ZERO, false), slow("p", Duration::ZERO, false));
        fill(&poison, (0..3).map(|i| format!("r{i}"))).await;
        let op = operator(queue, poison);
        let list = op.poison_list(&PoisonQuery::default()).await.unwrap();
        let wanted = vec![list.entries[1].id.clone(), "no-such-id".to_string()];
        let report = op
            .poison_requeue(&PoisonSelection::ids(wanted), &|_| {})
            .await
            .unwrap();
        assert_eq!(report.not_found, ["no-such-id"]);
        assert_eq!(report.message, "requeued 1 entry as fresh triggers; 1 not found");
        let report = op
            .poison_purge(&PoisonSelection::ids(["gone".to_string()]))
            .await
            .unwrap();
        assert_eq!(report.message, "purged 0 entries; 1 not found");
    }
}
